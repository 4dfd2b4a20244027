"""Tolerances of the check, per model dtype, each with the reason for its size and where it comes from.

A tolerance flag left unset takes the value for `--dtype`: the calibrated value when
`sglang_checks/calibration/<dtype>.json` exists (written by `calibrate --install`: each threshold placed between the
worst healthy and the best broken value measured, docs/calibration.md), else the hand-set default below.

fp32 defaults are far tighter than the 1% that slime's parallel check (its tests/test_qwen3_0.6B_parallel_check.py)
allows between the total gradient norms of two parallel layouts: on fp32 the only differences between trainer layouts
are the shard shapes of the logits matmul (ppo_ops itself is bitwise identical across TP), and an fp32 engine differs
from the trainer only by the order of its fp32 sums; docs/calibration.md shows them between the measured healthy and
broken values on CPU.

bf16 uses the two-H200 calibration installed in sglang_checks/calibration/bfloat16.json (docs/calibration.md). The
hand-set bf16 defaults below are the fallback where that file is absent; they come from the two-H200 measurements
quoted in the reasons, so that a healthy bf16 setup passes and a wrong trainer temperature fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, Optional

CALIBRATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration")

# name: (float32 default, bfloat16 fallback default), one line each so the sizes read side by side.
_VALUES = {
    "trainer_logprob_atol": (1e-5, 5e-2),
    "trainer_rtol": (1e-5, 1e-2),
    "engine_layout_tol": (1e-4, 1e-1),
    "mismatch_tol": (1e-4, 1e-1),
    "kl_tol": (1e-6, 2e-2),
    "top_p_outside_tol": (1e-2, 5e-2),
}

# name: what the tolerance bounds, and why its two sizes are what they are (the flag help and the report quote it).
_REASONS = {
    "trainer_logprob_atol": (
        "max |d log-prob| and |d entropy| of a trainer layout vs tp1; fp32 logits from matmul shards of other "
        "shapes differ by a few ulps (~1e-7 relative); bf16 logits are rounded to 8 bits after the matmul, so one "
        "ulp of a logit (up to ~0.03) can differ"),
    "trainer_rtol": (
        "relative difference of the loss and the logits / LM-head gradient norms vs tp1; fp32 sums in another order "
        "differ by ~1e-7 relative; the bf16 1e-2 is what slime's parallel check allows between the total gradient "
        "norms of two parallel layouts"),
    "engine_layout_tol": (
        "mean |d log-prob| of an engine layout's teacher-forced scores vs the first layout's; fp32 engines differ by "
        "~1e-6; bf16: no more than two different stacks (trainer vs SGLang teacher-forced, 0.046 on two H200s), "
        "while other weights differ by ~1 nat"),
    "mismatch_tol": (
        "mean |trainer - engine| log-prob per token, same log-prob kind on both sides; fp32 KV-cache decoding vs a "
        "full forward differs by ~1e-6; healthy bf16 on two H200s 0.046-0.051 (hf and SGLang)"),
    "kl_tol": (
        "k3 estimate of KL(engine || trainer) (~ mean of d^2 / 2 for small d); healthy bf16 on two H200s "
        "2.4e-3-3.5e-3, a trainer at 1.0 instead of 0.8 temperature 0.12: the bf16 value sits between, ~6x from "
        "each"),
    "top_p_outside_tol": (
        "share of sampled tokens outside the trainer's top-p set: only tokens at the set's boundary can flip, "
        "through rounding of the cumulative probability (and, for SGLang, its kept-set rule differing at the "
        "boundary)"),
}


@dataclasses.dataclass(frozen=True)
class Default:
    """A tolerance's hand-set sizes, used where no calibration is installed for the dtype, and their reason."""

    float32: float
    bfloat16: float
    reason: str

    def value(self, dtype: str) -> float:
        return self.float32 if dtype == "float32" else self.bfloat16


DEFAULTS: Dict[str, Default] = {name: Default(*sizes, _REASONS[name]) for name, sizes in _VALUES.items()}
assert set(_REASONS) == set(_VALUES), "every tolerance has sizes and a reason"


def calibration_path(dtype: str) -> str:
    return os.path.join(CALIBRATION_DIR, f"{dtype}.json")


def calibrated(dtype: str) -> Optional[dict]:
    """The installed calibration for dtype ({"source", "thresholds": {name: {"value", ...}}}), or None."""
    try:
        with open(calibration_path(dtype)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def resolve(name: str, given, dtype: str) -> float:
    """The flag's value if given, else the calibrated value for dtype, else the default."""
    if given is not None:
        return float(given)
    table = calibrated(dtype)
    if table and name in table["thresholds"]:
        return float(table["thresholds"][name]["value"])
    return DEFAULTS[name].value(dtype)


def resolve_all(given: Dict[str, Optional[float]], dtype: str) -> Dict[str, float]:
    """resolve() for every tolerance; `given` maps a name to its flag's value (missing or None: not given)."""
    return {name: resolve(name, given.get(name), dtype) for name in DEFAULTS}


def reason(name: str, dtype: str) -> str:
    table = calibrated(dtype)
    if table and name in table["thresholds"]:
        t = table["thresholds"][name]
        return (f"calibrated: between the worst healthy value {t['healthy_max']:.3g} and the best broken value "
                f"{t['broken_min']:.3g}, margin {t['margin']:.3g}x on each side ({table['source']})")
    return DEFAULTS[name].reason


def source(dtype: str) -> str:
    """One line for the report: which calibration the tolerances come from."""
    table = calibrated(dtype)
    if table:
        return f"calibrated, {os.path.relpath(calibration_path(dtype), os.path.dirname(CALIBRATION_DIR))}: " \
               f"{table['source']}"
    if dtype == "float32":
        return "hand-set float32 defaults (tolerances.py), inside the CPU calibration of docs/calibration.md"
    return "hand-set bfloat16 defaults (tolerances.py); no GPU calibration installed"

# The textbook trainer against the ppo_ops trainer over --train_steps (train_steps.py, --reference_trainer), per model
# dtype: both train from the same weights on the same rollouts, so they part only through rounding, which AdamW's
# normalised steps carry forward (where a gradient is near 0, its sign decides a whole step). Measured on `tiny`
# (fp32, CPU, 8 prompts x 4 samples, 8 steps, seeds 0-4): the two stayed within 4.5e-4 in policy reward and 5.8e-5
# in loss (seed 4; the others within 4e-6 and 2e-7), while the largest step-to-step move of each run was >= 0.14 in
# policy reward and >= 3.8e-3 in loss. Each fp32 band sits near the geometric middle of the two, so rounding passes
# and a reference that trained otherwise (an update behind, another lr) fails at the steps that move. bf16 adds the
# rounding of the two forwards (8-bit logits; under sglang_on_policy the ppo_ops trainer's values are SGLang's
# forward's, ~0.05 nats from transformers'): twice the reward band and five times the loss band, not yet measured
# on a GPU (docs/contributing.md has the run that will).
REFERENCE_REWARD_BAND = {"float32": 0.01, "bfloat16": 0.02}  # |d policy reward| (probability on the target ids)
REFERENCE_LOSS_BAND = {"float32": 2e-4, "bfloat16": 1e-3}  # |d GRPO loss|; the loss is ~ -entropy_coef * entropy
