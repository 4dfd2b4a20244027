"""Vocab-parallel ppo_ops.log_probs_and_entropy on 2 and 4 spawned ranks, both backends: gloo on CPU (the CPU target),
NCCL with one GPU per rank on CUDA (the `_gpu` target on two GPUs; 4 ranks in `_gpu4`).

Every rank builds the same GLOBAL inputs from seeds, keeps its vocabulary shard, runs forward and backward, and
checks (tests/sharded_case.py):
- log-probs and entropy (replicated on every rank) against the float64 reference on the global logits;
- its gradient shard against the matching slice of the reference gradient;
- where V_global % 8 == 0 (the fixed-segment layout), bitwise equality with the same call at TP=1 (run once in the
  parent process, no process group): values, and the gradient shard against the slice of the TP=1 gradient.

CASES is a compact matrix: each case turns several options on at once (dtypes, keep masks dropping targets,
temperatures, row masks, padding that covers a whole rank, -inf logits, leading dimensions, chunk sizes, entropy
modes, inplace_grad, empty input, every row masked; tp_group=None inside a job is tested in
test_core_reliability.py); the slime-compatible API has its own check.
All cases of both backends run in one spawn per world size; a rank collects its failures and each (world size,
backend) test reports its own. Row counts stay small: the Triton interpreter runs one program per (row, segment), and
4 ranks share the CI's 2 cores.
"""

import os

import pytest
import torch
import torch.distributed as dist

import ppo_ops
from tests.core_support import CaseFailures, backend_params, run_op, triton_skip_reason
from tests.ranks import DEVICE, rank_device, run_ranks, world_size_param
from tests.reference import shard_vocab
from tests.sharded_case import ShardedCase, check_rank, global_inputs, has_fixed_segments, tp1_result

CASES = [
    ShardedCase("fp32_keep_rows", (6,), 96, temperature=0.7, keep="random", rows="random"),
    # padding = v_local + 5: the last rank holds only padding, the one before it some.
    ShardedCase("bf16_value_padded_chunked", (5,), 96, torch.bfloat16, entropy="value", temperature=1.3,
                padding=96 + 5, chunk_size=3),
    ShardedCase("fp16_neg_inf_keep_rows", (5,), 64, torch.float16, entropy="none", keep="random", rows="random",
                neg_inf=True, chunk_size=-1),
    ShardedCase("leading_dims_everything", (2, 3), 40, temperature=1.3, keep="random", rows="random", padding=7,
                chunk_size=2),
    ShardedCase("odd_vocab_per_rank_segments", (7,), 37, temperature=0.7, keep="random"),  # V_global % 8 != 0
    ShardedCase("bf16_inplace_grad", (4,), 64, torch.bfloat16, keep="random", inplace_grad=True),
    ShardedCase("keep_only_targets", (4,), 32, keep="target_only"),  # every log-prob is exactly 0
    ShardedCase("rows_only", (4,), 48, rows="random"),
    ShardedCase("empty_input", (0,), 32, keep="random"),
    ShardedCase("every_row_masked", (3,), 32, rows="none"),
]


def _check_calculate_api(rank, world_size):
    """slime's signature at TP > 1: same values and gradient as log_probs_and_entropy, [T, 1] log-probs."""
    case = ShardedCase("calculate_api", (6,), 48, keep="random", chunk_size=2)
    logits, tokens, opts, weights = global_inputs(case, world_size)
    device = rank_device(rank)
    x = shard_vocab(logits, rank, world_size).to(device)
    keep = shard_vocab(opts["keep_mask"], rank, world_size).to(device)
    weights = {k: v.to(device) for k, v in weights.items()}
    x_slime = x.clone().requires_grad_(True)
    log_prob, entropy = ppo_ops.calculate_log_probs_and_entropy(
        x_slime, tokens.to(device), dist.group.WORLD, with_entropy=True, chunk_size=2, log_prob_keep_mask=keep)
    assert log_prob.shape == (6, 1) and entropy.shape == (6,) and entropy.requires_grad
    (g_slime,) = torch.autograd.grad([log_prob, entropy], x_slime,
                                     [weights["grad_log_probs"][:, None], weights["grad_entropy"]])
    new = run_op(x, tokens, device=device, tp_group=dist.group.WORLD, entropy="grad", keep_mask=keep, chunk_size=2,
                 **weights)
    assert torch.equal(log_prob[:, 0].detach(), new.log_probs) and torch.equal(entropy.detach(), new.entropy)
    assert torch.equal(g_slime, new.grad)


def _parallel_worker(rank, world_size, tp1_by_backend, out_dir):
    """Every case of each backend on this rank; its failures by backend, saved as rank{rank}.pt."""
    failures = {}
    for backend, tp1_results in tp1_by_backend.items():
        found = CaseFailures(rank)
        for case in CASES:
            found.run(case.name, check_rank, case, rank, world_size, backend, tp1_results.get(case.name))
        if backend == ("triton" if DEVICE.type == "cuda" else "torch"):  # the slime API's "auto" backend here
            found.run("calculate_api", _check_calculate_api, rank, world_size)
        failures[backend] = [f"{backend}: {item}" for item in found.items]
    torch.save(failures, os.path.join(out_dir, f"rank{rank}.pt"))


def _runnable_backends():
    return ["torch"] + (["triton"] if triton_skip_reason(DEVICE) is None else [])


@pytest.fixture(scope="module")
def rank_failures(tmp_path_factory):
    """world_size -> [per rank {backend: failures}]: one spawn per world size runs both backends' cases (a spawn's
    imports cost about as much as a backend's cases), the first time a test asks for that world size."""
    cache = {}

    def failures(world_size):
        if world_size not in cache:
            out_dir = tmp_path_factory.mktemp(f"tp{world_size}")
            tp1 = {backend: {case.name: tp1_result(case, world_size, backend) for case in CASES
                             if has_fixed_segments(case, world_size)}
                   for backend in _runnable_backends()}
            run_ranks(world_size, _parallel_worker, tp1, str(out_dir))
            cache[world_size] = [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(world_size)]
        return cache[world_size]

    return failures


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("world_size", [world_size_param(2), world_size_param(4)])
def test_vocab_parallel_matches_reference(rank_failures, world_size, backend):
    failures = [item for per_rank in rank_failures(world_size) for item in per_rank[backend]]
    assert not failures, "\n".join(failures)
