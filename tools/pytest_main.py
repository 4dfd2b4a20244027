"""Entry point of every Bazel test made by tools/pytest.bzl: runs pytest on one test file.

Bazel starts this script under the pinned venv interpreter with the test file's runfiles path as the first argument.
It gives the test a home of its own (HOME and the caches of Triton, Hugging Face, matplotlib under $TEST_TMPDIR, so
nothing depends on or writes to the user's home), moves to the runfiles copy of the workspace (where pytest.ini makes
`ppo_ops`, `sglang_checks` and `tests.*` importable exactly as under plain pytest), and hands the rest to pytest,
with a JUnit report in the file Bazel names so `bazel test` shows the individual test cases.
"""

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
    return pytest.main(pytest_args + extra_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
