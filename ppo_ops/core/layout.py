"""Vocab-parallel layout: which slice of the global vocabulary this rank holds, and how it is cut into segments.

Rank r of the tensor-parallel group holds the global columns [r * V_local, (r + 1) * V_local). Row statistics are
computed per *segment*, a fixed partition of the global (padded) vocabulary that does not depend on the TP size:
eight equal segments when V_global is divisible by 8 and the TP size divides 8, otherwise one segment per rank. Each
segment is reduced by exactly the same code on whichever rank holds it, and segments are merged in global order, so
the result is bitwise identical at TP = 1, 2, 4 and 8 (and otherwise at least deterministic).

Resolving the layout issues no collective: `get_world_size` and `get_rank` (in checks.check_tp_group) are local
queries.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

# Fixed number of vocabulary segments (a power of two, so TP = 1, 2, 4, 8 each hold a whole number of them).
NUM_FIXED_SEGMENTS = 8


@dataclasses.dataclass(frozen=True)
class VocabLayout:
    group: Optional["dist.ProcessGroup"]  # None when single-rank (no collective is ever issued then)
    world_size: int
    rank: int
    v_local: int  # columns held by this rank
    vocab_size: int  # true global vocabulary; global columns >= vocab_size are padding
    seg_len: int  # columns per segment; v_local % seg_len == 0

    @property
    def v_global(self) -> int:
        return self.v_local * self.world_size

    @property
    def vocab_start(self) -> int:
        return self.rank * self.v_local

    @property
    def n_valid(self) -> int:
        """Columns of this shard that are real vocabulary (the rest is padding)."""
        return max(0, min(self.v_local, self.vocab_size - self.vocab_start))

    @property
    def segments_local(self) -> int:
        return self.v_local // self.seg_len


def segment_length(v_local: int, world_size: int) -> int:
    v_global = v_local * world_size
    if v_global % NUM_FIXED_SEGMENTS == 0 and NUM_FIXED_SEGMENTS % world_size == 0:
        return v_global // NUM_FIXED_SEGMENTS
    return v_local


def make_layout(group, world_size: int, rank: int, v_local: int, vocab_size: Optional[int]) -> VocabLayout:
    """The layout of a call on (group, world_size, rank) as checks.check_tp_group resolved them."""
    v_global = v_local * world_size
    return VocabLayout(
        group=group,
        world_size=world_size,
        rank=rank,
        v_local=v_local,
        vocab_size=v_global if vocab_size is None else int(vocab_size),
        seg_len=max(1, segment_length(v_local, world_size)),
    )


def target_columns(tokens: torch.Tensor, vocab_start: int, v_local: int) -> torch.Tensor:
    """Local column of each token's target in the shard [vocab_start, vocab_start + v_local), or -1 where another
    rank owns it (or the id is out of range). The Triton kernels compute the same in-kernel (_target_column)."""
    local = tokens.to(torch.int64) - vocab_start
    owned = (local >= 0) & (local < v_local)
    return torch.where(owned, local, torch.full_like(local, -1))
