"""Parity of the fused core with the legacy reference: TP=1 in-process, TP=2 on two spawned ranks. On CPU (the CPU
target) over gloo; on CUDA (the `_gpu` target, two GPUs) the core takes its Triton backend and the ranks use NCCL,
one GPU each; the legacy runs Megatron's fused CE (eager: TORCHDYNAMO_DISABLE=1, set by the Bazel macros).

Both sides go through the slime-compatible `calculate_log_probs_and_entropy`; the 12 scenarios, inputs, tolerances and
comparisons live in tests/parity_common.py. The TP=2 cases all run inside ONE spawned group (module fixture), each
case then reported as its own test. Negative controls at the end feed
`_assert_legacy_parity` deliberately wrong "cores" to prove each comparison can fail.
"""

import pytest
import torch

import ppo_ops
import ppo_ops.legacy
from tests import parity_common
from tests.parity_common import PARITY_SCENARIOS, PARITY_VOCABS, ParityScenario, _assert_legacy_parity
from tests.ranks import DEVICE, DIST_BACKEND

_CASES = [
    pytest.param(vocab, scenario, id=parity_common.case_id(vocab, scenario))
    for vocab in PARITY_VOCABS
    for scenario in PARITY_SCENARIOS
]
_CPU = torch.device("cpu")


@pytest.mark.parametrize("vocab, scenario", _CASES)
def test_parity_tp1(vocab, scenario):
    _assert_legacy_parity(scenario, parity_common.make_parity_inputs(torch.device(DEVICE.type, 0) if DEVICE.type ==
                                                                      "cuda" else _CPU, vocab))


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    """Every case on two ranks (gloo on CPU, NCCL on two GPUs), in one spawned group; per rank {case id: failure text
    or None}."""
    result_dir = str(tmp_path_factory.mktemp("parity_tp2"))
    return parity_common.spawn_tp_group(parity_common.parity_worker, 2, DIST_BACKEND, result_dir, DEVICE.type)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("vocab, scenario", _CASES)
def test_parity_tp2(vocab, scenario, tp2_results):
    failures = parity_common.case_failures(tp2_results, vocab, scenario)
    assert not failures, (f"TP=2 {DIST_BACKEND} parity failed for {parity_common.case_id(vocab, scenario)}:\n"
                          f"{failures}")


@pytest.mark.parametrize("with_entropy", [False, True])
def test_empty_input_shapes_match(with_entropy):
    """T == 0: both return a (0,) log-prob (slime's shape) and a (0,) entropy or None."""
    outputs = [
        fn(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long), None, with_entropy=with_entropy)
        for fn in (ppo_ops.calculate_log_probs_and_entropy, ppo_ops.legacy.calculate_log_probs_and_entropy)
    ]
    for log_prob, entropy in outputs:
        assert log_prob.shape == (0,) and log_prob.dtype == torch.float32
        assert (entropy is not None and entropy.shape == (0,)) if with_entropy else entropy is None


def test_scenario_table_covers_the_issue_grid():
    """chunk_size {-1, 2} x keep mask off/on x {no entropy, forward only, with grad}: 12 distinct scenarios."""
    grid = {(s.chunk_size, s.keep_mask, s.entropy) for s in PARITY_SCENARIOS}
    assert len(PARITY_SCENARIOS) == len(grid) == 12
    assert {c for c, _, _ in grid} == {-1, 2}
    assert {k for _, k, _ in grid} == {False, True}
    assert {e for _, _, e in grid} == {"none", "forward", "grad"}


@pytest.mark.parametrize("vocab", PARITY_VOCABS)
def test_parity_inputs_have_the_edge_rows_and_bounds_the_tolerances_assume(vocab):
    inputs = parity_common.make_parity_inputs(_CPU, vocab)
    logits, tokens, keep = inputs["logits"], inputs["tokens"], inputs["keep_mask"]
    rows = torch.arange(logits.shape[0])
    assert (~keep[rows, tokens]).sum() >= 2, "rows whose keep mask drops the target"
    assert (keep.sum(-1) == 0).any(), "a row that keeps nothing but its target"
    assert torch.softmax(logits.double(), -1)[rows, tokens].max() > 0.999, "a row peaked on its target"
    assert logits.abs().max() <= parity_common.PARITY_MAX_ABS_LOGIT
    assert torch.logsumexp(logits.double(), -1).abs().max() < 16.0, "the tolerances assume magnitudes below 16"


# --- negative controls: wrong "cores" that the parity comparisons must reject -----------------------------------------
class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward scales the gradient (a core whose gradient is off by a relative factor)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _legacy(*args, **kwargs):
    return ppo_ops.legacy.calculate_log_probs_and_entropy(*args, **kwargs)


def _log_prob_shifted(logits, *args, **kwargs):
    log_prob, entropy = _legacy(logits, *args, **kwargs)
    return log_prob + 3 * parity_common.LOGPROB_FORWARD_ATOL, entropy


def _keep_mask_ignored(logits, tokens, tp_group, **kwargs):
    kwargs["log_prob_keep_mask"] = None
    return _legacy(logits, tokens, tp_group, **kwargs)


def _entropy_shifted(logits, *args, **kwargs):
    log_prob, entropy = _legacy(logits, *args, **kwargs)
    return log_prob, entropy + 3 * parity_common.ENTROPY_FORWARD_ATOL


def _log_prob_grad_two_bf16_ulps_off(logits, tokens, tp_group, **kwargs):
    log_prob, _ = _legacy(_ScaleGrad.apply(logits, 1 + 2.0**-6), tokens, tp_group, **kwargs)
    _, entropy = _legacy(logits, tokens, tp_group, **kwargs)
    return log_prob, entropy


def _entropy_grad_off(logits, tokens, tp_group, **kwargs):
    log_prob, _ = _legacy(logits, tokens, tp_group, **kwargs)
    _, entropy = _legacy(_ScaleGrad.apply(logits, 1.1), tokens, tp_group, **kwargs)
    return log_prob, entropy


def _entropy_without_grad(logits, tokens, tp_group, **kwargs):
    kwargs["with_entropy_grad"] = False
    return _legacy(logits, tokens, tp_group, **kwargs)


@pytest.mark.parametrize(
    "wrong_core, scenario",
    [
        pytest.param(_log_prob_shifted, ParityScenario(-1, False, "none"), id="log_prob_off_by_3_tolerances"),
        pytest.param(_keep_mask_ignored, ParityScenario(2, True, "none"), id="keep_mask_ignored"),
        pytest.param(_entropy_shifted, ParityScenario(-1, False, "forward"), id="entropy_off_by_3_tolerances"),
        pytest.param(_log_prob_grad_two_bf16_ulps_off, ParityScenario(-1, True, "none"),
                     id="log_prob_grad_2_bf16_ulps"),
        pytest.param(_entropy_grad_off, ParityScenario(2, False, "grad"), id="entropy_grad_10_percent"),
        pytest.param(_entropy_without_grad, ParityScenario(-1, False, "grad"), id="entropy_requires_grad_missing"),
    ],
)
def test_parity_rejects_a_wrong_core(wrong_core, scenario):
    inputs = parity_common.make_parity_inputs(_CPU, PARITY_VOCABS[0])
    with pytest.raises(AssertionError):
        _assert_legacy_parity(scenario, inputs, core_fn=wrong_core)
