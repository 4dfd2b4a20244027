"""Probe: the logits op's two passes compiled for Hopper (sm_90) without a GPU, instructions per logit transform.

    python3 tools/probes/logits_sass.py     (TRITON_INTERPRET unset; runs on a CPU machine)

Compiles the forward pass (`forward_partials_kernel`) and the gradient pass (`backward_grad_kernel`,
ppo_ops/logits/triton_kernels.py) with the launcher's bf16 tile configurations (logits/triton_backend.py,
launch_config) for sm_90 through this Python's Triton and its bundled ptxas, once per transform (none, a scalar
temperature, a per-row one, a softcap, a softcap with a temperature), and counts the SASS instructions (cuobjdump)
and the MUFU ones among them. In the gradient pass each thread holds BLOCK_V / (32 num_warps) logits of its row in
one tile, so the difference of two counts over that is what a transform adds per logit; the forward pass loops over
tiles (the transform's code sits in the loop body and in the masked last tile), so its counts compare variants
only. The passes run near copy bandwidth, where such instructions show in their time (docs/performance.md, row 27):
the counts predict which way a change moves the bench, which then measures it. The code is this Triton's (the CPU
venv's may be newer than a GPU runner's), so counts compare variants, not Triton versions. The CPU suite compiles
the transforms' variants too (tests/triton_compile_check.py, in test_triton_backend).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(os.path.abspath(__file__)).parents[2]))  # the repository root

from absl import app

from ppo_ops.runtime import cli

ARCH = 90
# (SCALE, ROW_SCALE, SOFTCAP) of each variant
VARIANTS = {"none": (False, False, False), "scalar_temp": (True, False, False), "row_temp": (True, True, False),
            "softcap": (False, False, True), "softcap_temp": (True, False, True)}
# Argument types of the two kernels: pointers by name (the rest fp32), integers by name, every other scalar fp32.
_POINTERS = {"logits_ptr": "*bf16", "row_mask_ptr": "*u8", "tokens_ptr": "*i64", "keep_ptr": "*u8",
             "log_prob_defined_ptr": "*u8", "row_has_mass_ptr": "*u8"}
_INTS = ("num_rows", "n_valid", "seg_len", "v_local", "vocab_start", "logits_row_stride", "keep_row_stride",
         "out_row_stride")
_SASS_LINE = re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+(\S+)")


def _configs():
    import torch

    from ppo_ops.logits.triton_backend import launch_config

    return {name: launch_config(name, torch.bfloat16, 151936, interpreted=False) for name in ("forward", "backward")}


def _constexprs(pass_name, variant, config) -> dict:
    scale, row_scale, softcap = variant
    common = dict(HAS_ROW_MASK=False, HAS_KEEP=False, SCALE=scale, BLOCK_V=config.block_v, ROW_SCALE=row_scale,
                  SOFTCAP=softcap)
    if pass_name == "forward":  # bf16 segments 16-byte aligned, as Qwen3's vocabulary gives them
        return dict(common, WITH_ENTROPY=True, LOGITS_ALIGN=8, KEEP_ALIGN=16, LANE_WIDTH=config.lane_width)
    return dict(common, HAS_GRAD_LOG_PROB=True, HAS_GRAD_ENTROPY=True, HAS_LOG_PROB_DEFINED=True, HAS_MASS=True,
                ROUND_BF16_BY_BITS=False)


def sass(pass_name: str, variant, config=None) -> list:
    """The SASS opcodes of the pass ("forward" or "backward") compiled for sm_90 in `variant` (SCALE, ROW_SCALE,
    SOFTCAP) with the launcher's bf16 configuration (or `config`)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ppo_ops.logits import triton_kernels

    config = config or _configs()[pass_name]
    fn = triton_kernels.forward_partials_kernel if pass_name == "forward" else triton_kernels.backward_grad_kernel
    constexprs = _constexprs(pass_name, variant, config)
    pointers = dict(_POINTERS, out_ptr="*fp32" if pass_name == "forward" else "*bf16")  # partials; the gradient
    signature = {name: ("constexpr" if name in constexprs else pointers.get(name)
                        or ("i32" if name in _INTS else "*fp32" if name.endswith("_ptr") else "fp32"))
                 for name in fn.arg_names}
    source = triton.compiler.ASTSource(fn=fn, signature=signature,
                                       constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", ARCH, 32),
                            options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.cubin"
        path.write_bytes(kernel.asm["cubin"])
        text = subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    return [m.group(1) for m in map(_SASS_LINE.match, text.splitlines()) if m]


def main(argv):
    del argv
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise app.UsageError("unset TRITON_INTERPRET: this probe compiles the kernels for sm_90")
    for pass_name, config in _configs().items():
        per_thread = config.block_v // (32 * config.num_warps)
        print(f"{pass_name} pass, bf16: BLOCK_V {config.block_v}, {config.num_warps} warps, {per_thread} logits a "
              f"thread per tile")
        base = None
        for name, variant in VARIANTS.items():
            ops = sass(pass_name, variant, config)
            mufu = sum(op.startswith("MUFU") for op in ops)
            base = len(ops) if base is None else base
            per_logit = f", {(len(ops) - base) / per_thread:+.2f} a logit" if pass_name == "backward" else ""
            print(f"  {name:13s} {len(ops):5d} SASS instructions ({mufu} MUFU), {len(ops) - base:+d} against "
                  f"none{per_logit}")


if __name__ == "__main__":
    cli.run(main, program="logits_sass")
