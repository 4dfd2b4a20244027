"""What the Triton kernels and launchers of both ops share: constants, jit helpers and launch helpers.

Imported only by Triton modules, loaded when a Triton backend is selected (ppo_ops/backends.py), so
`import ppo_ops` works without triton.
"""

import torch
import triton
import triton.language as tl

from ppo_ops.core import row_stats
from ppo_ops.core.contracts import inverse_fp32

# Channel order of the partials, from core/row_stats.py (jit code may read only constexpr globals).
CH_MAX = tl.constexpr(row_stats.MAX)
CH_SUMEXP = tl.constexpr(row_stats.SUMEXP)
CH_KEPT_SUMEXP = tl.constexpr(row_stats.KEPT_SUMEXP)
CH_ENT_SUM = tl.constexpr(row_stats.ENT_SUM)
CH_TARGET_Z = tl.constexpr(row_stats.TARGET_Z)
NUM_PARTIALS = tl.constexpr(row_stats.NUM_PARTIALS)
FLT_MAX = tl.constexpr(row_stats.FLT_MAX)  # an empty lane's or row's running max: finite, so never -inf - -inf


@triton.jit
def bf16_by_bits(value):
    """fp32 `value` rounded to bf16, nearest even, on its bits: for the interpreter, whose fp32 -> bf16 casts
    truncate in Triton 3.9 (compiled code rounds to nearest even, as torch does). Values are finite, so no NaN
    payload to protect."""
    bits = value.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def store_rounded(ptr, value, mask, ROUND_BF16_BY_BITS: tl.constexpr):
    """Stores fp32 `value` in ptr's dtype, rounding to nearest even (under the interpreter, bf16 by bf16_by_bits).
    The logits op's backward kernel spells the same rounding out inline: through a call its compiler schedules the
    store's address arithmetic differently."""
    if ROUND_BF16_BY_BITS:
        tl.store(ptr, bf16_by_bits(value), mask=mask)
    else:
        tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


# Compiled (not interpreted) kernels: Triton decorates every kernel in the same mode.
COMPILED = tl.constexpr(type(store_rounded).__name__ != "InterpretedFunction")


@triton.jit
def grouped_tile(pid, n_row_blocks, n_col_tiles, GROUP_M: tl.constexpr):
    """(row block, column tile) of program `pid` in a GEMM-shaped grid launched GROUP_M row blocks at a time, so the
    programs running together share a few hidden and weight tiles in L2 (the order has no effect on values)."""
    per_group = GROUP_M * n_col_tiles
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(n_row_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def empty_row_state(BLOCK: tl.constexpr):
    """The online softmax state of BLOCK rows before any column: (max m, Σ e^(z-m), Σ e^(z-m)(z-m), target logit),
    m at the finite sentinel -FLT_MAX so that no e^(-inf - -inf) is ever formed."""
    m = tl.full([BLOCK], -FLT_MAX, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    w = tl.zeros([BLOCK], tl.float32)
    zt = tl.full([BLOCK], float("-inf"), tl.float32)
    return m, s, w, zt


@triton.jit
def store_row_partials(out_ptr, seg, rows, num_rows, m, s, w, zt, mask):
    """Stores the five partials of segment `seg` for `rows` of an [n_seg, 5, num_rows] buffer from a row's max m,
    Σ e^(z-m) s, Σ e^(z-m)(z-m) w and target logit zt, without a keep mask (KEPT_SUMEXP = SUMEXP). MAX becomes -inf
    where no logit was finite (s == 0: neutral under the merge) and NaN where s is NaN (NaN or +inf logits: tl.max
    may drop a NaN), which is where the core looks for bad input."""
    m = tl.where(s != 0.0, m, float("-inf"))
    m = tl.where(s != s, float("nan"), m)
    out = out_ptr + seg.to(tl.int64) * (NUM_PARTIALS * num_rows) + rows
    tl.store(out + CH_MAX * num_rows, m, mask=mask)
    tl.store(out + CH_SUMEXP * num_rows, s, mask=mask)
    tl.store(out + CH_KEPT_SUMEXP * num_rows, s, mask=mask)
    tl.store(out + CH_ENT_SUM * num_rows, w, mask=mask)
    tl.store(out + CH_TARGET_Z * num_rows, zt, mask=mask)


@triton.jit
def scaled(z, inv_temperature):
    """z * inv_temperature rounded to fp32 once. Compiled: mul.rn, which the compiler never contracts with a following
    subtraction into an FMA; a contracted fma(x, inv_t, -m) forms d = z - m from the unrounded product while MAX
    holds the rounded z, which puts the entropy partial measurably off (docs/performance.md). Under the interpreter
    (numpy rounds every multiply): a plain multiply."""
    if COMPILED:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [z, tl.zeros_like(z) + inv_temperature],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return z * inv_temperature


_TWO_LOG2E = tl.constexpr(2.8853900817779268)  # 2 log2(e)


@triton.jit
def ex2_ftz(x):
    """2^x: compiled, one MUFU.EX2 with flush-to-zero; under the interpreter (no PTX), tl.exp2."""
    if COMPILED:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _rcp(x):
    """1 / x: compiled, one MUFU.RCP (within an ulp, flush-to-zero); under the interpreter, a division."""
    if COMPILED:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return 1.0 / x


@triton.jit
def tanh(x):
    """tanh in fp32 as 1 - 2 / (e^2x + 1): one formula on every lane, two MUFU operations and three FMA-pipe ones
    compiled. The logits op's passes run near copy bandwidth, where a branchy tanh (an odd polynomial below |x| =
    0.625 beside this quotient, both evaluated on every lane) made them compute bound. Near 0 the quotient cancels:
    its error is absolute, within about 2^-22 (ex2's and rcp's relative errors), so softcap * tanh(x / softcap) is
    within softcap * 2^-22 of the true value (7e-6 at Gemma 2's 30), under the log-prob accuracy the ops state.
    +inf gives 1, -inf -1, NaN NaN."""
    return 1.0 - 2.0 * _rcp(ex2_ftz(x * _TWO_LOG2E) + 1.0)


@triton.jit
def transformed(x, inv_temperature, softcap, inv_softcap, SCALE: tl.constexpr, SOFTCAP: tl.constexpr):
    """z of fp32 logits x: softcap * tanh(x * inv_softcap) with SOFTCAP (Gemma 2's final_logit_softcapping), then
    scaled by the temperature with SCALE (as `scaled`); without SOFTCAP exactly `scaled`, so the scalar-temperature
    path keeps its bits. -inf logits become -softcap, as the formula gives."""
    if SOFTCAP:
        x = scaled(tanh(x * inv_softcap), softcap)  # rounded on its own, as `scaled` says why
    if SCALE:
        x = scaled(x, inv_temperature)
    return x


@triton.jit
def transformed_with_slope(x, inv_temperature, softcap, inv_softcap, SCALE: tl.constexpr, SOFTCAP: tl.constexpr):
    """(z, the softcap's slope) of fp32 logits x for a backward: z as `transformed` gives it, bit for bit, and
    d(softcap * tanh(x / softcap)) / dx = 1 - tanh²(x / softcap) from the same tanh (one per element; 1.0 without
    SOFTCAP, which the caller then does not apply)."""
    if SOFTCAP:
        th = tanh(x * inv_softcap)
        z = scaled(th, softcap)
        slope = 1.0 - th * th
    else:
        z = x
        slope = 1.0
    if SCALE:
        z = scaled(z, inv_temperature)
    return z, slope


@triton.jit
def row_scale(inv_temperature, row_inv_temperature_ptr, rows, row_ok, ROW_SCALE: tl.constexpr):
    """The temperature's scale of a vector of `rows`: their own [BLOCK] fp32 1 / T with ROW_SCALE (1 where not
    row_ok), else the scalar."""
    if ROW_SCALE:
        inv_temperature = tl.load(row_inv_temperature_ptr + rows, mask=row_ok, other=1.0)
    return inv_temperature


@triton.jit
def tile_row_scale(inv_temperature, row_inv_temperature_ptr, rows, row_ok, ROW_SCALE: tl.constexpr):
    """row_scale for a [BLOCK_M, BLOCK_N] tile of `rows`: [BLOCK_M, 1] with ROW_SCALE, else the scalar."""
    if ROW_SCALE:
        inv_temperature = tl.load(row_inv_temperature_ptr + rows, mask=row_ok, other=1.0)[:, None]
    return inv_temperature


def transform_args(shard, like: torch.Tensor) -> dict:
    """The kernels' logit-transform arguments (`transformed`) of a ShardOptions: the scalar temperature (SCALE), the
    per-row one (ROW_SCALE: a [rows] fp32 vector indexed like the kernel's rows) and the softcap (SOFTCAP). The last
    five have the kernels' defaults, so without a per-row temperature or a softcap they are not passed and the launch
    is the scalar temperature's as it always was. `like` stands in for the per-row pointer when there is none."""
    rows, softcap = shard.row_inv_temperature, shard.softcap
    args = dict(inv_temperature=float(shard.inv_temperature),
                SCALE=rows is not None or float(shard.inv_temperature) != 1.0)
    if rows is None and softcap is None:
        return args
    return dict(args, row_inv_temperature_ptr=like if rows is None else rows.to(torch.float32).contiguous(),
                softcap=1.0 if softcap is None else float(softcap),
                inv_softcap=1.0 if softcap is None else inverse_fp32(softcap),
                ROW_SCALE=rows is not None, SOFTCAP=softcap is not None)


def interpreting() -> bool:
    """True when the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 was set before triton loaded them)."""
    return not COMPILED.value


def round_bf16_by_bits(dtype: torch.dtype) -> bool:
    """The ROUND_BF16_BY_BITS constexpr of a kernel storing `dtype` (see store_rounded)."""
    return dtype == torch.bfloat16 and interpreting()


def options(config) -> dict:
    """Compiler options of a launch from its config's num_warps / num_stages (none under the interpreter, which
    ignores them)."""
    if config.num_warps is None:
        return {}
    # fp fusion set explicitly, not left to Triton's default (which Triton announces it will change), so the compiled
    # code does not depend on the installed version's default; fused multiply-adds are the faster choice.
    return {"num_warps": config.num_warps, "num_stages": config.num_stages, "enable_fp_fusion": True}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
