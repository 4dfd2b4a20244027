"""Public API: fused vocab-parallel log-prob + entropy, and a drop-in for slime's calculate_log_probs_and_entropy.

Both are thin wrappers: check arguments (before any collective), resolve the TP layout and the backend, flatten the
leading dimensions, call LogProbEntropyFunction (ppo_ops/_function.py), restore the leading dimensions.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ppo_ops.core import checks
from ppo_ops.logits import torch_backend
from ppo_ops.core.contracts import Backend, ShardOptions
from ppo_ops.logits.function import LogProbEntropyFunction, Plan
from ppo_ops.core.layout import make_layout


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
    temperature: float = 1.0,
    row_mask: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    inplace_grad: bool = False,
    backend: str = "auto",
    validate: bool = True,
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
        False: no host sync, and what ppo_ops/checks.py lists is no longer guaranteed (out-of-range tokens, NaN
        logits and ranks that disagree give wrong results, or an error or wait until the process group's timeout;
        an argument error raises on its own rank only). Must be the same on every rank.

    Returns:
      LogProbsEntropy(log_probs, entropy), float32, shaped like tokens. Bitwise deterministic run to run.

    Unsupported: float64 logits (TypeError; the kernels compute in fp32 and the fp32 guarantees would not hold);
    torch.func transforms (vmap, grad, jvp: the autograd Function has no vmap or forward-mode rule, and the
    collectives and value checks act on whole tensors); torch.compile(fullgraph=True) (the value checks read the
    device and the collectives run in Python: a graph break; without fullgraph the op runs eagerly inside a
    compiled model).
    """
    return _compute(
        "log_probs_and_entropy", logits, tokens, tp_group=tp_group, entropy=entropy, keep_mask=keep_mask,
        temperature=temperature, row_mask=row_mask, vocab_size=vocab_size, chunk_size=chunk_size,
        inplace_grad=inplace_grad, backend=backend, validate=validate,
    )


def calculate_log_probs_and_entropy(
    logits,
    tokens,
    tp_group,
    with_entropy: bool = False,
    chunk_size: int = -1,
    log_prob_keep_mask: Optional[torch.Tensor] = None,
    with_entropy_grad: bool = True,
):
    """Drop-in replacement for slime's function of the same name, argument by argument.

    Returns (log_prob [T, 1] float32 (shape (0,) when T == 0), entropy [T] float32 or None). As in slime's (and every
    torch.distributed call), tp_group=None is the default group when torch.distributed is initialised, and one rank
    otherwise; every chunk_size <= 0 means no chunking. Unlike slime's, the entropy stays finite when some logits are
    -inf. Values are validated (validate=True: one host sync per call).
    """
    if tp_group is None and dist.is_available() and dist.is_initialized():
        tp_group = dist.group.WORLD
    if _is_number(chunk_size) and chunk_size <= 0:
        chunk_size = None
    mode = "none" if not with_entropy else ("grad" if with_entropy_grad else "value")
    result = _compute(
        "calculate_log_probs_and_entropy", logits, tokens, tp_group=tp_group, entropy=mode,
        keep_mask=log_prob_keep_mask, temperature=1.0, row_mask=None, vocab_size=None, chunk_size=chunk_size,
        inplace_grad=False, backend="auto", validate=True,
    )
    log_prob = result.log_probs
    log_prob = log_prob.reshape(0) if log_prob.numel() == 0 else log_prob.unsqueeze(-1)
    return log_prob, result.entropy


def _is_number(value) -> bool:
    """A real number, or a one-element tensor of one (bool aside): what the option checks would read as one."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.dtype != torch.bool and not value.dtype.is_complex
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def backend_kind(fn_name: str, backend: str, tensor: torch.Tensor, name: str) -> str:
    """"torch" or "triton": the choice every op of ppo_ops makes for backend="auto" | "torch" | "triton" on `tensor`
    (its argument `name`: logits, hidden). auto: triton for CUDA tensors when triton imports, else torch;
    triton: CUDA tensors, or CPU ones under TRITON_INTERPRET=1 (set before triton is imported), and triton importable,
    else an error naming `backend`."""
    if backend == "torch":
        return "torch"
    if backend == "auto" and not tensor.is_cuda:
        return "torch"
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if backend == "triton" and not (tensor.is_cuda or interpreted):
        raise checks.argument_error(
            ValueError, fn_name, "backend",
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is imported, to run its "
            f"kernels on CPU), got {name} on {tensor.device}")
    try:
        import triton  # noqa: F401
    except ImportError as err:
        if backend == "auto":
            return "torch"
        raise checks.argument_error(
            RuntimeError, fn_name, "backend",
            f"backend='triton' is unavailable ({err}); install triton (pip install triton) or use backend='torch'"
        ) from err
    return "triton"


def _select_backend(fn_name: str, backend: str, logits: torch.Tensor) -> Backend:
    if backend_kind(fn_name, backend, logits, "logits") == "torch":
        return torch_backend.BACKEND
    from ppo_ops.logits import triton_backend

    return triton_backend.BACKEND


class _Call(NamedTuple):
    """A call whose arguments passed the local checks: what LogProbEntropyFunction.apply takes, and the lead shape."""

    logits: torch.Tensor  # [T, V_local]
    tokens: torch.Tensor  # [T]
    keep_mask: Optional[torch.Tensor]  # [T, V_local] or None
    row_mask: Optional[torch.Tensor]  # [T] or None
    plan: Plan
    lead: tuple


def _compute(
    fn_name, logits, tokens, *, tp_group, entropy, keep_mask, temperature, row_mask, vocab_size, chunk_size,
    inplace_grad, backend, validate,
) -> LogProbsEntropy:
    group, world_size, rank = checks.check_tp_group(fn_name, tp_group)
    try:
        call = _prepare(fn_name, logits, tokens, group, world_size, rank, entropy=entropy, keep_mask=keep_mask,
                        temperature=temperature, row_mask=row_mask, vocab_size=vocab_size, chunk_size=chunk_size,
                        inplace_grad=inplace_grad, backend=backend, validate=validate)
    except Exception as exc:
        # TP > 1 with validate=True: the other ranks learn of this error from the header exchange and raise with it.
        checks.raise_collectively(fn_name, exc, group, world_size, validate, logits)
    out = LogProbEntropyFunction.apply(call.logits, call.tokens, call.keep_mask, call.row_mask, call.plan)
    if entropy == "none":
        return LogProbsEntropy(out.reshape(call.lead), None)
    log_prob, ent = out
    return LogProbsEntropy(log_prob.reshape(call.lead), ent.reshape(call.lead))


def _prepare(fn_name, logits, tokens, group, world_size, rank, *, entropy, keep_mask, temperature, row_mask,
             vocab_size, chunk_size, inplace_grad, backend, validate) -> _Call:
    """Every local check (no tensor value read, no collective), the layout and the backend."""
    temperature, inv_temperature, chunk_size, vocab_size = checks.check_options(
        fn_name, entropy=entropy, backend=backend, temperature=temperature, chunk_size=chunk_size,
        vocab_size=vocab_size, inplace_grad=inplace_grad, validate=validate,
    )
    checks.check_tensors(fn_name, logits, tokens, keep_mask, row_mask)
    lead, v_local = tuple(logits.shape[:-1]), logits.shape[-1]
    layout = make_layout(group, world_size, rank, v_local, vocab_size)
    checks.check_vocab(fn_name, vocab_size, layout.v_global)
    selected = _select_backend(fn_name, backend, logits)

    n_rows = math.prod(lead)
    logits2d = _flatten_logits(fn_name, logits, n_rows, v_local, inplace_grad,
                               needs_unit_stride=selected.needs_unit_column_stride)
    shard = ShardOptions(
        inv_temperature=inv_temperature,
        n_valid=layout.n_valid,
        seg_len=layout.seg_len,
        vocab_start=layout.vocab_start,
        chunk_rows=None if chunk_size in (None, -1) else chunk_size,
    )
    plan = Plan(fn_name=fn_name, layout=layout, backend=selected, shard=shard, temperature=temperature,
                entropy_mode=entropy, inplace_grad=inplace_grad, validate=validate)
    return _Call(logits2d, tokens.reshape(n_rows), None if keep_mask is None else keep_mask.reshape(n_rows, v_local),
                 None if row_mask is None else row_mask.reshape(n_rows), plan, lead)


def _flatten_logits(fn_name, logits, n_rows, v_local, inplace_grad, needs_unit_stride):
    flat = _flatten_logits_view(fn_name, logits, n_rows, v_local, inplace_grad, needs_unit_stride)
    if v_local == 1 and flat.stride(1) != 1:
        # One column: its stride is meaningless; give it the unit stride kernels expect (same storage, a view).
        flat = flat.as_strided((n_rows, 1), (flat.stride(0), 1))
    return flat


def _flatten_logits_view(fn_name, logits, n_rows, v_local, inplace_grad, needs_unit_stride):
    if inplace_grad:
        try:
            flat = logits.view(n_rows, v_local)
        except RuntimeError as err:
            raise checks.argument_error(
                ValueError, fn_name, "inplace_grad",
                f"inplace_grad=True needs logits whose leading dims flatten without a copy (got shape "
                f"{tuple(logits.shape)}, strides {logits.stride()})") from err
        checks.check_inplace_target(fn_name, flat, needs_unit_stride)
        return flat
    flat = logits.reshape(n_rows, v_local)
    if needs_unit_stride and v_local > 1 and flat.stride(1) != 1:
        flat = flat.contiguous()
    return flat
