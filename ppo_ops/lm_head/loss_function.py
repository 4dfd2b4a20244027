"""linear_token_loss as one autograd Function: the loss's gradient formed inside the forward, logits formed once.

Forward (under no_grad for autograd; the caller's loss runs under enable_grad on small per-row tensors), per row
block of the chunked backend (lm_head/chunked.py, `loss_forward`): the block's fp32 logits over this rank's
segments -> per-segment partials -> (TP > 1) all-gather -> fixed-order merge -> the caller's token_loss on the block's
global log-probs and entropies -> torch.autograd.grad of its values w.r.t. those two -> dlogits (input dtype) -> dX
rows of the block (fp32 accumulation over the segments; with reduce_dx at TP > 1 all-reduced in fp32; one rounding)
and dW accumulated in fp32 over the blocks. Returned: the loss (sum over the kept rows, fp32, 0-d), and the
log-probs and entropies (detached: metrics). Saved: dX [T, H] in the input dtype and dW [V_local, H], finished in
the input dtype where one block held every row, else its fp32 accumulator. Backward: scales dX (and a finished dW)
by the upstream scalar in place, nothing where it is 1; an accumulator in the same pass as its one rounding to the
input dtype (in place too: core/scale.py; these are this op's own buffers), and hands them out; a second backward
raises (the saved gradients are gone).

Row-separable losses only: a row's term may depend on its own log-prob, entropy and constants (indexed by the row
ids the loss is given), never on other rows' values, because the loss sees one row block at a time. TP > 1: every
rank calls token_loss with the same global values (merged statistics), so a deterministic loss gives the same values,
gradients and errors on every rank.

Validation (validate=True): at TP > 1 the logits op's header exchange runs before the first block's all-gather
(ranks agreeing on rows, tokens and options; the NaN / +inf flag from this rank's first block); every block adds
device-side flags for NaN / +inf logits (merged statistics) and for non-finite loss values or gradients; one host
read raises on them before the forward returns, and at TP = 1 also on out-of-range tokens. That read starts as soon
as the last block's flags are formed (an asynchronous copy and an event: agreement.HostRead), so the host waits
while the GPU still runs that block's dlogits, dX and dW and queues what comes next, instead of the GPU idling
while the host returns from a sync. Host reads: TP = 1, one; TP > 1, two (the header table, the end flags; both
identical on every rank, so every rank raises the same error). Checked always, on each block: token_loss returns
a float32 tensor of shape [n] on hidden's device.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ppo_ops.core import agreement, checks, shell
from ppo_ops.core.scale import scale_in_place, scale_round_in_place
from ppo_ops.core.contracts import BlockGrads, LossHooks
from ppo_ops.core.shell import Plan, refuse_double_backward
from ppo_ops.lm_head.function import kept, kept_row_indices, scatter_rows


class LinearTokenLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, row_mask, plan: Plan, token_loss):
        layout = plan.layout
        device = hidden.device
        n_rows, width = hidden.shape
        rows = kept_row_indices(row_mask)
        h = kept(hidden, rows).contiguous()
        t = kept(tokens, rows)
        row_ids = rows if rows is not None else torch.arange(n_rows, device=device)
        n_kept = h.shape[0]
        need_dx = plan.needs_grad and ctx.needs_input_grad[0]
        need_dw = plan.needs_grad and ctx.needs_input_grad[1]
        with_entropy = plan.entropy_mode != "none"

        log_prob = torch.zeros(n_kept, dtype=torch.float32, device=device)
        entropy = torch.zeros(n_kept, dtype=torch.float32, device=device) if with_entropy else None
        loss = torch.zeros((), dtype=torch.float32, device=device)
        flags = torch.zeros(2, dtype=torch.bool, device=device)  # NaN / +inf logits; non-finite loss or gradient
        dx = None
        if need_dx:
            dx = (torch.zeros if rows is not None else torch.empty)((n_rows, width), dtype=hidden.dtype,
                                                                   device=device)
        headers_done = [layout.group is None or not plan.validate]
        end_read = []  # the value checks' host read, started once the last block's flags are formed

        def merge(partials):
            stats = shell.merge_row_stats(plan, partials, tokens, row_mask, validate=not headers_done[0])
            headers_done[0] = True
            return stats

        def block_grads(stats, r0, r1):
            log_prob[r0:r1] = stats.log_prob
            ent = None
            if with_entropy:
                entropy[r0:r1] = stats.entropy
                ent = stats.entropy
            value, g_lp, g_ent = _call_loss(plan.fn_name, token_loss, stats.log_prob, ent, row_ids[r0:r1],
                                            need_grad=need_dx or need_dw,
                                            entropy_grad=plan.entropy_mode == "grad")
            loss.add_(value.sum())
            if plan.validate:
                flags[0] |= stats.bad_input.any()
                finite = torch.isfinite(value).all()
                for g in (g_lp, g_ent):
                    if g is not None:
                        finite = finite & torch.isfinite(g).all()
                flags[1] |= ~finite
                if r1 == n_kept:
                    end_read.append(_start_end_read(plan, tokens, row_mask, flags))
            # No gradient where the quantity has none (log-prob -inf: no mass in its set; entropy of an empty row).
            if g_lp is not None:
                g_lp = torch.where(stats.log_prob_defined, g_lp, torch.zeros_like(g_lp)).contiguous()
            if g_ent is not None:
                g_ent = torch.where(stats.row_has_mass, g_ent, torch.zeros_like(g_ent)).contiguous()
            return BlockGrads(g_lp, g_ent)

        def finish_dx(dx32, r0, r1):
            if plan.reduce_dx and layout.group is not None:
                dist.all_reduce(dx32, group=layout.group)  # fp32: one rounding to the input dtype, after the sum
            if rows is None:
                dx[r0:r1].copy_(dx32)
            else:
                dx.index_copy_(0, rows[r0:r1], dx32.to(dx.dtype))

        dw = plan.backend.loss_forward(h, weight, t, plan.shard, with_entropy,
                                       LossHooks(merge=merge, block_grads=block_grads, finish_dx=finish_dx),
                                       need_dx=need_dx, need_dw=need_dw)
        if not headers_done[0]:  # no kept row on this rank: it still takes part in the header exchange
            shell.check_across_ranks(plan, tokens, row_mask, torch.zeros((), dtype=torch.bool, device=device))
        if plan.validate:
            _check_end(plan, row_mask, end_read[0] if end_read else _start_end_read(plan, tokens, row_mask, flags))

        ctx.plan = plan
        ctx.consumed = False
        ctx.set_materialize_grads(False)
        ctx.dw_dtype = weight.dtype
        ctx.save_for_backward(dx, dw)  # dW finished in weight's dtype, or its fp32 accumulator
        lp_out = scatter_rows(log_prob, rows, n_rows)
        # entropy="none": an empty placeholder (the wrapper returns None), so every output is a tensor.
        ent_out = log_prob.new_empty(0) if entropy is None else scatter_rows(entropy, rows, n_rows)
        ctx.mark_non_differentiable(lp_out, ent_out)
        return loss, lp_out, ent_out

    @staticmethod
    def backward(ctx, grad_loss, grad_log_prob=None, grad_entropy=None):
        plan: Plan = ctx.plan
        refuse_double_backward(plan.fn_name)
        if ctx.consumed:
            raise RuntimeError(
                f"ppo_ops.{plan.fn_name}: backward ran twice; the first one handed out the gradients this op formed "
                "in its forward (call the op again for a second backward)")
        ctx.consumed = True
        dx, dw = ctx.saved_tensors
        if grad_loss is None:
            return None, None, None, None, None, None
        g = grad_loss.to(torch.float32)
        # In place, in fp32, nothing to do where g is 1: dX one more rounding otherwise; dW its only rounding where
        # it is still the fp32 accumulator, else (finished in the forward) one more rounding like dX.
        if dx is not None:
            scale_in_place(dx, g)
        if dw is not None and dw.dtype == torch.float32:
            dw = scale_round_in_place(dw, g, ctx.dw_dtype)
        elif dw is not None:
            scale_in_place(dw, g)
        return dx, dw, None, None, None, None


def _call_loss(fn_name, token_loss, log_prob, entropy, rows, *, need_grad, entropy_grad):
    """(values [n] fp32, d sum / d log_prob or None, d sum / d entropy or None) of the caller's loss on a block."""
    lp_in = log_prob.detach().requires_grad_(need_grad)
    ent_in = None
    if entropy is not None:
        ent_in = entropy.detach().requires_grad_(need_grad and entropy_grad)
    with torch.enable_grad() if need_grad else contextlib.nullcontext():
        value = token_loss(lp_in, ent_in, rows)
    n = log_prob.shape[0]
    def fail(exc_type, detail):
        raise checks.argument_error(exc_type, fn_name, "token_loss", f"token_loss must return {detail}")

    if not isinstance(value, torch.Tensor):
        fail(TypeError, f"a torch.Tensor, got {type(value).__name__}")
    if value.dtype != torch.float32:
        fail(TypeError, f"float32 values, got {value.dtype}")
    if tuple(value.shape) != (n,):
        fail(ValueError, f"one value per row, shape ({n},) for this block of {n} rows, got {tuple(value.shape)} (the "
                         "loss must be row-separable: a sum over rows of per-row terms)")
    if value.device != log_prob.device:
        fail(ValueError, f"values on {log_prob.device}, got {value.device}")
    if not need_grad:
        return value.detach(), None, None
    inputs = [lp_in] + ([ent_in] if ent_in is not None and ent_in.requires_grad else [])
    grads = [None] * len(inputs)
    if value.requires_grad:
        grads = torch.autograd.grad(value, inputs, grad_outputs=torch.ones_like(value), allow_unused=True)
    g_lp = None if grads[0] is None else grads[0].to(torch.float32)
    g_ent = None if len(grads) < 2 or grads[1] is None else grads[1].to(torch.float32)
    return value.detach(), g_lp, g_ent


def _start_end_read(plan: Plan, tokens, row_mask, flags) -> agreement.HostRead:
    """The value checks' one host read (module docstring), started: at TP = 1 the logits op's values (token range,
    NaN / +inf logits) with this op's loss flag; at TP > 1 both flags (the merged statistics: the same on every
    rank)."""
    if plan.layout.group is None:
        return agreement.HostRead(agreement.single_rank_values(flags[:1], tokens, row_mask, extra_flags=flags[1:]))
    return agreement.HostRead(flags.to(torch.int64))


def _check_end(plan: Plan, row_mask, read: agreement.HostRead) -> None:
    """Waits for the value checks' read and raises on them."""
    fn = plan.fn_name
    if plan.layout.group is None:
        (bad_loss,) = agreement.raise_single_rank_values(fn, read.values(), row_mask, plan.layout.vocab_size,
                                                         naming=plan.naming)
        bad_logits, where = False, ""
    else:
        bad_logits, bad_loss = read.values()
        where = f" (merged over the {plan.layout.world_size} tensor-parallel ranks)"
    if bad_logits:
        raise checks.argument_error(ValueError, fn, plan.naming.bad_logits_argument,
                                    plan.naming.bad_logits.format(where=where))
    if bad_loss:
        raise checks.argument_error(
            ValueError, fn, "token_loss",
            "token_loss returned a non-finite value or gradient (NaN or inf) on some row; check the loss's inputs "
            "(e.g. ratios exp(log_prob - old_log_prob) overflowing) or pass validate=False to skip this check")
