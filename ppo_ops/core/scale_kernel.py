"""The Triton kernel of core/scale.py (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def scale_kernel(src_ptr, dst_ptr, g_ptr, n, BLOCK: tl.constexpr):
    """dst[i] = round(float(src[i]) * g) over n elements (g one fp32 value): fp32 math, one rounding to dst's
    dtype. src and dst are the same elements (in place) or do not overlap."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * tl.load(g_ptr)
    tl.store(dst_ptr + offsets, x.to(dst_ptr.dtype.element_ty), mask=mask)


def launch_scale(src, dst, g, block: int) -> None:
    """src, dst: 1-D contiguous of one length; g: [1] fp32 on their device."""
    n = src.numel()
    scale_kernel[(triton.cdiv(n, block),)](src, dst, g, n, BLOCK=block, num_warps=4)
