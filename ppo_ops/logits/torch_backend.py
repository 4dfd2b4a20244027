"""PyTorch backend: per-segment row partials (forward) and the logits' gradient (backward) with plain torch ops.

Works on any device; the CPU path and the fallback where Triton is absent. Rows are processed in chunks of at most
`chunk_rows` rows, each held as two fp32 [rows, V_local] working buffers, so peak memory is bounded by the chunk,
never by T (backward recomputes the softmax per chunk from the logits and O(T) row statistics instead of keeping it).

The module-level functions implement the typed contract of core/contracts.py on its dataclasses; `TorchBackend` at
the end names them as the backend.

Row mask: the contract passes it as a [T] bool mask with [T]-sized per-row tensors. This backend turns it into the
index list of the kept rows (`nonzero`, a host sync on CUDA: acceptable for the fallback) and works on those rows
only, gathered into its chunks, so a dropped row costs neither compute nor working memory; dropped rows get the
neutral partials and zero gradient rows.

Bitwise invariance. Every reduction over the vocabulary is either a max (exact, order-free) or `fold_sum`
(core/fold.py: a fixed pairwise fold of element-wise adds on views, shared with core/sparse_keep.py), so a row's
result never depends on how many rows share its chunk, which rank holds its segment, or the thread count; a plain
`tensor.sum` would change with chunk_size.

Forward, per chunk (z = fp32 logits through the logit transform: softcap * tanh(x / softcap) where a softcap is set,
then times 1 / T, the scalar's or each row's; padding columns set to -inf), for each segment:
    m = max z;  d = z - m (in place);  e = exp(d);  w = fold(e * d) (0 where e == 0: no 0 * inf);
    sk = fold(e restricted to keep ∪ target);  s = fold(e).
Backward, per chunk: d = z - shift (in place), p = exp(d - log_sum),
    grad = inv_t * ( g_ent * p * (mean_shifted - d) - g_lp * q + g_lp * onehot(target) ),
    q = p * e^(log_sum - log_sum_kept) on keep ∪ target (q = p without a keep mask),
    and with a softcap grad *= 1 - tanh²(x / softcap), from the logits x (a third fp32 buffer for the chunk).
"""

from __future__ import annotations

from typing import Optional

import torch

from ppo_ops.core import row_stats
from ppo_ops.core.fold import fold_sum
from ppo_ops.core.contracts import (BackwardStats, RowInputs, ShardOptions, UpstreamGrads, logit_transform,
                                    row_inverse, softcap_slope)
from ppo_ops.core.layout import target_columns
from ppo_ops.core.row_stats import ENT_SUM, KEPT_SUMEXP, MAX, NUM_PARTIALS, SUMEXP, TARGET_Z, empty_partials

# Rows per chunk when the caller sets no bound: each of the two fp32 working buffers stays under this size.
AUTO_CHUNK_BYTES = 64 * 1024 * 1024

NEG_INF = float("-inf")


def _chunks(n_rows: int, v_local: int, chunk_rows: Optional[int]):
    if chunk_rows is None:
        chunk_rows = max(1, AUTO_CHUNK_BYTES // (4 * max(1, v_local)))
    for start in range(0, n_rows, chunk_rows):
        yield start, min(n_rows, start + chunk_rows)


def _row_slices(n: int):
    """Sub-slices of a chunk for row gathers, so a gathered temporary stays at 1/16 of a working buffer."""
    step = max(1, -(-n // 16))
    for i in range(0, n, step):
        yield i, min(n, i + step)


def _load_z(logits, rows, start, end, shard: ShardOptions, with_slope: bool = False):
    """fp32 copy of the chunk's logits through the logit transform (the softcap, then the temperature:
    contracts.logit_transform), padding columns at -inf. with_slope: (z, the softcap's slope 1 - tanh²(x / softcap)
    of those logits, or None without a softcap)."""
    n_valid = shard.n_valid
    n = end - start
    z = torch.empty((n, logits.shape[1]), dtype=torch.float32, device=logits.device)
    if rows is None:
        z.copy_(logits[start:end])
    elif logits.dtype == torch.float32:
        torch.index_select(logits, 0, rows[start:end], out=z)
    else:
        for i, j in _row_slices(n):
            z[i:j].copy_(logits.index_select(0, rows[start + i : start + j]))
    slope = softcap_slope(z, shard.softcap) if with_slope and shard.softcap is not None else None
    logit_transform(z, shard, slice(start, end) if rows is None else rows[start:end])
    if n_valid < z.shape[1]:
        z[:, n_valid:] = NEG_INF
    return (z, slope) if with_slope else z


def _restrict_to_kept(x, keep_mask, rows, start, end, target_col) -> None:
    """x[r, c] = 0 unless c is kept or is row r's target; in place, with no [rows, V] temporary."""
    owned = torch.nonzero(target_col >= 0).squeeze(1)
    target_values = x[owned, target_col[owned]]
    # torch.where writing into x: a bool multiplier would be promoted to a float copy of the mask.
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if rows is None:
        torch.where(keep_mask[start:end], x, zero, out=x)
    else:
        for i, j in _row_slices(end - start):
            torch.where(keep_mask.index_select(0, rows[start + i : start + j]), x[i:j], zero, out=x[i:j])
    x[owned, target_col[owned]] = target_values


def _kept_rows(row_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Indices of the rows the mask keeps (None: every row)."""
    return None if row_mask is None else torch.nonzero(row_mask).squeeze(1)


def forward_partials(inputs: RowInputs, shard: ShardOptions, with_entropy: bool) -> torch.Tensor:
    """[V_local // seg_len, 5, T] fp32 segment partials, neutral for dropped rows (the contract's forward_partials)."""
    logits = inputs.logits
    target_col = target_columns(inputs.tokens, shard.vocab_start, logits.shape[1])
    rows = _kept_rows(inputs.row_mask)
    if rows is None:
        return _partials_of_rows(inputs, None, target_col, shard, with_entropy)
    kept = _partials_of_rows(inputs, rows, target_col.index_select(0, rows), shard, with_entropy)
    out = empty_partials(kept.shape[0], logits.shape[0], logits.device)  # dropped rows: neutral under the merge
    out[:, :, rows] = kept
    return out


def _partials_of_rows(inputs: RowInputs, rows, target_col, shard: ShardOptions, with_entropy: bool) -> torch.Tensor:
    """[nseg, 5, R] partials of the rows `rows` (all T rows when None); target_col is [R]."""
    logits, keep_mask, seg_len = inputs.logits, inputs.keep_mask, shard.seg_len
    n_rows = logits.shape[0] if rows is None else rows.numel()
    v_local = logits.shape[1]
    n_seg = v_local // seg_len
    out = torch.zeros((n_seg, NUM_PARTIALS, n_rows), dtype=torch.float32, device=logits.device)
    for start, end in _chunks(n_rows, v_local, shard.chunk_rows):
        n = end - start
        tcol = target_col[start:end]
        z = _load_z(logits, rows, start, end, shard)

        # Target logit: -inf everywhere except in the segment holding it.
        zt = torch.full((n, n_seg), NEG_INF, dtype=torch.float32, device=logits.device)
        owned = torch.nonzero(tcol >= 0).squeeze(1)
        zt[owned, tcol[owned] // seg_len] = z[owned, tcol[owned]]

        zs = z.view(n, n_seg, seg_len)
        m = zs.amax(dim=-1)
        zs.sub_(torch.where(m == NEG_INF, torch.zeros_like(m), m).unsqueeze(-1))  # zs now holds d = z - m
        e = torch.exp(zs)
        if with_entropy:
            ent_terms = zs.mul_(e).nan_to_num_(nan=0.0, posinf=float("inf"), neginf=NEG_INF)  # -inf * 0 -> 0
            out[:, ENT_SUM, start:end] = fold_sum(ent_terms).T
        if keep_mask is not None:
            zs.copy_(e)
            _restrict_to_kept(z, keep_mask, rows, start, end, tcol)
            out[:, KEPT_SUMEXP, start:end] = fold_sum(zs).T
        out[:, SUMEXP, start:end] = fold_sum(e).T
        if keep_mask is None:
            out[:, KEPT_SUMEXP, start:end] = out[:, SUMEXP, start:end]
        out[:, MAX, start:end] = m.T
        out[:, TARGET_Z, start:end] = zt.T
    return out


def backward_grad(inputs: RowInputs, shard: ShardOptions, stats: BackwardStats, upstream: UpstreamGrads,
                  out: torch.Tensor) -> None:
    """Writes d(loss)/d(logits) into `out` (may be the logits), zero rows where the row mask is False (the contract's
    backward_grad)."""
    logits, row_mask, keep_mask = inputs.logits, inputs.row_mask, inputs.keep_mask
    inv_temperature, n_valid = shard.inv_temperature, shard.n_valid
    shift, log_sum, log_sum_kept, mean_shifted = stats.shift, stats.log_sum, stats.log_sum_kept, stats.mean_shifted
    grad_log_prob, grad_entropy = upstream.grad_log_prob, upstream.grad_entropy
    target_col = target_columns(inputs.tokens, shard.vocab_start, logits.shape[1])
    # Upstream gradients count only where their quantity has one (elsewhere 0, whatever they hold).
    if grad_log_prob is not None and stats.log_prob_defined is not None:
        grad_log_prob = torch.where(stats.log_prob_defined, grad_log_prob, torch.zeros_like(grad_log_prob))
    if grad_entropy is not None and stats.row_has_mass is not None:
        grad_entropy = torch.where(stats.row_has_mass, grad_entropy, torch.zeros_like(grad_entropy))
    rows = _kept_rows(row_mask)
    n_rows = logits.shape[0] if rows is None else rows.numel()
    v_local = logits.shape[1]
    if rows is not None:
        # Dropped rows get a zero gradient; written first, so an in-place `out` is never read after this.
        out.masked_fill_(~row_mask.unsqueeze(1), 0)
        # The kept rows' per-row values, in chunk order: O(R) gathers.
        target_col, shift, log_sum, log_sum_kept, mean_shifted, grad_log_prob, grad_entropy = (
            None if t is None else t.index_select(0, rows)
            for t in (target_col, shift, log_sum, log_sum_kept, mean_shifted, grad_log_prob, grad_entropy)
        )
    for start, end in _chunks(n_rows, v_local, shard.chunk_rows):
        n = end - start
        tcol = target_col[start:end]
        z, slope = _load_z(logits, rows, start, end, shard, with_slope=True)
        d = z.sub_(shift[start:end].unsqueeze(1))
        p = torch.sub(d, log_sum[start:end].unsqueeze(1)).exp_()
        if grad_entropy is not None:
            # p * (E[z] - z) = p * (mean_shifted - d); 0 where p == 0 (d = -inf).
            grad = d.neg_().add_(mean_shifted[start:end].unsqueeze(1)).mul_(p)
            grad.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=NEG_INF)
            grad.mul_(grad_entropy[start:end].unsqueeze(1))
        else:
            grad = d.zero_()
        if grad_log_prob is not None:
            g_lp = grad_log_prob[start:end]
            q = p  # reused in place: p is not needed any more
            if log_sum_kept is not None:
                q.mul_(torch.exp(log_sum[start:end] - log_sum_kept[start:end]).unsqueeze(1))
                _restrict_to_kept(q, keep_mask, rows, start, end, tcol)
            grad.sub_(q.mul_(g_lp.unsqueeze(1)))
            del q
            owned = torch.nonzero(tcol >= 0).squeeze(1)
            grad[owned, tcol[owned]] += g_lp[owned]
        inv_rows = row_inverse(shard, slice(start, end) if rows is None else rows[start:end])
        if inv_rows is not None:
            grad.mul_(inv_rows.unsqueeze(1))
        elif inv_temperature != 1.0:
            grad.mul_(inv_temperature)
        if slope is not None:  # the chain rule through softcap * tanh(x / softcap)
            grad.mul_(slope)
        if n_valid < v_local:
            grad[:, n_valid:] = 0.0
        if rows is None:
            out[start:end].copy_(grad)
        elif out.dtype == torch.float32:
            out.index_copy_(0, rows[start:end], grad)
        else:
            for i, j in _row_slices(n):
                out.index_copy_(0, rows[start + i : start + j], grad[i:j].to(out.dtype))
        del z, p, grad, slope


class TorchBackend:
    """The Backend protocol (core/contracts.py): this module's functions and core/row_stats.py's merge."""

    name = "torch"
    needs_unit_column_stride = False
    forward_partials = staticmethod(forward_partials)
    merge_partials = staticmethod(row_stats.merge_partials)
    backward_grad = staticmethod(backward_grad)


BACKEND = TorchBackend()
