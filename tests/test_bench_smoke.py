"""The bench's plumbing on the CPU (tools/bench): `bench.py --smoke`, its record, its report, its command line.

CPU timings are meaningless and never asserted. What is checked: one `--smoke` run writes one row per smoke case of
every family (logits, step, lm_head) to the one CSV, in order, each measured or skipped with its provider's reason;
the numbers derived from the measured ones (bytes, GB/s, fraction of the copy bandwidth) and the float64 check; the
report's ratios against the baselines computed from the CSV's own cells, and --render_only rendering it again; failure
handling (a wrong forward fails its check and the run, an OOM and an error are rows and the run goes on); the time
budget; a foreign CSV refused; bad flags refused with one line and exit 2 before any case runs.

The smoke run is one subprocess without TRITON_INTERPRET (the triton rows are then skipped with their reason; the
interpreter takes seconds a step, and the triton provider's code is the torch provider's but for the backend name).
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests import processes
from tools.bench import bench, lm_head, logits, report, runner, step
from tools.bench.common import Closure, Provider

REPO_ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent  # not resolved: Bazel runfiles stay themselves
BENCH = REPO_ROOT / "tools" / "bench" / "bench.py"
# The CSV stores 6 significant digits: each stored cell is within half a unit of its 6th digit of the value.
CSV_RTOL = 2e-5  # a quotient of two stored cells against the stored quotient: three roundings
# The published floor is quoted to 3 significant digits (7.47 GB, 1.76 ms at 4.25 TB/s).
REFERENCE_RTOL = 1e-3
FAST = dict(warmup=1, min_reps=1, max_reps=1, target_ms=0.0, copy_bytes=1 << 20, check_rows=4, warm_max_s=0.0)


def _bench(*args, timeout=300, **env):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **env)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=str(REPO_ROOT), env=env, capture_output=True,
                          text=True, timeout=timeout)


def _smoke_cases(tp=1):
    return [c for f in (logits, step, lm_head) for c in f.SMOKE() if c.tp == tp]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("smoke")
    out = _bench("--smoke", f"--out_dir={out_dir}", "--png=")
    return out, report.read_csv(str(out_dir / "results.csv")), out_dir


def test_smoke_writes_one_row_per_case_of_every_family_in_order(smoke):
    out, rows, _ = smoke
    assert out.returncode == 0, out.stderr[-3000:]
    cases = _smoke_cases()
    assert [(r["family"], r["provider"], r["T"], r["V"], r["H"], r["entropy"], r["keep_mask"], r["row_frac"],
             r["validate"], r["inplace_grad"]) for r in rows] == [
        tuple(str(v) for v in (c.family, c.provider, c.T, c.V, c.H or "", c.entropy)) + tuple(
            c.fields()[k] for k in ("keep_mask", "row_frac", "validate", "inplace_grad")) for c in cases]
    assert {r["family"] for r in rows} == {"logits", "step", "lm_head"}
    assert len({r["timestamp"] for r in rows}) == 1 and {r["round"] for r in rows} == {"1"}  # one run
    assert all(r["gpu"].startswith("CPU") and r["torch"] == torch.__version__ for r in rows)


def test_providers_that_cannot_run_are_skipped_with_their_reason(smoke):
    _, rows, _ = smoke
    skipped = {(r["family"], r["provider"]): r["status"] for r in rows if r["status"] != "ok"}
    assert skipped == {
        ("logits", "legacy"): "skipped: the legacy API has no row mask",
        ("logits", "liger"): "skipped: Liger-Kernel needs a GPU",
        ("logits", "triton"): "skipped: the triton backend needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)",
        ("logits", "reduce_overhead"): "skipped: reduce-overhead's CUDA graphs need a GPU",
        ("step", "mcore_head_flash"): "skipped: megatron-core's attention runs on CUDA only",
        ("lm_head", "liger_flsce"): "skipped: liger_flsce's kernels need CUDA",
    }
    assert all(r["p50_ms"] == "" for r in rows if r["status"] != "ok")


def test_measured_rows_carry_consistent_numbers(smoke):
    _, rows, _ = smoke
    for r in (r for r in rows if r["status"] == "ok"):
        p20, p50, p80 = (float(r[k]) for k in ("p20_ms", "p50_ms", "p80_ms"))
        assert 0 < p20 <= p50 <= p80 and float(r["host_ms"]) > 0, r
        if r["family"] == "logits":
            kept = 1 if r["row_frac"] == "0.1" else 8
            mask = kept * 256 if r["keep_mask"] == "on" else 0
            width = 2 if r["dtype"] == "bf16" else 4
            assert int(r["bytes"]) == 2 * (kept * 256 * width + mask) + 8 * 256 * width, r
            assert float(r["gbps"]) == pytest.approx(int(r["bytes"]) / (p50 * 1e-3) / 1e9, rel=CSV_RTOL)
            assert float(r["frac_copy_bw"]) == pytest.approx(float(r["gbps"]) / float(r["copy_gbps"]), rel=CSV_RTOL)
            if r["check"] != "":  # the floor rows and the replay-off row are not log-probs: not checked
                assert r["check"] == "ok" and 0 <= float(r["err_logprob"]) < 1e-2, r
        else:
            assert r["bytes"] == r["gbps"] == ""
        assert (r["steady_ms"] != "") == (r["family"] == "lm_head")  # only the LM head is timed back to back
    fused = next(r for r in rows if r["provider"] == "fused")
    assert float(fused["err_logprob"]) < 0.05 and float(fused["err_dx_rel"]) < 0.05  # bf16 against float64
    assert fused["baseline"] == "provider=gemms; provider=unfused"


def test_report_sets_rows_against_their_baselines(smoke):
    _, rows, out_dir = smoke
    md = (out_dir / "results.md").read_text()
    by = {(r["family"], r["provider"], r["validate"]): r for r in rows}
    for (family, provider, validate), base in ((("lm_head", "fused", ""), "gemms"),
                                                (("logits", "eager", "off"), "eager_own_path"),
                                                (("step", "qwen3_step", "off"), None)):
        row = by[(family, provider, validate)]
        other = by[(family, base, validate)] if base else by[(family, provider, "on")]
        ratio = float(row["p50_ms"]) / float(other["p50_ms"])
        line = next(line for line in md.splitlines() if line.startswith(f"| {report._label(row)} |")
                    and f"| {row['baseline'].split('; ')[0]} |" in line)
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[3] == "1" and cells[6] == f"{ratio:.3f}", (line, ratio)
        assert cells[7] == f"{float(row['p50_ms']) - float(other['p50_ms']):+.3f}"
    for family in ("logits", "step", "lm_head"):
        assert f"## {family}" in md


def test_render_only_renders_the_same_report_again(smoke):
    _, _, out_dir = smoke
    before = (out_dir / "results.md").read_text()
    (out_dir / "results.md").unlink()
    out = _bench("--render_only", f"--out_dir={out_dir}", "--png=", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (out_dir / "results.md").read_text() == before


def test_headline_bytes_are_the_reference_floor():
    """docs/performance.md: 3 x 2.49 GB = 7.47 GB for log-prob + entropy with gradient at T=8192, V=151936, bf16,
    1.76 ms at 4.25 TB/s."""
    nbytes = logits.bytes_moved(logits.case("triton"))
    assert nbytes == 3 * 8192 * 151936 * 2
    assert nbytes / 1e9 == pytest.approx(7.47, rel=REFERENCE_RTOL)
    assert nbytes / 4.25e12 * 1e3 == pytest.approx(1.76, rel=REFERENCE_RTOL * 3)


def test_custom_runs_vary_validate_only_where_a_provider_calls_ppo_ops():
    """--suite=custom --validate=on,off: the logits op's ppo_ops providers and the Megatron step's head ways run with
    validate on and off, the body-only step and the other providers once."""
    from absl import flags

    flags.FLAGS(["bench", "--out_dir=x", "--suite=custom", "--tokens=8192", "--validate=on,off", "--entropy=grad",
                 "--keep_mask=off", "--row_frac=1.0", "--dtypes=bf16",
                 "--providers=mcore_body_flash,mcore_loss_spare_flash,naive,triton,gemms"])
    try:
        got = sorted((c.family, c.provider, c.validate) for c in bench._cases())
    finally:
        flags.FLAGS.unparse_flags()
    assert got == [("lm_head", "gemms", None), ("logits", "naive", None), ("logits", "triton", False),
                   ("logits", "triton", True), ("step", "mcore_body_flash", True),
                   ("step", "mcore_loss_spare_flash", False), ("step", "mcore_loss_spare_flash", True)]


# --- failure handling, in process ---

TINY = dict(T=8, V=256)
# A broken stand-in for the naive provider: a plausible but wrong log-prob (fp32), out of memory (bf16, log-prob
# only), an unexpected error (bf16, entropy grad). Each is followed by a correct torch case on the same inputs.
FAILURE_CASES = [logits.case(p, dtype=dt, entropy=e, **TINY)
                 for dt, e in (("fp32", "none"), ("bf16", "none"), ("bf16", "grad")) for p in ("naive", "torch")]


def _broken_naive(case, inp):
    closure = logits.build_naive(case, inp)
    if case.dtype == "fp32":
        return Closure(closure.prepare, closure.step, lambda: (closure.forward()[0] + 0.5, None))
    error = (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB") if case.entropy == "none"
             else RuntimeError("kernel exploded"))

    def fail(_):
        raise error

    return Closure(closure.prepare, fail, closure.forward)


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    csv = str(tmp_path_factory.mktemp("failures") / "r.csv")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(logits.PROVIDERS, "naive", Provider("naive", _broken_naive, lambda case, device: None))
        rc = runner.run(runner.BenchConfig(cases=FAILURE_CASES, tp=1, device="cpu", csv=csv, **FAST))
    return rc, report.read_csv(csv)


def test_failures_are_rows_and_fail_the_run(failures):
    rc, rows = failures
    assert rc == 1  # a failed check and an unexpected error; the OOM alone would not
    assert rows[0]["status"] == "ok" and rows[0]["check"].startswith("fail: log_prob row 0:")
    assert rows[1]["check"] == "ok"  # same inputs, same cached reference: the correct provider passes
    assert rows[2]["status"] == "OOM" and rows[2]["p50_ms"] == ""
    assert rows[4]["status"] == "error: RuntimeError: kernel exploded"
    assert [r["status"] for r in rows[1::2]] == ["ok"] * 3
    assert [runner.problem(r) is not None for r in rows] == [True, False, False, False, True, False]


def test_time_budget_stops_starting_cases(tmp_path):
    csv = str(tmp_path / "r.csv")
    config = runner.BenchConfig(cases=FAILURE_CASES[1:2], tp=1, device="cpu", csv=csv,
                                **dict(FAST, time_budget_s=1e-9))
    assert runner.run(config) == 0
    assert report.read_csv(csv) == []


def test_csv_with_foreign_columns_is_refused(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("provider,T,ms\ntriton,8192,2.0\n")
    with pytest.raises(ValueError, match="are not the bench's; use a new --csv"):
        report.append_csv(str(path), [dict(provider="torch")])
    assert path.read_text() == "provider,T,ms\ntriton,8192,2.0\n"


# --- the command line ---


@pytest.mark.parametrize("args, message", [
    (["--suite=custom", "--tokens=abc"], "--tokens: expected integers"),
    (["--suite=nope"], "--suite: unknown suite 'nope'"),
    (["--providers=torch,cuDNN"], "--providers: unknown ['cuDNN']"),
    (["--rounds=0"], "--rounds"),
    (["--smoke", "--out_dir=/proc/x"], "--out_dir=/proc/x: not a writable folder"),
])
def test_cli_refuses_bad_flags_with_one_line_and_exit_2(tmp_path, args, message):
    out = _bench("--device=cpu", f"--out_dir={tmp_path}", *args, timeout=120)
    assert out.returncode == 2, out.stderr
    line = processes.only_line(out.stderr)
    assert line.startswith("bench: error: ") and message in line
    assert not (tmp_path / "results.csv").exists()


def test_plot_draws_the_logits_familys_headline_vocabulary(tmp_path):
    image = pytest.importorskip("matplotlib.image")

    rows = [dict(report.HEADLINE, provider=p, T=str(T), V_local="151936", validate="on", inplace_grad="off",
                 status="ok", p20_ms=str(t * 0.9), p50_ms=str(t), p80_ms=str(t * 1.1), peak_extra_mib=str(T / 4),
                 gpu="GPU", dtype=dt, entropy=e)
            for p, scale in (("triton", 1.0), ("naive", 20.0)) for T in (4096, 8192) for dt in ("bf16", "fp32")
            for e in ("grad", "none") for t in (scale * T / 4096,)]
    csv = str(tmp_path / "r.csv")
    report.append_csv(csv, rows)
    report.render(csv, str(tmp_path / "r.md"), str(tmp_path / "r.png"))
    height, width = image.imread(str(tmp_path / "r.png")).shape[:2]
    assert width > 1000 and height > 500
    md = (tmp_path / "r.md").read_text()
    assert md.count("| triton | T=8192 V=151936 bf16 entropy grad TP=1 | 2.000 |") == 2  # headline and family tables


def test_the_pieces_probe_runs_and_refuses_a_machine_without_cuda(tmp_path):
    probe = REPO_ROOT / "tools" / "probes" / "lm_head_pieces.py"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(probe), f"--out_dir={tmp_path}"], cwd=str(REPO_ROOT), env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert processes.only_line(out.stderr) == "lm_head_pieces: error: the pieces are CUDA kernels: run on a GPU"
