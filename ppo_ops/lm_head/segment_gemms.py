"""The segment-GEMM backend of the fused LM head: every GEMM over the fixed vocabulary segments, with the softmax
statistics formed in GEMM epilogues or by the logits op's passes over bounded chunks.

Runs every bf16 / fp16 call of linear_log_probs_and_entropy and every call of linear_token_loss (whose row blocks are
lm_head/token_loss_blocks.py). Implements `LinearBackend` and `FusedLossBackend` (core/contracts.py) over one of two
sets of passes: "triton" (CUDA; or CPU under TRITON_INTERPRET=1) and "torch" (the logits op's PyTorch code).

The segments are core/layout.py's (V_global / 8 columns each, whichever rank holds them), the row blocks fixed per
device (ChunkShape). Two ways to form a segment's logits:
    one-GEMM kernels (the Triton passes on half precision, rows and weight TMA-aligned: `applies`): the forward is
        one Triton GEMM whose epilogue reduces each logit tile to the five partials (gemm_partials.py), so no logit
        reaches memory; the backward's dlogits come from the same GEMM tiles again with the gradient in the
        epilogue (gemm_dlogits.py), or, for the first rows, from probabilities the forward held (below).
    chunk GEMMs (otherwise): the library's GEMM (cuBLAS with fp32 accumulation on CUDA; an fp32 matmul of the upcast
        operands elsewhere, whose products are exact) writes an fp32 chunk [rows, seg_len] with one shape for every
        block, segment, rank, TP size and row count, and the logits op's forward or gradient pass reads it.
dX and dW are always library GEMMs on the dlogits of a group of rows: dX32 += dl @ W_s (fp32 accumulator,
K = seg_len) and dW_s (+)= dl^T @ X (K = dw_rows; one group: written once in the input dtype).

Invariance, and what it rests on. A row's logit depends on its row of X, its column of W and a K order fixed by the
GEMM's shape (one shape per path), never on the other rows, the rank or the TP size; segments start at global
columns; row blocks and weight segments start at multiples of 16 bytes whenever H * itemsize is. The partials and
their merge are the logits op's (TP-invariant by construction). Hence log-probs, entropies and dW (segment-relative
GEMM shapes) are bitwise identical across TP sizes and row counts (a row mask that moves rows included); dX sums a
rank's segments, then the ranks: deterministic, within fp32 rounding of TP = 1. On the chunk path the values equal
log_probs_and_entropy(tile_logits(...)) bit for bit; on the one-GEMM path they equal the logits op's within fp32
reduction order (the epilogue reduces over GEMM tiles).

Held probabilities. A forward that a backward follows (forward_for_backward) also stores the first held_rows rows'
logits as fp16 probabilities e^(z - tile max) within their tiles (at most the call's working_memory, default
HOLD_BYTES, at the global vocabulary; in as many dW groups as they reach), whose dlogits the backward then forms,
group by group, in a memory-bound pass (prob_dlogits.py) instead of a second GEMM; those dlogits
carry that fp16 rounding (2^-11 of their terms) before their own rounding to the input dtype. The held rows run in a
launch of their own, so the other rows' partials are those of the forward without a store, bit for bit, in any
grad mode.

Memory (besides dX and dW): forward, one fp32 chunk on the chunk path (rows x seg_len), none on the one-GEMM path
(tile partials: 12 bytes per row and 256 columns), plus the held probabilities until the backward (2 bytes per
logit of the held rows); backward, one chunk (none on the one-GEMM path), a dlogits buffer (dw_rows x seg_len in
the input dtype), with more than one group a segment's fp32 dW accumulator (seg_len x H), and the fp32 dX
accumulator [R, H]. Measured sizes and times: docs/performance.md, "The fused LM head".
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ppo_ops.core import layout, row_stats
from ppo_ops.core.contracts import (BackwardStats, GradsWanted, HeadRows, HeldProbs, LinearSaved, LossHooks,
                                    RowInputs, RowStats, ShardOptions, UpstreamGrads)
from ppo_ops.core.triton_launch import launcher  # fewer host steps per launch

_HALF = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """Row counts of the chunks. Part of the bit-exactness contract: every call on a device uses the same ones."""

    rows: int  # general op: rows per GEMM chunk (forward and the backward's recompute)
    dw_rows: int  # general op backward: dlogits rows per dX / dW GEMM, a multiple of rows
    loss_rows: int  # token loss: rows per block, whose logits over all local segments are held
    loss_dw_rows: int  # token loss: dlogits rows per dW GEMM (its K), a multiple of loss_rows


# CUDA: a chunk GEMM of 1024 rows fills the chip at Qwen3's shapes while its fp32 chunk stays small; the general op's
# dW groups of 8192 rows read and write the fp32 dW accumulator once per 8192 rows of GEMM work; the token loss's
# chunk blocks trade their logits' memory (loss_rows x V_local fp32) against the dW accumulator's traffic (once per
# loss_dw_rows). The sizes measured behind these choices: docs/performance.md, "The fused LM head".
CUDA_SHAPE = ChunkShape(rows=1024, dw_rows=8192, loss_rows=1024, loss_dw_rows=1024)
# Elsewhere (the CPU suite, Triton's interpreter): small, so tiny test shapes cross block and group boundaries.
HOST_SHAPE = ChunkShape(rows=16, dw_rows=32, loss_rows=8, loss_dw_rows=16)


def chunk_shape(device: torch.device) -> ChunkShape:
    return CUDA_SHAPE if device.type == "cuda" else HOST_SHAPE


# The general op's one-GEMM forward, in a call that a backward follows, also keeps the first rows' logits as fp16
# probabilities within their tiles (the token loss's store), at most the call's working_memory bytes at the global
# vocabulary (default HOLD_BYTES; a multiple of PROB_ROWS_STEP rows, so of the forward's row tile): their backward
# then forms each group's dlogits of those rows in a memory-bound pass instead of a second GEMM over them.
# The default keeps them well under the fp32 [T, V] logits of the logits path (1 GiB: 3328 rows at Qwen3's
# vocabulary); a caller who can spare more saves more of the second GEMM (docs/performance.md).
HOLD_BYTES = 2**30
HOST_HOLD_ROWS = 16  # the interpreter's default: the tests' row counts cross it (one row block of HOST_SHAPE)
PROB_ROWS_STEP = 256  # the row tile of the probabilities' pass (prob_dlogits.PASS_ROWS): held rows are a multiple
HOST_ROWS_STEP = 16  # the interpreter's step (its forward's row tile), so the tests' small allowances hold rows


def held_rows(n_rows: int, seg_len: int, device: torch.device, working_memory: Optional[int] = None) -> int:
    """How many of a call's first rows the general op's forward keeps as probabilities for its backward: 2 bytes
    a logit at the global vocabulary within working_memory (None: HOLD_BYTES, or HOST_HOLD_ROWS rows off CUDA), in
    steps of a row tile, at most the call's rows. A function of the row count, the segment length and the allowance
    only (the global vocabulary), so the same on every rank and TP size."""
    on_cuda = device.type == "cuda"
    if working_memory is None and not on_cuda:
        cap = HOST_HOLD_ROWS
    else:
        step = PROB_ROWS_STEP if on_cuda else HOST_ROWS_STEP
        allowance = HOLD_BYTES if working_memory is None else working_memory
        cap = allowance // (seg_len * layout.NUM_FIXED_SEGMENTS * 2) // step * step
    return max(0, min(n_rows, cap))


# ---- GEMMs: the library's, fp32 accumulation ----

def mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out (fp32) = a @ b. Half precision on CUDA: cuBLAS with fp32 accumulation and fp32 output (mm's out_dtype);
    elsewhere an fp32 matmul of the upcast operands (bf16 / fp16 products are exact in fp32)."""
    if a.is_cuda and a.dtype in _HALF:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b, accumulating into the fp32 buffer (addmm's out_dtype on CUDA)."""
    if a.is_cuda and a.dtype in _HALF:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def mm_rounded(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out (a's dtype) = a @ b, fp32 accumulation inside the GEMM, one rounding."""
    if a.is_cuda:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a.float(), b.float()))


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
        self.one_gemm_forward = gemm_partials  # the general op's forward where gemm_partials.applies()
        self.one_gemm_recompute = gemm_dlogits  # its backward's logits + dlogits where gemm_dlogits.applies()
        self.token_loss_pass = prob_dlogits  # the token loss's dlogits from the one-GEMM forward's probabilities

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
    """The logits op's PyTorch code on one fp32 chunk (any device)."""

    name = "torch"
    one_gemm_forward = None  # the chunk GEMMs and this code's partials pass, always
    one_gemm_recompute = None  # the chunk GEMMs and this code's gradient pass, always
    token_loss_pass = None  # the token loss's chunk blocks, always

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
                                             _rows_of(stats.mean_shifted, slice(0, n))),
                               UpstreamGrads(_rows_of(upstream.grad_log_prob, slice(0, n)),
                                             _rows_of(upstream.grad_entropy, slice(0, n))),
                               out[:n])


# ---- row blocks ----

class RowBlocks:
    """The kept rows as fixed-shape [rows, H] blocks: a view of hidden where it is a whole block starting at a
    16-byte boundary, else a copy into one zero-padded buffer (so every GEMM gets the same shape and alignment)."""

    def __init__(self, hidden: torch.Tensor, rows: int):
        self.hidden, self.rows = hidden, rows
        n_rows, width = hidden.shape
        self.aligned = (hidden.stride(0) * hidden.element_size()) % 16 == 0 and hidden.data_ptr() % 16 == 0
        self._pad = None
        self.count = -(-n_rows // rows)

    def block(self, b: int):
        """(first row, real rows n, [rows, H] block) of block b."""
        r0 = b * self.rows
        n = min(self.rows, self.hidden.shape[0] - r0)
        if n == self.rows and self.aligned:
            return r0, n, self.hidden[r0:r0 + n]
        if self._pad is None:
            self._pad = torch.zeros((self.rows, self.hidden.shape[1]), dtype=self.hidden.dtype,
                                    device=self.hidden.device)
        elif n < self.rows:
            self._pad[n:].zero_()
        self._pad[:n].copy_(self.hidden[r0:r0 + n])
        return r0, n, self._pad


def _rows_of(t: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    return None if t is None else t[rows]


def backward_rows(saved: LinearSaved, upstream: UpstreamGrads, rows: slice) -> tuple:
    """(BackwardStats, UpstreamGrads) of `rows` for the general op's backward (E_p[z] - M only where the entropy
    brings a gradient)."""
    g_lp, g_ent = upstream.grad_log_prob, upstream.grad_entropy
    stats = BackwardStats(saved.shift[rows], saved.log_sum[rows], None,
                          None if g_ent is None else saved.mean_shifted[rows])
    return stats, UpstreamGrads(_rows_of(g_lp, rows), _rows_of(g_ent, rows))


def neutral_partials(out: torch.Tensor) -> None:
    """Partials of a segment with no real column (vocabulary padding): neutral under the merge."""
    out.zero_()
    out[..., row_stats.MAX, :] = float("-inf")
    out[..., row_stats.TARGET_Z, :] = float("-inf")


def segments(shard: ShardOptions, v_local: int):
    """(segment index, first local column, the segment's ShardOptions) of this shard, in order."""
    for s, seg_lo in enumerate(range(0, v_local, shard.seg_len)):
        yield s, seg_lo, shard.segment(seg_lo)


class SegmentGemmBackend:
    """LinearBackend and FusedLossBackend over the segment GEMMs and the logits op's passes (`passes`)."""

    applies_dlogits_term = True  # backward adds UpstreamGrads.dlogits_term into each group's dlogits

    def __init__(self, passes):
        self.passes = passes
        self.name = f"segments-{passes.name}"

    # -- the general op --

    def merge_partials(self, partials: torch.Tensor, has_keep_mask: bool) -> RowStats:
        return self.passes.merge(partials, has_keep_mask)

    def forward_partials(self, hidden, weight, tokens, shard: ShardOptions, with_entropy: bool) -> torch.Tensor:
        one_gemm = self.passes.one_gemm_forward
        if one_gemm is not None and one_gemm.applies(hidden, weight):
            # one GEMM whose epilogue forms the partials: no logits written or read
            return one_gemm.forward_partials(hidden, weight, tokens, shard, with_entropy)
        n_rows, v_local = hidden.shape[0], weight.shape[0]
        n_seg = v_local // shard.seg_len
        shape = chunk_shape(hidden.device)
        blocks = RowBlocks(hidden, shape.rows)
        buf = torch.empty((blocks.count, n_seg, row_stats.NUM_PARTIALS, shape.rows), dtype=torch.float32,
                          device=hidden.device)
        if n_rows == 0:
            return buf.new_empty((n_seg, row_stats.NUM_PARTIALS, 0))
        tokens = tokens.to(torch.int64).contiguous()
        chunk = torch.empty((shape.rows, shard.seg_len), dtype=torch.float32, device=hidden.device)
        for s, _seg_lo, seg in segments(shard, v_local):
            if seg.n_valid == 0:
                neutral_partials(buf[:, s])
        for b in range(blocks.count):
            r0, n, x = blocks.block(b)
            for s, seg_lo, seg in segments(shard, v_local):
                if seg.n_valid == 0:
                    continue
                mm_fp32(x, weight[seg_lo:seg_lo + shard.seg_len].T, chunk)
                self.passes.partials(chunk, n, tokens[r0:r0 + n], seg, with_entropy, buf[b, s])
        # [blocks, segments, 5, rows] -> [segments, 5, R] (O(R) bytes)
        return buf.permute(1, 2, 0, 3).reshape(n_seg, row_stats.NUM_PARTIALS, -1)[:, :, :n_rows]

    def forward_for_backward(self, hidden, weight, tokens, shard: ShardOptions, with_entropy: bool,
                             working_memory: Optional[int] = None) -> tuple:
        """The forward of a call that a backward follows: where the one-GEMM forward and the probabilities' pass
        apply, the first held_rows rows (within working_memory) through forward_probs (their probabilities held),
        the rest through forward_partials; the same partials, bit for bit (a row's partials do not depend on the
        other rows). Two launches, not one with a store branch: a branch in the epilogue lets the compiler schedule
        the other rows' arithmetic differently, and values must not depend on grad mode."""
        passes = self.passes
        n_rows = hidden.shape[0]
        k = held_rows(n_rows, shard.seg_len, hidden.device, working_memory)
        if passes.token_loss_pass is None or k == 0 or not passes.one_gemm_recompute.applies(hidden, weight):
            return self.forward_partials(hidden, weight, tokens, shard, with_entropy), None
        forward = passes.one_gemm_forward
        v_local, seg_len = weight.shape[0], shard.seg_len
        n_seg = v_local // seg_len
        tile_rows = round_up(k, forward.config().block_m)
        probs = torch.empty((n_seg, seg_len, tile_rows), dtype=torch.float16, device=hidden.device).transpose(1, 2)
        parts, tiles = forward.forward_probs(hidden[:k], weight, tokens[:k], shard, with_entropy, probs)
        if k < n_rows:
            rest = forward.forward_partials(hidden[k:], weight, tokens[k:], shard, with_entropy)
            parts = torch.cat((parts, rest), dim=2)
        return parts, HeldProbs(probs, tiles, k)

    def backward(self, head: HeadRows, saved: LinearSaved, upstream: UpstreamGrads, wanted: GradsWanted):
        hidden, weight, tokens, shard = head.hidden, head.weight, head.tokens, head.shard
        need_dx, need_dw = wanted.dx, wanted.dw
        n_rows, width = hidden.shape
        v_local = weight.shape[0]
        seg_len = shard.seg_len
        dx = torch.zeros((gemm_rows(n_rows), width), dtype=torch.float32, device=hidden.device) if need_dx else None
        dw = torch.empty_like(weight) if need_dw else None
        shape = chunk_shape(hidden.device)
        g_lp, g_ent = upstream.grad_log_prob, upstream.grad_entropy
        if n_rows == 0 or (g_lp is None and g_ent is None):
            if dw is not None:
                dw.zero_()
            return None if dx is None else dx[:n_rows], dw
        tokens = tokens.to(torch.int64).contiguous()
        blocks = RowBlocks(hidden, shape.rows)
        group_rows = min(shape.dw_rows, blocks.count * shape.rows)
        recompute = self.passes.one_gemm_recompute
        fused = recompute is not None and recompute.applies(hidden, weight)
        # the fused recompute writes dl vocabulary-major (dW's GEMM then reads dl^T K-major); the chunk pass row-major
        if fused:
            dl = torch.empty((seg_len, group_rows), dtype=hidden.dtype, device=hidden.device).T
        else:
            dl = torch.empty((group_rows, seg_len), dtype=hidden.dtype, device=hidden.device)
        one_group = n_rows <= shape.dw_rows
        dw_acc = None
        if need_dw and not one_group:
            dw_acc = torch.empty((seg_len, width), dtype=torch.float32, device=hidden.device)
        blocks_per_group = shape.dw_rows // shape.rows
        # dW's operand of the last group: its hidden rows zero-padded to GEMM_ROWS, made once for every segment
        last_g0 = (blocks.count - 1) // blocks_per_group * shape.dw_rows
        last_x = gemm_operand_rows(hidden[last_g0:], gemm_rows(n_rows - last_g0)) if need_dw else None
        chunk = None if fused else torch.empty((shape.rows, seg_len), dtype=torch.float32, device=hidden.device)
        held = saved.held if fused else None
        for s, seg_lo, seg in segments(shard, v_local):
            w_s = weight[seg_lo:seg_lo + seg_len]
            if seg.n_valid == 0:  # padding only: no gradient, no dX contribution
                if need_dw:
                    dw[seg_lo:seg_lo + seg_len].zero_()
                continue
            for g0_block in range(0, blocks.count, blocks_per_group):
                g0 = g0_block * shape.rows
                if fused:  # no fp32 chunk
                    stop = min(g0 + group_rows, n_rows)
                    lo = g0
                    if held is not None and g0 < held.rows:  # the group's held rows (the call's first): their probs
                        lo = min(stop, held.rows)
                        self._held_dlogits(held, s, slice(g0, lo), HeadRows(hidden, w_s, tokens, seg), saved,
                                           upstream, dl)
                    if lo < stop:  # the forward's GEMM tiles again, the gradient in their epilogue
                        rs = slice(lo, stop)
                        recompute.dlogits(hidden[rs], w_s, tokens[rs], seg, *backward_rows(saved, upstream, rs),
                                          dl[lo - g0:stop - g0])
                else:
                    for b in range(g0_block, min(g0_block + blocks_per_group, blocks.count)):
                        r0, n, x = blocks.block(b)
                        mm_fp32(x, w_s.T, chunk)  # the forward's chunk GEMM: the same logits, bit for bit
                        rs = slice(r0, r0 + n)
                        self.passes.dlogits(chunk, n, tokens[rs], seg, *backward_rows(saved, upstream, rs),
                                            dl[r0 - g0:r0 - g0 + n])
                m = min(group_rows, n_rows - g0)
                if upstream.dlogits_term is not None:  # a sparse keep set's term: it rides in the GEMMs below
                    upstream.dlogits_term(dl[:m], g0, seg_lo)
                m_gemm = gemm_rows(m)  # the rows above m zero (GEMM_ROWS; an earlier group may have written them)
                dl[m:m_gemm].zero_()
                part = dl[:m_gemm]
                if need_dx:
                    addmm_fp32(dx[g0:g0 + m_gemm], part, w_s)
                if need_dw:
                    x = last_x if g0 == last_g0 else hidden[g0:g0 + m]
                    if one_group:
                        mm_rounded(part.T, x, dw[seg_lo:seg_lo + seg_len])
                    elif g0 == 0:
                        mm_fp32(part.T, x, dw_acc)
                    else:
                        addmm_fp32(dw_acc, part.T, x)
            if dw_acc is not None:
                dw[seg_lo:seg_lo + seg_len].copy_(dw_acc)
        return None if dx is None else dx[:n_rows], dw

    def _held_dlogits(self, held: HeldProbs, s: int, rs: slice, segment: HeadRows, saved: LinearSaved,
                      upstream: UpstreamGrads, dl) -> None:
        """dl[:n] = segment s's dlogits of the held rows rs (n of them, a group's first), from the probabilities the
        forward held (read only: a second backward finds them unchanged). `segment`: the rows with segment s's
        weight and options. The views start at rs.start and run to the buffers' ends (the pass may cover the rows
        that round n up to 16, which the forward wrote)."""
        n = rs.stop - rs.start
        self.passes.token_loss_pass.dlogits(
            held.probs[s:s + 1, rs.start:], held.tiles[s:s + 1, :, :, rs.start:], n, segment.hidden[rs],
            segment.weight, segment.tokens[rs], segment.shard, *backward_rows(saved, upstream, rs), dl.dtype,
            out=dl[None, :n])

    # -- the token loss: lm_head/token_loss_blocks.py --

    def loss_forward(self, head: HeadRows, with_entropy: bool, hooks: LossHooks, wanted: GradsWanted,
                     working_memory: Optional[int] = None) -> Optional[torch.Tensor]:
        from ppo_ops.lm_head import token_loss_blocks  # it builds on this module's pieces

        return token_loss_blocks.loss_forward(self.passes, head, with_entropy, hooks, wanted, working_memory)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# dX and dW GEMMs run on a row count rounded up to a multiple of GEMM_ROWS, the extra dlogits rows zero: their
# vocabulary-major dlogits operand has the rows as its contiguous dimension, and with a row count that is not a
# multiple of 8 (16 bytes of bf16; a row mask's count, the last position dropped) cuBLAS falls back to 1-element
# aligned kernels, measured 6x slower on an H200 (docs/performance.md). The zero rows add exact zeros: dX's extra rows
# are dropped, dW's sums are unchanged in value (their bits are those of the padded shape, the same on every rank).
GEMM_ROWS = 8


def gemm_rows(n: int) -> int:
    return round_up(n, GEMM_ROWS)


def gemm_operand_rows(x: torch.Tensor, n_gemm: int) -> torch.Tensor:
    """x [n, H] as a GEMM's [n_gemm, H] operand: x itself when n == n_gemm, else x followed by zero rows."""
    n = x.shape[0]
    if n == n_gemm:
        return x
    out = x.new_zeros((n_gemm, x.shape[1]))
    out[:n].copy_(x)
    return out


def tile_logits(hidden: torch.Tensor, weight: torch.Tensor, seg_len: int) -> torch.Tensor:
    """[R, V_local] fp32 logits made by exactly the chunk GEMMs (tests and comparisons: the op never holds them)."""
    n_rows, v_local = hidden.shape[0], weight.shape[0]
    shape = chunk_shape(hidden.device)
    blocks = RowBlocks(hidden.contiguous(), shape.rows)
    out = torch.empty((blocks.count * shape.rows, v_local), dtype=torch.float32, device=hidden.device)
    chunk = torch.empty((shape.rows, seg_len), dtype=torch.float32, device=hidden.device)
    for b in range(blocks.count):
        r0, n, x = blocks.block(b)
        for seg_lo in range(0, v_local, seg_len):
            mm_fp32(x, weight[seg_lo:seg_lo + seg_len].T, chunk)
            out[r0:r0 + shape.rows, seg_lo:seg_lo + seg_len] = chunk
    return out[:n_rows]


_BACKENDS = {}


def backend(passes: str) -> SegmentGemmBackend:
    """The segment-GEMM backend over the logits op's "triton" or "torch" passes (one instance each)."""
    if passes not in _BACKENDS:
        _BACKENDS[passes] = SegmentGemmBackend(_TritonPasses() if passes == "triton" else _TorchPasses())
    return _BACKENDS[passes]
