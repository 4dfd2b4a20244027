"""LM-head bench (--suite=lm_head): log-prob + entropy straight from hidden states, fused vs the GEMMs around it.

    bazel run --config=gpu //tools:bench -- --suite=lm_head --out_dir=$PWD/bench_out            # TP=1, one H200
    bazel run --config=gpu //tools:bench -- --suite=lm_head --tp=2 --out_dir=$PWD/bench_out     # TP=2, NCCL
    bazel run --config=gpu //tools:bench -- --suite=lm_head_own --out_dir=$PWD/bench_out        # ppo_ops + GEMMs only
    python3 tools/bench/bench.py --suite=lm_head_smoke --device=cpu --out_dir=/tmp/b            # plumbing only

Cases: T in (8192, 32768), H = 4096, V = 151936, bf16, forward + backward with upstream gradients for the log-prob and
(where the provider has one) the entropy. At --tp=1 the suite also runs, on the local shape of a TP=2
rank (V = 75968) for the gemms, unfused and fused providers: the reference of the TP=2 target. Providers:
  gemms     the three cuBLAS GEMMs alone: logits = X W^T, dX = G W, dW = G^T X (G a stored [T, V_local] gradient)
  gemm1     one cuBLAS GEMM, logits = X W^T: the yardstick of the forward-only rows
  unfused   logits = X W^T (cuBLAS), ppo_ops.log_probs_and_entropy (Triton) with entropy="grad", autograd's GEMMs
            back; at TP > 1 dX is all-reduced (as Megatron's column-parallel layer does)
  fused     ppo_ops.linear_log_probs_and_entropy(backend="triton", entropy="grad"), validate on (default) and off:
            cuBLAS GEMMs on fixed-shape chunks, the logits op's Triton passes over each fp32 chunk
  fused_gemm the same op on its Triton GEMM kernels (_linear_shell.HALF_PRECISION_PATH = "triton-gemm"): the path
            the chunked one replaced, for before/after in one run
  fused_nograd the fused op's forward under torch.no_grad (old-policy / reference passes), against gemm1
  token_loss ppo_ops.linear_token_loss with ppo_ops.token_losses.policy_loss (clipped surrogate with DAPO's clip
            range, entropy bonus, k3 KL to a reference, token mean), validate on and off (token_loss_novalidate): the
            gradient formed in the forward
  liger     Liger-Kernel's fused linear cross entropy (log-prob only, reduction "mean"; TP=1), where installed
  cce       Cut Cross-Entropy's linear_cross_entropy (log-prob only, per token; TP=1), gradient filtering on (its
            default: gradient blocks under bf16 eps/32 are skipped, an approximation), where installed
  cce_exact the same with filter_eps=None: exact gradients
  verl      verl's fused linear cross entropy (log-prob and entropy, both gradients; vocabulary-parallel), where its
            wheel is installed: its kernel modules are loaded without verl's package import, which needs its trainer
Reported per case (slowest rank at TP > 1): p20/p50/p80 ms, TFLOP/s against the three GEMMs' count 6 T H V_local,
time over the baseline of the same shape (`baseline`: the three GEMMs, or one GEMM for the forward-only rows), peak
extra memory (max allocated during one step over what was allocated before it, inputs alive), the largest
|log-prob difference| against the unfused one (a sanity check, not an error measure: the unfused path rounds its
logits to bf16, about 0.03 at |z| ~ 5; the fused op keeps them in fp32), and the largest differences from float64
values: log-prob and entropy (absolute) and dX (relative to max |dX|) on CHECK_ROWS rows of the call (the first and
last CHECK_ROWS / 2: the float64 reference over all T rows would cost a [T, V] float64 tensor), the reference
computed from the same bf16 inputs in float64 (for token_loss: autograd through the same closure in float64).
Results go to lm_head.csv and lm_head.md in --out_dir, with the targets' verdicts (general op <= 1.38 x the three
GEMMs; forward only <= 1.08 x one GEMM; token_loss <= 1.10 x the three GEMMs and peak extra <= 3.5 GiB at
T = 32768; TP = 2 rank within 15% of TP = 1 on the local shape, read from the TP = 1 rows of the same CSV when
present). `pieces` (python3 -m tools.bench.lm_head --pieces) times the chunked path's pieces alone.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import time
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from tools.bench import measure

HIDDEN = 4096
VOCAB = 151936
TOKENS = (8192, 32768)
PROVIDERS = ("gemms", "gemm1", "unfused", "fused", "fused_novalidate", "fused_gemm", "fused_nograd", "token_loss",
             "token_loss_novalidate", "liger", "cce", "cce_exact", "verl")
PEERS = ("liger", "cce", "cce_exact", "verl")  # other projects' kernels
# ppo_ops' fused paths and the GEMMs they are measured against
OWN = ("gemms", "gemm1", "fused", "fused_novalidate", "fused_gemm", "fused_nograd", "token_loss",
       "token_loss_novalidate")
OWN_AND_UNFUSED = ("gemms", "unfused", "fused", "fused_novalidate")
TP_REF = ("gemms", "fused", "token_loss")  # lm_head_own's rows on a TP = 2 rank's local shape
ONE_GEMM = ("gemm1", "fused_nograd")  # rows measured against one GEMM (the rest against the three)
FIELDS = ("label", "provider", "T", "H", "V", "tp", "v_local", "status", "p20_ms", "p50_ms", "p80_ms", "reps", "tflops",
          "baseline", "vs_gemms", "peak_extra_gib", "grad_gib", "max_dlogprob_vs_unfused", "f64_dlogprob",
          "f64_dentropy", "f64_ddx_rel")
CHECK_ROWS = 64  # rows compared with float64 (first and last half): a [64, V] float64 logits block is 78 MB
# The PPO loss of the token_loss rows (ppo_ops.token_losses.policy_loss).
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # DAPO's asymmetric clip
ENTROPY_COEF = 0.01
KL_COEF = 0.01
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
        cases += [HeadCase(p, T, HIDDEN, VOCAB // 2, tp) for T in TOKENS for p in (TP_REF if own else OWN_AND_UNFUSED)]
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
        self.ppo = None  # the PPO closure's constants, made on first use
        self._seed = seed

    def logits_grad(self, case):
        if self.g_logits is None:
            self.g_logits = torch.randn((case.T, case.v_local), device=self.hidden.device, dtype=torch.bfloat16)
        return self.g_logits

    def ppo_loss(self, backend):
        """The token_loss rows' closure, ppo_ops.token_losses.policy_loss: old and reference log-probs near the
        current ones (the fused forward under no_grad, plus noise of 0.1), advantages ~ N(0, 1), token mean."""
        import ppo_ops
        from ppo_ops import token_losses

        if self.ppo is None:
            T = self.hidden.shape[0]
            gen = torch.Generator(device=self.hidden.device).manual_seed(self._seed + 7)
            with torch.no_grad():
                lp = ppo_ops.linear_log_probs_and_entropy(self.hidden, self.weight, self.tokens, tp_group=self.group,
                                                          backend=backend).log_probs
            noise = lambda: 0.1 * torch.randn(T, generator=gen, device=lp.device)  # noqa: E731
            self.ppo = token_losses.policy_loss(
                lp + noise(), torch.randn(T, generator=gen, device=lp.device), clip_low=CLIP_LOW,
                clip_high=CLIP_HIGH, entropy_coef=ENTROPY_COEF, kl_coef=KL_COEF, ref_log_probs=lp + noise(),
                kl_type="k3", normalization="token_mean")
        return self.ppo


class Built(NamedTuple):
    step: object  # () -> the step's outputs (timed)
    forward: Optional[object] = None  # () -> forward log-probs
    check: Optional[object] = None  # () -> (log_probs, entropy or None, dX or None, closure or None), untimed


def _f64_diffs(case, inp, got) -> dict:
    """Largest differences from float64 on CHECK_ROWS rows (TP = 1: the reference needs the whole weight)."""
    if inp.group is not None or got is None:
        return {}
    lp, ent, dx, closure = got
    T = case.T
    k = min(CHECK_ROWS // 2, T // 2)
    rows = torch.cat([torch.arange(k), torch.arange(T - k, T)]).to(inp.hidden.device)
    x, w = inp.hidden[rows].double(), inp.weight.double()
    z = (x @ w.T).requires_grad_(dx is not None)
    lsm = torch.log_softmax(z, dim=-1)
    lp64 = lsm.gather(1, inp.tokens[rows][:, None])[:, 0]
    ent64 = -(lsm.exp() * lsm).sum(-1)
    out = dict(f64_dlogprob=f"{(lp[rows].double() - lp64).abs().max().item():.2e}")
    if ent is not None:
        out["f64_dentropy"] = f"{(ent[rows].double() - ent64).abs().max().item():.2e}"
    if dx is not None:
        if closure is not None:  # a TokenLoss takes fp32: the float64 values rounded once, the cast differentiable
            dz = torch.autograd.grad(closure(lp64.float(), ent64.float(), rows).sum(), z)[0]
        else:
            dz = torch.autograd.grad([lp64, ent64], z, [inp.g_lp[rows].double(), inp.g_ent[rows].double()])[0]
        ref = dz @ w
        out["f64_ddx_rel"] = f"{((dx[rows].double() - ref).abs().max() / ref.abs().max()).item():.2e}"
    del w
    return out


def _leaf(x):
    return x.detach().requires_grad_(True)


def _build(case: HeadCase, inp: Inputs, interpreted: bool):
    """A provider's Built, or a string saying why it cannot run."""
    import ppo_ops
    from ppo_ops.core import shell as _linear_shell

    backend = "triton" if (inp.hidden.is_cuda or interpreted) else "torch"
    if case.provider == "gemms":
        g = inp.logits_grad(case)

        def step():
            logits = inp.hidden @ inp.weight.T
            return logits, g @ inp.weight, g.T @ inp.hidden

        return Built(step)
    if case.provider == "gemm1":
        return Built(lambda: inp.hidden @ inp.weight.T)
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
            if grad == "values":
                return out.log_probs.detach(), out.entropy.detach(), dx, None
            return dx, dw

        return Built(lambda: run(True), lambda: run(False), lambda: run("values"))
    if case.provider in ("fused", "fused_novalidate", "fused_gemm"):
        validate = case.provider != "fused_novalidate"
        path = "triton-gemm" if case.provider == "fused_gemm" else "chunked"

        def run(grad):
            _linear_shell.HALF_PRECISION_PATH = path
            try:
                x, w = _leaf(inp.hidden), _leaf(inp.weight)
                out = ppo_ops.linear_log_probs_and_entropy(x, w, inp.tokens, tp_group=inp.group, entropy="grad",
                                                           backend=backend, validate=validate)
                if not grad:
                    return out.log_probs.detach()
                return torch.autograd.grad([out.log_probs, out.entropy], [x, w], [inp.g_lp, inp.g_ent])
            finally:
                _linear_shell.HALF_PRECISION_PATH = "chunked"

        def check():
            _linear_shell.HALF_PRECISION_PATH = path
            try:
                x = _leaf(inp.hidden)
                out = ppo_ops.linear_log_probs_and_entropy(x, inp.weight, inp.tokens, tp_group=inp.group,
                                                           entropy="grad", backend=backend, validate=validate)
                dx, = torch.autograd.grad([out.log_probs, out.entropy], [x], [inp.g_lp, inp.g_ent])
                return out.log_probs.detach(), out.entropy.detach(), dx, None
            finally:
                _linear_shell.HALF_PRECISION_PATH = "chunked"

        return Built(lambda: run(True), lambda: run(False), check)
    if case.provider == "fused_nograd":
        def forward():
            with torch.no_grad():
                return ppo_ops.linear_log_probs_and_entropy(inp.hidden, inp.weight, inp.tokens, tp_group=inp.group,
                                                            entropy="value", backend=backend)

        def check():
            out = forward()
            return out.log_probs, out.entropy, None, None

        return Built(forward, lambda: forward().log_probs, check)
    if case.provider in ("token_loss", "token_loss_novalidate"):
        validate = case.provider == "token_loss"
        closure = inp.ppo_loss(backend)

        def run(grad):
            x, w = _leaf(inp.hidden), _leaf(inp.weight)
            loss, out = ppo_ops.linear_token_loss(x, w, inp.tokens, closure, tp_group=inp.group, entropy="grad",
                                                  backend=backend, validate=validate)
            if grad == "values":
                dx, = torch.autograd.grad(loss, [x])
                return out.log_probs, out.entropy, dx, closure
            if not grad:
                return out.log_probs
            return torch.autograd.grad(loss, [x, w])

        return Built(lambda: run(True), lambda: run(False), lambda: run("values"))
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

        return Built(step)
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

        return Built(lambda: run(True), lambda: run(False))
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

        return Built(lambda: run(True), lambda: run(False))
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


def _measure_case(case, inp, device, cfg, interpreted, baselines, unfused_lp):
    built = _build(case, inp, interpreted)
    if isinstance(built, str):
        return _row(case, f"skipped: {built}"), None
    lp = built.forward() if built.forward is not None else None
    checked = {}
    if built.check is not None and cfg.get("check", True):
        checked = _f64_diffs(case, inp, built.check())
    nothing = lambda: None  # noqa: E731
    call = lambda _: built.step()  # noqa: E731
    estimate = measure.warm_up(call, nothing, device, cfg["warmup"])
    peak = measure.peak_extra_bytes(call, nothing, device)
    timing = measure.time_step(call, nothing, device, estimate_ms=estimate, min_reps=cfg["min_reps"],
                               max_reps=cfg["max_reps"], target_ms=cfg["target_ms"])
    p = _slowest([timing.p20_ms, timing.p50_ms, timing.p80_ms, -1.0 if peak is None else float(peak)], inp.group)
    one = case.provider in ONE_GEMM
    flops = (2.0 if one else 6.0) * case.T * case.H * case.v_local
    grad_bytes = 2 * (case.T * case.H + case.v_local * case.H)  # dX + dW in bf16
    values = dict(p20_ms=f"{p[0]:.3f}", p50_ms=f"{p[1]:.3f}", p80_ms=f"{p[2]:.3f}", reps=timing.reps,
                  tflops=f"{flops / (p[1] * 1e-3) / 1e12:.1f}", grad_gib=f"{grad_bytes / GIB:.3f}",
                  baseline="1 GEMM" if one else "3 GEMMs", **checked)
    if p[3] >= 0:
        values["peak_extra_gib"] = f"{p[3] / GIB:.3f}"
    base = baselines.get("gemm1" if one else "gemms")
    if base:
        values["vs_gemms"] = f"{p[1] / base:.3f}"
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
        baselines, unfused_lp = {}, None
        for case in [c for c in cases if (c.T, c.H, c.V) == (T, H, V)]:
            if cfg["time_budget_s"] and time.time() - start > cfg["time_budget_s"]:
                rows.append(_row(case, "skipped: time budget"))
                continue
            try:
                row, result = _measure_case(case, inp, device, cfg, interpreted, baselines, unfused_lp)
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
                                                         "baseline", "vs_gemms", "peak_extra_gib", "f64_dlogprob",
                                                         "f64_dentropy", "f64_ddx_rel") if row[k] != ""), flush=True)
            if result is not None and case.provider in ("gemms", "gemm1"):
                baselines[case.provider] = result[0]
            if result is not None and case.provider == "unfused":
                unfused_lp = result[1]
        del inp
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        _write(out_dir, [dict(row, label=cfg.get("label", "")) for row in rows])


def _write(out_dir, rows):
    """Appends `rows` to lm_head.csv (rewritten with FIELDS when an older file has other columns) and renders
    lm_head.md from the whole file."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "lm_head.csv")
    old = []
    if os.path.exists(path):
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
    all_rows = [{k: r.get(k, "") or "" for k in FIELDS} for r in old + rows]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(all_rows)
    md = os.path.join(out_dir, "lm_head.md")
    with open(md, "w") as f:
        f.write(render(all_rows))
    print(f"wrote {path} and {md}")
    print(verdicts(all_rows))


def render(rows) -> str:
    cols = ("label", "provider", "T", "V", "tp", "status", "p50_ms", "tflops", "baseline", "vs_gemms", "peak_extra_gib",
            "grad_gib", "max_dlogprob_vs_unfused", "f64_dlogprob", "f64_dentropy", "f64_ddx_rel")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n\n" + verdicts(rows) + "\n"


def _find(rows, provider, T, V, tp):
    hits = [r for r in rows if r["provider"] == provider and int(r["T"]) == T and int(r["V"]) == V
            and int(r["tp"]) == tp and r["status"] == "ok"]
    return hits[-1] if hits else None


TARGETS = {  # provider: (baseline provider, bound on time / baseline, what it is)
    "fused": ("gemms", 1.38, "general op, validate on"),
    "fused_novalidate": ("gemms", 1.38, "general op, validate off"),
    "fused_nograd": ("gemm1", 1.08, "forward only under no_grad, vs one GEMM"),
    "token_loss": ("gemms", 1.10, "linear_token_loss (PPO closure), validate on"),
    "token_loss_novalidate": ("gemms", 1.10, "linear_token_loss (PPO closure), validate off"),
}
TOKEN_LOSS_PEAK_GIB = 3.5  # target: linear_token_loss's peak extra at T = 32768


def verdicts(rows) -> str:
    """The targets' verdicts over the rows of the CSV's last run (its last label): baselines from the same run."""
    label = rows[-1].get("label", "") if rows else ""
    rows = [r for r in rows if r.get("label", "") == label]
    out = [f"Targets (the rows of the last run in the CSV, label {label!r}):"]
    for T in TOKENS:
        for tp in (1, 2):
            for name, (base_name, bound, what) in TARGETS.items():
                r, base = _find(rows, name, T, VOCAB, tp), _find(rows, base_name, T, VOCAB, tp)
                if r and base:
                    ratio = float(r["p50_ms"]) / float(base["p50_ms"])
                    out.append(f"- time T={T} TP={tp} {what}: {float(r['p50_ms']):.1f} ms = {ratio:.3f} x "
                               f"{base_name} ({float(base['p50_ms']):.1f} ms): "
                               f"{'MET' if ratio <= bound else 'MISSED'} (target <= {bound})")
            r = _find(rows, "token_loss", T, VOCAB, tp)
            if r and r.get("peak_extra_gib") and T == 32768:
                peak = float(r["peak_extra_gib"])
                out.append(f"- memory T={T} TP={tp} linear_token_loss: peak extra {peak:.2f} GiB: "
                           f"{'MET' if peak <= TOKEN_LOSS_PEAK_GIB else 'MISSED'} (target <= {TOKEN_LOSS_PEAK_GIB})")
        for name in ("fused", "fused_novalidate", "token_loss"):
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


# --- the chunked path's pieces, each alone (python3 -m tools.bench.lm_head --pieces --out=FILE) ---

def _event_ms(fn, reps=5, warmup=1):
    """Median ms of fn() over `reps` calls, CUDA events around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def pieces(out_path, T=8192, seed=1234):
    """Times the chunked path's pieces alone at (T, H, V) = (T, 4096, 151936), bf16, and the forward-only op at
    several row-block sizes; writes one line per piece (name, ms, count of launches, what it is) to out_path."""
    import ppo_ops
    from ppo_ops.lm_head import chunked as lc
    from ppo_ops.core.contracts import ShardOptions as LinearShard

    device = torch.device("cuda")
    inp = Inputs(HeadCase("gemms", T, HIDDEN, VOCAB, 1), device, seed, None, 0)
    x, w, tokens = inp.hidden, inp.weight, inp.tokens
    seg_len = VOCAB // 8
    lines = []

    def record(name, ms, what):
        lines.append(f'{name},{ms:.3f},"{what}"')
        print(f"{name}: {ms:.3f} ms  ({what})", flush=True)

    record("gemm1", _event_ms(lambda: x @ w.T), "one cuBLAS GEMM, bf16 logits [T, V]")
    backend = lc.backend("triton")
    passes = backend.passes
    shard = LinearShard(inv_temperature=1.0, n_valid=VOCAB, seg_len=seg_len, vocab_start=0)
    default = lc.CUDA_SHAPE
    for rows in (512, 1024, 2048):
        chunk = torch.empty((rows, seg_len), dtype=torch.float32, device=device)
        blocks = T // rows

        def gemms():
            for b in range(blocks):
                for s in range(8):
                    lc._mm_fp32(x[b * rows:(b + 1) * rows], w[s * seg_len:(s + 1) * seg_len].T, chunk)

        record(f"chunk_gemms_rows{rows}", _event_ms(gemms), f"{blocks * 8} GEMMs [{rows}, H] x [H, {seg_len}] fp32 out")
        part = torch.empty((5, rows), dtype=torch.float32, device=device)
        lc._mm_fp32(x[:rows], w[:seg_len].T, chunk)

        def partials():
            for b in range(blocks):
                for s in range(8):
                    passes.partials(chunk, rows, tokens[:rows], shard.segment(s * seg_len), True, part)

        record(f"partials_pass_rows{rows}", _event_ms(partials), f"{blocks * 8} partials launches on one chunk "
               "(L2-warm: the same chunk each time)")
        lc.CUDA_SHAPE = dataclasses.replace(default, rows=rows)
        try:
            def forward():
                with torch.no_grad():
                    ppo_ops.linear_log_probs_and_entropy(x, w, tokens, entropy="value", validate=False)

            record(f"forward_nograd_rows{rows}", _event_ms(forward), "the op under no_grad, validate off")
        finally:
            lc.CUDA_SHAPE = default
        del chunk
    rows = default.rows
    chunk = torch.empty((rows, seg_len), dtype=torch.float32, device=device)
    lc._mm_fp32(x[:rows], w[:seg_len].T, chunk)
    dl = torch.empty((default.dw_rows, seg_len), dtype=torch.bfloat16, device=device)
    vec = torch.zeros(rows, device=device)
    g = torch.rand(rows, device=device)

    def dlogits():
        for b in range(T // rows):
            for s in range(8):
                passes.dlogits(chunk, rows, tokens[:rows], shard.segment(s * seg_len), vec, vec, vec, g, g,
                               dl[:rows])

    record("dlogits_pass", _event_ms(dlogits), f"{T // rows * 8} gradient launches, fp32 chunk -> bf16 dlogits")
    dl.normal_()
    dx32 = torch.zeros((default.dw_rows, HIDDEN), dtype=torch.float32, device=device)
    m = min(T, default.dw_rows)

    def dx_gemm():
        for s in range(8):
            lc._addmm_fp32(dx32[:m], dl[:m], w[s * seg_len:(s + 1) * seg_len])

    record("dx_gemms", _event_ms(dx_gemm), f"8 x (dX32[{m}] += dl[{m}, {seg_len}] @ W_s), fp32 accumulator")
    dw = torch.empty((seg_len, HIDDEN), dtype=torch.bfloat16, device=device)
    acc = torch.zeros((seg_len, HIDDEN), dtype=torch.float32, device=device)
    for k in (1024, 2048, 4096, 8192):
        if k > min(T, default.dw_rows):
            continue
        n = (T // k) * 8

        def dw_direct():
            for i in range(n):
                lc._mm_rounded(dl[:k].T, x[:k], dw)

        def dw_acc():
            for i in range(n):
                lc._addmm_fp32(acc, dl[:k].T, x[:k])

        record(f"dw_gemms_k{k}_bf16out", _event_ms(dw_direct), f"{n} x dW_s = dl^T @ X, K = {k}, bf16 out")
        record(f"dw_gemms_k{k}_fp32acc", _event_ms(dw_acc), f"{n} x dW32_s += dl^T @ X, K = {k}, fp32 accumulator")
    del dl, dx32, acc
    closure = inp.ppo_loss("triton")
    for loss_rows, loss_dw_rows in ((1024, 1024), (512, 2048), (1024, 2048), (512, 1024)):
        lc.CUDA_SHAPE = dataclasses.replace(default, loss_rows=loss_rows, loss_dw_rows=loss_dw_rows)
        try:
            def token_loss():
                xl, wl = _leaf(x), _leaf(w)
                loss, _ = ppo_ops.linear_token_loss(xl, wl, tokens, closure, entropy="grad", validate=False)
                return torch.autograd.grad(loss, [xl, wl])

            ms = _event_ms(token_loss, reps=3)
            peak = measure.peak_extra_bytes(lambda _: token_loss(), lambda: None, device)
            record(f"token_loss_rows{loss_rows}_dwrows{loss_dw_rows}", ms,
                   f"linear_token_loss fwd+bwd, PPO closure, validate off; peak extra {peak / GIB:.3f} GiB")
        finally:
            lc.CUDA_SHAPE = default
    # Measured, not adopted: the partials pass on a second stream, overlapping the next chunk's GEMM (two chunks).
    side = torch.cuda.Stream()
    chunks = [torch.empty((rows, seg_len), dtype=torch.float32, device=device) for _ in range(2)]
    part = torch.empty((T // rows, 8, 5, rows), dtype=torch.float32, device=device)
    main = torch.cuda.current_stream()

    def overlapped():
        done = [None, None]
        for i in range(T // rows * 8):
            b, s_ = divmod(i, 8)
            c = chunks[i % 2]
            if done[i % 2] is not None:
                main.wait_event(done[i % 2])
            lc._mm_fp32(x[b * rows:(b + 1) * rows], w[s_ * seg_len:(s_ + 1) * seg_len].T, c)
            ready = torch.cuda.Event()
            ready.record(main)
            with torch.cuda.stream(side):
                side.wait_event(ready)
                passes.partials(c, rows, tokens[b * rows:(b + 1) * rows], shard.segment(s_ * seg_len), True,
                                part[b, s_])
                done[i % 2] = torch.cuda.Event()
                done[i % 2].record(side)
        main.wait_stream(side)

    record("forward_two_streams", _event_ms(overlapped), "GEMMs on one stream, partials on another (no merge)")
    bf = torch.empty((rows, seg_len), dtype=torch.bfloat16, device=device)

    def gemms_bf16():
        for b in range(T // rows):
            for s_ in range(8):
                torch.mm(x[b * rows:(b + 1) * rows], w[s_ * seg_len:(s_ + 1) * seg_len].T, out=bf)

    record("chunk_gemms_rows1024_bf16out", _event_ms(gemms_bf16), "the chunk GEMMs with bf16 output instead")
    with open(out_path, "a") as f:
        f.write("\n".join(f"T={T},{line}" for line in lines) + "\n")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--pieces", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    if args.pieces:
        pieces(args.out, T=args.tokens)
