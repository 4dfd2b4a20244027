"""The Triton kernel of core/scale.py (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def scale_kernel(t_ptr, g_ptr, n, BLOCK: tl.constexpr):
    """t[i] = round(float(t[i]) * g) over n elements (t bf16 / fp16, g one fp32 value): one rounding."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(t_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * tl.load(g_ptr)
    tl.store(t_ptr + offsets, x.to(t_ptr.dtype.element_ty), mask=mask)
