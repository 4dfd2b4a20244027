"""Rewrites a bench record of an earlier schema in the long format of report.py, so that the report renders the
figures the docs quote from it (`bench.py --render_only`):

    python3 tools/bench/legacy_records.py IN.csv OUT.csv

Two earlier schemas are read, told apart by their header:
  logits   the logits op's wide rows (docs/bench/results.csv, sglang_order.csv): every case column of today's but
           `family` and `H` (the whole step's rows, qwen3_step*, are family step), the run's `date` as its
           timestamp, a `device` column; the packages as columns.
  lm_head  the LM head's rows (docs/bench/lm_head.csv): a run `label` (its commit in parentheses where it names one),
           times, `baseline` as "3 GEMMs" / "1 GEMM", peak extra memory in GiB, the float64 errors as f64_*; every
           case bf16 with an entropy gradient. Rows are in run order; a run is the rows of one label in a row.
Nothing is measured again: each value is carried over, renamed or converted (GiB to MiB), and what the earlier
schema did not record stays empty. The GPU of every earlier lm_head run was one H200 (docs/gpu_runs.md).
"""

from __future__ import annotations

import csv
import re
import sys

if __package__ in (None, ""):  # run as a script: the repository root on the path
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.bench.report import COLUMNS  # noqa: E402

LM_HEAD_GPU = "NVIDIA H200"
LM_HEAD_BASELINES = {"3 GEMMs": "provider=gemms", "1 GEMM": "provider=gemm1"}
_COMMIT = re.compile(r"\(([0-9a-f]{7,40})\)")


def _logits_row(row: dict) -> dict:
    packages = "; ".join(f"{name} {row[name]}" for name in ("ppo_ops", "liger_kernel", "megatron_core")
                         if row.get(name))
    out = {k: row.get(k, "") for k in COLUMNS if k in row}
    family = "step" if row["provider"].startswith("qwen3_step") else "logits"  # the whole RL step's rows
    out.update(family=family, packages=packages, timestamp=row["date"], round="1",
               validate="" if row.get("validate") == "n/a" else row.get("validate", ""),
               inplace_grad="" if row.get("inplace_grad") == "n/a" else row.get("inplace_grad", ""))
    return out


def _lm_head_rows(rows: list) -> list:
    out, run, last_label = [], 0, None
    for row in rows:
        if row["label"] != last_label:
            run, last_label = run + 1, row["label"]
        commit = _COMMIT.search(row["label"])
        gib = row.get("peak_extra_gib", "")
        out.append(dict(
            family="lm_head", provider=row["provider"], T=row["T"], V=row["V"], V_local=row["v_local"], H=row["H"],
            dtype="bf16", entropy="grad", keep_mask="off", row_frac="1.0", tp=row["tp"], label=row["label"],
            status=row["status"], reps=row["reps"], p20_ms=row["p20_ms"], p50_ms=row["p50_ms"], p80_ms=row["p80_ms"],
            steady_ms=row.get("steady_ms", ""), peak_extra_mib=f"{float(gib) * 1024:.1f}" if gib else "",
            err_logprob=row.get("f64_dlogprob", ""), err_entropy=row.get("f64_dentropy", ""),
            err_dx_rel=row.get("f64_ddx_rel", ""), baseline=LM_HEAD_BASELINES.get(row.get("baseline", ""), ""),
            gpu=LM_HEAD_GPU, commit=commit.group(1) if commit else "", timestamp=f"run {run:03d}", round="1"))
    return out


def convert(rows: list, header: list) -> list:
    """Today's rows for the rows of an earlier schema (told apart by its header)."""
    if "family" in header:
        raise ValueError("already in the long format")
    if "label" in header and "vs_gemms" in header:
        out = _lm_head_rows(rows)
    elif "date" in header and "provider" in header:
        out = [_logits_row(r) for r in rows]
    else:
        raise ValueError(f"an unknown record schema: {header[:6]}...")
    for row in out:  # a case's baseline must not point at itself (gemms, gemm1 are the baselines)
        if row.get("baseline") == f"provider={row['provider']}":
            row["baseline"] = ""
    return out


def main(argv: list) -> int:
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    with open(argv[1], newline="") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames or []), list(reader)
    out = convert(rows, header)
    with open(argv[2], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: row.get(k, "") for k in COLUMNS} for row in out)
    print(f"{argv[2]}: {len(out)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
