"""The implementations the bench compares, each as a forward + backward closure over one input set.

One `build_*` function per provider turns (case, inputs) into a `Closure`:
  prepare()  untimed; returns the logits tensor the step runs on (a refilled copy when the step destroys its input)
  step(x)    timed; forward and backward (torch.autograd.grad with the case's upstream gradients), returns the
             logits' gradient so that it is alive at the peak of memory, as in a trainer
  forward()  no grad; (log_prob [T] fp32, entropy [T] fp32 or None), checked against a float64 reference

Providers:
  triton  ppo_ops.log_probs_and_entropy(backend="triton"), with the case's validate / inplace_grad
  torch   ppo_ops.log_probs_and_entropy(backend="torch")
  triton_sglang  the triton provider with reduction_order="sglang" (SGLang's log_softmax order, bit for bit)
  triton_keep_sparse / triton_keep_dense  the triton provider with a 64-id nucleus per row as the sparse keep set /
          as the dense keep_mask built from it in the step (keep_set.py; the keep_set suite; not checked here: the
          tests check the keep set against float64)
  sglang  SGLang's batch-invariant log_softmax (sglang.srt.batch_invariant_ops) of logits.float() + gather: what its
          deterministic / on-policy inference scores with (TP=1, log-prob only). FORWARD ONLY: its kernel has no
          backward, so its step is the forward (its bytes and GB/s columns still count a backward: read its ms)
  eager / compiled / reduce_overhead  the small_call suite: ppo_ops.log_probs_and_entropy as a user calls it (backend
          "auto": triton on a GPU) with the case's validate; plainly, in torch.compile(fn, fullgraph=True) of a
          function calling it, and in torch.compile(fn, mode="reduce-overhead") (CUDA graphs; a GPU only). Each
          compiled case compiles afresh and runs COMPILE_WARMUP_CALLS steps in its build (compilation, CUDA graph
          trees' warm-up run, recording, first replay) before the bench's own warm-up; dynamo is enabled for the
          compile whatever TORCHDYNAMO_DISABLE says, and a compile that ran eagerly fails the case. Under
          reduce-overhead the logits are marked static (no copy into the graph's input buffer per replay)
  eager_own_path  the eager call with the replay of repeated calls off (ppo_ops/logits/replay.py, ENABLED): every
          call takes the op's own path, as before the replay; beside `eager`, what the replay saves
  floor_eager / floor_compiled / floor_reduce_overhead  the same three modes of an autograd op that does next to
          nothing (one kernel each way, _FloorOp): the host time torch itself takes per call on this host, beside
          which the small-call rows read. Not checked (its gradient is not one)
  legacy  ppo_ops.legacy.calculate_log_probs_and_entropy (Megatron fused vocab-parallel CE + separate entropy)
  naive   log_softmax + gather + softmax entropy in fp32 (TP=1)
  qwen3_step  one RL step through a random Qwen3-0.6B with ppo_ops (tools/bench/whole_step.py; its own suites);
            qwen3_step_ckpt / _head / _loss: with checkpointing, the logits path / the fused head / linear_token_loss
  mcore_*  one RL step through a megatron-core GPTModel (tools/bench/megatron_step.py; the megatron_step suite)
  liger   Liger-Kernel's cross entropy, reduction="none" (TP=1, log-prob only, no keep mask). Its forward writes the
          gradient into its input, so the step clones the logits first; the clone is timed, as any caller pays it.
          Rows dropped by the row mask are passed as its ignore_index (-100), which it skips.

Each provider is a contract.Provider in PROVIDERS; its `unsupported(case, device)` gives the reason it cannot run a
case (missing package or option), or None; the bench records it as "skipped: <reason>" and prints it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

from tools.bench import keep_set, megatron_step, whole_step
from tools.bench.cases import SMALL_CALL_PROVIDERS, Case
from tools.bench.contract import Closure, Provider, first_import_problem, registry
from tools.bench.inputs import IGNORED_TOKEN, Inputs

# What each provider imports (in its build function, so that the bench starts without them).
TRITON_MODULES = ("triton", "ppo_ops")
TORCH_MODULES = ("ppo_ops",)
LEGACY_MODULES = ("megatron.core", "ppo_ops.legacy")
LIGER_MODULES = ("liger_kernel.transformers.functional",)
SGLANG_MODULES = ("sglang.srt.batch_invariant_ops",)


def _grad(outputs: list, grads: list, logits: torch.Tensor):
    """The logits' gradient for upstream `grads` (no accumulation into .grad, nothing retained)."""
    return torch.autograd.grad(outputs, logits, [g.view_as(o) for o, g in zip(outputs, grads)])[0]


def _outputs_and_grads(case: Case, inp: Inputs, log_prob, entropy):
    outputs, grads = [log_prob], [inp.grad_log_prob]
    if case.entropy == "grad":
        outputs.append(entropy)
        grads.append(inp.grad_entropy)
    return outputs, grads


def _fp32_1d(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.detach().float().reshape(-1)


# --- ppo_ops (triton and torch backends) ----------------------------------------------------------------------------


def _build_ppo_ops(backend: str, case: Case, inp: Inputs, **order) -> Closure:
    import ppo_ops

    kwargs = dict(
        **order,
        tp_group=inp.group,
        entropy=case.entropy,
        keep_mask=inp.keep_mask,
        row_mask=inp.row_mask,
        backend=backend,
        validate=case.validate,
        inplace_grad=case.inplace_grad,
    )

    def step(logits):
        out = ppo_ops.log_probs_and_entropy(logits, inp.tokens, **kwargs)
        return _grad(*_outputs_and_grads(case, inp, out.log_probs, out.entropy), logits)

    def forward():
        with torch.no_grad():
            out = ppo_ops.log_probs_and_entropy(inp.logits, inp.tokens, **kwargs)
        return _fp32_1d(out.log_probs), _fp32_1d(out.entropy)

    if case.inplace_grad:
        # The backward overwrites the logits with their gradient: each repetition runs on a fresh copy (untimed).
        work = torch.empty_like(inp.logits).requires_grad_(True)

        def prepare():
            with torch.no_grad():
                work.copy_(inp.logits)
            return work

    else:

        def prepare():
            return inp.logits

    return Closure(prepare=prepare, step=step, forward=forward)


def build_triton(case: Case, inp: Inputs) -> Closure:
    return _build_ppo_ops("triton", case, inp)


def build_torch(case: Case, inp: Inputs) -> Closure:
    return _build_ppo_ops("torch", case, inp)


def build_triton_sglang(case: Case, inp: Inputs) -> Closure:
    return _build_ppo_ops("triton", case, inp, reduction_order="sglang")


def build_triton_keep(case: Case, inp: Inputs) -> Closure:
    """triton_keep_sparse / triton_keep_dense: the triton provider with a 64-id nucleus per row (keep_set.py) as the
    sparse keep set, or as the dense keep_mask built from it inside the step (what a trainer without the sparse form
    builds per step, so its memory counts at the peak)."""
    import ppo_ops

    keep = keep_set.nucleus(inp.tokens, case.V, seed=17)
    v_local = inp.logits.shape[-1]
    vocab_start = inp.rank * v_local
    kwargs = dict(tp_group=inp.group, entropy=case.entropy, row_mask=inp.row_mask, backend="triton",
                  validate=case.validate)

    def keep_args():
        if case.provider == "triton_keep_sparse":
            return {"keep": keep}
        return {"keep_mask": keep_set.dense_mask(keep, case.T, v_local, vocab_start)}

    def step(logits):
        out = ppo_ops.log_probs_and_entropy(logits, inp.tokens, **kwargs, **keep_args())
        return _grad(*_outputs_and_grads(case, inp, out.log_probs, out.entropy), logits)

    return Closure(prepare=lambda: inp.logits, step=step)


def _unsupported_triton_keep(case: Case, device: torch.device) -> Optional[str]:
    if case.keep_mask:
        return "the keep-set rows bring their own nucleus (no random keep_mask)"
    problem = _unsupported_triton(case, device)
    if problem or case.provider == "triton_keep_dense":
        return problem
    return keep_set.missing()


def _unsupported_triton(case: Case, device: torch.device) -> Optional[str]:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)"
    return first_import_problem(TRITON_MODULES)


def _unsupported_torch(case: Case, device: torch.device) -> Optional[str]:
    return first_import_problem(TORCH_MODULES)


def _unsupported_triton_sglang(case: Case, device: torch.device) -> Optional[str]:
    if case.keep_mask:
        return "reduction_order='sglang' has no keep mask"
    return _unsupported_triton(case, device)


# --- small calls: eager, torch.compile, reduce-overhead -------------------------------------------------------------

# Steps each compiled case runs in its build, untimed: the first compiles (and under reduce-overhead is CUDA graph
# trees' eager warm-up run), the second records the graphs, the third is a first replay. The bench's own warm-up
# (--warmup) follows, so timing starts on replays whatever the flags.
COMPILE_WARMUP_CALLS = 3


@contextlib.contextmanager
def _dynamo_enabled():
    """TORCHDYNAMO_DISABLE=0 while torch.compile wraps a function. The test suite (tests/conftest.py,
    tools/pytest.bzl) and some launch scripts set it to 1 (megatron-core's jit_fuser compiles otherwise); with it,
    torch.compile returns the function uncompiled and these rows would time the eager call under another name. Torch
    reads the variable when torch.compile is called, not when the compiled function runs, so it is restored after:
    the legacy provider's jit_fuser and the record's torch_compile column keep what the run was started with."""
    before = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = before


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class _FloorOp(torch.autograd.Function):
    """The least work an autograd op with the logits op's outputs and gradient can launch: forward, one kernel writing
    two [T] fp32 outputs from two columns; backward, an uninitialised [T, V] gradient and one kernel writing its first
    column. Not a gradient (its row is not checked): its host time is what torch's autograd (and, compiled, its
    graph machinery) costs on this host before any op's own work."""

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


def build_small_call(case: Case, inp: Inputs) -> Closure:
    """eager / compiled / reduce_overhead: the logits op called as a user calls it; floor_*: _FloorOp in the same mode
    (see the module docstring)."""
    import ppo_ops
    from ppo_ops.logits import replay

    def call(logits):
        out = ppo_ops.log_probs_and_entropy(logits, inp.tokens, tp_group=inp.group, entropy=case.entropy,
                                            keep_mask=inp.keep_mask, row_mask=inp.row_mask, validate=case.validate)
        return out.log_probs, out.entropy

    mode = case.provider.removeprefix("floor_")
    if mode != case.provider:
        call = _FloorOp.apply
    if mode == "eager_own_path":
        mode, plain = "eager", call

        def call(logits):  # the replay off for this call only: the other rows keep it
            replay.ENABLED = False
            try:
                return plain(logits)
            finally:
                replay.ENABLED = True
    graphs = mode == "reduce_overhead"
    if graphs:
        # CUDA graph trees copy every input that is not static into the graph's own buffer at each replay. The logits
        # are the bench's one fixed tensor; marked static, the rows time the op, not a copy of T x V_local elements
        # that a trainer whose logits come from outside the compiled function would pay on top (and one whose LM
        # head is compiled with it would not). Unguarded: a new address re-records rather than recompiles.
        torch._dynamo.mark_static_address(inp.logits)
    if mode != "eager":
        torch._dynamo.reset()  # a fresh compile per case: static shapes, as a trainer with a fixed T has them
        with _dynamo_enabled():
            call = torch.compile(call, mode="reduce-overhead") if graphs else torch.compile(call, fullgraph=True)

    def step(logits):
        if graphs:
            # A new iteration of CUDA graph trees: the previous step's outputs (freed by the bench) may be overwritten.
            torch.compiler.cudagraph_mark_step_begin()
        log_prob, entropy = call(logits)
        return _grad(*_outputs_and_grads(case, inp, log_prob, entropy), logits)

    def forward():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            log_prob, entropy = call(inp.logits)
        # Copies: a CUDA graph's outputs are overwritten by its next replay.
        return _fp32_1d(log_prob).clone(), None if entropy is None else _fp32_1d(entropy).clone()

    if mode != "eager":
        before = _unique_graphs()
        for _ in range(COMPILE_WARMUP_CALLS):
            step(inp.logits)  # its gradient dropped at once, as the bench's repetitions drop theirs
        if _unique_graphs() == before:
            raise RuntimeError("torch.compile ran the function without compiling it (dynamo disabled?)")
    return Closure(prepare=lambda: inp.logits, step=step, forward=forward)


def _unsupported_small_call(case: Case, device: torch.device) -> Optional[str]:
    if case.inplace_grad:
        return "the small-call rows time the op's default call (inplace_grad off)"
    if case.provider.endswith("reduce_overhead") and device.type != "cuda":
        return "reduce-overhead's CUDA graphs need a GPU (on CPU it would time the compiled provider again)"
    return first_import_problem(TORCH_MODULES)


# --- SGLang's batch-invariant log_softmax ----------------------------------------------------------------------------


def build_sglang(case: Case, inp: Inputs) -> Closure:
    from sglang.srt.batch_invariant_ops import log_softmax

    index = inp.tokens if inp.row_mask is None else torch.where(inp.row_mask, inp.tokens, 0)

    def log_prob_of(logits):
        log_prob = log_softmax(logits.float(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
        return log_prob if inp.row_mask is None else log_prob * inp.row_mask

    def step(logits):  # the forward alone: SGLang's kernel defines no gradient
        with torch.no_grad():
            return log_prob_of(logits)

    def forward():
        with torch.no_grad():
            return log_prob_of(inp.logits), None

    return Closure(prepare=lambda: inp.logits, step=step, forward=forward)


def _unsupported_sglang(case: Case, device: torch.device) -> Optional[str]:
    if case.tp > 1:
        return "SGLang's log_softmax is single-rank (its engine all-gathers the logits first)"
    if case.entropy != "none" or case.keep_mask:
        return "SGLang's scoring gives the log-prob only, over the full vocabulary"
    if device.type != "cuda":
        return "SGLang's batch-invariant kernels need a GPU"
    return first_import_problem(SGLANG_MODULES)


# --- legacy reference ----------------------------------------------------------------------------------------------


def build_legacy(case: Case, inp: Inputs) -> Closure:
    from ppo_ops.legacy import calculate_log_probs_and_entropy

    def call(logits):
        return calculate_log_probs_and_entropy(
            logits,
            inp.tokens,
            inp.group,
            with_entropy=case.entropy != "none",
            chunk_size=-1,
            log_prob_keep_mask=inp.keep_mask,
            with_entropy_grad=case.entropy == "grad",
        )

    def step(logits):
        log_prob, entropy = call(logits)
        return _grad(*_outputs_and_grads(case, inp, log_prob, entropy), logits)

    def forward():
        with torch.no_grad():
            log_prob, entropy = call(inp.logits)
        return _fp32_1d(log_prob), _fp32_1d(entropy)

    return Closure(prepare=lambda: inp.logits, step=step, forward=forward)


def _unsupported_legacy(case: Case, device: torch.device) -> Optional[str]:
    if case.row_frac < 1.0:
        return "the legacy API has no row mask"
    return first_import_problem(LEGACY_MODULES)


# --- naive torch ---------------------------------------------------------------------------------------------------


def naive_log_probs_and_entropy(
    logits: torch.Tensor,  # [T, V] float, the whole vocabulary (TP=1); READ-ONLY
    tokens: torch.Tensor,  # [T] int64; rows dropped by row_mask may hold any id
    entropy: str,  # "none" | "value" | "grad"
    keep_mask: Optional[torch.Tensor] = None,  # [T, V] bool
    row_mask: Optional[torch.Tensor] = None,  # [T] bool
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """What a trainer writes without a fused op: fp32 log_softmax, gather, softmax entropy. Returns fp32 [T] tensors."""
    z = logits.float()
    index = tokens if row_mask is None else torch.where(row_mask, tokens, torch.zeros_like(tokens))
    index = index.unsqueeze(-1)
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
        log_prob = log_prob * row_mask
        ent = None if ent is None else ent * row_mask
    return log_prob, ent


def build_naive(case: Case, inp: Inputs) -> Closure:
    def step(logits):
        log_prob, entropy = naive_log_probs_and_entropy(logits, inp.tokens, case.entropy, inp.keep_mask, inp.row_mask)
        return _grad(*_outputs_and_grads(case, inp, log_prob, entropy), logits)

    def forward():
        with torch.no_grad():
            log_prob, entropy = naive_log_probs_and_entropy(
                inp.logits, inp.tokens, case.entropy, inp.keep_mask, inp.row_mask
            )
        return _fp32_1d(log_prob), _fp32_1d(entropy)

    return Closure(prepare=lambda: inp.logits, step=step, forward=forward)


def _unsupported_naive(case: Case, device: torch.device) -> Optional[str]:
    return "naive torch is single-rank (no vocab-parallel merge)" if case.tp > 1 else None


# --- Liger-Kernel --------------------------------------------------------------------------------------------------


def build_liger(case: Case, inp: Inputs) -> Closure:
    from liger_kernel.transformers.functional import liger_cross_entropy

    # Its loss is -log_prob in the logits' dtype; rows dropped by the row mask already hold its ignore_index.
    grad_loss = (-inp.grad_log_prob).to(inp.logits.dtype)

    def loss(logits):
        return liger_cross_entropy(logits.clone(), inp.tokens, ignore_index=IGNORED_TOKEN, reduction="none")

    def step(logits):
        return torch.autograd.grad([loss(logits)], logits, [grad_loss])[0]

    def forward():
        with torch.no_grad():
            return -loss(inp.logits).float(), None

    return Closure(prepare=lambda: inp.logits, step=step, forward=forward)


def _unsupported_liger(case: Case, device: torch.device) -> Optional[str]:
    if case.tp > 1:
        return "Liger-Kernel's cross entropy is single-rank"
    if case.entropy != "none":
        return "Liger-Kernel's cross entropy gives the log-prob only (no entropy)"
    if case.keep_mask:
        return "Liger-Kernel's cross entropy has no keep mask"
    if device.type != "cuda":
        return "Liger-Kernel needs a GPU"
    return first_import_problem(LIGER_MODULES)


PROVIDERS = registry(
    Provider("triton", build_triton, _unsupported_triton, modules=TRITON_MODULES),
    Provider("torch", build_torch, _unsupported_torch, modules=TORCH_MODULES),
    Provider("triton_sglang", build_triton_sglang, _unsupported_triton_sglang, modules=TRITON_MODULES),
    *(Provider(name, build_triton_keep, _unsupported_triton_keep, checked=False, modules=TRITON_MODULES)
      for name in ("triton_keep_sparse", "triton_keep_dense")),
    *(Provider(name, build_small_call, _unsupported_small_call, checked=not name.startswith("floor_"),
               modules=TORCH_MODULES)
      for name in SMALL_CALL_PROVIDERS),
    Provider("sglang", build_sglang, _unsupported_sglang, modules=SGLANG_MODULES),
    Provider("legacy", build_legacy, _unsupported_legacy, modules=LEGACY_MODULES),
    Provider("naive", build_naive, _unsupported_naive),
    Provider("liger", build_liger, _unsupported_liger, modules=LIGER_MODULES),
    *whole_step.PROVIDERS,
    *megatron_step.PROVIDERS,
)
