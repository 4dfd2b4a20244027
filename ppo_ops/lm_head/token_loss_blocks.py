"""The token loss's blocks (linear_token_loss, lm_head/loss_function.py): the segment-GEMM backend's
`loss_forward`, which forms every logit once and the caller's loss's gradient in the forward.

Per block: the block's logits over every local segment -> their partials -> `hooks.merge` (TP all-gather,
fixed-order merge) -> `hooks.block_grads` (the caller's loss: upstream gradients of the block's log-probs and
entropies) -> dlogits in the input dtype -> dX rows (fp32 over the local segments, `hooks.finish_dx` reduces and
rounds them once) and dW; a sparse keep set's term goes into each block x segment of dlogits before those GEMMs
(`hooks.keep_dlogits`). The blocks are `hooks.row_blocks`: steps of the path's block rows, or for a sequence-scope
loss the same at most cut at sequence ends (lm_head/sequence_blocks.py); a block's log-probs and entropies do not
depend on where it starts or ends (each row's GEMM row and passes are its own). The path and its block rows are
lm_head/paths.py's `head_path` (the caller passes it):

    loss_one_block, loss_blocks (the Triton passes, half precision, TMA-aligned rows): the general op's one-GEMM
        forward also stores every logit as e^(z - tile max) in fp16 into a segment-major [n_seg, buffer_rows,
        seg_len] buffer, vocabulary-major in memory (dW's GEMMs then read dl^T K-major; gemm_partials.forward_probs),
        and prob_dlogits.py turns it into dlogits in place. loss_one_block where every row fits the allowance
        (paths.one_loss_block; the caller's working_memory, else paths.TOKEN_LOSS_BYTES): dW_s = dl_s^T X is then one
        GEMM per segment (K = T), finished in the forward in the input dtype; else loss_blocks, of
        paths.loss_block_rows rows (a function of H, the segment length and the allowance only: the same on every
        rank) beside an fp32 dW accumulator. Log-probs and entropies are the general op's, bit for bit; dlogits carry
        e's fp16 rounding (2^-11 of their terms) before their own to the input dtype. No gradient asked: the same
        blocks through the forward without the store (the same loss sum), nothing held.
    loss_chunk_blocks (otherwise): blocks of loss_block_rows rows whose fp32 logits over every local segment are
        held, the logits op's partials and gradient passes; dW accumulated in fp32 every loss_group_rows rows.
        Log-probs and entropies are the logits op's on those logits, bit for bit.

dW's fp32 accumulator [V_local, H] is returned as it is: the Function rounds it once in backward, together with the
upstream scale and in place (core/scale.py). A finished dW (one block) keeps the storage it was written into (the
block's own, from 2 H rows on) until released.

Memory (besides dX and dW): one-GEMM blocks, 2 bytes per logit of a block (plus, for one block, one segment's dW
temporary); chunk blocks, the block's fp32 logits (loss_block_rows x V_local) and its dlogits (loss_group_rows x
V_local in the input dtype); the fp32 dX rows of one block; the fp32 dW accumulator where there is one. Measured
sizes and times: docs/performance.md, "The fused LM head".
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ppo_ops.core import row_stats
from ppo_ops.core.contracts import BackwardStats, GradsWanted, HeadRows, LossHooks, UpstreamGrads
from ppo_ops.lm_head import gemms, paths
from ppo_ops.lm_head.paths import Path


def loss_forward(passes, path: paths.HeadPath, head: HeadRows, with_entropy: bool, hooks: LossHooks,
                 wanted: GradsWanted) -> Optional[torch.Tensor]:
    """The backend's loss_forward (core/contracts.py, FusedLossBackend) over `passes` (segment_gemms' Triton or
    torch passes) on `path` (paths.head_path's, a token loss's): the one-GEMM blocks or the chunk blocks."""
    hidden, weight, shard = head.hidden, head.weight, head.shard
    need_dx, need_dw = wanted.dx, wanted.dw
    n_rows, width = hidden.shape
    v_local = weight.shape[0]
    segments = list(gemms.segments(shard, v_local))
    if n_rows == 0:
        return torch.zeros((v_local, width), dtype=torch.float32, device=hidden.device) if need_dw else None
    head = HeadRows(hidden, weight, head.tokens.to(torch.int64).contiguous(), shard)
    if path.path in paths.PROB_PATHS:
        return _blocks_by_probs(passes, path, head, with_entropy, hooks, wanted)
    dw_acc = _accumulator(weight, segments) if need_dw else None
    grads = _Gradients(weight, segments, hooks, dw_acc, need_dx)
    _blocks_by_chunks(passes, path, head, with_entropy, hooks, grads)
    return dw_acc


def keeps_probs(passes, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the token loss on these kept rows and weight takes the one-GEMM blocks (fp16 probabilities), over
    segment_gemms' `passes` (paths.one_gemm_applies, head_path's condition for loss_one_block and loss_blocks)."""
    return paths.one_gemm_applies(passes.name, hidden, weight)


def _blocks_by_probs(passes, path: paths.HeadPath, head: HeadRows, with_entropy: bool, hooks: LossHooks,
                     wanted: GradsWanted) -> Optional[torch.Tensor]:
    """loss_one_block, loss_blocks: the forward GEMM keeps each logit as an fp16 probability within its tile, the
    pass turns them into dlogits in place (2 bytes per logit). Returns dW: finished, in the input dtype, on
    loss_one_block; else its fp32 accumulator."""
    hidden, weight, tokens, shard = head.hidden, head.weight, head.tokens, head.shard
    need_dx, need_dw = wanted.dx, wanted.dw
    n_rows, width = hidden.shape
    v_local, seg_len = weight.shape[0], shard.seg_len
    n_seg = v_local // seg_len
    segments = list(gemms.segments(shard, v_local))
    rows, buffer_rows, one = path.block_rows, path.buffer_rows, path.path is Path.LOSS_ONE_BLOCK
    forward = passes.one_gemm_forward
    bounds = hooks.row_blocks(n_rows, rows)
    if not (need_dx or need_dw):  # values only: the same blocks (the same loss sum), no probabilities kept
        for r0, r1 in bounds:
            rs = slice(r0, r1)
            hooks.block_grads(hooks.merge(forward.forward_partials(hidden[rs], weight, tokens[rs], shard.rows(rs),
                                                                   with_entropy)), rs.start, rs.stop)
        return None
    # vocabulary-major ([n_seg, seg_len, B] in memory, used as its [n_seg, B, seg_len] view): dW's GEMMs read
    # their dl^T operand K-major, which cuBLAS runs faster than the row-major buffer, with the same bits for dX
    # and dW (docs/performance.md)
    storage = torch.empty(n_seg * seg_len * buffer_rows, dtype=torch.float16, device=hidden.device)
    probs = storage.view(n_seg, seg_len, buffer_rows).transpose(1, 2)
    dw = None
    if need_dw and one:
        dw = (storage.view(hidden.dtype)[:v_local * width].view(v_local, width) if paths.dw_in_probs(buffer_rows, width)
              else torch.empty((v_local, width), dtype=hidden.dtype, device=hidden.device))
    elif need_dw:
        dw = _accumulator(weight, segments)
    grads = _Gradients(weight, segments, hooks, dw, need_dx, finished=one)
    for r0, r1 in bounds:
        n = r1 - r0
        rs = slice(r0, r1)
        x = hidden[rs]
        parts, tiles = forward.forward_probs(x, weight, tokens[rs], shard.rows(rs), with_entropy, probs)
        stats = hooks.merge(parts)
        up = hooks.block_grads(stats, r0, r0 + n)
        g_lp, g_ent = up.grad_log_prob, up.grad_entropy
        # the GEMMs run on n_gemm rows, those above n zero (dl's rows are its contiguous dimension:
        # gemms.GEMM_ROW_MULTIPLE)
        n_gemm = gemms.gemm_rows(n)
        if g_lp is None and g_ent is None:  # the loss does not depend on these rows: zero gradient
            dl = probs.view(hidden.dtype)
            dl[:, :n_gemm].zero_()
        else:
            dl = passes.prob_pass.dlogits(
                probs, tiles, n, x, weight, tokens[rs], shard.rows(rs),
                BackwardStats(stats.shift, stats.log_sum, None, stats.mean_shifted if g_ent is not None else None),
                UpstreamGrads(g_lp, g_ent), hidden.dtype)
            if passes.prob_pass.access_rows(n, probs, probs) < n_gemm:  # the pass zeroes the rows it covers
                dl[:, n:n_gemm].zero_()
        if up.keep_term:
            _add_keep_term(hooks, dl, r0, n, segments)
        if n_gemm > n:
            x = gemms.gemm_operand_rows(x, n_gemm)
        grads.add_block(dl, r0, n, x, n_gemm)
    return dw


def _blocks_by_chunks(passes, path: paths.HeadPath, head: HeadRows, with_entropy: bool, hooks: LossHooks,
                      grads: "_Gradients") -> None:
    """loss_chunk_blocks: per block of at most path.block_rows rows (hooks.row_blocks) its fp32 logits over every
    local segment (a chunk GEMM per segment, on block_rows rows whatever the block's), the logits op's partials and
    gradient passes; dW per group of consecutive blocks that fills at most path.group_rows rows (with blocks of
    block_rows rows: every group_rows rows)."""
    hidden, weight, tokens, shard = head.hidden, head.weight, head.tokens, head.shard
    need_grad = grads.need_dx or grads.dw is not None
    n_rows = hidden.shape[0]
    v_local, seg_len = weight.shape[0], shard.seg_len
    n_seg = v_local // seg_len
    block_rows, group_stride = path.block_rows, path.group_rows
    device = hidden.device
    bounds = hooks.row_blocks(n_rows, block_rows)
    blocks = gemms.RowBlocks(hidden, block_rows)
    logits = torch.empty((n_seg, block_rows, seg_len), dtype=torch.float32, device=device)
    parts = torch.empty((n_seg, row_stats.NUM_PARTIALS, block_rows), dtype=torch.float32, device=device)
    group_rows = min(group_stride, len(bounds) * block_rows)
    dl = torch.empty((n_seg, group_rows, seg_len), dtype=hidden.dtype, device=device) if need_grad else None
    for s, _seg_lo, seg in grads.segments:
        if seg.n_valid == 0:
            gemms.neutral_partials(parts[s])
    g0 = offset = 0  # the dlogits group: rows g0 .. g0 + offset of the kept rows, in dl[:, :offset]
    for b, (r0, r1) in enumerate(bounds):
        r0, n, x = blocks.span(r0, r1 - r0)
        rs = slice(r0, r0 + n)
        for s, seg_lo, seg in grads.segments:
            if seg.n_valid:
                gemms.mm_fp32(x, weight[seg_lo:seg_lo + seg_len].T, logits[s])
                passes.partials(logits[s], n, tokens[rs], seg.rows(rs), with_entropy, parts[s])
        stats = hooks.merge(parts[:, :, :n])
        up = hooks.block_grads(stats, r0, r0 + n)
        if not need_grad:
            continue
        g_lp, g_ent = up.grad_log_prob, up.grad_entropy
        if offset + n > group_rows:  # the group is full: its dW, then a new group from this block
            grads.add_dw(dl, offset, hidden[g0:g0 + offset])
            g0, offset = r0, 0
        if g_lp is None and g_ent is None:  # the loss does not depend on these rows: zero gradient
            dl[:, offset:offset + n].zero_()
        else:
            for s, _seg_lo, seg in grads.segments:
                if seg.n_valid:
                    passes.dlogits(logits[s], n, tokens[rs], seg.rows(rs),
                                        BackwardStats(stats.shift, stats.log_sum, None,
                                                      stats.mean_shifted if g_ent is not None else None),
                                        UpstreamGrads(g_lp, g_ent), dl[s, offset:offset + n])
        if up.keep_term:
            _add_keep_term(hooks, dl[:, offset:offset + n], r0, n, grads.segments)
        grads.add_dx(dl[:, offset:offset + n], r0, n)
        offset += n
        if offset == group_rows or b + 1 == len(bounds):
            grads.add_dw(dl, offset, hidden[g0:g0 + offset])
            g0, offset = r0 + n, 0


def _add_keep_term(hooks: LossHooks, dl, r0: int, n: int, segments) -> None:
    """A sparse keep set's term into the block's dlogits [n_seg, >= n, seg_len], segment by segment, before its dX
    and dW GEMMs read them (hooks.keep_dlogits: nothing without a keep set)."""
    for s, seg_lo, seg in segments:
        if seg.n_valid:
            hooks.keep_dlogits(dl[s, :n], r0, seg_lo)


def _accumulator(weight, segments) -> torch.Tensor:
    """dW's fp32 accumulator [V_local, H]: a segment's first GEMM writes it; padding segments are zero."""
    acc = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    seg_len = weight.shape[0] // len(segments)
    for _s, seg_lo, seg in segments:
        if seg.n_valid == 0:
            acc[seg_lo:seg_lo + seg_len].zero_()  # padding only: no gradient
    return acc


class _Gradients:
    """The token loss's dX and dW from a block's dlogits [n_seg, >= n, seg_len] (the input dtype): dX rows in fp32
    over the local segments in order, one rounding (hooks.finish_dx); dW either accumulated, dW_s (+)= dl_s^T X into
    the fp32 accumulator (a segment's first GEMM writing it: no memset, no read of C), or, `finished` (every row one
    block), dW_s = dl_s^T X written once in the input dtype, possibly into the dlogits' own storage.

    On CUDA a block's dW GEMMs run on a side stream beside its dX GEMMs (both only read dl), so dW's traffic
    overlaps dX's mainloop. The current stream waits for the
    side one before the next block overwrites dl. Where dW lies in dl's storage, segment s's dW GEMM first waits for
    the dX GEMMs of the segments it overwrites (events on the current stream). Each GEMM's inputs, shape and
    algorithm are the same wherever its output lies, so are its bits."""

    def __init__(self, weight, segments, hooks: LossHooks, dw, need_dx: bool, finished: bool = False):
        self.weight, self.segments, self.hooks, self.dw = weight, segments, hooks, dw
        self.seg_len = weight.shape[0] // len(segments)
        # (segment, its weight rows, its dW rows) of the segments with real columns: views made once, not per block
        self.live = [(s, weight[lo:lo + self.seg_len], None if dw is None else dw[lo:lo + self.seg_len])
                     for s, lo, seg in segments if seg.n_valid]
        self.need_dx, self.finished = need_dx, finished
        self.dx_block = None  # fp32 [rows, H], allocated for the first (largest) block
        self.started = [False] * len(segments)
        both = need_dx and dw is not None and weight.is_cuda
        self.side = torch.cuda.Stream(device=weight.device) if both else None

    def add_block(self, dl, r0: int, n: int, x, n_gemm: int) -> None:
        """A block's n rows; its GEMMs run on n_gemm >= n rows (dl's and x's rows above n zero)."""
        if self.finished:
            self._add_finished(dl, r0, n, x, n_gemm)
            return
        if self.side is None:
            self.add_dx(dl, r0, n, n_gemm)
            self.add_dw(dl, n_gemm, x)
            return
        main = torch.cuda.current_stream(self.weight.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            self.add_dw(dl, n_gemm, x)
        self.add_dx(dl, r0, n, n_gemm)
        main.wait_stream(self.side)

    def _dx_rows(self, n: int) -> torch.Tensor:
        if self.dx_block is None or self.dx_block.shape[0] < n:
            self.dx_block = torch.empty((n, self.weight.shape[1]), dtype=torch.float32, device=self.weight.device)
        return self.dx_block[:n]

    def _dx_segment(self, out, dl_s, w_s, first: bool) -> None:
        if first:
            gemms.mm_fp32(dl_s, w_s, out)
        else:
            gemms.addmm_fp32(out, dl_s, w_s)

    def add_dx(self, dl, r0: int, n: int, n_gemm: Optional[int] = None) -> None:
        """dX of the block's n rows, its GEMMs on n_gemm (default n) rows."""
        if not self.need_dx:
            return
        n_gemm = n if n_gemm is None else n_gemm
        out = self._dx_rows(n_gemm)
        rows = dl[:, :n_gemm].unbind(0)
        for i, (s, w_s, _dw_s) in enumerate(self.live):
            self._dx_segment(out, rows[s], w_s, first=i == 0)
        if not self.live:
            out.zero_()
        self.hooks.finish_dx(out[:n], r0, r0 + n)

    def add_dw(self, dl, m: int, x) -> None:
        """dW_s (+)= dl[s, :m]^T @ x (x: the m rows of hidden)."""
        if self.dw is None:
            return
        rows = dl[:, :m].transpose(1, 2).unbind(0)
        for s, _w_s, acc in self.live:
            if self.started[s]:
                gemms.addmm_fp32(acc, rows[s], x)
            else:
                gemms.mm_fp32(rows[s], x, acc)
                self.started[s] = True

    def _add_finished(self, dl, r0: int, n: int, x, n_gemm: int) -> None:
        """The one block: per segment dX_s (current stream) and dW_s = dl_s^T x in the input dtype (side stream)."""
        dw, seg_len = self.dw, self.seg_len
        shared = dw is not None and dw.untyped_storage().data_ptr() == dl.untyped_storage().data_ptr()
        slab = dl.stride(0)  # elements per segment of dl's storage
        main = torch.cuda.current_stream(self.weight.device) if self.side is not None else None
        if main is not None:
            self.side.wait_stream(main)
        out = self._dx_rows(n_gemm) if self.need_dx else None
        read = {}  # segment -> event after its dX GEMM (the side stream)
        late = []  # (dW rows, temporary): dW rows over dlogits not read yet when their GEMM ran
        for i, (s, w_s, target) in enumerate(self.live):
            if out is not None:
                self._dx_segment(out, dl[s, :n_gemm], w_s, first=i == 0)
                if main is not None:
                    read[s] = torch.cuda.Event()
                    read[s].record(main)
            if dw is None:
                continue
            # the highest segment of dl whose storage these dW rows cover (-1: none)
            covers = ((s + 1) * seg_len * dw.shape[1] - 1) // slab if shared else -1
            if covers >= s:  # over dlogits not read yet (the first segment's own): a temporary, copied in below
                late.append((target, torch.empty_like(target)))  # allocated on the current stream
                target, covers = late[-1][1], -1
            with torch.cuda.stream(self.side) if main is not None else contextlib.nullcontext():
                waits = [k for k in read if k <= covers]
                if main is not None and waits:
                    self.side.wait_event(read[max(waits)])  # dX has read every segment these rows cover
                gemms.mm_rounded(dl[s, :n_gemm].T, x, target)
        if out is not None:
            if not self.live:
                out.zero_()
            self.hooks.finish_dx(out[:n], r0, r0 + n)
        if main is not None:
            main.wait_stream(self.side)
        for target, temp in late:  # every dlogit read by now
            target.copy_(temp)
        if dw is not None:
            for _s, seg_lo, seg in self.segments:
                if seg.n_valid == 0:
                    dw[seg_lo:seg_lo + seg_len].zero_()  # padding only: no gradient
