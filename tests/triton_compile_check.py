"""Compiles the Triton backend's kernels for an H200 (sm_90) on a machine without a GPU; used by
tests/test_triton_backend.py, which runs `python -m tests.triton_compile_check` in a child process.

It must run WITHOUT TRITON_INTERPRET: in an interpreting process Triton's code generator runs tl.* helpers (tl.cdiv)
through the interpreter and cannot compile. No GPU is needed: Triton's bundled ptxas compiles for a fixed target.

Prints one JSON object:
- "forward_keys": {"<dtype>": number of distinct forward binaries over every rank of TP = 1, 2, 4, 8}
  for a vocabulary whose local width is a multiple of 16 at some TP sizes and not at others; 1 means every TP size
  runs the same code on a segment (bitwise TP invariance on the GPU, given the same inputs).
- "ptx": {"<pass> <dtype> keep=<bool>": {"v4_load": bool, "v4_store": bool}} for Qwen3-sized launches, where <pass> is
  "forward" or "backward", each with its GPU launch config (ppo_ops/logits/triton_backend.py _GPU_CONFIG).
- "forward_scaled_mul_rn": the forward with a temperature rounds the scaled logits with mul.rn (never contracted).
- "transforms": {"<pass> <transform>": {"v4_load": bool, "ex2_ftz": bool, "rcp": bool}} for bf16 Qwen3-sized
  launches with a per-row temperature ("rows") or a softcap ("softcap"): the compiled-only PTX of those paths
  (the flush-to-zero ex2 of the exponentials, the approximate reciprocal of the softcap's tanh), which the
  interpreter never sees.
"""

import json
import os

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("run without TRITON_INTERPRET: the compiler cannot run in an interpreting process")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile as triton_compile, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from ppo_ops.logits import triton_backend as tb, triton_kernels as _triton_kernels  # noqa: E402
from ppo_ops.core.contracts import RowInputs, ShardOptions  # noqa: E402
from ppo_ops.core import row_stats  # noqa: E402
from ppo_ops.core.row_stats import NUM_PARTIALS  # noqa: E402
from ppo_ops.core.triton_common import options, transform_args  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H200 (Hopper), 32-thread warps
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _specialize(kernel, args, kwargs):
    """What Triton's launcher derives from the arguments: the compile key and the compile inputs."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    key = (tuple(map(str, specialization)), str(options))
    return key, (backend, bound_args, specialization, options)


def _ptx(kernel, args, kwargs):
    _, (backend, bound_args, specialization, options) = _specialize(kernel, args, kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                          options=options.__dict__).asm["ptx"]


def _forward_args(logits, row_mask, keep_mask, seg_len, n_valid, inv_t=1.0, vocab_start=0, **transform):
    n_rows = logits.shape[0]
    out = torch.empty((logits.shape[1] // seg_len, 5, n_rows))
    config = tb.launch_config("forward", logits.dtype, seg_len, interpreted=False)
    target_col = torch.zeros(n_rows, dtype=torch.int64)
    shard = ShardOptions(inv_temperature=inv_t, n_valid=n_valid, seg_len=seg_len, vocab_start=vocab_start,
                         **transform)
    _, kwargs = tb.forward_launch_args(RowInputs(logits, target_col, keep_mask, row_mask), shard, True, out, config)
    return (), kwargs  # the launch passes every argument by name


def forward_key_count(dtype, n_rows=3, v_global=8000, vocab_size=7990):
    """Distinct forward binaries over all ranks of TP = 1, 2, 4, 8 (V_local = 8000, 4000, 2000, 1000: only the last
    is not a multiple of 16), with a keep mask, a row mask and padding on the last rank."""
    logits = torch.zeros((n_rows, v_global), dtype=dtype)
    keep_mask = torch.zeros((n_rows, v_global), dtype=torch.bool)
    row_mask = torch.arange(n_rows) % 2 == 0
    keys = set()
    for tp in (1, 2, 4, 8):
        v_local = v_global // tp
        for rank in range(tp):
            cols = slice(rank * v_local, (rank + 1) * v_local)
            n_valid = max(0, min(v_local, vocab_size - rank * v_local))
            args, kwargs = _forward_args(logits[:, cols].contiguous(), row_mask, keep_mask[:, cols].contiguous(),
                                         v_global // 8, n_valid, vocab_start=rank * v_local)
            keys.add(_specialize(_triton_kernels.forward_partials_kernel, args, kwargs)[0])
    return len(keys)


def qwen3_ptx(pass_name, dtype, keep, n_rows=8, v_local=151936, **transform):
    """PTX of a Qwen3-sized launch of the pass; `transform`: ShardOptions' softcap / row_inv_temperature."""
    logits = torch.empty((n_rows, v_local), dtype=dtype)
    keep_mask = torch.zeros((n_rows, v_local), dtype=torch.bool) if keep else None
    row_mask = torch.arange(n_rows) % 2 == 0
    if pass_name == "forward":
        args, kwargs = _forward_args(logits, row_mask, keep_mask, v_local // 8, v_local - 5, **transform)
        return _ptx(_triton_kernels.forward_partials_kernel, args, kwargs)
    config = tb.launch_config("backward", dtype, v_local, interpreted=False)
    vec = torch.zeros(n_rows)
    args = (logits, logits, row_mask.view(torch.uint8), torch.zeros(n_rows, dtype=torch.int64),
            logits if keep_mask is None else keep_mask.view(torch.uint8), vec, vec, vec, vec, vec, vec,
            row_mask.view(torch.uint8), row_mask.view(torch.uint8), v_local, v_local - 5, 0, v_local, v_local, v_local,
            1.5)
    kwargs = dict(HAS_ROW_MASK=True, HAS_KEEP=keep, HAS_GRAD_LOG_PROB=True, HAS_GRAD_ENTROPY=True,
                  HAS_LOG_PROB_DEFINED=True, HAS_MASS=True, SCALE=True, BLOCK_V=config.block_v,
                  ROUND_BF16_BY_BITS=False, **options(config))
    if transform:
        shard = ShardOptions(inv_temperature=1.5, n_valid=v_local - 5, seg_len=v_local // 8, vocab_start=0,
                             **transform)
        extra = transform_args(shard, vec)
        del extra["inv_temperature"]  # passed by position above
        kwargs.update(extra)
    return _ptx(_triton_kernels.backward_grad_kernel, args, kwargs)


def main():
    report = {"forward_keys": {name: forward_key_count(dtype) for name, dtype in DTYPES.items()}, "ptx": {}}
    for pass_name in ("forward", "backward"):
        for name, dtype in DTYPES.items():
            for keep in (False, True):
                ptx = qwen3_ptx(pass_name, dtype, keep)
                report["ptx"][f"{pass_name} {name} keep={keep}"] = {
                    "v4_load": "ld.global.v4" in ptx, "v4_store": "st.global.v4" in ptx}
    # With a temperature the scaled logit must be rounded on its own (mul.rn), not contracted into d = z - m.
    logits = torch.empty((8, 151936), dtype=torch.bfloat16)
    args, kwargs = _forward_args(logits, None, None, 151936 // 8, 151936, inv_t=1.5)
    report["forward_scaled_mul_rn"] = "mul.rn.f32" in _ptx(_triton_kernels.forward_partials_kernel, args, kwargs)
    report["transforms"] = {}
    for pass_name in ("forward", "backward"):
        for name, transform in (("rows", dict(row_inv_temperature=torch.full((8,), 1.25))),
                                ("softcap", dict(softcap=30.0))):
            ptx = qwen3_ptx(pass_name, torch.bfloat16, False, **transform)
            report["transforms"][f"{pass_name} {name}"] = {
                "v4_load": "ld.global.v4" in ptx, "ex2_ftz": "ex2.approx.ftz.f32" in ptx,
                "rcp": "rcp.approx.ftz.f32" in ptx}
    report["merge"] = {}
    for keep in (False, True):  # the fused merge: the interpreter does not enforce the compiler's rules on globals
        n_rows = 300
        args = (torch.empty((8, NUM_PARTIALS, n_rows)), torch.empty((row_stats.MERGED_FIELDS, n_rows)),
                torch.empty((row_stats.MERGED_FLAGS, n_rows), dtype=torch.uint8), n_rows)
        kwargs = dict(NUM_SEG=8, HAS_KEEP=keep, BLOCK_R=tb._MERGE_BLOCK_R)
        report["merge"][f"keep={keep}"] = ".entry" in _ptx(_triton_kernels.merge_partials_kernel, args, kwargs)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
