"""The LM-head family (--suite=lm_head): log-prob + entropy straight from hidden states, fused vs the GEMMs around it.

    bazel run --config=gpu //tools:bench -- --suite=lm_head --out_dir=$PWD/bench_out            # TP=1, one H200
    bazel run --config=gpu //tools:bench -- --suite=lm_head --tp=2 --out_dir=$PWD/bench_out     # TP=2, NCCL
    bazel run --config=gpu //tools:bench -- --suite=lm_head_own --out_dir=$PWD/bench_out        # ppo_ops + GEMMs only
    python3 tools/bench/bench.py --suite=lm_head_smoke --device=cpu --out_dir=/tmp/b            # plumbing only

Cases (cases.py `HeadCase`, suites lm_head, lm_head_own, lm_head_smoke): T in (8192, 32768), H = 4096, V = 151936,
bf16, forward + backward with upstream gradients for the log-prob and (where the provider has one) the entropy. At
--tp=1 the suites also run ppo_ops' paths on the local shape of a TP = 2 rank (V = 75968): the reference of the TP = 2
target. Providers:
  gemms     the three cuBLAS GEMMs alone: logits = X W^T, dX = G W, dW = G^T X (G a stored [T, V_local] gradient)
  gemm1     one cuBLAS GEMM, logits = X W^T: the yardstick of the forward-only rows
  unfused   logits = X W^T (cuBLAS), ppo_ops.log_probs_and_entropy (Triton) with entropy="grad", autograd's GEMMs
            back; at TP > 1 dX is all-reduced (as Megatron's column-parallel layer does)
  fused     ppo_ops.linear_log_probs_and_entropy(backend="triton", entropy="grad"), validate on (default) and off
            (fused_novalidate): the segment-GEMM backend (a Triton GEMM with the statistics in its epilogue, the
            recompute with the gradient in its epilogue, cuBLAS dX and dW GEMMs)
  fused_nograd the fused op's forward under torch.no_grad (old-policy / reference passes), against gemm1
  fused_keep, token_loss_keep  fused and token_loss with a 64-id nucleus per row as the sparse keep set (top-p replay;
            keep_set.py), set against fused and token_loss on the same case (the lm_head_keep suite)
  token_loss ppo_ops.linear_token_loss with ppo_ops.token_losses.policy_loss (clipped surrogate with DAPO's clip
            range, entropy bonus, k3 KL to a reference, token mean), validate on and off (token_loss_novalidate): the
            gradient formed in the forward; token_loss_lean the same with working_memory=0 (its least memory: 1024-row
            blocks beside the fp32 dW accumulator, each block's host steps against its GPU work)
  liger     Liger-Kernel's fused linear cross entropy (log-prob only, reduction "mean"; TP=1), where installed
  liger_flsce Liger-Kernel's fused linear scaled cross entropy (per-token NLL and entropy, both gradients; on sm_90
            its CuTe DSL kernel; TP=1), where it and the CUTLASS DSL are installed; liger_flsce_nograd its forward
            under torch.no_grad, against gemm1
  cce       Cut Cross-Entropy's linear_cross_entropy (log-prob only, per token; TP=1), gradient filtering on (its
            default: gradient blocks under bf16 eps/32 are skipped, an approximation), where installed
  cce_exact the same with filter_eps=None: exact gradients
  verl      verl's fused linear cross entropy (log-prob and entropy, both gradients; vocabulary-parallel), where its
            wheel is installed: its kernel modules are loaded without verl's package import, which needs its trainer
Reported per case (slowest rank at TP > 1): p20/p50/p80 ms, TFLOP/s against the three GEMMs' count 6 T H V_local,
time over the baseline of the same shape (`baseline`: the three GEMMs, or one GEMM for the forward-only rows), the
same two back to back (`steady_ms`, `steady_vs`: wall-clock ms per step over ~--steady_s of steps with one sync at
the end, measure.steady_ms: host time and the op's own host reads counted, every row and its baseline in the GPU's
sustained clock state; the per-step events leave out the idle gap after a host read, after which a GPU at its power
limit runs the next step at a higher clock), peak
extra memory (max allocated during one step over what was allocated before it, inputs alive), the largest
|log-prob difference| against the unfused one (a sanity check, not an error measure: the unfused path rounds its
logits to bf16, about 0.03 at |z| ~ 5; the fused op keeps them in fp32), and the largest differences from float64
values: log-prob and entropy (absolute) and dX (relative to max |dX|) on CHECK_ROWS rows of the call (the first and
last CHECK_ROWS / 2: the float64 reference over all T rows would cost a [T, V] float64 tensor), the reference
computed from the same bf16 inputs in float64 (for token_loss: autograd through the same closure in float64);
--check_rows=0 turns the float64 columns off. Results go to lm_head.csv and lm_head.md in --out_dir, with the targets'
verdicts (lm_head_report.py). An error of another project's kernel is a row of the table; one of ppo_ops' fails the
run. `--suite=lm_head_pieces` times the segment-GEMM backend's chunk-path pieces alone (lm_head_pieces.py).
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from tools.bench import keep_set, lm_head_report
from tools.bench.cases import LM_HEAD_KEEP_PROVIDERS, LM_HEAD_PEERS, LM_HEAD_PROVIDERS, HeadCase
from tools.bench.contract import Closure, Provider, RankResult, RunInfo, first_import_problem, registry

PEERS = LM_HEAD_PEERS
# rows measured against one GEMM (the rest against the three)
ONE_GEMM = ("gemm1", "fused_nograd", "liger_flsce_nograd")
BASELINES = ("gemms", "gemm1")
CHECK_ROWS = 64  # rows compared with float64 (first and last half): a [64, V] float64 logits block is 78 MB
# The PPO loss of the token_loss rows (ppo_ops.token_losses.policy_loss).
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # DAPO's asymmetric clip
ENTROPY_COEF = 0.01
KL_COEF = 0.01
PPO_SEED_OFFSET = 7  # the PPO closure's constants have their own stream of the run's seed
GIB = float(1 << 30)


# --- inputs ---

class HeadInputs:
    """bf16 hidden states [T, H] (the same on every rank), this rank's weight shard [V_local, H], tokens and the
    upstream gradients of the log-prob and the entropy; the gemms rows' stored logits gradient and the token_loss
    rows' PPO closure are made on first use."""

    def __init__(self, case: HeadCase, device: torch.device, seed: int, group, rank: int):
        # Seeded on the device (fast at these sizes); every rank draws the same global tensors, then keeps its slice.
        gen = torch.Generator(device=device).manual_seed(seed)
        dtype = torch.bfloat16
        self.group, self.rank = group, rank
        # The Triton backend on CUDA, or in the interpreter on CPU; else the torch one.
        interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self.backend = "triton" if (device.type == "cuda" or interpreted) else "torch"
        self.hidden = torch.randn((case.T, case.H), generator=gen, device=device).to(dtype)
        full = torch.randn((case.V, case.H), generator=gen, device=device, dtype=dtype)
        full.mul_(3.0 / case.H**0.5)  # logits of O(3): a peaked, not one-hot, distribution
        self.weight = full[rank * case.v_local:(rank + 1) * case.v_local].clone()
        del full
        self.tokens = torch.randint(0, case.V, (case.T,), generator=gen, device=device)
        self.g_lp = 0.5 + torch.rand(case.T, generator=gen, device=device)
        self.g_ent = torch.rand(case.T, generator=gen, device=device) * 2 - 1
        self._g_logits = None
        self._ppo = None
        self._seed = seed

    def leaves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and weight as fresh leaves that take a gradient."""
        return _leaf(self.hidden), _leaf(self.weight)

    def logits_grad(self, case: HeadCase) -> torch.Tensor:
        """The gemms rows' stored [T, V_local] logits gradient."""
        if self._g_logits is None:
            self._g_logits = torch.randn((case.T, case.v_local), device=self.hidden.device, dtype=torch.bfloat16)
        return self._g_logits

    def ppo_loss(self):
        """The token_loss rows' closure, ppo_ops.token_losses.policy_loss: old and reference log-probs near the
        current ones (the fused forward under no_grad, plus noise of 0.1), advantages ~ N(0, 1), token mean."""
        import ppo_ops
        from ppo_ops import token_losses

        if self._ppo is None:
            T = self.hidden.shape[0]
            gen = torch.Generator(device=self.hidden.device).manual_seed(self._seed + PPO_SEED_OFFSET)
            with torch.no_grad():
                lp = ppo_ops.linear_log_probs_and_entropy(self.hidden, self.weight, self.tokens, tp_group=self.group,
                                                          backend=self.backend).log_probs

            def noise():
                return 0.1 * torch.randn(T, generator=gen, device=lp.device)

            self._ppo = token_losses.policy_loss(
                lp + noise(), torch.randn(T, generator=gen, device=lp.device), clip_low=CLIP_LOW,
                clip_high=CLIP_HIGH, entropy_coef=ENTROPY_COEF, kl_coef=KL_COEF, ref_log_probs=lp + noise(),
                kl_type="k3", normalization="token_mean")
        return self._ppo


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)


# --- providers ---

class Values(NamedTuple):
    """What the float64 check compares: the call's outputs and dX (None where the provider has no backward), and the
    per-token loss the gradient is of (None: the upstream gradients g_lp, g_ent)."""

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    dx: Optional[torch.Tensor] = None
    token_loss: Optional[Callable] = None


class HeadClosure(Closure):
    """A Closure whose forward() gives the log-probs (for the comparison with the unfused path) and whose values()
    gives the float64 check's Values; either None where the provider has none."""

    def __init__(self, step: Callable[[], object], forward: Optional[Callable[[], torch.Tensor]] = None,
                 values: Optional[Callable[[], Values]] = None):
        super().__init__(prepare=_nothing, step=lambda _: step(), forward=forward)
        self.values = values


def _nothing():
    return None


def _logits_grads(out, wrt, inp: HeadInputs):
    """Gradients of `wrt` for the upstream gradients of the log-prob and the entropy."""
    return torch.autograd.grad([out.log_probs, out.entropy], wrt, [inp.g_lp, inp.g_ent])


def build_gemms(case: HeadCase, inp: HeadInputs) -> HeadClosure:
    g = inp.logits_grad(case)

    def step():
        logits = inp.hidden @ inp.weight.T
        return logits, g @ inp.weight, g.T @ inp.hidden

    return HeadClosure(step)


def build_gemm1(case: HeadCase, inp: HeadInputs) -> HeadClosure:
    return HeadClosure(lambda: inp.hidden @ inp.weight.T)


def build_unfused(case: HeadCase, inp: HeadInputs) -> HeadClosure:
    import ppo_ops

    def forward(x, w):
        return ppo_ops.log_probs_and_entropy(x @ w.T, inp.tokens, tp_group=inp.group, entropy="grad",
                                             backend=inp.backend)

    def backward(out, x, w):
        dx, dw = _logits_grads(out, [x, w], inp)
        if inp.group is not None:
            dist.all_reduce(dx, group=inp.group)  # the column-parallel layer's dX all-reduce
        return dx, dw

    def step():
        x, w = inp.leaves()
        return backward(forward(x, w), x, w)

    def log_probs():
        return forward(*inp.leaves()).log_probs.detach()

    def values():
        x, w = inp.leaves()
        out = forward(x, w)
        dx, _ = backward(out, x, w)
        return Values(out.log_probs.detach(), out.entropy.detach(), dx)

    return HeadClosure(step, log_probs, values)


def build_fused(case: HeadCase, inp: HeadInputs) -> HeadClosure:
    """fused and fused_novalidate."""
    import ppo_ops

    validate = case.provider != "fused_novalidate"

    def forward(x, w):
        return ppo_ops.linear_log_probs_and_entropy(x, w, inp.tokens, tp_group=inp.group, entropy="grad",
                                                    backend=inp.backend, validate=validate)

    def step():
        x, w = inp.leaves()
        return _logits_grads(forward(x, w), [x, w], inp)

    def log_probs():
        return forward(*inp.leaves()).log_probs.detach()

    def values():
        x = _leaf(inp.hidden)
        out = forward(x, inp.weight)
        dx, = _logits_grads(out, [x], inp)
        return Values(out.log_probs.detach(), out.entropy.detach(), dx)

    return HeadClosure(step, log_probs, values)


def build_fused_nograd(case: HeadCase, inp: HeadInputs) -> HeadClosure:
    import ppo_ops

    def forward():
        with torch.no_grad():
            return ppo_ops.linear_log_probs_and_entropy(inp.hidden, inp.weight, inp.tokens, tp_group=inp.group,
                                                        entropy="value", backend=inp.backend)

    def values():
        out = forward()
        return Values(out.log_probs, out.entropy)

    return HeadClosure(forward, lambda: forward().log_probs, values)


def build_token_loss(case: HeadCase, inp: HeadInputs) -> HeadClosure:
    """token_loss, token_loss_novalidate and token_loss_lean."""
    import ppo_ops

    validate = case.provider != "token_loss_novalidate"
    working_memory = 0 if case.provider == "token_loss_lean" else None
    closure = inp.ppo_loss()

    def forward(x, w):
        return ppo_ops.linear_token_loss(x, w, inp.tokens, closure, tp_group=inp.group, entropy="grad",
                                         backend=inp.backend, validate=validate, working_memory=working_memory)

    def step():
        x, w = inp.leaves()
        loss, _ = forward(x, w)
        return torch.autograd.grad(loss, [x, w])

    def log_probs():
        return forward(*inp.leaves())[1].log_probs

    def values():
        x, w = inp.leaves()
        loss, out = forward(x, w)
        dx, = torch.autograd.grad(loss, [x])
        return Values(out.log_probs, out.entropy, dx, closure)

    return HeadClosure(step, log_probs, values)


def build_keep(case: HeadCase, inp: HeadInputs) -> HeadClosure:
    """fused_keep and token_loss_keep: fused and token_loss with a 64-id nucleus per row as the sparse keep set
    (keep_set.py), given with the inputs as a rollout gives it. Not checked against float64 here (the tests do)."""
    import ppo_ops

    keep = keep_set.nucleus(inp.tokens, case.V, seed=17)
    options = dict(tp_group=inp.group, entropy="grad", backend=inp.backend, keep=keep)
    closure = inp.ppo_loss() if case.provider == "token_loss_keep" else None

    def step():
        x, w = inp.leaves()
        if closure is None:
            return _logits_grads(ppo_ops.linear_log_probs_and_entropy(x, w, inp.tokens, **options), [x, w], inp)
        loss, _ = ppo_ops.linear_token_loss(x, w, inp.tokens, closure, **options)
        return torch.autograd.grad(loss, [x, w])

    return HeadClosure(step)


def _needs_keep(case: HeadCase, device: torch.device) -> Optional[str]:
    return _needs_ppo_ops(case, device) or keep_set.missing()


def build_liger(case: HeadCase, inp: HeadInputs) -> HeadClosure:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def step():
        x, w = inp.leaves()
        loss = liger_fused_linear_cross_entropy(x, w, inp.tokens, reduction="mean")
        loss = loss[0] if isinstance(loss, tuple) else loss
        return torch.autograd.grad(loss, [x, w])

    return HeadClosure(step)


def build_liger_flsce(case: HeadCase, inp: HeadInputs) -> HeadClosure:
    """liger_flsce (log-prob and entropy, both gradients) and liger_flsce_nograd (its forward under no_grad)."""
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

    def forward(x, w):  # per-token NLL and entropy; temperature 1, ignore_index -100, one M tile per cluster
        return LigerFusedLinearScaledCrossEntropyFunction.apply(x, w, inp.tokens, 1.0, -100, 1, True)

    def backward(nll, ent, x, w):
        return torch.autograd.grad([nll, ent], [x, w], [-inp.g_lp, inp.g_ent])  # log p = -NLL

    def step():
        x, w = inp.leaves()
        if case.provider == "liger_flsce_nograd":
            with torch.no_grad():
                return forward(x, w)
        return backward(*forward(x, w), x, w)

    def log_probs():
        with torch.no_grad():
            return -forward(*inp.leaves())[0]

    def values():
        x, w = inp.leaves()
        nll, ent = forward(x, w)
        if case.provider == "liger_flsce_nograd":
            return Values(-nll.detach(), ent.detach())
        dx, _ = backward(nll, ent, x, w)
        return Values(-nll.detach(), ent.detach(), dx)

    return HeadClosure(step, log_probs, values)


def build_cce(case: HeadCase, inp: HeadInputs) -> HeadClosure:
    """cce (gradient filtering on, its default) and cce_exact."""
    from cut_cross_entropy import linear_cross_entropy

    filter_eps = "high" if case.provider == "cce" else None

    def loss(x, w):
        return linear_cross_entropy(x, w, inp.tokens, reduction="none", filter_eps=filter_eps)

    def step():
        x, w = inp.leaves()
        return torch.autograd.grad(loss(x, w), [x, w], -inp.g_lp)  # loss = -log p

    return HeadClosure(step, lambda: -loss(*inp.leaves()).detach())


def build_verl(case: HeadCase, inp: HeadInputs) -> HeadClosure:
    verl_lce = verl_linear_cross_entropy()

    def step():
        x, w = inp.leaves()
        log_probs, entropy = verl_lce(x, w, inp.tokens, 1.0, "none", inp.group)
        return torch.autograd.grad([log_probs, entropy], [x, w], [inp.g_lp, inp.g_ent])

    return HeadClosure(step, lambda: verl_lce(*inp.leaves(), inp.tokens, 1.0, "none", inp.group)[0].detach())


PPO_OPS_MODULES = ("ppo_ops",)
LIGER_MODULES = ("liger_kernel.transformers.functional",)
# Liger's scaled CE dispatches to its CuTe DSL kernel on sm_90, which needs NVIDIA's CUTLASS DSL (`cutlass`).
LIGER_FLSCE_MODULES = ("liger_kernel.ops.fused_linear_scaled_cross_entropy", "cutlass")
CCE_MODULES = ("cut_cross_entropy",)


def _runs_anywhere(case: HeadCase, device: torch.device) -> Optional[str]:
    return None


def _needs_ppo_ops(case: HeadCase, device: torch.device) -> Optional[str]:
    return first_import_problem(PPO_OPS_MODULES)


def _single_rank_cuda_peer(no_tp: str, no_cuda: str, modules: tuple[str, ...]):
    """The unsupported() of another project's kernel that needs CUDA and one rank: the reasons it gives."""

    def unsupported(case: HeadCase, device: torch.device) -> Optional[str]:
        if case.tp > 1:
            return no_tp
        if device.type != "cuda":
            return no_cuda
        return first_import_problem(modules)

    return unsupported


def _unsupported_verl(case: HeadCase, device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return "verl's kernels need CUDA"
    try:
        verl_linear_cross_entropy()
    except Exception as error:  # not installed, or its files fail to load
        first_line = (str(error).splitlines() or [""])[0]
        return f"verl's kernel is not loadable ({type(error).__name__}: {first_line})"
    return None


def verl_linear_cross_entropy():
    """verl's LinearCrossEntropy.apply, loaded from its installed files. `import verl` runs the package's __init__,
    which imports its trainer (tensordict, ray, ...); the kernel needs only torch, triton and four device helpers of
    verl.utils.device, so the parent packages are registered as bare namespaces and that module as a small stand-in."""
    import importlib
    import importlib.util
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


_LIGER_UNSUPPORTED = _single_rank_cuda_peer("Liger's fused linear CE has no vocabulary parallelism",
                                            "Liger's kernels need CUDA", LIGER_MODULES)
_LIGER_FLSCE_UNSUPPORTED = _single_rank_cuda_peer("this bench runs Liger's scaled CE at TP = 1 only",
                                                  "Liger's CuTe DSL kernel needs CUDA", LIGER_FLSCE_MODULES)
_CCE_UNSUPPORTED = _single_rank_cuda_peer("Cut Cross-Entropy has no vocabulary parallelism",
                                          "Cut Cross-Entropy's kernels need CUDA", CCE_MODULES)
PROVIDERS = registry(
    Provider("gemms", build_gemms, _runs_anywhere),
    Provider("gemm1", build_gemm1, _runs_anywhere),
    Provider("unfused", build_unfused, _needs_ppo_ops, modules=PPO_OPS_MODULES),
    *(Provider(name, build_fused, _needs_ppo_ops, modules=PPO_OPS_MODULES)
      for name in ("fused", "fused_novalidate")),
    Provider("fused_nograd", build_fused_nograd, _needs_ppo_ops, modules=PPO_OPS_MODULES),
    *(Provider(name, build_token_loss, _needs_ppo_ops, modules=PPO_OPS_MODULES)
      for name in ("token_loss", "token_loss_novalidate", "token_loss_lean")),
    Provider("liger", build_liger, _LIGER_UNSUPPORTED, modules=LIGER_MODULES),
    *(Provider(name, build_liger_flsce, _LIGER_FLSCE_UNSUPPORTED, modules=LIGER_FLSCE_MODULES)
      for name in ("liger_flsce", "liger_flsce_nograd")),
    *(Provider(name, build_cce, _CCE_UNSUPPORTED, modules=CCE_MODULES) for name in ("cce", "cce_exact")),
    Provider("verl", build_verl, _unsupported_verl),
    *(Provider(name, build_keep, _needs_keep, modules=PPO_OPS_MODULES) for name in LM_HEAD_KEEP_PROVIDERS),
)
assert tuple(PROVIDERS) == LM_HEAD_PROVIDERS + LM_HEAD_KEEP_PROVIDERS, "the registry lists cases' providers in order"


# --- the float64 check ---

def f64_diffs(case: HeadCase, inp: HeadInputs, got: Values) -> dict:
    """Largest differences from float64 on CHECK_ROWS rows (TP = 1: the reference needs the whole weight)."""
    if inp.group is not None:
        return {}
    T = case.T
    k = min(CHECK_ROWS // 2, T // 2)
    rows = torch.cat([torch.arange(k), torch.arange(T - k, T)]).to(inp.hidden.device)
    x, w = inp.hidden[rows].double(), inp.weight.double()
    z = (x @ w.T).requires_grad_(got.dx is not None)
    lsm = torch.log_softmax(z, dim=-1)
    lp64 = lsm.gather(1, inp.tokens[rows][:, None])[:, 0]
    ent64 = -(lsm.exp() * lsm).sum(-1)
    out = dict(f64_dlogprob=f"{(got.log_probs[rows].double() - lp64).abs().max().item():.2e}")
    if got.entropy is not None:
        out["f64_dentropy"] = f"{(got.entropy[rows].double() - ent64).abs().max().item():.2e}"
    if got.dx is not None:
        if got.token_loss is not None:  # a TokenLoss takes fp32: float64 values rounded once, the cast differentiable
            dz = torch.autograd.grad(got.token_loss(lp64.float(), ent64.float(), rows).sum(), z)[0]
        else:
            dz = torch.autograd.grad([lp64, ent64], z, [inp.g_lp[rows].double(), inp.g_ent[rows].double()])[0]
        ref = dz @ w
        out["f64_ddx_rel"] = f"{((got.dx[rows].double() - ref).abs().max() / ref.abs().max()).item():.2e}"
    del w
    return out


# --- the family ---

DESCRIBED = ("provider", "T", "V", "tp", "status", "p50_ms", "tflops", "baseline", "vs_gemms", "steady_ms",
             "steady_vs", "peak_extra_gib", "f64_dlogprob", "f64_dentropy", "f64_ddx_rel")


class LmHeadFamily:
    measures_copy_bandwidth = True  # printed with the run; the rows are set against the GEMMs of the same shape
    times_steady = True  # steady_ms: back to back, and steady_vs: over the baseline's, timed the same way

    def __init__(self, config):
        self.providers = PROVIDERS
        self._csv = config.paths.csv
        self._md = config.paths.md
        self._baselines = {}  # (input_key, gemms | gemm1) -> the slowest rank's (p50 ms, steady ms), this run

    def make_inputs(self, case: HeadCase, device, *, seed: int, rank: int, group) -> HeadInputs:
        return HeadInputs(case, device, seed, group, rank)

    def check(self, case: HeadCase, inputs: HeadInputs, closure: HeadClosure, memo: dict, check_rows: int) -> dict:
        out = {}
        lp = closure.forward() if closure.forward is not None else None
        if case.provider == "unfused":
            memo["unfused_log_probs"] = lp
        elif lp is not None and memo.get("unfused_log_probs") is not None:
            diff = (lp.float() - memo["unfused_log_probs"].float()).abs().max().item()
            out["max_dlogprob_vs_unfused"] = f"{diff:.2e}"
        if check_rows and closure.values is not None:
            out.update(f64_diffs(case, inputs, closure.values()))
        return out

    def row(self, case: HeadCase, results: list[RankResult], info: RunInfo) -> dict:
        row = dict(label=info.label, round=info.round, provider=case.provider, T=case.T, H=case.H, V=case.V,
                   tp=case.tp, v_local=case.v_local)
        bad = [r for r in results if r.status != "ok"]
        row["status"] = bad[0].status if bad else "ok"
        if bad:
            return row
        timings = [r.timing for r in results]
        p20, p50, p80 = (max(getattr(t, q) for t in timings) for q in ("p20_ms", "p50_ms", "p80_ms"))
        one = case.provider in ONE_GEMM
        flops = (2.0 if one else 6.0) * case.T * case.H * case.v_local
        grad_bytes = 2 * (case.T * case.H + case.v_local * case.H)  # dX + dW in bf16
        row.update(p20_ms=f"{p20:.3f}", p50_ms=f"{p50:.3f}", p80_ms=f"{p80:.3f}", reps=min(t.reps for t in timings),
                   tflops=f"{flops / (p50 * 1e-3) / 1e12:.1f}", grad_gib=f"{grad_bytes / GIB:.3f}",
                   baseline="1 GEMM" if one else "3 GEMMs", **results[0].checks)
        peaks = [r.peak for r in results if r.peak is not None]
        if peaks:
            row["peak_extra_gib"] = f"{max(peaks) / GIB:.3f}"
        steady = max((r.steady_ms for r in results if r.steady_ms is not None), default=None)
        if steady is not None:
            row["steady_ms"] = f"{steady:.3f}"
        # the baselines of this round (a reversed round measures them after the rows they are set against)
        base, base_steady = self._baselines.get((info.round, case.input_key(), "gemm1" if one else "gemms"),
                                                (None, None))
        if base:
            row["vs_gemms"] = f"{p50 / base:.3f}"
        if base_steady and steady is not None:
            row["steady_vs"] = f"{steady / base_steady:.3f}"
        if case.provider in BASELINES:  # after: a baseline's own row has no ratio
            self._baselines[(info.round, case.input_key(), case.provider)] = (p50, steady)
        return row

    def describe(self, row: dict) -> str:
        return " ".join(f"{k}={row[k]}" for k in DESCRIBED if row.get(k, "") != "")

    def append(self, row: dict) -> None:
        lm_head_report.append_row(self._csv, row)

    def record_rows(self) -> list[dict]:
        return lm_head_report.read_rows(self._csv)

    def render(self) -> None:
        rows = self.record_rows()
        with open(self._md, "w") as f:
            f.write(lm_head_report.render(rows))
        print(f"wrote {self._csv} and {self._md}")
        print(lm_head_report.verdicts(rows))

    def problem(self, row: dict) -> Optional[str]:
        if row["status"].startswith("error") and row["provider"] not in PEERS:
            return f"{row['provider']} T={row['T']} V={row['V']} tp={row['tp']}: {row['status']}"
        return None
