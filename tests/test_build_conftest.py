"""The build's own test: what tests/conftest.py gives every test file, under Bazel and plain pytest alike.

Runs small pytest sessions (pytester) with a copy of tests/conftest.py and none of the variables it reads, so each
check sees what a fresh plain-pytest run would. The sessions run in this process (a pytest session is milliseconds,
a fresh interpreter importing torch seconds), except the one that checks the environment a new process is given.
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
    for var in ("TRITON_INTERPRET", "TORCHINDUCTOR_COMPILE_THREADS", "TEST_TOTAL_SHARDS", "TEST_SHARD_INDEX",
                "PPO_OPS_GPUS", "PPO_OPS_RANKS_ABOVE"):
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
            assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
            assert os.environ["TORCHDYNAMO_DISABLE"] == "1"
    """)
    # A fresh process: the defaults as a new plain-pytest run gets them, not this process's environment.
    session.runpytest_subprocess("test_cpu.py", "-p", "no:cacheprovider").assert_outcomes(passed=1)


_RANKS_FILE = """
    import pytest
    @pytest.mark.parametrize("n", [pytest.param(n, marks=pytest.mark.world_size(n)) for n in (1, 2, 4, 8)])
    def test_ranks(n):
        pass
"""


@pytest.mark.parametrize("gpus, above, ran", [
    ("2", None, {"1", "2"}),  # the _gpu target on two GPUs: what two ranks hold
    ("4", "2", {"4"}),  # its _gpu4 target: only what needs more than two
    ("8", "4", {"8"}),
])
def test_a_gpu_target_runs_exactly_the_cases_its_gpus_hold(session, monkeypatch, gpus, above, ran):
    monkeypatch.setenv("PPO_OPS_GPUS", gpus)
    if above:
        monkeypatch.setenv("PPO_OPS_RANKS_ABOVE", above)
    session.makepyfile(test_ranks=_RANKS_FILE)
    result = session.runpytest_inprocess("test_ranks.py", "-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=len(ran), deselected=4 - len(ran))
    assert {line.split("[")[1].split("]")[0] for line in result.outlines if "PASSED" in line} == ran
    assert any("deselected: this target declares" in line for line in result.outlines)


def test_cpu_targets_run_every_rank_count_over_gloo(session):
    session.makepyfile(test_ranks=_RANKS_FILE)
    session.runpytest_inprocess("test_ranks.py", "-p", "no:cacheprovider").assert_outcomes(passed=4)


def test_device_marked_cases_run_only_on_their_device(session):
    # No GPU here: the CPU-marked and unmarked cases run, the CUDA-marked one is deselected (not skipped).
    session.makepyfile(test_devices="""
        import pytest
        @pytest.mark.device("cpu")
        def test_cpu(): pass
        @pytest.mark.device("cuda")
        def test_cuda(): pass
        @pytest.mark.device("any")
        def test_any(): pass
        def test_unmarked(): pass
    """)
    result = session.runpytest_inprocess("test_devices.py", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, deselected=1)
    assert any("written for CUDA" in line for line in result.outlines)


def test_shards_split_the_tests_without_overlap(session):
    session.makepyfile(test_many="\n".join(f"def test_{i}(): pass" for i in range(SHARDED_TESTS)))
    ran = []
    for index in range(2):
        os.environ.update(TEST_TOTAL_SHARDS="2", TEST_SHARD_INDEX=str(index))  # undone by the fixture's monkeypatch
        result = session.runpytest_inprocess("test_many.py", "-p", "no:cacheprovider", "-v")
        ran.append({line.split("::")[1].split()[0] for line in result.outlines
                    if "::test_" in line and "PASSED" in line})
    assert ran[0].isdisjoint(ran[1])
    assert ran[0] | ran[1] == {f"test_{i}" for i in range(SHARDED_TESTS)}
    assert {len(ran[0]), len(ran[1])} == {2, 3}
