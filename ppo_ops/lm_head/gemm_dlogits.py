"""The LM head's backward recompute as one GEMM: the forward's tile loop (gemm_partials.logit_tile) with the logits
op's gradient in its epilogue, writing dlogits in the input dtype, so no fp32 logit reaches memory.

Used by the segment-GEMM backend's backward (ppo_ops/lm_head/segment_gemms.py) wherever the one-GEMM forward
applies: per segment and group of rows, one launch fills the [rows, seg_len] dlogits buffer that the library's dX
and dW GEMMs then read. The buffer is vocabulary-major (each column's rows contiguous; the epilogue stores
transposed tiles), so dW_s = dl^T X reads its A operand K-major, which cuBLAS runs faster than an M-major one, and
its columns are 16-byte aligned whatever the segment width. No fp32 logit is written or read back, unlike the chunk
path.

Kernels:
    gemm_dlogits_kernel  persistent over the tiles of rows x (one segment's column tiles), GROUP_M row blocks at a
        time, flattened so that the next tile's loads are issued during a tile's epilogue. Per tile: the logits tile
        exactly as the forward formed it (the same function, tiles and K loop: the same bits), scaled by 1/T, then
        per element the logits op's gradient of a column that is not the target (the LM head has no keep or row
        masks):
            p = e^(z - M - log S),  g = p (g_ent (E_p[z] - M - (z - M)) - g_lp),  g / T,
        0 on columns past the segment or the vocabulary; stored transposed by TMA, clipped at the buffer's edges.
        Picking out the target column per element would cost a compare and a select per logit (a visible share of
        the GEMM: docs/performance.md); the target's element is O(R * H) work on its own instead.
    target_dlogits_kernel  then, per row whose target is in the segment, the target's element g_lp (1 - p_t) + the
        entropy term, from the forward's own target logit (gemm_partials.target_logit), rounded once. O(R * H).

Bits. A dlogit depends on its row's logits (fixed by row, column and the K loop), the row statistics (TP-invariant)
and the upstream gradients: the same whatever the other rows, the row count, the rank or the TP size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ppo_ops.core.contracts import BackwardStats, ShardOptions, UpstreamGrads
from ppo_ops.core.triton_common import (bf16_by_bits, grouped_tile, interpreting, options, round_bf16_by_bits,
                                        row_scale, store_rounded, tanh, tile_row_scale,
                                        transform_args, transformed_with_slope)
from ppo_ops.core.triton_launch import launcher as _launch  # fewer host steps per launch (core/triton_launch.py)
from ppo_ops.lm_head import gemm_partials


def applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused recompute takes these operands: the one-GEMM forward's conditions (its tiles again)."""
    return gemm_partials.applies(hidden, weight)


@triton.jit(do_not_specialize=["n_valid", "num_programs"])
def gemm_dlogits_kernel(
    x_desc,  # TMA descriptor of the group's hidden rows [R, H], blocks [BLOCK_M, BLOCK_K], READ-ONLY
    w_desc,  # TMA descriptor of the segment's weight rows [seg_len, H], blocks [BLOCK_N, BLOCK_K], READ-ONLY
    dl_desc,  # TMA descriptor of dlogits^T [seg_len, R] in the input dtype, blocks [BLOCK_N, BLOCK_M], WRITTEN
    shift_ptr,  # [R] fp32 row max M over the global vocabulary
    log_sum_ptr,  # [R] fp32 log Σ e^(z - M)
    mean_shifted_ptr,  # [R] fp32 E_p[z] - M (read only when HAS_GRAD_ENTROPY)
    grad_log_prob_ptr,  # [R] fp32 (read only when HAS_GRAD_LOG_PROB)
    grad_entropy_ptr,  # [R] fp32 (read only when HAS_GRAD_ENTROPY)
    num_rows,
    hidden_size,
    seg_len,
    n_valid,  # columns of the segment that are real vocabulary
    num_programs,
    inv_temperature,
    HAS_GRAD_LOG_PROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    OUT_BF16: tl.constexpr,  # dlogits in bf16 (else fp16)
    ROUND_BF16_BY_BITS: tl.constexpr,
    # the logit transform beyond a scalar temperature (core/triton_common.transformed; defaults: none)
    row_inv_temperature_ptr=None,  # [R] fp32 1 / T per row, read only when ROW_SCALE
    softcap=1.0,
    inv_softcap=1.0,
    ROW_SCALE: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    n_row_blocks = tl.cdiv(num_rows, BLOCK_M)
    n_col_tiles = tl.cdiv(seg_len, BLOCK_N)
    for tile_id in tl.range(tl.program_id(0), n_row_blocks * n_col_tiles, num_programs, flatten=True):
        pid_m, pid_n = grouped_tile(tile_id, n_row_blocks, n_col_tiles, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        x = gemm_partials.logit_tile(x_desc, w_desc, row0, col0, hidden_size, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        inv_t = tile_row_scale(inv_temperature, row_inv_temperature_ptr, rows, row_ok, ROW_SCALE)
        z, slope = transformed_with_slope(x, inv_t, softcap, inv_softcap, SCALE, SOFTCAP)
        cols = col0 + tl.arange(0, BLOCK_N)
        d = z - tl.load(shift_ptr + rows, mask=row_ok, other=0.0)[:, None]
        p = tl.exp(d - tl.load(log_sum_ptr + rows, mask=row_ok, other=0.0)[:, None])
        # every column as a non-target one (target_dlogits_kernel then writes the target's): z is a finite GEMM
        # output here (the forward refused NaN / inf), so no 0 * inf guard
        if HAS_GRAD_ENTROPY:
            g_ent = tl.load(grad_entropy_ptr + rows, mask=row_ok, other=0.0)
            mean_shifted = tl.load(mean_shifted_ptr + rows, mask=row_ok, other=0.0)
            if HAS_GRAD_LOG_PROB:
                g_lp = tl.load(grad_log_prob_ptr + rows, mask=row_ok, other=0.0)
                grad = p * (g_ent[:, None] * (mean_shifted[:, None] - d) - g_lp[:, None])
            else:
                grad = p * (g_ent[:, None] * (mean_shifted[:, None] - d))
        else:
            grad = -tl.load(grad_log_prob_ptr + rows, mask=row_ok, other=0.0)[:, None] * p
        if SCALE:
            grad = grad * inv_t
        if SOFTCAP:
            grad = grad * slope  # the chain rule through softcap * tanh(x / softcap)
        grad = tl.where(((cols < seg_len) & (cols < n_valid))[None, :], grad, 0.0)
        if ROUND_BF16_BY_BITS:
            out = bf16_by_bits(grad)
        elif OUT_BF16:
            out = grad.to(tl.bfloat16)
        else:
            out = grad.to(tl.float16)
        dl_desc.store([col0, row0], tl.trans(out))


@triton.jit(do_not_specialize=["n_valid", "vocab_start", "slab_stride"])
def target_dlogits_kernel(
    hidden_ptr,  # [R, H] half precision, READ-ONLY
    weight_ptr,  # the weight rows of the slabs' columns ([seg_len, H] for one segment), READ-ONLY
    tokens_ptr,  # [R] int64 global token ids
    shift_ptr,
    log_sum_ptr,
    mean_shifted_ptr,  # read only when HAS_GRAD_ENTROPY
    grad_log_prob_ptr,
    grad_entropy_ptr,  # read only when HAS_GRAD_ENTROPY
    out_ptr,  # dlogits slabs [R, slab_cols] slab_stride apart: each row's target element (where here), WRITTEN
    num_rows,
    hidden_size,
    hidden_stride,
    weight_stride,
    out_stride,  # between rows of a slab
    col_stride,  # between columns of a slab
    slab_cols,  # columns per slab: local column c lies in slab c // slab_cols
    slab_stride,  # elements between slabs (0 with one slab)
    n_valid,
    vocab_start,
    inv_temperature,
    HAS_GRAD_ENTROPY: tl.constexpr,
    SCALE: tl.constexpr,
    ROUND_BF16_BY_BITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    row_inv_temperature_ptr=None,  # as in gemm_dlogits_kernel
    softcap=1.0,
    inv_softcap=1.0,
    ROW_SCALE: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """The target's dlogit, g_lp (1 - p_t) [+ g_ent p_t (E_p[z] - M - (z_t - M))], from the forward's own target
    logit (gemm_partials.target_logit: the z_t its log-prob used)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    z, target, here, x = gemm_partials.target_logit(hidden_ptr, weight_ptr, tokens_ptr, rows, rows < num_rows,
                                                    hidden_size, hidden_stride, weight_stride, n_valid, vocab_start,
                                                    inv_temperature, SCALE, BLOCK_H, row_inv_temperature_ptr,
                                                    softcap, inv_softcap, ROW_SCALE, SOFTCAP)
    d = z - tl.load(shift_ptr + rows, mask=here, other=0.0)
    p = tl.exp(d - tl.load(log_sum_ptr + rows, mask=here, other=0.0))
    grad = tl.load(grad_log_prob_ptr + rows, mask=here, other=0.0) * (1.0 - p)
    if HAS_GRAD_ENTROPY:
        grad += tl.load(grad_entropy_ptr + rows, mask=here, other=0.0) * (
            p * (tl.load(mean_shifted_ptr + rows, mask=here, other=0.0) - d))
    if SCALE:
        grad = grad * row_scale(inv_temperature, row_inv_temperature_ptr, rows, here, ROW_SCALE)
    if SOFTCAP:
        th = tanh(x * inv_softcap)  # the slope of the cap at the target's own logit
        grad = grad * (1.0 - th * th)
    offset = ((target // slab_cols).to(tl.int64) * slab_stride + rows.to(tl.int64) * out_stride
              + (target % slab_cols).to(tl.int64) * col_stride)
    store_rounded(out_ptr + offset, grad, here, ROUND_BF16_BY_BITS)


def dlogits(hidden: torch.Tensor, w_seg: torch.Tensor, tokens: torch.Tensor, seg: ShardOptions,
            stats: BackwardStats, upstream: UpstreamGrads, out: torch.Tensor) -> None:
    """out [R, seg_len] (hidden's dtype, vocabulary-major: out.T contiguous rows, 16-byte aligned) = dlogits of the
    logits hidden @ w_seg^T of one segment; `applies` must hold. tokens, stats and upstream are the R rows' own
    (row-aligned with hidden)."""
    n_rows, width = hidden.shape
    if n_rows == 0:
        return
    cfg = gemm_partials.config()
    x_desc, w_desc = gemm_partials.descriptors(hidden, w_seg, cfg)
    if out.stride(0) != 1 or (out.stride(1) * out.element_size()) % 16:
        raise ValueError(f"out: expected a vocabulary-major [{n_rows}, {seg.seg_len}] dlogits buffer (stride 1 along "
                         f"rows, 16-byte aligned columns), got strides {out.stride()}")
    dl_desc = TensorDescriptor.from_tensor(out.T, [cfg.block_n, cfg.block_m])
    n_tiles = triton.cdiv(n_rows, cfg.block_m) * triton.cdiv(seg.seg_len, cfg.block_n)
    programs = gemm_partials.num_programs(hidden.device, n_tiles)
    g_lp, g_ent = upstream.grad_log_prob, upstream.grad_entropy
    dummy = stats.shift  # never read where its flag is off
    _launch(gemm_dlogits_kernel)((programs,),
        x_desc=x_desc, w_desc=w_desc, dl_desc=dl_desc, shift_ptr=stats.shift,
        log_sum_ptr=stats.log_sum,
        mean_shifted_ptr=stats.mean_shifted if g_ent is not None else dummy,
        grad_log_prob_ptr=g_lp if g_lp is not None else dummy,
        grad_entropy_ptr=g_ent if g_ent is not None else dummy,
        num_rows=n_rows, hidden_size=width, seg_len=seg.seg_len, n_valid=seg.n_valid,
        num_programs=programs, **transform_args(seg, dummy), HAS_GRAD_LOG_PROB=g_lp is not None,
        HAS_GRAD_ENTROPY=g_ent is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=interpreting(), OUT_BF16=out.dtype == torch.bfloat16,
        ROUND_BF16_BY_BITS=round_bf16_by_bits(out.dtype), **options(cfg))
    if g_lp is not None:  # the target's element (the epilogue wrote it as a non-target's)
        target_dlogits(hidden, w_seg, tokens, seg, stats, upstream, out)


def target_dlogits(hidden: torch.Tensor, w_seg: torch.Tensor, tokens: torch.Tensor, seg: ShardOptions,
                   stats: BackwardStats, upstream: UpstreamGrads, out: torch.Tensor) -> None:
    """Writes the target's element of out [R, seg_len] (rows whose target is a real column of this segment; row
    and column strides free) from the forward's target logit; upstream.grad_log_prob must be given. out may also be
    slabs [n_seg, B >= R, seg_len] (any strides), one per consecutive segment of w_seg; `seg` is then the options
    of all of them (the shard's)."""
    n_rows, width = hidden.shape
    g_lp, g_ent = upstream.grad_log_prob, upstream.grad_entropy
    dummy = stats.shift  # never read where its flag is off
    slab_stride = out.stride(0) if out.dim() == 3 else 0
    _launch(target_dlogits_kernel)((triton.cdiv(n_rows, gemm_partials.TARGET_ROWS),),
        hidden_ptr=hidden, weight_ptr=w_seg, tokens_ptr=tokens, shift_ptr=stats.shift, log_sum_ptr=stats.log_sum,
        mean_shifted_ptr=stats.mean_shifted if g_ent is not None else dummy, grad_log_prob_ptr=g_lp,
        grad_entropy_ptr=g_ent if g_ent is not None else dummy, out_ptr=out, num_rows=n_rows, hidden_size=width,
        hidden_stride=hidden.stride(0), weight_stride=w_seg.stride(0), out_stride=out.stride(-2),
        col_stride=out.stride(-1),
        slab_cols=out.shape[-1], slab_stride=slab_stride, n_valid=seg.n_valid, vocab_start=seg.vocab_start,
        **transform_args(seg, dummy), HAS_GRAD_ENTROPY=g_ent is not None,
        ROUND_BF16_BY_BITS=round_bf16_by_bits(out.dtype), BLOCK_R=gemm_partials.TARGET_ROWS,
        BLOCK_H=gemm_partials.TARGET_H)
