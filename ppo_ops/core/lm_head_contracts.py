"""The LM head's backend contract, as types: what the two autograd Functions of the fused LM head
(ppo_ops/_linear_function.py: log-probs and entropy; ppo_ops/_linear_loss_function.py: a token loss with its gradient
formed in the forward) ask of a backend. The logits op meets its backends the same way (ppo_ops/_backend.py).

Three backends implement `LinearBackend`:
  _linear_torch.BACKEND     fixed fp32 tiles through torch.matmul and the logits op's PyTorch code (any device);
  _linear_triton.BACKEND    Triton GEMM-tile kernels with the softmax statistics fused in (fp32 inputs on CUDA);
  _linear_chunked.backend() library GEMMs (cuBLAS on CUDA; an fp32 matmul elsewhere) on fixed-shape chunks, with
                            the logits op's own passes (Triton, or PyTorch) over a bounded fp32 logits chunk: the
                            half-precision CUDA path, and the only one that also implements `FusedLossBackend`.

Per call the Functions ask for (rows are the kept rows, compacted; weight is this rank's [V_local, H] slice):

    forward_partials(hidden [R, H], weight, tokens [R], shard, with_entropy) -> [V_local // seg_len, 5, R] fp32:
        the logits op's five per-segment partials (channels in _row_stats.py) of z = (hidden @ weight.T) * inv_t,
        fp32 accumulation, columns >= n_valid padding. A segment's partials may not depend on V_local, the rank or
        the row count R (that is what makes the results TP- and row-count invariant).
    merge_partials(partials in global segment order) -> RowStats: the logits op's merge of the same kind.
    backward(hidden, weight, tokens, shard, saved, upstream, need_dx, need_dw) -> (dX fp32 [R, H] or None: this
        rank's contribution; dW [V_local, H] in weight's dtype or None). dlogits = inv_t * (g_lp * (onehot - p)
        + g_ent * p * (mean_shifted - d)), d = z - shift, p = exp(d - log_sum); the upstream gradients arrive zeroed
        where their quantity has none.

`FusedLossBackend` adds, for ppo_ops.linear_token_loss:

    loss_forward(hidden, weight, tokens, shard, with_entropy, hooks, need_dx, need_dw) -> dW or None: per row block,
        the block's logits over every local segment, their partials, `hooks.merge` (TP all-gather + merge: global
        RowStats of the block), `hooks.block_grads` (the caller's loss on those stats: upstream gradients of the
        block), dlogits, `hooks.finish_dx` (the block's fp32 dX rows, to be reduced and rounded by the caller) and
        dW accumulated in fp32 over the blocks, rounded once. The logits are formed once per row.

No backend issues a collective or reads a device value on the host: communication, validation and autograd stay in
the Functions.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from ppo_ops.core.contracts import RowStats, ShardOptions, UpstreamGrads


@dataclasses.dataclass(frozen=True, slots=True)
class LinearShard:
    """What a linear backend needs about this rank's vocabulary shard and the call, besides tensors."""

    inv_temperature: float  # 1 / temperature rounded to fp32 once (_validate.check_options)
    n_valid: int  # local columns that are real vocabulary; the rest is padding
    seg_len: int  # columns per fixed vocabulary segment (_layout.py); V_local % seg_len == 0
    vocab_start: int  # global id of this shard's first column

    def segment(self, seg_lo: int) -> ShardOptions:
        """The logits op's options for a chunk holding the local columns [seg_lo, seg_lo + seg_len) of this shard."""
        return ShardOptions(inv_temperature=self.inv_temperature,
                            n_valid=max(0, min(self.seg_len, self.n_valid - seg_lo)), seg_len=self.seg_len,
                            vocab_start=self.vocab_start + seg_lo, chunk_rows=None)


@dataclasses.dataclass(frozen=True, slots=True)
class LinearSaved:
    """The row statistics the backward reads (saved by the forward, O(R) fp32, sanitised: 0 where no mass)."""

    shift: torch.Tensor  # [R] row max M of z
    log_sum: torch.Tensor  # [R] log Σ e^(z - M)
    mean_shifted: Optional[torch.Tensor]  # [R] E_p[z] - M; None unless the entropy has a gradient


@dataclasses.dataclass(frozen=True, slots=True)
class BlockGrads:
    """What the caller's loss gives back for one row block: fp32 [n] upstream gradients of its log-probs and
    entropies (None: no gradient), already zero where the quantity has none."""

    grad_log_prob: Optional[torch.Tensor]
    grad_entropy: Optional[torch.Tensor]


@dataclasses.dataclass(frozen=True, slots=True)
class LossHooks:
    """The Function's side of loss_forward: communication, the caller's loss and the dX epilogue, per row block
    (rows r0 .. r1 of the kept rows)."""

    merge: Callable[[torch.Tensor], RowStats]  # [local segments, 5, n] partials -> global RowStats of the block
    block_grads: Callable[[RowStats, int, int], BlockGrads]  # (stats, r0, r1) -> upstream gradients
    finish_dx: Callable[[torch.Tensor, int, int], None]  # (fp32 [n, H] dX rows of this rank, r0, r1)


@runtime_checkable
class LinearBackend(Protocol):
    name: str  # "torch" | "triton" | "chunked-triton" | "chunked-torch"

    def forward_partials(self, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                         shard: LinearShard, with_entropy: bool) -> torch.Tensor: ...

    def merge_partials(self, partials: torch.Tensor) -> RowStats: ...

    def backward(self, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, shard: LinearShard,
                 saved: LinearSaved, upstream: UpstreamGrads, need_dx: bool, need_dw: bool) -> tuple: ...


@runtime_checkable
class FusedLossBackend(LinearBackend, Protocol):
    def loss_forward(self, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, shard: LinearShard,
                     with_entropy: bool, hooks: LossHooks, need_dx: bool,
                     need_dw: bool) -> Optional[torch.Tensor]: ...
