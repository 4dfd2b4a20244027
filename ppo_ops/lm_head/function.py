"""The fused LM head as one autograd Function: GEMM-tile partials -> TP all-gather -> fixed-order merge; backward
recomputes logit tiles and returns dX and dW. No [T, V] tensor is ever held.

The backend contract is a type: `LinearBackend` in core/contracts.py, implemented by lm_head/torch_backend.py,
lm_head/triton_backend.py and lm_head/segment_gemms.py; the call is prepared by the shell both ops share
(core/shell.py), and which path it takes is lm_head/paths.py's `head_path`.

No grad (torch.no_grad, or neither hidden nor weight requires grad): the forward keeps nothing for a backward (no
saved tensors, no row statistics beyond the outputs), so an old-policy or reference pass costs the forward alone.
With a gradient the backend may keep more for its backward (`forward_for_backward`: the segment-GEMM backend's fp16
probabilities of the first rows, at most the call's working_memory, default lm_head/paths.py's HELD_BYTES), saved
with the row statistics, so autograd frees them after the backward (or keeps them for another one under
retain_graph).

Rows: a row_mask is applied before any GEMM: the kept rows' hidden states are gathered into a compact [R, H] tensor
(O(R * H) bytes; the index list is a host sync on CUDA), every kernel runs on those R rows only, and dropped rows get
log-prob 0, entropy 0 and zero dX rows. Without a row mask `hidden` is used as is (no copy).

Validation (validate=True) is the logits op's, in core/agreement.py: at TP > 1 the ranks' fixed-size headers (over
the call's T rows and row mask; the NaN / +inf flag from this rank's partials) are all-gathered before the partials
and read once; at TP = 1 the token bounds and that flag are read once after the merge.

Communication (TP > 1): forward, one all-gather of the [segments, 5, R] fp32 partials (O(R) bytes), as the logits op
(with validate=True preceded by the all-gather of one int64 header per rank).
Backward: dW needs none (each rank owns its slice); dX = sum over ranks of each rank's dlogits @ W_local, so it needs an
all-reduce over tp_group. With reduce_dx=True it happens here, in fp32, before the cast to the input dtype; with
reduce_dx=False each rank returns its own contribution and the caller reduces it (Megatron's column-parallel layer
does, see linear_log_probs_and_entropy's docstring).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.distributed as dist

from ppo_ops.core import shell, sparse_keep
from ppo_ops.core.contracts import GradsWanted, HeadRows, HeldProbs, LinearSaved, UpstreamGrads
from ppo_ops.core.shell import Plan, forward_outputs, refuse_double_backward


class LinearLogProbEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, row_mask, plan: Plan, keep=None):
        log_prob, entropy, kept_rows, stats, held, keep_state = forward_values(
            hidden, weight, tokens, row_mask, plan, keep, hold=plan.needs_grad)
        ctx.plan = plan
        ctx.n_rows = kept_rows.n_rows
        ctx.hidden_dtype = hidden.dtype
        ctx.set_materialize_grads(False)
        if plan.needs_grad:  # what the backend keeps for the backward: saved here, freed by autograd after it
            ctx.save_for_backward(
                kept_rows.hidden, weight, kept_rows.tokens, kept_rows.rows, stats.shift, stats.log_sum,
                stats.mean_shifted if plan.entropy_mode == "grad" else None, stats.log_prob_defined,
                stats.row_has_mass, None if held is None else held.probs, None if held is None else held.tiles,
            )
            ctx.held_rows = None if held is None else held.rows
            ctx.keep_state = keep_state
        return forward_outputs(ctx, plan.entropy_mode, log_prob, entropy)

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy=None):
        plan: Plan = ctx.plan
        refuse_double_backward(plan.fn_name)
        if not plan.needs_grad:
            raise RuntimeError(f"ppo_ops.{plan.fn_name}: the forward ran without grad mode and kept nothing")
        h, weight, t, rows, shift, log_sum, mean_shifted, log_prob_defined, has_mass, probs, tiles = ctx.saved_tensors
        held = None if probs is None else HeldProbs(probs, tiles, ctx.held_rows)
        dx, dw = input_grads(
            plan, KeptRows(h, t, rows, ctx.n_rows), weight, LinearSaved(shift, log_sum, mean_shifted, held),
            (log_prob_defined, has_mass), ctx.keep_state, (grad_log_prob, grad_entropy),
            GradsWanted(dx=ctx.needs_input_grad[0], dw=ctx.needs_input_grad[1]), ctx.hidden_dtype)
        return dx, dw, None, None, None, None


@dataclasses.dataclass(frozen=True)
class KeptRows:
    """The rows a call works on: the kept rows of its row mask, compacted."""

    hidden: torch.Tensor  # [R, H], contiguous
    tokens: torch.Tensor  # [R]
    rows: Optional[torch.Tensor]  # [R] their indices into the call's T rows, or None (every row)
    n_rows: int  # T


def forward_values(hidden, weight, tokens, row_mask, plan: Plan, keep, *, hold: bool) -> tuple:
    """The forward of a prepared call: (log_prob [T], entropy [T], KeptRows, RowStats of the R kept rows, HeldProbs
    or None, KeepState or None). hold: let the backend hold what its backward would otherwise recompute. Shared by
    the autograd Function and the custom operator (ppo_ops/compiled/linear_op.py)."""
    layout = plan.layout
    n_rows = hidden.shape[0]
    rows = kept_row_indices(row_mask)
    h = kept(hidden, rows).contiguous()
    t = kept(tokens, rows)
    with_entropy = plan.entropy_mode != "none"
    shard = kept_shard(plan, rows)
    if plan.reduction_order == "sglang":  # its own blocks and the logits op's SGLang order (lm_head/sglang_head.py)
        stats = plan.backend.row_stats(plan, h, weight, t, tokens, row_mask)
        if plan.validate and layout.group is None:
            shell.check_single_rank(plan, stats.bad_input, tokens, row_mask)
        return (scatter_rows(stats.log_prob, rows, n_rows), scatter_rows(stats.entropy, rows, n_rows),
                KeptRows(h, t, rows, n_rows), stats, None, None)
    if hold:
        partials, held = plan.backend.forward_for_backward(h, weight, t, shard, with_entropy, plan.working_memory)
    else:
        partials, held = plan.backend.forward_partials(h, weight, t, shard, with_entropy), None
    # TP > 1, validate: before the all-gather of the partials, whose size depends on the call, ranks that
    # disagree, or whose tokens or logits are bad, all raise together (the call's one host read). The header
    # covers the call's T rows and row mask; the partials (kept rows) give the NaN / +inf flag.
    stats = shell.merge_row_stats(plan, partials, tokens, row_mask, keep=keep)
    log_prob = stats.log_prob
    keep_state = None
    if keep is not None:  # after the header exchange: its all-reduce is sized by the keep set
        keep_state, log_prob = sparse_keep.lm_head_forward(keep, h, weight, t, rows, plan, log_prob)
    if plan.validate and layout.group is None:
        # TP = 1: last, so every launch of the forward is queued before the host waits (the one value read).
        shell.check_single_rank(plan, stats.bad_input, tokens, row_mask, keep=keep)
    log_prob = scatter_rows(log_prob, rows, n_rows)
    entropy = scatter_rows(stats.entropy, rows, n_rows)
    return log_prob, entropy, KeptRows(h, t, rows, n_rows), stats, held, keep_state


def input_grads(plan: Plan, kept_rows: KeptRows, weight, saved: LinearSaved, flags: tuple, keep_state,
                upstream: tuple, wanted: GradsWanted, hidden_dtype) -> tuple:
    """(dX [T, H] in hidden_dtype or None, dW [V_local, H] or None) from the upstream gradients (grad_log_prob,
    grad_entropy) of the call's [T] outputs; flags: the kept rows' (log_prob_defined, row_has_mass)."""
    grad_log_prob, grad_entropy = upstream
    log_prob_defined, has_mass = flags
    h, t, rows = kept_rows.hidden, kept_rows.tokens, kept_rows.rows
    g_lp = _upstream(grad_log_prob, rows, log_prob_defined)
    g_ent = _upstream(grad_entropy, rows, has_mass) if plan.entropy_mode == "grad" else None
    if g_lp is None and g_ent is None:
        return None, None
    g_keep, term = None, None
    if keep_state is not None and g_lp is not None:  # keep rows: their log-prob's term is added below
        g_keep = kept(grad_log_prob.to(torch.float32), rows)
        g_lp = sparse_keep.dense_grad(g_lp, keep_state)
        if getattr(plan.backend, "applies_dlogits_term", False):  # into its dlogits blocks: no passes of its own
            coef = sparse_keep.coefficients(keep_state, g_keep)
            term = functools.partial(sparse_keep.add_to_dlogits, keep_state, coef)
            g_keep = None
    head = HeadRows(h, weight, t, kept_shard(plan, rows))
    if plan.reduction_order == "sglang":  # its backward reads the call's plan (the temperature's division)
        dx, dw = plan.backend.backward(head, saved, UpstreamGrads(g_lp, g_ent), wanted, plan=plan)
    else:
        dx, dw = plan.backend.backward(head, saved, UpstreamGrads(g_lp, g_ent, term), wanted)
    if g_keep is not None:  # backends that form no dlogits blocks: the keep term's dX and dW passes
        if dx is not None:  # before the dX all-reduce: no collective of its own
            sparse_keep.add_dx(keep_state, g_keep, dx, weight)
        if dw is not None:
            sparse_keep.add_dw(keep_state, g_keep, dw, h)
    if dx is not None:
        if plan.reduce_dx and plan.layout.group is not None:
            dist.all_reduce(dx, group=plan.layout.group)  # fp32: one rounding to the input dtype, after the sum
        dx = scatter_rows(dx.to(hidden_dtype), rows, kept_rows.n_rows)
    return dx, dw


def _upstream(grad, rows, ok):
    """The kept rows' upstream gradient in fp32, 0 where the quantity has none (whatever it holds)."""
    if grad is None:
        return None
    g = kept(grad.to(torch.float32), rows)
    return torch.where(ok, g, torch.zeros_like(g)).contiguous()


# ---- rows ----

def kept_row_indices(row_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[R] int64 indices of the kept rows (a host sync on CUDA: their count sizes every GEMM), or None for all."""
    return None if row_mask is None else torch.nonzero(row_mask).squeeze(1)


def kept_shard(plan: Plan, rows: Optional[torch.Tensor]):
    """The shard options of the kept rows: a per-row temperature compacted as the rows are."""
    return plan.shard if rows is None else plan.shard.rows(rows)


def kept(x: Optional[torch.Tensor], rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x if (x is None or rows is None) else x.index_select(0, rows)


def scatter_rows(values: torch.Tensor, rows: Optional[torch.Tensor], n_rows: int) -> torch.Tensor:
    """[R, ...] values of the kept rows -> [T, ...] with zeros for dropped rows."""
    if rows is None:
        return values
    out = torch.zeros((n_rows,) + tuple(values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_copy_(0, rows, values)
