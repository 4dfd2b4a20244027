"""reduction_order="sglang": SGLang's batch-invariant log_softmax order (ppo_ops/logits/sglang_order.py).

- The order itself: the torch backend equals, bit for bit, a scalar loop written from the order's statement (each
  thread's 8 values in column order, the lane butterfly, (w0 + w2) + (w1 + w3), the blocks added from 0), for
  vocabularies of each load width (4, 2, 1) and a partial last block.
- Values and gradients against float64, both backends (Triton interpreted on CPU, compiled on a GPU).
- TP = 1, 2, 4 bit for bit (gloo on CPU, NCCL in the GPU targets), the vocabulary cut inside blocks, with padding,
  temperature and a row mask; and the module's steps run by hand for two shards in one process, which is how the GPU
  test covers TP = 2 on one GPU (NCCL needs a GPU per rank).
- Refusals: keep_mask, shards under 1024 columns, an unknown order, ranks that disagree on the order.
- Against SGLang's own kernel: tests/test_sglang_kernels.py (the SGLang runner configuration).
"""

import pytest
import torch

import ppo_ops
from ppo_ops.logits import sglang_order as order
from tests.core_support import backend_params, compile_check_report, make_logits, make_row_mask, make_tokens
from tests.ranks import DEVICE, results_by_tp, run_gloo, world_size_param
from tests.sglang_kernels_check import steps_by_hand
from tests.reference import (assert_entropy_close, assert_grad_close, assert_log_probs_close,
                             reference_log_probs_and_entropy, shard_vocab)

TP_SIZES = (1, 2, 4)
V_TP = 6144  # TP = 4: shards of 1536, so two of the three boundaries fall inside a block
PADDED_VOCAB = 6000  # the last rank's shard ends in padding


def _loop_log_probs(z_rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The order written out one scalar addition at a time (fp32 torch scalars), from the module docstring."""
    out = []
    for z, t in zip(z_rows, tokens.tolist()):
        vocab, width = z.numel(), order.vector_width(z.numel())
        m = z.max()
        e = torch.exp(z - m)
        total = torch.zeros((), dtype=torch.float32)
        for b in range((vocab + order.BLOCK - 1) // order.BLOCK):
            chains = []
            for thread in range(order.THREADS):
                acc = None
                for q in range(order.CHAIN):
                    col = b * order.BLOCK + (q // width) * (order.THREADS * width) + thread * width + q % width
                    value = e[col] if col < vocab else torch.zeros((), dtype=torch.float32)
                    acc = value if acc is None else acc + value
                chains.append(acc)
            warps = []
            for w in range(order.WARPS):
                lanes = chains[32 * w:32 * (w + 1)]
                while len(lanes) > 1:
                    half = len(lanes) // 2
                    lanes = [lanes[i] + lanes[i + half] for i in range(half)]
                warps.append(lanes[0])
            total = total + ((warps[0] + warps[2]) + (warps[1] + warps[3]))
        out.append((z[t] - m) - torch.log(total))
    return torch.stack(out)


@pytest.mark.parametrize("vocab", [
    3000,  # 4-wide loads, a partial third block
    3002,  # 2-wide loads
    3001,  # 1-wide loads
    1000,  # one partial block
])
def test_torch_backend_adds_in_the_stated_order(vocab):
    logits = make_logits((3, vocab), torch.bfloat16, seed=vocab, scale=4.0)
    tokens = make_tokens((3,), vocab, seed=vocab + 1)
    out = ppo_ops.log_probs_and_entropy(logits, tokens, backend="torch", reduction_order="sglang")
    assert torch.equal(out.log_probs, _loop_log_probs(logits.float(), tokens))


def _case(vocab, rows=6, dtype=torch.bfloat16, seed=0):
    logits = make_logits((rows, vocab), dtype, seed=seed, scale=4.0)
    logits[0, ::7] = float("-inf")  # -inf columns: no mass, and no 0 * -inf in the entropy sums
    tokens = make_tokens((rows,), vocab, seed=seed + 1)
    return logits, tokens


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_and_gradients_match_float64(backend, dtype):
    logits, tokens = _case(V_TP, dtype=dtype)
    row_mask = make_row_mask((6,), seed=5)
    opts = dict(entropy="grad", temperature=0.7, row_mask=row_mask, vocab_size=PADDED_VOCAB)
    gen = torch.Generator().manual_seed(9)
    w_lp, w_ent = torch.rand(6, generator=gen), torch.rand(6, generator=gen)
    x = logits.to(DEVICE).requires_grad_(True)
    out = ppo_ops.log_probs_and_entropy(x, tokens.to(DEVICE), backend=backend, reduction_order="sglang",
                                        **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                                           for k, v in opts.items()})
    (grad,) = torch.autograd.grad([out.log_probs, out.entropy], x, [w_lp.to(DEVICE), w_ent.to(DEVICE)])
    # The reference scores what the op scores at T != 1: the logits divided as SGLang's sampler divides them,
    # bf16(bf16(logits) / T), at temperature 1, the gradient carrying 1 / T.
    divided = logits.to(torch.bfloat16).float().div(torch.full((1,), opts["temperature"])).to(torch.bfloat16)
    ref = reference_log_probs_and_entropy(divided, tokens, grad_log_probs=w_lp, grad_entropy=w_ent,
                                          **dict(opts, temperature=1.0))
    assert_log_probs_close(out.log_probs, ref.log_probs)
    assert_entropy_close(out.entropy, ref.entropy)
    # The gradient is taken with respect to the bf16 quotients: bf16 values in the logits' dtype.
    assert grad.dtype == dtype
    assert_grad_close(grad.to(torch.bfloat16), ref.grad / opts["temperature"], torch.bfloat16)


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("vocab", [
    3000,  # 4-wide loads: the kernel's [128, 4] tiles
    3002,  # 2-wide
    3001,  # 1-wide
])
def test_every_load_width_matches_float64(backend, vocab):
    logits, tokens = _case(vocab)
    out = ppo_ops.log_probs_and_entropy(logits.to(DEVICE), tokens.to(DEVICE), entropy="value", backend=backend,
                                        reduction_order="sglang")
    ref = reference_log_probs_and_entropy(logits, tokens, entropy="value")
    assert_log_probs_close(out.log_probs, ref.log_probs)
    assert_entropy_close(out.entropy, ref.entropy)


def _tp_run(rank, world_size, tp_group, device):
    logits, tokens = _case(V_TP)
    row_mask = make_row_mask((6,), seed=5)
    out = {}
    for backend in ("torch", "triton"):
        if backend == "triton" and not _triton_runs(device):
            continue
        x = shard_vocab(logits, rank, world_size).to(device).requires_grad_(True)
        res = ppo_ops.log_probs_and_entropy(x, tokens.to(device), tp_group=tp_group, entropy="grad",
                                            temperature=0.7, row_mask=row_mask.to(device),
                                            vocab_size=PADDED_VOCAB, backend=backend, reduction_order="sglang")
        (grad,) = torch.autograd.grad([res.log_probs, res.entropy], x,
                                      [torch.ones(6, device=device), torch.full((6,), 0.5, device=device)])
        out[backend] = (res.log_probs.detach().cpu(), res.entropy.detach().cpu(), grad.cpu())
    return out


def _triton_runs(device) -> bool:
    from tests.core_support import triton_skip_reason
    return triton_skip_reason(device) is None


@pytest.fixture(scope="module", name="tp_results")
def tp_results_fixture(tmp_path_factory):
    return results_by_tp(str(tmp_path_factory.mktemp("sglang_order")), _tp_run)


@pytest.mark.parametrize("tp", [world_size_param(tp) for tp in TP_SIZES[1:]])
def test_bitwise_identical_across_tp_sizes(tp_results, tp):
    base = tp_results(1)[0]
    for rank, per_rank in enumerate(tp_results(tp)):
        for backend, (lp, ent, _) in per_rank.items():
            assert torch.equal(lp, base[backend][0]), f"{backend} TP={tp} rank {rank}: log_probs differ from TP=1"
            assert torch.equal(ent, base[backend][1]), f"{backend} TP={tp} rank {rank}: entropy differs from TP=1"
    for backend in base:
        shards = torch.cat([per_rank[backend][2] for per_rank in tp_results(tp)], dim=-1)
        assert torch.equal(shards, base[backend][2]), f"{backend} TP={tp}: gradient shards differ from TP=1"


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("world_size", [2, 4])
def test_steps_by_hand_equal_one_rank(backend, world_size):
    logits, tokens = _case(V_TP)
    logits, tokens = logits.to(DEVICE), tokens.to(DEVICE)
    one = ppo_ops.log_probs_and_entropy(logits, tokens, backend=backend, reduction_order="sglang").log_probs
    assert torch.equal(steps_by_hand(logits, tokens, world_size, backend), one)


def test_keep_mask_is_refused():
    logits, tokens = _case(2048)
    with pytest.raises(ValueError, match="keep_mask must be None with reduction_order='sglang'"):
        ppo_ops.log_probs_and_entropy(logits, tokens, keep_mask=torch.ones_like(logits, dtype=torch.bool),
                                      reduction_order="sglang")


def test_unknown_order_is_refused():
    logits, tokens = _case(2048)
    with pytest.raises(ValueError, match="reduction_order must be one of"):
        ppo_ops.log_probs_and_entropy(logits, tokens, reduction_order="sglng")


def test_a_temperature_divides_a_copy_and_refuses_inplace_grad():
    logits, tokens = _case(2048)
    before = logits.clone()
    ppo_ops.log_probs_and_entropy(logits, tokens, temperature=0.7, reduction_order="sglang")
    assert torch.equal(logits, before)  # the quotients are a copy: the caller's logits are untouched
    with pytest.raises(ValueError, match="inplace_grad"):
        ppo_ops.log_probs_and_entropy(logits.clone().requires_grad_(True), tokens, temperature=0.7,
                                      inplace_grad=True, reduction_order="sglang")


def _small_shard_rank(rank, world_size):
    logits, tokens = _case(1024)
    with pytest.raises(ValueError, match="at least 1024 vocabulary columns per tensor-parallel rank"):
        ppo_ops.log_probs_and_entropy(shard_vocab(logits, rank, world_size), tokens,
                                      tp_group=torch.distributed.group.WORLD, reduction_order="sglang")


def _disagreeing_rank(rank, world_size):
    logits, tokens = _case(4096)
    with pytest.raises(ValueError, match="reduction order differs across the 2 tensor-parallel ranks"):
        ppo_ops.log_probs_and_entropy(shard_vocab(logits, rank, world_size), tokens,
                                      tp_group=torch.distributed.group.WORLD,
                                      reduction_order="sglang" if rank == 0 else "fused")


def test_shards_under_one_block_are_refused_on_every_rank():
    run_gloo(2, _small_shard_rank)


def test_ranks_that_disagree_on_the_order_raise_together():
    run_gloo(2, _disagreeing_rank)


COMPILE_TIMEOUT_S = 600  # a dozen sm_90 compiles in a child process, on the CI's 2 cores


@pytest.mark.device("any")  # compiles in a child process, whatever this process runs on
def test_kernels_compile_for_sm90_at_every_load_width(tmp_path_factory):
    # The interpreter runs code the compiler rejects: every width and variant must compile as an H200 runs it, each
    # block-sum kernel with the 8 exps of a thread's chain (4, 2 and 1 wide: one code path each).
    report = compile_check_report("tests.sglang_order_compile_check", tmp_path_factory.mktemp("triton_cache"),
                                  COMPILE_TIMEOUT_S)
    assert set(report["block_sums"]) == {f"{w} {v}" for w in (4, 2, 1) for v in ("plain", "continuing", "tail_only")}
    assert all(n == 8 for n in report["block_sums"].values()), report["block_sums"]
    assert report["combine"]
