"""What the three operators share: crossing the schema (process group, keep set, scalar options), the two
registrations of a forward operator, and empty placeholders for absent outputs."""

from __future__ import annotations

import numbers
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ppo_ops.core.checks import error_prefix

# Compiled graphs that read values on the host must stay out of CUDA graphs; older torch has no such tag.
_SYNC_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def compile_error(exc_type, fn_name: str, argument: str, detail: str) -> Exception:
    """An argument error raised while dynamo traces the wrapper: named like checks.argument_error's (the argument in
    the message), without its attribute, which dynamo cannot set on an exception it traces. Raised before any
    collective, on every rank alike (they compile the same code)."""
    assert argument in detail
    return exc_type(f"{error_prefix(fn_name)}{detail}")


def group_name(fn_name: str, tp_group) -> str:
    """The schema's form of tp_group: "" for None (one rank), else the group's registered name."""
    if tp_group is None:
        return ""
    if not isinstance(tp_group, dist.ProcessGroup):
        raise compile_error(TypeError, fn_name, "tp_group",
                             f"tp_group must be a torch.distributed ProcessGroup or None under torch.compile, got "
                             f"{type(tp_group).__name__}")
    return tp_group.group_name


def resolve_group(name: str):
    return None if name == "" else dist.distributed_c10d._resolve_process_group(name)


def python_number(fn_name: str, name: str, value, kind=numbers.Real):
    """A scalar option as the schema takes it: a Python (or NumPy) number, never a tensor (reading one while tracing
    would be a host read). None passes through (the option's default)."""
    if value is None or isinstance(value, bool):
        return value  # a bool: the op's own checks refuse it by name
    if isinstance(value, numbers.Integral) and kind is numbers.Integral:
        return int(value)
    if isinstance(value, numbers.Real) and kind is numbers.Real:
        return float(value)
    if isinstance(value, torch.Tensor):
        raise compile_error(TypeError, fn_name, name,
                             f"{name} must be a Python number under torch.compile (a tensor would be read on the "
                             f"host while tracing), got a tensor; pass {name}=float(...) or int(...) computed outside")
    return value  # anything else: the op's own checks name it


def keep_tensors(fn_name: str, keep) -> tuple:
    """keep=(ids, offsets) or None -> (ids, offsets) or (None, None); the op's own checks judge the values."""
    if keep is None:
        return None, None
    if not (isinstance(keep, (tuple, list)) and len(keep) == 2
            and all(isinstance(t, torch.Tensor) for t in keep)):
        raise compile_error(TypeError, fn_name, "keep",
                             "keep must be a pair (ids, offsets) of 1-D integer tensors, or None")
    return keep[0], keep[1]


def keep_pair(ids: Optional[torch.Tensor], offsets: Optional[torch.Tensor]):
    return None if ids is None else (ids, offsets)


def empty(like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The placeholder of an absent output (every output of a schema is a tensor)."""
    return like.new_empty((0,), dtype=dtype)


def or_empty(t: Optional[torch.Tensor], like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return empty(like, dtype) if t is None else t


def unaliased(outputs: tuple, inputs: tuple) -> tuple:
    """An operator's outputs may alias neither its inputs nor each other; the backends return row statistics as
    views of one buffer (and the LM head's log-probs may be views of its partials). Clones those (O(T) each)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and t.numel()}
    out = []
    for t in outputs:
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
        out.append(t)
    return tuple(out)


class TwoRegistrations:
    """One forward operator under two names: `ppo_ops::<name>` and `ppo_ops::<name>_syncing` (tagged
    cudagraph_unsafe), with the same implementation, fake and autograd."""

    def __init__(self, name: str, impl: Callable, fake: Callable, backward: Callable, setup_context: Callable):
        self.plain = _define(name, impl, fake, backward, setup_context, ())
        self.syncing = _define(name + "_syncing", impl, fake, backward, setup_context, _SYNC_TAGS)

    def __call__(self, *args, syncs: bool):
        return (self.syncing if syncs else self.plain)(*args)


def _define(name, impl, fake, backward, setup_context, tags):
    op = torch.library.custom_op(f"ppo_ops::{name}", impl, mutates_args=(), tags=tags)
    op.register_fake(fake)
    op.register_autograd(backward, setup_context=setup_context)
    return op
