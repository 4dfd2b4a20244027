"""Per-token RL losses (PPO's clipped surrogate, CISPO, GRPO; rollout correction) as row-separable closures over the
flattened tokens.

A `TokenLoss` holds the per-token constants of one batch of T tokens (any leading shape, flattened in row-major
order): old log-probs, advantages, reference log-probs, and each token's normalisation weight. Called as

    loss(log_probs [R] fp32, entropy [R] fp32 or None, rows [R] int64 indices into the T tokens) -> [R] fp32

it returns each row's term already multiplied by its weight, so the sum over all T rows is the trainer's scalar loss,
however the rows are split into calls and in whatever order. A term depends only on its own row's log-prob, entropy
and constants (gathered by `rows`): that row-separability is what lets a fused LM head evaluate the loss, and take
its gradient with autograd, chunk by chunk while each chunk's logits are live. The same closure serves the unfused
path through `loss.total(log_probs, entropy)` on the outputs of `ppo_ops.log_probs_and_entropy`. A closure issues
no collective: at TP > 1 every rank holds the same one and calls it with the same global values. The fused op does
not record a graph per block for these losses: `value_and_grad` returns the terms with their gradients in closed
form, the elementwise ops autograd's backward of the call would run, in its order, hence the same bits.

The term of token t, with lp its log-prob, old / ref its old and reference log-probs, A its advantage, H its entropy,
c its rollout-correction weight (1 without one; ppo_ops/rollout_correction.py: TIS, MIS, IcePop at token or sequence
level, a constant from the old and the rollout engine's log-probs):

    r      = exp(lp - old)
    pg     = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))            surrogate="ppo": PPO's clipped surrogate
             where A < 0 and dual_clip = c:  min(pg, -A c)                 dual-clip PPO: a capped loss
    pg     = -A sg(clip(r, 1 - clip_low, 1 + clip_high)) lp                surrogate="cispo": CISPO (MiniMax-M1,
                                                                           eq. 4): the clipped ratio a constant
                                                                           coefficient, every token keeps a gradient;
                                                                           clip_low = 1: no lower bound
    x      = lp - ref;   k1 = x,   k2 = x^2 / 2,   k3 = exp(-x) - 1 + x    Schulman's estimators of KL(pi || ref)
    term   = c pg + kl_coef * k - entropy_coef * H
    row    = weight_t * term

pg is formed as -A * exp(min(lp - old, log(1 + clip_high))) for A >= 0 and -A * exp(max(lp - old, log(1 - clip_low)))
(then min with log c) for A < 0: the same value and gradient as the max above, but a clipped ratio is never formed,
so a log-ratio past fp32's exp range (~88) gives a finite term and a zero gradient where it is clipped, and A = 0
gives 0 rather than 0 * inf. k3 is evaluated as expm1(-x) + x (no cancellation near x = 0).

Weights (`normalization`), over the tokens that `loss_mask` counts (m_t = 1 or the mask's value; 0 = not counted),
N the sequences with a counted token (verl's `loss_agg_mode` names with "_" for "-"):

    "token_mean"             m_t / Σ m                            the mean over all counted tokens (DAPO)
    "seq_mean_token_mean"    m_t / (N * Σ_{u in seq(t)} m_u)      the mean over sequences of each sequence's token
      (or "seq_mean")                                             mean (GRPO, GSPO)
    "seq_mean_token_sum"     m_t / N                              the mean over sequences of each sequence's sum
    "seq_sum_over_constant"  m_t / normalization_constant         Dr. GRPO: the sum over a constant fixed for the
                                                                  run (TRL's dr_grpo: sequences x max completion
                                                                  length; verl seq-mean-token-sum-norm)
    "sum"                    m_t

computed once at construction in float64 on the constants' device with tensor ops (counts stay tensors: no host
sync) and rounded to fp32; a batch with nothing counted gets weight 0 everywhere (a loss of 0, not NaN). Tokens not
counted contribute 0 and get a zero gradient whatever their log-probs, entropies or constants hold (-inf, NaN,
placeholders): those are replaced by 0 before any arithmetic.

`TokenLoss.metrics(log_probs)` gives what users log with the loss (clipped shares, ppo_kl, and with rollout log-probs
the rollout-vs-trainer k3 KL and log-perplexity difference), as 0-d tensors without a host read.

`grpo_loss` builds a TokenLoss from per-sequence rewards (group-normalised advantages, `grpo_advantages`) with GRPO's
defaults. All constants are copied (detached, fp32) at construction: the closure never writes the caller's tensors,
and a later in-place change to them does not change it. Per-row math is fp32; outputs are fp32.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple, Optional

import torch

from ppo_ops import rollout_correction as rollout_correction_mod
from ppo_ops.core.checks import argument_error

KL_TYPES = ("k1", "k2", "k3")
NORMALIZATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_over_constant", "sum",
                  "seq_mean")
SURROGATES = ("ppo", "cispo")
SCOPES = ("row", "sequence", "batch")


@dataclasses.dataclass(frozen=True, eq=False)
class TokenLoss:
    """A row-separable per-token loss over T tokens; build it with `policy_loss` or `grpo_loss`.

    The tensor fields are the checked fp32 [T] copies those functions make (0 where a token is not counted). The
    `freeze` of a sequence- or batch-scope loss (ppo_ops.sequence_losses, ppo_ops.entropy_mask) is a TokenLoss too,
    surrogate "linearised": term v_t + g_t (lp - lp0_t) plus the KL and entropy terms, with `advantages` holding
    the weighted values v_t, `pg_coef` the gradients g_t and `old_log_probs` the point lp0.
    """

    weight: torch.Tensor = dataclasses.field(repr=False)  # [T] fp32 normalisation weight; 0: not counted
    old_log_probs: torch.Tensor = dataclasses.field(repr=False)  # [T] fp32
    advantages: torch.Tensor = dataclasses.field(repr=False)  # [T] fp32
    ref_log_probs: Optional[torch.Tensor] = dataclasses.field(repr=False)  # [T] fp32, None without a KL term
    shape: torch.Size  # the constants' shape before flattening (what `total` expects)
    clip_low: float
    clip_high: float
    dual_clip: Optional[float]
    entropy_coef: float
    kl_coef: float
    kl_type: str
    normalization: str
    surrogate: str = "ppo"
    pg_coef: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)  # [T] fp32 rollout correction c_t
    constant_metrics: dict = dataclasses.field(default_factory=dict, repr=False)  # 0-d fp32 tensors (`metrics`)

    # What a token's gradient reads (one of SCOPES): its own row, "row", for every TokenLoss; ppo_ops.sequence_losses'
    # are "sequence", ppo_ops.entropy_mask's "batch", and linear_token_loss gives those a statistics pass first
    # (docs/losses.md, the schedules).
    scope = "row"

    @property
    def n_tokens(self) -> int:
        return self.weight.numel()

    @property
    def needs_entropy(self) -> bool:
        """Whether calls must pass the entropy (entropy_coef != 0); otherwise the entropy is not used."""
        return self.entropy_coef != 0.0

    def __call__(self, log_probs: torch.Tensor, entropy: Optional[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """Weighted terms of the tokens `rows` (int64 [R] in [0, T), not range checked): [R] fp32, differentiable
        w.r.t. log_probs [R] fp32 and entropy [R] fp32. The entropy is used only when entropy_coef != 0, and then
        required; otherwise it may be None and the result does not depend on it."""
        self._check_call(log_probs, entropy, rows)
        return self._forward(log_probs, entropy, rows).value

    def value_and_grad(self, log_probs: torch.Tensor, entropy: Optional[torch.Tensor], rows: torch.Tensor, *,
                       entropy_grad: bool = True) -> tuple:
        """(terms [R], d terms.sum() / d log_probs [R], d terms.sum() / d entropy [R] or None) without autograd: the
        elementwise ops autograd's backward of __call__ runs, in its order, on the same values, so the same bits
        (tests/test_token_losses.py checks that). The fused token loss calls this once per row block, for a
        fraction of the host time of recording a graph and running its backward. The entropy's gradient is None
        where the entropy is not used (entropy_coef == 0) or not asked (`entropy_grad` False)."""
        self._check_call(log_probs, entropy, rows)
        f = self._forward(log_probs, entropy, rows)
        g_term = f.weight  # the upstream 1 times the weight: 1 * w == w
        if self.surrogate == "linearised":  # v + g (lp - lp0): the upstream 1 times g
            g_lp = f.e
        elif self.surrogate == "cispo":  # coef * lp: mul's gradient is grad * the other factor
            g_lp = g_term * f.e
        else:
            g_log_r = (g_term * f.neg_adv) * f.e  # through -A * exp(log_r): exp's gradient is grad * result
            if f.capped is not None:  # where(A >= 0, log_r, clamp(log_r, max=cap)): each branch's share, then sum
                g_log_r = (torch.where(f.positive, g_log_r, 0.0)
                           + torch.where(f.log_r <= f.cap, torch.where(f.positive, 0.0, g_log_r), 0.0))
            # where(A >= 0, clamp(log_ratio, max=hi), clamp(log_ratio, min=lo)): clamp passes the gradient within
            # its bounds
            g_lp = (torch.where(f.log_ratio <= f.hi, torch.where(f.positive, g_log_r, 0.0), 0.0)
                    + torch.where(f.log_ratio >= f.lo, torch.where(f.positive, 0.0, g_log_r), 0.0))
        if f.kl_x is not None:
            g_lp = g_lp + _kl_grad(f.kl_x, f.kl_saved, self.kl_type, g_term * self.kl_coef)
        g_lp = torch.where(f.counted, g_lp, 0.0)
        g_ent = None
        if self.entropy_coef != 0.0 and entropy_grad:  # -(c H), or - c H after a first addend
            g_ent = torch.where(f.counted, -g_term * self.entropy_coef, 0.0)
        return f.value.detach(), g_lp, g_ent

    def _forward(self, log_probs, entropy, rows) -> "_Terms":
        """The terms and the intermediates their gradient reads (one set of ops for __call__ and value_and_grad)."""
        weight = self.weight[rows]
        counted = weight != 0
        lp = torch.where(counted, log_probs, 0.0)
        adv = self.advantages[rows]
        positive = adv >= 0
        neg_adv = -adv if self.pg_coef is None else -(adv * self.pg_coef[rows])
        hi, lo = _log_bounds(self.clip_low, self.clip_high)
        log_ratio = log_r = cap = capped = None
        if self.surrogate == "linearised":  # v + g (lp - lp0): a sequence loss frozen at lp0 (its `freeze`)
            e = self.pg_coef[rows]
            lin = self.advantages[rows] + e * (lp - self.old_log_probs[rows])
            term = None
        elif self.surrogate == "cispo":  # -A c sg(clip(r)) lp: the clipped ratio is a constant coefficient
            e = neg_adv * torch.exp((lp.detach() - self.old_log_probs[rows]).clamp(min=lo, max=hi))
            term = e * lp
        else:
            log_ratio = lp - self.old_log_probs[rows]
            log_r = torch.where(positive, log_ratio.clamp(max=hi), log_ratio.clamp(min=lo))
            if self.dual_clip is not None:
                cap = math.log(self.dual_clip)
                capped = torch.where(positive, log_r, log_r.clamp(max=cap))
            e = torch.exp(log_r if capped is None else capped)
            term = neg_adv * e
        kl_x = kl_saved = None
        if self.kl_coef != 0.0:
            kl_x = lp - self.ref_log_probs[rows]
            kl, kl_saved = _kl(kl_x, self.kl_type)
            term = self.kl_coef * kl if term is None else term + self.kl_coef * kl
        if self.entropy_coef != 0.0:
            h = self.entropy_coef * torch.where(counted, entropy, 0.0)
            term = -h if term is None else term - h
        if self.surrogate == "linearised":  # its values carry their weights already
            value = lin if term is None else weight * term + lin
        else:
            value = weight * term
        return _Terms(value, weight, counted, positive, log_ratio, hi, lo, log_r, cap, capped, neg_adv, e,
                      kl_x, kl_saved)

    def total(self, log_probs: torch.Tensor, entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The scalar loss (fp32) from every token's log-prob (and entropy), shaped like the constants: e.g. the
        outputs of `ppo_ops.log_probs_and_entropy`. Equals self(log_probs.flatten(), entropy, arange(T)).sum()."""
        for name, t in (("log_probs", log_probs), ("entropy", entropy)):
            if isinstance(t, torch.Tensor) and t.shape != self.shape:
                raise _error(ValueError, "TokenLoss.total", name,
                             f"{name} must have the loss constants' shape {tuple(self.shape)}, got {tuple(t.shape)}")
        rows = torch.arange(self.n_tokens, device=self.weight.device)
        return self(_flatten(log_probs), None if entropy is None else _flatten(entropy), rows).sum()

    def metrics(self, log_probs: torch.Tensor) -> dict:
        """What users log with the loss, from every token's log-prob shaped like the constants (e.g. the op's
        detached log-probs): 0-d fp32 tensors, means over the counted tokens (unweighted; 0 when none is), no host
        read. Always:

            clipped_share       share of tokens whose surrogate is clipped: PPO A > 0 with r > 1 + clip_high or
                                A < 0 with r < 1 - clip_low (a zero gradient there); CISPO, r outside its clip
            dual_clipped_share  share of tokens with A < 0 and r > dual_clip (0 without a dual clip)
            ppo_kl              mean (old - lp): verl's ppo_kl, the k1 estimate of KL(pi_old || pi)

        With a rollout correction, also its constants' metrics (ppo_ops/rollout_correction.py: rollout_k3_kl,
        rollout_log_ppl_diff, rollout_corrected_share, rollout_weight_mean)."""
        fn = "TokenLoss.metrics"
        _check_tensor(fn, "log_probs", log_probs, self.weight.device)
        if log_probs.shape != self.shape:
            raise _error(ValueError, fn, "log_probs", f"log_probs must have the loss constants' shape "
                                                      f"{tuple(self.shape)}, got {tuple(log_probs.shape)}")
        counted = self.weight != 0
        n = counted.sum()
        log_ratio = torch.where(counted, log_probs.detach().reshape(-1).float(), 0.0) - self.old_log_probs
        hi, lo = _log_bounds(self.clip_low, self.clip_high)
        adv = self.advantages
        if self.surrogate == "cispo":
            clipped = (log_ratio > hi) | (log_ratio < lo)
        else:
            clipped = ((adv > 0) & (log_ratio > hi)) | ((adv < 0) & (log_ratio < lo))
        dual = torch.zeros_like(counted)
        if self.dual_clip is not None:
            dual = (adv < 0) & (log_ratio > math.log(self.dual_clip))

        def mean(x):
            return torch.where(counted, x.float(), 0.0).sum() / torch.where(n > 0, n, 1)

        out = {"clipped_share": mean(clipped), "dual_clipped_share": mean(dual), "ppo_kl": mean(-log_ratio)}
        out.update(self.constant_metrics)
        return out

    def _check_call(self, log_probs, entropy, rows):
        fn = "TokenLoss"
        _check_tensor(fn, "log_probs", log_probs, self.weight.device)
        if log_probs.dim() != 1 or log_probs.dtype != torch.float32:
            raise _error(TypeError if log_probs.dtype != torch.float32 else ValueError, fn, "log_probs",
                         f"log_probs must be a 1-D float32 tensor [R], got {log_probs.dtype} of shape "
                         f"{tuple(log_probs.shape)}")
        _check_tensor(fn, "rows", rows, self.weight.device)
        if rows.dtype != torch.int64:
            raise _error(TypeError, fn, "rows", f"rows must be int64 token indices, got {rows.dtype}")
        if rows.shape != log_probs.shape:
            raise _error(ValueError, fn, "rows", f"rows must have log_probs' shape {tuple(log_probs.shape)}, got "
                                                 f"{tuple(rows.shape)}")
        if entropy is None:
            if self.needs_entropy:
                raise _error(ValueError, fn, "entropy",
                             f"entropy_coef={self.entropy_coef} needs the entropy; got entropy=None (ask the op for "
                             "entropy='grad')")
            return
        _check_tensor(fn, "entropy", entropy, self.weight.device)
        if entropy.dtype != torch.float32:
            raise _error(TypeError, fn, "entropy", f"entropy must be float32, got {entropy.dtype}")
        if entropy.shape != log_probs.shape:
            raise _error(ValueError, fn, "entropy", f"entropy must have log_probs' shape {tuple(log_probs.shape)}, "
                                                    f"got {tuple(entropy.shape)}")


def policy_loss(
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    ref_log_probs: Optional[torch.Tensor] = None,
    kl_type: str = "k3",
    loss_mask: Optional[torch.Tensor] = None,
    normalization: str = "token_mean",
    seq_ids: Optional[torch.Tensor] = None,
    normalization_constant: Optional[float] = None,
    surrogate: str = "ppo",
    rollout_log_probs: Optional[torch.Tensor] = None,
    rollout_correction: Optional[str] = None,
    rollout_is_high: float = 2.0,
    rollout_is_low: Optional[float] = None,
) -> TokenLoss:
    """TokenLoss of Σ_t w_t (pg_t + kl_coef k_t - entropy_coef H_t), pg_t = max(-A_t r_t, -A_t clip(r_t,
    1 - clip_low, 1 + clip_high)), r_t = exp(lp_t - old_t), k_t the KL estimator, w_t from `normalization` over
    `loss_mask` (module docstring): PPO's clipped surrogate with DAPO's clip-higher, dual clip, entropy bonus and KL.

    Its constants are one per scored token: the ops that take it (linear_token_loss, ppo_ops.hf, ppo_ops.megatron)
    raise a ValueError naming token_loss when their rows number or are shaped otherwise.

    Args:
      old_log_probs: [...] floating, the sampling policy's log-prob of each token; its shape (T elements) is the
        shape of every per-token argument, and the device of all of them.
      advantages: old_log_probs.shape floating, each token's advantage.
      clip_low: the ratio's lower clip is 1 - clip_low; in [0, 1).
      clip_high: the upper clip is 1 + clip_high; >= 0; None: clip_low (DAPO's clip-higher when larger).
      dual_clip: None, or c > 1: where A < 0 the term is capped at -A * c (dual-clip PPO).
      entropy_coef: subtracts entropy_coef * entropy (a bonus when > 0); when != 0, calls must pass the entropy.
      kl_coef: adds kl_coef * k (kl_type's estimator of KL(pi || ref)); when != 0, ref_log_probs is required.
      ref_log_probs: old_log_probs.shape floating, the reference policy's log-probs (used only when kl_coef != 0).
      kl_type: "k1", "k2" or "k3" (module docstring).
      loss_mask: old_log_probs.shape, bool, or floating non-negative per-token weights (0: not counted); None: all.
      normalization: "token_mean", "seq_mean" (needs seq_ids) or "sum" (module docstring).
      seq_ids: old_log_probs.shape integer, each token's sequence index in [0, T) (any order; not range checked);
        used by the "seq_*" normalizations and the sequence-level rollout corrections.
      normalization_constant: > 0, the divisor of "seq_sum_over_constant" (required there, refused elsewhere).
      surrogate: "ppo" (the clipped surrogate above) or "cispo" (clip_low may then be 1: no lower bound; no
        dual_clip).
      rollout_log_probs: old_log_probs.shape floating, the rollout engine's log-probs of the sampled tokens; alone it
        adds the rollout metrics (`TokenLoss.metrics`), with rollout_correction it also weighs each pg term.
      rollout_correction: None, or one of rollout_correction.MODES: "token_tis", "token_mis", "token_icepop",
        "seq_tis", "seq_mis", "seq_icepop" (ppo_ops/rollout_correction.py); the weight exp(old - rollout_log_probs),
        a detached constant, uses old_log_probs as the trainer's log-probs.
      rollout_is_high: the weight's upper cap, finite > 0 (verl's rollout_is_threshold 2.0).
      rollout_is_low: None or the lower cap in [0, rollout_is_high); required by the icepop modes (IcePop: 0.5).

    Numbers are Python or NumPy reals (no tensors: reading one would be a host sync).
    """
    fn = "policy_loss"
    _check_tensor(fn, "old_log_probs", old_log_probs)
    advantages = _checked_float(fn, "advantages", advantages, old_log_probs)
    ids = None if seq_ids is None else _checked_ids(fn, seq_ids, old_log_probs)
    return _build(fn, old_log_probs, advantages, ids, n_seq_slots=old_log_probs.numel(), clip_low=clip_low,
                  clip_high=clip_high, dual_clip=dual_clip, entropy_coef=entropy_coef, kl_coef=kl_coef,
                  ref_log_probs=ref_log_probs, kl_type=kl_type, loss_mask=loss_mask, normalization=normalization,
                  normalization_constant=normalization_constant, surrogate=surrogate,
                  rollout_log_probs=rollout_log_probs, rollout_correction=rollout_correction,
                  rollout_is_high=rollout_is_high, rollout_is_low=rollout_is_low)


def grpo_advantages(rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """(r_s - mean_g) / (std_g + eps) for each sequence s of group g: GRPO's advantages, [n_seq] fp32.

    Sequences [g * group_size, (g + 1) * group_size) form group g (the rollouts of one prompt, consecutive):
        A_s = (r_s - mean_g) / (std_g + eps)     std_g: the unbiased sample std of the group (torch.std, as TRL, verl)
        A_s = r_s - mean_g                       scale_by_std=False (Dr. GRPO)
    group_size >= 2 must divide n_seq; eps > 0. Computed in fp32.
    """
    fn = "grpo_advantages"
    _check_tensor(fn, "rewards", rewards)
    return _advantages(fn, rewards, group_size, scale_by_std, eps)


def grpo_loss(
    old_log_probs: torch.Tensor,
    rewards: torch.Tensor,
    seq_ids: torch.Tensor,
    *,
    group_size: int,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    clip_low: float = 0.2,
    clip_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.04,
    ref_log_probs: Optional[torch.Tensor] = None,
    kl_type: str = "k3",
    loss_mask: Optional[torch.Tensor] = None,
    normalization: str = "seq_mean",
    normalization_constant: Optional[float] = None,
    surrogate: str = "ppo",
    rollout_log_probs: Optional[torch.Tensor] = None,
    rollout_correction: Optional[str] = None,
    rollout_is_high: float = 2.0,
    rollout_is_low: Optional[float] = None,
) -> TokenLoss:
    """policy_loss(old_log_probs, grpo_advantages(rewards, group_size, ...)[seq_ids], ...): GRPO.

    Defaults are the GRPO paper's (DeepSeekMath): clip 0.2, k3 KL to the reference with kl_coef 0.04 (so
    ref_log_probs is required unless kl_coef=0.0), and "seq_mean" (each sequence's token mean, averaged over
    sequences). Dr. GRPO: scale_by_std=False, normalization="sum" or "token_mean", kl_coef=0.0.

    Args:
      old_log_probs: [...] floating, as in policy_loss.
      rewards: [n_seq] floating, one reward per sequence, groups consecutive (grpo_advantages).
      seq_ids: old_log_probs.shape integer, each token's sequence index in [0, n_seq) (not range checked).
      group_size, scale_by_std, eps: grpo_advantages'; the rest: policy_loss's.
    """
    fn = "grpo_loss"
    _check_tensor(fn, "old_log_probs", old_log_probs)
    _check_tensor(fn, "rewards", rewards, old_log_probs.device)
    ids = _checked_ids(fn, seq_ids, old_log_probs)
    advantages = _advantages(fn, rewards, group_size, scale_by_std, eps)[ids]
    return _build(fn, old_log_probs, advantages, ids, n_seq_slots=rewards.numel(), clip_low=clip_low,
                  clip_high=clip_high, dual_clip=dual_clip, entropy_coef=entropy_coef, kl_coef=kl_coef,
                  ref_log_probs=ref_log_probs, kl_type=kl_type, loss_mask=loss_mask, normalization=normalization,
                  normalization_constant=normalization_constant, surrogate=surrogate,
                  rollout_log_probs=rollout_log_probs, rollout_correction=rollout_correction,
                  rollout_is_high=rollout_is_high, rollout_is_low=rollout_is_low)


# ---- construction ----

def _log_bounds(clip_low: float, clip_high: float) -> tuple:
    """(log(1 + clip_high), log(1 - clip_low)); clip_low = 1 (CISPO without a lower bound) gives -inf."""
    return math.log1p(clip_high), (-math.inf if clip_low == 1.0 else math.log1p(-clip_low))


def _build(fn, old_log_probs, advantages, ids, *, n_seq_slots, clip_low, clip_high, dual_clip, entropy_coef, kl_coef,
           ref_log_probs, kl_type, loss_mask, normalization, normalization_constant, surrogate, rollout_log_probs,
           rollout_correction, rollout_is_high, rollout_is_low) -> TokenLoss:
    """Checks the options, computes the weights and returns the TokenLoss. advantages: [T] fp32; ids: [T] int64
    sequence indices in [0, n_seq_slots), or None."""
    if not isinstance(surrogate, str) or surrogate not in SURROGATES:
        raise _error(ValueError, fn, "surrogate", f"surrogate must be one of {SURROGATES}, got {surrogate!r}")
    clip_low = _real(fn, "clip_low", clip_low)
    low_max = 1.0 if surrogate == "cispo" else math.nextafter(1.0, 0.0)  # CISPO: 1 is "no lower bound"
    if not 0.0 <= clip_low <= low_max:
        raise _error(ValueError, fn, "clip_low", f"clip_low must be in [0, 1{']' if surrogate == 'cispo' else ')'}"
                                                 f" (surrogate={surrogate!r}), got {clip_low}")
    clip_high = clip_low if clip_high is None else _real(fn, "clip_high", clip_high)
    if not 0.0 <= clip_high < math.inf:
        raise _error(ValueError, fn, "clip_high", f"clip_high must be finite and >= 0, got {clip_high}")
    if dual_clip is not None:
        if surrogate == "cispo":
            raise _error(ValueError, fn, "dual_clip", "dual_clip applies to the PPO surrogate only (CISPO's clipped "
                                                      "ratio is already a bounded constant); pass dual_clip=None")
        dual_clip = _real(fn, "dual_clip", dual_clip)
        if not 1.0 < dual_clip < math.inf:
            raise _error(ValueError, fn, "dual_clip", f"dual_clip must be None or finite and > 1, got {dual_clip}")
    entropy_coef, kl_coef = _real(fn, "entropy_coef", entropy_coef), _real(fn, "kl_coef", kl_coef)
    for name, value in (("entropy_coef", entropy_coef), ("kl_coef", kl_coef)):
        if not math.isfinite(value):
            raise _error(ValueError, fn, name, f"{name} must be finite, got {value}")
    if not isinstance(kl_type, str) or kl_type not in KL_TYPES:
        raise _error(ValueError, fn, "kl_type", f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    if not isinstance(normalization, str) or normalization not in NORMALIZATIONS:
        raise _error(ValueError, fn, "normalization",
                     f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")

    old = _checked_float(fn, "old_log_probs", old_log_probs, old_log_probs)
    ref = None
    if kl_coef != 0.0:
        if ref_log_probs is None:
            raise _error(ValueError, fn, "ref_log_probs",
                         f"kl_coef={kl_coef} needs ref_log_probs (or pass kl_coef=0.0 for no KL term)")
        ref = _checked_float(fn, "ref_log_probs", ref_log_probs, old_log_probs)
    elif ref_log_probs is not None:
        _checked_float(fn, "ref_log_probs", ref_log_probs, old_log_probs)  # checked, unused at kl_coef=0
    mask = _checked_mask(fn, loss_mask, old_log_probs)
    if normalization.startswith("seq_") and ids is None:
        raise _error(ValueError, fn, "seq_ids", f"normalization={normalization!r} needs seq_ids (each token's "
                                                "sequence)")
    if normalization == "seq_sum_over_constant":
        if normalization_constant is None:
            raise _error(ValueError, fn, "normalization_constant",
                         'normalization="seq_sum_over_constant" needs normalization_constant (e.g. the number of '
                         "sequences times the generation budget, Dr. GRPO's constant)")
        normalization_constant = _real(fn, "normalization_constant", normalization_constant)
        if not 0.0 < normalization_constant < math.inf:
            raise _error(ValueError, fn, "normalization_constant",
                         f"normalization_constant must be finite and > 0, got {normalization_constant}")
    elif normalization_constant is not None:
        raise _error(ValueError, fn, "normalization_constant",
                     f'normalization_constant is used by normalization="seq_sum_over_constant" only, got '
                     f"normalization={normalization!r}")
    correction = None
    if rollout_correction is not None:
        correction = rollout_correction_mod.check_options(fn, rollout_correction, rollout_is_high, rollout_is_low,
                                                          has_seq_ids=ids is not None)
        if rollout_log_probs is None:
            raise _error(ValueError, fn, "rollout_log_probs",
                         f"rollout_correction={rollout_correction!r} needs rollout_log_probs (the engine's log-probs)")
    rollout = None
    if rollout_log_probs is not None:
        rollout = _checked_float(fn, "rollout_log_probs", rollout_log_probs, old_log_probs)

    weight = _weights(mask, normalization, ids, n_seq_slots, normalization_constant)
    counted = weight != 0

    def own(x):  # the closure's own fp32 copy, 0 where not counted (no placeholder ever reaches the arithmetic)
        return None if x is None else torch.where(counted, x, 0.0)

    pg_coef, constant_metrics = None, {}
    if rollout is not None:
        c, constant_metrics = rollout_correction_mod.weights(
            correction or rollout_correction_mod.Correction("token_tis", math.inf, None), old, rollout, counted,
            ids, n_seq_slots)
        if correction is not None:
            pg_coef = c
        else:  # metrics only: no weight applied (c_t = 1), none changed by a bound (an infinite cap)
            constant_metrics["rollout_weight_mean"] = counted.any().float()
    return TokenLoss(weight=weight, old_log_probs=own(old), advantages=own(advantages), ref_log_probs=own(ref),
                     shape=old_log_probs.shape, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                     entropy_coef=entropy_coef, kl_coef=kl_coef, kl_type=kl_type, normalization=normalization,
                     surrogate=surrogate, pg_coef=pg_coef, constant_metrics=constant_metrics)


def _weights(mask, normalization, seq_ids, n_seq_slots, constant=None) -> torch.Tensor:
    """[T] fp32 normalisation weights from the [T] float64 mask (module docstring); float64 until the one rounding."""
    if normalization == "sum":
        return mask.float()
    if normalization == "seq_sum_over_constant":
        return (mask / constant).float()
    if normalization == "token_mean":
        count = mask.sum()
        return (mask / torch.where(count > 0, count, 1.0)).float()
    # Per-sequence sums by index_add_: exact for 0/1 masks; on CUDA its atomics may order fractional masks' float64
    # additions differently run to run (a last-bit difference before the fp32 rounding).
    per_seq = torch.zeros(n_seq_slots, dtype=torch.float64, device=mask.device).index_add_(0, seq_ids, mask)
    n_seqs = (per_seq > 0).sum()
    if normalization == "seq_mean_token_sum":  # N >= 1 wherever a token is counted
        return torch.where(mask != 0, mask / n_seqs, 0.0).float()
    # A counted token's sequence has a count > 0 and N >= 1 (masks are non-negative); others get 0, not 0 / 0.
    return torch.where(mask != 0, mask / (n_seqs * per_seq[seq_ids]), 0.0).float()


def _advantages(fn, rewards, group_size, scale_by_std, eps) -> torch.Tensor:
    if not rewards.dtype.is_floating_point:
        raise _error(TypeError, fn, "rewards", f"rewards must be floating, got {rewards.dtype}")
    if rewards.dim() != 1:
        raise _error(ValueError, fn, "rewards", f"rewards must be 1-D [n_seq], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise _error(TypeError, fn, "group_size", f"group_size must be an int, got {type(group_size).__name__}")
    group_size = int(group_size)
    if group_size < 2 or rewards.numel() % group_size != 0:
        raise _error(ValueError, fn, "group_size",
                     f"group_size must be >= 2 (a group of one has no baseline) and divide the {rewards.numel()} "
                     f"rewards, got {group_size}")
    if not isinstance(scale_by_std, bool):
        raise _error(TypeError, fn, "scale_by_std", f"scale_by_std must be a bool, got {type(scale_by_std).__name__}")
    eps = _real(fn, "eps", eps)
    if not 0.0 < eps < math.inf:
        raise _error(ValueError, fn, "eps", f"eps must be finite and > 0, got {eps}")
    groups = rewards.detach().float().reshape(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def _kl(x: torch.Tensor, kl_type: str) -> tuple:
    """(the estimator's value, the intermediate its gradient reads: k2's 0.5 x, k3's expm1(-x), else None)."""
    if kl_type == "k1":
        return x, None
    if kl_type == "k2":
        half = 0.5 * x
        return half * x, half
    e = torch.expm1(-x)
    return e + x, e


def _kl_grad(x: torch.Tensor, saved: Optional[torch.Tensor], kl_type: str, g: torch.Tensor) -> torch.Tensor:
    """d/dx of _kl(x) times g, as autograd's backward of _kl forms it (each use of x's share, then their sum), from
    the intermediate the forward kept (`saved`, _kl's second result), as autograd keeps it."""
    if kl_type == "k1":
        return g
    if kl_type == "k2":  # (0.5 * x) * x
        return g * saved + (g * x) * 0.5
    return g + -(g * (saved + 1))  # expm1(-x) + x: expm1's gradient is grad * (result + 1)


class _Terms(NamedTuple):
    """TokenLoss._forward's result: the terms and what their gradient reads."""

    value: torch.Tensor
    weight: torch.Tensor
    counted: torch.Tensor
    positive: torch.Tensor
    log_ratio: Optional[torch.Tensor]  # None for CISPO (its ratio is a constant)
    hi: float
    lo: float
    log_r: Optional[torch.Tensor]
    cap: Optional[float]
    capped: Optional[torch.Tensor]
    neg_adv: torch.Tensor
    e: torch.Tensor
    kl_x: Optional[torch.Tensor]
    kl_saved: Optional[torch.Tensor]


# ---- checks ----

def _error(exc_type, fn, argument, detail):
    return argument_error(exc_type, fn, argument, detail)


def _check_tensor(fn, name, t, device=None):
    if not isinstance(t, torch.Tensor):
        raise _error(TypeError, fn, name, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if device is not None and t.device != device:
        raise _error(ValueError, fn, name, f"{name} must be on {device} (the loss constants' device), got {t.device}")


def _checked_float(fn, name, t, like) -> torch.Tensor:
    """A floating tensor shaped like `like`, detached, as fp32 [T] (a view when it already is: _build copies)."""
    _check_tensor(fn, name, t, like.device)
    if not t.dtype.is_floating_point:
        raise _error(TypeError, fn, name, f"{name} must be floating, got {t.dtype}")
    if t.shape != like.shape:
        raise _error(ValueError, fn, name, f"{name} must have old_log_probs' shape {tuple(like.shape)}, got "
                                           f"{tuple(t.shape)}")
    return t.detach().reshape(-1).to(torch.float32)


def _checked_mask(fn, mask, like) -> torch.Tensor:
    """The loss mask as a float64 [T] tensor (all ones when None)."""
    if mask is None:
        return torch.ones(like.numel(), dtype=torch.float64, device=like.device)
    _check_tensor(fn, "loss_mask", mask, like.device)
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise _error(TypeError, fn, "loss_mask", f"loss_mask must be bool or floating, got {mask.dtype}")
    if mask.shape != like.shape:
        raise _error(ValueError, fn, "loss_mask", f"loss_mask must have old_log_probs' shape {tuple(like.shape)}, "
                                                  f"got {tuple(mask.shape)}")
    return mask.detach().reshape(-1).to(torch.float64)


def _checked_ids(fn, seq_ids, like) -> torch.Tensor:
    """seq_ids as an int64 [T] tensor."""
    _check_tensor(fn, "seq_ids", seq_ids, like.device)
    if seq_ids.dtype == torch.bool or seq_ids.dtype.is_floating_point or seq_ids.dtype.is_complex:
        raise _error(TypeError, fn, "seq_ids", f"seq_ids must be an integer tensor, got {seq_ids.dtype}")
    if seq_ids.shape != like.shape:
        raise _error(ValueError, fn, "seq_ids", f"seq_ids must have old_log_probs' shape {tuple(like.shape)}, got "
                                                f"{tuple(seq_ids.shape)}")
    return seq_ids.detach().reshape(-1).to(torch.int64)


def _real(fn, name, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _error(TypeError, fn, name, f"{name} must be a Python or NumPy real number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        raise _error(ValueError, fn, name, f"{name} must not be NaN")
    return value


def _flatten(t):
    return t.reshape(-1) if isinstance(t, torch.Tensor) else t
