"""The shell both LM-head ops share (linear_log_probs_and_entropy, linear_token_loss): one way of preparing a call
(local checks, layout, backend), of compacting kept rows, and of turning per-segment partials into global row stats
(value checks, TP all-gather, fixed-order merge).

Preparing (no tensor value read, no collective): `prepare` checks hidden / weight / tokens / row_mask and the
options with the logits op's checks (ppo_ops/checks.py), resolves the vocabulary layout (_layout.py) and the
backend, flattens the leading dimensions and returns a `LinearCall`. Its errors name the argument; the public wrappers
make them collective at TP > 1 (`checks.raise_collectively`).

Backends (`select_backend`; the contract is ppo_ops/_linear_backend.py):
  backend="torch", or "auto" on CPU tensors: _linear_torch (fixed fp32 tiles) for the general op; the chunked backend
      over the logits op's PyTorch passes for the token loss.
  backend="triton", or "auto" on CUDA tensors: half-precision inputs, and every token loss, take the chunked backend
      over the logits op's Triton passes (cuBLAS GEMMs on CUDA; under TRITON_INTERPRET=1 on CPU an fp32 matmul stands
      in for cuBLAS and the passes run in the interpreter); fp32 inputs of the general op take _linear_triton's GEMM
      kernels (IEEE fp32 dots).
  `HALF_PRECISION_PATH` switches half precision of the general op to "triton-gemm" (the Triton GEMM kernels): for
  the bench's before/after rows only; results differ from the chunked path's within the documented tolerances.

Backend kind: the logits op's choice (api.backend_kind), the same rules and errors. Row statistics
(`merge_across_ranks`): the logits op's path (_function.merge_row_stats): at TP > 1 with validate=True the ranks'
fixed-size headers first (the call's one host read for the general op), then the all-gather of the partials, then
the merge of the backend's kind.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch

from ppo_ops.core import checks
from ppo_ops.core.contracts import RowStats
from ppo_ops.logits.function import merge_row_stats
from ppo_ops.core.layout import VocabLayout, make_layout
from ppo_ops.core.lm_head_contracts import LinearBackend, LinearShard

_HALF = (torch.bfloat16, torch.float16)
HALF_PRECISION_PATH = "chunked"  # or "triton-gemm": see the module docstring

# How the value errors name the LM head's arguments: the logits are hidden @ weight.T, V_local is weight.shape[0].
NAMING = checks.Naming(
    fields={**checks.LOGITS_NAMING.fields,
            checks.V_LOCAL: ("V_local (weight.shape[0])", "weight"),
            checks.DTYPE: ("hidden dtype", "hidden")},
    bad_logits_argument="hidden",
    bad_logits="hidden @ weight.T{where} has NaN or +inf logits (after the temperature scaling); check hidden and "
               "weight for NaN / inf",
)


@dataclasses.dataclass(frozen=True)
class LinearPlan:
    """Everything about one call that is not a tensor."""

    fn_name: str
    layout: VocabLayout
    backend: LinearBackend
    shard: LinearShard
    temperature: float  # as the caller gave it (the ranks compare it)
    entropy_mode: str  # "none" | "value" | "grad"
    reduce_dx: bool
    validate: bool
    needs_grad: bool  # grad mode on and hidden or weight requires grad: else the forward keeps nothing


class LinearCall(NamedTuple):
    """A call whose arguments passed the local checks: flattened tensors, the plan and the lead shape."""

    hidden: torch.Tensor  # [T, H]
    tokens: torch.Tensor  # [T]
    row_mask: Optional[torch.Tensor]  # [T] or None
    plan: LinearPlan
    lead: tuple


def prepare(fn_name, hidden, weight, tokens, group, world_size, rank, *, entropy, temperature, row_mask, vocab_size,
            reduce_dx, backend, validate, fused_loss) -> LinearCall:
    """Every local check (no tensor value read, no collective), the layout and the backend."""
    temperature, inv_temperature, _, vocab_size = checks.check_options(
        fn_name, entropy=entropy, backend=backend, temperature=temperature, chunk_size=None, vocab_size=vocab_size,
        inplace_grad=False, validate=validate,
    )
    if not isinstance(reduce_dx, bool):
        raise checks.argument_error(TypeError, fn_name, "reduce_dx",
                                       f"reduce_dx must be a bool, got {type(reduce_dx).__name__}")
    check_tensors(fn_name, hidden, weight, tokens, row_mask)
    lead, width = tuple(hidden.shape[:-1]), hidden.shape[-1]
    layout = make_layout(group, world_size, rank, weight.shape[0], vocab_size)
    checks.check_vocab(fn_name, vocab_size, layout.v_global)
    selected = select_backend(fn_name, backend, hidden, fused_loss)
    n_rows = math.prod(lead)
    plan = LinearPlan(
        fn_name=fn_name, layout=layout, backend=selected,
        shard=LinearShard(inv_temperature=inv_temperature, n_valid=layout.n_valid, seg_len=layout.seg_len,
                          vocab_start=layout.vocab_start),
        temperature=temperature, entropy_mode=entropy, reduce_dx=reduce_dx, validate=validate,
        needs_grad=torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad),
    )
    return LinearCall(hidden.reshape(n_rows, width), tokens.reshape(n_rows),
                      None if row_mask is None else row_mask.reshape(n_rows), plan, lead)


def check_tensors(fn_name, hidden, weight, tokens, row_mask) -> None:
    def fail(exc_type, name, detail):
        raise checks.argument_error(exc_type, fn_name, name, detail)

    if not isinstance(hidden, torch.Tensor):
        fail(TypeError, "hidden", f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
    if hidden.dtype not in checks.FLOAT_DTYPES:
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
    checks.check_row_tensors(fn_name, "hidden", hidden.device, lead, tokens, (("row_mask", row_mask, lead),))


def select_backend(fn_name: str, backend: str, hidden: torch.Tensor, fused_loss: bool) -> LinearBackend:
    """The logits op's choice of kind (api.backend_kind), then the LM head's backend of that kind."""
    from ppo_ops.lm_head import chunked, torch_backend
    from ppo_ops.api import backend_kind

    if backend_kind(fn_name, backend, hidden, "hidden") == "torch":
        return chunked.backend("torch") if fused_loss else torch_backend.BACKEND
    if fused_loss or (hidden.dtype in _HALF and HALF_PRECISION_PATH == "chunked"):
        return chunked.backend("triton")
    from ppo_ops.lm_head import triton_backend

    return triton_backend.BACKEND


# ---- rows ----

def kept_row_indices(row_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[R] int64 indices of the kept rows (a host sync on CUDA: their count sizes every GEMM), or None for all."""
    return None if row_mask is None else torch.nonzero(row_mask).squeeze(1)


def kept(x: Optional[torch.Tensor], rows: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x if (x is None or rows is None) else x.index_select(0, rows)


def scatter_rows(values: torch.Tensor, rows: Optional[torch.Tensor], n_rows: int) -> torch.Tensor:
    """[R, ...] values of the kept rows -> [T, ...] with zeros for dropped rows."""
    if rows is None:
        return values
    out = torch.zeros((n_rows,) + tuple(values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_copy_(0, rows, values)


# ---- partials -> row stats ----

def merge_across_ranks(plan: LinearPlan, partials: torch.Tensor, tokens, row_mask, dtype, *,
                       validate: bool) -> RowStats:
    """This rank's [local segments, 5, R] partials -> global RowStats through the logits op's path
    (_function.merge_row_stats): with `validate` at TP > 1 the header exchange first (over the call's T rows and row
    mask; the NaN / +inf flag from these partials), then the all-gather and the backend's fixed-order merge."""
    return merge_row_stats(plan.fn_name, plan.layout, validate, partials, plan.backend.merge_partials, tokens,
                           row_mask, naming=NAMING, temperature=plan.temperature, entropy_mode=plan.entropy_mode,
                           has_keep_mask=False, dtype=dtype)


def row_stats(plan: LinearPlan, partials, tokens, row_mask, dtype) -> RowStats:
    """The general op's forward after its partials: header exchange (TP > 1, validate), all-gather, merge."""
    return merge_across_ranks(plan, partials, tokens, row_mask, dtype, validate=plan.validate)
