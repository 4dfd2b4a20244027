"""The verifiable reward of the training steps: the share of a completion's tokens that lie in a fixed target set.

A completion of n tokens earns |{t in completion : t in TARGET}| / n, in [0, 1], with TARGET the token ids divisible
by TARGET_MODULUS. It needs no tokenizer and no task text, so it runs on a generated model with random weights, and it
is exactly reproducible from the token ids alone (a rollout file carries all it needs).

Why a random model can learn it within a few steps: every sampling step draws from a distribution that already puts
about 1 / TARGET_MODULUS of its mass on target ids (random weights do not prefer any residue), so each GRPO group
holds completions with more and with fewer target tokens, the advantages are rarely all zero, and the signal is dense:
every completion token is a choice between a target and a non-target id. The gradient of the surrogate raises the
target ids' logits directly through the LM head rows (untied on `tiny`), which is one linear layer away from the loss,
so the share rises step by step instead of waiting for a rare success.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

# Target ids: every TARGET_MODULUS-th id. 4 gives a start near 0.25, far from both 0 (no signal) and 1 (no room).
TARGET_MODULUS = 4


def in_target(token_id: int) -> bool:
    return token_id % TARGET_MODULUS == 0


def reward(completion_ids: Sequence[int]) -> float:
    """Share of the completion's tokens in the target set (0 for an empty completion)."""
    if not completion_ids:
        return 0.0
    return sum(1 for t in completion_ids if in_target(t)) / len(completion_ids)


def rewards(completions: Sequence[Sequence[int]]) -> List[float]:
    return [reward(c) for c in completions]


def target_mass(probs: torch.Tensor) -> torch.Tensor:
    """probs [..., V] -> [...]: the probability of the target set, the reward's expectation for the next token."""
    return probs[..., ::TARGET_MODULUS].sum(-1)
