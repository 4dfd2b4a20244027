"""Triton backend with compiled kernels on an NVIDIA GPU (H200): the contract checks of tests/test_triton_backend.py
at real sizes, bitwise invariance of the compiled forward under vocabulary sharding, determinism, and int64 offsets.

Run with `pytest tests/test_triton_backend_gpu.py` (no TRITON_INTERPRET) or `bazel test --config=gpu`. The float64
references and tolerances are those of tests/triton_reference.py.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="needs triton")

from ppo_ops import _triton_backend as tb  # noqa: E402
from ppo_ops._row_stats import empty_partials  # noqa: E402
from tests.triton_reference import (assert_kernel_grad_close, assert_partials_close, check_once, make_case,  # noqa: E402
                                    reference_grad, reference_partials, reference_stats, results_per_tp)

DEVICE = "cuda"
QWEN3_VOCAB = 151936  # 8 segments of 18992 = 16 * 1187


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("keep", [False, True])
def test_qwen3_rows(dtype, keep):
    inv_t = float(torch.tensor(1 / 0.7, dtype=torch.float32))
    check_once(*make_case(48, QWEN3_VOCAB, dtype=dtype, keep=keep, n_rows_active=40), inv_t=inv_t,
               seg_len=QWEN3_VOCAB // 8, device=DEVICE)


@pytest.mark.parametrize("n_valid", [QWEN3_VOCAB, QWEN3_VOCAB - 293])  # 293: Qwen3's padding, splits a vector
def test_one_segment_per_rank_and_padding(n_valid):
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(16, QWEN3_VOCAB, dtype=torch.bfloat16, keep=True)
    logits[:, n_valid:] = float("nan")  # never read as vocabulary
    check_once(logits, row_mask, target_col.clamp(max=n_valid - 1), keep_mask, g_lp, g_ent, n_valid=n_valid,
               device=DEVICE)


def test_online_rescaling_across_small_tiles():
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(8, 4096, keep=True, scale=1.0)
    logits += torch.linspace(-30, 30, 4096)  # the running max grows at every tile
    check_once(logits, row_mask, target_col, keep_mask, g_lp, g_ent, seg_len=2048, device=DEVICE, block_v=256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v_global,vocab_size", [(QWEN3_VOCAB, QWEN3_VOCAB - 293), (8000, 7990)])
def test_compiled_shards_give_the_same_bits(dtype, v_global, vocab_size):
    # Each TP rank's forward partials (its fixed segments) and gradient shard equal those of TP=1 bit for bit. 8000:
    # V_local = 1000 at TP=8 is not a multiple of 16 (another vector alignment than at TP=1 unless the kernel pins it).
    logits, row_mask, tokens, keep_mask, g_lp, g_ent = make_case(24, v_global, dtype=dtype, keep=True, n_rows_active=20)
    tokens = tokens.clamp(max=vocab_size - 1)
    stats = [s.float().to(DEVICE) for s in reference_stats(logits, row_mask, tokens, keep_mask, 1.0, vocab_size)]
    logits, row_mask, keep_mask, g_lp, g_ent = (t.to(DEVICE) for t in (logits, row_mask, keep_mask, g_lp, g_ent))
    tokens = tokens.to(DEVICE)
    results = results_per_tp(logits, row_mask, tokens, keep_mask, stats, g_lp, g_ent, vocab_size, v_global // 8)
    for tp in (2, 4, 8):
        assert torch.equal(results[tp][0], results[1][0]), f"partials differ at TP={tp}"
        assert torch.equal(results[tp][1], results[1][1]), f"gradient differs at TP={tp}"


def test_deterministic_run_to_run():
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(512, QWEN3_VOCAB, dtype=torch.bfloat16, keep=True)
    args = [t.to(DEVICE) for t in (logits, target_col, keep_mask)]
    first = tb.forward_partials(args[0], None, args[1], args[2], 1.0, QWEN3_VOCAB, QWEN3_VOCAB // 8, True, None)
    for _ in range(3):
        again = tb.forward_partials(args[0], None, args[1], args[2], 1.0, QWEN3_VOCAB, QWEN3_VOCAB // 8, True, None)
        assert torch.equal(again, first)
    stats = [s.float().to(DEVICE) for s in reference_stats(logits, None, target_col, keep_mask, 1.0, QWEN3_VOCAB)]
    grads = []
    for _ in range(2):
        grads.append(torch.empty_like(args[0]))
        tb.backward_grad(args[0], None, args[1], args[2], 1.0, QWEN3_VOCAB, *stats, g_lp.to(DEVICE),
                         g_ent.to(DEVICE), grads[-1], None)
    assert torch.equal(grads[0], grads[1])


def test_int64_offsets():
    # T x V > 2^31 elements (4.3 GB of bf16): the last rows' offsets overflow int32. Forward over all rows and with a
    # row mask keeping the last two; backward in place (no second 4.3 GB buffer) with only the last two rows kept.
    n_rows = 2**31 // QWEN3_VOCAB + 2
    small, _, target_col, _, g_lp, g_ent = make_case(2, QWEN3_VOCAB, dtype=torch.bfloat16)
    logits = torch.zeros((n_rows, QWEN3_VOCAB), dtype=torch.bfloat16, device=DEVICE)
    logits[-2:] = small.to(DEVICE)
    assert logits.numel() > 2**31
    seg_len = QWEN3_VOCAB // 8
    expected = reference_partials(small, None, target_col, None, 1.0, QWEN3_VOCAB, seg_len, True)
    targets = torch.zeros(n_rows, dtype=torch.int64, device=DEVICE)
    targets[-2:] = target_col.to(DEVICE)
    everything = tb.forward_partials(logits, None, targets, None, 1.0, QWEN3_VOCAB, seg_len, True, None)
    assert_partials_close(everything[:, :, -2:].cpu(), expected)
    row_mask = torch.zeros(n_rows, dtype=torch.bool, device=DEVICE)
    row_mask[-2:] = True
    last = tb.forward_partials(logits, row_mask, targets, None, 1.0, QWEN3_VOCAB, seg_len, True, None)
    assert_partials_close(last[:, :, -2:].cpu(), expected)
    assert torch.equal(last[:, :, :-2], empty_partials(last.shape[0], n_rows - 2, DEVICE))

    def last_two(values):  # [2] per-row values of the small case -> [T], zeros elsewhere (as the core passes them)
        full = torch.zeros(n_rows, dtype=torch.float32, device=DEVICE)
        full[-2:] = values.float().to(DEVICE)
        return full

    stats = [last_two(s) for s in reference_stats(small, None, target_col, None, 1.0, QWEN3_VOCAB)]
    tb.backward_grad(logits, row_mask, targets, None, 1.0, QWEN3_VOCAB, *stats, last_two(g_lp), last_two(g_ent),
                     logits, None)
    stats64 = reference_stats(small, None, target_col, None, 1.0, QWEN3_VOCAB)
    assert_kernel_grad_close(logits[-2:].cpu(), reference_grad(small, None, target_col, None, 1.0, QWEN3_VOCAB, stats64,
                                                        g_lp, g_ent))
    assert int(torch.count_nonzero(logits[:-2])) == 0
