"""The sequence schedule's row blocks: the token loss's blocks cut at sequence ends.

`linear_token_loss` with a loss of scope "sequence" (ppo_ops.sequence_losses: GSPO, GMPO, and with them the
sequence-level rollout corrections) on the segment-GEMM paths (loss_one_block, loss_blocks, loss_chunk_blocks) walks
its kept rows in blocks of at most the path's `block_rows`, as the row schedule does, but ends each block at a
sequence end, so that the loss sees every sequence whole and forms its statistic (GSPO's length-normalised ratio,
GMPO's geometric mean) and its gradient from the block's own log-probs, in the one forward.

The cut, from the sequence id of each kept row in the call's row order (a run: consecutive kept rows of one id):

    in block    a sequence that is one run of at most block_rows rows: it lies in one block, never cut.
    recomputed  a sequence of more than block_rows rows, or whose rows are not consecutive (two runs or more): its
                rows get a statistics pass of their own (the forward without gradients over those rows only) and the
                loss frozen there serves them (SequenceLoss.partly_frozen); its rows may be cut anywhere.
    free        a sequence with no counted row (every loss_mask weight 0): its rows add nothing and may be cut anywhere.

Blocks are packed greedily in row order: a block takes whole in-block sequences while it holds at most block_rows
rows and closes before the first one that would not fit; recomputed and free rows fill it up to block_rows. Every
block then holds at most block_rows rows (the path's buffers are sized for those), and the cut is a function of the
ids, the counted rows and block_rows only: every rank that holds the same loss cuts the same blocks (at TP > 1 with
validate the ranks compare their cuts before any other collective: `summary`).

Packed streams (sequences one after another) have one run per sequence, so only sequences longer than a block are
recomputed. Where every row is one block (loss_one_block, or fewer kept rows than block_rows) nothing is cut and
nothing read; otherwise the ids come to the host once (one host read).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class SequenceBlocks:
    """The cut: `bounds` (r0, r1) of each block over the kept rows, in order; `recompute` [n_kept] bool (CPU), the
    kept rows whose sequence is recomputed (None: none is)."""

    bounds: tuple
    recompute: Optional[torch.Tensor]

    @property
    def recomputed_rows(self) -> int:
        return 0 if self.recompute is None else int(self.recompute.sum())


def cut(seq_ids: torch.Tensor, counted: torch.Tensor, block_rows: int) -> SequenceBlocks:
    """The blocks of kept rows with sequence ids `seq_ids` ([n] int64 on the CPU, the call's row order) and
    `counted` ([n] bool, rows with a loss weight) for blocks of at most block_rows rows (module docstring)."""
    n = int(seq_ids.shape[0])
    if n <= block_rows:  # one block holds every sequence whole, whatever the order
        return SequenceBlocks(bounds=((0, n),) if n else (), recompute=None)
    change = torch.ones(n, dtype=torch.bool)
    change[1:] = seq_ids[1:] != seq_ids[:-1]
    starts = torch.nonzero(change).squeeze(1)
    ends = torch.cat((starts[1:], torch.tensor([n])))
    run_ids = seq_ids[starts]
    ids, runs_per_id = torch.unique(run_ids, return_counts=True)
    live = torch.isin(run_ids, torch.unique(seq_ids[counted]))
    split = torch.isin(run_ids, ids[runs_per_id > 1])
    recompute_run = (split | (ends - starts > block_rows)) & live
    cuttable = recompute_run | ~live  # recomputed or free: cut anywhere
    bounds = []
    b0 = 0
    # Invariant: every row of the block [b0, s) before the run [s, e) fits, s - b0 <= block_rows.
    for s, e, anywhere in zip(starts.tolist(), ends.tolist(), cuttable.tolist()):
        if anywhere:
            while e - b0 > block_rows:  # b0 + block_rows >= s: the cut falls within this run
                bounds.append((b0, b0 + block_rows))
                b0 += block_rows
        elif e - b0 > block_rows:  # the whole sequence goes to the next block (e - s <= block_rows, s > b0)
            bounds.append((b0, s))
            b0 = s
    bounds.append((b0, n))
    recompute = torch.repeat_interleave(recompute_run, ends - starts)
    return SequenceBlocks(bounds=tuple(bounds), recompute=recompute if bool(recompute.any()) else None)


def summary(blocks: Optional[SequenceBlocks], error: int = 0) -> list:
    """Four ints that ranks compare before cutting: a local error code (0: none), the block count, and checksums
    (CRC-32) of the block ends and of the recomputed rows."""
    if blocks is None:
        return [error, 0, 0, 0]
    ends = ",".join(str(r1) for _, r1 in blocks.bounds).encode()
    recompute = b"" if blocks.recompute is None else bytes(blocks.recompute.to(torch.uint8).tolist())
    return [error, len(blocks.bounds), zlib.crc32(ends), zlib.crc32(recompute)]
