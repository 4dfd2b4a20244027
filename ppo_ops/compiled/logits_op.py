"""`log_probs_and_entropy` as the operators ppo_ops::log_probs_and_entropy (forward; `_syncing` with validate=True)
and ppo_ops::log_probs_and_entropy_backward.

The forward operator prepares the call exactly as the eager wrapper does and runs the eager Function's forward body
(logits/function.py, forward_values); besides the log-probs and entropies it returns the row statistics the backward
reads ([T] each; an empty placeholder where the eager Function keeps None). The backward operator prepares the call
again without value checks (validate=False: no host read, no header exchange) and runs the eager backward body
(grad_logits). With a sparse keep set the backward forms the keep state again from the logits (the eager Function
holds it from the forward, an object no schema carries): one more pass over the entries with the gather of the kept
logits, and at TP > 1 one more all-reduce of them. Not under compile: inplace_grad=True (it mutates an input the
compiler owns) and reduction_order="sglang" is taken as in eager. A per-row temperature travels as its own tensor
argument (`temperature_rows`; the scalar `temperature` is then unused) and the softcap as an optional float.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import torch
from torch import Tensor

from ppo_ops.compiled import common
from ppo_ops.core import checks, shell
from ppo_ops.core.contracts import BackwardStats, RowInputs
from ppo_ops.logits import function

FN = "log_probs_and_entropy"


def _prepare(logits, tokens, keep_mask, row_mask, keep_ids, keep_offsets, temperature_rows, group_name, entropy,
             temperature, softcap, vocab_size, chunk_size, backend, validate, reduction_order) -> shell.Call:
    return shell.prepare_logits(
        FN, logits, tokens, tp_group=common.resolve_group(group_name), entropy=entropy, keep_mask=keep_mask,
        temperature=temperature if temperature_rows is None else temperature_rows, row_mask=row_mask,
        vocab_size=vocab_size, chunk_size=chunk_size, inplace_grad=False, backend=backend, validate=validate,
        reduction_order=reduction_order, keep=common.keep_pair(keep_ids, keep_offsets), softcap=softcap)


def _forward(logits: Tensor, tokens: Tensor, keep_mask: Optional[Tensor], row_mask: Optional[Tensor],
             keep_ids: Optional[Tensor], keep_offsets: Optional[Tensor], temperature_rows: Optional[Tensor],
             group_name: str, entropy: str, temperature: float, softcap: Optional[float], vocab_size: Optional[int],
             chunk_size: Optional[int], backend: str, validate: bool,
             reduction_order: str) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    call = _prepare(logits, tokens, keep_mask, row_mask, keep_ids, keep_offsets, temperature_rows, group_name,
                    entropy, temperature, softcap, vocab_size, chunk_size, backend, validate, reduction_order)
    with shell.on_device(call):
        log_prob, ent, stats, _ = function.forward_values(
            RowInputs(call.rows, call.tokens, call.keep_mask, call.row_mask), call.plan, call.keep)
    like = call.rows
    saved = [common.or_empty(t, like, dtype) for t, dtype in
             zip(function.saved_stats(stats, call.plan), (torch.float32,) * 4 + (torch.bool,) * 2)]
    return common.unaliased((log_prob.reshape(call.lead).contiguous(),
                             ent.reshape(call.lead).contiguous() if entropy != "none" else common.empty(like),
                             *saved), (logits, tokens, keep_mask, row_mask, keep_ids, keep_offsets,
                                       temperature_rows))


def _forward_fake(logits, tokens, keep_mask, row_mask, keep_ids, keep_offsets, temperature_rows, group_name, entropy,
                  temperature, softcap, vocab_size, chunk_size, backend, validate, reduction_order):
    lead = logits.shape[:-1]
    n_rows = math.prod(lead)

    def rows(present, dtype=torch.float32):
        return logits.new_empty((n_rows,) if present else (0,), dtype=dtype)

    return (logits.new_empty(lead, dtype=torch.float32),
            logits.new_empty(lead if entropy != "none" else (0,), dtype=torch.float32),
            rows(True), rows(True), rows(keep_mask is not None), rows(entropy == "grad"),
            rows(True, torch.bool), rows(True, torch.bool))


@torch.library.custom_op("ppo_ops::log_probs_and_entropy_backward", mutates_args=())
def _backward_op(logits: Tensor, tokens: Tensor, keep_mask: Optional[Tensor], row_mask: Optional[Tensor],
                 keep_ids: Optional[Tensor], keep_offsets: Optional[Tensor], temperature_rows: Optional[Tensor],
                 shift: Tensor, log_sum: Tensor, log_sum_kept: Tensor, mean_shifted: Tensor, defined: Tensor,
                 has_mass: Tensor, grad_log_prob: Optional[Tensor], grad_entropy: Optional[Tensor], group_name: str,
                 entropy: str, temperature: float, softcap: Optional[float], vocab_size: Optional[int],
                 chunk_size: Optional[int], backend: str, reduction_order: str) -> Tensor:
    call = _prepare(logits, tokens, keep_mask, row_mask, keep_ids, keep_offsets, temperature_rows, group_name,
                    entropy, temperature, softcap, vocab_size, chunk_size, backend, False, reduction_order)
    n_rows = call.rows.shape[0]
    stats = BackwardStats(shift, log_sum, log_sum_kept if keep_mask is not None else None,
                          mean_shifted if entropy == "grad" else None, defined, has_mass)
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    with shell.on_device(call):
        keep_state = None
        if call.keep is not None:
            keep_state, _ = function.sparse_keep.logits_forward(
                call.keep, call.rows, call.tokens, call.row_mask, call.plan,
                torch.zeros(n_rows, dtype=torch.float32, device=logits.device))
        function.grad_logits(RowInputs(call.rows, call.tokens, call.keep_mask, call.row_mask), call.plan, stats,
                             None if grad_log_prob is None else grad_log_prob.reshape(n_rows),
                             None if grad_entropy is None else grad_entropy.reshape(n_rows),
                             keep_state, out.view(n_rows, logits.shape[-1]))
    return out


@_backward_op.register_fake
def _backward_fake(logits, *args, **kwargs):
    return logits.new_empty(logits.shape)


_OPTIONS = ("group_name", "entropy", "temperature", "softcap", "vocab_size", "chunk_size", "backend",
            "reduction_order")
_N_INPUTS = 16  # the forward operator's arguments


def _setup_context(ctx, inputs, output):
    (logits, tokens, keep_mask, row_mask, keep_ids, keep_offsets, temperature_rows, group_name, entropy, temperature,
     softcap, vocab_size, chunk_size, backend, _validate, reduction_order) = inputs
    ctx.save_for_backward(logits, tokens, keep_mask, row_mask, keep_ids, keep_offsets, temperature_rows, *output[2:])
    ctx.options = (group_name, entropy, temperature, softcap, vocab_size, chunk_size, backend, reduction_order)
    ctx.mark_non_differentiable(*output[2:], *((output[1],) if entropy != "grad" else ()))
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_log_prob, grad_entropy, *_stats):
    shell.refuse_double_backward(FN)
    options = ctx.options
    if grad_log_prob is None and (grad_entropy is None or options[1] != "grad"):
        return (None,) * _N_INPUTS
    logits, tokens, keep_mask, row_mask, keep_ids, keep_offsets, temperature_rows, *stats = ctx.saved_tensors
    grad = _backward_op(logits, tokens, keep_mask, row_mask, keep_ids, keep_offsets, temperature_rows, *stats,
                        grad_log_prob, grad_entropy if options[1] == "grad" else None, *options)
    return (grad,) + (None,) * (_N_INPUTS - 1)


forward_op = common.TwoRegistrations("log_probs_and_entropy", _forward, _forward_fake, _backward, _setup_context)


def log_probs_and_entropy(logits, tokens, *, tp_group, entropy, keep_mask, keep, temperature, row_mask, vocab_size,
                          chunk_size, backend, validate, reduction_order, softcap=None):
    """The public function's route under torch.compile: (log_probs, entropy or None), shaped like tokens. (The
    wrapper's inplace_grad does not reach here: under the compiler, which owns the logits' storage, the gradient comes
    back in a new tensor.)"""
    # A per-row temperature is a tensor argument of its own; any other tensor in place of a number is refused.
    temperature_rows = temperature if checks.is_row_temperature(temperature) else None
    scalar_temperature = 1.0 if temperature_rows is not None else temperature
    common.check_crossable(FN, tp_group, keep, temperature=scalar_temperature, softcap=softcap, vocab_size=vocab_size,
                           chunk_size=chunk_size)
    keep_ids, keep_offsets = common.keep_tensors(keep)
    out = forward_op(logits, tokens, keep_mask, row_mask, keep_ids, keep_offsets, temperature_rows,
                     common.group_name(tp_group), entropy, common.number(scalar_temperature),
                     None if softcap is None else common.number(softcap), common.number(vocab_size, numbers.Integral),
                     common.number(chunk_size, numbers.Integral), backend, validate, reduction_order,
                     syncs=bool(validate))
    return out[0], (out[1] if entropy != "none" else None)
