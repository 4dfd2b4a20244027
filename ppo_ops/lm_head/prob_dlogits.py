"""dlogits from the probabilities a one-GEMM forward kept: no second GEMM over those rows.

Two users: the token loss's one-GEMM blocks (in place, below) and the general op's backward on the rows its
forward held (path one_gemm_held of lm_head/paths.py: `held_rows`), which writes them into its own vocabulary-major
dlogits buffer (`out`) beside the rows it recomputes, so its dX and dW GEMMs stay one per segment and group.

linear_token_loss forms the loss's gradient inside its forward (lm_head/token_loss_blocks.py). Where the
one-GEMM forward applies, a block's forward (gemm_partials.forward_probs) leaves every logit as
e = fl16(e^(z - m)) in a segment-major [n_seg, B, seg_len] fp16 buffer (vocabulary-major: a column's rows are
contiguous), m the max of the element's row over its GEMM tile (BLOCK_N columns from a segment start), beside the
tile maxima; the row statistics then become global (the merge, the TP all-gather) and the caller's loss gives the
upstream gradients. This pass turns the buffer into dlogits in the input dtype, element for element in place, for
the library's dX and dW GEMMs:

    p = e * e^(m - M - log S)          (M the row max, S = Σ e^(z - M): p = e^(z - M - log S))
    z - M = log e + (m - M)
    g = p (g_ent (E_p[z] - M - (z - M)) - g_lp),  times 1/T          every column as a non-target
then gemm_dlogits.target_dlogits_kernel writes each row's target element (in its segment's slab) from the forward's
own target logit, as the general op's backward does.

Accuracy. e is rounded once to fp16: relative 2^-11 where e >= 2^-14, absolute 2^-25 below (subnormals); z - M from
log e errs by 2^-11 absolute there, plus at most 2^-17 from the compiled pass's approximate log (`_log`). So a
dlogit errs by 2^-11 of its own terms, p |g_lp| and p |g_ent| (|z - E_p[z]| + 1), before its one rounding to bf16
(2^-8). The buffer takes 2 bytes per logit where fp32 logits and separate dlogits take 6: a block holds three times
the rows in the same memory (paths.TOKEN_LOSS_BYTES sizes the blocks, paths.CUDA_SHAPE the chunk blocks), and
dW's GEMMs get that K.

Bits. A dlogit depends on its logit's tile (fixed by row, column and the K loop), its tile max, the row statistics and
the upstream gradients, not on the other rows, the rank or the TP size.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ppo_ops.core.contracts import BackwardStats, ShardOptions, UpstreamGrads
from ppo_ops.core.triton_common import (COMPILED, interpreting, round_bf16_by_bits, store_rounded, tile_row_scale,
                                        transform_args)
from ppo_ops.core.triton_launch import launcher as _launch  # fewer host steps per launch (core/triton_launch.py)
from ppo_ops.lm_head import gemm_dlogits, gemm_partials

# Rows and columns per step of a program (the columns within one forward tile, BLOCK_N, so one tile max per row),
# steps per program (each program walks PASS_STEPS column groups of one tile, loading its rows' statistics and tile
# max once) and warps; the buffer is vocabulary-major, so a program's rows are its contiguous axis: tall programs,
# the fastest of the row counts and steps timed on Hopper (docs/performance.md, "The fused LM head").
PASS_ROWS = 256
PASS_COLS = 16
PASS_STEPS = 4
PASS_WARPS = 4


@triton.jit
def _log(x):
    """ln x for x in [2^-24, 1] (fp16 values as fp32, all normal in fp32). Compiled: the hardware's approximate
    log2 times ln 2 (__logf; CUDA's intrinsic table: abs error <= 2^-21.41 on [0.5, 2], else <= 3 ulp, so <= 2^-17
    here), where the library's accurate logf costs ~25 instructions per element and leaves this pass bound by its
    arithmetic instead of its 4 bytes per element; the error is far under e's own fp16 rounding (2^-11 in ln e).
    Interpreted: numpy's log (the interpreter has no libdevice)."""
    if COMPILED:
        return tl.extra.cuda.libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit(do_not_specialize=["n_valid"])
def prob_dlogits_kernel(
    probs_ptr,  # [n_seg, B, seg_len] fp16 e^(z - m), vocabulary-major (strides slab_stride, 1, col_stride), READ
    out_ptr,  # dlogits in the output dtype (bf16 / fp16), vocabulary-major (strides out_slab_stride, 1,
    #           out_col_stride): the probabilities' own storage (written over each element once read) or another buffer
    tiles_ptr,  # [n_seg, tiles_per_seg, 3, >= R] fp32 tile partials of the forward (channel 0: the tile max m),
    #             rows contiguous, tile_stride between tiles (a view of a call's rows starts where its first row does)
    shift_ptr,  # [R] fp32 row max M
    log_sum_ptr,  # [R] fp32 log Σ e^(z - M)
    mean_shifted_ptr,  # [R] fp32 E_p[z] - M (read only when HAS_GRAD_ENTROPY)
    grad_log_prob_ptr,  # [R] fp32 (read only when HAS_GRAD_LOG_PROB)
    grad_entropy_ptr,  # [R] fp32 (read only when HAS_GRAD_ENTROPY)
    num_rows,  # R
    io_rows,  # rows the element accesses cover: R, or R rounded up to 16 where both buffers hold those rows
    col_stride,  # B: a multiple of 16 (the forward's row tile), which the compiler may assume for vector accesses
    slab_stride,
    out_col_stride,  # the output's (read only when not IN_PLACE), likewise a multiple of 16
    out_slab_stride,
    seg_len,
    n_valid,  # local columns that are real vocabulary
    tiles_per_seg,
    tile_stride,  # elements between consecutive tiles' partials (3 x the rows the forward wrote)
    inv_temperature,
    HAS_GRAD_LOG_PROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    SCALE: tl.constexpr,
    ROUND_BF16_BY_BITS: tl.constexpr,
    IN_PLACE: tl.constexpr,  # out is probs' own storage with its strides: one set of offsets
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,  # columns per step, a divisor of BLOCK_N
    STEPS: tl.constexpr,  # steps per program: STEPS * BLOCK_C columns of one tile (at most BLOCK_N)
    BLOCK_N: tl.constexpr,  # the forward's tile width: one tile max per row
    # the logit transform beyond a scalar temperature (core/triton_common.transformed; defaults: none)
    row_inv_temperature_ptr=None,  # [R] fp32 1 / T per row, read only when ROW_SCALE
    softcap=1.0,
    inv_softcap=1.0,
    ROW_SCALE: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    col_groups = tl.cdiv(seg_len, BLOCK_C * STEPS)
    pid_c = tl.program_id(1)
    seg = pid_c // col_groups
    group0 = (pid_c % col_groups) * (BLOCK_C * STEPS)
    tile = group0 // BLOCK_N
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    # the rows' factors, once per program: p = e * scale_row, z - M = log e + m_shift
    m = tl.load(tiles_ptr + (seg.to(tl.int64) * tiles_per_seg + tile) * tile_stride + rows, mask=row_ok, other=0.0)
    big_m = tl.load(shift_ptr + rows, mask=row_ok, other=0.0)
    m_shift = m - big_m  # m - M <= 0
    inv_t = tile_row_scale(inv_temperature, row_inv_temperature_ptr, rows, row_ok, ROW_SCALE)
    scale_row = tl.exp(m_shift - tl.load(log_sum_ptr + rows, mask=row_ok, other=0.0))
    # Rows in [R, io_rows) get 0 through their upstream gradients (loaded as 0), not through a select on row_ok per
    # element: at a row count like 8191 that select is computed element by element and slows the whole pass
    # (docs/performance.md). Their e are the forward's, finite (see access_rows), so every product stays 0.
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + rows, mask=row_ok, other=0.0)
        mean_shifted = tl.load(mean_shifted_ptr + rows, mask=row_ok, other=0.0)
    if HAS_GRAD_LOG_PROB:
        g_lp = tl.load(grad_log_prob_ptr + rows, mask=row_ok, other=0.0)
        neg_g_lp = tl.where(row_ok, -g_lp, 0.0)  # +0, not -0, on rows past R (used without the entropy term)
    slab = seg.to(tl.int64) * slab_stride
    out_slab = seg.to(tl.int64) * out_slab_stride  # unused IN_PLACE
    for step in tl.static_range(STEPS):
        cols = group0 + step * BLOCK_C + tl.arange(0, BLOCK_C)  # column within the segment
        in_seg = cols < seg_len
        real = in_seg & (seg * seg_len + cols < n_valid)
        offsets = slab + (cols.to(tl.int64) * col_stride)[None, :] + rows[:, None]
        if IN_PLACE:
            out_offsets = offsets
        else:
            out_offsets = out_slab + (cols.to(tl.int64) * out_col_stride)[None, :] + rows[:, None]
        io_mask = (rows < io_rows)[:, None] & in_seg[None, :]
        e = tl.load(probs_ptr + offsets, mask=io_mask, other=0.0).to(tl.float32)
        p = e * scale_row[:, None]
        if HAS_GRAD_ENTROPY or SOFTCAP:
            # z - M; where e rounded to 0 (p = 0) any finite stand-in gives a 0 gradient, never 0 * inf
            d = _log(tl.where(e > 0.0, e, 1.0)) + m_shift[:, None]
        if HAS_GRAD_ENTROPY:
            inner = g_ent[:, None] * (mean_shifted[:, None] - d)
            if HAS_GRAD_LOG_PROB:
                inner = inner - g_lp[:, None]
            grad = p * inner
        else:
            grad = neg_g_lp[:, None] * p
        if SCALE:
            grad = grad * inv_t
        if SOFTCAP:
            # The slope 1 - tanh²(x / c) from the held z: tanh(x / c) = z / (c / T), within e's fp16 rounding
            # (2^-11 in ln e, so 2^-11 T / c in the tanh), which is below the rounding these dlogits carry anyway.
            th = (d + big_m[:, None]) / (softcap * inv_t)
            grad = grad * (1.0 - th * th)
        grad = tl.where(real[None, :], grad, 0.0)
        store_rounded(out_ptr + out_offsets, grad, io_mask, ROUND_BF16_BY_BITS)


def access_rows(n_rows: int, probs: torch.Tensor, out: torch.Tensor) -> int:
    """The rows the pass's loads and stores cover: n_rows rounded up to 16 where both buffers hold that many rows
    (rows past n_rows then get 0), else n_rows. A bound that is a multiple of 16 lets the compiler vectorise the
    contiguous row axis; at a bound like 8191 every access splits into single elements and the pass runs far below
    the copy rate (docs/performance.md). The rows past n_rows that it reads were written by the forward
    (gemm_partials.forward_probs stores whole row tiles, a multiple of 16 rows, and its TMA loads zero-fill the
    hidden rows past n_rows), so they hold finite e in [0, 1], which the pass's zero upstream gradients turn into
    exact zeros."""
    rounded = -(-n_rows // 16) * 16
    return rounded if rounded <= min(probs.shape[1], out.shape[1]) else n_rows


def dlogits(probs: torch.Tensor, tiles: torch.Tensor, n_rows: int, hidden: torch.Tensor, weight: torch.Tensor,
            tokens: torch.Tensor, shard: ShardOptions, stats: BackwardStats, upstream: UpstreamGrads,
            dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The first n_rows rows of every segment of probs ([n_seg, B, seg_len] fp16, vocabulary-major, from
    gemm_partials.forward_probs on hidden [n_rows, H] and weight, the segments' weight rows; tiles its tile
    partials [n_seg, tiles_per_seg, 3, >= n_rows], rows contiguous; probs and tiles may be views starting at a later
    row of the forward's buffers; shard the segments' options) turned into dlogits of `dtype`: in place (returns
    that view of probs' storage, probs' shape and strides), or into `out` ([n_seg, >= n_rows, seg_len] of `dtype`,
    vocabulary-major, columns 16-byte aligned; returned). stats and upstream are the n_rows rows' own."""
    n_seg, _, seg_len = probs.shape
    if probs.stride(1) != 1:
        raise ValueError(f"probs: expected a vocabulary-major buffer (row stride 1), got strides {probs.stride()}")
    if (tiles.stride(3) != 1 or tiles.stride(2) * 3 != tiles.stride(1) or tiles.shape[3] < n_rows
            or (tiles.shape[0] > 1 and tiles.stride(0) != tiles.shape[1] * tiles.stride(1))):
        raise ValueError(f"tiles: expected [n_seg, tiles_per_seg, 3, >= {n_rows}] partials with contiguous rows, got "
                         f"{tuple(tiles.shape)} strides {tiles.stride()}")
    in_place = out is None
    if in_place:
        out = probs.view(dtype)
    elif (out.dtype != dtype or out.dim() != 3 or out.shape[0] != n_seg or out.shape[1] < n_rows
          or out.shape[2] != seg_len or out.stride(1) != 1 or (out.stride(2) * out.element_size()) % 16):
        raise ValueError(f"out: expected a vocabulary-major {dtype} [{n_seg}, >= {n_rows}, {seg_len}] buffer with "
                         f"16-byte aligned columns, got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    g_lp, g_ent = upstream.grad_log_prob, upstream.grad_entropy
    if n_rows == 0:
        return out
    io_rows = access_rows(n_rows, probs, out)
    block_n = gemm_partials.config().block_n
    tiles_per_seg = triton.cdiv(seg_len, block_n)
    dummy = stats.shift  # never read where its flag is off
    block_c = min(PASS_COLS, block_n)
    steps = max(1, min(PASS_STEPS, block_n // block_c))  # powers of two: a program's columns lie in one tile
    _launch(prob_dlogits_kernel)((triton.cdiv(n_rows, PASS_ROWS), n_seg * triton.cdiv(seg_len, block_c * steps)),
        probs_ptr=probs, out_ptr=out, tiles_ptr=tiles, shift_ptr=stats.shift, log_sum_ptr=stats.log_sum,
        mean_shifted_ptr=stats.mean_shifted if g_ent is not None else dummy,
        grad_log_prob_ptr=g_lp if g_lp is not None else dummy, grad_entropy_ptr=g_ent if g_ent is not None else dummy,
        num_rows=n_rows, io_rows=io_rows, col_stride=probs.stride(2), slab_stride=probs.stride(0),
        out_col_stride=out.stride(2), out_slab_stride=out.stride(0), seg_len=seg_len, n_valid=shard.n_valid,
        tiles_per_seg=tiles_per_seg, tile_stride=tiles.stride(1), **transform_args(shard, dummy),
        HAS_GRAD_LOG_PROB=g_lp is not None, HAS_GRAD_ENTROPY=g_ent is not None,
        ROUND_BF16_BY_BITS=round_bf16_by_bits(dtype), IN_PLACE=in_place, BLOCK_R=PASS_ROWS, BLOCK_C=block_c,
        STEPS=steps, BLOCK_N=block_n,
        **({} if interpreting() else {"num_warps": PASS_WARPS}))
    if g_lp is not None:  # the target's element, from the forward's own target logit, in its segment's slab
        gemm_dlogits.target_dlogits(hidden, weight, tokens, shard, stats, upstream, out)
    return out
