"""The Qwen3 parallel check on GPU with the embedded hf engine: `qwen3-0.6b-random` (the real Qwen3-0.6B
architecture, seeded random weights) sampled and scored on cuda:0, trainer layouts on NCCL ranks, one GPU each.

One GPU: tp1 only (one NCCL rank). Two GPUs: tp1, tp2, cp2, dp2. fp32 model, so the fp32 tolerances apply
(tolerances.py). The 0.6B model is built once into a shared cache (seeded init on CPU, ~1.2 GB of
bf16 weights). Runtime on an H200 host: about 1-2 minutes per test, most of it the model build and HF generation.
"""

import json
import os

import pytest
import torch

from sglang_checks import check, cli

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """$PPO_OPS_MODEL_CACHE when set (tools/run_qwen3_check_gpu.sh shares one build with its check run), else a
    temporary folder."""
    return os.environ.get("PPO_OPS_MODEL_CACHE") or str(tmp_path_factory.mktemp("model_cache"))


def _run(tmp_path, cache_dir, trainer_layouts):
    settings = cli.settings(report_dir=str(tmp_path / "report"), cache_dir=cache_dir, model="qwen3-0.6b-random",
                              device="cuda", trainer_layouts=trainer_layouts, num_prompts=4, samples_per_prompt=2,
                              max_new_tokens=32)
    code = check.run(settings)
    with open(os.path.join(settings.report_dir, "report.json")) as f:
        report = json.load(f)
    failed = [c for c in report["comparisons"] if not c["passed"]]
    return code, report, failed


@pytest.mark.skipif(GPUS < 1, reason="needs 1 NVIDIA GPU (torch sees none)")
def test_qwen3_0_6b_random_on_one_gpu(tmp_path, cache_dir):
    code, report, failed = _run(tmp_path, cache_dir, "tp1")
    assert code == 0, failed
    assert report["trainer"]["backend"] == "nccl" and report["model"]["vocab_size"] == 151936
    mismatch = [c for c in report["comparisons"] if c["section"] == "train-rollout mismatch"]
    assert mismatch and all(c["passed"] for c in mismatch)
    print(json.dumps({c["subject"] + " / " + c["metric"]: c["value"] for c in report["comparisons"]}, indent=1))


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 NVIDIA GPUs (torch sees {GPUS})")
def test_qwen3_0_6b_random_trainer_layouts_on_two_gpus(tmp_path, cache_dir):
    code, report, failed = _run(tmp_path, cache_dir, "tp1,tp2,cp2,dp2")
    assert code == 0, failed
    assert list(report["trainer_layouts"]) == ["tp1", "tp2", "cp2", "dp2"]
    trainer_rows = [c for c in report["comparisons"] if c["section"] == "trainer layouts"]
    assert len(trainer_rows) == 3 * 8 and all(c["passed"] for c in trainer_rows)
    print(json.dumps({c["subject"] + " / " + c["metric"]: c["value"] for c in report["comparisons"]}, indent=1))
