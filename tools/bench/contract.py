"""What every bench family gives the runner: cases, providers, inputs, a check, a record row and a report.

A family is one kind of measurement: the logits op (and the whole RL step built on it) over [T, V] logits, or the LM
head from hidden states. Its cases are frozen dataclasses with `provider`, `tp` and `input_key()`; its providers are
`Provider` records in one name-keyed registry (`registry`). The runner (runner.py) does the rest the same way for all:
skip with a reason, make or reuse inputs, check, warm up, peak memory, time, merge the ranks, append the row.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Optional, Protocol, Sequence


@dataclasses.dataclass
class Closure:
    """One provider on one input set. `prepare` is untimed and returns what `step` runs on (a refilled copy when the
    step destroys its input); `step` is timed and returns what a trainer would keep alive (so it counts at the peak);
    `forward` gives the untimed outputs the family's check compares."""

    prepare: Callable[[], Any]
    step: Callable[[Any], Any]
    forward: Optional[Callable[[], Any]] = None


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    build: Callable[[Any, Any], Closure]  # (case, inputs) -> Closure
    unsupported: Callable[[Any, Any], Optional[str]]  # (case, torch.device) -> why it cannot run, or None
    checked: bool = True  # the family's check applies to its forward
    modules: tuple[str, ...] = ()  # what `build` imports; imported before the first case (see `preload`)


def registry(*providers: Provider) -> dict[str, Provider]:
    """Providers by name; a name given twice is a mistake in the list."""
    out = {}
    for p in providers:
        if p.name in out:
            raise ValueError(f"provider {p.name!r} registered twice")
        out[p.name] = p
    return out


@functools.lru_cache(maxsize=None)
def import_problem(module: str) -> Optional[str]:
    """None when `module` imports, else why not (cached: imports are slow)."""
    try:
        importlib.import_module(module)
    except Exception as error:  # ImportError, or a package that fails at import (e.g. needs a GPU driver)
        first_line = (str(error).splitlines() or [""])[0]
        return f"{module} is not importable ({type(error).__name__}: {first_line})"
    return None


def first_import_problem(modules: Sequence[str]) -> Optional[str]:
    return next((p for p in map(import_problem, modules) if p), None)


def preload(providers: Sequence[Provider]) -> None:
    """Imports what the providers need now rather than inside a timed case (failures are reported per case)."""
    for p in providers:
        first_import_problem(p.modules)


@dataclasses.dataclass(frozen=True)
class RankResult:
    """One rank's measurement of one case (gathered to rank 0, so plain values only)."""

    status: str  # "ok", "OOM", "skipped: ...", "error: ..."
    checks: dict = dataclasses.field(default_factory=dict)  # the family's check columns
    timing: Any = None  # measure.Timing when measured
    peak: Optional[int] = None  # peak extra bytes (None off CUDA)
    steady_ms: Optional[float] = None  # ms per step back to back (measure.steady_ms), where the family asks for it


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What every row of one run shares."""

    env: dict  # runner.environment(): GPU, versions, date
    copy_gbps: Optional[float]  # the device copy bandwidth when the family measures against it
    label: str
    round: int = 1  # which pass over the case list (bench --rounds), from 1


class Family(Protocol):
    """One kind of measurement (see the module docstring). Instances live for one run on one rank."""

    providers: dict[str, Provider]
    measures_copy_bandwidth: bool  # measure the device copy first (printed); rows may set their GB/s against it
    times_steady: bool  # also time each case back to back (measure.steady_ms), for config.steady_s

    def make_inputs(self, case, device, *, seed: int, rank: int, group) -> Any:
        """Seeded inputs of the case for this rank (shared by the consecutive cases with its input_key())."""

    def check(self, case, inputs, closure: Closure, memo: dict, check_rows: int) -> dict:
        """This rank's check columns of a closure, before it is timed. `memo` lives as long as the input set (for
        float64 references and other providers' outputs on the same inputs); a collective when TP > 1."""

    def row(self, case, results: list[RankResult], info: RunInfo) -> dict:
        """One record row from every rank's result (rank 0)."""

    def describe(self, row: dict) -> str:
        """The progress line of a row."""

    def append(self, row: dict) -> None:
        """Writes a row to the record as soon as it is measured (a run cut short keeps what it measured)."""

    def record_rows(self) -> list[dict]:
        """Every row of the record so far (the rows of earlier runs first)."""

    def render(self) -> None:
        """Renders the report from the whole record."""

    def problem(self, row: dict) -> Optional[str]:
        """What is wrong with a row (an unexpected error, a failed check), or None: any problem fails the run."""
