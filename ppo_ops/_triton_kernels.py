"""Triton kernels of the Triton backend: segment partials (forward) and the fused gradient (backward).

Forward, `forward_partials_kernel`, grid (active row, vocabulary segment):
    each program streams its segment's columns in BLOCK_V tiles, in the logits' own dtype, and keeps four fp32 scalars
    online: the max m, the sum-exp s, the kept sum-exp sk and the entropy sum w = sum exp(z - m) * (z - m). When a tile
    raises the max from m_old to m_new, everything is rescaled by alpha = exp(m_old - m_new) and
    w_new = alpha * (w + (m_old - m_new) * s) + tile terms. The target's logit is one scalar load. It writes only the
    [nseg, 5, R] fp32 partials. The tile sequence is relative to the segment start and BLOCK_V depends only on the
    segment length and dtype, so a (row, segment) gives the same bits whichever rank, or TP size, holds the segment.
Backward, `backward_grad_kernel`, grid (row, column tile):
    with the global row stats relative to the row max M (the core sanitises rows without mass to 0 and zeroes their
    upstream gradients), d = z - M, p = exp(d - log_sum), q = 1[keep or target] * exp(d - log_sum_kept) (q = p without
    a keep mask) and grad = inv_t * (g_lp * (1[c == target] - q) + g_ent * p * (mean_shifted - d)), stored in the
    output's dtype. Every element is read before it is written by the same program, so `out` may alias the logits.
    Rows outside the active set (row_map < 0) get zeros without reading anything.

-inf guards: the reference point of exp() is 0 while the running max is -inf, so no exp(-inf - -inf); a factor that
may be -inf is replaced by 0 where its partner is 0 (no 0 * inf). Padding columns are loaded when their vector is and
then selected away. Row offsets are int64.
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


@triton.jit(do_not_specialize_on_alignment=FORWARD_UNALIGNED_ARGS)
def forward_partials_kernel(
    # data ptrs
    logits_ptr,  # [T, V_local] logits (fp32/bf16/fp16), READ-ONLY
    rows_ptr,  # [R] int64 row ids of the active rows (read only when HAS_ROWS)
    target_ptr,  # [R] int64 target column in this shard, -1 where it lives on another rank
    keep_ptr,  # [T, V_local] uint8 keep mask, READ-ONLY (read only when HAS_KEEP)
    out_ptr,  # [nseg, 5, R] fp32 partials, WRITTEN
    # shapes
    num_rows,  # R
    n_valid,  # columns >= n_valid are padding
    seg_len,  # columns per segment
    # strides
    logits_row_stride,
    keep_row_stride,
    # constants
    inv_temperature,  # fp32 scalar, used only when SCALE
    HAS_ROWS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,  # a multiple of both ALIGNs
    LOGITS_ALIGN: tl.constexpr,  # divides seg_len and logits_row_stride
    KEEP_ALIGN: tl.constexpr,  # divides seg_len and keep_row_stride
):
    pid_r = tl.program_id(0)
    seg = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + pid_r)
    else:
        row = pid_r.to(tl.int64)
    target = tl.load(target_ptr + pid_r)
    seg_start = tl.multiple_of(seg * seg_len, LOGITS_ALIGN)
    seg_end = tl.minimum(seg_start + seg_len, n_valid)  # end of the valid columns
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

    out = out_ptr + seg.to(tl.int64) * (_NUM_PARTIALS * num_rows) + pid_r
    tl.store(out + _MAX * num_rows, m)
    tl.store(out + _SUMEXP * num_rows, s)
    tl.store(out + _KEPT_SUMEXP * num_rows, sk)
    tl.store(out + _ENT_SUM * num_rows, w)
    tl.store(out + _TARGET_Z * num_rows, zt)


BACKWARD_UNALIGNED_ARGS = ["n_valid"]  # only selects values: loads stay vectorised when it is odd


@triton.jit(do_not_specialize_on_alignment=BACKWARD_UNALIGNED_ARGS)
def backward_grad_kernel(
    # data ptrs
    logits_ptr,  # [T, V_local] logits, READ-ONLY unless out aliases it
    out_ptr,  # [T, V_local] gradient in out's dtype, WRITTEN (may be logits_ptr: each element is read first)
    row_map_ptr,  # [T] int64: index into the [R] row tensors, -1 for inactive rows (read only when HAS_ROWS)
    target_ptr,  # [R] int64 target column in this shard, -1 where it lives on another rank
    keep_ptr,  # [T, V_local] uint8 keep mask, READ-ONLY (read only when HAS_KEEP)
    shift_ptr,  # [R] fp32 row max M of z over the global vocabulary (0 for rows without mass)
    log_sum_ptr,  # [R] fp32 log sum_valid exp(z - M)
    log_sum_kept_ptr,  # [R] fp32 log sum_{kept + target} exp(z - M) (read only when HAS_KEEP)
    mean_shifted_ptr,  # [R] fp32 E_p[z] - M (read only when HAS_GENT)
    grad_logprob_ptr,  # [R] fp32 upstream gradient of log_prob (read only when HAS_GLP)
    grad_entropy_ptr,  # [R] fp32 upstream gradient of entropy (read only when HAS_GENT)
    # shapes
    v_local,
    n_valid,
    # strides
    logits_row_stride,
    out_row_stride,
    keep_row_stride,
    # constants
    inv_temperature,
    HAS_ROWS: tl.constexpr,
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
    if HAS_ROWS:
        idx = tl.load(row_map_ptr + row)
        # Inactive rows read nothing and get zeros. (A vector-scalar compare: the interpreter mis-types
        # `vector & scalar` masks.)
        load = cols < tl.where(idx >= 0, v_local, 0)
        idx = tl.maximum(idx, 0)  # a valid index (R >= 1, the launcher ensures it): row scalars load unmasked
    else:
        idx = row
        load = in_row
    valid = load & (cols < n_valid)  # padding is read with its vector and selected away: n_valid never splits one

    z = tl.load(logits_ptr + row * logits_row_stride + cols, mask=load, other=float("-inf")).to(tl.float32)
    if SCALE:
        z = z * inv_temperature
    d = z - tl.load(shift_ptr + idx)
    p = tl.exp(d - tl.load(log_sum_ptr + idx))  # 0 for -inf logits

    grad = tl.zeros([BLOCK_V], tl.float32)
    if HAS_GLP:
        g_lp = tl.load(grad_logprob_ptr + idx)
        is_target = cols == tl.load(target_ptr + idx)
        if HAS_KEEP:
            keep = tl.load(keep_ptr + row * keep_row_stride + cols, mask=load, other=0)
            q = tl.where((keep != 0) | is_target, tl.exp(d - tl.load(log_sum_kept_ptr + idx)), 0.0)
        else:
            q = p
        grad = g_lp * (tl.where(is_target, 1.0, 0.0) - q)
    if HAS_GENT:
        g_ent = tl.load(grad_entropy_ptr + idx)
        mean_shifted = tl.load(mean_shifted_ptr + idx)
        grad += g_ent * (p * tl.where(p == 0.0, 0.0, mean_shifted - d))  # p == 0 (d = -inf): no 0 * inf
    if SCALE:
        grad = grad * inv_temperature
    grad = tl.where(valid, grad, 0.0)  # padding and inactive rows: 0, whatever the padding holds
    if ROUND_BF16_BY_BITS:
        # Triton 3.9's interpreter truncates fp32 -> bf16 casts (compiled code rounds to nearest even, as torch does):
        # there, round to nearest even on the bits. Gradients are finite, so no NaN payload to protect.
        bits = grad.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        grad_out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        grad_out = grad.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, grad_out, mask=in_row)
