"""Legacy per-token log-prob: Megatron-core's fused vocab-parallel cross entropy, negated.

Design (the pre-fusion computation, kept on purpose as the yardstick and the benchmark baseline):

1. Copy the logits to a contiguous fp32 working tensor. Megatron's forward subtracts the row max *in place* from its
   input after ``.float()``, which is a no-op for fp32 input, so without this copy it would overwrite the caller's
   logits (the reason slime clones them before the call).
2. Keep mask, the legacy way: ``masked_fill`` the dropped columns of the copy with -inf, then restore the target's logit
   on the rank that owns the target's column. The log-prob is then renormalised over kept ∪ {target}. The gradient of
   a dropped column is 0; the target's gradient flows back through the restored value.
3. ``megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy`` on ``[T, 1, V_local]`` with
   target ``[T, 1]``: all-reduce MAX of the row maxima, then one all-reduce SUM of (target logit, Σ exp) — two
   collectives per call. It returns the loss ``logsumexp - z[target]``; the log-prob is its negation, shape ``[T, 1]``.

Legacy behaviours kept on purpose:
* Megatron's backward casts the logits' gradient to bfloat16 (``grad_input.to(torch.bfloat16)``) and autograd casts it
  back to the input's dtype, so the log-prob gradient carries bf16 rounding, on CPU as on CUDA, even for fp32 logits.
* Megatron's ``jit_fuser`` is ``torch.compile``: the first call compiles unless ``TORCHDYNAMO_DISABLE=1``
  (same results, eager).

Memory, per chunk of C rows and V_local columns: the fp32 working copy (4·C·V bytes) becomes exp(z - max) and then the
softmax in place and is saved for backward; with a keep mask, a transient bool ``~keep_mask`` (C·V bytes). Backward
reuses the saved softmax as the gradient buffer, then allocates its bf16 cast (2·C·V) and autograd's cast back to fp32
(4·C·V), plus the cast to the logits' dtype for non-fp32 logits.
"""

import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ppo_ops.legacy._group import group_rank_and_size


def _megatron_fused_cross_entropy():
    """Imports Megatron's fused CE lazily: the import is slow (~2-4 s) and noisy (TE/Apex absent, deprecations)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.")
            from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    except ImportError as error:
        raise ImportError(
            "ppo_ops.legacy needs megatron-core (pinned 0.16.1): pip install megatron-core==0.16.1"
        ) from error
    return fused_vocab_parallel_cross_entropy


def apply_keep_mask_legacy(
    logits_f32: torch.Tensor,  # [T, V_local] fp32 working copy, owned by the caller of this helper: filled IN PLACE
    logits: torch.Tensor,  # [T, V_local] the caller's logits, READ-ONLY: source of the restored target logit
    local_targets: torch.Tensor,  # [T] int64, target column relative to this rank's first column
    keep_mask: torch.Tensor,  # [T, V_local] bool, True = column kept for the log-prob's normaliser
) -> torch.Tensor:
    """Sets dropped columns to -inf, then restores the target's logit where this rank owns the target column."""
    masked = logits_f32.masked_fill_(~keep_mask, float("-inf"))
    owned_rows = ((local_targets >= 0) & (local_targets < logits.shape[-1])).nonzero(as_tuple=True)[0]
    owned_cols = local_targets[owned_rows]
    masked[owned_rows, owned_cols] = logits[owned_rows, owned_cols].float()
    return masked


def legacy_log_probs(
    logits: torch.Tensor,  # [T, V_local] float (fp32/bf16/fp16), contiguous in the vocab dim not required; READ-ONLY
    tokens: torch.Tensor,  # [T] int64 global vocab ids, validated by the caller
    tp_group: "dist.ProcessGroup",  # resolved group (see _group.resolve_group); rank r holds [r*V_local, (r+1)*V_local)
    keep_mask: Optional[torch.Tensor] = None,  # [T, V_local] bool or None
) -> torch.Tensor:
    """Log-prob of ``tokens`` under softmax(logits) (renormalised over kept ∪ {target}); returns ``[T, 1]`` fp32."""
    fused_vocab_parallel_cross_entropy = _megatron_fused_cross_entropy()
    # Step 1: a fresh contiguous fp32 copy that Megatron may overwrite (autograd-tracked, so gradients reach `logits`).
    work = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if keep_mask is not None:
        rank, _ = group_rank_and_size(tp_group)
        local_targets = tokens - rank * logits.shape[-1]
        work = apply_keep_mask_legacy(work, logits, local_targets, keep_mask)
    # Megatron's layout is [S, B, V_local] / [S, B]: one row per sequence position, batch of one.
    loss = fused_vocab_parallel_cross_entropy(work.unsqueeze(1), tokens.unsqueeze(1), tp_group)
    return -loss
