"""The saved rollout: sampled tokens, the engine's log-prob of each, the sampling settings and the model fingerprint.

Saved as JSON (`rollout.json` in the report folder; floats are written with Python's repr, so fp32 values round-trip
exactly) and replayed with `--rollout_data`, so every comparison of a run, and of later runs, uses the same tokens.
Replaying a rollout against a model with another fingerprint is refused: its log-probs would not mean anything.

`pack` lays the rollout out as the trainer sees it: right-padded [B, S] token rows where row s of sequence b holds the
logits that predict token s + 1; `row_mask` is true exactly on the rows that predict a completion token (the GRPO loss
mask), `targets` there is that token (elsewhere -100: masked rows' tokens are never read).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, List

import torch

from sglang_checks.errors import CheckError
from sglang_checks.logprob_kinds import KINDS
from sglang_checks.report import write_atomic

FORMAT = "ppo_ops.qwen3_parallel_check.rollout/1"
IGNORE_TARGET = -100


@dataclasses.dataclass
class Sample:
    prompt_index: int
    sample_index: int
    prompt_ids: List[int]
    completion_ids: List[int]
    engine_logprobs: List[float]  # one per completion token, of the rollout's `logprob_kind`


@dataclasses.dataclass
class Rollout:
    model_name: str
    model_fingerprint: str
    engine: str  # "hf" or "sglang"
    engine_layout: str  # the layout that sampled it
    logprob_kind: str  # see logprob_kinds.py
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    samples: List[Sample]

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.samples)

    @property
    def longest(self) -> int:
        return max(len(s.prompt_ids) + len(s.completion_ids) for s in self.samples)


def save(rollout: Rollout, path: str) -> None:
    """Writes the rollout whole or not at all (a temporary file renamed into place)."""
    write_atomic(path, json.dumps({"format": FORMAT, **dataclasses.asdict(rollout)}))


def load(path: str) -> Rollout:
    """Reads and validates a saved rollout field by field; anything off is bad input (CheckError), never scored."""
    flag = f"--rollout_data={path}"
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckError(f"{flag}: cannot read a rollout from the file ({exc})") from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else None
        raise CheckError(f"{flag}: not a rollout of this check (format {found!r}, expected {FORMAT!r})")
    fields = {f.name for f in dataclasses.fields(Rollout)}
    unknown = sorted(set(record) - fields - {"format"})
    missing = sorted(fields - set(record))
    if unknown or missing:
        raise CheckError(f"{flag}: malformed rollout ({'missing ' + ', '.join(missing) if missing else ''}"
                         f"{'; ' if missing and unknown else ''}{'unknown ' + ', '.join(unknown) if unknown else ''})")
    for name in ("model_name", "model_fingerprint", "engine_layout"):
        _expect(isinstance(record[name], str) and record[name], flag, name, "a non-empty string", record[name])
    _expect(record["engine"] in ("hf", "sglang"), flag, "engine", "hf or sglang", record["engine"])
    _expect(record["logprob_kind"] in KINDS, flag, "logprob_kind", f"one of {', '.join(KINDS)}",
            record["logprob_kind"])
    _expect(_is_number(record["temperature"]) and record["temperature"] > 0, flag, "temperature",
            "a finite number > 0", record["temperature"])
    _expect(_is_number(record["top_p"]) and 0 < record["top_p"] <= 1, flag, "top_p", "a number in (0, 1]",
            record["top_p"])
    _expect(_is_int(record["max_new_tokens"]) and record["max_new_tokens"] >= 1, flag, "max_new_tokens",
            "an integer >= 1", record["max_new_tokens"])
    _expect(_is_int(record["seed"]), flag, "seed", "an integer", record["seed"])
    raw_samples = record["samples"]
    _expect(isinstance(raw_samples, list) and raw_samples, flag, "samples", "a non-empty list", raw_samples)
    samples = [_sample(raw, n, flag) for n, raw in enumerate(raw_samples)]
    return Rollout(**{k: v for k, v in record.items() if k not in ("format", "samples")}, samples=samples)


def _is_int(v) -> bool:
    return type(v) is int  # not bool, not a float that happens to be whole


def _is_number(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _expect(ok, flag: str, field: str, expected: str, got) -> None:
    if not ok:
        shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
        raise CheckError(f"{flag}: {field} must be {expected}, got {shown}")


def _sample(raw, n: int, flag: str) -> Sample:
    where = f"sample {n}"
    fields = [f.name for f in dataclasses.fields(Sample)]
    _expect(isinstance(raw, dict) and sorted(raw) == sorted(fields), flag, where,
            f"an object with {', '.join(fields)}", raw if not isinstance(raw, dict) else sorted(raw))
    for name in ("prompt_index", "sample_index"):
        _expect(_is_int(raw[name]) and raw[name] >= 0, flag, f"{where} {name}", "an integer >= 0", raw[name])
    for name in ("prompt_ids", "completion_ids"):
        ids = raw[name]
        _expect(isinstance(ids, list) and ids and all(_is_int(t) and t >= 0 for t in ids), flag, f"{where} {name}",
                "a non-empty list of integer token ids >= 0", ids)
    lps = raw["engine_logprobs"]
    _expect(isinstance(lps, list) and len(lps) == len(raw["completion_ids"]), flag, f"{where} engine_logprobs",
            f"a list of {len(raw['completion_ids'])} log-probs (one per completion token)", lps)
    bad = [v for v in lps if not (_is_number(v) and v <= 0)]
    _expect(not bad, flag, f"{where} engine_logprobs", "finite log-probs <= 0", bad[:1])
    return Sample(**raw)


def check_model(rollout: Rollout, fingerprint: str, model_name: str, path: str) -> None:
    """Refuses a rollout sampled from another model (different weights)."""
    if rollout.model_fingerprint != fingerprint:
        raise CheckError(
            f"--rollout_data={path}: the rollout was sampled from model {rollout.model_name!r} "
            f"(fingerprint {rollout.model_fingerprint[:16]}...), but --model={model_name} has fingerprint "
            f"{fingerprint[:16]}...; replay it with the model that sampled it, or drop --rollout_data")


def check_vocab(rollout: Rollout, vocab_size: int, path: str) -> None:
    for n, s in enumerate(rollout.samples):
        bad = [t for t in s.prompt_ids + s.completion_ids if not 0 <= t < vocab_size]
        if bad:
            raise CheckError(f"--rollout_data={path}: sample {n} has token {bad[0]} outside [0, {vocab_size})")


@dataclasses.dataclass
class Packed:
    """The rollout as trainer tensors, all [B, S] on CPU."""

    input_ids: torch.Tensor  # int64, right-padded with 0 (causal attention: padding never reaches real positions)
    targets: torch.Tensor  # int64, the token row s predicts; IGNORE_TARGET where row_mask is false
    row_mask: torch.Tensor  # bool, rows that predict a completion token
    engine_logprobs: torch.Tensor  # fp32, the engine's log-prob of the target; 0 where row_mask is false
    advantages: torch.Tensor  # fp32 [B], GRPO advantages per sequence (see grpo_advantages)


def pack(rollout: Rollout, seq_len: int) -> Packed:
    batch = len(rollout.samples)
    input_ids = torch.zeros(batch, seq_len, dtype=torch.int64)
    targets = torch.full((batch, seq_len), IGNORE_TARGET, dtype=torch.int64)
    row_mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    engine = torch.zeros(batch, seq_len, dtype=torch.float32)
    for b, s in enumerate(rollout.samples):
        tokens = s.prompt_ids + s.completion_ids
        input_ids[b, :len(tokens)] = torch.tensor(tokens)
        first, last = len(s.prompt_ids) - 1, len(tokens) - 1  # rows predicting the completion
        targets[b, first:last] = torch.tensor(s.completion_ids, dtype=torch.int64)
        row_mask[b, first:last] = True
        engine[b, first:last] = torch.tensor(s.engine_logprobs, dtype=torch.float32)
    return Packed(input_ids, targets, row_mask, engine, grpo_advantages(rollout))


def reward(completion_ids: List[int]) -> float:
    """A deterministic stand-in reward (no task here): the share of even token ids in the completion."""
    return sum(1 for t in completion_ids if t % 2 == 0) / max(len(completion_ids), 1)


def grpo_advantages(rollout: Rollout) -> torch.Tensor:
    """GRPO: each sample's reward minus its prompt group's mean, over the group's std (+1e-6; 0 for a lone sample)."""
    groups: Dict[int, List[int]] = {}
    for b, s in enumerate(rollout.samples):
        groups.setdefault(s.prompt_index, []).append(b)
    rewards = torch.tensor([reward(s.completion_ids) for s in rollout.samples], dtype=torch.float64)
    advantages = torch.zeros_like(rewards)
    for members in groups.values():
        r = rewards[members]
        std = r.std(unbiased=False) if len(members) > 1 else torch.tensor(1.0, dtype=torch.float64)
        advantages[members] = (r - r.mean()) / (std + 1e-6)
    return advantages.float()


def settings_dict(rollout: Rollout) -> Dict[str, Any]:
    return {k: getattr(rollout, k) for k in ("engine", "engine_layout", "logprob_kind", "temperature", "top_p",
                                              "max_new_tokens", "seed")}
