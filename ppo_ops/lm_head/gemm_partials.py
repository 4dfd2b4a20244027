"""The LM head's forward as one GEMM: a Triton tensor-core GEMM whose epilogue reduces each logit tile to softmax
partials, so no logit reaches memory.

Used by the segment-GEMM backend (ppo_ops/lm_head/segment_gemms.py) for the forward of linear_log_probs_and_entropy on
half-precision inputs whose rows are 16-byte aligned (the TMA loads need it); other inputs keep the chunk GEMM and
the logits op's partials pass. The forward is then one GEMM's work plus O(R * V / BLOCK_N) bytes of tile partials,
where the chunk path writes and reads R * V fp32 logits: under torch.no_grad (the old-policy and reference passes)
this is the whole op. The backward's fused recompute (gemm_dlogits.py) runs the same tile loop.

Kernels:
    gemm_partials_kernel  persistent: one program per SM walks the tiles of the grid row blocks x (local segment,
        column tile), taken GROUP_M row blocks at a time so the programs running together share weight tiles in L2.
        Per tile it loads [BLOCK_M, BLOCK_K] hidden and [BLOCK_N, BLOCK_K] weight tiles with TMA (zero-filled past
        the tensors' ends), accumulates the [BLOCK_M, BLOCK_N] logit tile in fp32 over K = 0..H in BLOCK_K steps
        (wgmma on Hopper), scales it by 1/temperature (rounded once, as the logits op does) and stores the tile's
        three partials per row: its max m, Σ e^(z-m) and Σ e^(z-m)(z-m). A tile whose columns are all real
        vocabulary of its segment (all but the last of a segment and the padding) takes an unmasked epilogue; the
        others mask the columns past the segment's width or the vocabulary. Both give the same bits on real columns.
        With STORE_PROBS (the token loss, forward_probs) the epilogue also stores the tile's e^(z - m) in fp16 by TMA
        into a segment-major, vocabulary-major buffer (each column's rows contiguous: the layout in which the
        library's dW GEMM reads them fastest), for the dlogits pass once the row statistics are global
        (prob_dlogits.py).
    target_logits_kernel  per row, the target's logit x . w_target in fp32 (-inf when the target is not in this
        shard), in a fixed order of its own. Picking it out of the GEMM tile would cost a compare and a select per
        logit (a visible share of the GEMM: docs/performance.md); this is O(R * H).
    merge_tiles_kernel  grid: (local segment, row block): per row, merges the segment's tiles in column order with
        the online form of core/row_stats.py's formulas into the five partials of the segment (the backend contract's
        [segments, 5, R]), the target logit going to the segment that holds it; the core's all-gather and fixed-order
        merge then apply unchanged.

Bits. Column tiles start at segment starts, a tile's logits depend on its row, its column and the fixed K loop, the
epilogue reduces along columns only, and the tiles of a segment merge in a fixed order: a row's partials are the same
whatever the other rows, the row count, the rank or the TP size (the integers that differ between ranks are not
specialised on; which tiles are whole depends on global columns only). The values equal the logits op's on the same
logits within fp32 reduction-order differences (the reductions run over GEMM tiles, not the logits op's lanes), not
bit for bit. The target logit is the same dot product in another summation order: it can exceed the GEMM's row max
by rounding, so the merge caps it at the max of its segment, which keeps every log-prob <= 0.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ppo_ops.core import row_stats
from ppo_ops.core.contracts import ShardOptions
from ppo_ops.core.triton_common import (FLT_MAX, empty_row_state, grouped_tile, interpreting, options, row_scale,
                                        store_row_partials, tile_row_scale, transform_args, transformed)
from ppo_ops.core.triton_launch import launcher as _launch  # fewer host steps per launch (core/triton_launch.py)

TILE_PARTIALS = 3  # per row and tile: m, Σ e^(z-m), Σ e^(z-m)(z-m)
_TILE_PARTIALS = tl.constexpr(TILE_PARTIALS)
_MERGE_ROWS = 256  # rows per merge program
TARGET_ROWS, TARGET_H = 16, 256  # rows per target-logit program, hidden columns per step

# Integers that differ between ranks and TP sizes (and the program count and slab height, which follow the row
# count): never specialised on, so every rank runs the same code.
_TP_VARYING = ["n_seg", "n_valid", "num_programs"]


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: Optional[int]  # None under the interpreter
    num_stages: Optional[int]
    flatten: bool = False  # the tile loop flattened with the K loop (the pipeliner then loads across tiles)


# The fastest of the tile shapes, stage counts, group sizes and loop forms timed at Qwen3's shapes on Hopper
# (docs/performance.md, "The fused LM head" and later sections, has the alternatives and their times): persistent,
# flattened (the next tile's loads issue during this tile's epilogue: with the probabilities' store 12% faster at
# H = 1024 and 4% at H = 4096, the same without it). The epilogue keeps few [BLOCK_M, BLOCK_N] tiles live, since
# every live tile costs registers the mainloop needs.
GPU_CONFIG = GemmConfig(128, 256, 64, 16, 8, 3, flatten=True)
# Interpreter: the smallest tiles tl.dot takes (every program runs in Python).
INTERPRET_CONFIG = GemmConfig(16, 32, 16, 2, None, None)
_INTERPRET_PROGRAMS = 3  # persistent programs under the interpreter: each walks several tiles


def config() -> GemmConfig:
    return INTERPRET_CONFIG if interpreting() else GPU_CONFIG


def num_programs(device: torch.device, n_tiles: int) -> int:
    """Programs of a persistent launch: one per SM (compiled), a few under the interpreter."""
    if interpreting():
        return max(1, min(_INTERPRET_PROGRAMS, n_tiles))
    return max(1, min(torch.cuda.get_device_properties(device).multi_processor_count, n_tiles))


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


@triton.jit
def logit_tile(x_desc, w_desc, row0, col0, hidden_size, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """The fp32 [BLOCK_M, BLOCK_N] tile hidden[row0:] @ weight[col0:]^T, K = 0..H in BLOCK_K steps. The forward and
    the backward's recompute (gemm_dlogits.py) both call this, so they form the same logits bit for bit."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, hidden_size, BLOCK_K):
        acc = _dot(x_desc.load([row0, k]), w_desc.load([col0, k]), acc, UPCAST)
    return acc


@triton.jit(do_not_specialize=_TP_VARYING)
def gemm_partials_kernel(
    x_desc,  # TMA descriptor of hidden [R, H] (half precision), blocks [BLOCK_M, BLOCK_K], READ-ONLY
    w_desc,  # TMA descriptor of the local weight [V_local, H], blocks [BLOCK_N, BLOCK_K], READ-ONLY
    tiles_ptr,  # [n_seg, tiles_per_seg, 3, R] fp32 tile partials, WRITTEN
    probs_desc,  # STORE_PROBS: TMA descriptor, [n_seg, seg_len, B >= R] fp16, blocks [1, BLOCK_N, BLOCK_M], WRITTEN
    num_rows,  # R
    hidden_size,  # H
    seg_len,  # columns per segment
    n_seg,  # local segments
    n_valid,  # local columns that are real vocabulary
    tiles_per_seg,  # cdiv(seg_len, BLOCK_N)
    num_programs,  # programs launched (persistent: each walks every num_programs-th tile)
    inv_temperature,
    SCALE: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    STORE_PROBS: tl.constexpr,  # also store e^(z - m) of every element, m its tile row's max (the token loss's)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
    UPCAST: tl.constexpr,
    # the logit transform beyond a scalar temperature (core/triton_common.transformed; defaults: none)
    row_inv_temperature_ptr=None,  # [R] fp32 1 / T per row, read only when ROW_SCALE
    softcap=1.0,
    inv_softcap=1.0,
    ROW_SCALE: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    n_row_blocks = tl.cdiv(num_rows, BLOCK_M)
    n_col_tiles = n_seg * tiles_per_seg
    for tile_id in tl.range(tl.program_id(0), n_row_blocks * n_col_tiles, num_programs, flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile_id, n_row_blocks, n_col_tiles, GROUP_M)
        seg = pid_n // tiles_per_seg
        tile = pid_n % tiles_per_seg
        col0 = seg * seg_len + tile * BLOCK_N  # local column of the tile's first column
        row0 = pid_m * BLOCK_M
        z = logit_tile(x_desc, w_desc, row0, col0, hidden_size, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
        tile_rows = row0 + tl.arange(0, BLOCK_M)
        inv_t = tile_row_scale(inv_temperature, row_inv_temperature_ptr, tile_rows, tile_rows < num_rows, ROW_SCALE)
        z = transformed(z, inv_t, softcap, inv_softcap, SCALE, SOFTCAP)
        if (tile * BLOCK_N + BLOCK_N <= seg_len) & (col0 + BLOCK_N <= n_valid):
            # every column real: no masks (the masked form below gives the same bits on such a tile)
            m = tl.max(z, axis=1)
            d = z - m[:, None]
            p = tl.exp(d)
            s = tl.sum(p, axis=1)
            if WITH_ENTROPY:
                w = tl.sum(p * d, axis=1)
            else:
                w = tl.zeros([BLOCK_M], tl.float32)
        else:
            # columns past the segment's width (the next segment) or the vocabulary (padding) masked out
            valid = ((tile * BLOCK_N + tl.arange(0, BLOCK_N)) < seg_len) & ((col0 + tl.arange(0, BLOCK_N)) < n_valid)
            z = tl.where(valid[None, :], z, float("-inf"))
            m = tl.maximum(tl.max(z, axis=1), -FLT_MAX)  # finite unless +inf; tl.max may drop NaN (the sums keep it)
            d = z - m[:, None]  # -inf where masked
            p = tl.exp(d)  # 0 where masked
            s = tl.sum(p, axis=1)
            if WITH_ENTROPY:
                w = tl.sum(tl.where(valid[None, :], p * d, 0.0), axis=1)  # 0 * -inf where masked: selected away
            else:
                w = tl.zeros([BLOCK_M], tl.float32)
        if STORE_PROBS:
            # segment-major, each column's rows contiguous: the store is clipped at the segment's width (no column of
            # the next segment is touched) and past R it lands on rows of the column that nothing reads
            probs_desc.store([seg, tile * BLOCK_N, row0], tl.trans(p.to(tl.float16)).reshape(1, BLOCK_N, BLOCK_M))
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        out = tiles_ptr + (seg.to(tl.int64) * tiles_per_seg + tile) * (_TILE_PARTIALS * num_rows) + rows
        tl.store(out, m, mask=row_ok)
        tl.store(out + num_rows, s, mask=row_ok)
        tl.store(out + 2 * num_rows, w, mask=row_ok)


@triton.jit
def target_logit(hidden_ptr, weight_ptr, tokens_ptr, rows, ok, hidden_size, hidden_stride, weight_stride, n_valid,
                 vocab_start, inv_temperature, SCALE: tl.constexpr, BLOCK_H: tl.constexpr,
                 row_inv_temperature_ptr=None, softcap=1.0, inv_softcap=1.0, ROW_SCALE: tl.constexpr = False,
                 SOFTCAP: tl.constexpr = False):
    """(z, target, here, x) of `rows`: here where the row's target is a real column of this weight (target its local
    column there, 0 elsewhere), x = x_row . w_target and z its transform (the softcap, then 1/T; 0 where not here):
    exact products, fp32 sums in one order for every row (it depends on H and BLOCK_H only)."""
    target = tl.load(tokens_ptr + rows, mask=ok, other=-1) - vocab_start
    here = ok & (target >= 0) & (target < n_valid)
    target = tl.where(here, target, 0)
    acc = tl.zeros([rows.shape[0], BLOCK_H], tl.float32)
    for k in range(0, hidden_size, BLOCK_H):
        cols = k + tl.arange(0, BLOCK_H)
        mask = here[:, None] & (cols < hidden_size)[None, :]
        x = tl.load(hidden_ptr + rows.to(tl.int64)[:, None] * hidden_stride + cols[None, :], mask=mask, other=0.0)
        w = tl.load(weight_ptr + target.to(tl.int64)[:, None] * weight_stride + cols[None, :], mask=mask, other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)
    x = tl.sum(acc, axis=1)
    inv_t = row_scale(inv_temperature, row_inv_temperature_ptr, rows, ok, ROW_SCALE)
    z = transformed(x, inv_t, softcap, inv_softcap, SCALE, SOFTCAP)
    return z, target, here, x


@triton.jit(do_not_specialize=["n_valid", "vocab_start"])
def target_logits_kernel(
    hidden_ptr,  # [R, H] half precision, READ-ONLY
    weight_ptr,  # [V_local, H], READ-ONLY
    tokens_ptr,  # [R] int64 global token ids
    out_ptr,  # [R] fp32 target logit (scaled), -inf where the target is not a real column of this shard, WRITTEN
    num_rows,
    hidden_size,
    hidden_stride,
    weight_stride,
    n_valid,
    vocab_start,
    inv_temperature,
    SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    row_inv_temperature_ptr=None,  # as in gemm_partials_kernel
    softcap=1.0,
    inv_softcap=1.0,
    ROW_SCALE: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < num_rows
    z, _, here, _ = target_logit(hidden_ptr, weight_ptr, tokens_ptr, rows, ok, hidden_size, hidden_stride,
                                 weight_stride, n_valid, vocab_start, inv_temperature, SCALE, BLOCK_H,
                                 row_inv_temperature_ptr, softcap, inv_softcap, ROW_SCALE, SOFTCAP)
    tl.store(out_ptr + rows, tl.where(here, z, float("-inf")), mask=ok)


@triton.jit(do_not_specialize=["vocab_start"])
def merge_tiles_kernel(
    tiles_ptr,  # [n_seg, tiles_per_seg, 3, R] fp32 tile partials, READ-ONLY
    target_ptr,  # [R] fp32 target logits (-inf: not in this shard), READ-ONLY
    tokens_ptr,  # [R] int64 global token ids
    out_ptr,  # [n_seg, 5, R] fp32 segment partials, WRITTEN
    num_rows,
    tiles_per_seg,
    seg_len,
    vocab_start,
    BLOCK_R: tl.constexpr,
):
    seg = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < num_rows
    m, s, w, _ = empty_row_state(BLOCK_R)
    base = tiles_ptr + seg.to(tl.int64) * tiles_per_seg * (_TILE_PARTIALS * num_rows) + rows
    for tile in range(0, tiles_per_seg):  # column order: fixes the bits
        t = base + tile * (_TILE_PARTIALS * num_rows)
        m_t = tl.load(t, mask=ok, other=-FLT_MAX)
        s_t = tl.load(t + num_rows, mask=ok, other=0.0)
        w_t = tl.load(t + 2 * num_rows, mask=ok, other=0.0)
        m_new = tl.maximum(m, m_t)
        a = tl.exp(m - m_new)  # both finite: 0 <= a <= 1
        b = tl.exp(m_t - m_new)
        w = a * (w + (m - m_new) * s) + b * (w_t + (m_t - m_new) * s_t)
        s = a * s + b * s_t
        m = m_new
    in_seg = (tl.load(tokens_ptr + rows, mask=ok, other=-1) - vocab_start) // seg_len == seg
    zt = tl.where(in_seg, tl.load(target_ptr + rows, mask=ok, other=float("-inf")), float("-inf"))
    zt = tl.where(zt > m, m, zt)  # the GEMM's max bounds its own target logit: log-prob <= 0
    store_row_partials(out_ptr, seg, rows, num_rows, m, s, w, zt, ok)


def descriptors(hidden: torch.Tensor, weight: torch.Tensor, cfg: GemmConfig):
    """TMA descriptors of hidden [R, H] and weight [V, H] in the tile loop's blocks."""
    return (TensorDescriptor.from_tensor(hidden, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]))


def forward_partials(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, shard: ShardOptions,
                     with_entropy: bool) -> torch.Tensor:
    """[V_local / seg_len, 5, R] fp32 segment partials of logits hidden @ weight^T (the backend contract's forward);
    `applies(hidden, weight)` must hold. Segments past shard.n_valid come out neutral."""
    return _forward(hidden, weight, tokens, shard, with_entropy, None)[0]


def forward_probs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, shard: ShardOptions,
                  with_entropy: bool, probs: torch.Tensor):
    """The forward partials, and every logit kept as a probability relative to its tile: probs [n_seg, B, seg_len]
    fp16, vocabulary-major (probs.transpose(1, 2) contiguous; B >= R a multiple of config().block_m) gets e^(z - m)
    rounded once, m the max of the element's row over its tile's columns (a tile: BLOCK_N columns from a segment
    start), 0 on padding columns. Rows >= R: those of the last row tile get a zero hidden row's (1, or 0 on padding
    columns: finite, which the dlogits pass relies on), the rest are not written. Returns (partials [n_seg, 5, R],
    tiles [n_seg, tiles_per_seg, 3, R] fp32: the tile partials, channel 0 the tile max m): z = m + log e up to e's
    rounding, and p = e * e^(m - M - log S). `applies(hidden, weight)` must hold."""
    return _forward(hidden, weight, tokens, shard, with_entropy, probs)


def _forward(hidden, weight, tokens, shard: ShardOptions, with_entropy: bool, probs: Optional[torch.Tensor]):
    seg_len = shard.seg_len
    n_rows, width = hidden.shape
    v_local = weight.shape[0]
    n_seg = v_local // seg_len
    cfg = config()
    tiles_per_seg = triton.cdiv(seg_len, cfg.block_n)
    out = torch.empty((n_seg, row_stats.NUM_PARTIALS, n_rows), dtype=torch.float32, device=hidden.device)
    tiles = torch.empty((n_seg, tiles_per_seg, TILE_PARTIALS, n_rows), dtype=torch.float32, device=hidden.device)
    if n_rows == 0:
        return out, tiles
    tokens = tokens.to(torch.int64).contiguous()
    x_desc, w_desc = descriptors(hidden, weight, cfg)
    probs_desc = None
    if probs is not None:
        rows_per_seg = probs.shape[1]
        if (probs.dtype != torch.float16 or probs.shape != (n_seg, rows_per_seg, seg_len)
                or not probs.transpose(1, 2).is_contiguous() or rows_per_seg < n_rows or rows_per_seg % cfg.block_m):
            raise ValueError(f"probs: expected a vocabulary-major fp16 [{n_seg}, B, {seg_len}] buffer with B >= "
                             f"{n_rows} a multiple of {cfg.block_m}, got {probs.dtype} {tuple(probs.shape)} strides "
                             f"{probs.stride()}")
        probs_desc = TensorDescriptor.from_tensor(probs.transpose(1, 2), [1, cfg.block_n, cfg.block_m])
    n_tiles = triton.cdiv(n_rows, cfg.block_m) * n_seg * tiles_per_seg
    programs = num_programs(hidden.device, n_tiles)
    _launch(gemm_partials_kernel)((programs,),
        x_desc=x_desc, w_desc=w_desc, tiles_ptr=tiles, probs_desc=probs_desc,
        num_rows=n_rows, hidden_size=width, seg_len=seg_len,
        n_seg=n_seg, n_valid=shard.n_valid, tiles_per_seg=tiles_per_seg, num_programs=programs,
        **transform_args(shard, tiles), WITH_ENTROPY=with_entropy,
        STORE_PROBS=probs is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, FLATTEN=cfg.flatten, UPCAST=interpreting(), **options(cfg))
    target = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    _launch(target_logits_kernel)((triton.cdiv(n_rows, TARGET_ROWS),),
        hidden_ptr=hidden, weight_ptr=weight, tokens_ptr=tokens, out_ptr=target, num_rows=n_rows, hidden_size=width,
        hidden_stride=hidden.stride(0), weight_stride=weight.stride(0), n_valid=shard.n_valid,
        vocab_start=shard.vocab_start, **transform_args(shard, target), BLOCK_R=TARGET_ROWS, BLOCK_H=TARGET_H)
    _launch(merge_tiles_kernel)((n_seg, triton.cdiv(n_rows, _MERGE_ROWS)),
        tiles_ptr=tiles, target_ptr=target, tokens_ptr=tokens, out_ptr=out, num_rows=n_rows,
        tiles_per_seg=tiles_per_seg, seg_len=seg_len, vocab_start=shard.vocab_start, BLOCK_R=_MERGE_ROWS)
    return out, tiles
