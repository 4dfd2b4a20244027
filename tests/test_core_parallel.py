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
All cases run in one spawn per world size and backend; a rank collects its failures and reports them together at
the end. Row counts stay small: the Triton interpreter runs one program per (row, segment), and 4 ranks share the
CI's 2 cores.
"""

import pytest
import torch
import torch.distributed as dist

import ppo_ops
from tests.core_support import CaseFailures, backend_params, run_op
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


def _parallel_worker(rank, world_size, backend, tp1_results):
    failures = CaseFailures(rank)
    for case in CASES:
        failures.run(case.name, check_rank, case, rank, world_size, backend, tp1_results.get(case.name))
    if backend == ("triton" if DEVICE.type == "cuda" else "torch"):  # the slime API's "auto" backend on this device
        failures.run("calculate_api", _check_calculate_api, rank, world_size)
    failures.raise_if_any()


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("world_size", [world_size_param(2), world_size_param(4)])
def test_vocab_parallel_matches_reference(world_size, backend):
    tp1 = {case.name: tp1_result(case, world_size, backend) for case in CASES if has_fixed_segments(case, world_size)}
    run_ranks(world_size, _parallel_worker, backend, tp1)
