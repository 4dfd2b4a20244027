"""Probe: the logits op's gradient pass compiled for Hopper (sm_90) without a GPU, instructions per logit transform.

    python3 tools/probes/backward_sass.py     (TRITON_INTERPRET unset; runs on a CPU machine)

Compiles `backward_grad_kernel` (ppo_ops/logits/triton_kernels.py) with the launcher's bf16 tile configuration
(logits/triton_backend.py, launch_config) for sm_90 through this Python's Triton and its bundled ptxas, once per
transform (none, a scalar temperature, a per-row one, a softcap, a softcap with a temperature), and counts the SASS
instructions (cuobjdump) and the MUFU ones among them. A program's threads each hold BLOCK_V / (32 num_warps)
logits of the row, so the difference of two counts over that is what a transform adds per logit. The pass runs near
copy bandwidth, where such instructions show in its time (docs/performance.md, row 27): the counts predict which
way a change moves the bench, which then measures it. The code is this Triton's (the CPU venv's may be newer than a
GPU runner's), so counts compare variants, not Triton versions.
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
_POINTERS = {"logits_ptr": "*bf16", "out_ptr": "*bf16", "row_mask_ptr": "*u8", "tokens_ptr": "*i64",
             "keep_ptr": "*u8", "log_prob_defined_ptr": "*u8", "row_has_mass_ptr": "*u8"}
_INTS = ("v_local", "n_valid", "vocab_start", "logits_row_stride", "out_row_stride", "keep_row_stride")
_SASS_LINE = re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+(\S+)")


def sass(variant, config) -> list:
    """The SASS opcodes of the gradient pass compiled for `variant` with `config`."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ppo_ops.logits import triton_kernels

    scale, row_scale, softcap = variant
    fn = triton_kernels.backward_grad_kernel
    constexprs = dict(HAS_ROW_MASK=False, HAS_KEEP=False, HAS_GRAD_LOG_PROB=True, HAS_GRAD_ENTROPY=True,
                      HAS_LOG_PROB_DEFINED=True, HAS_MASS=True, SCALE=scale, BLOCK_V=config.block_v,
                      ROUND_BF16_BY_BITS=False, ROW_SCALE=row_scale, SOFTCAP=softcap)
    signature = {name: ("constexpr" if name in constexprs else _POINTERS.get(name)
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
        raise app.UsageError("unset TRITON_INTERPRET: this probe compiles the kernel for sm_90")
    import torch

    from ppo_ops.logits.triton_backend import launch_config

    config = launch_config("backward", torch.bfloat16, 151936, interpreted=False)
    per_thread = config.block_v // (32 * config.num_warps)
    print(f"gradient pass, bf16: BLOCK_V {config.block_v}, {config.num_warps} warps: {per_thread} logits a thread")
    base = None
    for name, variant in VARIANTS.items():
        ops = sass(variant, config)
        mufu = sum(op.startswith("MUFU") for op in ops)
        base = len(ops) if base is None else base
        print(f"  {name:13s} {len(ops):5d} SASS instructions ({mufu} MUFU), "
              f"{(len(ops) - base) / per_thread:+.2f} a logit against none")


if __name__ == "__main__":
    cli.run(main, program="backward_sass")
