"""Row statistics: merging per-segment partials into log-probs, entropies and what backward needs.

A backend's forward produces, for each vocabulary segment j it holds and each row, five fp32 partials relative to the
segment's own maximum m_j (see the backend contract in _function.py):

    MAX m_j, SUMEXP s_j = Σ e^(z-m_j), KEPT_SUMEXP over keep ∪ {target}, ENT_SUM w_j = Σ e^(z-m_j)(z-m_j), TARGET_Z.

Across tensor-parallel ranks the [segments, 5, T] tensors are all-gathered (one collective of O(T) bytes) and every
rank merges all segments in global order, sequentially, so every rank and every TP size computes the same bits:

    M = max_j m_j,  a_j = e^(m_j - M),  S = Σ_j a_j s_j,  W = Σ_j a_j (w_j + (m_j - M) s_j)
    log_prob = (z_t - M) - log S_kept,  entropy = log S - W / S,  E_p[z] - M = W / S.

W <= 0, so the entropy is a sum of two non-negative terms (no cancellation). Backward gets the statistics relative to
the row maximum M (log S, log S_kept, W / S): it then forms log p = (z - M) - log S, where z - M is small exactly for
the entries whose probability is large, so fp32 rounding there stays far below ulp(|z|). Segments and rows without any finite logit
(m = -inf) contribute nothing and never produce exp(-inf - -inf).
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ppo_ops._layout import VocabLayout

MAX, SUMEXP, KEPT_SUMEXP, ENT_SUM, TARGET_Z = range(5)
NUM_PARTIALS = 5

NEG_INF = float("-inf")


def empty_partials(segments: int, rows: int, device) -> torch.Tensor:
    """Partials of rows with no work (row_mask False): neutral under the merge. Backends give dropped rows exactly
    these values (MAX and TARGET_Z -inf, the sums 0)."""
    p = torch.zeros((segments, NUM_PARTIALS, rows), dtype=torch.float32, device=device)
    p[:, MAX] = NEG_INF
    p[:, TARGET_Z] = NEG_INF
    return p


def all_gather_partials(partials: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    """[segments_local, 5, T] on each rank -> [segments_global, 5, T], in global segment order."""
    if layout.group is None:
        return partials
    # Into one tensor: rank-major along dim 0 is the global segment order, with no list and no cat (host time).
    out = torch.empty((layout.world_size * partials.shape[0],) + tuple(partials.shape[1:]), dtype=partials.dtype,
                      device=partials.device)
    # torch >= 2.13 names it all_gather_single and deprecates all_gather_into_tensor, the only name torch 2.11 has.
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_single(out, partials.contiguous(), group=layout.group)
    return out


class RowStats(NamedTuple):
    """Per-row statistics over all T rows; a row the row mask drops has neutral partials, so it merges to a row
    without mass (log_prob -inf, everything else 0, both flags False)."""

    log_prob: torch.Tensor  # [T] fp32
    entropy: torch.Tensor  # [T] fp32 (zeros when not asked for)
    shift: torch.Tensor  # [T] M, the row max of z (0 where the row has no finite logit)
    log_sum: torch.Tensor  # [T] log Σ_valid e^(z - M) (0 where the row has no finite logit)
    log_sum_kept: Optional[torch.Tensor]  # [T] log Σ_{kept ∪ target} e^(z - M), or None without a keep mask
    mean_shifted: torch.Tensor  # [T] E_p[z] - M
    bad_input: torch.Tensor  # [T] bool: NaN or +inf logits reached the row (a kernel's max may skip NaN; the sum not)
    logprob_defined: torch.Tensor  # [T] bool: the kept set has mass (else log_prob = -inf and its gradient is 0)
    row_has_mass: torch.Tensor  # [T] bool: some valid logit is finite (else entropy 0 and gradient 0)


def merge_partials(p: torch.Tensor, has_keep_mask: bool) -> RowStats:
    """Merges [segments, 5, T] partials in segment order (the order fixes the bits)."""
    m_all = p[:, MAX]
    big_m = m_all.amax(dim=0)
    m_safe = torch.where(torch.isfinite(big_m), big_m, torch.zeros_like(big_m))
    s = torch.zeros_like(m_safe)
    sk = torch.zeros_like(m_safe)
    w = torch.zeros_like(m_safe)
    for j in range(p.shape[0]):
        m_j = m_all[j]
        present = m_j != NEG_INF
        shift = torch.where(present, m_j - m_safe, torch.zeros_like(m_j))  # <= 0
        a = torch.where(present, torch.exp(shift), torch.zeros_like(m_j))
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
        log_prob, entropy, m_safe, log_s, log_kept if has_keep_mask else None, ratio, bad_input, defined, has_mass
    )


# ---- Cross-rank consistency (validate=True, TP > 1): one small all-gather before the main work. ----

_HEADER_FIELDS = (
    "number of rows T",
    "V_local (logits.shape[-1])",
    "vocab_size",
    "temperature",
    "entropy mode",
    "keep_mask presence",
    "row_mask",
    "tokens",
)


def _fold_checksum(values: torch.Tensor) -> torch.Tensor:
    """Position-weighted checksum of an int64 vector, exact in int64 (no overflow for T < 2^24)."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=values.device)
    weights = torch.arange(values.numel(), device=values.device, dtype=torch.int64) % 65521 + 1
    return ((values.remainder(2147483647) * weights).remainder(2147483647)).sum()


def consistency_header(
    tokens: torch.Tensor,
    row_mask: Optional[torch.Tensor],
    v_local: int,
    vocab_size: Optional[int],
    temperature: float,
    entropy_mode: str,
    has_keep_mask: bool,
    device,
) -> torch.Tensor:
    flat_tokens = tokens.reshape(-1).to(torch.int64)
    if row_mask is not None:
        rm = row_mask.reshape(-1)
        flat_tokens = torch.where(rm, flat_tokens, torch.zeros_like(flat_tokens))
        row_sum = _fold_checksum(rm.to(torch.int64))
    else:
        row_sum = torch.zeros((), dtype=torch.int64, device=tokens.device)
    temp_bits = struct.unpack("<i", struct.pack("<f", temperature))[0]
    fixed = torch.tensor(
        [flat_tokens.numel(), v_local, -1 if vocab_size is None else vocab_size, temp_bits,
         ("none", "value", "grad").index(entropy_mode), int(has_keep_mask)],
        dtype=torch.int64,
        device=device,
    )
    return torch.cat([fixed, row_sum.reshape(1).to(device), _fold_checksum(flat_tokens).reshape(1).to(device)])


def check_consistent_across_ranks(fn_name: str, header: torch.Tensor, layout: VocabLayout) -> None:
    """All-gathers the header; every rank sees the same table, so every rank raises the same error (no hang)."""
    parts = [torch.empty_like(header) for _ in range(layout.world_size)]
    dist.all_gather(parts, header, group=layout.group)
    table = torch.stack(parts).cpu()
    for field, column in zip(_HEADER_FIELDS, table.T):
        if not bool((column == column[0]).all()):
            raise ValueError(
                f"ppo_ops.{fn_name}: the {field} differs across the {layout.world_size} tensor-parallel ranks "
                f"(per rank: {column.tolist()}); every rank of tp_group must pass the same rows, tokens and options"
            )
