"""The LM head's forward as one GEMM: a Triton tensor-core GEMM whose epilogue reduces each logit tile to softmax
partials, so no logit reaches memory.

Used by the chunked backend (ppo_ops/lm_head/chunked.py) for the forward of linear_log_probs_and_entropy on
half-precision inputs whose rows are 16-byte aligned (the TMA loads need it); other inputs keep the chunk GEMM and
the logits op's partials pass. The forward is then one GEMM's work plus O(R * V / BLOCK_N) bytes of tile partials,
where the chunk path writes and reads R * V fp32 logits: under torch.no_grad (the old-policy and reference passes)
this is the whole op.

Kernels:
    gemm_partials_kernel  grid: row blocks x (local segment, column tile), grouped GROUP_M row blocks at a time so
        the programs running together share weight tiles in L2. Each program loads [BLOCK_M, BLOCK_K] hidden and
        [BLOCK_N, BLOCK_K] weight tiles with TMA (zero-filled past the tensors' ends), accumulates the [BLOCK_M,
        BLOCK_N] logit tile in fp32 over K = 0..H in BLOCK_K steps (wgmma on Hopper), scales it by 1/temperature
        (rounded once, as the logits op does) and stores the tile's four partials per row: its max m, Σ e^(z-m),
        Σ e^(z-m)(z-m) and the target's logit (-inf when the target is not in the tile). Columns past the segment's
        valid width (the next segment, vocabulary padding) are masked out.
    merge_tiles_kernel  grid: (local segment, row block): per row, merges the segment's tiles in column order with
        the online form of core/row_stats.py's formulas into the five partials of the segment (the backend contract's
        [segments, 5, R]); the core's all-gather and fixed-order merge then apply unchanged.

Bits. Column tiles start at segment starts, a tile's logits depend on its row, its column and the fixed K loop, the
epilogue reduces along columns only, and the tiles of a segment merge in a fixed order: a row's partials are the same
whatever the other rows, the row count, the rank or the TP size (the integers that differ between ranks are not
specialised on). The values equal the logits op's on the same logits within fp32 reduction-order differences (the
reductions run over GEMM tiles, not the logits op's lanes), not bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ppo_ops.core import row_stats
from ppo_ops.core.contracts import ShardOptions
from ppo_ops.core.triton_common import (FLT_MAX, empty_row_state, grouped_tile, interpreting, options, scaled,
                                        store_row_partials)

TILE_PARTIALS = 4  # per row and tile: m, Σ e^(z-m), Σ e^(z-m)(z-m), target logit
_TILE_PARTIALS = tl.constexpr(TILE_PARTIALS)
_MERGE_ROWS = 1024  # rows per merge program

# Integers that differ between ranks and TP sizes: never specialised on, so every rank runs the same code.
_TP_VARYING = ["n_seg", "n_valid", "vocab_start"]


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: Optional[int]  # None under the interpreter
    num_stages: Optional[int]


# The fastest of the tile shapes, stage counts and group sizes timed on one H200 at Qwen3's shape (docs/gpu_runs.md,
# docs/performance.md). The epilogue keeps few [BLOCK_M, BLOCK_N] tiles live: masking d and p separately (two more
# live tiles) measured slower there.
_GPU_CONFIG = GemmConfig(128, 256, 64, 16, 8, 3)
# Interpreter: the smallest tiles tl.dot takes (every program runs in Python).
_INTERPRET_CONFIG = GemmConfig(16, 32, 16, 2, None, None)


def applies(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether these operands take the one-GEMM forward: half precision, Triton compiled on CUDA or interpreted on
    CPU, rows contiguous and 16-byte aligned (TMA descriptors)."""
    if hidden.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != hidden.dtype:
        return False
    if hidden.is_cuda != weight.is_cuda or (not hidden.is_cuda and not interpreting()):
        return False
    for t in (hidden, weight):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b^T, fp32 accumulation. UPCAST (interpreter only): its tl.dot multiplies the raw bits of bf16
    operands and hands fp32 ones to a BLAS whose sums depend on the row's position in the tile; there, the exact
    fp32 products are summed along K per element (the same order for every row, as on the tensor cores)."""
    if UPCAST:
        products = a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :]
        return acc + tl.sum(products, axis=2)
    else:
        return tl.dot(a, b.T, acc)


@triton.jit(do_not_specialize=_TP_VARYING)
def gemm_partials_kernel(
    x_desc,  # TMA descriptor of hidden [R, H] (half precision), blocks [BLOCK_M, BLOCK_K], READ-ONLY
    w_desc,  # TMA descriptor of the local weight [V_local, H], blocks [BLOCK_N, BLOCK_K], READ-ONLY
    tokens_ptr,  # [R] int64 global token ids
    tiles_ptr,  # [n_seg, tiles_per_seg, 4, R] fp32 tile partials, WRITTEN
    num_rows,  # R
    hidden_size,  # H
    seg_len,  # columns per segment
    n_seg,  # local segments
    n_valid,  # local columns that are real vocabulary
    vocab_start,  # global id of the shard's first column
    tiles_per_seg,  # cdiv(seg_len, BLOCK_N)
    inv_temperature,
    SCALE: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(num_rows, BLOCK_M), n_seg * tiles_per_seg, GROUP_M)
    seg = pid_n // tiles_per_seg
    tile = pid_n % tiles_per_seg
    col0 = seg * seg_len + tile * BLOCK_N  # local column of the tile's first column
    row0 = pid_m * BLOCK_M

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(0, hidden_size, BLOCK_K, num_stages=STAGES):
        acc = _dot(x_desc.load([row0, k]), w_desc.load([col0, k]), acc, UPCAST)

    cols = col0 + tl.arange(0, BLOCK_N)
    valid = ((tile * BLOCK_N + tl.arange(0, BLOCK_N)) < seg_len) & (cols < n_valid)
    z = acc
    if SCALE:
        z = scaled(z, inv_temperature)
    z = tl.where(valid[None, :], z, float("-inf"))
    m = tl.maximum(tl.max(z, axis=1), -FLT_MAX)  # finite unless +inf; tl.max may drop NaN (the sums keep it)
    d = z - m[:, None]  # -inf where masked
    p = tl.exp(d)  # 0 where masked
    s = tl.sum(p, axis=1)
    if WITH_ENTROPY:
        w = tl.sum(tl.where(valid[None, :], p * d, 0.0), axis=1)  # p * d is 0 * -inf where masked: selected away
    else:
        w = tl.zeros([BLOCK_M], tl.float32)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    target = tl.load(tokens_ptr + rows, mask=row_ok, other=-1) - vocab_start
    is_target = (cols[None, :] == target[:, None]) & valid[None, :]
    zt = tl.max(tl.where(is_target, z, float("-inf")), axis=1)

    out = tiles_ptr + (seg.to(tl.int64) * tiles_per_seg + tile) * (_TILE_PARTIALS * num_rows) + rows
    tl.store(out, m, mask=row_ok)
    tl.store(out + num_rows, s, mask=row_ok)
    tl.store(out + 2 * num_rows, w, mask=row_ok)
    tl.store(out + 3 * num_rows, zt, mask=row_ok)


@triton.jit
def merge_tiles_kernel(
    tiles_ptr,  # [n_seg, tiles_per_seg, 4, R] fp32 tile partials, READ-ONLY
    out_ptr,  # [n_seg, 5, R] fp32 segment partials, WRITTEN
    num_rows,
    tiles_per_seg,
    BLOCK_R: tl.constexpr,
):
    seg = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < num_rows
    m, s, w, zt = empty_row_state(BLOCK_R)
    base = tiles_ptr + seg.to(tl.int64) * tiles_per_seg * (_TILE_PARTIALS * num_rows) + rows
    for tile in range(0, tiles_per_seg):  # column order: fixes the bits
        t = base + tile * (_TILE_PARTIALS * num_rows)
        m_t = tl.load(t, mask=ok, other=-FLT_MAX)
        s_t = tl.load(t + num_rows, mask=ok, other=0.0)
        w_t = tl.load(t + 2 * num_rows, mask=ok, other=0.0)
        zt = tl.maximum(zt, tl.load(t + 3 * num_rows, mask=ok, other=float("-inf")))
        m_new = tl.maximum(m, m_t)
        a = tl.exp(m - m_new)  # both finite: 0 <= a <= 1
        b = tl.exp(m_t - m_new)
        w = a * (w + (m - m_new) * s) + b * (w_t + (m_t - m_new) * s_t)
        s = a * s + b * s_t
        m = m_new
    store_row_partials(out_ptr, seg, rows, num_rows, m, s, w, zt, ok)


def forward_partials(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, shard: ShardOptions,
                     with_entropy: bool) -> torch.Tensor:
    """[V_local / seg_len, 5, R] fp32 segment partials of logits hidden @ weight^T (the backend contract's forward);
    `applies(hidden, weight)` must hold. Segments past shard.n_valid come out neutral."""
    seg_len, inv_temperature = shard.seg_len, shard.inv_temperature
    n_rows, width = hidden.shape
    v_local = weight.shape[0]
    n_seg = v_local // seg_len
    interpreted = interpreting()
    cfg = _INTERPRET_CONFIG if interpreted else _GPU_CONFIG
    tiles_per_seg = triton.cdiv(seg_len, cfg.block_n)
    out = torch.empty((n_seg, row_stats.NUM_PARTIALS, n_rows), dtype=torch.float32, device=hidden.device)
    if n_rows == 0:
        return out
    tiles = torch.empty((n_seg, tiles_per_seg, TILE_PARTIALS, n_rows), dtype=torch.float32, device=hidden.device)
    x_desc = TensorDescriptor.from_tensor(hidden, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    grid = (triton.cdiv(n_rows, cfg.block_m) * n_seg * tiles_per_seg,)
    gemm_partials_kernel[grid](
        x_desc=x_desc, w_desc=w_desc, tokens_ptr=tokens.to(torch.int64).contiguous(), tiles_ptr=tiles,
        num_rows=n_rows, hidden_size=width, seg_len=seg_len, n_seg=n_seg, n_valid=shard.n_valid,
        vocab_start=shard.vocab_start, tiles_per_seg=tiles_per_seg, inv_temperature=float(inv_temperature),
        SCALE=float(inv_temperature) != 1.0, WITH_ENTROPY=with_entropy, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.num_stages or 1, UPCAST=interpreted, **options(cfg))
    merge_tiles_kernel[(n_seg, triton.cdiv(n_rows, _MERGE_ROWS))](
        tiles_ptr=tiles, out_ptr=out, num_rows=n_rows, tiles_per_seg=tiles_per_seg, BLOCK_R=_MERGE_ROWS)
    return out
