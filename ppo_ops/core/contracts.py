"""The backend contract: what the autograd Function (logits/function.py) asks of a backend, as types.

Two backends implement `Backend`: `logits.torch_backend.TorchBackend` (any device; the CPU path) and
`logits.triton_backend.TritonBackend` (CUDA, or CPU under TRITON_INTERPRET=1). Per call the Function asks for

    forward_partials(inputs, shard, with_entropy) -> [V_local // seg_len, 5, T] fp32 partials per segment
        (channels in core/row_stats.py), for every row: a dropped row (row_mask False) gets the neutral partials of
        row_stats.empty_partials, its logits never read. A row's target column is tokens - vocab_start when in
        [0, V_local), else another rank holds it (layout.target_columns; the Triton kernels form it in-kernel).
    merge_partials(partials [segments, 5, T] in global segment order, has_keep_mask) -> RowStats over all T rows,
        merged in segment order (the order fixes the bits); the Triton backend does it in one launch.
    backward_grad(inputs, shard, stats: BackwardStats, upstream, out) -> None: writes every row of `out` (dropped
        rows get 0, their logits never read); `out` may be the logits themselves (inplace_grad). The upstream
        log-prob gradient counts as 0 where stats.log_prob_defined is False (the log-prob is -inf: its kept set has
        no mass), the entropy's where stats.row_has_mass is False, whatever they hold (None flags: already 0 there).

With d = z - shift: log p = d - log_sum, q = 1[keep ∪ target] e^(d - log_sum_kept) (q = p without a keep mask),
grad = inv_temperature * (g_lp * (onehot - q) + g_ent * p * (mean_shifted - d)); padding columns and entries with
p == 0 get no entropy term (never 0 * inf). All statistics are global (merged over the TP ranks). With a softcap or a
per-row temperature (ShardOptions.softcap, row_inv_temperature) z = softcap * tanh(x / softcap) * (the row's 1 / T)
and the gradient carries the row's 1 / T and 1 - tanh²(x / softcap) in place of inv_temperature.

A dropped row's token and per-row values are unspecified (its token may be junk such as -100); backends ignore them.
The row mask crosses as a mask, not an index list: building one (nonzero) is a host sync on CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Protocol, runtime_checkable

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
    chunk_rows: Optional[int] = None  # rows per working chunk of the torch backend (None: automatic); ignored by Triton
    # The logit transform before the temperature (None: none): softcap * tanh(logit / softcap), Gemma 2's
    # final_logit_softcapping (see logit_transform below).
    softcap: Optional[float] = None
    # [rows] fp32 1 / temperature per row, indexed like the rows the backend is given (None: inv_temperature for
    # every row, which is then 1.0); one rounding each, as inv_temperature.
    row_inv_temperature: Optional[torch.Tensor] = None

    def segment(self, seg_lo: int, width: Optional[int] = None) -> "ShardOptions":
        """The options of a chunk holding the local columns [seg_lo, seg_lo + width) of this shard (width: seg_len by
        default; the LM head runs the logits op's passes on such chunks)."""
        width = self.seg_len if width is None else width
        return ShardOptions(inv_temperature=self.inv_temperature,
                            n_valid=max(0, min(width, self.n_valid - seg_lo)), seg_len=width,
                            vocab_start=self.vocab_start + seg_lo, softcap=self.softcap,
                            row_inv_temperature=self.row_inv_temperature)

    def rows(self, index) -> "ShardOptions":
        """The options for a subset of the rows: `index` a slice or an index tensor into row_inv_temperature."""
        if self.row_inv_temperature is None:
            return self
        return dataclasses.replace(self, row_inv_temperature=row_inverse(self, index))

    @property
    def transformed(self) -> bool:
        """Whether the logits go through more than a scalar temperature (a softcap or a per-row temperature)."""
        return self.softcap is not None or self.row_inv_temperature is not None


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
    # [T] bool flags; None where the upstream gradients are already 0 where their quantity has none (the LM head's)
    log_prob_defined: Optional[torch.Tensor] = None
    row_has_mass: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True, slots=True)
class UpstreamGrads:
    """The gradients autograd brings back, fp32 [T] and contiguous, or None where an output gets none."""

    grad_log_prob: Optional[torch.Tensor]
    grad_entropy: Optional[torch.Tensor]  # None unless entropy="grad"
    # LM head: a sparse keep set's term, added into a [rows, cols] block of dlogits (kept rows r0.., local columns
    # c0..) before the dX / dW GEMMs read it, by backends that form dlogits in blocks (`applies_dlogits_term`)
    dlogits_term: Optional[Callable[[torch.Tensor, int, int], None]] = None


@runtime_checkable
class Backend(Protocol):
    name: str  # "torch" | "triton"
    needs_unit_column_stride: bool  # its kernels index columns contiguously (logits.stride(-1) == 1)

    def forward_partials(self, inputs: RowInputs, shard: ShardOptions, with_entropy: bool) -> torch.Tensor: ...

    def merge_partials(self, partials: torch.Tensor, has_keep_mask: bool) -> RowStats: ...

    def backward_grad(self, inputs: RowInputs, shard: ShardOptions, stats: BackwardStats, upstream: UpstreamGrads,
                      out: torch.Tensor) -> None: ...


# ---- the LM head's backends ----
# The LM head's backend contract, as types: what the two autograd Functions of the fused LM head
# (lm_head/function.py: log-probs and entropy; lm_head/loss_function.py: a token loss with its gradient
# formed in the forward) ask of a backend. The logits op meets its backends the same way (above).
#
# Three backends implement `LinearBackend` (core/shell.py picks one per call through lm_head/paths.py's backend_key;
# which of a backend's paths a call takes is paths.head_path's answer):
#   lm_head/segment_gemms.py  every half-precision call under triton, and every token loss: GEMMs over the fixed
#                             vocabulary segments. A Triton GEMM whose epilogue reduces each logit tile to partials
#                             (gemm_partials.py), the same GEMM with the gradient in its epilogue for the backward's
#                             dlogits (gemm_dlogits.py), library GEMMs for dX and dW; where those kernels do not apply,
#                             library GEMMs on fixed-shape chunks and the logits op's passes.
#                             The only backend that also implements `FusedLossBackend` (lm_head/token_loss_blocks.py).
#   lm_head/torch_backend.py  fixed fp32 tiles through torch.matmul and the logits op's PyTorch code (the general op
#                             with backend="torch", any device);
#   lm_head/triton_backend.py Triton GEMM-tile kernels with the softmax statistics fused in (fp32 inputs under
#                             triton).
#
# Per call the Functions ask for (`HeadRows`: the kept rows, compacted, and this rank's [V_local, H] weight slice):
#
#     forward_partials(hidden [R, H], weight, tokens [R], shard, with_entropy) -> [V_local // seg_len, 5, R] fp32:
#         the logits op's five per-segment partials (channels in core/row_stats.py) of z = (hidden @ weight.T) * inv_t,
#         fp32 accumulation, columns >= n_valid padding. A segment's partials may not depend on V_local, the rank or
#         the row count R (that is what makes the results TP- and row-count invariant).
#     forward_for_backward(hidden, weight, tokens, shard, with_entropy, working_memory=None) -> (partials,
#         HeldProbs or None): the forward of a call that a backward follows (grad mode, an input requiring grad): the
#         same partials, bit for bit, and what the backend holds for its backward beyond the row statistics (None:
#         nothing). What it holds is bounded by working_memory bytes (None: the backend's default) and the same on
#         every rank for the same call.
#     merge_partials(partials in global segment order, has_keep_mask=False) -> RowStats: the logits op's merge.
#     backward(head: HeadRows, saved, upstream, wanted: GradsWanted) -> (dX fp32 [R, H] or None: this rank's
#         contribution; dW [V_local, H] in weight's dtype or None). dlogits = inv_t * (g_lp * (onehot - p)
#         + g_ent * p * (mean_shifted - d)), d = z - shift, p = exp(d - log_sum); the upstream gradients arrive zeroed
#         where their quantity has none. saved.held is what forward_for_backward returned (read, never written: a
#         second backward under retain_graph gets the same gradients).
#
# `FusedLossBackend` adds, for ppo_ops.linear_token_loss:
#
#     loss_forward(head: HeadRows, with_entropy, hooks: LossHooks, wanted: GradsWanted, working_memory: bytes its
#         row blocks may hold or None for the backend's default) -> dW or None: per row block,
#         the block's logits over every local segment, their partials, `hooks.merge` (TP all-gather + merge: global
#         RowStats of the block), `hooks.block_grads` (the caller's loss on those stats: upstream gradients of the
#         block), dlogits, `hooks.keep_dlogits` (a sparse keep set's term, into each block x segment of dlogits before
#         its GEMMs), `hooks.finish_dx` (the block's fp32 dX rows, to be reduced and rounded by the caller) and
#         dW: either accumulated in fp32 over the blocks and returned in fp32 (the caller rounds it once, with its
#         upstream scale), or, where one block holds every row, finished in weight's dtype (the caller scales it).
#         The logits are formed once per row.
#
# No backend issues a collective or reads a device value on the host: communication, validation and autograd stay in
# the Functions.


@dataclasses.dataclass(frozen=True, slots=True)
class HeadRows:
    """The LM head's operands as a backend sees them."""

    hidden: torch.Tensor  # [R, H] the kept rows' hidden states, READ-ONLY
    weight: torch.Tensor  # [V_local, H] this rank's vocabulary slice, READ-ONLY
    tokens: torch.Tensor  # [R] integer global token ids of those rows
    shard: ShardOptions


@dataclasses.dataclass(frozen=True, slots=True)
class GradsWanted:
    """Which gradients the caller asked for (autograd's needs_input_grad of hidden and weight)."""

    dx: bool
    dw: bool


@dataclasses.dataclass(frozen=True, slots=True)
class HeldProbs:
    """What the segment-GEMM backend's forward holds for its backward: the logits of the call's first `rows` rows (of
    the kept ones) as fp16 probabilities within their GEMM tiles (lm_head/gemm_partials.forward_probs), so their
    dlogits need no second GEMM."""

    probs: torch.Tensor  # [n_seg, B >= rows, seg_len] fp16 e^(z - tile max), vocabulary-major
    tiles: torch.Tensor  # [n_seg, tiles_per_seg, 3, rows] fp32 tile partials (channel 0: the tile max)
    rows: int


@dataclasses.dataclass(frozen=True, slots=True)
class LinearSaved:
    """What the backward reads: the row statistics (saved by the forward, O(R) fp32, sanitised: 0 where no mass)
    and what the backend's forward kept."""

    shift: torch.Tensor  # [R] row max M of z
    log_sum: torch.Tensor  # [R] log Σ e^(z - M)
    mean_shifted: Optional[torch.Tensor]  # [R] E_p[z] - M; None unless the entropy has a gradient
    held: Optional[HeldProbs] = None  # what forward_for_backward returned


@dataclasses.dataclass(frozen=True, slots=True)
class BlockGrads:
    """What the caller's loss gives back for one row block: fp32 [n] upstream gradients of its log-probs and
    entropies (None: no gradient), already zero where the quantity has none."""

    grad_log_prob: Optional[torch.Tensor]
    grad_entropy: Optional[torch.Tensor]
    keep_term: bool = False  # a sparse keep set's term goes into the block's dlogits (hooks.keep_dlogits)


class LossHooks(Protocol):
    """The Function's side of loss_forward (lm_head/loss_function.py, BlockLoop): communication, the caller's loss
    and the dX epilogue, per row block (rows r0 .. r1 of the kept rows)."""

    def merge(self, partials: torch.Tensor) -> RowStats: ...  # [local segments, 5, n] -> the block's global stats

    def headers(self) -> None: ...  # the header exchange, once, for a backend that merges its own stats

    # (r0, r1) of each row block, in order, each at most block_rows rows: fixed steps, or cut at sequence ends
    def row_blocks(self, n_rows: int, block_rows: int) -> list: ...

    def block_grads(self, stats: RowStats, r0: int, r1: int) -> BlockGrads: ...  # -> upstream gradients

    def keep_dlogits(self, dl: torch.Tensor, r0: int, c0: int) -> None: ...  # a sparse keep set's term, into dl

    def finish_dx(self, dx32: torch.Tensor, r0: int, r1: int) -> None: ...  # fp32 [n, H] dX rows of this rank


@runtime_checkable
class LinearBackend(Protocol):
    name: str  # "torch" | "triton" | "segments-triton" | "segments-torch"

    def forward_partials(self, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                         shard: ShardOptions, with_entropy: bool) -> torch.Tensor: ...

    def forward_for_backward(self, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                             shard: ShardOptions, with_entropy: bool, working_memory: Optional[int] = None
                             ) -> tuple: ...

    def merge_partials(self, partials: torch.Tensor, has_keep_mask: bool) -> RowStats: ...

    def backward(self, head: HeadRows, saved: LinearSaved, upstream: UpstreamGrads, wanted: GradsWanted) -> tuple: ...


def holds_nothing(forward_partials: Callable[..., torch.Tensor]) -> Callable[..., tuple]:
    """forward_for_backward of a backend whose backward recomputes every logit: the partials, nothing kept."""
    def forward_for_backward(hidden, weight, tokens, shard, with_entropy, working_memory=None):
        return forward_partials(hidden, weight, tokens, shard, with_entropy), None
    return forward_for_backward


@runtime_checkable
class FusedLossBackend(LinearBackend, Protocol):
    def loss_forward(self, head: HeadRows, with_entropy: bool, hooks: LossHooks, wanted: GradsWanted,
                     working_memory: Optional[int] = None) -> Optional[torch.Tensor]: ...


# ---- the logit transform (softcap, per-row temperature), for the backends that form z with torch ops ----

def logit_transform(x: torch.Tensor, shard: ShardOptions, rows=None) -> torch.Tensor:
    """z of fp32 logits x [n, V], in place: softcap * tanh(x * fl32(1 / softcap)) where a softcap is set (Gemma 2's
    final_logit_softcapping, `logits = tanh(logits / cap) * cap` in transformers' Gemma2ForCausalLM, the division
    taken as a multiplication by the fp32 reciprocal, as the Triton kernels take it; -inf becomes -softcap), then
    times 1 / T: the rows' own (`rows`, a slice or index tensor: which of row_inv_temperature's rows x holds; None:
    all) or the scalar's."""
    if shard.softcap is not None:
        x.mul_(inverse_fp32(shard.softcap)).tanh_().mul_(shard.softcap)
    inv = row_inverse(shard, rows)
    if inv is not None:
        x.mul_(inv.unsqueeze(1))
    elif shard.inv_temperature != 1.0:
        x.mul_(shard.inv_temperature)
    return x


def row_inverse(shard: ShardOptions, rows=None) -> Optional[torch.Tensor]:
    """The per-row 1 / T of `rows` (a slice or an index tensor; None: all), or None for a scalar temperature."""
    inv = shard.row_inv_temperature
    if inv is None or rows is None:
        return inv
    return inv[rows] if isinstance(rows, slice) else inv.index_select(0, rows)


def softcap_slope(x: torch.Tensor, softcap: float) -> torch.Tensor:
    """d(softcap * tanh(x / softcap)) / dx = 1 - tanh²(x / softcap) of fp32 logits x (a new tensor; 0 at +-inf)."""
    th = torch.mul(x, inverse_fp32(softcap)).tanh_()
    return th.mul_(th).neg_().add_(1.0)


@functools.lru_cache(maxsize=64)
def inverse_fp32(value: float) -> float:
    """1 / value rounded once to fp32 (inf where that is past float32's range): what every backend multiplies by for
    a temperature or a softcap. Kept per value: trainers pass the same few, and the CPU tensor's round trip is host
    time on every call (no device sync)."""
    return float(torch.tensor(1.0 / value if value >= _SMALLEST_INVERTED else math.inf, dtype=torch.float32))


_SMALLEST_INVERTED = 0.5 / torch.finfo(torch.float32).max  # below it 1 / value rounds to inf in fp32 anyway
