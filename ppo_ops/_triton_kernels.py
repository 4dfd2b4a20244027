"""Triton kernels of the Triton backend: segment partials (two forward variants) and the fused gradient (backward).

Forward: the variants take the same arguments, run on the grid (row, vocabulary segment) and write only the
[nseg, 5, T] fp32 partials; the launcher picks one by name (LaunchConfig.kernel in _triton_backend.py).
Row mask (HAS_ROW_MASK): a dropped row's program takes zero columns (seg_end = seg_start) and target -1, so its tile
loop runs no iteration, its tail and target loads are masked off, and it reads nothing but its mask byte and target;
its epilogue then stores exactly the neutral partials (MAX -inf, sums 0, TARGET_Z -inf). No early return: every
program runs the same code and stores the same channels.
"tiles", `forward_partials_kernel`:
    each program streams its segment's columns in BLOCK_V tiles, in the logits' own dtype, and keeps four fp32 scalars
    online: the max m, the sum-exp s, the kept sum-exp sk and the entropy sum w = sum exp(z - m) * (z - m). When a tile
    raises the max from m_old to m_new, everything is rescaled by alpha = exp(m_old - m_new) and
    w_new = alpha * (w + (m_old - m_new) * s) + tile terms. The target's logit is one scalar load. It writes only the
    [nseg, 5, T] fp32 partials. The tile sequence is relative to the segment start and BLOCK_V depends only on the
    segment length and dtype, so a (row, segment) gives the same bits whichever rank, or TP size, holds the segment.
    Per tile it needs one block-wide max and two or three block-wide sums, each a cross-warp reduction with barriers.
"lanes", `forward_lanes_kernel`:
    the same partials without any cross-lane reduction inside the tile loop. Each of the BLOCK_V lanes (column offset
    within a tile) keeps its own online state, vectors in registers: max m, sum-exp s, entropy sum w (and kept sum-exp
    sk), all relative to the lane's max. An element z updates its lane with one exp: with d = z - m and e = exp(-|d|),
        z > m (new lane max):  s = e*s + 1,  w = e*(w - d*s_old) = e*w + (e*(-d))*s_old,  sk = e*sk + kept,  m = z;
        otherwise:             s = s + e,    w = w + e*d,                                 sk = sk + e*kept,
    written with two shared selects (the old sums' scale e or 1, the new term's weight 1 or e): compiled for sm_90 the
    loop is about 15 instructions per element with no barrier (bf16, no keep mask; "tiles": about 22 plus four
    barriers per tile); the exp is a flush-to-zero ex2 (see `_exp_nonpositive`).
    The lanes are merged once per segment with the formulas of _row_stats.py (M = max m, a = exp(m - M),
    S = sum a*s, W = sum a*(w + (m - M)*s)). An empty lane has m = -FLT_MAX (a finite sentinel, so never
    -inf - -inf) and s = 0; it drops out of the merge by s == 0, and e*d is taken with d clamped to >= -FLT_MAX, so a
    -inf logit (e = 0) adds 0, not 0 * -inf. A NaN logit makes its lane's s NaN; +inf makes M +inf and S NaN.
    Whole tiles load without masks, each issuing the next tile's load before its own math (register double
    buffering); only the segment's last, partial tile is masked (memory) and selected (padding).
    No log2(e) is folded into the temperature scale (a base-2 z would save one multiply, with a temperature only):
    MAX must be exactly fp32(logit) * inv_t, and the exponent is formed from d = z - m of that z, then times log2(e),
    so its error is relative to |d|, not to |z|.
    Bits: the tile sequence and the lane of a column depend only on its offset in the segment, so TP invariance holds
    as for "tiles" (same arguments, same alignment scheme, same compiled code at every TP size).
Backward, `backward_grad_kernel`, grid (row, column tile):
    with the global row stats relative to the row max M (the core sanitises rows without mass to 0 and zeroes their
    upstream gradients), d = z - M, p = exp(d - log_sum), q = 1[keep or target] * exp(d - log_sum_kept) (q = p without
    a keep mask) and grad = inv_t * (g_lp * (1[c == target] - q) + g_ent * p * (mean_shifted - d)), stored in the
    output's dtype. Every element is read before it is written by the same program, so `out` may alias the logits.
    Rows the row mask drops get zeros: their logits and keep-mask loads are masked off (their per-row scalars, in
    bounds, are read and selected away).

-inf guards ("tiles" and backward; "lanes" above): the reference point of exp() is 0 while the running max is -inf, so
no exp(-inf - -inf); a factor that may be -inf is replaced by 0 where its partner is 0 (no 0 * inf). Padding columns
are loaded when their vector is and then selected away. Row offsets are int64.
"""

import triton
import triton.language as tl

from ppo_ops import _row_stats

# Channel order of the partials, from the core's single definition.
_MAX = tl.constexpr(_row_stats.MAX)
_SUMEXP = tl.constexpr(_row_stats.SUMEXP)
_KEPT_SUMEXP = tl.constexpr(_row_stats.KEPT_SUMEXP)
_ENT_SUM = tl.constexpr(_row_stats.ENT_SUM)
_TARGET_Z = tl.constexpr(_row_stats.TARGET_Z)
_NUM_PARTIALS = tl.constexpr(_row_stats.NUM_PARTIALS)


# The row stride (V_local) and n_valid differ between TP sizes: they must not change the compiled code (vector width,
# hence register layout, hence the order of the tile sums). Their alignment comes from the ALIGN constexprs instead,
# which the launcher derives from the segment length and dtype, the same at every TP size.
FORWARD_UNALIGNED_ARGS = ["n_valid", "logits_row_stride", "keep_row_stride"]


@triton.jit
def _row_extent(row_mask_ptr, target_ptr, row, seg_start, seg_len, n_valid, HAS_ROW_MASK: tl.constexpr):
    """(end of the segment's valid columns, target column) of a forward program. A row the mask drops gets zero
    columns and target -1: the kernel then reads none of its logits and stores the neutral partials (no early return,
    so every program runs the same code)."""
    seg_end = tl.minimum(seg_start + seg_len, n_valid)
    target = tl.load(target_ptr + row)
    if HAS_ROW_MASK:
        kept = tl.load(row_mask_ptr + row) != 0
        seg_end = tl.where(kept, seg_end, seg_start)
        target = tl.where(kept, target, -1)
    return seg_end, target


@triton.jit(do_not_specialize_on_alignment=FORWARD_UNALIGNED_ARGS)
def forward_partials_kernel(
    # data ptrs
    logits_ptr,  # [T, V_local] logits (fp32/bf16/fp16), READ-ONLY
    row_mask_ptr,  # [T] uint8 row mask, 0 = dropped row (read only when HAS_ROW_MASK)
    target_ptr,  # [T] int64 target column in this shard, -1 where it lives on another rank
    keep_ptr,  # [T, V_local] uint8 keep mask, READ-ONLY (read only when HAS_KEEP)
    out_ptr,  # [nseg, 5, T] fp32 partials, WRITTEN
    # shapes
    num_rows,  # T
    n_valid,  # columns >= n_valid are padding
    seg_len,  # columns per segment
    # strides
    logits_row_stride,
    keep_row_stride,
    # constants
    inv_temperature,  # fp32 scalar, used only when SCALE
    HAS_ROW_MASK: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,  # a multiple of both ALIGNs
    LOGITS_ALIGN: tl.constexpr,  # divides seg_len and logits_row_stride
    KEEP_ALIGN: tl.constexpr,  # divides seg_len and keep_row_stride
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    seg_start = tl.multiple_of(seg * seg_len, LOGITS_ALIGN)
    seg_end, target = _row_extent(row_mask_ptr, target_ptr, row, seg_start, seg_len, n_valid, HAS_ROW_MASK)
    mem_end = seg_start + seg_len  # loads are masked by the segment (TP-independent), padding by a select
    row_ptr = logits_ptr + tl.multiple_of(row * logits_row_stride, LOGITS_ALIGN)
    keep_row_ptr = keep_ptr + tl.multiple_of(row * keep_row_stride, KEEP_ALIGN)

    neg_inf = float("-inf")
    m = tl.full([], neg_inf, tl.float32)
    s = tl.zeros([], tl.float32)
    sk = tl.zeros([], tl.float32)
    w = tl.zeros([], tl.float32)
    for tile in range(0, tl.cdiv(seg_end - seg_start, BLOCK_V)):  # (a hint on a loop variable does not compile)
        cols = seg_start + tile * BLOCK_V + tl.arange(0, BLOCK_V)
        in_mem = cols < mem_end
        z = tl.load(row_ptr + cols, mask=in_mem, other=neg_inf).to(tl.float32)
        if SCALE:
            z = z * inv_temperature
        z = tl.where(cols < seg_end, z, neg_inf)  # padding has no mass, whatever it holds
        m_new = tl.maximum(m, tl.max(z, axis=0))
        ref = tl.where(m_new == neg_inf, 0.0, m_new)  # finite reference point: no exp(-inf - -inf)
        alpha = tl.exp(m - ref)  # 0 while m is still -inf
        e = tl.exp(z - ref)  # 0 for -inf and out-of-segment columns
        if WITH_ENTROPY:
            shift = tl.where(m == neg_inf, 0.0, m - ref)  # s == 0 then: no -inf * 0
            ez = e * tl.where(e == 0.0, 0.0, z - ref)  # a -inf logit contributes 0, not 0 * -inf
            w = alpha * (w + shift * s) + tl.sum(ez, axis=0)
        if HAS_KEEP:
            keep = tl.load(keep_row_ptr + cols, mask=in_mem, other=0)
            kept = (keep != 0) | (cols == target)
            sk = sk * alpha + tl.sum(tl.where(kept, e, 0.0), axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new

    # The target's logit, if it lies in this segment's valid columns: one scalar load.
    target_here = (target >= seg_start) & (target < seg_end)
    zt = tl.load(row_ptr + tl.where(target_here, target, 0), mask=target_here, other=neg_inf).to(tl.float32)
    if SCALE:
        zt = zt * inv_temperature
    if not HAS_KEEP:
        sk = s
    # A NaN or +inf logit makes s NaN (exp(nan), exp(inf - inf)), while tl.max drops NaN: report it through MAX,
    # where the core looks for bad input (ppo_ops/_function.py).
    m = tl.where(s != s, float("nan"), m)

    out = out_ptr + seg.to(tl.int64) * (_NUM_PARTIALS * num_rows) + row
    tl.store(out + _MAX * num_rows, m)
    tl.store(out + _SUMEXP * num_rows, s)
    tl.store(out + _KEPT_SUMEXP * num_rows, sk)
    tl.store(out + _ENT_SUM * num_rows, w)
    tl.store(out + _TARGET_Z * num_rows, zt)


_FLT_MAX = tl.constexpr(3.4028234663852886e38)  # largest finite fp32: the lanes' empty-state max
_LOG2E = tl.constexpr(1.4426950408889634)
# Compiled (not interpreted) kernels: Triton decorates every kernel of this module in the same mode.
_COMPILED = tl.constexpr(type(forward_partials_kernel).__name__ != "InterpretedFunction")


@triton.jit
def _exp_nonpositive(x):
    """exp(x) for x <= 0 (or NaN). Compiled: one MUFU.EX2 with flush-to-zero (results below 2^-126 become 0, nothing
    next to a lane max of 1), where tl.exp's ex2.approx.f32 adds a denormal fix-up of three instructions. Under the
    interpreter, which cannot run PTX: tl.exp."""
    if _COMPILED:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * _LOG2E], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp(x)


@triton.jit
def _lanes_update(z, keep, is_target, m, s, sk, w, HAS_KEEP: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """One tile's update of the per-lane online state (m, s, sk, w) by the fp32 z of its columns (-inf for padding):
    element-wise, one exp per element. `keep` and `is_target` are read only when HAS_KEEP."""
    new = z > m  # a new lane max (False for -inf and NaN)
    d = z - m  # m is finite (sentinel -FLT_MAX): -inf for a -inf logit, never NaN for a non-NaN one
    neg_abs = -tl.abs(d)  # the exponent relative to the larger of z and m
    e = _exp_nonpositive(neg_abs)  # 0 for |d| = inf, NaN for a NaN logit
    old_scale = tl.where(new, e, 1.0)  # rescales the lane's old sums
    new_weight = tl.where(new, 1.0, e)  # z's own term relative to the (new) lane max
    if WITH_ENTROPY:
        ed = e * tl.maximum(neg_abs, -_FLT_MAX)  # e = 0 where neg_abs = -inf: 0, not 0 * -inf
        # new: e*w - d*e*s_old (old terms shifted by -d, z's own term is 0); otherwise: w + e*d
        w = old_scale * w + ed * tl.where(new, s, 1.0)
    if HAS_KEEP:
        kept = tl.where((keep != 0) | is_target, new_weight, 0.0)
        sk = old_scale * sk + kept
    s = old_scale * s + new_weight
    m = tl.where(new, z, m)
    return m, s, sk, w


@triton.jit(do_not_specialize_on_alignment=FORWARD_UNALIGNED_ARGS)
def forward_lanes_kernel(
    logits_ptr, row_mask_ptr, target_ptr, keep_ptr, out_ptr,  # as forward_partials_kernel
    num_rows, n_valid, seg_len,
    logits_row_stride, keep_row_stride,
    inv_temperature,
    HAS_ROW_MASK: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LOGITS_ALIGN: tl.constexpr,
    KEEP_ALIGN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    seg_start = tl.multiple_of(seg * seg_len, LOGITS_ALIGN)
    seg_end, target = _row_extent(row_mask_ptr, target_ptr, row, seg_start, seg_len, n_valid, HAS_ROW_MASK)
    mem_end = seg_start + seg_len
    row_ptr = logits_ptr + tl.multiple_of(row * logits_row_stride, LOGITS_ALIGN)
    keep_row_ptr = keep_ptr + tl.multiple_of(row * keep_row_stride, KEEP_ALIGN)

    m = tl.full([BLOCK_V], -_FLT_MAX, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    sk = tl.zeros([BLOCK_V], tl.float32)
    w = tl.zeros([BLOCK_V], tl.float32)
    offs = tl.arange(0, BLOCK_V)
    n_cols = tl.maximum(seg_end - seg_start, 0)
    n_full = n_cols // BLOCK_V
    # Whole tiles of valid columns: no mask, no select, and the next tile's load is issued before this tile's math
    # (register double buffering: more bytes in flight per SM). The prefetch after the last whole tile re-reads it.
    last = tl.maximum(n_full - 1, 0)
    first = offs < tl.minimum(n_full, 1) * BLOCK_V  # no whole tile: nothing to prefetch
    x_next = tl.load(row_ptr + seg_start + offs, mask=first, other=0.0)
    if HAS_KEEP:
        k_next = tl.load(keep_row_ptr + seg_start + offs, mask=first, other=0)
    else:
        k_next = x_next
    for tile in range(0, n_full):
        x = x_next
        k = k_next
        ahead = seg_start + tl.minimum(tile + 1, last) * BLOCK_V
        x_next = tl.load(row_ptr + ahead + offs)
        if HAS_KEEP:
            k_next = tl.load(keep_row_ptr + ahead + offs)
        z = x.to(tl.float32)
        if SCALE:
            z = z * inv_temperature
        m, s, sk, w = _lanes_update(z, k, offs == target - (seg_start + tile * BLOCK_V), m, s, sk, w, HAS_KEEP,
                                    WITH_ENTROPY)
    tail = seg_start + n_full * BLOCK_V
    if tail < seg_end:  # the segment's partial last tile: loads masked by the segment, padding selected away
        in_mem = offs < mem_end - tail
        z = tl.load(row_ptr + tail + offs, mask=in_mem, other=float("-inf")).to(tl.float32)
        if SCALE:
            z = z * inv_temperature
        z = tl.where(offs < seg_end - tail, z, float("-inf"))
        if HAS_KEEP:
            k = tl.load(keep_row_ptr + tail + offs, mask=in_mem, other=0)
        else:
            k = z
        m, s, sk, w = _lanes_update(z, k, offs == target - tail, m, s, sk, w, HAS_KEEP, WITH_ENTROPY)

    _merge_lanes_and_store(m, s, sk, w, row_ptr, target, seg_start, seg_end, seg, row, num_rows, out_ptr,
                           inv_temperature, HAS_KEEP, WITH_ENTROPY, SCALE)


@triton.jit
def _merge_lanes_and_store(m, s, sk, w, row_ptr, target, seg_start, seg_end, seg, row, num_rows, out_ptr,
                           inv_temperature, HAS_KEEP: tl.constexpr, WITH_ENTROPY: tl.constexpr, SCALE: tl.constexpr):
    """Merges per-lane online states (m, s, sk, w: vectors, each sum relative to its lane's max m) into the segment's
    partials with the formulas of _row_stats.merge_partials, adds the target's logit and stores the five channels.
    Lanes without a finite value have s == 0 and drop out."""
    neg_inf = float("-inf")
    present = s != 0.0  # a NaN s stays present, so it reaches the sums
    m_top = tl.max(tl.where(present, m, neg_inf), axis=0)
    ref = tl.where(m_top == neg_inf, 0.0, m_top)  # finite reference point when no lane has mass
    shift = tl.where(present, m - ref, 0.0)  # <= 0
    a = tl.where(present, tl.exp(shift), 0.0)
    s_seg = tl.sum(a * s, axis=0)
    if WITH_ENTROPY:
        w_seg = tl.sum(a * (w + shift * s), axis=0)
    else:
        w_seg = tl.zeros([], tl.float32)
    if HAS_KEEP:
        sk_seg = tl.sum(a * sk, axis=0)
    else:
        sk_seg = s_seg

    target_here = (target >= seg_start) & (target < seg_end)
    zt = tl.load(row_ptr + tl.where(target_here, target, 0), mask=target_here, other=neg_inf).to(tl.float32)
    if SCALE:
        zt = zt * inv_temperature
    # NaN or +inf logits make s NaN (tl.max may drop NaN): report it through MAX, where the core looks.
    m_top = tl.where(s_seg != s_seg, float("nan"), m_top)

    out = out_ptr + seg.to(tl.int64) * (_NUM_PARTIALS * num_rows) + row
    tl.store(out + _MAX * num_rows, m_top)
    tl.store(out + _SUMEXP * num_rows, s_seg)
    tl.store(out + _KEPT_SUMEXP * num_rows, sk_seg)
    tl.store(out + _ENT_SUM * num_rows, w_seg)
    tl.store(out + _TARGET_Z * num_rows, zt)


@triton.jit
def _chunks_update(z, keep, is_target, m, s, sk, w, HAS_KEEP: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """One tile's update of the per-lane online state by z [LANES, CHUNK] (-inf for padding): each lane first takes
    the max of its CHUNK columns (in-thread), rescales its sums once, then adds the chunk with one exp per element."""
    m_new = tl.maximum(m, tl.max(z, axis=1))  # finite (sentinel -FLT_MAX) unless +inf; tl.max may drop NaN
    shift = m - m_new  # <= 0; -inf only when m_new is +inf (bad input, reported through s)
    alpha = _exp_nonpositive(shift)  # rescales the old sums: 1 while the lane stays empty
    d = z - m_new[:, None]  # <= 0; -inf for a -inf logit, NaN for NaN or +inf
    e = _exp_nonpositive(d)
    if WITH_ENTROPY:
        # old terms shift by (m - m_new); a -inf logit adds 0 (d clamped), not 0 * -inf
        w = alpha * (w + shift * s) + tl.sum(e * tl.maximum(d, -_FLT_MAX), axis=1)
    if HAS_KEEP:
        sk = alpha * sk + tl.sum(tl.where((keep != 0) | is_target, e, 0.0), axis=1)
    s = alpha * s + tl.sum(e, axis=1)
    return m_new, s, sk, w


@triton.jit(do_not_specialize_on_alignment=FORWARD_UNALIGNED_ARGS)
def forward_chunks_kernel(
    logits_ptr, row_mask_ptr, target_ptr, keep_ptr, out_ptr,  # as forward_partials_kernel
    num_rows, n_valid, seg_len,
    logits_row_stride, keep_row_stride,
    inv_temperature,
    HAS_ROW_MASK: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LOGITS_ALIGN: tl.constexpr,
    KEEP_ALIGN: tl.constexpr,
    CHUNK: tl.constexpr,  # contiguous columns per lane and tile; divides BLOCK_V
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    seg_start = tl.multiple_of(seg * seg_len, LOGITS_ALIGN)
    seg_end, target = _row_extent(row_mask_ptr, target_ptr, row, seg_start, seg_len, n_valid, HAS_ROW_MASK)
    mem_end = seg_start + seg_len
    row_ptr = logits_ptr + tl.multiple_of(row * logits_row_stride, LOGITS_ALIGN)
    keep_row_ptr = keep_ptr + tl.multiple_of(row * keep_row_stride, KEEP_ALIGN)

    LANES: tl.constexpr = BLOCK_V // CHUNK
    m = tl.full([LANES], -_FLT_MAX, tl.float32)
    s = tl.zeros([LANES], tl.float32)
    sk = tl.zeros([LANES], tl.float32)
    w = tl.zeros([LANES], tl.float32)
    offs = tl.arange(0, LANES)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # lane-major: a lane's chunk is contiguous
    n_cols = tl.maximum(seg_end - seg_start, 0)
    n_full = n_cols // BLOCK_V
    # Whole tiles: unmasked, the next tile's load issued before this tile's math (as forward_lanes_kernel).
    last = tl.maximum(n_full - 1, 0)
    first = offs < tl.minimum(n_full, 1) * BLOCK_V
    x_next = tl.load(row_ptr + seg_start + offs, mask=first, other=0.0)
    if HAS_KEEP:
        k_next = tl.load(keep_row_ptr + seg_start + offs, mask=first, other=0)
    else:
        k_next = x_next
    for tile in range(0, n_full):
        x = x_next
        k = k_next
        ahead = seg_start + tl.minimum(tile + 1, last) * BLOCK_V
        x_next = tl.load(row_ptr + ahead + offs)
        if HAS_KEEP:
            k_next = tl.load(keep_row_ptr + ahead + offs)
        z = x.to(tl.float32)
        if SCALE:
            z = z * inv_temperature
        m, s, sk, w = _chunks_update(z, k, offs == target - (seg_start + tile * BLOCK_V), m, s, sk, w, HAS_KEEP,
                                     WITH_ENTROPY)
    tail = seg_start + n_full * BLOCK_V
    if tail < seg_end:  # the partial last tile: loads masked by the segment, padding selected away
        in_mem = offs < mem_end - tail
        z = tl.load(row_ptr + tail + offs, mask=in_mem, other=float("-inf")).to(tl.float32)
        if SCALE:
            z = z * inv_temperature
        z = tl.where(offs < seg_end - tail, z, float("-inf"))
        if HAS_KEEP:
            k = tl.load(keep_row_ptr + tail + offs, mask=in_mem, other=0)
        else:
            k = z
        m, s, sk, w = _chunks_update(z, k, offs == target - tail, m, s, sk, w, HAS_KEEP, WITH_ENTROPY)
    _merge_lanes_and_store(m, s, sk, w, row_ptr, target, seg_start, seg_end, seg, row, num_rows, out_ptr,
                           inv_temperature, HAS_KEEP, WITH_ENTROPY, SCALE)


BACKWARD_UNALIGNED_ARGS = ["n_valid"]  # only selects values: loads stay vectorised when it is odd


@triton.jit(do_not_specialize_on_alignment=BACKWARD_UNALIGNED_ARGS)
def backward_grad_kernel(
    # data ptrs
    logits_ptr,  # [T, V_local] logits, READ-ONLY unless out aliases it
    out_ptr,  # [T, V_local] gradient in out's dtype, WRITTEN (may be logits_ptr: each element is read first)
    row_mask_ptr,  # [T] uint8 row mask, 0 = dropped row: zeros, no logits read (read only when HAS_ROW_MASK)
    target_ptr,  # [T] int64 target column in this shard, -1 where it lives on another rank
    keep_ptr,  # [T, V_local] uint8 keep mask, READ-ONLY (read only when HAS_KEEP)
    shift_ptr,  # [T] fp32 row max M of z over the global vocabulary (0 for rows without mass)
    log_sum_ptr,  # [T] fp32 log sum_valid exp(z - M)
    log_sum_kept_ptr,  # [T] fp32 log sum_{kept + target} exp(z - M) (read only when HAS_KEEP)
    mean_shifted_ptr,  # [T] fp32 E_p[z] - M (read only when HAS_GENT)
    grad_logprob_ptr,  # [T] fp32 upstream gradient of log_prob (read only when HAS_GLP)
    grad_entropy_ptr,  # [T] fp32 upstream gradient of entropy (read only when HAS_GENT)
    # shapes
    v_local,
    n_valid,
    # strides
    logits_row_stride,
    out_row_stride,
    keep_row_stride,
    # constants
    inv_temperature,
    HAS_ROW_MASK: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ROUND_BF16_BY_BITS: tl.constexpr,  # bf16 output under the interpreter
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = cols < v_local
    if HAS_ROW_MASK:
        # Dropped rows read no logits and get zeros. (A vector-scalar compare: the interpreter mis-types
        # `vector & scalar` masks.)
        load = cols < tl.where(tl.load(row_mask_ptr + row) != 0, v_local, 0)
    else:
        load = in_row
    valid = load & (cols < n_valid)  # padding is read with its vector and selected away: n_valid never splits one

    z = tl.load(logits_ptr + row * logits_row_stride + cols, mask=load, other=float("-inf")).to(tl.float32)
    if SCALE:
        z = z * inv_temperature
    d = z - tl.load(shift_ptr + row)
    p = tl.exp(d - tl.load(log_sum_ptr + row))  # 0 for -inf logits

    grad = tl.zeros([BLOCK_V], tl.float32)
    if HAS_GLP:
        g_lp = tl.load(grad_logprob_ptr + row)
        is_target = cols == tl.load(target_ptr + row)
        if HAS_KEEP:
            keep = tl.load(keep_ptr + row * keep_row_stride + cols, mask=load, other=0)
            q = tl.where((keep != 0) | is_target, tl.exp(d - tl.load(log_sum_kept_ptr + row)), 0.0)
        else:
            q = p
        grad = g_lp * (tl.where(is_target, 1.0, 0.0) - q)
    if HAS_GENT:
        g_ent = tl.load(grad_entropy_ptr + row)
        mean_shifted = tl.load(mean_shifted_ptr + row)
        grad += g_ent * (p * tl.where(p == 0.0, 0.0, mean_shifted - d))  # p == 0 (d = -inf): no 0 * inf
    if SCALE:
        grad = grad * inv_temperature
    grad = tl.where(valid, grad, 0.0)  # padding and dropped rows: 0, whatever they hold (NaN included)
    if ROUND_BF16_BY_BITS:
        # Triton 3.9's interpreter truncates fp32 -> bf16 casts (compiled code rounds to nearest even, as torch does):
        # there, round to nearest even on the bits. Gradients are finite, so no NaN payload to protect.
        bits = grad.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        grad_out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        grad_out = grad.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, grad_out, mask=in_row)
