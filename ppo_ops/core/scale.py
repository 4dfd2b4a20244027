"""Upstream scaling of the gradients an op formed in its forward, in fp32 with one rounding, no host read of g.

    scale_in_place(t, g)               t *= g, t bf16 / fp16 / fp32, g a 0-d fp32 tensor on t's device
    scale_round_in_place(acc, g, dt)   round(acc * g) to dt, written into the first half of acc's own storage

The fused LM head's token loss hands back gradients it formed in its forward, scaled by the upstream scalar in
backward. On CUDA, `t.mul_(g)` with t in bf16 / fp16 and g a 0-d fp32 tensor first casts g to t's dtype (the
result dtype of the promotion), so every gradient would be rounded twice and carry bf16's error of g as a common
bias (g = 1/3: 2^-9 relative on all of dW). CPU kernels multiply by g in fp32 as asked. Here: Triton kernels on
CUDA (vectorised), torch elsewhere and for fp32 tensors.

scale_in_place reads g on the device and does nothing where it is 1 (x * 1 rounds to x: the same bits), so the
usual `loss.backward()` costs no pass over the gradients.

Where dW is still the fp32 accumulator in backward (the token loss's many-block calls), its one rounding to the
input dtype and the upstream scale are one pass (4 bytes read, 2 written per element) and dW is rounded once for any
scale. In place: chunk by chunk from the start, each chunk [lo, hi) at most lo long, so its rounded values (bytes
[2 lo, 2 hi)) land on input bytes of earlier chunks only (< 4 lo), which were read by an earlier launch; the first
chunk, whose output overlaps its own input, goes through a small temporary.
"""

import torch

BLOCK = 4096  # elements per program (per step of scale_in_place's programs)
IN_PLACE_PROGRAMS = 1024  # scale_in_place's programs: a few per SM, each striding over its blocks
FIRST_CHUNK = 1 << 20  # elements of the first chunk (through a temporary: 4 MB)
HOST_CHUNK = 1 << 24  # elements per chunk of the torch path, whose fp32 product is a temporary (64 MB)
_HALF = (torch.bfloat16, torch.float16)


def _triton_kernels():
    """The kernels' module, or None where Triton is absent (CUDA then takes the torch path: more traffic, the same
    bits)."""
    try:
        import triton  # noqa: F401
        from ppo_ops.core import scale_kernel
    except ImportError:
        return None
    return scale_kernel


def scale_in_place(t: torch.Tensor, g: torch.Tensor) -> None:
    if not (t.is_cuda and t.dtype in _HALF):
        t.mul_(g)
        return
    if not t.is_contiguous():
        raise ValueError("scale_in_place: expected a contiguous tensor")
    kernels = _triton_kernels()
    if kernels is None:
        flat = t.view(-1)
        for lo in range(0, flat.numel(), HOST_CHUNK):
            part = flat[lo:lo + HOST_CHUNK]
            part.copy_(part.float().mul_(g))
        return
    kernels.launch_scale_in_place(t.view(-1), g.to(torch.float32).reshape(1), BLOCK, IN_PLACE_PROGRAMS)


def scale_round_in_place(acc: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """acc (fp32, contiguous) times g (0-d fp32), rounded once to `dtype`, in the first half of acc's storage;
    returns that tensor, of acc's shape (acc itself, scaled, for dtype float32). acc's values are gone after."""
    if acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError("scale_round_in_place: expected a contiguous float32 accumulator")
    g = g.to(torch.float32).reshape(())
    if dtype == torch.float32:
        acc.mul_(g)
        return acc
    flat = acc.view(-1)
    n = flat.numel()
    narrow = flat.view(dtype)[:n]
    kernels = _triton_kernels() if acc.is_cuda else None
    lo = 0
    while lo < n:
        hi = min(n, lo + (FIRST_CHUNK if lo == 0 else (lo if kernels is not None else min(lo, HOST_CHUNK))))
        if lo == 0 or kernels is None:  # the product is a temporary: read whole before the rounded copy lands
            narrow[lo:hi].copy_(flat[lo:hi] * g)
        else:
            kernels.launch_scale(flat[lo:hi], narrow[lo:hi], g.reshape(1), BLOCK)
        lo = hi
    return narrow.view(acc.shape)
