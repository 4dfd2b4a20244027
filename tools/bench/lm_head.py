"""The LM head's family: log-prob + entropy straight from bf16 hidden states [T, H] and a weight shard [V_local, H].

Suites:
  lm_head       T in (8192, 32768), H = 4096, V = 151936, TP in (1, 2, 4, 8) (a run keeps those of its --tp): every
                provider; at TP = 1 also the gemms, unfused and fused providers on a TP = 2 rank's local shape
  lm_head_own   the same without the other projects' kernels (its local-shape rows: gemms, fused, token_loss)
  lm_head_small Qwen3-0.6B's head (H = 1024), T in (8192, 32768), TP = 1: the GEMMs, the logits path, the fused head
                with and without a gradient, the token loss (and with working_memory=0)
  lm_head_keep  fused and token_loss with and without a 64-id sparse keep set per row, T = 8192
  lm_head_exact SGLang's order: H in (1024, 4096), T in (8192, 32768), TP = 1: the GEMMs, the fused head and token
                loss beside their reduction_order="sglang" forms and the sglang-order logits path (with and without
                the token loss)
  lm_head_transforms  T in (8192, 32768), H = 4096, TP = 1: fused and token_loss plain, with a per-row temperature
                and with a softcap (logits.TRANSFORM_*)
  lm_head_seq   the sequence schedule: T in (8192, 32768), H = 4096, TP = 1: the GEMMs, the PPO token loss, GSPO
                through the token loss without and with a token-level rollout correction (TIS)

Providers (forward + backward with upstream gradients for the log-prob and, where the provider has one, the entropy):
  gemms     the three cuBLAS GEMMs alone: logits = X W^T, dX = G W, dW = G^T X (G a stored [T, V_local] gradient)
  gemm1     one cuBLAS GEMM, logits = X W^T: what the forward-only rows are set against
  unfused   logits = X W^T, ppo_ops.log_probs_and_entropy, autograd's GEMMs back (dX all-reduced at TP > 1)
  fused / fused_novalidate  ppo_ops.linear_log_probs_and_entropy(entropy="grad"), validate on / off
  fused_nograd  its forward under torch.no_grad
  token_loss / token_loss_novalidate / token_loss_lean  ppo_ops.linear_token_loss with token_losses.policy_loss
            (DAPO's clip range, entropy bonus, k3 KL, token mean), validate on / off / working_memory=0
  fused_keep / token_loss_keep  fused / token_loss with a 64-id nucleus per row as the sparse keep set
  token_loss_gspo / token_loss_gspo_tis  ppo_ops.linear_token_loss with sequence_losses.gspo_loss (the sequence
            schedule) over packed sequences of GSPO_SEQ_ROWS rows, without / with rollout_correction="token_tis"
  fused_temp_rows / fused_softcap / token_loss_temp_rows / token_loss_softcap  fused / token_loss with a [T]
            temperature or Gemma 2's softcap (not checked against float64 here: tests/test_logit_transforms.py)
  exact / exact_token_loss  fused / token_loss with reduction_order="sglang": bit for bit SGLang's on-policy head
  sglang_logits / sglang_logits_loss  the sglang-order logits path: bf16 logits from SGLang's batch-invariant matmul
            (ppo_ops' reproduction of it, lm_head/sglang_matmul.py: its bits and its config), then
            log_probs_and_entropy(reduction_order="sglang") (with the token_loss rows' loss through autograd), cuBLAS
            GEMMs back: what a trainer exact with SGLang runs without the fused head
  liger     Liger-Kernel's fused linear cross entropy (log-prob only, reduction "mean"; TP=1)
  liger_flsce / liger_flsce_nograd  Liger's fused linear scaled CE (NLL and entropy, both gradients; its CuTe DSL
            kernel on sm_90; TP=1) / its forward under no_grad
  cce / cce_exact  Cut Cross-Entropy's linear_cross_entropy (log-prob, per token), gradient filtering on / off
  verl      verl's fused linear cross entropy (log-prob and entropy; vocabulary-parallel), its kernel modules loaded
            without verl's package import (which needs its trainer)

Check (TP = 1, --check_rows > 0): the largest differences from float64 on 64 rows (the first and last 32: a
reference over all T rows would cost a [T, V] float64 tensor), from the same bf16 inputs: log-prob and entropy
(absolute), dX (relative to max |dX|; for token_loss, autograd through the same closure in float64); and the largest
|log-prob difference| against the unfused path in `check` (a sanity check: the unfused path rounds its logits to bf16).
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from tools.bench import logits as logits_family
from tools.bench.common import (QWEN3_VOCAB, Case, Closure, Provider, first_import_problem, keep_missing, nucleus,
                                registry)

NAME = "lm_head"
TIMES_STEADY = True  # prepare does nothing: back to back times the op alone
HIDDEN, SMALL_HIDDEN = 4096, 1024  # the head of the lm_head suites; Qwen3-0.6B's (the step family's model)
TOKENS = (8192, 32768)
PROVIDERS_ORDER = ("gemms", "gemm1", "unfused", "fused", "fused_novalidate", "fused_nograd", "token_loss",
                   "token_loss_novalidate", "token_loss_lean", "liger", "liger_flsce", "liger_flsce_nograd", "cce",
                   "cce_exact", "verl", "fused_keep", "token_loss_keep", "exact", "exact_token_loss",
                   "sglang_logits", "sglang_logits_loss", "token_loss_gspo", "token_loss_gspo_tis", "fused_temp_rows",
                   "fused_softcap", "token_loss_temp_rows", "token_loss_softcap")
TRANSFORMS = ("_temp_rows", "_softcap")  # suffixes of the providers with a per-row temperature or a softcap
PEERS = ("liger", "liger_flsce", "liger_flsce_nograd", "cce", "cce_exact", "verl")  # other projects' kernels
ONE_GEMM = ("fused_nograd", "liger_flsce_nograd")  # forward only: set against one GEMM
CHECK_ROWS = 64  # rows compared with float64: a [64, V] float64 block is 78 MB
PPO = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, kl_coef=0.01)  # the token_loss rows' loss (DAPO's clip)
# The GSPO rows' sequences: packed one after another, lengths drawn in this range (responses of a GRPO group), all
# shorter than a loss_blocks block at H = 4096 (2816 rows): the sequence schedule recomputes none.
GSPO_SEQ_ROWS = (256, 2048)


# Each exact row's own baselines: the sglang-order logits path of the same loss, and the non-exact fused head.
EXACT_BASELINES = {"exact": ("sglang_logits", "fused"), "exact_token_loss": ("sglang_logits_loss", "token_loss")}


def case(provider: str, T: int, H: int = HIDDEN, V: int = QWEN3_VOCAB, tp: int = 1) -> Case:
    return Case(NAME, provider, T, V, tp=tp, H=H)


def _suite(providers, local_shape) -> list[Case]:
    out = [case(p, T, tp=tp) for tp in (1, 2, 4, 8) for T in TOKENS for p in providers]
    return out + [case(p, T, V=QWEN3_VOCAB // 2) for T in TOKENS for p in local_shape]


SUITES = dict(
    lm_head=lambda: _suite(PROVIDERS_ORDER[:15], ("gemms", "unfused", "fused", "fused_novalidate")),
    lm_head_own=lambda: _suite([p for p in PROVIDERS_ORDER[:15] if p != "unfused" and p not in PEERS],
                               ("gemms", "fused", "token_loss")),
    lm_head_small=lambda: [case(p, T, H=SMALL_HIDDEN) for T in TOKENS
                           for p in ("gemms", "unfused", "fused", "fused_nograd", "token_loss", "token_loss_lean")],
    lm_head_keep=lambda: [case(p, 8192) for p in ("fused", "fused_keep", "token_loss", "token_loss_keep")],
    lm_head_transforms=lambda: [case(p + t, T) for T in TOKENS for p in ("fused", "token_loss")
                                for t in ("",) + TRANSFORMS],
    lm_head_seq=lambda: [case(p, T) for T in TOKENS
                         for p in ("gemms", "token_loss", "token_loss_gspo", "token_loss_gspo_tis")],
    lm_head_exact=lambda: [case(p, T, H=H) for H in (SMALL_HIDDEN, HIDDEN) for T in TOKENS
                           for p in ("gemms", "fused", "exact", "sglang_logits", "token_loss", "exact_token_loss",
                                     "sglang_logits_loss")],
)


def SMOKE() -> list[Case]:
    """Tiny (T = 16, H = 64, V = 256): the GEMMs, each of ppo_ops' paths once, a peer (skipped off CUDA); the TP = 2
    cases run under --tp=2."""
    return ([case(p, 16, H=64, V=256) for p in ("gemms", "gemm1", "unfused", "fused", "fused_nograd", "token_loss",
                                                  "exact", "sglang_logits", "liger_flsce", "fused_temp_rows",
                                                  "token_loss_softcap")]
            + [case(p, 16, H=64, V=256, tp=2) for p in ("gemms", "fused")])


def bytes_moved(c: Case) -> None:
    return None


def baselines(c: Case) -> tuple[list[dict], Optional[dict]]:
    """The GEMMs of the same shape (one GEMM for the forward-only rows), the logits path (unfused), a keep set's row
    the same call without one, a TP > 1 row the same call on the rank's local shape at TP = 1."""
    if c.provider in ("gemms", "gemm1"):
        return [], None
    out = [dict(provider="gemm1" if c.provider in ONE_GEMM else "gemms")]
    if c.provider not in ONE_GEMM + ("unfused",):
        out.append(dict(provider="unfused"))
    if c.provider.endswith("_keep"):
        out.append(dict(provider=c.provider.removesuffix("_keep")))
    for suffix in TRANSFORMS:  # the same call without the transform
        if c.provider.endswith(suffix):
            out.append(dict(provider=c.provider.removesuffix(suffix)))
    if c.provider in EXACT_BASELINES:  # the exact head beside the logits path it replaces and the fused head
        out += [dict(provider=p) for p in EXACT_BASELINES[c.provider]]
    if c.tp > 1:
        out.append(dict(tp=1, V=c.V // c.tp))
    return out, None


# --- inputs ---


class HeadInputs:
    """bf16 hidden states [T, H] (the same on every rank), this rank's weight shard [V_local, H], tokens and the
    upstream gradients; the gemms rows' stored logits gradient and the token_loss rows' PPO closure on first use."""

    def __init__(self, c: Case, device: torch.device, seed: int, group, rank: int):
        gen = torch.Generator(device=device).manual_seed(seed)  # every rank draws the global tensors, keeps its slice
        self.group, self.rank, self._seed = group, rank, seed
        interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self.backend = "triton" if (device.type == "cuda" or interpreted) else "torch"
        self.hidden = torch.randn((c.T, c.H), generator=gen, device=device).to(torch.bfloat16)
        full = torch.randn((c.V, c.H), generator=gen, device=device, dtype=torch.bfloat16)
        full.mul_(3.0 / c.H**0.5)  # logits of O(3): a peaked, not one-hot, distribution
        self.weight = full[rank * c.v_local:(rank + 1) * c.v_local].clone()
        del full
        self.tokens = torch.randint(0, c.V, (c.T,), generator=gen, device=device)
        self.g_lp = 0.5 + torch.rand(c.T, generator=gen, device=device)
        self.g_ent = torch.rand(c.T, generator=gen, device=device) * 2 - 1
        self._g_logits, self._ppo, self._gspo = None, None, {}

    def leaves(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _leaf(self.hidden), _leaf(self.weight)

    def logits_grad(self, c: Case) -> torch.Tensor:
        if self._g_logits is None:
            self._g_logits = torch.randn((c.T, c.v_local), device=self.hidden.device, dtype=torch.bfloat16)
        return self._g_logits

    def ppo_loss(self):
        """policy_loss with old and reference log-probs near the current ones (the fused forward plus noise of
        0.1) and advantages ~ N(0, 1)."""
        import ppo_ops
        from ppo_ops import token_losses

        if self._ppo is None:
            gen = torch.Generator(device=self.hidden.device).manual_seed(self._seed + 7)
            with torch.no_grad():
                lp = ppo_ops.linear_log_probs_and_entropy(self.hidden, self.weight, self.tokens, tp_group=self.group,
                                                          backend=self.backend).log_probs

            def noisy():
                return lp + 0.1 * torch.randn(lp.shape, generator=gen, device=lp.device)

            self._ppo = token_losses.policy_loss(noisy(), torch.randn(lp.shape, generator=gen, device=lp.device),
                                                 ref_log_probs=noisy(), kl_type="k3", normalization="token_mean",
                                                 **PPO)
        return self._ppo


    def gspo_loss(self, tis: bool):
        """gspo_loss (clip 0.2 / 0.28) over packed sequences of GSPO_SEQ_ROWS rows with one advantage each, old and
        rollout log-probs near the current ones; with tis, rollout_correction="token_tis" (cap 2)."""
        import ppo_ops

        if tis not in self._gspo:
            device = self.hidden.device
            gen = torch.Generator(device="cpu").manual_seed(self._seed + 11)
            lens, total = [], self.hidden.shape[0]
            while sum(lens) < total:
                lens.append(min(int(torch.randint(*GSPO_SEQ_ROWS, (1,), generator=gen)), total - sum(lens)))
            seq_ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
            with torch.no_grad():
                lp = ppo_ops.linear_log_probs_and_entropy(self.hidden, self.weight, self.tokens, tp_group=self.group,
                                                          backend=self.backend).log_probs
            noise = torch.randn((2, lp.numel()), generator=gen).to(device)
            adv = torch.randn(len(lens), generator=gen).to(device)[seq_ids]
            options = dict(rollout_log_probs=lp + 0.1 * noise[1], rollout_correction="token_tis",
                           rollout_is_high=2.0) if tis else {}
            self._gspo[tis] = ppo_ops.gspo_loss(lp + 0.01 * noise[0], adv, seq_ids, clip_low=0.2, clip_high=0.28,
                                                **options)
        return self._gspo[tis]


def make_inputs(c: Case, device: torch.device, *, seed: int, rank: int = 0, group=None) -> HeadInputs:
    return HeadInputs(c, device, seed, group, rank)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True)


# --- providers ---


class Values(NamedTuple):
    """What the float64 check compares: the outputs, dX (None without a backward) and the per-token loss the
    gradient is of (None: the upstream gradients g_lp, g_ent)."""

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    dx: Optional[torch.Tensor] = None
    token_loss: Optional[Callable] = None


def _closure(step: Callable[[], object], values: Optional[Callable[[], Values]] = None) -> Closure:
    """A Closure whose forward gives the check's Values."""
    return Closure(prepare=lambda: None, step=lambda _: step(), forward=values)


def _grads(out, wrt, inp: HeadInputs):
    return torch.autograd.grad([out.log_probs, out.entropy], wrt, [inp.g_lp, inp.g_ent])


def build_gemms(c: Case, inp: HeadInputs) -> Closure:
    g = inp.logits_grad(c)
    if c.provider == "gemm1":
        return _closure(lambda: inp.hidden @ inp.weight.T)
    return _closure(lambda: (inp.hidden @ inp.weight.T, g @ inp.weight, g.T @ inp.hidden))


def build_ppo_ops(c: Case, inp: HeadInputs) -> Closure:
    """unfused, fused, fused_novalidate, fused_nograd, token_loss (_novalidate, _lean), fused_keep, token_loss_keep,
    exact, exact_token_loss, sglang_logits, sglang_logits_loss."""
    import ppo_ops

    options = dict(tp_group=inp.group, entropy="grad", backend=inp.backend, validate=not c.provider.endswith(
        "_novalidate"))
    if c.provider.startswith(("exact", "sglang_logits")):
        options["reduction_order"] = "sglang"
    if c.provider.startswith("sglang_logits"):
        return _sglang_logits_path(c, inp, options)
    if c.provider.endswith("_keep"):
        options["keep"] = nucleus(inp.tokens, c.V, seed=17)
    if c.provider.endswith("_temp_rows"):
        options["temperature"] = logits_family.per_row_temperatures(c.T, inp.hidden.device)
    if c.provider.endswith("_softcap"):
        options["softcap"] = logits_family.TRANSFORM_SOFTCAP
    if c.provider.startswith("token_loss_gspo"):
        loss_closure = inp.gspo_loss(tis=c.provider.endswith("_tis"))
    elif c.provider.startswith(("token_loss", "exact_token_loss")):
        loss_closure = inp.ppo_loss()
    else:
        loss_closure = None
    if c.provider == "token_loss_lean":
        options["working_memory"] = 0
    if c.provider == "fused_nograd":
        options["entropy"] = "value"

    def forward(x, w):
        if loss_closure is not None:
            return ppo_ops.linear_token_loss(x, w, inp.tokens, loss_closure, **options)
        if c.provider == "unfused":
            return ppo_ops.log_probs_and_entropy(x @ w.T, inp.tokens, **options)
        return ppo_ops.linear_log_probs_and_entropy(x, w, inp.tokens, **options)

    def step(x, w, wrt):
        if c.provider == "fused_nograd":
            with torch.no_grad():
                return forward(x, w)
        if loss_closure is not None:
            loss, out = forward(x, w)
            return torch.autograd.grad(loss, wrt), out
        out = forward(x, w)
        grads = _grads(out, wrt, inp)
        if c.provider == "unfused" and inp.group is not None:
            dist.all_reduce(grads[0], group=inp.group)  # the column-parallel layer's dX all-reduce
        return grads, out

    def values():
        x, w = inp.leaves()
        if c.provider == "fused_nograd":
            out = step(x, w, None)
            return Values(out.log_probs, out.entropy)
        (dx, *_), out = step(x, w, [x])
        return Values(out.log_probs.detach(), out.entropy.detach(), dx, loss_closure)

    def timed():
        x, w = inp.leaves()
        return step(x, w, [x, w])

    # no float64 check for a keep set, nor for GSPO (the check's 64 rows do not hold whole sequences), nor for a
    # transform (the check's reference has none)
    unchecked = c.provider.endswith(("_keep",) + TRANSFORMS) or "gspo" in c.provider
    return _closure(timed, None if unchecked else values)


def _sglang_logits_path(c: Case, inp: HeadInputs, options: dict) -> Closure:
    """SGLang's matmul to bf16 [T, V] logits, the logits op in SGLang's order, the gradient's GEMMs by cuBLAS."""
    import ppo_ops
    from ppo_ops.lm_head import sglang_matmul

    loss_closure = inp.ppo_loss() if c.provider == "sglang_logits_loss" else None

    def forward(x, w):
        z = torch.empty((c.T, c.v_local), dtype=torch.bfloat16, device=x.device)
        sglang_matmul.bf16_logits(x.detach(), w.detach(), z, None, inp.backend)
        z.requires_grad_(True)
        return z, ppo_ops.log_probs_and_entropy(z, inp.tokens, **options)

    def step(x, w, wrt):
        z, out = forward(x, w)
        if loss_closure is not None:
            loss = loss_closure(out.log_probs, out.entropy, torch.arange(c.T, device=x.device)).sum()
            (g,) = torch.autograd.grad(loss, z)
        else:
            (g,) = torch.autograd.grad([out.log_probs, out.entropy], z, [inp.g_lp, inp.g_ent])
        del z
        return (g @ w.detach(), g.T @ x.detach()), out

    def values():
        x, w = inp.leaves()
        (dx, _), out = step(x, w, None)
        return Values(out.log_probs.detach(), out.entropy.detach(), dx, loss_closure)

    return _closure(lambda: step(*inp.leaves(), None), values)


def build_liger(c: Case, inp: HeadInputs) -> Closure:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def step():
        x, w = inp.leaves()
        loss = liger_fused_linear_cross_entropy(x, w, inp.tokens, reduction="mean")
        return torch.autograd.grad(loss[0] if isinstance(loss, tuple) else loss, [x, w])

    return _closure(step)


def build_liger_flsce(c: Case, inp: HeadInputs) -> Closure:
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import LigerFusedLinearScaledCrossEntropyFunction

    def forward(x, w):  # per-token NLL and entropy; temperature 1, ignore_index -100, one M tile per cluster
        return LigerFusedLinearScaledCrossEntropyFunction.apply(x, w, inp.tokens, 1.0, -100, 1, True)

    def step():  # (the check's Values, dW: alive at the peak as in a trainer)
        x, w = inp.leaves()
        if c.provider == "liger_flsce_nograd":
            with torch.no_grad():
                nll, ent = forward(x, w)
            return Values(-nll, ent), None
        nll, ent = forward(x, w)
        dx, dw = torch.autograd.grad([nll, ent], [x, w], [-inp.g_lp, inp.g_ent])  # log p = -NLL
        return Values(-nll.detach(), ent.detach(), dx), dw

    return _closure(step, lambda: step()[0])


def build_cce(c: Case, inp: HeadInputs) -> Closure:
    from cut_cross_entropy import linear_cross_entropy

    filter_eps = "high" if c.provider == "cce" else None

    def step():
        x, w = inp.leaves()
        loss = linear_cross_entropy(x, w, inp.tokens, reduction="none", filter_eps=filter_eps)  # -log p
        dx, dw = torch.autograd.grad(loss, [x, w], -inp.g_lp)
        return Values(-loss.detach(), None, dx, lambda lp, ent, rows: lp * inp.g_lp[rows]), dw

    return _closure(step, lambda: step()[0])


def build_verl(c: Case, inp: HeadInputs) -> Closure:
    verl_lce = verl_linear_cross_entropy()

    def step():
        x, w = inp.leaves()
        log_probs, entropy = verl_lce(x, w, inp.tokens, 1.0, "none", inp.group)
        dx, dw = torch.autograd.grad([log_probs, entropy], [x, w], [inp.g_lp, inp.g_ent])
        return Values(log_probs.detach(), entropy.detach(), dx), dw

    return _closure(step, lambda: step()[0])


def verl_linear_cross_entropy():
    """verl's LinearCrossEntropy.apply from its installed files. `import verl` runs the package's __init__, which
    imports its trainer (tensordict, ray, ...); the kernel needs torch, triton and four helpers of verl.utils.device,
    so the parent packages are registered as bare namespaces and that module as a small stand-in."""
    import importlib
    import importlib.util
    import types

    if "verl.utils.kernel.linear_cross_entropy" in sys.modules:
        return sys.modules["verl.utils.kernel.linear_cross_entropy"].linear_cross_entropy
    spec = importlib.util.find_spec("verl")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed")
    root = list(spec.submodule_search_locations)[0]
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


def _unsupported(c: Case, device: torch.device) -> Optional[str]:
    """Why a provider cannot run a case: the peers need CUDA and (but verl) one rank; ppo_ops' need it importable."""
    if c.provider in PEERS:
        if c.tp > 1 and c.provider != "verl":
            return f"{c.provider} has no vocabulary parallelism here"
        if device.type != "cuda":
            return f"{c.provider}'s kernels need CUDA"
        if c.provider == "verl":
            try:
                verl_linear_cross_entropy()
            except Exception as error:  # not installed, or its files fail to load
                return f"verl's kernel is not loadable ({type(error).__name__}: {(str(error).splitlines() or [''])[0]})"
        return first_import_problem(PROVIDERS[c.provider].modules)
    if c.provider in ("gemms", "gemm1"):
        return None
    return first_import_problem(("ppo_ops",)) or (keep_missing() if c.provider.endswith("_keep") else None)


_MODULES = {"liger": ("liger_kernel.transformers.functional",),
            # Liger's scaled CE dispatches to its CuTe DSL kernel on sm_90, which needs NVIDIA's CUTLASS DSL
            "liger_flsce": ("liger_kernel.ops.fused_linear_scaled_cross_entropy", "cutlass"),
            "cce": ("cut_cross_entropy",)}
_BUILDERS = {"gemm": build_gemms, "liger_flsce": build_liger_flsce, "liger": build_liger, "cce": build_cce,
             "verl": build_verl}
PROVIDERS = registry(*(Provider(
    p, next((b for prefix, b in _BUILDERS.items() if p.startswith(prefix)), build_ppo_ops), _unsupported,
    modules=next((m for prefix, m in sorted(_MODULES.items(), reverse=True) if p.startswith(prefix)),
                 () if p.startswith(("gemm", "verl")) else ("ppo_ops",)),
    peer=p in PEERS) for p in PROVIDERS_ORDER))


# --- the check ---


def check(c: Case, inp: HeadInputs, closure: Closure, memo: dict, check_rows: int) -> dict:
    if not (check_rows and closure.forward):
        return {}
    got = closure.forward()
    out = {}
    if c.provider == "unfused":
        memo["unfused"] = got.log_probs
    elif memo.get("unfused") is not None:
        out["check"] = f"|Δ log-prob| vs unfused {(got.log_probs.float() - memo['unfused'].float()).abs().max():.2e}"
    if inp.group is not None:  # the reference needs the whole weight
        return out
    k = min(CHECK_ROWS // 2, c.T // 2)
    rows = torch.cat([torch.arange(k), torch.arange(c.T - k, c.T)]).to(inp.hidden.device)
    x, w = inp.hidden[rows].double(), inp.weight.double()
    z = (x @ w.T).requires_grad_(got.dx is not None)
    lsm = torch.log_softmax(z, dim=-1)
    lp64, ent64 = lsm.gather(1, inp.tokens[rows][:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
    out["err_logprob"] = (got.log_probs[rows].double() - lp64).abs().max().item()
    if got.entropy is not None:
        out["err_entropy"] = (got.entropy[rows].double() - ent64).abs().max().item()
    if got.dx is not None:
        if got.token_loss is not None:  # a TokenLoss takes fp32: float64 values rounded once, the cast differentiable
            dz = torch.autograd.grad(got.token_loss(lp64.float(), ent64.float(), rows).sum(), z)[0]
        else:
            dz = torch.autograd.grad([lp64, ent64], z, [inp.g_lp[rows].double(), inp.g_ent[rows].double()])[0]
        ref = dz @ w
        out["err_dx_rel"] = ((got.dx[rows].double() - ref).abs().max() / ref.abs().max()).item()
    return out
