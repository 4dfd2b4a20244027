"""qwen3_parallel_check: do the trainer's log-probs equal the rollout engine's, and stay the same across layouts?

    # CPU, `tiny` model, hf engine, then 8 GRPO steps (the target's args: --train_steps=8 --samples_per_prompt=4),
    # each step's weights synced into the engine and checked (sglang_checks/train_steps.py); about a minute
    bazel run //sglang_checks:qwen3_parallel_check
    bazel run //sglang_checks:qwen3_parallel_check -- --train_steps=0 --model=qwen3-0.6b-random --trainer_layouts=tp2
    bazel run //sglang_checks:qwen3_parallel_check -- --engine=sglang --engine_layouts=tp1,tp2 \\
        --model=/path/to/Qwen3-0.6B --sglang_python=/path/to/sglang-venv/bin/python --dtype=bfloat16
    # true on-policy: the trainer repeats SGLang's --rl-on-policy-target forward and must match it exactly; the tensor
    # dump names the first tensor where they part (report.json's layer_diff). The trainer imports SGLang's kernels,
    # which need the packages SGLang was installed with: run it with SGLang's interpreter (with absl-py), from here
    /path/to/sglang/python -m sglang_checks.qwen3_parallel_check --engine=sglang \\
        --sglang_python=/path/to/sglang/python --model=qwen3-0.6b-random --dtype=bfloat16 --device=cuda \\
        --sglang_rl_on_policy_target=fsdp --sglang_attention_backend=triton --sglang_sampling_backend=pytorch \\
        --trainer_numerics=sglang_on_policy --trainer_layouts=tp1,tp2,tp1-fused --expect_bitwise --sglang_dump_tensors
    # the same across 16 GRPO steps, each step's weights loaded into the server and read back, the textbook trainer
    # beside ppo_ops' (docs/contributing.md has the full command)
    ... --trainer_layouts=tp1,tp1-fused --expect_bitwise --sglang_mem_fraction=0.5 --train_steps=16 \\
        --samples_per_prompt=4 --reference_trainer

Exit code: 0 when every comparison is within its tolerance, 1 when one is not, 2 on bad input (flags, paths, rollout
files, prompts: one line on stderr saying what was expected, before any model is built or loaded), 3 when a trainer
rank crashed or timed out (one line naming the layout and rank; the report holds what finished), 130 when interrupted
(Ctrl-C: one line; servers and trainer ranks are stopped first). Relative paths are where the command was run from
(also under bazel run). The report folder gets report.md, report.json, logprob_diff_hist.png, rollout.json (replay
it with --rollout_data), with --train_steps train_steps.png (the per-step curves) and, with --engine=sglang, each
server's log, each file written whole (a temporary file renamed into place); a run holds the folder's .lock for its
duration, and a second run into it is refused (exit 2). See sglang_checks/check.py for the steps.
"""

from __future__ import annotations

import signal
import sys

from absl import flags

from sglang_checks import check, cli
from sglang_checks.errors import CheckError
from ppo_ops.runtime import cli as runtime_cli

flags.adopt_module_key_flags(cli)  # --help lists the check's flags (defined in cli.py), not only this module's


def _stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like Ctrl-C: servers and trainer ranks are shut down on the way out


def main(argv):
    del argv  # the flags parser refused stray arguments
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        return check.run(cli.settings_from_flags())
    except CheckError as exc:
        print(f"qwen3_parallel_check: error: {runtime_cli.one_line(exc)}", file=sys.stderr, flush=True)
        return check.EXIT_BAD_INPUT


if __name__ == "__main__":
    # --help exits 0; a bad flag is one line and exit 2; Ctrl-C is one line and exit 130 (ppo_ops/runtime/cli.py).
    runtime_cli.run(main, program="qwen3_parallel_check")
