"""The Qwen3 parallel check with real SGLang on two GPUs: engine layouts tp1, tp2 and dp2 (each a launched SGLang
0.5.17 server), trainer layouts tp1, tp2, cp2 and dp2 over NCCL, bf16, `qwen3-0.6b-random` (or $QWEN3_0_6B_PATH).

SGLang runs in the interpreter named by $PPO_OPS_SGLANG_PYTHON (SGLang pins its own torch, so it usually lives in an
environment of its own). With that variable set, this test FAILS, never skips, when SGLang is unusable there or fewer
than two GPUs are visible: it is set only by a GPU/SGLang configuration that promises both. With it unset (a plain CPU
run) the test skips and says why.

Server flags: those of an SGLang install without FA3 / FlashInfer sampling kernels (triton attention, pytorch
sampling, NCCL all-reduce, CPU feature transport), with CUDA graphs and warm-up off for a faster start. Expected
wall time on two H200s: the layouts test 247 s measured (three server starts); the negative controls through the
calibration program (two server starts, each serving every control) a few minutes more. The true on-policy test (one
server with --rl-on-policy-target fsdp and a tensor dump, the check under SGLang's interpreter) needs both GPUs for
its trainer tp2; at trainer tp1 the same check gives exactly 0 on one H200 (docs/calibration.md, true on-policy).
"""

import json
import os
import pathlib
import subprocess

import pytest
import torch

from sglang_checks import calibrate, check, cli, controls
from sglang_checks.engines import sglang_engine
from sglang_checks.errors import CheckError
from tests.check_support import run_calibrate

SGLANG_PYTHON = os.environ.get("PPO_OPS_SGLANG_PYTHON")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ENGINE_LAYOUTS = ["tp1", "tp2", "dp2"]
TRAINER_LAYOUTS = ["tp1", "tp2", "cp2", "dp2"]
# Each server holds the 0.6B weights (1.2 GB) and its KV cache; half a GPU leaves room for the trainer ranks.
MEM_FRACTION = 0.5
# The first start compiles SGLang's RoPE / QK-norm kernels with nvcc (~8 s each) on top of loading.
START_TIMEOUT_S = 600
REPO_ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent  # not resolved: Bazel's runfiles copy stays


def _require_sglang_and_two_gpus() -> None:
    if SGLANG_PYTHON is None:
        pytest.skip("PPO_OPS_SGLANG_PYTHON is not set (the GPU/SGLang configuration sets it to SGLang's interpreter)")
    if GPUS < 2:
        pytest.fail(f"PPO_OPS_SGLANG_PYTHON is set, but torch sees {GPUS} GPU(s); engine layout tp2 and the "
                    f"trainer layouts need 2", pytrace=False)
    try:
        version = sglang_engine.check_installed(SGLANG_PYTHON)
    except CheckError as exc:
        pytest.fail(f"PPO_OPS_SGLANG_PYTHON={SGLANG_PYTHON}: SGLang is not usable there: {exc}", pytrace=False)
    print(f"sglang {version} in {SGLANG_PYTHON}")


def test_qwen3_0_6b_sglang_engine_and_trainer_layouts(tmp_path, monkeypatch):
    _require_sglang_and_two_gpus()
    # Trainer ranks run compiled Triton kernels on the GPUs, whatever a CPU run of tests/conftest.py set.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    settings = cli.settings(
        report_dir=str(tmp_path / "report"), cache_dir=os.environ.get("PPO_OPS_MODEL_CACHE") or str(tmp_path / "m"),
        model=os.environ.get("QWEN3_0_6B_PATH", "qwen3-0.6b-random"), device="cuda", dtype="bfloat16",
        engine="sglang", engine_layouts=",".join(ENGINE_LAYOUTS), trainer_layouts=",".join(TRAINER_LAYOUTS),
        num_prompts=4, samples_per_prompt=2, max_new_tokens=32,
        sglang=sglang_engine.ServerOptions(
            python=SGLANG_PYTHON, mem_fraction_static=MEM_FRACTION, start_timeout_s=START_TIMEOUT_S,
            attention_backend="triton", sampling_backend="pytorch", disable_custom_all_reduce=True,
            mm_feature_transport="cpu", disable_cuda_graph=True, skip_server_warmup=True))
    code = check.run(settings)
    with open(os.path.join(settings.report_dir, "report.json")) as f:
        report = json.load(f)
    print(json.dumps({"engines": report["engines"], "calibration": report["calibration"],
                      "values": {c["subject"] + " / " + c["metric"]: c["value"] for c in report["comparisons"]}},
                     indent=1))
    assert report["rollout"]["engine"] == "sglang" and report["rollout"]["logprob_kind"] == "temperature"
    assert [e["layout"] for e in report["engines"]] == ENGINE_LAYOUTS
    assert all(e["version"].startswith("0.5.17") for e in report["engines"]), report["engines"]
    assert list(report["trainer_layouts"]) == TRAINER_LAYOUTS and report["trainer"]["backend"] == "nccl"
    assert [c["subject"] for c in report["comparisons"] if c["section"] == "engine layouts"] == [
        "engine tp2 vs tp1 (teacher-forced, raw)", "engine dp2 vs tp1 (teacher-forced, raw)"]
    assert code == 0, [c for c in report["comparisons"] if not c["passed"]]


def test_qwen3_0_6b_true_on_policy_trainer_is_bitwise_and_its_layer_diff_finds_no_difference(tmp_path):
    """--trainer_numerics=sglang_on_policy against SGLang under --rl-on-policy-target fsdp (triton attention): the
    teacher-forced trainer log-probs equal the engine's exactly (--expect_bitwise), at trainer tp1 and tp2, and the
    layer diff of the engine's tensor dump against the trainer's forward names no tensor. The check runs as its users
    run it in this mode: under SGLang's interpreter (the trainer imports SGLang's kernels)."""
    _require_sglang_and_two_gpus()
    report_dir = tmp_path / "report"
    cache = os.environ.get("PPO_OPS_MODEL_CACHE") or str(tmp_path / "m")
    flags = [f"--report_dir={report_dir}", f"--cache_dir={cache}", "--device=cuda", "--dtype=bfloat16",
             f"--model={os.environ.get('QWEN3_0_6B_PATH', 'qwen3-0.6b-random')}", "--engine=sglang",
             "--engine_layouts=tp1", "--trainer_layouts=tp1,tp2", "--num_prompts=4", "--samples_per_prompt=2",
             "--max_new_tokens=32", "--top_p=1.0", "--expect_bitwise", "--trainer_numerics=sglang_on_policy",
             "--sglang_dump_tensors", f"--sglang_python={SGLANG_PYTHON}", f"--sglang_mem_fraction={MEM_FRACTION}",
             f"--sglang_start_timeout_s={START_TIMEOUT_S}", "--sglang_rl_on_policy_target=fsdp",
             "--sglang_attention_backend=triton", "--sglang_sampling_backend=pytorch",
             "--sglang_disable_custom_all_reduce", "--sglang_mm_feature_transport=cpu", "--sglang_disable_cuda_graph",
             "--sglang_skip_server_warmup"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([SGLANG_PYTHON, "-m", "sglang_checks.qwen3_parallel_check", *flags], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    with open(report_dir / "report.json") as f:
        report = json.load(f)
    diff = report["layer_diff"]["tp1"]
    print(json.dumps({"layer_diff": diff["summary"], "first": diff.get("first_difference"),
                      "values": {c["subject"] + " / " + c["metric"]: c["value"] for c in report["comparisons"]}},
                     indent=1))
    assert report["trainer"]["numerics"] == "sglang_on_policy"
    assert diff["passes"] and diff["first_difference"] is None, diff["summary"]
    assert done.returncode == 0, (done.stderr[-3000:], [c for c in report["comparisons"] if not c["passed"]])


def test_bf16_negative_controls_fail_with_their_metric_with_sglang(tmp_path, monkeypatch):
    """SGLang engine layouts tp1 and tp2 (each server started once, serving every control): under the installed bf16
    tolerances every healthy run passes and every negative control fails with the metric that should catch it."""
    _require_sglang_and_two_gpus()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = run_calibrate(
        tmp_path / "cal", f"--cache_dir={os.environ.get('PPO_OPS_MODEL_CACHE') or tmp_path / 'm'}",
        f"--model={os.environ.get('QWEN3_0_6B_PATH', 'qwen3-0.6b-random')}", "--dtype=bfloat16", "--device=cuda",
        "--engine=sglang", "--engine_layouts=tp1,tp2", "--trainer_layouts=tp1,tp2", "--seeds=0",
        "--prompt_sets=builtin", "--num_prompts=4", "--max_new_tokens=32", f"--sglang_python={SGLANG_PYTHON}",
        f"--sglang_mem_fraction={MEM_FRACTION}", "--sglang_attention_backend=triton",
        "--sglang_sampling_backend=pytorch", "--sglang_disable_custom_all_reduce", "--sglang_mm_feature_transport=cpu",
        "--sglang_disable_cuda_graph", "--sglang_skip_server_warmup")
    assert {r["control"] for r in rows if r["kind"] == "control"} == set(controls.CONTROLS)
    assert calibrate.violations(rows, "bfloat16") == []
