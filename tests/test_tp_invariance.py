"""Bitwise tensor-parallel invariance at TP = 1, 2, 4 and 8, through the public API.

The same GLOBAL logits (V_global = 8 * 40, so the vocabulary splits into the eight fixed segments of
ppo_ops/core/layout.py) go through `ppo_ops.log_probs_and_entropy` at TP = 1 (no process group) and on 2, 4 and 8
spawned ranks, each rank holding its contiguous vocabulary shard: gloo on CPU (the CPU target), NCCL with one GPU per
rank on CUDA (the `_gpu` targets: TP = 2 on two GPUs, TP = 4 and 8 in `_gpu4` / `_gpu8` on hosts with that many), and
on CUDA also every rank on one GPU over gloo (so a one-GPU runner checks the compiled kernels at TP > 1). For
each backend ("torch" and "triton", the latter under TRITON_INTERPRET=1 on CPU, compiled on CUDA) and each case, the
log-probs and entropy of every rank and the concatenated gradient shards must equal the TP=1 result bit for bit
(`torch.equal`). The TP=1 result is also held to the float64 reference, so the bits compared are right ones.

Why it holds: each rank computes per-row partials of the fixed segments it holds, with code that does not depend on
which rank holds them or how many ranks there are; one all-gather brings every segment to every rank, which merges them
in global segment order; the backward is element-wise given the merged row stats (ppo_ops/core/row_stats.py).

On CUDA two cases run at Qwen3's real vocabulary (151936 columns, 267 of them padding) in bf16 and fp32. The cases mix
the options that touch the partials or the gradient: dtypes, temperature, keep mask, row mask, padded
vocabulary (the last rank at TP=8 holds padding), -inf logits, chunking, inplace_grad, entropy modes. All cases and
both backends run in one spawn per TP size (14 processes in all on the CI's 2 cores), each rank saving its results.
"""


import pytest
import torch

import ppo_ops
from tests.core_support import BACKENDS, backend_params, triton_skip_reason
from tests.ranks import DEVICE, results_by_tp, world_size_param
from tests.reference import (assert_entropy_close, assert_grad_close, assert_log_probs_close,
                             reference_log_probs_and_entropy, shard_vocab)
from tests.sharded_case import ShardedCase, global_inputs

TP_SIZES = (1, 2, 4, 8)
V_GLOBAL = 320  # eight segments of 40; V_local = 40 at TP=8: neither a power of two nor a multiple of 16
QWEN3_VOCAB = 151936  # Qwen3's LM head: eight segments of 18992
QWEN3_PADDING = 151936 - 151669  # columns past Qwen3's 151669 tokens


CASES = [
    ShardedCase("fp32_all_masks", (5,), V_GLOBAL, temperature=0.7, keep="random", rows="random", padding=7,
                neg_inf=True, chunk_size=2, scale=3.0),
    ShardedCase("bf16_inplace_rows", (2, 3), V_GLOBAL, torch.bfloat16, temperature=1.3, keep="random",
                rows="random", inplace_grad=True, scale=3.0, seed=10),
    # padding 45: at TP=8 the last rank holds only padding, the one before it some.
    ShardedCase("fp16_entropy_value", (4,), V_GLOBAL, torch.float16, entropy="value", padding=45, scale=3.0,
                seed=20),
]
if DEVICE.type == "cuda":
    # Qwen3's vocabulary at real size, compiled: bf16 and fp32 logits, temperature, -inf columns, row mask and the
    # padding of Qwen3's LM head (151936 columns for 151669 tokens), so each of TP = 2, 4, 8 cuts through real data.
    CASES += [
        ShardedCase("qwen3_bf16", (24,), QWEN3_VOCAB, torch.bfloat16, temperature=0.7, rows="random",
                    padding=QWEN3_PADDING, neg_inf=True, scale=3.0, seed=30),
        ShardedCase("qwen3_fp32_keep", (16,), QWEN3_VOCAB, temperature=1.3, keep="random", padding=QWEN3_PADDING,
                    scale=3.0, seed=40),
    ]


def _global_inputs(case):
    """The case's GLOBAL inputs (its v_local is V_GLOBAL: one rank's view), the same on every process."""
    return global_inputs(case, 1)


def _run(case, backend, rank, world_size, tp_group, device):
    """Forward + backward on this rank's shard, on `device`: (log_probs, entropy or None, gradient shard), on CPU."""
    logits, tokens, opts, weights = _global_inputs(case)
    if "keep_mask" in opts:
        opts["keep_mask"] = shard_vocab(opts["keep_mask"], rank, world_size)
    opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    weights = {k: v.to(device) for k, v in weights.items()}
    tokens = tokens.to(device)
    x = shard_vocab(logits, rank, world_size).to(device).requires_grad_(True)
    # inplace_grad needs a non-leaf input (as lm-head logits are): its storage receives the gradient.
    y = x * 1 if case.inplace_grad else x
    out = ppo_ops.log_probs_and_entropy(y, tokens, tp_group=tp_group, backend=backend,
                                        inplace_grad=case.inplace_grad, **opts)
    outputs, grads = [out.log_probs], [weights["grad_log_probs"]]
    if case.entropy == "grad":
        outputs.append(out.entropy)
        grads.append(weights["grad_entropy"])
    (grad,) = torch.autograd.grad(outputs, y, grads)
    entropy = None if out.entropy is None else out.entropy.detach().cpu()
    return out.log_probs.detach().cpu(), entropy, grad.detach().cpu()


def _all_results(rank, world_size, tp_group, device):
    return {(backend, case.name): _run(case, backend, rank, world_size, tp_group, device)
            for backend in _runnable_backends() for case in CASES}


def _runnable_backends():
    return [b for b in BACKENDS if b == "torch" or triton_skip_reason(DEVICE) is None]


@pytest.fixture(scope="module", name="results_by_tp")
def results_by_tp_fixture(tmp_path_factory):
    """tp -> [per-rank {(backend, case): (log_probs, entropy, grad shard)}] (tests/ranks.py)."""
    return results_by_tp(str(tmp_path_factory.mktemp("tp_invariance")), _all_results)


# The TP = 8 cases and the others each under a fixture of their own: a sharded CPU target then runs the spawn of 8
# ranks in one shard and those of 2 and 4 ranks in another (tests/conftest.py keeps a fixture's cases together), not
# every spawn in every shard.
@pytest.fixture(scope="module")
def results_up_to_tp4(results_by_tp):
    return results_by_tp


@pytest.fixture(scope="module")
def results_at_tp8(results_by_tp):
    return results_by_tp


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_tp1_matches_float64_reference(results_up_to_tp4, backend, case):
    logits, tokens, opts, weights = _global_inputs(case)
    ref = reference_log_probs_and_entropy(
        logits, tokens, grad_log_probs=weights["grad_log_probs"],
        grad_entropy=weights["grad_entropy"] if case.entropy == "grad" else None, **opts)
    log_probs, entropy, grad = results_up_to_tp4(1)[0][(backend, case.name)]
    assert_log_probs_close(log_probs, ref.log_probs)
    if case.entropy != "none":
        assert_entropy_close(entropy, ref.entropy)
    assert_grad_close(grad, ref.grad, case.dtype)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("tp", [world_size_param(tp) for tp in TP_SIZES[1:-1]])
@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_bitwise_identical_to_tp1(results_up_to_tp4, backend, tp, case):
    _assert_bitwise_tp1(results_up_to_tp4, backend, tp, case)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("tp", [world_size_param(TP_SIZES[-1])])
@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_bitwise_identical_to_tp1_at_tp8(results_at_tp8, backend, tp, case):
    _assert_bitwise_tp1(results_at_tp8, backend, tp, case)


@pytest.fixture(scope="module")
def results_on_one_gpu(tmp_path_factory):
    """As results_by_tp, the ranks of TP > 1 all on the one GPU over gloo (tests/ranks.py, one_gpu)."""
    return results_by_tp(str(tmp_path_factory.mktemp("tp_invariance_one_gpu")), _all_results, one_gpu=True)


@pytest.mark.device("cuda")
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("tp", TP_SIZES[1:])
@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_bitwise_identical_to_tp1_on_one_gpu(results_on_one_gpu, backend, tp, case):
    """The compiled kernels at TP = 2, 4 and 8 on a one-GPU runner: every rank on the GPU, gloo between them."""
    _assert_bitwise_tp1(results_on_one_gpu, backend, tp, case)


def _assert_bitwise_tp1(results, backend, tp, case):
    key = (backend, case.name)
    log_probs, entropy, grad = results(1)[0][key]
    ranks = [per_rank[key] for per_rank in results(tp)]
    for rank, (lp, ent, _) in enumerate(ranks):
        assert torch.equal(lp, log_probs), f"TP={tp} rank {rank}: log_probs differ bitwise from TP=1"
        if entropy is not None:
            assert torch.equal(ent, entropy), f"TP={tp} rank {rank}: entropy differs bitwise from TP=1"
    shards = torch.cat([g for _, _, g in ranks], dim=-1)
    assert torch.equal(shards, grad), f"TP={tp}: concatenated gradient shards differ bitwise from TP=1"

