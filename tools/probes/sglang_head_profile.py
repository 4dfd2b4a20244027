"""Probe: where the exact LM head's time goes (reduction_order="sglang"), kernel by kernel, on one CUDA GPU.

    python3 tools/probes/sglang_head_profile.py --out_dir=/tmp/prof [--hidden=1024,4096] [--tokens=8192]

For each (H, T), V = 151936, bf16, TP = 1, the bench's inputs and PPO loss (tools/bench/lm_head.py): the three GEMMs,
the exact token loss on its default path and with working_memory=0 (the recompute path), the exact general head, and
the sglang-order logits path with the loss; and the token loss in the default order with PPO and with GSPO (the
sequence schedule, the bench's packed sequences). Each way: the median of REPS fwd + bwd calls (CUDA events), its peak
extra memory, then one call under torch.profiler, whose CUDA kernels are summed by name. Writes profile.csv (label,
H, T, way, ms, peak_mib) and kernels.txt (each way's kernel table) to --out_dir.
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
from tools.bench import lm_head, measure
from tools.bench.common import QWEN3_VOCAB

_OUT_DIR = flags.DEFINE_string("out_dir", None, "Directory of profile.csv and kernels.txt.", required=True)
_HIDDEN = flags.DEFINE_list("hidden", ["1024", "4096"], "H values.")
_TOKENS = flags.DEFINE_list("tokens", ["8192"], "T values.")
_LABEL = flags.DEFINE_string("label", "", "A name for this run, written on each row.")
_WAYS = flags.DEFINE_list("ways", [], "Only these ways (default: every one).")

REPS = 5
TOP_KERNELS = 14
MIB = float(1 << 20)


def ways(c_T: int, H: int, device):
    import ppo_ops

    inp = lm_head.make_inputs(lm_head.case("exact_token_loss", c_T, H=H), device, seed=1234)
    loss = inp.ppo_loss()
    tokens = inp.tokens

    def gemms():
        x, w = inp.hidden, inp.weight
        z = x @ w.T
        return z @ w, z.T @ x

    def token_loss(the_loss=loss, **options):
        def run():
            x, w = inp.leaves()
            out, _ = ppo_ops.linear_token_loss(x, w, tokens, the_loss, entropy="grad", **options)
            return torch.autograd.grad(out, [x, w])
        return run

    def general():
        x, w = inp.leaves()
        out = ppo_ops.linear_log_probs_and_entropy(x, w, tokens, reduction_order="sglang", entropy="grad")
        return torch.autograd.grad([out.log_probs, out.entropy], [x, w], [inp.g_lp, inp.g_ent])

    def logits_path():
        from ppo_ops.lm_head import sglang_matmul
        x, w = inp.hidden, inp.weight
        z = torch.empty((c_T, QWEN3_VOCAB), dtype=torch.bfloat16, device=device)
        sglang_matmul.bf16_logits(x, w, z, None, "triton")
        z.requires_grad_(True)
        out = ppo_ops.log_probs_and_entropy(z, tokens, reduction_order="sglang", entropy="grad")
        lsum = loss(out.log_probs, out.entropy, torch.arange(c_T, device=device)).sum()
        (g,) = torch.autograd.grad(lsum, z)
        del z
        return g @ w, g.T @ x

    return dict(gemms=gemms, exact_token_loss=token_loss(reduction_order="sglang"),
                exact_token_loss_lean=token_loss(reduction_order="sglang", working_memory=0), exact=general,
                sglang_logits_loss=logits_path, token_loss=token_loss(),
                token_loss_gspo=lambda: token_loss(inp.gspo_loss(tis=False))())


def peak_mib(fn, device) -> float:
    """Peak allocated over what was allocated before one call (measure.peak_extra_bytes), MiB."""
    return measure.peak_extra_bytes(lambda _: fn(), lambda: None, device) / MIB


def kernel_table(fn) -> str:
    totals = measure.kernel_ms(fn)
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    total = sum(ms for ms, _ in totals.values())
    lines = [f"  kernels total {total:.2f} ms"]
    lines += [f"  {ms:8.2f} ms {count:5.0f}x  {name}" for name, (ms, count) in rows[:TOP_KERNELS]]
    return "\n".join(lines)


def main(argv):
    del argv
    if not torch.cuda.is_available():
        raise app.UsageError("the exact head's kernels are profiled on CUDA: run on a GPU")
    out = pathlib.Path(_OUT_DIR.value)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    rows, text = [], []
    for H in (int(h) for h in _HIDDEN.value):
        for T in (int(t) for t in _TOKENS.value):
            for name, fn in ways(T, H, device).items():
                if _WAYS.value and name not in _WAYS.value:
                    continue
                ms, mib = measure.event_ms(fn, REPS), peak_mib(fn, device)
                rows.append(dict(label=_LABEL.value, H=H, T=T, way=name, ms=f"{ms:.3f}", peak_mib=f"{mib:.1f}"))
                text.append(f"== H={H} T={T} {name}: {ms:.2f} ms, peak {mib:.0f} MiB\n{kernel_table(fn)}")
                print(text[-1], flush=True)
                torch.cuda.empty_cache()
    with open(out / "profile.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "kernels.txt").write_text("\n\n".join(text) + "\n")


if __name__ == "__main__":
    cli.run(main, program="sglang_head_profile")
