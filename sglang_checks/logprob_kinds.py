"""Which log-prob an engine returns, and the ppo_ops arguments that make the trainer compute the same one.

Engines do not agree on what "the log-prob of a sampled token" is, and comparing unlike ones shows a mismatch that
is not there (or hides one that is). Three kinds occur:

  sampler      log of the distribution the sampler drew from: z = logits / T, renormalised over the top-p set.
               The hf engine returns this (log_softmax of transformers' processed scores, see engines/hf_engine.py).
               Trainer: ppo_ops(temperature=T_trainer, keep_mask=top-p set of the trainer's own z).
  temperature  log_softmax(logits / T) over the whole vocabulary, not renormalised over top-p. SGLang 0.5.17's
               output_token_logprobs on its standard sampling path (sampler.py: log(softmax(logits / T)) before
               top-p; log_softmax(bf16(logits) / T) under --rl-on-policy-target).
               Trainer: ppo_ops(temperature=T_trainer, no keep mask).
  raw          log_softmax(logits), temperature 1. SGLang 0.5.17's input_token_logprobs (teacher-forced scores;
               its temperature / top-p flags for them are never set), or its output log-probs under
               SGLANG_RETURN_ORIGINAL_LOGPROB=1. Trainer: ppo_ops(temperature=1, no keep mask).

The top-p set is transformers' rule (TopPLogitsWarper): sort ascending, drop the tokens whose cumulative probability is
<= 1 - top_p, always keep the most likely one. It is computed from the trainer's logits at the trainer's temperature,
the set a trainer renormalises over, and is ppo_ops's keep_mask.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

SAMPLER = "sampler"
TEMPERATURE = "temperature"
RAW = "raw"
KINDS = (SAMPLER, TEMPERATURE, RAW)


def top_p_keep_mask(scaled_logits: torch.Tensor, top_p: float) -> Optional[torch.Tensor]:
    """Bool mask [..., V] of the top-p set of softmax(scaled_logits) (None when top_p >= 1: everything is kept)."""
    if top_p >= 1.0:
        return None
    flat = scaled_logits.reshape(-1, scaled_logits.shape[-1])
    sorted_logits, sorted_idx = torch.sort(flat, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[:, -1] = False  # the most likely token always stays
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    return (~remove).reshape(scaled_logits.shape)


def trainer_arguments(kind: str, trainer_temperature: float,
                      top_p_set: Optional[torch.Tensor]) -> Tuple[float, Optional[torch.Tensor]]:
    """(temperature, keep_mask) for ppo_ops so that it computes log-probs of `kind`; top_p_set from top_p_keep_mask."""
    if kind == SAMPLER:
        return trainer_temperature, top_p_set
    if kind == TEMPERATURE:
        return trainer_temperature, None
    if kind == RAW:
        return 1.0, None
    raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
