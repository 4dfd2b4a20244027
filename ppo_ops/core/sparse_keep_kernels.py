"""Triton kernels of the sparse keep set (core/sparse_keep.py): the LM head's kept logits (fp32 dots), its dX and dW
terms, and the logits op's masked write of the kept entries' gradient. On CUDA, and on CPU under TRITON_INTERPRET=1
with a Triton backend; imported only then, so `import ppo_ops` works without triton.

Fixed orders (what makes the results deterministic and, for z and dW, TP-invariant):
  keep_dots   one entry per tile row, the K loop over H in BLOCK_K steps from 0, each step's products summed by
              tl.sum in a tile whose shape is a constant: an entry's bits depend on its hidden row, its weight row
              and H, not on its position, the other entries or the rank. Entries go in (id, row) order, so the tile's
              entries mostly share a weight row (read once, from L1 / L2).
  keep_dx     one program per (row, H block): the row's entries in CSR order, BLOCK_J at a time, then its target;
              dX's row is this program's alone (read, add, write).
  keep_dw     fixed tiles of the entries in (id, row) order (the same order at every TP size): per tile a segmented
              scan over its entries sums each run of equal ids that starts in it, the tile's last run summed on past
              the tile; then dW[id] = round(dW[id] + sum): each dW row is written by the program owning its run.
No atomics anywhere.
"""

import torch
import triton
import triton.language as tl

from ppo_ops.core.triton_common import cdiv, interpreting, round_bf16_by_bits, scaled, store_rounded

# Compiled tile shapes (constants: a dot's bits depend on BLOCK_K and the tile shape, which depend on nothing of
# the call but H's dtype); the interpreter takes larger tiles (each loop step costs about a millisecond there).
_DOT_BLOCK_E, _DOT_BLOCK_K, _DOT_WARPS = 32, 128, 4
_SUM_BLOCK_J, _SUM_BLOCK_H, _SUM_WARPS = 16, 256, 4
_DW_BLOCK_J = 32
_SCATTER_BLOCK = 1024
_INTERPRET_BLOCK_J, _INTERPRET_MAX_H = 64, 1 << 12


def _flags(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _block_h(width: int) -> int:
    if interpreting():
        return min(_INTERPRET_MAX_H, triton.next_power_of_2(max(width, 1)))
    return _SUM_BLOCK_H


@triton.jit
def _keep_dots_kernel(h_ptr, w_ptr, order_ptr, row_ptr, col_ptr, local_ptr, z_ptr, n_entries, width, stride_h,
                      stride_w, inv_temperature, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    in_range = offs < n_entries
    e = tl.load(order_ptr + offs, mask=in_range, other=0)
    local = (tl.load(local_ptr + e, mask=in_range, other=0) != 0) & in_range
    row = tl.load(row_ptr + e, mask=local, other=0)
    col = tl.load(col_ptr + e, mask=local, other=0)
    acc = tl.zeros([BLOCK_E], tl.float32)
    for k0 in range(0, width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        m = local[:, None] & (k < width)[None, :]
        x = tl.load(h_ptr + row[:, None] * stride_h + k[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + col[:, None] * stride_w + k[None, :], mask=m, other=0.0).to(tl.float32)
        acc += tl.sum(x * w, axis=1)
    z = scaled(acc, inv_temperature)
    tl.store(z_ptr + e, tl.where(local, z, 0.0), mask=in_range)


def keep_dots(hidden, weight, order, row, col, local, inv_temperature, z) -> None:
    """z[e] = inv_t * (hidden[row_e] . weight[col_e]) in fp32 for local entries, 0 for the others (z [E] fp32)."""
    n = z.numel()
    hidden, weight = hidden.contiguous(), weight.contiguous()
    width = hidden.shape[1]
    if interpreting():
        block_e, block_k, opts = 64, min(_INTERPRET_MAX_H, triton.next_power_of_2(width)), {}
    else:
        block_e, block_k, opts = _DOT_BLOCK_E, _DOT_BLOCK_K, {"num_warps": _DOT_WARPS}
    _keep_dots_kernel[(cdiv(n, block_e),)](hidden, weight, order, row, col, _flags(local), z, n, width,
                                           hidden.stride(0), weight.stride(0), inv_temperature, BLOCK_E=block_e,
                                           BLOCK_K=block_k, **opts)


@triton.jit
def _keep_dx_kernel(dx_ptr, w_ptr, coef_ptr, col_ptr, local_ptr, start_ptr, end_ptr, n_ids, r0, width, stride_dx,
                    stride_w, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr):
    i = tl.program_id(0)
    r = r0 + i
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < width
    start = tl.load(start_ptr + r)
    end = tl.load(end_ptr + r)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j0 in range(start, end, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        jm = j < end
        use = (tl.load(local_ptr + j, mask=jm, other=0) != 0) & jm
        c = tl.load(coef_ptr + j, mask=use, other=0.0)
        col = tl.load(col_ptr + j, mask=use, other=0)
        w = tl.load(w_ptr + col[:, None] * stride_w + h[None, :], mask=use[:, None] & hm[None, :], other=0.0)
        acc += tl.sum(c[:, None] * w.to(tl.float32), axis=0)
    t = n_ids + r + 0 * h  # the row's target entry, last (as a vector: one value per lane)
    use_t = (tl.load(local_ptr + t) != 0) & hm
    c_t = tl.load(coef_ptr + t)
    col_t = tl.load(col_ptr + t)
    w_t = tl.load(w_ptr + col_t * stride_w + h, mask=use_t, other=0.0).to(tl.float32)
    acc += tl.where(use_t, c_t * w_t, 0.0)
    ptr = dx_ptr + i.to(tl.int64) * stride_dx + h
    tl.store(ptr, tl.load(ptr, mask=hm, other=0.0) + acc, mask=hm)


def keep_dx(dx, weight, coef, col, local, row_start, row_end, n_ids, r0, r1) -> None:
    """dx[r - r0] += Σ_e coef_e weight[col_e] over row r's local entries (CSR order, then its target), rows r0..r1."""
    weight = weight.contiguous()
    assert dx.dtype == torch.float32 and dx.stride(1) == 1
    width = weight.shape[1]
    block_h = _block_h(width)
    block_j = _INTERPRET_BLOCK_J if interpreting() else _SUM_BLOCK_J
    opts = {} if interpreting() else {"num_warps": _SUM_WARPS}
    _keep_dx_kernel[(r1 - r0, cdiv(width, block_h))](dx, weight, coef, col, _flags(local), row_start, row_end, n_ids,
                                                      r0, width, dx.stride(0), weight.stride(0), BLOCK_J=block_j,
                                                      BLOCK_H=block_h, **opts)


@triton.jit
def _segment_sum(a, a_start, b, b_start):
    """Combine of a segmented inclusive scan: a run restarts where its start flag is set."""
    return tl.where(b_start != 0, b, a + b), a_start | b_start


@triton.jit
def _sorted_entries(order_ptr, gid_ptr, j, n_entries, vocab_start, shard_end):
    """The entries at sorted positions j: their index and id, and whether the id is this rank's."""
    m = (j >= 0) & (j < n_entries)
    e = tl.load(order_ptr + j, mask=m, other=0)
    gid = tl.load(gid_ptr + e, mask=m, other=-1)
    return e, gid, m & (gid >= vocab_start) & (gid < shard_end)


@triton.jit
def _keep_dw_kernel(dw_ptr, h_ptr, coef_ptr, order_ptr, row_ptr, col_ptr, gid_ptr, local_ptr, n_entries, vocab_start,
                    shard_end, width, stride_dw, stride_h, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
                    ROUND_BF16_BY_BITS: tl.constexpr):
    # The runs of equal ids that start in this tile of the sorted entries: an in-tile segmented scan, and the tile's
    # last run summed on past the tile (its owner); the tile's leading entries of an earlier run are its owner's.
    first = tl.program_id(0) * BLOCK_J
    j = first + tl.arange(0, BLOCK_J)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < width
    e, gid, in_shard = _sorted_entries(order_ptr, gid_ptr, j, n_entries, vocab_start, shard_end)
    _, prev_gid, _ = _sorted_entries(order_ptr, gid_ptr, j - 1, n_entries, vocab_start, shard_end)
    _, next_gid, _ = _sorted_entries(order_ptr, gid_ptr, j + 1, n_entries, vocab_start, shard_end)
    start = in_shard & ((j == 0) | (gid != prev_gid))
    owned = in_shard & (tl.cumsum(start.to(tl.int32), 0) > 0)
    use = owned & (tl.load(local_ptr + e, mask=owned, other=0) != 0)
    c = tl.load(coef_ptr + e, mask=use, other=0.0)
    r = tl.load(row_ptr + e, mask=use, other=0)
    x = tl.load(h_ptr + r[:, None] * stride_h + h[None, :], mask=use[:, None] & hm[None, :], other=0.0)
    flags = start.to(tl.int32)[:, None] + tl.zeros([BLOCK_J, BLOCK_H], tl.int32)
    run_sum, _ = tl.associative_scan((c[:, None] * x.to(tl.float32), flags), 0, _segment_sum)
    ends = owned & (gid != next_gid)
    last = j == first + BLOCK_J - 1
    carry = tl.sum((owned & last & (gid == next_gid)).to(tl.int32), 0) != 0
    run_gid = tl.sum(tl.where(last, gid, 0), 0)
    more = tl.zeros([BLOCK_H], tl.float32)
    k = first + BLOCK_J
    while carry:
        j2 = k + tl.arange(0, BLOCK_J)
        e2, gid2, _ = _sorted_entries(order_ptr, gid_ptr, j2, n_entries, vocab_start, shard_end)
        same = (j2 < n_entries) & (gid2 == run_gid)
        use2 = same & (tl.load(local_ptr + e2, mask=same, other=0) != 0)
        c2 = tl.load(coef_ptr + e2, mask=use2, other=0.0)
        r2 = tl.load(row_ptr + e2, mask=use2, other=0)
        x2 = tl.load(h_ptr + r2[:, None] * stride_h + h[None, :], mask=use2[:, None] & hm[None, :], other=0.0)
        more += tl.sum(c2[:, None] * x2.to(tl.float32), 0)
        carry = tl.sum(same.to(tl.int32), 0) == BLOCK_J
        k += BLOCK_J
    store = owned & (ends | last)
    col = tl.load(col_ptr + e, mask=store, other=0)
    total = run_sum + tl.where(last[:, None], more[None, :], 0.0)
    ptr = dw_ptr + col.to(tl.int64)[:, None] * stride_dw + h[None, :]
    m = store[:, None] & hm[None, :]
    store_rounded(ptr, tl.load(ptr, mask=m, other=0.0).to(tl.float32) + total, m, ROUND_BF16_BY_BITS)


def keep_dw(dw, hidden, coef, order, row, gid, col, local, vocab_start, n_valid) -> None:
    """dw[v] = round(dw[v] + Σ coef_e hidden[row_e]) for each id v this rank holds (`col` its local row), the sum in
    fp32 over v's entries in (id, row) order (`order`), in fixed tiles of that order: the same at every TP size."""
    hidden = hidden.contiguous()
    assert dw.stride(1) == 1
    n = order.numel()
    width = hidden.shape[1]
    block_h = _block_h(width)
    if interpreting():
        block_j, opts = _INTERPRET_BLOCK_J, {}
    else:
        block_j, opts = _DW_BLOCK_J, {"num_warps": _SUM_WARPS}
    _keep_dw_kernel[(cdiv(n, block_j), cdiv(width, block_h))](
        dw, hidden, coef, order, row, col, gid, _flags(local), n, vocab_start, vocab_start + n_valid, width,
        dw.stride(0), hidden.stride(0), BLOCK_J=block_j, BLOCK_H=block_h,
        ROUND_BF16_BY_BITS=round_bf16_by_bits(dw.dtype), **opts)


@triton.jit
def _scatter_kernel(out_ptr, row_ptr, col_ptr, value_ptr, write_ptr, n, stride_r, stride_c, ADD: tl.constexpr,
                    BLOCK: tl.constexpr, ROUND_BF16_BY_BITS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    w = (tl.load(write_ptr + offs, mask=m, other=0) != 0) & m
    r = tl.load(row_ptr + offs, mask=w, other=0)
    c = tl.load(col_ptr + offs, mask=w, other=0)
    v = tl.load(value_ptr + offs, mask=w, other=0.0)
    ptr = out_ptr + r * stride_r + c * stride_c
    if ADD:
        v += tl.load(ptr, mask=w, other=0.0).to(tl.float32)
    store_rounded(ptr, v, w, ROUND_BF16_BY_BITS)


def _scatter(out, row, col, value, write, add: bool) -> None:
    n = value.numel()
    block = min(_SCATTER_BLOCK, triton.next_power_of_2(max(n, 1)))
    _scatter_kernel[(cdiv(n, block),)](out, row, col, value.contiguous(), _flags(write), n, out.stride(0),
                                       out.stride(1), ADD=add, BLOCK=block,
                                       ROUND_BF16_BY_BITS=round_bf16_by_bits(out.dtype))


def scatter_rows_cols(out, row, col, value, write) -> None:
    """out[row_e, col_e] = value_e rounded to out's dtype where write_e (each position written by one entry)."""
    _scatter(out, row, col, value, write, add=False)


def add_rows_cols(out, row, col, value, write) -> None:
    """out[row_e, col_e] = round(out[row_e, col_e] + value_e) where write_e (each position written by one entry)."""
    _scatter(out, row, col, value, write, add=True)
