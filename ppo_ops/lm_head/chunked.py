"""The chunked backend of the fused LM head: library GEMMs on fixed-shape chunks, the logits op's passes in between.

The half-precision CUDA path of linear_log_probs_and_entropy, and the only path of linear_token_loss. It implements
`FusedLossBackend` (core/contracts.py). The GEMM work runs at the GEMM library's rate because it IS the
library's GEMM (cuBLAS through torch.mm / torch.addmm with out_dtype=float32 on CUDA; an fp32 torch.mm on upcast
operands elsewhere, whose products are exact and whose sums accumulate in fp32, so the CPU suite runs the same
orchestration); everything between the GEMMs is a memory-bound pass of the logits op over a bounded fp32 chunk:
its own forward-partials and gradient kernels (Triton; `passes="torch"`: its PyTorch code).

Chunks. Row blocks of `rows` rows (the kept rows, in order; the last block zero-padded to the full shape) times the
fixed vocabulary segments of core/layout.py (V_global / 8 columns, whichever rank holds them):

    logits chunk  z[B, seg_len] = X[block] @ W[segment]^T    one GEMM shape for every block, segment, rank, TP size
                                                              and row count: so one cuBLAS algorithm, one set of bits
    partials      the logits op's forward kernel on the chunk (its launch depends on seg_len and fp32 only), writing
                  the five partials of (segment, rows): the core's all-gather and fixed-order merge apply unchanged.

Bitwise invariance. A row's logits come from a GEMM whose shape never changes; within it an element depends on its
row of X, its column of W and the library's K order for that shape, not on the other rows of the block nor on which
rank computes it (the segment starts at a global column and the chunk is always seg_len wide). Row blocks and
weight segments start at multiples of 16 bytes whenever H * itemsize is (rows of X and of W are H long), so the
library also sees the same operand alignment; other H still give deterministic results. Partials and merge are
the logits op's, which are TP-invariant by construction. Hence log-probs and entropies are bitwise identical across
TP sizes and row counts (a row mask that moves rows between blocks included), and, where the forward is the chunk
GEMM and the logits op's pass, equal bit for bit to log_probs_and_entropy(tile_logits(...)) with the same passes.
dW's GEMM shapes are segment-relative ([seg_len, K] @ [K, H], K the rows of a group), so dW is bitwise identical
across TP sizes; dX sums a rank's segments and then ranks, deterministic but not TP-invariant (within fp32
rounding).

General op (ChunkedBackend.forward_partials / backward):
    forward    with the Triton passes on half precision (CUDA, or the interpreter), 16-byte aligned rows: one Triton
               GEMM whose epilogue forms the partials (gemm_partials.py), no logits in memory; its reductions
               run over GEMM tiles, so the values equal the logits op's within fp32 reduction order, not bit for
               bit (TP and row-count invariance hold as below). Otherwise per block, per segment: GEMM -> partials
               pass. Under torch.no_grad nothing else is held: one GEMM's work (the Function keeps nothing
               either). With a gradient (forward_for_backward) the one-GEMM forward of the first held_rows rows
               (at most HOLD_BYTES: 3328 rows at Qwen3's vocabulary) also stores their logits as fp16
               probabilities within their tiles, the token loss's store (gemm_partials.forward_probs), held for
               the backward; the same partials, bit for bit.
    backward   per segment (outer), per group of `dw_rows` rows: the group's dlogits in the input dtype in a
               [dw_rows, seg_len] buffer; where the one-GEMM forward ran, one Triton launch forms them (the forward's
               GEMM tiles again, the same bits, the logits op's gradient in the epilogue: gemm_dlogits.py; the
               buffer vocabulary-major, so dW's GEMM reads dl^T K-major; at Qwen3's shapes on an H200 dX and dW
               hashed equal to the row-major layout's), except for the held rows, whose dlogits the token
               loss's pass forms from their probabilities (prob_dlogits.py, into the same buffer: no second
               GEMM over them, their dlogits carrying e's fp16 rounding); else per block the chunk GEMM again and
               the logits op's gradient pass. Then per group dX32[group] += dl @ W_s
               (fp32 accumulator, K = seg_len) and dW_s (+)= dl^T @ X[group] (K = dw_rows: large enough that the fp32
               dW read + write is small next to the GEMM; when one group covers every row, dW_s is written once in
               the input dtype, no accumulator). Four GEMMs' work in all, less the held rows' share of the
               recompute: the forward's, the recompute, dX, dW.
Token loss (ChunkedBackend.loss_forward): the logits are formed once (three GEMMs' work), per row block:
    one-GEMM blocks (the Triton passes, half precision, TMA-aligned rows as for the fused recompute): every row
        as one block where that fits the allowance (one_prob_block; T = 8192 at Qwen3-8B's shape), else blocks
        of prob_block_rows rows (2816 at Qwen3-8B's shape, a function of H and the segment length only). The
        general op's one-GEMM forward also stores every logit as e^(z - tile max) in fp16 into a segment-major
        [n_seg, rows, seg_len] buffer, vocabulary-major in memory (each column's rows contiguous: dW's GEMMs
        then read dl^T K-major; gemm_partials.forward_probs); merge (hooks.merge: TP all-gather), the caller's
        loss (hooks.block_grads), then prob_dlogits.py turns the buffer into dlogits in place (no gradient asked:
        the same blocks through the forward without the store, nothing held). Log-probs and
        entropies are the general op's, bit for bit; dlogits carry e's fp16 rounding (2^-11 of their terms) before
        their own to bf16.
    chunk blocks (otherwise): blocks of `loss_rows` rows, the block's logits over every local segment (held:
        loss_rows x V_local fp32), the logits op's partials, the merge, the loss, the logits op's gradient pass.
        Log-probs and entropies are the logits op's on those logits, bit for bit.
    Then, both: per segment dX32[block] += dl @ W_s (rounded by hooks.finish_dx, per block) and dW32_s += dl^T @
    X[block...] (every `loss_dw_rows` rows on chunk blocks, every block on one-GEMM blocks). dW's fp32 accumulator
    [V_local, H] is returned as it is: the Function rounds it in backward, once, together with the upstream scale
    and in place (core/scale.py: no second [V_local, H] allocation; the result keeps that storage until released).
    One one-GEMM block instead: dW_s = dl_s^T X (K = T) written once in the input dtype, no accumulator; from
    2 H rows on, into the block's storage, over the dlogits of lower segments (their dX and dW GEMMs done: the
    side stream waits on events of the dX GEMMs), the first segment's through a temporary copied in at the end;
    returned finished, it keeps that storage until released.

Memory (besides dX and dW): general op forward one chunk (rows x seg_len fp32: 78 MB at Qwen3 and rows = 1024;
none on the one-GEMM path, whose tile partials take 12 bytes per row and 256 columns), and with a gradient the
held probabilities (2 bytes per logit of the held rows: 0.94 GiB at Qwen3-8B's shape) until the backward; backward
one chunk (none on the fused path), a dl buffer (dw_rows x seg_len in the input dtype) and, with more than one
group, a dW_s fp32 accumulator (seg_len x H), plus the fp32 dX accumulator [R, H]. Token loss: one-GEMM blocks
2 bytes per logit of a block (0.80 GiB at 2816 rows; one block of T = 8192 rows 2.32 GiB, holding dW too, plus one
segment's temporary), chunk blocks the block's fp32 logits (loss_rows x V_local: 0.58 GiB) and dl
(loss_dw_rows x V_local in the input dtype); dX32 of one block; the fp32 dW accumulator (2.32 GiB at Qwen3-8B).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

from ppo_ops.core import layout, row_stats
from ppo_ops.core.contracts import (BackwardStats, HeldProbs, LinearSaved, LossHooks, RowInputs, RowStats,
                                    ShardOptions, UpstreamGrads)

_HALF = (torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class ChunkShape:
    """Row counts of the chunks. Part of the bit-exactness contract: every call on a device uses the same ones."""

    rows: int  # general op: rows per GEMM chunk (forward and the backward's recompute)
    dw_rows: int  # general op backward: dlogits rows per dX / dW GEMM, a multiple of rows
    loss_rows: int  # token loss: rows per block, whose logits over all local segments are held
    loss_dw_rows: int  # token loss: dlogits rows per dW GEMM (its K), a multiple of loss_rows


# CUDA: a [1024, 4096] x [4096, 18992] logits GEMM is 159 GFLOP and fills the chip (600 tiles of 128 x 256); its
# fp32 chunk (78 MB) is written once and read once by the partials pass. The general op's dW GEMM at K = 8192 reads
# and writes its fp32 accumulator (622 MB) once per 1.27 TFLOP. The token loss's chunk blocks: the dW GEMM at
# K = 1024 moves the same 622 MB of accumulator per 159 GFLOP, their largest overhead; a larger K needs K x V_local x
# 2 bytes of dlogits, over the memory allowance beside 1024-row fp32 logits blocks, and host-bound with 512-row ones
# (~100 launches per block); the one-GEMM blocks (prob_block_rows) keep 2 bytes per logit instead. The timings
# behind these choices: docs/performance.md, "The fused LM head".
CUDA_SHAPE = ChunkShape(rows=1024, dw_rows=8192, loss_rows=1024, loss_dw_rows=1024)
# Elsewhere (the CPU suite, Triton's interpreter): small, so tiny test shapes cross block and group boundaries.
HOST_SHAPE = ChunkShape(rows=16, dw_rows=32, loss_rows=8, loss_dw_rows=16)


def chunk_shape(device: torch.device) -> ChunkShape:
    return CUDA_SHAPE if device.type == "cuda" else HOST_SHAPE


# The general op's one-GEMM forward, in a call that a backward follows, also keeps the first rows' logits as fp16
# probabilities within their tiles (the token loss's store), at most HOLD_BYTES at the global vocabulary: their
# backward then forms dlogits from them in a memory-bound pass instead of a second GEMM over those rows. 1 GiB is
# 3328 rows at Qwen3's vocabulary (0.94 GiB; 40% of the recompute at T = 8192, 10% at 32768), well under the fp32
# [T, V] logits of the logits path it replaces (4.6 GiB at T = 8192); a multiple of PROB_ROWS_STEP, so of the
# forward's row tile, and at most one dW group (dw_rows).
HOLD_BYTES = 2**30
HOST_HOLD_ROWS = 16  # the interpreter: the tests' row counts cross it (one row block of HOST_SHAPE)


# The token loss's one-GEMM blocks hold 2 bytes per logit (fp16 probabilities, then dlogits in place). Two layouts,
# both within TOKEN_LOSS_BYTES (the 3.5 GiB allowance at Qwen3's shape, T = 32768, less dX's 0.25 GiB and the
# closure's and dX rows' temporaries):
# - one block (every row at once) where its probabilities, its fp32 dX rows and dW fit: dW_s = dl_s^T X is then one
#   GEMM per segment (K = T) written straight in the input dtype, no fp32 accumulator, and, where the block has at
#   least 2 H rows, into the probabilities' own storage (bytes of segments whose dlogits were read; only the first
#   segment's dW goes through a temporary): T = 8192 at Qwen3-8B's shape holds 2.48 GiB where blocks of 2816 rows
#   and the accumulator hold 3.12;
# - otherwise blocks of the most rows, a multiple of PROB_ROWS_STEP in [PROB_ROWS_MIN, PROB_ROWS_MAX], that fit beside
#   the [V_local, H] fp32 dW accumulator (H = 4096: 2816 rows, 0.80 GiB beside 2.32 GiB; H = 1024: 8192 rows). dW's
#   K is these rows, and each block's dW GEMMs read and write the whole accumulator, so the fewer blocks the better.
# Both count the global vocabulary (a function of H, the segment length and the row count, the same on every rank and
# TP size: dW's GEMM shapes, hence its bits, are). The step is the dlogits pass's row tile (prob_dlogits.PASS_ROWS);
# the block rows swept, with their peaks: docs/performance.md, run N1.
TOKEN_LOSS_BYTES = 25 * 2**27  # 3.125 GiB
PROB_ROWS_MIN, PROB_ROWS_MAX, PROB_ROWS_STEP = 1024, 8192, 256
HOST_PROB_ROWS = 16  # the interpreter: tiny test shapes cross blocks (a multiple of its GEMM tile's 16 rows)
HOST_TOKEN_LOSS_BYTES = 48 * 1024  # the interpreter: at the tests' shapes (V = 256, H = 48) one block up to ~32 rows


def _allowance(device: torch.device) -> int:
    return TOKEN_LOSS_BYTES if device.type == "cuda" else HOST_TOKEN_LOSS_BYTES


def prob_block_rows(width: int, seg_len: int, device: torch.device) -> int:
    """Rows per one-GEMM token-loss block beside the fp32 dW accumulator: a function of H and the segment length
    only. The vocabulary counted is the global one where segments are fixed (layout.NUM_FIXED_SEGMENTS of them), an
    upper bound of V_local."""
    if device.type != "cuda":
        return HOST_PROB_ROWS
    vocab = seg_len * layout.NUM_FIXED_SEGMENTS
    fit = (_allowance(device) - vocab * width * 4) // (vocab * 2)
    return max(PROB_ROWS_MIN, min(PROB_ROWS_MAX, fit // PROB_ROWS_STEP * PROB_ROWS_STEP))


def held_rows(n_rows: int, seg_len: int, device: torch.device) -> int:
    """How many of a call's first rows the general op's forward keeps as probabilities for its backward: a function
    of the row count and the segment length only (the global vocabulary), so the same on every rank and TP size."""
    if device.type != "cuda":
        cap = HOST_HOLD_ROWS
    else:
        vocab = seg_len * layout.NUM_FIXED_SEGMENTS
        cap = HOLD_BYTES // (vocab * 2) // PROB_ROWS_STEP * PROB_ROWS_STEP
    return max(0, min(n_rows, cap, chunk_shape(device).dw_rows))


def dw_in_probs(held: int, width: int) -> bool:
    """Whether one block's dW fits into its probabilities' storage: segment s's dW (seg_len x H) then lies over the
    dlogits of segments below s only, for every s >= 1 (held >= 2 H; the first goes through a temporary)."""
    return held >= 2 * width


def one_block_bytes(n_rows: int, held: int, width: int, seg_len: int) -> int:
    """What one token-loss block of n_rows rows (held: rounded up to the forward's row tile) holds at the global
    vocabulary: its probabilities, its fp32 dX rows, and dW (a temporary of one segment where dW_in_probs)."""
    vocab = seg_len * layout.NUM_FIXED_SEGMENTS
    dw = seg_len * width * 2 if dw_in_probs(held, width) else vocab * width * 2
    return held * vocab * 2 + n_rows * width * 4 + dw


def one_prob_block(n_rows: int, held: int, width: int, seg_len: int, device: torch.device) -> bool:
    """Whether the token loss takes every row as one one-GEMM block (dW finished in its forward)."""
    return one_block_bytes(n_rows, held, width, seg_len) <= _allowance(device)


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
        self._tk.forward_partials_kernel[(n, 1)](**kwargs)  # programs for the real rows only

    def dlogits(self, chunk, n, tokens, seg, stats: BackwardStats, upstream: UpstreamGrads, out) -> None:
        """out [>= n, seg_len] in its dtype: the logits op's gradient of the chunk's first n rows (fp32 math, one
        rounding to out's dtype)."""
        tb = self._tb
        config = tb.launch_config("backward", chunk.dtype, seg.seg_len, self._tc.interpreting())
        self._tk.backward_grad_kernel[(n, self._tc.cdiv(seg.seg_len, config.block_v))](
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

class _RowBlocks:
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


def _backward_rows(saved: LinearSaved, upstream: UpstreamGrads, rows: slice) -> tuple:
    """(BackwardStats, UpstreamGrads) of `rows` for the general op's backward (E_p[z] - M only where the entropy
    brings a gradient)."""
    g_lp, g_ent = upstream.grad_log_prob, upstream.grad_entropy
    stats = BackwardStats(saved.shift[rows], saved.log_sum[rows], None,
                          None if g_ent is None else saved.mean_shifted[rows])
    return stats, UpstreamGrads(_rows_of(g_lp, rows), _rows_of(g_ent, rows))


def _neutral(out: torch.Tensor) -> None:
    """Partials of a segment with no real column (vocabulary padding): neutral under the merge."""
    out.zero_()
    out[..., row_stats.MAX, :] = float("-inf")
    out[..., row_stats.TARGET_Z, :] = float("-inf")


def _segments(shard: ShardOptions, v_local: int):
    """(segment index, first local column, the segment's ShardOptions) of this shard, in order."""
    for s, seg_lo in enumerate(range(0, v_local, shard.seg_len)):
        yield s, seg_lo, shard.segment(seg_lo)


class ChunkedBackend:
    """LinearBackend and FusedLossBackend over library GEMMs and the logits op's passes (`passes`)."""

    def __init__(self, passes):
        self.passes = passes
        self.name = f"chunked-{passes.name}"

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
        blocks = _RowBlocks(hidden, shape.rows)
        buf = torch.empty((blocks.count, n_seg, row_stats.NUM_PARTIALS, shape.rows), dtype=torch.float32,
                          device=hidden.device)
        if n_rows == 0:
            return buf.new_empty((n_seg, row_stats.NUM_PARTIALS, 0))
        tokens = tokens.to(torch.int64).contiguous()
        chunk = torch.empty((shape.rows, shard.seg_len), dtype=torch.float32, device=hidden.device)
        for s, _seg_lo, seg in _segments(shard, v_local):
            if seg.n_valid == 0:
                _neutral(buf[:, s])
        for b in range(blocks.count):
            r0, n, x = blocks.block(b)
            for s, seg_lo, seg in _segments(shard, v_local):
                if seg.n_valid == 0:
                    continue
                mm_fp32(x, weight[seg_lo:seg_lo + shard.seg_len].T, chunk)
                self.passes.partials(chunk, n, tokens[r0:r0 + n], seg, with_entropy, buf[b, s])
        # [blocks, segments, 5, rows] -> [segments, 5, R] (O(R) bytes)
        return buf.permute(1, 2, 0, 3).reshape(n_seg, row_stats.NUM_PARTIALS, -1)[:, :, :n_rows]

    def forward_for_backward(self, hidden, weight, tokens, shard: ShardOptions, with_entropy: bool) -> tuple:
        """The forward of a call that a backward follows: where the one-GEMM forward and the probabilities' pass
        apply, the first held_rows rows through forward_probs (their probabilities held), the rest through
        forward_partials; the same partials, bit for bit (a row's partials do not depend on the other rows). One
        launch storing only the first rows' (a branch in the epilogue) saved 0.7 ms at T = 8192 on an H200 but
        changed some other rows' entropies in their last bit (the compiler schedules the branch's arithmetic
        differently), so values would depend on grad mode."""
        passes = self.passes
        n_rows = hidden.shape[0]
        k = held_rows(n_rows, shard.seg_len, hidden.device)
        if passes.token_loss_pass is None or k == 0 or not passes.one_gemm_recompute.applies(hidden, weight):
            return self.forward_partials(hidden, weight, tokens, shard, with_entropy), None
        forward = passes.one_gemm_forward
        v_local, seg_len = weight.shape[0], shard.seg_len
        n_seg = v_local // seg_len
        tile_rows = _round_up(k, forward.config().block_m)
        probs = torch.empty((n_seg, seg_len, tile_rows), dtype=torch.float16, device=hidden.device).transpose(1, 2)
        parts, tiles = forward.forward_probs(hidden[:k], weight, tokens[:k], shard, with_entropy, probs)
        if k < n_rows:
            rest = forward.forward_partials(hidden[k:], weight, tokens[k:], shard, with_entropy)
            parts = torch.cat((parts, rest), dim=2)
        return parts, HeldProbs(probs, tiles, k)

    def backward(self, hidden, weight, tokens, shard: ShardOptions, saved: LinearSaved, upstream: UpstreamGrads,
                 need_dx: bool, need_dw: bool):
        n_rows, width = hidden.shape
        v_local = weight.shape[0]
        seg_len = shard.seg_len
        dx = torch.zeros((n_rows, width), dtype=torch.float32, device=hidden.device) if need_dx else None
        dw = torch.empty_like(weight) if need_dw else None
        shape = chunk_shape(hidden.device)
        g_lp, g_ent = upstream.grad_log_prob, upstream.grad_entropy
        if n_rows == 0 or (g_lp is None and g_ent is None):
            if dw is not None:
                dw.zero_()
            return dx, dw
        tokens = tokens.to(torch.int64).contiguous()
        blocks = _RowBlocks(hidden, shape.rows)
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
        chunk = None if fused else torch.empty((shape.rows, seg_len), dtype=torch.float32, device=hidden.device)
        held = saved.held if fused else None
        for s, seg_lo, seg in _segments(shard, v_local):
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
                    if held is not None and g0 == 0:  # the held rows (the first group's first): from their probs
                        lo = held.rows
                        self._held_dlogits(held, s, hidden, w_s, tokens, seg, saved, upstream, dl)
                    if lo < stop:  # the forward's GEMM tiles again, the gradient in their epilogue
                        rs = slice(lo, stop)
                        recompute.dlogits(hidden[rs], w_s, tokens[rs], seg, *_backward_rows(saved, upstream, rs),
                                          dl[lo - g0:stop - g0])
                else:
                    for b in range(g0_block, min(g0_block + blocks_per_group, blocks.count)):
                        r0, n, x = blocks.block(b)
                        mm_fp32(x, w_s.T, chunk)  # the forward's chunk GEMM: the same logits, bit for bit
                        rs = slice(r0, r0 + n)
                        self.passes.dlogits(chunk, n, tokens[rs], seg, *_backward_rows(saved, upstream, rs),
                                            dl[r0 - g0:r0 - g0 + n])
                m = min(group_rows, n_rows - g0)
                part = dl[:m]
                if need_dx:
                    addmm_fp32(dx[g0:g0 + m], part, w_s)
                if need_dw:
                    if one_group:
                        mm_rounded(part.T, hidden[g0:g0 + m], dw[seg_lo:seg_lo + seg_len])
                    elif g0 == 0:
                        mm_fp32(part.T, hidden[g0:g0 + m], dw_acc)
                    else:
                        addmm_fp32(dw_acc, part.T, hidden[g0:g0 + m])
            if dw_acc is not None:
                dw[seg_lo:seg_lo + seg_len].copy_(dw_acc)
        return dx, dw

    def _held_dlogits(self, held: HeldProbs, s: int, hidden, w_s, tokens, seg: ShardOptions, saved: LinearSaved,
                      upstream: UpstreamGrads, dl) -> None:
        """dl[:held.rows] = segment s's dlogits of the held rows, from the probabilities the forward held (read
        only: a second backward finds them unchanged)."""
        rs = slice(0, held.rows)
        self.passes.token_loss_pass.dlogits(
            held.probs[s:s + 1], held.tiles[s:s + 1], held.rows, hidden[rs], w_s, tokens[rs], seg,
            *_backward_rows(saved, upstream, rs), dl.dtype, out=dl[None, :held.rows])

    # -- the token loss --

    def loss_forward(self, hidden, weight, tokens, shard: ShardOptions, with_entropy: bool, hooks: LossHooks,
                     need_dx: bool, need_dw: bool) -> Optional[torch.Tensor]:
        n_rows, width = hidden.shape
        v_local = weight.shape[0]
        segments = list(_segments(shard, v_local))
        if n_rows == 0:
            return torch.zeros((v_local, width), dtype=torch.float32, device=hidden.device) if need_dw else None
        tokens = tokens.to(torch.int64).contiguous()
        if self.loss_keeps_probs(hidden, weight):
            return self._loss_blocks_by_probs(hidden, weight, tokens, shard, with_entropy, hooks, segments, need_dx,
                                              need_dw)
        dw_acc = _accumulator(weight, segments) if need_dw else None
        grads = _Gradients(weight, segments, hooks, dw_acc, need_dx)
        self._loss_blocks_by_chunks(hidden, weight, tokens, shard, with_entropy, hooks, grads, need_dx or need_dw)
        return dw_acc

    def loss_keeps_probs(self, hidden, weight) -> bool:
        """Whether the token loss takes the one-GEMM blocks (fp16 probabilities) on these operands; else chunk
        blocks."""
        return self.passes.token_loss_pass is not None and self.passes.one_gemm_recompute.applies(hidden, weight)

    def loss_blocks(self, n_rows: int, width: int, seg_len: int, device: torch.device) -> tuple:
        """(rows per block, rows held per block, one block) of the one-GEMM blocks for n_rows kept rows."""
        block_m = self.passes.one_gemm_forward.config().block_m
        held = _round_up(n_rows, block_m)
        if one_prob_block(n_rows, held, width, seg_len, device):
            return n_rows, held, True
        rows = prob_block_rows(width, seg_len, device)
        return rows, min(rows, held), False

    def _loss_blocks_by_probs(self, hidden, weight, tokens, shard, with_entropy, hooks, segments, need_dx,
                              need_dw) -> Optional[torch.Tensor]:
        """One-GEMM blocks: the forward GEMM keeps each logit as an fp16 probability within its tile, the pass turns
        them into dlogits in place (2 bytes per logit). Returns dW: finished, in the input dtype, where every row is
        one block; else its fp32 accumulator."""
        n_rows, width = hidden.shape
        v_local, seg_len = weight.shape[0], shard.seg_len
        n_seg = v_local // seg_len
        rows, held, one = self.loss_blocks(n_rows, width, seg_len, hidden.device)
        forward = self.passes.one_gemm_forward
        if not (need_dx or need_dw):  # values only: the same blocks (the same loss sum), no probabilities kept
            for r0 in range(0, n_rows, rows):
                rs = slice(r0, min(n_rows, r0 + rows))
                hooks.block_grads(hooks.merge(forward.forward_partials(hidden[rs], weight, tokens[rs], shard,
                                                                       with_entropy)), rs.start, rs.stop)
            return None
        # vocabulary-major ([n_seg, seg_len, B] in memory, used as its [n_seg, B, seg_len] view): dW's GEMMs read
        # their dl^T operand K-major, which cuBLAS runs faster than the row-major buffer, with the same bits for dX
        # and dW (docs/performance.md, run M1)
        storage = torch.empty(n_seg * seg_len * held, dtype=torch.float16, device=hidden.device)
        probs = storage.view(n_seg, seg_len, held).transpose(1, 2)
        dw = None
        if need_dw and one:
            dw = (storage.view(hidden.dtype)[:v_local * width].view(v_local, width) if dw_in_probs(held, width)
                  else torch.empty((v_local, width), dtype=hidden.dtype, device=hidden.device))
        elif need_dw:
            dw = _accumulator(weight, segments)
        grads = _Gradients(weight, segments, hooks, dw, need_dx, finished=one)
        for r0 in range(0, n_rows, rows):
            n = min(rows, n_rows - r0)
            rs = slice(r0, r0 + n)
            x = hidden[rs]
            parts, tiles = forward.forward_probs(x, weight, tokens[rs], shard, with_entropy, probs)
            stats = hooks.merge(parts)
            up = hooks.block_grads(stats, r0, r0 + n)
            g_lp, g_ent = up.grad_log_prob, up.grad_entropy
            if g_lp is None and g_ent is None:  # the loss does not depend on these rows: zero gradient
                dl = probs.view(hidden.dtype)
                dl[:, :n].zero_()
            else:
                dl = self.passes.token_loss_pass.dlogits(
                    probs, tiles, n, x, weight, tokens[rs], shard,
                    BackwardStats(stats.shift, stats.log_sum, None, stats.mean_shifted if g_ent is not None else None),
                    UpstreamGrads(g_lp, g_ent), hidden.dtype)
            grads.add_block(dl, r0, n, x)
        return dw

    def _loss_blocks_by_chunks(self, hidden, weight, tokens, shard, with_entropy, hooks, grads, need_grad) -> None:
        """Chunk blocks: per block of loss_rows rows its fp32 logits over every local segment (GEMM into a held
        chunk), the logits op's partials and gradient passes; dW every loss_dw_rows rows."""
        v_local, seg_len = weight.shape[0], shard.seg_len
        n_seg = v_local // seg_len
        shape = chunk_shape(hidden.device)
        device = hidden.device
        blocks = _RowBlocks(hidden, shape.loss_rows)
        logits = torch.empty((n_seg, shape.loss_rows, seg_len), dtype=torch.float32, device=device)
        parts = torch.empty((n_seg, row_stats.NUM_PARTIALS, shape.loss_rows), dtype=torch.float32, device=device)
        group_rows = min(shape.loss_dw_rows, blocks.count * shape.loss_rows)
        dl = torch.empty((n_seg, group_rows, seg_len), dtype=hidden.dtype, device=device) if need_grad else None
        for s, _seg_lo, seg in grads.segments:
            if seg.n_valid == 0:
                _neutral(parts[s])
        blocks_per_group = shape.loss_dw_rows // shape.loss_rows
        for b in range(blocks.count):
            r0, n, x = blocks.block(b)
            rs = slice(r0, r0 + n)
            for s, seg_lo, seg in grads.segments:
                if seg.n_valid:
                    mm_fp32(x, weight[seg_lo:seg_lo + seg_len].T, logits[s])
                    self.passes.partials(logits[s], n, tokens[rs], seg, with_entropy, parts[s])
            stats = hooks.merge(parts[:, :, :n])
            up = hooks.block_grads(stats, r0, r0 + n)
            if not need_grad:
                continue
            g_lp, g_ent = up.grad_log_prob, up.grad_entropy
            offset = (b % blocks_per_group) * shape.loss_rows
            if g_lp is None and g_ent is None:  # the loss does not depend on these rows: zero gradient
                dl[:, offset:offset + n].zero_()
            else:
                for s, _seg_lo, seg in grads.segments:
                    if seg.n_valid:
                        self.passes.dlogits(logits[s], n, tokens[rs], seg,
                                            BackwardStats(stats.shift, stats.log_sum, None,
                                                          stats.mean_shifted if g_ent is not None else None),
                                            UpstreamGrads(g_lp, g_ent), dl[s, offset:offset + n])
            grads.add_dx(dl[:, offset:offset + n], r0, n)
            if (b + 1) % blocks_per_group == 0 or b + 1 == blocks.count:
                g0 = (b // blocks_per_group) * shape.loss_dw_rows
                grads.add_dw(dl, r0 + n - g0, hidden[g0:r0 + n])


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

    On CUDA a block's dW GEMMs run on a side stream beside its dX GEMMs (both only read dl): dW's traffic then
    overlaps dX's mainloop (measured in docs/performance.md, "The fused LM head"). The current stream waits for the
    side one before the next block overwrites dl. Where dW lies in dl's storage, segment s's dW GEMM first waits for
    the dX GEMMs of the segments it overwrites (events on the current stream). Each GEMM's inputs, shape and
    algorithm are the same wherever its output lies, so are its bits."""

    def __init__(self, weight, segments, hooks: LossHooks, dw, need_dx: bool, finished: bool = False):
        self.weight, self.segments, self.hooks, self.dw = weight, segments, hooks, dw
        self.seg_len = weight.shape[0] // len(segments)
        self.need_dx, self.finished = need_dx, finished
        self.dx_block = None  # fp32 [rows, H], allocated for the first (largest) block
        self.started = [False] * len(segments)
        both = need_dx and dw is not None and weight.is_cuda
        self.side = torch.cuda.Stream(device=weight.device) if both else None

    def add_block(self, dl, r0: int, n: int, x) -> None:
        if self.finished:
            self._add_finished(dl, r0, n, x)
            return
        if self.side is None:
            self.add_dx(dl, r0, n)
            self.add_dw(dl, n, x)
            return
        main = torch.cuda.current_stream(self.weight.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            self.add_dw(dl, n, x)
        self.add_dx(dl, r0, n)
        main.wait_stream(self.side)

    def _dx_rows(self, n: int) -> torch.Tensor:
        if self.dx_block is None or self.dx_block.shape[0] < n:
            self.dx_block = torch.empty((n, self.weight.shape[1]), dtype=torch.float32, device=self.weight.device)
        return self.dx_block[:n]

    def _dx_segment(self, out, dl_s, s: int, first: bool) -> None:
        w_s = self.weight[s * self.seg_len:(s + 1) * self.seg_len]
        if first:
            mm_fp32(dl_s, w_s, out)
        else:
            addmm_fp32(out, dl_s, w_s)

    def add_dx(self, dl, r0: int, n: int) -> None:
        if not self.need_dx:
            return
        out = self._dx_rows(n)
        contributed = False
        for s, _seg_lo, seg in self.segments:
            if seg.n_valid:
                self._dx_segment(out, dl[s, :n], s, first=not contributed)
                contributed = True
        if not contributed:
            out.zero_()
        self.hooks.finish_dx(out, r0, r0 + n)

    def add_dw(self, dl, m: int, x) -> None:
        """dW_s (+)= dl[s, :m]^T @ x (x: the m rows of hidden)."""
        if self.dw is None:
            return
        for s, seg_lo, seg in self.segments:
            if seg.n_valid == 0:
                continue
            acc = self.dw[seg_lo:seg_lo + self.seg_len]
            if self.started[s]:
                addmm_fp32(acc, dl[s, :m].T, x)
            else:
                mm_fp32(dl[s, :m].T, x, acc)
                self.started[s] = True

    def _add_finished(self, dl, r0: int, n: int, x) -> None:
        """The one block: per segment dX_s (current stream) and dW_s = dl_s^T x in the input dtype (side stream)."""
        dw, seg_len = self.dw, self.seg_len
        shared = dw is not None and dw.untyped_storage().data_ptr() == dl.untyped_storage().data_ptr()
        slab = dl.stride(0)  # elements per segment of dl's storage
        main = torch.cuda.current_stream(self.weight.device) if self.side is not None else None
        if main is not None:
            self.side.wait_stream(main)
        out = self._dx_rows(n) if self.need_dx else None
        read = {}  # segment -> event after its dX GEMM (the side stream)
        late = []  # (dW rows, temporary): dW rows over dlogits not read yet when their GEMM ran
        contributed = False
        for s, seg_lo, seg in self.segments:
            if seg.n_valid == 0:
                continue
            if out is not None:
                self._dx_segment(out, dl[s, :n], s, first=not contributed)
                contributed = True
                if main is not None:
                    read[s] = torch.cuda.Event()
                    read[s].record(main)
            if dw is None:
                continue
            target = dw[seg_lo:seg_lo + seg_len]
            # the highest segment of dl whose storage these dW rows cover (-1: none)
            covers = ((s + 1) * seg_len * dw.shape[1] - 1) // slab if shared else -1
            if covers >= s:  # over dlogits not read yet (the first segment's own): a temporary, copied in below
                late.append((target, torch.empty_like(target)))  # allocated on the current stream
                target, covers = late[-1][1], -1
            with torch.cuda.stream(self.side) if main is not None else contextlib.nullcontext():
                waits = [k for k in read if k <= covers]
                if main is not None and waits:
                    self.side.wait_event(read[max(waits)])  # dX has read every segment these rows cover
                mm_rounded(dl[s, :n].T, x, target)
        if out is not None:
            if not contributed:
                out.zero_()
            self.hooks.finish_dx(out, r0, r0 + n)
        if main is not None:
            main.wait_stream(self.side)
        for target, temp in late:  # every dlogit read by now
            target.copy_(temp)
        if dw is not None:
            for _s, seg_lo, seg in self.segments:
                if seg.n_valid == 0:
                    dw[seg_lo:seg_lo + seg_len].zero_()  # padding only: no gradient


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def tile_logits(hidden: torch.Tensor, weight: torch.Tensor, seg_len: int) -> torch.Tensor:
    """[R, V_local] fp32 logits made by exactly the chunks' GEMMs (tests and comparisons: the op never holds them)."""
    n_rows, v_local = hidden.shape[0], weight.shape[0]
    shape = chunk_shape(hidden.device)
    blocks = _RowBlocks(hidden.contiguous(), shape.rows)
    out = torch.empty((blocks.count * shape.rows, v_local), dtype=torch.float32, device=hidden.device)
    chunk = torch.empty((shape.rows, seg_len), dtype=torch.float32, device=hidden.device)
    for b in range(blocks.count):
        r0, n, x = blocks.block(b)
        for seg_lo in range(0, v_local, seg_len):
            mm_fp32(x, weight[seg_lo:seg_lo + seg_len].T, chunk)
            out[r0:r0 + shape.rows, seg_lo:seg_lo + seg_len] = chunk
    return out[:n_rows]


_BACKENDS = {}


def backend(passes: str) -> ChunkedBackend:
    """The chunked backend over the logits op's "triton" or "torch" passes (one instance each)."""
    if passes not in _BACKENDS:
        _BACKENDS[passes] = ChunkedBackend(_TritonPasses() if passes == "triton" else _TorchPasses())
    return _BACKENDS[passes]
