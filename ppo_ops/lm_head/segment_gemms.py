"""The segment-GEMM backend of the fused LM head: every GEMM over the fixed vocabulary segments, with the softmax
statistics formed in GEMM epilogues or by the logits op's passes over bounded chunks.

Runs every bf16 / fp16 call of linear_log_probs_and_entropy under triton and every call of linear_token_loss (whose
blocks are lm_head/token_loss_blocks.py). Implements `LinearBackend` and `FusedLossBackend` (core/contracts.py) over
one of two sets of passes: "triton" (CUDA; or CPU under TRITON_INTERPRET=1) and "torch" (the logits op's PyTorch
code). Which path a call takes, and the row counts that size it, is lm_head/paths.py's `head_path` (the words block,
chunk, group, segment and held rows are defined there); each method here asks it and follows the answer:
    one_gemm, one_gemm_held (the Triton passes on half precision, rows and weight TMA-aligned): the forward is one
        Triton GEMM whose epilogue reduces each logit tile to the five partials (gemm_partials.py), so no logit
        reaches memory; the backward's dlogits come from the same GEMM tiles again with the gradient in the
        epilogue (gemm_dlogits.py), or, for the held rows, from probabilities the forward held (below).
    chunk_gemms (otherwise): the library's GEMM (cuBLAS with fp32 accumulation on CUDA; an fp32 matmul of the upcast
        operands elsewhere, whose products are exact) writes an fp32 chunk [block_rows, seg_len] with one shape for
        every block, segment, rank, TP size and row count, and the logits op's forward or gradient pass reads it.
dX and dW are always library GEMMs on the dlogits of a group: dX32 += dl @ W_s (fp32 accumulator, K = seg_len) and
dW_s (+)= dl^T @ X (K = group_rows; one group: written once in the input dtype). gemms.py holds these pieces.

Invariance, and what it rests on. A row's logit depends on its row of X, its column of W and a K order fixed by the
GEMM's shape (one shape per path), never on the other rows, the rank or the TP size; segments start at global
columns; blocks and weight segments start at multiples of 16 bytes whenever H * itemsize is. The partials and
their merge are the logits op's (TP-invariant by construction). Hence log-probs, entropies and dW (segment-relative
GEMM shapes) are bitwise identical across TP sizes and row counts (a row mask that moves rows included); dX sums a
rank's segments, then the ranks: deterministic, within fp32 rounding of TP = 1. On chunk_gemms the values equal
log_probs_and_entropy(gemms.tile_logits(...)) bit for bit; on the one-GEMM paths they equal the logits op's within
fp32 reduction order (the epilogue reduces over GEMM tiles).

Held rows (one_gemm_held). A forward that a backward follows (forward_for_backward) also stores the held rows'
logits as fp16 probabilities e^(z - tile max) within their tiles (paths.held_rows: at most the call's
working_memory, default paths.HELD_BYTES, at the global vocabulary; in as many groups as they reach), whose dlogits
the backward then forms, group by group, in a memory-bound pass (prob_dlogits.py) instead of a second GEMM; those
dlogits carry that fp16 rounding (2^-11 of their terms) before their own rounding to the input dtype. The held rows
run in a launch of their own, so the other rows' partials are those of the forward without a store, bit for bit,
in any grad mode.

Memory (besides dX and dW): forward, one fp32 chunk on chunk_gemms (block_rows x seg_len), none on the one-GEMM
paths (tile partials: 12 bytes per row and 256 columns), plus the held probabilities until the backward (2 bytes per
logit of the held rows); backward, one chunk (none on the one-GEMM paths), a dlogits buffer (group_rows x seg_len
in the input dtype), with more than one group a segment's fp32 dW accumulator (seg_len x H), and the fp32 dX
accumulator [R, H]. Measured sizes and times: docs/performance.md, "The fused LM head".
"""

from __future__ import annotations

from typing import Optional

import torch

from ppo_ops.core import row_stats
from ppo_ops.core.contracts import (BackwardStats, GradsWanted, HeadRows, HeldProbs, LinearSaved, LossHooks,
                                    RowInputs, RowStats, ShardOptions, UpstreamGrads)
from ppo_ops.core.triton_launch import launcher  # fewer host steps per launch
from ppo_ops.lm_head import gemms, paths, token_loss_blocks
from ppo_ops.lm_head.gemms import RowBlocks, gemm_operand_rows, gemm_rows, neutral_partials, rows_of, segments
from ppo_ops.lm_head.paths import Path, held_rows, round_up

# held_rows: kept reachable here for the callers that count the held rows through this module (paths.held_rows).
__all__ = ["SegmentGemmBackend", "backend", "backward_rows", "held_rows"]


# ---- the passes over a chunk: the logits op's kernels (Triton) or code (PyTorch) ----

class _TritonPasses:
    """The logits op's Triton kernels on one fp32 chunk [B, seg_len], launched on its first n rows."""

    name = "triton"

    def __init__(self):
        # imported when selected: triton may be absent
        from ppo_ops.core import triton_common
        from ppo_ops.lm_head import gemm_dlogits, gemm_partials, prob_dlogits
        from ppo_ops.logits import triton_backend, triton_kernels

        self._tb, self._tk, self._tc = triton_backend, triton_kernels, triton_common
        self.one_gemm_forward = gemm_partials  # the one-GEMM paths' forward
        self.one_gemm_recompute = gemm_dlogits  # their backward's logits + dlogits
        self.prob_pass = prob_dlogits  # dlogits from the probabilities a one-GEMM forward held

    def merge(self, partials: torch.Tensor, has_keep_mask: bool) -> RowStats:
        return self._tb.merge_partials(partials, has_keep_mask)

    def partials(self, chunk, n, tokens, seg, with_entropy, out) -> None:
        """out [5, B] fp32 (rows >= n untouched): the segment partials of the chunk's first n rows."""
        tb = self._tb
        config = tb.launch_config("forward", chunk.dtype, seg.seg_len, self._tc.interpreting())
        _, kwargs = tb.forward_launch_args(RowInputs(chunk, tokens, None, None), seg, with_entropy, out.unsqueeze(0),
                                           config)
        launcher(self._tk.forward_partials_kernel)((n, 1), **kwargs)  # programs for the real rows only

    def dlogits(self, chunk, n, tokens, seg, stats: BackwardStats, upstream: UpstreamGrads, out) -> None:
        """out [>= n, seg_len] in its dtype: the logits op's gradient of the chunk's first n rows (fp32 math, one
        rounding to out's dtype)."""
        tb = self._tb
        config = tb.launch_config("backward", chunk.dtype, seg.seg_len, self._tc.interpreting())
        launcher(self._tk.backward_grad_kernel)((n, self._tc.cdiv(seg.seg_len, config.block_v)),
            **tb.backward_launch_args(RowInputs(chunk, tokens, None, None), seg, stats, upstream, out, config))


class _TorchPasses:
    """The logits op's PyTorch code on one fp32 chunk (any device); its paths are the chunk ones, always."""

    name = "torch"

    def __init__(self):
        from ppo_ops.logits import torch_backend

        self._tb = torch_backend

    def merge(self, partials: torch.Tensor, has_keep_mask: bool) -> RowStats:
        return row_stats.merge_partials(partials, has_keep_mask)

    def partials(self, chunk, n, tokens, seg, with_entropy, out) -> None:
        p = self._tb.forward_partials(RowInputs(chunk[:n], tokens[:n], None, None), seg, with_entropy)
        out[:, :n].copy_(p[0])

    def dlogits(self, chunk, n, tokens, seg, stats: BackwardStats, upstream: UpstreamGrads, out) -> None:
        self._tb.backward_grad(RowInputs(chunk[:n], tokens[:n], None, None), seg,
                               BackwardStats(stats.shift[:n], stats.log_sum[:n], None,
                                             rows_of(stats.mean_shifted, slice(0, n))),
                               UpstreamGrads(rows_of(upstream.grad_log_prob, slice(0, n)),
                                             rows_of(upstream.grad_entropy, slice(0, n))),
                               out[:n])


def backward_rows(saved: LinearSaved, upstream: UpstreamGrads, rows: slice) -> tuple:
    """(BackwardStats, UpstreamGrads) of `rows` for the general op's backward (E_p[z] - M only where the entropy
    brings a gradient)."""
    g_lp, g_ent = upstream.grad_log_prob, upstream.grad_entropy
    stats = BackwardStats(saved.shift[rows], saved.log_sum[rows], None,
                          None if g_ent is None else saved.mean_shifted[rows])
    return stats, UpstreamGrads(rows_of(g_lp, rows), rows_of(g_ent, rows))


class SegmentGemmBackend:
    """LinearBackend and FusedLossBackend over the segment GEMMs and the logits op's passes (`passes`)."""

    applies_dlogits_term = True  # backward adds UpstreamGrads.dlogits_term into each group's dlogits

    def __init__(self, passes):
        self.passes = passes
        self.name = f"segments-{passes.name}"

    def path(self, hidden: torch.Tensor, weight: torch.Tensor, seg_len: int, *, token_loss: bool = False,
             needs_grad: bool, working_memory: Optional[int] = None) -> paths.HeadPath:
        """The path of a call with these kept rows and weight (paths.head_path, on this backend's passes)."""
        kind = self.passes.name
        return paths.head_path(kind=kind, dtype=hidden.dtype, device=hidden.device, token_loss=token_loss,
                               aligned=paths.one_gemm_applies(kind, hidden, weight), needs_grad=needs_grad,
                               n_rows=hidden.shape[0], width=hidden.shape[1], seg_len=seg_len,
                               working_memory=working_memory)

    # -- the general op --

    def merge_partials(self, partials: torch.Tensor, has_keep_mask: bool) -> RowStats:
        return self.passes.merge(partials, has_keep_mask)

    def forward_partials(self, hidden, weight, tokens, shard: ShardOptions, with_entropy: bool) -> torch.Tensor:
        path = self.path(hidden, weight, shard.seg_len, needs_grad=False)
        if path.path is Path.ONE_GEMM:  # one GEMM whose epilogue forms the partials: no logits written or read
            return self.passes.one_gemm_forward.forward_partials(hidden, weight, tokens, shard, with_entropy)
        return self._chunk_forward(hidden, weight, tokens, shard, with_entropy, path.block_rows)

    def _chunk_forward(self, hidden, weight, tokens, shard: ShardOptions, with_entropy: bool,
                       rows: int) -> torch.Tensor:
        """chunk_gemms' forward: per block of `rows` rows and segment, the chunk GEMM and the partials pass."""
        n_rows, v_local = hidden.shape[0], weight.shape[0]
        n_seg = v_local // shard.seg_len
        blocks = RowBlocks(hidden, rows)
        buf = torch.empty((blocks.count, n_seg, row_stats.NUM_PARTIALS, rows), dtype=torch.float32,
                          device=hidden.device)
        if n_rows == 0:
            return buf.new_empty((n_seg, row_stats.NUM_PARTIALS, 0))
        tokens = tokens.to(torch.int64).contiguous()
        chunk = torch.empty((rows, shard.seg_len), dtype=torch.float32, device=hidden.device)
        for s, _seg_lo, seg in segments(shard, v_local):
            if seg.n_valid == 0:
                neutral_partials(buf[:, s])
        for b in range(blocks.count):
            r0, n, x = blocks.block(b)
            for s, seg_lo, seg in segments(shard, v_local):
                if seg.n_valid == 0:
                    continue
                gemms.mm_fp32(x, weight[seg_lo:seg_lo + shard.seg_len].T, chunk)
                self.passes.partials(chunk, n, tokens[r0:r0 + n], seg.rows(slice(r0, r0 + n)), with_entropy,
                                     buf[b, s])
        # [blocks, segments, 5, rows] -> [segments, 5, R] (O(R) bytes)
        return buf.permute(1, 2, 0, 3).reshape(n_seg, row_stats.NUM_PARTIALS, -1)[:, :, :n_rows]

    def forward_for_backward(self, hidden, weight, tokens, shard: ShardOptions, with_entropy: bool,
                             working_memory: Optional[int] = None) -> tuple:
        """The forward of a call that a backward follows: on one_gemm_held the held rows through forward_probs
        (their probabilities held), the rest through forward_partials; the same partials, bit for bit (a row's
        partials do not depend on the other rows). Two launches, not one with a store branch: a branch in the
        epilogue lets the compiler schedule the other rows' arithmetic differently, and values must not depend on
        grad mode. Other paths: forward_partials, nothing held."""
        path = self.path(hidden, weight, shard.seg_len, needs_grad=True, working_memory=working_memory)
        if path.path is not Path.ONE_GEMM_HELD:
            return self.forward_partials(hidden, weight, tokens, shard, with_entropy), None
        forward, k = self.passes.one_gemm_forward, path.held_rows
        n_rows, v_local, seg_len = hidden.shape[0], weight.shape[0], shard.seg_len
        tile_rows = round_up(k, forward.config().block_m)
        probs = torch.empty((v_local // seg_len, seg_len, tile_rows), dtype=torch.float16,
                            device=hidden.device).transpose(1, 2)
        parts, tiles = forward.forward_probs(hidden[:k], weight, tokens[:k], shard.rows(slice(0, k)), with_entropy,
                                             probs)
        if k < n_rows:
            rest = forward.forward_partials(hidden[k:], weight, tokens[k:], shard.rows(slice(k, n_rows)),
                                            with_entropy)
            parts = torch.cat((parts, rest), dim=2)
        return parts, HeldProbs(probs, tiles, k)

    def backward(self, head: HeadRows, saved: LinearSaved, upstream: UpstreamGrads, wanted: GradsWanted):
        """(dX fp32 [R, H] or None, dW [V_local, H] or None): per segment, per group, the group's dlogits
        (_GroupBackward.dlogits), the keep set's term, then its dX and dW GEMMs; a segment's dW finished last."""
        path = self.path(head.hidden, head.weight, head.shard.seg_len, needs_grad=True)
        run = _GroupBackward(self.passes, head, saved, upstream, wanted, path)
        if run.has_work:
            for s, seg_lo, seg in segments(head.shard, head.weight.shape[0]):
                run.segment(s, seg_lo, seg)
        return run.outputs()

    # -- the token loss: lm_head/token_loss_blocks.py --

    def loss_forward(self, head: HeadRows, with_entropy: bool, hooks: LossHooks, wanted: GradsWanted,
                     working_memory: Optional[int] = None) -> Optional[torch.Tensor]:
        path = self.path(head.hidden, head.weight, head.shard.seg_len, token_loss=True,
                         needs_grad=wanted.dx or wanted.dw, working_memory=working_memory)
        return token_loss_blocks.loss_forward(self.passes, path, head, with_entropy, hooks, wanted)


class _GroupBackward:
    """One backward of the general op on chunk_gemms, one_gemm or one_gemm_held: its outputs, its buffers, and its
    steps per segment and group (group_rows rows from a multiple of group_rows; dW's K)."""

    def __init__(self, passes, head: HeadRows, saved: LinearSaved, upstream: UpstreamGrads, wanted: GradsWanted,
                 path: paths.HeadPath):
        """The outputs (dX's fp32 accumulator on a multiple of 8 rows, dW) and the buffers every group reuses."""
        hidden, weight = head.hidden, head.weight
        n_rows, width = hidden.shape
        self.passes, self.saved, self.upstream = passes, saved, upstream
        self.hidden, self.weight, self.seg_len = hidden, weight, head.shard.seg_len
        self.tokens, self.n_rows = head.tokens, n_rows
        self.need_dx, self.need_dw = wanted.dx, wanted.dw
        self.dx = torch.zeros((gemm_rows(n_rows), width), dtype=torch.float32, device=hidden.device) \
            if wanted.dx else None
        self.dw = torch.empty_like(weight) if wanted.dw else None
        self.has_work = n_rows > 0 and not (upstream.grad_log_prob is None and upstream.grad_entropy is None)
        if not self.has_work:
            return
        self.tokens = head.tokens.to(torch.int64).contiguous()
        self.fused = path.path in paths.ONE_GEMM_PATHS
        self.held = saved.held if self.fused else None
        self.blocks = RowBlocks(hidden, path.block_rows)
        self.block_rows, self.group_stride = path.block_rows, path.group_rows
        self.group_rows = min(path.group_rows, self.blocks.count * path.block_rows)  # the dlogits buffer's rows
        self.dl = self._dlogits_buffer()
        self.one_group = n_rows <= path.group_rows
        self.dw_acc = None
        if self.need_dw and not self.one_group:
            self.dw_acc = torch.empty((self.seg_len, width), dtype=torch.float32, device=hidden.device)
        # dW's operand of the last group: its hidden rows zero-padded to gemm_rows, made once for every segment
        self.last_g0 = (n_rows - 1) // path.group_rows * path.group_rows
        self.last_x = (gemm_operand_rows(hidden[self.last_g0:], gemm_rows(n_rows - self.last_g0))
                       if self.need_dw else None)
        self.chunk = None if self.fused else torch.empty((path.block_rows, self.seg_len), dtype=torch.float32,
                                                         device=hidden.device)

    def _dlogits_buffer(self) -> torch.Tensor:
        """[group_rows, seg_len] in the input dtype: vocabulary-major for the fused recompute (dW's GEMM then reads
        dl^T K-major), row-major for the chunk pass."""
        hidden = self.hidden
        if self.fused:
            return torch.empty((self.seg_len, self.group_rows), dtype=hidden.dtype, device=hidden.device).T
        return torch.empty((self.group_rows, self.seg_len), dtype=hidden.dtype, device=hidden.device)

    def segment(self, s: int, seg_lo: int, seg: ShardOptions) -> None:
        """Segment s: every group's dlogits and GEMMs, then its dW rows (zero on a padding segment)."""
        if seg.n_valid == 0:  # padding only: no gradient, no dX contribution
            if self.need_dw:
                self.dw[seg_lo:seg_lo + self.seg_len].zero_()
            return
        w_s = self.weight[seg_lo:seg_lo + self.seg_len]
        for g0 in range(0, self.n_rows, self.group_stride):
            m = min(self.group_rows, self.n_rows - g0)
            self.dlogits(s, w_s, seg, g0, m)
            if self.upstream.dlogits_term is not None:  # a sparse keep set's term: it rides in the GEMMs below
                self.upstream.dlogits_term(self.dl[:m], g0, seg_lo)
            self.gemms(seg_lo, w_s, g0, m)
        if self.dw_acc is not None:
            self.dw[seg_lo:seg_lo + self.seg_len].copy_(self.dw_acc)

    def dlogits(self, s: int, w_s, seg: ShardOptions, g0: int, m: int) -> None:
        """dl[:m] = the dlogits of rows g0 .. g0 + m in segment s: held rows from their probabilities, the others by
        the fused recompute (one-GEMM paths) or by chunk GEMMs and the logits op's gradient pass (chunk_gemms)."""
        if not self.fused:
            self._chunk_dlogits(w_s, seg, g0, m)
            return
        lo, stop = g0, g0 + m
        if self.held is not None and g0 < self.held.rows:  # the group's held rows (the call's first)
            lo = min(stop, self.held.rows)
            self._held_dlogits(s, slice(g0, lo), HeadRows(self.hidden, w_s, self.tokens, seg.rows(slice(g0, lo))))
        if lo < stop:  # the forward's GEMM tiles again, the gradient in their epilogue
            rs = slice(lo, stop)
            self.passes.one_gemm_recompute.dlogits(self.hidden[rs], w_s, self.tokens[rs], seg.rows(rs),
                                                   *backward_rows(self.saved, self.upstream, rs),
                                                   self.dl[lo - g0:stop - g0])

    def _chunk_dlogits(self, w_s, seg: ShardOptions, g0: int, m: int) -> None:
        """chunk_gemms: per block of the group, the forward's chunk GEMM again (the same logits, bit for bit) and
        the logits op's gradient pass into dl."""
        first = g0 // self.block_rows
        for b in range(first, first + -(-m // self.block_rows)):
            r0, n, x = self.blocks.block(b)
            gemms.mm_fp32(x, w_s.T, self.chunk)
            rs = slice(r0, r0 + n)
            self.passes.dlogits(self.chunk, n, self.tokens[rs], seg.rows(rs),
                                *backward_rows(self.saved, self.upstream, rs), self.dl[r0 - g0:r0 - g0 + n])

    def _held_dlogits(self, s: int, rs: slice, segment: HeadRows) -> None:
        """dl[:n] = segment s's dlogits of the held rows rs (n of them, a group's first), from the probabilities the
        forward held (read only: a second backward finds them unchanged). `segment`: the rows with segment s's
        weight and options. The views start at rs.start and run to the buffers' ends (the pass may cover the rows
        that round n up to 16, which the forward wrote)."""
        held, n = self.held, rs.stop - rs.start
        self.passes.prob_pass.dlogits(
            held.probs[s:s + 1, rs.start:], held.tiles[s:s + 1, :, :, rs.start:], n, segment.hidden[rs],
            segment.weight, segment.tokens[rs], segment.shard, *backward_rows(self.saved, self.upstream, rs),
            self.dl.dtype, out=self.dl[None, :n])

    def gemms(self, seg_lo: int, w_s, g0: int, m: int) -> None:
        """The group's dX32 += dl @ W_s and dW_s (+)= dl^T @ X, on gemm_rows(m) rows (the rows above m zeroed: an
        earlier group may have written them)."""
        m_gemm = gemm_rows(m)
        self.dl[m:m_gemm].zero_()
        part = self.dl[:m_gemm]
        if self.need_dx:
            gemms.addmm_fp32(self.dx[g0:g0 + m_gemm], part, w_s)
        if not self.need_dw:
            return
        x = self.last_x if g0 == self.last_g0 else self.hidden[g0:g0 + m]
        if self.one_group:
            gemms.mm_rounded(part.T, x, self.dw[seg_lo:seg_lo + self.seg_len])
        elif g0 == 0:
            gemms.mm_fp32(part.T, x, self.dw_acc)
        else:
            gemms.addmm_fp32(self.dw_acc, part.T, x)

    def outputs(self) -> tuple:
        """(dX [R, H] fp32 or None, dW or None); dW zero where no row brings a gradient."""
        if not self.has_work and self.dw is not None:
            self.dw.zero_()
        return None if self.dx is None else self.dx[:self.n_rows], self.dw


_BACKENDS = {}


def backend(passes: str) -> SegmentGemmBackend:
    """The segment-GEMM backend over the logits op's "triton" or "torch" passes (one instance each)."""
    if passes not in _BACKENDS:
        _BACKENDS[passes] = SegmentGemmBackend(_TritonPasses() if passes == "triton" else _TorchPasses())
    return _BACKENDS[passes]
