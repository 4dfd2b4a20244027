"""linear_token_loss as one autograd Function: the loss's gradient formed inside the forward, logits formed once.

Forward (under no_grad for autograd; the caller's loss runs under enable_grad on small per-row tensors), per row
block of the backend's `loss_forward` (lm_head/token_loss_blocks.py): the block's fp32 logits over this rank's
segments -> per-segment partials -> (TP > 1) all-gather -> fixed-order merge -> the caller's token_loss on the
block's global log-probs and entropies -> torch.autograd.grad of its values w.r.t. those two -> dlogits (input dtype)
-> dX rows of the block (fp32 accumulation over the segments; with reduce_dx at TP > 1 all-reduced in fp32; one
rounding) and dW. Returned: the loss (sum over the kept rows, fp32, 0-d), and the log-probs and entropies
(detached: metrics). Saved: dX [T, H] in the input dtype and dW [V_local, H], finished in the input dtype or its
fp32 accumulator (the backend says which). Backward: scales dX (and a finished dW) by the upstream scalar in place,
nothing where it is 1; an accumulator in the same pass as its one rounding to the input dtype (in place too:
core/scale.py; these are this op's own buffers), and hands them out; a second backward raises (the saved gradients
are gone).

`BlockLoop` holds one forward's state (outputs, flags, the end read, this rank's failure, the keep set's state) and is
the backend's `LossHooks`: merge, block_grads, keep_dlogits and finish_dx are its methods.

A sparse keep set (`keep`, core/sparse_keep.py): its kept logits are formed once, in the first block's merge (after
the header exchange, since their all-reduce is sized by the keep set); each block's keep rows get their renormalised
log-probs before the caller's loss sees them; the loss's log-prob gradient goes to the full-vocabulary dlogits as 0 on
keep rows, and the keep term is added into each block x segment of dlogits (keep_dlogits) before its dX / dW GEMMs,
so it rides in them: no pass of its own over the weight or the hidden rows.

The loss sees one row block at a time, so the schedule follows its `scope` (paths.loss_schedule, docs/losses.md):
"row" losses (a row's term depends on its own log-prob, entropy and constants, indexed by the row ids the loss is
given; any closure) take the path's blocks as they come; "sequence" losses (ppo_ops.sequence_losses) take blocks cut
at sequence ends (lm_head/sequence_blocks.py, `_sequence_blocks`: the sequences that fit no block get a statistics
pass over their rows and are frozen there), except in SGLang's order; "batch" losses, and sequence ones in SGLang's
order, a statistics pass over every row and the loss frozen there (`_frozen`). TP > 1: every rank calls token_loss
with the same global values (merged statistics) on the same blocks.

Validation (validate=True): at TP > 1 the logits op's header exchange runs before the first block's all-gather
(ranks agreeing on rows, tokens and options; the NaN / +inf flag from this rank's first block); every block adds
device-side flags for NaN / +inf logits (merged statistics) and for non-finite loss values or gradients; one host
read raises on them before the forward returns, and at TP = 1 also on out-of-range tokens. That read starts as soon
as the last block's flags are formed (an asynchronous copy and an event: agreement.HostRead), so the host waits while
the GPU still runs that block's dlogits, dX and dW. Host reads: TP = 1, one; TP > 1, two (the header table, the end
table).

Failure of the caller's loss is collective at TP > 1 with validate=True. The caller's code runs between
collectives (after a block's all-gather, before its dX all-reduce), so a rank must not raise there alone: its first
failure (an exception of token_loss's own, or a return that is not float32 [n] on hidden's device) is kept, the
rank goes on with zero gradients for that block and every later one (so it still takes part in every collective,
with the same shapes), and the ranks all-gather their end flags (NaN / +inf logits, non-finite loss values or
gradients, the failure's kind) as an [tp, 3] int64 table: one small all-gather where the end flags were read before,
no extra host read. Every rank then raises the same error naming the rank(s) at fault; a faulty rank raises it from
its own exception (__cause__). TP = 1 (no other rank to wait) and validate=False: the failure raises at once, on its
rank only (validate=False: the other ranks wait in their next collective until the group's timeout).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from ppo_ops import sequence_losses, token_losses
from ppo_ops.core import agreement, checks, shell, sparse_keep
from ppo_ops.core.scale import scale_in_place, scale_round_in_place
from ppo_ops.core.contracts import BlockGrads, GradsWanted, HeadRows, RowStats
from ppo_ops.core.shell import Plan, refuse_double_backward
from ppo_ops.lm_head import paths, sequence_blocks
from ppo_ops.lm_head.function import kept, kept_row_indices, kept_shard, scatter_rows

# The end flags, one int64 each per rank: NaN / +inf logits (merged statistics), non-finite loss values or
# gradients, and how token_loss failed on this rank (FAILURES index + 1; 0: it did not).
_BAD_LOGITS, _NON_FINITE, _FAILURE = 0, 1, 2
# How token_loss can fail, each with the exception type that every rank raises for it.
FAILURES = (("raised an exception", RuntimeError), ("returned values of the wrong type", TypeError),
            ("returned values of the wrong shape or device", ValueError))


class LinearTokenLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, tokens, row_mask, plan: Plan, token_loss, keep=None):
        need_dx = plan.needs_grad and ctx.needs_input_grad[0]
        need_dw = plan.needs_grad and ctx.needs_input_grad[1]
        loss, lp_out, ent_out, dx, dw = forward_values(hidden, weight, tokens, row_mask, plan, token_loss, keep,
                                                       need_dx=need_dx, need_dw=need_dw)
        ctx.plan = plan
        ctx.consumed = False
        ctx.set_materialize_grads(False)
        ctx.dw_dtype = weight.dtype
        ctx.save_for_backward(dx, dw)  # dW finished in weight's dtype, or its fp32 accumulator
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
            return None, None, None, None, None, None, None
        g = grad_loss.to(torch.float32)
        # In place, in fp32, nothing to do where g is 1: dX one more rounding otherwise; dW its only rounding where
        # it is still the fp32 accumulator, else (finished in the forward) one more rounding like dX.
        if dx is not None:
            scale_in_place(dx, g)
        if dw is not None and dw.dtype == torch.float32:
            dw = scale_round_in_place(dw, g, ctx.dw_dtype)
        elif dw is not None:
            scale_in_place(dw, g)
        return _own_storage(dx), _own_storage(dw), None, None, None, None, None


def _own_storage(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A gradient in storage of its own size. dW is formed inside a larger buffer (one block's probabilities, or the
    first half of the fp32 accumulator), and autograd may keep the returned tensor itself as the parameter's .grad:
    handed out as a view it would hold that whole buffer through the model's backward and beyond (in a whole step,
    on top of the body's own peak). A copy here costs one pass over dW; the buffer goes with this node's saved
    tensors."""
    if grad is None or grad.untyped_storage().nbytes() == grad.numel() * grad.element_size():
        return grad
    return grad.clone(memory_format=torch.contiguous_format)


def forward_values(hidden, weight, tokens, row_mask, plan: Plan, token_loss, keep, *, need_dx: bool,
                   need_dw: bool) -> tuple:
    """The forward of a prepared call: (loss, log-probs [T], entropies [T] or an empty placeholder, dX or None, dW
    or None), dW in weight's dtype or as its fp32 accumulator. Shared by the autograd Function and the custom operator
    (ppo_ops/compiled/token_loss_op.py)."""
    n_rows = hidden.shape[0]
    rows = kept_row_indices(row_mask)
    head = HeadRows(kept(hidden, rows).contiguous(), weight, kept(tokens, rows), kept_shard(plan, rows))
    schedule = schedule_of(plan, token_loss, head)
    whole = plan.reduction_order == "sglang"  # on SGLang's order the sequence schedule is one call on every row
    if schedule == paths.SEQUENCES and not whole and hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        schedule = paths.STATISTICS  # the cut reads the sequence ids on the host, which a capture cannot
    if schedule == paths.STATISTICS:
        token_loss = _frozen(hidden, weight, tokens, row_mask, plan, token_loss, keep)
    blocks = None
    if schedule == paths.SEQUENCES and not whole:
        token_loss, blocks = _sequence_blocks(hidden, weight, tokens, row_mask, plan, token_loss, keep, rows, head,
                                              needs_grad=need_dx or need_dw)
    loop = BlockLoop(plan, token_loss, hidden, tokens, row_mask, rows, n_kept=head.hidden.shape[0],
                     need_dx=need_dx, need_grad=need_dx or need_dw, keep=keep, head=head, blocks=blocks)
    wanted = GradsWanted(dx=need_dx, dw=need_dw)
    if plan.reduction_order == "sglang":  # its blocks read the call's plan (lm_head/sglang_head.py)
        dw = plan.backend.loss_forward(head, loop.with_entropy, loop, wanted, plan=plan)
    else:
        dw = plan.backend.loss_forward(head, loop.with_entropy, loop, wanted, plan.working_memory)
    loop.finish()
    lp_out = scatter_rows(loop.log_prob, rows, n_rows)
    # entropy="none": an empty placeholder (the wrapper returns None), so every output is a tensor.
    ent_out = loop.log_prob.new_empty(0) if loop.entropy is None else scatter_rows(loop.entropy, rows, n_rows)
    return loop.loss, lp_out, ent_out, loop.dx, dw


def schedule_of(plan: Plan, token_loss, head: Optional[HeadRows] = None) -> str:
    """The schedule a call's loss takes (paths.loss_schedule: by its scope and the reduction order; in SGLang's
    order by whether the path's loss sees the kept rows `head` at once)."""
    scope = getattr(token_loss, "scope", "row")
    whole = (plan.reduction_order == "sglang" and scope == "sequence" and head is not None
             and plan.backend.scores_every_row_at_once(plan, head.hidden, head.weight))
    return paths.loss_schedule(scope, plan.reduction_order, whole)


def _sequence_blocks(hidden, weight, tokens, row_mask, plan: Plan, token_loss, keep, rows, head: HeadRows, *,
                     needs_grad: bool) -> tuple:
    """The sequence schedule (lm_head/sequence_blocks.py) of a SequenceLoss on the segment-GEMM paths: (the loss
    the blocks call, the blocks' cut or None for fixed steps). Where the kept rows are more than one block of the
    path, the kept rows' sequence ids and counted flags come to the host (one read), the cut is made (and compared
    across ranks at TP > 1 with validate, before any other collective), and the sequences that do not fit a block
    get a statistics pass over their rows only and are frozen there (SequenceLoss.partly_frozen)."""
    n_kept = head.hidden.shape[0]
    path = plan.backend.path(head.hidden, weight, plan.shard.seg_len, token_loss=True, needs_grad=needs_grad,
                             working_memory=plan.working_memory)
    if n_kept <= path.block_rows:  # one block: every sequence whole in it, nothing to cut
        return token_loss, None
    row_ids = rows if rows is not None else torch.arange(n_kept, device=hidden.device)
    n_tokens = token_loss.n_tokens
    ids = token_loss.seq_ids[row_ids]
    counted = token_loss.rest.weight[row_ids] != 0
    host = torch.stack((ids, counted.to(torch.int64))).cpu()
    blocks, error = None, None
    low, high = int(host[0].min()), int(host[0].max())
    if low < 0 or high >= n_tokens:
        error = checks.argument_error(
            ValueError, plan.fn_name, "token_loss",
            f"token_loss.seq_ids must be in [0, {n_tokens}) (one sequence index per token, the loss's T = "
            f"{n_tokens}), got values in [{low}, {high}]")
    else:
        blocks = sequence_blocks.cut(host[0], host[1].bool(), path.block_rows)
    _agree_on_blocks(plan, blocks, error, hidden)
    if blocks.recompute is not None:
        again = blocks.recompute.to(hidden.device)
        frozen = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        frozen[row_ids] = again
        stats_plan = dataclasses.replace(plan, needs_grad=False)
        _, log_prob, _, _, _ = forward_values(hidden, weight, tokens, frozen, stats_plan, _no_loss, keep,
                                              need_dx=False, need_dw=False)
        token_loss = token_loss.partly_frozen(log_prob, frozen)
    return token_loss, blocks


def _agree_on_blocks(plan: Plan, blocks, error: Optional[Exception], like: torch.Tensor) -> None:
    """Raises `error` (the seq ids' range), or at TP > 1 with validate, where the ranks' cuts differ, one error on
    every rank: the ranks exchange sequence_blocks.summary (one small all-gather and host read) before any other
    collective of the call, since the blocks fix the count and shapes of every later one."""
    layout = plan.layout
    if layout.group is None or not plan.validate:
        if error is not None:
            raise error
        return
    mine = torch.tensor(sequence_blocks.summary(blocks, error=int(error is not None)), dtype=torch.int64,
                        device=agreement.header_device(like, layout.group))
    table = agreement.exchange_headers(mine, layout.group, layout.world_size)
    faulty = [r for r, row in enumerate(table) if row[0]]
    if faulty:
        detail = (f"token_loss.seq_ids out of range on tensor-parallel {_ranks(faulty)} of {len(table)}"
                  + (f"; this rank's error: {error}" if error is not None else ""))
        raise checks.argument_error(ValueError, plan.fn_name, "token_loss", detail) from error
    if any(row != table[0] for row in table):
        raise checks.argument_error(
            ValueError, plan.fn_name, "token_loss",
            f"the ranks cut different sequence blocks (token_loss.seq_ids, or its loss_mask, differ across the "
            f"{len(table)} tensor-parallel ranks): every rank must hold the same loss")


def _frozen(hidden, weight, tokens, row_mask, plan: Plan, token_loss, keep):
    """A loss whose token's gradient reads other rows (scope "sequence": ppo_ops.sequence_losses; "batch":
    ppo_ops.entropy_mask): the statistics pass (this forward without gradients: every scored row's log-prob and
    entropy, from the same blocks) and the loss frozen at them (`token_loss.freeze`: a row-separable TokenLoss with
    its exact value and gradient there), which the gradient pass then evaluates block by block like any TokenLoss.
    One more forward GEMM pass: the general head's cost."""
    if getattr(token_loss, "needs_entropy_statistics", False) and plan.entropy_mode == "none":
        raise checks.argument_error(ValueError, plan.fn_name, "entropy",
                                    "this token_loss reads every token's entropy (a batch statistic): pass "
                                    'entropy="value" or "grad"')
    stats_plan = dataclasses.replace(plan, needs_grad=False)
    _, log_prob, ent, _, _ = forward_values(hidden, weight, tokens, row_mask, stats_plan, _no_loss, keep,
                                            need_dx=False, need_dw=False)
    return token_loss.freeze(log_prob, None if row_mask is None else row_mask.reshape(-1),
                             ent if ent.numel() else None)


def _no_loss(log_probs, entropy, rows):
    return torch.zeros_like(log_probs)


class BlockLoop:
    """One forward's row blocks, seen from the Function: the outputs they fill, the value checks' flags and end
    read, this rank's failure of token_loss, and the backend's hooks (core/contracts.py, LossHooks) as methods.
    Rows r0 .. r1 are indices into the kept rows."""

    def __init__(self, plan: Plan, token_loss, hidden, tokens, row_mask, rows: Optional[torch.Tensor], *,
                 n_kept: int, need_dx: bool, need_grad: bool, keep: Optional[sparse_keep.SparseKeep] = None,
                 head: Optional[HeadRows] = None, blocks: Optional[sequence_blocks.SequenceBlocks] = None):
        device = hidden.device
        self.plan, self.token_loss = plan, token_loss
        self.tokens, self.row_mask, self.rows = tokens, row_mask, rows  # the call's (all T rows), the kept indices
        self.n_kept, self.need_grad = n_kept, need_grad
        self.row_ids = rows if rows is not None else torch.arange(n_kept, device=device)
        self.with_entropy = plan.entropy_mode != "none"
        self.log_prob = torch.zeros(n_kept, dtype=torch.float32, device=device)
        self.entropy = torch.zeros(n_kept, dtype=torch.float32, device=device) if self.with_entropy else None
        self.loss = torch.zeros((), dtype=torch.float32, device=device)
        self.flags = torch.zeros(3, dtype=torch.int64, device=device)  # _BAD_LOGITS, _NON_FINITE, _FAILURE
        # With validate, each block's bad-logit rows and its loss values and gradients (0 where absent), checked once
        # after the last block: a copy per block instead of a reduction and a flag update per block and tensor.
        self.bad_rows = torch.zeros(n_kept, dtype=torch.bool, device=device) if plan.validate else None
        self.returned = torch.zeros((3, n_kept), dtype=torch.float32, device=device) if plan.validate else None
        self.dx = None
        if need_dx:  # dropped rows keep zeros; without a row mask every row is written
            self.dx = (torch.zeros if rows is not None else torch.empty)(hidden.shape, dtype=hidden.dtype,
                                                                         device=device)
        self.headers_done = plan.layout.group is None or not plan.validate
        # TP > 1 with validate: a failure of token_loss on this rank is kept until every rank knows of it (finish).
        self.collective_failure = plan.layout.group is not None and plan.validate
        self.failure: Optional[BaseException] = None
        self.end_read: Optional[agreement.HostRead] = None
        self.keep, self.head = keep, head  # the sparse keep set and the kept rows' operands it is formed from
        self.keep_state: Optional[sparse_keep.KeepState] = None  # formed in the first merge
        self.keep_coef: Optional[torch.Tensor] = None  # the current block's keep term per entry, or None
        self.blocks = blocks  # the sequence schedule's cut, or None: blocks of fixed steps

    # ---- the backend's hooks ----

    def row_blocks(self, n_rows: int, block_rows: int) -> list:
        """(r0, r1) of each row block: the sequence schedule's cut where there is one (made for these block rows),
        else steps of block_rows."""
        if self.blocks is not None:
            assert self.blocks.bounds[-1][1] == n_rows and all(r1 - r0 <= block_rows for r0, r1 in self.blocks.bounds)
            return list(self.blocks.bounds)
        return [(r0, min(n_rows, r0 + block_rows)) for r0 in range(0, n_rows, block_rows)]

    def headers(self) -> None:
        """The call's header exchange (TP > 1 with validate), once, before a backend's first collective: for a
        backend that merges its blocks' statistics itself (SGLang's order) rather than through `merge`."""
        if not self.headers_done:
            shell.check_across_ranks(self.plan, self.tokens, self.row_mask,
                                     torch.zeros((), dtype=torch.bool, device=self.loss.device), keep=self.keep)
            self.headers_done = True

    def merge(self, partials: torch.Tensor) -> RowStats:
        """[local segments, 5, n] partials -> the block's global RowStats (the header exchange before the first)."""
        stats = shell.merge_row_stats(self.plan, partials, self.tokens, self.row_mask,
                                      validate=not self.headers_done, keep=self.keep)
        self.headers_done = True
        if self.keep is not None and self.keep_state is None:  # after the header exchange: every rank, once
            h = self.head
            self.keep_state, _ = sparse_keep.lm_head_forward(self.keep, h.hidden, h.weight, h.tokens, self.rows,
                                                             self.plan, self.log_prob)
        return stats

    def block_grads(self, stats: RowStats, r0: int, r1: int) -> BlockGrads:
        """The caller's loss on the block: its values summed into the loss, its gradients for dlogits."""
        log_prob = stats.log_prob
        if self.keep_state is not None:  # the keep rows' log-probs, renormalised over their keep sets
            log_prob = sparse_keep.replace_log_probs(log_prob, self.keep_state, r0, r1)
        self.log_prob[r0:r1] = log_prob
        ent = None
        if self.with_entropy:
            self.entropy[r0:r1] = stats.entropy
            ent = stats.entropy
        value, g_lp, g_ent = self._loss_of_block(log_prob, ent, self.row_ids[r0:r1])
        self.loss.add_(value.sum())
        if self.plan.validate:
            self.bad_rows[r0:r1] = stats.bad_input
            for i, t in enumerate((value, g_lp, g_ent)):
                if t is not None:
                    self.returned[i, r0:r1] = t
            if r1 == self.n_kept:
                self.flags[_BAD_LOGITS] |= self.bad_rows.any()
                self.flags[_NON_FINITE] |= ~torch.isfinite(self.returned).all()
                self.end_read = self._start_end_read()
        self.keep_coef = None
        if self.keep_state is not None and g_lp is not None:
            # the keep rows' term, added into the block's dlogits (keep_dlogits); 0 on them for the full vocabulary
            self.keep_coef = sparse_keep.coefficients(self.keep_state, g_lp, r0, r1)
            g_lp = sparse_keep.dense_grad(g_lp, self.keep_state, r0, r1)
        # No gradient where the quantity has none (log-prob -inf: no mass in its set; entropy of an empty row).
        if g_lp is not None:
            g_lp = torch.where(stats.log_prob_defined, g_lp, 0.0).contiguous()
        if g_ent is not None:
            g_ent = torch.where(stats.row_has_mass, g_ent, 0.0).contiguous()
        return BlockGrads(g_lp, g_ent, keep_term=self.keep_coef is not None)

    def keep_dlogits(self, dl: torch.Tensor, r0: int, c0: int) -> None:
        """Adds the current block's keep term into `dl` [n, cols] (rows r0.. of the kept rows, local columns c0..), a
        block x segment of its dlogits, before the dX / dW GEMMs read it; nothing without a keep set."""
        if self.keep_coef is not None:
            sparse_keep.add_to_dlogits(self.keep_state, self.keep_coef, dl, r0, c0)

    def finish_dx(self, dx32: torch.Tensor, r0: int, r1: int) -> None:
        """The block's fp32 dX rows of this rank: reduced over the ranks (reduce_dx), rounded once, stored."""
        layout = self.plan.layout
        if self.plan.reduce_dx and layout.group is not None:
            dist.all_reduce(dx32, group=layout.group)  # fp32: one rounding to the input dtype, after the sum
        if self.rows is None:
            self.dx[r0:r1].copy_(dx32)
        else:
            self.dx.index_copy_(0, self.rows[r0:r1], dx32.to(self.dx.dtype))

    # ---- the end of the forward ----

    def finish(self) -> None:
        """After the last block: a rank without kept rows still takes part in the header exchange; then the value
        checks' read (started by the last block where there was one) and their errors, on every rank together."""
        plan = self.plan
        if not self.headers_done:
            shell.check_across_ranks(plan, self.tokens, self.row_mask,
                                     torch.zeros((), dtype=torch.bool, device=self.loss.device), keep=self.keep)
        if plan.validate:
            self._raise_end(self.end_read if self.end_read is not None else self._start_end_read())

    def _start_end_read(self) -> agreement.HostRead:
        """The value checks' one host read, started: at TP = 1 the logits op's values (token range, NaN / +inf
        logits) with the loss's flags; at TP > 1 every rank's flags, all-gathered (the same table on every rank)."""
        layout = self.plan.layout
        if layout.group is None:  # then the keep set's values (checked in the header exchange at TP > 1)
            extra = torch.cat([self.flags[_NON_FINITE:], sparse_keep.header_values(self.keep, self.flags.device)])
            return agreement.HostRead(agreement.single_rank_values(
                self.flags[_BAD_LOGITS:_BAD_LOGITS + 1], self.tokens, self.row_mask, extra_flags=extra,
                row_inv_temperature=self.plan.shard.row_inv_temperature))
        table = torch.empty((layout.world_size * self.flags.numel(),), dtype=torch.int64, device=self.flags.device)
        agreement.all_gather_into(table, self.flags, layout.group)  # rank-major: [tp, 3] when read
        return agreement.HostRead(table)

    def _raise_end(self, read: agreement.HostRead) -> None:
        """Waits for the value checks' read and raises on it; every rank decides from the same table."""
        plan = self.plan
        fn, layout = plan.fn_name, plan.layout
        if layout.group is None:
            bad_loss, _, *keep_values = agreement.raise_single_rank_values(fn, read.values(), self.row_mask,
                                                                           layout.vocab_size, naming=plan.naming)
            keep_error = sparse_keep.value_error(fn, keep_values, layout.vocab_size)
            if keep_error is not None:
                raise keep_error
            table = [[0, bad_loss, 0]]
            where = ""
        else:
            table = [list(row) for row in zip(*[iter(read.values())] * self.flags.numel())]
            where = f" (merged over the {layout.world_size} tensor-parallel ranks)"
        mine = self.failure
        if any(row[_BAD_LOGITS] for row in table):
            raise checks.argument_error(ValueError, fn, plan.naming.bad_logits_argument,
                                        plan.naming.bad_logits.format(where=where)) from mine
        failed = [r for r, row in enumerate(table) if row[_FAILURE]]
        if failed:
            raise _collective_failure(fn, table, failed, mine) from mine
        non_finite = [r for r, row in enumerate(table) if row[_NON_FINITE]]
        if non_finite:
            at = (f" on tensor-parallel {_ranks(non_finite)} of {len(table)}" if layout.group is not None else "")
            raise checks.argument_error(
                ValueError, fn, "token_loss",
                f"token_loss returned a non-finite value or gradient (NaN or inf) on some row{at}; check the loss's "
                "inputs (e.g. ratios exp(log_prob - old_log_prob) overflowing) or pass validate=False to skip this "
                "check")

    # ---- the caller's loss ----

    def _loss_of_block(self, log_prob, entropy, rows):
        """(values, g_lp, g_ent) of the caller's loss on a block. TP > 1 with validate: a failure is kept (the first
        one) and the block, like every later one, gets zero values and gradients, so this rank goes on through the
        collectives; elsewhere it raises here."""
        need_grad, entropy_grad = self.need_grad, self.plan.entropy_mode == "grad"
        if not self.collective_failure:
            return _call_loss(self.plan.fn_name, self.token_loss, log_prob, entropy, rows, need_grad=need_grad,
                              entropy_grad=entropy_grad)
        if self.failure is None:
            try:
                return _call_loss(self.plan.fn_name, self.token_loss, log_prob, entropy, rows, need_grad=need_grad,
                                  entropy_grad=entropy_grad)
            except Exception as exc:  # noqa: BLE001 - any failure of the caller's code is reported collectively
                self.failure = exc
                self.flags[_FAILURE] = 1 + _failure_kind(exc)
        zeros = torch.zeros_like(log_prob)
        g_ent = zeros if (need_grad and entropy_grad and entropy is not None) else None
        return zeros, (zeros if need_grad else None), g_ent


def _failure_kind(exc: BaseException) -> int:
    """Index into FAILURES: the op's own checks of the return (TypeError / ValueError naming token_loss), or the
    caller's exception."""
    if getattr(exc, "ppo_ops_argument", None) == "token_loss":
        return 1 if isinstance(exc, TypeError) else 2
    return 0


def _ranks(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _collective_failure(fn: str, table, failed, mine: Optional[BaseException]) -> Exception:
    """The one error every rank raises when token_loss failed on some rank(s): the type of the first faulty rank's
    kind of failure, naming every faulty rank and what it saw; the faulty rank adds its own error."""
    world = len(table)
    kinds = [table[r][_FAILURE] - 1 for r in failed]
    what = "; ".join(f"rank {r}: token_loss {FAILURES[k][0]}" for r, k in zip(failed, kinds))
    if mine is not None:
        detail = f" This rank's error: {type(mine).__name__}: {mine}"
    else:
        detail = f" See {_ranks(failed)}'s own error for the details."
    return checks.argument_error(
        FAILURES[kinds[0]][1], fn, "token_loss",
        f"token_loss failed on tensor-parallel {_ranks(failed)} of {world} ({what}); every rank raises this error "
        f"(the ranks went on to the end of the forward with zero gradients, so none waits in a collective).{detail}")


def _call_loss(fn_name, token_loss, log_prob, entropy, rows, *, need_grad, entropy_grad):
    """(values [n] fp32, d sum / d log_prob or None, d sum / d entropy or None) of the caller's loss on a block:
    ppo_ops' own losses (token_losses.TokenLoss) in their closed form, autograd's bits without its graph (the host
    time of a block's graph and backward is what many row blocks add up to), and a SequenceLoss on a block of whole
    sequences (its value_and_grad: the rest in closed form, the sequence terms by autograd over the block's rows);
    any other closure through autograd."""
    if need_grad and isinstance(token_loss, (token_losses.TokenLoss, sequence_losses.SequenceLoss)):
        return token_loss.value_and_grad(log_prob, entropy, rows, entropy_grad=entropy_grad)
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
