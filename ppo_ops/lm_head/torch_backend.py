"""PyTorch backend of the fused LM head (linear_log_probs_and_entropy): logits in fixed fp32 GEMM tiles, never [T, V].

Works on any device: the CPU path, and the fallback on CUDA where Triton is absent. It implements the linear backend
contract of core/contracts.py (`BACKEND` at the end).

Tiles. Logits are formed by torch.matmul in fp32 on tiles of a FIXED shape: ROW_TILE rows of the (row-compacted)
hidden states, zero-padded, times VOCAB_TILE rows of the weight, zero-padded at the end of a segment. Vocabulary tiles
start at the segment starts of core/layout.py (segments are fixed in GLOBAL columns), so a column always sits at
the same position of a tile of the same shape whichever rank, TP size or V_local computes it, and the K loop over H is
the GEMM library's own for that one shape. Rows sit at position (row index mod ROW_TILE) of a tile, also fixed.
Inputs in bf16/fp16 are upcast before the matmul: each product is exact in fp32 and the sum accumulates in fp32.
(On CUDA, torch's TF32 switch for fp32 matmuls, off by default, would apply to this fallback too.)

Forward, per ROW_TILE rows and per segment: the segment's logits are assembled in a [ROW_TILE, seg_len] fp32 slab
(the bounded tile of logits this backend holds) and handed to the logits op's own PyTorch code,
`logits/torch_backend.forward_partials`, on that slab. So the five partials (and after the merge the log-probs and
entropies) are bitwise those of `log_probs_and_entropy(logits, ..., backend="torch")` on the logits the same tiles
produce.
Backward, per vocabulary tile (outer) and ROW_TILE rows (inner): recompute the logit tile (the same bits as forward),
form the fp32 dlogits tile with `logits/torch_backend.backward_grad` (the logits op's gradient formula), then
dX[rows] += dlogits @ W_tile (fp32 accumulator [R, H], vocabulary tiles added in order) and
dW_tile += dlogits^T @ X[rows] (fp32 [VOCAB_TILE, H], row tiles added in order; written once in the weight's dtype).
Every order is fixed, so results are bitwise deterministic; no dlogits tile is rounded below fp32.
"""

from __future__ import annotations

from typing import Optional

import torch

from ppo_ops.logits import torch_backend as logits_torch
from ppo_ops.core import row_stats
from ppo_ops.core.contracts import (BackwardStats, GradsWanted, HeadRows, LinearSaved, RowInputs, ShardOptions,
                                    UpstreamGrads, holds_nothing)

ROW_TILE = 128  # rows per GEMM tile (hidden rows zero-padded to a multiple)
VOCAB_TILE = 256  # weight rows (vocabulary columns) per GEMM tile; tiles restart at every segment start


def _padded_rows_fp32(hidden: torch.Tensor) -> torch.Tensor:
    """[R_pad, H] fp32 copy of the hidden rows, zero rows up to a multiple of ROW_TILE."""
    n_rows, width = hidden.shape
    padded = -(-n_rows // ROW_TILE) * ROW_TILE
    x = torch.zeros((padded, width), dtype=torch.float32, device=hidden.device)
    x[:n_rows].copy_(hidden)
    return x


def _padded_vector(t: Optional[torch.Tensor], n_pad: int, fill, dtype) -> Optional[torch.Tensor]:
    if t is None:
        return None
    out = torch.full((n_pad,), fill, dtype=dtype, device=t.device)
    out[: t.shape[0]].copy_(t)
    return out


def _vocab_tiles(v_local: int, seg_len: int):
    """(lo, hi) local column ranges of the vocabulary tiles, segment by segment, each segment from its own start."""
    for seg_lo in range(0, v_local, seg_len):
        for lo in range(seg_lo, seg_lo + seg_len, VOCAB_TILE):
            yield lo, min(lo + VOCAB_TILE, seg_lo + seg_len)


def _weight_tile(weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """[VOCAB_TILE, H] fp32: weight rows lo..hi, zero rows after them."""
    w = torch.zeros((VOCAB_TILE, weight.shape[1]), dtype=torch.float32, device=weight.device)
    w[: hi - lo].copy_(weight[lo:hi])
    return w


def _logit_tile(x_tile: torch.Tensor, w_tile: torch.Tensor) -> torch.Tensor:
    """[ROW_TILE, VOCAB_TILE] fp32 logits of one tile: always the same shapes, so the same GEMM code."""
    return torch.matmul(x_tile, w_tile.T)


def tile_logits(hidden: torch.Tensor, weight: torch.Tensor, seg_len: int) -> torch.Tensor:
    """[R, V_local] fp32 logits made with exactly the tiles of this backend (for tests and comparisons: this is the
    [T, V] tensor the op itself never holds)."""
    n_rows, v_local = hidden.shape[0], weight.shape[0]
    x = _padded_rows_fp32(hidden)
    out = torch.empty((x.shape[0], v_local), dtype=torch.float32, device=hidden.device)
    for lo, hi in _vocab_tiles(v_local, seg_len):
        w = _weight_tile(weight, lo, hi)
        for r0 in range(0, x.shape[0], ROW_TILE):
            out[r0 : r0 + ROW_TILE, lo:hi] = _logit_tile(x[r0 : r0 + ROW_TILE], w)[:, : hi - lo]
    return out[:n_rows]


def forward_partials(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, shard: ShardOptions,
                     with_entropy: bool) -> torch.Tensor:
    """[V_local // seg_len, 5, R] fp32 segment partials of the R rows of `hidden` (the contract's forward_partials)."""
    seg_len = shard.seg_len
    n_rows, v_local = hidden.shape[0], weight.shape[0]
    n_seg = v_local // seg_len
    out = torch.empty((n_seg, 5, n_rows), dtype=torch.float32, device=hidden.device)
    if n_rows == 0:
        return out
    x = _padded_rows_fp32(hidden)
    slab = torch.empty((ROW_TILE, seg_len), dtype=torch.float32, device=hidden.device)
    for r0 in range(0, n_rows, ROW_TILE):
        n = min(ROW_TILE, n_rows - r0)
        x_tile = x[r0 : r0 + ROW_TILE]
        for seg in range(n_seg):
            seg_lo = seg * seg_len
            seg_shard = shard.segment(seg_lo)
            seg_valid = seg_shard.n_valid
            for lo, hi in _vocab_tiles(seg_len, seg_len):
                if lo >= seg_valid:
                    break  # padding only: forward_partials sets these columns to -inf without reading them
                z = _logit_tile(x_tile, _weight_tile(weight, seg_lo + lo, seg_lo + hi))
                slab[:, lo:hi] = z[:, : hi - lo]
            out[seg : seg + 1, :, r0 : r0 + n] = logits_torch.forward_partials(
                RowInputs(slab[:n], tokens[r0 : r0 + n], keep_mask=None, row_mask=None),
                seg_shard.rows(slice(r0, r0 + n)), with_entropy)
    return out


def backward(head: HeadRows, saved: LinearSaved, upstream: UpstreamGrads, wanted: GradsWanted) -> tuple:
    """(dX fp32 [R, H], this rank's contribution summed over its vocabulary; dW [V_local, H] in weight's dtype) of
    the loss sum(grad_log_prob * log_prob + grad_entropy * entropy) (the contract's backward). Either is None when
    not needed."""
    hidden, weight, tokens, shard = head.hidden, head.weight, head.tokens, head.shard
    need_dx, need_dw = wanted.dx, wanted.dw
    n_rows, width = hidden.shape
    v_local = weight.shape[0]
    x = _padded_rows_fp32(hidden)
    n_pad = x.shape[0]
    # Padding rows: no target (-1), zero upstream gradients, so their dlogits are exactly 0.
    tokens_p = _padded_vector(tokens, n_pad, -1, torch.int64)
    shift_p = _padded_vector(saved.shift, n_pad, 0.0, torch.float32)
    log_sum_p = _padded_vector(saved.log_sum, n_pad, 0.0, torch.float32)
    mean_p = _padded_vector(saved.mean_shifted, n_pad, 0.0, torch.float32)
    g_lp = _padded_vector(upstream.grad_log_prob, n_pad, 0.0, torch.float32)
    g_ent = _padded_vector(upstream.grad_entropy, n_pad, 0.0, torch.float32)
    inv_p = _padded_vector(shard.row_inv_temperature, n_pad, 1.0, torch.float32)  # a per-row temperature

    dx = torch.zeros((n_pad, width), dtype=torch.float32, device=hidden.device) if need_dx else None
    dw = torch.empty_like(weight) if need_dw else None
    dl = torch.empty((ROW_TILE, VOCAB_TILE), dtype=torch.float32, device=hidden.device)
    dw_tile = torch.empty((VOCAB_TILE, width), dtype=torch.float32, device=hidden.device)
    for lo, hi in _vocab_tiles(v_local, shard.seg_len):
        tile_valid = max(0, min(hi - lo, shard.n_valid - lo))
        if tile_valid == 0 or n_rows == 0:  # padding columns (or no rows): zero gradient, no contribution to dX
            if need_dw:
                dw[lo:hi] = 0
            continue
        w = _weight_tile(weight, lo, hi)
        dw_tile.zero_()
        for r0 in range(0, n_pad, ROW_TILE):
            r1 = r0 + ROW_TILE
            x_tile = x[r0:r1]
            z = _logit_tile(x_tile, w)
            # No gradient flags: the upstream gradients arrive already zeroed where their quantity has none (the
            # flags would be per-tile work for nothing).
            logits_torch.backward_grad(
                RowInputs(z, tokens_p[r0:r1], keep_mask=None, row_mask=None),
                ShardOptions(inv_temperature=shard.inv_temperature, n_valid=tile_valid, seg_len=VOCAB_TILE,
                             vocab_start=shard.vocab_start + lo, softcap=shard.softcap,
                             row_inv_temperature=_rows(inv_p, r0, r1)),
                BackwardStats(shift_p[r0:r1], log_sum_p[r0:r1], None, _rows(mean_p, r0, r1)),
                UpstreamGrads(_rows(g_lp, r0, r1), _rows(g_ent, r0, r1)), dl)
            if need_dx:
                dx[r0:r1] += torch.matmul(dl, w)
            if need_dw:
                dw_tile += torch.matmul(dl.T, x_tile)
        if need_dw:
            dw[lo:hi] = dw_tile[: hi - lo]
    return (None if dx is None else dx[:n_rows]), dw


def _rows(t: Optional[torch.Tensor], r0: int, r1: int) -> Optional[torch.Tensor]:
    return None if t is None else t[r0:r1]


class TorchLinearBackend:
    """The LinearBackend protocol (core/contracts.py): this module's functions and the logits op's torch merge."""

    name = "torch"
    forward_partials = staticmethod(forward_partials)
    forward_for_backward = staticmethod(holds_nothing(forward_partials))
    merge_partials = staticmethod(row_stats.merge_partials)
    backward = staticmethod(backward)


BACKEND = TorchLinearBackend()
