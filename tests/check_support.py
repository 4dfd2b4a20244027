"""Helpers of the Qwen3-check suites: run the calibration program as its users do and read what it measured."""

import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_calibrate_raw(*flags, timeout_s: float = 900, env=None) -> subprocess.CompletedProcess:
    """`python -m sglang_checks.calibrate FLAGS...` from the repository root (`env`: more environment variables);
    its exit code and output, unchecked."""
    env = dict(os.environ, **(env or {}))
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "sglang_checks.calibrate", *flags], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def run_calibrate(out_dir, *flags, timeout_s: float = 900) -> list:
    """run_calibrate_raw with --out_dir=OUT_DIR; asserts it exited 0 and returns the measured rows of its first run
    (measurements.json)."""
    proc = run_calibrate_raw(f"--out_dir={out_dir}", *flags, timeout_s=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(str(out_dir), "measurements.json")) as f:
        return json.load(f)["runs"][0]["rows"]
