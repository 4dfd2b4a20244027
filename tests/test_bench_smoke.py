"""Smoke test of the bench (tools/bench): its whole code path on tiny CPU shapes.

CPU timings are meaningless and never asserted. What is checked for real: every case gets one CSV row with the right
status (measured, or skipped with the provider's reason); the byte counts and the GB/s and copy-bandwidth fractions
derived from them; the host time per call; the small_call suite's eager and torch.compile providers (compiled even
with TORCHDYNAMO_DISABLE=1, as the test suite sets it; reduce-overhead skipped off-GPU with its reason); the semantic
check against the float64 reference, and that it catches a wrong provider; OOM and error handling; the time budget;
the Markdown, the plot data and the PNG; the target verdicts; the command line (flags, usage errors, --render_only)
and the TP=2 path (two spawned ranks over gloo, each holding half the vocab).

The Triton provider runs under TRITON_INTERPRET=1 (set by conftest.py / tools/pytest.bzl) on a few cases only: each
interpreted step takes about half a second.
"""

import csv
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests import processes
from tools.bench import keep_set, measure, providers, report, runner
from tools.bench.cases import Case, suite_cases
from tools.bench.check import checked_rows

REPO_ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent  # not resolved: Bazel runfiles stay themselves
BENCH = REPO_ROOT / "tools" / "bench" / "bench.py"
TINY = dict(T=8, V=256)  # the smoke suite's shape: 8 rows (a 10% row mask keeps 1), 256 columns (a power of two)

# The CSV stores 6 significant digits: one rounding moves a value by at most half a unit in the 6th digit.
CSV_ROUNDING = 5e-6


def _after_roundings(n: int) -> float:
    """Relative bound on a stored column against what n-1 other stored columns give: n roundings compound."""
    return (1 - CSV_ROUNDING) ** -n - 1


# The published floor is quoted to 3 significant digits (7.47 GB, 1.76 ms, 4.25 TB/s).
REFERENCE_RTOL = 1e-3
# Fast settings for CPU runs: the numbers only exercise the plumbing.
FAST = dict(warmup=1, min_reps=2, max_reps=2, target_ms=1.0, copy_bytes=1 << 20, check_rows=4)


def _config(tmp_path, cases, tp=1, **overrides):
    paths = runner.OutputPaths(csv=str(tmp_path / "r.csv"), md=str(tmp_path / "r.md"), png=str(tmp_path / "r.png"))
    return runner.BenchConfig(cases=cases, tp=tp, device="cpu", paths=paths, **dict(FAST, **overrides))


def _triton_runs() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench_smoke")
    cases = suite_cases(["smoke"])
    config = _config(tmp_path, cases)
    rc = runner.run(config)
    rows = report.read_csv(config.paths.csv)
    return config, cases, rows, rc


def _key(case: Case) -> tuple:
    return (case.provider, str(case.T), str(case.V), case.dtype, case.entropy, report.fmt_bool(case.keep_mask),
            f"{case.row_frac:.1f}", str(case.tp), report.fmt_bool(case.validate), report.fmt_bool(case.inplace_grad))


# --- byte accounting -------------------------------------------------------------------------------------------------


def test_headline_bytes_are_the_reference_floor():
    # bf16 T=8192 V=151936 moves 3 x 2.49 GB = 7.47 GB, i.e. 1.76 ms at 4.25 TB/s.
    b = measure.case_bytes(8192, 151936, "bf16", kept_rows=8192, keep_mask=False)
    assert b.fwd == 8192 * 151936 * 2 == 2_489_319_424
    assert b.bwd == 2 * b.fwd
    assert b.total == 7_467_958_272
    assert measure.gbps(b.total, 1.757) == pytest.approx(4250, rel=REFERENCE_RTOL)


def test_bytes_count_kept_rows_and_keep_mask():
    # T=10, V_local=100, fp32, one kept row, keep mask: forward reads 1 row (400 B) + its mask (100 B); backward
    # reads them again and writes the whole gradient (10 x 100 x 4 = 4000 B).
    b = measure.case_bytes(10, 100, "fp32", kept_rows=1, keep_mask=True)
    assert (b.fwd, b.bwd) == (500, 4500)


def test_checked_rows_are_first_and_last():
    assert checked_rows(10, 4).tolist() == [0, 1, 8, 9]
    assert checked_rows(10, 5).tolist() == [0, 1, 2, 8, 9]
    assert checked_rows(3, 8).tolist() == [0, 1, 2]


# --- the smoke run ---------------------------------------------------------------------------------------------------


def test_every_case_has_one_row_in_order(smoke):
    config, cases, rows, rc = smoke
    assert rc == 0, [(r["provider"], r["status"], r["check"]) for r in rows if r["status"] != "ok"]
    assert [tuple(r[k] for k in report.CASE_KEY) for r in rows] == [_key(c) for c in cases]
    with open(config.paths.csv, newline="") as f:
        assert tuple(next(csv.reader(f))) == report.COLUMNS


def test_unsupported_combinations_are_skipped_with_reasons(smoke):
    _, cases, rows, _ = smoke
    for case, row in zip(cases, rows):
        if case.provider == "legacy" and case.row_frac < 1.0:
            assert row["status"] == "skipped: the legacy API has no row mask"
        elif case.provider == "liger" and case.entropy != "none":
            assert row["status"].startswith("skipped: Liger-Kernel's cross entropy gives the log-prob only")
        elif case.provider == "liger" and case.keep_mask:
            assert row["status"] == "skipped: Liger-Kernel's cross entropy has no keep mask"
        elif case.provider == "liger":
            assert row["status"] == "skipped: Liger-Kernel needs a GPU"
        elif case.provider.startswith("triton") and not _triton_runs():
            assert row["status"].startswith("skipped: the triton backend needs CUDA tensors")
        elif case.provider == "triton_keep_sparse" and keep_set.missing():
            assert row["status"] == f"skipped: {keep_set.missing()}"
        else:
            assert row["status"] == "ok", (case, row["status"])
            checked = providers.PROVIDERS[case.provider].checked  # the keep-set rows are checked by the tests
            assert row["check"] == ("ok" if checked else ""), (case, row["check"])


def test_measured_rows_carry_consistent_numbers(smoke):
    _, cases, rows, _ = smoke
    measured = [(c, r) for c, r in zip(cases, rows) if r["status"] == "ok"]
    assert len(measured) >= 40
    for case, row in measured:
        p20, p50, p80 = (float(row[k]) for k in ("p20_ms", "p50_ms", "p80_ms"))
        assert 0 < p20 <= p50 <= p80
        assert int(row["reps"]) == FAST["min_reps"]
        kept = 1 if case.row_frac < 1.0 else case.T  # round(0.1 * 8) = 1 row
        assert int(row["kept_rows"]) == kept
        expected = measure.case_bytes(case.T, case.V, case.dtype, kept, case.keep_mask)
        assert (int(row["bytes_fwd"]), int(row["bytes_bwd"])) == (expected.fwd, expected.bwd)
        gbps = expected.total / (p50 * 1e-3) / 1e9
        assert float(row["gbps"]) == pytest.approx(gbps, rel=_after_roundings(2))  # gbps and p50_ms
        frac = float(row["gbps"]) / float(row["copy_gbps"])
        assert float(row["frac_copy_bw"]) == pytest.approx(frac, rel=_after_roundings(3))  # and copy_gbps
        # The host's time of a call is bracketed inside its device (here perf_counter) time, rep by rep.
        assert 0 < float(row["host_ms"]) <= p50 * (1 + _after_roundings(2))
        grad_mib = case.T * case.V * measure.DTYPE_BYTES[case.dtype] / 2**20
        assert float(row["grad_mib"]) == pytest.approx(grad_mib, rel=_after_roundings(1))
        assert row["peak_extra_mib"] == ""  # not measured off CUDA
        assert row["device"] == "cpu" and row["torch"] == torch.__version__ and row["date"]


def test_markdown_lists_every_case_and_the_targets(smoke):
    config, cases, rows, _ = smoke
    md = pathlib.Path(config.paths.md).read_text()
    assert "## Targets" in md
    all_cases = md.split("## All cases", 1)[1]
    table = [line for line in all_cases.splitlines() if line.startswith("| ") and not line.startswith("| provider")]
    assert len(table) == len(cases)
    assert "| legacy | 8 | 256 | bf16 | grad | off | 10% | 1 |" in all_cases
    assert "skipped: the legacy API has no row mask" in all_cases
    assert "| torch inplace | 8 | 256 | bf16 | grad | off | all | 1 |" in all_cases


def test_plot_shows_tp1_unmasked_rows(smoke):
    config, _, rows, _ = smoke
    vocab, series = report.plot_series(rows)
    assert vocab == "256"
    grad_bf16 = series[("bf16", "grad")]
    expected = {"torch", "torch inplace", "legacy", "naive"}
    expected |= {"triton", "triton inplace"} if _triton_runs() else set()
    assert set(grad_bf16) == expected
    (t, p20, p50, p80, peak), = grad_bf16["naive"]
    assert t == 8 and p20 <= p50 <= p80 and peak is None
    assert "liger" not in series[("bf16", "none")]  # skipped on CPU, so not plotted
    png = pathlib.Path(config.paths.png).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(config.paths.png).shape[:2]
    assert width > 1000 and height > 500


# --- failure handling ------------------------------------------------------------------------------------------------

# A broken stand-in for the naive provider, by case: a plausible but wrong log-prob (fp32), out of memory (bf16,
# log-prob only), an unexpected error (bf16, entropy grad). Each is followed by a correct torch case on the same inputs.
FAILURE_CASES = [
    Case("naive", dtype="fp32", entropy="none", **TINY),
    Case("torch", dtype="fp32", entropy="none", **TINY),
    Case("naive", dtype="bf16", entropy="none", **TINY),
    Case("torch", dtype="bf16", entropy="none", **TINY),
    Case("naive", dtype="bf16", entropy="grad", **TINY),
    Case("torch", dtype="bf16", entropy="grad", **TINY),
]


def _broken_naive(case, inp):
    closure = providers.build_naive(case, inp)
    if case.dtype == "fp32":
        def forward():
            log_prob, entropy = closure.forward()
            return log_prob + 0.5, entropy
        return providers.Closure(prepare=closure.prepare, step=closure.step, forward=forward)
    error = (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB") if case.entropy == "none"
             else RuntimeError("kernel exploded"))

    def step(_):
        raise error
    return providers.Closure(prepare=closure.prepare, step=step, forward=closure.forward)


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench_failures")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(providers.PROVIDERS, "naive", providers.Provider("naive", _broken_naive, lambda case, device: None))
        rc = runner.run(_config(tmp_path, FAILURE_CASES))
    return tmp_path, rc, report.read_csv(str(tmp_path / "r.csv"))


def test_failures_make_the_run_fail(failures):
    _, rc, rows = failures
    assert rc == 1  # a failed check and an unexpected error; the OOM alone would not
    assert len(rows) == len(FAILURE_CASES)


def test_check_catches_a_wrong_provider(failures):
    tmp_path, _, rows = failures
    assert rows[0]["status"] == "ok" and rows[0]["check"].startswith("fail: log_prob row 0:")
    assert rows[1]["check"] == "ok"  # same inputs, same cached reference: the correct provider passes
    assert "check fail: log_prob" in (tmp_path / "r.md").read_text()


def test_oom_is_recorded_and_the_run_goes_on(failures):
    _, _, rows = failures
    assert rows[2]["status"] == "OOM" and rows[2]["p50_ms"] == ""
    assert rows[3]["status"] == "ok" and rows[3]["check"] == "ok"


def test_unexpected_error_is_recorded_and_the_run_goes_on(failures):
    _, _, rows = failures
    assert rows[4]["status"] == "error: RuntimeError: kernel exploded"
    assert rows[5]["status"] == "ok" and rows[5]["check"] == "ok"


def test_time_budget_stops_starting_cases(tmp_path):
    cases = [Case("torch", dtype="bf16", **TINY)]
    rc = runner.run(_config(tmp_path, cases, time_budget_s=1e-9))
    assert rc == 0
    assert not (tmp_path / "r.csv").exists()
    assert "## Targets" in (tmp_path / "r.md").read_text()


def test_record_of_an_older_bench_gains_the_new_columns(tmp_path):
    """A results.csv written before host_ms existed keeps growing: rewritten with the new header, old cells kept."""
    path = tmp_path / "r.csv"
    older = [c for c in report.COLUMNS if c != "host_ms"]
    report.write_csv(str(path), [dict(provider="triton", T="8192", p50_ms="2.1")], older)
    report.append_csv(str(path), [dict(provider="eager", T="1024", p50_ms="0.5", host_ms="1.2")])
    assert report.csv_columns(str(path)) == report.COLUMNS
    old, new = report.read_csv(str(path))
    assert (old["provider"], old["T"], old["p50_ms"], old["host_ms"]) == ("triton", "8192", "2.1", "")
    assert (new["provider"], new["host_ms"]) == ("eager", "1.2")


def test_csv_with_foreign_columns_is_refused(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("provider,ms\ntriton,1.0\n")
    with pytest.raises(ValueError, match="existing CSV has columns"):
        report.append_csv(str(path), [{"provider": "torch"}])


# --- small calls: eager, torch.compile, reduce-overhead ------------------------------------------------------------


def test_small_call_suite_is_the_issue_shape():
    cases = suite_cases(["small_call"])
    modes = ("eager", "compiled", "reduce_overhead")
    assert [(c.provider, c.T) for c in cases] == [(p, T) for T in (1024, 8192)
                                                  for p in ("eager", "eager_own_path") + modes[1:]
                                                  + tuple(f"floor_{m}" for m in modes)]
    for c in cases:
        assert (c.V, c.dtype, c.entropy, c.validate, c.inplace_grad, c.tp) == (151936, "bf16", "grad", False, False, 1)
    assert all((c.T, c.V) == (TINY["T"], TINY["V"]) for c in suite_cases(["small_call_smoke"]))


@pytest.fixture(scope="module")
def small_calls(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench_small_call")
    cases = suite_cases(["small_call_smoke"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHDYNAMO_DISABLE", "1")  # as tests/conftest.py and tools/pytest.bzl set it: compiled anyway
        config = _config(tmp_path, cases)
        rc = runner.run(config)
        still_disabled = os.environ["TORCHDYNAMO_DISABLE"] == "1"
    return config, cases, report.read_csv(config.paths.csv), rc, still_disabled


def test_small_calls_are_measured_and_checked(small_calls):
    config, cases, rows, rc, still_disabled = small_calls
    assert rc == 0
    assert still_disabled  # the providers enable dynamo only while they compile
    by_provider = {r["provider"]: r for r in rows}
    assert len(rows) == len(cases) == 7
    for name in ("eager", "eager_own_path", "compiled", "floor_eager", "floor_compiled"):
        row = by_provider[name]
        # The floor's gradient is not one: its rows are timed, never checked.
        check = "" if name.startswith("floor_") else "ok"
        assert (row["status"], row["check"], row["validate"]) == ("ok", check, "off"), row
        assert 0 < float(row["host_ms"]) and float(row["p50_ms"]) > 0
    for name in ("reduce_overhead", "floor_reduce_overhead"):
        assert by_provider[name]["status"] == (
            "skipped: reduce-overhead's CUDA graphs need a GPU (on CPU it would time the compiled provider again)")
    md = pathlib.Path(config.paths.md).read_text()
    section = md.split("## Small calls", 1)[1].split("## All cases", 1)[0]
    for name in ("eager", "eager_own_path", "compiled", "reduce_overhead", "floor_eager", "floor_compiled",
                 "floor_reduce_overhead"):
        assert f"| {name} | 8 | 256 | bf16 | grad | off | 1 |" in section
    assert "CUDA graphs need a GPU" in section


def test_a_compile_that_runs_eagerly_fails_its_row(tmp_path, monkeypatch):
    """Were dynamo left disabled, torch.compile would hand back the plain function: its row must not pass as a
    compiled one."""
    import contextlib

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    monkeypatch.setattr(providers, "_dynamo_enabled", contextlib.nullcontext)
    rc = runner.run(_config(tmp_path, [Case("compiled", dtype="bf16", validate=False, **TINY)]))
    (row,) = report.read_csv(str(tmp_path / "r.csv"))
    assert rc == 1
    assert row["status"] == ("error: RuntimeError: torch.compile ran the function without compiling it "
                             "(dynamo disabled?)")


# --- target verdicts --------------------------------------------------------------------------------------------


def _row(provider, p50, *, T=8192, V=151936, dtype="bf16", entropy="grad", tp=1, validate="on", inplace="off",
         frac=None, peak=None):
    grad_mib = T * (V // tp) * measure.DTYPE_BYTES[dtype] / 2**20
    return dict(provider=provider, T=str(T), V=str(V), dtype=dtype, entropy=entropy, keep_mask="off", row_frac="1.0",
                tp=str(tp), validate=validate, inplace_grad=inplace, status="ok", check="ok", p20_ms=str(p50),
                p50_ms=str(p50), p80_ms=str(p50), gbps=str(4000 * (frac or 0)), copy_gbps="4000",
                frac_copy_bw="" if frac is None else str(frac), peak_extra_mib="" if peak is None else str(peak),
                grad_mib=str(grad_mib))


def test_target_verdicts():
    grad = 8192 * 151936 * 2 / 2**20  # MiB of the bf16 gradient
    rows = [
        _row("triton", 2.2, frac=0.85, peak=grad + 10),  # time met, memory met
        _row("triton", 2.3, inplace="on", frac=0.8, peak=100.0),  # inplace memory missed by 36 MiB
        _row("triton", 1.5, entropy="none", frac=0.9),
        _row("liger", 1.2, entropy="none", validate="n/a", inplace="n/a"),  # liger faster: target missed
        _row("triton", 1.21, tp=2),
        _row("triton", 1.0, V=75968),  # the TP=1 reference on the TP=2 local shape
    ]
    verdicts = [v for _, _, v in report.target_rows(rows)]
    assert verdicts == ["met", "met", "missed by 36.0 MiB", "missed: 25.0% slower", "missed by 0.060 x"]


def test_validate_off_rows_get_their_own_verdicts():
    rows = [
        _row("triton", 2.6, frac=0.68),  # default: missed
        _row("triton", 2.0, frac=0.88, validate="off"),  # no host sync: met
        _row("triton", 1.3, tp=2, validate="off"),
        _row("triton", 1.0, V=75968, validate="off"),  # 1.3 x: missed
    ]
    verdicts = {t.split(":")[0]: v for t, _, v in report.target_rows(rows)}
    assert verdicts["time"].startswith("missed")
    assert verdicts["time with validate=False"] == "met"
    assert verdicts["TP=2 with validate=False"] == "missed by 0.150 x"


def test_small_call_target_verdicts():
    def small(provider, p50, T, p80=None):
        row = _row(provider, p50, T=T, validate="off")
        row["p80_ms"], row["host_ms"] = str(p80 or p50), str(p50)
        return row

    rows = [small("eager", 0.45, 1024), small("reduce_overhead", 0.40, 1024),
            small("eager", 2.01, 8192), small("eager_own_path", 2.00, 8192, p80=2.02)]
    verdicts = {t: v for t, _, v in report.target_rows(rows) if t.startswith("small call")}
    assert verdicts == {
        "small call, eager, T=1024: <= 0.5 ms a forward + backward": "met",
        "small call, reduce_overhead, T=1024: <= 0.35 ms a forward + backward": "missed by 0.050 ms",
        "small call, eager, T=8192: no slower than without the replay": "met",  # within the own path's p80
    }
    rows[2] = small("eager", 2.05, 8192)
    verdicts = {t: v for t, _, v in report.target_rows(rows) if t.startswith("small call, eager, T=8192")}
    assert list(verdicts.values()) == ["missed: +0.050 ms"]


def test_target_on_a_wrong_forward_is_invalid():
    row = _row("triton", 1.0, frac=0.95)
    row["check"] = "fail: log_prob row 0: -3 vs reference -12"
    (_, _, verdict), *_ = report.target_rows([row])
    assert verdict.startswith("invalid")


def test_time_target_missed_says_what_time_is_needed():
    rows = [_row("triton", 4.0, frac=0.4)]  # 40% of copy BW: 80% needs half the time
    (target, measured, verdict), *_ = report.target_rows(rows)
    assert "40.0%" in measured and verdict == "missed: needs <= 2 ms"


# --- command line ----------------------------------------------------------------------------------------------------


def _bench(*args, timeout=240, env=None):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=str(REPO_ROOT), env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_tp2_over_gloo_then_render_only(tmp_path):
    out = _bench("--device=cpu", "--tp=2", "--suite=custom", "--providers=torch,legacy,naive", "--tokens=8",
                 "--vocab=256", "--dtypes=bf16", "--entropy=grad", "--keep_mask=off,on", "--row_frac=1.0",
                 "--warmup=1", "--min_reps=2", "--target_ms=1", "--copy_mib=1", f"--out_dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = report.read_csv(str(tmp_path / "results.csv"))
    assert [(r["provider"], r["keep_mask"]) for r in rows] == [
        ("torch", "off"), ("torch", "on"), ("legacy", "off"), ("legacy", "on"), ("naive", "off"), ("naive", "on")]
    for row in rows[:4]:
        # Each rank held 128 of the 256 columns; the check gathered both halves for the float64 reference.
        assert (row["tp"], row["V_local"], row["status"], row["check"]) == ("2", "128", "ok", "ok")
        assert int(row["bytes_bwd"]) == 2 * 128 * 8 * 2 + (8 * 128 if row["keep_mask"] == "on" else 0)
    assert rows[4]["status"] == "skipped: naive torch is single-rank (no vocab-parallel merge)"
    (tmp_path / "results.md").unlink()
    again = _bench("--render_only", f"--out_dir={tmp_path}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "| legacy | 8 | 256 | bf16 | grad | on | all | 2 |" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("flag, message", [
    ("--tokens=abc", "--tokens: expected integers"),
    ("--suite=nope", "unknown suite 'nope'"),
    ("--providers=torch,cuDNN", "--providers: unknown ['cuDNN']"),
])
def test_cli_rejects_bad_flags(tmp_path, flag, message):
    suite = [] if flag.startswith("--suite") else ["--suite=custom"]
    out = _bench("--device=cpu", *suite, flag, f"--out_dir={tmp_path}", timeout=60)
    assert out.returncode == 2, out.stderr
    assert message in processes.only_line(out.stderr)
    assert not (tmp_path / "results.csv").exists()


def test_cli_help_exits_0_and_lists_the_bench_flags():
    out = _bench("--help", timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--out_dir", "--suite", "--tp", "--render_only"):
        assert flag in out.stdout, flag


@pytest.mark.parametrize("out_dir", ["/proc/x", "{file}/sub"])
def test_cli_unwritable_out_dir_is_one_line_and_exit_2(tmp_path, out_dir):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    out_dir = out_dir.format(file=a_file)
    out = _bench("--device=cpu", "--suite=smoke", f"--out_dir={out_dir}", timeout=60)
    assert out.returncode == 2, out.stderr
    assert processes.only_line(out.stderr).startswith(f"bench: error: --out_dir={out_dir}: not a writable folder")




def test_cli_sigint_exits_130_with_one_line_and_no_rank_left(tmp_path):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    # 4 x 2 x 3 x 2 x 2 = 96 cases: many seconds of work, so the ranks are still measuring when the signal comes.
    # The torch provider only: the legacy one's megatron-core import warns on stderr from the ranks.
    cases = 96
    proc = subprocess.Popen([sys.executable, str(BENCH), "--device=cpu", "--tp=2", "--suite=custom",
                             "--providers=torch", "--tokens=8,16,32,64", "--vocab=256", "--dtypes=bf16,fp32",
                             "--entropy=none,value,grad", "--keep_mask=off,on", "--row_frac=1.0,0.1",
                             "--warmup=1", "--min_reps=50", "--max_reps=50", "--copy_mib=1", f"--out_dir={tmp_path}"],
                            cwd=str(REPO_ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Rank 0 reports the copy bandwidth once the group is up.
    processes.assert_interrupt_stops_ranks(proc, "bench", stream=proc.stdout, ready_text="device copy")
    # Stopped, not waited for: ranks left to finish (the interpreter's exit waits for non-daemon children) would
    # have measured every case.
    rows = report.read_csv(str(tmp_path / "results.csv")) if (tmp_path / "results.csv").exists() else []
    assert len(rows) < cases, len(rows)


def test_cli_relative_out_dir_is_the_callers(tmp_path):
    """bazel run starts the bench in its runfiles tree; a relative --out_dir is where the user was."""
    (tmp_path / "results.csv").write_text("")  # an empty CSV: --render_only renders no rows, quickly
    env_dir = dict(BUILD_WORKING_DIRECTORY=str(tmp_path.parent))
    out = _bench("--render_only", f"--out_dir={tmp_path.name}", timeout=60, env=env_dir)
    assert out.returncode == 0, out.stderr
    assert f"wrote {tmp_path / 'results.md'}" in out.stdout


def _rep_count_worker(rank, world_size):
    import torch.distributed as dist

    # Each rank's own warm-up estimate differs (rank 1 looks 10x slower); the agreed estimate, hence the number of
    # timed steps (each a collective at TP > 1), must be the same on every rank.
    estimate = runner.max_over_ranks(0.5 if rank == 0 else 5.0, dist.group.WORLD, torch.device("cpu"))
    assert estimate == 5.0, f"rank {rank}: agreed estimate {estimate}, expected the slowest rank's 5.0"
    calls = []
    measure.time_step(lambda x: calls.append(x), lambda: None, torch.device("cpu"), estimate_ms=estimate,
                      min_reps=1, max_reps=50, target_ms=20.0)
    counts = [None] * world_size
    dist.all_gather_object(counts, len(calls))
    assert counts == [4, 4], f"rank {rank}: timed steps per rank {counts}"


def test_ranks_time_the_same_number_of_steps():
    from tests.core_support import run_gloo

    run_gloo(2, _rep_count_worker)


# --- the Megatron step's bodies (tools/bench/megatron_step.py; the step needs CUDA and megatron-core >= 0.18) ---

# fp32 attention on CPU against float64: a softmax over 12 keys and a weighted sum, each within a few fp32 ulps
SDPA_ATOL = 1e-5


def test_mcore_flash_body_attention_is_causal_grouped_attention():
    """SdpaCoreAttention, the flash body's core attention: Megatron's layout in ([S, B, heads, d] queries, [S, B,
    groups, d] keys and values), [S, B, heads * d] out; causal softmax(q k^T / sqrt(d)) v with head h reading query
    group h // (heads / groups), as Megatron's repeat_interleave gives it; against float64."""
    from tools.bench.megatron_step import SdpaCoreAttention

    gen = torch.Generator().manual_seed(0)
    seq, batch, heads, groups, d = 12, 2, 4, 2, 8
    q = torch.randn(seq, batch, heads, d, generator=gen)
    k = torch.randn(seq, batch, groups, d, generator=gen)
    v = torch.randn(seq, batch, groups, d, generator=gen)
    out = SdpaCoreAttention(config=None, layer_number=1, attn_mask_type=None)(q, k, v, None, attn_mask_type=None)
    assert out.shape == (seq, batch, heads * d)

    q64, k64, v64 = (t.double() for t in (q, k, v))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for h in range(heads):
        g = h // (heads // groups)
        scores = torch.einsum("sbd,tbd->bst", q64[:, :, h], k64[:, :, g]) / d ** 0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        want = torch.einsum("bst,tbd->sbd", probs, v64[:, :, g])
        torch.testing.assert_close(out[:, :, h * d:(h + 1) * d].double(), want, atol=SDPA_ATOL, rtol=0)


def test_mcore_provider_names_say_their_way():
    """Each Megatron-step provider parses to its way to the loss, keep set and body: the flash suite runs the same
    eleven ways as the local one."""
    from tools.bench.cases import MCORE_FLASH_PROVIDERS, MCORE_STEP_PROVIDERS
    from tools.bench.megatron_step import _way

    local = [_way(p) for p in MCORE_STEP_PROVIDERS]
    assert [_way(p) for p in MCORE_FLASH_PROVIDERS] == [(kind, keep, "flash") for kind, keep, _ in local]
    assert {kind for kind, _, _ in local} == {"body", "logits", "head", "loss", "logits_dense", "logits_sparse",
                                              "loss_lean", "loss_spare", "head_spare"}
    assert [keep for _, keep, _ in local] == [False] * 4 + [True] * 4 + [False] * 3
    assert {case.provider for case in suite_cases(["megatron_step_flash"])} == set(MCORE_FLASH_PROVIDERS)


def test_custom_runs_vary_validate_for_the_megatron_head_ways():
    """--suite=custom --validate=on,off: each Megatron-step way that calls ppo_ops runs with validate on and off (what
    its host read costs in the step), the body-only way once."""
    from tools.bench.cases import CustomGrid, cross_product

    grid = CustomGrid(providers=["mcore_body_flash", "mcore_loss_spare_flash", "mcore_logits"], tokens=[8192],
                      vocab=[151936], dtypes=["bf16"], entropy=["grad"], keep_mask=[False], row_frac=[1.0],
                      validate=[True, False], inplace_grad=[False], tp=1)
    got = sorted((c.provider, c.validate) for c in cross_product(grid))
    assert got == [("mcore_body_flash", True), ("mcore_logits", False), ("mcore_logits", True),
                   ("mcore_loss_spare_flash", False), ("mcore_loss_spare_flash", True)]
