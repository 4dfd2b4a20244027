"""Default tolerances of the check, per model dtype, each with the reason for its size.

A tolerance flag left unset takes the value for `--dtype`. fp32 values are far tighter than the peer's 1% on gradient
norms: on fp32 the only differences between trainer layouts are the shard shapes of the logits matmul (ppo_ops itself
is bitwise identical across TP), and an fp32 engine differs from the trainer only by the order of its fp32 sums.
"""

from __future__ import annotations

from typing import Dict

# name -> (float32 default, bfloat16 default, reason)
DEFAULTS: Dict[str, tuple] = {
    "trainer_logprob_atol": (
        1e-5, 5e-2,
        "max |d log-prob| and |d entropy| of a trainer layout vs tp1; fp32 logits from matmul shards of other shapes "
        "differ by a few ulps (~1e-7 relative); bf16 logits are rounded to 8 bits after the matmul, so one ulp of a "
        "logit (up to ~0.03) can differ"),
    "trainer_rtol": (
        1e-5, 1e-2,
        "relative difference of the loss and the logits / LM-head gradient norms vs tp1 (the peer accepts 1e-2 on "
        "gradient norms); fp32 sums in another order differ by ~1e-7 relative"),
    "engine_layout_tol": (
        1e-4, 2e-2,
        "mean |d log-prob| of an engine layout's teacher-forced scores vs the first layout's; bf16 engines drift "
        "0.011-0.036 between paths in public reports, fp32 ones by ~1e-6"),
    "mismatch_tol": (
        1e-4, 2e-2,
        "mean |trainer - engine| log-prob per token, same log-prob kind on both sides; fp32 KV-cache decoding vs a "
        "full forward differs by ~1e-6, bf16 by ~1e-2; a wrong trainer temperature gives ~1e-1"),
    "kl_tol": (
        1e-6, 1e-3,
        "k3 estimate of KL(engine || trainer) (~ mean of d^2 / 2 for small d)"),
    "top_p_outside_tol": (
        1e-2, 2e-2,
        "share of sampled tokens outside the trainer's top-p set: only tokens at the set's boundary can flip, through "
        "rounding of the cumulative probability"),
}


def resolve(name: str, given, dtype: str) -> float:
    """The flag's value if given, else the default for dtype."""
    if given is not None:
        return float(given)
    fp32, bf16, _ = DEFAULTS[name]
    return fp32 if dtype == "float32" else bf16


def reason(name: str) -> str:
    return DEFAULTS[name][2]
