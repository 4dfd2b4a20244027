"""What every family of the bench shares: the case, the provider record, and the top-p replay's keep set.

A `Case` is one forward + backward of one provider on one input set; its fields are the case columns of the record
(report.COLUMNS). A family (logits.py, lm_head.py, step.py) is a module with
  PROVIDERS     name -> Provider
  SUITES        suite name -> a function listing its cases, most important first; SMOKE: the tiny CPU cases
  TIMES_STEADY  whether each case is also timed back to back (measure.steady_ms)
  make_inputs(case, device, *, seed, rank, group)  the seeded inputs of a case on this rank
  check(case, inputs, closure, memo, check_rows)  the check columns of a closure before it is timed (`memo` lives
                as long as the input set)
  bytes_moved(case)  the bytes the op must move (None where a byte count means nothing)
  baselines(case)  ([overrides of the case fields naming each row it is set against], the floor's or None): what
                the report divides this row by (report.py)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Optional, Sequence

QWEN3_VOCAB = 151936  # Qwen3's vocabulary (2^7 x 1187: splits into the 8 fixed segments)
NUCLEUS = 64  # kept ids per row of the keep-set rows (top-p replay)


@dataclasses.dataclass(frozen=True)
class Case:
    family: str  # "logits" | "lm_head" | "step"
    provider: str
    T: int  # tokens (rows)
    V: int  # global vocabulary; each of the `tp` ranks holds V // tp columns (or weight rows)
    dtype: str = "bf16"  # the logits' (or hidden states') dtype: "bf16" | "fp32"
    entropy: str = "grad"  # "none" (log-prob only) | "value" (no gradient) | "grad"
    keep_mask: bool = False  # a random dense keep mask (renormalises the log-prob)
    row_frac: float = 1.0  # fraction of rows the row mask keeps; 1.0 = no row mask
    tp: int = 1
    validate: Optional[bool] = None  # a provider that calls ppo_ops: its validate (None: no such switch)
    inplace_grad: Optional[bool] = None  # likewise
    H: Optional[int] = None  # hidden size (the LM head's cases)

    @property
    def v_local(self) -> int:
        return self.V // self.tp

    @property
    def kept_rows(self) -> int:
        """Rows the row mask keeps: round(row_frac * T), at least one."""
        return self.T if self.row_frac >= 1.0 else max(1, round(self.row_frac * self.T))

    def input_key(self) -> tuple:
        """Consecutive cases with equal keys share one input set."""
        return (self.family, self.T, self.V, self.H, self.dtype, self.tp, self.keep_mask, self.row_frac)

    def fields(self) -> dict:
        """The case's cells in the record."""
        def on_off(v):
            return "" if v is None else ("on" if v else "off")

        return dict(family=self.family, provider=self.provider, T=self.T, V=self.V, V_local=self.v_local,
                    H=self.H or "", dtype=self.dtype, entropy=self.entropy, keep_mask=on_off(self.keep_mask),
                    row_frac=f"{self.row_frac:.1f}", tp=self.tp, validate=on_off(self.validate),
                    inplace_grad=on_off(self.inplace_grad))


@dataclasses.dataclass
class Closure:
    """One provider on one input set. `prepare` is untimed and returns what `step` runs on (a refilled copy when the
    step destroys its input); `step` is timed and returns what a trainer keeps alive (so it counts at the peak);
    `forward` gives the untimed outputs the family's check compares (None: not checked)."""

    prepare: Callable[[], Any]
    step: Callable[[Any], Any]
    forward: Optional[Callable[[], Any]] = None


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    build: Callable[[Case, Any], Closure]  # (case, inputs) -> Closure
    unsupported: Callable[[Case, Any], Optional[str]]  # (case, torch.device) -> why it cannot run, or None
    modules: tuple[str, ...] = ()  # what `build` imports; imported before the first case
    peer: bool = False  # another project's kernel: its error is a row of the record, not a failed run


def registry(*providers: Provider) -> dict[str, Provider]:
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
        return f"{module} is not importable ({type(error).__name__}: {(str(error).splitlines() or [''])[0]})"
    return None


def first_import_problem(modules: Sequence[str]) -> Optional[str]:
    return next((p for p in map(import_problem, modules) if p), None)


# --- the keep set: a 64-id nucleus per row, as top-p replay has it ---


def nucleus(targets, vocab: int, seed: int) -> tuple:
    """(ids [T * NUCLEUS] int64, offsets [T + 1] int64), the CSR keep set ppo_ops takes (global ids, the same on every
    rank): each row's target first (the sampled token), then NUCLEUS - 1 seeded random ids."""
    import torch

    flat = targets.reshape(-1)
    gen = torch.Generator(device=flat.device).manual_seed(seed)
    rest = torch.randint(0, vocab, (flat.numel(), NUCLEUS - 1), generator=gen, device=flat.device)
    ids = torch.cat([flat.reshape(-1, 1).to(torch.int64), rest], dim=1).reshape(-1)
    offsets = torch.arange(flat.numel() + 1, device=flat.device, dtype=torch.int64) * NUCLEUS
    return ids, offsets


def dense_mask(keep: tuple, n_rows: int, v_local: int, vocab_start: int = 0):
    """[n_rows, v_local] bool, True at this rank's columns of each row's kept ids: the keep_mask a trainer without the
    sparse form builds (1.2 GB at T = 8192 and Qwen3's vocabulary)."""
    import torch

    ids = keep[0].view(n_rows, NUCLEUS) - vocab_start
    local = (ids >= 0) & (ids < v_local)
    mask = torch.zeros((n_rows, v_local), dtype=torch.uint8, device=ids.device)
    # Other ranks' ids point at column 0 with 0: a max, not a plain scatter, so that they cannot clear a kept column 0
    mask.scatter_reduce_(1, torch.where(local, ids, 0), local.to(torch.uint8), reduce="amax")
    return mask.view(torch.bool)


def keep_missing() -> Optional[str]:
    """Why this ppo_ops cannot take a sparse keep set, or None."""
    import inspect

    import ppo_ops

    if "keep" not in inspect.signature(ppo_ops.log_probs_and_entropy).parameters:
        return "this ppo_ops has no sparse keep set (keep=)"
    return None
