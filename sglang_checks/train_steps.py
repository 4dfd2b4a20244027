"""The check across GRPO training steps (--train_steps=N): train, sync the weights into the engine, roll out, check.

After the check's own step, one trainer in this process (TP = 1, the logits op path of the check's tp1 layout: the
model's final hidden states h, logits = h @ W^T in the model's dtype, ppo_ops.log_probs_and_entropy at the rollout's
temperature and log-prob kind, with the trainer's own top-p set as keep mask) runs N GRPO steps against the engine:

  step k = 0 .. N:
    sync      the trainer's weights (in the model's dtype) are loaded into the engine's model; then every tensor is
              read back from the engine and its checksum compared with the trainer's, and a fixed probe batch is
              teacher-forced through both models with the engine's scoring code: both must agree exactly
    rollout   the engine samples --samples_per_prompt completions of the check's prompts (a GRPO group each) at the
              check's sampling settings, with the step's own seed
    check     the trainer's log-probs of the step's tokens (its weights are the engine's) vs the engine's sampled
              ones, held to the check's mismatch tolerances; the ratio exp(trainer - engine) (mean, max |ratio - 1|)
    update    (k < N) the GRPO loss of the step's tokens (ppo_ops.grpo_loss: group-normalised advantages of
              reward.py's rewards, old log-probs = the trainer's own before the update, no KL term: no reference
              model is kept), backward, gradient clipped, one AdamW step on fp32 master weights, cast back to the
              model's dtype (a bf16 model keeps fp32 masters; a fp32 model's weights are the masters)

Row k of the report holds step k's numbers: mean reward, mean entropy, loss, gradient norm (before clipping), the
ratio, the mismatch, the sync results, the step time and the peak memory. The reward rising over the rows is what the
training proves (the test asserts it for the tiny model); every other row entry is a comparison with a tolerance.

Engines: the hf engine only. The SGLang engine would need its server's weight update endpoint fed from this
process's tensors (update_weights_from_tensor / from_distributed on a GPU); --train_steps with --engine=sglang is bad
input until that exists.
"""

from __future__ import annotations

import hashlib
import math
import resource
import sys
import time
from typing import Dict, List, Tuple

import numpy as np
import torch

from sglang_checks import logprob_kinds, metrics, models, reward as reward_lib, rollout as rollout_lib, trainer
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
# The synced engine must hold the trainer's weights bit for bit: a copy of tensors changes no bit.
SYNC_TENSORS_TOL = 0
# Same weights, same code (the engine's own scoring), same shapes, same device: the probe log-probs are equal bits.
SYNC_PROBE_TOL = 0.0
# A loss or gradient norm that is NaN or infinite ruins every later step: none is allowed.
NONFINITE_TOL = 0
# Probe batch: PROBE_PROMPTS of the check's prompts, each followed by PROBE_TOKENS fixed completion ids.
PROBE_PROMPTS, PROBE_TOKENS = 2, 8


def check_settings(s) -> None:
    """--train_steps and --lr, and what training needs of the other flags (bad input: CheckError naming the flag)."""
    if s.train_steps < 0:
        raise CheckError(f"--train_steps: expected 0 (no training) or a positive number of steps, got "
                         f"{s.train_steps}")
    if not (math.isfinite(s.lr) and s.lr > 0):
        raise CheckError(f"--lr: expected a finite learning rate > 0, got {s.lr}")
    if not s.train_steps:
        return
    if s.engine != "hf":
        raise CheckError(f"--train_steps={s.train_steps}: syncing trained weights into an SGLang server is not "
                         f"implemented (it needs the server's weight update from this process's tensors, on a "
                         f"GPU); use --engine=hf, or --train_steps=0")
    if s.samples_per_prompt < 2:
        raise CheckError(f"--train_steps={s.train_steps}: GRPO compares the completions of one prompt; expected "
                         f"--samples_per_prompt >= 2, got {s.samples_per_prompt}")
    if s.trainer_numerics != trainer.HF:
        raise CheckError(f"--train_steps={s.train_steps}: trains with --trainer_numerics={trainer.HF} only, got "
                         f"{s.trainer_numerics}")


class Trainer:
    """One TP = 1 trainer: the model in its dtype for the forward, fp32 master weights for AdamW."""

    def __init__(self, model, lr: float):
        self.model = model.eval()  # Qwen3 has no dropout; eval keeps the forward the engine's
        self.params = [p for p in model.parameters()]  # tied weights appear once
        for p in self.params:
            p.requires_grad_(True)
        if all(p.dtype == torch.float32 for p in self.params):
            self.masters = self.params
        else:  # a bf16 model's updates are far below its rounding step: accumulate them in fp32
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, weight_decay=WEIGHT_DECAY)

    def forward(self, packed: rollout_lib.Packed, kind: str, temperature: float, top_p: float):
        """(log-probs [B, S] fp32, entropy [B, S] fp32) of the packed tokens, differentiable w.r.t. the weights."""
        device = self.model.device
        hidden = self.model.model(input_ids=packed.input_ids.to(device)).last_hidden_state
        logits = torch.matmul(hidden, self.model.lm_head.weight.t())
        with torch.no_grad():
            top_p_set = logprob_kinds.top_p_keep_mask(logits.float() / temperature, top_p)
        t, keep = logprob_kinds.trainer_arguments(kind, temperature, top_p_set)
        out = trainer.log_probs_and_entropy(logits, packed.targets.to(device), temperature=t, keep_mask=keep,
                                            row_mask=packed.row_mask.to(device), entropy="grad")
        return out.log_probs, out.entropy

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


def probe_samples(prompt_ids: List[List[int]], vocab_size: int) -> List[rollout_lib.Sample]:
    """A fixed teacher-forcing batch: the first prompts, each with fixed completion ids spread over the vocabulary."""
    out = []
    for n, prompt in enumerate(prompt_ids[:PROBE_PROMPTS]):
        completion = [(7919 * (n * PROBE_TOKENS + i) + 13) % vocab_size for i in range(PROBE_TOKENS)]
        out.append(rollout_lib.Sample(prompt_index=n, sample_index=0, prompt_ids=list(prompt),
                                      completion_ids=completion, engine_logprobs=[0.0] * PROBE_TOKENS))
    return out


def sync(trainer_: Trainer, engine, probe: List[rollout_lib.Sample]) -> dict:
    """Loads the trainer's weights into the engine, then reads them back: the tensors whose checksums differ, and the
    probe batch's teacher-forced log-probs by the engine vs by the same code on the trainer's model."""
    state = {name: t.detach().clone() for name, t in trainer_.model.state_dict().items()}
    engine.load_state_dict(state)
    theirs, ours = engine.checksums(), models.state_checksums(trainer_.model)
    differing = sorted(name for name in set(ours) | set(theirs) if ours.get(name) != theirs.get(name))
    with torch.no_grad():
        engine_lp = engine.score(probe)
        trainer_lp = hf_engine.HFEngine(trainer_.model, engine.layout, trainer_.model.device).score(probe)
    probe_diff = max(abs(a - b) for e, t in zip(engine_lp, trainer_lp) for a, b in zip(e, t))
    # one digest of every tensor's: it changes with every update, so a sync that moved nothing shows across the rows
    state = hashlib.sha256("".join(f"{name}={theirs[name]};" for name in sorted(theirs)).encode()).hexdigest()
    return {"tensors": len(ours), "tensors_differing": len(differing), "first_differing": differing[:3],
            "probe_max_abs_diff": float(probe_diff), "engine_state_checksum": state}


def _peak_memory(device: torch.device) -> Tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(rss if sys.platform == "darwin" else rss * 1024), "process max RSS"


def run(s, plan, info: models.ModelInfo, prompt_ids: List[List[int]], tol: Dict[str, float], *, sample_rollout,
        log=print) -> Tuple[dict, List[Comparison]]:
    """The N training steps (module docstring). Returns report.json's train_steps record and every step's
    comparisons. `sample_rollout(s, engine, layout, info, prompt_ids, seed)` is the check's sampler."""
    dtype = getattr(torch, s.dtype)
    layout = plan.engine_layouts[0]
    engine_model = models.load_hf_model(info, dtype=dtype, device=plan.device)
    trainer_ = Trainer(models.load_hf_model(info, dtype=dtype, device=plan.device), s.lr)
    probe = probe_samples(prompt_ids, info.vocab_size)
    rows: List[dict] = []
    comparisons: List[Comparison] = []
    with hf_engine.HFEngine(engine_model, layout, plan.device) as engine:
        for step in range(s.train_steps + 1):
            t0 = time.monotonic()
            if plan.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(plan.device)
            synced = sync(trainer_, engine, probe)
            rollout = sample_rollout(s, engine, layout, info, prompt_ids, s.seed + SEED_OFFSET + step)
            row, step_comparisons = _train_step(s, trainer_, rollout, tol, synced, step,
                                                update=step < s.train_steps)
            row["step_time_s"] = time.monotonic() - t0
            row["peak_memory_bytes"], row["peak_memory_kind"] = _peak_memory(plan.device)
            rows.append(row)
            comparisons += step_comparisons
            log(f"train step {step}/{s.train_steps}: reward {row['reward_mean']:.4f}, loss {row['loss']:.4g}, "
                f"grad norm {row['grad_norm']:.4g}, max |ratio - 1| {row['ratio_max_abs_dev']:.3g}, "
                f"{row['step_time_s']:.1f} s")
    record = {"steps": s.train_steps, "lr": s.lr, "optimizer": "AdamW", "weight_decay": WEIGHT_DECAY,
              "max_grad_norm": MAX_GRAD_NORM, "loss": "ppo_ops.grpo_loss (seq_mean, no KL)",
              "master_weights": "float32", "engine_layout": layout.name,
              "reward": {"name": "share of completion tokens with id % TARGET_MODULUS == 0",
                         "target_modulus": reward_lib.TARGET_MODULUS},
              "reward_first": rows[0]["reward_mean"], "reward_last": rows[-1]["reward_mean"],
              "reward_rise": rows[-1]["reward_mean"] - rows[0]["reward_mean"], "rows": rows}
    return record, comparisons


def _train_step(s, trainer_: Trainer, rollout: rollout_lib.Rollout, tol: Dict[str, float], synced: dict, step: int,
                *, update: bool) -> Tuple[dict, List[Comparison]]:
    packed = rollout_lib.pack(rollout, rollout.longest)
    rewards = reward_lib.rewards([sample.completion_ids for sample in rollout.samples])
    log_probs, entropy = trainer_.forward(packed, rollout.logprob_kind, rollout.temperature, rollout.top_p)
    mask = packed.row_mask
    seq_ids = torch.arange(mask.shape[0])[:, None].expand_as(mask).to(log_probs.device)
    import ppo_ops

    loss_fn = ppo_ops.grpo_loss(log_probs.detach(), torch.tensor(rewards, dtype=torch.float32,
                                                                 device=log_probs.device), seq_ids,
                                group_size=s.samples_per_prompt, clip_low=CLIP_LOW, clip_high=CLIP_HIGH,
                                entropy_coef=s.entropy_coef, kl_coef=0.0, loss_mask=mask.to(log_probs.device),
                                normalization="seq_mean")
    loss = loss_fn.total(log_probs, entropy)
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
           "entropy_mean": float(entropy.detach().double().cpu().numpy()[mask_np].mean()),
           "loss": loss_value, "grad_norm": grad_norm,
           "ratio_mean": float(ratio.mean()), "ratio_max_abs_dev": float(np.abs(ratio - 1).max()),
           "mismatch_mean_abs": stats["mean_abs"], "mismatch_max_abs": stats["max_abs"],
           "kl_k3": metrics.k3_kl(trainer_lp, engine_lp, mask_np), "sync": synced}

    subject = f"step {step}"
    comparisons = [
        Comparison(SECTION, subject, "engine tensors differing from the trainer's", synced["tensors_differing"],
                   SYNC_TENSORS_TOL, {"tensors": synced["tensors"]}, "SYNC_TENSORS_TOL"),
        Comparison(SECTION, subject, "probe max |engine - trainer| log-prob", synced["probe_max_abs_diff"],
                   SYNC_PROBE_TOL, {}, "SYNC_PROBE_TOL"),
        Comparison(SECTION, subject, "non-finite loss or grad norm",
                   sum(not math.isfinite(v) for v in (loss_value, grad_norm)), NONFINITE_TOL,
                   {"loss": loss_value, "grad_norm": grad_norm}, "NONFINITE_TOL"),
        # |exp(d) - 1| ~ |d| for small d, so the mismatch tolerance bounds the ratio's mean deviation too
        Comparison(SECTION, subject, "mean |ratio - 1|", float(np.abs(ratio - 1).mean()),
                   math.expm1(tol["mismatch_tol"]), {"max": row["ratio_max_abs_dev"], "mean": row["ratio_mean"]},
                   "mismatch_tol"),
    ]
    for c in metrics.mismatch_comparisons(f"{subject}: {rollout.engine} {rollout.engine_layout} sampled "
                                          f"({rollout.logprob_kind})", trainer_lp, engine_lp, mask_np, tol):
        c.section = SECTION
        comparisons.append(c)
    return row, comparisons
