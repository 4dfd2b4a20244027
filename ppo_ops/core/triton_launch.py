"""Launching a compiled Triton kernel for less host time than `kernel[grid](**kwargs)`.

Why: a small call of the logits op is host-bound. On an H200 host, Triton's `JITFunction.run` costs about 0.12 ms
per launch (docs/performance.md, "Host cost of small calls"): per call it reads its knobs, binds and specialises the
arguments, formats a cache key, checks that no global the kernel read has changed, and builds launch metadata,
before the launcher proper (a few tens of microseconds) runs.

What: `Launcher(kernel)(grid, **kwargs)` keys each call on what Triton specialises a kernel on (per argument:
a constexpr's value; an integer's class: equal to 1, divisible by 16, 32- or 64-bit; a tensor's dtype and 16-byte
alignment; a host tensor descriptor's dtype, block shape and padding; the launch options; the current device),
so every call that Triton would run with one compiled kernel maps to one key, and no two calls that Triton would
run differently share a key. The key and the launch's argument list come from one straight-line function generated
per kernel (`key_and_arguments`), equal by construction to `specialization_key` and a loop over the signature, in
fewer Python steps. The first call of a key goes
through `kernel[grid](**kwargs)` (which compiles if needed) and keeps the CompiledKernel it returns; later calls of
that key call its launcher directly, with the arguments in the order and the launch metadata and hooks that
`JITFunction.run` passes. So the kernel, hence the bits, are Triton's own choice; what is skipped is the per-call
bookkeeping only (the changed-global check guards against editing a module's constants at run time, which ppo_ops
never does).

`recording()` keeps every launch a thread makes inside it (`Launch`: the kernel, grid and arguments), and
`Launcher.run` makes a launch from those parts: the logits op replays a small call's recorded launches with the new
call's pointers (ppo_ops/logits/replay.py).

Where it does not apply it is `kernel[grid](**kwargs)`: under the interpreter (TRITON_INTERPRET=1), and for a Triton
whose internals differ from those this relies on (`JITFunction.params`, `CompiledKernel.run`/`function`/
`packed_metadata`/`launch_metadata`, `triton.knobs.runtime` launch hooks), found once per kernel at the first launch.
"""

from __future__ import annotations

import contextlib
import threading
from typing import NamedTuple, Optional

import torch

_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1


def specialization_key(names: tuple, constexpr: tuple, kwargs: dict) -> tuple:
    """The key of one call: each parameter's class in signature order (`names`, with `constexpr` flags; a
    constexpr's value; an integer's (== 1, % 16 == 0, fits int32); a float's type; a tensor's dtype and 16-byte
    alignment; a TensorDescriptor's base dtype, block shape and padding (Triton compiles a descriptor argument for
    its dtype and block shape; its base, shape and strides are launch arguments); None, a bool or anything else as
    itself), then the launch options (every keyword that is not a parameter: num_warps, num_stages, ...) by name.
    The definition; a launch computes the same with the function key_and_arguments generates."""
    get = kwargs.get
    key = tuple(get(name) if is_const else value_class(get(name)) for name, is_const in zip(names, constexpr))
    return key, launch_options(kwargs, frozenset(names))


def value_class(value):
    """What Triton specialises a non-constexpr argument on (specialization_key)."""
    kind = type(value)
    if value is None or kind is bool:
        return value
    if kind is int:
        return (value == 1, value % 16 == 0, _INT32_MIN <= value <= _INT32_MAX)
    if kind is float:
        return float
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if hasattr(value, "block_shape") and hasattr(value, "base"):  # a host TMA descriptor
        return (kind, value.base.dtype, tuple(value.block_shape), getattr(value, "padding", None))
    return (kind, value)


def launch_options(kwargs: dict, params: frozenset) -> tuple:
    """The keywords that are not parameters (num_warps, num_stages, ...), by name: a set difference in C, then the
    few left sorted (a key must not depend on the order the caller wrote them in)."""
    extra = kwargs.keys() - params
    return tuple(sorted((k, kwargs[k]) for k in extra)) if extra else ()


_MISSING = object()


def key_and_arguments(names: tuple, constexpr: tuple, defaults: tuple, example: dict):
    """A function `f(kwargs) -> (specialization_key(names, constexpr, kwargs), the launch's arguments in signature
    order, a default where a name is absent)`, as straight-line code: per parameter one dict lookup and, for a
    tensor, an int or a float (the kinds `example`, one call's kwargs, gives it), the class inline, behind a type
    test that hands any other kind to `value_class`; the launch options as `example` has them without a sort. Same
    result as the loop for every argument, of any kind."""
    lines, key_parts = ["    missing = 0"], []
    for i, (name, is_const) in enumerate(zip(names, constexpr)):
        v = f"v{i}"
        lines.append(f"    {v} = get({name!r}, M)")
        kind = type(example.get(name))
        if is_const:
            form = v
        elif kind is int:
            form = (f"(({v} == 1, {v} % 16 == 0, {_INT32_MIN} <= {v} <= {_INT32_MAX}) "
                    f"if type({v}) is int else value_class({v}))")
        elif kind is float:
            form = f"(float if type({v}) is float else value_class({v}))"
        elif isinstance(example.get(name), torch.Tensor):
            form = f"(({v}.dtype, {v}.data_ptr() % 16 == 0) if type({v}) is Tensor else value_class({v}))"
        else:
            form = f"value_class({v})"
        # An absent name keys as None (what the loop's kwargs.get gives) and launches with its default.
        lines.append(f"    if {v} is M:\n        k{i} = None\n        {v} = D[{i}]\n        missing += 1\n"
                     f"    else:\n        k{i} = {form}")
        key_parts.append(f"k{i}")
    # The example's launch options, sorted as launch_options sorts them: when a call has exactly these (its length
    # leaves room for no other keyword), they key without launch_options' set difference and sort.
    options = sorted(set(example) - set(names))
    same_options = " and ".join([f"len(kwargs) == {len(names) + len(options)} - missing"]
                                + [f"{o!r} in kwargs" for o in options])
    option_pairs = _tuple_source(f"({o!r}, kwargs[{o!r}])" for o in options)
    lines.append(f"    if {same_options}:\n        options = {option_pairs}\n"
                 f"    else:\n        options = launch_options(kwargs, P)")
    key = _tuple_source(key_parts)
    arguments = _tuple_source(f"v{i}" for i in range(len(names)))
    source = ("def key_and_arguments(kwargs):\n    get = kwargs.get\n" + "\n".join(lines)
              + f"\n    return ({key}, options), {arguments}\n")
    scope = dict(M=_MISSING, D=defaults, P=frozenset(names), Tensor=torch.Tensor, value_class=value_class,
                 launch_options=launch_options)
    exec(compile(source, f"<ppo_ops launch of {len(names)} parameters>", "exec"), scope)  # noqa: S102
    return scope["key_and_arguments"]


def _tuple_source(parts) -> str:
    return "(" + "".join(f"{p}, " for p in parts) + ")"  # a trailing comma each: a 1-tuple stays a tuple


def bind_arguments(names: tuple, args: tuple, kwargs: dict) -> dict:
    """Positional arguments to their parameter names (signature order), then the keywords, as a call binds them."""
    if len(args) > len(names):
        raise TypeError(f"{len(args)} positional arguments for {len(names)} parameters")
    bound = dict(zip(names, args))
    twice = bound.keys() & kwargs.keys()
    if twice:
        raise TypeError(f"arguments given by position and by name: {sorted(twice)}")
    bound.update(kwargs)
    return bound


class Launcher:
    """One kernel's launches (module docstring). Call as `launcher(grid, *args, **kwargs)`, as `kernel[grid](...)`."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict = {}  # (device, key) -> CompiledKernel
        self._signature = None  # (names, constexpr flags, defaults) once read from the kernel
        self._direct = None  # whether this Triton has what the direct launch needs (decided at the first launch)
        self._key_and_arguments = None  # generated at the first direct launch (key_and_arguments)

    def _read_signature(self) -> bool:
        try:
            params = self.kernel.params
            names = tuple(p.name for p in params)
            constexpr = tuple(bool(p.is_constexpr) for p in params)
            defaults = tuple(p.default for p in params)
            from triton import knobs
            from triton.runtime import driver
            knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook  # noqa: B018  (present?)
            self._hooks, self._driver = knobs.runtime, driver
        except (AttributeError, ImportError):
            return False
        self._signature = (names, constexpr, defaults)
        return True

    def __call__(self, grid: tuple, *args, **kwargs) -> None:
        if self._direct is None:
            self._direct = not _interpreting() and self._read_signature()
        record = getattr(_RECORDING, "launches", None)
        if not self._direct:
            self.kernel[grid](*args, **kwargs)
            if record is not None:
                record.append(Launch(self, None, None, tuple(grid), (), kwargs))
            return
        if args:
            kwargs = bind_arguments(self._signature[0], args, kwargs)
        prepare = self._key_and_arguments
        if prepare is None:
            prepare = self._key_and_arguments = key_and_arguments(*self._signature, kwargs)
        device = torch.cuda.current_device()
        key, args = prepare(kwargs)
        key = (device, key)
        compiled = self._compiled.get(key)
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        if compiled is None:
            compiled = self.kernel[grid](**kwargs)
            if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
                self._compiled[key] = compiled
            else:
                self._direct = False
                compiled = None
        else:
            self.run(compiled, device, grid3, args)
        if record is not None:
            record.append(Launch(self, compiled, device, grid3, args, kwargs))

    def run(self, compiled, device: int, grid: tuple, args: tuple) -> None:
        """Launches `compiled` (a CompiledKernel this launcher keeps) on grid (3 dims) with `args` in signature order,
        on the current stream of `device` (the current device), with Triton's launch hooks."""
        stream = self._driver.active.get_current_stream(device)
        hooks = self._hooks
        enter = hooks.launch_enter_hook
        # launch_metadata is None without an enter hook (what Triton's own launch computes then), so skip the call.
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                     None if enter is None else compiled.launch_metadata(grid, stream, *args), enter,
                     hooks.launch_exit_hook, *args)


class Launch(NamedTuple):
    """One launch a Launcher made, as `recording()` keeps it: enough to make it again with other pointers."""

    launcher: Launcher
    compiled: Optional[object]  # the CompiledKernel; None where it went through kernel[grid] (not replayable)
    device: Optional[int]
    grid: tuple  # three dims (as given, where not replayable)
    args: tuple  # every argument in signature order (empty where not replayable)
    kwargs: dict  # the arguments as the caller named them


_RECORDING = threading.local()


@contextlib.contextmanager
def recording():
    """Every Launcher call this thread makes inside the block, in order, as a list of Launch (the launches happen as
    usual)."""
    launches: list = []
    outer = getattr(_RECORDING, "launches", None)
    _RECORDING.launches = launches
    try:
        yield launches
    finally:
        _RECORDING.launches = outer


_LAUNCHERS: dict = {}  # id(kernel) -> its Launcher (by id: whether a Triton kernel object hashes varies by version)


def launcher(kernel) -> Launcher:
    """The one Launcher of `kernel` (its compiled-kernel cache is per Launcher): for modules that launch many
    kernels, `launcher(kernel)(grid, ...)` in place of `kernel[grid](...)`. Kernels are module globals, so an id
    stays theirs."""
    found = _LAUNCHERS.get(id(kernel))
    if found is None:
        found = _LAUNCHERS[id(kernel)] = Launcher(kernel)
    return found


def _interpreting() -> bool:
    from ppo_ops.core.triton_common import interpreting
    return interpreting()
