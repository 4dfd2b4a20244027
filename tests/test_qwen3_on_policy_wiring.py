"""The check's wiring of --trainer_numerics and --sglang_dump_tensors, on CPU without SGLang: bad combinations refused
up front naming the flag and what it needs, the server's launch (dump folder, environment), the one place that passes
ppo_ops' reduction_order, the on-policy LM head's matmul, and report.md's layer-diff section. A few seconds."""

import dataclasses
import importlib.util
import os
import sys
import types

import pytest
import torch

from sglang_checks import check, cli, report, trainer
from sglang_checks.engines import sglang_engine
from sglang_checks.errors import CheckError
from sglang_checks.layouts import Layout

pytestmark = pytest.mark.device("cpu")

# An on-policy run's trainer layouts (its -fused ones score with the head in SGLang's order).
ON_POLICY = dict(trainer_numerics=trainer.SGLANG_ON_POLICY, engine="sglang", dtype="bfloat16",
                 trainer_layouts="tp1,tp2")


def _settings(tmp_path, *, sglang=None, **overrides):
    options = dict(python=sys.executable, rl_on_policy_target="fsdp", attention_backend="triton")
    options.update(sglang or {})
    base = cli.settings(report_dir=str(tmp_path / "report"), cache_dir=str(tmp_path / "cache"))
    return cli.settings(report_dir=str(tmp_path / "report"), cache_dir=str(tmp_path / "cache"),
                        sglang=dataclasses.replace(base.sglang, **options), **overrides)


@pytest.mark.parametrize("overrides, sglang, message", [
    (dict(ON_POLICY, engine="hf"), {}, r"--trainer_numerics=sglang_on_policy: .*expected --engine=sglang, got "
                                       r"--engine=hf"),
    (ON_POLICY, dict(rl_on_policy_target=None), "expected --sglang_rl_on_policy_target=fsdp, got "
                                                "--sglang_rl_on_policy_target=None"),
    (ON_POLICY, dict(attention_backend="fa3"), "expected --sglang_attention_backend=triton, got "
                                               "--sglang_attention_backend=fa3"),
    (dict(ON_POLICY, dtype="float32"), {}, "expected --dtype=bfloat16, got --dtype=float32"),
    (dict(ON_POLICY, device="cpu"), {}, "runs SGLang's CUDA kernels; expected --device=cuda"),
    (dict(sglang_dump_tensors=True), {}, "--sglang_dump_tensors: .*expected --engine=sglang, got --engine=hf"),
])
def test_bad_on_policy_combinations_are_refused_before_anything_runs(overrides, sglang, message, tmp_path):
    with pytest.raises(CheckError, match=message):
        check.run(_settings(tmp_path, sglang=sglang, **overrides))
    assert not any(name.startswith("tiny") for name in os.listdir(tmp_path / "cache"))  # no model was built


def test_the_default_numerics_is_hf():
    assert cli.settings(report_dir="r", cache_dir="c").trainer_numerics == trainer.HF


def test_launch_command_dumps_tensors_into_the_given_folder():
    options = sglang_engine.ServerOptions(tensor_dump_dir="/r/engine_dump/tp1", extra_args=("--x",))
    command = sglang_engine.launch_command("/m", Layout("tp1"), 1, options)
    assert command[-3:] == ["--debug-tensor-dump-output-folder", "/r/engine_dump/tp1", "--x"]
    assert "--debug-tensor-dump-output-folder" not in sglang_engine.launch_command(
        "/m", Layout("tp1"), 1, sglang_engine.ServerOptions())


class _Info:
    path = "/models/q"


def test_open_engine_passes_the_dump_folder_and_the_trainers_matmul_choice(tmp_path):
    s = _settings(tmp_path, sglang_dump_tensors=True, **ON_POLICY)
    os.makedirs(s.report_dir)
    engine = check.open_engine(s, Layout("tp1"), None, torch.device("cpu"), _Info())  # not started
    command = engine.server.command
    folder = command[command.index("--debug-tensor-dump-output-folder") + 1]
    assert folder == os.path.join(s.report_dir, check.ENGINE_DUMP_NAME, "tp1")
    assert engine.server.env["SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM"] == "0"
    plain = check.open_engine(_settings(tmp_path, engine="sglang"), Layout("tp1"), None, torch.device("cpu"),
                              _Info())
    assert "--debug-tensor-dump-output-folder" not in plain.server.command


def test_layer_diffs_skip_what_they_cannot_compare_and_survive_a_bad_dump(tmp_path):
    s = _settings(tmp_path, sglang_dump_tensors=True, **ON_POLICY)
    bad = tmp_path / "report" / check.ENGINE_DUMP_NAME / "tp1" / "TP0_PP0_Rank0_pid1"
    bad.mkdir(parents=True)
    (bad / "Pass00000.pt").write_bytes(b"not a torch file")
    plan = types.SimpleNamespace(engine_layouts=[Layout("tp1"), Layout("tp2", tp=2)])
    rollout = types.SimpleNamespace(samples=[types.SimpleNamespace(prompt_ids=[1, 2], completion_ids=[3])])
    scores = types.SimpleNamespace(record={"model.embed_tokens": torch.zeros(3, 4)})
    out = check._layer_diffs(s, plan, rollout, scores)
    assert out["tp1"]["summary"].startswith("failed: ")  # the run goes on to its report
    assert out["tp2"]["summary"].startswith("skipped: a tensor-parallel dump")
    assert scores.record is None  # freed before the trainer ranks start
    scores.record = None
    assert check._layer_diffs(s, plan, rollout, scores)["tp1"]["summary"].startswith(
        "skipped: the trainer records SGLang's tensor names only with --trainer_numerics=sglang_on_policy")


def test_site_dir_is_where_the_interpreter_finds_sglang(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    assert sglang_engine.site_dir(str(wrapper)) == str(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_site_dir_without_sglang_says_so():
    with pytest.raises(CheckError, match="cannot find the sglang package's folder"):
        sglang_engine.site_dir(sys.executable)


def test_reduction_order_is_passed_only_under_on_policy_numerics(monkeypatch):
    import ppo_ops

    calls = []
    monkeypatch.setattr(ppo_ops, "log_probs_and_entropy", lambda logits, targets, **kw: calls.append(kw))
    logits, targets = torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64)
    trainer.log_probs_and_entropy(logits, targets, temperature=0.5)
    trainer.log_probs_and_entropy(logits, targets, numerics=trainer.SGLANG_ON_POLICY, temperature=0.5)
    assert calls == [{"temperature": 0.5}, {"temperature": 0.5, "reduction_order": "sglang"}]


def test_on_policy_lm_head_is_a_bf16_matmul_whose_shards_are_the_full_columns():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(3, 5, 16, generator=gen), torch.randn(64, 16, generator=gen).bfloat16()
    full = trainer.lm_head_logits(hidden, weight, trainer.SGLANG_ON_POLICY)
    assert full.dtype == torch.bfloat16
    assert torch.equal(full, torch.matmul(hidden.bfloat16(), weight.T.bfloat16()))
    shard = trainer.lm_head_logits(hidden, weight[16:32], trainer.SGLANG_ON_POLICY)
    assert torch.equal(shard, full[..., 16:32])  # CPU GEMM here; on CUDA the batch-invariant matmul guarantees it
    assert torch.equal(trainer.lm_head_logits(hidden, weight.float()), torch.matmul(hidden, weight.float().t()))


def _report(layer_diff):
    return {"settings": {"engine": "sglang", "engine_layouts": "tp1"}, "model": {"name": "m", "fingerprint": "f" * 16},
            "rollout": {"engine": "sglang", "engine_layout": "tp1", "temperature": 0.8, "top_p": 1.0,
                        "logprob_kind": "temperature", "sequences": 2, "completion_tokens": 4, "seq_len": 8},
            "trainer": {"temperature": 0.8, "backend": "nccl", "numerics": trainer.SGLANG_ON_POLICY},
            "trainer_layouts": {"tp1": {}}, "tolerances": {}, "layer_diff": layer_diff}


def test_report_md_has_the_layer_diff_section(tmp_path):
    row = {"name": "model.layers.3.self_attn.attn", "engine_shape": [10, 2048], "trainer_shape": [12, 2048],
           "engine_dtype": "torch.bfloat16", "trainer_dtype": "torch.bfloat16", "dtype_mismatch": False}
    diffs = {"tp1": {"summary": "first difference at model.layers.3.self_attn.attn: 3 of 9 elements differ",
                     "first_difference": {"name": row["name"], "reason": "..."}, "tensors": [row]},
             "tp2": {"summary": "skipped: a tensor-parallel dump holds each rank's shards"}}
    path = str(tmp_path / "report.md")
    report.write_markdown(path, _report(diffs), [])
    text = open(path).read()
    assert "## Layer diff" in text and "numerics `sglang_on_policy`" in text
    assert "- engine `tp1`: first difference at model.layers.3.self_attn.attn" in text
    assert "engine [10, 2048] torch.bfloat16, trainer [12, 2048] torch.bfloat16" in text
    assert "- engine `tp2`: skipped" in text
    report.write_markdown(path, _report(None), [])
    assert "Layer diff" not in open(path).read()
