"""bf16 logits as SGLang's true on-policy LM head forms them: `torch.matmul(hidden.bfloat16(), weight.T.bfloat16())`
under its batch-invariant mode, then, for a sampling temperature T, `logits.div(T).bfloat16()`.

What SGLang 0.5.17 runs (sglang/srt/batch_invariant_ops/batch_invariant_ops.py, with
SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM=0): aten::mm goes to `matmul_kernel_persistent`, whose bf16 config is
BLOCK_M 128, BLOCK_N 128, BLOCK_K 64, 8 warps, 3 stages. Each output tile starts from an fp32 zero accumulator, adds
`tl.dot(a, b, acc)` over the K tiles in order (64 columns of hidden and weight each, a tail tile's missing columns
loaded as 0) and is stored as `acc.to(bfloat16)`. An element's bits therefore depend on its row of hidden, its row of
the weight and that K loop (with the MMA instruction the config makes Triton emit on the GPU), not on M, N, which
program computes the tile or how many tiles a launch has. The sampler's temperature (sampler.py under
--rl-on-policy-target) is `logits.bfloat16().div(temperatures).bfloat16()`: an IEEE fp32 division of the bf16 logit
by fp32(T), rounded to bf16.

`bf16_logits` forms any [rows, columns] rectangle of those logits:
  triton  this module's kernel, the same K loop, config and epilogue (the division with div_rn, as torch's CUDA
          division rounds): bit for bit SGLang's on a GPU of the generation it was checked on (Hopper, sm_90), for
          any rectangle, so the head's forward (row blocks x GEMM spans) and backward (spans x row blocks) see the
          same bits. Under TRITON_INTERPRET=1 the kernel runs on CPU: the same K tiles, each tile's fp32 products
          summed by numpy (the interpreter's tl.dot would multiply bf16's raw bits).
  torch   fp32 products summed by torch.mm in fp32 (the BLAS's K order), one rounding to bf16, the same division:
          the same rounding points, not SGLang's K order. Deterministic for a fixed rectangle shape; the head calls it
          on the same shapes forward and backward.
"""

from __future__ import annotations

from typing import Optional

import torch

# SGLang's bf16 config (batch_invariant_ops.py, _matmul_persistent_triton) is 128 x 128 x 64 tiles, 8 warps, 3
# stages. BLOCK_K and the K loop fix an element's bits; the output tile does not (each element's MMA accumulation is
# its own): 256-row tiles gave SGLang's bits on an H100 at H = 1024 and 4096 and ran 1.2x faster (15.3 against 18.6
# ms at T = 8192, H = 4096), and tests/sglang_head_check.py holds the head to SGLang's matmul with them.
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_WARPS, NUM_STAGES = 256, 128, 64, 8, 8, 3
# Under the interpreter smaller output tiles (an element's bits do not depend on them) keep CPU tests fast; the K
# tile stays SGLang's.
HOST_BLOCK_M, HOST_BLOCK_N = 64, 128


def bf16_logits(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, temperature: Optional[float],
                kind: str) -> torch.Tensor:
    """out[r, c] = bf16(sum_k hidden[r, k] * weight[c, k]) (then bf16(that / T) when temperature is not None).
    hidden [R, H] and weight [C, H] bf16, out [R, C] bf16 (any strides with a unit column stride)."""
    if hidden.shape[0] == 0 or weight.shape[0] == 0:
        return out
    if kind == "triton":
        _launch(hidden, weight, out, temperature)
        return out
    z = torch.mm(hidden.float(), weight.float().t())
    if temperature is None:
        out.copy_(z)
    else:  # bf16 first, then the division in fp32 by a tensor (not a host scalar: true division), as SGLang's
        divisor = torch.full((1,), temperature, dtype=torch.float32, device=z.device)
        out.copy_(z.to(torch.bfloat16).float().div(divisor))
    return out


def _launch(hidden, weight, out, temperature):
    kernel = _kernel()
    interpreted = not hidden.is_cuda
    block_m, block_n = (HOST_BLOCK_M, HOST_BLOCK_N) if interpreted else (BLOCK_M, BLOCK_N)
    rows, cols, width = hidden.shape[0], weight.shape[0], hidden.shape[1]
    grid = (-(-rows // block_m) * -(-cols // block_n),)
    kernel[grid](hidden, weight, out, rows, cols, width, hidden.stride(0), hidden.stride(1), weight.stride(0),
                 weight.stride(1), out.stride(0), out.stride(1), 1.0 if temperature is None else float(temperature),
                 HAS_TEMPERATURE=temperature is not None, UPCAST=interpreted, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def _kernel():
    from ppo_ops.lm_head import sglang_matmul_kernel  # imported on first use: triton may be absent
    return sglang_matmul_kernel.logits_kernel
