"""The fused op as one autograd Function: forward partials -> TP all-gather -> fixed-order merge; backward one pass.

The backend contract is a type: `Backend` in core/contracts.py (forward partials, merge, backward), implemented by
logits.torch_backend.TorchBackend and logits.triton_backend.TritonBackend; RowInputs, ShardOptions, RowStats and
UpstreamGrads are what crosses it.
Host time: with validate=True the forward has one host sync (at TP = 1 at its end, at TP > 1 after the header
exchange), after which the host's work up to the next launch is on the GPU's critical path; at small shapes the whole
call is host-bound. So the core launches as few torch ops as it can (targets and gradient masks are formed inside
the kernels).

Communication: at TP > 1 forward issues one all-gather of [segments, 5, T] fp32 (plus, with validate=True and before
it, one all-gather of a fixed-size int64 header per rank: core/agreement.py). Backward issues none: given the
global row stats the gradient is element-wise. At TP = 1 it is the same code with the collectives skipped.

What is kept for backward: a reference to the logits (no copy), the keep mask and the row mask the caller passed, and
O(T) fp32 row statistics (row max, log-sums relative to it, E_p[z] relative to it). With entropy="value" the entropy
is returned detached and nothing extra is kept for it.

inplace_grad: backward writes the gradient into the logits' own storage and returns that tensor as the gradient. The
logits' values are gone afterwards; autograd's version counter makes any other saved use of them fail loudly, and a
second backward through this op raises instead of reading a gradient as logits. Every backend's write counts as an
in-place write to the version counter (Triton's kernels too, whose raw-pointer stores torch cannot see).
"""

from __future__ import annotations

from typing import Optional

import torch

from ppo_ops.core import shell, sparse_keep
from ppo_ops.core.contracts import BackwardStats, RowInputs, UpstreamGrads
from ppo_ops.core.shell import Plan, forward_outputs, refuse_double_backward
from ppo_ops.logits import sglang_order


class LogProbEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, keep_mask, row_mask, plan: Plan, keep=None):
        log_prob, entropy, stats, keep_state = forward_values(RowInputs(logits, tokens, keep_mask, row_mask), plan,
                                                              keep)
        ctx.plan = plan
        ctx.keep_state = keep_state
        ctx.consumed = False
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        # The stats are sanitised (0 where a row has no mass, dropped rows included); the backend zeroes those rows'
        # upstream gradients.
        ctx.save_for_backward(logits, keep_mask, row_mask, tokens, *saved_stats(stats, plan))
        return forward_outputs(ctx, plan.entropy_mode, log_prob, entropy)

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy=None):
        plan: Plan = ctx.plan
        refuse_double_backward(plan.fn_name)
        if ctx.consumed and plan.inplace_grad:
            raise RuntimeError(
                f"ppo_ops.{plan.fn_name}: backward ran twice with inplace_grad=True; the first one overwrote the "
                "logits with their gradient, so a second would read a gradient as logits"
            )
        ctx.consumed = True
        logits, keep_mask, row_mask, tokens, *stats = ctx.saved_tensors
        out = logits if plan.inplace_grad else torch.empty_like(logits)
        grad_logits(RowInputs(logits, tokens, keep_mask, row_mask), plan, BackwardStats(*stats), grad_log_prob,
                    grad_entropy, ctx.keep_state, out)
        if plan.inplace_grad:
            # A kernel that writes through a raw pointer leaves the version counter alone, so autograd would let
            # another op's saved copy of these logits be read after they were overwritten: a silently wrong
            # gradient. Record the write as an in-place torch op would (torch ops have counted it already).
            torch.autograd.graph.increment_version(logits)
        return out, None, None, None, None, None


def forward_values(inputs: RowInputs, plan: Plan, keep: Optional[sparse_keep.SparseKeep]) -> tuple:
    """The forward of a prepared call: (log_prob [T], entropy [T], RowStats, the keep set's KeepState or None).
    Shared by the autograd Function and the custom operator (ppo_ops/compiled/logits_op.py)."""
    logits, tokens, row_mask = inputs.logits, inputs.tokens, inputs.row_mask
    # A dropped row's token may be junk (-100 for prompt rows): its column is -1 or unused, never read.
    if plan.reduction_order == "sglang":  # SGLang's log_softmax order; backward is the same
        stats = sglang_order.row_stats(plan, inputs)
    else:
        partials = plan.backend.forward_partials(inputs, plan.shard, plan.entropy_mode != "none")
        stats = shell.merge_row_stats(plan, partials, tokens, row_mask, keep=keep)

    log_prob, entropy = stats.log_prob, stats.entropy  # a dropped row's entropy is 0 already (no mass)
    keep_state = None
    if keep is not None:  # after the header exchange: its all-reduce is sized by the keep set
        keep_state, log_prob = sparse_keep.logits_forward(keep, logits, tokens, row_mask, plan, log_prob)
    if row_mask is not None:
        log_prob = torch.where(row_mask, log_prob, torch.zeros_like(log_prob))  # no mass would give -inf
    if plan.validate and plan.layout.group is None:
        # TP = 1: last, so every launch of the forward is queued before the host waits (the one host sync).
        shell.check_single_rank(plan, stats.bad_input, tokens, row_mask, keep=keep)
    return log_prob, entropy, stats, keep_state


def saved_stats(stats, plan: Plan) -> tuple:
    """What backward reads of the forward's RowStats, in BackwardStats' field order (a defined log-prob implies
    mass: its kept set has some)."""
    return (stats.shift, stats.log_sum, stats.log_sum_kept,
            stats.mean_shifted if plan.entropy_mode == "grad" else None,
            stats.log_prob_defined, stats.row_has_mass)


def grad_logits(inputs: RowInputs, plan: Plan, stats: BackwardStats, grad_log_prob, grad_entropy,
                keep_state: Optional[sparse_keep.KeepState], out: torch.Tensor) -> torch.Tensor:
    """Writes the logits' gradient into `out` ([T, V_local], the logits' dtype; the logits themselves with
    inplace_grad) and returns it."""
    # Everything between here and the backend's launch is host time on the critical path when the forward
    # synchronised (validate=True): the backends zero the upstream gradients of rows without one themselves.
    upstream = UpstreamGrads(as_fp32(grad_log_prob), as_fp32(grad_entropy) if plan.entropy_mode == "grad" else None)
    if keep_state is not None:  # keep rows: their log-prob's term is added below, on the kept entries only
        upstream = UpstreamGrads(sparse_keep.dense_grad(upstream.grad_log_prob, keep_state), upstream.grad_entropy)
    plan.backend.backward_grad(inputs, plan.shard, stats, upstream, out)
    if keep_state is not None:
        sparse_keep.logits_backward(keep_state, as_fp32(grad_log_prob), upstream.grad_entropy, stats.shift,
                                    stats.log_sum, stats.mean_shifted, out)
    return out


def as_fp32(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if grad is None or (grad.dtype == torch.float32 and grad.is_contiguous()):
        return grad  # no torch call: host time on a small call's critical path
    return grad.to(torch.float32).contiguous()
