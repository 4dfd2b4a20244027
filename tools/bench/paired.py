"""Targets that compare ways measured in the same run, round by round (bench --rounds), judged on the median.

Why: on a noisy host a row's p50 moves by more than the differences these targets judge (a Megatron step's 0.2%, a
keep set's 5%), and rows measured minutes apart see different phases of the host. A run with --rounds=N measures its
case list N times, every other round in reverse order, so each way is measured early and late and next to the ways
it is compared with. A comparison here takes the latest run (its date) that measured every case it needs, pairs the
rows of each round, and judges the median over rounds of the per-round difference or ratio; with one round that is
the one pair. Peaks are judged on the worst round.

The targets (their bounds are the issues' targets, named below):
  - the Megatron step (providers mcore_*, and mcore_*_flash on the SDPA body): the head's peak over the body-only
    step at most STEP_MEMORY_SHARE of the logits path's, and its step no slower than the logits path's, for each head
    way, T and validate setting measured;
  - the sparse keep set: the logits op (keep_set suite) within KEEP_LOGITS_SLOWDOWN of the same call without one,
    the fused head and the token loss (lm_head_keep suite, lm_head_report.py) within KEEP_HEAD_SLOWDOWN, each peak
    within KEEP_PEAK_GROWTH of the call without one.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Optional

STEP_MEMORY_SHARE = 0.25  # target: the head's peak over the body-only step <= a quarter of the logits path's
KEEP_LOGITS_SLOWDOWN = 1.10  # target: the logits op with a 64-id sparse keep set within 10% of the op without one
KEEP_HEAD_SLOWDOWN = 1.05  # target: the fused head / token loss with the keep set within 5% of the same call
KEEP_PEAK_GROWTH = 1.02  # target: peak extra with the keep set at most 2% above the same call's without one
# The Megatron step's ways through the output processor (each with its _flash twin on the SDPA body).
MCORE_HEAD_WAYS = ("mcore_head", "mcore_head_spare", "mcore_loss", "mcore_loss_spare", "mcore_loss_lean")


def number(row: dict, key: str) -> Optional[float]:
    try:
        value = float(row.get(key, ""))
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def matches(row: dict, fields: dict) -> bool:
    return all(row.get(k) == v for k, v in fields.items())


def rounds(rows: list[dict], *cases: dict, run_key: str = "date") -> list[tuple]:
    """Per round of the latest run (rows sharing `run_key`) whose rows match every one of `cases` (dicts of fields)
    with status ok: a tuple of one row per case, in round order; [] where no run measured them all. Rows without a
    round are round 1."""
    runs: dict = {}  # run -> round -> [row per case]
    order: list = []  # runs in the order they first appear
    for row in rows:
        if row.get("status") != "ok":
            continue
        run = row.get(run_key, "")
        for i, fields in enumerate(cases):
            if matches(row, fields):
                if run not in runs:
                    runs[run] = {}
                    order.append(run)
                runs[run].setdefault(row.get("round") or "1", [None] * len(cases))[i] = row
    for run in reversed(order):
        full = [tuple(found) for _, found in sorted(runs[run].items(), key=lambda kv: int(kv[0]))
                if None not in found]
        if full:
            return full
    return []


def median_of(pairs: list[tuple], value: Callable[..., Optional[float]]) -> Optional[float]:
    """The median over rounds of value(*rows) (None where a round's value is missing)."""
    values = [v for v in (value(*rows) for rows in pairs) if v is not None]
    return statistics.median(values) if values else None


def spread(pairs: list[tuple], value: Callable[..., Optional[float]], spec: str) -> str:
    """', median over N rounds (range a to b)' of value(*rows); '' for one round."""
    values = [v for v in (value(*rows) for rows in pairs) if v is not None]
    if len(values) < 2:
        return ""
    return f", median over {len(values)} rounds (range {min(values):{spec}} to {max(values):{spec}})"


def worst_of(found: list) -> str:
    """' (worst of N rounds)'; '' for one round."""
    return f" (worst of {len(found)} rounds)" if len(found) > 1 else ""


def _verdict(met: bool, missed: str) -> str:
    return "met" if met else missed


def megatron_step_targets(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for each Megatron-step head way measured beside the logits path and the body."""
    out = []
    seen = []  # (suffix, T, validate) in the order the record has them
    for row in rows:
        provider = row.get("provider", "")
        if provider in ("mcore_logits", "mcore_logits_flash"):
            key = (provider[len("mcore_logits"):], row.get("T"), row.get("validate"))
            if key not in seen:
                seen.append(key)
    for suffix, T, validate in seen:
        shape = dict(T=T, tp="1", dtype="bf16", entropy="grad")
        body = dict(provider="mcore_body" + suffix, **shape)
        logits = dict(provider="mcore_logits" + suffix, validate=validate, **shape)
        where = f"T={T}{' flash' if suffix else ''} validate {validate}"
        for way in MCORE_HEAD_WAYS:
            mine = dict(provider=way + suffix, validate=validate, **shape)
            found = rounds(rows, mine, logits, body)
            if not found:
                continue
            out += [_step_memory(way, where, found), _step_time(way, where, found)]
    return out


def _step_memory(way: str, where: str, found: list[tuple]) -> tuple[str, str, str]:
    def over(mine, logits, body):  # MiB by which the head's extra exceeds the bound
        m, g, b = (number(r, "peak_extra_mib") for r in (mine, logits, body))
        return None if None in (m, g, b) else (m - b) - STEP_MEMORY_SHARE * (g - b)

    worst = max(found, key=lambda rows: over(*rows) if over(*rows) is not None else -math.inf)
    excess = over(*worst)
    if excess is None:
        return (f"Megatron step {where}, {way}: memory", "not measured (no peak on this device)", "n/a")
    m, g, b = (number(r, "peak_extra_mib") for r in worst)
    return (f"Megatron step {where}, {way}: peak over the body <= {STEP_MEMORY_SHARE:.2f} x the logits path's",
            f"+{m - b:.1f} MiB against a bound of {STEP_MEMORY_SHARE * (g - b):.1f} (the logits path "
            f"+{g - b:.1f}){worst_of(found)}",
            _verdict(excess <= 0, f"missed by {excess:.1f} MiB"))


def _step_time(way: str, where: str, found: list[tuple]) -> tuple[str, str, str]:
    def difference(mine, logits, _body):
        a, b = number(mine, "p50_ms"), number(logits, "p50_ms")
        return None if None in (a, b) else a - b

    diff = median_of(found, difference)
    if diff is None:
        return (f"Megatron step {where}, {way}: step no slower than the logits path", "not measured", "n/a")
    mine = median_of(found, lambda m, _g, _b: number(m, "p50_ms"))
    logits = median_of(found, lambda _m, g, _b: number(g, "p50_ms"))
    return (f"Megatron step {where}, {way}: step no slower than the logits path",
            f"p50 {mine:.2f} vs {logits:.2f} ms; paired difference {diff:+.2f} ms"
            f"{spread(found, difference, '+.2f')}",
            _verdict(diff <= 0, f"missed by {diff:+.2f} ms"))


def keep_targets(rows: list[dict], pairs: list[tuple[dict, dict, str]], bound: float, *, time_keys=("p50_ms",),
                 peak_key: str = "peak_extra_mib", run_key: str = "date") -> list[tuple[str, str, str]]:
    """(target, measured, verdict) of each (with the keep set, without it, what) in `pairs`: time within `bound` of
    the call without a keep set on each of `time_keys` (the median over rounds of the per-round ratio), peak within
    KEEP_PEAK_GROWTH (the worst round)."""
    out = []
    for with_keep, without, what in pairs:
        found = rounds(rows, with_keep, without, run_key=run_key)
        if not found:
            continue
        for key in time_keys:
            def ratio(a, b, key=key):
                x, y = number(a, key), number(b, key)
                return None if x is None or not y else x / y

            r = median_of(found, ratio)
            if r is None:
                continue
            out.append((f"keep set, {what}: {key} within {bound - 1:.0%} of the call without one",
                        f"{r:.3f} x{spread(found, ratio, '.3f')}",
                        _verdict(r <= bound, f"missed: {r - 1:+.1%}")))

        def growth(a, b):
            x, y = number(a, peak_key), number(b, peak_key)
            return None if x is None or not y else x / y

        worst = max((g for g in (growth(*p) for p in found) if g is not None), default=None)
        if worst is not None:
            out.append((f"keep set, {what}: peak extra within {KEEP_PEAK_GROWTH - 1:.0%} of the call without one",
                        f"{worst:.4f} x{worst_of(found)}",
                        _verdict(worst <= KEEP_PEAK_GROWTH, f"missed: {worst - 1:+.2%}")))
    return out
