"""Small calls of the logits op, replayed from the first call of their signature.

Why: at T = 1024 an eager call is host-bound. Of its host time on the development CPU (docs/performance.md), about
three quarters is the op's own Python around three launches: the checks, the plan, each launch's arguments and
Triton's specialisation key, none of which changes between calls of one signature.

What: a call's signature (`signature`) is everything the op's own path decides from: each tensor's type, shape,
strides, dtype, device and address modulo 16 (Triton specialises pointers on 16-byte alignment), every option, and
grad mode. The first call of a signature runs the op's own path (logits/function.py) while the launcher records its
launches (core/triton_launch.py, `recording`), and the record becomes an `Entry`: per launch the compiled
kernel, its grid, and its argument list as a function of the call's pointers, each tensor argument replaced by the
role of the buffer it points into (the logits, the tokens, the partials, the merged statistics or flags, and in the
backward the gradient and the upstream gradients), every other argument kept as recorded. A later call of the
signature allocates the same buffers and makes the same launches with its own pointers (`run`), so it runs the same
kernels on the same arguments: the same bits. The checks are not run again: they are a function of the signature,
and it passed them. The backward is recorded the same way at its first run per kind of upstream gradient (which of
the two are given, and their alignment).

Where it applies: eager calls on CUDA with the Triton kernels launched directly, one rank, no keep mask, keep set or
row mask, reduction_order="fused", inplace_grad=False, logits and tokens plain tensors whose flattened views are
their own storage. With validate=True the replayed forward ends with the op's own value checks (their one host
read), and inside a CUDA graph capture the op's own path raises its error. Anything else, a signature whose record
does not map onto those roles (a copy made inside the op, two roles at one address), and a call whose fresh buffers
or current device differ from the record, takes the op's own path. Entries are kept per signature, cleared when 256
are held.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple, Optional

import torch

from ppo_ops.core import row_stats, shell, triton_launch
from ppo_ops.core.contracts import BackwardStats, RowInputs
from ppo_ops.core.shell import Plan, forward_outputs, refuse_double_backward
from ppo_ops.logits import function

ENABLED = True  # False: every call takes the op's own path (tests compare the two)
_ENTRIES: dict = {}  # signature -> Entry, or _NOT_REPLAYABLE
_ENTRIES_MAX = 256
_NOT_REPLAYABLE = object()


class Replayable(NamedTuple):
    """One recorded launch, without the recorded call's tensors: `arguments(*pointers)` is its argument list for a
    call's buffer pointers."""

    launcher: object  # the triton_launch.Launcher that made it
    compiled: object  # its CompiledKernel
    device: int
    grid: tuple
    arguments: Callable[..., tuple]

    def run(self, *pointers) -> None:
        self.launcher.run(self.compiled, self.device, self.grid, self.arguments(*pointers))


class Entry(NamedTuple):
    plan: Plan
    lead: tuple  # the logits' leading shape
    device: int  # the CUDA device index the kernels were recorded on
    partials_shape: tuple
    residues: tuple  # the flat logits', flat tokens', partials', merged statistics' and flags' addresses modulo 16
    forward: tuple  # (Replayable of the partials, Replayable of the merge): pointers (L, K, P, O, F)
    backward: dict  # upstream-gradient key -> Replayable (pointers L, K, G, O, F, GL, GE), or _NOT_REPLAYABLE


def signature(logits, tokens, *, tp_group, entropy, keep_mask, keep, temperature, row_mask, vocab_size, chunk_size,
              inplace_grad, backend, validate, reduction_order) -> Optional[tuple]:
    """The call's signature, or None where replay does not apply (module docstring)."""
    if (not ENABLED or type(validate) is not bool or tp_group is not None or keep_mask is not None or keep is not None
            or row_mask is not None or inplace_grad is not False or reduction_order != "fused"
            or type(logits) is not torch.Tensor or type(tokens) is not torch.Tensor or not _on_cuda(logits)
            or type(temperature) not in (int, float) or type(vocab_size) not in (int, type(None))
            or type(chunk_size) not in (int, type(None)) or type(entropy) is not str or type(backend) is not str):
        return None
    return (logits.shape, logits.stride(), logits.dtype, logits.device, logits.data_ptr() % 16, logits.requires_grad,
            tokens.shape, tokens.stride(), tokens.dtype, tokens.device, tokens.data_ptr() % 16, entropy,
            type(temperature), temperature, vocab_size, chunk_size, backend, validate, torch.is_grad_enabled())


def _on_cuda(tensor) -> bool:
    """Where the kernels launch directly (a test's stand-in for CUDA replaces this)."""
    return tensor.is_cuda


@contextlib.contextmanager
def recording(key: Optional[tuple], call: shell.Call, logits: torch.Tensor):
    """Around the op's own path on `call`: the first call of a signature (`key` not None) records its launches and
    leaves the signature's Entry (or marks it not replayable); any other call runs as it is."""
    if key is None or key in _ENTRIES:
        yield
        return
    with triton_launch.recording() as launches:
        yield
    _remember(key, call, logits, launches)


def _remember(key: tuple, call: shell.Call, logits: torch.Tensor, launches: list) -> None:
    """Turns the recorded forward of a signature's first call into its Entry (or marks it not replayable)."""
    found = _NOT_REPLAYABLE
    rows, tokens = call.rows, call.tokens
    if (len(launches) == 2 and all(launch.compiled is not None for launch in launches) and call.plan.layout.group
            is None and rows.data_ptr() == logits.data_ptr()):
        partials = launches[0].kwargs.get("out_ptr")
        merged, flags = launches[1].kwargs.get("out_ptr"), launches[1].kwargs.get("flags_ptr")
        if all(isinstance(t, torch.Tensor) for t in (partials, merged, flags)):
            roles = _forward_roles(rows, tokens, partials, merged, flags)
            replayed = [_replayable(launch, roles) for launch in launches]
            if None not in replayed and rows.shape[0] == merged.shape[1]:
                found = Entry(call.plan, call.lead, launches[0].device, tuple(partials.shape),
                              tuple(t.data_ptr() % 16 for t in (rows, tokens, partials, merged, flags)),
                              tuple(replayed), {})
    if len(_ENTRIES) >= _ENTRIES_MAX:
        _ENTRIES.clear()
    _ENTRIES[key] = found


def run(key: Optional[tuple], logits: torch.Tensor, tokens: torch.Tensor):
    """The call replayed: (what the op's Function returns, [T] outputs; the entropy mode; the leading shape), or None
    when the signature has no Entry or this call cannot replay (its current device, or its buffers' alignment,
    differ from the record): the caller then takes the op's own path."""
    found = None if key is None else _ENTRIES.get(key)
    if found is None or found is _NOT_REPLAYABLE or torch.cuda.current_device() != found.device:
        return None
    if found.plan.validate and torch.cuda.is_current_stream_capturing():
        return None  # the op's own path raises its error naming validate=False
    n_rows = found.partials_shape[2]
    rows, flat_tokens = shell.shaped(logits, (n_rows, logits.shape[-1])), shell.shaped(tokens, (n_rows,))
    device = logits.device
    partials = torch.empty(found.partials_shape, dtype=torch.float32, device=device)
    merged = torch.empty((row_stats.MERGED_FIELDS, n_rows), dtype=torch.float32, device=device)
    flags = torch.empty((row_stats.MERGED_FLAGS, n_rows), dtype=torch.uint8, device=device)
    # Triton specialises on each pointer's 16-byte alignment: the flat tokens may be a copy made here (a strided
    # [B, S] view), the buffers are new, so their addresses are checked against the record's
    if tuple(t.data_ptr() % 16 for t in (rows, flat_tokens, partials, merged, flags)) != found.residues:
        return None
    out = ReplayedFunction.apply(rows, flat_tokens, partials, merged, flags, found)
    return out, found.plan.entropy_mode, found.lead


class ReplayedFunction(torch.autograd.Function):
    """The op's Function (logits/function.py) for a recorded signature: the same launches, made from the record."""

    @staticmethod
    def forward(ctx, rows, tokens, partials, merged, flags, found: Entry):
        pointers = (rows.data_ptr(), tokens.data_ptr(), partials.data_ptr(), merged.data_ptr(), flags.data_ptr())
        for replayable in found.forward:
            replayable.run(*pointers)
        if found.plan.validate:  # the value checks' one host read, as the op's own forward ends (function.py)
            shell.check_single_rank(found.plan, flags[row_stats.BAD_INPUT].view(torch.bool), tokens, None)
        log_prob, entropy = merged[row_stats.LOG_PROB], merged[row_stats.ENTROPY]
        ctx.found = found
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(rows, tokens, merged, flags)
        return forward_outputs(ctx, found.plan.entropy_mode, log_prob, entropy)

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy=None):
        found: Entry = ctx.found
        plan = found.plan
        refuse_double_backward(plan.fn_name)
        rows, tokens, merged, flags = ctx.saved_tensors
        # fp32 and contiguous as the op's own backward takes them (a sum's expanded gradient is copied there too)
        grad_log_prob = function.as_fp32(grad_log_prob)
        grad_entropy = function.as_fp32(grad_entropy) if plan.entropy_mode == "grad" else None
        out = torch.empty_like(rows)
        key = (_address_class(grad_log_prob), _address_class(grad_entropy), out.data_ptr() % 16)
        replayable = found.backward.get(key)
        if replayable is None or replayable is _NOT_REPLAYABLE:
            _own_backward(found, rows, tokens, merged, flags, grad_log_prob, grad_entropy, out, key,
                          record=replayable is None)
            return out, None, None, None, None, None
        pointers = (rows.data_ptr(), tokens.data_ptr(), out.data_ptr(), merged.data_ptr(), flags.data_ptr(),
                    0 if grad_log_prob is None else grad_log_prob.data_ptr(),
                    0 if grad_entropy is None else grad_entropy.data_ptr())
        replayable.run(*pointers)
        return out, None, None, None, None, None


def _address_class(grad) -> Optional[int]:
    """What the recorded backward depends on of an upstream gradient (fp32, contiguous): whether it is given, and
    its address modulo 16."""
    return None if grad is None else grad.data_ptr() % 16


def _own_backward(found: Entry, rows, tokens, merged, flags, grad_log_prob, grad_entropy, out, key, record) -> None:
    """The op's own backward (function.grad_logits) on the replayed forward's buffers; with `record`, its launch is
    kept for this kind of upstream gradient (`key`)."""
    plan = found.plan
    stats = BackwardStats(*function.saved_stats(row_stats.merged_row_stats(merged, flags, False), plan))
    inputs = RowInputs(rows, tokens, None, None)
    if not record:
        function.grad_logits(inputs, plan, stats, grad_log_prob, grad_entropy, None, out)
        return
    with triton_launch.recording() as launches:
        function.grad_logits(inputs, plan, stats, grad_log_prob, grad_entropy, None, out)
    replayable = None
    if len(launches) == 1 and launches[0].compiled is not None:
        roles = _forward_roles(rows, tokens, None, merged, flags)
        roles.update(G=(out.data_ptr(), (0,)),
                     GL=(None if grad_log_prob is None else grad_log_prob.data_ptr(), (0,)),
                     GE=(None if grad_entropy is None else grad_entropy.data_ptr(), (0,)))
        replayable = _replayable(launches[0], roles, order=("L", "K", "G", "O", "F", "GL", "GE"))
    found.backward[key] = _NOT_REPLAYABLE if replayable is None else replayable


def _forward_roles(rows, tokens, partials, merged, flags) -> dict:
    """role -> (base address or None, the offsets in bytes a pointer into it may have): the merged statistics and
    flags are passed row by row (views), the rest whole."""
    n_rows = merged.shape[1]
    return dict(L=(rows.data_ptr(), (0,)), K=(tokens.data_ptr(), (0,)),
                P=(None if partials is None else partials.data_ptr(), (0,)),
                O=(merged.data_ptr(), tuple(i * n_rows * merged.element_size() for i in range(merged.shape[0]))),
                F=(flags.data_ptr(), tuple(i * n_rows * flags.element_size() for i in range(flags.shape[0]))))


def _replayable(launch, roles: dict, order=("L", "K", "P", "O", "F")) -> Optional[Replayable]:
    """The launch's arguments as a function of the roles' base pointers (in `order`), or None when a tensor
    argument points at no role, or at two."""
    parts, constants = [], []
    for value in launch.args:
        if isinstance(value, torch.Tensor):
            address = value.data_ptr()
            hits = [(name, address - base) for name, (base, offsets) in roles.items()
                    if base is not None and address - base in offsets]
            if len(hits) != 1:
                return None
            name, offset = hits[0]
            parts.append(f"{name} + {offset}" if offset else name)
        else:
            parts.append(f"C[{len(constants)}]")
            constants.append(value)
    source = f"def arguments({', '.join(order)}):\n    return ({''.join(p + ', ' for p in parts)})\n"
    scope = {"C": tuple(constants)}
    exec(compile(source, "<ppo_ops replayed launch>", "exec"), scope)  # noqa: S102
    return Replayable(launch.launcher, launch.compiled, launch.device, launch.grid, scope["arguments"])
