"""qwen3_parallel_check: do the trainer's log-probs equal the rollout engine's, and stay the same across layouts?

    bazel run //sglang_checks:qwen3_parallel_check            # CPU, `tiny` model, hf engine, about a minute
    bazel run //sglang_checks:qwen3_parallel_check -- --model=qwen3-0.6b-random --trainer_layouts=tp1,tp2
    bazel run //sglang_checks:qwen3_parallel_check -- --engine=sglang --engine_layouts=tp1,tp2 \\
        --model=/path/to/Qwen3-0.6B --sglang_python=/path/to/sglang-venv/bin/python --dtype=bfloat16

Exit code: 0 when every comparison is within its tolerance, 1 when one is not, 2 on bad input (flags, paths, rollout
files, prompts: one line on stderr saying what was expected, before any model is built or loaded), 3 when a trainer
rank crashed or timed out (one line naming the layout and rank; the report holds what finished). The report folder gets report.md, report.json, logprob_diff_hist.png, rollout.json (replay it with
--rollout_data) and, with --engine=sglang, each server's log. See sglang_checks/check.py for the steps.
"""

from __future__ import annotations

import signal
import sys

from absl import app

from sglang_checks import check, cli
from sglang_checks.errors import CheckError


def _stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: servers and trainer ranks are shut down on the way out


def main(argv):
    del argv  # flags_parser refused stray arguments
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return check.run(cli.settings_from_flags())
    except CheckError as exc:
        print(f"qwen3_parallel_check: error: {exc}", file=sys.stderr, flush=True)
        return check.EXIT_BAD_INPUT


if __name__ == "__main__":
    app.run(main, flags_parser=cli.flags_parser("qwen3_parallel_check"))
