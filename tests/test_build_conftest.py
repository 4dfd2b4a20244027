"""The build's own test: what tests/conftest.py gives every test file, under Bazel and plain pytest alike.

Runs small pytest sessions in a subprocess (pytester) with a copy of tests/conftest.py, so each check sees the
environment a fresh plain-pytest run would.
"""

import os
import pathlib
import random

import pytest
import torch

from tests.conftest import base_seed

pytest_plugins = ["pytester"]

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")
SHARDED_TESTS = 5  # odd, so the two shards differ in size


@pytest.fixture
def session(pytester, monkeypatch):
    """A pytester folder with our conftest and none of the Bazel test environment that would mask its defaults."""
    for var in ("TRITON_INTERPRET", "TEST_TOTAL_SHARDS", "TEST_SHARD_INDEX"):
        monkeypatch.delenv(var, raising=False)
    pytester.makeconftest(CONFTEST.read_text())
    return pytester


def test_each_test_starts_from_the_fixed_seed():
    drawn = (random.random(), torch.rand(3))
    random.seed(base_seed())
    torch.manual_seed(base_seed())
    assert drawn[0] == random.random()
    assert torch.equal(drawn[1], torch.rand(3))


def test_cpu_files_get_the_triton_interpreter(session):
    session.makepyfile(test_cpu="""
        import os
        def test_env():
            assert os.environ["TRITON_INTERPRET"] == "1"
            assert os.environ["TORCHDYNAMO_DISABLE"] == "1"
    """)
    session.runpytest_subprocess("test_cpu.py", "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_gpu_files_get_compiled_triton(session):
    session.makepyfile(test_kernels_gpu="""
        import os
        def test_env():
            assert "TRITON_INTERPRET" not in os.environ
    """)
    session.runpytest_subprocess("test_kernels_gpu.py", "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_shards_split_the_tests_without_overlap(session):
    session.makepyfile(test_many="\n".join(f"def test_{i}(): pass" for i in range(SHARDED_TESTS)))
    ran = []
    for index in range(2):
        os.environ.update(TEST_TOTAL_SHARDS="2", TEST_SHARD_INDEX=str(index))  # undone by the fixture's monkeypatch
        result = session.runpytest_subprocess("test_many.py", "-p", "no:cacheprovider", "-v")
        ran.append({line.split("::")[1].split()[0] for line in result.outlines if "::test_" in line and "PASSED" in line})
    assert ran[0].isdisjoint(ran[1])
    assert ran[0] | ran[1] == {f"test_{i}" for i in range(SHARDED_TESTS)}
    assert {len(ran[0]), len(ran[1])} == {2, 3}
