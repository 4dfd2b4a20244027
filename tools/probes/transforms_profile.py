"""Probe: what each logit transform costs the logits op, kernel by kernel, on one CUDA GPU.

    python3 tools/probes/transforms_profile.py --out_dir=/tmp/prof [--tokens=8192]

For T rows of V = 151936 bf16 logits (randn x 3, seed 0), `log_probs_and_entropy(entropy="grad", validate=False)`
then backward through log-prob + entropy, in four ways: no transform, a scalar temperature of 0.8, a per-row [T]
temperature (every row 0.8, so its values are the scalar's), and a softcap of 30 (Gemma 2's). Each way runs WARMUP
untimed calls, then CALLS calls under torch.profiler; its CUDA kernels' device times are summed by name and divided
by CALLS. The bench (`--suite=transforms`) times whole calls against the call without the transform; this says
which pass a transform's cost sits in. Writes kernels.csv (label, T, way, kernel, ms per call) to --out_dir and
prints each way's table.
"""

from __future__ import annotations

import csv
import os
import pathlib
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(os.path.abspath(__file__)).parents[2]))  # the repository root

from absl import app, flags

from ppo_ops.runtime import cli
from tools.bench import measure
from tools.bench.common import QWEN3_VOCAB

_OUT_DIR = flags.DEFINE_string("out_dir", None, "Directory of kernels.csv.", required=True)
_TOKENS = flags.DEFINE_integer("tokens", 8192, "T, the rows of logits.")
_LABEL = flags.DEFINE_string("label", "", "A name for this run, written on each row.")

WARMUP = 5
CALLS = 10
TEMPERATURE = 0.8
SOFTCAP = 30.0
LOGIT_SCALE = 3.0
TOP_KERNELS = 6


def ways(tokens: int) -> dict:
    return {"none": {}, "scalar_temp": dict(temperature=TEMPERATURE),
            "row_temp": dict(temperature=torch.full((tokens,), TEMPERATURE, device="cuda")),
            "softcap": dict(softcap=SOFTCAP)}


def main(argv):
    del argv
    import ppo_ops

    if not torch.cuda.is_available():
        raise app.UsageError("the logits op's kernels are profiled on CUDA: run on a GPU")
    out = pathlib.Path(_OUT_DIR.value)
    out.mkdir(parents=True, exist_ok=True)
    T = _TOKENS.value
    torch.manual_seed(0)
    logits = (torch.randn(T, QWEN3_VOCAB, device="cuda") * LOGIT_SCALE).bfloat16().requires_grad_()
    tokens = torch.randint(0, QWEN3_VOCAB, (T,), device="cuda")
    rows = []
    for name, options in ways(T).items():
        def step(options=options):
            res = ppo_ops.log_probs_and_entropy(logits, tokens, entropy="grad", validate=False, **options)
            (res.log_probs.sum() + res.entropy.sum()).backward()
            logits.grad = None

        totals = {kernel: ms for kernel, (ms, _) in measure.kernel_ms(step, CALLS, WARMUP).items()}
        print(f"== {name}: kernels {sum(totals.values()):.3f} ms per call", flush=True)
        for kernel, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]:
            print(f"   {ms:8.3f} ms  {kernel}")
            rows.append(dict(label=_LABEL.value, T=T, way=name, kernel=kernel, ms=f"{ms:.4f}"))
    with open(out / "kernels.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    cli.run(main, program="transforms_profile")
