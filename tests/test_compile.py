"""The three ops under torch.compile, through their custom operators (ppo_ops/compiled/): torch.library.opcheck of
every operator; fullgraph=True compiles of small functions calling each op, whose values and gradients are bitwise
equal to eager on both backends; dynamic shapes (five row counts, at most one recompile); TP = 2 over gloo; the
errors that only exist under compile; the validate=True refusal inside a CUDA graph capture, and capture / replay
with validate=False (one-GPU target).
"""

import pytest
import torch
import torch.distributed as dist

import ppo_ops
from ppo_ops.compiled import logits_op
from tests.core_support import DEVICE, backend_params, make_keep_mask, make_logits, make_tokens
from tests.ranks import run_gloo



@pytest.fixture(autouse=True)
def _dynamo_on(monkeypatch):
    """The suite's default (tests/conftest.py, tools/pytest.bzl) disables dynamo for megatron-core's jit_fuser; this
    file is about compiling, so its tests turn it back on (the compile counter below shows it compiles)."""
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")

V = 96  # columns: three of the torch backend's segments at TP = 1 and at TP = 2
MAX_FRAMES_FOR_FIVE_ROW_COUNTS = 2  # the first compile is static; the second marks T dynamic, then no more


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True)


def _logits(shape, dtype=torch.float32, seed=0):
    return make_logits(shape, dtype, seed=seed).to(DEVICE)


def _loss_of(lp, ent):
    """A scalar that weighs every output differently, so a wrong gradient of either shows."""
    w = torch.linspace(0.5, 1.5, lp.numel(), device=lp.device).reshape(lp.shape)
    return (lp * w).sum() + (0.0 if ent is None else (ent * w.flip(-1)).sum())


def _value_and_grads(fn, leaves, *args):
    for x in leaves:
        x.grad = None
    lp, ent = fn(*leaves, *args)
    _loss_of(lp, ent).backward()
    return [lp.detach(), None if ent is None else ent.detach()] + [x.grad for x in leaves]


def _assert_bitwise(eager, compiled):
    assert len(eager) == len(compiled)
    for i, (a, b) in enumerate(zip(eager, compiled)):
        if a is None:
            assert b is None, i
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (i, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max())


# ---- the logits op ----

LOGITS_CASES = {
    "none": dict(entropy="none"),
    "value": dict(entropy="value"),
    "grad": dict(entropy="grad"),
    "grad_temperature_vocab": dict(entropy="grad", temperature=0.7, vocab_size=V - 5),
    "row_mask": dict(entropy="grad", row_mask=True),
    "keep_mask": dict(entropy="grad", keep_mask=True),
    "keep": dict(entropy="grad", keep=True),
    "validate": dict(entropy="grad", validate=True),
    "bf16": dict(entropy="grad", dtype=torch.bfloat16),
}


def _logits_call(case, lead=(3, 5), seed=0):
    """(logits leaf, tokens, keyword options) of one case."""
    opts = dict(case)
    dtype = opts.pop("dtype", torch.float32)
    x = _logits(lead + (V,), dtype, seed).requires_grad_()
    t = make_tokens(lead, opts.get("vocab_size") or V, seed=seed + 1).to(DEVICE)
    n = t.numel()
    if opts.pop("row_mask", False):
        opts["row_mask"] = (torch.arange(n, device=DEVICE) % 3 != 1).reshape(lead)
    if opts.pop("keep_mask", False):
        opts["keep_mask"] = make_keep_mask(lead + (V,), t.cpu()).to(DEVICE)
    if opts.pop("keep", False):
        counts = torch.arange(n) % 4  # rows with 0 entries keep everything
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        ids = torch.randint(0, V, (int(offsets[-1]),), generator=torch.Generator().manual_seed(seed + 2))
        opts["keep"] = (ids.to(DEVICE), offsets.to(DEVICE))
    opts.setdefault("validate", False)
    return x, t, opts


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", list(LOGITS_CASES))
def test_logits_op_compiles_fullgraph_bitwise(case, backend):
    x, t, opts = _logits_call(LOGITS_CASES[case])

    def fn(x, t):
        return ppo_ops.log_probs_and_entropy(x, t, backend=backend, **opts)

    eager = _value_and_grads(fn, [x], t)
    compiled = _value_and_grads(_compiled(fn), [x], t)
    _assert_bitwise(eager, compiled)


@pytest.mark.parametrize("layout", ["compact", "permuted"])
@pytest.mark.parametrize("case", ["none", "grad", "row_mask", "keep_mask", "keep", "validate"])
def test_logits_operators_opcheck(case, layout):
    x, t, opts = _logits_call(LOGITS_CASES[case])
    if layout == "permuted":  # rows strided along dim 0 of a transposed buffer
        x = x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
        assert not x.is_contiguous()
    ids, offsets = opts.get("keep") or (None, None)
    args = (x, t, opts.get("keep_mask"), opts.get("row_mask"), ids, offsets, "", opts["entropy"],
            float(opts.get("temperature", 1.0)), opts.get("vocab_size"), None, "torch", opts["validate"], "fused")
    op = logits_op.forward_op.syncing if opts["validate"] else logits_op.forward_op.plain
    torch.library.opcheck(op, args)
    torch.library.opcheck(op, (x.detach(),) + args[1:])  # without a gradient
    outs = op(*args)
    grad_lp = torch.randn(t.shape, device=DEVICE)
    grad_ent = torch.randn(t.shape, device=DEVICE) if opts["entropy"] == "grad" else None
    torch.library.opcheck(logits_op._backward_op,
                          (x.detach(), t, args[2], args[3], ids, offsets, *outs[2:], grad_lp, grad_ent, "",
                           opts["entropy"], args[8], args[9], None, "torch", "fused"))


def test_logits_op_varying_rows_compile_at_most_twice():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def fn(x, t):
        return ppo_ops.log_probs_and_entropy(x, t, entropy="grad", validate=False)

    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for n_rows in (4, 7, 16, 33, 50):
        x = _logits((n_rows, V), seed=n_rows).requires_grad_()
        t = make_tokens((n_rows,), V, seed=n_rows).to(DEVICE)
        _assert_bitwise(_value_and_grads(fn, [x], t), _value_and_grads(compiled, [x], t))
    assert 1 <= counter.frame_count <= MAX_FRAMES_FOR_FIVE_ROW_COUNTS, counter.frame_count


@pytest.mark.parametrize("change, exc, argument", [
    (dict(inplace_grad=True), ValueError, "inplace_grad"),
    (dict(temperature=torch.tensor(0.5)), TypeError, "temperature"),
    (dict(tp_group=object()), TypeError, "tp_group"),
    (dict(keep=(torch.zeros(1, dtype=torch.long),)), TypeError, "keep"),
])
def test_logits_op_compile_only_errors_name_the_argument(change, exc, argument):
    """Raised while dynamo traces the wrapper: under fullgraph=True dynamo reports it with ppo_ops' message (without
    fullgraph the call would fall back to the eager op, where these are valid or checked as usual)."""
    x, t, opts = _logits_call(LOGITS_CASES["grad"])
    opts.update(change)
    fn = _compiled(lambda x, t: ppo_ops.log_probs_and_entropy(x, t, **opts))
    with pytest.raises(Exception) as info:
        fn(x, t)
    message = str(info.value)
    assert exc.__name__ in message and f"ppo_ops.log_probs_and_entropy: {argument}" in message, message


def test_logits_op_compiled_value_error_is_the_eager_one():
    """validate=True inside the operator: an out-of-range token raises the eager op's ValueError naming tokens."""
    x, t, opts = _logits_call(LOGITS_CASES["validate"])
    t = t.clone()
    t.view(-1)[2] = V
    fn = _compiled(lambda x, t: ppo_ops.log_probs_and_entropy(x, t, **opts))
    with pytest.raises(ValueError, match="tokens"):
        fn(x, t)


def _tp2_logits_worker(rank, world_size):
    torch.manual_seed(0)
    full = make_logits((6, V * world_size)).requires_grad_()
    t = make_tokens((6,), V * world_size, seed=3)
    group = dist.group.WORLD

    def fn(x, t):
        return ppo_ops.log_probs_and_entropy(x, t, tp_group=group, entropy="grad", validate=False)

    x = full.detach()[:, rank * V:(rank + 1) * V].clone().requires_grad_()
    eager = _value_and_grads(fn, [x], t)
    compiled = _value_and_grads(_compiled(fn), [x], t)
    _assert_bitwise(eager, compiled)


def test_logits_op_compiles_at_tp2_over_gloo():
    run_gloo(2, _tp2_logits_worker)


# ---- CUDA graphs (one-GPU target) ----

_CUDA = pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graph capture needs a GPU")


@_CUDA
def test_validate_true_inside_capture_names_validate():
    x, t, opts = _logits_call(LOGITS_CASES["grad"])
    ppo_ops.log_probs_and_entropy(x.detach(), t, validate=False)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="validate=False"):
        with torch.cuda.graph(graph):
            ppo_ops.log_probs_and_entropy(x.detach(), t, validate=True)


@_CUDA
@pytest.mark.parametrize("case", ["grad", "row_mask", "keep"])
def test_logits_op_cuda_graph_replay_is_eager_bitwise(case):
    x, t, opts = _logits_call(LOGITS_CASES[case])
    static_x = x.detach().clone().requires_grad_()

    def step():
        static_x.grad = None
        lp, ent = ppo_ops.log_probs_and_entropy(static_x, t, **opts)
        _loss_of(lp, ent).backward()
        return lp, ent

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: Triton compiles and allocations happen outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lp, ent = step()
    for seed in (5, 6):  # fresh inputs copied into the captured buffers
        fresh = _logits(x.shape, seed=seed)
        with torch.no_grad():
            static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        eager = _value_and_grads(lambda x, t: ppo_ops.log_probs_and_entropy(x, t, **opts),
                                 [fresh.requires_grad_()], t)
        _assert_bitwise(eager, [lp, ent, static_x.grad])

