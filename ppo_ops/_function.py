"""The fused op as one autograd Function: forward partials -> TP all-gather -> fixed-order merge; backward one pass.

Backend contract (ppo_ops/_torch_backend.py and ppo_ops/_triton_backend.py implement the same two functions):

    forward_partials(logits [T, V_local] READ-ONLY, row_mask [T] bool or None, tokens [T] global ids,
                     keep_mask [T, V_local] bool or None, inv_temperature, n_valid, seg_len, with_entropy, chunk_rows,
                     vocab_start=0)
        -> [V_local // seg_len, 5, T] fp32 partials per segment (channels in _row_stats.py), for every row: a dropped
           row (row_mask False) gets the neutral partials of _row_stats.empty_partials, its logits never read.
           A row's target column is tokens - vocab_start when in [0, V_local), else it has none here (another rank
           holds it): _layout.target_columns. The backends form it themselves (the Triton kernels in-kernel).
    backward_grad(logits, row_mask, tokens, keep_mask, inv_temperature, n_valid, shift [T], log_sum [T],
                  log_sum_kept [T] or None, mean_shifted [T] or None, grad_logprob [T] or None,
                  grad_entropy [T] or None, out [T, V_local], chunk_rows, logprob_ok=None [T] bool,
                  row_has_mass=None [T] bool, vocab_start=0)
        -> None; writes every row of `out` (dropped rows get 0, their logits never read); `out` may be `logits`
           itself (inplace_grad). grad_logprob counts as 0 where logprob_ok is False (the log-prob is -inf: its kept
           set has no mass), grad_entropy as 0 where row_has_mass is False, whatever they hold.
    merge_partials(partials [segments, 5, T], has_keep_mask) -> RowStats   (optional; default: _row_stats's, in torch
        ops; the Triton backend fuses it into one launch, see ppo_ops/_triton_merge.py)
        With d = z - shift: log p = d - log_sum, q = 1[keep ∪ target] e^(d - log_sum_kept) (q = p without a keep mask),
        grad = inv_temperature * (g_lp * (onehot - q) + g_ent * p * (mean_shifted - d)); padding columns and entries
        with p == 0 get no entropy term (never 0 * inf). All statistics are global (merged over TP ranks).
    A dropped row's token and per-row values are unspecified (its token may be junk such as -100); backends ignore
    them. The row mask is passed as a mask, not as an index list: building one (nonzero) is a host sync on CUDA. The
    Triton backend skips dropped rows inside its kernels; the torch backend (the CPU fallback) builds the list itself.
    Host time: with validate=True the forward has one host sync (at TP = 1 at its end, at TP > 1 after the header
    exchange), after which the host's work up to the next launch is on the GPU's critical path; at small shapes the
    whole call is host-bound. So the core launches as few
    torch ops as it can (targets and gradient masks are formed inside the kernels).

Communication: at TP > 1 forward issues one all-gather of [segments, 5, T] fp32 (plus, with validate=True and before
it, one all-gather of a fixed-size int64 header per rank: ppo_ops/_validate.py). Backward issues none: given the global row stats the
gradient is element-wise. At TP = 1 it is the same code with the collectives skipped.

What is kept for backward: a reference to the logits (no copy), the keep mask and the row mask the caller passed, and
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
from ppo_ops._layout import VocabLayout


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything about one call that is not a tensor."""

    fn_name: str
    layout: VocabLayout
    backend: object  # module implementing the contract above
    temperature: float  # as the caller gave it (the ranks compare it)
    inv_temperature: float  # 1 / temperature rounded to fp32 once: every backend multiplies by the same constant
    entropy_mode: str  # "none" | "value" | "grad"
    chunk_rows: Optional[int]
    inplace_grad: bool
    validate: bool


def compute_row_stats(plan: Plan, logits, row_mask, tokens, keep_mask):
    """Forward partials on this rank, (validate=True, TP > 1) the header exchange and its one host read, the
    all-gather of the partials, the merge. Returns RowStats over all T rows (neutral, i.e. without mass, for rows
    the row mask drops)."""
    layout = plan.layout
    partials = plan.backend.forward_partials(
        logits, row_mask, tokens, keep_mask, plan.inv_temperature, layout.n_valid, layout.seg_len,
        plan.entropy_mode != "none", plan.chunk_rows, vocab_start=layout.vocab_start,
    )
    if layout.group is not None:
        if plan.validate:
            # Before the all-gather of the partials, whose size depends on the call: ranks that disagree, or whose
            # tokens or logits are bad, all raise here together.
            header = _validate.rank_header(
                tokens, row_mask, partials, v_local=layout.v_local, vocab_size=layout.vocab_size,
                temperature=plan.temperature, entropy_mode=plan.entropy_mode, has_keep_mask=keep_mask is not None,
                dtype=logits.dtype,
            )
            table = _validate.exchange_headers(header, layout.group, layout.world_size)
            _validate.raise_if_any(plan.fn_name, table, row_mask is not None)
        # Every rank takes part, T = 0 included: [segments, 5, T] has the same shape on every rank.
        partials = _row_stats.all_gather_partials(partials, layout)
    merge = getattr(plan.backend, "merge_partials", _row_stats.merge_partials)  # a backend may fuse the merge
    return merge(partials, keep_mask is not None)


class LogProbEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, keep_mask, row_mask, plan: Plan):
        # A dropped row's token may be junk (-100 for prompt rows): its column is -1 or unused, never read.
        stats = compute_row_stats(plan, logits, row_mask, tokens, keep_mask)

        log_prob, entropy = stats.log_prob, stats.entropy  # a dropped row's entropy is 0 already (no mass)
        if row_mask is not None:
            log_prob = torch.where(row_mask, log_prob, torch.zeros_like(log_prob))  # no mass would give -inf
        if plan.validate and plan.layout.group is None:
            # TP = 1: last, so every launch of the forward is queued before the host waits (the one host sync).
            _validate.check_single_rank_values(plan.fn_name, stats.bad_input, tokens, row_mask,
                                               plan.layout.vocab_size)

        ctx.plan = plan
        ctx.consumed = False
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        # The stats are sanitised (0 where a row has no mass, dropped rows included); the backend zeroes those rows'
        # upstream gradients.
        ctx.save_for_backward(
            logits, keep_mask, row_mask, tokens, stats.shift, stats.log_sum, stats.log_sum_kept,
            stats.mean_shifted if plan.entropy_mode == "grad" else None,
            stats.logprob_defined, stats.row_has_mass,  # a defined log-prob implies mass: its kept set has some
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
        logits, keep_mask, row_mask, tokens, shift, log_sum, log_sum_kept, mean_shifted, logprob_ok, has_mass = (
            ctx.saved_tensors
        )
        # Everything between here and the backend's launch is host time on the critical path when the forward
        # synchronised (validate=True): the backends zero the upstream gradients of rows without one themselves.
        out = logits if plan.inplace_grad else torch.empty_like(logits)
        plan.backend.backward_grad(
            logits, row_mask, tokens, keep_mask, plan.inv_temperature, plan.layout.n_valid,
            shift, log_sum, log_sum_kept, mean_shifted, _as_fp32(grad_logprob),
            _as_fp32(grad_entropy) if plan.entropy_mode == "grad" else None, out, plan.chunk_rows,
            logprob_ok=logprob_ok, row_has_mass=has_mass, vocab_start=plan.layout.vocab_start,
        )
        return out, None, None, None, None


def _as_fp32(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if grad is None else grad.to(torch.float32).contiguous()
