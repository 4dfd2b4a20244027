"""Public API of the fused LM head with the RL loss's gradient formed inside its forward: linear_token_loss.

A thin wrapper: the shell both LM-head ops share (ppo_ops/shell.py) checks arguments (before any collective),
resolves the TP layout and the backend and flattens the leading dimensions; LinearTokenLossFunction
(ppo_ops/_linear_loss_function.py) computes; the leading dimensions are restored here.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ppo_ops.core import checks
from ppo_ops.lm_head import shell
from ppo_ops.lm_head.loss_function import LinearTokenLossFunction
from ppo_ops.api import LogProbsEntropy

_FN = "linear_token_loss"

TokenLoss = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor]


def linear_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    token_loss: TokenLoss,
    *,
    tp_group=None,
    entropy: str = "none",
    temperature: float = 1.0,
    row_mask: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    reduce_dx: bool = True,
    backend: str = "auto",
    validate: bool = True,
) -> tuple:
    """A per-token RL loss on the LM head's log-probs (and entropies), its gradient formed inside the forward: the
    logits are computed once, so the whole op costs three GEMMs' work (logits, dX, dW) and never holds [T, V].

    `token_loss(log_probs, entropy, rows) -> values` is the caller's per-token loss in torch ops:
      log_probs: [n] fp32, the log-probs of a block of n kept rows (requires grad);
      entropy: [n] fp32 (requires grad with entropy="grad"; a constant with "value") or None with entropy="none";
      rows: [n] int64 indices of those rows into the flattened tokens (tokens.reshape(-1)): index per-token
        constants (advantages, old log-probs, masks, per-row normalisation weights) with them;
      values: [n] fp32, the rows' loss terms.
    The op calls it on row blocks (1024 rows on CUDA) while the block's logits are live, takes the gradient of
    values.sum() with autograd w.r.t. its first two arguments, and forms dlogits, dX and dW right there.
    The loss MUST be row-separable: a row's term may depend only on its own log-prob, its own entropy and constants,
    never on other rows' values (it sees one block at a time; a mean over rows must use a count known beforehand,
    folded into the constants). PPO / GRPO / DAPO clipped surrogates, an entropy bonus, k1/k2/k3 KL to a reference
    and token- or sequence-mean normalisation with known counts all are. Checked on every block: values is a float32
    tensor of shape [n] on hidden's device; with validate=True also that values and gradients are finite.
    At TP > 1 every rank calls token_loss with the same global values (merged statistics). Gradients flow to hidden
    and weight only: tensors the loss closes over (constants, or a module's parameters) get none from this op.

    Returns (loss, LogProbsEntropy(log_probs, entropy)):
      loss: 0-d fp32, the sum of values over the kept rows; differentiable w.r.t. hidden and weight. Its backward
        scales the gradients formed in the forward by the upstream scalar (in place, one more rounding unless that
        scalar is 1: fold constant factors into token_loss) and can run once.
      log_probs, entropy: fp32, shaped like tokens, detached (for metrics); entropy None with entropy="none".
        Bitwise equal to linear_log_probs_and_entropy's on the same chunked backend (the same GEMM chunks, passes and
        merge; TP- and row-count invariant, as there).

    Arguments as in linear_log_probs_and_entropy (tp_group, entropy, temperature, row_mask, vocab_size, reduce_dx,
    backend, validate); row_mask False rows get log-prob 0, entropy 0, no loss term and zero gradient, and are never
    passed to token_loss. backend="triton" (the default on CUDA): cuBLAS GEMMs and the logits op's Triton passes;
    "torch": the same chunks with the logits op's PyTorch code (any device).

    Gradients: dX [T, H] in hidden's dtype (fp32 accumulation over this rank's segments, all-reduced in fp32 over
    tp_group when reduce_dx, one rounding); dW [V_local, H] in weight's dtype, accumulated in fp32 over the row blocks
    and rounded once, TP-invariant bit for bit. dW is rounded into the storage of its fp32 accumulator (no second
    [V_local, H] buffer), which it keeps until released (2x dW's size).
    Memory held from forward to backward: dX and dW. Working memory (CUDA, half precision): one block's fp32 logits
    over the local vocabulary (1024 x V_local x 4 bytes: 0.58 GiB at Qwen3's vocabulary), its dlogits (half that)
    and the fp32 dW accumulator (V_local x H x 4 bytes: 2.3 GiB at H = 4096).

    Host syncs on CUDA with validate=True: one at TP = 1 (the end-of-forward value read), two at TP > 1 (the header
    exchange before the first all-gather, the end flags); a row_mask adds one (the kept-row count). validate=False:
    none (plus the row mask's). Under torch.no_grad nothing is kept and only the loss value and the metrics are formed.
    """
    group, world_size, rank = checks.check_tp_group(_FN, tp_group)
    try:
        if not callable(token_loss):
            raise checks.argument_error(
                TypeError, _FN, "token_loss",
                f"token_loss must be callable as token_loss(log_probs, entropy, rows) -> [R] float32, got "
                f"{type(token_loss).__name__}")
        call = shell.prepare(_FN, hidden, weight, tokens, group, world_size, rank, entropy=entropy,
                                     temperature=temperature, row_mask=row_mask, vocab_size=vocab_size,
                                     reduce_dx=reduce_dx, backend=backend, validate=validate, fused_loss=True)
    except Exception as exc:
        # TP > 1 with validate=True: the other ranks learn of this error from the header exchange and raise with it.
        checks.raise_collectively(_FN, exc, group, world_size, validate, hidden)
    loss, log_prob, ent = LinearTokenLossFunction.apply(call.hidden, weight, call.tokens, call.row_mask, call.plan,
                                                        token_loss)
    return loss, LogProbsEntropy(log_prob.reshape(call.lead), None if entropy == "none" else ent.reshape(call.lead))
