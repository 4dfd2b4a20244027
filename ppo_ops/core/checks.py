"""Local argument checks: types, shapes, devices and option values, read from no tensor value and issuing no
collective, for both ops.

They always run. At one rank (or with validate=False) their errors raise at once; at TP > 1 with validate=True the
call shell (core/shell.py) hands an error to the cross-rank agreement (core/agreement.py), so every rank raises it.
Errors name the argument (kept on the exception as `ppo_ops_argument`, which the agreement's header carries) and what
was expected: TypeError for a wrong dtype or type, ValueError for a wrong shape or value.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
import torch.distributed as dist

from ppo_ops.core.contracts import inverse_fp32
from ppo_ops.core.row_stats import FLT_MAX

ENTROPY_MODES = ("none", "value", "grad")
REDUCTION_ORDERS = ("fused", "sglang")
BACKENDS = ("auto", "torch", "triton")
SGLANG_BLOCK = 1024  # columns per block of SGLang's log_softmax kernel (logits/sglang_order.py reduces in its order)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Smallest temperature accepted: 1 / temperature, rounded to fp32 (the kernels multiply by it), must be finite.
MIN_TEMPERATURE = 1.0 / FLT_MAX
# The plan's temperature where the caller gave one per row (a [T] tensor): no scalar is a valid temperature <= 0, so
# the ranks' headers tell the two apart.
ROW_TEMPERATURE = -1.0


def error_prefix(fn_name: str) -> str:
    return f"ppo_ops.{fn_name}: "


def argument_error(exc_type, fn_name: str, argument: str, detail: str) -> Exception:
    """An exception whose message starts with the function and names `argument`; `argument` is kept on it so that
    the cross-rank header can say which argument a rank rejected."""
    exc = exc_type(f"{error_prefix(fn_name)}{detail}")
    exc.ppo_ops_argument = argument
    return exc


# ---- local checks (no tensor values read) ----

def _scalar(fn_name: str, name: str, value, integral: bool):
    """A Python/NumPy number or a one-element tensor as a Python int (integral) or float."""
    kind = "an int" if integral else "a real number"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise argument_error(ValueError, fn_name, name,
                                 f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        if value.is_meta:
            raise argument_error(ValueError, fn_name, name,
                                 f"{name} must have a value, got a tensor on the meta device")
        if value.dtype == torch.bool or value.dtype.is_complex or (integral and value.dtype.is_floating_point):
            raise argument_error(TypeError, fn_name, name, f"{name} must be {kind}, got a {value.dtype} tensor")
        value = value.item()  # a host read of its own when the tensor is on a GPU
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integral else numbers.Real):
        raise argument_error(TypeError, fn_name, name, f"{name} must be {kind}, got {type(value).__name__}")
    return int(value) if integral else float(value)


def check_working_memory(fn_name: str, working_memory) -> Optional[int]:
    """The LM head's working_memory: None or bytes >= 0, as a Python int."""
    if working_memory is None:
        return None
    value = _scalar(fn_name, "working_memory", working_memory, integral=True)
    if value < 0:
        raise argument_error(ValueError, fn_name, "working_memory",
                             f"working_memory must be a number of bytes >= 0 or None, got {value}")
    return value


def check_reduction_order(fn_name: str, reduction_order, keep_mask) -> None:
    if not isinstance(reduction_order, str) or reduction_order not in REDUCTION_ORDERS:
        raise argument_error(ValueError, fn_name, "reduction_order",
                             f"reduction_order must be one of {REDUCTION_ORDERS}, got {reduction_order!r}")
    if reduction_order == "sglang" and keep_mask is not None:
        raise argument_error(ValueError, fn_name, "keep_mask",
                             "keep_mask must be None with reduction_order='sglang' (SGLang's log_softmax normalises "
                             "over the full vocabulary)")


def check_sglang_shard(fn_name: str, layout, argument: str = "logits") -> None:
    """reduction_order="sglang" on this vocabulary layout: a block may span at most two ranks."""
    if layout.world_size > 1 and layout.v_local < SGLANG_BLOCK:
        raise argument_error(
            ValueError, fn_name, argument,
            f"reduction_order='sglang' needs at least {SGLANG_BLOCK} vocabulary columns per tensor-parallel rank (a "
            f"{SGLANG_BLOCK}-column block may span at most two ranks), got V_local={layout.v_local}")


# The GPU generation the LM head's SGLang-order logits were checked on against SGLang's own matmul (compute
# capability major): another generation's MMA may add a tile's products otherwise.
SGLANG_HEAD_CAPABILITY = 9


def check_lm_head_order(fn_name: str, reduction_order, keep, kind: str, device: torch.device) -> None:
    """The LM head's reduction_order: "fused", or "sglang" where its logits can be SGLang's (lm_head/sglang_head.py):
    no keep set; on CUDA the Triton backend on an sm_90 GPU. Elsewhere the error names reduction_order."""
    check_reduction_order(fn_name, reduction_order, None)
    if reduction_order != "sglang":
        return
    if keep is not None:
        raise argument_error(ValueError, fn_name, "keep",
                             "keep must be None with reduction_order='sglang' (SGLang's log_softmax normalises over "
                             "the full vocabulary)")
    if device.type != "cuda":
        return
    if kind != "triton":
        raise argument_error(
            ValueError, fn_name, "reduction_order",
            "reduction_order='sglang' on CUDA needs backend='triton' (or 'auto'): SGLang's logits come from its "
            "batch-invariant Triton matmul, whose K order the torch backend's cuBLAS GEMM does not reproduce")
    major, minor = torch.cuda.get_device_capability(device)
    if major != SGLANG_HEAD_CAPABILITY:
        raise argument_error(
            ValueError, fn_name, "reduction_order",
            f"reduction_order='sglang' reproduces SGLang's batch-invariant matmul on sm_{SGLANG_HEAD_CAPABILITY}0 "
            f"(Hopper) GPUs, where it was checked; this GPU is sm_{major}{minor}, whose matrix instructions may add "
            "a tile's products in another order. Use the logits op: log_probs_and_entropy(logits, ..., "
            "reduction_order='sglang') on the logits your engine's matmul formed")


def check_options(
    fn_name: str,
    *,
    entropy,
    backend,
    temperature,
    chunk_size,
    vocab_size,
    inplace_grad,
    validate,
) -> tuple:
    """Checks the non-tensor options; returns (temperature, 1 / temperature in fp32, chunk_size, vocab_size) as Python
    numbers (chunk_size and vocab_size may be None)."""
    if not isinstance(entropy, str) or entropy not in ENTROPY_MODES:
        raise argument_error(ValueError, fn_name, "entropy", f"entropy must be one of {ENTROPY_MODES}, got {entropy!r}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise argument_error(ValueError, fn_name, "backend", f"backend must be one of {BACKENDS}, got {backend!r}")
    if is_row_temperature(temperature):  # checked against the rows by check_row_temperature
        temperature, inv_temperature = ROW_TEMPERATURE, 1.0
        return temperature, inv_temperature, *_chunk_and_vocab(fn_name, chunk_size, vocab_size, inplace_grad, validate)
    temperature = _scalar(fn_name, "temperature", temperature, integral=False)
    if not math.isfinite(temperature) or temperature <= 0.0:
        raise argument_error(ValueError, fn_name, "temperature",
                             f"temperature must be finite and > 0, got {temperature}")
    inv_temperature = inverse_fp32(temperature)
    if not math.isfinite(inv_temperature):
        raise argument_error(
            ValueError, fn_name, "temperature",
            f"temperature must be >= {MIN_TEMPERATURE:.4g} (1 / temperature must fit in float32), got {temperature:g}")
    return temperature, inv_temperature, *_chunk_and_vocab(fn_name, chunk_size, vocab_size, inplace_grad, validate)


def _chunk_and_vocab(fn_name: str, chunk_size, vocab_size, inplace_grad, validate) -> tuple:
    if chunk_size is not None:
        chunk_size = _scalar(fn_name, "chunk_size", chunk_size, integral=True)
        if chunk_size == 0 or chunk_size < -1:
            raise argument_error(ValueError, fn_name, "chunk_size",
                                 f"chunk_size must be -1 (no chunking) or >= 1, got {chunk_size}")
    if vocab_size is not None:
        vocab_size = _scalar(fn_name, "vocab_size", vocab_size, integral=True)
        if vocab_size < 1:
            raise argument_error(ValueError, fn_name, "vocab_size", f"vocab_size must be >= 1, got {vocab_size}")
    for name, flag in (("inplace_grad", inplace_grad), ("validate", validate)):
        if not isinstance(flag, bool):
            raise argument_error(TypeError, fn_name, name, f"{name} must be a bool, got {type(flag).__name__}")
    return chunk_size, vocab_size


def is_row_temperature(temperature) -> bool:
    """A temperature per row: a tensor of other than one element (a one-element tensor is a scalar, read with
    .item(); for one row both mean the same)."""
    return isinstance(temperature, torch.Tensor) and temperature.numel() != 1


def check_row_temperature(fn_name: str, temperature, lead: tuple, source: str, device) -> None:
    """A per-row temperature: float32 of the rows' shape (`lead`, the leading shape of `source`) on their device.
    Its values (finite, > 0, a reciprocal that fits in float32) are read with the value checks (validate=True)."""
    if not is_row_temperature(temperature):
        return
    if temperature.dtype != torch.float32:
        raise argument_error(TypeError, fn_name, "temperature",
                             f"a per-row temperature must be a float32 tensor, got {temperature.dtype}")
    if tuple(temperature.shape) != lead:
        raise argument_error(
            ValueError, fn_name, "temperature",
            f"a per-row temperature must have the rows' shape {lead} ({source}.shape[:-1]), got "
            f"{tuple(temperature.shape)} (a scalar: a Python number or a one-element tensor)")
    if temperature.device != device:
        raise argument_error(ValueError, fn_name, "temperature",
                             f"a per-row temperature must be on {device} like {source}, got {temperature.device}")


def row_inverse_temperature(temperature: torch.Tensor, n_rows: int, row_mask: Optional[torch.Tensor]
                            ) -> torch.Tensor:
    """[n_rows] fp32 1 / temperature, each rounded once to fp32 from the float64 quotient as the scalar path rounds
    (so a row of temperature t gets the bits a scalar t gives); rows the row mask drops get 1 (they are not checked
    and their values are never used). The values the value checks reject give a non-finite or non-positive inverse
    (bad_inverse_rows)."""
    # detached: the temperature is a constant of the call (no gradient flows to it); an expanded view (one value per
    # sequence over its positions) reshapes to a copy
    inv = torch.reciprocal(temperature.detach().reshape(n_rows).to(torch.float64)).to(torch.float32)
    if row_mask is not None:
        inv = torch.where(row_mask.reshape(n_rows), inv, torch.ones_like(inv))
    return inv


def bad_inverse_rows(inv_temperature: torch.Tensor) -> torch.Tensor:
    """0-d bool: a row's temperature was not finite and > 0 with a reciprocal that fits in float32 (a NaN, an inf,
    a non-positive or a subnormal temperature gives an inverse that is NaN, 0, negative or infinite)."""
    return ~(torch.isfinite(inv_temperature) & (inv_temperature > 0)).all()


ROW_TEMPERATURE_VALUES = ("every kept row's temperature must be finite and > 0, with 1 / temperature finite in "
                          f"float32 (temperature >= {MIN_TEMPERATURE:.4g})")


def check_softcap(fn_name: str, softcap) -> Optional[float]:
    """softcap: None, or a finite real > 0 (a Python or NumPy scalar, or a one-element tensor), as a Python float."""
    if softcap is None:
        return None
    value = _scalar(fn_name, "softcap", softcap, integral=False)
    if not (math.isfinite(value) and value > 0.0) or not math.isfinite(inverse_fp32(value)):
        raise argument_error(ValueError, fn_name, "softcap",
                             f"softcap must be None or a finite real > 0 whose reciprocal fits in float32, got {value}")
    return value


def check_transform_support(fn_name: str, temperature, softcap, *, reduction_order="fused", keep=None) -> None:
    """A per-row temperature and a softcap are applied in the fused kernels' elementwise step; the paths that form or
    gather logits elsewhere refuse them, naming the argument."""
    for name, given in (("temperature", is_row_temperature(temperature)), ("softcap", softcap is not None)):
        if not given:
            continue
        what = "a per-row temperature" if name == "temperature" else "softcap"
        if reduction_order == "sglang":
            raise argument_error(
                ValueError, fn_name, name,
                f"{what} is not available with reduction_order='sglang' (SGLang's sampler divides by one scalar "
                "temperature and caps no logits): use reduction_order='fused'")
        if keep is not None:
            raise argument_error(
                ValueError, fn_name, name,
                f"{what} is not available with a sparse keep set (keep=(ids, offsets) gathers its kept logits "
                "outside the fused kernels): pass keep=None, or a dense keep_mask to log_probs_and_entropy")


def check_tp_group(fn_name: str, tp_group) -> tuple:
    """(group or None, world size, rank). None means one rank, always (also inside an initialised job); TP over the
    default group is `tp_group=torch.distributed.group.WORLD`, given explicitly. A group of one rank is one rank.
    Raised on this rank alone: without a valid group there is no one to tell."""
    if tp_group is None:
        return None, 1, 0
    if not (dist.is_available() and isinstance(tp_group, dist.ProcessGroup)):
        raise argument_error(
            TypeError, fn_name, "tp_group",
            f"tp_group must be a torch.distributed.ProcessGroup (e.g. torch.distributed.group.WORLD) or None for one "
            f"rank, got {type(tp_group).__name__}")
    world_size = dist.get_world_size(tp_group)
    rank = dist.get_rank(tp_group)
    if rank < 0:
        raise argument_error(ValueError, fn_name, "tp_group", "tp_group does not contain this process")
    if world_size == 1:
        return None, 1, 0
    return tp_group, world_size, rank


def _check_float_input(fn_name: str, name: str, t) -> None:
    """The op's main input (`name`: logits, hidden) is a float32/bfloat16/float16 tensor with values."""
    if not isinstance(t, torch.Tensor):
        raise argument_error(TypeError, fn_name, name, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise argument_error(TypeError, fn_name, name, f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.is_meta:
        raise argument_error(ValueError, fn_name, name,
                             f"{name} must be on a device with values (CPU or CUDA), got meta: the op reads them")


def check_tensors(
    fn_name: str,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    keep_mask: Optional[torch.Tensor],
    row_mask: Optional[torch.Tensor],
) -> None:
    def fail(exc_type, name, detail):
        raise argument_error(exc_type, fn_name, name, detail)

    _check_float_input(fn_name, "logits", logits)
    if logits.dim() < 2:
        fail(ValueError, "logits",
             f"logits must have shape [..., V_local] with at least 2 dims, got {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        fail(ValueError, "logits", f"logits must have a non-empty vocabulary dimension, got {tuple(logits.shape)}")
    lead = tuple(logits.shape[:-1])
    check_row_tensors(fn_name, "logits", logits.device, lead, tokens,
                      (("keep_mask", keep_mask, tuple(logits.shape)), ("row_mask", row_mask, lead)))


def check_lm_head_tensors(fn_name: str, hidden, weight, tokens, row_mask, same_dtype: bool = True) -> None:
    """The LM head's tensors: hidden [..., H], weight [V_local, H] of its dtype (same_dtype; else any of the float
    dtypes hidden may have: SGLang's order casts both to bf16) and device, and the per-row ones."""
    def fail(exc_type, name, detail):
        raise argument_error(exc_type, fn_name, name, detail)

    _check_float_input(fn_name, "hidden", hidden)
    if hidden.dim() < 2 or hidden.shape[-1] < 1:
        fail(ValueError, "hidden",
             f"hidden must have shape [..., H] with at least 2 dims and H >= 1, got {tuple(hidden.shape)}")
    if not isinstance(weight, torch.Tensor):
        fail(TypeError, "weight", f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if same_dtype and weight.dtype != hidden.dtype:
        fail(TypeError, "weight", f"weight must have hidden's dtype {hidden.dtype}, got {weight.dtype}")
    if not same_dtype:
        _check_float_input(fn_name, "weight", weight)
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] != hidden.shape[-1]:
        fail(ValueError, "weight", f"weight must have shape [V_local, H] = [>= 1, {hidden.shape[-1]}] "
                                   f"(H = hidden.shape[-1]), got {tuple(weight.shape)}")
    if weight.device != hidden.device:
        fail(ValueError, "weight", f"weight must be on {hidden.device} like hidden, got {weight.device}")
    lead = tuple(hidden.shape[:-1])
    check_row_tensors(fn_name, "hidden", hidden.device, lead, tokens, (("row_mask", row_mask, lead),))


def check_row_tensors(fn_name: str, source: str, device, lead: tuple, tokens, masks) -> None:
    """The per-row arguments of an op whose rows come from `source` (logits or hidden, of leading shape `lead`, on
    `device`): integer tokens of shape `lead`, and each (name, mask or None, shape) a bool tensor of that shape."""
    def fail(exc_type, name, detail):
        raise argument_error(exc_type, fn_name, name, detail)

    if not isinstance(tokens, torch.Tensor):
        fail(TypeError, "tokens", f"tokens must be a torch.Tensor of integer ids, got {type(tokens).__name__}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        fail(TypeError, "tokens", f"tokens must hold integer token ids, got dtype {tokens.dtype}")
    if tuple(tokens.shape) != lead:
        fail(ValueError, "tokens", f"tokens must have shape {lead} ({source}.shape[:-1]), got {tuple(tokens.shape)}: "
                                   f"token/{source} length mismatch")
    if tokens.device != device:
        fail(ValueError, "tokens", f"tokens must be on {device} like {source}, got {tokens.device}")
    for name, mask, shape in masks:
        if mask is None:
            continue
        if not isinstance(mask, torch.Tensor):
            fail(TypeError, name, f"{name} must be a bool torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            fail(TypeError, name, f"{name} must have dtype torch.bool, got {mask.dtype}")
        if tuple(mask.shape) != shape:
            fail(ValueError, name, f"{name} must have shape {shape}, got {tuple(mask.shape)}")
        if mask.device != device:
            fail(ValueError, name, f"{name} must be on {device} like {source}, got {mask.device}")


def check_token_loss_rows(fn_name: str, token_loss, lead: tuple, source: str, hint: str = "") -> None:
    """A token loss that says how many tokens its constants cover (`shape`, as a ppo_ops.token_losses.TokenLoss
    does) must cover the call's rows one to one: as many constants as rows (`lead`, the leading shape of `source`),
    and, where the constants have as many dims as the rows, the rows' shape. More constants would be normalised over
    tokens the call never scores; fewer would be indexed past their end. Other callables are not checked. `source`
    says where `lead` comes from ("hidden.shape[:-1] ="); `hint` ends the message (what the caller's layout expects).
    """
    shape = getattr(token_loss, "shape", None)
    if not isinstance(shape, torch.Size):
        return
    n_rows = math.prod(lead)
    if shape.numel() == n_rows and (len(shape) != len(lead) or tuple(shape) == tuple(lead)):
        return
    raise argument_error(
        ValueError, fn_name, "token_loss",
        f"token_loss was built over constants of shape {tuple(shape)} ({shape.numel()} tokens), but the call scores "
        f"{n_rows} rows ({source} {tuple(lead)}): build it over one constant per scored row, in the rows' layout"
        f"{hint}")


def check_vocab(fn_name: str, vocab_size: Optional[int], v_global: int) -> None:
    if vocab_size is not None and vocab_size > v_global:
        raise argument_error(
            ValueError, fn_name, "vocab_size",
            f"vocab_size must be <= the global vocabulary V_local * tp_size = {v_global}, got {vocab_size}")


def overlaps(t: torch.Tensor) -> bool:
    """True when two indices of `t` address the same element (a stride-0 / expanded or otherwise overlapping view)."""
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1)
    extent = 1
    for stride, size in dims:
        if stride < extent:
            return True
        extent = stride * size
    return False


def check_inplace_target(fn_name: str, flat: torch.Tensor, needs_unit_stride: bool) -> None:
    """inplace_grad=True: every logit must own its storage element, or backward's rows would write one element
    several times (a stride-0 / expanded view, an overlapping as_strided view)."""
    if overlaps(flat):
        raise argument_error(
            ValueError, fn_name, "inplace_grad",
            f"inplace_grad=True needs logits whose elements do not overlap in memory, got shape {tuple(flat.shape)} "
            f"with strides {flat.stride()} (an expanded or overlapping view): pass a contiguous tensor or "
            "inplace_grad=False")
    if needs_unit_stride and flat.shape[1] > 1 and flat.stride(1) != 1:
        raise argument_error(ValueError, fn_name, "inplace_grad",
                             "inplace_grad=True with this backend needs logits.stride(-1) == 1")
