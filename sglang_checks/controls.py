"""Negative controls: faults injected on purpose, each of which the check must FAIL on, with the metric named here.

A testing aid (`--negative_control=NAME`), not a mode for real runs: it proves that each metric separates a healthy
setup from a broken one, and the calibration (calibrate.py) measures by how much. Each control reproduces a bug that
RL stacks have shipped:

  trainer_temperature    the trainer scores at TEMPERATURE_FACTOR x the rollout temperature (a sampler temperature
                         that never reached the trainer)
  trainer_top_p          the trainer's top-p set is built with CONTROL_TOP_P instead of the rollout's top-p
  trainer_weights        the trainer holds other weights (the generated model with seed + 1: a stale checkpoint)
  shifted_logprobs       the trainer's log-prob of completion token k is compared with the engine's of token k + 1
                         (labels not shifted, or shifted twice)
  vocab_offset           the last TP rank of every tensor-parallel trainer layout takes its LM-head rows from an
                         offset VOCAB_OFFSET rows too far (a vocabulary-partition offset computed wrongly)
  engine_layout_weights  the last engine layout serves other weights (seed + 1: a replica that missed a weight sync)
  trainer_weight_ulp     one trainer weight element (the first of the final norm's weight, which every token's
                         hidden state is scaled by) one ulp of its dtype off: a weight sync that lost one bit. Only
                         exact equality (--expect_bitwise, true on-policy) can catch a fault this small, so it is in
                         BITWISE_CONTROLS and caught by no tolerance.

Each control is caught by the comparisons held to the tolerances in CAUGHT_BY (tolerances.py names); calibrate.py
takes the largest such value in a control's run as that control's "broken" value for those tolerances.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

NONE = "none"
TRAINER_TEMPERATURE = "trainer_temperature"
TRAINER_TOP_P = "trainer_top_p"
TRAINER_WEIGHTS = "trainer_weights"
SHIFTED_LOGPROBS = "shifted_logprobs"
VOCAB_OFFSET = "vocab_offset"
ENGINE_LAYOUT_WEIGHTS = "engine_layout_weights"
TRAINER_WEIGHT_ULP = "trainer_weight_ulp"

# control -> (what it breaks, tolerance names whose comparisons must fail)
CONTROLS: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    TRAINER_TEMPERATURE: ("trainer at another temperature", ("mismatch_tol", "kl_tol")),
    TRAINER_TOP_P: ("trainer with another top-p", ("top_p_outside_tol",)),
    TRAINER_WEIGHTS: ("trainer with other weights (seed + 1)", ("mismatch_tol", "kl_tol")),
    SHIFTED_LOGPROBS: ("trainer log-probs shifted by one position", ("mismatch_tol", "kl_tol")),
    VOCAB_OFFSET: ("a trainer TP shard with the wrong vocabulary offset", ("trainer_logprob_atol", "trainer_rtol")),
    ENGINE_LAYOUT_WEIGHTS: ("an engine layout with other weights (seed + 1)", ("engine_layout_tol",)),
}
# Controls that only exact equality catches (what the trainer-engine comparisons must show under --expect_bitwise).
BITWISE_CONTROLS = {TRAINER_WEIGHT_ULP: "trainer weights one ulp off in one element"}
NAMES = (NONE,) + tuple(CONTROLS) + tuple(BITWISE_CONTROLS)

# 0.8 -> 1.0 with the default rollout temperature: the measured two-H200 case (KL 0.12 in bf16).
TEMPERATURE_FACTOR = 1.25
# Well inside the default rollout top-p of 0.95, so tokens sampled from the rollout's set fall outside the trainer's.
CONTROL_TOP_P = 0.5
# seed + 1: another draw of the same architecture, as a stale or wrong checkpoint would be.
WEIGHTS_SEED_OFFSET = 1
# One row: the smallest partition-offset error (e.g. an unpadded vs a padded vocabulary size).
VOCAB_OFFSET_ROWS = 1


ULP_WEIGHT = "model.norm.weight"  # one element scales one channel of every token's final hidden state


def one_ulp_off(model):
    """A copy of `model` with the first element of ULP_WEIGHT moved one ulp of its dtype away from zero."""
    import copy

    import torch

    other = copy.deepcopy(model)
    weight = dict(other.named_parameters())[ULP_WEIGHT]
    with torch.no_grad():
        flat = weight.view(-1)
        value = flat[:1]
        flat[:1] = torch.nextafter(value, torch.where(value >= 0, torch.full_like(value, float("inf")),
                                                      torch.full_like(value, float("-inf"))))
    return other


def shift_by_one(rows: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[B, S] log-prob rows where completion row s holds what row s + 1 held (the last completion row gets 0)."""
    shifted = np.zeros_like(rows)
    shifted[:, :-1] = rows[:, 1:]
    return np.where(mask, shifted, rows)
