"""Sequence-level policy losses (GSPO, GMPO): a token's gradient reads its whole sequence's log-probs.

With lp / old a token's log-prob and old log-prob, m_t its loss-mask value (0: not counted), A_t its advantage, c_t
its rollout-correction weight (ppo_ops/rollout_correction.py; 1 without one), M_i = Σ_{t in i} m_t, and the clip
bounds in log space hi = log(1 + clip_high), lo = log(1 - clip_low):

    GSPO (Zheng et al. 2025, eq. 5-7; verl core_algos "gspo", NeMo-RL sequence_level_importance_ratios)
      log s_i = Σ_{t in i} m_t (lp_t - old_t) / M_i                  the length-normalised sequence ratio
      pg_t    = max(-A_t s_i, -A_t clip(s_i, 1 - clip_low, 1 + clip_high))
              d pg_t / d lp_u = -A_t s_i m_u / M_i where s_i is inside its clip (for A_t's sign), else 0
    GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"; verl core_algos "geo_mean")
      x_t     = lp_t - old_t clipped on A_t's side: min(x_t, hi) where A_t >= 0, max(x_t, lo) where A_t < 0
      pg_i    = -Ā_i exp(Σ_{t in i} m_t x_t / M_i),  Ā_i = Σ_{t in i} m_t A_t / M_i    (a geometric mean of ratios)
              every token t of i carries pg_t = pg_i; d / d lp_u = pg_i m_u / M_i where x_u is not clipped, else 0

    term_t = c_t pg_t + kl_coef k_t - entropy_coef H_t, summed with the weights of `normalization` as
    ppo_ops.token_losses does (the default "seq_mean_token_mean" is GSPO's and GMPO's mean over sequences).

GSPO's paper clips s_i in [1 - 3e-4, 1 + 4e-4]; GMPO's, the token ratio in (e^-0.4, e^0.4): the defaults here.
Advantages are usually constant over a sequence (GRPO's); per-token ones are allowed, as in verl.

A `SequenceLoss` is called as a TokenLoss is, `loss(log_probs, entropy, rows) -> [R]`, but the rows must hold whole
sequences (every counted token of each sequence present), and its `scope` is "sequence". `value_and_grad` gives the
terms with their gradients on such rows: the row-separable rest (KL, entropy) in TokenLoss's closed form, the
sequence terms through autograd over the rows given. `linear_token_loss` evaluates it with the sequence schedule
(lm_head/sequence_blocks.py): row blocks cut at sequence ends, the loss on each block in the one forward; a sequence
that does not fit a block (longer than one, or its rows not consecutive) is frozen at a statistics pass over its rows
(`partly_frozen`); in SGLang's order the exact token loss calls it once on every kept row where its path scores them
together. Where a statistics pass over every row is taken instead (SGLang's order on sglang_loss_blocks, and under a
batch-scope loss), the gradient pass evaluates `loss.freeze(log_probs, ...)`: a row-separable TokenLoss with every
token's value and exact gradient at those log-probs (docs/losses.md, the schedules). Rows a row_mask drops are not
scored: they add no term and are left out of their sequence's statistics, while the weights stay those of loss_mask,
as for a TokenLoss (build the loss with loss_mask & row_mask to normalise over the scored tokens). The logits op's
route is plain autograd: `loss.total(log_probs, entropy)`. No collective is issued; constants are copied at
construction (fp32, detached).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ppo_ops import token_losses
from ppo_ops.token_losses import TokenLoss

KINDS = ("gspo", "gmpo")
GSPO_CLIP_LOW, GSPO_CLIP_HIGH = 3e-4, 4e-4  # GSPO paper, section 5.1
GMPO_CLIP_LOW, GMPO_CLIP_HIGH = 1.0 - math.exp(-0.4), math.exp(0.4) - 1.0  # GMPO paper: ratios in (e^-0.4, e^0.4)


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceLoss:
    """GSPO or GMPO over T tokens; build it with `gspo_loss` or `gmpo_loss`.

    `rest` is the row-separable remainder (KL, entropy and the weights, advantages 0), the other tensors the
    sequence terms' fp32 [T] constants (0 where a token is not counted)."""

    rest: TokenLoss = dataclasses.field(repr=False)
    advantages: torch.Tensor = dataclasses.field(repr=False)  # [T] fp32
    mask: torch.Tensor = dataclasses.field(repr=False)  # [T] fp32 m_t, 0 where not counted
    seq_ids: torch.Tensor = dataclasses.field(repr=False)  # [T] int64 in [0, T)
    kind: str
    # partly_frozen's: `frozen`, the rest with the sequence terms of the tokens not `live` ([T] bool) frozen in (a
    # linearised TokenLoss, freeze's), in place of `rest` for the row terms; None, None: every sequence live.
    frozen: Optional[TokenLoss] = dataclasses.field(default=None, repr=False)
    live: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)

    scope = "sequence"

    @property
    def shape(self) -> torch.Size:
        return self.rest.shape

    @property
    def n_tokens(self) -> int:
        return self.rest.n_tokens

    @property
    def needs_entropy(self) -> bool:
        return self.rest.needs_entropy

    def __call__(self, log_probs: torch.Tensor, entropy: Optional[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """Weighted terms of the tokens `rows`, which must hold whole sequences: [R] fp32, differentiable w.r.t.
        log_probs and entropy (as TokenLoss.__call__)."""
        rest = self._row_terms(log_probs, entropy, rows)
        return rest + self._pg_terms(log_probs, rows)

    def value_and_grad(self, log_probs: torch.Tensor, entropy: Optional[torch.Tensor], rows: torch.Tensor, *,
                       entropy_grad: bool = True) -> tuple:
        """(terms [R], d terms.sum() / d log_probs [R], d terms.sum() / d entropy [R] or None) of rows that hold
        whole sequences, without a graph left behind: the rest's closed form (TokenLoss.value_and_grad) plus the
        sequence terms and their gradient by autograd over these rows only. What the sequence schedule of
        linear_token_loss calls on each of its blocks."""
        row_terms = self.rest if self.frozen is None else self.frozen
        value, g_lp, g_ent = row_terms.value_and_grad(log_probs, entropy, rows, entropy_grad=entropy_grad)
        at = log_probs.detach().requires_grad_(True)
        with torch.enable_grad():  # the fused head's forward runs under no_grad
            pg = self._pg_terms(at, rows)
            (g_pg,) = torch.autograd.grad(pg.sum(), at)
        return value + pg.detach(), g_lp + g_pg, g_ent

    def partly_frozen(self, log_probs: torch.Tensor, frozen: torch.Tensor) -> "SequenceLoss":
        """This loss with the sequences of the tokens `frozen` ([T] bool, whole sequences' scored tokens) frozen at
        `log_probs` ([T] fp32, read on those tokens): their terms and exact gradients there are row terms (`freeze`,
        scored = frozen, with the KL and entropy terms of every token), and every other sequence's terms are still
        formed from the log-probs the loss is called with. The sequence schedule's loss where some sequences do not
        fit a row block."""
        if self.frozen is not None:
            raise token_losses._error(ValueError, "SequenceLoss.partly_frozen", "self",
                                      "this loss is partly frozen already: freeze the loss it came from")
        frozen = frozen.reshape(-1)
        return dataclasses.replace(self, frozen=self.freeze(log_probs, frozen), live=~frozen)

    def _row_terms(self, log_probs, entropy, rows) -> torch.Tensor:
        return (self.rest if self.frozen is None else self.frozen)(log_probs, entropy, rows)

    def total(self, log_probs: torch.Tensor, entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The scalar loss from every token's log-prob (and entropy), shaped like the constants."""
        for name, t in (("log_probs", log_probs), ("entropy", entropy)):
            if isinstance(t, torch.Tensor) and t.shape != self.shape:
                raise token_losses._error(ValueError, "SequenceLoss.total", name, f"{name} must have the loss "
                                          f"constants' shape {tuple(self.shape)}, got {tuple(t.shape)}")
        rows = torch.arange(self.n_tokens, device=self.mask.device)
        return self(log_probs.reshape(-1), None if entropy is None else entropy.reshape(-1), rows).sum()

    def freeze(self, log_probs: torch.Tensor, scored: Optional[torch.Tensor] = None,
               entropy: Optional[torch.Tensor] = None) -> TokenLoss:
        """The row-separable TokenLoss equal to this loss at `log_probs` ([T] fp32, every token's) in value and
        gradient: each token's term v_t + g_t (lp - lp_t) with v_t its weighted sequence term and g_t the exact
        d loss / d lp_t there (by autograd over the [T] tokens), plus the KL and entropy terms. `scored` ([T] bool,
        None: all): tokens the call scores; the others are left out of the sequences' statistics. `entropy` is not
        read (the statistics pass hands every loss it)."""
        if not isinstance(log_probs, torch.Tensor) or log_probs.numel() != self.n_tokens:
            raise token_losses._error(ValueError, "SequenceLoss.freeze", "log_probs",
                                      f"log_probs must hold the {self.n_tokens} tokens' log-probs")
        lp = log_probs.detach().reshape(-1).to(torch.float32)
        rows = torch.arange(self.n_tokens, device=self.mask.device)
        at = lp.clone().requires_grad_(True)
        with torch.enable_grad():
            pg = self._pg_terms(at, rows, scored)
            (g,) = torch.autograd.grad(pg.sum(), at)
        counted = self.rest.weight != 0
        if scored is not None:
            counted = counted & scored.reshape(-1)
        return dataclasses.replace(self.rest, surrogate="linearised", advantages=pg.detach(),
                                   pg_coef=torch.where(counted, g, 0.0), old_log_probs=torch.where(counted, lp, 0.0))

    def metrics(self, log_probs: torch.Tensor) -> dict:
        """As TokenLoss.metrics: clipped_share (tokens whose sequence ratio, GSPO, or own log-ratio, GMPO, is
        clipped), dual_clipped_share (0), ppo_kl, and the rollout metrics with rollout log-probs."""
        out = self.rest.metrics(log_probs)
        lp = log_probs.detach().reshape(-1).float()
        counted = self.rest.weight != 0
        x = torch.where(counted, lp, 0.0) - self.rest.old_log_probs
        hi, lo = token_losses._log_bounds(self.rest.clip_low, self.rest.clip_high)
        if self.kind == "gspo":
            x = self._seq_mean(self.mask * x, self.seq_ids)[self.seq_ids]
        adv = self.advantages
        clipped = ((adv >= 0) & (x > hi)) | ((adv < 0) & (x < lo))
        n = counted.sum()
        out["clipped_share"] = torch.where(counted, clipped.float(), 0.0).sum() / torch.where(n > 0, n, 1)
        return out

    # ---- the sequence terms ----

    def _seq_mean(self, values: torch.Tensor, ids: torch.Tensor, mask: Optional[torch.Tensor] = None):
        """[T slots] Σ values / Σ m per sequence (0 for a sequence without a counted token); differentiable."""
        m = self.mask if mask is None else mask
        slots = self.n_tokens
        num = torch.zeros(slots, dtype=values.dtype, device=values.device).index_add(0, ids, values)
        den = torch.zeros(slots, dtype=m.dtype, device=m.device).index_add(0, ids, m)
        return num / torch.where(den > 0, den, 1.0)

    def _pg_terms(self, log_probs, rows, scored=None) -> torch.Tensor:
        """[R] w_t c_t pg_t of the rows (whole sequences), differentiable in log_probs."""
        rest = self.rest
        weight = rest.weight[rows]
        counted = weight != 0
        if scored is not None:
            counted = counted & scored.reshape(-1)[rows]
        if self.live is not None:
            counted = counted & self.live[rows]
        m = torch.where(counted, self.mask[rows], 0.0)
        x = torch.where(counted, log_probs, 0.0) - rest.old_log_probs[rows]
        adv = self.advantages[rows]
        ids = self.seq_ids[rows]
        hi, lo = token_losses._log_bounds(rest.clip_low, rest.clip_high)
        positive = adv >= 0
        if self.kind == "gspo":
            log_s = self._seq_mean(m * x, ids, m)[ids]
            pg = -adv * torch.exp(torch.where(positive, log_s.clamp(max=hi), log_s.clamp(min=lo)))
        else:
            x_clip = torch.where(positive, x.clamp(max=hi), x.clamp(min=lo))
            mean_adv = self._seq_mean(m * adv, ids, m)[ids]
            pg = -mean_adv * torch.exp(self._seq_mean(m * x_clip, ids, m)[ids])
        if rest.pg_coef is not None:
            pg = pg * rest.pg_coef[rows]
        return torch.where(counted, weight * pg, 0.0)


def gspo_loss(old_log_probs: torch.Tensor, advantages: torch.Tensor, seq_ids: torch.Tensor, *,
              clip_low: float = GSPO_CLIP_LOW, clip_high: float = GSPO_CLIP_HIGH, **options) -> SequenceLoss:
    """GSPO (module docstring): the clipped surrogate of each sequence's length-normalised ratio s_i.

    Args as ppo_ops.policy_loss (seq_ids required; `options`: entropy_coef, kl_coef, ref_log_probs, kl_type,
    loss_mask, normalization (default "seq_mean_token_mean"), normalization_constant, rollout_log_probs,
    rollout_correction, rollout_is_high, rollout_is_low); no dual_clip or surrogate."""
    return _build("gspo_loss", "gspo", old_log_probs, advantages, seq_ids, clip_low, clip_high, options)


def gmpo_loss(old_log_probs: torch.Tensor, advantages: torch.Tensor, seq_ids: torch.Tensor, *,
              clip_low: float = GMPO_CLIP_LOW, clip_high: float = GMPO_CLIP_HIGH, **options) -> SequenceLoss:
    """GMPO (module docstring): the geometric mean of each sequence's token ratios, each clipped on its
    advantage's side. Args as gspo_loss."""
    return _build("gmpo_loss", "gmpo", old_log_probs, advantages, seq_ids, clip_low, clip_high, options)


def _build(fn, kind, old_log_probs, advantages, seq_ids, clip_low, clip_high, options) -> SequenceLoss:
    for name in ("dual_clip", "surrogate", "seq_ids"):
        if name in options:
            raise token_losses._error(TypeError, fn, name, f"{fn} takes no {name} option")
    options.setdefault("normalization", "seq_mean_token_mean")
    token_losses._check_tensor(fn, "old_log_probs", old_log_probs)
    adv = token_losses._checked_float(fn, "advantages", advantages, old_log_probs)
    ids = token_losses._checked_ids(fn, seq_ids, old_log_probs)
    zero = torch.zeros_like(adv)
    try:
        rest = token_losses._build(fn, old_log_probs, zero, ids, n_seq_slots=old_log_probs.numel(),
                                   clip_low=clip_low, clip_high=clip_high, dual_clip=None, surrogate="ppo",
                                   **_with_defaults(options))
    except TypeError as exc:
        if getattr(exc, "ppo_ops_argument", None) is None:  # an unknown keyword
            raise token_losses._error(TypeError, fn, "options", str(exc)) from exc
        raise
    counted = rest.weight != 0
    mask = token_losses._checked_mask(fn, options.get("loss_mask"), old_log_probs)
    return SequenceLoss(rest=rest, advantages=torch.where(counted, adv, 0.0),
                        mask=torch.where(counted, mask.float(), 0.0), seq_ids=ids, kind=kind)


def _with_defaults(options: dict) -> dict:
    out = dict(entropy_coef=0.0, kl_coef=0.0, ref_log_probs=None, kl_type="k3", loss_mask=None,
               normalization_constant=None, rollout_log_probs=None, rollout_correction=None, rollout_is_high=2.0,
               rollout_is_low=None)
    out.update(options)
    return out
