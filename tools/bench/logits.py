"""The logits-op family (and the whole RL step built on it): [T, V_local] logits in, log-prob + entropy out.

Cases and suites: cases.py (`Case`); inputs: inputs.py; providers: providers.py and whole_step.py; the check against
the float64 reference: check.py; the record (results.csv, one row per case with the environment), the Markdown and
the plot: report.py. Here: how those meet the runner's contract (contract.Family).
"""

from __future__ import annotations

import os
from typing import Optional

from tools.bench import measure, report
from tools.bench.cases import Case
from tools.bench.check import check_forward, reference_rows
from tools.bench.contract import Closure, RankResult, RunInfo
from tools.bench.inputs import Inputs, make_inputs
from tools.bench.providers import PROVIDERS


class LogitsFamily:
    measures_copy_bandwidth = True  # each row's GB/s is set against the device copy
    times_steady = False  # its prepare refills logits an in-place backward destroyed: a copy, not the op's

    def __init__(self, config):
        self.providers = PROVIDERS
        self._paths = config.paths

    def make_inputs(self, case: Case, device, *, seed: int, rank: int, group) -> Inputs:
        return make_inputs(case, device, seed=seed, rank=rank, group=group)

    def check(self, case: Case, inputs: Inputs, closure: Closure, memo: dict, check_rows: int) -> dict:
        if not (check_rows and self.providers[case.provider].checked):
            return {}
        outputs = closure.forward()
        # The reference depends only on the inputs and the entropy mode: once per input set and mode.
        if case.entropy not in memo:
            memo[case.entropy] = reference_rows(case, inputs, check_rows)
        return {"check": check_forward(outputs, memo[case.entropy])}

    def row(self, case: Case, results: list[RankResult], info: RunInfo) -> dict:
        """The slowest rank's quantiles and host time, the largest peak, the first problem."""
        bytes_ = measure.case_bytes(case.T, case.v_local, case.dtype, case.kept_rows, case.keep_mask)
        row = dict(
            provider=case.provider, T=case.T, V=case.V, V_local=case.v_local, dtype=case.dtype, entropy=case.entropy,
            keep_mask=report.fmt_bool(case.keep_mask), row_frac=f"{case.row_frac:.1f}", kept_rows=case.kept_rows,
            tp=case.tp, validate=report.fmt_bool(case.validate), inplace_grad=report.fmt_bool(case.inplace_grad),
            bytes_fwd=bytes_.fwd, bytes_bwd=bytes_.bwd, copy_gbps=info.copy_gbps,
            grad_mib=case.T * case.v_local * measure.DTYPE_BYTES[case.dtype] / measure.MIB, **info.env,
            round=info.round,
        )
        bad = [r for r in results if r.status != "ok"]
        row["status"] = bad[0].status if bad else "ok"
        checks = [r.checks.get("check", "") for r in results]
        row["check"] = next((c for c in checks if c and c != "ok"), checks[0])
        if bad:
            return row
        timings = [r.timing for r in results]
        row.update(
            reps=min(t.reps for t in timings),
            p20_ms=max(t.p20_ms for t in timings),
            p50_ms=max(t.p50_ms for t in timings),
            p80_ms=max(t.p80_ms for t in timings),
            host_ms=max(t.host_p50_ms for t in timings),
        )
        row["gbps"] = measure.gbps(bytes_.total, row["p50_ms"])
        row["frac_copy_bw"] = row["gbps"] / info.copy_gbps if info.copy_gbps else None
        peaks = [r.peak for r in results if r.peak is not None]
        row["peak_extra_mib"] = max(peaks) / measure.MIB if peaks else None
        return row

    def describe(self, row: dict) -> str:
        head = (f"{report.case_label(row):22s} T={row['T']:>5} V={row['V']:>6} {row['dtype']} "
                f"entropy={row['entropy']:5s} keep={row['keep_mask']:3s} rows={row['row_frac']} tp={row['tp']}")
        if row["status"] != "ok":
            return f"{head}: {row['status']}"
        frac = row.get("frac_copy_bw")
        peak = row.get("peak_extra_mib")
        return (f"{head}: p50 {row['p50_ms']:.3f} ms [{row['p20_ms']:.3f}, {row['p80_ms']:.3f}] "
                f"(host {row['host_ms']:.3f} ms) {row['gbps']:.0f} GB/s" + (f" ({frac:.0%} of copy)" if frac else "")
                + (f", peak extra {peak:.1f} MiB" if peak is not None else "") + f", check {row['check'] or 'off'}")

    def append(self, row: dict) -> None:
        report.append_csv(self._paths.csv, [row])

    def record_rows(self) -> list[dict]:
        return report.read_csv(self._paths.csv) if os.path.exists(self._paths.csv) else []

    def render(self) -> None:
        report.render(self._paths.csv, self._paths.md, self._paths.png)
        print(f"wrote {self._paths.md} and {self._paths.png} from {self._paths.csv}", flush=True)

    def problem(self, row: dict) -> Optional[str]:
        if row["status"].startswith("error") or row["check"].startswith("fail"):
            return (f"{row['provider']} T={row['T']} {row['dtype']} entropy={row['entropy']}: {row['status']} "
                    f"{row['check']}")
        return None
