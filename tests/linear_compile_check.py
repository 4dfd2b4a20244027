"""Compiles the fused LM head's Triton kernels (ppo_ops/lm_head/triton_backend.py, gemm_partials.py,
gemm_dlogits.py) for an H200 (sm_90) without a GPU; run by tests/test_linear_log_probs.py as
`python -m tests.linear_compile_check` in a child process WITHOUT TRITON_INTERPRET (an interpreting process cannot
compile). Triton's bundled ptxas compiles for a fixed target.

Prints one JSON object:
- "forward_keys": {"fp32": distinct binaries of lm_head/triton_backend.py's forward (the fp32_tiles path) over every
  rank of TP = 1, 2, 4, 8 at Qwen3's vocabulary (V_local 151936 ... 18992) with padding on the last rank},
  "gemm_partials bf16" for the segment-GEMM backend's
  one-GEMM forward, "gemm_partials probs bf16" for its token-loss form (which also stores fp16 probabilities) and
  "gemm_dlogits bf16" for its fused backward recompute over every segment: 1 means every TP size runs the same code
  on a segment.
- "kernels": {"<kernel> bf16": {"wgmma": bool, "tma": bool}} for the half-precision kernels ("gemm_partials",
  "gemm_partials probs", "gemm_dlogits") with the GPU launch configs: "wgmma" when the PTX issues Hopper's warpgroup
  MMA (wgmma.mma_async), "tma" when their tiles move by TMA (cp.async.bulk.tensor).
"""

import json
import os

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("run without TRITON_INTERPRET: the compiler cannot run in an interpreting process")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from ppo_ops.core.triton_common import options  # noqa: E402
from ppo_ops.lm_head import gemm_dlogits as gd, gemm_partials as gp, triton_backend as lt  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H200 (Hopper), 32-thread warps
V_QWEN3, H_QWEN3_8B = 151936, 4096


def _specialize(kernel, args, kwargs):
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    return (tuple(map(str, specialization)), str(options)), (backend, bound_args, specialization, options)


def _ptx(kernel, args, kwargs):
    _, (backend, bound_args, specialization, options) = _specialize(kernel, args, kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                          options=options.__dict__).asm["ptx"]


def _forward_args(n_rows, v_local, seg_len, n_valid, vocab_start, inv_t=1.0):
    """lm_head/triton_backend.py's forward (fp32 operands only: half precision takes the segment-GEMM backend)."""
    cfg = lt.tile_config()
    hidden = torch.empty((n_rows, H_QWEN3_8B), dtype=torch.float32)
    weight = torch.empty((v_local, H_QWEN3_8B), dtype=torch.float32)
    args = (hidden, weight, torch.zeros(n_rows, dtype=torch.int64), torch.empty((v_local // seg_len, 5, n_rows)),
            n_rows, H_QWEN3_8B, seg_len, n_valid, v_local, vocab_start, H_QWEN3_8B, H_QWEN3_8B, inv_t)
    kwargs = dict(WITH_ENTROPY=True, SCALE=inv_t != 1.0,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **options(cfg))
    return args, kwargs


def forward_key_count(n_rows=8192, vocab_size=V_QWEN3 - 100):
    keys = set()
    for tp in (1, 2, 4, 8):
        v_local = V_QWEN3 // tp
        for rank in range(tp):
            n_valid = max(0, min(v_local, vocab_size - rank * v_local))
            args, kwargs = _forward_args(n_rows, v_local, V_QWEN3 // 8, n_valid, rank * v_local)
            keys.add(_specialize(lt.forward_partials_kernel, args, kwargs)[0])
    return len(keys)


def _gemm_partials_args(n_rows, v_local, n_valid, inv_t=1.5, store_probs=False, prob_rows=2048):
    """The segment-GEMM backend's one-GEMM forward (bf16 only: the path is half precision); store_probs: the token
    loss's form, which also stores fp16 probabilities into [segments x prob_rows, seg_len]."""
    cfg = gp.GPU_CONFIG
    seg_len = V_QWEN3 // 8
    hidden = torch.empty((n_rows, H_QWEN3_8B), dtype=torch.bfloat16)
    weight = torch.empty((v_local, H_QWEN3_8B), dtype=torch.bfloat16)
    probs_desc = None
    if store_probs:  # vocabulary-major, as the token loss holds them
        probs = torch.empty((v_local // seg_len, seg_len, prob_rows), dtype=torch.float16)
        probs_desc = TensorDescriptor.from_tensor(probs, [1, cfg.block_n, cfg.block_m])
    args = (TensorDescriptor.from_tensor(hidden, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k]), torch.empty(1), probs_desc, n_rows,
            H_QWEN3_8B, seg_len, v_local // seg_len, n_valid, -(-seg_len // cfg.block_n), 132, inv_t)
    kwargs = dict(SCALE=inv_t != 1.0, WITH_ENTROPY=True, STORE_PROBS=store_probs, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, FLATTEN=cfg.flatten, UPCAST=False,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return args, kwargs


def _gemm_dlogits_args(n_rows, seg_n_valid, inv_t=1.5):
    """The segment-GEMM backend's fused backward recompute on one segment (bf16)."""
    cfg = gp.GPU_CONFIG
    seg_len = V_QWEN3 // 8
    hidden = torch.empty((n_rows, H_QWEN3_8B), dtype=torch.bfloat16)
    w_seg = torch.empty((seg_len, H_QWEN3_8B), dtype=torch.bfloat16)
    dl_t = torch.empty((seg_len, n_rows), dtype=torch.bfloat16)  # vocabulary-major dlogits, as the backend holds them
    vec = torch.empty(n_rows)
    args = (TensorDescriptor.from_tensor(hidden, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(w_seg, [cfg.block_n, cfg.block_k]),
            TensorDescriptor.from_tensor(dl_t, [cfg.block_n, cfg.block_m]), vec, vec, vec, vec, vec, n_rows,
            H_QWEN3_8B, seg_len, seg_n_valid, 132, inv_t)
    kwargs = dict(HAS_GRAD_LOG_PROB=True, HAS_GRAD_ENTROPY=True, SCALE=inv_t != 1.0, BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=False, OUT_BF16=True,
                  ROUND_BF16_BY_BITS=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return args, kwargs


def gemm_partials_key_count(n_rows=8192, vocab_size=V_QWEN3 - 100, store_probs=False):
    keys = set()
    for tp in (1, 2, 4, 8):
        v_local = V_QWEN3 // tp
        for rank in range(tp):
            n_valid = max(0, min(v_local, vocab_size - rank * v_local))
            args, kwargs = _gemm_partials_args(n_rows, v_local, n_valid, store_probs=store_probs)
            keys.add(_specialize(gp.gemm_partials_kernel, args, kwargs)[0])
    return len(keys)


def gemm_dlogits_key_count(n_rows=8192, vocab_size=V_QWEN3 - 100):
    """Distinct binaries over every segment of the vocabulary (each segment is one launch, on whichever rank)."""
    seg_len = V_QWEN3 // 8
    keys = set()
    for seg_lo in range(0, V_QWEN3, seg_len):
        args, kwargs = _gemm_dlogits_args(n_rows, max(0, min(seg_len, vocab_size - seg_lo)))
        keys.add(_specialize(gd.gemm_dlogits_kernel, args, kwargs)[0])
    return len(keys)


def main():
    report = {"forward_keys": {"fp32": forward_key_count()}, "kernels": {}}
    report["forward_keys"]["gemm_partials bf16"] = gemm_partials_key_count()
    report["forward_keys"]["gemm_dlogits bf16"] = gemm_dlogits_key_count()
    report["forward_keys"]["gemm_partials probs bf16"] = gemm_partials_key_count(n_rows=2048, store_probs=True)
    for name, kernel, case in (("gemm_partials", gp.gemm_partials_kernel, _gemm_partials_args(8192, V_QWEN3, V_QWEN3)),
                               ("gemm_partials probs", gp.gemm_partials_kernel,
                                _gemm_partials_args(2048, V_QWEN3, V_QWEN3, store_probs=True)),
                               ("gemm_dlogits", gd.gemm_dlogits_kernel, _gemm_dlogits_args(8192, V_QWEN3 // 8))):
        ptx = _ptx(kernel, *case)
        report["kernels"][f"{name} bf16"] = {"wgmma": "wgmma.mma_async" in ptx, "tma": "cp.async.bulk.tensor" in ptx}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
