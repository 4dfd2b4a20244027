"""Rollout correction: importance weights between the engine that sampled the tokens and the trainer.

The rollout engine (vLLM, SGLang) samples token t with its own log-prob `rollout_t`; the trainer's log-prob of the
same token under the same weights, before this update, is `old_t` (verl's `old_log_prob`, NeMo-RL's
`prev_logprobs`: the trainer's recomputation). They differ by kernels and precision, and by policy lag in
asynchronous training. The correction multiplies each token's policy-gradient term by a constant

    log w_t = old_t - rollout_t                      token level: w_t = exp(log w_t)
    log w_s = mean_{t in s} (old_t - rollout_t)      sequence level: the geometric mean of the sequence's ratios,
                                                     w_t = w_s for every token of s (NeMo-RL seq-mask-tis, GSPO's
                                                     length normalisation)

bounded one of three ways (caps `high` > 0 and `low` in [0, high)):

    tis     c_t = clamp(w_t, low, high)                       truncated IS (Yao et al. 2025 "Your efficient RL
                                                              framework secretly brings you off-policy RL training";
                                                              verl rollout_is=token|sequence with its threshold, NeMo-RL
                                                              "tis", slime --tis-clip / --tis-clip-low); low None: 0
    mis     c_t = w_t if w_t <= high (and w_t >= low) else 0  masked IS: a token (sequence) past the cap is dropped,
                                                              the others keep their weight (TRL "token_mask" /
                                                              "sequence_mask"); low None: no lower bound
    icepop  c_t = w_t if low <= w_t <= high else 0            IcePop (Ring-1T, 2025): M(k) = k within [alpha, beta],
                                                              0 outside; both caps required (NeMo-RL "icepop")

The weight is computed from constants only (both log-probs are given before the step), so it is detached by
construction: the gradient of c_t * pg_t is c_t times pg_t's, and the loss stays row-separable at either level.
A dropped token still counts in the loss's normalisation (the IcePop paper's 1 / |y|, NeMo-RL's masked mean over
the loss mask): c_t only scales its term. Tokens the loss mask does not count get c_t = 0 whatever they hold; the
sequence level averages over counted tokens only. Computed in float64, rounded once to fp32.

The metrics users log with it (0-d fp32 tensors; means over counted tokens, unweighted; 0 when none is counted):

    rollout_k3_kl          mean_t (w_t - 1 - log w_t): Schulman's k3 estimate of KL(pi_rollout || pi_trainer) on the
                           rollout's own samples (token-level w)
    rollout_log_ppl_diff   mean over sequences of mean_{t in s} (rollout_t - old_t): the trainer's log-perplexity minus
                           the rollout's (all counted tokens as one sequence without seq_ids)
    rollout_corrected_share  the share of counted tokens whose weight the bound changed (truncated or dropped)
    rollout_weight_mean    mean_t c_t
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ppo_ops.core.checks import argument_error

MODES = ("token_tis", "token_mis", "token_icepop", "seq_tis", "seq_mis", "seq_icepop")


class Correction(NamedTuple):
    """The checked options of one rollout correction."""

    mode: str
    high: float
    low: Optional[float]

    @property
    def level(self) -> str:
        return "sequence" if self.mode.startswith("seq_") else "token"

    @property
    def bound(self) -> str:
        return self.mode.split("_", 1)[1]


def check_options(fn: str, mode, high, low, *, has_seq_ids: bool) -> Correction:
    """The correction's options checked (one error naming the argument), before any tensor is read."""
    if not isinstance(mode, str) or mode not in MODES:
        raise argument_error(ValueError, fn, "rollout_correction",
                             f"rollout_correction must be one of {MODES}, got {mode!r}")
    high = _real(fn, "rollout_is_high", high)
    if not 0.0 < high < math.inf:
        raise argument_error(ValueError, fn, "rollout_is_high", f"rollout_is_high must be finite and > 0, got {high}")
    if low is not None:
        low = _real(fn, "rollout_is_low", low)
        if not 0.0 <= low < high:
            raise argument_error(ValueError, fn, "rollout_is_low",
                                 f"rollout_is_low must be in [0, rollout_is_high={high}), got {low}")
    correction = Correction(mode, high, low)
    if correction.bound == "icepop" and low is None:
        raise argument_error(ValueError, fn, "rollout_is_low",
                             f"rollout_correction={mode!r} masks on both sides: it needs rollout_is_low (IcePop's "
                             "alpha, e.g. 0.5)")
    if correction.level == "sequence" and not has_seq_ids:
        raise argument_error(ValueError, fn, "seq_ids",
                             f"rollout_correction={mode!r} weighs whole sequences: it needs seq_ids")
    return correction


def weights(correction: Correction, old: torch.Tensor, rollout: torch.Tensor, counted: torch.Tensor,
            seq_ids: Optional[torch.Tensor], n_seq_slots: int) -> tuple:
    """(c [T] fp32, metrics dict) from the [T] fp32 old and rollout log-probs, the [T] bool counted tokens and the
    [T] int64 sequence ids (or None). No host read."""
    log_w = torch.where(counted, old.double() - rollout.double(), 0.0)  # placeholders never reach the arithmetic
    n = counted.sum()
    per_seq_mean = None
    if seq_ids is not None:
        sums = torch.zeros(n_seq_slots, dtype=torch.float64, device=old.device).index_add_(0, seq_ids, log_w)
        counts = torch.zeros(n_seq_slots, dtype=torch.float64, device=old.device).index_add_(
            0, seq_ids, counted.double())
        per_seq_mean = sums / torch.where(counts > 0, counts, 1.0)
    level_log_w = log_w if correction.level == "token" else per_seq_mean[seq_ids]
    w = torch.exp(level_log_w)
    hi, lo = correction.high, correction.low
    if correction.bound == "tis":
        c = w.clamp(min=0.0 if lo is None else lo, max=hi)
    else:
        inside = w <= hi if lo is None else (w >= lo) & (w <= hi)
        c = torch.where(inside, w, 0.0)
    c = torch.where(counted, c, 0.0)

    def mean(x):  # over counted tokens, 0 when none is
        return (torch.where(counted, x, 0.0).sum() / torch.where(n > 0, n, 1)).float()

    if per_seq_mean is None:
        log_ppl_diff = mean(-log_w)
    else:
        live = counts > 0
        n_live = live.sum()
        log_ppl_diff = (torch.where(live, -per_seq_mean, 0.0).sum() / torch.where(n_live > 0, n_live, 1)).float()
    metrics = {
        "rollout_k3_kl": mean(torch.expm1(log_w) - log_w),
        "rollout_log_ppl_diff": log_ppl_diff,
        "rollout_corrected_share": mean((c != w).double()),
        "rollout_weight_mean": mean(c),
    }
    return c.float(), metrics


def _real(fn, name, value) -> float:
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise argument_error(TypeError, fn, name, f"{name} must be a Python or NumPy real number, got "
                                                  f"{type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        raise argument_error(ValueError, fn, name, f"{name} must not be NaN")
    return value
