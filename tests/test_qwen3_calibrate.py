"""The calibration program on CPU (fp32, `tiny`, hf engine), kept small: one sampling seed, one prompt set of two
prompts, engine layouts tp1 and dp2, trainer layouts tp1 and tp2. Every negative control must be measured and
separated from the healthy values; the outputs must be what the check and the docs read. About 30-60 s on 2 cores
(one model pair, two engine layouts, one group of 2 gloo ranks).
"""

import fcntl
import json
import os

from sglang_checks import calibrate, controls, tolerances
from tests import processes
from tests.check_support import run_calibrate, run_calibrate_raw


def test_calibrate_measures_every_control_and_separates_it(tmp_path):
    out = tmp_path / "cal"
    rows = run_calibrate(out, f"--cache_dir={tmp_path / 'models'}", "--seeds=0", "--prompt_sets=builtin",
                         "--num_prompts=2", "--max_new_tokens=8", "--engine_layouts=tp1,dp2",
                         "--trainer_layouts=tp1,tp2")
    cal = json.loads((out / "calibration.json").read_text())
    assert set(cal["thresholds"]) == set(tolerances.DEFAULTS)
    for name, t in cal["thresholds"].items():
        assert t["healthy_max"] < t["value"] < t["broken_min"], (name, t)
        assert t["margin"] >= calibrate.MIN_MARGIN, (name, t)
    assert {r["control"] for r in rows if r["kind"] == "control"} == set(controls.CONTROLS)
    # With the fp32 tolerances in use: every healthy run passes, every control fails with the metric that catches it.
    assert calibrate.violations(rows, "float32") == []
    md = (out / "calibration.md").read_text()
    assert all(f"`{name}`" in md for name in tolerances.DEFAULTS)


def test_derive_places_the_threshold_between_healthy_and_broken():
    def row(kind, control, name, value):
        return {"kind": kind, "control": control, "tolerance_name": name, "value": value, "engine": "hf",
                "config": "c", "subject": "s", "metric": "m"}

    rows = [row("healthy", "none", "kl_tol", 1e-3), row("healthy", "none", "kl_tol", 4e-3),
            row("control", controls.TRAINER_TEMPERATURE, "kl_tol", 0.1),
            row("control", controls.TRAINER_TEMPERATURE, "kl_tol", 0.2),  # the control's largest value counts
            row("control", controls.SHIFTED_LOGPROBS, "kl_tol", 0.4),
            row("control", controls.TRAINER_TOP_P, "kl_tol", 1e-4),  # not a kl_tol control: ignored
            row("healthy", "none", "mismatch_tol", 0.5), row("control", controls.SHIFTED_LOGPROBS, "mismatch_tol", 0.3)]
    table = {e["name"]: e for e in calibrate.derive(rows)}
    kl = table["kl_tol"]
    assert kl["healthy_max"] == 4e-3 and kl["broken_min"] == 0.2 and kl["status"] == "ok"
    assert abs(kl["value"] - (4e-3 * 0.2) ** 0.5) < 1e-12 and abs(kl["margin"] - (0.2 / 4e-3) ** 0.5) < 1e-9
    assert table["mismatch_tol"]["status"] == "NOT SEPARATED"
    assert table["engine_layout_tol"]["status"] == "not measured"


def test_violations_name_a_false_fail_and_a_fault_that_would_pass():
    limit = tolerances.resolve("kl_tol", None, "float32")

    def row(kind, control, value):
        return {"kind": kind, "control": control, "tolerance_name": "kl_tol", "value": value, "engine": "hf",
                "config": "c", "subject": "s", "metric": "k3 KL"}

    rows = [row("healthy", "none", 2 * limit), row("control", controls.TRAINER_TEMPERATURE, limit / 2)]
    found = calibrate.violations(rows, "float32")
    assert any(v.startswith("healthy hf c") for v in found)
    assert any(v.startswith(f"control {controls.TRAINER_TEMPERATURE}: largest kl_tol") for v in found)
    assert any(v.startswith(f"control {controls.SHIFTED_LOGPROBS}: no mismatch_tol") for v in found)


# ------------------------------------------------------------------------------------ the CLI: one line, exit code


def test_help_exits_0_and_lists_calibrates_and_the_checks_flags():
    proc = run_calibrate_raw("--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--out_dir", "--seeds", "--model", "--engine_layouts"):
        assert flag in proc.stdout, flag


def test_unbalanced_quote_is_one_line_and_exit_2(tmp_path):
    proc = run_calibrate_raw(f"--out_dir={tmp_path / 'cal'}", f"--cache_dir={tmp_path / 'models'}",
                             "--sglang_extra_args='abc")
    assert proc.returncode == 2, proc.stderr
    assert processes.only_line(proc.stderr).startswith("calibrate: error: --sglang_extra_args='abc: not a shell-quoted")
    assert not (tmp_path / "models").exists()


def test_relative_out_dir_is_the_callers_and_a_folder_being_written_is_refused(tmp_path):
    """Under `bazel run` a relative --out_dir is where the user was (BUILD_WORKING_DIRECTORY); another calibration
    writing it holds its lock, so this one is refused before any model is built."""
    caller = tmp_path / "caller"
    (caller / "relcal").mkdir(parents=True)
    fd = os.open(str(caller / "relcal" / ".lock"), os.O_RDWR | os.O_CREAT)  # the lock a running calibration holds
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        proc = run_calibrate_raw("--out_dir=relcal", f"--cache_dir={tmp_path / 'models'}",
                                 env={"BUILD_WORKING_DIRECTORY": str(caller)})
    finally:
        os.close(fd)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert processes.only_line(proc.stderr).startswith(f"calibrate: error: --out_dir={caller / 'relcal'}: another "
                                                       f"run is writing this folder")
    assert not (tmp_path / "models").exists()
