"""Legacy ``calculate_log_probs_and_entropy``: the slime-compatible entry point of the pre-fusion computation.

Same signature and return shapes as ``ppo_ops.calculate_log_probs_and_entropy`` so tests and the bench can swap one
for the other:

    log_prob  [T, 1] fp32 (shape (0,) when T == 0)
              from legacy_log_probs (Megatron fused CE, keep mask the legacy way)
    entropy   [T] fp32 or None
              from legacy_entropy (own vocab-parallel Function, full distribution)

chunk_size > 0 splits the rows into chunks of that many rows, runs both ops per chunk and concatenates (slime's
semantics; any chunk_size <= 0 = all rows at once). Each chunk runs its own collectives: 2 for the log-prob, 3 for
the entropy.
with_entropy_grad=False computes the entropy under ``torch.no_grad()`` (nothing saved, ``requires_grad`` False).

All argument checks run before the first collective, so a bad argument raises on every rank instead of hanging one.
"""

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ppo_ops.legacy._group import group_rank_and_size, resolve_group
from ppo_ops.legacy.entropy import legacy_entropy
from ppo_ops.legacy.log_probs import legacy_log_probs

_FN = "ppo_ops.legacy.calculate_log_probs_and_entropy"  # named in every error message
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TOKEN_DTYPES = (torch.int64, torch.int32)


def _validate_logits_and_group(logits: torch.Tensor, tp_group: Optional["dist.ProcessGroup"]) -> None:
    """Checks what resolving the group and sizing the vocabulary rely on."""
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _FLOAT_DTYPES:
        got = getattr(logits, 'dtype', type(logits))
        raise TypeError(f"{_FN}: logits must be a float32/bfloat16/float16 tensor, got {got}")
    if logits.dim() != 2 or logits.shape[-1] == 0:
        raise ValueError(f"{_FN}: logits must have shape [T, V_local] with V_local > 0, got {tuple(logits.shape)}")
    if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"{_FN}: tp_group must be a torch.distributed.ProcessGroup or None, "
                        f"got {type(tp_group).__name__}")


def _validate_rest(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    chunk_size: int,
    log_prob_keep_mask: Optional[torch.Tensor],
    global_vocab: int,
) -> None:
    """Raises TypeError/ValueError naming the argument; needs one host sync (token range), like the core's validate."""
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in _TOKEN_DTYPES:
        raise TypeError(f"{_FN}: tokens must be an int64/int32 tensor, got {getattr(tokens, 'dtype', type(tokens))}")
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(f"{_FN}: tokens must have shape {tuple(logits.shape[:-1])} (logits.shape[:-1]), "
                         f"got {tuple(tokens.shape)}")
    if tokens.device != logits.device:
        raise ValueError(f"{_FN}: tokens must be on the logits' device {logits.device}, got {tokens.device}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"{_FN}: chunk_size must be an int (<= 0: all rows at once), got {chunk_size!r}")
    if log_prob_keep_mask is not None:
        if not isinstance(log_prob_keep_mask, torch.Tensor) or log_prob_keep_mask.dtype != torch.bool:
            got = getattr(log_prob_keep_mask, 'dtype', type(log_prob_keep_mask))
            raise TypeError(f"{_FN}: log_prob_keep_mask must be a bool tensor, got {got}")
        if log_prob_keep_mask.shape != logits.shape:
            raise ValueError(f"{_FN}: log_prob_keep_mask must have the logits' shape {tuple(logits.shape)}, "
                             f"got {tuple(log_prob_keep_mask.shape)}")
        if log_prob_keep_mask.device != logits.device:
            raise ValueError(f"{_FN}: log_prob_keep_mask must be on the logits' device {logits.device}, "
                             f"got {log_prob_keep_mask.device}")
    if tokens.numel() > 0 and bool(((tokens < 0) | (tokens >= global_vocab)).any()):
        bad = tokens[(tokens < 0) | (tokens >= global_vocab)][0].item()
        raise ValueError(f"{_FN}: tokens must lie in [0, {global_vocab}) (V_local x TP), found {bad}")


def calculate_log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tp_group: Optional["dist.ProcessGroup"],
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask: Optional[torch.Tensor] = None,
    with_entropy_grad: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-prob of ``tokens`` and (optionally) entropy, computed the legacy, pre-fusion way.

    Args:
        logits: ``[T, V_local]`` float logits of this rank's vocab slice (global columns
            ``[rank*V_local, (rank+1)*V_local)``); never modified.
        tokens: ``[T]`` int64/int32 global ids of the sampled tokens, in ``[0, V_local * TP)``.
        tp_group: vocab-parallel group; None = the default group if torch.distributed is initialised, else TP=1.
        with_entropy: also return the per-token entropy of the full distribution.
        chunk_size: rows per chunk; any value <= 0 = all rows at once.
        log_prob_keep_mask: ``[T, V_local]`` bool; the log-prob is renormalised over kept columns ∪ {target}.
        with_entropy_grad: when False the entropy is computed without autograd.

    Returns:
        ``(log_prob [T, 1] fp32 (shape (0,) when T == 0), entropy [T] fp32 or None)``.
    """
    _validate_logits_and_group(logits, tp_group)
    group = resolve_group(tp_group, logits.device)
    _, tp_size = group_rank_and_size(group)
    _validate_rest(logits, tokens, chunk_size, log_prob_keep_mask, global_vocab=logits.shape[-1] * tp_size)
    tokens = tokens.long()

    if logits.shape[0] == 0:
        empty = torch.zeros((0,), dtype=torch.float32, device=logits.device)
        return empty, (empty.clone() if with_entropy else None)

    rows = logits.shape[0] if chunk_size <= 0 else chunk_size
    logit_chunks = logits.split(rows, dim=0)
    token_chunks = tokens.split(rows, dim=0)
    if log_prob_keep_mask is not None:
        mask_chunks = log_prob_keep_mask.split(rows, dim=0)
    else:
        mask_chunks = [None] * len(logit_chunks)

    log_prob = torch.cat(
        [legacy_log_probs(lc, tc, group, mc) for lc, tc, mc in zip(logit_chunks, token_chunks, mask_chunks)], dim=0
    )
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(with_entropy_grad and torch.is_grad_enabled()):
            entropy = torch.cat([legacy_entropy(lc, group) for lc in logit_chunks], dim=0)
    return log_prob, entropy
