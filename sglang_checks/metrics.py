"""The comparisons of the check, each a value against a tolerance, and the statistics behind them.

Three sections:
  trainer layouts         each layout vs tp1 (a fused-head layout vs tp1-unfused, trainer.py): max |d log-prob| and
                          max |d entropy| over the completion tokens, and the relative difference of the loss and of
                          the gradient norms (logits, hidden states, LM head; a fused layout has no logits), per loss
                          variant
  engine layouts          each engine layout's teacher-forced log-probs vs the first layout's: mean |d| (max, p99
                          reported)
  train-rollout mismatch  trainer vs engine log-probs of the same kind (logprob_kinds.py): mean |d| (p99, max
                          reported), the k3 estimate of KL(engine || trainer), and the share of the engine's sampled
                          tokens outside the trainer's top-p set
All statistics are computed in float64 over the completion tokens only. A NaN never passes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

import numpy as np

TRAINER = "trainer layouts"
ENGINE = "engine layouts"
MISMATCH = "train-rollout mismatch"


@dataclasses.dataclass
class Comparison:
    section: str
    subject: str  # e.g. "tp2 vs tp1", "engine tp1 (sampled, sampler)"
    metric: str
    value: float
    tolerance: float
    details: Dict[str, float] = dataclasses.field(default_factory=dict)
    tolerance_name: str = ""  # the tolerances.py entry (or "expect_bitwise") the value is held to

    @property
    def passed(self) -> bool:
        return not math.isnan(self.value) and self.value <= self.tolerance

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "passed": self.passed}


def diff_stats(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> Dict[str, float]:
    """mean, p99 and max of |a - b| over the masked entries, in float64."""
    diff = np.abs(a.astype(np.float64)[mask] - b.astype(np.float64)[mask])
    if diff.size == 0:
        return {"mean_abs": 0.0, "p99_abs": 0.0, "max_abs": 0.0, "tokens": 0}
    return {"mean_abs": float(diff.mean()), "p99_abs": float(np.quantile(diff, 0.99)), "max_abs": float(diff.max()),
            "tokens": int(diff.size)}


def k3_kl(trainer_logprobs: np.ndarray, engine_logprobs: np.ndarray, mask: np.ndarray) -> float:
    """k3 estimate of KL(engine || trainer) from the engine's samples: mean of exp(r) - 1 - r, r = lp_train - lp_eng."""
    r = trainer_logprobs.astype(np.float64)[mask] - engine_logprobs.astype(np.float64)[mask]
    return float(np.mean(np.expm1(r) - r)) if r.size else 0.0


def relative_diff(value: float, reference: float) -> float:
    scale = max(abs(reference), 1e-30)
    return abs(value - reference) / scale


def trainer_comparisons(baseline, result, mask: np.ndarray, tol: Dict[str, float]) -> List[Comparison]:
    """One layout's result (trainer.LayoutResult) against its baseline (tp1, or tp1-unfused for a fused layout).
    A gradient norm that either side lacks (None: the fused head forms no logits) is not compared."""
    subject = f"{result.layout.name} vs {baseline.layout.name}"
    lp = diff_stats(result.log_probs, baseline.log_probs, mask)
    ent = diff_stats(result.entropy, baseline.entropy, mask)
    atol, rtol = "trainer_logprob_atol", "trainer_rtol"
    out = [Comparison(TRAINER, subject, "max |d log-prob|", lp["max_abs"], tol[atol], lp, atol),
           Comparison(TRAINER, subject, "max |d entropy|", ent["max_abs"], tol[atol], ent, atol)]
    for variant, values in result.losses.items():
        for key in ("loss", "logits_grad_norm", "hidden_grad_norm", "lm_head_grad_norm"):
            ref = baseline.losses[variant][key]
            if values[key] is None or ref is None:
                continue
            out.append(Comparison(TRAINER, subject, f"{variant} {key} rel diff", relative_diff(values[key], ref),
                                  tol[rtol], {"value": values[key], "baseline": ref}, rtol))
    return out


def engine_layout_comparisons(first_name: str, name: str, first: np.ndarray, other: np.ndarray,
                              mask: np.ndarray, tol: Dict[str, float], bitwise: bool) -> List[Comparison]:
    """An engine layout's teacher-forced log-probs vs the first layout's; with `bitwise`, every token must be equal."""
    stats = diff_stats(other, first, mask)
    subject = f"engine {name} vs {first_name} (teacher-forced, raw)"
    out = [Comparison(ENGINE, subject, "mean |d log-prob|", stats["mean_abs"], tol["engine_layout_tol"], stats,
                      "engine_layout_tol")]
    if bitwise:
        out.append(Comparison(ENGINE, subject, "max |d log-prob|", stats["max_abs"], 0.0, stats, BITWISE))
    return out


BITWISE = "expect_bitwise"


def mismatch_comparisons(subject: str, trainer_lp: np.ndarray, engine_lp: np.ndarray, mask: np.ndarray,
                         tol: Dict[str, float], *, outside_share: Optional[float] = None,
                         bitwise: bool = False) -> List[Comparison]:
    """Trainer vs engine log-probs of one series; with `bitwise`, every token must be equal (max |d| = 0)."""
    stats = diff_stats(trainer_lp, engine_lp, mask)
    out = [Comparison(MISMATCH, subject, "mean |trainer - engine| log-prob", stats["mean_abs"], tol["mismatch_tol"],
                      stats, "mismatch_tol"),
           Comparison(MISMATCH, subject, "k3 KL(engine || trainer)", k3_kl(trainer_lp, engine_lp, mask),
                      tol["kl_tol"], {}, "kl_tol")]
    if outside_share is not None:
        out.append(Comparison(MISMATCH, subject, "share sampled outside trainer top-p", outside_share,
                              tol["top_p_outside_tol"], {}, "top_p_outside_tol"))
    if bitwise:
        out.append(Comparison(MISMATCH, subject, "max |trainer - engine| log-prob", stats["max_abs"], 0.0, stats,
                              BITWISE))
    return out


def outside_top_p_share(keep_mask, targets, mask) -> float:
    """Share of completion tokens whose target is outside the trainer's top-p set (keep_mask [B, S, V] torch bool)."""
    import torch

    rows = torch.as_tensor(mask)
    if keep_mask is None or not bool(rows.any()):
        return 0.0
    kept = keep_mask.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return float((~kept[rows]).double().mean())
