"""`linear_log_probs_and_entropy` as the operators ppo_ops::linear_log_probs_and_entropy (forward; `_syncing` with
validate=True or a row_mask) and ppo_ops::linear_log_probs_and_entropy_backward.

The forward operator prepares the call as the eager wrapper does and runs the eager forward body
(lm_head/function.py, forward_values), holding what the eager op holds when a backward follows (`hold`: grad mode
and an input that requires grad). Besides the log-probs and entropies it returns the kept rows' statistics scattered
to all T rows (0 on dropped rows), so that their shapes are functions of the inputs' (the kept-row count is data),
and what the backend held (the segment-GEMM backend's fp16 probabilities of the first rows and their tile partials,
in their storage's layout; empty when nothing is held): sizes that depend on the kept-row count and on the operands'
alignment, which the fake implementation declares unbacked (learnt at run time). The backward operator prepares the
call again without value checks, selects the kept rows again and runs the eager backward body (input_grads) on the
held probabilities, the keep state formed again from hidden and weight as in logits_op.py. Values and gradients are
the eager op's bit for bit.
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch
from torch import Tensor

from ppo_ops.compiled import common
from ppo_ops.core import checks, shell, sparse_keep
from ppo_ops.core.contracts import GradsWanted, HeldProbs, LinearSaved
from ppo_ops.lm_head import function
from ppo_ops.lm_head.function import KeptRows, kept, kept_row_indices

FN = "linear_log_probs_and_entropy"


def _prepare(hidden, weight, tokens, row_mask, keep_ids, keep_offsets, group_name, entropy, temperature, vocab_size,
             reduce_dx, backend, validate, needs_grad, working_memory=None) -> shell.Call:
    return shell.prepare_lm_head(
        FN, hidden, weight, tokens, tp_group=common.resolve_group(group_name), entropy=entropy,
        temperature=temperature, row_mask=row_mask, vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend,
        validate=validate, keep=common.keep_pair(keep_ids, keep_offsets), needs_grad=needs_grad,
        working_memory=working_memory)


def _forward(hidden: Tensor, weight: Tensor, tokens: Tensor, row_mask: Optional[Tensor], keep_ids: Optional[Tensor],
             keep_offsets: Optional[Tensor], group_name: str, entropy: str, temperature: float,
             vocab_size: Optional[int], reduce_dx: bool, backend: str, validate: bool, working_memory: Optional[int],
             hold: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    call = _prepare(hidden, weight, tokens, row_mask, keep_ids, keep_offsets, group_name, entropy, temperature,
                    vocab_size, reduce_dx, backend, validate, needs_grad=hold, working_memory=working_memory)
    with shell.on_device(call):
        log_prob, ent, kept_rows, stats, held, _ = function.forward_values(
            call.rows, weight, call.tokens, call.row_mask, call.plan, call.keep, hold=hold)
        n_rows, rows = kept_rows.n_rows, kept_rows.rows
        saved = (stats.shift, stats.log_sum, stats.mean_shifted if entropy == "grad" else None,
                 stats.log_prob_defined, stats.row_has_mass)
        saved = tuple(common.empty(hidden) if t is None else function.scatter_rows(t, rows, n_rows) for t in saved)
    # What the backend held, in its storage's own layout (the probabilities are a transposed view of it).
    probs = hidden.new_empty((0, 0, 0), dtype=torch.float16) if held is None else held.probs.transpose(1, 2)
    tiles = hidden.new_empty((0, 0, 3, 0), dtype=torch.float32) if held is None else held.tiles.contiguous()
    return common.unaliased((
        log_prob.reshape(call.lead).contiguous(),
        ent.reshape(call.lead).contiguous() if entropy != "none" else common.empty(hidden), *saved, probs, tiles,
    ), (hidden, weight, tokens, row_mask, keep_ids, keep_offsets))


def _forward_fake(hidden, weight, tokens, row_mask, keep_ids, keep_offsets, group_name, entropy, temperature,
                  vocab_size, reduce_dx, backend, validate, working_memory, hold):
    lead = hidden.shape[:-1]
    n_rows = tokens.numel()

    def rows(present=True, dtype=torch.float32):
        return hidden.new_empty((n_rows,) if present else (0,), dtype=dtype)

    # Whether and how much the backend holds depends on the data (the kept-row count, the operands' alignment):
    # sizes the compiler learns at run time.
    ctx = torch.library.get_ctx()
    probs = hidden.new_empty(tuple(ctx.new_dynamic_size() for _ in range(3)), dtype=torch.float16)
    tiles = hidden.new_empty((ctx.new_dynamic_size(), ctx.new_dynamic_size(), 3, ctx.new_dynamic_size()),
                             dtype=torch.float32)
    return (hidden.new_empty(lead, dtype=torch.float32),
            hidden.new_empty(lead if entropy != "none" else (0,), dtype=torch.float32),
            rows(), rows(), rows(entropy == "grad"), rows(dtype=torch.bool), rows(dtype=torch.bool), probs, tiles)


@torch.library.custom_op("ppo_ops::linear_log_probs_and_entropy_backward", mutates_args=())
def _backward_op(hidden: Tensor, weight: Tensor, tokens: Tensor, row_mask: Optional[Tensor],
                 keep_ids: Optional[Tensor], keep_offsets: Optional[Tensor], shift: Tensor, log_sum: Tensor,
                 mean_shifted: Tensor, defined: Tensor, has_mass: Tensor, probs: Tensor, tiles: Tensor,
                 grad_log_prob: Optional[Tensor],
                 grad_entropy: Optional[Tensor], group_name: str, entropy: str, temperature: float,
                 vocab_size: Optional[int], reduce_dx: bool, backend: str, need_dx: bool, need_dw: bool
                 ) -> Tuple[Tensor, Tensor]:
    call = _prepare(hidden, weight, tokens, row_mask, keep_ids, keep_offsets, group_name, entropy, temperature,
                    vocab_size, reduce_dx, backend, False, needs_grad=True)
    plan, n_rows = call.plan, call.rows.shape[0]
    with shell.on_device(call):
        rows = kept_row_indices(call.row_mask)
        kept_rows = KeptRows(kept(call.rows, rows).contiguous(), kept(call.tokens, rows), rows, n_rows)
        keep_state = None
        if call.keep is not None:
            keep_state, _ = sparse_keep.lm_head_forward(
                call.keep, kept_rows.hidden, weight, kept_rows.tokens, rows, plan,
                torch.zeros(kept_rows.hidden.shape[0], dtype=torch.float32, device=hidden.device))
        held = HeldProbs(probs.transpose(1, 2), tiles, tiles.shape[-1]) if probs.numel() else None
        saved = LinearSaved(kept(shift, rows), kept(log_sum, rows),
                            kept(mean_shifted, rows) if entropy == "grad" else None, held)
        upstream = (None if grad_log_prob is None else grad_log_prob.reshape(n_rows),
                    None if grad_entropy is None else grad_entropy.reshape(n_rows))
        dx, dw = function.input_grads(plan, kept_rows, weight, saved, (kept(defined, rows), kept(has_mass, rows)),
                                      keep_state, upstream, GradsWanted(dx=need_dx, dw=need_dw), hidden.dtype)
    if dx is None:
        dx = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_dx else common.empty(hidden)
    if dw is None:
        dw = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device) if need_dw else common.empty(weight)
    return dx.reshape(hidden.shape) if need_dx else dx, dw


@_backward_op.register_fake
def _backward_fake(hidden, weight, *args):
    need_dx, need_dw = args[-2], args[-1]
    return (hidden.new_empty(hidden.shape if need_dx else (0,)),
            weight.new_empty(weight.shape if need_dw else (0,)))


def _setup_context(ctx, inputs, output):
    (hidden, weight, tokens, row_mask, keep_ids, keep_offsets, group_name, entropy, temperature, vocab_size,
     reduce_dx, backend, _validate, _working_memory, _hold) = inputs
    ctx.save_for_backward(hidden, weight, tokens, row_mask, keep_ids, keep_offsets, *output[2:])
    ctx.options = (group_name, entropy, temperature, vocab_size, reduce_dx, backend)
    ctx.mark_non_differentiable(*output[2:], *((output[1],) if entropy != "grad" else ()))
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_log_prob, grad_entropy, *_stats):
    shell.refuse_double_backward(FN)
    options = ctx.options
    if options[1] != "grad":
        grad_entropy = None
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if (grad_log_prob is None and grad_entropy is None) or not (need_dx or need_dw):
        return (None,) * 15
    hidden, weight, tokens, row_mask, keep_ids, keep_offsets, *stats = ctx.saved_tensors
    dx, dw = _backward_op(hidden, weight, tokens, row_mask, keep_ids, keep_offsets, *stats, grad_log_prob,
                          grad_entropy, *options, need_dx, need_dw)
    return (dx if need_dx else None, dw if need_dw else None) + (None,) * 13


forward_op = common.TwoRegistrations("linear_log_probs_and_entropy", _forward, _forward_fake, _backward,
                                     _setup_context)


def linear_log_probs_and_entropy(hidden, weight, tokens, *, tp_group, entropy, keep, temperature, row_mask,
                                 vocab_size, reduce_dx, backend, validate, working_memory):
    """The public function's route under torch.compile: (log_probs, entropy or None), shaped like tokens."""
    common.check_crossable(FN, tp_group, keep, temperature=temperature, vocab_size=vocab_size,
                           working_memory=working_memory)
    working_memory = checks.check_working_memory(FN, working_memory)  # an int (or None) for the schema
    keep_ids, keep_offsets = common.keep_tensors(keep)
    out = forward_op(hidden, weight, tokens, row_mask, keep_ids, keep_offsets, common.group_name(tp_group), entropy,
                     common.number(temperature), common.number(vocab_size, numbers.Integral), reduce_dx, backend,
                     validate, working_memory,
                     torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad),
                     syncs=bool(validate) or row_mask is not None)
    return out[0], (out[1] if entropy != "none" else None)
