"""The bench's rounds (--rounds) and the targets that set one way against another over them (tools/bench/paired.py).

What is checked: the order a run of several rounds measures its cases in (every other round reversed), that every
row records its round through the runner and the command line; that a comparison takes the latest run that measured
every case it needs and pairs rows round by round, leaving out failed rows; and the verdicts of the Megatron step's
targets (memory against a quarter of the logits path's extra over the body, time on the median of the per-round
differences), of the sparse keep set's (the logits op's and the LM head's) and of the small calls over rounds, on
records written here with known numbers. CPU timings are never asserted.
"""

import os
import pathlib
import subprocess
import sys

from tools.bench import lm_head_report, paired, report, runner
from tools.bench.cases import Case

REPO_ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent
BENCH = REPO_ROOT / "tools" / "bench" / "bench.py"
FAST = dict(warmup=1, min_reps=1, max_reps=1, target_ms=0.0, copy_bytes=1 << 20, check_rows=2)


def test_every_other_round_runs_the_cases_in_reverse():
    assert runner.round_order(["a", "b", "c"], 3) == [
        (1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a"), (3, "a"), (3, "b"), (3, "c")]
    assert runner.round_order(["a", "b"], 1) == [(1, "a"), (1, "b")]


def test_a_run_of_rounds_records_each_round_in_its_order(tmp_path):
    cases = [Case(p, T=8, V=256, dtype="fp32", entropy="grad") for p in ("torch", "naive")]
    paths = runner.OutputPaths(csv=str(tmp_path / "r.csv"), md=str(tmp_path / "r.md"), png=str(tmp_path / "r.png"))
    assert runner.run(runner.BenchConfig(cases=cases, tp=1, device="cpu", paths=paths, rounds=3, **FAST)) == 0
    rows = report.read_csv(paths.csv)
    assert [(r["round"], r["provider"]) for r in rows] == [
        ("1", "torch"), ("1", "naive"), ("2", "naive"), ("2", "torch"), ("3", "torch"), ("3", "naive")]
    assert len({r["date"] for r in rows}) == 1  # one run
    assert all(r["status"] == "ok" for r in rows)


def test_the_command_line_takes_rounds(tmp_path):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(BENCH), "--device=cpu", "--suite=custom", "--providers=torch",
                          "--tokens=8", "--vocab=256", "--dtypes=fp32", "--entropy=none", "--keep_mask=off",
                          "--row_frac=1.0", "--rounds=2", "--min_reps=1", "--max_reps=1", "--copy_mib=1",
                          f"--out_dir={tmp_path}"], cwd=str(REPO_ROOT), env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = report.read_csv(str(tmp_path / "results.csv"))
    assert [r["round"] for r in rows] == ["1", "2"]
    bad = subprocess.run([sys.executable, str(BENCH), "--device=cpu", "--rounds=0", f"--out_dir={tmp_path}"],
                         cwd=str(REPO_ROOT), env=env, capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and "--rounds" in bad.stderr


# --- pairing rows round by round ---


def _r(provider, p50, *, date="d1", round_="1", status="ok", **fields):
    return dict(provider=provider, p50_ms=str(p50), date=date, round=round_, status=status, **fields)


def test_pairs_come_from_the_latest_run_that_measured_every_case():
    rows = [
        _r("a", 1.0, date="d1"), _r("b", 2.0, date="d1"),
        _r("a", 3.0, date="d2", round_="1"), _r("b", 4.0, date="d2", round_="1"),
        _r("b", 6.0, date="d2", round_="2"), _r("a", 5.0, date="d2", round_="2"),  # a reversed round
        _r("a", 7.0, date="d3"),  # a later run without b
        _r("a", 9.0, date="d2", round_="3"), _r("b", 0.0, date="d2", round_="3", status="error: x"),  # unpaired
    ]
    found = paired.rounds(rows, dict(provider="a"), dict(provider="b"))
    assert [(a["p50_ms"], b["p50_ms"]) for a, b in found] == [("3.0", "4.0"), ("5.0", "6.0")]
    assert paired.rounds(rows, dict(provider="a"), dict(provider="c")) == []
    # a record from before rounds: every row is round 1
    old = [dict(r, round="") for r in rows[:2]]
    assert [(a["p50_ms"], b["p50_ms"]) for a, b in paired.rounds(old, dict(provider="a"), dict(provider="b"))] == [
        ("1.0", "2.0")]


def test_median_and_spread_over_rounds():
    found = [(dict(x="1"),), (dict(x="5"),), (dict(x="2"),)]
    value = lambda r: paired.number(r, "x")  # noqa: E731
    assert paired.median_of(found, value) == 2.0
    assert paired.spread(found, value, ".1f") == ", median over 3 rounds (range 1.0 to 5.0)"
    assert paired.spread(found[:1], value, ".1f") == ""


# --- the Megatron step ---

STEP = dict(T="8192", tp="1", dtype="bf16", entropy="grad")


def _step(provider, p50, peak, round_="1", validate="on"):
    return _r(provider, p50, round_=round_, peak_extra_mib=str(peak), validate=validate, **STEP)


def _step_verdicts(rows):
    return {target: (measured, verdict) for target, measured, verdict in paired.megatron_step_targets(rows)}


def test_megatron_step_memory_is_judged_against_a_quarter_of_the_logits_paths_extra():
    rows = [_step("mcore_body", 200.0, 1000.0), _step("mcore_logits", 210.0, 5000.0),  # the logits path: +4000
            _step("mcore_head", 205.0, 2000.0),  # +1000: at the bound
            _step("mcore_loss", 205.0, 2000.5)]  # +1000.5: over by 0.5 MiB
    verdicts = _step_verdicts(rows)
    memory = {t: v for t, v in verdicts.items() if "peak over the body" in t}
    assert memory == {
        "Megatron step T=8192 validate on, mcore_head: peak over the body <= 0.25 x the logits path's":
            ("+1000.0 MiB against a bound of 1000.0 (the logits path +4000.0)", "met"),
        "Megatron step T=8192 validate on, mcore_loss: peak over the body <= 0.25 x the logits path's":
            ("+1000.5 MiB against a bound of 1000.0 (the logits path +4000.0)", "missed by 0.5 MiB"),
    }


def test_megatron_step_time_is_the_median_of_the_paired_differences():
    # The host slows down while the head's step of round 2 runs: the median of the head's p50s is above the logits
    # path's, yet the head is faster in two rounds of three when each is set against the logits path of its round.
    times = {"1": (200.0, 201.0), "2": (231.0, 209.0), "3": (210.0, 211.0)}  # round: (head, logits)
    rows = []
    for round_, (head, logits) in times.items():
        rows += [_step("mcore_body", 150.0, 1000.0, round_), _step("mcore_logits", logits, 5000.0, round_),
                 _step("mcore_head_spare", head, 1900.0, round_)]
    (measured, verdict), = [v for t, v in _step_verdicts(rows).items() if "no slower" in t]
    assert verdict == "met"
    assert measured == ("p50 210.00 vs 209.00 ms; paired difference -1.00 ms, median over 3 rounds "
                        "(range -1.00 to +22.00)")
    memory = [v for t, v in _step_verdicts(rows).items() if "peak over the body" in t]
    assert memory == [("+900.0 MiB against a bound of 1000.0 (the logits path +4000.0) (worst of 3 rounds)", "met")]
    rows = [dict(r, p50_ms=str(float(r["p50_ms"]) + 2.0)) if r["provider"] == "mcore_head_spare" else r
            for r in rows]
    (_, verdict), = [v for t, v in _step_verdicts(rows).items() if "no slower" in t]
    assert verdict == "missed by +1.00 ms"


def test_megatron_step_targets_pair_the_same_body_and_validate():
    rows = [_step("mcore_body", 150.0, 1000.0), _step("mcore_logits", 200.0, 5000.0, validate="off"),
            _step("mcore_head", 199.0, 1500.0, validate="on"),  # no logits path with validate on
            _step("mcore_body_flash", 140.0, 900.0), _step("mcore_logits_flash", 190.0, 4900.0),
            _step("mcore_loss_flash", 191.0, 1900.0)]
    verdicts = _step_verdicts(rows)
    assert sorted(verdicts) == [
        "Megatron step T=8192 flash validate on, mcore_loss: peak over the body <= 0.25 x the logits path's",
        "Megatron step T=8192 flash validate on, mcore_loss: step no slower than the logits path"]
    memory, time = (verdicts[t] for t in sorted(verdicts))
    assert memory == ("+1000.0 MiB against a bound of 1000.0 (the logits path +4000.0)", "met")  # at the bound
    assert time == ("p50 191.00 vs 190.00 ms; paired difference +1.00 ms", "missed by +1.00 ms")


def test_the_logits_reports_targets_include_the_megatron_step():
    rows = [_step("mcore_body", 150.0, 1000.0), _step("mcore_logits", 200.0, 5000.0),
            _step("mcore_head", 199.0, 1500.0)]
    for row in rows:  # the rest of a logits-family row's case fields
        row.update(V="151936", keep_mask="off", row_frac="1.0", inplace_grad="off", check="")
    targets = {t: v for t, _, v in report.target_rows(rows)}
    assert targets["Megatron step T=8192 validate on, mcore_head: step no slower than the logits path"] == "met"
    assert targets["Megatron step T=8192 validate on, mcore_head: peak over the body <= 0.25 x the logits path's"] \
        == "met"


# --- the sparse keep set ---

KEEP = dict(T="8192", V="151936", dtype="bf16", tp="1", entropy="grad", keep_mask="off", row_frac="1.0",
            inplace_grad="off", check="ok", grad_mib="2374.0")  # (grad_mib: the headline memory target reads it)


def test_the_logits_ops_keep_set_is_judged_per_validate_setting_over_rounds():
    rows = []
    for round_, (plain, sparse) in {"1": (2.00, 2.30), "2": (2.40, 2.50), "3": (2.00, 2.18)}.items():
        for validate in ("on", "off"):
            rows += [_r("triton", plain, round_=round_, validate=validate, peak_extra_mib="2374.2", **KEEP),
                     _r("triton_keep_sparse", sparse, round_=round_, validate=validate,
                        peak_extra_mib="2389.6" if validate == "on" else "2430.0", **KEEP)]
    targets = {t: (m, v) for t, m, v in report.target_rows(rows) if t.startswith("keep set")}
    # per-round ratios 1.15, 1.042, 1.09: median 1.09 (the ratio of the median p50s would be 1.15)
    assert targets["keep set, logits op, validate on: p50_ms within 10% of the call without one"] == (
        "1.090 x, median over 3 rounds (range 1.042 to 1.150)", "met")
    assert targets["keep set, logits op, validate on: peak extra within 2% of the call without one"] == (
        "1.0065 x (worst of 3 rounds)", "met")
    assert targets["keep set, logits op, validate off: peak extra within 2% of the call without one"][1] == \
        "missed: +2.35%"


def test_the_lm_heads_keep_set_is_judged_on_both_measures():
    head = dict(T="8192", H="4096", V="151936", tp="1", label="K1")
    rows = [_r("fused", 56.0, steady_ms="57.0", peak_extra_gib="2.538", **head),
            _r("fused_keep", 57.5, steady_ms="60.0", peak_extra_gib="2.570", **head),  # steady +5.3%
            _r("token_loss", 48.0, steady_ms="48.5", peak_extra_gib="3.572", **head),
            _r("token_loss_keep", 49.4, steady_ms="49.9", peak_extra_gib="3.541", **head)]
    lines = [line for line in lm_head_report.verdicts(rows).splitlines() if "keep set" in line]
    assert lines == [
        "- keep set, fused: p50_ms within 5% of the call without one: 1.027 x: MET",
        "- keep set, fused: steady_ms within 5% of the call without one: 1.053 x: MISSED: +5.3%",
        "- keep set, fused: peak extra within 2% of the call without one: 1.0126 x: MET",
        "- keep set, token_loss: p50_ms within 5% of the call without one: 1.029 x: MET",
        "- keep set, token_loss: steady_ms within 5% of the call without one: 1.029 x: MET",
        "- keep set, token_loss: peak extra within 2% of the call without one: 0.9913 x: MET",
    ]


def test_lm_head_time_targets_set_each_row_against_the_gemms_of_its_own_width_and_round():
    rows = [_r("gemms", 10.0, T="8192", H="4096", V="151936", tp="1", label="L", round_="1"),
            _r("fused", 13.0, T="8192", H="4096", V="151936", tp="1", label="L", round_="1"),
            _r("gemms", 14.0, T="8192", H="4096", V="151936", tp="1", label="L", round_="2"),
            _r("fused", 15.0, T="8192", H="4096", V="151936", tp="1", label="L", round_="2"),
            _r("gemms", 2.0, T="8192", H="1024", V="151936", tp="1", label="L", round_="1"),
            _r("fused", 3.0, T="8192", H="1024", V="151936", tp="1", label="L", round_="1")]
    lines = [line for line in lm_head_report.verdicts(rows).splitlines() if line.startswith("- time")]
    # H = 4096: ratios 1.3 and 1.071 (median 1.186); H = 1024: 1.5
    assert lines == [
        "- time T=8192 TP=1 H=1024 general op, validate on: 3.0 ms = 1.500 x gemms (2.0 ms): MISSED (target <= 1.38)",
        "- time T=8192 TP=1 H=4096 general op, validate on: 14.0 ms = 1.186 x gemms (12.0 ms); medians over 2 "
        "rounds: MET (target <= 1.38)",
    ]


# --- small calls over rounds ---


def test_small_call_targets_take_the_median_of_the_rounds():
    shape = dict(V="151936", dtype="bf16", tp="1", entropy="grad", validate="off", keep_mask="off", row_frac="1.0",
                 inplace_grad="off", check="ok")
    rows = []
    for round_, p50 in {"1": 0.45, "2": 0.95, "3": 0.48}.items():
        rows.append(_r("eager", p50, T="1024", round_=round_, host_ms=str(p50 - 0.05), **shape))
    for round_, (eager, own, own80) in {"1": (2.00, 2.01, 2.02), "2": (2.10, 2.00, 2.05),
                                         "3": (2.01, 2.00, 2.03)}.items():
        rows += [_r("eager", eager, T="8192", round_=round_, **shape),
                 _r("eager_own_path", own, T="8192", round_=round_, p80_ms=str(own80), **shape)]
    targets = {t: (m, v) for t, m, v in report.target_rows(rows) if t.startswith("small call")}
    assert targets["small call, eager, T=1024: <= 0.5 ms a forward + backward"] == (
        "0.480 ms (host 0.430 ms), median over 3 rounds (range 0.450 to 0.950)", "met")
    # eager's p50 less the replay-off call's p80, per round: -0.02, +0.05, -0.02
    assert targets["small call, eager, T=8192: no slower than without the replay"] == (
        "2.010 ms vs 2.000 ms (eager's p50 less the other's p80: -0.020 ms, median over 3 rounds (range -0.020 to "
        "+0.050))", "met")
    slower = [dict(r, p50_ms=str(float(r["p50_ms"]) + 0.1)) if r["provider"] == "eager" and r["T"] == "8192" else r
              for r in rows]
    targets = {t: v for t, _, v in report.target_rows(slower) if t.startswith("small call, eager, T=8192")}
    assert list(targets.values()) == ["missed: +0.110 ms"]
