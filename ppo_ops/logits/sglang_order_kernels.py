"""Triton kernels of the logits op in SGLang's reduction order (sglang_order.py states the order and the protocol,
and assembles these launchers into its `Kernels`; the block geometry is sglang_order_geometry.py's).

`block_sums_kernel`: one program per row, over the blocks the shard touches, like SGLang's kernel; for each block
the 128 per-thread chains are built from 8 / W loads of a [128, W] tile (row t: thread t's W contiguous columns of
one repetition, as chain_offsets gives them), whose columns are added to the chains one after another, so the
additions happen in SGLang's order however this kernel's own layout falls; `_block_tree` then reduces the chains as
SGLang's butterfly and warp combine do, by reshapes into axes of 2, each of which is a single (commutative, hence
exact) addition. exp and log are Triton's,
as in SGLang's kernel. The logits are read in their own dtype (bf16 -> fp32 is exact), with no fp32 copy.
`combine_kernel`: per row, the global block sums added in order from 0, then log S, the log-prob and the entropy.
"""

import torch
import triton
import triton.language as tl

from ppo_ops.core.triton_common import cdiv, scaled
from ppo_ops.logits.sglang_order_geometry import BLOCK, CHAIN, THREADS

_THREADS = tl.constexpr(THREADS)
_BLOCK = tl.constexpr(BLOCK)
_CHAIN = tl.constexpr(CHAIN)
_COMBINE_ROWS = 128


@triton.jit
def _block_tree(v):
    """[128] chains -> their block sum: lanes xor 16, 8, 4, 2, 1 within each warp, then (w0 + w2) + (w1 + w3)."""
    v = tl.sum(tl.reshape(v, (4, 2, 16)), axis=1)
    v = tl.sum(tl.reshape(v, (4, 2, 8)), axis=1)
    v = tl.sum(tl.reshape(v, (4, 2, 4)), axis=1)
    v = tl.sum(tl.reshape(v, (4, 2, 2)), axis=1)
    v = tl.sum(tl.reshape(v, (4, 2, 1)), axis=1)
    v = tl.sum(tl.reshape(v, (2, 2)), axis=0)
    return tl.sum(v, axis=0)


@triton.jit
def _add_columns(chain, tile, WIDTH: tl.constexpr):
    """chain [128] + tile[:, 0] + tile[:, 1] + ... in column order (tile [128, WIDTH], WIDTH 1, 2 or 4)."""
    if WIDTH == 1:
        out = chain + tl.reshape(tile, (128,))
    elif WIDTH == 2:
        c0, c1 = tl.split(tile)
        out = (chain + c0) + c1
    else:
        even, odd = tl.split(tl.reshape(tile, (128, 2, 2)))  # column 2a + b: split by b, then by a
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        out = (((chain + c0) + c1) + c2) + c3
    return out


@triton.jit
def block_sums_kernel(
    # data
    logits_ptr,  # [T, V_local] fp32/bf16/fp16, READ-ONLY
    shift_ptr,  # [T] fp32 global row max M (0 where the row has no finite logit), READ-ONLY
    row_mask_ptr,  # [T] uint8 (HAS_ROW_MASK), READ-ONLY
    head_ptr,  # [T, 2, 128] fp32 chains carried in from the previous rank (HEAD_CONTINUES), READ-ONLY
    sums_ptr,  # [T, 2, n_out] fp32 block sums, written (not with TAIL_ONLY)
    tail_ptr,  # [T, 2, 128] fp32 chains handed on to the next rank (TAIL_CONTINUES), written
    # shapes
    stride_row, n_valid, start, first_block, n_blocks, n_out,
    # constants
    inv_temperature,
    WIDTH: tl.constexpr,  # SGLang's load width (sglang_order.vector_width)
    HEAD_CONTINUES: tl.constexpr,
    TAIL_CONTINUES: tl.constexpr,
    TAIL_ONLY: tl.constexpr,  # only the last block's chains (before the boundary exchange)
    SCALED: tl.constexpr,  # multiply by inv_temperature
    HAS_ROW_MASK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if HAS_ROW_MASK:
        if tl.load(row_mask_ptr + row) == 0:
            return
    m = tl.load(shift_ptr + row)
    t = tl.arange(0, _THREADS)
    base = logits_ptr + row * stride_row
    lo = 0
    if TAIL_ONLY:
        lo = n_blocks - 1
    for i in range(lo, n_blocks):
        chain_e = tl.zeros([_THREADS], tl.float32)
        chain_w = tl.zeros([_THREADS], tl.float32)
        if HEAD_CONTINUES:
            if i == 0:
                chain_e = tl.load(head_ptr + row * 2 * _THREADS + t)
                chain_w = tl.load(head_ptr + row * 2 * _THREADS + _THREADS + t)
        block_col = (first_block + i).to(tl.int64) * _BLOCK - start
        for rep in tl.static_range(_CHAIN // WIDTH):
            # Thread t's WIDTH contiguous columns of this repetition as one row of the tile (vector loads); the
            # chain takes them in column order, as SGLang's thread adds its registers.
            col = block_col + rep * (_THREADS * WIDTH) + t[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :]
            ok = (col >= 0) & (col < n_valid)
            z = tl.load(base + col, mask=ok, other=0.0).to(tl.float32)
            if SCALED:
                z = scaled(z, inv_temperature)
            shifted = z - m
            e = tl.where(ok, tl.exp(shifted), 0.0)
            chain_e = _add_columns(chain_e, e, WIDTH)
            chain_w = _add_columns(chain_w, tl.where(e > 0, e * shifted, 0.0), WIDTH)
        handed_on = False
        if TAIL_CONTINUES:
            handed_on = i == n_blocks - 1
        if handed_on:
            tl.store(tail_ptr + row * 2 * _THREADS + t, chain_e)
            tl.store(tail_ptr + row * 2 * _THREADS + _THREADS + t, chain_w)
        else:
            tl.store(sums_ptr + row * 2 * n_out + i, _block_tree(chain_e))
            tl.store(sums_ptr + row * 2 * n_out + n_out + i, _block_tree(chain_w))


@triton.jit
def combine_kernel(
    sums_ptr,  # [T, 2, n_blocks] fp32 block sums in global order, READ-ONLY
    shift_ptr,  # [T] fp32 M, READ-ONLY
    target_ptr,  # [T] fp32 target z (-inf where no rank holds it), READ-ONLY
    row_mask_ptr,  # [T] uint8 (HAS_ROW_MASK), READ-ONLY
    out_ptr,  # [5, T] fp32: log_prob, entropy, log S, W / S, has_mass (0/1), written
    n_rows, n_blocks,
    HAS_ROW_MASK: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = rows < n_rows
    r64 = rows.to(tl.int64)
    s = tl.zeros([ROWS], tl.float32)
    w = tl.zeros([ROWS], tl.float32)
    for b in range(n_blocks):
        s = s + tl.load(sums_ptr + r64 * 2 * n_blocks + b, mask=ok, other=0.0)
        w = w + tl.load(sums_ptr + r64 * 2 * n_blocks + n_blocks + b, mask=ok, other=0.0)
    has_mass = s > 0
    if HAS_ROW_MASK:
        has_mass = has_mass & (tl.load(row_mask_ptr + rows, mask=ok, other=0) != 0)
    s_safe = tl.where(has_mass, s, 1.0)
    log_s = tl.log(s_safe)
    ratio = tl.where(has_mass, tl.math.div_rn(w, s_safe), 0.0)
    m = tl.load(shift_ptr + rows, mask=ok, other=0.0)
    zt = tl.load(target_ptr + rows, mask=ok, other=0.0)
    log_prob = tl.where(has_mass, (zt - m) - log_s, float("-inf"))
    entropy = tl.where(has_mass, log_s - ratio, 0.0)
    tl.store(out_ptr + rows, log_prob, mask=ok)
    tl.store(out_ptr + n_rows + rows, entropy, mask=ok)
    tl.store(out_ptr + 2 * n_rows + rows, tl.where(has_mass, log_s, 0.0), mask=ok)
    tl.store(out_ptr + 3 * n_rows + rows, ratio, mask=ok)
    tl.store(out_ptr + 4 * n_rows + rows, has_mass.to(tl.float32), mask=ok)


def _mask_bytes(row_mask, like):
    return (row_mask.view(torch.uint8), True) if row_mask is not None else (like, False)


def _launch(logits, shift, shard, start, n_valid, width, inv_temperature, head, row_mask, tail_only):
    rows = logits.shape[0]
    sums = torch.zeros((rows, 2, max(shard.finished, 0)), dtype=torch.float32, device=logits.device)
    tail = torch.zeros((rows, 2, THREADS), dtype=torch.float32, device=logits.device) \
        if shard.tail_continues else sums
    if rows == 0 or shard.count == 0:
        return sums, (tail if shard.tail_continues else None)
    mask, has_mask = _mask_bytes(row_mask, logits)
    block_sums_kernel[(rows,)](
        logits_ptr=logits, shift_ptr=shift, row_mask_ptr=mask, head_ptr=head if head is not None else shift,
        sums_ptr=sums, tail_ptr=tail,
        stride_row=logits.stride(0), n_valid=n_valid, start=start, first_block=shard.first, n_blocks=shard.count,
        n_out=max(shard.finished, 1), inv_temperature=1.0 if inv_temperature is None else inv_temperature,
        WIDTH=width, HEAD_CONTINUES=shard.head_continues and head is not None,
        TAIL_CONTINUES=shard.tail_continues, TAIL_ONLY=tail_only, SCALED=inv_temperature is not None,
        HAS_ROW_MASK=has_mask, num_warps=4)
    return sums, (tail if shard.tail_continues else None)


def block_sums(logits, shift, shard, start, n_valid, width, inv_temperature, head, row_mask):
    return _launch(logits, shift, shard, start, n_valid, width, inv_temperature, head, row_mask, tail_only=False)[0]


def tail_chains(logits, shift, shard, start, n_valid, width, inv_temperature):
    return _launch(logits, shift, shard, start, n_valid, width, inv_temperature, None, None, tail_only=True)[1]


def combine(sums, shift, target_z, row_mask):
    rows, _, n_blocks = sums.shape
    out = torch.empty((5, rows), dtype=torch.float32, device=sums.device)
    if rows:
        mask, has_mask = _mask_bytes(row_mask, sums)
        combine_kernel[(cdiv(rows, _COMBINE_ROWS),)](
            sums_ptr=sums.contiguous(), shift_ptr=shift, target_ptr=target_z.contiguous(), row_mask_ptr=mask,
            out_ptr=out, n_rows=rows, n_blocks=n_blocks, HAS_ROW_MASK=has_mask, ROWS=_COMBINE_ROWS)
    return out[0], out[1], out[2], out[3], out[4] > 0

