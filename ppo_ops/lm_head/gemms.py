"""The GEMM pieces the segment-GEMM backend's general op (segment_gemms.py) and its token loss (token_loss_blocks.py)
share: the library's GEMMs with fp32 accumulation, the kept rows as fixed-shape blocks, the local segments, and the
row counts the dX / dW GEMMs run on. Words (block, chunk, group, segment): lm_head/paths.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from ppo_ops.core import row_stats
from ppo_ops.core.contracts import ShardOptions
from ppo_ops.lm_head.paths import HALF, block_shape, round_up


# ---- GEMMs: the library's, fp32 accumulation ----

def mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out (fp32) = a @ b. Half precision on CUDA: cuBLAS with fp32 accumulation and fp32 output (mm's out_dtype);
    elsewhere an fp32 matmul of the upcast operands (bf16 / fp16 products are exact in fp32)."""
    if a.is_cuda and a.dtype in HALF:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b, accumulating into the fp32 buffer (addmm's out_dtype on CUDA)."""
    if a.is_cuda and a.dtype in HALF:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def mm_rounded(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out (a's dtype) = a @ b, fp32 accumulation inside the GEMM, one rounding."""
    if a.is_cuda:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a.float(), b.float()))


# dX and dW GEMMs run on a row count rounded up to a multiple of GEMM_ROW_MULTIPLE, the extra dlogits rows zero: their
# vocabulary-major dlogits operand has the rows as its contiguous dimension, and with a row count that is not a
# multiple of 8 (16 bytes of bf16; a row mask's count, the last position dropped) cuBLAS falls back to 1-element
# aligned kernels, measured 6x slower on an H200 (docs/performance.md). The zero rows add exact zeros: dX's extra rows
# are dropped, dW's sums are unchanged in value (their bits are those of the padded shape, the same on every rank).
GEMM_ROW_MULTIPLE = 8


def gemm_rows(n: int) -> int:
    return round_up(n, GEMM_ROW_MULTIPLE)


def gemm_operand_rows(x: torch.Tensor, n_gemm: int) -> torch.Tensor:
    """x [n, H] as a GEMM's [n_gemm, H] operand: x itself when n == n_gemm, else x followed by zero rows."""
    n = x.shape[0]
    if n == n_gemm:
        return x
    out = x.new_zeros((n_gemm, x.shape[1]))
    out[:n].copy_(x)
    return out


# ---- blocks and segments ----

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
        return self.span(r0, min(self.rows, self.hidden.shape[0] - r0))

    def span(self, r0: int, n: int):
        """(r0, n, [rows, H] block) of the n <= rows rows from r0: the same fixed shape for a block of any start
        (the token loss's sequence schedule cuts its blocks at sequence ends)."""
        if n == self.rows and self.aligned:
            return r0, n, self.hidden[r0:r0 + n]
        if self._pad is None:
            self._pad = torch.zeros((self.rows, self.hidden.shape[1]), dtype=self.hidden.dtype,
                                    device=self.hidden.device)
        elif n < self.rows:
            self._pad[n:].zero_()
        self._pad[:n].copy_(self.hidden[r0:r0 + n])
        return r0, n, self._pad


def segments(shard: ShardOptions, v_local: int):
    """(segment index, first local column, the segment's ShardOptions) of this shard, in order."""
    for s, seg_lo in enumerate(range(0, v_local, shard.seg_len)):
        yield s, seg_lo, shard.segment(seg_lo)


def neutral_partials(out: torch.Tensor) -> None:
    """Partials of a segment with no real column (vocabulary padding): neutral under the merge."""
    out.zero_()
    out[..., row_stats.MAX, :] = float("-inf")
    out[..., row_stats.TARGET_Z, :] = float("-inf")


def rows_of(t: Optional[torch.Tensor], rows: slice) -> Optional[torch.Tensor]:
    return None if t is None else t[rows]


def tile_logits(hidden: torch.Tensor, weight: torch.Tensor, seg_len: int) -> torch.Tensor:
    """[R, V_local] fp32 logits made by exactly the chunk GEMMs (tests and comparisons: the op never holds them)."""
    n_rows, v_local = hidden.shape[0], weight.shape[0]
    rows = block_shape(hidden.device).block_rows
    blocks = RowBlocks(hidden.contiguous(), rows)
    out = torch.empty((blocks.count * rows, v_local), dtype=torch.float32, device=hidden.device)
    chunk = torch.empty((rows, seg_len), dtype=torch.float32, device=hidden.device)
    for b in range(blocks.count):
        r0, n, x = blocks.block(b)
        for seg_lo in range(0, v_local, seg_len):
            mm_fp32(x, weight[seg_lo:seg_lo + seg_len].T, chunk)
            out[r0:r0 + rows, seg_lo:seg_lo + seg_len] = chunk
    return out[:n_rows]
