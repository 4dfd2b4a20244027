"""layer_diff_main: the trainer's on-policy forward, run again on a finished check's rollout, against that run's engine
tensor dump, without starting SGLang again: the loop for finding (and fixing) where trainer and engine part.

    python -m sglang_checks.layer_diff_main --report_dir=R --sglang_python=/tmp/sgl_python [--engine_layout=tp1]

R is the report folder of a check run with --engine=sglang --sglang_dump_tensors: its report.json names the model
(settings model, cache_dir, seed), rollout.json holds the tokens, engine_dump/<layout>/ the server's passes. The
forward is on_policy.py's with SGLang's kernels (imported from --sglang_python's site folder) on CUDA, or its torch
stand-ins with --kernels=torch (any device; for checking this tool on a CPU). Prints layer_diff.py's summary and one
line per tensor, in forward order, up to --after tensors past the first difference; writes the whole result to
R/layer_diff_<layout>.json. Exit code: 0 when no tensor differs, 1 when one does, 2 on bad input.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from absl import flags

from sglang_checks import layer_diff, models, on_policy, report, rollout as rollout_lib
from sglang_checks.engines import sglang_engine
from sglang_checks.errors import CheckError
from ppo_ops.runtime import cli as runtime_cli

_REPORT_DIR = flags.DEFINE_string("report_dir", None, "Report folder of a check run with --sglang_dump_tensors.",
                                  required=True)
_ENGINE_LAYOUT = flags.DEFINE_string("engine_layout", "tp1", "Which engine layout's dump (a tp1 or dpN layout).")
_KERNELS = flags.DEFINE_enum("kernels", "sglang", ["sglang", "torch"], "SGLang's kernels (CUDA) or the torch "
                             "stand-ins.")
_SGLANG_PYTHON = flags.DEFINE_string("sglang_python", sys.executable, "Interpreter whose sglang the kernels come "
                                     "from (its site folder is appended to sys.path).")
_AFTER = flags.DEFINE_integer("after", 3, "Tensors listed past the first difference.")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise runtime_cli.BadInput(f"--report_dir: cannot read {path} ({exc})") from exc


def _line(t: dict) -> str:
    verdict = "equal" if not t["differing"] and not t["dtype_mismatch"] and not t["width_mismatch"] else "DIFFERS"
    return (f"{t['name']:<55} {verdict:<8} {t['differing']:>10}/{t['elements']:<10} max|d| {t['max_abs_diff']:.3e}  "
            f"engine {t['engine_dtype']} {t['engine_shape']}  trainer {t['trainer_dtype']} {t['trainer_shape']}")


def main(argv) -> int:
    del argv
    try:
        return _main()
    except CheckError as exc:  # a rollout, model or interpreter the check itself would refuse
        raise runtime_cli.BadInput(str(exc)) from exc


def _main() -> int:
    folder = runtime_cli.caller_path(_REPORT_DIR.value)
    if not os.path.isdir(folder):  # said as such, not as a dump missing inside it
        where = "" if folder == _REPORT_DIR.value else f" {folder}"  # a relative path: where it was looked for
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise runtime_cli.BadInput(f"--report_dir={_REPORT_DIR.value}: the report folder{where} {what}")
    dump = os.path.join(folder, "engine_dump", _ENGINE_LAYOUT.value)
    if not layer_diff.pass_files(dump):
        raise runtime_cli.BadInput(f"--engine_layout={_ENGINE_LAYOUT.value}: no PassNNNNN.pt under {dump} (run "
                                    f"the check with --engine=sglang --sglang_dump_tensors)")
    settings = _read_json(os.path.join(folder, report.JSON_NAME)).get("settings", {})
    rollout = rollout_lib.load(os.path.join(folder, report.ROLLOUT_NAME))
    info = models.resolve_model(settings.get("model", rollout.model_name), cache_dir=settings.get("cache_dir"),
                                seed=settings.get("seed", rollout.seed), log=lambda m: print(m, file=sys.stderr))
    rollout_lib.check_model(rollout, info.fingerprint, info.name, os.path.join(folder, report.ROLLOUT_NAME))
    if _KERNELS.value == "sglang":
        kernels, device = on_policy.sglang_kernels(sglang_engine.site_dir(_SGLANG_PYTHON.value)), "cuda"
    else:
        kernels, device = on_policy.TORCH_KERNELS, "cuda" if torch.cuda.is_available() else "cpu"
    model = models.load_hf_model(info, dtype=torch.bfloat16, device=torch.device(device))
    sequences = [s.prompt_ids + s.completion_ids for s in rollout.samples]
    packed = rollout_lib.pack(rollout, rollout.longest)
    record = {}
    on_policy.model_outputs(model, packed.input_ids, [len(s) for s in sequences], kernels=kernels, record=record)
    result = layer_diff.diff(dump, record, sequences)
    report.write_json(os.path.join(folder, f"layer_diff_{_ENGINE_LAYOUT.value}.json"), result)
    first = result["first_difference"]
    shown = result["tensors"]
    if first is not None:
        index = next(i for i, t in enumerate(shown) if t["name"] == first["name"])
        shown = shown[:index + 1 + _AFTER.value]
    for t in shown:
        print(_line(t))
    print(f"layer_diff_main: {result['summary']}", flush=True)
    return 0 if first is None and result["passes"] else 1


if __name__ == "__main__":
    runtime_cli.run(main, program="layer_diff_main")
