"""The build's own test: every tests/test_*.py file has a Bazel test target, so CI runs it.

tests/BUILD ends with `undeclared_tests_check` (tools/pytest.bzl), which compares the package's test_*.py files
with its py_test targets at loading time and hands the difference to this test in PPO_OPS_UNDECLARED_TEST_FILES.
"""

import os

import pytest

UNDECLARED_VAR = "PPO_OPS_UNDECLARED_TEST_FILES"


@pytest.mark.skipif(UNDECLARED_VAR not in os.environ,
                    reason="needs `bazel test //tests:test_build_declarations`: "
                           "the list comes from Bazel's loading phase")
def test_every_test_file_has_a_target():
    undeclared = os.environ[UNDECLARED_VAR].split()
    assert not undeclared, (f"test files without a target in tests/BUILD: {undeclared}; declare each with "
                            "cpu_pytest or gpu_pytest (tools/pytest.bzl)")
