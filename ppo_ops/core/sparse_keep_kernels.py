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
  row entries the logits op's entries, one program per row: an id counts where it is its row's first listing
              (found by comparing the row's ids pairwise, or with a vocabulary bitmap for long rows); which listing
              that is depends on the row's ids alone, not on the rank or the other rows.
  keep_dw     fixed tiles of the entries in (id, row) order (the same order at every TP size): per tile a segmented
              scan over its entries sums each run of equal ids that starts in it, the tile's last run summed on past
              the tile; then dW[id] = round(dW[id] + sum): each dW row is written by the program owning its run.
No atomic adds into any value: the only atomics are the long rows' bitmap ORs and the header's integer min / max
/ sums, whose results do not depend on their order.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from ppo_ops.core.sparse_keep_types import Entries, FullStats, KeepShard, KeepState, SparseKeep
from ppo_ops.core.triton_common import cdiv, interpreting, round_bf16_by_bits, scaled, store_rounded
# The keep set's many small launches, with little host work each (triton_launch.py).
from ppo_ops.core.triton_launch import launcher as _launch

# Compiled tile shapes (constants: a dot's bits depend on BLOCK_K and the tile shape, which depend on nothing of
# the call but H's dtype); the interpreter takes larger tiles (each loop step costs about a millisecond there).
_DOT_BLOCK_E, _DOT_BLOCK_K, _DOT_WARPS = 32, 128, 4
# dX / dW: tiles of 32 entries x 64 columns on one warp were the fastest of those measured on an H200 at T = 8192,
# V = 151936, H = 4096, 64 ids a row (dX 0.9 ms, dW 5.0 ms; 16 x 256 on four warps: 5.0 and 10.1 ms).
_SUM_BLOCK_J, _SUM_BLOCK_H, _SUM_WARPS = 32, 64, 1
_DW_BLOCK_J = 32
_SCATTER_BLOCK = 1024
_INTERPRET_BLOCK_J, _INTERPRET_MAX_H = 64, 1 << 12


def _flags(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _block_h(width: int) -> int:
    if interpreting():
        return min(_INTERPRET_MAX_H, triton.next_power_of_2(max(width, 1)))
    return _SUM_BLOCK_H


# ---- entries, kept sets, log-probs and gradients (the pieces sparse_keep.py forms with torch ops elsewhere) ----

_ROW_BLOCK = 128  # entries per loop step of the per-row kernels
_ENTRY_BLOCK = 1024  # entries per program of the per-entry kernels
_INT64_MAX, _INT64_MIN = (1 << 63) - 1, -(1 << 63)


@triton.jit
def _header_kernel(ids_ptr, off_ptr, out_ptr, n_ids, n_all, BLOCK: tl.constexpr):
    """The keep set's header values (sparse_keep.header_values): element-wise pieces reduced with integer atomics
    (exact and order-free: the same values whatever the order)."""
    k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    is_id = k < n_ids
    o = k - n_ids  # offsets follow the ids in the checksum's vector
    is_off = (o >= 0) & (o <= n_all)
    v = tl.where(is_id, tl.load(ids_ptr + k, mask=is_id, other=0), tl.load(off_ptr + o, mask=is_off, other=0))
    weight = (k % 65521 + 1).to(tl.int64)
    part = tl.where(is_id | is_off, ((v % 2147483647 + 2147483647) % 2147483647 * weight) % 2147483647, 0)
    tl.atomic_add(out_ptr + 1, tl.sum(part, 0))
    prev = tl.load(off_ptr + o - 1, mask=is_off & (o >= 1), other=0)
    bits = tl.max(tl.where(is_off & (o >= 1) & (v < prev), 4, 0), 0)
    bits |= tl.max(tl.where(is_off & (o == 0) & (v != 0), 1, 0), 0)
    bits |= tl.max(tl.where(is_off & (o == n_all) & (v != n_ids), 2, 0), 0)
    tl.atomic_or(out_ptr + 2, bits.to(tl.int64))
    tl.atomic_min(out_ptr + 3, tl.min(tl.where(is_id, v, 9223372036854775807), 0))
    tl.atomic_max(out_ptr + 4, tl.max(tl.where(is_id, v, -9223372036854775807 - 1), 0))


def header_values(ids, offsets):
    """[5] int64: len(ids), checksum, offsets error bits, id min, id max (0, 0 without ids); no sync."""
    n_ids, n_all = ids.numel(), offsets.numel() - 1
    init = [n_ids, 0, 0, _INT64_MAX, _INT64_MIN] if n_ids else [0, 0, 0, 0, 0]
    out = torch.tensor(init, dtype=torch.int64).to(ids.device, non_blocking=True)
    n = n_ids + n_all + 1
    _launch(_header_kernel)((cdiv(n, _ENTRY_BLOCK),), ids, offsets, out, n_ids, n_all, BLOCK=_ENTRY_BLOCK)
    return out


@triton.jit
def _entries_kernel(ids_ptr, off_ptr, tok_ptr, rows_ptr, to_compact_ptr, row_mask_ptr, row_out, gid_out, valid_out,
                    key_out, n_ids, n_all, n_rows, vocab_size, v_global, n_steps, HAS_ROWS: tl.constexpr,
                    HAS_ROW_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Per entry (the ids in CSR order, then one target per row): its row, id (clamped), whether it may be kept
    (a valid id of a kept row, not the row's target; or a keep row's valid target) and its (id, row) sort key (the
    stable sort keeps an id before its row's target, which never both count)."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    is_id = j < n_ids
    c_t = j - n_ids
    is_t = (c_t >= 0) & (c_t < n_rows)
    # The ids' call row: the last r with offsets[r] <= j (binary search; -1 or n_all outside the CSR).
    lo = tl.full([BLOCK], -1, tl.int64)
    hi = tl.zeros([BLOCK], tl.int64) + n_all + 1
    for _ in range(n_steps):
        active = hi - lo > 1
        mid = (lo + hi) // 2
        below = tl.load(off_ptr + mid, mask=active & is_id, other=0) <= j
        lo = tl.where(active & below, mid, lo)
        hi = tl.where(active & ~below, mid, hi)
    call_row = tl.where(is_id, lo, tl.load(rows_ptr + c_t, mask=is_t, other=0) if HAS_ROWS else c_t)
    row_ok = (call_row >= 0) & (call_row < n_all) & (is_id | is_t)
    safe = tl.where(row_ok, call_row, 0)
    if HAS_ROWS:
        crow = tl.where(is_id, tl.load(to_compact_ptr + safe, mask=row_ok & is_id, other=-1), c_t)
        row_ok &= crow >= 0
    else:
        crow = call_row
    if HAS_ROW_MASK:
        row_ok &= tl.load(row_mask_ptr + safe, mask=row_ok, other=0) != 0
    crow = tl.where(row_ok, crow, 0)
    keep_row = tl.load(off_ptr + safe + 1, mask=row_ok, other=0) > tl.load(off_ptr + safe, mask=row_ok, other=0)
    tok = tl.load(tok_ptr + crow, mask=row_ok, other=-1).to(tl.int64)
    the_id = tl.where(is_id, tl.load(ids_ptr + j, mask=is_id, other=-1), tok)
    valid = row_ok & keep_row & (the_id >= 0) & (the_id < vocab_size) & (~is_id | (the_id != tok))
    gid = tl.minimum(tl.maximum(the_id, -1), v_global)
    key = (gid + 1) * tl.maximum(n_rows, 1) + crow  # equal for an id and its row's target: never both kept
    m = is_id | is_t
    tl.store(row_out + j, crow, mask=m)
    tl.store(gid_out + j, gid, mask=m)
    tl.store(valid_out + j, valid.to(tl.uint8), mask=m)
    tl.store(key_out + j, key, mask=m)


@triton.jit
def _dedup_kernel(skey_ptr, order_ptr, valid_ptr, gid_ptr, ok_out, local_out, col_out, n, vocab_start, n_valid,
                  BLOCK: tl.constexpr):
    """In (id, row) order: the first valid entry of each (id, row) counts (duplicates sit side by side); each
    entry's local column and whether this rank holds it."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    key = tl.load(skey_ptr + i, mask=m, other=0)
    has_prev = m & (i > 0)
    prev = tl.load(skey_ptr + i - 1, mask=has_prev, other=0)
    prev_valid = tl.load(valid_ptr + tl.load(order_ptr + i - 1, mask=has_prev, other=0), mask=has_prev, other=0) != 0
    e = tl.load(order_ptr + i, mask=m, other=0)
    # A (row, id) group is its listed ids (all valid or all not: an id equal to the row's target is not), then the
    # row's target where the id is the target: the first valid entry of a group counts.
    ok = (~has_prev | (key != prev) | ~prev_valid) & (tl.load(valid_ptr + e, mask=m, other=0) != 0)
    col = tl.load(gid_ptr + e, mask=m, other=0) - vocab_start
    local = ok & (col >= 0) & (col < n_valid)
    tl.store(ok_out + e, ok.to(tl.uint8), mask=m)
    tl.store(local_out + e, local.to(tl.uint8), mask=m)
    tl.store(col_out + e, tl.minimum(tl.maximum(col, 0), tl.maximum(n_valid - 1, 0)), mask=m)


def entries(keep: SparseKeep, tokens, rows, row_mask, shard: KeepShard):
    """The kernel path of sparse_keep.entries: (row, gid, ok, local, col, order) of the E = len(ids) + R entries."""
    keep_ids, offsets = keep.ids, keep.offsets
    vocab_size, v_global, vocab_start, n_valid = shard.vocab_size, shard.v_global, shard.vocab_start, shard.n_valid
    device = tokens.device
    n_ids, n_all, n_rows = keep_ids.numel(), offsets.numel() - 1, tokens.numel()
    n = n_ids + n_rows
    to_compact = None
    if rows is not None:
        to_compact = torch.full((n_all,), -1, dtype=torch.int64, device=device)
        to_compact[rows] = torch.arange(n_rows, device=device)
    ints = torch.empty((3, n), dtype=torch.int64, device=device)
    row, gid, key = ints[0], ints[1], ints[2]
    flags = torch.empty((3, n), dtype=torch.uint8, device=device)
    valid, ok, local = flags[0], flags[1], flags[2]
    grid = (cdiv(max(n, 1), _ENTRY_BLOCK),)
    _launch(_entries_kernel)(grid, keep_ids, offsets, tokens, rows if rows is not None else offsets,
                             to_compact if to_compact is not None else offsets,
                             _flags(row_mask) if row_mask is not None else offsets, row, gid, valid, key, n_ids, n_all,
                             n_rows, vocab_size, v_global, (n_all + 1).bit_length() + 1, HAS_ROWS=rows is not None,
                             HAS_ROW_MASK=row_mask is not None, BLOCK=_ENTRY_BLOCK)
    # (id, row) keys fit int32 up to V_global * R < 2^31 (T = 8192 at Qwen3's vocabulary): half the radix passes.
    narrow = (v_global + 2) * max(n_rows, 1) < 2**31
    skey, order = torch.sort(key.to(torch.int32) if narrow else key, stable=True)
    col = key  # reused: the keys are sorted into skey
    _launch(_dedup_kernel)(grid, skey, order, valid, gid, ok, local, col, n, vocab_start, n_valid, BLOCK=_ENTRY_BLOCK)
    return row, gid, ok.view(torch.bool), local.view(torch.bool), col, order


# ---- the logits op's entries: one program per row, no sort (the logits op needs which entries count, no order) ----

# ids per step of a row's program: duplicates within a step are found by comparing its [CHUNK, CHUNK] id pairs. On an
# H200 (T = 8192, V = 151936, 64 ids a row) the logits op with the keep set took +3.8% over the call without one at
# 32 ids on one warp, +4.2 to +4.6% at 32 on two or four, +5.6% at 16 on one, +4.8 to +8.1% at 64 on two to eight.
_ROW_CHUNK = 32
_ROW_WARPS = 1
# A row of up to this many ids compares each step with the row's earlier steps (at most ten step pairs); a longer
# row (a wide nucleus) is taken by one of the scanner programs, which marks its ids in a bitmap of the vocabulary.
_PAIRWISE_MAX = 256
# Scanner programs (the first rows' programs), each with its own bitmap: bitmap memory is _SCANNERS * V / 8 bytes.
_SCANNERS = 128
_SCAN_BLOCK = 128  # rows a scanner looks at per step when it looks for long rows


@triton.jit
def _spread(flag, like):
    """A scalar flag as a vector shaped like `like` (the interpreter keeps a scalar bool combined with a vector of
    bools as integers, which it then refuses as a mask)."""
    return (flag.to(tl.int32) + 0 * like) != 0


@triton.jit
def _row_ids(ids_ptr, j, m, keep, tok, vocab_size, v_global):
    """The ids at positions j of a row: the id clamped to [-1, v_global], and whether it may count (a valid id of a
    keep row that is not the row's target: the target's own entry counts for it)."""
    the_id = tl.load(ids_ptr + j, mask=m, other=-1)
    valid = m & _spread(keep, j) & (the_id >= 0) & (the_id < vocab_size) & (the_id != tok)
    return tl.minimum(tl.maximum(the_id, -1), v_global), valid


@triton.jit
def _listed_before(gid_a, gid_b, valid_b, before):
    """Per lane of step a: whether a valid id of step b at a position `before` it ([CHUNK, CHUNK] mask) equals it.
    Compared as int32 (ids are clamped to [-1, v_global]): the pair tile's registers bound the program's occupancy."""
    hit = (gid_a.to(tl.int32)[:, None] == gid_b.to(tl.int32)[None, :]) & valid_b[None, :] & before
    return tl.max(hit.to(tl.int32), 1) > 0


@triton.jit
def _store_entries(j, m, r, gid, ok, vocab_start, n_valid, logits_ptr, stride_r, stride_c, inv_temperature, row_out,
                   gid_out, ok_out, local_out, col_out, z_out):
    """Entries j of row r: row, id, ok, local, local column and kept logit (the gather: 0 where not local)."""
    col = gid - vocab_start
    local = ok & m & (col >= 0) & (col < n_valid)
    col = tl.minimum(tl.maximum(col, 0), tl.maximum(n_valid - 1, 0))
    x = tl.load(logits_ptr + r * stride_r + col * stride_c, mask=local, other=0.0).to(tl.float32)
    tl.store(row_out + j, r + 0 * j, mask=m)
    tl.store(gid_out + j, gid, mask=m)
    tl.store(ok_out + j, ok.to(tl.uint8), mask=m)
    tl.store(local_out + j, local.to(tl.uint8), mask=m)
    tl.store(col_out + j, col, mask=m)
    tl.store(z_out + j, tl.where(local, scaled(x, inv_temperature), 0.0), mask=m)


@triton.jit
def _row_range(off_ptr, r, n_ids):
    """Row r's CSR range, clamped so that malformed offsets never reach past the ids: ranges may then overlap, but
    every position from the first row's start to the last row's end lies in one of them."""
    start = tl.minimum(tl.maximum(tl.load(off_ptr + r), 0), n_ids)
    return start, tl.maximum(tl.minimum(tl.load(off_ptr + r + 1), n_ids), start)


@triton.jit
def _row_entries_kernel(ids_ptr, off_ptr, tok_ptr, row_mask_ptr, logits_ptr, row_out, gid_out, ok_out, local_out,
                        col_out, z_out, seen_ptr, n_ids, n_rows, vocab_size, v_global, vocab_start, n_valid, stride_r,
                        stride_c, inv_temperature, seen_words, n_scanners, rows_per_scanner,
                        HAS_ROW_MASK: tl.constexpr, CHUNK: tl.constexpr, PAIRWISE_MAX: tl.constexpr,
                        SCAN_BLOCK: tl.constexpr):
    """The logits op's entries and kept logits, row r per program: its target's entry, its ids' entries (the first
    listing of an id counts) where it has at most PAIRWISE_MAX ids, and, in the first n_scanners programs, the longer
    rows of a share of the rows (first listings found with a bitmap: one atomic OR per id, the bit's old value says
    whether an earlier step listed it). Ids at positions no row covers (malformed offsets) get entries that never
    count. Everything an entry gets depends on its row's ids alone: the same at every TP size."""
    r = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, CHUNK)
    start, end = _row_range(off_ptr, r, n_ids)
    keep = end > start
    if HAS_ROW_MASK:
        keep &= tl.load(row_mask_ptr + r) != 0
    tok = tl.load(tok_ptr + r).to(tl.int64)
    # The target's entry (always the first of its id in the row: a listed id equal to it never counts).
    t_valid = keep & (tok >= 0) & (tok < vocab_size)
    _store_entries(n_ids + r + 0 * lanes, lanes == 0, r, tl.minimum(tl.maximum(tok, -1), v_global) + 0 * lanes,
                   (lanes == 0) & _spread(t_valid, lanes), vocab_start, n_valid, logits_ptr, stride_r, stride_c,
                   inv_temperature, row_out, gid_out, ok_out, local_out, col_out, z_out)
    if end - start <= PAIRWISE_MAX:
        for a0 in range(start, end, CHUNK):
            ja = a0 + lanes
            ma = ja < end
            gid_a, valid_a = _row_ids(ids_ptr, ja, ma, keep, tok, vocab_size, v_global)
            dup = _listed_before(gid_a, gid_a, valid_a, lanes[None, :] < lanes[:, None])
            for b0 in range(start, a0, CHUNK):
                gid_b, valid_b = _row_ids(ids_ptr, b0 + lanes, lanes >= 0, keep, tok, vocab_size, v_global)
                dup |= _listed_before(gid_a, gid_b, valid_b, lanes[None, :] >= 0)
            _store_entries(ja, ma, r, gid_a, valid_a & ~dup, vocab_start, n_valid, logits_ptr, stride_r, stride_c,
                           inv_temperature, row_out, gid_out, ok_out, local_out, col_out, z_out)
    # Positions before the first row's range and after the last row's (offsets that do not span the ids).
    if r == 0:
        for a0 in range(0, start, CHUNK):
            ja = a0 + lanes
            _store_entries(ja, ja < start, r, -1 + 0 * ja, ja < 0, vocab_start, n_valid, logits_ptr, stride_r,
                           stride_c, inv_temperature, row_out, gid_out, ok_out, local_out, col_out, z_out)
    if r == n_rows - 1:
        for a0 in range(end, n_ids, CHUNK):
            ja = a0 + lanes
            _store_entries(ja, ja < n_ids, r, -1 + 0 * ja, ja < 0, vocab_start, n_valid, logits_ptr, stride_r,
                           stride_c, inv_temperature, row_out, gid_out, ok_out, local_out, col_out, z_out)
    if r < n_scanners:
        _scan_long_rows(ids_ptr, off_ptr, tok_ptr, row_mask_ptr, logits_ptr, row_out, gid_out, ok_out, local_out,
                        col_out, z_out, seen_ptr + r * seen_words, r, n_ids, n_rows, vocab_size, v_global,
                        vocab_start, n_valid, stride_r, stride_c, inv_temperature, seen_words, rows_per_scanner,
                        HAS_ROW_MASK, CHUNK, PAIRWISE_MAX, SCAN_BLOCK)


@triton.jit
def _scan_long_rows(ids_ptr, off_ptr, tok_ptr, row_mask_ptr, logits_ptr, row_out, gid_out, ok_out, local_out, col_out,
                    z_out, seen, s, n_ids, n_rows, vocab_size, v_global, vocab_start, n_valid, stride_r, stride_c,
                    inv_temperature, seen_words, rows_per_scanner, HAS_ROW_MASK: tl.constexpr, CHUNK: tl.constexpr,
                    PAIRWISE_MAX: tl.constexpr, SCAN_BLOCK: tl.constexpr):
    """Scanner s: the rows of more than PAIRWISE_MAX ids among rows s * rows_per_scanner onwards, one at a time, with
    the bitmap `seen` (cleared first, then after each row at the words its ids touched)."""
    lanes = tl.arange(0, CHUNK)
    first = s * rows_per_scanner
    last = tl.minimum(first + rows_per_scanner, n_rows)
    n_long = 0
    for b0 in range(first, last, SCAN_BLOCK):
        rr = b0 + tl.arange(0, SCAN_BLOCK)
        rs, re = _row_range(off_ptr, tl.where(rr < last, rr, 0), n_ids)
        n_long += tl.sum(((rr < last) & (re - rs > PAIRWISE_MAX)).to(tl.int32), 0)
    if n_long > 0:
        for w0 in range(0, seen_words, CHUNK):
            w = w0 + lanes
            tl.store(seen + w, tl.zeros([CHUNK], tl.int32), mask=w < seen_words)
        tl.debug_barrier()
        for b0 in range(first, last, SCAN_BLOCK):
            rr = b0 + tl.arange(0, SCAN_BLOCK)
            rs, re = _row_range(off_ptr, tl.where(rr < last, rr, 0), n_ids)
            is_long = (rr < last) & (re - rs > PAIRWISE_MAX)
            for _ in range(0, tl.sum(is_long.to(tl.int32), 0)):
                r = tl.min(tl.where(is_long, rr, n_rows), 0).to(tl.int64)
                is_long &= rr != r
                start, end = _row_range(off_ptr, r, n_ids)
                keep = end > start
                if HAS_ROW_MASK:
                    keep &= tl.load(row_mask_ptr + r) != 0
                tok = tl.load(tok_ptr + r).to(tl.int64)
                for a0 in range(start, end, CHUNK):
                    ja = a0 + lanes
                    ma = ja < end
                    gid_a, valid_a = _row_ids(ids_ptr, ja, ma, keep, tok, vocab_size, v_global)
                    first_here = valid_a & ~_listed_before(gid_a, gid_a, valid_a, lanes[None, :] < lanes[:, None])
                    bit = tl.full([CHUNK], 1, tl.int32) << (gid_a & 31).to(tl.int32)
                    old = tl.atomic_or(seen + tl.where(first_here, gid_a >> 5, 0), bit, mask=first_here)
                    _store_entries(ja, ma, r, gid_a, first_here & ((old & bit) == 0), vocab_start, n_valid,
                                   logits_ptr, stride_r, stride_c, inv_temperature, row_out, gid_out, ok_out,
                                   local_out, col_out, z_out)
                    tl.debug_barrier()  # this step's bits are set before the next step's ORs read them
                for a0 in range(start, end, CHUNK):
                    ja = a0 + lanes
                    gid_a, valid_a = _row_ids(ids_ptr, ja, ja < end, keep, tok, vocab_size, v_global)
                    tl.store(seen + tl.where(valid_a, gid_a >> 5, 0), tl.zeros([CHUNK], tl.int32), mask=valid_a)
                tl.debug_barrier()


def logits_entries(keep: SparseKeep, tokens, row_mask, logits, inv_temperature, shard: KeepShard, *, chunk=None,
                   pairwise_max=None, warps=None):
    """The logits op's entries and kept logits (before the exchange) in one launch: (row, gid, ok, local, col, z) of
    the E = len(ids) + T entries as `entries` gives them, z the kept logits times inv_t where this rank holds the
    entry (else 0), without the sort (no `order`).
    `chunk`, `pairwise_max` and `warps` default to the tuning constants above (tests take small ones to reach the
    long-row path)."""
    keep_ids, offsets = keep.ids, keep.offsets
    vocab_size, v_global, vocab_start, n_valid = shard.vocab_size, shard.v_global, shard.vocab_start, shard.n_valid
    chunk = chunk or _ROW_CHUNK
    pairwise_max = pairwise_max or _PAIRWISE_MAX
    opts = {} if interpreting() else {"num_warps": warps or _ROW_WARPS}
    device = tokens.device
    n_ids, n_rows = keep_ids.numel(), tokens.numel()
    n = n_ids + n_rows
    ints = torch.empty((3, n), dtype=torch.int64, device=device)
    flags = torch.empty((2, n), dtype=torch.uint8, device=device)
    z = torch.empty(n, dtype=torch.float32, device=device)
    if n_rows == 0:  # no row to take the ids: none counts
        ints.zero_()
        flags.zero_()
        z.zero_()
    else:
        scanners = min(n_rows, _SCANNERS) if n_ids > pairwise_max else 0
        words = cdiv(vocab_size, 32)
        seen = torch.empty(max(scanners * words, 1), dtype=torch.int32, device=device)
        _launch(_row_entries_kernel)((n_rows,), keep_ids, offsets, tokens,
                                     _flags(row_mask) if row_mask is not None else offsets, logits, ints[0], ints[1],
                                     flags[0], flags[1], ints[2], z, seen, n_ids, n_rows, vocab_size, v_global,
                                     vocab_start, n_valid, logits.stride(0), logits.stride(1), inv_temperature, words,
                                     scanners, cdiv(n_rows, max(scanners, 1)), HAS_ROW_MASK=row_mask is not None,
                                     CHUNK=chunk, PAIRWISE_MAX=pairwise_max, SCAN_BLOCK=_SCAN_BLOCK, **opts)
    flags = flags.view(torch.bool)
    return ints[0], ints[1], flags[0], flags[1], ints[2], z


@triton.jit
def _lse_kernel(z_ptr, ok_ptr, off_ptr, rows_ptr, row_mask_ptr, dense_ptr, stats_ptr, flags_ptr, n_ids, n_rows,
                scale, HAS_ROWS: tl.constexpr, HAS_ROW_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Per row: M = max over its keep set (ids and target), S = Σ e^(z - M) in fixed point (int64, exact), the keep
    log-prob, and the row's log-prob (the dense one where the row has no keep set)."""
    c = tl.program_id(0)
    r = tl.load(rows_ptr + c) if HAS_ROWS else c
    start, end = _row_range(off_ptr, r, n_ids)
    keep = end > start
    if HAS_ROW_MASK:
        keep &= tl.load(row_mask_ptr + r) != 0
    t = n_ids + c
    z_t = tl.where(tl.load(ok_ptr + t) != 0, tl.load(z_ptr + t), float("-inf"))
    m = z_t
    for j0 in range(start, end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        jm = j < end
        z = tl.where((tl.load(ok_ptr + j, mask=jm, other=0) != 0) & jm, tl.load(z_ptr + j, mask=jm, other=0.0),
                     float("-inf"))
        m = tl.maximum(m, tl.max(z, 0))
    m = tl.where((m == m) & (tl.abs(m) < float("inf")), m, 0.0)
    total = _fixed_term(z_t, m, scale)
    for j0 in range(start, end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        jm = j < end
        z = tl.where((tl.load(ok_ptr + j, mask=jm, other=0) != 0) & jm, tl.load(z_ptr + j, mask=jm, other=0.0),
                     float("-inf"))
        total += tl.sum(_fixed_term(z, m, scale), 0)
    s = (total.to(tl.float64) / scale).to(tl.float32)
    defined = keep & (s > 0)
    log_s = tl.log(tl.where(defined, s, 1.0))
    lp = tl.where(defined, (z_t - m) - log_s, float("-inf"))
    tl.store(stats_ptr + c, m)
    tl.store(stats_ptr + n_rows + c, log_s)
    tl.store(stats_ptr + 2 * n_rows + c, lp)
    tl.store(stats_ptr + 3 * n_rows + c, tl.where(keep, lp, tl.load(dense_ptr + c)))
    tl.store(flags_ptr + c, defined.to(tl.uint8))
    tl.store(flags_ptr + n_rows + c, keep.to(tl.uint8))


@triton.jit
def _fixed_term(z, m, scale):
    """e^(z - m) in [0, 1] (0 for -inf and NaN) as an int64 multiple of 1 / scale, truncated."""
    e = tl.exp(z - m)
    e = tl.where(e == e, tl.minimum(tl.maximum(e, 0.0), 1.0), 0.0)
    return (e * scale).to(tl.int64)


def log_probs(z, ent: Entries, dense_log_prob, fixed_bits):
    """(shift, log_sum, defined, keep_row, keep log_prob, the rows' log-prob) per row (the kernel path of
    sparse_keep.keep_state), from the entries' kept logits `z`."""
    ok, offsets, rows, row_mask, n_ids = ent.ok, ent.offsets, ent.rows, ent.row_mask, ent.n_ids
    n_rows = dense_log_prob.numel()
    stats = torch.empty((4, n_rows), dtype=torch.float32, device=z.device)
    flags = torch.empty((2, n_rows), dtype=torch.uint8, device=z.device)
    if n_rows:
        _launch(_lse_kernel)((n_rows,), z, _flags(ok), offsets, rows if rows is not None else offsets,
                             _flags(row_mask) if row_mask is not None else offsets, dense_log_prob.contiguous(),
                             stats, flags, n_ids, n_rows, float(2 ** fixed_bits), HAS_ROWS=rows is not None,
                             HAS_ROW_MASK=row_mask is not None, BLOCK=_ROW_BLOCK)
    flags = flags.view(torch.bool)
    return stats[0], stats[1], flags[0], flags[1], stats[2], stats[3]


@triton.jit
def _keep_grad_kernel(out_ptr, z_ptr, row_ptr, col_ptr, local_ptr, keep_shift_ptr, keep_log_sum_ptr, defined_ptr,
                      g_lp_ptr, g_ent_ptr, shift_ptr, log_sum_ptr, mean_ptr, n, n_ids, r0, r1, stride_r, stride_c,
                      inv_temperature, MODE: tl.constexpr, BLOCK: tl.constexpr, ROUND_BF16_BY_BITS: tl.constexpr):
    """Per entry this rank holds, of rows r0 .. r1 - 1 whose keep set has mass: c = inv_t * g_lp (delta - q).
    MODE 0: c into a [E] fp32 vector (0 elsewhere); MODE 1 (the logits op): out[row, col] = c + inv_t * g_ent p
    (mean - d), rounded once to out's dtype; MODE 2: the same without the entropy term."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = j < n
    r = tl.load(row_ptr + j, mask=m, other=0)
    use = m & (tl.load(local_ptr + j, mask=m, other=0) != 0) & (r >= r0) & (r < r1)
    use &= tl.load(defined_ptr + r, mask=use, other=0) != 0
    z = tl.load(z_ptr + j, mask=use, other=0.0)
    q = tl.exp(z - tl.load(keep_shift_ptr + r, mask=use, other=0.0)
               - tl.load(keep_log_sum_ptr + r, mask=use, other=0.0))
    delta = tl.where(j >= n_ids, 1.0, 0.0)
    value = (tl.load(g_lp_ptr + r - r0, mask=use, other=0.0) * (delta - q)) * inv_temperature
    if MODE == 0:
        tl.store(out_ptr + j, tl.where(use, value, 0.0), mask=m)
    else:
        if MODE == 1:
            d = z - tl.load(shift_ptr + r, mask=use, other=0.0)
            p = tl.exp(d - tl.load(log_sum_ptr + r, mask=use, other=0.0))
            ent = tl.load(g_ent_ptr + r, mask=use, other=0.0) * p * (tl.load(mean_ptr + r, mask=use, other=0.0) - d)
            value += tl.where(p > 0, ent, 0.0) * inv_temperature
        c = tl.load(col_ptr + j, mask=use, other=0)
        store_rounded(out_ptr + r * stride_r + c * stride_c, value, use, ROUND_BF16_BY_BITS)


def _grad_launch(out, state: KeepState, g_lp, r0, r1, mode, full: Optional[FullStats] = None):
    g_ent, shift, log_sum, mean = full if full is not None else (None, None, None, None)
    ent = state.ent
    n = ent.row.numel()
    dummy = state.z
    _launch(_keep_grad_kernel)((cdiv(max(n, 1), _ENTRY_BLOCK),),
                               out, state.z, ent.row, state.col, _flags(state.local), state.shift,
                               state.log_sum, _flags(state.defined), g_lp, g_ent if g_ent is not None else dummy,
                               shift if shift is not None else dummy, log_sum if log_sum is not None else dummy,
                               mean if mean is not None else dummy, n, ent.n_ids, r0, r1, out.stride(0) if mode else 0,
                               out.stride(1) if mode else 0, state.inv_temperature, MODE=mode, BLOCK=_ENTRY_BLOCK,
                               ROUND_BF16_BY_BITS=round_bf16_by_bits(out.dtype))


def coefficients(state, g_lp, r0, r1):
    """[E] fp32 inv_t * g (delta - q) on the kept entries of rows r0 .. r1 - 1 whose keep set has mass, else 0."""
    out = torch.empty_like(state.z)
    _grad_launch(out, state, g_lp.to(torch.float32).contiguous(), r0, r1, 0)
    return out


def write_logits_grad(out, state: KeepState, g_lp, full: FullStats) -> None:
    """The logits op's kept entries of its gradient `out`, written once (sparse_keep.logits_backward)."""
    with_entropy = full.g_ent is not None and full.mean is not None
    _grad_launch(out, state, g_lp, 0, state.ent.n_rows, 1 if with_entropy else 2, full)


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


def keep_dots(hidden, weight, ent: Entries, inv_temperature, z) -> None:
    """z[e] = inv_t * (hidden[row_e] . weight[col_e]) in fp32 for local entries, 0 for the others (z [E] fp32)."""
    order, row, col, local = ent.order, ent.row, ent.col, ent.local
    n = z.numel()
    hidden, weight = hidden.contiguous(), weight.contiguous()
    width = hidden.shape[1]
    if interpreting():
        block_e, block_k, opts = 64, min(_INTERPRET_MAX_H, triton.next_power_of_2(width)), {}
    else:
        block_e, block_k, opts = _DOT_BLOCK_E, _DOT_BLOCK_K, {"num_warps": _DOT_WARPS}
    _launch(_keep_dots_kernel)((cdiv(n, block_e),), hidden, weight, order, row, col, _flags(local), z, n, width,
                               hidden.stride(0), weight.stride(0), inv_temperature, BLOCK_E=block_e,
                               BLOCK_K=block_k, **opts)


@triton.jit
def _keep_dx_kernel(dx_ptr, w_ptr, coef_ptr, col_ptr, local_ptr, off_ptr, rows_ptr, n_ids, r0, width, stride_dx,
                    stride_w, HAS_ROWS: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr):
    i = tl.program_id(0)
    r = r0 + i
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < width
    call_row = tl.load(rows_ptr + r) if HAS_ROWS else r
    start, end = _row_range(off_ptr, call_row, n_ids)
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


def keep_dx(dx, weight, coef, ent: Entries, r0, r1) -> None:
    """dx[r - r0] += Σ_e coef_e weight[col_e] over row r's local entries (CSR order, then its target), rows r0..r1
    (ent.rows: their call rows where compacted, else None)."""
    col, local, offsets, rows, n_ids = ent.col, ent.local, ent.offsets, ent.rows, ent.n_ids
    weight = weight.contiguous()
    assert dx.dtype == torch.float32 and dx.stride(1) == 1
    width = weight.shape[1]
    block_h = _block_h(width)
    block_j = _INTERPRET_BLOCK_J if interpreting() else _SUM_BLOCK_J
    opts = {} if interpreting() else {"num_warps": _SUM_WARPS}
    _launch(_keep_dx_kernel)((r1 - r0, cdiv(width, block_h)), dx, weight, coef, col, _flags(local), offsets,
                             rows if rows is not None else offsets, n_ids, r0, width,
                             dx.stride(0), weight.stride(0), HAS_ROWS=rows is not None,
                             BLOCK_J=block_j, BLOCK_H=block_h, **opts)


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
def _keep_dw_kernel(dw_ptr, h_ptr, coef_ptr, order_ptr, row_ptr, col_ptr, gid_ptr, local_ptr, run_end_ptr, n_entries,
                    vocab_start,
                    shard_end, width, stride_dw, stride_h, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
                    ROUND_BF16_BY_BITS: tl.constexpr):
    # The runs of equal ids that start in this tile of the sorted entries: an in-tile segmented scan, and the tile's
    # last run summed on past the tile (its owner); the tile's leading entries of an earlier run are its owner's.
    first = tl.program_id(0) * BLOCK_J
    j = first + tl.arange(0, BLOCK_J)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < width
    e, gid, in_shard = _sorted_entries(order_ptr, gid_ptr, j, n_entries, vocab_start, shard_end)
    prev_e, prev_gid, prev_in = _sorted_entries(order_ptr, gid_ptr, j - 1, n_entries, vocab_start, shard_end)
    next_e, next_gid, next_in = _sorted_entries(order_ptr, gid_ptr, j + 1, n_entries, vocab_start, shard_end)
    start = in_shard & ((j == 0) | (gid != prev_gid))
    owned = in_shard & (tl.cumsum(start.to(tl.int32), 0) > 0)
    use = owned & (tl.load(local_ptr + e, mask=owned, other=0) != 0)
    c = tl.load(coef_ptr + e, mask=use, other=0.0)
    r = tl.load(row_ptr + e, mask=use, other=0)
    x = tl.load(h_ptr + r[:, None] * stride_h + h[None, :], mask=use[:, None] & hm[None, :], other=0.0)
    flags = start.to(tl.int32)[:, None] + tl.zeros([BLOCK_J, BLOCK_H], tl.int32)
    run_sum, run_flags = tl.associative_scan((c[:, None] * x.to(tl.float32), flags), 0, _segment_sum)
    ends = owned & (gid != next_gid)
    last = j == first + BLOCK_J - 1
    carry = tl.sum((owned & last & (gid == next_gid)).to(tl.int32), 0) != 0
    # The tile's last run, where it goes on past the tile: on to its end (run_end: the next run's first position).
    cont_end = tl.where(carry, tl.load(run_end_ptr + tl.minimum(first + BLOCK_J - 1, n_entries - 1)), 0)
    more = tl.zeros([BLOCK_H], tl.float32)
    for k in range(first + BLOCK_J, cont_end, BLOCK_J):
        j2 = k + tl.arange(0, BLOCK_J)
        e2 = tl.load(order_ptr + j2, mask=j2 < cont_end, other=0)
        use2 = (j2 < cont_end) & (tl.load(local_ptr + e2, mask=j2 < cont_end, other=0) != 0)
        c2 = tl.load(coef_ptr + e2, mask=use2, other=0.0)
        r2 = tl.load(row_ptr + e2, mask=use2, other=0)
        x2 = tl.load(h_ptr + r2[:, None] * stride_h + h[None, :], mask=use2[:, None] & hm[None, :], other=0.0)
        more += tl.sum(c2[:, None] * x2.to(tl.float32), 0)
    store = owned & (ends | last)
    col = tl.load(col_ptr + e, mask=store, other=0)
    total = run_sum + tl.where(last[:, None], more[None, :], 0.0)
    ptr = dw_ptr + col.to(tl.int64)[:, None] * stride_dw + h[None, :]
    m = store[:, None] & hm[None, :]
    store_rounded(ptr, tl.load(ptr, mask=m, other=0.0).to(tl.float32) + total, m, ROUND_BF16_BY_BITS)


def keep_dw(dw, hidden, coef, ent: Entries) -> None:
    """dw[v] = round(dw[v] + Σ coef_e hidden[row_e]) for each id v this rank holds (ent.col its local row), the sum
    in fp32 over v's entries in (id, row) order (ent.order), in fixed tiles of that order: the same at every TP
    size."""
    order, row, gid, col, local = ent.order, ent.row, ent.gid, ent.col, ent.local
    vocab_start, n_valid = ent.vocab_start, ent.n_valid
    hidden = hidden.contiguous()
    assert dw.stride(1) == 1
    n = order.numel()
    # Each sorted position's run end: the first later position holding another id (n past the last run).
    gid_s = gid[order]
    positions = torch.arange(1, n + 1, device=dw.device)
    next_start = torch.where(torch.cat([gid_s[1:] != gid_s[:-1], gid_s.new_ones(1, dtype=torch.bool)]), positions, n)
    run_end = torch.cummin(next_start.flip(0), 0).values.flip(0)
    width = hidden.shape[1]
    block_h = _block_h(width)
    if interpreting():
        block_j, opts = _INTERPRET_BLOCK_J, {}
    else:
        block_j, opts = _DW_BLOCK_J, {"num_warps": _SUM_WARPS}
    _launch(_keep_dw_kernel)((cdiv(n, block_j), cdiv(width, block_h)),
                             dw, hidden, coef, order, row, col, gid, _flags(local), run_end, n, vocab_start,
                             vocab_start + n_valid, width, dw.stride(0), hidden.stride(0), BLOCK_J=block_j,
                             BLOCK_H=block_h, ROUND_BF16_BY_BITS=round_bf16_by_bits(dw.dtype), **opts)


@triton.jit
def _add_kernel(out_ptr, row_ptr, col_ptr, value_ptr, write_ptr, n, stride_r, stride_c, BLOCK: tl.constexpr,
                ROUND_BF16_BY_BITS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    w = (tl.load(write_ptr + offs, mask=m, other=0) != 0) & m
    r = tl.load(row_ptr + offs, mask=w, other=0)
    c = tl.load(col_ptr + offs, mask=w, other=0)
    ptr = out_ptr + r * stride_r + c * stride_c
    v = tl.load(value_ptr + offs, mask=w, other=0.0) + tl.load(ptr, mask=w, other=0.0).to(tl.float32)
    store_rounded(ptr, v, w, ROUND_BF16_BY_BITS)


def add_rows_cols(out, row, col, value, write) -> None:
    """out[row_e, col_e] = round(out[row_e, col_e] + value_e) where write_e (each position written by one entry)."""
    n = value.numel()
    block = min(_SCATTER_BLOCK, triton.next_power_of_2(max(n, 1)))
    _launch(_add_kernel)((cdiv(n, block),), out, row, col, value.contiguous(), _flags(write), n, out.stride(0),
                         out.stride(1), BLOCK=block, ROUND_BF16_BY_BITS=round_bf16_by_bits(out.dtype))
