"""The bench's TP path on the CPU: two spawned ranks over gloo, each holding half the vocabulary (tools/bench).

What is checked: `bench.py --smoke --tp=2` records one row per TP = 2 smoke case (the slowest rank's numbers), each
rank's check gathers both halves for the float64 reference, a single-rank provider is skipped with its reason; the
ranks agree on the number of timed steps (each a collective) whatever their own warm-up estimates; Ctrl-C ends the
bench with one line and exit 130 and leaves no rank behind; a relative --out_dir is the caller's (bazel run changes
the working directory). CPU timings are never asserted.
"""

import os
import pathlib
import subprocess
import sys

import torch

from tests import processes
from tools.bench import lm_head, logits, measure, report, runner

REPO_ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent  # not resolved: Bazel runfiles stay themselves
BENCH = REPO_ROOT / "tools" / "bench" / "bench.py"
ENV = dict(TORCHDYNAMO_DISABLE="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")


def _bench(*args, timeout=300, **env):
    env = dict(os.environ, **ENV, **env)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=str(REPO_ROOT), env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_smoke_over_two_gloo_ranks(tmp_path):
    out = _bench("--smoke", "--tp=2", f"--out_dir={tmp_path}", "--png=")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = report.read_csv(str(tmp_path / "results.csv"))
    cases = [c for f in (logits, lm_head) for c in f.SMOKE() if c.tp == 2]
    assert [(r["family"], r["provider"], r["keep_mask"]) for r in rows] == [
        (c.family, c.provider, c.fields()["keep_mask"]) for c in cases]
    for row in rows:
        assert (row["tp"], row["V_local"]) == ("2", "128")
        if row["provider"] == "naive":
            assert row["status"] == "skipped: naive torch is single-rank (no vocab-parallel merge)"
        else:
            assert row["status"] == "ok", row
        if row["family"] == "logits" and row["status"] == "ok":
            # each rank held 128 of the 256 columns; the check gathered both halves for the float64 reference
            assert row["check"] == "ok"
            assert int(row["bytes"]) == 3 * 8 * 128 * 2 + (2 * 8 * 128 if row["keep_mask"] == "on" else 0)
    fused = next(r for r in rows if r["provider"] == "fused")
    assert fused["baseline"] == "provider=gemms; provider=unfused; tp=1,V=128"


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


def test_sigint_exits_130_with_one_line_and_no_rank_left(tmp_path):
    # 4 x 2 x 3 x 2 x 2 = 96 cases: many seconds of work, so the ranks are still measuring when the signal comes.
    cases = 96
    env = dict(os.environ, **ENV)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.Popen([sys.executable, str(BENCH), "--device=cpu", "--tp=2", "--suite=custom",
                             "--providers=torch", "--tokens=8,16,32,64", "--vocab=256", "--dtypes=bf16,fp32",
                             "--entropy=none,value,grad", "--keep_mask=off,on", "--row_frac=1.0,0.1",
                             "--warmup=1", "--min_reps=50", "--max_reps=50", "--copy_mib=1", "--warm_max_s=0",
                             f"--out_dir={tmp_path}"],
                            cwd=str(REPO_ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Rank 0 reports the copy bandwidth once the group is up.
    processes.assert_interrupt_stops_ranks(proc, "bench", stream=proc.stdout, ready_text="device copy")
    # Stopped, not waited for: ranks left to finish would have measured every case.
    assert len(report.read_csv(str(tmp_path / "results.csv"))) < cases


def test_relative_out_dir_is_the_callers(tmp_path):
    (tmp_path / "results.csv").write_text("")  # an empty record: --render_only renders no rows, quickly
    out = _bench("--render_only", f"--out_dir={tmp_path.name}", "--png=", timeout=60,
                 BUILD_WORKING_DIRECTORY=str(tmp_path.parent))
    assert out.returncode == 0, out.stderr
    assert f"wrote {tmp_path / 'results.md'}" in out.stdout
    assert (tmp_path / "results.md").read_text().startswith("# ppo_ops bench")
