"""The parts of ppo_ops below its public API that the LM-head bench measures: the switch between the fused head's two
half-precision paths, and the chunked path's pieces (its GEMMs, its passes, its chunk shape). Every other bench module
uses the public `ppo_ops` API only, so a change of ppo_ops' internal layout is followed here alone.
"""

from __future__ import annotations

import contextlib
import dataclasses

from ppo_ops.core import shell
from ppo_ops.core.contracts import BackwardStats, ShardOptions, UpstreamGrads
from ppo_ops.lm_head import chunked

# The chunked path's row-block shape (rows, dw_rows, loss_rows, loss_dw_rows).
DEFAULT_CHUNK_SHAPE = chunked.CUDA_SHAPE


@contextlib.contextmanager
def half_precision_path(path: str):
    """The fused head's half-precision path while the block runs: "chunked" (cuBLAS GEMMs on fixed-shape chunks, the
    default) or "triton-gemm" (its Triton GEMM kernels)."""
    before = shell.HALF_PRECISION_PATH
    shell.HALF_PRECISION_PATH = path
    try:
        yield
    finally:
        shell.HALF_PRECISION_PATH = before


@contextlib.contextmanager
def chunk_shape(**fields):
    """The chunked path's row-block shape with `fields` replaced while the block runs."""
    before = chunked.CUDA_SHAPE
    chunked.CUDA_SHAPE = dataclasses.replace(before, **fields)
    try:
        yield
    finally:
        chunked.CUDA_SHAPE = before


def triton_passes():
    """The logits op's Triton passes as the chunked path calls them (partials, dlogits)."""
    return chunked.backend("triton").passes


def dlogits_inputs(vec, g):
    """(BackwardStats, UpstreamGrads) of the dlogits pass: every row statistic `vec`, both upstream gradients `g`."""
    return BackwardStats(shift=vec, log_sum=vec, log_sum_kept=None, mean_shifted=vec), UpstreamGrads(g, g)


def shard(vocab: int, seg_len: int) -> ShardOptions:
    """A whole-vocabulary shard (TP = 1) cut into segments of seg_len columns, temperature 1."""
    return ShardOptions(inv_temperature=1.0, n_valid=vocab, seg_len=seg_len, vocab_start=0)


# The chunked path's GEMMs: out = a @ b in fp32; acc += a @ b in fp32; out = a @ b rounded to out's dtype.
mm_fp32 = chunked.mm_fp32
addmm_fp32 = chunked.addmm_fp32
mm_rounded = chunked.mm_rounded
