"""Against SGLang's own kernels, on a GPU runner with SGLang (`bazel test --config=sglang`):
tests/sglang_kernels_check.py runs in a child process under $PPO_OPS_SGLANG_PYTHON (SGLang imports only beside the
packages it was installed with), and each of its results is asserted here.

- ppo_ops' reduction_order="sglang" is bit for bit SGLang's batch-invariant log_softmax: every load width, a
  temperature, and 2 and 4 shards (their steps in one process).
- sglang_checks/on_policy.py with SGLang's kernels records what its torch stand-ins record (names, dtypes, shapes) and
  stays within bf16 of them.
"""


import pytest

from tests.sglang_kernels_check import TEMPERATURE_CASES, child_report

CHECK_TIMEOUT_S = 900  # Triton compiles of SGLang's and ppo_ops' kernels, the RoPE's torch.compile
# SGLang's kernels vs the stand-ins on `tiny`, mean |d log-prob| per sequence: other GEMM and attention kernels under
# bf16 activations (measured 0.03 between the bf16 forward and the fp32 model); a bound against wrong wiring.
BF16_MEAN_LOGPROB_ATOL = 0.1


@pytest.fixture(scope="module")
def report():
    return child_report("tests.sglang_kernels_check", CHECK_TIMEOUT_S)


@pytest.mark.parametrize("case", list(TEMPERATURE_CASES) + ["shards_by_hand_2", "shards_by_hand_4"])
def test_sglang_order_is_bitwise_sglangs_log_softmax(report, case):
    assert report["order"][case], f"{case}: reduction_order='sglang' differs from SGLang's log_softmax"


def test_on_policy_forward_with_sglangs_kernels_records_what_the_stand_ins_record(report):
    got = report["on_policy"]
    assert got["names_equal"] and got["layout_mismatches"] == [], got
    assert all(gap < BF16_MEAN_LOGPROB_ATOL for gap in got["mean_gaps"]), got["mean_gaps"]
