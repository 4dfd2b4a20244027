"""The embedded engine: transformers generation (CPU or GPU) that returns the log-prob of every sampled token.

Sampling: one `generate` call per prompt with `samples_per_prompt` copies of it (same length, so no padding), seeded
with `seed * 1_000_003 + prompt_index` through torch's global RNG (transformers' multinomial draws from it; the
caller's RNG state is restored afterwards). The generation config is built from scratch (do_sample, temperature,
top_p, top_k=0, nothing else), so a checkpoint's generation_config.json (top_k=20, repetition penalty, ...) cannot
change the distribution behind our back.

Engine log-prob (kind `sampler`, logprob_kinds.py): log_softmax of transformers' processed per-step scores
(`output_scores`: the raw logits in fp32, divided by the temperature, tokens outside the top-p set at -inf), i.e.
the log of exactly the distribution the multinomial sampler drew from. Every step is checked against our own
processing of the raw logits (`output_logits`); any other processor transformers applied is an error, not a silent
mismatch.

Teacher-forced scoring (`score`, kind `raw`, as SGLang's input log-probs): one forward over prompt + completion,
log_softmax of the fp32 logits. Engine layout `dpN` scores the samples as N separate batches (N replicas' shares),
so a batch-composition dependence shows up as an engine layout difference.
"""

from __future__ import annotations

from typing import List

import torch

from sglang_checks import logprob_kinds
from sglang_checks.engines import SamplingSettings, completion_until_eos
from sglang_checks.errors import CheckError
from sglang_checks.layouts import Layout
from sglang_checks.rollout import Sample

ALLOWED_DIMS = ("tp", "dp")


def check_layout(layout: Layout, flag: str) -> None:
    if layout.tp != 1 or layout.cp != 1:
        raise CheckError(
            f"{flag}: the hf engine runs unsharded, so its layouts may only split the batch (dpN); got "
            f"{layout.name!r}. Use --engine=sglang for tensor-parallel engine layouts")


class HFEngine:
    name = "hf"
    sampled_logprob_kind = logprob_kinds.SAMPLER

    def __init__(self, model, layout: Layout, device: torch.device, progress=lambda it, **kw: it):
        self.model = model
        self.layout = layout
        self.device = device
        self._progress = progress

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.model = None

    def info(self) -> dict:
        import transformers

        return {"engine": "hf", "layout": self.layout.name, "version": f"transformers {transformers.__version__}",
                "command": "embedded (eager attention)", "startup_s": 0.0}

    def load_state_dict(self, state_dict) -> None:
        """Replaces every weight of the model in place (the training steps' sync, train_steps.py); strict, so a
        missing or unexpected tensor name is an error, not a weight silently left behind."""
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)

    def checksums(self) -> dict:
        """Per-tensor checksums of the weights the engine now serves, read back from its model."""
        from sglang_checks import models

        return models.state_checksums(self.model)

    def generate(self, prompts: List[List[int]], samples_per_prompt: int, settings: SamplingSettings) -> List[Sample]:
        from transformers import GenerationConfig

        eos = settings.eos_token_id or None
        config = GenerationConfig(
            do_sample=True, temperature=settings.temperature, top_p=settings.top_p, top_k=0,
            max_new_tokens=settings.max_new_tokens, min_new_tokens=0, eos_token_id=eos,
            pad_token_id=eos[0] if eos else 0, output_scores=True, output_logits=True,
            return_dict_in_generate=True)
        samples = []
        for p_index, prompt in enumerate(self._progress(prompts, desc=f"hf {self.layout.name} sampling")):
            ids = torch.tensor([prompt] * samples_per_prompt, dtype=torch.int64, device=self.device)
            devices = [self.device.index or 0] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(settings.seed * 1_000_003 + p_index)
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            scores = torch.stack(out.scores, dim=1).float()  # [n, steps, V], what the sampler drew from
            _check_processing(torch.stack(out.logits, dim=1).float(), scores, settings)
            new_tokens = out.sequences[:, len(prompt):]
            logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens[..., None])[..., 0]
            for s_index in range(samples_per_prompt):
                tokens = new_tokens[s_index].tolist()
                keep = completion_until_eos(tokens, eos)
                samples.append(Sample(prompt_index=p_index, sample_index=s_index, prompt_ids=list(prompt),
                                      completion_ids=tokens[:keep],
                                      engine_logprobs=logprobs[s_index, :keep].tolist()))
        return samples

    def score(self, samples: List[Sample]) -> List[List[float]]:
        parts = [samples[i * len(samples) // self.layout.dp:(i + 1) * len(samples) // self.layout.dp]
                 for i in range(self.layout.dp)]
        result = []
        for part in self._progress(parts, desc=f"hf {self.layout.name} scoring"):
            if part:
                result.extend(self._score_batch(part))
        return result

    def _score_batch(self, samples: List[Sample]) -> List[List[float]]:
        longest = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        ids = torch.zeros(len(samples), longest, dtype=torch.int64)
        for b, s in enumerate(samples):
            tokens = s.prompt_ids + s.completion_ids
            ids[b, :len(tokens)] = torch.tensor(tokens)
        with torch.no_grad():  # right padding and causal attention: no mask needed
            logits = self.model(ids.to(self.device)).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        out = []
        for b, s in enumerate(samples):
            first = len(s.prompt_ids) - 1
            rows = logprobs[b, first:first + len(s.completion_ids)]
            targets = torch.tensor(s.completion_ids, device=rows.device)
            out.append(rows.gather(-1, targets[:, None])[:, 0].tolist())
        return out


def _check_processing(logits: torch.Tensor, scores: torch.Tensor, settings: SamplingSettings) -> None:
    """transformers' processed scores [n, steps, V] must be exactly logits / T with the top-p set kept, nothing else.

    Step by step, on [n, V] like transformers' warpers, so the same kernels see the same shapes (bitwise equal)."""
    differing = 0
    for step in range(logits.shape[1]):
        raw = logits[:, step]
        expected = raw / settings.temperature if settings.temperature != 1.0 else raw
        keep = logprob_kinds.top_p_keep_mask(expected, settings.top_p)
        if keep is not None:
            expected = expected.masked_fill(~keep, float("-inf"))
        differing += int((expected != scores[:, step]).sum())  # -inf == -inf, so only real differences count
    if differing:
        raise RuntimeError(
            f"transformers processed the logits beyond temperature {settings.temperature} and top-p "
            f"{settings.top_p} ({differing} entries differ); the engine log-probs would not be the sampler's")
