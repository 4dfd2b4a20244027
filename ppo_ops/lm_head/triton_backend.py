"""Triton backend of the fused LM head for fp32 inputs (linear_log_probs_and_entropy, path fp32_tiles of
lm_head/paths.py): GEMM tiles with IEEE fp32 dots, no [T, V] logits. Half precision, and every token loss, take the
segment-GEMM backend (lm_head/segment_gemms.py) instead, so every kernel here runs on fp32 operands.

Implements the LinearBackend contract of core/contracts.py with three kernels:

Forward, `forward_partials_kernel`, grid (local segment, row block): one program sweeps its segment's vocabulary in
tiles of BLOCK_N columns starting at the segment start; per tile it forms the [BLOCK_M, BLOCK_N] logit tile with a K
loop over H in steps of BLOCK_K (`tl.dot` with IEEE fp32 products, not tf32; fp32 accumulators), scales it by
1/temperature (rounded once, as the logits op's kernel does) and folds it into per-row online statistics (max m,
Σ e^(z-m), Σ e^(z-m)(z-m), the target's logit). At the end it stores the five partials of its (segment, rows): the
same channels as the logits op (row_stats.py), so the core's all-gather and fixed-order merge apply unchanged. The
segment axis is the grid's fast axis: programs running together share a few weight tiles (one per segment) and a
few hidden-row blocks, which stay in L2.
Backward, per span of columns holding at most DL_SPAN_BYTES of dlogits (spans start at segment starts, so tiles do):
    `dlogits_kernel`, one program per (row block, column tile), grouped for L2 reuse: recomputes the logit tile
    with the forward's code and tiles, forms dlogits = inv_t * (g_lp * (onehot - p) + g_ent * p * (mean_shifted - d))
    in fp32 (the logits op's formula) into an fp32 [R, span] buffer;
    two GEMMs by `gemm_kernel`: dX32[R, H] += dlogits @ W[span] (fp32 accumulator, spans added in order) and
    dW[span] = dlogits^T @ X (fp32 accumulation over all R rows).
No atomics anywhere, every reduction order is fixed by the tile shapes: bitwise deterministic run to run.

Bits. A column's logit depends only on the tile shapes and the K loop (0..H by BLOCK_K), never on V_local, the rank
or the row count, and tiles start at segment starts: the partials of a (row, segment) are the same at every TP size
(the TP-varying integers are not specialised on, so they cannot change the code). The per-row reductions run over
[BLOCK_M, BLOCK_N] tiles, not the logits op kernel's lanes, so the values equal the logits op's on the same logits
within its fp32 tolerances, not bit for bit (the PyTorch backend gives bitwise identity).
Memory (besides dX and dW): the fp32 dX accumulator [R, H] and one dlogits span. With four GEMMs' work and fp32
accumulation, one of dX or dW needs an fp32 accumulator across the other's spans, and dX's is the smaller while
R < V_local.
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ppo_ops.core import row_stats
from ppo_ops.core.checks import argument_error
from ppo_ops.core.contracts import GradsWanted, HeadRows, LinearSaved, ShardOptions, UpstreamGrads, holds_nothing
from ppo_ops.core.triton_common import (FLT_MAX, cdiv, empty_row_state, grouped_tile, interpreting, options,
                                        store_row_partials, tile_row_scale, transform_args, transformed,
                                        transformed_with_slope)
from ppo_ops.core.triton_launch import launcher as _launch  # fewer host steps per launch (core/triton_launch.py)
from ppo_ops.logits.triton_backend import merge_partials  # the logits op's fused merge: the partials are the same

# Integers that differ between ranks / TP sizes: not specialised on (divisibility by 16 would change the code).
_TP_VARYING = ["n_valid", "v_local", "vocab_start", "col_lo", "col_hi"]

DL_SPAN_BYTES = 128 * 1024 * 1024  # bound on one backward dlogits span ([R, span] fp32)
_DLOGITS_GROUP_M = 8  # row blocks per launch-order group of dlogits_kernel (L2 reuse; no effect on values)


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: Optional[int]  # None under the interpreter
    num_stages: Optional[int]


# Compiled: 64x64 tiles of 32-deep K steps, four warps, three pipeline stages; the backward's gemm_kernel runs the
# same tiles (one config).
_GPU_CONFIG = TileConfig(64, 64, 32, 4, 3)
# Interpreter: the smallest tiles tl.dot takes (it runs every program in Python: its time grows with the tile).
_INTERPRET_CONFIG = TileConfig(16, 32, 16, None, None)


def tile_config() -> TileConfig:
    """The tiles of every kernel of this module."""
    return _INTERPRET_CONFIG if interpreting() else _GPU_CONFIG


@triton.jit
def _dot(a, b, acc):
    """acc + a @ b of fp32 operands: IEEE fp32 products (not tf32), fp32 accumulation."""
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_x, stride_w,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32 logits x[rows] @ w[cols]^T, K loop from 0 to H in steps of BLOCK_K (the only
    accumulation order, whoever calls it)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        k_ok = k < H
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(x, tl.trans(w), acc)
    return acc


@triton.jit(do_not_specialize=_TP_VARYING)
def forward_partials_kernel(
    # data ptrs
    x_ptr,  # [R, H] fp32 hidden rows, READ-ONLY
    w_ptr,  # [V_local, H] weight slice, READ-ONLY
    tokens_ptr,  # [R] int64 global token ids
    out_ptr,  # [nseg, 5, R] fp32 partials, WRITTEN
    # shapes
    num_rows, H, seg_len,
    n_valid,  # local columns >= n_valid are padding
    v_local, vocab_start,
    # strides
    stride_x, stride_w,
    # constants
    inv_temperature,
    WITH_ENTROPY: tl.constexpr, SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    # the logit transform beyond a scalar temperature (core/triton_common.transformed; defaults: none)
    row_inv_temperature_ptr=None, softcap=1.0, inv_softcap=1.0,
    ROW_SCALE: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    seg = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    seg_lo = seg * seg_len
    seg_end = tl.minimum(seg_lo + seg_len, n_valid)
    target = tl.load(tokens_ptr + rows, mask=row_ok, other=-1).to(tl.int64) - vocab_start
    target = tl.where((target >= 0) & (target < v_local), target, -1)

    inv_t = tile_row_scale(inv_temperature, row_inv_temperature_ptr, rows, row_ok, ROW_SCALE)
    m, s, w, zt = empty_row_state(BLOCK_M)
    for n0 in range(seg_lo, seg_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < seg_end
        z = _logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K)
        z = transformed(z, inv_t, softcap, inv_softcap, SCALE, SOFTCAP)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        zt = tl.maximum(zt, tl.max(tl.where(cols[None, :] == target[:, None], z, float("-inf")), axis=1))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        shift = m - m_new  # <= 0
        alpha = tl.exp(shift)
        d = z - m_new[:, None]
        e = tl.exp(d)  # 0 for padding (-inf)
        if WITH_ENTROPY:
            w = alpha * (w + shift * s) + tl.sum(e * tl.maximum(d, -FLT_MAX), axis=1)  # -inf: adds 0, not 0 * inf
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new

    store_row_partials(out_ptr, seg, rows, num_rows, m, s, w, zt, row_ok)


@triton.jit(do_not_specialize=_TP_VARYING)
def dlogits_kernel(
    # data ptrs
    x_ptr,  # [R, H] hidden rows, READ-ONLY
    w_ptr,  # [V_local, H] weight slice, READ-ONLY
    tokens_ptr,  # [R] int64 global token ids
    shift_ptr, log_sum_ptr, mean_shifted_ptr,  # [R] fp32 merged row stats (mean_shifted read when HAS_GRAD_ENTROPY)
    # [R] fp32 upstream gradients, already 0 where undefined (read when HAS_GRAD_LOG_PROB / HAS_GRAD_ENTROPY)
    grad_log_prob_ptr, grad_entropy_ptr,
    out_ptr,  # [R, >= col_hi - col_lo] fp32 dlogits (or logits when LOGITS_ONLY), WRITTEN
    # shapes
    num_rows, H,
    col_lo, col_hi,  # local columns of this span; tiles start at col_lo
    n_valid, v_local, vocab_start,
    # strides
    stride_x, stride_w, stride_out,
    # constants
    inv_temperature,
    HAS_GRAD_LOG_PROB: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    SCALE: tl.constexpr,
    LOGITS_ONLY: tl.constexpr,  # store the raw fp32 logit tile (tile_logits), no gradient
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    row_inv_temperature_ptr=None, softcap=1.0, inv_softcap=1.0,  # as in forward_partials_kernel
    ROW_SCALE: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
):
    # Programs in launch order take GROUP_M row blocks times a run of column tiles, so the ones resident together
    # share a few hidden and weight tiles in L2 instead of each streaming its own weight tile from HBM.
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(num_rows, BLOCK_M), tl.cdiv(col_hi - col_lo, BLOCK_N),
                                GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = col_lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < col_hi
    x = _logit_tile(x_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_x, stride_w, BLOCK_M, BLOCK_N, BLOCK_K)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + (cols - col_lo)[None, :]
    store_ok = row_ok[:, None] & col_ok[None, :]
    if LOGITS_ONLY:
        tl.store(out, x, mask=store_ok)
    else:
        inv_t = tile_row_scale(inv_temperature, row_inv_temperature_ptr, rows, row_ok, ROW_SCALE)
        z, slope = transformed_with_slope(x, inv_t, softcap, inv_softcap, SCALE, SOFTCAP)
        d = z - tl.load(shift_ptr + rows, mask=row_ok, other=0.0)[:, None]
        p = tl.exp(d - tl.load(log_sum_ptr + rows, mask=row_ok, other=0.0)[:, None])
        grad = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if HAS_GRAD_LOG_PROB:
            g_lp = tl.load(grad_log_prob_ptr + rows, mask=row_ok, other=0.0)
            target = tl.load(tokens_ptr + rows, mask=row_ok, other=-1).to(tl.int64) - vocab_start
            onehot = tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
            grad = g_lp[:, None] * (onehot - p)
        if HAS_GRAD_ENTROPY:
            g_ent = tl.load(grad_entropy_ptr + rows, mask=row_ok, other=0.0)
            mean_shifted = tl.load(mean_shifted_ptr + rows, mask=row_ok, other=0.0)
            grad += g_ent[:, None] * (p * tl.where(p == 0.0, 0.0, mean_shifted[:, None] - d))
        if SCALE:
            grad = grad * inv_t
        if SOFTCAP:
            grad = grad * slope  # the chain rule through softcap * tanh(x / softcap)
        grad = tl.where(row_ok[:, None] & (cols < n_valid)[None, :], grad, 0.0)
        tl.store(out, grad, mask=store_ok)


@triton.jit
def gemm_kernel(
    # data ptrs
    a_ptr,  # [M, K] (any strides), READ-ONLY
    b_ptr,  # [K, N] (any strides), READ-ONLY
    c_ptr,  # [M, N] fp32, READ when ACCUMULATE (may be out_ptr)
    out_ptr,  # [M, N] fp32, WRITTEN: c + a @ b (or a @ b)
    # shapes
    M, N, K,
    # strides
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_om, stride_on,
    # constants
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One output tile, K loop in order from 0: deterministic, fp32 accumulation."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    tile_ok = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc = tl.load(c_ptr + rows64[:, None] * stride_cm + cols64[None, :] * stride_cn, mask=tile_ok, other=0.0)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k = (k0 + ks).to(tl.int64)
        k_ok = k < K
        a = tl.load(a_ptr + rows64[:, None] * stride_am + k[None, :] * stride_ak, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + cols64[None, :] * stride_bn, mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        acc = _dot(a, b, acc)
    tl.store(out_ptr + rows64[:, None] * stride_om + cols64[None, :] * stride_on, acc, mask=tile_ok)


# ---- launchers (the launch layer under BACKEND, at the end) ----

_WHERE = "lm_head.triton_backend"  # message prefix of this module's own checks: "ppo_ops.lm_head.triton_backend: ..."


def _check(hidden, weight):
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not (t.is_cuda or interpreting()):
            raise argument_error(ValueError, _WHERE, name,
                                 f"triton backend needs CUDA tensors or TRITON_INTERPRET=1: {name} is on {t.device}")
        if t.dim() != 2 or t.stride(1) != 1:
            raise argument_error(ValueError, _WHERE, name,
                                 f"{name} must be 2-D with unit column stride, got {tuple(t.shape)} {t.stride()}")
        if t.dtype != torch.float32:  # the dispatch sends half precision to the segment-GEMM backend
            raise argument_error(ValueError, _WHERE, name,
                                 f"this backend takes fp32 {name} (half precision runs lm_head/segment_gemms.py), "
                                 f"got {t.dtype}")


def forward_partials(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, shard: ShardOptions,
                     with_entropy: bool) -> torch.Tensor:
    """[V_local // seg_len, 5, R] fp32 segment partials (the contract's forward_partials)."""
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    _check(hidden, weight)
    n_rows, width = hidden.shape
    v_local, seg_len = weight.shape[0], shard.seg_len
    out = torch.empty((v_local // seg_len, row_stats.NUM_PARTIALS, n_rows), dtype=torch.float32,
                      device=hidden.device)
    if out.numel() == 0:
        return out
    cfg = tile_config()
    _launch(forward_partials_kernel)((v_local // seg_len, cdiv(n_rows, cfg.block_m)),
        x_ptr=hidden, w_ptr=weight, tokens_ptr=tokens.to(torch.int64).contiguous(), out_ptr=out,
        num_rows=n_rows, H=width, seg_len=seg_len, n_valid=shard.n_valid, v_local=v_local,
        vocab_start=int(shard.vocab_start),
        stride_x=hidden.stride(0), stride_w=weight.stride(0),
        **transform_args(shard, out),
        WITH_ENTROPY=bool(with_entropy),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **options(cfg),
    )
    return out


def _launch_dlogits(hidden, weight, tokens, out, col_lo, col_hi, shard: ShardOptions, saved=None, upstream=None):
    """dlogits of the local columns [col_lo, col_hi) into `out`; without `saved` and `upstream`, the raw fp32 logits
    (LOGITS_ONLY)."""
    cfg = tile_config()
    n_rows, width = hidden.shape
    unused = out  # stands in for the pointers the constexprs switch off
    logits_only = saved is None
    saved = saved or LinearSaved(unused, unused, None)
    upstream = upstream or UpstreamGrads(None, None)
    _launch(dlogits_kernel)((cdiv(col_hi - col_lo, cfg.block_n) * cdiv(n_rows, cfg.block_m),),
        x_ptr=hidden, w_ptr=weight, tokens_ptr=tokens, shift_ptr=saved.shift, log_sum_ptr=saved.log_sum,
        mean_shifted_ptr=unused if saved.mean_shifted is None else saved.mean_shifted,
        grad_log_prob_ptr=unused if upstream.grad_log_prob is None else upstream.grad_log_prob,
        grad_entropy_ptr=unused if upstream.grad_entropy is None else upstream.grad_entropy, out_ptr=out,
        num_rows=n_rows, H=width, col_lo=col_lo, col_hi=col_hi, n_valid=shard.n_valid, v_local=weight.shape[0],
        vocab_start=int(shard.vocab_start),
        stride_x=hidden.stride(0), stride_w=weight.stride(0), stride_out=out.stride(0),
        **transform_args(shard, out),
        HAS_GRAD_LOG_PROB=upstream.grad_log_prob is not None, HAS_GRAD_ENTROPY=upstream.grad_entropy is not None,
        LOGITS_ONLY=logits_only,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=_DLOGITS_GROUP_M, **options(cfg),
    )


def _gemm(a, b, out, accumulate):
    """out = (out if accumulate else 0) + a @ b by gemm_kernel, fp32 throughout; a, b, out may be strided views. The
    backward's shapes do not depend on the TP size (spans are segment-relative), so dW keeps its bits at every TP
    size."""
    (m, k), n = a.shape, b.shape[1]
    cfg = tile_config()
    _launch(gemm_kernel)((cdiv(m, cfg.block_m), cdiv(n, cfg.block_n)),
        a_ptr=a, b_ptr=b, c_ptr=out, out_ptr=out,  # c is out: read only when accumulating
        M=m, N=n, K=k,
        stride_am=a.stride(0), stride_ak=a.stride(1), stride_bk=b.stride(0), stride_bn=b.stride(1),
        stride_cm=out.stride(0), stride_cn=out.stride(1), stride_om=out.stride(0), stride_on=out.stride(1),
        ACCUMULATE=accumulate,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **options(cfg),
    )


def tile_logits(hidden, weight, seg_len):
    """[R, V_local] fp32 logits from exactly the forward's tiles (tests and comparisons only: the op never holds
    them)."""
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    _check(hidden, weight)
    n_rows, v_local = hidden.shape[0], weight.shape[0]
    out = torch.empty((n_rows, v_local), dtype=torch.float32, device=hidden.device)
    tokens = torch.zeros(max(n_rows, 1), dtype=torch.int64, device=hidden.device)
    for seg_lo in range(0, v_local, seg_len):
        if n_rows:
            _launch_dlogits(hidden, weight, tokens, out[:, seg_lo:], seg_lo, seg_lo + seg_len,
                            ShardOptions(inv_temperature=1.0, n_valid=v_local, seg_len=seg_len, vocab_start=0))
    return out


def _span_columns(n_rows, block_n):
    """Columns per backward span: the most whole tiles whose fp32 dlogits fit DL_SPAN_BYTES (at least one tile).
    Depends on R only, so span boundaries, segment-relative, are the same at every TP size."""
    return max(block_n, DL_SPAN_BYTES // max(1, n_rows * 4) // block_n * block_n)


def backward(head: HeadRows, saved: LinearSaved, upstream: UpstreamGrads, wanted: GradsWanted) -> tuple:
    """(dX fp32 [R, H] this rank's contribution, dW [V_local, H] fp32) (the contract's backward)."""
    hidden, weight, tokens, shard = head.hidden, head.weight, head.tokens, head.shard
    need_dx, need_dw = wanted.dx, wanted.dw
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    _check(hidden, weight)
    n_rows, width = hidden.shape
    v_local, seg_len = weight.shape[0], shard.seg_len
    dx = torch.zeros((n_rows, width), dtype=torch.float32, device=hidden.device) if need_dx else None
    dw = torch.zeros_like(weight) if need_dw else None  # padding columns keep their zeros
    if n_rows == 0:
        return dx, dw
    tokens = tokens.to(torch.int64).contiguous()
    shift, log_sum, mean_shifted, grad_log_prob, grad_entropy = (
        None if t is None else t.to(torch.float32).contiguous()
        for t in (saved.shift, saved.log_sum, saved.mean_shifted, upstream.grad_log_prob, upstream.grad_entropy))
    saved, upstream = LinearSaved(shift, log_sum, mean_shifted), UpstreamGrads(grad_log_prob, grad_entropy)
    span = _span_columns(n_rows, tile_config().block_n)
    dl = torch.empty((n_rows, span), dtype=torch.float32, device=hidden.device)
    for seg_lo in range(0, v_local, seg_len):
        seg_valid_end = min(seg_lo + seg_len, shard.n_valid)
        for lo in range(seg_lo, seg_valid_end, span):
            hi = min(lo + span, seg_valid_end)
            _launch_dlogits(hidden, weight, tokens, dl, lo, hi, shard, saved, upstream)
            part = dl[:, : hi - lo]
            if need_dx:
                _gemm(part, weight[lo:hi], dx, accumulate=True)
            if need_dw:
                _gemm(part.T, hidden, dw[lo:hi], accumulate=False)
    return dx, dw


class TritonLinearBackend:
    """The LinearBackend protocol (core/contracts.py): this module's launchers and the logits op's fused merge."""

    name = "triton"
    forward_partials = staticmethod(forward_partials)
    forward_for_backward = staticmethod(holds_nothing(forward_partials))
    merge_partials = staticmethod(merge_partials)
    backward = staticmethod(backward)


BACKEND = TritonLinearBackend()
