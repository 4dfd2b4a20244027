"""`linear_token_loss` under torch.compile: the operator ppo_ops::linear_token_loss (`_syncing` with validate=True or
a row_mask) for the shipped losses; any other callable traced into the graph on top of the general head.

The closure: an operator's schema carries tensors and scalars, never a Python callable, and the op calls its loss
between collectives on row blocks the compiler never sees. So the losses ppo_ops ships (ppo_ops.token_losses'
TokenLoss, ppo_ops.sequence_losses' SequenceLoss, ppo_ops.entropy_mask's EntropyMaskedLoss) cross as their fields,
operator options (the [T] weights, old log-probs, advantages, reference log-probs, rollout-correction weights, a
sequence loss's advantages, mask and ids; clip, dual clip, coefficients, KL estimator, surrogate, sequence kind,
entropy quantile), and the operator rebuilds the same loss inside (where a statistics pass runs too): one graph, the
eager op's bits. Any other callable is traced by the compiler like the rest of the caller's code, applied to the
general head's log-probs and entropies (`traced_closure`): one graph too, the loss within rounding of the eager
op's, at the general head's cost.

The forward operator returns the loss, the metrics and the gradients the op formed in its forward (dX [..., H] and dW
[V_local, H], or empty placeholders when not wanted). dW always comes back in weight's dtype: where the eager op keeps
its fp32 accumulator to round it in backward together with the upstream scale, the operator rounds it in the forward
(the same rounding as the eager backward's for the usual upstream 1). Backward is torch arithmetic the compiler
traces: dX and dW times the upstream scalar in fp32, rounded once to their dtype, into new tensors (the eager op
scales in place: the compiled backward holds one more dX and dW at its peak). For an upstream 1 the bits are the eager
op's; for another scalar, dW (where the eager op kept the accumulator) may differ by that one extra rounding.
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch
from torch import Tensor

from ppo_ops.compiled import common
from ppo_ops.core import checks, shell
from ppo_ops.core.scale import scale_round_in_place
from ppo_ops.lm_head import loss_function
from ppo_ops.entropy_mask import EntropyMaskedLoss
from ppo_ops.sequence_losses import SequenceLoss
from ppo_ops.token_losses import TokenLoss

FN = "linear_token_loss"


def _forward(hidden: Tensor, weight: Tensor, tokens: Tensor, row_mask: Optional[Tensor], keep_ids: Optional[Tensor],
             keep_offsets: Optional[Tensor], loss_weight: Tensor, old_log_probs: Tensor, advantages: Tensor,
             ref_log_probs: Optional[Tensor], pg_coef: Optional[Tensor], clip_low: float, clip_high: float,
             dual_clip: Optional[float], entropy_coef: float, kl_coef: float, kl_type: str, normalization: str,
             surrogate: str, seq_advantages: Optional[Tensor], seq_mask: Optional[Tensor], seq_ids: Optional[Tensor],
             seq_kind: str, entropy_quantile: Optional[float], group_name: str, entropy: str, temperature: float,
             vocab_size: Optional[int], reduce_dx: bool, backend: str, validate: bool,
             working_memory: Optional[int], need_dx: bool, need_dw: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor,
                                                                                   Tensor]:
    token_loss = TokenLoss(weight=loss_weight, old_log_probs=old_log_probs, advantages=advantages,
                           ref_log_probs=ref_log_probs, shape=loss_weight.shape, clip_low=clip_low,
                           clip_high=clip_high, dual_clip=dual_clip, entropy_coef=entropy_coef, kl_coef=kl_coef,
                           kl_type=kl_type, normalization=normalization, surrogate=surrogate, pg_coef=pg_coef)
    if seq_kind:  # a SequenceLoss: the TokenLoss above is its row-separable rest
        token_loss = SequenceLoss(rest=token_loss, advantages=seq_advantages, mask=seq_mask, seq_ids=seq_ids,
                                  kind=seq_kind)
    if entropy_quantile is not None:
        token_loss = EntropyMaskedLoss(base=token_loss, quantile=entropy_quantile)
    # Shapes only, so every rank raises it alike (the eager op's check, run where the operator runs)
    checks.check_token_loss_rows(FN, token_loss, tuple(hidden.shape[:-1]), "hidden.shape[:-1] =")
    call = shell.prepare_lm_head(
        FN, hidden, weight, tokens, tp_group=common.resolve_group(group_name), entropy=entropy,
        temperature=temperature, row_mask=row_mask, vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend,
        validate=validate, token_loss=token_loss, fused_loss=True, keep=common.keep_pair(keep_ids, keep_offsets),
        needs_grad=need_dx or need_dw, working_memory=working_memory)
    with shell.on_device(call), common.autograd_inside():
        loss, log_prob, ent, dx, dw = loss_function.forward_values(
            call.rows, weight, call.tokens, call.row_mask, call.plan, token_loss, call.keep, need_dx=need_dx,
            need_dw=need_dw)
        if dw is not None and dw.dtype != weight.dtype:  # the fp32 accumulator: its one rounding, for a scale 1
            dw = scale_round_in_place(dw, torch.ones((), dtype=torch.float32, device=dw.device), weight.dtype)
    return common.unaliased((
        loss, log_prob.reshape(call.lead).contiguous(),
        ent.reshape(call.lead).contiguous() if entropy != "none" else common.empty(hidden),
        dx.reshape(hidden.shape) if dx is not None else common.empty(hidden, hidden.dtype),
        dw if dw is not None else common.empty(weight, weight.dtype),
    ), (hidden, weight, tokens, row_mask, keep_ids, keep_offsets, loss_weight, old_log_probs, advantages,
        ref_log_probs, pg_coef, seq_advantages, seq_mask, seq_ids))


def _forward_fake(hidden, weight, tokens, row_mask, keep_ids, keep_offsets, loss_weight, old_log_probs, advantages,
                  ref_log_probs, pg_coef, clip_low, clip_high, dual_clip, entropy_coef, kl_coef, kl_type,
                  normalization, surrogate, seq_advantages, seq_mask, seq_ids, seq_kind, entropy_quantile, group_name,
                  entropy, temperature, vocab_size, reduce_dx, backend, validate,
                  working_memory, need_dx, need_dw):
    lead = hidden.shape[:-1]
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(lead, dtype=torch.float32),
            hidden.new_empty(lead if entropy != "none" else (0,), dtype=torch.float32),
            hidden.new_empty(hidden.shape if need_dx else (0,)),
            weight.new_empty(weight.shape if need_dw else (0,)))


def _setup_context(ctx, inputs, output):
    need_dx, need_dw = inputs[-2], inputs[-1]
    ctx.need_dx, ctx.need_dw = need_dx, need_dw
    ctx.save_for_backward(output[3] if need_dx else None, output[4] if need_dw else None)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _scaled(t: Optional[Tensor], g: Tensor) -> Optional[Tensor]:
    """t * g in fp32, rounded once to t's dtype (the eager op's scale_in_place, out of place)."""
    return None if t is None else (t.to(torch.float32) * g).to(t.dtype)


def _backward(ctx, grad_loss, *_detached):
    shell.refuse_double_backward(FN)
    dx, dw = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 34
    g = grad_loss.to(torch.float32)
    return (_scaled(dx, g), _scaled(dw, g)) + (None,) * 32


forward_op = common.TwoRegistrations("linear_token_loss", _forward, _forward_fake, _backward, _setup_context)


def linear_token_loss(hidden, weight, tokens, token_loss, *, tp_group, entropy, keep, temperature, row_mask,
                      vocab_size, reduce_dx, backend, validate, working_memory):
    """The public function's route under torch.compile: (loss, log_probs, entropy or None). A TokenLoss goes
    through the operator; any other callable is traced into the graph (`traced_closure`)."""
    common.check_crossable(FN, tp_group, keep, temperature=temperature, vocab_size=vocab_size,
                           working_memory=working_memory)
    working_memory = checks.check_working_memory(FN, working_memory)  # an int for the schema; checked on both routes
    if not isinstance(token_loss, (TokenLoss, SequenceLoss, EntropyMaskedLoss)):
        return traced_closure(hidden, weight, tokens, token_loss, tp_group=tp_group, entropy=entropy, keep=keep,
                              temperature=temperature, row_mask=row_mask, vocab_size=vocab_size, reduce_dx=reduce_dx,
                              backend=backend, validate=validate, working_memory=working_memory)
    keep_ids, keep_offsets = common.keep_tensors(keep)
    quantile = None
    if isinstance(token_loss, EntropyMaskedLoss):
        token_loss, quantile = token_loss.base, token_loss.quantile
    seq = token_loss if isinstance(token_loss, SequenceLoss) else None
    if seq is not None:
        token_loss = seq.rest
    grad = torch.is_grad_enabled()
    need_dx, need_dw = grad and hidden.requires_grad, grad and weight.requires_grad
    loss, log_prob, ent, _dx, _dw = forward_op(
        hidden, weight, tokens, row_mask, keep_ids, keep_offsets, token_loss.weight, token_loss.old_log_probs,
        token_loss.advantages, token_loss.ref_log_probs, token_loss.pg_coef, token_loss.clip_low,
        token_loss.clip_high, token_loss.dual_clip, token_loss.entropy_coef, token_loss.kl_coef, token_loss.kl_type,
        token_loss.normalization, token_loss.surrogate, None if seq is None else seq.advantages,
        None if seq is None else seq.mask, None if seq is None else seq.seq_ids, "" if seq is None else seq.kind,
        quantile, common.group_name(tp_group), entropy,
        common.number(temperature), common.number(vocab_size, numbers.Integral), reduce_dx, backend, validate,
        working_memory, need_dx, need_dw, syncs=bool(validate) or row_mask is not None)
    return loss, log_prob, (ent if entropy != "none" else None)


def traced_closure(hidden, weight, tokens, token_loss, *, tp_group, entropy, keep, temperature, row_mask, vocab_size,
                   reduce_dx, backend, validate, working_memory=None):
    """A loss of the caller's own under torch.compile: the general head's operator (linear_op.py) for every row's
    log-prob and entropy, then the closure, traced into the graph, called once on all T rows (rows = arange(T)); rows
    a row_mask drops are masked out of the sum (the head gives them log-prob 0 and no gradient whatever the closure
    makes of them). The loss is the eager op's within rounding, not bit for bit: the general head's logits path
    and one sum over all rows instead of the token loss's row blocks, and four GEMMs' work instead of three (the
    gradient flows back through the head's backward; working_memory is the general head's: what it may hold for
    its backward). What validate checks of the closure's values here: dtype and
    shape (known while tracing); not their finiteness, which would take a host read."""
    from ppo_ops.compiled import linear_op
    log_prob, ent = linear_op.linear_log_probs_and_entropy(
        hidden, weight, tokens, tp_group=tp_group, entropy=entropy, keep=keep, temperature=temperature,
        row_mask=row_mask, vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend, validate=validate,
        working_memory=working_memory)
    flat_lp = log_prob.reshape(-1)
    rows = torch.arange(flat_lp.numel(), device=hidden.device)
    values = token_loss(flat_lp, None if ent is None else ent.reshape(-1), rows)
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float32:
        raise common.compile_error(TypeError, FN, "token_loss",
                                   f"token_loss must return a float32 tensor [R], got "
                                   f"{getattr(values, 'dtype', type(values).__name__)}")
    if values.shape != flat_lp.shape:
        raise common.compile_error(ValueError, FN, "token_loss",
                                   f"token_loss must return values of shape {tuple(flat_lp.shape)}, got "
                                   f"{tuple(values.shape)}")
    if row_mask is not None:
        values = torch.where(row_mask.reshape(-1), values, torch.zeros_like(values))
    return values.sum(), log_prob.detach(), (None if ent is None else ent.detach())
