"""What the bench measures: one `Case` per (provider, shape, options), named suites in priority order.

A case is a forward + backward of one provider on one input set. Suites list cases most important first, so a run that
stops on its time budget (bench --time_budget_s) has measured the headline before anything else:

  headline  T=8192, V=151936 (Qwen3), bf16, TP=1: log-prob + entropy with grad for every provider, log-prob only
            against Liger-Kernel, the triton provider with inplace_grad (memory) and validate=False (host-sync cost).
  tp_ref    TP=1 on logits of the local size a TP=2 rank holds (V=75968), the reference for the TP=2 target.
  sweep     T in {4096, 8192, 16384} x {bf16, fp32} x {log-prob only, + entropy grad}: the time/memory-vs-T plot.
  options   T=8192 bf16: entropy value, keep mask, 10% row mask, each against every provider that supports it.
  grid      the rest of the cross product for the ppo_ops providers (cheap for triton).
  tp2       the TP=2 cases (run with --tp=2): headline shape and sweep, options for ppo_ops and legacy.
  sglang_order  reduction_order="sglang" beside the fused op, SGLang's own log_softmax and naive torch, TP = 1 and 2
            (--suite=sglang_order --providers=triton,triton_sglang,sglang,naive; SGLang importable for its row).
  smoke     a tiny CPU shape covering every provider and option (few for triton), for tests/test_bench_smoke.py.
  small_call  the host cost of a small call: the logits op at T = 1024 and 8192, V = 151936, bf16, entropy with
            gradient, validate=False, called plainly (eager: repeated calls replay, ppo_ops/logits/replay.py;
            eager_own_path: the same with the replay off), through torch.compile(fullgraph=True) (compiled) and
            torch.compile(mode="reduce-overhead") (reduce_overhead: CUDA graphs), each row with its host time per
            call beside its device time; floor_eager / floor_compiled / floor_reduce_overhead: the same three modes
            of an op doing one kernel each way, the host time torch itself takes there (--suite=small_call with
            these seven as --providers).
            small_call_smoke: the same on the smoke shape, for the CPU tests (no CUDA graphs there: the
            reduce-overhead rows are skipped with their reason).
  whole_step  one RL step through a random Qwen3-0.6B (T=8192, bf16, forward + backward through the model, ppo_ops
            for log-prob + entropy), validate on and off: what the host sync costs in a whole step
            (--suite=whole_step --providers=qwen3_step). whole_step_smoke: the same on a tiny model, on CPU.
  lm_head_step  the whole step at T = 8192 and 32768 with the logits path, the fused head and linear_token_loss
            (--suite=lm_head_step --providers=qwen3_step_ckpt,qwen3_step_head,qwen3_step_loss); its _smoke on CPU.
  megatron_step  one RL step through a megatron-core GPTModel (Qwen3-0.6B's shape) at T = 8192 and 32768: the body
            alone, Megatron's output layer + the logits op, the output processor with the fused head and with the
            token loss, and a 64-id nucleus as dense mask or sparse keep set (--suite=megatron_step
            --providers=mcore_body,...; CUDA, megatron-core >= 0.18). megatron_step_flash: the same ways (providers
            mcore_*_flash) on a body whose core attention is torch's SDPA (flash on an H200), which forms no [S, S]
            scores: the local spec's unfused attention runs out of memory at T = 32768 on one H200 and its [S, S]
            tensors set the body's peak at T = 8192, above anything the head holds.

The LM head's suites (`HeadCase`: hidden states [T, H] and a weight shard [V_local, H] in, see lm_head.py):
  lm_head       T in (8192, 32768), H = 4096, V = 151936, bf16: ppo_ops' fused paths, the unfused path, the GEMMs
            they are measured against and other projects' kernels; at TP = 1 also the gemms, unfused and fused
            providers on a TP = 2 rank's local shape (V = 75968), the reference of the TP = 2 target.
  lm_head_own   the same without the other projects' kernels; its local-shape rows are gemms, fused, token_loss.
  lm_head_smoke  every LM-head provider on a tiny shape, for the CPU tests.
  lm_head_small  Qwen3-0.6B's head (H = 1024, tied), T in (8192, 32768), TP = 1: the GEMMs, the logits path
            (unfused), the fused head with and without a following backward, and the token loss (also with
            working_memory=0, token_loss_lean): the head's own cost at the shape of the megatron_step suites, where a
            small H leaves the GEMMs light against the passes over T x V.
  lm_head_keep  fused and token_loss with and without a 64-id sparse keep set per row (T = 8192); keep_set, in the
            logits family: the triton provider without one, with it, and with the dense mask built from it
            (--suite=keep_set --providers=triton,triton_keep_sparse,triton_keep_dense).

A suite belongs to one family (its case type); one run measures the suites of one family. Every suite lists its
cases for the TP sizes it runs at; a run keeps those of its --tp. Duplicates across suites are dropped (first
occurrence wins), so `--suite=headline,sweep` never measures a case twice.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterable, Optional, Sequence

QWEN3_VOCAB = 151936  # Qwen3's vocabulary (2^7 x 1187: splits into the 8 fixed segments): every headline case's V
TOKENS = (4096, 8192, 16384)
HEADLINE_TOKENS = 8192
DTYPES = ("bf16", "fp32")
ENTROPY_MODES = ("none", "value", "grad")
ROW_FRACTION = 0.1  # the row-mask cases keep 10% of the rows

# Providers whose options include validate / inplace_grad (the ppo_ops API); others have no such switch.
PPO_OPS_PROVIDERS = ("triton", "torch", "triton_sglang", "triton_keep_sparse", "triton_keep_dense")  # keep_set.py
ALL_PROVIDERS = ("triton", "torch", "legacy", "naive", "liger", "triton_sglang", "sglang")
KEEP_SET_PROVIDERS = ("triton_keep_sparse", "triton_keep_dense")  # the keep_set suite (pass --providers)
# SGLang's log_softmax order beside ppo_ops' own and SGLang's kernel (the sglang_order suite; pass --providers)
SGLANG_ORDER_PROVIDERS = ("triton", "triton_sglang", "sglang", "naive")
# The logits op as a user calls it (backend "auto"): plain, torch.compile(fullgraph=True), mode="reduce-overhead".
SMALL_CALL_PROVIDERS = ("eager", "eager_own_path", "compiled", "reduce_overhead",  # the logits op, then the floor
                        "floor_eager", "floor_compiled", "floor_reduce_overhead")  # under any op:
SMALL_CALL_TOKENS = (1024, 8192)  # a small call, where the host's cost shows, and the headline T
# A whole training step through a model that calls ppo_ops (tools/bench/whole_step.py): only in its own suites.
WHOLE_STEP_PROVIDERS = ("qwen3_step", "qwen3_step_ckpt", "qwen3_step_head", "qwen3_step_loss")
HEAD_STEP_PROVIDERS = WHOLE_STEP_PROVIDERS[1:]  # with checkpointing; the logits path, the fused head, the loss
# A whole step through a megatron-core GPTModel (tools/bench/megatron_step.py): only in the megatron_step suite.
MCORE_STEP_PROVIDERS = ("mcore_body", "mcore_logits", "mcore_head", "mcore_loss", "mcore_logits_dense_keep",
                        "mcore_logits_sparse_keep", "mcore_head_keep", "mcore_loss_keep", "mcore_loss_lean",
                        "mcore_loss_spare", "mcore_head_spare")
# The same ways on a body whose core attention is torch's SDPA (flash): no [S, S] tensor (the megatron_step_flash suite)
MCORE_FLASH_PROVIDERS = tuple(f"{p}_flash" for p in MCORE_STEP_PROVIDERS)


# The LM head's shape and providers (lm_head.py says what each one runs).
LM_HEAD_HIDDEN = 4096
LM_HEAD_SMALL_HIDDEN = 1024  # Qwen3-0.6B's hidden size (the megatron_step suites' model)
LM_HEAD_SMALL = ("gemms", "unfused", "fused", "fused_nograd", "token_loss", "token_loss_lean")  # lm_head_small
LM_HEAD_TOKENS = (8192, 32768)
LM_HEAD_TP = (1, 2, 4, 8)  # the TP sizes whose ranks split V = 151936 into the 8 equal segments
LM_HEAD_PROVIDERS = ("gemms", "gemm1", "unfused", "fused", "fused_novalidate", "fused_nograd",
                     "token_loss", "token_loss_novalidate", "token_loss_lean", "liger", "liger_flsce",
                     "liger_flsce_nograd", "cce", "cce_exact", "verl")
LM_HEAD_KEEP_PROVIDERS = ("fused_keep", "token_loss_keep")  # fused / token_loss with a sparse keep set (keep_set.py)
LM_HEAD_KEEP = ("fused", "fused_keep", "token_loss", "token_loss_keep")  # the lm_head_keep suite: keep set vs none
LM_HEAD_PEERS = ("liger", "liger_flsce", "liger_flsce_nograd", "cce", "cce_exact", "verl")  # other projects' kernels
LM_HEAD_OWN = tuple(p for p in LM_HEAD_PROVIDERS if p != "unfused" and p not in LM_HEAD_PEERS)  # ppo_ops + GEMMs
LM_HEAD_LOCAL_SHAPE = ("gemms", "unfused", "fused", "fused_novalidate")  # lm_head's rows on a TP = 2 rank's shape
LM_HEAD_OWN_LOCAL_SHAPE = ("gemms", "fused", "token_loss")  # lm_head_own's


@dataclasses.dataclass(frozen=True)
class Case:
    provider: str
    T: int  # tokens (rows)
    V: int  # global vocabulary; each of the `tp` ranks holds V // tp columns
    dtype: str  # "bf16" | "fp32": the logits' dtype
    entropy: str = "grad"  # "none" (log-prob only) | "value" (entropy, no gradient) | "grad"
    keep_mask: bool = False  # top-p/top-k style keep mask (renormalises the log-prob)
    row_frac: float = 1.0  # fraction of rows kept by the row mask; 1.0 = no row mask
    tp: int = 1
    validate: Optional[bool] = None  # ppo_ops providers only (None elsewhere: no such switch)
    inplace_grad: Optional[bool] = None  # ppo_ops providers only

    def __post_init__(self):
        if self.provider in (PPO_OPS_PROVIDERS + SMALL_CALL_PROVIDERS + WHOLE_STEP_PROVIDERS + MCORE_STEP_PROVIDERS
                             + MCORE_FLASH_PROVIDERS):
            # ppo_ops defaults, spelled out so equal cases compare equal.
            if self.validate is None:
                object.__setattr__(self, "validate", True)
            if self.inplace_grad is None:
                object.__setattr__(self, "inplace_grad", False)

    @property
    def v_local(self) -> int:
        return self.V // self.tp

    @property
    def kept_rows(self) -> int:
        """Rows the row mask keeps: round(row_frac * T), at least one."""
        return self.T if self.row_frac >= 1.0 else max(1, round(self.row_frac * self.T))

    def input_key(self) -> tuple:
        """Cases with equal keys share one input set (the bench keeps the last one alive)."""
        return (self.T, self.V, self.dtype, self.tp, self.keep_mask, self.row_frac)


@dataclasses.dataclass(frozen=True)
class HeadCase:
    """A forward + backward of one LM-head provider on bf16 hidden states [T, H] and the weight shard [V_local, H]."""

    provider: str
    T: int  # tokens (rows)
    H: int  # hidden size
    V: int  # global vocabulary; each of the `tp` ranks holds V // tp rows of the weight
    tp: int = 1

    @property
    def v_local(self) -> int:
        return self.V // self.tp

    def input_key(self) -> tuple:
        return (self.T, self.H, self.V, self.tp)


def _variants(provider: str, *, validate_off: bool = False, inplace: bool = False) -> list[dict]:
    out = [dict(provider=provider)]
    if provider == "triton" and inplace:
        out.append(dict(provider=provider, inplace_grad=True))
    if provider == "triton" and validate_off:
        out.append(dict(provider=provider, validate=False))
    return out


def _cases(providers: Sequence[str], extra_variants: bool = True, **shape) -> list[Case]:
    cases = []
    for p in providers:
        for v in _variants(p, validate_off=extra_variants, inplace=extra_variants):
            cases.append(Case(**v, **shape))
    return cases


def _headline() -> list[Case]:
    s = dict(T=HEADLINE_TOKENS, V=QWEN3_VOCAB, dtype="bf16")
    return (
        _cases(("triton", "torch", "legacy", "naive"), entropy="grad", **s)
        + _cases(("triton", "liger", "torch", "legacy", "naive"), entropy="none", **s)
    )


def _tp_ref() -> list[Case]:
    s = dict(T=HEADLINE_TOKENS, V=QWEN3_VOCAB // 2, dtype="bf16")
    return (
        _cases(("triton", "torch"), extra_variants=False, entropy="grad", **s)
        + [Case("triton", validate=False, entropy="grad", **s)]  # the TP=2 target's reference without host syncs
        + _cases(("triton",), extra_variants=False, entropy="none", **s)
    )


def _sweep() -> list[Case]:
    cases = []
    for dtype, T in itertools.product(DTYPES, TOKENS):
        s = dict(T=T, V=QWEN3_VOCAB, dtype=dtype)
        cases += _cases(("triton", "torch", "legacy", "naive"), entropy="grad", **s)
        cases += _cases(("triton", "liger", "torch", "legacy", "naive"), entropy="none", **s)
    return cases


def _options() -> list[Case]:
    s = dict(T=HEADLINE_TOKENS, V=QWEN3_VOCAB, dtype="bf16")
    cases = _cases(ALL_PROVIDERS, entropy="value", **s)
    for mask in (dict(keep_mask=True), dict(row_frac=ROW_FRACTION)):  # outer loop: one input set per mask
        for entropy in ("none", "grad"):
            cases += _cases(ALL_PROVIDERS, entropy=entropy, **mask, **s)
    return cases


def _grid(providers: Sequence[str] = PPO_OPS_PROVIDERS, tp: int = 1) -> list[Case]:
    cases = []
    for T, dtype, keep, row, entropy in itertools.product(  # entropy innermost: consecutive cases share inputs
        TOKENS, DTYPES, (False, True), (1.0, ROW_FRACTION), ENTROPY_MODES
    ):
        cases += _cases(
            providers, extra_variants=False, T=T, V=QWEN3_VOCAB, dtype=dtype, entropy=entropy,
            keep_mask=keep, row_frac=row, tp=tp,
        )
    return cases


def _tp2() -> list[Case]:
    tp_providers = ("triton", "torch", "legacy")
    cases = []
    for T in (HEADLINE_TOKENS, 4096, 16384):
        s = dict(T=T, V=QWEN3_VOCAB, dtype="bf16", tp=2)
        cases += _cases(tp_providers, entropy="grad", **s) + _cases(tp_providers, entropy="none", **s)
    s = dict(T=HEADLINE_TOKENS, V=QWEN3_VOCAB, dtype="bf16", tp=2)
    cases += _cases(tp_providers, extra_variants=False, entropy="value", **s)
    cases += _cases(tp_providers, extra_variants=False, entropy="grad", keep_mask=True, **s)
    cases += _cases(tp_providers, extra_variants=False, entropy="grad", row_frac=ROW_FRACTION, **s)
    cases += _grid(("triton",), tp=2)
    return cases


def _sglang_order() -> list[Case]:
    cases = []
    for tp, entropy in itertools.product((1, 2), ("none", "grad")):
        s = dict(T=HEADLINE_TOKENS, V=QWEN3_VOCAB, dtype="bf16", entropy=entropy, tp=tp)
        cases += [Case(p, **s) for p in SGLANG_ORDER_PROVIDERS]
        cases += [Case(p, validate=False, **s) for p in ("triton", "triton_sglang")]
    return cases


def _smoke() -> list[Case]:
    # Tiny: 8 rows (so a 10% row mask keeps one row), 256 columns (a power of two for the Triton interpreter).
    s = dict(T=8, V=256)
    torch_based = ("torch", "legacy", "naive", "liger")
    cases = []
    for keep, row, entropy in itertools.product((False, True), (1.0, ROW_FRACTION), ENTROPY_MODES):
        cases += [Case(p, dtype="bf16", entropy=entropy, keep_mask=keep, row_frac=row, **s) for p in torch_based]
    for entropy in ("none", "grad"):
        cases += [Case(p, dtype="fp32", entropy=entropy, **s) for p in torch_based]
    cases += [Case("torch", dtype="bf16", inplace_grad=True, **s), Case("torch", dtype="bf16", validate=False, **s)]
    # Triton under the interpreter takes about half a second a step: the headline options, both masks, inplace.
    cases += [
        Case("triton", dtype="bf16", entropy="grad", **s),
        Case("triton", dtype="fp32", entropy="none", keep_mask=True, row_frac=ROW_FRACTION, **s),
        Case("triton", dtype="bf16", entropy="grad", inplace_grad=True, **s),
        Case("triton_keep_sparse", dtype="bf16", entropy="grad", **s),
        Case("triton_keep_dense", dtype="bf16", entropy="grad", **s),
    ]
    return cases


def _small_call() -> list[Case]:
    """The logits op called plainly, compiled and under reduce-overhead: host and device time per call."""
    return [Case(p, T=T, V=QWEN3_VOCAB, dtype="bf16", entropy="grad", validate=False)
            for T in SMALL_CALL_TOKENS for p in SMALL_CALL_PROVIDERS]


def _small_call_smoke() -> list[Case]:
    return [Case(p, T=8, V=256, dtype="bf16", entropy="grad", validate=False) for p in SMALL_CALL_PROVIDERS]


def _whole_step() -> list[Case]:
    s = dict(T=HEADLINE_TOKENS, V=QWEN3_VOCAB, dtype="bf16", entropy="grad")
    return [Case("qwen3_step", validate=True, **s), Case("qwen3_step", validate=False, **s)]


def _lm_head_step() -> list[Case]:
    """The whole step with the logits path, the fused head and linear_token_loss (tools/bench/whole_step.py)."""
    return [Case(p, T=T, V=QWEN3_VOCAB, dtype="bf16", entropy="grad")
            for T in (HEADLINE_TOKENS, 32768) for p in HEAD_STEP_PROVIDERS]


def _megatron_step() -> list[Case]:
    """One RL step through a megatron-core GPTModel of Qwen3-0.6B's shape, each way to the loss and with a 64-id
    nucleus as a dense mask or a sparse keep set (tools/bench/megatron_step.py)."""
    return [Case(p, T=T, V=QWEN3_VOCAB, dtype="bf16", entropy="grad")
            for T in (HEADLINE_TOKENS, 32768) for p in MCORE_STEP_PROVIDERS]


def _megatron_step_flash() -> list[Case]:
    """The megatron_step cases on the SDPA-attention body (tools/bench/megatron_step.py)."""
    return [Case(p, T=T, V=QWEN3_VOCAB, dtype="bf16", entropy="grad")
            for T in (HEADLINE_TOKENS, 32768) for p in MCORE_FLASH_PROVIDERS]


def _lm_head_step_smoke() -> list[Case]:
    return [Case(p, T=8, V=256, dtype="fp32", entropy="grad") for p in HEAD_STEP_PROVIDERS]


def _whole_step_smoke() -> list[Case]:
    s = dict(T=8, V=256, dtype="fp32", entropy="grad")  # a tiny model of the same architecture
    return [Case("qwen3_step", validate=True, **s), Case("qwen3_step", validate=False, **s)]


def _lm_head_suite(providers: Sequence[str], local_shape: Sequence[str]) -> list[HeadCase]:
    cases = []
    for tp in LM_HEAD_TP:
        cases += [HeadCase(p, T, LM_HEAD_HIDDEN, QWEN3_VOCAB, tp) for T in LM_HEAD_TOKENS for p in providers]
    # The local shape of a TP = 2 rank, at TP = 1: the reference of the TP = 2 target.
    return cases + [HeadCase(p, T, LM_HEAD_HIDDEN, QWEN3_VOCAB // 2) for T in LM_HEAD_TOKENS for p in local_shape]


def _lm_head() -> list[HeadCase]:
    return _lm_head_suite(LM_HEAD_PROVIDERS, LM_HEAD_LOCAL_SHAPE)


def _lm_head_own() -> list[HeadCase]:
    return _lm_head_suite(LM_HEAD_OWN, LM_HEAD_OWN_LOCAL_SHAPE)


def _lm_head_small() -> list[HeadCase]:
    return [HeadCase(p, T, LM_HEAD_SMALL_HIDDEN, QWEN3_VOCAB) for T in LM_HEAD_TOKENS for p in LM_HEAD_SMALL]


def _lm_head_keep() -> list[HeadCase]:
    """The fused head and the token loss with and without a 64-id sparse keep set per row, T = 8192."""
    return [HeadCase(p, HEADLINE_TOKENS, LM_HEAD_HIDDEN, QWEN3_VOCAB) for p in LM_HEAD_KEEP]


def _keep_set() -> list[Case]:
    """The logits op without a keep set, with a 64-id sparse keep set per row and with the dense mask built from it
    (T = 8192, bf16, entropy with gradient)."""
    return [Case(p, T=HEADLINE_TOKENS, V=QWEN3_VOCAB, dtype="bf16", entropy="grad", validate=v)
            for v in (True, False) for p in ("triton",) + KEEP_SET_PROVIDERS]


def _lm_head_smoke() -> list[HeadCase]:
    return [HeadCase(p, 16, 64, 256, tp) for tp in (1, 2) for p in LM_HEAD_PROVIDERS + LM_HEAD_KEEP_PROVIDERS]


@dataclasses.dataclass(frozen=True)
class Suite:
    family: str  # which family measures its cases (tools/bench/runner.py FAMILIES)
    cases: Callable[[], list]


SUITES = {
    "headline": Suite("logits", _headline),
    "tp_ref": Suite("logits", _tp_ref),
    "sweep": Suite("logits", _sweep),
    "options": Suite("logits", _options),
    "grid": Suite("logits", _grid),
    "tp2": Suite("logits", _tp2),
    "sglang_order": Suite("logits", _sglang_order),
    "smoke": Suite("logits", _smoke),
    "small_call": Suite("logits", _small_call),
    "small_call_smoke": Suite("logits", _small_call_smoke),
    "whole_step": Suite("logits", _whole_step),
    "whole_step_smoke": Suite("logits", _whole_step_smoke),
    "lm_head_step": Suite("logits", _lm_head_step),
    "lm_head_step_smoke": Suite("logits", _lm_head_step_smoke),
    "megatron_step": Suite("logits", _megatron_step),
    "megatron_step_flash": Suite("logits", _megatron_step_flash),
    "lm_head": Suite("lm_head", _lm_head),
    "lm_head_own": Suite("lm_head", _lm_head_own),
    "lm_head_smoke": Suite("lm_head", _lm_head_smoke),
    "lm_head_keep": Suite("lm_head", _lm_head_keep),
    "lm_head_small": Suite("lm_head", _lm_head_small),
    "keep_set": Suite("logits", _keep_set),
}


def suite_family(names: Iterable[str]) -> str:
    """The one family of the named suites."""
    families = []
    for name in names:
        if name not in SUITES:
            raise ValueError(f"unknown suite {name!r}; expected one of {sorted(SUITES)}")
        families.append(SUITES[name].family)
    if len(set(families)) != 1:
        raise ValueError(f"suites {list(names)} mix the {' and '.join(sorted(set(families)))} families: run each alone")
    return families[0]


def suite_cases(names: Iterable[str], tp: Optional[int] = None) -> list:
    """Cases of the named suites (of one family) in order, only those of `tp` when given, duplicates dropped
    (first occurrence wins)."""
    names = list(names)
    suite_family(names)
    seen, out = set(), []
    for name in names:
        for case in SUITES[name].cases():
            if case not in seen and (tp is None or case.tp == tp):
                seen.add(case)
                out.append(case)
    return out


@dataclasses.dataclass(frozen=True)
class CustomGrid:
    """The axes of a custom run (--suite=custom, one list flag each): every combination is a case at TP = `tp`."""

    providers: Sequence[str]
    tokens: Sequence[int]
    vocab: Sequence[int]
    dtypes: Sequence[str]
    entropy: Sequence[str]
    keep_mask: Sequence[bool]
    row_frac: Sequence[float]
    validate: Sequence[bool]  # varies only for the ppo_ops providers
    inplace_grad: Sequence[bool]  # likewise
    tp: int


def cross_product(grid: CustomGrid) -> list[Case]:
    """The cases of a custom run (--suite=custom). validate / inplace_grad vary only for the ppo_ops providers (the
    small-call ones and the Megatron step's head ways included)."""
    out, seen = [], set()
    axes = itertools.product(grid.providers, grid.tokens, grid.vocab, grid.dtypes, grid.entropy, grid.keep_mask,
                             grid.row_frac)
    for p, T, V, dt, ent, keep, row in axes:
        # The Megatron step's ways but the body call ppo_ops with its validate (what the host read costs in a step).
        megatron_head = p in MCORE_STEP_PROVIDERS + MCORE_FLASH_PROVIDERS and not p.startswith("mcore_body")
        ppo_ops_call = p in PPO_OPS_PROVIDERS + SMALL_CALL_PROVIDERS or megatron_head
        extra = itertools.product(grid.validate, grid.inplace_grad) if ppo_ops_call else [(None, None)]
        for val, inp in extra:
            case = Case(p, T=T, V=V, dtype=dt, entropy=ent, keep_mask=keep, row_frac=row, tp=grid.tp, validate=val,
                        inplace_grad=inp)
            if case not in seen:
                seen.add(case)
                out.append(case)
    return out
