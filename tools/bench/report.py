"""Bench outputs: one long-format CSV (appended case by case), a Markdown summary and a PNG plot rendered from it.

The CSV is the record: one row per case and run, with the environment (GPU, versions, date) on every row, so results
of several runs (TP=1 on one GPU, TP=2 over two) can be appended to one file and rendered together. When a case
appears more than once, the Markdown and the plot use its latest row.

The Markdown has the environment, the performance targets checked against the measurements (met / missed by how much /
not measured; those that set one way against another over the rounds of one run, paired.py), the headline shape, the
small calls (the small_call suite: device and host time per call), and every case. The plot shows p50 time (p20-p80
bars) and peak extra memory against T for each provider, TP=1, no masks.
"""

from __future__ import annotations

import csv
import math
import os
from typing import Iterable, Optional, Sequence

from tools.bench import paired

COLUMNS = (
    "provider", "T", "V", "V_local", "dtype", "entropy", "keep_mask", "row_frac", "kept_rows", "tp", "validate",
    "inplace_grad", "status", "check", "reps", "p20_ms", "p50_ms", "p80_ms", "host_ms", "bytes_fwd", "bytes_bwd",
    "gbps", "copy_gbps", "frac_copy_bw", "peak_extra_mib", "grad_mib", "device", "gpu", "torch", "triton", "ppo_ops",
    "liger_kernel", "megatron_core", "torch_compile", "date", "round",
)
# Fields that identify a case (a later row with the same key replaces an earlier one in the rendered outputs).
CASE_KEY = ("provider", "T", "V", "dtype", "entropy", "keep_mask", "row_frac", "tp", "validate", "inplace_grad")

HEADLINE = dict(T="8192", V="151936", dtype="bf16", tp="1", keep_mask="off", row_frac="1.0")
TIME_TARGET_FRAC = 0.8  # target: at least 80% of the measured copy bandwidth
MEM_SLACK_MIB = 64.0  # target: peak extra <= gradient buffer + 64 MiB (64 MiB with inplace_grad)
# Small-call targets (the small_call suite: T = 1024, V = 151936, bf16, entropy with gradient, validate off), ms per
# forward + backward: eager, and under torch.compile(mode="reduce-overhead").
SMALL_CALL_TARGETS_MS = {"eager": 0.5, "reduce_overhead": 0.35}
TP2_SLOWDOWN = 1.15  # target: TP=2 rank time at most 15% above TP=1 on logits of the same local size
# The keep_set suite's cases (the sparse keep set is the provider's: its row has no keep mask)
KEEP_SHAPE = dict(T="8192", V="151936", dtype="bf16", tp="1", entropy="grad", keep_mask="off", row_frac="1.0",
                  inplace_grad="off")


def fmt_bool(value: Optional[bool]) -> str:
    return "n/a" if value is None else ("on" if value else "off")


def append_csv(path: str, rows: Iterable[dict], columns: Sequence[str] = COLUMNS) -> None:
    """Appends rows (dicts keyed by `columns`); writes the header when the file is new. A record written before
    columns were added (its header a subset of `columns`) is rewritten first with the new header, its rows' new cells
    empty, so that a record keeps growing across bench versions. Refuses a foreign header."""
    rows = list(rows)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new and csv_columns(path) != tuple(columns) and set(csv_columns(path)) < set(columns):
        write_csv(path, read_csv(path), columns)
    if not new and csv_columns(path) != tuple(columns):
        raise ValueError(f"{path}: existing CSV has columns {list(csv_columns(path))}, expected {list(columns)}; "
                         "use a new --csv")
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row.get(k)) for k in columns})


def csv_columns(path: str) -> tuple:
    """The header of an existing CSV."""
    with open(path, newline="") as f:
        return tuple(next(csv.reader(f), None) or ())


def write_csv(path: str, rows: Iterable[dict], columns: Sequence[str]) -> None:
    """Writes the whole file: the header, then each row's `columns` (missing ones empty)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
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
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def latest_per_case(rows: list[dict]) -> list[dict]:
    """The last row of each case, in order of first appearance."""
    order, latest = [], {}
    for row in rows:
        key = tuple(row[k] for k in CASE_KEY)
        if key not in latest:
            order.append(key)
        latest[key] = row
    return [latest[k] for k in order]


_num = paired.number  # a CSV cell as a float; None where empty or NaN


def _find(rows: list[dict], **fields) -> Optional[dict]:
    for row in rows:
        if paired.matches(row, fields) and row.get("status") == "ok":
            return row
    return None


def case_label(row: dict) -> str:
    """The provider and the options that set a row apart from its default (the tables' and the plot's name)."""
    label = row["provider"]
    if row.get("inplace_grad") == "on":
        label += " inplace"
    if row.get("validate") == "off":
        label += " no-validate"
    return label


def target_rows(all_rows: list[dict]) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for each performance target: the headline's from the latest row of each case (the
    time and TP=2 targets get a second row for validate=False, no host sync, when that was measured); the small
    calls', the sparse keep set's and the Megatron step's from the rounds of the latest run that measured what each
    compares (paired.py)."""
    rows = latest_per_case(all_rows)
    out = []
    head = dict(HEADLINE, entropy="grad")
    tri = _find(rows, provider="triton", validate="on", inplace_grad="off", **head)
    if tri:
        out.append(_time_target(tri, "time"))
        peak, grad = _num(tri, "peak_extra_mib"), _num(tri, "grad_mib")
        if peak is not None:
            out.append((
                f"memory: peak extra <= gradient ({grad:.0f} MiB) + {MEM_SLACK_MIB:.0f} MiB",
                f"{peak:.1f} MiB",
                _verdict(peak <= grad + MEM_SLACK_MIB, f"missed by {peak - grad - MEM_SLACK_MIB:.1f} MiB", tri),
            ))
    else:
        out.append(("time and memory of the headline (triton)", "not measured", "n/a"))
    fast = _find(rows, provider="triton", validate="off", inplace_grad="off", **head)
    if fast:
        out.append(_time_target(fast, "time with validate=False"))
    inplace = _find(rows, provider="triton", validate="on", inplace_grad="on", **head)
    peak = _num(inplace, "peak_extra_mib") if inplace else None
    out.append((
        f"memory with inplace_grad: peak extra <= {MEM_SLACK_MIB:.0f} MiB",
        f"{peak:.1f} MiB" if peak is not None else "not measured",
        "n/a" if peak is None else _verdict(peak <= MEM_SLACK_MIB, f"missed by {peak - MEM_SLACK_MIB:.1f} MiB",
                                            inplace),
    ))
    for dtype in ("bf16", "fp32"):
        lp = dict(HEADLINE, entropy="none", dtype=dtype)
        mine = _find(rows, provider="triton", validate="on", inplace_grad="off", **lp)
        liger = _find(rows, provider="liger", **lp)
        if mine and liger:
            a, b = _num(mine, "p50_ms"), _num(liger, "p50_ms")
            out.append((f"log-prob only, {dtype}: faster than Liger-Kernel CE", f"{a:.3f} ms vs {b:.3f} ms",
                        _verdict(a < b, f"missed: {a / b - 1:.1%} slower", mine, liger)))
        elif dtype == "bf16":
            out.append((f"log-prob only, {dtype}: faster than Liger-Kernel CE", "not measured (liger absent?)", "n/a"))
    tp2 = _tp2_target(rows, head, "on", "TP=2")
    out.append(tp2 or ("TP=2 vs TP=1 on the same local shape", "not measured", "n/a"))
    tp2_fast = _tp2_target(rows, head, "off", "TP=2 with validate=False")
    if tp2_fast:
        out.append(tp2_fast)
    return (out + _small_call_targets(all_rows)
            + paired.keep_targets(all_rows, [(dict(provider="triton_keep_sparse", validate=v, **KEEP_SHAPE),
                                              dict(provider="triton", validate=v, **KEEP_SHAPE),
                                              f"logits op, validate {v}") for v in ("on", "off")],
                                  paired.KEEP_LOGITS_SLOWDOWN)
            + paired.megatron_step_targets(all_rows))


def _small_call_targets(rows: list[dict]) -> list[tuple[str, str, str]]:
    """The small-call targets where the small_call suite measured them, over the rounds of the latest run: T = 1024
    under each mode's bound (the median of the rounds' p50), and T = 8192 eager no slower than the same call without
    the replay of repeated calls (the median over rounds of eager's p50 less that call's p80)."""
    shape = dict(V="151936", dtype="bf16", tp="1", entropy="grad", validate="off")
    out = []
    for provider, goal in SMALL_CALL_TARGETS_MS.items():
        found = paired.rounds(rows, dict(provider=provider, T="1024", **shape))
        if found:
            p50 = paired.median_of(found, lambda r: _num(r, "p50_ms"))
            host = paired.median_of(found, lambda r: _num(r, "host_ms"))
            out.append((f"small call, {provider}, T=1024: <= {goal} ms a forward + backward",
                        f"{p50:.3f} ms (host {host:.3f} ms){paired.spread(found, lambda r: _num(r, 'p50_ms'), '.3f')}",
                        _verdict(p50 <= goal, f"missed by {p50 - goal:.3f} ms", *(r for r, in found))))
    found = paired.rounds(rows, dict(provider="eager", T="8192", **shape),
                          dict(provider="eager_own_path", T="8192", **shape))
    if found:
        a = paired.median_of(found, lambda e, o: _num(e, "p50_ms"))
        b = paired.median_of(found, lambda e, o: _num(o, "p50_ms"))
        over = paired.median_of(found, lambda e, o: _num(e, "p50_ms") - _num(o, "p80_ms"))
        out.append(("small call, eager, T=8192: no slower than without the replay",
                    f"{a:.3f} ms vs {b:.3f} ms (eager's p50 less the other's p80: {over:+.3f} ms"
                    f"{paired.spread(found, lambda e, o: _num(e, 'p50_ms') - _num(o, 'p80_ms'), '+.3f')})",
                    _verdict(over <= 0, f"missed: {a - b:+.3f} ms", *(r for pair in found for r in pair))))
    return out


def _time_target(row: dict, name: str) -> tuple[str, str, str]:
    frac = _num(row, "frac_copy_bw")
    goal_ms = _num(row, "p50_ms") * frac / TIME_TARGET_FRAC if frac else None
    return (
        f"{name}: >= {TIME_TARGET_FRAC:.0%} of copy BW (T=8192 bf16 TP=1, log-prob + entropy grad)",
        f"{_fmt(row, 'p50_ms', '.3f')} ms, {_fmt(row, 'gbps', 'g')} GB/s = {frac:.1%} of the copy's "
        f"{_fmt(row, 'copy_gbps', 'g')} GB/s" if frac else "n/a",
        _verdict(frac is not None and frac >= TIME_TARGET_FRAC,
                 f"missed: needs <= {goal_ms:.3g} ms" if goal_ms else "not measured", row),
    )


def _tp2_target(rows: list[dict], head: dict, validate: str, name: str) -> Optional[tuple[str, str, str]]:
    """TP=2's slowest rank against TP=1 on the same local shape, both with the given validate; None if unmeasured."""
    tp2 = _find(rows, provider="triton", validate=validate, inplace_grad="off", **dict(head, tp="2"))
    ref = _find(rows, provider="triton", validate=validate, inplace_grad="off",
                **dict(head, V=str(int(HEADLINE["V"]) // 2)))
    if not (tp2 and ref):
        return None
    a, b = _num(tp2, "p50_ms"), _num(ref, "p50_ms")
    return (f"{name}: slowest rank <= {TP2_SLOWDOWN:.2f} x TP=1 on the same local shape [8192, 75968]",
            f"{a:.3f} ms vs {b:.3f} ms ({a / b:.3f} x)",
            _verdict(a <= TP2_SLOWDOWN * b, f"missed by {a / b - TP2_SLOWDOWN:.3f} x", tp2, ref))


def _verdict(met: bool, missed: str, *rows: dict) -> str:
    """"met", or how it was missed; a measurement whose forward failed the bench's check proves nothing."""
    if any(r.get("check", "").startswith("fail") for r in rows):
        return "invalid: the forward failed the check against the float64 reference"
    return "met" if met else missed


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _fmt(row: dict, key: str, spec: str) -> str:
    """A CSV number formatted with `spec` ("g": 3 significant digits below 100, none after the point above)."""
    value = _num(row, key)
    if value is None:
        return ""
    if spec == "g":
        spec = ".0f" if abs(value) >= 100 else ".3g"
    return format(value, spec)


def _case_cells(row: dict) -> list[str]:
    spread = f"{_fmt(row, 'p20_ms', '.3f')}–{_fmt(row, 'p80_ms', '.3f')}" if row.get("p20_ms") else ""
    status = row["status"] if row.get("check") in ("", "ok", None) else f"{row['status']}, check {row['check']}"
    rows = "all" if row["row_frac"] == "1.0" else f"{float(row['row_frac']):.0%}"
    return [
        case_label(row), row["T"], row["V"], row["dtype"], row["entropy"], row["keep_mask"], rows, row["tp"],
        _fmt(row, "p50_ms", ".3f"), spread, _fmt(row, "host_ms", ".3f"), _fmt(row, "gbps", "g"),
        _fmt(row, "frac_copy_bw", ".0%"), _fmt(row, "peak_extra_mib", ".1f"), status,
    ]


_CASE_HEADER = ["provider", "T", "V", "dtype", "entropy", "keep", "rows", "TP", "p50 ms", "p20–p80 ms", "host ms",
                "GB/s", "of copy BW", "peak extra MiB", "status"]


def _small_cells(row: dict) -> list[str]:
    p50, host = _num(row, "p50_ms"), _num(row, "host_ms")
    ratio = f"{host / p50:.2f}" if p50 and host is not None else ""
    return [row["provider"], row["T"], row["V"], row["dtype"], row["entropy"], row["validate"], row["tp"],
            _fmt(row, "p50_ms", ".3f"), _fmt(row, "host_ms", ".3f"), ratio, _fmt(row, "frac_copy_bw", ".0%"),
            row["status"] if row.get("check") in ("", "ok", None) else f"{row['status']}, check {row['check']}"]


def render_markdown(all_rows: list[dict]) -> str:
    from tools.bench.cases import SMALL_CALL_PROVIDERS

    rows = latest_per_case(all_rows)
    envs = sorted({(r["gpu"], r["device"], r["torch"], r["triton"], r["ppo_ops"], r["liger_kernel"],
                    r["megatron_core"], r["torch_compile"]) for r in rows})
    copies = sorted({(r["gpu"], r["tp"], r["copy_gbps"]) for r in rows if r.get("copy_gbps")})
    dates = sorted({r["date"] for r in rows if r.get("date")})
    parts = ["# ppo_ops bench results", ""]
    for gpu, device, torch_v, triton_v, ppo_v, liger_v, mcore_v, compiled in envs:
        parts.append(f"- {gpu} ({device}); torch {torch_v}, triton {triton_v}, ppo_ops {ppo_v}, "
                     f"liger-kernel {liger_v or 'absent'}, megatron-core {mcore_v or 'absent'} "
                     f"(its jit_fuser's torch.compile {compiled})")
    for _gpu, tp, copy in copies:
        copy_text = _fmt({"c": copy}, "c", "g")
        parts.append(f"- measured device copy bandwidth (read + write) in the TP={tp} run: {copy_text} GB/s per GPU")
    if dates:
        parts.append(f"- date: {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1 else ""))
    parts += ["- time: forward + backward, p50 of CUDA-event timings (p20–p80); host ms: p50 of the host's wall "
              "time in the call before any synchronisation (host bound where it reaches the device time); bytes = "
              "forward reads the kept rows, backward reads them again and writes the whole gradient (+ keep mask read "
              "in each pass); TP=2 rows show the slowest rank", ""]
    parts += ["## Targets", "", _md_table(["target", "measured", "verdict"],
                                                 [list(t) for t in target_rows(all_rows)]), ""]
    head = [r for r in rows if all(r.get(k) == v for k, v in HEADLINE.items())]
    if head:
        parts += ["## Headline shape: T=8192, V=151936, bf16, TP=1, no masks", "",
                  _md_table(_CASE_HEADER, [_case_cells(r) for r in head]), ""]
    small = [r for r in rows if r["provider"] in SMALL_CALL_PROVIDERS]
    if small:
        parts += ["## Small calls: eager, torch.compile and reduce-overhead (CUDA graphs)", "",
                  "Host / device near 1: the call is host bound (its CUDA events then span the GPU's wait on the "
                  "launches); well below 1: the device is the bottleneck. floor_*: an autograd op doing one kernel "
                  "each way in the same mode, the host time torch itself takes per call on this host. A run of "
                  "several rounds shows each case's last round here; the targets take the medians over rounds.", "",
                  _md_table(["provider", "T", "V", "dtype", "entropy", "validate", "TP", "p50 ms", "host ms",
                             "host / device", "of copy BW", "status"], [_small_cells(r) for r in small]), ""]
    parts += ["## All cases", "", _md_table(_CASE_HEADER, [_case_cells(r) for r in rows]), ""]
    return "\n".join(parts)


def _plot_vocab(rows: list[dict]) -> Optional[str]:
    """V of the plot: the headline V when measured, else the V with the most measured TP=1 rows."""
    vs = [r["V"] for r in rows]
    if not vs:
        return None
    return HEADLINE["V"] if HEADLINE["V"] in vs else max(sorted(set(vs)), key=vs.count)


PLOT_PANELS = tuple((dt, ent) for ent in ("grad", "none") for dt in ("bf16", "fp32"))
# One colour per line label in every panel (matplotlib's tab10 order).
_PLOT_LABELS = ("triton", "triton inplace", "torch", "torch inplace", "legacy", "naive", "liger")


def plot_series(all_rows: list[dict]) -> tuple[Optional[str], dict]:
    """What the plot shows: (V, {(dtype, entropy): {label: [(T, p20, p50, p80, peak MiB or None)] sorted by T}}).

    TP=1, no keep mask (nor a keep set: the keep_set rows), no row mask, validate on, measured rows only."""
    from tools.bench.cases import KEEP_SET_PROVIDERS

    rows = [r for r in latest_per_case(all_rows)
            if r["status"] == "ok" and r["tp"] == "1" and r["keep_mask"] == "off" and r["row_frac"] == "1.0"
            and r.get("validate") != "off" and r["provider"] not in KEEP_SET_PROVIDERS]
    vocab = _plot_vocab(rows)
    series = {}
    for dtype, entropy in PLOT_PANELS:
        sel = [r for r in rows if r["V"] == vocab and r["dtype"] == dtype and r["entropy"] == entropy]
        panel = {}
        for row in sorted(sel, key=lambda r: int(r["T"])):
            panel.setdefault(case_label(row), []).append((
                int(row["T"]), _num(row, "p20_ms"), _num(row, "p50_ms"), _num(row, "p80_ms"),
                _num(row, "peak_extra_mib"),
            ))
        series[(dtype, entropy)] = panel
    return vocab, series


def render_plot(all_rows: list[dict], path: str) -> None:
    """p50 time (p20-p80 bars) and peak extra memory vs T, per provider; TP=1, no masks (see plot_series)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocab, series = plot_series(all_rows)
    colours = plt.get_cmap("tab10").colors

    def colour(label):
        return colours[_PLOT_LABELS.index(label) % len(colours)] if label in _PLOT_LABELS else None

    fig, axes = plt.subplots(2, len(PLOT_PANELS), figsize=(4.2 * len(PLOT_PANELS), 7.5), squeeze=False)
    for col, (dtype, entropy) in enumerate(PLOT_PANELS):
        time_ax, mem_ax = axes[0][col], axes[1][col]
        for label, pts in sorted(series[(dtype, entropy)].items()):
            ts = [p[0] for p in pts]
            p50 = [p[2] for p in pts]
            spread = [[p[2] - p[1] for p in pts], [p[3] - p[2] for p in pts]]
            time_ax.errorbar(ts, p50, yerr=spread, marker="o", capsize=3, label=label, color=colour(label))
            mem = [(p[0], p[4] / 1024) for p in pts if p[4] is not None]
            if mem:
                mem_ax.plot([m[0] for m in mem], [m[1] for m in mem], marker="o", label=label, color=colour(label))
        what = "log-prob + entropy grad" if entropy == "grad" else "log-prob only"
        time_ax.set_title(f"{dtype}, {what}")
        time_ax.set_ylabel("forward + backward, ms (p50, p20–p80)")
        mem_ax.set_ylabel("peak extra memory, GiB")
        ticks = sorted({p[0] for pts in series[(dtype, entropy)].values() for p in pts})
        for ax in (time_ax, mem_ax):
            ax.set_xlabel(f"T (tokens); V={vocab}, TP=1")
            ax.set_xscale("log", base=2)
            if ticks:
                ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.grid(True, alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=7)
        if time_ax.has_data():
            time_ax.set_yscale("log")
    gpus = sorted({r["gpu"] for r in all_rows if r.get("gpu")})
    fig.suptitle(f"ppo_ops bench: {', '.join(gpus) or 'no measurements'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(csv_path: str, md_path: str, png_path: str) -> None:
    rows = read_csv(csv_path) if os.path.exists(csv_path) else []
    with open(md_path, "w") as f:
        f.write(render_markdown(rows))
    render_plot(rows, png_path)
