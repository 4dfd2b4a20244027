"""The bench's rounds (--rounds) and the paired statistics its report gives (tools/bench/report.py).

What is checked: the order a run of several rounds measures its cases in (every other round reversed) and that
every row records its round; that a row is paired with its baseline (and floor) round by round within the latest run
that measured them all, failed rows left out; and the figures over the rounds (median and range of the time ratio,
the p50 difference, the back-to-back and peak ratios, the extra over the floor) against values computed by hand from
records written here. CPU timings are never asserted.
"""

from tools.bench import logits, report, runner

FAST = dict(warmup=1, min_reps=1, max_reps=1, target_ms=0.0, copy_bytes=1 << 20, check_rows=2, warm_max_s=0.0)


def test_every_other_round_runs_the_cases_in_reverse():
    assert runner.round_order(["a", "b", "c"], 3) == [
        (1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a"), (3, "a"), (3, "b"), (3, "c")]
    assert runner.round_order(["a", "b"], 1) == [(1, "a"), (1, "b")]


def test_a_run_of_rounds_records_each_round_in_its_order(tmp_path):
    cases = [logits.case(p, T=8, V=256, dtype="fp32") for p in ("torch", "naive")]
    csv = str(tmp_path / "r.csv")
    assert runner.run(runner.BenchConfig(cases=cases, tp=1, device="cpu", csv=csv, rounds=3, **FAST)) == 0
    rows = report.read_csv(csv)
    assert [(r["round"], r["provider"]) for r in rows] == [
        ("1", "torch"), ("1", "naive"), ("2", "naive"), ("2", "torch"), ("3", "torch"), ("3", "naive")]
    assert len({r["timestamp"] for r in rows}) == 1  # one run
    assert all(r["status"] == "ok" and r["check"] == "ok" for r in rows)


# --- pairing rows round by round ---

CASE = dict(family="logits", T="8192", V="151936", H="", dtype="bf16", entropy="grad", keep_mask="off",
            row_frac="1.0", tp="1", validate="on", inplace_grad="off")


def _r(provider, p50, *, run="t1", round_="1", status="ok", **fields):
    return dict(CASE, provider=provider, p50_ms=str(p50), timestamp=run, round=round_, status=status, **fields)


def _key(provider):
    return report.key_of(dict(CASE, provider=provider))


def test_pairs_come_from_the_latest_run_that_measured_every_case():
    rows = [
        _r("a", 1.0, run="t1"), _r("b", 2.0, run="t1"),
        _r("a", 3.0, run="t2", round_="1"), _r("b", 4.0, run="t2", round_="1"),
        _r("b", 6.0, run="t2", round_="2"), _r("a", 5.0, run="t2", round_="2"),  # a reversed round
        _r("a", 7.0, run="t3"),  # a later run without b
        _r("a", 9.0, run="t2", round_="3"), _r("b", 0.0, run="t2", round_="3", status="error: x"),  # unpaired
    ]
    found = report.rounds(rows, _key("a"), _key("b"))
    assert [(a["p50_ms"], b["p50_ms"]) for a, b in found] == [("3.0", "4.0"), ("5.0", "6.0")]
    assert report.rounds(rows, _key("a"), _key("c")) == []


def test_median_and_range_over_rounds():
    found = [({"x": "1"},), ({"x": "5"},), ({"x": "2"},), ({"x": ""},)]  # a round without the value is left out
    value = lambda r: report.number(r, "x")  # noqa: E731
    assert report.median_of(found, value) == 2.0
    assert report.spread(found, value, ".1f") == "2.0 [1.0, 5.0]"
    assert report.spread(found[:1], value, ".1f") == "1.0"
    assert report.spread(found[3:], value, ".1f") == ""


def _comparison(rows, provider, against):
    (line,) = [c for c in report.comparisons(rows) if c[0] == provider and c[2].startswith(against)]
    return dict(zip(report.COMPARISON_HEADER, line))


def test_a_row_is_set_against_its_baseline_round_by_round():
    # The host slows down while round 2's head runs: the head's median p50 is above the logits path's, yet it is
    # faster in two rounds of three when each is set against the logits path of its own round.
    times = {"1": (200.0, 201.0), "2": (231.0, 209.0), "3": (210.0, 211.0)}  # round: (head, logits)
    rows = []
    for round_, (head, path) in times.items():
        rows += [_r("mcore_logits", path, round_=round_, peak_extra_mib="5000", steady_ms=str(path + 1)),
                 _r("mcore_body", 150.0, round_=round_, peak_extra_mib="1000"),
                 _r("mcore_head", head, round_=round_, peak_extra_mib=str(1900 + int(round_) * 50),
                    steady_ms=str(head + 1), baseline="provider=mcore_logits", floor="provider=mcore_body")]
    got = _comparison(rows, "mcore_head", "provider=mcore_logits")
    assert got["rounds"] == "3"
    assert got["p50 ms"] == "210.000 [200.000, 231.000]" and got["its p50 ms"] == "209.000 [201.000, 211.000]"
    # per-round ratios 200/201 = 0.995, 231/209 = 1.105, 210/211 = 0.995; differences -1, +22, -1
    assert got["time ratio"] == "0.995 [0.995, 1.105]"
    assert got["p50 difference ms"] == "-1.000 [-1.000, +22.000]"
    assert got["back-to-back ratio"] == f"{211 / 212:.3f} [{201 / 202:.3f}, {232 / 210:.3f}]"
    assert got["peak ratio"] == f"{2000 / 5000:.3f} [{1950 / 5000:.3f}, {2050 / 5000:.3f}]"
    # the extra over the body: (1950 - 1000) / (5000 - 1000) = 0.2375, then 0.25, 0.2625
    assert got["extra over the floor, ratio"] == f"{1000 / 4000:.3f} [{950 / 4000:.3f}, {1050 / 4000:.3f}]"


def test_rows_of_separate_runs_are_set_against_the_latest_of_each():
    """TP = 2 against TP = 1 on the rank's local shape: two runs (two processes), one pair of latest rows."""
    rows = [_r("triton", 1.20, run="t1", V="75968"), _r("triton", 1.10, run="t2", V="75968"),
            _r("triton", 1.32, run="t3", tp="2", baseline="tp=1,V=75968")]
    got = _comparison(rows, "triton", "tp=1,V=75968")
    assert got["against"] == "tp=1,V=75968 (separate runs)" and got["rounds"] == "1"
    assert got["time ratio"] == "1.200" and got["p50 difference ms"] == "+0.220"


def test_a_row_without_its_baseline_measured_has_no_comparison():
    rows = [_r("fused_keep", 2.0, baseline="provider=fused"), _r("fused", 1.0, status="OOM")]
    assert report.comparisons(rows) == []


def test_the_logits_familys_baselines_name_the_rows_docs_compare():
    """The keep set against the call without one, TP = 2 against TP = 1 on the local shape, the small call against
    the call without the replay and against the floor under it."""
    def named(case):
        bases, floor = logits.baselines(case)
        return [report.format_fields(b) for b in bases], floor

    assert named(logits.case("triton_keep_sparse", validate=False)) == (["provider=triton"], None)
    assert named(logits.case("triton", tp=2)) == (["tp=1,V=75968"], None)
    assert named(logits.case("eager", T=1024, validate=False)) == (
        ["provider=eager_own_path", "provider=floor_eager"], None)
    assert named(logits.case("triton")) == ([], None)
