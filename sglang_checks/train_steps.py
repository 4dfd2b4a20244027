"""The check across GRPO training steps (--train_steps=N): train, sync the weights into the engine, roll out, check.

After the check's own step, one trainer in this process (TP = 1) runs N GRPO steps against the engine, with the
head --train_head names: `logits` (the check's tp1 layout: the model's final hidden states h, logits = h @ W^T in the
model's dtype, ppo_ops.log_probs_and_entropy at the rollout's temperature and log-prob kind, the trainer's own top-p
set as keep mask) or `fused` (the check's tp1-fused layout: ppo_ops.linear_token_loss on h and W with the GRPO loss
in its forward, the top-p set as its sparse keep set; under sglang_on_policy in SGLang's exact order, from the
on-policy forward's h). The check's comparisons of a step read the logits path's log-probs of the same weights; the
ratio, the loss and the entropy are the training head's.
Every engine layout of --engine_layouts runs for the whole run and gets every sync; the first one samples.

  step k = 0 .. N:
    sync      the trainer's weights (in the model's dtype) go into every engine layout, then are read back:
                hf engine   load_state_dict into its model; every tensor's SHA-256 compared with the trainer's
                SGLang      saved as a Hugging Face checkpoint (config.json + model.safetensors, the model's dtype,
                            a tied embedding stored once, as the model saves itself) into a folder of the report
                            directory, loaded with POST /update_weights_from_disk; READBACK_TENSORS' first
                            READBACK_ROWS rows read back with POST /get_weights_by_name and compared value by value
              and a fixed probe batch is teacher-forced through the engine and through the trainer's own scoring
              (the trainer numerics' forward, raw log-probs). Exact (0) on the hf engine (the same code on the same
              weights) and under --expect_bitwise; otherwise its mean |engine - trainer| is held to mismatch_tol,
              the check's own bound on teacher-forced scores of two stacks
    rollout   the first engine layout samples --samples_per_prompt completions of the check's prompts (a GRPO group
              each) at the check's sampling settings, with the step's own seed; every engine layout teacher-force
              scores them
    check     the comparisons of the check's own step (check.compare: the trainer's sampled and teacher-forced
              log-probs against every engine layout's, engine layouts against the first), on the step's rollout
              with the step's weights; the ratio exp(trainer - engine) of the step's first (and only) minibatch
              against the engine's sampling-time log-probs: mean |ratio - 1| within expm1(mismatch_tol). Not held
              to exactly 1 under --expect_bitwise, as the check's sampled comparison is not: SGLang samples with
              its decode kernels (split-KV decode attention), whose bits are not its prefill's; the exact claim is
              the teacher-forced scores (prefill) and the probe batch, exactly 0 at every step
    update    (k < N) the GRPO loss of the step's tokens (ppo_ops.grpo_loss: group-normalised advantages of
              reward.py's rewards, old log-probs = the trainer's own before the update, no KL term: no reference
              model is kept), backward, gradient clipped, one AdamW step on fp32 master weights, cast back to the
              model's dtype (a bf16 model keeps fp32 masters; a fp32 model's weights are the masters)

Trainer layouts: the weights are trained by the in-process tp1 trainer only. Every other --trainer_layouts layout
scores each step's rollout with that step's weights and is compared with tp1 by the check's own comparisons
(trainer.run_jobs, all steps on one group of ranks after the last step, the training's seq_mean loss only; a `-fused`
layout runs ppo_ops' fused head, under sglang_on_policy in SGLang's exact order).

--trainer_numerics=sglang_on_policy: the trainer's log-probs and entropies (the ratio, the loss's value, the
comparisons) are those of SGLang's on-policy forward (on_policy.py, the check's on-policy trainer), and their
gradient is that of transformers' forward of the same weights: value + (hf - hf.detach()), which adds an exact 0 to
the on-policy value (SGLang's prefill kernels have no backward).

--reference_trainer: a textbook PyTorch trainer (ReferenceTrainer) from the same initial weights replays every
step's rollout (the same tokens, rewards and advantages) with its own forward: fp32 log_softmax of the logits, gather,
softmax entropy, the GRPO loss written out in torch ops, the same AdamW, clipping and masters. Its first step's loss
and gradient norm are held to trainer_rtol against the ppo_ops trainer's; over the run its policy reward and loss
stay within REFERENCE_REWARD_BAND and REFERENCE_LOSS_BAND (tolerances.py). The sampled reward of a replayed rollout is
the same for both by construction, so the reward curve compared is the policy reward: the probability mass each
trainer's policy puts on reward.py's target ids at the step's completion positions (softmax at the rollout's
temperature, before its update), which moves with each trainer's own weights.

Row k of the report holds step k's numbers: mean reward, policy reward, mean entropy, loss, gradient norm (before
clipping), the ratio, the mismatch and k3 KL, the sync results per engine layout, the step time and the peak memory;
with --reference_trainer the reference's policy reward, entropy, loss and gradient norm beside them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import resource
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from sglang_checks import controls, logprob_kinds, metrics, models, reward as reward_lib, rollout as rollout_lib
from sglang_checks import tolerances, trainer
from sglang_checks.engines import hf_engine
from sglang_checks.errors import CheckError
from sglang_checks.metrics import Comparison

SECTION = "train steps"
# Sampling seeds of the training rollouts: the check's seed plus this plus the step, so no step reuses the check's own
# rollout draws (the check samples with --seed itself).
SEED_OFFSET = 1000
# The PPO clip of the surrogate, as the check's trainer layouts (trainer.py). With one update per rollout and
# old = the trainer's own log-probs every ratio is 1, so it never binds; it is there because a trainer has it.
CLIP_LOW, CLIP_HIGH = trainer.CLIP_LOW, trainer.CLIP_HIGH
# Gradient clipping at global norm 1.0, the usual GRPO trainer default: a few steps from random init must not jump.
MAX_GRAD_NORM = 1.0
# No weight decay: only the loss moves the weights, so a rising reward is the loss's doing.
WEIGHT_DECAY = 0.0
# GRPO's advantage: (r - group mean) / (unbiased group std + GRPO_EPS), ppo_ops.grpo_loss's default eps.
GRPO_EPS = 1e-6
# The synced engine must hold the trainer's weights bit for bit: a copy of tensors changes no bit.
SYNC_TENSORS_TOL = 0
# Same weights, same code (the hf engine's own scoring, or on-policy numerics under --expect_bitwise): equal bits.
SYNC_PROBE_TOL = 0.0
# A loss or gradient norm that is NaN or infinite ruins every later step: none is allowed.
NONFINITE_TOL = 0
# Probe batch: PROBE_PROMPTS of the check's prompts, each followed by PROBE_TOKENS fixed completion ids.
PROBE_PROMPTS, PROBE_TOKENS = 2, 8
# SGLang read-back (POST /get_weights_by_name): tensors SGLang holds under the checkpoint's own name and unsplit at
# any TP on their first rows (the vocab-parallel embedding's first rows are rank 0's; norms are replicated).
# model.norm.weight is also the tensor the trainer_weight_ulp control moves.
READBACK_TENSORS = ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight")
READBACK_ROWS = 4  # rows of each (a norm weight has one: all of it)
# The loss normalization the steps train with; the trainer layouts score each step's rollout with it alone (the
# check's own step scores both of trainer.VARIANTS).
TRAINED_VARIANT = "seq_mean"
# --train_head: what the in-process trainer trains with (module docstring).
LOGITS_HEAD, FUSED_HEAD = "logits", "fused"
TRAIN_HEADS = (LOGITS_HEAD, FUSED_HEAD)


def check_settings(s) -> None:
    """--train_steps, --lr, --reference_trainer and what training needs of the other flags (bad input: CheckError
    naming the flag)."""
    if s.train_steps < 0:
        raise CheckError(f"--train_steps: expected 0 (no training) or a positive number of steps, got "
                         f"{s.train_steps}")
    if not (math.isfinite(s.lr) and s.lr > 0):
        raise CheckError(f"--lr: expected a finite learning rate > 0, got {s.lr}")
    if not s.train_steps:
        if s.reference_trainer:
            raise CheckError("--reference_trainer: replays the training steps' rollouts; expected --train_steps "
                             ">= 1, got --train_steps=0")
        return
    if s.samples_per_prompt < 2:
        raise CheckError(f"--train_steps={s.train_steps}: GRPO compares the completions of one prompt; expected "
                         f"--samples_per_prompt >= 2, got {s.samples_per_prompt}")
    if s.train_head not in TRAIN_HEADS:
        raise CheckError(f"--train_head: expected one of {', '.join(TRAIN_HEADS)}, got {s.train_head}")
    if s.negative_control not in (controls.NONE, controls.TRAINER_WEIGHT_ULP):
        raise CheckError(f"--train_steps={s.train_steps}: of the negative controls the training steps carry only "
                         f"{controls.TRAINER_WEIGHT_ULP} (each sync then delivers weights one ulp off); got "
                         f"--negative_control={s.negative_control}")


class Trainer:
    """One TP = 1 trainer: the model in its dtype for the forward, fp32 master weights for AdamW. Under
    sglang_on_policy (`kernels` given) its values are the on-policy forward's, its gradient transformers' (module
    docstring)."""

    def __init__(self, model, lr: float, *, numerics: str = trainer.HF, kernels=None, head: str = LOGITS_HEAD):
        self.model = model.eval()  # Qwen3 has no dropout; eval keeps the forward the engine's
        self.numerics, self.kernels, self.head = numerics, kernels, head
        self.params = [p for p in model.parameters()]  # tied weights appear once
        for p in self.params:
            p.requires_grad_(True)
        if all(p.dtype == torch.float32 for p in self.params):
            self.masters = self.params
        else:  # a bf16 model's updates are far below its rounding step: accumulate them in fp32
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=WEIGHT_DECAY)

    def forward(self, packed: rollout_lib.Packed, rollout: rollout_lib.Rollout, temperature: float, top_p: float):
        """(log-probs [B, S] fp32, entropy [B, S] fp32, differentiable w.r.t. the weights; the check's TrainerView of
        the step, no gradient) of the packed tokens at the rollout's log-prob kind."""
        from sglang_checks import check as check_lib

        device = self.model.device
        targets, row_mask = packed.targets.to(device), packed.row_mask.to(device)
        hidden = self.model.model(input_ids=packed.input_ids.to(device)).last_hidden_state
        weight = self.model.lm_head.weight
        logits = trainer.lm_head_logits(hidden, weight)
        with torch.no_grad():
            top_p_set = logprob_kinds.top_p_keep_mask(logits.float() / temperature, top_p)
        t, keep = logprob_kinds.trainer_arguments(rollout.logprob_kind, temperature, top_p_set)
        out = trainer.log_probs_and_entropy(logits, targets, temperature=t, keep_mask=keep, row_mask=row_mask,
                                            entropy="grad")
        if self.numerics == trainer.HF:
            view = check_lib.TrainerView(hidden.detach(), weight.detach(), logits.detach(), temperature, top_p,
                                         top_p_set, keep, trainer.HF)
            return out.log_probs, out.entropy, view
        view = check_lib.trainer_view(self.model, packed, rollout, temperature, top_p, numerics=self.numerics,
                                      kernels=self.kernels)
        t, _ = logprob_kinds.trainer_arguments(rollout.logprob_kind, temperature, view.top_p_set)
        with torch.no_grad():
            exact = trainer.log_probs_and_entropy(view.logits, targets, numerics=self.numerics, temperature=t,
                                                  keep_mask=view.keep, row_mask=row_mask, entropy="value")
        log_probs = exact.log_probs + (out.log_probs - out.log_probs.detach())  # the value + an exact 0
        entropy = exact.entropy + (out.entropy - out.entropy.detach())
        return log_probs, entropy, view

    def loss(self, packed: rollout_lib.Packed, rollout: rollout_lib.Rollout, rewards: List[float], group_size: int,
             entropy_coef: float):
        """(the GRPO loss with its graph, log-probs [B, S], entropy [B, S], the step's TrainerView) by self.head."""
        import ppo_ops

        if self.head == FUSED_HEAD:
            return self._fused_loss(packed, rollout, rewards, group_size, entropy_coef)
        log_probs, entropy, view = self.forward(packed, rollout, rollout.temperature, rollout.top_p)
        device = log_probs.device
        loss_fn = ppo_ops.grpo_loss(log_probs.detach(), torch.tensor(rewards, dtype=torch.float32, device=device),
                                    _seq_ids(packed, device), group_size=group_size, eps=GRPO_EPS, clip_low=CLIP_LOW,
                                    clip_high=CLIP_HIGH, entropy_coef=entropy_coef, kl_coef=0.0,
                                    loss_mask=packed.row_mask.to(device), normalization=TRAINED_VARIANT)
        return loss_fn.total(log_probs, entropy), log_probs, entropy, view

    def _fused_loss(self, packed, rollout, rewards, group_size, entropy_coef):
        """The fused head (ppo_ops.linear_token_loss, the loss's gradient formed in its forward, no logits): from
        transformers' final hidden states, or under sglang_on_policy from the on-policy forward's (their value, the
        gradient into transformers' graph, as Trainer.forward does it) in SGLang's order."""
        import ppo_ops
        from sglang_checks import check as check_lib

        device = self.model.device
        targets, mask = packed.targets.to(device), packed.row_mask.to(device)
        hidden = self.model.model(input_ids=packed.input_ids.to(device)).last_hidden_state
        weight = self.model.lm_head.weight
        if self.numerics == trainer.HF:
            logits = trainer.lm_head_logits(hidden.detach(), weight.detach())
            top_p_set = logprob_kinds.top_p_keep_mask(logits.float() / rollout.temperature, rollout.top_p)
            t, keep_mask = logprob_kinds.trainer_arguments(rollout.logprob_kind, rollout.temperature, top_p_set)
            view = check_lib.TrainerView(hidden.detach(), weight.detach(), logits, rollout.temperature,
                                         rollout.top_p, top_p_set, keep_mask, trainer.HF)
            order = "fused"
        else:
            view = check_lib.trainer_view(self.model, packed, rollout, rollout.temperature, rollout.top_p,
                                          numerics=self.numerics, kernels=self.kernels)
            t, keep_mask = logprob_kinds.trainer_arguments(rollout.logprob_kind, rollout.temperature,
                                                           view.top_p_set)
            hidden = view.hidden.detach() + (hidden.float() - hidden.float().detach())  # the value + an exact 0
            weight = weight.float()  # as the check's fused layouts pass it: fp32 leaves, SGLang's bf16 rounding inside
            order = "sglang"
        keep = None if keep_mask is None else sparse_keep(keep_mask)
        options = dict(temperature=t, row_mask=mask, keep=keep, reduction_order=order)
        with torch.no_grad():  # PPO's old log-probs: this trainer's own, before the update
            old = ppo_ops.linear_log_probs_and_entropy(hidden.detach(), weight.detach(), targets, **options).log_probs
        token_loss = ppo_ops.grpo_loss(old, torch.tensor(rewards, dtype=torch.float32, device=device),
                                       _seq_ids(packed, device), group_size=group_size, eps=GRPO_EPS,
                                       clip_low=CLIP_LOW, clip_high=CLIP_HIGH, entropy_coef=entropy_coef,
                                       kl_coef=0.0, loss_mask=mask, normalization=TRAINED_VARIANT)
        loss, out = ppo_ops.linear_token_loss(hidden, weight, targets, token_loss, entropy="grad", **options)
        return loss, out.log_probs, out.entropy, view

    def step(self, loss: torch.Tensor, update: bool) -> float:
        """Backward; the gradient norm before clipping; with `update`, one AdamW step, cast into the model."""
        for p in self.params + self.masters:
            p.grad = None
        loss.backward()
        if self.masters is not self.params:
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
        norm = float(torch.nn.utils.clip_grad_norm_(self.masters, MAX_GRAD_NORM))
        if update:
            self.optimizer.step()
            if self.masters is not self.params:
                with torch.no_grad():
                    for p, m in zip(self.params, self.masters):
                        p.copy_(m)
        for p in self.params + self.masters:
            p.grad = None
        return norm


def _seq_ids(packed: rollout_lib.Packed, device) -> torch.Tensor:
    mask = packed.row_mask
    return torch.arange(mask.shape[0])[:, None].expand_as(mask).to(device)


def sparse_keep(keep_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A dense keep mask [..., V] as the fused head's sparse keep set (ids, offsets) over the flattened rows."""
    flat = keep_mask.reshape(-1, keep_mask.shape[-1])
    offsets = torch.zeros(flat.shape[0] + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = flat.sum(1).cumsum(0)
    return flat.nonzero()[:, 1].contiguous(), offsets


class ReferenceTrainer(Trainer):
    """The textbook trainer of --reference_trainer: transformers' logits, then plain torch in fp32 (module
    docstring); the optimizer, clipping and masters are Trainer's."""

    def __init__(self, model, lr: float):
        super().__init__(model, lr)

    def loss(self, packed: rollout_lib.Packed, rollout: rollout_lib.Rollout, temperature: float, top_p: float,
             rewards: List[float], group_size: int, entropy_coef: float):
        """(GRPO loss, log-probs [B, S], entropy [B, S], logits [B, S, V] without gradient)."""
        device = self.model.device
        logits = self.model(input_ids=packed.input_ids.to(device)).logits
        targets = packed.targets.to(device).clamp(min=0)
        mask = packed.row_mask.to(device)
        kind = rollout.logprob_kind
        z = logits.float() / (1.0 if kind == logprob_kinds.RAW else temperature)
        scored = z
        if kind == logprob_kinds.SAMPLER and top_p < 1.0:  # renormalised over the top-p set and the target
            keep = logprob_kinds.top_p_keep_mask(z.detach(), top_p)
            keep = keep.scatter(-1, targets[..., None], True)
            scored = z.masked_fill(~keep, float("-inf"))
        log_probs = torch.log_softmax(scored, dim=-1).gather(-1, targets[..., None])[..., 0]
        log_p = torch.log_softmax(z, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)  # over the whole distribution at the temperature
        log_probs = torch.where(mask, log_probs, torch.zeros_like(log_probs))
        entropy = torch.where(mask, entropy, torch.zeros_like(entropy))

        r = torch.tensor(rewards, dtype=torch.float32, device=device).view(-1, group_size)
        advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + GRPO_EPS)).reshape(-1, 1)
        ratio = torch.exp(log_probs - log_probs.detach())
        surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
        per_token = (surrogate - entropy_coef * entropy) * mask
        counts = mask.sum(1)
        has = counts > 0
        per_sequence = per_token.sum(1)[has] / counts[has]
        return per_sequence.sum() / has.sum(), log_probs, entropy, logits.detach()


def policy_reward(logits: torch.Tensor, temperature: float, mask: torch.Tensor) -> float:
    """Mean over the masked rows of the probability the policy softmax(logits / T) puts on reward.py's target ids:
    the reward its next token would earn in expectation, in fp32."""
    with torch.no_grad():
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        mass = reward_lib.target_mass(probs)
        return float(mass[mask.to(mass.device)].double().mean())


def probe_samples(prompt_ids: List[List[int]], vocab_size: int) -> List[rollout_lib.Sample]:
    """A fixed teacher-forcing batch: the first prompts, each with fixed completion ids spread over the vocabulary."""
    out = []
    for n, prompt in enumerate(prompt_ids[:PROBE_PROMPTS]):
        completion = [(7919 * (n * PROBE_TOKENS + i) + 13) % vocab_size for i in range(PROBE_TOKENS)]
        out.append(rollout_lib.Sample(prompt_index=n, sample_index=0, prompt_ids=list(prompt),
                                      completion_ids=completion, engine_logprobs=[0.0] * PROBE_TOKENS))
    return out


def trainer_scores(trainer_: Trainer, samples: List[rollout_lib.Sample], info: models.ModelInfo,
                   layout) -> List[List[float]]:
    """The trainer's teacher-forced raw log-probs of `samples`, as an engine's score() returns them: the hf engine's
    own scoring on the trainer's model (hf numerics), or the on-policy forward (sglang_on_policy)."""
    if trainer_.numerics == trainer.HF:
        return hf_engine.HFEngine(trainer_.model, layout, trainer_.model.device).score(samples)
    from sglang_checks import check as check_lib

    rollout = rollout_lib.Rollout(model_name=info.name, model_fingerprint=info.fingerprint, engine="probe",
                                  engine_layout=layout.name, logprob_kind=logprob_kinds.RAW, temperature=1.0,
                                  top_p=1.0, max_new_tokens=PROBE_TOKENS, seed=0, samples=samples)
    packed = rollout_lib.pack(rollout, rollout.longest)
    view = check_lib.trainer_view(trainer_.model, packed, rollout, 1.0, 1.0, numerics=trainer_.numerics,
                                  kernels=trainer_.kernels)
    rows = check_lib.trainer_logprobs(view.logits, packed, logprob_kinds.RAW, 1.0, None, trainer_.numerics)
    return [rows[b, len(x.prompt_ids) - 1:len(x.prompt_ids) - 1 + len(x.completion_ids)].tolist()
            for b, x in enumerate(samples)]


# ------------------------------------------------------------------------------------------------ the weight sync


def sent_state(model, control: str) -> Dict[str, torch.Tensor]:
    """The state dict a sync delivers: the trainer's tensors (copies), under the trainer_weight_ulp control with
    controls.ULP_WEIGHT's first element one ulp away from zero, as controls.one_ulp_off moves it."""
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    if control == controls.TRAINER_WEIGHT_ULP:
        flat = state[controls.ULP_WEIGHT].view(-1)
        toward = torch.full_like(flat[:1], float("inf") if float(flat[0]) >= 0 else float("-inf"))
        flat[:1] = torch.nextafter(flat[:1], toward)
    return state


def save_weights(model, state: Dict[str, torch.Tensor], folder: str) -> None:
    """`state` (the model's names, shapes and dtype) as the Hugging Face checkpoint an SGLang server loads from disk:
    config.json and model.safetensors, written by the model's own save, a tensor the model ties to an earlier one
    (Qwen3-0.6B's lm_head.weight is its embedding) stored once under the earlier name, as the checkpoint has it."""
    first: Dict[int, str] = {}
    for name, t in model.state_dict().items():
        first.setdefault(t.data_ptr(), name)
    kept = set(first.values())
    model.save_pretrained(folder, state_dict={n: t for n, t in state.items() if n in kept}, safe_serialization=True)


def readback_differs(values, tensor: torch.Tensor, rows: int) -> bool:
    """Whether SGLang's /get_weights_by_name answer (the first `rows` rows as nested lists; one list per data
    parallel replica when it has several) differs from the trainer's tensor's first rows in fp32."""
    expected = tensor.detach()[:rows].float().cpu().numpy()
    got = np.asarray(values, dtype=np.float32)
    replicas = got if got.ndim == expected.ndim + 1 else got[None]
    return any(r.shape != expected.shape or not np.array_equal(r, expected) for r in replicas)


@dataclasses.dataclass
class EngineSlot:
    """One engine layout for the whole run."""

    layout: object
    engine: object


def sync(trainer_: Trainer, slots: List[EngineSlot], probe: List[rollout_lib.Sample], trainer_probe: List[List[float]],
         *, control: str, weights_dir: Optional[str], log=print) -> List[dict]:
    """Loads the trainer's weights into every engine layout, then reads them back (module docstring): per layout the
    tensors compared and those differing, and the probe batch's engine - trainer differences."""
    state = sent_state(trainer_.model, control)
    trainer_state = trainer_.model.state_dict()
    saved = False
    out = []
    for slot in slots:
        engine = slot.engine
        if engine.name == "hf":
            engine.load_state_dict(state)
            theirs, ours = engine.checksums(), models.state_checksums(trainer_.model)
            differing = sorted(name for name in set(ours) | set(theirs) if ours.get(name) != theirs.get(name))
            checked, method = len(ours), "sha256 of every tensor"
            digest = hashlib.sha256("".join(f"{n}={theirs[n]};" for n in sorted(theirs)).encode()).hexdigest()
        else:
            if not saved:
                save_weights(trainer_.model, state, weights_dir)
                saved = True
            engine.load_weights(weights_dir)
            names = [n for n in READBACK_TENSORS if n in trainer_state]
            got = {n: engine.weights_by_name(n, READBACK_ROWS) for n in names}
            unread = [n for n in names if got[n] is None]
            if unread:  # the probe batch alone then stands for the sync; the report says so
                log(f"engine {slot.layout.name}: /get_weights_by_name answered null for {unread[0]} (the served "
                    f"model class cannot read its weights back); the sync is checked by the probe batch alone")
            names = [n for n in names if n not in unread]
            differing = [n for n in names if readback_differs(got[n], trainer_state[n], READBACK_ROWS)]
            checked = len(names)
            method = f"/get_weights_by_name, first {READBACK_ROWS} rows" + \
                (f"; not readable: {', '.join(unread)}" if unread else "")
            got = {n: got[n] for n in names}
            digest = hashlib.sha256(repr(sorted((n, np.asarray(v, dtype=np.float32).tobytes())
                                                for n, v in got.items())).encode()).hexdigest()
        with torch.no_grad():
            engine_lp = engine.score(probe)
        d = np.abs(np.array([a - b for e, t in zip(engine_lp, trainer_probe) for a, b in zip(e, t)],
                            dtype=np.float64))
        out.append({"layout": slot.layout.name, "method": method, "tensors": checked,
                    "tensors_differing": len(differing), "first_differing": differing[:3],
                    "probe_max_abs_diff": float(d.max()), "probe_mean_abs_diff": float(d.mean()),
                    "engine_state_checksum": digest})
    return out


def _peak_memory(device: torch.device) -> Tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(rss if sys.platform == "darwin" else rss * 1024), "process max RSS"


def _open_slots(stack: contextlib.ExitStack, s, plan, info, dtype) -> List[EngineSlot]:
    """Every engine layout, started from the checkpoint and kept for the run (the hf engine: a model of its own)."""
    from sglang_checks import check as check_lib

    slots = []
    for layout in plan.engine_layouts:
        model = models.load_hf_model(info, dtype=dtype, device=plan.device) if s.engine == "hf" else None
        slots.append(EngineSlot(layout, stack.enter_context(check_lib.open_engine(s, layout, model, plan.device,
                                                                                  info))))
    return slots


def run(s, plan, info: models.ModelInfo, prompt_ids: List[List[int]], tol: Dict[str, float], *, sample_rollout,
        log=print) -> Tuple[dict, List[Comparison]]:
    """The N training steps (module docstring). Returns report.json's train_steps record and every step's
    comparisons. `sample_rollout(s, engine, layout, info, prompt_ids, seed)` is the check's sampler."""
    dtype = getattr(torch, s.dtype)
    kernels = None
    if s.trainer_numerics == trainer.SGLANG_ON_POLICY:
        from sglang_checks import on_policy

        kernels = on_policy.sglang_kernels(plan.sglang_site)
    trainer_ = Trainer(models.load_hf_model(info, dtype=dtype, device=plan.device), s.lr,
                       numerics=s.trainer_numerics, kernels=kernels, head=s.train_head)
    reference = ReferenceTrainer(models.load_hf_model(info, dtype=dtype, device=plan.device), s.lr) \
        if s.reference_trainer else None
    probe = probe_samples(prompt_ids, info.vocab_size)
    rows: List[dict] = []
    comparisons: List[Comparison] = []
    jobs: List[Tuple[int, trainer.TrainerInputs, rollout_lib.Packed]] = []
    with contextlib.ExitStack() as stack:
        weights_dir = None
        if s.engine == "sglang":
            weights_dir = os.path.abspath(stack.enter_context(tempfile.TemporaryDirectory(
                prefix=".train_weights_", dir=s.report_dir)))  # the server resolves it, not this process
        slots = _open_slots(stack, s, plan, info, dtype)
        for step in range(s.train_steps + 1):
            t0 = time.monotonic()
            if plan.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(plan.device)
            with torch.no_grad():
                trainer_probe = trainer_scores(trainer_, probe, info, slots[0].layout)
            synced = sync(trainer_, slots, probe, trainer_probe, control=s.negative_control,
                          weights_dir=weights_dir, log=log if step == 0 else lambda message: None)
            rollout = sample_rollout(s, slots[0].engine, slots[0].layout, info, prompt_ids,
                                     s.seed + SEED_OFFSET + step)
            engine_scores = {slot.layout.name: slot.engine.score(rollout.samples) for slot in slots}
            row, step_comparisons, job = _train_step(s, plan, trainer_, reference, rollout, engine_scores, tol,
                                                     synced, step, update=step < s.train_steps)
            row["step_time_s"] = time.monotonic() - t0
            row["peak_memory_bytes"], row["peak_memory_kind"] = _peak_memory(plan.device)
            rows.append(row)
            comparisons += step_comparisons
            if job is not None:
                jobs.append((step,) + job)
            ref = f", reference loss {row['reference']['loss']:.4g}" if reference is not None else ""
            log(f"train step {step}/{s.train_steps}: reward {row['reward_mean']:.4f}, loss {row['loss']:.4g}, "
                f"grad norm {row['grad_norm']:.4g}, max |ratio - 1| {row['ratio_max_abs_dev']:.3g}{ref}, "
                f"{row['step_time_s']:.1f} s")
    if jobs:
        log(f"trainer layouts {','.join(layout.name for layout in plan.trainer_layouts)} on every step's rollout")
        comparisons += _layout_comparisons(s, plan, jobs, tol)
    if reference is not None:
        comparisons += _reference_comparisons(rows, tol, s.dtype)
    record = {"steps": s.train_steps, "lr": s.lr, "optimizer": "AdamW", "weight_decay": WEIGHT_DECAY,
              "max_grad_norm": MAX_GRAD_NORM, "loss": "ppo_ops.grpo_loss (seq_mean, no KL)",
              "train_head": s.train_head,
              "master_weights": "float32", "numerics": s.trainer_numerics,
              "engine_layouts": [slot.layout.name for slot in slots], "sampling_layout": slots[0].layout.name,
              "trainer_layouts": [layout.name for layout in plan.trainer_layouts],
              "reward": {"name": "share of completion tokens with id % TARGET_MODULUS == 0",
                         "target_modulus": reward_lib.TARGET_MODULUS},
              "reference_trainer": reference is not None,
              "reference_bands": {"policy_reward": tolerances.REFERENCE_REWARD_BAND[s.dtype],
                                  "loss": tolerances.REFERENCE_LOSS_BAND[s.dtype]} if reference is not None else None,
              "reward_first": rows[0]["reward_mean"], "reward_last": rows[-1]["reward_mean"],
              "reward_rise": rows[-1]["reward_mean"] - rows[0]["reward_mean"], "rows": rows}
    return record, comparisons


def _train_step(s, plan, trainer_: Trainer, reference: Optional[ReferenceTrainer], rollout: rollout_lib.Rollout,
                engine_scores: Dict[str, List[List[float]]], tol: Dict[str, float], synced: List[dict], step: int,
                *, update: bool):
    """One step's numbers, comparisons, and (when other trainer layouts are asked for) its trainer layout inputs."""
    from sglang_checks import check as check_lib

    import ppo_ops

    packed = rollout_lib.pack(rollout, rollout.longest)
    rewards = reward_lib.rewards([sample.completion_ids for sample in rollout.samples])
    loss, log_probs, entropy, view = trainer_.loss(packed, rollout, rewards, s.samples_per_prompt, s.entropy_coef)
    mask = packed.row_mask
    loss_value = float(loss.detach())
    grad_norm = trainer_.step(loss, update)

    mask_np = mask.numpy()
    trainer_lp = log_probs.detach().float().cpu().numpy()
    engine_lp = packed.engine_logprobs.numpy()
    d = trainer_lp.astype(np.float64)[mask_np] - engine_lp.astype(np.float64)[mask_np]
    ratio = np.exp(d)
    stats = metrics.diff_stats(trainer_lp, engine_lp, mask_np)
    row = {"step": step, "updated": update, "sequences": len(rollout.samples), "tokens": int(mask_np.sum()),
           "reward_mean": float(np.mean(rewards)), "reward_min": float(np.min(rewards)),
           "reward_max": float(np.max(rewards)),
           "policy_reward": policy_reward(view.logits, rollout.temperature, mask),
           "entropy_mean": float(entropy.detach().double().cpu().numpy()[mask_np].mean()),
           "loss": loss_value, "grad_norm": grad_norm,
           "ratio_mean": float(ratio.mean()), "ratio_max_abs_dev": float(np.abs(ratio - 1).max()),
           "mismatch_mean_abs": stats["mean_abs"], "mismatch_max_abs": stats["max_abs"],
           "kl_k3": metrics.k3_kl(trainer_lp, engine_lp, mask_np), "sync": synced}
    if reference is not None:
        ref_loss, _, ref_entropy, ref_logits = reference.loss(packed, rollout, rollout.temperature, rollout.top_p,
                                                              rewards, s.samples_per_prompt, s.entropy_coef)
        ref_value = float(ref_loss.detach())
        row["reference"] = {"policy_reward": policy_reward(ref_logits, rollout.temperature, mask),
                            "entropy_mean": float(ref_entropy.detach().double().cpu().numpy()[mask_np].mean()),
                            "loss": ref_value, "grad_norm": reference.step(ref_loss, update)}
        del ref_logits

    subject = f"step {step}"
    bitwise = s.expect_bitwise
    comparisons = [
        Comparison(SECTION, subject, "non-finite loss or grad norm",
                   sum(not math.isfinite(v) for v in (loss_value, grad_norm)), NONFINITE_TOL,
                   {"loss": loss_value, "grad_norm": grad_norm}, "NONFINITE_TOL"),
        # |exp(d) - 1| ~ |d| for small d, so the mismatch tolerance bounds the ratio's mean deviation too
        Comparison(SECTION, subject, "mean |ratio - 1|", float(np.abs(ratio - 1).mean()),
                   math.expm1(tol["mismatch_tol"]), {"max": row["ratio_max_abs_dev"], "mean": row["ratio_mean"]},
                   "mismatch_tol"),
    ]
    for entry in synced:
        where = f"{subject}: engine {entry['layout']} sync"
        comparisons.append(Comparison(SECTION, where, "engine tensors differing from the trainer's",
                                      entry["tensors_differing"], SYNC_TENSORS_TOL,
                                      {"tensors": entry["tensors"]}, "SYNC_TENSORS_TOL"))
        if s.engine == "hf" or bitwise:
            comparisons.append(Comparison(SECTION, where, "probe max |engine - trainer| log-prob",
                                          entry["probe_max_abs_diff"], SYNC_PROBE_TOL, {},
                                          "SYNC_PROBE_TOL" if s.engine == "hf" else metrics.BITWISE))
        else:
            comparisons.append(Comparison(SECTION, where, "probe mean |engine - trainer| log-prob",
                                          entry["probe_mean_abs_diff"], tol["mismatch_tol"],
                                          {"max": entry["probe_max_abs_diff"]}, "mismatch_tol"))
    checked, _, _ = check_lib.compare(rollout, packed, [], engine_scores, view, tol, engine=s.engine,
                                      first_layout=synced[0]["layout"], bitwise=bitwise)
    for c in checked:
        c.subject, c.section = f"{subject}: {c.subject}", SECTION
    comparisons += checked

    job = None
    if len(plan.trainer_layouts) > 1:
        advantages = ppo_ops.grpo_advantages(torch.tensor(rewards, dtype=torch.float32), s.samples_per_prompt,
                                             eps=GRPO_EPS)
        inputs = dataclasses.replace(check_lib.trainer_inputs(view, packed, s.entropy_coef, plan.sglang_site),
                                     advantages=advantages, variants=(TRAINED_VARIANT,))
        job = (inputs, packed)
    return row, comparisons, job


def _layout_comparisons(s, plan, jobs, tol: Dict[str, float]) -> List[Comparison]:
    """Every step's rollout under every trainer layout (one group of ranks for all steps), each compared with tp1 by
    the check's own comparisons."""
    from sglang_checks import check as check_lib

    results = trainer.run_jobs([trainer.Job(inputs, plan.trainer_layouts) for _, inputs, _ in jobs],
                               backend=plan.backend, threads=s.cpu_threads, timeout_s=s.trainer_timeout_s)
    out = []
    for (step, _, packed), step_results in zip(jobs, results):
        checked, _ = check_lib.trainer_layout_comparisons(step_results, packed.row_mask.numpy(), tol)
        for c in checked:
            c.subject, c.section = f"step {step}: {c.subject}", SECTION
        out += checked
    return out


def _reference_comparisons(rows: List[dict], tol: Dict[str, float], dtype: str) -> List[Comparison]:
    """The textbook trainer against the ppo_ops trainer: the first step's loss and gradient norm within
    trainer_rtol, every step's policy reward and loss within the bands of tolerances.py."""
    first, ref = rows[0], rows[0]["reference"]
    subject = "reference trainer vs ppo_ops trainer"
    out = [Comparison(SECTION, f"step 0: {subject}", f"{key} rel diff", metrics.relative_diff(ref[key], first[key]),
                      tol["trainer_rtol"], {"value": ref[key], "ppo_ops": first[key]}, "trainer_rtol")
           for key in ("loss", "grad_norm")]
    for row in rows:
        ref = row["reference"]
        out.append(Comparison(SECTION, f"step {row['step']}: {subject}", "|d policy reward|",
                              abs(ref["policy_reward"] - row["policy_reward"]), tolerances.REFERENCE_REWARD_BAND[dtype],
                              {"value": ref["policy_reward"], "ppo_ops": row["policy_reward"]},
                              "REFERENCE_REWARD_BAND"))
        out.append(Comparison(SECTION, f"step {row['step']}: {subject}", "|d loss|", abs(ref["loss"] - row["loss"]),
                              tolerances.REFERENCE_LOSS_BAND[dtype], {"value": ref["loss"], "ppo_ops": row["loss"]},
                              "REFERENCE_LOSS_BAND"))
    return out
