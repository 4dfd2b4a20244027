"""The top-entropy-share mask ("80/20", batch scope): train the policy-gradient term on the highest-entropy tokens only.

Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning for
LLM Reasoning"; TRL GRPOConfig.top_entropy_quantile (`get_high_entropy_mask`). With H_t the token's entropy under
the current policy, over the tokens the loss mask counts (and the call scores):

    tau  = quantile({H_t : t counted}, q)          torch.quantile in float64, linear interpolation; q = 0.8 keeps
                                                   the top 20%
    k_t  = 1 if H_t >= tau else 0                  a constant: no gradient flows through the threshold or the mask
    term = k_t c_t pg_t + kl_coef k_t - entropy_coef H_t     (the mask multiplies the policy-gradient term only, as
                                                              TRL does; the normalisation is unchanged)

tau is a statistic of the whole batch, so a token's term reads every token's entropy: the loss's `scope` is "batch".
`linear_token_loss` evaluates it with a statistics pass (every scored row's log-prob and entropy, no gradient kept:
the call must ask for the entropy, entropy="value" or "grad") and then the loss with the mask fixed (`freeze`), at
the cost of the general head. Through the logits op, `loss.total(log_probs, entropy)` computes tau from the entropies
it is given (all tokens) and goes through autograd. The entropies that set tau are the trainer's own, rank-invariant
under TP (every rank computes the same tau). Selecting the counted entropies for torch.quantile is a data-dependent
shape: one host sync per call. torch.quantile takes at most 2^24 counted tokens.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Union

import torch

from ppo_ops import token_losses
from ppo_ops.sequence_losses import SequenceLoss
from ppo_ops.token_losses import TokenLoss


@dataclasses.dataclass(frozen=True, eq=False)
class EntropyMaskedLoss:
    """A TokenLoss or SequenceLoss whose policy-gradient term is masked to the top-entropy share; build it with
    `top_entropy_mask`."""

    base: Union[TokenLoss, SequenceLoss] = dataclasses.field(repr=False)
    quantile: float

    scope = "batch"
    needs_entropy_statistics = True  # the statistics pass must compute entropies

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    @property
    def n_tokens(self) -> int:
        return self.base.n_tokens

    @property
    def needs_entropy(self) -> bool:
        return True

    def __call__(self, log_probs: torch.Tensor, entropy: Optional[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """Weighted terms of the tokens `rows`, which must be every token (tau is a batch statistic): [R] fp32,
        differentiable w.r.t. log_probs and entropy."""
        fn = "EntropyMaskedLoss"
        if entropy is None:
            raise token_losses._error(ValueError, fn, "entropy", "the top-entropy mask needs every token's entropy")
        if rows.numel() != self.n_tokens:
            raise token_losses._error(ValueError, fn, "rows", f"the top-entropy mask is a batch statistic: call it on "
                                                              f"all {self.n_tokens} tokens, got {rows.numel()} rows")
        ent = torch.zeros(self.n_tokens, dtype=entropy.dtype, device=entropy.device).index_copy(
            0, rows, entropy.detach())
        return self._masked(ent)(log_probs, entropy, rows)

    def total(self, log_probs: torch.Tensor, entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The scalar loss from every token's log-prob and entropy, shaped like the constants."""
        if entropy is None:
            raise token_losses._error(ValueError, "EntropyMaskedLoss.total", "entropy",
                                      "the top-entropy mask needs every token's entropy")
        return self._masked(entropy.detach().reshape(-1)).total(log_probs, entropy)

    def freeze(self, log_probs: torch.Tensor, scored: Optional[torch.Tensor] = None,
               entropy: Optional[torch.Tensor] = None) -> TokenLoss:
        """The row-separable TokenLoss with the mask fixed by `entropy` ([T], every token's), frozen further at
        `log_probs` where the base loss is sequence-scope."""
        if entropy is None or entropy.numel() != self.n_tokens:
            raise token_losses._error(ValueError, "EntropyMaskedLoss.freeze", "entropy",
                                      f"the top-entropy mask needs the {self.n_tokens} tokens' entropies")
        masked = self._masked(entropy.detach().reshape(-1).float(), scored)
        return masked.freeze(log_probs, scored) if isinstance(masked, SequenceLoss) else masked

    def keep(self, entropy: torch.Tensor, scored: Optional[torch.Tensor] = None) -> torch.Tensor:
        """k_t ([T] bool) from every token's entropy: counted (and scored) tokens with H_t >= tau."""
        rest = self.base.rest if isinstance(self.base, SequenceLoss) else self.base
        counted = rest.weight != 0
        if scored is not None:
            counted = counted & scored.reshape(-1)
        h = entropy.reshape(-1).double()  # float64: the interpolation exact enough to put tau between the right pair
        picked = h[counted]  # the one data-dependent shape here (torch.quantile takes a dense tensor)
        if picked.numel() == 0:
            return counted
        tau = torch.quantile(picked, self.quantile)
        return counted & (h >= tau)

    def metrics(self, log_probs: torch.Tensor, entropy: torch.Tensor) -> dict:
        """The base loss's metrics, and entropy_masked_share: the share of counted tokens the mask drops."""
        out = self.base.metrics(log_probs)
        rest = self.base.rest if isinstance(self.base, SequenceLoss) else self.base
        counted = rest.weight != 0
        n = counted.sum()
        dropped = counted & ~self.keep(entropy.detach())
        out["entropy_masked_share"] = dropped.float().sum() / torch.where(n > 0, n, 1)
        return out

    def _masked(self, entropy: torch.Tensor, scored: Optional[torch.Tensor] = None):
        """The base loss with k_t folded into its policy-gradient coefficient."""
        k = self.keep(entropy, scored).float()
        if isinstance(self.base, SequenceLoss):
            rest = self.base.rest
            coef = k if rest.pg_coef is None else rest.pg_coef * k
            return dataclasses.replace(self.base, rest=dataclasses.replace(rest, pg_coef=coef))
        coef = k if self.base.pg_coef is None else self.base.pg_coef * k
        return dataclasses.replace(self.base, pg_coef=coef)


def top_entropy_mask(loss: Union[TokenLoss, SequenceLoss], quantile: float = 0.8) -> EntropyMaskedLoss:
    """`loss` with its policy-gradient term masked to the tokens whose entropy is at least the `quantile` of the
    counted tokens' entropies (module docstring; TRL's top_entropy_quantile: 0.8 trains the top 20%).

    Args:
      loss: a TokenLoss (policy_loss, grpo_loss) or a SequenceLoss (gspo_loss, gmpo_loss).
      quantile: in [0, 1]; 0 keeps every token.
    """
    fn = "top_entropy_mask"
    if not isinstance(loss, (TokenLoss, SequenceLoss)):
        raise token_losses._error(TypeError, fn, "loss", f"loss must be a TokenLoss or SequenceLoss, got "
                                                         f"{type(loss).__name__}")
    if isinstance(quantile, bool) or not isinstance(quantile, numbers.Real):
        raise token_losses._error(TypeError, fn, "quantile", f"quantile must be a real number, got "
                                                             f"{type(quantile).__name__}")
    quantile = float(quantile)
    if math.isnan(quantile) or not 0.0 <= quantile <= 1.0:
        raise token_losses._error(ValueError, fn, "quantile", f"quantile must be in [0, 1], got {quantile}")
    return EntropyMaskedLoss(base=loss, quantile=quantile)
