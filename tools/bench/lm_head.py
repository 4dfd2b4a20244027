"""LM-head bench (--suite=lm_head): log-prob + entropy straight from hidden states, fused vs the GEMMs around it.

    bazel run --config=gpu //tools:bench -- --suite=lm_head --out_dir=$PWD/bench_out            # TP=1, one H200
    bazel run --config=gpu //tools:bench -- --suite=lm_head --tp=2 --out_dir=$PWD/bench_out     # TP=2, NCCL
    bazel run --config=gpu //tools:bench -- --suite=lm_head_own --out_dir=$PWD/bench_out        # ppo_ops + GEMMs only
    python3 tools/bench/bench.py --suite=lm_head_smoke --device=cpu --out_dir=/tmp/b            # plumbing only

Cases: T in (8192, 32768), H = 4096, V = 151936, bf16, forward + backward with upstream gradients for the log-prob and
(where the provider has one) the entropy. At --tp=1 the suite also runs, on the local shape of a TP=2
rank (V = 75968) for the gemms, unfused and fused providers: the reference of the TP=2 target. Providers:
  gemms     the three cuBLAS GEMMs alone: logits = X W^T, dX = G W, dW = G^T X (G a stored [T, V_local] gradient)
  unfused   logits = X W^T (cuBLAS), ppo_ops.log_probs_and_entropy (Triton) with entropy="grad", autograd's GEMMs
            back; at TP > 1 dX is all-reduced (as Megatron's column-parallel layer does)
  fused     ppo_ops.linear_log_probs_and_entropy(backend="triton", entropy="grad"), validate on (default) and off
  liger     Liger-Kernel's fused linear cross entropy (log-prob only, reduction "mean"; TP=1), where installed
  cce       Cut Cross-Entropy's linear_cross_entropy (log-prob only, per token; TP=1), gradient filtering on (its
            default: gradient blocks under bf16 eps/32 are skipped, an approximation), where installed
  cce_exact the same with filter_eps=None: exact gradients
  verl      verl's fused linear cross entropy (log-prob and entropy, both gradients; vocabulary-parallel), where its
            wheel is installed: its kernel modules are loaded without verl's package import, which needs its trainer
Reported per case (slowest rank at TP > 1): p20/p50/p80 ms, TFLOP/s against the three GEMMs' count 6 T H V_local,
time over the gemms case of the same shape, peak extra memory (max allocated during one step over what was allocated
before it, inputs alive), and for the fused provider the largest |log-prob difference| against the unfused one
(a sanity check, not an error measure: the unfused path rounds its logits to bf16, about 0.03 at |z| ~ 5; the fused
op keeps them in fp32).
Results go to lm_head.csv and lm_head.md in --out_dir, with the targets' verdicts (time <= 1.05 x gemms; peak extra
<= dX + dW + 256 MiB at T = 32768; TP = 2 rank within 15% of TP = 1 on the local shape, read from the TP = 1 rows of
the same CSV when present).
"""

from __future__ import annotations

import csv
import dataclasses
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from tools.bench import measure

HIDDEN = 4096
VOCAB = 151936
TOKENS = (8192, 32768)
PROVIDERS = ("gemms", "unfused", "fused", "fused_novalidate", "liger", "cce", "cce_exact", "verl")
PEERS = ("liger", "cce", "cce_exact", "verl")  # other projects' kernels
OWN = ("gemms", "fused", "fused_novalidate")  # ppo_ops' fused paths and the GEMMs they are measured against
OWN_AND_UNFUSED = ("gemms", "unfused", "fused", "fused_novalidate")
FIELDS = ("label", "provider", "T", "H", "V", "tp", "v_local", "status", "p20_ms", "p50_ms", "p80_ms", "reps", "tflops",
          "vs_gemms", "peak_extra_gib", "grad_gib", "max_dlogprob_vs_unfused")
GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class HeadCase:
    provider: str
    T: int
    H: int
    V: int  # global vocabulary
    tp: int

    @property
    def v_local(self):
        return self.V // self.tp


def suite(name: str, tp: int) -> list[HeadCase]:
    if name == "lm_head_smoke":
        return [HeadCase(p, 16, 64, 256, tp) for p in PROVIDERS]
    own = name == "lm_head_own"
    cases = [HeadCase(p, T, HIDDEN, VOCAB, tp) for T in TOKENS for p in (OWN if own else PROVIDERS)]
    if tp == 1:  # a TP=2 rank's local shape at TP=1: the reference of the TP=2 target, for ppo_ops' own paths
        cases += [HeadCase(p, T, HIDDEN, VOCAB // 2, tp) for T in TOKENS for p in (OWN if own else OWN_AND_UNFUSED)]
    return cases


# --- inputs and providers ---

class Inputs:
    def __init__(self, case: HeadCase, device, seed: int, group, rank: int):
        # Seeded on the device (fast at these sizes); every rank draws the same global tensors, then keeps its slice.
        gen = torch.Generator(device=device).manual_seed(seed)
        dtype = torch.bfloat16
        self.group, self.rank = group, rank
        self.hidden = torch.randn((case.T, case.H), generator=gen, device=device).to(dtype)  # the same on every rank
        full = torch.randn((case.V, case.H), generator=gen, device=device, dtype=dtype)
        full.mul_(3.0 / case.H**0.5)  # logits of O(3): a peaked, not one-hot, distribution
        self.weight = full[rank * case.v_local:(rank + 1) * case.v_local].clone()
        del full
        self.tokens = torch.randint(0, case.V, (case.T,), generator=gen, device=device)
        self.g_lp = 0.5 + torch.rand(case.T, generator=gen, device=device)
        self.g_ent = torch.rand(case.T, generator=gen, device=device) * 2 - 1
        self.g_logits = None  # the gemms case's stored logits gradient, made on first use

    def logits_grad(self, case):
        if self.g_logits is None:
            self.g_logits = torch.randn((case.T, case.v_local), device=self.hidden.device, dtype=torch.bfloat16)
        return self.g_logits


def _leaf(x):
    return x.detach().requires_grad_(True)


def _build(case: HeadCase, inp: Inputs, interpreted: bool):
    """(step, forward log-probs or None) of a provider, or a string saying why it cannot run."""
    import ppo_ops

    backend = "triton" if (inp.hidden.is_cuda or interpreted) else "torch"
    if case.provider == "gemms":
        g = inp.logits_grad(case)

        def step():
            logits = inp.hidden @ inp.weight.T
            return logits, g @ inp.weight, g.T @ inp.hidden

        return step, None
    if case.provider == "unfused":
        def run(grad):
            x, w = _leaf(inp.hidden), _leaf(inp.weight)
            logits = x @ w.T
            out = ppo_ops.log_probs_and_entropy(logits, inp.tokens, tp_group=inp.group, entropy="grad",
                                                backend=backend)
            if not grad:
                return out.log_probs.detach()
            dx, dw = torch.autograd.grad([out.log_probs, out.entropy], [x, w], [inp.g_lp, inp.g_ent])
            if inp.group is not None:
                dist.all_reduce(dx, group=inp.group)  # the column-parallel layer's dX all-reduce
            return dx, dw

        return (lambda: run(True)), (lambda: run(False))
    if case.provider in ("fused", "fused_novalidate"):
        validate = case.provider == "fused"

        def run(grad):
            x, w = _leaf(inp.hidden), _leaf(inp.weight)
            out = ppo_ops.linear_log_probs_and_entropy(x, w, inp.tokens, tp_group=inp.group, entropy="grad",
                                                       backend=backend, validate=validate)
            if not grad:
                return out.log_probs.detach()
            return torch.autograd.grad([out.log_probs, out.entropy], [x, w], [inp.g_lp, inp.g_ent])

        return (lambda: run(True)), (lambda: run(False))
    if case.provider == "liger":
        if case.tp > 1:
            return "Liger's fused linear CE has no vocabulary parallelism"
        if not inp.hidden.is_cuda:
            return "Liger's kernels need CUDA"
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        except Exception as error:  # not installed, or fails at import
            return f"liger_kernel is not importable ({_why(error)})"

        def step():
            x, w = _leaf(inp.hidden), _leaf(inp.weight)
            loss = liger_fused_linear_cross_entropy(x, w, inp.tokens, reduction="mean")
            loss = loss[0] if isinstance(loss, tuple) else loss
            return torch.autograd.grad(loss, [x, w])

        return step, None
    if case.provider in ("cce", "cce_exact"):
        if case.tp > 1:
            return "Cut Cross-Entropy has no vocabulary parallelism"
        if not inp.hidden.is_cuda:
            return "Cut Cross-Entropy's kernels need CUDA"
        try:
            from cut_cross_entropy import linear_cross_entropy
        except Exception as error:
            return f"cut_cross_entropy is not importable ({_why(error)})"
        filter_eps = "high" if case.provider == "cce" else None

        def run(grad):
            x, w = _leaf(inp.hidden), _leaf(inp.weight)
            loss = linear_cross_entropy(x, w, inp.tokens, reduction="none", filter_eps=filter_eps)
            if not grad:
                return -loss.detach()
            return torch.autograd.grad(loss, [x, w], -inp.g_lp)  # loss = -log p

        return (lambda: run(True)), (lambda: run(False))
    if case.provider == "verl":
        if not inp.hidden.is_cuda:
            return "verl's kernels need CUDA"
        try:
            verl_lce = _verl_linear_cross_entropy()
        except Exception as error:
            return f"verl's kernel is not loadable ({_why(error)})"

        def run(grad):
            x, w = _leaf(inp.hidden), _leaf(inp.weight)
            log_probs, entropy = verl_lce(x, w, inp.tokens, 1.0, "none", inp.group)
            if not grad:
                return log_probs.detach()
            return torch.autograd.grad([log_probs, entropy], [x, w], [inp.g_lp, inp.g_ent])

        return (lambda: run(True)), (lambda: run(False))
    raise ValueError(case.provider)


def _why(error):
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"


def _verl_linear_cross_entropy():
    """verl's LinearCrossEntropy.apply, loaded from its installed files. `import verl` runs the package's __init__,
    which imports its trainer (tensordict, ray, ...); the kernel needs only torch, triton and four device helpers of
    verl.utils.device, so the parent packages are registered as bare namespaces and that module as a small stand-in."""
    import importlib
    import importlib.util
    import sys
    import types

    if "verl.utils.kernel.linear_cross_entropy" in sys.modules:
        return sys.modules["verl.utils.kernel.linear_cross_entropy"].linear_cross_entropy
    spec = importlib.util.find_spec("verl")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed")
    root = os.path.join(list(spec.submodule_search_locations)[0])
    for name, path in (("verl", root), ("verl.utils", os.path.join(root, "utils")),
                       ("verl.utils.kernel", os.path.join(root, "utils", "kernel"))):
        module = types.ModuleType(name)
        module.__path__ = [path]
        sys.modules.setdefault(name, module)
    device = types.ModuleType("verl.utils.device")
    device.is_cuda_available = torch.cuda.is_available()
    device.get_device_capability = lambda device_id=0: torch.cuda.get_device_capability(device_id)
    device.get_device_name = lambda: "cuda"
    device.get_torch_device = lambda: torch.cuda
    sys.modules.setdefault("verl.utils.device", device)
    return importlib.import_module("verl.utils.kernel.linear_cross_entropy").linear_cross_entropy


# --- running ---

def _row(case, status, **values):
    row = {k: "" for k in FIELDS}
    row.update(provider=case.provider, T=case.T, H=case.H, V=case.V, tp=case.tp, v_local=case.v_local, status=status)
    row.update({k: v for k, v in values.items() if k in row})
    return row


def _measure_case(case, inp, device, cfg, interpreted, gemm_ms, unfused_lp):
    built = _build(case, inp, interpreted)
    if isinstance(built, str):
        return _row(case, f"skipped: {built}"), None
    step, forward = built
    lp = forward() if forward is not None else None
    nothing = lambda: None  # noqa: E731
    call = lambda _: step()  # noqa: E731
    estimate = measure.warm_up(call, nothing, device, cfg["warmup"])
    peak = measure.peak_extra_bytes(call, nothing, device)
    timing = measure.time_step(call, nothing, device, estimate_ms=estimate, min_reps=cfg["min_reps"],
                               max_reps=cfg["max_reps"], target_ms=cfg["target_ms"])
    p = _slowest([timing.p20_ms, timing.p50_ms, timing.p80_ms, -1.0 if peak is None else float(peak)], inp.group)
    flops = 6.0 * case.T * case.H * case.v_local
    grad_bytes = 2 * (case.T * case.H + case.v_local * case.H)  # dX + dW in bf16
    values = dict(p20_ms=f"{p[0]:.3f}", p50_ms=f"{p[1]:.3f}", p80_ms=f"{p[2]:.3f}", reps=timing.reps,
                  tflops=f"{flops / (p[1] * 1e-3) / 1e12:.1f}", grad_gib=f"{grad_bytes / GIB:.3f}")
    if p[3] >= 0:
        values["peak_extra_gib"] = f"{p[3] / GIB:.3f}"
    if gemm_ms:
        values["vs_gemms"] = f"{p[1] / gemm_ms:.3f}"
    if lp is not None and unfused_lp is not None and case.provider != "unfused":
        values["max_dlogprob_vs_unfused"] = f"{(lp.float() - unfused_lp.float()).abs().max().item():.2e}"
    return _row(case, "ok", **values), (p[1], lp)


def _slowest(values, group):
    """Element-wise max over the ranks (the slowest rank's times, the largest peak)."""
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def run_rank(rank, world_size, suite_name, device_type, out_dir, cfg):
    group = dist.group.WORLD if world_size > 1 else None
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    rows, start = [], time.time()
    cases = suite(suite_name, world_size)
    shapes = list(dict.fromkeys((c.T, c.H, c.V) for c in cases))
    for T, H, V in shapes:
        inp = Inputs(HeadCase("gemms", T, H, V, world_size), device, cfg["seed"], group, rank)
        gemm_ms, unfused_lp = None, None
        for case in [c for c in cases if (c.T, c.H, c.V) == (T, H, V)]:
            if cfg["time_budget_s"] and time.time() - start > cfg["time_budget_s"]:
                rows.append(_row(case, "skipped: time budget"))
                continue
            try:
                row, result = _measure_case(case, inp, device, cfg, interpreted, gemm_ms, unfused_lp)
            except torch.cuda.OutOfMemoryError:
                row, result = _row(case, "OOM"), None
                torch.cuda.empty_cache()
            except Exception as error:  # a peer's kernel failing is a row of the table, not the end of the run
                if case.provider not in PEERS:
                    raise
                row, result = _row(case, f"error: {_why(error)}"), None
            rows.append(row)
            if rank == 0:
                print(" ".join(f"{k}={row[k]}" for k in ("provider", "T", "V", "tp", "status", "p50_ms", "tflops",
                                                         "vs_gemms", "peak_extra_gib") if row[k] != ""), flush=True)
            if result is not None and case.provider == "gemms":
                gemm_ms = result[0]
            if result is not None and case.provider == "unfused":
                unfused_lp = result[1]
        del inp
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        _write(out_dir, [dict(row, label=cfg.get("label", "")) for row in rows])


def _write(out_dir, rows):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "lm_head.csv")
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerows(rows)
    with open(path, newline="") as f:
        all_rows = list(csv.DictReader(f))
    md = os.path.join(out_dir, "lm_head.md")
    with open(md, "w") as f:
        f.write(render(all_rows))
    print(f"wrote {path} and {md}")
    print(verdicts(all_rows))


def render(rows) -> str:
    cols = ("label", "provider", "T", "V", "tp", "status", "p50_ms", "tflops", "vs_gemms", "peak_extra_gib", "grad_gib",
            "max_dlogprob_vs_unfused")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n\n" + verdicts(rows) + "\n"


def _find(rows, provider, T, V, tp):
    hits = [r for r in rows if r["provider"] == provider and int(r["T"]) == T and int(r["V"]) == V
            and int(r["tp"]) == tp and r["status"] == "ok"]
    return hits[-1] if hits else None


def verdicts(rows) -> str:
    out = ["Targets (fused = linear_log_probs_and_entropy; last row of each case in the CSV):"]
    for T in TOKENS:
        for tp, V in ((1, VOCAB), (2, VOCAB)):
            gem, fus, nov = (_find(rows, p, T, V, tp) for p in ("gemms", "fused", "fused_novalidate"))
            if gem and fus:
                for name, r in (("validate on", fus), ("validate off", nov)):
                    if r:
                        ratio = float(r["p50_ms"]) / float(gem["p50_ms"])
                        out.append(f"- time T={T} TP={tp} ({name}): {float(r['p50_ms']):.1f} ms = {ratio:.2f} x the "
                                   f"three GEMMs ({float(gem['p50_ms']):.1f} ms): "
                                   f"{'MET' if ratio <= 1.05 else 'MISSED'} (target <= 1.05)")
            if fus and fus.get("peak_extra_gib") and T == 32768:
                limit = float(fus["grad_gib"]) + 256 * measure.MIB / GIB
                peak = float(fus["peak_extra_gib"])
                out.append(f"- memory T={T} TP={tp}: peak extra {peak:.2f} GiB vs dX + dW + 256 MiB = {limit:.2f} GiB: "
                           f"{'MET' if peak <= limit else 'MISSED'}")
        for name in ("fused", "fused_novalidate"):
            tp2, ref = _find(rows, name, T, VOCAB, 2), _find(rows, name, T, VOCAB // 2, 1)
            if tp2 and ref:
                ratio = float(tp2["p50_ms"]) / float(ref["p50_ms"])
                out.append(f"- TP=2 T={T} ({name}): slowest rank {float(tp2['p50_ms']):.1f} ms = {ratio:.2f} x TP=1 on "
                           f"the local shape: {'MET' if ratio <= 1.15 else 'MISSED'} (target <= 1.15)")
    return "\n".join(out)


def main(suite_name, tp, device_type, out_dir, cfg) -> int:
    if tp == 1:
        run_rank(0, 1, suite_name, device_type, out_dir, cfg)
        return 0
    from tests.ranks import run_ranks

    backend = "nccl" if device_type == "cuda" else "gloo"
    run_ranks(tp, _rank_entry, suite_name, device_type, out_dir, cfg, backend=backend)
    return 0


def _rank_entry(rank, world_size, suite_name, device_type, out_dir, cfg):
    run_rank(rank, world_size, suite_name, device_type, out_dir, cfg)
