"""Argument checks for log_probs_and_entropy, all raised before any collective.

Checks that are free (dtypes, shapes, option values) always run. Checks that read tensor values (the token range,
NaN / +inf logits) need a host sync on CUDA and run only with `validate=True` (the default). A sync stalls the GPU
until the host has launched everything after it, so there are as few as the rule "raise before any collective"
allows: at TP = 1 one, after the forward kernels (token bounds and the bad-logits flag read together); at TP > 1 the
token range before the first collective, the ranks' consistency header, then the bad-logits flag. Rows dropped by `row_mask` are not range
checked: prompt rows routinely carry placeholder ids such as -100.

Errors name the argument and what was expected: TypeError for a wrong dtype or type, ValueError for a wrong shape
or value.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

ENTROPY_MODES = ("none", "value", "grad")
BACKENDS = ("auto", "torch", "triton")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _prefix(fn_name: str) -> str:
    return f"ppo_ops.{fn_name}: "


def check_options(
    fn_name: str,
    *,
    entropy: str,
    backend: str,
    temperature,
    chunk_size,
    vocab_size,
    inplace_grad: bool,
) -> float:
    """Checks the non-tensor options; returns the temperature as a python float."""
    p = _prefix(fn_name)
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"{p}entropy must be one of {ENTROPY_MODES}, got {entropy!r}")
    if backend not in BACKENDS:
        raise ValueError(f"{p}backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError(f"{p}temperature must be a scalar, got a tensor of shape {tuple(temperature.shape)}")
        temperature = temperature.item()
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{p}temperature must be a real number, got {type(temperature).__name__}")
    temperature = float(temperature)
    if not math.isfinite(temperature) or temperature <= 0.0:
        raise ValueError(f"{p}temperature must be finite and > 0, got {temperature}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
            raise TypeError(f"{p}chunk_size must be an int (-1 or >= 1) or None, got {type(chunk_size).__name__}")
        if chunk_size == 0 or chunk_size < -1:
            raise ValueError(f"{p}chunk_size must be -1 (no chunking) or >= 1, got {chunk_size}")
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
            raise TypeError(f"{p}vocab_size must be an int or None, got {type(vocab_size).__name__}")
        if vocab_size < 1:
            raise ValueError(f"{p}vocab_size must be >= 1, got {vocab_size}")
    if not isinstance(inplace_grad, bool):
        raise TypeError(f"{p}inplace_grad must be a bool, got {type(inplace_grad).__name__}")
    return temperature


def check_tensors(
    fn_name: str,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    keep_mask: Optional[torch.Tensor],
    row_mask: Optional[torch.Tensor],
) -> None:
    p = _prefix(fn_name)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{p}logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{p}logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() < 2:
        raise ValueError(f"{p}logits must have shape [..., V_local] with at least 2 dims, got {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError(f"{p}logits must have a non-empty vocabulary dimension, got {tuple(logits.shape)}")
    lead = tuple(logits.shape[:-1])
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{p}tokens must be a torch.Tensor of integer ids, got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"{p}tokens must hold integer token ids, got dtype {tokens.dtype}")
    if tuple(tokens.shape) != lead:
        raise ValueError(
            f"{p}tokens must have shape {lead} (logits.shape[:-1]), got {tuple(tokens.shape)}: token/logit length mismatch"
        )
    if tokens.device != logits.device:
        raise ValueError(f"{p}tokens must be on {logits.device} like logits, got {tokens.device}")
    for name, mask, shape in (("keep_mask", keep_mask, tuple(logits.shape)), ("row_mask", row_mask, lead)):
        if mask is None:
            continue
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"{p}{name} must be a bool torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"{p}{name} must have dtype torch.bool, got {mask.dtype}")
        if tuple(mask.shape) != shape:
            raise ValueError(f"{p}{name} must have shape {shape}, got {tuple(mask.shape)}")
        if mask.device != logits.device:
            raise ValueError(f"{p}{name} must be on {logits.device} like logits, got {mask.device}")


def check_vocab(fn_name: str, vocab_size: Optional[int], v_global: int) -> None:
    if vocab_size is not None and vocab_size > v_global:
        raise ValueError(
            f"{_prefix(fn_name)}vocab_size must be <= the global vocabulary V_local * tp_size = {v_global}, got {vocab_size}"
        )


def token_bounds(tokens: torch.Tensor, row_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """[2] int64 (min, max) of the kept rows' token ids, on their device, without a host sync. Dropped rows count
    as id 0 (always in range); no rows at all gives (0, 0)."""
    t = tokens.reshape(-1).to(torch.int64)
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=tokens.device)
    if row_mask is not None:
        t = torch.where(row_mask.reshape(-1), t, torch.zeros_like(t))
    return torch.stack(torch.aminmax(t))


def raise_if_out_of_range(fn_name: str, lo: int, hi: int, upper: int, has_row_mask: bool) -> None:
    """Token ids of kept rows must lie in [0, upper)."""
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"{_prefix(fn_name)}tokens must be global token ids in [0, {upper}), found {bad}"
            + (" (rows dropped by row_mask are not checked)" if has_row_mask else "")
        )


def check_token_range(
    fn_name: str, tokens: torch.Tensor, row_mask: Optional[torch.Tensor], upper: int
) -> None:
    """The token range check on its own: a host sync on CUDA. At TP > 1 it must run before the first collective;
    at TP = 1 the core reads the bounds together with its other checks after the forward (one sync, not two)."""
    lo, hi = token_bounds(tokens, row_mask).tolist()
    raise_if_out_of_range(fn_name, lo, hi, upper, row_mask is not None)
