"""The legacy reference (ppo_ops.legacy) against the float64 reference (tests/reference.py), TP=1 and gloo TP=2.

Checks the legacy path on its own, so a parity failure can be attributed: its log-probs, entropies and both gradients
match float64 math within the legacy formulas' error budgets (tests/parity_common.py); its documented behaviours hold
(log-prob gradient rounded to bf16, NaN entropy on -inf logits, caller's logits untouched, no global process group
at TP=1); bad arguments raise before any collective. The TP=2 cases all run in one spawned gloo group.
"""

import ast
import pathlib
import traceback

import pytest
import torch
import torch.distributed as dist

import ppo_ops.legacy
from ppo_ops.legacy import _group as legacy_group
from tests import parity_common
from tests import reference
from tests.parity_common import ENTROPY_BACKWARD_ATOL, ENTROPY_FORWARD_ATOL, PARITY_VOCABS, vocab_slice

_CPU = torch.device("cpu")
# (vocab, keep mask, chunk_size): both vocab sizes, keep mask off/on, whole vs chunked with a tail chunk.
_CASES = [(v, k, c) for v in PARITY_VOCABS for k in (False, True) for c in (-1, 2)]


def _case_id(vocab, keep, chunk):
    return f"V{vocab}-{'keep' if keep else 'nokeep'}-chunk{chunk}"


def _check_legacy_against_float64_once(vocab, keep, chunk, rank=0, tp_size=1, group=None):
    """Legacy forward and the two separate gradients on this rank's slice vs the float64 reference's slice."""
    inputs = parity_common.make_parity_inputs(_CPU, vocab)
    logits, tokens = inputs["logits"], inputs["tokens"]
    keep_mask = inputs["keep_mask"] if keep else None
    w_lp, w_ent = inputs["w_log_prob"], inputs["w_entropy"]

    x = vocab_slice(logits, rank, tp_size).requires_grad_(True)
    local_keep = vocab_slice(keep_mask, rank, tp_size) if keep else None
    log_prob, entropy = ppo_ops.legacy.calculate_log_probs_and_entropy(
        x, tokens, group, with_entropy=True, chunk_size=chunk, log_prob_keep_mask=local_keep
    )
    (grad_lp,) = torch.autograd.grad(log_prob, x, w_lp, retain_graph=True)
    (grad_ent,) = torch.autograd.grad(entropy, x, w_ent)

    ref_lp = reference.reference_log_probs_and_entropy(
        logits, tokens, entropy="value", keep_mask=keep_mask, grad_log_probs=w_lp.squeeze(-1)
    )
    ref_ent = reference.reference_log_probs_and_entropy(logits, tokens, entropy="grad", grad_entropy=w_ent)

    assert log_prob.shape == (tokens.shape[0], 1) and entropy.shape == tokens.shape
    reference.assert_log_probs_close(log_prob.detach().squeeze(-1), ref_lp.log_probs)
    torch.testing.assert_close(entropy.detach().double(), ref_lp.entropy, atol=ENTROPY_FORWARD_ATOL, rtol=0.0)
    # Megatron rounds the log-prob gradient to bf16: it is bf16-valued, and within one bf16 ulp of the reference.
    assert torch.equal(grad_lp, grad_lp.to(torch.bfloat16).float()), "legacy log-prob gradient is not bf16-rounded"
    reference.assert_grad_close(
        grad_lp.to(torch.bfloat16), vocab_slice(ref_lp.grad, rank, tp_size), torch.bfloat16, "log-prob grad"
    )
    torch.testing.assert_close(
        grad_ent.double(), vocab_slice(ref_ent.grad, rank, tp_size), atol=ENTROPY_BACKWARD_ATOL, rtol=0.0
    )


@pytest.mark.parametrize("vocab, keep, chunk", [pytest.param(*c, id=_case_id(*c)) for c in _CASES])
def test_legacy_matches_float64_tp1(vocab, keep, chunk):
    _check_legacy_against_float64_once(vocab, keep, chunk)


def legacy_tp_worker(rank, tp_size, group):
    """Every case on this rank; {case id: None or the failure's traceback} (runs in a spawned process)."""
    results = {}
    for case in _CASES:
        try:
            _check_legacy_against_float64_once(*case, rank=rank, tp_size=tp_size, group=group)
            results[_case_id(*case)] = None
        except Exception:
            results[_case_id(*case)] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    result_dir = str(tmp_path_factory.mktemp("legacy_tp2_gloo"))
    return parity_common.spawn_tp_group(legacy_tp_worker, 2, "gloo", result_dir)


@pytest.mark.parametrize("vocab, keep, chunk", [pytest.param(*c, id=_case_id(*c)) for c in _CASES])
def test_legacy_matches_float64_tp2_gloo(vocab, keep, chunk, tp2_results):
    failures = parity_common.rank_failures(tp2_results, _case_id(vocab, keep, chunk))
    assert not failures, failures


# --- documented legacy behaviours -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep", [False, True])
def test_legacy_leaves_the_callers_logits_untouched(dtype, keep):
    """Megatron subtracts the row max in place after a no-op .float() for fp32 input: the legacy copies first."""
    inputs = parity_common.make_parity_inputs(_CPU, 512)
    logits = inputs["logits"].to(dtype).requires_grad_(True)
    before = logits.detach().clone()
    keep_mask = inputs["keep_mask"].clone() if keep else None
    log_prob, entropy = ppo_ops.legacy.calculate_log_probs_and_entropy(
        logits, inputs["tokens"], None, with_entropy=True, log_prob_keep_mask=keep_mask
    )
    (log_prob.sum() + entropy.sum()).backward()
    assert torch.equal(logits.detach(), before)
    assert logits.grad.dtype == dtype
    if keep:
        assert torch.equal(keep_mask, inputs["keep_mask"])


def test_legacy_bf16_logits_match_float64_of_the_rounded_logits():
    inputs = parity_common.make_parity_inputs(_CPU, 512)
    logits = inputs["logits"].to(torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    log_prob, _ = ppo_ops.legacy.calculate_log_probs_and_entropy(x, inputs["tokens"], None)
    (grad,) = torch.autograd.grad(log_prob, x, inputs["w_log_prob"])
    ref = reference.reference_log_probs_and_entropy(logits, inputs["tokens"], grad_log_probs=inputs["w_log_prob"][:, 0])
    reference.assert_log_probs_close(log_prob.detach().squeeze(-1), ref.log_probs)
    reference.assert_grad_close(grad, ref.grad, torch.bfloat16)


def test_legacy_entropy_is_nan_where_a_logit_is_minus_inf():
    """Kept on purpose (legacy semantics): p·z = 0·(-inf) = NaN in Σp·z. The log-prob stays finite and right."""
    logits = torch.randn(3, 64)
    logits[1, 5] = float("-inf")
    tokens = torch.tensor([0, 7, 9])
    log_prob, entropy = ppo_ops.legacy.calculate_log_probs_and_entropy(logits, tokens, None, with_entropy=True)
    assert torch.isnan(entropy[1]) and torch.isfinite(entropy[[0, 2]]).all()
    ref = reference.reference_log_probs_and_entropy(logits, tokens)
    reference.assert_log_probs_close(log_prob.squeeze(-1), ref.log_probs)


@pytest.mark.parametrize("with_entropy_grad", [False, True])
def test_legacy_entropy_requires_grad_as_asked(with_entropy_grad):
    logits = torch.randn(4, 32, requires_grad=True)
    log_prob, entropy = ppo_ops.legacy.calculate_log_probs_and_entropy(
        logits, torch.arange(4), None, with_entropy=True, with_entropy_grad=with_entropy_grad
    )
    assert log_prob.requires_grad
    assert entropy.requires_grad == with_entropy_grad


@pytest.mark.parametrize("with_entropy", [False, True])
def test_legacy_empty_input_gives_empty_outputs(with_entropy):
    log_prob, entropy = ppo_ops.legacy.calculate_log_probs_and_entropy(
        torch.zeros(0, 32), torch.zeros(0, dtype=torch.long), None, with_entropy=with_entropy
    )
    assert log_prob.shape == (0,) and log_prob.dtype == torch.float32
    assert (entropy.shape == (0,)) if with_entropy else (entropy is None)


def test_legacy_tp1_builds_no_global_process_group():
    """tp_group=None without torch.distributed: a private single-rank group, the global state left alone."""
    initialised_before = dist.is_initialized()
    log_prob, _ = ppo_ops.legacy.calculate_log_probs_and_entropy(torch.randn(2, 16), torch.tensor([1, 2]), None)
    assert dist.is_initialized() == initialised_before
    assert torch.isfinite(log_prob).all()
    if not initialised_before:
        assert legacy_group.resolve_group(None, _CPU).size() == 1


def test_legacy_imports_nothing_of_the_fused_code():
    """The yardstick stays independent: ppo_ops/legacy/*.py import only torch, megatron and ppo_ops.legacy."""
    legacy_dir = pathlib.Path(ppo_ops.legacy.__file__).parent
    sources = sorted(legacy_dir.glob("*.py"))
    assert {p.name for p in sources} >= {"__init__.py", "api.py", "entropy.py", "log_probs.py"}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                if name == "ppo_ops" or name.startswith("ppo_ops."):
                    assert name.startswith("ppo_ops.legacy"), f"{path.name} imports {name}"


# --- bad arguments --------------------------------------------------------------------------------------------------
def _good():
    return dict(logits=torch.randn(3, 16), tokens=torch.tensor([0, 5, 15]), tp_group=None)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(logits=torch.randn(3, 16).double()), TypeError, "logits"),
        (dict(logits=torch.randn(3, 2, 16)), ValueError, "logits"),
        (dict(tokens=torch.tensor([0.0, 1.0, 2.0])), TypeError, "tokens"),
        (dict(tokens=torch.tensor([0, 1])), ValueError, "tokens"),
        (dict(tokens=torch.tensor([0, 16, 1])), ValueError, r"tokens must lie in \[0, 16\)"),
        (dict(tokens=torch.tensor([0, -100, 1])), ValueError, "tokens"),
        (dict(chunk_size=2.5), TypeError, "chunk_size"),
        (dict(log_prob_keep_mask=torch.ones(3, 16)), TypeError, "log_prob_keep_mask"),
        (dict(log_prob_keep_mask=torch.ones(3, 8, dtype=torch.bool)), ValueError, "log_prob_keep_mask"),
        (dict(tp_group="tp"), TypeError, "tp_group"),
    ],
    ids=["logits_fp64", "logits_3d", "tokens_float", "tokens_shape", "token_past_vocab", "token_negative",
         "chunk_size_float", "keep_mask_float", "keep_mask_shape", "tp_group_str"],
)
def test_legacy_rejects_bad_arguments(change, error, match):
    with pytest.raises(error, match=match):
        ppo_ops.legacy.calculate_log_probs_and_entropy(**{**_good(), **change})
