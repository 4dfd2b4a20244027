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
) -> LogProbsEntropy:
    """Log-probability of each target token and the entropy of each row's distribution, vocab-parallel.

    Args:
      logits: [..., V_local] float32/bfloat16/float16; this rank's contiguous slice of the global vocabulary
        ([rank * V_local, (rank + 1) * V_local)). Math is fp32; the gradient comes back in the logits' dtype.
      tokens: logits.shape[:-1] integer global token ids.
      tp_group: tensor-parallel process group, given explicitly (e.g. torch.distributed.group.WORLD for TP over
        the default group); None means one rank, always, also inside an initialised job. One rank issues no
        collective. Every rank of the group must call with the same rows, tokens, options and `validate`.
      entropy: "none"; "value" (returned without gradient, nothing kept for backward); "grad" (differentiable).
      keep_mask: logits.shape bool; log-probs are normalised over keep_mask ∪ {target} (the target is always kept);
        the entropy is always over the full distribution.
      keep: the same semantics from a sparse keep set, without any [T, V] mask: a pair (ids, offsets) of 1-D integer
        tensors on the logits' device, CSR over the flattened rows (tokens.reshape(-1)): row r keeps the global token
        ids ids[offsets[r]:offsets[r+1]] (offsets: rows + 1 entries, offsets[0] == 0, offsets[-1] == len(ids),
        non-decreasing; the same values on every rank). A row's kept ids are a set (an id listed twice counts once)
        and its target always counts; a row with offsets[r] == offsets[r+1] keeps the full vocabulary. Not together
        with keep_mask. Cost: O(len(ids) + rows) memory and work (the kept logits gathered; a sort of the entries);
        at TP > 1 one more all-reduce of 4 bytes per id and per row. Bitwise deterministic and TP-invariant like the
        rest; its log-probs equal keep_mask's within the tolerances, not bit for bit (core/sparse_keep.py).
      temperature: both quantities use logits / temperature, and the gradient carries the 1 / temperature factor.
        Any real number > 0 whose reciprocal fits in float32 (>= about 2.94e-39): Python or NumPy scalars, or a
        one-element tensor (read with .item(): a host sync of its own when it is on a GPU).
      row_mask: logits.shape[:-1] bool; False rows get log-prob 0, entropy 0 and gradient 0, cost no compute, and
        their tokens are not checked.
      vocab_size: the true global vocabulary; global columns at or past it are padding (no mass, zero gradient).
        An int (Python, NumPy or a one-element integer tensor), like chunk_size.
      chunk_size: rows per working chunk, bounding the PyTorch backend's fp32 buffers in forward and backward
        (None or -1: an automatic bound). Results are bitwise identical for every chunk size.
      inplace_grad: backward writes the gradient into the logits' storage and returns it as their gradient; the
        logits' values are lost, so nothing else may need them afterwards (autograd's version counter flags saved
        uses), and a second backward through this op raises. Logits whose elements overlap in memory (expanded,
        stride-0 views) are refused with a ValueError by both backends.
      backend: "auto" (triton for CUDA tensors when triton imports, else torch), "torch" or "triton".
      validate: run the checks that read tensor values (token range; NaN / +inf logits; ranks agreeing on rows,
        tokens and options) and make failure collective. Exactly one host sync per call at any TP size: at TP = 1 at
        the end of the forward, at TP > 1 when the ranks' fixed-size headers have been all-gathered, before the
        partials' all-gather; every rank then raises the same error, naming the rank(s) at fault and the argument.
        False: no host sync, and what core/agreement.py lists is no longer guaranteed (out-of-range tokens, NaN
        logits and ranks that disagree give wrong results, or an error or wait until the process group's timeout;
        an argument error raises on its own rank only). Must be the same on every rank.
      reduction_order: "fused" (one pass, fixed vocabulary segments) or "sglang": the log-probs are bit for bit those
        of SGLang's batch-invariant log_softmax of logits.float() (its deterministic and true-on-policy inference),
        at any TP size, with the Triton backend on a GPU (logits/sglang_order.py: the order, and what it costs:
        two reads of the logits and up to three small collectives). keep_mask and keep must be None; at TP > 1 each
        rank needs at least 1024 columns. The torch backend adds in the same order (bitwise TP-invariant) with torch's
        exp and log.

    Returns:
      LogProbsEntropy(log_probs, entropy), float32, shaped like tokens. Bitwise deterministic run to run.

    Unsupported: float64 logits (TypeError; the kernels compute in fp32 and the fp32 guarantees would not hold);
    torch.func transforms (vmap, grad, jvp: the autograd Function has no vmap or forward-mode rule, and the
    collectives and value checks act on whole tensors). Under torch.compile the call is the custom operator of
    ppo_ops/compiled/logits_op.py (fullgraph, bitwise equal to eager): options must be Python numbers there, and
    inplace_grad has no effect (the gradient comes back in a new tensor).
    """
    options = dict(tp_group=tp_group, entropy=entropy, keep_mask=keep_mask, keep=keep, temperature=temperature,
                   row_mask=row_mask, vocab_size=vocab_size, chunk_size=chunk_size, backend=backend,
                   validate=validate, reduction_order=reduction_order)
    if not torch.compiler.is_compiling():
        return _log_probs_eager(logits, tokens, inplace_grad=inplace_grad, **options)
    return LogProbsEntropy(*logits_op.log_probs_and_entropy(logits, tokens, **options))


def _log_probs_eager(logits, tokens, *, tp_group, entropy, keep_mask, keep, temperature, row_mask, vocab_size,
                     chunk_size, inplace_grad, backend, validate, reduction_order) -> LogProbsEntropy:
    # A call of a signature seen before replays that call's launches (logits/replay.py).
    key = replay.signature(logits, tokens, tp_group=tp_group, entropy=entropy, keep_mask=keep_mask, keep=keep,
                           temperature=temperature, row_mask=row_mask, vocab_size=vocab_size, chunk_size=chunk_size,
                           inplace_grad=inplace_grad, backend=backend, validate=validate,
                           reduction_order=reduction_order)
    replayed = replay.run(key, logits, tokens)
    if replayed is not None:
        return _shaped_outputs(*replayed)
    call = shell.prepare_logits(
        "log_probs_and_entropy", logits, tokens, tp_group=tp_group, entropy=entropy, keep_mask=keep_mask,
        temperature=temperature, row_mask=row_mask, vocab_size=vocab_size, chunk_size=chunk_size,
        inplace_grad=inplace_grad, backend=backend, validate=validate, reduction_order=reduction_order, keep=keep,
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

    Returns (log_prob [T, 1] float32 (shape (0,) when T == 0), entropy [T] float32 or None). As in slime's (and every
    torch.distributed call), tp_group=None is the default group when torch.distributed is initialised, and one rank
    otherwise; every chunk_size <= 0 means no chunking. Unlike slime's, the entropy stays finite when some logits are
    -inf. Values are validated (validate=True: one host sync per call).

    One keyword beyond slime's: `keep=(ids, offsets)`, log_probs_and_entropy's sparse keep set over these rows, in
    place of log_prob_keep_mask (not both). For a call on one sample's response rows, slime's own top-p record of
    that sample is such a set (rollout_top_p_token_ids, rollout_top_p_token_offsets as int64 tensors on the logits'
    device, offsets starting at 0): no dense [T, V_local] mask to build.
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
) -> LogProbsEntropy:
    """Log-probability of each target token and the entropy of each row, from hidden states and a (vocab-parallel)
    LM-head weight, without ever holding the [T, V] logits.

    Same semantics and outputs as `log_probs_and_entropy(hidden @ weight.T, tokens, ...)` with the logits accumulated
    in fp32 (never rounded to the input dtype): per-token log-probs and entropies in fp32, gradients for `hidden` and
    `weight` in their dtype. Guarantees:
      - accuracy against float64 on the same inputs: the logits op's error plus what the fp32 accumulation of
        H products costs (the logits move by at most ~2 H u32 |x| . |w|); dlogits are rounded once to the input
        dtype before the dX and dW GEMMs (bf16: 2^-8 of each term), except the rows whose probabilities the forward
        held (below), whose dlogits carry an fp16 rounding of their probabilities (2^-11) before that;
      - bitwise deterministic run to run (fixed tile shapes and reduction orders, no atomics);
      - bitwise identical log-probs, entropies and dW at every TP size, and log-probs and entropies for every row
        count and row mask, under the logits op's vocabulary condition (V_global % 8 == 0): a column's logit never
        depends on which rank computes it or on the other rows (tiles start at the fixed global segments, the K loop
        over H is fixed per GEMM shape), and the per-segment partials go through the logits op's all-gather and
        fixed-order merge; with the same dtype and backend (the backends' GEMMs differ);
      - dX is deterministic; at TP > 1 its fp32 sum runs in another order than at TP = 1 (within fp32 rounding);
      - memory: never [T, V] logits nor their gradient. Under torch.no_grad it keeps nothing and costs one GEMM's
        work. With a gradient the forward holds the first rows' logits as fp16 probabilities (at most
        `working_memory` bytes at the global vocabulary, 2 V bytes a row; default 1 GiB: 3328 rows at Qwen3's; up to
        every row), whose backward needs no second GEMM; the other rows' logits are formed again in the
        backward (four GEMMs' work for them: forward, recompute, dX, dW). Working memory beyond
        dX and dW (CUDA, half precision): an fp32 dX accumulator [R, H], a dlogits buffer of 8192 rows x one
        vocabulary segment and, past 8192 rows, one segment's fp32 dW accumulator.
    Backends (backend="auto" picks triton on CUDA): "triton" with bf16 / fp16, the segment-GEMM backend (a Triton GEMM
    whose epilogue reduces each logit tile, the same GEMM with the gradient in its epilogue, cuBLAS dX and dW); with
    fp32, Triton GEMM tiles with IEEE fp32 dots; "torch", fixed fp32 tiles through torch.matmul and the logits op's
    own code (bitwise equal to log_probs_and_entropy(logits, ..., backend="torch") on the logits its tiles produce).
    To form the gradient of an RL loss in the forward instead (three GEMMs' work), see ppo_ops.linear_token_loss.

    Args:
      hidden: [..., H] float32/bfloat16/float16, the same on every rank of tp_group (the LM head's input).
      weight: [V_local, H], hidden's dtype and device; this rank's contiguous slice of the vocabulary
        ([rank * V_local, (rank + 1) * V_local)), as in Megatron's column-parallel output layer.
      tokens: hidden.shape[:-1] integer global token ids.
      tp_group: tensor-parallel process group, given explicitly (e.g. torch.distributed.group.WORLD for TP over
        the default group); None means one rank, always, also inside an initialised job. One rank issues no
        collective. Every rank of the group must call with the same hidden, rows, tokens, options and `validate`.
      entropy: "none"; "value" (returned without gradient); "grad" (differentiable).
      keep: a sparse keep set (ids, offsets), CSR over the flattened rows, as in log_probs_and_entropy: keep rows'
        log-probs are renormalised over their ids ∪ {target}, entropies stay full. Their kept logits are fp32 dots
        hidden[r] . weight[id] formed by the rank holding the id (the target's too, so log_prob <= 0), exchanged in
        one more all-reduce at TP > 1 (4 bytes per id and per row); backward adds Σ c W[id] to dX (before its
        all-reduce) and Σ c X[r] to dW's kept rows (fixed order, one more rounding of those rows to weight's dtype).
        About 2 * len(ids) * H multiply-adds forward and 4 * len(ids) * H backward; O(len(ids) + rows) memory.
        Log-probs and dW stay bitwise TP-invariant, log-probs row-count invariant (core/sparse_keep.py).
      temperature: both quantities use logits / temperature; the gradients carry the 1 / temperature factor. Any
        real number > 0 whose reciprocal fits in float32: Python or NumPy scalars, or a one-element tensor (read
        with .item(): a host sync of its own when it is on a GPU).
      row_mask: hidden.shape[:-1] bool; False rows get log-prob 0, entropy 0 and zero gradient, cost no GEMM work
        (the kept rows are gathered first: O(rows * H) bytes, and on CUDA one host sync of its own for their count,
        with validate True or False), and their tokens are not checked.
      vocab_size: the true global vocabulary; global columns at or past it are padding (no mass, zero dW rows).
        An int (Python, NumPy or a one-element integer tensor).
      reduce_dx: True (default): backward all-reduces the hidden gradient over tp_group (in fp32, then one rounding
        to hidden's dtype), so the returned dX is the full gradient. False: each rank returns only its own
        vocabulary's contribution dlogits_local @ weight, and the caller reduces it. Use False when `hidden` reaches
        this op through Megatron's `copy_to_tensor_model_parallel_region` (the input of its column-parallel LM head),
        whose backward already all-reduces dX over the TP group (or, with sequence parallelism, through
        `gather_from_sequence_parallel_region`, whose backward reduce-scatters it); True would sum it twice.
      backend: "auto" (triton for CUDA tensors when triton imports, else torch), "torch" or "triton".
      validate: run the checks that read tensor values (token range; NaN / +inf logits; ranks agreeing on rows,
        tokens and options) and make failure collective, as `log_probs_and_entropy` does (core/agreement.py):
        one host read of values per call at any TP size: at TP = 1 at the end of the forward, at TP > 1 when the
        ranks' fixed-size headers have been all-gathered, before the partials' all-gather; every rank then raises
        the same error, naming the rank(s) at fault and the argument. A local argument error (a wrong shape, dtype
        or option) on one rank also raises on every rank. False: no value read, and what core/agreement.py lists is no
        longer guaranteed (an argument error raises on its own rank only, the others wait in the all-gather until
        the process group's timeout). Must be the same on every rank. Not checked either way: that `hidden` is the
        same on every rank.
      working_memory: bytes the forward may hold for the backward (None: 1 GiB; 0: nothing, every logit formed
        again): the more rows held, the less of the second GEMM (the trade at Qwen3's shapes: docs/performance.md).
        Rounded down to whole 256-row steps, at most the call's rows. Must be the same on every rank (validate=True
        checks it); the log-probs and entropies do not depend on it, dX and dW do by the held rows' fp16 rounding.

    Host syncs per call on CUDA (forward + backward): validate=True, 1 without a row_mask and 2 with one (the kept-row
    count, needed to size the GEMMs before the partials exist, and the value read, which needs the partials);
    validate=False, 0 without a row_mask and 1 with one. On the CPU the count is no sync.

    Options of `log_probs_and_entropy` that do not apply:
      keep_mask: a dense [T, V] mask is as large as the logits this op exists not to hold (use `keep`).
      inplace_grad: there is no logits tensor whose storage could take the gradient.
      chunk_size: replaced by the backends' fixed GEMM chunks, which are part of the bit-exactness contract.

    Gradient: dW is this rank's [V_local, H] slice (no communication); dX as `reduce_dx` says. dW's bits are
    TP-invariant like the log-probs; dX's are deterministic but, at TP > 1, summed in a different order than at
    TP = 1 (within rounding of fp32).

    Returns:
      LogProbsEntropy(log_probs, entropy), float32, shaped like tokens.
    """
    options = dict(tp_group=tp_group, entropy=entropy, keep=keep, temperature=temperature, row_mask=row_mask,
                   vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend, validate=validate,
                   working_memory=working_memory)
    if not torch.compiler.is_compiling():
        return _linear_eager(hidden, weight, tokens, **options)
    return LogProbsEntropy(*linear_op.linear_log_probs_and_entropy(hidden, weight, tokens, **options))


def _linear_eager(hidden, weight, tokens, *, tp_group, entropy, keep, temperature, row_mask, vocab_size, reduce_dx,
                  backend, validate, working_memory) -> LogProbsEntropy:
    call = shell.prepare_lm_head(
        "linear_log_probs_and_entropy", hidden, weight, tokens, tp_group=tp_group, entropy=entropy,
        temperature=temperature, row_mask=row_mask, vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend,
        validate=validate, keep=keep, working_memory=working_memory)
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
) -> tuple:
    """A per-token RL loss on the LM head's log-probs (and entropies), its gradient formed inside the forward: the
    logits are computed once, so the whole op costs three GEMMs' work (logits, dX, dW) and never holds [T, V].

    `token_loss(log_probs, entropy, rows) -> values` is the caller's per-token loss in torch ops:
      log_probs: [n] fp32, the log-probs of a block of n kept rows (requires grad);
      entropy: [n] fp32 (requires grad with entropy="grad"; a constant with "value") or None with entropy="none";
      rows: [n] int64 indices of those rows into the flattened tokens (tokens.reshape(-1)): index per-token
        constants (advantages, old log-probs, masks, per-row normalisation weights) with them;
      values: [n] fp32, the rows' loss terms.
    The op calls it on row blocks (on CUDA every row at once where that fits, else 2816 rows at H = 4096, see
    Working memory) while the block's logits are
    live, takes the gradient of values.sum() with autograd w.r.t. its first two arguments, and forms dlogits, dX
    and dW right there.
    The loss MUST be row-separable: a row's term may depend only on its own log-prob, its own entropy and constants,
    never on other rows' values (it sees one block at a time; a mean over rows must use a count known beforehand,
    folded into the constants). PPO / GRPO / DAPO clipped surrogates, an entropy bonus, k1/k2/k3 KL to a reference
    and token- or sequence-mean normalisation with known counts all are. Checked on every block: values is a float32
    tensor of shape [n] on hidden's device; with validate=True also that values and gradients are finite.
    At TP > 1 every rank calls token_loss with the same global values (merged statistics). Gradients flow to hidden
    and weight only: tensors the loss closes over (constants, or a module's parameters) get none from this op.

    Returns (loss, LogProbsEntropy(log_probs, entropy)):
      loss: 0-d fp32, the sum of values over the kept rows; differentiable w.r.t. hidden and weight. Its backward
        scales the gradients formed in the forward by the upstream scalar (in place, in fp32; an upstream 1, as from
        loss.backward(), costs nothing and returns them as formed, another value may add one rounding: fold
        constant factors into token_loss) and can run once.
      log_probs, entropy: fp32, shaped like tokens, detached (for metrics); entropy None with entropy="none".
        Bitwise equal to linear_log_probs_and_entropy's with backend="triton" on CUDA half precision with 16-byte
        aligned rows (the same one-GEMM forward; TP- and row-count invariant, as there); elsewhere equal to the logits
        op's on the same chunk GEMMs' logits.

    Arguments as in linear_log_probs_and_entropy (tp_group, entropy, keep, temperature, row_mask, vocab_size,
    reduce_dx, backend, validate; with `keep`, token_loss sees the keep rows' renormalised log-probs); row_mask False
    rows get log-prob 0, entropy 0, no loss term and zero gradient, and are never passed to token_loss.
    backend="triton" (the default on CUDA): the segment-GEMM backend's one-GEMM blocks on half precision (Triton
    GEMMs, cuBLAS dX / dW), chunk GEMMs with the logits op's Triton passes otherwise; "torch": the chunk GEMMs with
    the logits op's PyTorch code (any device).

    Gradients: dX [T, H] in hidden's dtype (fp32 accumulation over this rank's segments, all-reduced in fp32 over
    tp_group when reduce_dx, one rounding); dW [V_local, H] in weight's dtype, fp32 accumulation, rounded once (for
    an upstream 1), TP-invariant bit for bit.
    Memory held from forward to backward: dX and dW. Working memory (CUDA, half precision, 16-byte aligned rows):
    the logits of a row block as fp16 probabilities, then its dlogits in place (2 bytes per logit). Every row is one
    block where its probabilities, its fp32 dX rows and dW (in the probabilities' own storage once the block has 2 H
    rows, else beside them) fit the allowance, `working_memory` bytes (default None: 3.125 GiB): dW is then one GEMM
    per vocabulary segment written in weight's dtype in the forward, and keeps the storage it was written into until
    released (T x V_local x 2 bytes). Else blocks of a fixed number of rows (a function of H, the segment length and
    the allowance only: 2816 at Qwen3-8B's shape by default) beside an fp32 dW accumulator (V_local x H x 4 bytes),
    rounded in backward into its own storage, which dW keeps (2x dW's size); the blocks' rows are the most that fit
    the allowance beside the accumulator, at least 1024 (an allowance below that takes 1024-row blocks: the least
    this layout holds). A larger allowance means fewer blocks (dW's accumulator read and written once per block);
    set it to what the caller's step can spare. working_memory must be the same on every rank (the blocks set the
    collectives; validate=True checks it).
    Other inputs: 1024-row blocks whose fp32 logits are held (1024 x V_local x 4 bytes) with their dlogits (half
    that). The figures at Qwen3's shapes: docs/performance.md.

    Failure of token_loss (validate=True): at TP = 1 it raises at once (the loss's own exception, or the TypeError /
    ValueError naming token_loss). At TP > 1 the loss runs between collectives, so a rank never raises there alone:
    it keeps its failure, goes on to the end of the forward with zero gradients, and the ranks all-gather their end
    flags (one more small all-gather, no extra host read); every rank then raises the same error naming the ranks at
    fault, each faulty rank from its own exception (raised: RuntimeError; wrong type or dtype: TypeError; wrong
    shape or device, or non-finite values or gradients: ValueError). validate=False: a failure raises on its rank at
    once and the others wait in their next collective until the group's timeout; non-finite values go unchecked.

    Host syncs on CUDA with validate=True: one at TP = 1 (the end-of-forward value read), two at TP > 1 (the header
    exchange before the first all-gather, the end flags); a row_mask adds one (the kept-row count). validate=False:
    none (plus the row mask's). Under torch.no_grad nothing is kept and only the loss value and the metrics are formed
    (on the one-GEMM blocks their forward alone, without the probabilities: one GEMM's work, the same values).
    """
    options = dict(tp_group=tp_group, entropy=entropy, keep=keep, temperature=temperature, row_mask=row_mask,
                   vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend, validate=validate,
                   working_memory=working_memory)
    if not torch.compiler.is_compiling():
        return _token_loss_eager(hidden, weight, tokens, token_loss, **options)
    loss, log_prob, ent = token_loss_op.linear_token_loss(hidden, weight, tokens, token_loss, **options)
    return loss, LogProbsEntropy(log_prob, ent)


def _token_loss_eager(hidden, weight, tokens, token_loss, *, tp_group, entropy, keep, temperature, row_mask,
                      vocab_size, reduce_dx, backend, validate, working_memory) -> tuple:
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:  # else the shell's checks name hidden
        agreement.check_collectively("linear_token_loss", tp_group, validate, hidden, checks.check_token_loss_rows,
                                     "linear_token_loss", token_loss, tuple(hidden.shape[:-1]), "hidden.shape[:-1] =")
    call = shell.prepare_lm_head(
        "linear_token_loss", hidden, weight, tokens, tp_group=tp_group, entropy=entropy, temperature=temperature,
        row_mask=row_mask, vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend, validate=validate,
        token_loss=token_loss, fused_loss=True, keep=keep, working_memory=working_memory)
    keep_arg = () if call.keep is None else (call.keep,)  # the Function's last argument, given only with keep
    with shell.on_device(call):
        loss, log_prob, ent = LinearTokenLossFunction.apply(call.rows, weight, call.tokens, call.row_mask, call.plan,
                                                            token_loss, *keep_arg)
    return loss, _outputs((log_prob, ent) if entropy != "none" else log_prob, call)



def _outputs(out, call: shell.Call) -> LogProbsEntropy:
    """A Function's log-prob (and entropy) outputs, [T] each, in the call's leading shape."""
    return _shaped_outputs(out, call.plan.entropy_mode, call.lead)


def _shaped_outputs(out, entropy_mode: str, lead: tuple) -> LogProbsEntropy:
    if entropy_mode == "none":
        return LogProbsEntropy(shell.shaped(out, lead), None)
    log_prob, ent = out
    return LogProbsEntropy(shell.shaped(log_prob, lead), shell.shaped(ent, lead))
