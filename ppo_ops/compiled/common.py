"""What the three operators share: crossing the schema (process group, keep set, scalar options), the two
registrations of a forward operator, and empty placeholders for absent outputs."""

from __future__ import annotations

import numbers
from typing import Callable, Optional

import torch
import torch.distributed as dist


# Compiled graphs that read values on the host must stay out of CUDA graphs; older torch has no such tag.
_SYNC_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def compile_error(exc_type, fn_name: str, argument: str, detail: str) -> Exception:
    """An argument error raised while dynamo traces a wrapper: worded like checks.argument_error's (the function,
    then the argument), without its attribute, which dynamo cannot set on an exception it traces. Under
    fullgraph=True dynamo reports it with this message; without fullgraph the call breaks the graph."""
    return exc_type(f"ppo_ops.{fn_name}: {detail}")


def check_crossable(fn_name: str, tp_group, keep, **scalars) -> None:
    """That the call's options fit an operator's schema (their values are judged by the op's own checks inside the
    operator): a ProcessGroup or None, keep a pair of tensors or None, scalar options not tensors (reading one while
    tracing would be a host read)."""
    if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
        raise compile_error(TypeError, fn_name, "tp_group",
                            f"tp_group must be a torch.distributed ProcessGroup or None, got {type(tp_group).__name__}")
    if keep is not None and not (isinstance(keep, (tuple, list)) and len(keep) == 2
                                 and isinstance(keep[0], torch.Tensor) and isinstance(keep[1], torch.Tensor)):
        raise compile_error(TypeError, fn_name, "keep",
                            "keep must be a pair (ids, offsets) of 1-D integer tensors, or None")
    for name, value in scalars.items():
        if isinstance(value, torch.Tensor):
            raise compile_error(TypeError, fn_name, name,
                                f"{name} must be a Python number under torch.compile (a tensor would be read on the "
                                f"host while tracing), got a tensor")


def group_name(tp_group) -> str:
    """The schema's form of tp_group: "" for None (one rank), else the group's registered name."""
    return "" if tp_group is None else tp_group.group_name


def resolve_group(name: str):
    return None if name == "" else dist.distributed_c10d._resolve_process_group(name)


def number(value, kind=numbers.Real):
    """A scalar option as the schema takes it (NumPy numbers as Python ones); None, bools and other types pass
    through, for the op's own checks (or the schema's) to name."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and kind is numbers.Integral:
        return int(value)
    if isinstance(value, numbers.Real) and kind is numbers.Real:
        return float(value)
    return value


def keep_tensors(keep) -> tuple:
    """keep=(ids, offsets) or None -> (ids, offsets) or (None, None)."""
    return (None, None) if keep is None else (keep[0], keep[1])


def keep_pair(ids: Optional[torch.Tensor], offsets: Optional[torch.Tensor]):
    return None if ids is None else (ids, offsets)


def empty(like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The placeholder of an absent output (every output of a schema is a tensor)."""
    return like.new_empty((0,), dtype=dtype)


def or_empty(t: Optional[torch.Tensor], like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return empty(like, dtype) if t is None else t


def unaliased(outputs: tuple, inputs: tuple) -> tuple:
    """An operator's outputs may alias neither its inputs nor each other, and each must be what its fake
    implementation promises: a contiguous tensor at offset 0 of its storage (the compiler assumes that, and its
    alignment). The backends return row statistics as views into one buffer (and the LM head's log-probs may be views
    of its partials): those are cloned (O(T) each)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and t.numel()}
    out = []
    for t in outputs:
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or t.storage_offset() != 0 or not t.is_contiguous():
                t = t.clone(memory_format=torch.contiguous_format)
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
        out.append(t)
    return tuple(out)


def autograd_inside():
    """Autograd back on inside an operator's implementation, which runs below it (the dispatcher excludes the
    autograd keys there): the token loss takes the gradient of its loss with autograd inside its forward. Only the
    keys between autocast and ADInplaceOrView (autograd's) are let back in; what else the call excluded (autocast)
    stays excluded."""
    after = torch._C._dispatch_keyset_full_after
    autograd_keys = after(torch._C.DispatchKey.AutocastCPU) - after(torch._C.DispatchKey.ADInplaceOrView)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - autograd_keys)


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
