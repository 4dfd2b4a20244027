"""Smoke test of the bench's whole-step provider (tools/bench/whole_step.py) on CPU: a tiny model of Qwen3's
architecture, forward + backward through it with ppo_ops, validate on and off.

CPU timings are meaningless and never asserted. What is checked: both rows are measured (status ok, unchecked: the
logits come from the model), the step really trains (every parameter gets a finite gradient, the same for validate on
and off, since validate changes no value), and the Qwen3-0.6B config matches its public facts.
"""

import pytest
import torch

from tools.bench import report, runner, whole_step
from tools.bench.cases import QWEN3_VOCAB, suite_cases
from tools.bench.inputs import make_inputs

pytest.importorskip("transformers", reason="the whole-step provider builds its model with transformers")

FAST = dict(warmup=1, min_reps=2, max_reps=2, target_ms=1.0, copy_bytes=1 << 20, check_rows=4)


def test_whole_step_rows_are_measured(tmp_path):
    cases = suite_cases(["whole_step_smoke"])
    paths = runner.OutputPaths(csv=str(tmp_path / "r.csv"), md=str(tmp_path / "r.md"), png=str(tmp_path / "r.png"))
    rc = runner.run(runner.BenchConfig(cases=cases, tp=1, device="cpu", paths=paths, **FAST))
    rows = report.read_csv(paths.csv)
    assert rc == 0
    assert [(r["provider"], r["validate"], r["status"], r["check"]) for r in rows] == [
        ("qwen3_step", "on", "ok", ""), ("qwen3_step", "off", "ok", "")]


def test_whole_step_trains_every_parameter_the_same_with_and_without_validate():
    grads = {}
    for case in suite_cases(["whole_step_smoke"]):
        inp = make_inputs(case, torch.device("cpu"), seed=0)
        closure = whole_step.build(case, inp)
        closure.prepare()
        loss = closure.step(None)
        params = dict(closure_model_parameters(closure))
        assert torch.isfinite(loss)
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params.values())
        grads[case.validate] = {name: p.grad.clone() for name, p in params.items()}
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.equal(grads[True][k], grads[False][k]) for k in grads[True])


def closure_model_parameters(closure):
    """The model a closure trains (its step closes over it)."""
    cells = {c.cell_contents for c in closure.prepare.__closure__ if hasattr(c.cell_contents, "named_parameters")}
    (model,) = cells
    return model.named_parameters()


def test_qwen3_config_matches_its_public_facts():
    config = whole_step.model_config(QWEN3_VOCAB, 8192)
    facts = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960)
    assert {k: getattr(config, k) for k in facts} == facts
