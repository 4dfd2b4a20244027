"""The record (one long-format CSV, every family's rows) and its report (Markdown, and a PNG where asked).

The CSV is the record: one row per measured case, appended as it is measured, with the run's environment on every
row (GPU, versions, commit, the run's timestamp, which names the run) and the case's round (bench --rounds). Each
row also names the rows it is set against (`baseline`: case fields that differ, e.g. `provider=gemms`, several
separated by "; "; `floor`: the body-only step under a whole-step row), so the report needs nothing but the CSV.

The report gives numbers, no verdicts: per family the latest row of every case, and for each row with a baseline
the ratios to it: p50 time, back-to-back time, peak extra memory (and the extra over the floor against the
baseline's extra over it), and the p50 difference in ms. A row and its baseline measured in one run are paired
round by round (the latest run that measured both) and each figure is the median over the rounds with its range;
otherwise the latest row of each is used (marked "separate runs").
"""

from __future__ import annotations

import csv
import math
import os
import statistics
from typing import Callable, Iterable, Optional

CASE_COLUMNS = ("family", "provider", "T", "V", "V_local", "H", "dtype", "entropy", "keep_mask", "row_frac", "tp",
                "validate", "inplace_grad")
COLUMNS = CASE_COLUMNS + (
    "label", "status", "check", "err_logprob", "err_entropy", "err_dx_rel", "reps", "p20_ms", "p50_ms", "p80_ms",
    "host_ms", "steady_ms", "peak_extra_mib", "bytes", "gbps", "copy_gbps", "frac_copy_bw", "baseline", "floor",
    "gpu", "torch", "triton", "packages", "commit", "timestamp", "round")
CASE_KEY = tuple(c for c in CASE_COLUMNS if c != "V_local")  # a later row of the same key is the same case again
HEADLINE = dict(family="logits", T="8192", V="151936", dtype="bf16", tp="1", entropy="grad", keep_mask="off",
                row_frac="1.0")


# --- the CSV ---


def append_csv(path: str, rows: Iterable[dict], columns=COLUMNS) -> None:
    """Appends rows (missing cells empty); writes the header when the file is new; refuses a foreign header."""
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        with open(path, newline="") as f:
            header = tuple(next(csv.reader(f), None) or ())
        if header != tuple(columns):
            raise ValueError(f"{path}: its columns {list(header)} are not the bench's; use a new --csv")
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row.get(k)) for k in columns})


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def read_csv(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def format_fields(fields: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in fields.items())


def parse_fields(text: str) -> dict:
    return dict(part.split("=", 1) for part in text.split(",") if part)


def number(row: dict, key: str) -> Optional[float]:
    """A cell as a float; None where empty or not a number."""
    try:
        value = float(row.get(key) or "")
    except ValueError:
        return None
    return None if math.isnan(value) else value


def key_of(row: dict) -> tuple:
    return tuple(row.get(k, "") for k in CASE_KEY)


def latest_per_case(rows: list[dict]) -> list[dict]:
    """The last row of each case, in order of first appearance."""
    latest: dict = {}
    for row in rows:
        latest[key_of(row)] = row  # an existing key keeps its place
    return list(latest.values())


# --- pairing over rounds ---


def rounds(rows: list[dict], *cases: tuple) -> list[tuple]:
    """Per round of the latest run (timestamp) that measured every one of `cases` (CASE_KEY tuples) with status ok:
    a tuple of one row per case, in round order; [] where no run measured them all."""
    runs: dict = {}  # timestamp -> round -> [row per case]
    for row in rows:
        if row.get("status") != "ok":
            continue
        for i, case in enumerate(cases):
            if key_of(row) == case:
                per_round = runs.setdefault(row.get("timestamp", ""), {})
                per_round.setdefault(row.get("round") or "1", [None] * len(cases))[i] = row
    for run in reversed(list(runs)):
        full = [tuple(found) for _, found in sorted(runs[run].items(), key=lambda kv: int(kv[0])) if None not in found]
        if full:
            return full
    return []


def median_of(pairs: list[tuple], value: Callable[..., Optional[float]]) -> Optional[float]:
    """The median over rounds of value(*rows), rounds where it is None left out."""
    values = [v for v in (value(*rows) for rows in pairs) if v is not None]
    return statistics.median(values) if values else None


def spread(pairs: list[tuple], value: Callable[..., Optional[float]], spec: str) -> str:
    """'median' of value(*rows) formatted with spec, then ' [min, max]' over rounds where there are several."""
    values = [v for v in (value(*rows) for rows in pairs) if v is not None]
    if not values:
        return ""
    text = format(statistics.median(values), spec)
    return text + (f" [{min(values):{spec}}, {max(values):{spec}}]" if len(values) > 1 else "")


def _ratio(key: str) -> Callable:
    def of(mine, base, *_):
        a, b = number(mine, key), number(base, key)
        return None if a is None or not b else a / b
    return of


def _difference(mine, base, *_):
    a, b = number(mine, "p50_ms"), number(base, "p50_ms")
    return None if a is None or b is None else a - b


def _over_floor(mine, base, floor):
    """The row's peak over the floor's, against the baseline's peak over the floor's."""
    m, b, f = (number(r, "peak_extra_mib") for r in (mine, base, floor))
    return None if None in (m, b, f) or b == f else (m - f) / (b - f)


def comparisons(all_rows: list[dict]) -> list[list[str]]:
    """One table row per (measured case, baseline it names): the paired figures of the module docstring."""
    out = []
    for row in latest_per_case(all_rows):
        if row.get("status") != "ok" or not row.get("baseline"):
            continue
        floor = parse_fields(row.get("floor", ""))
        for text in row["baseline"].split("; "):
            base_key = key_of(dict(row, **parse_fields(text)))
            cases = [key_of(row), base_key] + ([key_of(dict(row, **floor))] if floor else [])
            found, note = rounds(all_rows, *cases), ""
            if not found:  # measured in separate runs (TP = 2 against TP = 1): the latest row of each
                latest = {key_of(r): r for r in all_rows if r.get("status") == "ok"}
                if not all(c in latest for c in cases):
                    continue
                found, note = [tuple(latest[c] for c in cases)], " (separate runs)"
            out.append([
                _label(row), _shape(row), text + note, str(len(found)),
                spread(found, lambda m, *_: number(m, "p50_ms"), ".3f"),
                spread(found, lambda _m, b, *_: number(b, "p50_ms"), ".3f"),
                spread(found, _ratio("p50_ms"), ".3f"), spread(found, _difference, "+.3f"),
                spread(found, _ratio("steady_ms"), ".3f"), spread(found, _ratio("peak_extra_mib"), ".3f"),
                spread(found, _over_floor, ".3f") if floor else ""])
    return out


COMPARISON_HEADER = ["case", "shape", "against", "rounds", "p50 ms", "its p50 ms", "time ratio", "p50 difference ms",
                     "back-to-back ratio", "peak ratio", "extra over the floor, ratio"]


# --- the Markdown ---


def _label(row: dict) -> str:
    """The provider and the options that set the row apart from its default."""
    label = row["provider"]
    if row.get("inplace_grad") == "on":
        label += " inplace"
    if row.get("validate") == "off":
        label += " no-validate"
    return label


def _shape(row: dict) -> str:
    parts = [f"T={row['T']}", f"V={row['V']}"] + ([f"H={row['H']}"] if row.get("H") else [])
    parts += [row["dtype"], f"entropy {row['entropy']}"]
    if row.get("keep_mask") == "on":
        parts.append("keep mask")
    if row.get("row_frac") not in ("", "1.0", None):
        parts.append(f"rows {float(row['row_frac']):.0%}")
    return " ".join(parts + [f"TP={row['tp']}"])


def _fmt(row: dict, key: str, spec: str) -> str:
    value = number(row, key)
    return "" if value is None else format(value, spec)


CASE_TABLE = (  # (header, cell); a column empty in every row of a family is left out of its table
    ("case", _label), ("shape", _shape),
    ("p50 ms", lambda r: _fmt(r, "p50_ms", ".3f")),
    ("p20–p80 ms", lambda r: f"{_fmt(r, 'p20_ms', '.3f')}–{_fmt(r, 'p80_ms', '.3f')}" if r.get("p20_ms") else ""),
    ("host ms", lambda r: _fmt(r, "host_ms", ".3f")),
    ("back to back ms", lambda r: _fmt(r, "steady_ms", ".3f")),
    ("GB/s", lambda r: _fmt(r, "gbps", ".0f")),
    ("of copy BW", lambda r: _fmt(r, "frac_copy_bw", ".1%")),
    ("peak extra MiB", lambda r: _fmt(r, "peak_extra_mib", ".1f")),
    ("|Δ log-prob| vs float64", lambda r: _fmt(r, "err_logprob", ".2e")),
    ("|Δ entropy| vs float64", lambda r: _fmt(r, "err_entropy", ".2e")),
    ("dX rel. vs float64", lambda r: _fmt(r, "err_dx_rel", ".2e")),
    ("status", lambda r: r["status"] if r.get("check") in ("", "ok", None) else f"{r['status']}, {r['check']}"),
)


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _case_table(rows: list[dict]) -> str:
    cells = [[cell(r) for _, cell in CASE_TABLE] for r in rows]
    keep = [i for i in range(len(CASE_TABLE)) if any(c[i] for c in cells)]
    return md_table([CASE_TABLE[i][0] for i in keep], [[c[i] for i in keep] for c in cells])


def render_markdown(all_rows: list[dict]) -> str:
    rows = latest_per_case(all_rows)
    parts = ["# ppo_ops bench", ""]
    for env in sorted({(r["gpu"], r["torch"], r["triton"], r["packages"], r["commit"]) for r in rows}):
        parts.append("- {}; torch {}, triton {}; {}; commit {}".format(*(v or "?" for v in env)))
    for stamp, copy, label in sorted({(r["timestamp"], r["copy_gbps"], r["label"]) for r in rows if r["copy_gbps"]}):
        parts.append(f"- run {stamp}{f' ({label})' if label else ''}: device copy {float(copy):.0f} GB/s "
                     "(read + write)")
    parts += ["- time: forward + backward, p50 of CUDA-event timings (p20–p80); host ms: the host's wall time in the "
              "call before any synchronisation; back to back: wall-clock ms per step over a run of steps with one "
              "synchronisation; TP > 1 rows: the slowest rank; a row whose case ran again shows its latest run", ""]
    head = [r for r in rows if all(r.get(k) == v for k, v in HEADLINE.items())]
    if head:
        parts += ["## Headline: T=8192, V=151936, bf16, log-prob + entropy with gradient, TP=1, no masks", "",
                  _case_table(head), ""]
    table = comparisons(all_rows)
    if table:
        parts += ["## Against the baselines", "",
                  "Each ratio is the row's figure over its baseline's (median over the rounds of one run, [range]); "
                  "the difference is the row's p50 less the baseline's.", "", md_table(COMPARISON_HEADER, table), ""]
    for family in dict.fromkeys(r["family"] for r in rows):
        parts += [f"## {family}", "", _case_table([r for r in rows if r["family"] == family]), ""]
    return "\n".join(parts)


def render_plot(all_rows: list[dict], path: str) -> None:
    """The logits family's p50 (p20–p80 bars) and peak extra memory against T, per provider; TP=1, no masks, bf16 and
    fp32, with and without the entropy's gradient."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in latest_per_case(all_rows) if r["family"] == "logits" and r["status"] == "ok" and r["tp"] == "1"
            and r["keep_mask"] == "off" and r["row_frac"] == "1.0" and r.get("validate") != "off"
            and r["V"] == HEADLINE["V"]]
    panels = [(dt, ent) for ent in ("grad", "none") for dt in ("bf16", "fp32")]
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7.5), squeeze=False)
    for col, (dtype, entropy) in enumerate(panels):
        time_ax, mem_ax = axes[0][col], axes[1][col]
        series: dict = {}
        for r in sorted(rows, key=lambda r: int(r["T"])):
            if r["dtype"] == dtype and r["entropy"] == entropy:
                series.setdefault(_label(r), []).append(r)
        for label, pts in sorted(series.items()):
            ts, p50 = [int(r["T"]) for r in pts], [number(r, "p50_ms") for r in pts]
            bars = [[m - number(r, "p20_ms") for m, r in zip(p50, pts)],
                    [number(r, "p80_ms") - m for m, r in zip(p50, pts)]]
            time_ax.errorbar(ts, p50, yerr=bars, marker="o", capsize=3, label=label)
            mem = [(int(r["T"]), number(r, "peak_extra_mib")) for r in pts if r.get("peak_extra_mib")]
            if mem:
                mem_ax.plot([t for t, _ in mem], [m / 1024 for _, m in mem], marker="o", label=label)
        time_ax.set_title(f"{dtype}, {'log-prob + entropy grad' if entropy == 'grad' else 'log-prob only'}")
        time_ax.set_ylabel("forward + backward, ms (p50, p20–p80)")
        mem_ax.set_ylabel("peak extra memory, GiB")
        for ax in (time_ax, mem_ax):
            ax.set_xlabel(f"T (tokens); V={HEADLINE['V']}, TP=1")
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=7)
    fig.suptitle(f"ppo_ops bench: {', '.join(sorted({r['gpu'] for r in rows})) or 'no measurements'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(csv_path: str, md_path: str, png_path: str = "") -> None:
    rows = read_csv(csv_path)
    with open(md_path, "w") as f:
        f.write(render_markdown(rows))
    if png_path:
        render_plot(rows, png_path)


def describe(row: dict) -> str:
    """The progress line of a row."""
    head = f"{row['family']:7s} {_label(row):24s} {_shape(row)}"
    if row["status"] != "ok":
        return f"{head}: {row['status']}"
    parts = [f"p50 {row['p50_ms']:.3f} ms [{row['p20_ms']:.3f}, {row['p80_ms']:.3f}]", f"host {row['host_ms']:.3f}"]
    if row.get("steady_ms") is not None:
        parts.append(f"back to back {row['steady_ms']:.3f}")
    if row.get("frac_copy_bw") is not None:
        parts.append(f"{row['gbps']:.0f} GB/s ({row['frac_copy_bw']:.0%} of copy)")
    if row.get("peak_extra_mib") is not None:
        parts.append(f"peak extra {row['peak_extra_mib']:.1f} MiB")
    return f"{head}: {', '.join(parts)}, check {row.get('check') or 'off'}"
