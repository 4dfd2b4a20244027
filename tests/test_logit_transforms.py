"""A temperature per row and logit soft-capping (Gemma 2's final_logit_softcapping) in the logits op, against float64
references written out here: z = softcap * tanh(x / softcap) / temperature[row], then log_softmax, the target's
log-prob, the entropy, and autograd's gradient of float64 math. Both backends (Triton under the interpreter on CPU).
Also: equal per-row values give the scalar temperature's bits, bad arguments raise naming the argument, the paths
that refuse the options say so, and at TP = 2 over gloo the ranks' results equal TP = 1's and disagreeing
temperatures raise on every rank.
"""

import pytest
import torch

from ppo_ops import log_probs_and_entropy
from tests.core_support import backend_params, run_gloo
from tests.reference import ENTROPY_TOL, GRAD_TOL, LOG_PROB_TOL
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


def test_caller_tensors_unchanged():
    logits, tokens, temperature = _logits(), _tokens(), _temperatures()
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
    for result in ranks:
        argument, message = result["disagreement"]
        assert argument == "temperature" and "per-row temperature" in message
