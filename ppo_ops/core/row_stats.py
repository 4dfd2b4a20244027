"""Row statistics: merging per-segment partials into log-probs, entropies and what backward needs.

A backend's forward produces, for each vocabulary segment j it holds and each row, five fp32 partials relative to the
segment's own maximum m_j (see the backend contract in core/contracts.py):

    MAX m_j, SUMEXP s_j = Σ e^(z-m_j), KEPT_SUMEXP over keep ∪ {target}, ENT_SUM w_j = Σ e^(z-m_j)(z-m_j), TARGET_Z.

Across tensor-parallel ranks the [segments, 5, T] tensors are all-gathered (one collective of O(T) bytes, in
logits/function.py) and every rank merges all segments in global order, sequentially, so every rank and every TP size
computes the same bits:

    M = max_j m_j,  a_j = e^(m_j - M),  S = Σ_j a_j s_j,  W = Σ_j a_j (w_j + (m_j - M) s_j)
    log_prob = (z_t - M) - log S_kept,  entropy = log S - W / S,  E_p[z] - M = W / S.

W <= 0, so the entropy is a sum of two non-negative terms (no cancellation). Backward gets the statistics relative to
the row maximum M (log S, log S_kept, W / S): it then forms log p = (z - M) - log S, where z - M is small exactly for
the entries whose probability is large, so fp32 rounding there stays far below ulp(|z|). Segments and rows without
any finite logit (m = -inf) contribute nothing and never produce exp(-inf - -inf); a segment whose shift m_j - M
overflows to -inf (finite maxima near -fp32 max and +fp32 max) has a_j = 0 and adds exactly 0 to W (merge_partials
clamps the shift where e^shift is 0 in fp32 anyway).
"""

from __future__ import annotations


import torch

from ppo_ops.core.contracts import RowStats

MAX, SUMEXP, KEPT_SUMEXP, ENT_SUM, TARGET_Z = range(5)
NUM_PARTIALS = 5

NEG_INF = float("-inf")
FLT_MAX = 3.4028234663852886e38  # largest finite fp32: the bound of every "finite" check and sentinel
SHIFT_FLOOR = -128.0  # e^-128 ~ 3e-56 is 0 in fp32 (its smallest subnormal is e^-103.3)


def empty_partials(segments: int, rows: int, device) -> torch.Tensor:
    """Partials of rows with no work (row_mask False): neutral under the merge. Backends give dropped rows exactly
    these values (MAX and TARGET_Z -inf, the sums 0)."""
    p = torch.zeros((segments, NUM_PARTIALS, rows), dtype=torch.float32, device=device)
    p[:, MAX] = NEG_INF
    p[:, TARGET_Z] = NEG_INF
    return p


def merge_partials(p: torch.Tensor, has_keep_mask: bool) -> RowStats:
    """Merges [segments, 5, T] partials in segment order (the order fixes the bits)."""
    m_all = p[:, MAX]
    big_m = m_all.amax(dim=0)
    m_safe = torch.where(torch.isfinite(big_m), big_m, torch.zeros_like(big_m))
    s = torch.zeros_like(m_safe)
    sk = torch.zeros_like(m_safe)
    w = torch.zeros_like(m_safe)
    for j in range(p.shape[0]):
        # a_j = e^(m_j - M) with the shift clamped at SHIFT_FLOOR, where e^shift is 0 in fp32 anyway: an empty segment
        # (m_j = -inf) and one whose shift overflows to -inf (maxima near -fp32 max and +fp32 max) add exactly 0 to
        # every sum, never 0 * -inf; a NaN max stays NaN (clamp keeps it) and reaches S.
        shift = (m_all[j] - m_safe).clamp_(min=SHIFT_FLOOR)  # <= 0
        a = torch.exp(shift)
        s = s + a * p[j, SUMEXP]
        sk = sk + a * p[j, KEPT_SUMEXP]
        w = w + a * (p[j, ENT_SUM] + shift * p[j, SUMEXP])
    z_t = p[:, TARGET_Z].amax(dim=0)

    has_mass = s > 0
    s_safe = torch.where(has_mass, s, torch.ones_like(s))
    log_s = torch.log(s_safe)
    ratio = w / s_safe  # E_p[z] - M, <= 0
    entropy = torch.where(has_mass, log_s - ratio, torch.zeros_like(s))

    kept = sk if has_keep_mask else s
    defined = kept > 0
    log_kept = torch.log(torch.where(defined, kept, torch.ones_like(kept)))
    neg_inf = torch.full_like(s, NEG_INF)
    log_prob = torch.where(defined, (z_t - m_safe) - log_kept, neg_inf)
    bad_input = torch.isnan(big_m) | (big_m == float("inf")) | torch.isnan(s)
    return RowStats(
        log_prob=log_prob, entropy=entropy, shift=m_safe, log_sum=log_s,
        log_sum_kept=log_kept if has_keep_mask else None, mean_shifted=ratio, bad_input=bad_input,
        log_prob_defined=defined, row_has_mass=has_mass,
    )


# The Triton merge's outputs (logits/triton_kernels.py): an fp32 [MERGED_FIELDS, T] tensor and a byte
# [MERGED_FLAGS, T] one (read as bool), one RowStats field per row.
(LOG_PROB, ENTROPY, SHIFT, LOG_SUM, LOG_SUM_KEPT, MEAN_SHIFTED) = range(6)
MERGED_FIELDS = 6
(LOG_PROB_DEFINED, HAS_MASS, BAD_INPUT) = range(3)
MERGED_FLAGS = 3


def merged_row_stats(fields: torch.Tensor, flags: torch.Tensor, has_keep_mask: bool) -> RowStats:
    """RowStats as views of the merge's two outputs (no copy)."""
    f, b = fields.unbind(0), flags.view(torch.bool).unbind(0)
    return RowStats(log_prob=f[LOG_PROB], entropy=f[ENTROPY], shift=f[SHIFT], log_sum=f[LOG_SUM],
                    log_sum_kept=f[LOG_SUM_KEPT] if has_keep_mask else None, mean_shifted=f[MEAN_SHIFTED],
                    bad_input=b[BAD_INPUT], log_prob_defined=b[LOG_PROB_DEFINED], row_has_mass=b[HAS_MASS])
