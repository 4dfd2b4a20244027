"""Compiles the kernels of reduction_order="sglang" (ppo_ops/logits/sglang_order_kernels.py) for an H200 (sm_90) on
a machine without a GPU; used by tests/test_sglang_order.py, which runs `python -m tests.sglang_order_compile_check`
in a child process (without TRITON_INTERPRET: the interpreter runs code the compiler rejects, e.g. shapes of a branch
that a constexpr condition never takes).

Prints one JSON object: {"block_sums": {"<width> <variant>": number of ex2.approx instructions}, "combine": bool}
for every load width (4, 2, 1) and variant (plain; continuing a chain, handing one on, scaled, row mask; the tail
alone), and the combine kernel.
"""

import json
import os

import torch

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("run without TRITON_INTERPRET: the compiler cannot run in an interpreting process")

from tests.triton_compile_check import _ptx  # noqa: E402
from ppo_ops.logits import sglang_order_kernels as kernels  # noqa: E402

VOCAB = 151936
VARIANTS = {  # (HEAD_CONTINUES, TAIL_CONTINUES, TAIL_ONLY, SCALED, HAS_ROW_MASK)
    "plain": (False, False, False, False, False),
    "continuing": (True, True, False, True, True),
    "tail_only": (False, True, True, False, False),
}


def block_sums_report() -> dict:
    rows = 4
    logits = torch.empty((rows, VOCAB), dtype=torch.bfloat16)
    f32 = torch.empty(rows)
    chains = torch.empty((rows, 2, 128))
    sums = torch.empty((rows, 2, 149))
    mask = torch.empty(rows, dtype=torch.uint8)
    out = {}
    for width in (4, 2, 1):
        for name, (head, tail, only, scaled, row_mask) in VARIANTS.items():
            ptx = _ptx(kernels.block_sums_kernel, (), dict(
                logits_ptr=logits, shift_ptr=f32, row_mask_ptr=mask, head_ptr=chains, sums_ptr=sums, tail_ptr=chains,
                stride_row=VOCAB, n_valid=VOCAB, start=0, first_block=0, n_blocks=149, n_out=149,
                inv_temperature=1.0, WIDTH=width, HEAD_CONTINUES=head, TAIL_CONTINUES=tail, TAIL_ONLY=only,
                SCALED=scaled, HAS_ROW_MASK=row_mask, num_warps=4))
            out[f"{width} {name}"] = ptx.count("ex2.approx.f32")
    return out


def combine_compiles() -> bool:
    rows = 4
    sums = torch.empty((rows, 2, 149))
    f32 = torch.empty(rows)
    ptx = _ptx(kernels.combine_kernel, (), dict(
        sums_ptr=sums, shift_ptr=f32, target_ptr=f32, row_mask_ptr=torch.empty(rows, dtype=torch.uint8),
        out_ptr=torch.empty((5, rows)), n_rows=rows, n_blocks=149, HAS_ROW_MASK=True, ROWS=128))
    return "__nv_logf" in ptx or "lg2" in ptx or ".entry" in ptx


if __name__ == "__main__":
    print(json.dumps({"block_sums": block_sums_report(), "combine": combine_compiles()}))
