"""The sparse keep set's data types, shared by core/sparse_keep.py (checks, entries, statistics, gradient terms) and
core/sparse_keep_kernels.py (their Triton kernels), so that neither module imports the other."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch


@dataclasses.dataclass(frozen=True)
class SparseKeep:
    """A keep set that passed the local checks: int64, contiguous, on the op's device."""

    ids: torch.Tensor  # [nnz] global token ids
    offsets: torch.Tensor  # [rows + 1]


@dataclasses.dataclass(frozen=True)
class KeepShard:
    """The vocabulary a call's entries are formed against: the true size, the global (padded) size and this rank's
    shard, global ids vocab_start .. vocab_start + n_valid - 1."""

    vocab_size: int
    v_global: int
    vocab_start: int
    n_valid: int

    @classmethod
    def of(cls, plan) -> "KeepShard":
        """The shard of a call's Plan (core/shell.py)."""
        return cls(plan.layout.vocab_size, plan.layout.v_global, plan.shard.vocab_start, plan.shard.n_valid)


class FullStats(NamedTuple):
    """The full-vocabulary statistics the logits op's kept entries' gradient reads besides the keep set's: the
    upstream entropy gradient, the shift, log-sum and mean shifted logit per row (entropy unused: g_ent None)."""

    g_ent: Optional[torch.Tensor]
    shift: torch.Tensor
    log_sum: torch.Tensor
    mean: Optional[torch.Tensor]


@dataclasses.dataclass
class Entries:
    """A call's keep entries over its R rows (compacted rows for the LM head with a row mask): the ids part in CSR
    order, E = n_ids + R entries, then one target entry per row (entry n_ids + r)."""

    n_ids: int
    n_rows: int
    row: torch.Tensor  # [E] int64 row of each entry (valid as an index even where `ok` is False)
    gid: torch.Tensor  # [E] int64 global id, clamped to [-1, V_global]
    ok: torch.Tensor  # [E] bool: the entry is in its keep row's set (first of its (row, id), a valid id)
    local: torch.Tensor  # [E] bool: ok, and the id is in this rank's shard
    col: torch.Tensor  # [E] int64 the id's local column (the weight's row), clamped into the shard
    order: Optional[torch.Tensor]  # [E] int64 entries sorted by (id, row), targets first among equal (id, row)
    #   (the torch path puts the entries that cannot count first); None from the logits op's kernel path, which needs
    #   no order
    offsets: torch.Tensor  # [T + 1] the CSR (the torch path's made monotone), T the call's rows
    rows: Optional[torch.Tensor]  # [R] the call's row of each of the R rows, or None (the same rows)
    row_mask: Optional[torch.Tensor]  # [T] the call's row mask where rows are not compacted, or None
    vocab_start: int  # this rank's shard: global ids vocab_start .. vocab_start + n_valid - 1
    n_valid: int
    row_start: Optional[torch.Tensor] = None  # [R] the torch path's CSR ranges of the R rows
    row_end: Optional[torch.Tensor] = None
    keep_row: Optional[torch.Tensor] = None  # [R] the torch path's keep rows (the kernel path's come with the sums)


@dataclasses.dataclass
class KeepState:
    """What a call with `keep` holds from forward to backward: the entries, their kept logits and per-row
    statistics over the keep sets (all O(ids + rows))."""

    ent: Entries
    z: torch.Tensor  # [E] fp32 kept logits (after the exchange: every rank holds all)
    shift: torch.Tensor  # [R] M, the max over the keep set (0 where none is finite)
    log_sum: torch.Tensor  # [R] log S (0 where S == 0)
    defined: torch.Tensor  # [R] bool: keep row whose set has mass
    keep_row: torch.Tensor  # [R] bool: the row has a keep set (and is not dropped)
    log_prob: torch.Tensor  # [R] fp32 keep log-probs (valid where keep_row)
    inv_temperature: float
    kernels: bool  # Triton kernels (CUDA, or the interpreter under a Triton backend) or torch ops

    @property
    def local(self) -> torch.Tensor:
        return self.ent.local

    @property
    def col(self) -> torch.Tensor:
        return self.ent.col
