"""The build's own test: tools/runner_env.py, the probe behind `--config=gpu` and `--config=sglang`.

The repository rules of tools/runner_toolchains.bzl fail the build with the reasons this module finds; CI proves the
whole chain without a GPU (tools/check_gpu_wiring.sh). Here the reasons themselves are checked on made-up probes.
"""

import json
import subprocess
import sys

import pytest

from tools import runner_env

CUDA_PROBE = {
    "interpreter": "/opt/torch/.venv/bin/python3",
    "python": "3.12.3",
    "torch": "2.11.0",
    "torch_cuda": "13.0",
    "triton": "3.6.0",
    "distributions": {"torch": "2.11.0", "triton": "3.6.0", "numpy": "2.5.2", "megatron-core": "0.16.1"},
    "sglang": "0.5.17",
    "sglang_kernel": "0.4.5",
}
PINS = {"python": "3.12.3", "torch": "2.11.0", "triton": "3.6.0", "numpy": "2.5.2", "megatron-core": "0.16.1"}


def test_a_matching_cuda_interpreter_has_no_problem():
    assert runner_env.problems_gpu(CUDA_PROBE, PINS) == []
    assert runner_env.problems_sglang(CUDA_PROBE) == []


def test_a_cpu_torch_is_named():
    probe = dict(CUDA_PROBE, torch="2.13.0+cpu", torch_cuda=None)
    assert any("its torch 2.13.0+cpu has no CUDA" in p for p in runner_env.problems_gpu(probe, {}))
    assert any("has no CUDA" in p for p in runner_env.problems_sglang(probe))


@pytest.mark.parametrize("name, actual, message", [
    ("numpy", "2.4.6", "numpy is 2.4.6, requirements_gpu.lock pins 2.5.2"),
    ("megatron-core", None, "megatron-core is not installed, requirements_gpu.lock pins 0.16.1"),
])
def test_each_version_that_differs_from_the_lock_is_named(name, actual, message):
    dists = dict(CUDA_PROBE["distributions"])
    if actual is None:
        del dists[name]
    else:
        dists[name] = actual
    assert runner_env.problems_gpu(dict(CUDA_PROBE, distributions=dists), PINS) == [message]


def test_the_python_version_is_pinned_too():
    assert runner_env.problems_gpu(dict(CUDA_PROBE, python="3.11.7"), PINS) == [
        "python is 3.11.7, requirements_gpu.lock pins 3.12.3"]


def test_missing_sglang_pieces_are_named():
    probe = dict(CUDA_PROBE, sglang=None, sglang_kernel=None)
    assert runner_env.problems_sglang(probe) == ["sglang is not installed",
                                                 "sglang-kernel (sgl_kernel) is not installed"]


def test_freeze_writes_a_lock_that_read_lock_reads_back(tmp_path):
    lock = tmp_path / "requirements_gpu.lock"
    lock.write_text(runner_env.freeze())
    pins = runner_env.read_lock(lock)
    assert pins["python"] == ".".join(map(str, sys.version_info[:3]))
    assert set(pins) - {"python"} <= {runner_env.normalize(n) for n in runner_env.GPU_PINNED}


def test_check_records_the_probe_and_fails_on_a_cpu_interpreter(tmp_path):
    # This interpreter (the CPU venv) is what CI hands --config=gpu to prove it fails.
    record = tmp_path / "runner_env.json"
    done = subprocess.run([sys.executable, "tools/runner_env.py", "check", "gpu", "requirements_gpu.lock",
                           str(record)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "has no CUDA" in done.stderr
    recorded = json.loads(record.read_text())
    assert recorded["interpreter"] == sys.executable and recorded["distributions"]
