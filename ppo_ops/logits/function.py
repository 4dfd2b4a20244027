"""The fused op as one autograd Function: forward partials -> TP all-gather -> fixed-order merge; backward one pass.

The backend contract is a type: `Backend` in ppo_ops/_backend.py (forward partials, merge, backward), implemented by
_torch_backend.TorchBackend and _triton_backend.TritonBackend; RowInputs, ShardOptions, RowStats and UpstreamGrads
are what crosses it.
Host time: with validate=True the forward has one host sync (at TP = 1 at its end, at TP > 1 after the header
exchange), after which the host's work up to the next launch is on the GPU's critical path; at small shapes the whole
call is host-bound. So the core launches as few torch ops as it can (targets and gradient masks are formed inside
the kernels).

Communication: at TP > 1 forward issues one all-gather of [segments, 5, T] fp32 (plus, with validate=True and before
it, one all-gather of a fixed-size int64 header per rank: ppo_ops/checks.py). Backward issues none: given the
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

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ppo_ops.core import checks
from ppo_ops.core.contracts import Backend, BackwardStats, RowInputs, ShardOptions, UpstreamGrads
from ppo_ops.core.layout import VocabLayout


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything about one call that is not a tensor."""

    fn_name: str
    layout: VocabLayout
    backend: Backend
    shard: ShardOptions
    temperature: float  # as the caller gave it (the ranks compare it)
    entropy_mode: str  # "none" | "value" | "grad"
    inplace_grad: bool
    validate: bool


def all_gather_partials(partials: torch.Tensor, layout: VocabLayout) -> torch.Tensor:
    """[segments_local, 5, T] on each rank -> [segments_global, 5, T], in global segment order."""
    if layout.group is None:
        return partials
    # Into one tensor: rank-major along dim 0 is the global segment order, with no list and no cat (host time).
    out = torch.empty((layout.world_size * partials.shape[0],) + tuple(partials.shape[1:]), dtype=partials.dtype,
                      device=partials.device)
    # torch >= 2.13 names it all_gather_single and deprecates all_gather_into_tensor, the only name torch 2.11 has.
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_single(out, partials.contiguous(), group=layout.group)
    return out


def merge_row_stats(fn_name: str, layout: VocabLayout, validate: bool, partials: torch.Tensor, merge, tokens,
                    row_mask, *, naming=None, **header_fields):
    """This rank's [local segments, 5, T] partials -> global RowStats, the way every op of ppo_ops does it: at TP > 1
    with validate=True the ranks' fixed-size headers first (the value checks' one host read; `header_fields` as
    checks.rank_header takes them), then the all-gather of the partials, then `merge` (the backend's fixed-order
    merge). The logits op and both LM-head ops (ppo_ops/_linear_shell.py) call this."""
    if layout.group is not None:
        if validate:
            # Before the all-gather of the partials, whose size depends on the call: ranks that disagree, or whose
            # tokens or logits are bad, all raise here together.
            checks.check_across_ranks(fn_name, layout.group, layout.world_size, tokens, row_mask, partials,
                                         naming=naming, v_local=layout.v_local, vocab_size=layout.vocab_size,
                                         **header_fields)
        # Every rank takes part, T = 0 included: [segments, 5, T] has the same shape on every rank.
        partials = all_gather_partials(partials, layout)
    return merge(partials)


def compute_row_stats(plan: Plan, inputs: RowInputs):
    """Forward partials on this rank, (validate=True, TP > 1) the header exchange and its one host read, the
    all-gather of the partials, the merge. Returns RowStats over all T rows (neutral, i.e. without mass, for rows
    the row mask drops)."""
    partials = plan.backend.forward_partials(inputs, plan.shard, plan.entropy_mode != "none")
    has_keep = inputs.keep_mask is not None
    return merge_row_stats(plan.fn_name, plan.layout, plan.validate, partials,
                           lambda p: plan.backend.merge_partials(p, has_keep), inputs.tokens, inputs.row_mask,
                           temperature=plan.temperature, entropy_mode=plan.entropy_mode, has_keep_mask=has_keep,
                           dtype=inputs.logits.dtype)


class LogProbEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, keep_mask, row_mask, plan: Plan):
        # A dropped row's token may be junk (-100 for prompt rows): its column is -1 or unused, never read.
        stats = compute_row_stats(plan, RowInputs(logits, tokens, keep_mask, row_mask))

        log_prob, entropy = stats.log_prob, stats.entropy  # a dropped row's entropy is 0 already (no mass)
        if row_mask is not None:
            log_prob = torch.where(row_mask, log_prob, torch.zeros_like(log_prob))  # no mass would give -inf
        if plan.validate and plan.layout.group is None:
            # TP = 1: last, so every launch of the forward is queued before the host waits (the one host sync).
            checks.check_single_rank_values(plan.fn_name, stats.bad_input, tokens, row_mask,
                                               plan.layout.vocab_size)

        ctx.plan = plan
        ctx.consumed = False
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        # The stats are sanitised (0 where a row has no mass, dropped rows included); the backend zeroes those rows'
        # upstream gradients.
        ctx.save_for_backward(
            logits, keep_mask, row_mask, tokens, stats.shift, stats.log_sum, stats.log_sum_kept,
            stats.mean_shifted if plan.entropy_mode == "grad" else None,
            stats.log_prob_defined, stats.row_has_mass,  # a defined log-prob implies mass: its kept set has some
        )
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
        logits, keep_mask, row_mask, tokens, shift, log_sum, log_sum_kept, mean_shifted, defined, has_mass = (
            ctx.saved_tensors
        )
        # Everything between here and the backend's launch is host time on the critical path when the forward
        # synchronised (validate=True): the backends zero the upstream gradients of rows without one themselves.
        stats = BackwardStats(shift, log_sum, log_sum_kept, mean_shifted, defined, has_mass)
        upstream = UpstreamGrads(_as_fp32(grad_log_prob),
                                 _as_fp32(grad_entropy) if plan.entropy_mode == "grad" else None)
        out = logits if plan.inplace_grad else torch.empty_like(logits)
        plan.backend.backward_grad(RowInputs(logits, tokens, keep_mask, row_mask), plan.shard, stats, upstream, out)
        if plan.inplace_grad:
            # A kernel that writes through a raw pointer leaves the version counter alone, so autograd would let
            # another op's saved copy of these logits be read after they were overwritten: a silently wrong
            # gradient. Record the write as an in-place torch op would (torch ops have counted it already).
            torch.autograd.graph.increment_version(logits)
        return out, None, None, None, None


def _as_fp32(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if grad is None else grad.to(torch.float32).contiguous()


def forward_outputs(ctx, entropy_mode, log_prob, entropy):
    """What an op's forward returns: the log-prob alone (entropy="none"), or with the entropy, which is a constant
    for entropy="value"."""
    if entropy_mode == "none":
        return log_prob
    if entropy_mode == "value":
        ctx.mark_non_differentiable(entropy)
    return log_prob, entropy


def refuse_double_backward(fn_name):
    if torch.is_grad_enabled():
        raise RuntimeError(f"ppo_ops.{fn_name}: double backward (create_graph=True through this op) is not supported")
