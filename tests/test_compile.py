"""The three ops under torch.compile, through their custom operators (ppo_ops/compiled/): torch.library.opcheck of
every operator; fullgraph=True compiles of small functions calling each op, whose values and gradients are bitwise
equal to eager on both backends; dynamic shapes (five row counts, at most one recompile); TP = 2 over gloo; the
errors that only exist under compile; the validate=True refusal inside a CUDA graph capture, and capture / replay
with validate=False (one-GPU target).
"""

import functools
import math
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
# Rows of a case: on CPU the Triton kernels run under the interpreter, whose time grows with the rows, and a compiled
# call equals the eager one bit for bit at any row count (row counts are the varying-rows tests' subject), so the CPU
# target runs 6 rows; the GPU target runs 15.
LEAD = (3, 5) if DEVICE.type == "cuda" else (2, 3)
MAX_FRAMES_FOR_FIVE_ROW_COUNTS = 2  # the first compile is static; the second marks T dynamic, then no more
# A caller's own loss closure, compiled on the general head, against the eager token loss: the two heads' log-probs
# agree within the head's fp32 tolerance (2e-6 relative), and the loss is summed in another order.
CLOSURE_LOSS_REL_TOL = 1e-5
LOG_PROB_TOL = 2e-6  # relative to max(1, |log-prob|): the head's accuracy, both heads fp32 here
ENTROPY_TOL = 2e-5  # the head's entropy accuracy
GRAD_TOL = 1e-5  # dX and dW, relative to max(1, |value|): both heads' fp32 dlogits and GEMMs, summed differently


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


def test_operator_outputs_own_their_storage_from_offset_zero():
    """What the fake implementations promise (and the compiler asserts on CUDA, alignment included): row statistics
    returned as views into one buffer, at an offset or strided, come out as separate contiguous tensors at offset 0;
    an output aliasing an input is copied; a compact output that owns its storage is passed through."""
    from ppo_ops.compiled import common

    buffer = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    fresh = torch.ones(6)
    given = torch.zeros(6)
    outs = common.unaliased((buffer[1], buffer[:, 2], fresh, given), (given,))
    for got, want in zip(outs, (buffer[1], buffer[:, 2], fresh, given)):
        assert torch.equal(got, want)
        assert got.storage_offset() == 0 and got.is_contiguous()
    assert len({t.untyped_storage().data_ptr() for t in outs}) == len(outs)
    assert outs[2] is fresh


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
    "sglang_order": dict(entropy="grad", reduction_order="sglang"),
    "temperature_rows_softcap": dict(entropy="grad", temperature_rows=True, softcap=4.0),
}


def _logits_call(case, lead=LEAD, seed=0):
    """(logits leaf, tokens, keyword options) of one case."""
    opts = dict(case)
    dtype = opts.pop("dtype", torch.float32)
    x = _logits(lead + (V,), dtype, seed).requires_grad_()
    t = make_tokens(lead, opts.get("vocab_size") or V, seed=seed + 1).to(DEVICE)
    n = t.numel()
    if opts.pop("row_mask", False):
        opts["row_mask"] = (torch.arange(n, device=DEVICE) % 3 != 1).reshape(lead)
    if opts.pop("temperature_rows", False):  # a sequence's own temperature per row, in [0.6, 1.4]
        opts["temperature"] = (0.6 + 0.8 * torch.rand(lead, generator=torch.Generator().manual_seed(seed + 3))).to(
            DEVICE)
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
    # the case's per-row temperature and softcap where it has them (a tensor argument, an optional float)
    temperature = opts.get("temperature", 1.0)
    rows = temperature if isinstance(temperature, torch.Tensor) else None
    args = (x, t, opts.get("keep_mask"), opts.get("row_mask"), ids, offsets, rows, "", opts["entropy"],
            1.0 if rows is not None else float(temperature), opts.get("softcap"), opts.get("vocab_size"), None,
            "auto", opts["validate"], "fused")
    op = logits_op.forward_op.syncing if opts["validate"] else logits_op.forward_op.plain
    torch.library.opcheck(op, args)
    torch.library.opcheck(op, (x.detach(),) + args[1:])  # without a gradient
    outs = op(*args)
    grad_lp = torch.randn(t.shape, device=DEVICE)
    grad_ent = torch.randn(t.shape, device=DEVICE) if opts["entropy"] == "grad" else None
    torch.library.opcheck(logits_op._backward_op,
                          (x.detach(), t, args[2], args[3], ids, offsets, rows, *outs[2:], grad_lp, grad_ent, "",
                           opts["entropy"], args[9], args[10], args[11], None, "auto", "fused"))


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


def test_logits_op_inplace_grad_under_compile_returns_a_new_gradient():
    """inplace_grad=True under the compiler, which owns the logits' storage: the gradient comes back in a new tensor,
    the eager op's bits, and the logits keep their values."""
    x, t, opts = _logits_call(LOGITS_CASES["grad"])
    before = x.detach().clone()

    def fn(x, t, inplace):
        return ppo_ops.log_probs_and_entropy(x, t, inplace_grad=inplace, **opts)

    eager = _value_and_grads(lambda x, t: fn(x, t, False), [x], t)
    compiled = _value_and_grads(_compiled(lambda x, t: fn(x, t, True)), [x], t)
    _assert_bitwise(eager, compiled)
    assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("change, argument", [
    (dict(temperature=torch.tensor(0.5)), "temperature"),
    (dict(vocab_size=torch.tensor(V)), "vocab_size"),
    (dict(tp_group=object()), "tp_group"),
    (dict(keep=(torch.zeros(1, dtype=torch.long),)), "keep"),
])
def test_logits_op_options_an_operator_cannot_carry_name_the_argument(change, argument):
    """Raised while dynamo traces the wrapper: under fullgraph=True dynamo reports ppo_ops' TypeError."""
    x, t, opts = _logits_call(LOGITS_CASES["grad"])
    opts.update(change)
    with pytest.raises(Exception) as info:
        _compiled(lambda x, t: ppo_ops.log_probs_and_entropy(x, t, **opts))(x, t)
    message = str(info.value)
    assert "TypeError" in message and f"ppo_ops.log_probs_and_entropy: {argument} must be" in message, message


def test_calculate_log_probs_and_entropy_compiles_fullgraph_bitwise():
    x, t, _ = _logits_call(LOGITS_CASES["grad"])

    def fn(x, t):
        lp, ent = ppo_ops.calculate_log_probs_and_entropy(x.reshape(-1, V), t.reshape(-1), None, with_entropy=True)
        return lp.squeeze(-1), ent

    _assert_bitwise(_value_and_grads(fn, [x], t), _value_and_grads(_compiled(fn), [x], t))


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


# ---- the LM head: linear_log_probs_and_entropy and linear_token_loss ----

H = 32  # hidden width of the LM-head cases

LINEAR_CASES = {
    "none": dict(entropy="none"),
    "value": dict(entropy="value"),
    "grad": dict(entropy="grad", temperature=0.7, vocab_size=V - 5),
    "row_mask": dict(entropy="grad", row_mask=True),
    "keep": dict(entropy="grad", keep=True),
    "validate": dict(entropy="grad", validate=True),
    "bf16": dict(entropy="grad", dtype=torch.bfloat16),
    "bf16_hold_none": dict(entropy="grad", dtype=torch.bfloat16, working_memory=0),  # the operator's int option
    "bf16_hold_all": dict(entropy="grad", dtype=torch.bfloat16, working_memory=1 << 20),
}


def _head_call(case, lead=LEAD, seed=0):
    """(hidden leaf, weight leaf, tokens, keyword options) of one case, on a rank holding the whole vocabulary."""
    opts = dict(case)
    dtype = opts.pop("dtype", torch.float32)
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(lead + (H,), generator=gen) * 0.5).to(dtype).to(DEVICE).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.5).to(dtype).to(DEVICE).requires_grad_()
    x, t, rest = _logits_call(opts, lead, seed)
    rest.pop("keep_mask", None)
    return hidden, weight, t, rest


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_linear_log_probs_compiles_fullgraph_bitwise(case, backend):
    hidden, weight, t, opts = _head_call(LINEAR_CASES[case])

    def fn(hidden, weight, t):
        return ppo_ops.linear_log_probs_and_entropy(hidden, weight, t, backend=backend, **opts)

    eager = _value_and_grads(fn, [hidden, weight], t)
    compiled = _value_and_grads(_compiled(fn), [hidden, weight], t)
    _assert_bitwise(eager, compiled)


def _policy_loss(t, entropy, seed=7):
    """The shipped PPO loss with seeded constants on t's device; one object per (shape, device, mode, seed), so a
    CUDA graph capture reuses the one its warm-up built (a host-to-device copy cannot be captured)."""
    return _cached_policy_loss(tuple(t.shape), t.device, entropy, seed)


@functools.lru_cache(maxsize=None)
def _cached_policy_loss(shape, device, entropy, seed):
    gen = torch.Generator().manual_seed(seed)
    old = (-torch.rand(shape, generator=gen) * 3).to(device)
    adv = torch.randn(shape, generator=gen).to(device)
    ref = (-torch.rand(shape, generator=gen) * 3).to(device)
    mask = (torch.rand(shape, generator=gen) < 0.8).to(device)
    return ppo_ops.token_losses.policy_loss(old, adv, clip_high=0.28, dual_clip=3.0, kl_coef=0.05,
                                            ref_log_probs=ref, loss_mask=mask,
                                            entropy_coef=0.01 if entropy == "grad" else 0.0)


def _token_loss_results(fn, hidden, weight, t, loss_fn, upstream=1.0):
    for x in (hidden, weight):
        x.grad = None
    loss, (lp, ent) = fn(hidden, weight, t, loss_fn)
    (loss * upstream).backward()
    return [loss.detach(), lp, ent, hidden.grad, weight.grad]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", ["none", "grad", "row_mask", "keep", "validate", "bf16", "bf16_least_memory"])
def test_token_loss_compiles_fullgraph_bitwise(case, backend):
    least = case.endswith("_least_memory")  # working_memory=0: the smallest blocks, the operator's int option
    hidden, weight, t, opts = _head_call(LINEAR_CASES[case.removesuffix("_least_memory")])
    if least:
        opts["working_memory"] = 0
    loss_fn = _policy_loss(t, opts["entropy"])

    def fn(hidden, weight, t, loss_fn):
        return ppo_ops.linear_token_loss(hidden, weight, t, loss_fn, backend=backend, **opts)

    eager = _token_loss_results(fn, hidden, weight, t, loss_fn)
    compiled = _token_loss_results(_compiled(fn), hidden, weight, t, loss_fn)
    _assert_bitwise(eager, compiled)


@functools.lru_cache(maxsize=None)
def _cached_objective_loss(name, shape, device, seed=8):
    """The objectives beyond PPO, each crossing the operator with the fields PPO's does not have: CISPO with a
    sequence-level IcePop correction (the correction weights, the surrogate); GSPO under the top-entropy mask (a
    sequence loss's tensors and kind, the quantile; its statistics pass inside the operator)."""
    gen = torch.Generator().manual_seed(seed)
    old = (-torch.rand(shape, generator=gen) * 3).to(device)
    adv = torch.randn(shape, generator=gen).to(device)
    seq_ids = (torch.arange(math.prod(shape)) // 5).reshape(shape).to(device)
    if name == "gspo_top_entropy":
        return ppo_ops.top_entropy_mask(ppo_ops.gspo_loss(old, adv, seq_ids, clip_low=0.2, clip_high=0.28), 0.5)
    rollout = old + torch.where(seq_ids % 2 == 1, 0.5, 0.05)  # odd sequences: w = e^-0.5, outside IcePop's caps
    return ppo_ops.token_losses.policy_loss(
        old, adv, surrogate="cispo", clip_high=0.28, kl_coef=0.05,
        ref_log_probs=(-torch.rand(shape, generator=gen) * 3).to(device), seq_ids=seq_ids,
        normalization="seq_mean_token_sum", rollout_log_probs=rollout, rollout_correction="seq_icepop",
        rollout_is_low=0.8, rollout_is_high=1.25)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", ["cispo_seq_icepop", "gspo_top_entropy"])
def test_objective_token_loss_compiles_fullgraph_bitwise(name, backend):
    hidden, weight, t, opts = _head_call(LINEAR_CASES["grad"])
    loss_fn = _cached_objective_loss(name, tuple(t.shape), t.device)
    if name == "cispo_seq_icepop":
        assert bool((loss_fn.pg_coef == 0).any()), "no sequence was dropped"

    def fn(hidden, weight, t, loss_fn):
        return ppo_ops.linear_token_loss(hidden, weight, t, loss_fn, backend=backend, **opts)

    eager = _token_loss_results(fn, hidden, weight, t, loss_fn)
    compiled = _token_loss_results(_compiled(fn), hidden, weight, t, loss_fn)
    _assert_bitwise(eager, compiled)


def test_token_loss_compiled_refuses_a_loss_over_other_rows():
    """A TokenLoss built over more constants than the rows it scores: the eager op's ValueError naming token_loss,
    raised while the call is traced (shapes alone decide it)."""
    hidden, weight, t, _opts = _head_call(LINEAR_CASES["none"])
    loss_fn = _policy_loss(torch.cat([t, t[:1]]), "none")
    fn = _compiled(lambda h, w, t: ppo_ops.linear_token_loss(h, w, t, loss_fn)[0])
    with pytest.raises(ValueError, match="token_loss was built over constants of shape"):
        fn(hidden, weight, t)


def test_token_loss_compiled_no_grad_is_the_eager_forward():
    hidden, weight, t, opts = _head_call(LINEAR_CASES["grad"])
    loss_fn = _policy_loss(t, "grad")

    def fn(hidden, weight, t):
        with torch.no_grad():
            loss, (lp, ent) = ppo_ops.linear_token_loss(hidden, weight, t, loss_fn, **opts)
        return loss, lp, ent

    _assert_bitwise(list(fn(hidden, weight, t)), list(_compiled(fn)(hidden, weight, t)))


@pytest.mark.parametrize("case", ["grad", "row_mask", "keep"])
def test_token_loss_own_closure_is_traced_into_the_graph(case):
    """A callable that is not a TokenLoss: traced with fullgraph=True on top of the general head. Under aot_eager
    (the graph's ops as eager kernels) bit for bit the same composition run eagerly; under inductor the eager token
    loss within CLOSURE_LOSS_REL_TOL, its log-probs and gradients within the head's tolerances."""
    hidden, weight, t, opts = _head_call(LINEAR_CASES[case])
    shipped = _policy_loss(t, "grad")
    opts["entropy"] = "grad"

    def own(lp, ent, rows):  # the shipped loss through a closure of the caller's
        return shipped(lp, ent, rows)

    def fn(hidden, weight, t, loss_fn):
        return ppo_ops.linear_token_loss(hidden, weight, t, loss_fn, **opts)

    def composed(hidden, weight, t, loss_fn):  # what the compiled call computes, run eagerly
        lp, ent = ppo_ops.linear_log_probs_and_entropy(hidden, weight, t, **opts)
        values = loss_fn(lp.reshape(-1), ent.reshape(-1), torch.arange(lp.numel(), device=lp.device))
        if "row_mask" in opts:
            values = torch.where(opts["row_mask"].reshape(-1), values, torch.zeros_like(values))
        return values.sum(), (lp.detach(), ent.detach())

    torch._dynamo.reset()
    traced = _token_loss_results(torch.compile(fn, fullgraph=True, backend="aot_eager"), hidden, weight, t, own)
    _assert_bitwise(_token_loss_results(composed, hidden, weight, t, own), traced)
    eager = _token_loss_results(fn, hidden, weight, t, own)
    inductor = _token_loss_results(_compiled(fn), hidden, weight, t, own)
    assert abs(inductor[0] - eager[0]) <= CLOSURE_LOSS_REL_TOL * max(1.0, abs(eager[0])), (inductor[0], eager[0])
    for got, ref, tol in zip(inductor[1:], eager[1:], (LOG_PROB_TOL, ENTROPY_TOL, GRAD_TOL, GRAD_TOL)):
        assert ((got - ref).abs() <= tol * ref.abs().clamp(min=1.0)).all(), (got - ref).abs().max()


def test_token_loss_compiled_upstream_scale():
    """An upstream scalar other than 1: dX is the eager op's bit for bit (one rounding of dX * g either way)."""
    hidden, weight, t, opts = _head_call(LINEAR_CASES["grad"])
    loss_fn = _policy_loss(t, "grad")

    def fn(hidden, weight, t, loss_fn):
        return ppo_ops.linear_token_loss(hidden, weight, t, loss_fn, **opts)

    eager = _token_loss_results(fn, hidden, weight, t, loss_fn, upstream=0.37)
    compiled = _token_loss_results(_compiled(fn), hidden, weight, t, loss_fn, upstream=0.37)
    _assert_bitwise(eager, compiled)


@pytest.mark.parametrize("case", ["grad", "row_mask", "keep", "validate"])
def test_lm_head_operators_opcheck(case):
    from ppo_ops.compiled import linear_op, token_loss_op
    hidden, weight, t, opts = _head_call(LINEAR_CASES[case])
    ids, offsets = opts.get("keep") or (None, None)
    common = (float(opts.get("temperature", 1.0)), opts.get("vocab_size"), True, "auto", opts["validate"])
    validate = opts["validate"]
    syncs = validate or "row_mask" in opts
    args = (hidden, weight, t, opts.get("row_mask"), ids, offsets, "", opts["entropy"]) + common + (1 << 20, True)
    op = linear_op.forward_op.syncing if syncs else linear_op.forward_op.plain
    torch.library.opcheck(op, args)
    torch.library.opcheck(op, (hidden.detach(), weight.detach()) + args[2:-1] + (False,))
    outs = op(*args)
    grad_ent = torch.randn(t.shape, device=DEVICE) if opts["entropy"] == "grad" else None
    torch.library.opcheck(linear_op._backward_op,
                          (hidden.detach(), weight.detach(), t, args[3], ids, offsets, *outs[2:],
                           torch.randn(t.shape, device=DEVICE), grad_ent, "", opts["entropy"], common[0], common[1],
                           True, "auto", True, True))
    loss = _policy_loss(t, opts["entropy"])
    no_sequence = (None, None, None, "", None)  # a sequence loss's advantages, mask, ids, kind; the entropy quantile
    loss_args = (hidden, weight, t, args[3], ids, offsets, loss.weight, loss.old_log_probs, loss.advantages,
                 loss.ref_log_probs, loss.pg_coef, loss.clip_low, loss.clip_high, loss.dual_clip, loss.entropy_coef,
                 loss.kl_coef, loss.kl_type, loss.normalization, loss.surrogate) + no_sequence + (
                     "", opts["entropy"]) + common[:4] + (validate, 1 << 20, True, True)
    op = token_loss_op.forward_op.syncing if syncs else token_loss_op.forward_op.plain
    torch.library.opcheck(op, loss_args)
    if case == "grad":  # the fields of a sequence loss under the top-entropy mask, with its statistics pass
        seq = _cached_objective_loss("gspo_top_entropy", tuple(t.shape), t.device)
        rest = seq.base.rest
        seq_args = (hidden, weight, t, None, None, None, rest.weight, rest.old_log_probs, rest.advantages,
                    rest.ref_log_probs, rest.pg_coef, rest.clip_low, rest.clip_high, rest.dual_clip,
                    rest.entropy_coef, rest.kl_coef, rest.kl_type, rest.normalization, rest.surrogate,
                    seq.base.advantages, seq.base.mask, seq.base.seq_ids, seq.base.kind, seq.quantile, "",
                    opts["entropy"]) + common[:4] + (validate, 1 << 20, True, True)
        torch.library.opcheck(token_loss_op.forward_op.plain, seq_args)


def test_lm_head_varying_rows_compile_at_most_twice():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def fn(hidden, weight, t, loss_fn):
        loss, (lp, ent) = ppo_ops.linear_token_loss(hidden, weight, t, loss_fn, entropy="grad", validate=False)
        lp2, ent2 = ppo_ops.linear_log_probs_and_entropy(hidden, weight, t, entropy="grad", validate=False)
        return loss, (lp2, ent2)

    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for n_rows in (4, 7, 16, 33, 50):
        hidden, weight, t, _ = _head_call(LINEAR_CASES["grad"], lead=(n_rows,), seed=n_rows)
        loss_fn = _policy_loss(t, "grad", seed=n_rows)
        eager = _token_loss_results(fn, hidden, weight, t, loss_fn)
        _assert_bitwise(eager, _token_loss_results(compiled, hidden, weight, t, loss_fn))
    assert 1 <= counter.frame_count <= MAX_FRAMES_FOR_FIVE_ROW_COUNTS, counter.frame_count


def _tp2_head_worker(rank, world_size):
    group = dist.group.WORLD
    hidden, weight, t, opts = _head_call(dict(entropy="grad"), lead=(6,))
    hidden = hidden.detach().cpu().requires_grad_()
    weight = weight.detach().cpu()[rank * (V // 2):(rank + 1) * (V // 2)].clone().requires_grad_()
    t = t.cpu()
    loss_fn = _policy_loss(t, "grad")

    def general(hidden, weight, t):
        return ppo_ops.linear_log_probs_and_entropy(hidden, weight, t, tp_group=group, entropy="grad",
                                                    validate=False)

    def fused(hidden, weight, t, loss_fn):
        return ppo_ops.linear_token_loss(hidden, weight, t, loss_fn, tp_group=group, entropy="grad",
                                         validate=True)

    _assert_bitwise(_value_and_grads(general, [hidden, weight], t),
                    _value_and_grads(_compiled(general), [hidden, weight], t))
    _assert_bitwise(_token_loss_results(fused, hidden, weight, t, loss_fn),
                    _token_loss_results(_compiled(fused), hidden, weight, t, loss_fn))


def test_lm_head_compiles_at_tp2_over_gloo():
    run_gloo(2, _tp2_head_worker)


# ---- inside a model: a transformers causal LM through ppo_ops.hf ----

def _tiny_qwen3(vocab):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=True, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.Qwen3ForCausalLM(config).to(DEVICE).eval()


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_hf_policy_loss_step_compiles_fullgraph(packed):
    """A trainer's compiled loss: the body of a tiny Qwen3 and the fused head with a shipped PPO loss in one graph.
    With the aot_eager backend (the graph's ops run as eager kernels) loss, log-probs and every parameter's gradient
    are the eager step's bit for bit; inductor, which fuses the body's own ops, changes the body's rounding only.
    The model uses eager attention: with SDPA, transformers skips the causal mask only when it is not tracing, so a
    compiled body runs another attention kernel on CUDA (masked instead of is_causal) and differs in the last bit."""
    from ppo_ops.hf import token_log_probs
    vocab, seq = 301, 12
    model = _tiny_qwen3(vocab)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, seq), generator=gen).to(DEVICE)
    kwargs = {}
    if packed:
        lengths = [[5, 7], [12], [3, 1, 2, 6]]
        kwargs["position_ids"] = torch.tensor([[p for n in row for p in range(n)] for row in lengths]).to(DEVICE)
    loss_fn = ppo_ops.policy_loss((-torch.rand(ids.shape, generator=gen) * 3).to(DEVICE),
                                  torch.randn(ids.shape, generator=gen).to(DEVICE), entropy_coef=0.01)

    def step(ids):
        loss, out = token_log_probs(model, ids, entropy="grad", token_loss=loss_fn, validate=False, **kwargs)
        return loss, out.log_probs, out.entropy

    def run(fn):
        model.zero_grad(set_to_none=True)
        loss, lp, ent = fn(ids)
        loss.backward()
        return [loss.detach(), lp, ent] + [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    _assert_bitwise(run(step), run(torch.compile(step, fullgraph=True, backend="aot_eager")))
    assert "forward" not in model.lm_head.__dict__  # the head's swap undone after the compiled call too


# ---- CUDA graphs (one-GPU target) ----

_CUDA = pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graph capture needs a GPU")


@_CUDA
def test_lm_head_row_mask_inside_capture_names_row_mask():
    hidden, weight, t, opts = _head_call(LINEAR_CASES["row_mask"])
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="row_mask=None"):
        with torch.cuda.graph(graph):
            ppo_ops.linear_log_probs_and_entropy(hidden.detach(), weight.detach(), t, **opts)


@_CUDA
def test_validate_true_inside_capture_names_validate():
    x, t, opts = _logits_call(LOGITS_CASES["grad"])
    ppo_ops.log_probs_and_entropy(x.detach(), t, validate=False)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="validate=False"):
        with torch.cuda.graph(graph):
            ppo_ops.log_probs_and_entropy(x.detach(), t, validate=True)


def _capture(step):
    """A CUDA graph of step() after one warm-up on a side stream (Triton compiles and allocations outside the
    capture), and the outputs of the captured call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


# op -> (case options, eager results of (leaves, tokens) as a list, leaves' shapes from the case)
def _logits_results(leaves, t, opts):
    return _value_and_grads(lambda x, t: ppo_ops.log_probs_and_entropy(x, t, **opts), leaves, t)


def _linear_results(leaves, t, opts):
    return _value_and_grads(lambda h, w, t: ppo_ops.linear_log_probs_and_entropy(h, w, t, **opts), leaves, t)


def _fused_results(leaves, t, opts):
    loss_fn = _policy_loss(t, opts["entropy"])
    return _token_loss_results(lambda h, w, t, f: ppo_ops.linear_token_loss(h, w, t, f, **opts), *leaves, t, loss_fn)


_CAPTURED_OPS = {"logits": _logits_results, "linear": _linear_results, "token_loss": _fused_results}


def _case_leaves(op, case, seed=0):
    if op == "logits":
        x, t, opts = _logits_call(case, seed=seed)
        return [x], t, opts
    hidden, weight, t, opts = _head_call(case, seed=seed)
    return [hidden, weight], t, opts


@_CUDA
@pytest.mark.parametrize("op", list(_CAPTURED_OPS))
@pytest.mark.parametrize("case", ["grad", "keep", "bf16"])
def test_cuda_graph_replay_is_eager_bitwise(op, case):
    """Forward and backward captured with validate=False; each replay on fresh inputs copied into the captured
    buffers equals the eager op on those inputs, bit for bit."""
    results = _CAPTURED_OPS[op]
    leaves, t, opts = _case_leaves(op, LINEAR_CASES[case] if op != "logits" else LOGITS_CASES[case])
    static = [x.detach().clone().requires_grad_() for x in leaves]
    graph, outs = _capture(lambda: results(static, t, opts))
    for seed in (5, 6):
        fresh, _, _ = _case_leaves(op, LINEAR_CASES[case] if op != "logits" else LOGITS_CASES[case], seed=seed)
        with torch.no_grad():
            for dst, src in zip(static, fresh):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        captured = [o.clone() if o is not None else None for o in outs[:-len(static)]] + [x.grad for x in static]
        _assert_bitwise(results(fresh, t, opts), captured)


@_CUDA
@pytest.mark.parametrize("op", list(_CAPTURED_OPS))
@pytest.mark.parametrize("validate", [False, True])
def test_reduce_overhead_is_eager_bitwise(op, validate):
    """mode="reduce-overhead": validate=False calls are captured in its CUDA graphs; validate=True calls (tagged
    cudagraph_unsafe) stay out of them; every call equals eager bit for bit."""
    results = _CAPTURED_OPS[op]
    torch._dynamo.reset()
    case = dict(LINEAR_CASES["grad"], validate=validate)
    opts = _case_leaves(op, case)[2]  # the same options for every seed
    if op == "logits":
        fn = torch.compile(lambda x, t: ppo_ops.log_probs_and_entropy(x, t, **opts), mode="reduce-overhead")
    elif op == "linear":
        fn = torch.compile(lambda h, w, t: ppo_ops.linear_log_probs_and_entropy(h, w, t, **opts),
                           mode="reduce-overhead")
    else:
        fn = torch.compile(lambda h, w, t, f: ppo_ops.linear_token_loss(h, w, t, f, **opts), mode="reduce-overhead")
    for seed in range(4):  # the first calls warm up and record, the later ones replay
        leaves, t, _ = _case_leaves(op, case, seed=seed)
        twins = [x.detach().clone().requires_grad_() for x in leaves]
        eager = results(leaves, t, opts)
        if op == "token_loss":
            got = _token_loss_results(fn, *twins, t, _policy_loss(t, "grad"))
        else:
            got = _value_and_grads(fn, twins, t)
        _assert_bitwise(eager, [g.clone() if g is not None else None for g in got])
