"""The backends the call shell can select, registered from above: the core imports no op's module, so each backend
is a zero-argument loader, keyed by (op, kind), that imports its module when first called (ppo_ops/backends.py
registers them on `import ppo_ops`). Keys the shell looks up (core/shell.py, select_backend):

  ("logits", "torch" | "triton")            the logits op's backends
  ("lm_head", "torch" | "triton")           the general LM head's fp32-tile backends
  ("lm_head_segments", "torch" | "triton")  the segment-GEMM backend (token loss; half precision under triton)
  ("lm_head_sglang", "torch" | "triton")    the LM head in SGLang's order (reduction_order="sglang")

An op whose backend depends on more than its kind registers a router too: a loader of the function that maps the
call's (kind, dtype, token loss, reduction order) to one of those keys. The LM head's is lm_head/paths.py's
`backend_key`, the first step of the function that names the head's paths, so the shell and the paths cannot
disagree.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

_LOADERS: Dict[Tuple[str, str], Callable[[], object]] = {}
_ROUTERS: Dict[str, Callable[[], Callable[..., Tuple[str, str]]]] = {}


def register(op: str, kind: str, loader: Callable[[], object]) -> None:
    """Make `loader()` the backend of (op, kind); a later registration of the same key replaces it."""
    if not callable(loader):
        raise TypeError(f"ppo_ops.core.registry: the loader of ({op!r}, {kind!r}) must be callable, "
                        f"got {type(loader).__name__}")
    _LOADERS[(op, kind)] = loader


def registered() -> Tuple[Tuple[str, str], ...]:
    """The registered (op, kind) keys, sorted."""
    return tuple(sorted(_LOADERS))


def load(op: str, kind: str):
    """The backend registered for (op, kind), its module imported on the first call (the module caches it)."""
    loader = _LOADERS.get((op, kind))
    if loader is None:
        have = ", ".join(f"{o}/{k}" for o, k in registered()) or "none"
        raise RuntimeError(
            f"ppo_ops: no backend registered for op {op!r}, kind {kind!r} (registered: {have}); backends are "
            f"registered by ppo_ops/backends.py, which `import ppo_ops` runs")
    return loader()


def register_router(op: str, loader: Callable[[], Callable[..., Tuple[str, str]]]) -> None:
    """Make `loader()` the router of `op`: a function of (kind, dtype, token_loss) returning a backend's key."""
    if not callable(loader):
        raise TypeError(f"ppo_ops.core.registry: the router loader of {op!r} must be callable, "
                        f"got {type(loader).__name__}")
    _ROUTERS[op] = loader


def route(op: str, kind: str, dtype, token_loss: bool, reduction_order: str = "fused"):
    """The backend of `op` for a call of this kind, dtype, token loss and reduction order, through its registered
    router."""
    loader = _ROUTERS.get(op)
    if loader is None:
        raise RuntimeError(f"ppo_ops: no router registered for op {op!r}; routers are registered by "
                           f"ppo_ops/backends.py, which `import ppo_ops` runs")
    return load(*loader()(kind, dtype, token_loss, reduction_order))
