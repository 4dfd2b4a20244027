"""The logits op's family: per-token log-prob and entropy of [T, V_local] logits, forward + backward.

Suites (most important first, so that a run stopped by its time budget has measured the headline):
  headline  T=8192, V=151936 (Qwen3), bf16, TP=1: log-prob + entropy with grad for every provider, log-prob only
            against Liger-Kernel, the triton provider with inplace_grad (memory) and validate=False (no host sync)
  tp_ref    TP=1 on the local shape of a TP=2 rank (V=75968): what the tp2 rows are set against
  sweep     T in {4096, 8192, 16384} x {bf16, fp32} x {log-prob only, + entropy grad}: the plot
  options   T=8192 bf16: entropy value, keep mask, 10% row mask, against every provider that supports them
  grid      the rest of the cross product for the ppo_ops providers
  tp2       the TP=2 cases (run with --tp=2)
  sglang_order  reduction_order="sglang" beside the fused op, SGLang's own log_softmax and naive torch, TP = 1 and 2
  small_call  the host cost of a small call, T = 1024 and 8192, validate=False: eager (repeated calls replay,
            ppo_ops/logits/replay.py; eager_own_path: the replay off), torch.compile(fullgraph=True) (compiled),
            mode="reduce-overhead" (CUDA graphs); floor_*: the same modes of an op doing one kernel each way
  keep_set  the triton provider without a keep set, with a 64-id sparse one per row, and with the dense mask built
            from it in the step
  transforms  the triton provider, with a scalar temperature, a per-row [T] temperature, and Gemma 2's softcap
            (T = 8192 and 32768): the scalar one tells what any temperature costs from what a per-row one adds

Providers:
  triton / torch  ppo_ops.log_probs_and_entropy(backend=...), with the case's validate / inplace_grad
  triton_sglang  the triton provider with reduction_order="sglang"
  triton_keep_sparse / triton_keep_dense  the keep_set suite's ways (not checked: the tests check the keep set)
  triton_temp / triton_temp_rows / triton_softcap  the triton provider with temperature=TRANSFORM_TEMPERATURE / a [T]
          temperature (TRANSFORM_TEMPERATURES, one value per TRANSFORM_SEQ_ROWS rows) / softcap=TRANSFORM_SOFTCAP (not
          checked: tests/test_logit_transforms.py checks them)
  eager, eager_own_path, compiled, reduce_overhead, floor_eager, floor_compiled, floor_reduce_overhead  small_call
  sglang  SGLang's batch-invariant log_softmax of logits.float() + gather (TP=1, log-prob only); FORWARD ONLY: its
          kernel has no backward, so its step is the forward (its bytes still count a backward: read its ms)
  legacy  ppo_ops.legacy.calculate_log_probs_and_entropy (Megatron's fused vocab-parallel CE + an entropy Function)
  naive   log_softmax + gather + softmax entropy in fp32 (TP=1)
  liger   Liger-Kernel's cross entropy, reduction="none" (TP=1, log-prob only); its forward writes the gradient into
          its input, so the step clones the logits first (timed: any caller pays it)

Inputs: rank r holds the logits' columns [r V_local, (r + 1) V_local), random normals drawn in the case's dtype from a
rank-specific seed (never zeros); tokens, row mask and upstream gradients come from a shared CPU seed, identical on
every rank. Rows the row mask drops hold token -100, as prompt rows do (Liger skips them as its ignore_index).

Check: each provider's forward on the first and last check_rows / 2 rows (an offset overflowing 32 bits shows in the
last) against the test suite's float64 reference (tests/reference.py) on the same rows of the global logits,
gathered across ranks; a semantic check (1% of max(1, |reference|): Liger returns bf16), not a precision test.

Bytes (per rank, the op's floor): the forward reads the kept rows once; the backward reads them again and writes the
whole gradient; a keep mask (1 byte an element) is read in each pass. O(T) vectors are not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from typing import Optional

import torch
import torch.distributed as dist

from tools.bench.common import (QWEN3_VOCAB, Case, Closure, Provider, dense_mask, first_import_problem, keep_missing,
                                nucleus, registry)
from tools.bench.measure import DTYPE_BYTES, TORCH_DTYPES

NAME = "logits"
TIMES_STEADY = False  # prepare refills the logits an in-place backward destroyed: back to back would time the copy
TOKENS = (4096, 8192, 16384)
DTYPES = ("bf16", "fp32")
ENTROPY_MODES = ("none", "value", "grad")
ROW_FRACTION = 0.1  # the row-mask cases keep 10% of the rows
PPO_OPS = ("triton", "torch", "triton_sglang", "triton_keep_sparse", "triton_keep_dense", "triton_temp",
           "triton_temp_rows", "triton_softcap")  # have validate, inplace
BASELINES = ("triton", "torch", "legacy", "naive", "liger")
SMALL_CALL = ("eager", "eager_own_path", "compiled", "reduce_overhead", "floor_eager", "floor_compiled",
              "floor_reduce_overhead")
LOGIT_STD = 2.0  # spread of the random logits
KEEP_FRACTION = 0.5  # density of the random keep mask
IGNORED_TOKEN = -100  # token id of rows dropped by the row mask (prompt rows)
CHECK_RTOL = 1e-2  # semantic check (see the module docstring)
# The transforms suite: sampling temperatures that vary by sequence (verl's per-sample temperature), one per
# TRANSFORM_SEQ_ROWS rows, and Gemma 2's final_logit_softcapping.
TRANSFORM_TEMPERATURES = (0.6, 0.8, 1.0, 1.2)
TRANSFORM_TEMPERATURE = 0.8  # the scalar case: one of the per-row values
TRANSFORM_SEQ_ROWS = 1024
TRANSFORM_SOFTCAP = 30.0
COMPILE_WARMUP_CALLS = 3  # a compiled case's untimed steps in its build: compile, CUDA graph warm-up, record, replay


def case(provider: str, T: int = 8192, V: int = QWEN3_VOCAB, **options) -> Case:
    """A logits-family case; the ppo_ops providers' validate / inplace_grad spelled out (so equal cases compare
    equal)."""
    if provider in PPO_OPS + SMALL_CALL:
        options.setdefault("validate", True)
        options.setdefault("inplace_grad", False)
    return Case(NAME, provider, T, V, **options)


def _variants(providers, extra: bool = True, **shape) -> list[Case]:
    """Each provider on the shape; the triton provider also with inplace_grad and validate=False where `extra`."""
    out = []
    for p in providers:
        out.append(case(p, **shape))
        if p == "triton" and extra:
            out += [case(p, inplace_grad=True, **shape), case(p, validate=False, **shape)]
    return out


def _headline() -> list[Case]:
    return (_variants(("triton", "torch", "legacy", "naive"), entropy="grad")
            + _variants(("triton", "liger", "torch", "legacy", "naive"), entropy="none"))


def _tp_ref() -> list[Case]:
    s = dict(V=QWEN3_VOCAB // 2, dtype="bf16")
    return (_variants(("triton", "torch"), False, entropy="grad", **s) + [case("triton", validate=False, **s)]
            + [case("triton", entropy="none", **s)])


def _sweep() -> list[Case]:
    out = []
    for dtype, T in itertools.product(DTYPES, TOKENS):
        out += _variants(("triton", "torch", "legacy", "naive"), T=T, dtype=dtype, entropy="grad")
        out += _variants(("triton", "liger", "torch", "legacy", "naive"), T=T, dtype=dtype, entropy="none")
    return out


def _options() -> list[Case]:
    providers = BASELINES + ("triton_sglang", "sglang")
    out = _variants(providers, entropy="value")
    for mask in (dict(keep_mask=True), dict(row_frac=ROW_FRACTION)):  # outer: one input set per mask
        for entropy in ("none", "grad"):
            out += _variants(providers, entropy=entropy, **mask)
    return out


def _grid(providers=PPO_OPS, tp: int = 1) -> list[Case]:
    out = []
    for T, dtype, keep, row, entropy in itertools.product(TOKENS, DTYPES, (False, True), (1.0, ROW_FRACTION),
                                                          ENTROPY_MODES):  # entropy innermost: shared inputs
        out += [case(p, T=T, dtype=dtype, entropy=entropy, keep_mask=keep, row_frac=row, tp=tp) for p in providers]
    return out


def _tp2() -> list[Case]:
    out, providers = [], ("triton", "torch", "legacy")
    for T in (8192, 4096, 16384):
        out += _variants(providers, T=T, entropy="grad", tp=2) + _variants(providers, T=T, entropy="none", tp=2)
    out += _variants(providers, False, entropy="value", tp=2)
    out += _variants(providers, False, keep_mask=True, tp=2) + _variants(providers, False, row_frac=ROW_FRACTION, tp=2)
    return out + _grid(("triton",), tp=2)


def _sglang_order() -> list[Case]:
    out = []
    for tp, entropy in itertools.product((1, 2), ("none", "grad")):
        out += [case(p, entropy=entropy, tp=tp) for p in ("triton", "triton_sglang", "sglang", "naive")]
        out += [case(p, entropy=entropy, tp=tp, validate=False) for p in ("triton", "triton_sglang")]
    return out


def _small_call() -> list[Case]:
    return [case(p, T=T, validate=False) for T in (1024, 8192) for p in SMALL_CALL]


def _keep_set() -> list[Case]:
    return [case(p, validate=v) for v in (True, False) for p in ("triton", "triton_keep_sparse", "triton_keep_dense")]


def _smoke() -> list[Case]:
    """Tiny: 8 rows (a 10% row mask keeps one), 256 columns (a power of two for the Triton interpreter, which takes
    about half a second a step). Every option once; liger and reduce_overhead skip on CPU, triton too unless
    TRITON_INTERPRET=1. The TP = 2 cases run under --tp=2."""
    s = dict(T=8, V=256)
    out = [case(p, entropy=e, **s) for e in ("none", "grad") for p in ("torch", "naive", "legacy")]
    out += [case(p, keep_mask=True, row_frac=ROW_FRACTION, **s) for p in ("torch", "naive", "legacy")]
    out += [case("torch", dtype="fp32", entropy="value", **s), case("liger", entropy="none", **s),
            case("torch", inplace_grad=True, **s), case("triton", **s)]
    out += [case(p, validate=False, **s) for p in ("eager", "eager_own_path", "floor_eager", "reduce_overhead")]
    return out + [case(p, keep_mask=k, tp=2, **s) for k in (False, True) for p in ("torch", "legacy", "naive")]


def _transforms() -> list[Case]:
    return [case(p, T=T) for T in (8192, 32768)
            for p in ("triton", "triton_temp", "triton_temp_rows", "triton_softcap")]


SUITES = dict(headline=_headline, tp_ref=_tp_ref, sweep=_sweep, options=_options, grid=_grid, tp2=_tp2,
              sglang_order=_sglang_order, small_call=_small_call, keep_set=_keep_set, transforms=_transforms)
SMOKE = _smoke


def bytes_moved(c: Case) -> int:
    db, mask = DTYPE_BYTES[c.dtype], c.kept_rows * c.v_local if c.keep_mask else 0
    return 2 * (c.kept_rows * c.v_local * db + mask) + c.T * c.v_local * db


def baselines(c: Case) -> tuple[list[dict], Optional[dict]]:
    out = []
    if c.tp > 1:
        out.append(dict(tp=1, V=c.V // c.tp))  # the same call on a TP = 1 shape of the rank's local size
    if c.provider.startswith(("triton_keep", "triton_sglang", "triton_temp", "triton_softcap")):
        out.append(dict(provider="triton"))
    elif c.provider == "eager":
        out.append(dict(provider="eager_own_path"))
    if c.provider in ("eager", "compiled", "reduce_overhead"):
        out.append(dict(provider=f"floor_{c.provider}"))
    return out, None


# --- inputs and the check ---


@dataclasses.dataclass
class Inputs:
    logits: torch.Tensor  # [T, V_local] leaf with requires_grad, the case's dtype; READ-ONLY for every provider
    tokens: torch.Tensor  # [T] int64 global ids; IGNORED_TOKEN in rows dropped by the row mask
    keep_mask: Optional[torch.Tensor]  # [T, V_local] bool, True = in the log-prob's normaliser; or None
    row_mask: Optional[torch.Tensor]  # [T] bool, True = trained on; or None
    grad_log_prob: torch.Tensor  # [T] fp32 upstream gradient of the log-prob
    grad_entropy: torch.Tensor  # [T] fp32 upstream gradient of the entropy
    group: object  # the TP process group, or None at TP=1
    rank: int


def make_inputs(c: Case, device: torch.device, *, seed: int, rank: int = 0, group=None) -> Inputs:
    shared = torch.Generator().manual_seed(seed)
    local = torch.Generator(device=device).manual_seed(seed + 1000 * (rank + 1))
    logits = torch.randn(c.T, c.v_local, device=device, dtype=TORCH_DTYPES[c.dtype], generator=local)
    logits.mul_(LOGIT_STD).requires_grad_(True)
    tokens = torch.randint(0, c.V, (c.T,), dtype=torch.int64, generator=shared)
    grads = torch.randn(2, c.T, dtype=torch.float32, generator=shared)
    keep_mask = torch.rand(c.T, c.v_local, device=device, generator=local) < KEEP_FRACTION if c.keep_mask else None
    row_mask = None
    if c.row_frac < 1.0:
        row_mask = torch.zeros(c.T, dtype=torch.bool)
        row_mask[torch.randperm(c.T, generator=shared)[: c.kept_rows]] = True
        tokens = tokens.masked_fill(~row_mask, IGNORED_TOKEN)
        row_mask = row_mask.to(device)
    grads = grads.to(device)
    return Inputs(logits, tokens.to(device), keep_mask, row_mask, grads[0], grads[1], group, rank)


def _global_rows(x: torch.Tensor, rows: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Rows `rows` of a vocab-sharded [T, V_local] tensor with every rank's columns, on the CPU (a collective)."""
    part = x.detach()[rows.to(x.device)].contiguous()
    if world_size == 1:
        return part.cpu()
    part = part.to(torch.uint8) if part.dtype == torch.bool else part  # not every backend gathers bool
    parts = [torch.empty_like(part) for _ in range(world_size)]
    dist.all_gather(parts, part, group=group)
    return torch.cat([p.cpu() for p in parts], dim=-1).to(x.dtype)


def check(c: Case, inp: Inputs, closure: Closure, memo: dict, check_rows: int) -> dict:
    """check ("ok" or "fail: ...") and the largest |difference| from float64 of the log-prob and entropy."""
    if not (check_rows and closure.forward):
        return {}
    from tests.reference import reference_log_probs_and_entropy

    n = min(check_rows, c.T)
    rows = torch.cat([torch.arange((n + 1) // 2), torch.arange(c.T - n // 2, c.T)]) if n < c.T else torch.arange(c.T)
    if c.entropy not in memo:  # depends only on the inputs and the entropy mode
        keep = None if inp.keep_mask is None else _global_rows(inp.keep_mask, rows, inp.group, c.tp)
        memo[c.entropy] = reference_log_probs_and_entropy(
            _global_rows(inp.logits, rows, inp.group, c.tp), inp.tokens[rows.to(inp.tokens.device)].cpu(),
            entropy=c.entropy, keep_mask=keep,
            row_mask=None if inp.row_mask is None else inp.row_mask[rows.to(inp.row_mask.device)].cpu())
    ref = memo[c.entropy]
    out, problems = {"check": "ok"}, []
    for name, got, want in zip(("log_prob", "entropy"), closure.forward(), (ref.log_probs, ref.entropy)):
        if want is None:
            continue
        if got is None:
            problems.append(f"{name} missing")
            continue
        a = got.detach()[rows.to(got.device)].cpu().double()
        err = (a - want).abs()
        out[f"err_{name.replace('_', '')}"] = float(err.max())
        bad = ~(err <= CHECK_RTOL * want.abs().clamp(min=1.0))  # NaN counts as bad
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            problems.append(f"{name} row {int(rows[i])}: {a[i].item():.6g} vs reference {want[i].item():.6g}")
    if problems:
        out["check"] = "fail: " + "; ".join(problems)
    return out


# --- providers ---


def _grad(c: Case, inp: Inputs, log_prob, entropy, logits):
    """The logits' gradient for the case's upstream gradients (nothing accumulated into .grad)."""
    outputs, grads = [log_prob], [inp.grad_log_prob]
    if c.entropy == "grad":
        outputs, grads = outputs + [entropy], grads + [inp.grad_entropy]
    return torch.autograd.grad(outputs, logits, [g.view_as(o) for o, g in zip(outputs, grads)])[0]


def _fp32(x):
    return None if x is None else x.detach().float().reshape(-1)


def _closure(c: Case, inp: Inputs, call) -> Closure:
    """A closure over call(logits) -> (log_prob, entropy): step is forward + backward, forward its no-grad values."""
    def step(logits):
        return _grad(c, inp, *call(logits), logits)

    def forward():
        with torch.no_grad():
            lp, ent = call(inp.logits)
        return _fp32(lp), _fp32(ent)

    return Closure(prepare=lambda: inp.logits, step=step, forward=forward)


def build_ppo_ops(c: Case, inp: Inputs) -> Closure:
    """triton, torch, triton_sglang, triton_keep_sparse, triton_keep_dense."""
    import ppo_ops

    kwargs = dict(tp_group=inp.group, entropy=c.entropy, keep_mask=inp.keep_mask, row_mask=inp.row_mask,
                  backend="torch" if c.provider == "torch" else "triton", validate=c.validate,
                  inplace_grad=c.inplace_grad)
    if c.provider == "triton_sglang":
        kwargs["reduction_order"] = "sglang"
    if c.provider == "triton_temp":
        kwargs["temperature"] = TRANSFORM_TEMPERATURE
    if c.provider == "triton_temp_rows":
        kwargs["temperature"] = per_row_temperatures(c.T, inp.logits.device)
    if c.provider == "triton_softcap":
        kwargs["softcap"] = TRANSFORM_SOFTCAP
    keep = nucleus(inp.tokens, c.V, seed=17) if c.provider.startswith("triton_keep") else None

    def call(logits):
        extra = {}
        if c.provider == "triton_keep_sparse":
            extra = {"keep": keep}
        elif c.provider == "triton_keep_dense":  # built in the step, as a trainer without the sparse form does
            extra = {"keep_mask": dense_mask(keep, c.T, c.v_local, inp.rank * c.v_local)}
        out = ppo_ops.log_probs_and_entropy(logits, inp.tokens, **dict(kwargs, **extra))
        return out.log_probs, out.entropy

    closure = _closure(c, inp, call)
    if keep is not None or c.provider in ("triton_temp", "triton_temp_rows", "triton_softcap"):
        closure.forward = None
    if c.inplace_grad:  # the backward overwrites the logits with their gradient: a fresh copy each step (untimed)
        work = torch.empty_like(inp.logits).requires_grad_(True)

        def prepare():
            with torch.no_grad():
                work.copy_(inp.logits)
            return work

        closure.prepare = prepare
    return closure


def per_row_temperatures(n_rows: int, device: torch.device) -> torch.Tensor:
    """[n_rows] float32: TRANSFORM_TEMPERATURES in turn, one per TRANSFORM_SEQ_ROWS rows."""
    values = torch.tensor(TRANSFORM_TEMPERATURES, dtype=torch.float32)
    index = (torch.arange(n_rows) // TRANSFORM_SEQ_ROWS) % len(TRANSFORM_TEMPERATURES)
    return values[index].to(device)


def _unsupported_ppo_ops(c: Case, device: torch.device) -> Optional[str]:
    if c.provider != "torch" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)"
    if c.provider == "triton_sglang" and c.keep_mask:
        return "reduction_order='sglang' has no keep mask"
    if c.provider.startswith("triton_keep") and c.keep_mask:
        return "the keep-set rows bring their own nucleus (no random keep_mask)"
    problem = first_import_problem(("ppo_ops",) if c.provider == "torch" else ("triton", "ppo_ops"))
    return problem or (keep_missing() if c.provider == "triton_keep_sparse" else None)


@contextlib.contextmanager
def _dynamo_enabled():
    """TORCHDYNAMO_DISABLE=0 while torch.compile wraps a function: the test suite and some launch scripts set it to 1
    (megatron-core's jit_fuser compiles otherwise), and then torch.compile returns the function uncompiled. Torch
    reads it at torch.compile, so it is restored after."""
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


class _FloorOp(torch.autograd.Function):
    """The least an autograd op with the logits op's outputs and gradient can launch (one kernel each way): its host
    time is what torch's autograd (and, compiled, its graph machinery) costs before any op's own work."""

    @staticmethod
    def forward(ctx, logits):
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        pair = logits[:, :2].float()
        return pair[:, 0], pair[:, 1]

    @staticmethod
    def backward(ctx, grad_first, grad_second):
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad_first.device)
        grad[:, 0] = grad_first
        return grad


def build_small_call(c: Case, inp: Inputs) -> Closure:
    """The op as a user calls it (backend "auto") plainly, compiled or under reduce-overhead; floor_*: _FloorOp."""
    import ppo_ops
    from ppo_ops.logits import replay
    from torch._dynamo.utils import counters

    def call(logits):
        out = ppo_ops.log_probs_and_entropy(logits, inp.tokens, tp_group=inp.group, entropy=c.entropy,
                                            keep_mask=inp.keep_mask, row_mask=inp.row_mask, validate=c.validate)
        return out.log_probs, out.entropy

    mode = c.provider.removeprefix("floor_")
    if mode != c.provider:
        call = _FloorOp.apply
    if mode == "eager_own_path":
        mode, plain = "eager", call

        def call(logits):  # the replay of repeated calls off for this call only
            replay.ENABLED = False
            try:
                return plain(logits)
            finally:
                replay.ENABLED = True
    graphs = mode == "reduce_overhead"
    if graphs:
        # The logits are the bench's one fixed tensor: marked static, a replay does not copy them into the graph's
        # own input buffer (a trainer feeding logits from outside the compiled function pays that copy on top).
        torch._dynamo.mark_static_address(inp.logits)
    if mode != "eager":
        torch._dynamo.reset()  # a fresh compile per case: static shapes, as a trainer with a fixed T has them
        with _dynamo_enabled():
            call = torch.compile(call, mode="reduce-overhead") if graphs else torch.compile(call, fullgraph=True)

    def marked(logits):
        if graphs:  # a new CUDA graph trees iteration: the previous step's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        return call(logits)

    closure = _closure(c, inp, marked)
    if c.provider.startswith("floor_"):
        closure.forward = None  # the floor's values are not log-probs
    if mode != "eager":
        before = counters["stats"]["unique_graphs"]
        for _ in range(COMPILE_WARMUP_CALLS):
            closure.step(inp.logits)
        if counters["stats"]["unique_graphs"] == before:
            raise RuntimeError("torch.compile ran the function without compiling it (dynamo disabled?)")
    return closure


def _unsupported_small_call(c: Case, device: torch.device) -> Optional[str]:
    if c.inplace_grad:
        return "the small-call rows time the op's default call (inplace_grad off)"
    if c.provider.endswith("reduce_overhead") and device.type != "cuda":
        return "reduce-overhead's CUDA graphs need a GPU"
    return first_import_problem(("ppo_ops",))


def build_sglang(c: Case, inp: Inputs) -> Closure:
    from sglang.srt.batch_invariant_ops import log_softmax

    index = inp.tokens if inp.row_mask is None else torch.where(inp.row_mask, inp.tokens, 0)

    def log_prob_of(logits):
        with torch.no_grad():  # SGLang's kernel defines no gradient: the step is the forward alone
            lp = log_softmax(logits.float(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
            return lp if inp.row_mask is None else lp * inp.row_mask

    return Closure(prepare=lambda: inp.logits, step=log_prob_of, forward=lambda: (log_prob_of(inp.logits), None))


def _unsupported_sglang(c: Case, device: torch.device) -> Optional[str]:
    if c.tp > 1:
        return "SGLang's log_softmax is single-rank (its engine all-gathers the logits first)"
    if c.entropy != "none" or c.keep_mask:
        return "SGLang's scoring gives the log-prob only, over the full vocabulary"
    if device.type != "cuda":
        return "SGLang's batch-invariant kernels need a GPU"
    return first_import_problem(("sglang.srt.batch_invariant_ops",))


def build_legacy(c: Case, inp: Inputs) -> Closure:
    from ppo_ops.legacy import calculate_log_probs_and_entropy

    return _closure(c, inp, lambda logits: calculate_log_probs_and_entropy(
        logits, inp.tokens, inp.group, with_entropy=c.entropy != "none", chunk_size=-1,
        log_prob_keep_mask=inp.keep_mask, with_entropy_grad=c.entropy == "grad"))


def naive_log_probs_and_entropy(logits, tokens, entropy: str, keep_mask=None, row_mask=None):
    """What a trainer writes without a fused op: fp32 log_softmax, gather, softmax entropy; fp32 [T] outputs."""
    z = logits.float()
    index = (tokens if row_mask is None else torch.where(row_mask, tokens, 0)).unsqueeze(-1)
    log_p = torch.log_softmax(z, dim=-1)
    if keep_mask is None:
        log_prob = log_p.gather(-1, index).squeeze(-1)
    else:
        kept = keep_mask.scatter(-1, index, True)  # the target always belongs to the normaliser
        log_prob = torch.log_softmax(z.masked_fill(~kept, float("-inf")), dim=-1).gather(-1, index).squeeze(-1)
    ent = None
    if entropy != "none":
        with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
            ent = -(log_p.exp() * log_p).sum(-1)
    if row_mask is not None:
        log_prob, ent = log_prob * row_mask, None if ent is None else ent * row_mask
    return log_prob, ent


def build_naive(c: Case, inp: Inputs) -> Closure:
    return _closure(c, inp, lambda logits: naive_log_probs_and_entropy(logits, inp.tokens, c.entropy, inp.keep_mask,
                                                                       inp.row_mask))


def build_liger(c: Case, inp: Inputs) -> Closure:
    from liger_kernel.transformers.functional import liger_cross_entropy

    grad_loss = (-inp.grad_log_prob).to(inp.logits.dtype)  # its loss is -log_prob in the logits' dtype

    def loss(logits):
        return liger_cross_entropy(logits.clone(), inp.tokens, ignore_index=IGNORED_TOKEN, reduction="none")

    return Closure(prepare=lambda: inp.logits, step=lambda x: torch.autograd.grad([loss(x)], x, [grad_loss])[0],
                   forward=lambda: (-loss(inp.logits).detach().float(), None))


def _unsupported_liger(c: Case, device: torch.device) -> Optional[str]:
    if c.tp > 1:
        return "Liger-Kernel's cross entropy is single-rank"
    if c.entropy != "none" or c.keep_mask:
        return "Liger-Kernel's cross entropy gives the log-prob only, with no keep mask"
    if device.type != "cuda":
        return "Liger-Kernel needs a GPU"
    return first_import_problem(("liger_kernel.transformers.functional",))


def _single_rank(c: Case, device: torch.device) -> Optional[str]:
    return "naive torch is single-rank (no vocab-parallel merge)" if c.tp > 1 else None


def _unsupported_legacy(c: Case, device: torch.device) -> Optional[str]:
    return "the legacy API has no row mask" if c.row_frac < 1.0 else first_import_problem(("megatron.core",
                                                                                           "ppo_ops.legacy"))


PROVIDERS = registry(
    *(Provider(p, build_ppo_ops, _unsupported_ppo_ops, modules=("triton", "ppo_ops")) for p in PPO_OPS),
    *(Provider(p, build_small_call, _unsupported_small_call, modules=("ppo_ops",)) for p in SMALL_CALL),
    Provider("sglang", build_sglang, _unsupported_sglang, modules=("sglang.srt.batch_invariant_ops",), peer=True),
    Provider("legacy", build_legacy, _unsupported_legacy, modules=("megatron.core", "ppo_ops.legacy")),
    Provider("naive", build_naive, _single_rank),
    Provider("liger", build_liger, _unsupported_liger, modules=("liger_kernel.transformers.functional",), peer=True),
)
