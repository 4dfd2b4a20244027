"""Entry point of every Bazel test made by tools/pytest.bzl: runs pytest on one test file.

Bazel starts this script under the pinned venv interpreter with the test file's runfiles path as the first argument.
It gives the test a home of its own (HOME and the caches of Triton, Hugging Face, matplotlib under $TEST_TMPDIR, so
nothing depends on or writes to the user's home), moves to the runfiles copy of the workspace (where pytest.ini makes
`ppo_ops`, `sglang_checks` and `tests.*` importable exactly as under plain pytest), and hands the rest to pytest,
with a JUnit report in the file Bazel names so `bazel test` shows the individual test cases.

GPU targets (PPO_OPS_GPUS=N, set by the GPU macros in tools/pytest.bzl) never pass without running: the target fails
at once, naming the interpreter, torch, CUDA and the device count, unless N GPUs are visible; a test that skips
fails the target; and the log starts with the runner environment the GPU toolchain recorded. SGLang-tagged targets
get the SGLang interpreter recorded by --config=sglang as PPO_OPS_SGLANG_PYTHON.
"""

import json
import os
import sys

# Where each tool keeps its cache or config, relative to the test's private temporary directory.
_PRIVATE_DIRS = {
    "HOME": "home",
    "XDG_CACHE_HOME": "cache",
    "XDG_CONFIG_HOME": "config",
    "TRITON_CACHE_DIR": "triton_cache",
    "HF_HOME": "hf_home",
    "MPLCONFIGDIR": "matplotlib",
}


def _private_environment(tmp_dir):
    for var, sub_dir in _PRIVATE_DIRS.items():
        path = os.path.join(tmp_dir, sub_dir)
        os.makedirs(path, exist_ok=True)
        os.environ[var] = path
    # No downloads from the Hugging Face hub inside tests: models are built from configs or local files.
    os.environ["HF_HUB_OFFLINE"] = "1"


def _workspace_root():
    src_dir = os.environ.get("TEST_SRCDIR")
    workspace = os.environ.get("TEST_WORKSPACE")
    if not src_dir or not workspace:
        raise SystemExit("pytest_main.py runs under `bazel test`; outside Bazel use `pytest tests/FILE.py`.")
    return os.path.join(src_dir, workspace)


GPUS_VAR = "PPO_OPS_GPUS"  # tools/pytest.bzl
SGLANG_PYTHON_VAR = "PPO_OPS_SGLANG_PYTHON"
# External repositories' runfiles, relative to the workspace's runfiles folder (--nolegacy_external_runfiles).
GPU_RECORD = "../ppo_gpu_python/runner_env.json"
SGLANG_PYTHON_FILE = "../ppo_sglang_python/sglang_python.txt"


def _runner_description():
    """One line saying what this process runs on: interpreter, torch, its CUDA, visible GPUs."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return (f"interpreter {sys.executable} (Python {sys.version.split()[0]}), torch {torch.__version__}, "
            f"CUDA {torch.version.cuda or 'none (a CPU build)'}, {count} GPU(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")


def _gpu_preflight(required):
    """Fails the target (exit 1) unless `required` GPUs are visible; prints what it runs on either way."""
    description = _runner_description()
    if os.path.exists(GPU_RECORD):
        with open(GPU_RECORD) as f:
            record = json.load(f)
        print(f"[pytest_main] GPU toolchain record: {record.get('interpreter')}: Python {record.get('python')}, "
              f"torch {record.get('torch')} (CUDA {record.get('torch_cuda')}), triton {record.get('triton')}, "
              f"{len(record.get('distributions', {}))} distributions")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < required:
        print(f"[pytest_main] FAIL: this GPU target needs {required} GPU(s); {description}", file=sys.stderr)
        return False
    print(f"[pytest_main] GPU target on {required} GPU(s): {description}")
    return True


class _SkipIsFailure:
    """pytest plugin for GPU targets: a skipped test fails the run (a GPU target never passes by skipping)."""

    def __init__(self):
        self.skipped = []

    def pytest_runtest_logreport(self, report):
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped.append(f"{report.nodeid}: {reason}")

    def pytest_sessionfinish(self, session, exitstatus):
        if self.skipped and exitstatus == 0:
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter):
        if self.skipped:
            terminalreporter.write_line(f"FAILED: {len(self.skipped)} test(s) skipped inside a GPU target:", red=True)
            for line in self.skipped:
                terminalreporter.write_line(f"  {line}", red=True)


def _sglang_interpreter():
    """The SGLang interpreter recorded by --config=sglang (empty without it)."""
    if not os.path.exists(SGLANG_PYTHON_FILE):
        return ""
    with open(SGLANG_PYTHON_FILE) as f:
        return f.read().strip()


def main(argv):
    if len(argv) < 2:
        raise SystemExit("usage: pytest_main.py TEST_FILE [PYTEST_ARGS...]")
    test_file, extra_args = argv[1], argv[2:]
    _private_environment(os.environ["TEST_TMPDIR"])
    root = _workspace_root()
    os.chdir(root)
    # Python put this script's folder first on sys.path, with symlinks resolved: that is tools/ of the source tree,
    # which plain pytest would not have and which would make undeclared files importable.
    script_dirs = {os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.realpath(__file__))}
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") not in script_dirs]

    sglang_python = _sglang_interpreter()
    if sglang_python:
        os.environ[SGLANG_PYTHON_VAR] = sglang_python
    plugins = []
    required_gpus = int(os.environ.get(GPUS_VAR, "0"))
    if required_gpus:
        if not _gpu_preflight(required_gpus):
            return 1
        plugins.append(_SkipIsFailure())

    import pytest  # after the environment is set: plugins may read it at import

    pytest_args = [
        test_file,
        "-c", os.path.join(root, "pytest.ini"),
        "-p", "no:cacheprovider",  # runfiles are read-only; Bazel caches results itself
        "-v",
        "-ra",  # summary line for every test that did not pass, with the skip reason
    ]
    xml_output = os.environ.get("XML_OUTPUT_FILE")
    if xml_output:
        pytest_args.append("--junitxml=" + xml_output)
    # Under `--test_sharding_strategy`, Bazel asks the runner to confirm it shards; pytest does not, so shards
    # are split in tests/conftest.py by TEST_SHARD_INDEX / TEST_TOTAL_SHARDS.
    shard_status = os.environ.get("TEST_SHARD_STATUS_FILE")
    if shard_status:
        open(shard_status, "w").close()
    return pytest.main(pytest_args + extra_args, plugins=plugins)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
