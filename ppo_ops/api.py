"""The public functions of ppo_ops, both ops: thin wrappers over the call shell (ppo_ops/core/shell.py) and each op's
autograd Function.

The logits op, from [..., V_local] logits: `log_probs_and_entropy` (the full API) and `calculate_log_probs_and_entropy`
(a drop-in for slime's function of that name) -> logits/function.py. The fused LM head, from hidden states and a
vocab-parallel weight, never holding [T, V] logits: `linear_log_probs_and_entropy` -> lm_head/function.py, and
`linear_token_loss` (a per-token RL loss whose gradient is formed in the forward) -> lm_head/loss_function.py.
Each wrapper prepares the call (local checks before any collective, the TP layout, the backend, the leading dimensions
flattened), applies the Function and restores the leading dimensions. While torch.compile traces a wrapper, it calls
the op's custom operator instead (ppo_ops/compiled/).
"""

from __future__ import annotations

import numbers
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from ppo_ops.compiled import common as compiled_common
from ppo_ops.compiled import linear_op, logits_op, token_loss_op
from ppo_ops.core import agreement, checks, shell
from ppo_ops.lm_head.function import LinearLogProbEntropyFunction
from ppo_ops.lm_head.loss_function import LinearTokenLossFunction
from ppo_ops.logits import replay
from ppo_ops.logits.function import LogProbEntropyFunction


class LogProbsEntropy(NamedTuple):
    log_probs: torch.Tensor  # logits.shape[:-1], float32
    entropy: Optional[torch.Tensor]  # logits.shape[:-1], float32, or None when entropy="none"


def log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    tp_group=None,
    entropy: str = "none",
    keep_mask: Optional[torch.Tensor] = None,
    keep: Optional[tuple] = None,
    temperature: float = 1.0,
    row_mask: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    inplace_grad: bool = False,
    backend: str = "auto",
    validate: bool = True,
    reduction_order: str = "fused",
    softcap: Optional[float] = None,
) -> LogProbsEntropy:
    """Log-probability of each target token and entropy of each row, over a vocabulary split across TP ranks.

    Equivalent to `log_softmax(logits.float() / T, -1).gather(-1, tokens[..., None])` and `-(p * log p).sum(-1)`
    over the global vocabulary that the ranks' shards make up, without fp32 [T, V] temporaries, forward and
    backward. Every argument and guarantee in full: docs/api.md.

    Args:
      logits: [..., V_local] float32/bfloat16/float16, this rank's contiguous slice of the global vocabulary
        ([rank * V_local, (rank + 1) * V_local)); math in fp32, the gradient in the logits' dtype.
      tokens: logits.shape[:-1] integer global token ids.
      tp_group: the TP process group, explicit: None is one rank, always (torch.distributed.group.WORLD: TP over the
        default group). Every rank calls with the same rows, tokens, options and `validate`.
      entropy: "none"; "value" (no gradient, nothing kept for backward); "grad".
      keep_mask: logits.shape bool; log-probs renormalised over keep_mask ∪ {target}, entropies over the full
        distribution. An all-False row keeps its target only.
      keep: (ids, offsets), the same from a sparse CSR keep set over the flattened rows, no [T, V] mask; a row with
        an empty range keeps the whole vocabulary. Not with keep_mask (docs/api.md#keep-sets).
      temperature: both outputs use logits / temperature, the gradient carries 1 / temperature. A real > 0 whose
        reciprocal fits in float32: a Python or NumPy scalar, or a one-element tensor (read with .item()); or one
        per row, a float32 tensor of tokens' shape on the logits' device (its values checked with validate=True).
        With reduction_order="sglang": a scalar, bf16(bf16(logits) / T), as SGLang's sampler divides (a bf16 copy
        of the logits).
      row_mask: logits.shape[:-1] bool; False rows get 0, 0 and zero gradient, cost nothing, are not checked.
      vocab_size: the true global vocabulary; columns at or past it are padding (no mass, zero gradient).
      chunk_size: rows per chunk of the PyTorch backend's fp32 buffers (None or -1: automatic); bitwise invariant.
      inplace_grad: backward writes the gradient into the logits' storage (their values are lost); logits that do
        not flatten to rows without a copy, or overlap, are refused (docs/api.md#in-place-gradient).
      backend: "auto" (triton for CUDA tensors when triton imports, else torch), "torch" or "triton".
      validate: value checks and collective failure, exactly one host sync per call; False: no sync, and what
        core/agreement.py lists is no longer guaranteed (docs/api.md#validation-and-collective-failure).
      reduction_order: "fused", or "sglang": log-probs bit for bit SGLang's batch-invariant log_softmax at any TP
        size (Triton on CUDA; no keep_mask or keep; docs/api.md#sglang-reduction-order).
      softcap: None, or c > 0: the logits become c * tanh(logits / c) before the temperature, as Gemma 2's
        final_logit_softcapping caps them; the gradient carries 1 - tanh²(logits / c). Not with keep or
        reduction_order="sglang" (nor a per-row temperature).

    Returns LogProbsEntropy(log_probs, entropy), float32, shaped like tokens; entropy None with entropy="none".
    Guarantees (docs/api.md#guarantees): one all-gather per forward, none in backward; bitwise reproducible run to
    run, for every chunk_size, and across TP sizes when V_global % 8 == 0. Unsupported: float64 logits, torch.func
    transforms. Under torch.compile: the custom operator of compiled/logits_op.py (docs/compile.md).
    """
    options = dict(tp_group=tp_group, entropy=entropy, keep_mask=keep_mask, keep=keep, temperature=temperature,
                   row_mask=row_mask, vocab_size=vocab_size, chunk_size=chunk_size, backend=backend,
                   validate=validate, reduction_order=reduction_order)
    if softcap is not None or checks.is_row_temperature(temperature):
        # Not replayed (the replayed launches take a scalar temperature and no softcap); the shell checks the rest.
        if torch.compiler.is_compiling():
            return LogProbsEntropy(*logits_op.log_probs_and_entropy(logits, tokens, softcap=softcap, **options))
        return _log_probs_eager(logits, tokens, inplace_grad=inplace_grad, softcap=softcap, **options)
    if reduction_order == "sglang":
        temperature, inv_temperature, _, _ = checks.check_options(
            "log_probs_and_entropy", entropy=entropy, backend=backend, temperature=temperature, chunk_size=chunk_size,
            vocab_size=vocab_size, inplace_grad=inplace_grad, validate=validate)
        if temperature != 1.0:
            return _divided_as_sglangs_sampler(logits, tokens, temperature, inv_temperature, inplace_grad, options)
    if not torch.compiler.is_compiling():
        return _log_probs_eager(logits, tokens, inplace_grad=inplace_grad, **options)
    return LogProbsEntropy(*logits_op.log_probs_and_entropy(logits, tokens, **options))


def _divided_as_sglangs_sampler(logits, tokens, temperature, inv_temperature, inplace_grad, options):
    """reduction_order="sglang" at temperature T != 1. SGLang's sampler divides before its log_softmax,
    bf16(bf16(logits) / fp32(T)) (lm_head/sglang_matmul.py), and the fused head in this order applies T the same way;
    so the logits op scores those quotients at temperature 1 (a bf16 copy of the logits), and the 1 / T of the
    gradient scales the upstream gradients (the dlogits are linear in them: one rounding, as at T = 1)."""
    if inplace_grad:
        raise checks.argument_error(
            ValueError, "log_probs_and_entropy", "inplace_grad",
            "inplace_grad=True is not available with reduction_order='sglang' and temperature != 1: the op scores "
            "a copy of the logits divided as SGLang's sampler divides them, so the gradient cannot land in theirs")
    divided = _SamplerDivision.apply(logits, temperature)
    out = log_probs_and_entropy(divided, tokens, **dict(options, temperature=1.0))
    scaled = [None if t is None else _ScaledGrad.apply(t, inv_temperature) for t in out]
    return LogProbsEntropy(*scaled)


class _SamplerDivision(torch.autograd.Function):
    """bf16(bf16(logits) / T): an IEEE fp32 division by a device tensor (true division, as SGLang divides by its
    temperatures tensor; a host scalar may be turned into a multiplication). Backward passes the gradient through in
    the logits' dtype (_ScaledGrad carries the 1 / T)."""

    @staticmethod
    def forward(ctx, logits, temperature):
        ctx.dtype = logits.dtype
        divisor = torch.full((1,), temperature, dtype=torch.float32, device=logits.device)
        return logits.to(torch.bfloat16).float().div(divisor).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class _ScaledGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale` in fp32."""

    @staticmethod
    def forward(ctx, values, scale):
        ctx.scale = scale
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _log_probs_eager(logits, tokens, *, tp_group, entropy, keep_mask, keep, temperature, row_mask, vocab_size,
                     chunk_size, inplace_grad, backend, validate, reduction_order, softcap=None) -> LogProbsEntropy:
    # A call of a signature seen before replays that call's launches (logits/replay.py); not one with a softcap or a
    # per-row temperature, which its record does not carry.
    key = None
    if softcap is None and not checks.is_row_temperature(temperature):
        key = replay.signature(logits, tokens, tp_group=tp_group, entropy=entropy, keep_mask=keep_mask, keep=keep,
                               temperature=temperature, row_mask=row_mask, vocab_size=vocab_size,
                               chunk_size=chunk_size, inplace_grad=inplace_grad, backend=backend, validate=validate,
                               reduction_order=reduction_order)
    replayed = None if key is None else replay.run(key, logits, tokens)
    if replayed is not None:
        return _shaped_outputs(*replayed)
    call = shell.prepare_logits(
        "log_probs_and_entropy", logits, tokens, tp_group=tp_group, entropy=entropy, keep_mask=keep_mask,
        temperature=temperature, row_mask=row_mask, vocab_size=vocab_size, chunk_size=chunk_size,
        inplace_grad=inplace_grad, backend=backend, validate=validate, reduction_order=reduction_order, keep=keep,
        softcap=softcap,
    )
    with shell.on_device(call), replay.recording(key, call, logits):
        out = LogProbEntropyFunction.apply(call.rows, call.tokens, call.keep_mask, call.row_mask, call.plan,
                                           call.keep)
    return _outputs(out, call)



def calculate_log_probs_and_entropy(
    logits,
    tokens,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask: Optional[torch.Tensor] = None,
    with_entropy_grad: bool = True,
    *,
    keep: Optional[tuple] = None,
):
    """Drop-in replacement for slime's function of the same name, argument by argument.

    Equivalent to `log_probs_and_entropy(logits, tokens, tp_group=tp_group, entropy=..., keep_mask=log_prob_keep_mask,
    chunk_size=...)` with slime's conventions: tp_group=None is the default group when torch.distributed is
    initialised (one rank otherwise), every chunk_size <= 0 means no chunking, with_entropy / with_entropy_grad pick
    "none", "value" or "grad". Values are validated (validate=True: one host sync per call). Unlike slime's, the
    entropy stays finite when some logits are -inf.

    Returns (log_prob [T, 1] float32 (shape (0,) when T == 0), entropy [T] float32 or None).

    One keyword beyond slime's: `keep=(ids, offsets)`, the sparse keep set over these rows, in place of
    log_prob_keep_mask (not both). For a call on one sample's response rows, slime's own top-p record of that
    sample (rollout_top_p_token_ids, rollout_top_p_token_offsets as int64 tensors on the logits' device, offsets
    starting at 0) is such a set: no dense [T, V_local] mask to build. docs/api.md#calculate_log_probs_and_entropy.
    """
    if tp_group is None and dist.is_available() and dist.is_initialized():
        tp_group = dist.group.WORLD
    if _is_number(chunk_size) and chunk_size <= 0:
        chunk_size = None
    mode = "none" if not with_entropy else ("grad" if with_entropy_grad else "value")
    if torch.compiler.is_compiling():  # the logits op's operator (its errors name log_probs_and_entropy)
        result = log_probs_and_entropy(logits, tokens, tp_group=tp_group, entropy=mode, keep_mask=log_prob_keep_mask,
                                       chunk_size=chunk_size, keep=keep)
    else:
        call = shell.prepare_logits(
            "calculate_log_probs_and_entropy", logits, tokens, tp_group=tp_group, entropy=mode,
            keep_mask=log_prob_keep_mask, temperature=1.0, row_mask=None, vocab_size=None, chunk_size=chunk_size,
            inplace_grad=False, backend="auto", validate=True, keep=keep,
        )
        with shell.on_device(call):
            out = LogProbEntropyFunction.apply(call.rows, call.tokens, call.keep_mask, call.row_mask, call.plan,
                                               call.keep)
        result = _outputs(out, call)
    log_prob = result.log_probs
    log_prob = log_prob.reshape(0) if log_prob.numel() == 0 else log_prob.unsqueeze(-1)
    return log_prob, result.entropy


def _is_number(value) -> bool:
    """A real number, or a one-element tensor of one (bool aside): what the option checks would read as one."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.dtype != torch.bool and not value.dtype.is_complex
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def linear_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    tp_group=None,
    entropy: str = "none",
    keep: Optional[tuple] = None,
    temperature: float = 1.0,
    row_mask: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    reduce_dx: bool = True,
    backend: str = "auto",
    validate: bool = True,
    working_memory: Optional[int] = None,
    reduction_order: str = "fused",
    softcap: Optional[float] = None,
) -> LogProbsEntropy:
    """Log-probability of each target token and entropy of each row, from hidden states and a vocab-parallel
    LM-head weight, without ever holding the [T, V] logits.

    Equivalent to `log_probs_and_entropy(hidden @ weight.T, tokens, ...)` with the logits accumulated in fp32 (never
    rounded to the input dtype), with gradients for `hidden` and `weight`, never holding [T, V] logits nor their
    gradient. Every argument in full: docs/api.md#linear_log_probs_and_entropy; which path a call takes:
    docs/lm_head.md.

    Args:
      hidden: [..., H] float32/bfloat16/float16, the same on every rank of tp_group (not checked).
      weight: [V_local, H], hidden's dtype and device: this rank's contiguous slice of the vocabulary, as in
        Megatron's column-parallel output layer.
      tokens: hidden.shape[:-1] integer global token ids.
      tp_group, entropy, keep, temperature, vocab_size, backend, validate, softcap: as in log_probs_and_entropy (a
        keep row's kept logits are fp32 dots hidden[r] . weight[id]: docs/api.md#keep-sets; a per-row temperature
        has hidden.shape[:-1]); the softcap and temperature apply to the fp32 logits in the GEMMs' epilogues.
      row_mask: hidden.shape[:-1] bool; False rows get 0, 0, zero gradient and no GEMM work; on CUDA the kept-row
        count costs one host sync of its own, with validate True or False.
      reduce_dx: True: the backward all-reduces dX over tp_group (fp32, one rounding). False: each rank returns its
        own vocabulary's part, for a caller whose layer already reduces dX (Megatron's
        copy_to_tensor_model_parallel_region, or its sequence-parallel gather); True there would sum it twice.
      working_memory: bytes the forward may hold for the backward as the first rows' fp16 probabilities (2 V bytes a
        row, V global; None: paths.HELD_BYTES; 0: none): the more rows held, the less of the backward's
        second GEMM. The same on every rank; the log-probs do not depend on it, dX and dW by those rows' rounding.
      reduction_order: "fused"; or "sglang": log-probs bit for bit SGLang's true on-policy LM head (its batch-invariant
        matmul's bf16 logits, divided by T as its sampler divides, then its log_softmax order) at any TP size; CUDA
        with Triton on sm_90, no keep, working_memory unused (docs/api.md#sglang-reduction-order).

    Not taken: keep_mask (use keep), inplace_grad, chunk_size (the backends' fixed GEMM chunks replace it).
    Returns LogProbsEntropy(log_probs, entropy), float32, shaped like tokens; dW is this rank's [V_local, H] slice.
    Guarantees (docs/api.md#guarantees): log-probs, entropies and dW bitwise equal across TP sizes (log-probs and
    entropies across row counts too) when V_global % 8 == 0, for one dtype and backend; dX deterministic. Host
    syncs on CUDA: validate=True 1 (2 with a row_mask), validate=False 0 (1 with a row_mask). Under torch.no_grad
    nothing is kept and it costs one GEMM's work. To form an RL loss's gradient in the forward: linear_token_loss.
    """
    options = dict(tp_group=tp_group, entropy=entropy, keep=keep, temperature=temperature, row_mask=row_mask,
                   vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend, validate=validate,
                   working_memory=working_memory)
    if not torch.compiler.is_compiling():
        return _linear_eager(hidden, weight, tokens, reduction_order=reduction_order, softcap=softcap, **options)
    _refuse_compiled_transform("linear_log_probs_and_entropy", temperature, softcap)
    _refuse_compiled_order("linear_log_probs_and_entropy", reduction_order)
    return LogProbsEntropy(*linear_op.linear_log_probs_and_entropy(hidden, weight, tokens, **options))


def _linear_eager(hidden, weight, tokens, *, tp_group, entropy, keep, temperature, row_mask, vocab_size, reduce_dx,
                  backend, validate, working_memory, reduction_order="fused", softcap=None) -> LogProbsEntropy:
    call = shell.prepare_lm_head(
        "linear_log_probs_and_entropy", hidden, weight, tokens, tp_group=tp_group, entropy=entropy,
        temperature=temperature, row_mask=row_mask, vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend,
        validate=validate, keep=keep, working_memory=working_memory, reduction_order=reduction_order,
        softcap=softcap)
    with shell.on_device(call):
        out = LinearLogProbEntropyFunction.apply(call.rows, weight, call.tokens, call.row_mask, call.plan, call.keep)
    return _outputs(out, call)



def linear_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    token_loss: Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor], torch.Tensor],
    *,
    tp_group=None,
    entropy: str = "none",
    keep: Optional[tuple] = None,
    temperature: float = 1.0,
    row_mask: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    reduce_dx: bool = True,
    backend: str = "auto",
    validate: bool = True,
    working_memory: Optional[int] = None,
    reduction_order: str = "fused",
    softcap: Optional[float] = None,
) -> tuple:
    """A per-token RL loss on the LM head's log-probs (and entropies), its gradient formed inside the forward.

    Equivalent to `token_loss(lp, ent, rows).sum()` over the rows row_mask keeps, with `lp, ent` those of
    `linear_log_probs_and_entropy(hidden, weight, tokens, ...)`: the logits are formed once, so the op costs three
    GEMMs' work (logits, dX, dW), not four, and never holds [T, V]. In full: docs/api.md#linear_token_loss.

    `token_loss(log_probs [n] fp32, entropy [n] fp32 or None, rows [n] int64) -> values [n] fp32` is the caller's
    loss in torch ops, called on row blocks while their logits are live; `rows` index the flattened tokens (index
    per-token constants with them). It MUST be row-separable: a row's term depends only on its own log-prob,
    entropy and constants (a mean over rows uses a count known beforehand). A ppo_ops.token_losses.TokenLoss
    (policy_loss, grpo_loss) gives its gradient in closed form; any other callable goes through autograd once per
    block. A loss whose `scope` is "sequence" (ppo_ops.sequence_losses: gspo_loss, gmpo_loss) or "batch"
    (ppo_ops.top_entropy_mask) gets a statistics pass first, then its frozen row-separable form (docs/losses.md, the
    schedules). Checked on every block: values
    float32 [n] on hidden's device (finite, with validate=True). row_mask False rows are never passed to it; at
    TP > 1 every rank calls it with the same global values.

    Arguments as in linear_log_probs_and_entropy (with `keep`, token_loss sees renormalised log-probs), except:
      working_memory: the bytes the row blocks may hold (None: paths.TOKEN_LOSS_BYTES). Where every row
        fits, one block, and dW is finished in the forward; else blocks of (working_memory - 4 V H) / (2 V) rows
        (a multiple of 256, 1024 to 8192) beside an fp32 dW accumulator. Fewer blocks run faster. The same on
        every rank.
      reduction_order: as in linear_log_probs_and_entropy ("sglang": token_loss sees SGLang's log-probs).

    Returns (loss, LogProbsEntropy(log_probs, entropy)): loss is 0-d fp32, the sum of values over the kept rows;
    its backward (once) scales the gradients formed in the forward by the upstream scalar (an upstream 1 costs
    nothing, another may round once more). log_probs and entropy are detached, bit for bit those of
    linear_log_probs_and_entropy on CUDA half precision with 16-byte aligned rows.
    Failure of token_loss at TP > 1 (validate=True): every rank raises the same error naming the ranks at fault
    (one more small all-gather at the end of the forward). Host syncs on CUDA: validate=True 1 at TP = 1, 2 at
    TP > 1; validate=False none; a row_mask adds one.
    """
    options = dict(tp_group=tp_group, entropy=entropy, keep=keep, temperature=temperature, row_mask=row_mask,
                   vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend, validate=validate,
                   working_memory=working_memory)
    if not torch.compiler.is_compiling():
        return _token_loss_eager(hidden, weight, tokens, token_loss, reduction_order=reduction_order, softcap=softcap,
                                 **options)
    _refuse_compiled_transform("linear_token_loss", temperature, softcap)
    _refuse_compiled_order("linear_token_loss", reduction_order)
    loss, log_prob, ent = token_loss_op.linear_token_loss(hidden, weight, tokens, token_loss, **options)
    return loss, LogProbsEntropy(log_prob, ent)


def _token_loss_eager(hidden, weight, tokens, token_loss, *, tp_group, entropy, keep, temperature, row_mask,
                      vocab_size, reduce_dx, backend, validate, working_memory, reduction_order="fused",
                      softcap=None) -> tuple:
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:  # else the shell's checks name hidden
        agreement.check_collectively("linear_token_loss", tp_group, validate, hidden, checks.check_token_loss_rows,
                                     "linear_token_loss", token_loss, tuple(hidden.shape[:-1]), "hidden.shape[:-1] =")
    call = shell.prepare_lm_head(
        "linear_token_loss", hidden, weight, tokens, tp_group=tp_group, entropy=entropy, temperature=temperature,
        row_mask=row_mask, vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend, validate=validate,
        token_loss=token_loss, fused_loss=True, keep=keep, working_memory=working_memory,
        reduction_order=reduction_order, softcap=softcap)
    keep_arg = () if call.keep is None else (call.keep,)  # the Function's last argument, given only with keep
    with shell.on_device(call):
        loss, log_prob, ent = LinearTokenLossFunction.apply(call.rows, weight, call.tokens, call.row_mask, call.plan,
                                                            token_loss, *keep_arg)
    return loss, _outputs((log_prob, ent) if entropy != "none" else log_prob, call)



def _refuse_compiled_transform(fn_name: str, temperature, softcap) -> None:
    """The LM head's custom operators (ppo_ops/compiled/) take a scalar temperature and no softcap."""
    for name, given in (("temperature", checks.is_row_temperature(temperature)), ("softcap", softcap is not None)):
        if given:  # compile_error: dynamo cannot set the attribute argument_error adds on an exception it traces
            raise compiled_common.compile_error(
                ValueError, fn_name, name,
                f"{'a per-row temperature' if name == 'temperature' else 'softcap'} is not available inside "
                "torch.compile (the LM head's custom operators take a scalar temperature and no softcap): call the "
                "op outside the compiled region, or under torch.compiler.disable")


def _refuse_compiled_order(fn_name: str, reduction_order) -> None:
    """The LM head's custom operators (ppo_ops/compiled/) take the fused order only."""
    if reduction_order != "fused":
        raise compiled_common.compile_error(
            ValueError, fn_name, "reduction_order",
            f"reduction_order={reduction_order!r} is not available inside torch.compile (the LM head's custom operator "
            "takes the fused order only): call the op outside the compiled region, or under "
            "torch.compiler.disable")


def _outputs(out, call: shell.Call) -> LogProbsEntropy:
    """A Function's log-prob (and entropy) outputs, [T] each, in the call's leading shape."""
    return _shaped_outputs(out, call.plan.entropy_mode, call.lead)


def _shaped_outputs(out, entropy_mode: str, lead: tuple) -> LogProbsEntropy:
    if entropy_mode == "none":
        return LogProbsEntropy(shell.shaped(out, lead), None)
    log_prob, ent = out
    return LogProbsEntropy(shell.shaped(log_prob, lead), shell.shaped(ent, lead))
