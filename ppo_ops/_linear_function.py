"""The fused LM head as one autograd Function: GEMM-tile partials -> TP all-gather -> fixed-order merge; backward
recomputes logit tiles and returns dX and dW. No [T, V] tensor is ever held.

Linear backend contract (ppo_ops/_linear_torch.py and ppo_ops/_linear_triton.py implement it):

    forward_partials(hidden [R, H] kept rows READ-ONLY, weight [V_local, H] READ-ONLY, tokens [R] global ids,
                     inv_temperature, n_valid, seg_len, with_entropy, vocab_start=0)
        -> [V_local // seg_len, 5, R] fp32: the same five per-segment partials as the logits op's backends (channels
           in _row_stats.py) of the logits z = (hidden @ weight.T) * inv_temperature, fp32 accumulation, columns
           >= n_valid padding. A segment's partials must not depend on V_local, the rank or the row count.
    backward(hidden, weight, tokens, inv_temperature, n_valid, seg_len, shift [R], log_sum [R], mean_shifted [R] or
             None, grad_logprob [R] fp32 or None, grad_entropy [R] fp32 or None, need_dx, need_dw, vocab_start=0)
        -> (dX fp32 [R, H] or None: this rank's contribution, summed over its own vocabulary only;
            dW [V_local, H] in weight's dtype or None). The upstream gradients arrive already zeroed where their
           quantity has none (log-prob -inf, row without mass). dlogits = inv_t * (g_lp * (onehot - p)
           + g_ent * p * (mean_shifted - d)), d = z - shift, p = exp(d - log_sum): the logits op's formula.
    merge_partials: the merge of the logits op's backend of the same kind (so results match that op bitwise).

Rows: a row_mask is applied before any GEMM: the kept rows' hidden states are gathered into a compact [R, H] tensor
(O(R * H) bytes; the index list is a host sync on CUDA), every kernel runs on those R rows only, and dropped rows get
log-prob 0, entropy 0 and zero dX rows. Without a row mask `hidden` is used as is (no copy).

Validation (validate=True) is the logits op's, in ppo_ops/_validate.py: at TP > 1 the ranks' fixed-size headers (over
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
from typing import Optional

import torch
import torch.distributed as dist

from ppo_ops import _validate
from ppo_ops._function import all_gather_partials, forward_outputs, refuse_double_backward
from ppo_ops._layout import VocabLayout


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """Everything about one call that is not a tensor."""

    fn_name: str
    layout: VocabLayout
    backend: object  # module implementing the linear backend contract above
    temperature: float  # as the caller gave it (the ranks compare it)
    inv_temperature: float  # 1 / temperature rounded to fp32 once (_validate.check_options)
    entropy_mode: str  # "none" | "value" | "grad"
    reduce_dx: bool
    validate: bool


# How the value errors name this op's arguments: the logits are hidden @ weight.T, V_local is weight.shape[0].
NAMING = _validate.Naming(
    fields={**_validate.LOGITS_NAMING.fields,
            _validate.V_LOCAL: ("V_local (weight.shape[0])", "weight"),
            _validate.DTYPE: ("hidden dtype", "hidden")},
    bad_logits_argument="hidden",
    bad_logits="hidden @ weight.T{where} has NaN or +inf logits (after the temperature scaling); check hidden and "
               "weight for NaN / inf",
)


def _kept(x: Optional[torch.Tensor], rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x if (x is None or rows is None) else x.index_select(0, rows)


def _scatter_rows(values: torch.Tensor, rows: Optional[torch.Tensor], n_rows: int) -> torch.Tensor:
    """[R, ...] values of the kept rows -> [T, ...] with zeros for dropped rows."""
    if rows is None:
        return values
    out = torch.zeros((n_rows,) + tuple(values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_copy_(0, rows, values)


class LinearLogProbEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, row_mask, plan: LinearPlan):
        layout = plan.layout
        n_rows = hidden.shape[0]
        rows = None if row_mask is None else torch.nonzero(row_mask).squeeze(1)
        h = _kept(hidden, rows).contiguous()
        t = _kept(tokens, rows)
        partials = plan.backend.forward_partials(
            h, weight, t, plan.inv_temperature, layout.n_valid, layout.seg_len, plan.entropy_mode != "none",
            vocab_start=layout.vocab_start,
        )
        if layout.group is not None:
            if plan.validate:
                # Before the all-gather of the partials, whose size depends on the call: ranks that disagree, or
                # whose tokens or logits are bad, all raise here together (the call's one host read). The header
                # covers the call's T rows and row mask; the partials (kept rows) give the NaN / +inf flag.
                _validate.check_across_ranks(
                    plan.fn_name, layout.group, layout.world_size, tokens, row_mask, partials, naming=NAMING,
                    v_local=layout.v_local, vocab_size=layout.vocab_size, temperature=plan.temperature,
                    entropy_mode=plan.entropy_mode, has_keep_mask=False, dtype=hidden.dtype,
                )
            # Every rank takes part, R = 0 included: [segments, 5, R] has the same shape on every rank that agrees.
            partials = all_gather_partials(partials, layout)
        stats = plan.backend.merge_partials(partials, False)
        if plan.validate and layout.group is None:
            # TP = 1: last, so every launch of the forward is queued before the host waits (the one value read).
            _validate.check_single_rank_values(plan.fn_name, stats.bad_input, tokens, row_mask,
                                               layout.vocab_size, naming=NAMING)

        log_prob = _scatter_rows(stats.log_prob, rows, n_rows)
        entropy = _scatter_rows(stats.entropy, rows, n_rows)
        ctx.plan = plan
        ctx.n_rows = n_rows
        ctx.hidden_dtype = hidden.dtype
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(
            h, weight, t, rows, stats.shift, stats.log_sum,
            stats.mean_shifted if plan.entropy_mode == "grad" else None, stats.log_prob_defined, stats.row_has_mass,
        )
        return forward_outputs(ctx, plan.entropy_mode, log_prob, entropy)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy=None):
        plan: LinearPlan = ctx.plan
        refuse_double_backward(plan.fn_name)
        h, weight, t, rows, shift, log_sum, mean_shifted, logprob_ok, has_mass = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_lp = _upstream(grad_logprob, rows, logprob_ok)
        g_ent = _upstream(grad_entropy, rows, has_mass) if plan.entropy_mode == "grad" else None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        dx, dw = plan.backend.backward(
            h, weight, t, plan.inv_temperature, plan.layout.n_valid, plan.layout.seg_len, shift, log_sum,
            mean_shifted, g_lp, g_ent, need_dx=need_dx, need_dw=need_dw, vocab_start=plan.layout.vocab_start,
        )
        if dx is not None:
            if plan.reduce_dx and plan.layout.group is not None:
                dist.all_reduce(dx, group=plan.layout.group)  # fp32: one rounding to the input dtype, after the sum
            dx = _scatter_rows(dx.to(ctx.hidden_dtype), rows, ctx.n_rows)
        return dx, dw, None, None, None


def _upstream(grad, rows, ok):
    """The kept rows' upstream gradient in fp32, 0 where the quantity has none (whatever it holds)."""
    if grad is None:
        return None
    g = _kept(grad.to(torch.float32), rows)
    return torch.where(ok, g, torch.zeros_like(g)).contiguous()
