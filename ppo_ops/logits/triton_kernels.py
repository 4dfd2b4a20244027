"""Triton kernels of the Triton backend: segment partials (forward) and the fused gradient (backward).

Forward, `forward_partials_kernel`, grid (row, vocabulary segment): reads the segment's logits once, in their own
dtype, and writes only that (row, segment)'s five fp32 partials of the [nseg, 5, T] output (channels in
row_stats.py): max m, sum-exp s, kept sum-exp sk (over keep ∪ {target}), entropy sum w = Σ e^(z-m)(z-m), and the
target's logit (one scalar load).
    Lanes: a tile of BLOCK_V columns is viewed as LANES = BLOCK_V / LANE_WIDTH lanes of LANE_WIDTH contiguous columns
    (one 16-byte vector of bf16 for LANE_WIDTH = 8, so a lane's columns sit in one thread). Each lane keeps its own
    online state (m, s, sk, w; vectors in registers, sums relative to the lane's max). Per tile a lane takes the max of
    its columns (in-thread), rescales its sums once by alpha = exp(m_old - m_new), w by alpha * (w + (m_old - m_new) *
    s), then adds its columns with one exp per element: about 8 instructions per element and one rescale per LANE_WIDTH
    elements, no cross-thread reduction and no barrier inside the tile loop. At the end the lanes are merged with the
    formulas of row_stats.py (M = max m, a = exp(m - M), S = Σ a s, W = Σ a (w + (m - M) s)).
    LANE_WIDTH spans the design space: 1 is a per-column online state, BLOCK_V a block-wide online softmax
    (cross-warp reductions with barriers per tile); the launcher's choice in between is a measurement
    (docs/performance.md).
    -inf and bad values: an empty lane has m = -FLT_MAX (a finite sentinel, so never -inf - -inf) and s = 0; it drops
    out of the merge by s == 0, and e*d is taken with d clamped to >= -FLT_MAX, so a -inf logit (e = 0) adds 0, not
    0 * -inf. Maxima near fp32's limit: m_old - m_new (the sentinel, or a finite max near -FLT_MAX, minus a max near
    +FLT_MAX) may overflow to -inf; then alpha = 0 and the rescaled old entropy sum is taken as 0, never -inf * 0
    (likewise in the lane merge and the segment merge), so every finite logit gives finite results. A NaN logit makes
    its lane's s NaN (tl.max may drop it; the sum does not); +inf makes M +inf and S NaN. The core looks for both
    through MAX (NaN when S is).
    Loads: whole tiles load without masks, each issuing the next tile's load before its own math (register double
    buffering); only the segment's last, partial tile is masked (memory) and selected (padding).
    No log2(e) is folded into the temperature scale: MAX must be exactly fp32(logit) * inv_t, and the exponent is
    formed from d = z - m of that z, then times log2(e), so its error is relative to |d|, not to |z|.
    Bits: the tile sequence and the lane of a column depend only on its offset in the segment, and the compiled code
    does not depend on V_local (see FORWARD_UNALIGNED_ARGS), so a (row, segment) gives the same bits whichever rank,
    or TP size, holds the segment.
Row mask (HAS_ROW_MASK): a dropped row's program takes zero columns (seg_end = seg_start) and target -1, so its tile
loop runs no iteration, its tail and target loads are masked off, and it reads nothing but its mask byte and target;
its epilogue then stores exactly the neutral partials (MAX -inf, sums 0, TARGET_Z -inf). No early return: every
program runs the same code and stores the same channels.
Backward, `backward_grad_kernel`, grid (row, column tile):
    with the global row stats relative to the row max M (the core sanitises rows without mass to 0), d = z - M,
    p = exp(d - log_sum), q = 1[keep or target] * exp(d - log_sum_kept) (q = p without a keep mask) and
    grad = inv_t * (g_lp * (1[c == target] - q) + g_ent * p * (mean_shifted - d)), stored in the output's dtype.
    The pass runs near copy bandwidth, where each added instruction per element shows in its time, so a
    temperature (scalar or per row) is folded into per-row constants: d = z - M of the forward's rounded z,
    p = 2^fma(d, log2 e, -log_sum log2 e) with one flush-to-zero ex2, and g_lp, g_ent times inv_t once per row
    instead of the gradient per element: as few instructions per element as at temperature 1 (docs/performance.md,
    row 27). The upstream gradients count as 0 where the per-row flags say the quantity has none (log-prob -inf, no
    mass). Every element is read before it is written by the same program, so `out` may alias the logits. Rows the
    row mask drops get zeros: their logits and keep-mask loads are masked off (their per-row scalars, in bounds, are
    read and selected away). -inf guards: p == 0 entries get no entropy term (no 0 * inf).
Padding columns (>= n_valid) are loaded when their vector is and then selected away. Row offsets are int64.
Merge, `merge_partials_kernel`, grid (block of rows): the fixed-order merge of row_stats.merge_partials (the same
math, see row_stats.py) for BLOCK_R rows per program, segments merged in global order by a compile-time loop, so the
bits do not depend on which rank or TP size produced the partials; one launch where the torch-op merge costs about ten
small kernels per segment.
"""

import triton
import triton.language as tl

from ppo_ops.core import row_stats
from ppo_ops.core.row_stats import (BAD_INPUT, ENTROPY, HAS_MASS, LOG_PROB, LOG_PROB_DEFINED, LOG_SUM, LOG_SUM_KEPT,
                                    MEAN_SHIFTED, SHIFT)
from ppo_ops.core.triton_common import (CH_ENT_SUM, CH_KEPT_SUMEXP, CH_MAX, CH_SUMEXP, CH_TARGET_Z, COMPILED, FLT_MAX,
                                        NUM_PARTIALS, ex2_ftz, scaled, transformed, transformed_with_slope)

# The row stride (V_local) and n_valid differ between TP sizes: they must not change the compiled code (vector width,
# hence register layout, hence the order of the tile sums). Their alignment comes from the ALIGN constexprs instead,
# which the launcher derives from the segment length and dtype, the same at every TP size.
FORWARD_UNALIGNED_ARGS = ["n_valid", "v_local", "vocab_start", "logits_row_stride", "keep_row_stride"]


@triton.jit
def _target_column(tokens_ptr, row, vocab_start, v_local):
    """The row's target column in this shard, -1 where another rank owns it (or the id is out of range): the same as
    layout.target_columns, computed here so the core launches no torch ops for it."""
    col = tl.load(tokens_ptr + row).to(tl.int64) - vocab_start
    return tl.where((col >= 0) & (col < v_local), col, -1)


@triton.jit
def _row_extent(row_mask_ptr, tokens_ptr, row, seg_start, seg_len, n_valid, vocab_start, v_local,
                HAS_ROW_MASK: tl.constexpr):
    """(end of the segment's valid columns, target column) of a forward program. A row the mask drops gets zero
    columns and target -1: the kernel then reads none of its logits and stores the neutral partials (no early return,
    so every program runs the same code)."""
    seg_end = tl.minimum(seg_start + seg_len, n_valid)
    target = _target_column(tokens_ptr, row, vocab_start, v_local)
    if HAS_ROW_MASK:
        kept = tl.load(row_mask_ptr + row) != 0
        seg_end = tl.where(kept, seg_end, seg_start)
        target = tl.where(kept, target, -1)
    return seg_end, target


_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp_nonpositive(x):
    """exp(x) for x <= 0 (or NaN). Compiled: one MUFU.EX2 with flush-to-zero (results below 2^-126 become 0, nothing
    next to a lane max of 1), where tl.exp's ex2.approx.f32 adds a denormal fix-up of three instructions. Under the
    interpreter, which cannot run PTX: tl.exp."""
    if COMPILED:
        return ex2_ftz(x * _LOG2E)
    else:
        return tl.exp(x)


@triton.jit
def _merge_lanes_and_store(m, s, sk, w, row_ptr, target, seg_start, seg_end, seg, row, num_rows, out_ptr,
                           inv_temperature, softcap, inv_softcap, HAS_KEEP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                           SCALE: tl.constexpr, SOFTCAP: tl.constexpr):
    """Merges per-lane online states (m, s, sk, w: vectors, each sum relative to its lane's max m) into the segment's
    partials with the formulas of row_stats.merge_partials, adds the target's logit and stores the five channels.
    Lanes without a finite value have s == 0 and drop out."""
    neg_inf = float("-inf")
    present = s != 0.0  # a NaN s stays present, so it reaches the sums
    m_top = tl.max(tl.where(present, m, neg_inf), axis=0)
    ref = tl.where(m_top == neg_inf, 0.0, m_top)  # finite reference point when no lane has mass
    shift = tl.where(present, m - ref, 0.0)  # <= 0
    a = tl.where(present, tl.exp(shift), 0.0)
    s_seg = tl.sum(a * s, axis=0)
    if WITH_ENTROPY:
        w_seg = tl.sum(tl.where(a > 0.0, a * (w + shift * s), 0.0), axis=0)  # a shift of -inf (overflow) adds 0
    else:
        w_seg = tl.zeros([], tl.float32)
    if HAS_KEEP:
        sk_seg = tl.sum(a * sk, axis=0)
    else:
        sk_seg = s_seg

    target_here = (target >= seg_start) & (target < seg_end)
    zt = tl.load(row_ptr + tl.where(target_here, target, 0), mask=target_here, other=neg_inf).to(tl.float32)
    if SOFTCAP:
        zt = transformed(zt, inv_temperature, softcap, inv_softcap, SCALE, SOFTCAP)
    elif SCALE:
        zt = zt * inv_temperature  # stored as is: nothing to contract with
    # NaN or +inf logits make s NaN (tl.max may drop NaN): report it through MAX, where the core looks.
    m_top = tl.where(s_seg != s_seg, float("nan"), m_top)

    out = out_ptr + seg.to(tl.int64) * (NUM_PARTIALS * num_rows) + row
    tl.store(out + CH_MAX * num_rows, m_top)
    tl.store(out + CH_SUMEXP * num_rows, s_seg)
    tl.store(out + CH_KEPT_SUMEXP * num_rows, sk_seg)
    tl.store(out + CH_ENT_SUM * num_rows, w_seg)
    tl.store(out + CH_TARGET_Z * num_rows, zt)


@triton.jit
def _lanes_update(z, keep, is_target, m, s, sk, w, HAS_KEEP: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """One tile's update of the per-lane online state by z [LANES, LANE_WIDTH] (-inf for padding): each lane first takes
    the max of its LANE_WIDTH columns (in-thread), rescales its sums once, then adds its columns with one exp per
    element."""
    m_new = tl.maximum(m, tl.max(z, axis=1))  # finite (sentinel -FLT_MAX) unless +inf; tl.max may drop NaN
    shift = m - m_new  # <= 0; -inf only when m_new is +inf (bad input, reported through s)
    alpha = _exp_nonpositive(shift)  # rescales the old sums: 1 while the lane stays empty
    d = z - m_new[:, None]  # <= 0; -inf for a -inf logit, NaN for NaN or +inf
    e = _exp_nonpositive(d)
    if WITH_ENTROPY:
        # old terms shift by (m - m_new), dropped where alpha == 0: an empty lane's sentinel minus a new max near
        # fp32's limit overflows to -inf (and -inf * 0 is NaN); a -inf logit adds 0 (d clamped), not 0 * -inf
        w = tl.where(alpha > 0.0, alpha * (w + shift * s), 0.0) + tl.sum(e * tl.maximum(d, -FLT_MAX), axis=1)
    if HAS_KEEP:
        sk = alpha * sk + tl.sum(tl.where((keep != 0) | is_target, e, 0.0), axis=1)
    s = alpha * s + tl.sum(e, axis=1)
    return m_new, s, sk, w


@triton.jit(do_not_specialize_on_alignment=FORWARD_UNALIGNED_ARGS)
def forward_partials_kernel(
    # data ptrs
    logits_ptr,  # [T, V_local] logits (fp32/bf16/fp16), READ-ONLY
    row_mask_ptr,  # [T] uint8 row mask, 0 = dropped row (read only when HAS_ROW_MASK)
    tokens_ptr,  # [T] int64 global token ids; the target column is token - vocab_start when in [0, v_local)
    keep_ptr,  # [T, V_local] uint8 keep mask, READ-ONLY (read only when HAS_KEEP)
    out_ptr,  # [nseg, 5, T] fp32 partials, WRITTEN
    # shapes
    num_rows,  # T
    n_valid,  # columns >= n_valid are padding
    seg_len,  # columns per segment
    v_local,  # columns of this shard
    vocab_start,  # global id of this shard's first column
    # strides
    logits_row_stride,
    keep_row_stride,
    # constants
    inv_temperature,  # fp32 scalar, used only when SCALE and not ROW_SCALE
    HAS_ROW_MASK: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,  # a multiple of LANE_WIDTH and of both ALIGNs
    LOGITS_ALIGN: tl.constexpr,  # divides seg_len and logits_row_stride
    KEEP_ALIGN: tl.constexpr,  # divides seg_len and keep_row_stride
    LANE_WIDTH: tl.constexpr,  # contiguous columns per lane and tile; divides BLOCK_V
    # the logit transform beyond a scalar temperature (last, with defaults: a launch without it is unchanged)
    row_inv_temperature_ptr=None,  # [T] fp32 1 / temperature per row, read only when ROW_SCALE
    softcap=1.0,  # fp32 softcap and its fp32 reciprocal, used only when SOFTCAP
    inv_softcap=1.0,
    ROW_SCALE: tl.constexpr = False,  # the temperature per row (SCALE too)
    SOFTCAP: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    if ROW_SCALE:
        inv_temperature = tl.load(row_inv_temperature_ptr + row)
    seg_start = tl.multiple_of(seg * seg_len, LOGITS_ALIGN)
    seg_end, target = _row_extent(row_mask_ptr, tokens_ptr, row, seg_start, seg_len, n_valid, vocab_start, v_local,
                                  HAS_ROW_MASK)
    mem_end = seg_start + seg_len
    row_ptr = logits_ptr + tl.multiple_of(row * logits_row_stride, LOGITS_ALIGN)
    keep_row_ptr = keep_ptr + tl.multiple_of(row * keep_row_stride, KEEP_ALIGN)

    LANES: tl.constexpr = BLOCK_V // LANE_WIDTH
    m = tl.full([LANES], -FLT_MAX, tl.float32)
    s = tl.zeros([LANES], tl.float32)
    sk = tl.zeros([LANES], tl.float32)
    w = tl.zeros([LANES], tl.float32)
    # lane-major: a lane's columns are contiguous
    offs = tl.arange(0, LANES)[:, None] * LANE_WIDTH + tl.arange(0, LANE_WIDTH)[None, :]
    n_cols = tl.maximum(seg_end - seg_start, 0)
    n_full = n_cols // BLOCK_V
    # Whole tiles: unmasked, the next tile's load issued before this tile's math (register double buffering).
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
        z = transformed(x.to(tl.float32), inv_temperature, softcap, inv_softcap, SCALE, SOFTCAP)
        m, s, sk, w = _lanes_update(z, k, offs == target - (seg_start + tile * BLOCK_V), m, s, sk, w, HAS_KEEP,
                                     WITH_ENTROPY)
    tail = seg_start + n_full * BLOCK_V
    if tail < seg_end:  # the partial last tile: loads masked by the segment, padding selected away
        in_mem = offs < mem_end - tail
        z = tl.load(row_ptr + tail + offs, mask=in_mem, other=float("-inf")).to(tl.float32)
        z = transformed(z, inv_temperature, softcap, inv_softcap, SCALE, SOFTCAP)
        z = tl.where(offs < seg_end - tail, z, float("-inf"))
        if HAS_KEEP:
            k = tl.load(keep_row_ptr + tail + offs, mask=in_mem, other=0)
        else:
            k = z
        m, s, sk, w = _lanes_update(z, k, offs == target - tail, m, s, sk, w, HAS_KEEP, WITH_ENTROPY)
    _merge_lanes_and_store(m, s, sk, w, row_ptr, target, seg_start, seg_end, seg, row, num_rows, out_ptr,
                           inv_temperature, softcap, inv_softcap, HAS_KEEP, WITH_ENTROPY, SCALE, SOFTCAP)


BACKWARD_UNALIGNED_ARGS = ["n_valid"]  # only selects values: loads stay vectorised when it is odd


@triton.jit(do_not_specialize_on_alignment=BACKWARD_UNALIGNED_ARGS)
def backward_grad_kernel(
    # data ptrs
    logits_ptr,  # [T, V_local] logits, READ-ONLY unless out aliases it
    out_ptr,  # [T, V_local] gradient in out's dtype, WRITTEN (may be logits_ptr: each element is read first)
    row_mask_ptr,  # [T] uint8 row mask, 0 = dropped row: zeros, no logits read (read only when HAS_ROW_MASK)
    tokens_ptr,  # [T] int64 global token ids (the target column as in the forward)
    keep_ptr,  # [T, V_local] uint8 keep mask, READ-ONLY (read only when HAS_KEEP)
    shift_ptr,  # [T] fp32 row max M of z over the global vocabulary (0 for rows without mass)
    log_sum_ptr,  # [T] fp32 log sum_valid exp(z - M)
    log_sum_kept_ptr,  # [T] fp32 log sum_{kept + target} exp(z - M) (read only when HAS_KEEP)
    mean_shifted_ptr,  # [T] fp32 E_p[z] - M (read only when HAS_GRAD_ENTROPY)
    grad_log_prob_ptr,  # [T] fp32 upstream gradient of log_prob (read only when HAS_GRAD_LOG_PROB)
    grad_entropy_ptr,  # [T] fp32 upstream gradient of entropy (read only when HAS_GRAD_ENTROPY)
    log_prob_defined_ptr,  # [T] uint8: 0 where the log-prob is -inf (no kept mass): no gradient (HAS_LOG_PROB_DEFINED)
    row_has_mass_ptr,  # [T] uint8: 0 where the row has no mass (no entropy gradient), read when HAS_MASS
    # shapes
    v_local,
    n_valid,
    vocab_start,
    # strides
    logits_row_stride,
    out_row_stride,
    keep_row_stride,
    # constants
    inv_temperature,
    HAS_ROW_MASK: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    HAS_GRAD_LOG_PROB: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    HAS_LOG_PROB_DEFINED: tl.constexpr,
    HAS_MASS: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ROUND_BF16_BY_BITS: tl.constexpr,  # bf16 output under the interpreter
    # the logit transform beyond a scalar temperature, as in the forward
    row_inv_temperature_ptr=None,  # [T] fp32, read only when ROW_SCALE
    softcap=1.0,  # used only when SOFTCAP, with its fp32 reciprocal
    inv_softcap=1.0,
    ROW_SCALE: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
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

    if ROW_SCALE:
        inv_temperature = tl.load(row_inv_temperature_ptr + row)
    x = tl.load(logits_ptr + row * logits_row_stride + cols, mask=load, other=float("-inf")).to(tl.float32)
    # the softcap alone (u = x without it); the temperature below
    u, slope = transformed_with_slope(x, inv_temperature, softcap, inv_softcap, False, SOFTCAP)
    if SCALE:
        # Folded into per-row constants (module docstring): z as the forward rounded it, the exponent from one FMA.
        d = scaled(u, inv_temperature) - tl.load(shift_ptr + row)
        p = ex2_ftz(tl.fma(d, _LOG2E, -tl.load(log_sum_ptr + row) * _LOG2E))  # 0 for -inf logits
    else:
        d = u - tl.load(shift_ptr + row)
        p = tl.exp(d - tl.load(log_sum_ptr + row))  # 0 for -inf logits

    grad = tl.zeros([BLOCK_V], tl.float32)
    if HAS_GRAD_LOG_PROB:
        g_lp = tl.load(grad_log_prob_ptr + row)
        if HAS_LOG_PROB_DEFINED:
            g_lp = tl.where(tl.load(log_prob_defined_ptr + row) != 0, g_lp, 0.0)  # whatever it holds (inf, NaN)
        if SCALE:
            g_lp = g_lp * inv_temperature  # the chain rule's 1 / T, once per row
        is_target = cols == _target_column(tokens_ptr, row, vocab_start, v_local)
        if HAS_KEEP:
            keep = tl.load(keep_ptr + row * keep_row_stride + cols, mask=load, other=0)
            q = tl.where((keep != 0) | is_target, tl.exp(d - tl.load(log_sum_kept_ptr + row)), 0.0)
        else:
            q = p
        grad = g_lp * (tl.where(is_target, 1.0, 0.0) - q)
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + row)
        if HAS_MASS:
            g_ent = tl.where(tl.load(row_has_mass_ptr + row) != 0, g_ent, 0.0)
        if SCALE:
            g_ent = g_ent * inv_temperature
        mean_shifted = tl.load(mean_shifted_ptr + row)
        grad += g_ent * (p * tl.where(p == 0.0, 0.0, mean_shifted - d))  # p == 0 (d = -inf): no 0 * inf
    if SOFTCAP:
        grad = grad * slope  # the chain rule through softcap * tanh(x / softcap)
    grad = tl.where(valid, grad, 0.0)  # padding and dropped rows: 0, whatever they hold (NaN included)
    if ROUND_BF16_BY_BITS:
        # As core/triton_common.store_rounded (the interpreter truncates fp32 -> bf16 casts), inline: through that
        # call the compiler schedules this kernel's store differently.
        bits = grad.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        grad_out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        grad_out = grad.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, grad_out, mask=in_row)


# ---- merge: segment partials -> row statistics, in one launch ----
# Rows of the merge's [MERGED_FIELDS, T] fp32 output and [MERGED_FLAGS, T] uint8 flags (read as bool): the RowStats
# fields (core/contracts.py), in row_stats.py's order.
_LOG_PROB = tl.constexpr(LOG_PROB)
_ENTROPY = tl.constexpr(ENTROPY)
_SHIFT = tl.constexpr(SHIFT)
_LOG_SUM = tl.constexpr(LOG_SUM)
_LOG_SUM_KEPT = tl.constexpr(LOG_SUM_KEPT)
_MEAN_SHIFTED = tl.constexpr(MEAN_SHIFTED)
_LOG_PROB_DEFINED = tl.constexpr(LOG_PROB_DEFINED)
_HAS_MASS = tl.constexpr(HAS_MASS)
_BAD_INPUT = tl.constexpr(BAD_INPUT)
_SHIFT_FLOOR = tl.constexpr(row_stats.SHIFT_FLOOR)


@triton.jit
def merge_partials_kernel(
    partials_ptr,  # [NUM_SEG, 5, T] fp32 segment partials in global segment order, READ-ONLY
    out_ptr,  # [MERGED_FIELDS, T] fp32 merged row statistics, WRITTEN
    flags_ptr,  # [MERGED_FLAGS, T] uint8 row flags (0/1), WRITTEN
    num_rows,  # T
    NUM_SEG: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = rows < num_rows
    neg_inf = float("-inf")

    # The row max and the target logit: maxima, order-free.
    big_m = tl.full([BLOCK_R], neg_inf, tl.float32)
    z_t = tl.full([BLOCK_R], neg_inf, tl.float32)
    any_nan = tl.zeros([BLOCK_R], tl.int1)
    for j in tl.static_range(NUM_SEG):
        m_j = tl.load(partials_ptr + (j * NUM_PARTIALS + CH_MAX) * num_rows + rows, mask=in_rows, other=neg_inf)
        any_nan = any_nan | (m_j != m_j)  # tl.maximum may drop a NaN
        big_m = tl.maximum(big_m, m_j)
        zt_j = tl.load(partials_ptr + (j * NUM_PARTIALS + CH_TARGET_Z) * num_rows + rows, mask=in_rows, other=neg_inf)
        z_t = tl.maximum(z_t, zt_j)
    m_safe = tl.where((big_m == neg_inf) | (big_m == float("inf")) | any_nan, 0.0, big_m)

    # Sums rescaled to the row max, segment by segment in global order (the order fixes the bits).
    s = tl.zeros([BLOCK_R], tl.float32)
    sk = tl.zeros([BLOCK_R], tl.float32)
    w = tl.zeros([BLOCK_R], tl.float32)
    for j in tl.static_range(NUM_SEG):
        base = partials_ptr + j * NUM_PARTIALS * num_rows + rows
        m_j = tl.load(base + CH_MAX * num_rows, mask=in_rows, other=neg_inf)
        s_j = tl.load(base + CH_SUMEXP * num_rows, mask=in_rows, other=0.0)
        # As row_stats.merge_partials: the shift clamped at _SHIFT_FLOOR (e^shift is 0 in fp32 there), so an empty
        # segment (m_j = -inf) or a shift that overflows to -inf adds exactly 0, never 0 * -inf; NaN stays NaN.
        shift = m_j - m_safe  # <= 0
        shift = tl.where(shift < _SHIFT_FLOOR, _SHIFT_FLOOR, shift)
        a = tl.exp(shift)
        s += a * s_j
        if HAS_KEEP:
            sk += a * tl.load(base + CH_KEPT_SUMEXP * num_rows, mask=in_rows, other=0.0)
        w += a * (tl.load(base + CH_ENT_SUM * num_rows, mask=in_rows, other=0.0) + shift * s_j)
    if not HAS_KEEP:
        sk = s

    has_mass = s > 0.0
    s_safe = tl.where(has_mass, s, 1.0)
    log_s = tl.log(s_safe)
    ratio = w / s_safe  # E_p[z] - M, <= 0
    entropy = tl.where(has_mass, log_s - ratio, 0.0)
    defined = sk > 0.0
    log_kept = tl.log(tl.where(defined, sk, 1.0))
    log_prob = tl.where(defined, (z_t - m_safe) - log_kept, neg_inf)
    bad = any_nan | (big_m == float("inf")) | (s != s)

    out = out_ptr + rows
    tl.store(out + _LOG_PROB * num_rows, log_prob, mask=in_rows)
    tl.store(out + _ENTROPY * num_rows, entropy, mask=in_rows)
    tl.store(out + _SHIFT * num_rows, m_safe, mask=in_rows)
    tl.store(out + _LOG_SUM * num_rows, log_s, mask=in_rows)
    tl.store(out + _LOG_SUM_KEPT * num_rows, log_kept, mask=in_rows)
    tl.store(out + _MEAN_SHIFTED * num_rows, ratio, mask=in_rows)
    flags = flags_ptr + rows
    tl.store(flags + _LOG_PROB_DEFINED * num_rows, defined.to(tl.uint8), mask=in_rows)
    tl.store(flags + _HAS_MASS * num_rows, has_mass.to(tl.uint8), mask=in_rows)
    tl.store(flags + _BAD_INPUT * num_rows, bad.to(tl.uint8), mask=in_rows)
