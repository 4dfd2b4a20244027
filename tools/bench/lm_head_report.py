"""The LM-head record (lm_head.csv, one row per case and run, with the run's label) and its table with the targets'
verdicts (lm_head.md), rendered from the whole CSV.

Targets, over the rows of the CSV's last run (its label): the general op <= 1.38 x the three GEMMs; forward only <=
1.08 x one GEMM; token_loss <= 1.10 x the three GEMMs and peak extra <= 3.5 GiB at T = 32768; a TP = 2 rank within
15% of TP = 1 on the local shape, read from the TP = 1 rows of the same run. A target against the GEMMs is judged
on both measures where the row has them, the per-step events' p50 (vs_gemms) and back to back (steady_vs), and met
only where both meet it; the TP = 2 one on the p50s. The sparse keep set (lm_head_keep): the fused head and the token
loss with one within 5% of the same call without one on both measures, their peaks within 2% (paired.py). A run of
several rounds (bench --rounds) is judged on the median over rounds of each per-round ratio.
"""

from __future__ import annotations

import os
from typing import Optional

from tools.bench import paired, report
from tools.bench.cases import HEADLINE_TOKENS, LM_HEAD_HIDDEN, LM_HEAD_TOKENS, QWEN3_VOCAB

FIELDS = ("label", "provider", "T", "H", "V", "tp", "v_local", "status", "p20_ms", "p50_ms", "p80_ms", "reps", "tflops",
          "baseline", "vs_gemms", "peak_extra_gib", "grad_gib", "max_dlogprob_vs_unfused", "f64_dlogprob",
          "f64_dentropy", "f64_ddx_rel", "steady_ms", "steady_vs", "round")
TABLE = ("label", "provider", "T", "V", "tp", "status", "p50_ms", "tflops", "baseline", "vs_gemms", "steady_ms",
         "steady_vs", "peak_extra_gib", "grad_gib", "max_dlogprob_vs_unfused", "f64_dlogprob", "f64_dentropy",
         "f64_ddx_rel")
TARGETS = {  # provider: (baseline provider, bound on time / baseline, what it is)
    "fused": ("gemms", 1.38, "general op, validate on"),
    "fused_novalidate": ("gemms", 1.38, "general op, validate off"),
    "fused_nograd": ("gemm1", 1.08, "forward only under no_grad, vs one GEMM"),
    "token_loss": ("gemms", 1.10, "linear_token_loss (PPO closure), validate on"),
    "token_loss_novalidate": ("gemms", 1.10, "linear_token_loss (PPO closure), validate off"),
}
TOKEN_LOSS_PEAK_GIB = 3.5  # target: linear_token_loss's peak extra at T = 32768
TOKEN_LOSS_PEAK_T = 32768
TP2_SLOWDOWN = 1.15  # target: a TP = 2 rank at most 15% above TP = 1 on the same local shape
TP2_PROVIDERS = ("fused", "fused_novalidate", "token_loss")
KEEP_T = HEADLINE_TOKENS  # the lm_head_keep suite's T (the keep-set targets, paired.py)


def read_rows(path: str) -> list[dict]:
    return report.read_csv(path) if os.path.exists(path) else []


def append_row(path: str, row: dict) -> None:
    """Appends a row; a file of an older layout is first rewritten with FIELDS (its rows kept, new columns empty)."""
    if os.path.exists(path) and os.path.getsize(path) and report.csv_columns(path) != FIELDS:
        report.write_csv(path, report.read_csv(path), FIELDS)
    report.append_csv(path, [row], columns=FIELDS)


def render(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(TABLE) + " |", "|" + "---|" * len(TABLE)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in TABLE) + " |" for r in rows]
    return "\n".join(lines) + "\n\n" + verdicts(rows) + "\n"


def _find(rows, provider, T, V, tp):
    hits = [r for r in rows if r["provider"] == provider and int(r["T"]) == T and int(r["V"]) == V
            and int(r["tp"]) == tp and r["status"] == "ok"]
    return hits[-1] if hits else None


def _met(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def verdicts(rows) -> str:
    """The targets' verdicts over the rows of the CSV's last run (its last label): baselines from the same run, and
    from the same round where the run has several (bench --rounds: the median over rounds of the per-round ratio)."""
    label = rows[-1].get("label", "") if rows else ""
    rows = [r for r in rows if r.get("label", "") == label]
    out = [f"Targets (the rows of the last run in the CSV, label {label!r}):"]
    widths = sorted({int(r["H"]) for r in rows if r.get("H")})
    for T in LM_HEAD_TOKENS:
        for tp in (1, 2):
            for name, (base_name, bound, what) in TARGETS.items():
                for H in widths:  # a row is set against the GEMMs of its own shape
                    found = paired.rounds(rows, _case(name, T, QWEN3_VOCAB, tp, H),
                                          _case(base_name, T, QWEN3_VOCAB, tp, H), run_key="label")
                    if found:
                        out.append(_time_line(found, T, tp, H, what, base_name, bound))
            r = _find(rows, "token_loss", T, QWEN3_VOCAB, tp)
            if r and r.get("peak_extra_gib") and T == TOKEN_LOSS_PEAK_T:
                peak = float(r["peak_extra_gib"])
                out.append(f"- memory T={T} TP={tp} linear_token_loss: peak extra {peak:.2f} GiB: "
                           f"{_met(peak <= TOKEN_LOSS_PEAK_GIB)} (target <= {TOKEN_LOSS_PEAK_GIB})")
        for name in TP2_PROVIDERS:
            tp2, ref = _find(rows, name, T, QWEN3_VOCAB, 2), _find(rows, name, T, QWEN3_VOCAB // 2, 1)
            if tp2 and ref:
                ratio = float(tp2["p50_ms"]) / float(ref["p50_ms"])
                out.append(f"- TP=2 T={T} ({name}): slowest rank {float(tp2['p50_ms']):.1f} ms = {ratio:.2f} x TP=1 on "
                           f"the local shape: {_met(ratio <= TP2_SLOWDOWN)} (target <= {TP2_SLOWDOWN})")
    out += [f"- {target}: {measured}: {'MET' if verdict == 'met' else verdict.upper()}"
            for target, measured, verdict in paired.keep_targets(
                rows, [(_case(f"{name}_keep", KEEP_T, QWEN3_VOCAB, 1, LM_HEAD_HIDDEN),
                        _case(name, KEEP_T, QWEN3_VOCAB, 1, LM_HEAD_HIDDEN), name) for name in ("fused", "token_loss")],
                paired.KEEP_HEAD_SLOWDOWN, time_keys=("p50_ms", "steady_ms"), peak_key="peak_extra_gib",
                run_key="label")]
    return "\n".join(out)


def _case(provider: str, T: int, V: int, tp: int, H: Optional[int] = None) -> dict:
    """The fields a row of this case has in the CSV (strings)."""
    fields = dict(provider=provider, T=str(T), V=str(V), tp=str(tp))
    return fields if H is None else dict(fields, H=str(H))


def _time_line(found: list, T: int, tp: int, H: int, what: str, base_name: str, bound: float) -> str:
    """A time target's line: the median over rounds of the p50 ratio, and of the back-to-back ratio where both rows
    have it; met where each is within the bound."""
    def ratio(key):
        def of(r, base):
            a, b = paired.number(r, key), paired.number(base, key)
            return None if a is None or not b else a / b
        return of

    p50 = paired.median_of(found, ratio("p50_ms"))
    mine = paired.median_of(found, lambda r, _b: paired.number(r, "p50_ms"))
    base = paired.median_of(found, lambda _r, b: paired.number(b, "p50_ms"))
    line = f"- time T={T} TP={tp} H={H} {what}: {mine:.1f} ms = {p50:.3f} x {base_name} ({base:.1f} ms)"
    ok = p50 <= bound
    steady = paired.median_of(found, ratio("steady_ms"))
    if steady is not None:
        mine_s = paired.median_of(found, lambda r, _b: paired.number(r, "steady_ms"))
        base_s = paired.median_of(found, lambda _r, b: paired.number(b, "steady_ms"))
        line += f"; back to back {mine_s:.1f} ms = {steady:.3f} x ({base_s:.1f} ms)"
        ok = ok and steady <= bound
    if len(found) > 1:
        line += f"; medians over {len(found)} rounds"
    return f"{line}: {_met(ok)} (target <= {bound})"
