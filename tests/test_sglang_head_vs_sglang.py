"""The fused LM head with reduction_order="sglang" against SGLang's own batch-invariant matmul and log_softmax, on a
GPU runner with SGLang (`bazel test --config=sglang`): tests/sglang_head_check.py runs in a child process under
$PPO_OPS_SGLANG_PYTHON (SGLang imports only beside the packages it was installed with), and each of its results is
asserted here.

Cases: Qwen3-0.6B's head (H = 1024, the tied fp32 embedding) and an untied H = 4096 bf16 head at Qwen3's vocabulary,
T = 1, 7, 1000, 4099 and 32768 rows, temperature 1 and 0.7: the head's bf16 logits equal SGLang's matmul's, every
element; its log-probs equal SGLang's log_softmax of them (divided as its sampler divides them), every row; the token
loss's equal the general op's; TP = 2 and 4 as shards by hand (each rank's logits from its weight slice, the order's
steps on them); and one weight one bf16 ulp off makes them differ (the comparison can fail).
"""


import pytest

from tests.sglang_head_check import HEADS, ROWS, TEMPERATURES
from tests.sglang_kernels_check import child_report

CHECK_TIMEOUT_S = 1200  # Triton compiles of both matmuls and the order's kernels; SGLang's log_softmax at T = 32768
CASES = [f"{head}/T={rows}/temp={temperature}" for head in HEADS for rows in ROWS for temperature in TEMPERATURES]


@pytest.fixture(scope="module")
def report():
    return child_report("tests.sglang_head_check", CHECK_TIMEOUT_S)


@pytest.mark.parametrize("case", CASES)
def test_logits_and_log_probs_are_sglangs_bit_for_bit(report, case):
    got = report[case]
    assert got["logits_equal"], f"{case}: the head's bf16 logits differ from SGLang's matmul"
    assert got["log_probs_equal"], f"{case}: {got['rows_differing']} rows differ (max {got['max_abs_diff']})"
    assert got["token_loss_equal"] and got["entropy_finite"], got


@pytest.mark.parametrize("case", [c for c in CASES if "/T=4099/" in c])
def test_shards_by_hand_and_the_one_ulp_control(report, case):
    got = report[case]
    for world in (2, 4):
        assert got[f"shards_{world}_logits_equal"] and got[f"shards_{world}_log_probs_equal"], (world, got)
    assert got["control_one_ulp_differs"], f"{case}: a weight one bf16 ulp off gave SGLang's log-probs still"
