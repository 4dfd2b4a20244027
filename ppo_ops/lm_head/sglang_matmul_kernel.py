"""The Triton kernel of sglang_matmul.py (its docstring says what it reproduces and why each step is as it is)."""

import triton
import triton.language as tl


@triton.jit
def to_bf16(x, UPCAST: tl.constexpr):
    """fp32 -> bf16, round to nearest even (the GPU's conversion; the interpreter's truncates, so there the
    rounding is done on the bits first and the conversion is exact)."""
    if UPCAST:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)

@triton.jit
def logits_kernel(h_ptr, w_ptr, out_ptr, M, N, K, stride_hm, stride_hk, stride_wn, stride_wk, stride_om,
                  stride_on, temperature, HAS_TEMPERATURE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the end read row / column 0 (their results are not stored), as SGLang's kernel does.
    safe_rows = tl.where(rows < M, rows, 0).to(tl.int64)
    safe_cols = tl.where(cols < N, cols, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k = kt * BLOCK_K + ks
        in_k = ks < K - kt * BLOCK_K
        a = tl.load(h_ptr + safe_rows[:, None] * stride_hm + k[None, :] * stride_hk, mask=in_k[None, :],
                    other=0.0)
        # The weight as SGLang's `weight.T` operand: a [BLOCK_K, BLOCK_N] tile, K along the first dimension.
        b = tl.load(w_ptr + k[:, None] * stride_wk + safe_cols[None, :] * stride_wn, mask=in_k[:, None],
                    other=0.0)
        if UPCAST:  # the interpreter's tl.dot multiplies bf16's raw bits: fp32 products, summed over the tile
            acc = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc)
    logits = to_bf16(acc, UPCAST)
    if HAS_TEMPERATURE:
        logits = to_bf16(tl.math.div_rn(logits.to(tl.float32), temperature), UPCAST)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols.to(tl.int64)[None, :] * stride_on
    tl.store(out, logits, mask=(rows[:, None] < M) & (cols[None, :] < N))
