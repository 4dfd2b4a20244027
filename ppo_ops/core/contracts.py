"""The backend contract: what the autograd Function (ppo_ops/_function.py) asks of a backend, as types.

Two backends implement `Backend`: `_torch_backend.TorchBackend` (any device; the CPU path) and
`_triton_backend.TritonBackend` (CUDA, or CPU under TRITON_INTERPRET=1). Per call the Function asks for

    forward_partials(inputs, shard, with_entropy) -> [V_local // seg_len, 5, T] fp32 partials per segment
        (channels in _row_stats.py), for every row: a dropped row (row_mask False) gets the neutral partials of
        _row_stats.empty_partials, its logits never read. A row's target column is tokens - vocab_start when in
        [0, V_local), else another rank holds it (_layout.target_columns; the Triton kernels form it in-kernel).
    merge_partials(partials [segments, 5, T] in global segment order, has_keep_mask) -> RowStats over all T rows,
        merged in segment order (the order fixes the bits); the Triton backend does it in one launch.
    backward_grad(inputs, shard, stats: BackwardStats, upstream, out) -> None: writes every row of `out` (dropped rows get 0, their
        logits never read); `out` may be the logits themselves (inplace_grad). The upstream log-prob gradient counts
        as 0 where stats.log_prob_defined is False (the log-prob is -inf: its kept set has no mass), the entropy's
        where stats.row_has_mass is False, whatever they hold.

With d = z - shift: log p = d - log_sum, q = 1[keep ∪ target] e^(d - log_sum_kept) (q = p without a keep mask),
grad = inv_temperature * (g_lp * (onehot - q) + g_ent * p * (mean_shifted - d)); padding columns and entries with
p == 0 get no entropy term (never 0 * inf). All statistics are global (merged over the TP ranks).

A dropped row's token and per-row values are unspecified (its token may be junk such as -100); backends ignore them.
The row mask crosses as a mask, not an index list: building one (nonzero) is a host sync on CUDA.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, runtime_checkable

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class RowInputs:
    """The tensors a backend reads, flattened to rows."""

    logits: torch.Tensor  # [T, V_local] fp32/bf16/fp16, READ-ONLY (written only as `out` with inplace_grad)
    tokens: torch.Tensor  # [T] integer global token ids
    keep_mask: Optional[torch.Tensor]  # [T, V_local] bool, or None
    row_mask: Optional[torch.Tensor]  # [T] bool, or None (every row kept)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardOptions:
    """Everything but tensors that a backend needs about this rank's shard and the call."""

    inv_temperature: float  # 1 / temperature rounded to fp32 once: every backend multiplies by the same constant
    n_valid: int  # columns of this shard that are real vocabulary; the rest is padding
    seg_len: int  # columns per segment; V_local % seg_len == 0
    vocab_start: int  # global id of this shard's first column
    chunk_rows: Optional[int]  # rows per working chunk of the torch backend (None: automatic); ignored by Triton


@dataclasses.dataclass(frozen=True, slots=True)
class RowStats:
    """Per-row statistics over all T rows; a row the row mask drops has neutral partials, so it merges to a row
    without mass (log_prob -inf, everything else 0, both flags False)."""

    log_prob: torch.Tensor  # [T] fp32
    entropy: torch.Tensor  # [T] fp32 (zeros when not asked for)
    shift: torch.Tensor  # [T] M, the row max of z (0 where the row has no finite logit)
    log_sum: torch.Tensor  # [T] log Σ_valid e^(z - M) (0 where the row has no finite logit)
    log_sum_kept: Optional[torch.Tensor]  # [T] log Σ_{kept ∪ target} e^(z - M), or None without a keep mask
    mean_shifted: torch.Tensor  # [T] E_p[z] - M
    bad_input: torch.Tensor  # [T] bool: NaN or +inf logits reached the row (a kernel's max may skip NaN; the sum not)
    log_prob_defined: torch.Tensor  # [T] bool: the kept set has mass (else log_prob = -inf and its gradient is 0)
    row_has_mass: torch.Tensor  # [T] bool: some valid logit is finite (else entropy 0 and gradient 0)


@dataclasses.dataclass(frozen=True, slots=True)
class BackwardStats:
    """The part of RowStats that backward reads (saved by the forward, O(T))."""

    shift: torch.Tensor
    log_sum: torch.Tensor
    log_sum_kept: Optional[torch.Tensor]  # None without a keep mask
    mean_shifted: Optional[torch.Tensor]  # None unless entropy="grad"
    log_prob_defined: torch.Tensor
    row_has_mass: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class UpstreamGrads:
    """The gradients autograd brings back, fp32 [T] and contiguous, or None where an output gets none."""

    grad_log_prob: Optional[torch.Tensor]
    grad_entropy: Optional[torch.Tensor]  # None unless entropy="grad"


@runtime_checkable
class Backend(Protocol):
    name: str  # "torch" | "triton"
    needs_unit_column_stride: bool  # its kernels index columns contiguously (logits.stride(-1) == 1)

    def forward_partials(self, inputs: RowInputs, shard: ShardOptions, with_entropy: bool) -> torch.Tensor: ...

    def merge_partials(self, partials: torch.Tensor, has_keep_mask: bool) -> RowStats: ...

    def backward_grad(self, inputs: RowInputs, shard: ShardOptions, stats: BackwardStats, upstream: UpstreamGrads,
                      out: torch.Tensor) -> None: ...
