"""The fused op as one autograd Function: forward partials -> TP all-gather -> fixed-order merge; backward one pass.

Backend contract (ppo_ops/_torch_backend.py and ppo_ops/_triton_backend.py implement the same two functions):

    forward_partials(logits [T, V_local] READ-ONLY, rows [R] int64 or None, target_col [R] (-1: other rank),
                     keep_mask [T, V_local] bool or None, inv_temperature, n_valid, seg_len, with_entropy, chunk_rows)
        -> [V_local // seg_len, 5, R] fp32 partials per segment (channels in _row_stats.py).
    backward_grad(logits, rows, target_col, keep_mask, inv_temperature, n_valid, shift [R], log_sum [R],
                  log_sum_kept [R] or None, mean_shifted [R] or None, grad_logprob [R] or None,
                  grad_entropy [R] or None, out [T, V_local], chunk_rows)
        -> None; writes every row of `out` (dropped rows get 0); `out` may be `logits` itself (inplace_grad).
    merge_partials(partials [segments, 5, R], has_keep_mask) -> RowStats   (optional; default: _row_stats's, in torch
        ops; the Triton backend fuses it into one launch, see ppo_ops/_triton_merge.py)
        With d = z - shift: log p = d - log_sum, q = 1[keep ∪ target] e^(d - log_sum_kept) (q = p without a keep mask),
        grad = inv_temperature * (g_lp * (onehot - q) + g_ent * p * (mean_shifted - d)); padding columns and entries
        with p == 0 get no entropy term (never 0 * inf). All statistics are global (merged over TP ranks).

Communication: at TP > 1 forward issues one all-gather of [segments, 5, T] fp32 (plus, with validate=True, one tiny
all-gather of a consistency header issued earlier by the caller). Backward issues none: given the global row stats the
gradient is element-wise. At TP = 1 it is the same code with the collectives skipped.

What is kept for backward: a reference to the logits (no copy), the keep mask and the row ids the caller passed, and
O(T) fp32 row statistics (row max, log-sums relative to it, E_p[z] relative to it). With entropy="value" the entropy is returned detached and nothing
extra is kept for it.

inplace_grad: backward writes the gradient into the logits' own storage and returns that tensor as the gradient. The
logits' values are gone afterwards; autograd's version counter makes any other saved use of them fail loudly, and a
second backward through this op raises instead of reading a gradient as logits.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ppo_ops import _row_stats, _validate
from ppo_ops._layout import VocabLayout, target_columns


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything about one call that is not a tensor."""

    fn_name: str
    layout: VocabLayout
    backend: object  # module implementing the contract above
    inv_temperature: float
    entropy_mode: str  # "none" | "value" | "grad"
    chunk_rows: Optional[int]
    inplace_grad: bool
    validate: bool


def compute_row_stats(plan: Plan, logits, rows, target_col, keep_mask, n_total_rows: int, tokens, row_mask):
    """Forward partials on this rank, all-gather across ranks, merge. Returns RowStats over the active rows."""
    layout = plan.layout
    partials = plan.backend.forward_partials(
        logits, rows, target_col, keep_mask, plan.inv_temperature, layout.n_valid, layout.seg_len,
        plan.entropy_mode != "none", plan.chunk_rows,
    )
    if layout.group is not None and n_total_rows > 0:
        # Collectives need the same shape on every rank: scatter active rows into all T rows (neutral elsewhere).
        if rows is not None:
            full = _row_stats.empty_partials(layout.segments_local, n_total_rows, logits.device)
            full[:, :, rows] = partials
            partials = full
        partials = _row_stats.all_gather_partials(partials, layout)
        if rows is not None:
            partials = partials[:, :, rows]
    merge = getattr(plan.backend, "merge_partials", _row_stats.merge_partials)  # a backend may fuse the merge
    stats = merge(partials, keep_mask is not None)
    if plan.validate:
        _check_values(plan, stats, tokens, row_mask)
    return stats


def _check_values(plan: Plan, stats, tokens, row_mask) -> None:
    """validate=True: the checks that read values, with one host sync. At TP = 1 the token range is read here too
    (nothing collective has run); at TP > 1 api.py checked it before the first collective."""
    flags = [stats.bad_input.any().reshape(1).to(torch.int64)]
    single_rank = plan.layout.group is None
    if single_rank:
        flags.append(_validate.token_bounds(tokens, row_mask))
    values = torch.cat(flags).tolist()  # the host sync
    if single_rank:
        _validate.raise_if_out_of_range(plan.fn_name, values[1], values[2], plan.layout.vocab_size,
                                        row_mask is not None)
    if values[0]:
        raise ValueError(f"ppo_ops.{plan.fn_name}: logits contain NaN or +inf (after the temperature scaling)")


class LogProbEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, keep_mask, row_mask, plan: Plan):
        n_total = logits.shape[0]
        rows = None
        if row_mask is not None:
            rows = torch.nonzero(row_mask).squeeze(1)
        active_tokens = tokens if rows is None else tokens.index_select(0, rows)
        target_col = target_columns(active_tokens, plan.layout)

        stats = compute_row_stats(plan, logits, rows, target_col, keep_mask, n_total, tokens, row_mask)

        log_prob, entropy = stats.log_prob, stats.entropy
        if rows is not None:
            log_prob = _scatter_rows(log_prob, rows, n_total)
            entropy = _scatter_rows(entropy, rows, n_total)

        ctx.plan = plan
        ctx.consumed = False
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        # The stats are sanitised (0 where a row has no mass); backward zeroes those rows' upstream gradients.
        ctx.save_for_backward(
            logits, keep_mask, rows, target_col, stats.shift, stats.log_sum, stats.log_sum_kept,
            stats.mean_shifted if plan.entropy_mode == "grad" else None,
            stats.logprob_defined, stats.row_has_mass,
        )
        if plan.entropy_mode == "none":
            return log_prob
        if plan.entropy_mode == "value":
            ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy=None):
        plan: Plan = ctx.plan
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"ppo_ops.{plan.fn_name}: double backward (create_graph=True through this op) is not supported"
            )
        if ctx.consumed and plan.inplace_grad:
            raise RuntimeError(
                f"ppo_ops.{plan.fn_name}: backward ran twice with inplace_grad=True; the first one overwrote the "
                "logits with their gradient, so a second would read a gradient as logits"
            )
        ctx.consumed = True
        logits, keep_mask, rows, target_col, shift, log_sum, log_sum_kept, mean_shifted, defined, has_mass = (
            ctx.saved_tensors
        )

        g_lp = _active(grad_logprob, rows)
        g_ent = _active(grad_entropy, rows) if plan.entropy_mode == "grad" else None
        if g_lp is not None:
            g_lp = torch.where(defined & has_mass, g_lp, torch.zeros_like(g_lp))
        if g_ent is not None:
            g_ent = torch.where(has_mass, g_ent, torch.zeros_like(g_ent))

        out = logits if plan.inplace_grad else torch.empty_like(logits)
        plan.backend.backward_grad(
            logits, rows, target_col, keep_mask, plan.inv_temperature, plan.layout.n_valid,
            shift, log_sum, log_sum_kept, mean_shifted, g_lp, g_ent, out, plan.chunk_rows,
        )
        return out, None, None, None, None


def _active(grad: Optional[torch.Tensor], rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if grad is None:
        return None
    grad = grad.to(torch.float32)
    return (grad if rows is None else grad.index_select(0, rows)).contiguous()


def _scatter_rows(values: torch.Tensor, rows: torch.Tensor, n_total: int) -> torch.Tensor:
    full = torch.zeros(n_total, dtype=values.dtype, device=values.device)
    full[rows] = values
    return full
