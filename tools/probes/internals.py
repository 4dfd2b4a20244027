"""The parts of ppo_ops below its public API that tools/probes/lm_head_pieces.py times: the segment-GEMM backend's
chunk-path pieces (its GEMMs, its passes, its chunk shape). The bench itself uses the public `ppo_ops` API only, so a
change of ppo_ops' internal layout is followed here alone. Not a program: imported by the pieces probe.
"""

from __future__ import annotations

import contextlib
import dataclasses

from ppo_ops.core.contracts import BackwardStats, ShardOptions, UpstreamGrads
from ppo_ops.lm_head import gemms, paths, segment_gemms

# The chunk path's row shape (block_rows, group_rows, loss_block_rows, loss_group_rows: docs/lm_head.md's glossary).
DEFAULT_CHUNK_SHAPE = paths.CUDA_SHAPE


@contextlib.contextmanager
def chunk_shape(**fields):
    """The chunk path's row-block shape with `fields` replaced while the block runs."""
    before = paths.CUDA_SHAPE
    paths.CUDA_SHAPE = dataclasses.replace(before, **fields)
    try:
        yield
    finally:
        paths.CUDA_SHAPE = before


def triton_passes():
    """The logits op's Triton passes as the chunk path calls them (partials, dlogits)."""
    return segment_gemms.backend("triton").passes


def dlogits_inputs(vec, g):
    """(BackwardStats, UpstreamGrads) of the dlogits pass: every row statistic `vec`, both upstream gradients `g`."""
    return BackwardStats(shift=vec, log_sum=vec, log_sum_kept=None, mean_shifted=vec), UpstreamGrads(g, g)


def shard(vocab: int, seg_len: int) -> ShardOptions:
    """A whole-vocabulary shard (TP = 1) cut into segments of seg_len columns, temperature 1."""
    return ShardOptions(inv_temperature=1.0, n_valid=vocab, seg_len=seg_len, vocab_start=0)


# The chunk path's GEMMs: out = a @ b in fp32; acc += a @ b in fp32; out = a @ b rounded to out's dtype.
mm_fp32 = gemms.mm_fp32
addmm_fp32 = gemms.addmm_fp32
mm_rounded = gemms.mm_rounded
