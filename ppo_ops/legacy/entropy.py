"""Legacy per-token entropy: a separate vocab-parallel autograd Function over the full distribution.

Algorithm (the pre-fusion one, three collectives per call, none skipped at TP=1):

    m      = max_v z                      all-reduce MAX over the TP group
    e      = exp(z - m)
    S      = Σ_v e                        all-reduce SUM
    p      = e / S
    Σpz    = Σ_v p·z                      all-reduce SUM
    H      = m + log S - Σpz
    dH/dz  = p · (Σpz - z)                (times the upstream gradient g)

The keep mask never applies here: the entropy is over the full distribution (the legacy semantics).

Legacy behaviour kept on purpose: a -inf logit makes p·z = 0·(-inf) = NaN, so the entropy (and its gradient) of such a
row is NaN. It is documented, not fixed; the fused core handles -inf, and the parity suite keeps -inf out of the logits
(its keep masks apply to the log-prob only).

Memory, per chunk of C rows and V_local columns: ``z`` (the fp32 logits: an alias for fp32 input, a 4·C·V copy
otherwise), ``e`` turned into ``p`` in place (4·C·V), and a transient ``p·z`` (4·C·V); ``z`` and ``p`` are saved for
backward when a gradient is wanted. Backward allocates ``Σpz - z`` and the product (4·C·V each).
"""

import torch
import torch.distributed as dist


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of softmax over a vocab-split logits matrix; the gradient is elementwise given the row sums."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,  # [T, V_local] float, READ-ONLY (z aliases it for fp32 input; never written)
        tp_group: "dist.ProcessGroup",  # resolved group; every rank holds T rows of its own vocab slice
    ) -> torch.Tensor:
        z = logits.float()
        row_max = z.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        probs = torch.exp(z - row_max.unsqueeze(-1))
        sum_exp = probs.sum(dim=-1)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=tp_group)
        probs.div_(sum_exp.unsqueeze(-1))
        sum_p_z = (probs * z).sum(dim=-1)
        dist.all_reduce(sum_p_z, op=dist.ReduceOp.SUM, group=tp_group)
        entropy = row_max + torch.log(sum_exp) - sum_p_z
        ctx.save_for_backward(z, probs, sum_p_z)
        ctx.logits_dtype = logits.dtype
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor):
        z, probs, sum_p_z = ctx.saved_tensors
        grad_logits = probs * (sum_p_z.unsqueeze(-1) - z) * grad_entropy.unsqueeze(-1)
        return grad_logits.to(ctx.logits_dtype), None


def legacy_entropy(
    logits: torch.Tensor,  # [T, V_local] float; READ-ONLY
    tp_group: "dist.ProcessGroup",  # resolved group (see _group.resolve_group)
) -> torch.Tensor:
    """Entropy of softmax(logits) per row, over the whole (vocab-split) vocabulary; returns ``[T]`` fp32."""
    return _VocabParallelEntropy.apply(logits, tp_group)
