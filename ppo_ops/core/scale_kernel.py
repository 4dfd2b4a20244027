"""The Triton kernels of core/scale.py (imported only where Triton is)."""

import triton
import triton.language as tl

from ppo_ops.core.triton_launch import launcher as _launch  # fewer host steps per launch (core/triton_launch.py)


@triton.jit
def scale_kernel(src_ptr, dst_ptr, g_ptr, n, BLOCK: tl.constexpr):
    """dst[i] = round(float(src[i]) * g) over n elements (g one fp32 value): fp32 math, one rounding to dst's
    dtype. src and dst do not overlap (scale_in_place_kernel scales in place)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * tl.load(g_ptr)
    tl.store(dst_ptr + offsets, x.to(dst_ptr.dtype.element_ty), mask=mask)


def launch_scale(src, dst, g, block: int) -> None:
    """src, dst: 1-D contiguous of one length; g: [1] fp32 on their device."""
    n = src.numel()
    _launch(scale_kernel)((triton.cdiv(n, block),), src, dst, g, n, BLOCK=block, num_warps=4)


@triton.jit
def scale_in_place_kernel(t_ptr, g_ptr, n, BLOCK: tl.constexpr):
    """t[i] = round(float(t[i]) * g) over n elements, each program striding over blocks; nothing where g is 1
    (x * 1 rounds to x): the common upstream scale costs one read of g, not a pass over t."""
    g = tl.load(g_ptr)
    if g != 1.0:
        for b in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offsets = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            x = tl.load(t_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * g
            tl.store(t_ptr + offsets, x.to(t_ptr.dtype.element_ty), mask=mask)


def launch_scale_in_place(t, g, block: int, programs: int) -> None:
    """t: 1-D contiguous; g: [1] fp32 on its device; at most `programs` programs."""
    n = t.numel()
    grid = (max(1, min(programs, triton.cdiv(n, block))),)
    _launch(scale_in_place_kernel)(grid, t, g, n, BLOCK=block, num_warps=4)
