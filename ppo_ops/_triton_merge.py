"""Triton backend: the fixed-order merge of segment partials into row statistics, in one launch.

The PyTorch merge (ppo_ops/_row_stats.py::merge_partials) costs about ten small kernels per segment; with eight
segments that is ~90 launches per forward, a few hundred microseconds next to a ~1 ms forward kernel. This kernel does
the same math (see _row_stats.py's docstring) for a block of rows per program, segments merged in global order with a
compile-time loop, so the bits do not depend on which rank or TP size produced the partials.

Output rows of `out` ([MERGED_FIELDS, T] fp32): log_prob, entropy, shift (row max M, 0 without mass),
log_sum = log Σ e^(z-M), log_sum_kept, mean_shifted = E_p[z] - M, and three 0/1 flags: log-prob defined (the kept
set has mass), row has mass, bad input (NaN or +inf logits reached the row).
"""

import torch
import triton
import triton.language as tl

from ppo_ops import _row_stats
from ppo_ops._triton_kernels import _ENT_SUM, _KEPT_SUMEXP, _MAX, _NUM_PARTIALS, _SUMEXP, _TARGET_Z

(LOG_PROB, ENTROPY, SHIFT, LOG_SUM, LOG_SUM_KEPT, MEAN_SHIFTED, DEFINED, HAS_MASS, BAD_INPUT) = range(9)
MERGED_FIELDS = 9

# Field rows of `out` as constexprs: a @triton.jit function may read module globals only when they are constexprs.
_LOG_PROB = tl.constexpr(LOG_PROB)
_ENTROPY = tl.constexpr(ENTROPY)
_SHIFT = tl.constexpr(SHIFT)
_LOG_SUM = tl.constexpr(LOG_SUM)
_LOG_SUM_KEPT = tl.constexpr(LOG_SUM_KEPT)
_MEAN_SHIFTED = tl.constexpr(MEAN_SHIFTED)
_DEFINED = tl.constexpr(DEFINED)
_HAS_MASS = tl.constexpr(HAS_MASS)
_BAD_INPUT = tl.constexpr(BAD_INPUT)



@triton.jit
def merge_partials_kernel(
    partials_ptr,  # [NUM_SEG, 5, T] fp32 segment partials in global segment order, READ-ONLY
    out_ptr,  # [9, T] fp32 merged row statistics, WRITTEN
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
        m_j = tl.load(partials_ptr + (j * _NUM_PARTIALS + _MAX) * num_rows + rows, mask=in_rows, other=neg_inf)
        any_nan = any_nan | (m_j != m_j)  # tl.maximum may drop a NaN
        big_m = tl.maximum(big_m, m_j)
        zt_j = tl.load(partials_ptr + (j * _NUM_PARTIALS + _TARGET_Z) * num_rows + rows, mask=in_rows, other=neg_inf)
        z_t = tl.maximum(z_t, zt_j)
    m_safe = tl.where((big_m == neg_inf) | (big_m == float("inf")) | any_nan, 0.0, big_m)

    # Sums rescaled to the row max, segment by segment in global order (the order fixes the bits).
    s = tl.zeros([BLOCK_R], tl.float32)
    sk = tl.zeros([BLOCK_R], tl.float32)
    w = tl.zeros([BLOCK_R], tl.float32)
    for j in tl.static_range(NUM_SEG):
        base = partials_ptr + j * _NUM_PARTIALS * num_rows + rows
        m_j = tl.load(base + _MAX * num_rows, mask=in_rows, other=neg_inf)
        s_j = tl.load(base + _SUMEXP * num_rows, mask=in_rows, other=0.0)
        present = m_j != neg_inf
        shift = tl.where(present, m_j - m_safe, 0.0)  # <= 0
        a = tl.where(present, tl.exp(shift), 0.0)
        s += a * s_j
        if HAS_KEEP:
            sk += a * tl.load(base + _KEPT_SUMEXP * num_rows, mask=in_rows, other=0.0)
        w_j = tl.load(base + _ENT_SUM * num_rows, mask=in_rows, other=0.0)
        w += tl.where(a > 0.0, a * (w_j + shift * s_j), 0.0)  # a shift of -inf (overflow) adds 0, not -inf * 0
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
    tl.store(out + _DEFINED * num_rows, defined.to(tl.float32), mask=in_rows)
    tl.store(out + _HAS_MASS * num_rows, has_mass.to(tl.float32), mask=in_rows)
    tl.store(out + _BAD_INPUT * num_rows, bad.to(tl.float32), mask=in_rows)


# Rows per program: enough to amortise the static segment loop; a power of two (tl.arange).
_BLOCK_R = 256


def merge_partials(partials: torch.Tensor, has_keep_mask: bool) -> _row_stats.RowStats:
    """[segments, 5, T] fp32 partials -> RowStats, the same math as _row_stats.merge_partials in one launch."""
    num_seg, _, num_rows = partials.shape
    partials = partials.contiguous()
    out = torch.empty((MERGED_FIELDS, num_rows), dtype=torch.float32, device=partials.device)
    if num_rows:
        merge_partials_kernel[(triton.cdiv(num_rows, _BLOCK_R),)](
            partials, out, num_rows, NUM_SEG=num_seg, HAS_KEEP=has_keep_mask, BLOCK_R=_BLOCK_R,
        )
    flags = out[DEFINED:].bool()
    return _row_stats.RowStats(
        log_prob=out[LOG_PROB],
        entropy=out[ENTROPY],
        shift=out[SHIFT],
        log_sum=out[LOG_SUM],
        log_sum_kept=out[LOG_SUM_KEPT] if has_keep_mask else None,
        mean_shifted=out[MEAN_SHIFTED],
        bad_input=flags[BAD_INPUT - DEFINED],
        logprob_defined=flags[DEFINED - DEFINED],
        row_has_mass=flags[HAS_MASS - DEFINED],
    )
