"""The report folder: report.json (everything), report.md (the table a person reads first), logprob_diff_hist.png.

report.json keys: passed, settings (every flag), versions, model, rollout, engine_layouts, trainer_layouts,
comparisons (section, subject, metric, value, tolerance, passed, details), tolerances (each with its reason), timings_s.
The PNG has one panel of per-token (trainer - engine) log-prob differences per engine log-prob series, and one of
(layout - tp1) trainer log-prob differences, over the completion tokens.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

import numpy as np

from sglang_checks.metrics import Comparison

JSON_NAME = "report.json"
MD_NAME = "report.md"
PNG_NAME = "logprob_diff_hist.png"


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=_plain)


def _plain(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e-3 and abs(value) < 1e4:
        return f"{value:.4g}"
    return f"{value:.3e}"


def write_markdown(path: str, report: dict, comparisons: List[Comparison]) -> None:
    failed = [c for c in comparisons if not c.passed]
    verdict = "PASS" if not failed else f"FAIL ({len(failed)} of {len(comparisons)} comparisons out of tolerance)"
    s = report["settings"]
    r = report["rollout"]
    lines = [
        "# Qwen3 parallel check",
        "",
        f"**{verdict}**",
        "",
        f"- model: `{report['model']['name']}` (fingerprint `{report['model']['fingerprint'][:16]}`)",
        f"- engine: `{s['engine']}`, engine layouts `{s['engine_layouts']}`; rollout sampled by "
        f"`{r['engine']} {r['engine_layout']}` at temperature {r['temperature']}, top-p {r['top_p']}, "
        f"engine log-prob kind `{r['logprob_kind']}`",
        f"- trainer: temperature {report['trainer']['temperature']}, layouts "
        f"`{','.join(report['trainer_layouts'])}`, backend `{report['trainer']['backend']}`",
        f"- rollout: {r['sequences']} sequences, {r['completion_tokens']} completion tokens, trainer sequence length "
        f"{r['seq_len']}{' (replayed from ' + r['path'] + ')' if r.get('replayed') else ''}",
        "",
        "| section | subject | metric | value | tolerance | result |",
        "|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        cells = [c.section, c.subject, c.metric, _fmt(c.value), _fmt(c.tolerance), "pass" if c.passed else "**FAIL**"]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines += ["", "Tolerances:", ""]
    lines += [f"- `{name}` = {_fmt(t['value'])}: {t['reason']}" for name, t in report["tolerances"].items()]
    lines += ["", f"Histogram of per-token differences: `{PNG_NAME}`. Everything else: `{JSON_NAME}`.", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def write_histogram(path: str, mismatch: Dict[str, np.ndarray], layouts: Dict[str, np.ndarray]) -> None:
    """mismatch: label -> per-token (trainer - engine); layouts: layout name -> per-token (layout - tp1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, series, title in ((axes[0], mismatch, "trainer - engine log-prob (completion tokens)"),
                              (axes[1], layouts, "trainer layout - tp1 log-prob (completion tokens)")):
        values = [v for v in series.values() if v.size]
        if not values:
            ax.text(0.5, 0.5, "nothing to compare", ha="center", va="center", transform=ax.transAxes)
        else:
            lo = min(float(v.min()) for v in values)
            hi = max(float(v.max()) for v in values)
            span = max(hi - lo, 1e-12)  # all-equal series still get a visible bin
            bins = np.linspace(lo - 0.05 * span, hi + 0.05 * span, 61)
            for label, v in series.items():
                if v.size:
                    ax.hist(v, bins=bins, histtype="step", linewidth=1.5,
                            label=f"{label} (max |d| {_fmt(float(np.abs(v).max()))})")
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("difference (nats)")
        ax.set_ylabel("tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(report_dir: str, report: dict, comparisons: List[Comparison], mismatch, layouts) -> Dict[str, str]:
    os.makedirs(report_dir, exist_ok=True)
    paths = {name: os.path.join(report_dir, name) for name in (JSON_NAME, MD_NAME, PNG_NAME)}
    report = dict(report, comparisons=[c.as_dict() for c in comparisons],
                  passed=all(c.passed for c in comparisons))
    write_json(paths[JSON_NAME], report)
    write_markdown(paths[MD_NAME], report, comparisons)
    write_histogram(paths[PNG_NAME], mismatch, layouts)
    return paths
