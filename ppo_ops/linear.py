"""Public API of the fused LM head: log-probs and entropy straight from hidden states, vocab-parallel, no [T, V] logits.

A thin wrapper: check arguments (before any collective), resolve the TP layout and the backend, flatten the leading
dimensions, call LinearLogProbEntropyFunction (ppo_ops/_linear_function.py), restore the leading dimensions.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch

from ppo_ops import _linear_torch, _validate
from ppo_ops._layout import make_layout
from ppo_ops._linear_function import LinearLogProbEntropyFunction, LinearPlan
from ppo_ops.api import LogProbsEntropy

_FN = "linear_log_probs_and_entropy"


def linear_log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    tp_group=None,
    entropy: str = "none",
    temperature: float = 1.0,
    row_mask: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    reduce_dx: bool = True,
    backend: str = "auto",
    validate: bool = True,
) -> LogProbsEntropy:
    """Log-probability of each target token and the entropy of each row, from hidden states and a (vocab-parallel)
    LM-head weight, without ever holding the [T, V] logits.

    Same semantics and outputs as `log_probs_and_entropy(hidden @ weight.T, tokens, ...)` with the logits accumulated
    in fp32 (never rounded to the input dtype): per-token log-probs and entropies in fp32, gradients for `hidden` and
    `weight` in their dtype. Guarantees:
      - bitwise deterministic run to run (fixed tile shapes and reduction orders, no atomics);
      - bitwise identical log-probs, entropies and dW at every TP size: a column's logit never depends on which rank
        computes it (tiles start at the fixed global segments, the K loop over H is fixed), and the per-segment
        partials go through the logits op's all-gather and fixed-order merge;
      - backend="torch": bitwise identical to `log_probs_and_entropy(logits, ..., backend="torch")` on the fp32 logits
        its tiles produce (it runs that op's own code on each tile); backend="triton": the same logits, reduced
        over [rows x columns] GEMM tiles instead of the logits kernel's lanes, so equal to the logits op within its
        fp32 tolerances. The Triton backward rounds dlogits to the input dtype before its tensor-core GEMMs.
    The logits exist only as bounded tiles in forward and are recomputed tile by tile in backward: 4 GEMMs' worth of
    work instead of the unfused path's 3 (forward, recompute, dX, dW), so the fused op cannot beat 4/3 of the three
    GEMMs' time; it saves the [T, V] logits and their gradient. Extra memory: an fp32 dX accumulator [rows, H] and,
    on the Triton backend, one dlogits chunk of at most 128 MiB.

    Args:
      hidden: [..., H] float32/bfloat16/float16, the same on every rank of tp_group (the LM head's input).
      weight: [V_local, H], hidden's dtype and device; this rank's contiguous slice of the vocabulary
        ([rank * V_local, (rank + 1) * V_local)), as in Megatron's column-parallel output layer.
      tokens: hidden.shape[:-1] integer global token ids.
      tp_group: tensor-parallel process group, given explicitly (e.g. torch.distributed.group.WORLD for TP over
        the default group); None means one rank, always, also inside an initialised job. One rank issues no
        collective. Every rank of the group must call with the same hidden, rows, tokens, options and `validate`.
      entropy: "none"; "value" (returned without gradient); "grad" (differentiable).
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
        tokens and options) and make failure collective, as `log_probs_and_entropy` does (ppo_ops/_validate.py):
        one host read of values per call at any TP size: at TP = 1 at the end of the forward, at TP > 1 when the
        ranks' fixed-size headers have been all-gathered, before the partials' all-gather; every rank then raises
        the same error, naming the rank(s) at fault and the argument. A local argument error (a wrong shape, dtype
        or option) on one rank also raises on every rank. False: no value read, and what _validate lists is no
        longer guaranteed (an argument error raises on its own rank only, the others wait in the all-gather until
        the process group's timeout). Must be the same on every rank. Not checked either way: that `hidden` is the
        same on every rank.

    Host syncs per call on CUDA (forward + backward): validate=True, 1 without a row_mask and 2 with one (the kept-row
    count, needed to size the GEMMs before the partials exist, and the value read, which needs the partials);
    validate=False, 0 without a row_mask and 1 with one. On the CPU the count is no sync.

    Options of `log_probs_and_entropy` that do not apply:
      keep_mask: a dense [T, V] mask is as large as the logits this op exists not to hold.
      inplace_grad: there is no logits tensor whose storage could take the gradient.
      chunk_size: replaced by the backends' fixed GEMM tiles, which are part of the bit-exactness contract.

    Gradient: dW is this rank's [V_local, H] slice (no communication); dX as `reduce_dx` says. dW's bits are
    TP-invariant like the log-probs; dX's are deterministic but, at TP > 1, summed in a different order than at
    TP = 1 (within rounding of fp32).

    Returns:
      LogProbsEntropy(log_probs, entropy), float32, shaped like tokens.
    """
    group, world_size, rank = _validate.check_tp_group(_FN, tp_group)
    try:
        call = _prepare(hidden, weight, tokens, group, world_size, rank, entropy=entropy, temperature=temperature,
                        row_mask=row_mask, vocab_size=vocab_size, reduce_dx=reduce_dx, backend=backend,
                        validate=validate)
    except Exception as exc:
        # TP > 1 with validate=True: the other ranks learn of this error from the header exchange and raise with it.
        _validate.raise_collectively(_FN, exc, group, world_size, validate, hidden)
    out = LinearLogProbEntropyFunction.apply(call.hidden, weight, call.tokens, call.row_mask, call.plan)
    if entropy == "none":
        return LogProbsEntropy(out.reshape(call.lead), None)
    log_prob, ent = out
    return LogProbsEntropy(log_prob.reshape(call.lead), ent.reshape(call.lead))


class _Call(NamedTuple):
    """A call whose arguments passed the local checks: what LinearLogProbEntropyFunction.apply takes, and the lead
    shape."""

    hidden: torch.Tensor  # [T, H]
    tokens: torch.Tensor  # [T]
    row_mask: Optional[torch.Tensor]  # [T] or None
    plan: LinearPlan
    lead: tuple


def _prepare(hidden, weight, tokens, group, world_size, rank, *, entropy, temperature, row_mask, vocab_size,
             reduce_dx, backend, validate) -> _Call:
    """Every local check (no tensor value read, no collective), the layout and the backend."""
    temperature, inv_temperature, _, vocab_size = _validate.check_options(
        _FN, entropy=entropy, backend=backend, temperature=temperature, chunk_size=None, vocab_size=vocab_size,
        inplace_grad=False, validate=validate,
    )
    if not isinstance(reduce_dx, bool):
        raise _validate.argument_error(TypeError, _FN, "reduce_dx",
                                       f"reduce_dx must be a bool, got {type(reduce_dx).__name__}")
    _check_tensors(hidden, weight, tokens, row_mask)
    lead, width = tuple(hidden.shape[:-1]), hidden.shape[-1]
    layout = make_layout(group, world_size, rank, weight.shape[0], vocab_size)
    _validate.check_vocab(_FN, vocab_size, layout.v_global)
    selected = _select_backend(backend, hidden)
    n_rows = math.prod(lead)
    plan = LinearPlan(
        fn_name=_FN,
        layout=layout,
        backend=selected,
        temperature=temperature,
        inv_temperature=inv_temperature,
        entropy_mode=entropy,
        reduce_dx=reduce_dx,
        validate=validate,
    )
    return _Call(hidden.reshape(n_rows, width), tokens.reshape(n_rows),
                 None if row_mask is None else row_mask.reshape(n_rows), plan, lead)


def _check_tensors(hidden, weight, tokens, row_mask) -> None:
    def fail(exc_type, name, detail):
        raise _validate.argument_error(exc_type, _FN, name, detail)

    if not isinstance(hidden, torch.Tensor):
        fail(TypeError, "hidden", f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dtype not in _validate.FLOAT_DTYPES:
        fail(TypeError, "hidden", f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if hidden.is_meta:
        fail(ValueError, "hidden", "hidden must be on a device with values (CPU or CUDA), got meta: the op reads them")
    if hidden.dim() < 2 or hidden.shape[-1] < 1:
        fail(ValueError, "hidden",
             f"hidden must have shape [..., H] with at least 2 dims and H >= 1, got {tuple(hidden.shape)}")
    if not isinstance(weight, torch.Tensor):
        fail(TypeError, "weight", f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype != hidden.dtype:
        fail(TypeError, "weight", f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] != hidden.shape[-1]:
        fail(ValueError, "weight", f"weight must have shape [V_local, H] = [>= 1, {hidden.shape[-1]}] "
                                   f"(H = hidden.shape[-1]), got {tuple(weight.shape)}")
    if weight.device != hidden.device:
        fail(ValueError, "weight", f"weight must be on {hidden.device} like hidden, got {weight.device}")
    lead = tuple(hidden.shape[:-1])
    _validate.check_row_tensors(_FN, "hidden", hidden.device, lead, tokens, (("row_mask", row_mask, lead),))


def _select_backend(backend: str, hidden: torch.Tensor):
    if backend == "torch" or (backend == "auto" and not hidden.is_cuda):
        return _linear_torch
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if backend == "triton" and not (hidden.is_cuda or interpreted):
        raise _validate.argument_error(
            ValueError, _FN, "backend",
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported, to run its "
            f"kernels on CPU), got hidden on {hidden.device}")
    try:
        from ppo_ops import _linear_triton
    except ImportError as err:
        if backend == "auto":
            return _linear_torch
        raise _validate.argument_error(
            RuntimeError, _FN, "backend",
            f"backend='triton' is unavailable ({err}); install triton (pip install triton) or use backend='torch'"
        ) from err
    return _linear_triton
