"""Public API: fused vocab-parallel log-prob + entropy, and a drop-in for slime's calculate_log_probs_and_entropy.

Both are thin wrappers: check arguments (before any collective), resolve the TP layout and the backend, flatten the
leading dimensions, call LogProbEntropyFunction (ppo_ops/_function.py), restore the leading dimensions.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch

from ppo_ops import _row_stats, _torch_backend, _validate
from ppo_ops._function import LogProbEntropyFunction, Plan
from ppo_ops._layout import make_layout


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
      tp_group: tensor-parallel process group; None = the default group when torch.distributed is initialised,
        else a single rank. One rank issues no collective.
      entropy: "none"; "value" (returned without gradient, nothing kept for backward); "grad" (differentiable).
      keep_mask: logits.shape bool; log-probs are normalised over keep_mask ∪ {target} (the target is always kept);
        the entropy is always over the full distribution.
      temperature: both quantities use logits / temperature, and the gradient carries the 1 / temperature factor.
      row_mask: logits.shape[:-1] bool; False rows get log-prob 0, entropy 0 and gradient 0, cost no compute, and
        their tokens are not checked.
      vocab_size: the true global vocabulary; global columns at or past it are padding (no mass, zero gradient).
      chunk_size: rows per working chunk, bounding the PyTorch backend's fp32 buffers in forward and backward
        (None or -1: an automatic bound). Results are bitwise identical for every chunk size.
      inplace_grad: backward writes the gradient into the logits' storage and returns it as their gradient; the
        logits' values are lost, so nothing else may need them afterwards (autograd's version counter flags saved
        uses), and a second backward through this op raises.
      backend: "auto" (triton for CUDA tensors when triton imports, else torch), "torch" or "triton".
      validate: run the checks that read tensor values (token range; NaN / +inf logits; ranks agreeing on rows,
        tokens and options). On CUDA they cost host syncs (one at TP = 1, at the end of the forward; three at
        TP > 1), each exposing the host time of what follows; set False once inputs are known good.

    Returns:
      LogProbsEntropy(log_probs, entropy), float32, shaped like tokens. Bitwise deterministic run to run.
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
    """Drop-in replacement for slime's function of the same name.

    Returns (log_prob [T, 1] float32 (shape (0,) when T == 0), entropy [T] float32 or None). Unlike slime's, the
    entropy stays finite when some logits are -inf.
    """
    mode = "none" if not with_entropy else ("grad" if with_entropy_grad else "value")
    result = _compute(
        "calculate_log_probs_and_entropy", logits, tokens, tp_group=tp_group, entropy=mode,
        keep_mask=log_prob_keep_mask, temperature=1.0, row_mask=None, vocab_size=None, chunk_size=chunk_size,
        inplace_grad=False, backend="auto", validate=True,
    )
    log_prob = result.log_probs
    log_prob = log_prob.reshape(0) if log_prob.numel() == 0 else log_prob.unsqueeze(-1)
    return log_prob, result.entropy


def _select_backend(fn_name: str, backend: str, logits: torch.Tensor):
    if backend == "torch":
        return _torch_backend
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if backend == "auto":
        if not logits.is_cuda:
            return _torch_backend
        try:
            from ppo_ops import _triton_backend
        except ImportError:
            return _torch_backend
        return _triton_backend
    if not (logits.is_cuda or interpreted):
        raise ValueError(
            f"ppo_ops.{fn_name}: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
            f"imported, to run its kernels on CPU), got logits on {logits.device}"
        )
    try:
        from ppo_ops import _triton_backend
    except ImportError as err:
        raise RuntimeError(
            f"ppo_ops.{fn_name}: backend='triton' is unavailable ({err}); install triton (pip install triton) or use "
            "backend='torch'"
        ) from err
    return _triton_backend


def _compute(
    fn_name, logits, tokens, *, tp_group, entropy, keep_mask, temperature, row_mask, vocab_size, chunk_size,
    inplace_grad, backend, validate,
) -> LogProbsEntropy:
    temperature = _validate.check_options(
        fn_name, entropy=entropy, backend=backend, temperature=temperature, chunk_size=chunk_size,
        vocab_size=vocab_size, inplace_grad=inplace_grad,
    )
    _validate.check_tensors(fn_name, logits, tokens, keep_mask, row_mask)
    lead, v_local = tuple(logits.shape[:-1]), logits.shape[-1]
    layout = make_layout(tp_group, v_local, vocab_size)
    _validate.check_vocab(fn_name, vocab_size, layout.v_global)
    if validate and layout.group is not None:
        # Before the first collective; at TP = 1 the forward reads it with its other checks (one host sync).
        _validate.check_token_range(fn_name, tokens, row_mask, layout.vocab_size)
    selected = _select_backend(fn_name, backend, logits)

    n_rows = math.prod(lead)
    logits2d = _flatten_logits(fn_name, logits, n_rows, v_local, inplace_grad, needs_unit_stride=selected is not _torch_backend)
    tokens1d = tokens.reshape(n_rows)
    keep2d = None if keep_mask is None else keep_mask.reshape(n_rows, v_local)
    rows1d = None if row_mask is None else row_mask.reshape(n_rows)

    if validate and layout.group is not None:
        header = _row_stats.consistency_header(
            tokens1d, rows1d, v_local, vocab_size, temperature, entropy, keep_mask is not None, logits.device
        )
        _row_stats.check_consistent_across_ranks(fn_name, header, layout)

    plan = Plan(
        fn_name=fn_name,
        layout=layout,
        backend=selected,
        inv_temperature=_inverse_temperature(temperature),
        entropy_mode=entropy,
        chunk_rows=None if chunk_size in (None, -1) else chunk_size,
        inplace_grad=inplace_grad,
        validate=validate,
    )
    out = LogProbEntropyFunction.apply(logits2d, tokens1d, keep2d, rows1d, plan)
    if entropy == "none":
        return LogProbsEntropy(out.reshape(lead), None)
    log_prob, ent = out
    return LogProbsEntropy(log_prob.reshape(lead), ent.reshape(lead))


def _inverse_temperature(temperature: float) -> float:
    """1 / temperature rounded to fp32 once, so every backend multiplies by the same constant."""
    return float(torch.tensor(1.0 / temperature, dtype=torch.float32).item())


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
            raise ValueError(
                f"ppo_ops.{fn_name}: inplace_grad=True needs logits whose leading dims flatten without a copy "
                f"(got shape {tuple(logits.shape)}, strides {logits.stride()})"
            ) from err
        if needs_unit_stride and v_local > 1 and flat.stride(1) != 1:
            raise ValueError(f"ppo_ops.{fn_name}: inplace_grad=True with this backend needs logits.stride(-1) == 1")
        return flat
    flat = logits.reshape(n_rows, v_local)
    if needs_unit_stride and v_local > 1 and flat.stride(1) != 1:
        flat = flat.contiguous()
    return flat
