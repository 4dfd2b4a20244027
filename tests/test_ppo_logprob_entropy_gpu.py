"""Parity of the fused core with the legacy reference on NVIDIA GPUs: TP=1 on one GPU, TP=2 over NCCL on two.

The same 12 scenarios x 2 vocab sizes, inputs, tolerances and comparisons as the CPU file (tests/parity_common.py).
On CUDA the core takes its Triton backend ("auto"); the legacy runs Megatron's fused CE (eager: TORCHDYNAMO_DISABLE=1,
set by the Bazel macro, tests/conftest.py and tools/run_parity_gpu.sh) and at TP=1 a private single-rank NCCL group.
The TP=2 cases run inside ONE spawned NCCL group (ranks on cuda:0 and cuda:1), each case reported as its own test.

Skips: every test without CUDA ("needs CUDA"); the TP=2 tests where fewer than two GPUs are visible ("needs 2 GPUs").
Run it on its own (`pytest tests/test_ppo_logprob_entropy_gpu.py`): CPU files in the same run set TRITON_INTERPRET=1.
"""

import pytest
import torch

from tests import parity_common
from tests.parity_common import PARITY_SCENARIOS, PARITY_VOCABS, _assert_legacy_parity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
_NEEDS_2_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs" if torch.cuda.is_available() else "needs CUDA"
)

_CASES = [
    pytest.param(vocab, scenario, id=parity_common.case_id(vocab, scenario))
    for vocab in PARITY_VOCABS
    for scenario in PARITY_SCENARIOS
]


@pytest.mark.parametrize("vocab, scenario", _CASES)
def test_parity_tp1_cuda(vocab, scenario):
    _assert_legacy_parity(scenario, parity_common.make_parity_inputs(torch.device("cuda", 0), vocab))


@pytest.fixture(scope="module")
def tp2_nccl_results(tmp_path_factory):
    """Every case on two NCCL ranks (cuda:0, cuda:1), in one spawned group; per rank {case id: failure or None}."""
    result_dir = str(tmp_path_factory.mktemp("parity_tp2_nccl"))
    return parity_common.spawn_tp_group(parity_common.parity_worker, 2, "nccl", result_dir, "cuda")


@_NEEDS_2_GPUS
@pytest.mark.parametrize("vocab, scenario", _CASES)
def test_parity_tp2_nccl(vocab, scenario, tp2_nccl_results):
    failures = parity_common.case_failures(tp2_nccl_results, vocab, scenario)
    assert not failures, f"TP=2 NCCL parity failed for {parity_common.case_id(vocab, scenario)}:\n{failures}"
