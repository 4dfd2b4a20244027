"""A temperature per row and logit soft-capping (Gemma 2's final_logit_softcapping) in the three ops, against float64
references written out here: z = softcap * tanh(x / softcap) / temperature[row], then log_softmax, the target's
log-prob, the entropy, and autograd's gradient of float64 math (of the logits; of hidden and weight through the fused
head, linear_token_loss with a simple loss). Both backends (Triton under the interpreter on CPU), every path of the
fused head. Also: equal per-row values give the scalar temperature's bits, and in the fused head each row of a
per-row call is bit for bit that row of a scalar call at its temperature; bad arguments raise naming the argument;
the paths that refuse the options say so; at TP = 2 over gloo the ranks' results equal TP = 1's and disagreeing
temperatures raise on every rank.
"""

import pytest
import torch

from ppo_ops import linear_log_probs_and_entropy, linear_token_loss, log_probs_and_entropy
from ppo_ops.lm_head.paths import path_of_call
from tests.core_support import backend_params, run_gloo, triton_skip_reason
from tests.linear_support import ACCUM_ULPS, SAFETY, U32
from tests.reference import ENTROPY_TOL, GRAD_DTYPE_ULP, GRAD_TOL, LOG_PROB_TOL
from tests.ranks import DEVICE

ROWS, VOCAB = 12, 384  # 384 columns: 8 segments of 48, at TP = 2 four per rank
SOFTCAP = 6.0  # below the logits' scale (about 10), so the cap bends them


def _logits(seed=0, rows=ROWS, vocab=VOCAB, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def _tokens(rows=ROWS, vocab=VOCAB, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (rows,), generator=gen)


def _temperatures(rows=ROWS, seed=2):
    """Per-row temperatures in [0.6, 1.6]: max|logit| / T² stays within the accuracy figures' precondition."""
    gen = torch.Generator().manual_seed(seed)
    return 0.6 + torch.rand(rows, generator=gen)


def reference(logits, tokens, temperature, softcap, grad_log_probs, grad_entropy, row_mask=None):
    """float64: (log-probs, entropies, d(Σ g_lp lp + Σ g_ent ent) / d logits), rows the mask drops 0."""
    x = logits.detach().double().requires_grad_()
    z = x if softcap is None else softcap * torch.tanh(x / softcap)
    t = temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    log_p = torch.log_softmax(z / t, dim=-1)
    log_probs = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    if row_mask is not None:
        log_probs, entropy = log_probs * row_mask, entropy * row_mask
    (grad,) = torch.autograd.grad((grad_log_probs * log_probs).sum() + (grad_entropy * entropy).sum(), x)
    return log_probs.detach(), entropy.detach(), grad


def assert_close(out, grad, ref):
    log_probs, entropy, ref_grad = ref
    assert (out.log_probs.double().cpu() - log_probs).abs().max() <= LOG_PROB_TOL * max(1.0, log_probs.abs().max())
    assert (out.entropy.double().cpu() - entropy).abs().max() <= ENTROPY_TOL
    assert (grad.double().cpu() - ref_grad).abs().max() <= GRAD_TOL


def run(logits, tokens, g_lp, g_ent, **options):
    x = logits.to(DEVICE).requires_grad_()
    out = log_probs_and_entropy(x, tokens.to(DEVICE), entropy="grad", **options)
    (grad,) = torch.autograd.grad((out.log_probs * g_lp.to(DEVICE)).sum() + (out.entropy * g_ent.to(DEVICE)).sum(), x)
    return out, grad


def _upstream(rows=ROWS, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("transform", ["rows", "softcap", "both"])
def test_logits_op_against_float64(backend, transform):
    logits, tokens = _logits(), _tokens()
    temperature = _temperatures() if transform != "softcap" else 0.8
    softcap = SOFTCAP if transform != "rows" else None
    g_lp, g_ent = _upstream()
    # Dropped rows carry junk temperatures (0, NaN): never checked, never used.
    row_mask = torch.ones(ROWS, dtype=torch.bool)
    row_mask[[2, 7]] = False
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.clone()
        temperature[2], temperature[7] = 0.0, float("nan")
    options = dict(temperature=temperature.to(DEVICE) if isinstance(temperature, torch.Tensor) else temperature,
                   softcap=softcap, row_mask=row_mask.to(DEVICE), backend=backend)
    out, grad = run(logits, tokens, g_lp, g_ent, **options)
    ref_temperature = torch.where(row_mask, temperature, 1.0) if isinstance(temperature, torch.Tensor) else temperature
    assert_close(out, grad, reference(logits, tokens, ref_temperature, softcap, g_lp, g_ent, row_mask))
    assert (grad[~row_mask.to(DEVICE)] == 0).all()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_op_half_precision(backend, dtype):
    """Half-precision logits (the reference takes the same rounded values): the gradient within GRAD_TOL plus one ulp
    of its dtype."""
    logits, tokens = _logits().to(dtype), _tokens()
    temperature = _temperatures()
    g_lp, g_ent = _upstream()
    out, grad = run(logits, tokens, g_lp, g_ent, temperature=temperature.to(DEVICE), softcap=SOFTCAP, backend=backend)
    assert grad.dtype == dtype
    log_probs, entropy, ref_grad = reference(logits.float(), tokens, temperature, SOFTCAP, g_lp, g_ent)
    assert (out.log_probs.double().cpu() - log_probs).abs().max() <= LOG_PROB_TOL * max(1.0, log_probs.abs().max())
    assert (out.entropy.double().cpu() - entropy).abs().max() <= ENTROPY_TOL
    assert ((grad.double().cpu() - ref_grad).abs() <= GRAD_TOL + GRAD_DTYPE_ULP[dtype] * ref_grad.abs()).all()


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("softcap", [None, SOFTCAP])
def test_equal_row_temperatures_are_the_scalar_bitwise(backend, softcap):
    """A per-row temperature whose rows all hold t gives the scalar t's bits: values and gradient."""
    logits, tokens = _logits(), _tokens()
    g_lp, g_ent = _upstream()
    t = 0.7  # not a power of two: 1 / t is rounded, once, the same way on both paths
    rows = torch.full((ROWS,), t, dtype=torch.float32)
    scalar = float(rows[0])  # the fp32 value the tensor holds
    a, grad_a = run(logits, tokens, g_lp, g_ent, temperature=scalar, softcap=softcap, backend=backend)
    b, grad_b = run(logits, tokens, g_lp, g_ent, temperature=rows.to(DEVICE), softcap=softcap, backend=backend)
    assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.entropy, b.entropy)
    assert torch.equal(grad_a, grad_b)


@pytest.mark.parametrize("backend", backend_params())
def test_keep_mask_and_leading_dims(backend):
    """A dense keep mask renormalises over the transformed logits; [B, S] rows take a [B, S] temperature."""
    logits, tokens = _logits().view(3, 4, VOCAB), _tokens().view(3, 4)
    temperature = _temperatures().view(3, 4)
    keep = torch.rand(3, 4, VOCAB, generator=torch.Generator().manual_seed(5)) < 0.5
    out = log_probs_and_entropy(logits.to(DEVICE), tokens.to(DEVICE), temperature=temperature.to(DEVICE),
                                softcap=SOFTCAP, keep_mask=keep.to(DEVICE), backend=backend)
    z = SOFTCAP * torch.tanh(logits.double() / SOFTCAP) / temperature.double().unsqueeze(-1)
    kept = keep | torch.nn.functional.one_hot(tokens, VOCAB).bool()
    ref = torch.log_softmax(z.masked_fill(~kept, float("-inf")), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert (out.log_probs.double().cpu() - ref).abs().max() <= LOG_PROB_TOL * max(1.0, ref.abs().max())


def test_expanded_per_sequence_temperature():
    """One temperature per sequence, expanded over its positions (a stride-0 view), is each row's."""
    logits, tokens = _logits().view(3, 4, VOCAB), _tokens().view(3, 4)
    per_sequence = torch.tensor([[0.6], [1.0], [1.4]])
    out = log_probs_and_entropy(logits.to(DEVICE), tokens.to(DEVICE),
                                temperature=per_sequence.to(DEVICE).expand(3, 4), softcap=SOFTCAP)
    dense = log_probs_and_entropy(logits.to(DEVICE), tokens.to(DEVICE),
                                  temperature=per_sequence.expand(3, 4).contiguous().to(DEVICE), softcap=SOFTCAP)
    assert torch.equal(out.log_probs, dense.log_probs)
    for b in range(3):
        row = log_probs_and_entropy(logits[b].to(DEVICE), tokens[b].to(DEVICE), temperature=float(per_sequence[b]),
                                    softcap=SOFTCAP)
        assert torch.equal(out.log_probs[b], row.log_probs)


def test_caller_tensors_unchanged():
    logits, tokens, temperature = _logits(), _tokens(), _temperatures()
    logits, tokens, temperature = (t.to(DEVICE) for t in (logits, tokens, temperature))
    copies = [t.clone() for t in (logits, tokens, temperature)]
    run(logits, tokens, *_upstream(), temperature=temperature, softcap=SOFTCAP)
    assert all(torch.equal(a, b) for a, b in zip((logits, tokens, temperature), copies))


# ---- bad arguments: each error names its argument ----

BAD_TEMPERATURES = [
    pytest.param(lambda: torch.ones(ROWS + 1), ValueError, "shape", id="shape"),
    pytest.param(lambda: torch.ones(ROWS, dtype=torch.float64), TypeError, "float32", id="dtype"),
    pytest.param(lambda: torch.ones(ROWS, device="meta"), ValueError, "meta", id="device"),
    pytest.param(lambda: torch.ones(ROWS).index_fill_(0, torch.tensor([3]), 0.0), ValueError, "> 0", id="zero"),
    pytest.param(lambda: torch.ones(ROWS).index_fill_(0, torch.tensor([3]), -0.5), ValueError, "> 0", id="negative"),
    pytest.param(lambda: torch.ones(ROWS).index_fill_(0, torch.tensor([3]), float("nan")), ValueError, "finite",
                 id="nan"),
    pytest.param(lambda: torch.ones(ROWS).index_fill_(0, torch.tensor([3]), float("inf")), ValueError, "finite",
                 id="inf"),
    pytest.param(lambda: torch.ones(ROWS).index_fill_(0, torch.tensor([3]), 1e-39), ValueError, "float32",
                 id="subnormal"),
]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("make, exc_type, detail", BAD_TEMPERATURES)
def test_bad_temperature(backend, make, exc_type, detail):
    temperature = make()
    if temperature.device.type != "meta":
        temperature = temperature.to(DEVICE)
    with pytest.raises(exc_type, match="temperature") as info:
        log_probs_and_entropy(_logits().to(DEVICE), _tokens().to(DEVICE), temperature=temperature, backend=backend)
    assert detail in str(info.value) and info.value.ppo_ops_argument == "temperature"


@pytest.mark.parametrize("softcap, exc_type", [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                                               (float("nan"), ValueError), ("30", TypeError)])
def test_bad_softcap(softcap, exc_type):
    with pytest.raises(exc_type, match="softcap") as info:
        log_probs_and_entropy(_logits().to(DEVICE), _tokens().to(DEVICE), softcap=softcap)
    assert info.value.ppo_ops_argument == "softcap"


@pytest.mark.parametrize("argument", ["temperature", "softcap"])
def test_refused_paths_name_the_argument(argument):
    """The sparse keep set and SGLang's order refuse both options, naming the one given."""
    logits, tokens = _logits().to(DEVICE), _tokens().to(DEVICE)
    option = {"temperature": _temperatures().to(DEVICE)} if argument == "temperature" else {"softcap": SOFTCAP}
    keep = (torch.tensor([1, 2], device=DEVICE), torch.tensor([0] + [2] * ROWS, device=DEVICE))
    for extra in (dict(keep=keep), dict(reduction_order="sglang")):
        with pytest.raises(ValueError, match=argument) as info:
            log_probs_and_entropy(logits, tokens, **option, **extra)
        assert info.value.ppo_ops_argument == argument


def _compiling(monkeypatch):
    """A compile backend (AOT autograd, eager kernels) that counts the frames it captures, with dynamo on (the suite's
    default turns it off: tests/conftest.py)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    torch._dynamo.reset()
    return CompileCounterWithBackend("aot_eager")


def test_logits_op_compiled_equals_eager(monkeypatch):
    """torch.compile(fullgraph=True) of the logits op with a per-row temperature and a softcap: the custom operator's
    log-probs, entropies and gradient are eager's bits (the same kernels, reached through the operator)."""
    counter = _compiling(monkeypatch)
    logits, tokens = _logits(), _tokens()
    temperature, (g_lp, g_ent) = _temperatures(), _upstream()

    def forward(x, t, tok):
        out = log_probs_and_entropy(x, tok, entropy="grad", temperature=t, softcap=SOFTCAP, backend="torch")
        return out.log_probs, out.entropy

    def results(fn):
        x = logits.to(DEVICE).requires_grad_()
        log_probs, entropy = fn(x, temperature.to(DEVICE), tokens.to(DEVICE))
        (grad,) = torch.autograd.grad((log_probs * g_lp.to(DEVICE)).sum() + (entropy * g_ent.to(DEVICE)).sum(), x)
        return log_probs, entropy, grad

    eager = results(forward)
    compiled = results(torch.compile(forward, fullgraph=True, backend=counter))
    assert counter.frame_count == 1  # traced, not run eagerly
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_fused_head_under_compile_refuses_the_transforms(monkeypatch):
    """The LM head's custom operators take a scalar temperature and no softcap: refused, naming the argument."""
    counter = _compiling(monkeypatch)
    hidden = torch.randn(ROWS, 16, device=DEVICE)
    weight = torch.randn(VOCAB, 16, device=DEVICE)
    tokens = _tokens().to(DEVICE)

    def call(h, w):
        return linear_log_probs_and_entropy(h, w, tokens, softcap=SOFTCAP, backend="torch").log_probs

    with pytest.raises(Exception, match="softcap is not available inside torch.compile"):
        torch.compile(call, fullgraph=True, backend=counter)(hidden, weight)


# ---- TP = 2 over gloo ----

def _tp_worker(rank, world_size, out_dir):
    import torch.distributed as dist

    group = dist.group.WORLD
    v_local = VOCAB // world_size
    logits, tokens, temperature = _logits(), _tokens(), _temperatures()
    shard = logits[:, rank * v_local:(rank + 1) * v_local].contiguous()
    results = {}
    for backend in ("torch", "triton"):
        x = shard.clone().requires_grad_()
        out = log_probs_and_entropy(x, tokens, tp_group=group, entropy="grad", temperature=temperature,
                                    softcap=SOFTCAP, backend=backend)
        g_lp, g_ent = _upstream()
        (grad,) = torch.autograd.grad((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum(), x)
        results[backend] = (out.log_probs, out.entropy, grad)
    # The fused head on this rank's weight rows: log-probs, entropies and dW bitwise those of TP = 1.
    hidden, weight, head_tokens, head_temperature, g_lp, g_ent = _head_inputs(torch.float32, HIDDEN)
    rows = HEAD_VOCAB // world_size
    results["head"] = _head_run("linear", hidden, weight[rank * rows:(rank + 1) * rows], head_tokens, g_lp, g_ent,
                                tp_group=group, backend="torch", temperature=head_temperature,
                                softcap=HEAD_SOFTCAP)
    results["token_loss"] = _head_run("token_loss", hidden, weight[rank * rows:(rank + 1) * rows], head_tokens, g_lp,
                                      g_ent, tp_group=group, backend="torch", temperature=head_temperature,
                                      softcap=HEAD_SOFTCAP)
    # A rank whose temperatures differ: every rank raises, naming temperature.
    other = temperature.clone()
    if rank == 1:
        other[0] += 0.25
    try:
        log_probs_and_entropy(shard, tokens, tp_group=group, temperature=other, softcap=SOFTCAP)
        results["disagreement"] = None
    except ValueError as exc:
        results["disagreement"] = (exc.ppo_ops_argument, str(exc))
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.mark.world_size(2)
@pytest.mark.device("cpu")  # the ranks run the interpreter on CPU tensors
def test_tp2_gloo_equals_tp1(tmp_path):
    run_gloo(2, _tp_worker, str(tmp_path), timeout_s=60, deadline_s=300)
    logits, tokens, temperature = _logits(), _tokens(), _temperatures()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for backend in ("torch", "triton"):
        x = logits.clone().requires_grad_()
        out = log_probs_and_entropy(x, tokens, entropy="grad", temperature=temperature, softcap=SOFTCAP,
                                    backend=backend)
        g_lp, g_ent = _upstream()
        (grad,) = torch.autograd.grad((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum(), x)
        for r, result in enumerate(ranks):
            log_probs, entropy, rank_grad = result[backend]
            # V_global % 8 == 0: the results are bitwise TP-invariant (docs/api.md#reproducibility)
            assert torch.equal(log_probs, out.log_probs) and torch.equal(entropy, out.entropy)
            assert torch.equal(rank_grad, grad[:, r * (VOCAB // 2):(r + 1) * (VOCAB // 2)])
    hidden, weight, head_tokens, head_temperature, g_lp, g_ent = _head_inputs(torch.float32, HIDDEN)
    log_probs, entropy, _, dw = _head_run("linear", hidden, weight, head_tokens, g_lp, g_ent, backend="torch",
                                          temperature=head_temperature, softcap=HEAD_SOFTCAP)
    rows = HEAD_VOCAB // 2
    for r, result in enumerate(ranks):
        rank_lp, rank_ent, _, rank_dw = result["head"]
        assert torch.equal(rank_lp, log_probs) and torch.equal(rank_ent, entropy)
        assert torch.equal(rank_dw, dw[r * rows:(r + 1) * rows])
    # The token loss: its values and dW shards those of TP = 1 too (the same segments at every TP size).
    log_probs, entropy, _, dw = _head_run("token_loss", hidden, weight, head_tokens, g_lp, g_ent, backend="torch",
                                          temperature=head_temperature, softcap=HEAD_SOFTCAP)
    for r, result in enumerate(ranks):
        rank_lp, rank_ent, _, rank_dw = result["token_loss"]
        assert torch.equal(rank_lp, log_probs) and torch.equal(rank_ent, entropy)
        assert torch.equal(rank_dw, dw[r * rows:(r + 1) * rows])
    for result in ranks:
        argument, message = result["disagreement"]
        assert argument == "temperature" and "per-row temperature" in message


# ---- the fused head: linear_log_probs_and_entropy and linear_token_loss ----

HEAD_ROWS, HIDDEN, HEAD_VOCAB = 40, 48, 256  # eight segments of 32; H * 2 bytes a multiple of 16 (TMA-aligned rows)
UNALIGNED_HIDDEN = 44  # 88-byte bf16 rows: not TMA-aligned, so the chunk GEMM paths
# dX and dW against float64, norm-relative. fp32 inputs: fp32 dlogits (GRAD_TOL per unit of upstream gradient) through
# fp32 GEMMs of K <= 256, measured near 1e-6. Half precision: dlogits rounded once to bf16 before the GEMMs and dX,
# dW returned in bf16 (half an ulp, 2^-9, each), measured near 2^-8.6.
HEAD_GRAD_REL_TOL = 1e-5
HALF_HEAD_GRAD_REL_TOL = 2.0**-7
HEAD_SOFTCAP = 4.0  # the head's logits reach about 9: the cap bends them

# (backend, dtype, hidden width, working_memory, the path linear_log_probs_and_entropy takes, linear_token_loss's)
HEAD_CASES = {
    "torch-fp32": ("torch", torch.float32, HIDDEN, None, "TORCH_TILES", "LOSS_CHUNK_BLOCKS"),
    "triton-fp32": ("triton", torch.float32, HIDDEN, None, "FP32_TILES", "LOSS_CHUNK_BLOCKS"),
    "triton-bf16-held": ("triton", torch.bfloat16, HIDDEN, None, "ONE_GEMM_HELD", "LOSS_BLOCKS"),
    "triton-bf16-one-block": ("triton", torch.bfloat16, HIDDEN, 1 << 30, "ONE_GEMM_HELD", "LOSS_ONE_BLOCK"),
    "triton-bf16-recompute": ("triton", torch.bfloat16, HIDDEN, 0, "ONE_GEMM", "LOSS_BLOCKS"),
    "triton-bf16-chunks": ("triton", torch.bfloat16, UNALIGNED_HIDDEN, None, "CHUNK_GEMMS", "LOSS_CHUNK_BLOCKS"),
}


def _head_case(name, marks=()):
    backend = HEAD_CASES[name][0]
    reason = triton_skip_reason(DEVICE) if backend == "triton" else None
    skip = [pytest.mark.skipif(reason is not None, reason=reason or "")]
    return pytest.param(name, id=name, marks=skip + list(marks))


def _head_inputs(dtype, width, seed=7):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(HEAD_ROWS, width, generator=gen).to(dtype)
    weight = (torch.randn(HEAD_VOCAB, width, generator=gen) * (9.0 / width**0.5)).to(dtype)
    tokens = torch.randint(0, HEAD_VOCAB, (HEAD_ROWS,), generator=gen)
    temperature = 0.6 + torch.rand(HEAD_ROWS, generator=gen)
    g_lp, g_ent = torch.randn(HEAD_ROWS, generator=gen), torch.randn(HEAD_ROWS, generator=gen)
    return hidden, weight, tokens, temperature, g_lp, g_ent


def _head_run(op, hidden, weight, tokens, g_lp, g_ent, **options):
    """(log-probs, entropies, dX, dW) of `op` ("linear" or "token_loss") with loss Σ g_lp lp + Σ g_ent ent."""
    h, w = hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE).requires_grad_()
    g_lp, g_ent, tokens = g_lp.to(DEVICE), g_ent.to(DEVICE), tokens.to(DEVICE)
    if op == "linear":
        out = linear_log_probs_and_entropy(h, w, tokens, entropy="grad", **options)
        loss = (out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()
    else:
        loss, out = linear_token_loss(h, w, tokens, lambda lp, ent, rows: lp * g_lp[rows] + ent * g_ent[rows],
                                      entropy="grad", **options)
    dx, dw = torch.autograd.grad(loss, (h, w))
    return out.log_probs, out.entropy, dx, dw


def _head_reference(hidden, weight, tokens, temperature, softcap, g_lp, g_ent):
    """float64 (log-probs, entropies, dX, dW) and each row's bound on the logits' fp32 accumulation error
    E_r = max_c ACCUM_ULPS * H * u32 * (|X| @ |W|^T) / T_r (the transform's slope is at most 1)."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    x = h @ w.T
    z = x if softcap is None else softcap * torch.tanh(x / softcap)
    t = temperature.double().unsqueeze(-1)
    log_p = torch.log_softmax(z / t, dim=-1)
    log_probs = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    dx, dw = torch.autograd.grad((g_lp * log_probs).sum() + (g_ent * entropy).sum(), (h, w))
    accumulation = ACCUM_ULPS * hidden.shape[1] * U32 * (hidden.double().abs() @ weight.double().abs().T)
    return log_probs.detach(), entropy.detach(), dx, dw, accumulation.amax(-1) / temperature.double()


def _rel(a, b):
    b = b.double().cpu()
    return float((a.double().cpu() - b).norm() / b.norm())


@pytest.mark.parametrize("op", ["linear", "token_loss"])
@pytest.mark.parametrize("case", [_head_case("torch-fp32"), _head_case("triton-fp32"),
                                  _head_case("triton-bf16-held"),
                                  _head_case("triton-bf16-chunks")])
def test_head_against_float64(op, case):
    """A per-row temperature and a softcap together, values and the gradients of hidden and weight."""
    backend, dtype, width, memory, path, loss_path = HEAD_CASES[case]
    hidden, weight, tokens, temperature, g_lp, g_ent = _head_inputs(dtype, width)
    if DEVICE.type == "cpu":  # the paths' row sizes off CUDA (lm_head/paths.py's HOST_*), which HEAD_CASES names
        assert path_of_call(hidden, weight, backend=backend, working_memory=memory, token_loss=op == "token_loss",
                            needs_grad=True).path.name == (path if op == "linear" else loss_path)
    log_probs, entropy, dx, dw = _head_run(op, hidden, weight, tokens, g_lp, g_ent, backend=backend,
                                           temperature=temperature.to(DEVICE), softcap=HEAD_SOFTCAP,
                                           working_memory=memory)
    ref_lp, ref_ent, ref_dx, ref_dw, e_row = _head_reference(hidden, weight, tokens, temperature, HEAD_SOFTCAP,
                                                             g_lp, g_ent)
    lp_tol = LOG_PROB_TOL * ref_lp.abs().clamp(min=1) + SAFETY * 2 * e_row
    assert ((log_probs.double().cpu() - ref_lp).abs() <= lp_tol).all()
    # the entropy moves by at most E_r times Σ_c p |z - E_p z| <= 2 log V per unit of z's error
    ent_tol = ENTROPY_TOL + SAFETY * e_row * 2 * torch.log(torch.tensor(float(HEAD_VOCAB), dtype=torch.float64))
    assert ((entropy.double().cpu() - ref_ent).abs() <= ent_tol).all()
    grad_tol = HEAD_GRAD_REL_TOL if dtype == torch.float32 else HALF_HEAD_GRAD_REL_TOL
    assert _rel(dx, ref_dx) <= grad_tol and _rel(dw, ref_dw) <= grad_tol


@pytest.mark.parametrize("softcap", [HEAD_SOFTCAP, pytest.param(None, marks=[pytest.mark.device("cuda")])])
@pytest.mark.parametrize("case", [
    _head_case("torch-fp32"), _head_case("triton-fp32", marks=[pytest.mark.device("cuda")]),
    _head_case("triton-bf16-held"), _head_case("triton-bf16-one-block", marks=[pytest.mark.device("cuda")]),
    _head_case("triton-bf16-recompute", marks=[pytest.mark.device("cuda")]),
    _head_case("triton-bf16-chunks", marks=[pytest.mark.device("cuda")]),
])
def test_head_rows_are_scalar_rows(case, softcap):
    """Each row of a per-row call is, bit for bit, that row of a scalar call at the row's temperature (a row's
    results do not depend on the other rows): log-probs, entropies and dX, in both ops, through a row mask."""
    backend, dtype, width, memory, _, _ = HEAD_CASES[case]
    hidden, weight, tokens, _, g_lp, g_ent = _head_inputs(dtype, width)
    temperature = torch.tensor([0.7, 1.3]).repeat(HEAD_ROWS // 2)
    row_mask = torch.rand(HEAD_ROWS, generator=torch.Generator().manual_seed(9)) < 0.8
    even = torch.arange(HEAD_ROWS) % 2 == 0
    options = dict(backend=backend, working_memory=memory, softcap=softcap, row_mask=row_mask.to(DEVICE))
    for op in ("linear", "token_loss"):
        rows = _head_run(op, hidden, weight, tokens, g_lp, g_ent, temperature=temperature.to(DEVICE), **options)
        cold = _head_run(op, hidden, weight, tokens, g_lp, g_ent, temperature=0.7, **options)
        hot = _head_run(op, hidden, weight, tokens, g_lp, g_ent, temperature=1.3, **options)
        for got, a, b in zip(rows[:3], cold[:3], hot[:3]):
            assert torch.equal(got[even.to(DEVICE)], a[even.to(DEVICE)])
            assert torch.equal(got[~even.to(DEVICE)], b[~even.to(DEVICE)])


@pytest.mark.parametrize("fn", ["linear_log_probs_and_entropy", "linear_token_loss"])
def test_head_bad_arguments(fn):
    hidden, weight, tokens, temperature, g_lp, g_ent = _head_inputs(torch.float32, HIDDEN)
    hidden, weight, tokens = hidden.to(DEVICE), weight.to(DEVICE), tokens.to(DEVICE)

    def call(**options):
        if fn == "linear_log_probs_and_entropy":
            return linear_log_probs_and_entropy(hidden, weight, tokens, **options)
        return linear_token_loss(hidden, weight, tokens, lambda lp, ent, rows: lp, **options)

    cases = [(dict(temperature=torch.ones(HEAD_ROWS - 1, device=DEVICE)), ValueError, "temperature"),
             (dict(temperature=torch.ones(HEAD_ROWS, device=DEVICE).index_fill_(0, torch.tensor([5], device=DEVICE),
                                                                                 -1.0)), ValueError, "temperature"),
             (dict(softcap=0.0), ValueError, "softcap"),
             (dict(softcap=HEAD_SOFTCAP, keep=(torch.tensor([1], device=DEVICE),
                                               torch.tensor([0] + [1] * HEAD_ROWS, device=DEVICE))),
              ValueError, "softcap"),
             (dict(temperature=temperature.to(DEVICE), reduction_order="sglang"), ValueError, "temperature")]
    for options, exc_type, argument in cases:
        with pytest.raises(exc_type, match=argument) as info:
            call(**options)
        assert info.value.ppo_ops_argument == argument


# ---- ppo_ops.hf: Gemma 2's final_logit_softcapping ----

GEMMA_SOFTCAP = 1.0  # below the tiny model's uncapped logits (about 2), so the cap bends them; Gemma 2 ships 30.0


def _gemma2():
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = transformers.Gemma2Config(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           final_logit_softcapping=GEMMA_SOFTCAP, attn_implementation="eager")
        model = transformers.Gemma2ForCausalLM(config).eval()
        for p in model.parameters():  # matrices scaled up: logits of a few units, which the cap bends
            if p.dim() == 2:
                p.data.mul_(4.0)
    return model.to(DEVICE)


def test_hf_serves_gemma2_softcapping():
    """token_log_probs on a Gemma 2 whose config caps its logits, with a per-position temperature: values and every
    parameter's gradient against the model's own (capped) logits taken to float64."""
    from ppo_ops.hf import token_log_probs

    model = _gemma2()
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 301, (2, 9), generator=gen).to(DEVICE)
    temperature = (0.6 + torch.rand(2, 9, generator=gen)).to(DEVICE)
    w_lp, w_ent = (torch.randn(2, 9, generator=gen).to(DEVICE) for _ in range(2))

    out = token_log_probs(model, ids, entropy="grad", temperature=temperature)
    assert model.config.final_logit_softcapping == GEMMA_SOFTCAP  # off during the call only
    (w_lp * out.log_probs + w_ent * out.entropy).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    logits = model(input_ids=ids, use_cache=False).logits  # the model's own, capped in its forward
    assert logits.abs().max() <= GEMMA_SOFTCAP and logits.abs().max() > 0.8 * GEMMA_SOFTCAP  # the cap bends them
    log_p = torch.log_softmax(logits.double() / temperature.double().unsqueeze(-1), -1)[:, :-1]
    ref_lp = log_p.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    (w_lp[:, :-1] * ref_lp + w_ent[:, :-1] * ref_ent).sum().backward()

    # Both sides' fp32 logits (the model's GEMM and the head's) are within the fp32 accumulation bound of
    # _head_reference, E <= ACCUM_ULPS * H * u32 * max |h| . |w| / T, each.
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state.detach()
    weight = model.lm_head.weight.detach()
    e_row = (ACCUM_ULPS * hidden.shape[-1] * U32 * (hidden.double().abs() @ weight.double().abs().T).amax(-1)
             / temperature.double())[:, :-1]
    lp_tol = LOG_PROB_TOL * ref_lp.abs().clamp(min=1) + SAFETY * 4 * e_row
    assert ((out.log_probs[:, :-1].double() - ref_lp).abs() <= lp_tol).all()
    assert (out.log_probs[:, -1] == 0).all()
    ent_tol = ENTROPY_TOL + SAFETY * 2 * e_row * 2 * torch.log(torch.tensor(301.0, dtype=torch.float64))
    assert ((out.entropy[:, :-1].double() - ref_ent).abs() <= ent_tol).all()
    for name, p in model.named_parameters():
        assert _rel(grads[name], p.grad.double()) <= HEAD_GRAD_REL_TOL, name


def test_hf_refuses_softcapping_of_other_models():
    """A model outside SOFTCAPPED_MODELS whose config names a soft-cap is still refused, before it runs."""
    import transformers

    from ppo_ops.hf import token_log_probs

    config = transformers.Qwen3Config(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = transformers.Qwen3ForCausalLM(config)
    model.config.final_logit_softcapping = 30.0  # Qwen3's forward would not apply it
    with pytest.raises(ValueError, match="final_logit_softcapping") as info:
        token_log_probs(model, torch.zeros(1, 4, dtype=torch.long))
    assert info.value.ppo_ops_argument == "model"


# ---- ppo_ops.megatron: the Context passes a per-label temperature and the softcap to the head ----

def test_megatron_context_passes_them_through():
    """output_processor in Megatron's [S, B, H] layout, one rank (no process group), against the head called
    directly on the same rows: bit for bit, both ops; and the softcap refused beside MuP's logit multiplier."""
    import types

    pytest.importorskip("megatron.core")
    import ppo_ops.megatron as pm

    hidden, weight, tokens, temperature, g_lp, g_ent = _head_inputs(torch.float32, HIDDEN)
    batch, seq = 4, HEAD_ROWS // 4
    labels = tokens.view(batch, seq).to(DEVICE)
    loss_mask = (torch.rand(batch, seq, generator=torch.Generator().manual_seed(3)) < 0.8).to(DEVICE)
    per_label = temperature.view(batch, seq).to(DEVICE)
    hidden_sbh = hidden.view(batch, seq, HIDDEN).transpose(0, 1).contiguous().to(DEVICE)
    w = weight.to(DEVICE)
    for token_loss in (None, lambda lp, ent, rows: lp * 2.0 + ent):
        context = pm.Context(entropy="value", temperature=per_label, softcap=HEAD_SOFTCAP, token_loss=token_loss)
        got = pm.output_processor(hidden_states=hidden_sbh, labels=labels, context=context, output_weight=w,
                                  loss_mask=loss_mask)
        options = dict(entropy="value", temperature=per_label, softcap=HEAD_SOFTCAP, row_mask=loss_mask)
        if token_loss is None:
            want = linear_log_probs_and_entropy(hidden_sbh.transpose(0, 1), w, labels, **options)
        else:
            ppo_ops_loss, want = linear_token_loss(hidden_sbh.transpose(0, 1), w, labels, token_loss, **options)
            loss, got = got
            assert torch.equal(loss, ppo_ops_loss)
        assert torch.equal(got.log_probs, want.log_probs) and torch.equal(got.entropy, want.entropy)
    # the cap acts on the multiplied logits: no temperature can carry MuP's multiplier past it
    mup = types.SimpleNamespace(use_mup=True, mup_output_mult=2.0)
    with pytest.raises(ValueError, match="softcap") as info:
        pm.output_processor(hidden_states=hidden_sbh, labels=labels, context=pm.Context(softcap=HEAD_SOFTCAP),
                            output_weight=w, config=mup)
    assert info.value.ppo_ops_argument == "softcap"
