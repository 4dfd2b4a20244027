"""Rollout engines. Both implement the same small interface:

    engine.generate(prompts, samples_per_prompt, settings) -> [Sample]   # sample completions + their log-probs
    engine.score(samples) -> [[float]]   # teacher-forced "raw" log-prob of every completion token
    engine.sampled_logprob_kind          # what generate's log-probs are (logprob_kinds.py)
    engine.info() -> dict                # what ran: engine, layout, version, command, startup_s
    engine.close()                       # also on failure; engines are context managers

hf_engine.py is the embedded default (transformers, CPU or GPU); sglang_engine.py drives an SGLang server.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    eos_token_id: Optional[List[int]]  # None or [] with ignore_eos: completions always have max_new_tokens tokens


def completion_until_eos(tokens: List[int], eos: Optional[List[int]]) -> int:
    """Length of the completion: up to and including the first end-of-sequence token, else all of it."""
    for n, token in enumerate(tokens):
        if eos and token in eos:
            return n + 1
    return len(tokens)
