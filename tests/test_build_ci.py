"""The build's own test: `.ci/run` ends with `N passed, N failed` counted from Bazel's per-target summary.

Feeds `.ci/run --count LOGFILE` (the counting half of the CI script, without running Bazel) saved `bazel test`
outputs, and checks every status Bazel prints lands on the right side.
"""

import subprocess

import pytest

CI_SCRIPT = ".ci/run"

# One summary line per status Bazel 4.2.3 can print for a test target, with the side it must count on.
SUMMARY_LINES = [
    ("//tests:test_a                                      PASSED in 1.2s", "passed"),
    ("//tests:test_b                             (cached) PASSED in 8.0s", "passed"),
    ("//tests:test_c                                      FAILED in 3.4s", "failed"),
    ("//tests:test_d                                      FAILED in 2 out of 3 in 9.1s", "failed"),
    ("//tests:test_e                                      FLAKY, failed in 1 out of 2 in 5.0s", "failed"),
    ("//tests:test_f                                      TIMEOUT in 300.0s", "failed"),
    ("//tests:test_g                                      NO STATUS", "failed"),
    ("//tests:test_h                                      FAILED TO BUILD", "failed"),
    ("//tests:test_i                                      INCOMPLETE", "failed"),
    ("//tests:test_j                                      \x1b[32mPASSED\x1b[0m in 0.9s", "passed"),  # colour
    # tools/check_gpu_wiring.sh, run by .ci/run after the suite
    ("gpu-wiring PASSED: --config=gpu without PPO_OPS_GPU_PYTHON fails naming the variable", "passed"),
    ("gpu-wiring FAILED: GPU targets declared with their tags and GPU counts (bazel query)", "failed"),
    # the lint, run by .ci/run after the wiring checks
    ("lint PASSED: ruff check .", "passed"),
    ("lint FAILED: ruff check . (the findings are above)", "failed"),
]

# Lines around the summary that must not be counted.
NOISE = [
    "INFO: Analyzed 12 targets (40 packages loaded, 900 targets configured).",
    "FAIL: //tests:test_c (see /root/.cache/bazel/.../test.log)",
    "FAILED tests/test_c.py::test_values[odd shape] - AssertionError",
    "Target //tests:test_a up-to-date:",
    "  Stats over 3 runs: max = 9.1s, min = 2.0s, avg = 4.0s, dev = 3.0s",
    "Executed 9 out of 10 tests: 3 tests pass and 7 fail locally.",
]


def _count(tmp_path, lines):
    log = tmp_path / "bazel_test.log"
    log.write_text("\n".join(lines) + "\n")
    result = subprocess.run(["bash", CI_SCRIPT, "--count", str(log)], capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_counts_each_status_on_its_side(tmp_path):
    lines = NOISE[:2] + [line for line, _ in SUMMARY_LINES] + NOISE[2:]
    passed = sum(side == "passed" for _, side in SUMMARY_LINES)
    assert _count(tmp_path, lines) == f"{passed} passed, {len(SUMMARY_LINES) - passed} failed"


@pytest.mark.parametrize("line, side", SUMMARY_LINES)
def test_single_status(tmp_path, line, side):
    expected = "1 passed, 0 failed" if side == "passed" else "0 passed, 1 failed"
    assert _count(tmp_path, [line]) == expected


def test_log_without_a_summary_counts_nothing(tmp_path):
    # e.g. the bootstrap failed before Bazel ran: the exit status carries the failure, the count stays honest.
    assert _count(tmp_path, NOISE) == "0 passed, 0 failed"


def test_rejects_a_missing_log_argument():
    result = subprocess.run(["bash", CI_SCRIPT, "--count"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr
