"""The call shell of both ops: one way of preparing a call, choosing its backend, and turning this rank's per-segment
partials into global row statistics.

Preparing (no tensor value read, no collective): `prepare_logits` / `prepare_lm_head` run the local checks
(core/checks.py), resolve the vocabulary layout (core/layout.py) and the backend, flatten the leading dimensions and
return a `Call` whose `Plan` is everything about the call that is not a tensor. Their errors name the argument; at
TP > 1 with validate=True the other ranks learn of one from the header exchange and every rank raises it
(core/agreement.py, `raise_collectively`).

Backends (`select_backend`; the contracts are core/contracts.py), by kind (`backend_kind`, the same rules and errors
for both ops). The core imports no op's module: each backend is a loader in core/registry.py, keyed by ("logits" |
"lm_head" | "lm_head_segments", kind), registered by ppo_ops/backends.py on `import ppo_ops` and called (importing its
module) when selected; an unregistered key is a RuntimeError naming it.
  logits op: "torch" -> logits/torch_backend.py; "triton" -> logits/triton_backend.py.
  LM head: the key comes from the head's router, lm_head/paths.py's `backend_key` (the first step of `head_path`,
      which names the path a call takes; docs/lm_head.md has the table): the segment-GEMM backend
      (lm_head/segment_gemms.py) for every token loss and for half precision under triton, else
      lm_head/torch_backend.py (kind torch) or lm_head/triton_backend.py (kind triton, fp32).

Row statistics (`merge_row_stats`): at TP > 1 with validate=True the ranks' fixed-size headers first (the value checks'
one host read), then the all-gather of the partials (rank-major along dim 0 is the global segment order), then the
backend's fixed-order merge. At TP = 1 the same code with the collectives skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Callable, NamedTuple, Optional, Union

import torch

from ppo_ops.core import agreement, checks, registry, sparse_keep
from ppo_ops.core.contracts import Backend, LinearBackend, RowStats, ShardOptions
from ppo_ops.core.layout import VocabLayout, make_layout


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything about one call that is not a tensor, but for a per-row temperature's reciprocals, which the shard
    carries (with_row_temperature: a plan of its own per call)."""

    fn_name: str
    layout: VocabLayout
    backend: Union[Backend, LinearBackend]  # the logits op's or the LM head's, as the op asks
    shard: ShardOptions
    temperature: float  # as the caller gave it (the ranks compare it); checks.ROW_TEMPERATURE for a per-row one
    entropy_mode: str  # "none" | "value" | "grad"
    validate: bool
    naming: agreement.Naming  # how value errors name this op's arguments
    dtype: torch.dtype  # of the logits or the hidden states (the ranks compare it)
    has_keep_mask: bool = False
    inplace_grad: bool = False  # logits op
    reduce_dx: bool = True  # LM head
    needs_grad: bool = True  # LM head: grad mode on and hidden or weight requires grad, else the forward keeps nothing
    reduction_order: str = "fused"  # "fused" or "sglang" (logits/sglang_order.py; the LM head's lm_head/sglang_head.py)
    working_memory: Optional[int] = None  # LM head: bytes it may hold beyond its outputs (None: the default)
    softcap: Optional[float] = None  # softcap * tanh(logits / softcap) before the temperature (the shard has it too)


class Call(NamedTuple):
    """A call whose arguments passed the local checks: flattened tensors, the plan and the leading shape."""

    rows: torch.Tensor  # [T, V_local] logits, or [T, H] hidden states
    tokens: torch.Tensor  # [T]
    keep_mask: Optional[torch.Tensor]  # [T, V_local] or None
    row_mask: Optional[torch.Tensor]  # [T] or None
    plan: Plan
    lead: tuple
    keep: Optional[sparse_keep.SparseKeep] = None  # the sparse keep set (ids, offsets), checked, or None


def on_device(call: Call):
    """The call's CUDA device made current while its Function runs forward (autograd runs backward on the device of
    its inputs): Triton launches on the current device and stream, not the tensors', so tensors on another GPU than
    the current one would otherwise be read from the wrong device. Off CUDA: nothing."""
    return torch.cuda.device(call.rows.device) if call.rows.is_cuda else contextlib.nullcontext()


# ---- preparing a call ----

def _prepare(fn_name: str, tp_group, validate, like, local_checks: Callable[..., Call],
             host_read_row_mask=None) -> Call:
    """Resolves tp_group, then `local_checks(group, world_size, rank)`; its error raises on every rank together
    (TP > 1 with validate=True) or here. `like` is the tensor whose device the error header goes on;
    host_read_row_mask: a row mask whose kept-row count the op reads on the host (the LM head's)."""
    if isinstance(like, torch.Tensor) and like.is_cuda and torch.cuda.is_current_stream_capturing():
        # Before any collective, on every rank alike (they all capture): a host read would fail inside the capture
        # with an error of torch's that names no option.
        if validate is True:
            raise checks.argument_error(
                RuntimeError, fn_name, "validate",
                "validate=True reads values on the host, which CUDA graph capture forbids: call with validate=False "
                "inside torch.cuda.graph (or a compiled function in mode='reduce-overhead' keeps the call out of its "
                "graphs)")
        if host_read_row_mask is not None:
            raise checks.argument_error(
                RuntimeError, fn_name, "row_mask",
                "a row_mask's kept-row count is read on the host (it sizes the GEMMs), which CUDA graph capture "
                "forbids: inside torch.cuda.graph pass row_mask=None and mask the outputs and their gradients "
                "yourself")
    group, world_size, rank = checks.check_tp_group(fn_name, tp_group)
    try:
        return local_checks(group, world_size, rank)
    except Exception as exc:
        agreement.raise_collectively(fn_name, exc, group, world_size, validate, like)


# Plans already built, by everything a Plan is made of: a trainer repeats a few call signatures, and building one
# (the layout, the backend, two frozen dataclasses) is host time on every small call. Bounded: cleared when full.
_PLANS: dict = {}
_PLANS_MAX = 256


def _plan(fn_name, group, world_size, rank, rows: torch.Tensor, v_local: int, options: tuple, *, op: str,
          entropy, backend, validate, fused_loss: bool = False, **fields) -> Plan:
    """The layout and the backend of a call whose options (`options`: what checks.check_options returned) and tensors
    passed their checks: built once per signature (a call that raises is not kept)."""
    key = (fn_name, group, world_size, rank, rows.dtype, rows.device.type, v_local, options, op, entropy, backend,
           validate, fused_loss, tuple(fields.items()))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _build_plan(fn_name, group, world_size, rank, rows, v_local, options, op=op, entropy=entropy,
                           backend=backend, validate=validate, fused_loss=fused_loss, **fields)
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _build_plan(fn_name, group, world_size, rank, rows, v_local, options, *, op, entropy, backend, validate,
                fused_loss, **fields) -> Plan:
    temperature, inv_temperature, chunk_size, vocab_size = options
    layout = make_layout(group, world_size, rank, v_local, vocab_size)
    checks.check_vocab(fn_name, vocab_size, layout.v_global)
    shard = ShardOptions(inv_temperature=inv_temperature, n_valid=layout.n_valid, seg_len=layout.seg_len,
                         vocab_start=layout.vocab_start, chunk_rows=None if chunk_size in (None, -1) else chunk_size,
                         softcap=fields.get("softcap"))
    order = fields.get("reduction_order", "fused") if op == "lm_head" else "fused"
    return Plan(fn_name=fn_name, layout=layout, backend=select_backend(fn_name, backend, rows, op, fused_loss, order),
                shard=shard, temperature=temperature, entropy_mode=entropy, validate=validate,
                naming=agreement.LOGITS_NAMING if op == "logits" else agreement.LM_HEAD_NAMING, dtype=rows.dtype,
                **fields)


def prepare_logits(fn_name, logits, tokens, *, tp_group, entropy, keep_mask, temperature, row_mask, vocab_size,
                   chunk_size, inplace_grad, backend, validate, reduction_order="fused", keep=None,
                   softcap=None) -> Call:
    """The logits op's call: every local check, the layout, the backend, the flattened [T, V_local] logits."""
    def local_checks(group, world_size, rank):
        options = checks.check_options(fn_name, entropy=entropy, backend=backend, temperature=temperature,
                                       chunk_size=chunk_size, vocab_size=vocab_size, inplace_grad=inplace_grad,
                                       validate=validate)
        cap = checks.check_softcap(fn_name, softcap)
        checks.check_reduction_order(fn_name, reduction_order, keep_mask)
        checks.check_transform_support(fn_name, temperature, cap, reduction_order=reduction_order, keep=keep)
        checks.check_tensors(fn_name, logits, tokens, keep_mask, row_mask)
        lead, v_local = tuple(logits.shape[:-1]), logits.shape[-1]
        checks.check_row_temperature(fn_name, temperature, lead, "logits", logits.device)
        plan = _plan(fn_name, group, world_size, rank, logits, v_local, options, op="logits", entropy=entropy,
                     backend=backend, validate=validate, inplace_grad=inplace_grad,
                     has_keep_mask=keep_mask is not None, reduction_order=reduction_order, softcap=cap)
        if reduction_order == "sglang":
            checks.check_sglang_shard(fn_name, plan.layout)
        n_rows = math.prod(lead)
        plan = with_row_temperature(plan, temperature, n_rows, row_mask)
        sparse = sparse_keep.check(fn_name, keep, n_rows, logits.device, keep_mask, reduction_order)
        flat = _flatten_logits(fn_name, logits, n_rows, v_local, inplace_grad,
                               needs_unit_stride=plan.backend.needs_unit_column_stride)
        return Call(flat, shaped(tokens, (n_rows,)),
                    None if keep_mask is None else shaped(keep_mask, (n_rows, v_local)),
                    None if row_mask is None else shaped(row_mask, (n_rows,)), plan, lead, sparse)

    return _prepare(fn_name, tp_group, validate, logits, local_checks)


def prepare_lm_head(fn_name, hidden, weight, tokens, *, tp_group, entropy, temperature, row_mask, vocab_size,
                    reduce_dx, backend, validate, token_loss=None, fused_loss=False, keep=None,
                    needs_grad: Optional[bool] = None, working_memory=None, reduction_order="fused",
                    softcap=None) -> Call:
    """The LM head's call (fused_loss: linear_token_loss, whose `token_loss` must be callable; `working_memory`
    for both ops): every local check, the layout, the backend, the flattened [T, H] hidden states. needs_grad:
    whether a backward follows (None: grad mode and the inputs' requires_grad say; the custom operators, which run
    below autograd, pass it)."""
    def local_checks(group, world_size, rank):
        if fused_loss and not callable(token_loss):
            raise checks.argument_error(
                TypeError, fn_name, "token_loss",
                f"token_loss must be callable as token_loss(log_probs, entropy, rows) -> [R] float32, got "
                f"{type(token_loss).__name__}")
        options = checks.check_options(fn_name, entropy=entropy, backend=backend, temperature=temperature,
                                       chunk_size=None, vocab_size=vocab_size, inplace_grad=False, validate=validate)
        cap = checks.check_softcap(fn_name, softcap)
        checks.check_transform_support(fn_name, temperature, cap, reduction_order=reduction_order, keep=keep)
        if not isinstance(reduce_dx, bool):
            raise checks.argument_error(TypeError, fn_name, "reduce_dx",
                                        f"reduce_dx must be a bool, got {type(reduce_dx).__name__}")
        memory = checks.check_working_memory(fn_name, working_memory)
        checks.check_lm_head_tensors(fn_name, hidden, weight, tokens, row_mask,
                                     same_dtype=reduction_order != "sglang")
        checks.check_lm_head_order(fn_name, reduction_order, keep,
                                   backend_kind(fn_name, backend, hidden, "hidden"), hidden.device)
        lead, width = tuple(hidden.shape[:-1]), hidden.shape[-1]
        checks.check_row_temperature(fn_name, temperature, lead, "hidden", hidden.device)
        plan = _plan(fn_name, group, world_size, rank, hidden, weight.shape[0], options, op="lm_head",
                     fused_loss=fused_loss, entropy=entropy, backend=backend, validate=validate, reduce_dx=reduce_dx,
                     needs_grad=(torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad))
                     if needs_grad is None else needs_grad, working_memory=memory, reduction_order=reduction_order,
                     softcap=cap)
        if reduction_order == "sglang":
            checks.check_sglang_shard(fn_name, plan.layout, "weight")
        n_rows = math.prod(lead)
        plan = with_row_temperature(plan, temperature, n_rows, row_mask)
        sparse = sparse_keep.check(fn_name, keep, n_rows, hidden.device)
        return Call(shaped(hidden, (n_rows, width)), shaped(tokens, (n_rows,)), None,
                    None if row_mask is None else shaped(row_mask, (n_rows,)), plan, lead, sparse)

    return _prepare(fn_name, tp_group, validate, hidden, local_checks, host_read_row_mask=row_mask)


def with_row_temperature(plan: Plan, temperature, n_rows: int, row_mask) -> Plan:
    """The plan of a call with a per-row temperature: its shard carries the [n_rows] fp32 reciprocals (1 in rows the
    row mask drops), a plan of the call's own; any other call's plan as it is (kept per signature)."""
    if not checks.is_row_temperature(temperature):
        return plan
    inv = checks.row_inverse_temperature(temperature, n_rows, row_mask)
    return dataclasses.replace(plan, shard=dataclasses.replace(plan.shard, row_inv_temperature=inv))


def shaped(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """t reshaped to `shape`, or t itself when it has that shape already: a reshape would add a view, and a node for
    autograd to run backward (host time on every small call)."""
    return t if t.shape == shape else t.reshape(shape)


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
    flat = shaped(logits, (n_rows, v_local))
    if needs_unit_stride and v_local > 1 and flat.stride(1) != 1:
        flat = flat.contiguous()
    return flat


# ---- the backend ----

def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's CPU interpreter (it takes effect only when set before triton is
    imported; logits/triton_backend.py tells the two apart)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def backend_kind(fn_name: str, backend: str, tensor: torch.Tensor, name: str) -> str:
    """"torch" or "triton" for backend="auto" | "torch" | "triton" on `tensor` (its argument `name`: logits, hidden).
    auto: triton for CUDA tensors when triton imports, else torch; triton: CUDA tensors, or CPU ones under
    TRITON_INTERPRET=1 (set before triton is imported), and triton importable, else an error naming `backend`."""
    if backend == "torch":
        return "torch"
    if backend == "auto" and not tensor.is_cuda:
        return "torch"
    if backend == "triton" and not (tensor.is_cuda or interpret_requested()):
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


def select_backend(fn_name: str, backend: str, rows: torch.Tensor, op: str, fused_loss: bool = False,
                   reduction_order: str = "fused"):
    """The backend of `op` ("logits" or "lm_head") of the kind backend_kind picks (see the module docstring), loaded
    from core/registry.py, so a Triton module is imported only when selected. The LM head's goes through its router
    (lm_head/paths.py, backend_key: the first step of head_path, which names the path a call takes)."""
    kind = backend_kind(fn_name, backend, rows, "logits" if op == "logits" else "hidden")
    if op == "lm_head":
        return registry.route(op, kind, rows.dtype, fused_loss, reduction_order)
    return registry.load(op, kind)


# ---- partials -> global row statistics ----

def check_across_ranks(plan: Plan, tokens, row_mask, bad: torch.Tensor, keep=None) -> None:
    """TP > 1, validate=True: the header exchange of the call (its one host read), before any collective whose size
    depends on the call: ranks that disagree, or whose tokens, keep set or logits are bad, all raise here together.
    `tokens` and `row_mask` are the call's (all T rows); `bad` is this rank's NaN / +inf flag (0-d bool); `keep`
    the call's sparse keep set or None."""
    layout = plan.layout
    agreement.check_across_ranks(
        plan.fn_name, layout.group, layout.world_size, tokens, row_mask, bad, naming=plan.naming,
        v_local=layout.v_local, vocab_size=layout.vocab_size, temperature=plan.temperature,
        entropy_mode=plan.entropy_mode, has_keep_mask=plan.has_keep_mask, dtype=plan.dtype,
        reduction_order=plan.reduction_order, keep=keep, working_memory=plan.working_memory, softcap=plan.softcap,
        row_inv_temperature=plan.shard.row_inv_temperature)


def check_single_rank(plan: Plan, bad_rows, tokens, row_mask, keep=None) -> None:
    """TP = 1, validate=True: the value checks' one host read (token range, NaN / +inf logits, the sparse keep set's
    offsets and ids)."""
    row_inv = plan.shard.row_inv_temperature
    if keep is None and row_inv is None:
        agreement.check_single_rank_values(plan.fn_name, bad_rows, tokens, row_mask, plan.layout.vocab_size,
                                           naming=plan.naming)
        return
    values = agreement.single_rank_values(
        bad_rows, tokens, row_mask, row_inv_temperature=row_inv,
        extra_flags=None if keep is None else sparse_keep.header_values(keep, bad_rows.device))
    extra = agreement.raise_single_rank_values(plan.fn_name, agreement.read_to_host(values), row_mask,
                                               plan.layout.vocab_size, naming=plan.naming)
    exc = None if keep is None else sparse_keep.value_error(plan.fn_name, extra, plan.layout.vocab_size)
    if exc is not None:
        raise exc


def merge_row_stats(plan: Plan, partials: torch.Tensor, tokens, row_mask, *,
                    validate: Optional[bool] = None, keep=None) -> RowStats:
    """This rank's [local segments, 5, R] partials -> global RowStats: at TP > 1 with `validate` (default: the
    plan's) the header exchange first (`keep`: the call's sparse keep set, checked in it), then the all-gather of the
    partials, then the backend's fixed-order merge."""
    layout = plan.layout
    if layout.group is not None:
        if plan.validate if validate is None else validate:
            check_across_ranks(plan, tokens, row_mask, agreement.bad_logits(partials), keep=keep)
        # Every rank takes part, R = 0 included: [segments, 5, R] has the same shape on every rank.
        gathered = torch.empty((layout.world_size * partials.shape[0],) + tuple(partials.shape[1:]),
                               dtype=partials.dtype, device=partials.device)
        agreement.all_gather_into(gathered, partials, layout.group)
        partials = gathered
    return plan.backend.merge_partials(partials, plan.has_keep_mask)


# ---- autograd, the same for every op ----

def forward_outputs(ctx, entropy_mode, log_prob, entropy):
    """What an op's forward returns: the log-prob alone (entropy="none"), or with the entropy, which is a constant
    for entropy="value"."""
    if entropy_mode == "none":
        return log_prob
    if entropy_mode == "value":
        ctx.mark_non_differentiable(entropy)
    return log_prob, entropy


def refuse_double_backward(fn_name):
    if torch.is_grad_enabled():
        raise RuntimeError(f"ppo_ops.{fn_name}: double backward (create_graph=True through this op) is not supported")
