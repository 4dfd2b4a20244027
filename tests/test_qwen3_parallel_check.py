"""The Qwen3 parallel check with the embedded hf engine. On CPU (the CPU target): the default run end to end, replay,
the temperature-mismatch failure, the negative controls, the trainer's loss and gradient math against a float64
reference, and every bad input. On CUDA (the `_gpu` target, two GPUs; the last section): `qwen3-0.6b-random` (the
real Qwen3-0.6B architecture, seeded random weights) sampled and scored on cuda:0, trainer layouts tp1, tp2, cp2, dp2
on NCCL ranks, one GPU each (fp32 model, so the fp32 tolerances apply; ~1-2 minutes per test on an H200 host).

The default run is the binary itself as a subprocess (`python -m sglang_checks.qwen3_parallel_check`, only the cache
and report folders set); replays reuse its rollout.json in-process through check.run. Models are cached in a
temporary folder per module. Runtime on a 2-core machine: about 60-90 s, most of it the default run (one model build,
sampling, 4 gloo ranks) and the rank groups of the replays.
"""

import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from sglang_checks import calibrate, check, cli, controls, layouts, logprob_kinds, models, report, trainer
from sglang_checks.engines import SamplingSettings, hf_engine
from sglang_checks.errors import CheckError
from tests import processes
from tests.check_support import run_calibrate

pytestmark = pytest.mark.device("cpu")  # the CUDA runs at the end are marked cuda (tests/conftest.py places them)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRAINER_LAYOUTS = ["tp1", "tp2", "tp4", "cp2", "dp2", "tp2-fused"]
# Per trainer layout vs tp1: max |d log-prob|, max |d entropy|, then the loss and 3 gradient norms (logits, hidden
# states, LM head) for 2 loss variants. A fused-head layout (vs tp1-unfused) has no logits, so no logits gradient.
COMPARISONS_PER_TRAINER_LAYOUT = 2 + 2 * 4
COMPARISONS_PER_FUSED_LAYOUT = 2 + 2 * 3

# fp32 trainer vs the float64 reference: log-probs of magnitude <= ~20 after a few fp32 ops (eps 1.2e-7 each).
FP32_LOGPROB_ATOL = 2e-5
# fp32 sums of a few hundred terms vs float64: relative error ~1e-6.
FP32_NORM_RTOL = 2e-5


def _run_binary(args, timeout=900, env=None):
    env = dict(env or os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "sglang_checks.qwen3_parallel_check", *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def _report(report_dir):
    with open(os.path.join(report_dir, "report.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model_cache"))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, cache_dir):
    report_dir = str(tmp_path_factory.mktemp("default_report"))
    proc = _run_binary([f"--cache_dir={cache_dir}", f"--report_dir={report_dir}"])
    return proc, report_dir


def _settings(tmp_path, cache_dir, **overrides):
    return cli.settings(report_dir=str(tmp_path / "report"), cache_dir=cache_dir, **overrides)


# ------------------------------------------------------------------------------------------------ end to end


def test_default_run_passes_and_writes_the_report(default_run):
    proc, report_dir = default_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and os.path.join(report_dir, "report.md") in proc.stdout
    report = _report(report_dir)
    assert report["passed"] is True
    # The fused layout's baseline is listed before it (the losses of every layout are in the report).
    assert list(report["trainer_layouts"]) == DEFAULT_TRAINER_LAYOUTS[:-1] + ["tp1-unfused", "tp2-fused"]
    assert report["settings"]["engine"] == "hf" and report["settings"]["model"] == "tiny"
    assert report["trainer"]["backend"] == "gloo"
    comparisons = report["comparisons"]
    for name in DEFAULT_TRAINER_LAYOUTS[1:-1]:
        mine = [c for c in comparisons if c["section"] == "trainer layouts" and c["subject"] == f"{name} vs tp1"]
        assert len(mine) == COMPARISONS_PER_TRAINER_LAYOUT
    # The main job scores with the fused LM head (linear_token_loss with ppo_ops' policy_loss) and it matches its
    # unfused specification: log-probs, entropies, loss, dX and dW norms within the trainer tolerances.
    fused = [c for c in comparisons if c["section"] == "trainer layouts" and c["subject"] == "tp2-fused vs tp1-unfused"]
    assert len(fused) == COMPARISONS_PER_FUSED_LAYOUT and all(c["passed"] for c in fused)
    assert {c["tolerance_name"] for c in fused} == {"trainer_logprob_atol", "trainer_rtol"}
    metrics = {c["metric"] for c in fused}
    assert {"token_mean hidden_grad_norm rel diff", "seq_mean lm_head_grad_norm rel diff"} <= metrics
    assert not any("logits_grad_norm" in m for m in metrics)
    losses = report["trainer_layouts"]["tp2-fused"]["token_mean"]
    assert losses["logits_grad_norm"] is None and losses["hidden_grad_norm"] > 0 and losses["lm_head_grad_norm"] > 0
    mismatch = [c for c in comparisons if c["section"] == "train-rollout mismatch"]
    assert {c["subject"] for c in mismatch} == {"hf tp1 sampled (sampler)", "hf tp1 teacher-forced (raw)"}
    assert all(c["passed"] and c["value"] <= c["tolerance"] for c in comparisons)
    # The engine really sampled: 8 built-in prompts x 2 samples, 24 tokens each (tiny has no end-of-sequence token).
    assert report["rollout"]["sequences"] == 16 and report["rollout"]["completion_tokens"] == 16 * 24
    with open(os.path.join(report_dir, "rollout.json")) as f:
        saved = json.load(f)
    assert saved["model_fingerprint"] == report["model"]["fingerprint"]
    assert len({tuple(s["completion_ids"]) for s in saved["samples"]}) == 16  # distinct samples, not a stub
    with open(os.path.join(report_dir, "logprob_diff_hist.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    md = open(os.path.join(report_dir, "report.md")).read()
    assert "**PASS**" in md and "tp4 vs tp1" in md


def test_replay_scores_the_saved_tokens(default_run, cache_dir, tmp_path):
    _, first_dir = default_run
    rollout_path = os.path.join(first_dir, "rollout.json")
    first = _report(first_dir)
    # The same padded length as the first run (its cp2 layout rounded it up): same tensors, same sums.
    s = _settings(tmp_path, cache_dir, rollout_data=rollout_path, trainer_layouts="tp1",
                  seq_len=first["rollout"]["seq_len"], engine_layouts="tp1,dp2")
    assert check.run(s) == 0
    replay = _report(s.report_dir)
    # Engine layout dp2 scores the rollout as two batches; it is compared with tp1 token by token.
    engine_rows = [c for c in replay["comparisons"] if c["section"] == "engine layouts"]
    assert [c["subject"] for c in engine_rows] == ["engine dp2 vs tp1 (teacher-forced, raw)"]
    assert engine_rows[0]["details"]["tokens"] == first["rollout"]["completion_tokens"] and engine_rows[0]["passed"]
    assert replay["rollout"]["replayed"] is True and replay["rollout"]["path"] == rollout_path
    assert replay["rollout"]["completion_tokens"] == first["rollout"]["completion_tokens"]
    # Same tokens, same model, same code: the trainer's numbers are bitwise those of the first run.
    assert replay["trainer_layouts"]["tp1"] == first["trainer_layouts"]["tp1"]
    assert not os.path.exists(os.path.join(s.report_dir, "rollout.json"))  # nothing was sampled


def test_trainer_temperature_mismatch_fails(default_run, cache_dir, tmp_path):
    _, first_dir = default_run
    s = _settings(tmp_path, cache_dir, rollout_data=os.path.join(first_dir, "rollout.json"),
                  trainer_layouts="tp1,tp2", trainer_temperature=1.0)
    assert check.run(s) == 1
    report = _report(s.report_dir)
    assert report["passed"] is False and report["trainer"]["temperature"] == 1.0
    failed = {(c["subject"], c["metric"]) for c in report["comparisons"] if not c["passed"]}
    assert failed == {("hf tp1 sampled (sampler)", "mean |trainer - engine| log-prob"),
                      ("hf tp1 sampled (sampler)", "k3 KL(engine || trainer)")}
    mean = next(c for c in report["comparisons"] if c["metric"] == "mean |trainer - engine| log-prob"
                and c["subject"].endswith("(sampler)"))
    assert mean["value"] > 100 * mean["tolerance"]  # a real mismatch, not rounding
    assert "**FAIL" in open(os.path.join(s.report_dir, "report.md")).read()


# ------------------------------------------------------------------------------------------- negative controls


@pytest.mark.parametrize("control", list(controls.CONTROLS))
def test_negative_control_fails_with_the_metric_that_should_catch_it(control, default_run, cache_dir, tmp_path):
    """Each injected fault FAILs the check, and the comparisons held to the tolerances named for it are among the
    failures (controls.CAUGHT_BY); run on the default run's saved rollout, with only the layouts each fault needs."""
    _, first_dir = default_run
    s = _settings(tmp_path, cache_dir, rollout_data=os.path.join(first_dir, "rollout.json"), negative_control=control,
                  trainer_layouts="tp1,tp2,tp2-fused" if control == controls.VOCAB_OFFSET else "tp1",
                  engine_layouts="tp1,dp2" if control == controls.ENGINE_LAYOUT_WEIGHTS else "tp1")
    assert check.run(s) == 1
    report = _report(s.report_dir)
    assert report["negative_control"] == control and report["passed"] is False
    failed = {c["tolerance_name"] for c in report["comparisons"] if not c["passed"]}
    assert set(controls.CONTROLS[control][1]) <= failed, failed
    for c in report["comparisons"]:  # and far out, not by rounding
        if not c["passed"] and c["tolerance_name"] in controls.CONTROLS[control][1]:
            assert c["value"] > 10 * c["tolerance"], c
    if control == controls.VOCAB_OFFSET:  # the fused head's shard with the wrong offset is caught too
        assert any(c["subject"] == "tp2-fused vs tp1-unfused" and c["metric"] == "max |d log-prob|" and not c["passed"]
                   for c in report["comparisons"])


@pytest.mark.parametrize("control, overrides, message", [
    (controls.ENGINE_LAYOUT_WEIGHTS, {}, "needs at least two --engine_layouts"),
    (controls.VOCAB_OFFSET, dict(trainer_layouts="tp1,cp2"), "needs a tensor-parallel trainer layout"),
])
def test_negative_control_without_what_it_breaks_is_refused(control, overrides, message, tmp_path, cache_dir):
    with pytest.raises(CheckError, match=message):
        check.run(_settings(tmp_path, cache_dir, negative_control=control, **overrides))


def test_expect_bitwise_fails_naming_the_metric(default_run, cache_dir, tmp_path):
    """The hf engine scores with a batched forward and the trainer with its own: equal to ~1e-6, not bitwise, so
    --expect_bitwise FAILs on the max |d| rows (and an identical engine layout, dp2's split batch, may pass)."""
    _, first_dir = default_run
    s = _settings(tmp_path, cache_dir, rollout_data=os.path.join(first_dir, "rollout.json"), trainer_layouts="tp1",
                  expect_bitwise=True)
    code = check.run(s)
    report = _report(s.report_dir)
    bitwise = [c for c in report["comparisons"] if c["tolerance_name"] == "expect_bitwise"]
    assert bitwise and all(c["tolerance"] == 0 for c in bitwise)
    assert [c["metric"] for c in bitwise] == ["max |trainer - engine| log-prob"]
    assert code == (0 if bitwise[0]["value"] == 0 else 1)
    assert report["expect_bitwise"] is True


# ------------------------------------------------------------------------------- trainer math vs float64 reference


def _synthetic_inputs():
    gen = torch.Generator().manual_seed(7)
    batch, seq, hidden, vocab = 4, 8, 16, 64
    h = torch.randn(batch, seq, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * 0.5
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    row_mask = torch.zeros(batch, seq, dtype=torch.bool)
    row_mask[0, 2:8] = True  # completions of different lengths: token-mean and seq-mean differ
    row_mask[1, 3:5] = True
    row_mask[2, 1:8] = True  # sequence 3 has no completion: left out of the seq-mean denominator
    targets[~row_mask] = -100
    temperature = 0.7
    keep = logprob_kinds.top_p_keep_mask((h @ w.t()) / temperature, 0.9)
    return trainer.TrainerInputs(hidden=h, lm_head=w, targets=targets, row_mask=row_mask, keep_mask=keep,
                                 advantages=torch.tensor([1.0, -0.5, 0.25, 2.0]), temperature=temperature,
                                 entropy_coef=0.05)


def _reference(inputs, variant, keep=True):
    """float64 autograd: log-probs over keep ∪ {target} (keep=False: over the whole vocabulary, what the fused head
    and its tp1-unfused baseline score), full entropy, the surrogate loss and gradient norms. The surrogate's ratio
    is exp(lp - old) with old = lp itself (the trainer's old log-probs are its own forward before the step)."""
    w = inputs.lm_head.double().requires_grad_(True)
    h = inputs.hidden.double().requires_grad_(True)
    logits = h @ w.t()
    logits.retain_grad()
    z = logits / inputs.temperature
    mask = inputs.row_mask
    t = inputs.targets.clamp(min=0)
    kept = inputs.keep_mask.clone() if keep else torch.ones_like(inputs.keep_mask)
    kept.scatter_(-1, t[..., None], True)
    lp = z.gather(-1, t[..., None])[..., 0] - torch.logsumexp(z.masked_fill(~kept, -math.inf), dim=-1)
    p = torch.softmax(z, dim=-1)
    entropy = torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
    per_token = (-(torch.exp(lp - lp.detach()) * inputs.advantages.double()[:, None])
                 - inputs.entropy_coef * entropy) * mask
    if variant == "token_mean":
        loss = per_token.sum() / mask.sum()
    else:
        counts = mask.sum(1)
        loss = (per_token.sum(1) / counts.clamp(min=1)).sum() / (counts > 0).sum()
    loss.backward()
    norms = {"logits_grad_norm": logits.grad.norm().item(), "hidden_grad_norm": h.grad.norm().item(),
             "lm_head_grad_norm": w.grad.norm().item()}
    return {"loss": loss.item(), **norms}, (lp * mask).detach(), (entropy * mask).detach()


def test_trainer_layouts_match_a_float64_reference():
    """Every layout's log-probs, entropies, loss (ppo_ops.policy_loss) and gradient norms against float64; the fused
    layouts (ppo_ops.linear_token_loss) and their tp1-unfused baseline against the reference without the keep mask."""
    inputs = _synthetic_inputs()
    names = ["tp1", "tp2", "cp2", "dp2", "tp2cp2", "tp2-fused", "tp2cp2-fused"]
    results = trainer.run_layouts(inputs, [layouts.parse_layout(n, flag="test", allowed_dims=("tp", "cp", "dp"),
                                                                fused=True) for n in names],
                                  backend="gloo", timeout_s=300)
    assert [r.layout.name for r in results] == names
    refs = {(v, keep): _reference(inputs, v, keep) for v in trainer.VARIANTS for keep in (True, False)}
    assert abs(refs["token_mean", True][0]["loss"] - refs["seq_mean", True][0]["loss"]) > 1e-3  # variants differ
    # Without the keep mask the log-probs, and so the gradients, are others: the fused layouts need their baseline.
    assert abs(refs["token_mean", True][0]["lm_head_grad_norm"] / refs["token_mean", False][0]["lm_head_grad_norm"]
               - 1) > 100 * FP32_NORM_RTOL
    baselines = {id(r.baseline) for r in results if r.layout.fused}
    assert len(baselines) == 1 and all((r.baseline is None) != r.layout.fused for r in results)
    checked = results + [results[-1].baseline]
    assert checked[-1].layout.name == "tp1-unfused"
    for result in checked:
        keep = result.layout.head == layouts.LOGITS
        _, ref_lp, ref_ent = refs["token_mean", keep]
        torch.testing.assert_close(torch.from_numpy(result.log_probs).double(), ref_lp, atol=FP32_LOGPROB_ATOL, rtol=0)
        torch.testing.assert_close(torch.from_numpy(result.entropy).double(), ref_ent, atol=FP32_LOGPROB_ATOL, rtol=0)
        for variant in trainer.VARIANTS:
            for key, value in refs[variant, keep][0].items():
                if key == "logits_grad_norm" and result.layout.fused:
                    assert result.losses[variant][key] is None  # the fused head forms no logits
                    continue
                assert result.losses[variant][key] == pytest.approx(value, rel=FP32_NORM_RTOL), (result.layout, key)


def test_a_failing_rank_is_reported_and_every_rank_reaped():
    inputs = _synthetic_inputs()
    inputs.targets[0, 3] = 10_000  # outside the vocabulary on a completion row: ppo_ops rejects it in every rank
    with pytest.raises(trainer.TrainerRankError, match=r"^trainer layout tp2: rank [01] failed: .*tokens") as info:
        trainer.run_layouts(inputs, [layouts.Layout("tp2", tp=2)], backend="gloo", timeout_s=300)
    assert info.value.layout == "tp2" and info.value.rank in (0, 1) and "Traceback" in info.value.detail
    assert "\n" not in str(info.value)  # one line; the traceback is in .detail (and the report)
    assert multiprocessing.active_children() == []


def test_an_interrupt_while_ranks_start_reaps_the_started_ones(monkeypatch):
    """Ctrl-C can land while the second rank is being spawned (seen on a loaded 2-core machine): the first rank is
    reaped, the unstarted one skipped, and the interrupt itself, not an error of the clean-up, reaches the caller
    (the command line then exits 130)."""
    spawn_process = type(torch.multiprocessing.get_context("spawn").Process())
    start, calls = spawn_process.start, []

    def start_interrupted_at_the_second(self):
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return start(self)

    monkeypatch.setattr(spawn_process, "start", start_interrupted_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        trainer.run_layouts(_synthetic_inputs(), [layouts.Layout("tp2", tp=2)], backend="gloo", timeout_s=300)
    assert len(calls) == 2 and calls[0].exitcode is not None, "the started rank was not reaped"
    assert multiprocessing.active_children() == []


def test_a_real_ctrl_c_as_a_rank_starts_lets_it_start_whole_then_reaps_every_rank(monkeypatch, capfd):
    """A SIGINT that arrives as the second rank's Process.start begins: the start completes (the rank has a pid),
    then the interrupt reaches the caller, every rank is reaped, and no half-spawned child writes a traceback."""
    spawn_process = type(torch.multiprocessing.get_context("spawn").Process())
    start, calls = spawn_process.start, []

    def start_with_ctrl_c_at_the_second(self):
        calls.append(self)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return start(self)

    monkeypatch.setattr(spawn_process, "start", start_with_ctrl_c_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        trainer.run_layouts(_synthetic_inputs(), [layouts.Layout("tp2", tp=2)], backend="gloo", timeout_s=300)
    assert len(calls) == 2 and all(p.pid is not None for p in calls), "a rank was interrupted while being spawned"
    assert all(p.exitcode is not None for p in calls), "a started rank was not reaped"
    assert multiprocessing.active_children() == []
    assert "Traceback" not in capfd.readouterr().err


def test_ctrl_c_while_a_rank_is_spawned_waits_until_it_is_whole():
    """A Ctrl-C (a real SIGINT) inside the block around Process.start arrives when the block ends, not in the
    middle: an interrupted start leaves a child that dies reading half its start-up data, with a traceback."""
    done, handler = [], signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with trainer._interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # an unheld SIGINT raises in here
            done.append("the block ran to its end")
    assert done == ["the block ran to its end"]
    assert signal.getsignal(signal.SIGINT) is handler, "the caller's SIGINT handler was not put back"


# ------------------------------------------------------------------------------------------------ hf engine


def test_hf_engine_refuses_processing_beyond_temperature_and_top_p():
    logits = torch.randn(2, 3, 50)
    settings = SamplingSettings(temperature=0.5, top_p=0.9, max_new_tokens=3, seed=0, eos_token_id=None)
    processed = (logits / 0.5).masked_fill(~logprob_kinds.top_p_keep_mask(logits / 0.5, 0.9), -math.inf)
    hf_engine._check_processing(logits, processed, settings)  # exactly temperature + top-p: accepted
    top_k = processed.clone()
    top_k[..., :5] = -math.inf  # a top-k a checkpoint's generation_config.json could add
    with pytest.raises(RuntimeError, match="beyond temperature"):
        hf_engine._check_processing(logits, top_k, settings)


# ------------------------------------------------------------------------------------------------ bad input


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def _model_dir(tmp_path, config=None, weights=None, raw_config=None):
    d = tmp_path / "model"
    d.mkdir()
    if raw_config is not None:
        (d / "config.json").write_text(raw_config)
    elif config is not None:
        (d / "config.json").write_text(json.dumps(config))
    if weights is not None:
        (d / "model.safetensors").write_bytes(weights)
    return str(d)


QWEN3_CONFIG = {"model_type": "qwen3", "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2}


@pytest.mark.parametrize("overrides, message", [
    (dict(trainer_layouts="tp1,pp2"), "unknown layout name 'pp2'"),
    (dict(trainer_layouts="tp2x"), "unknown layout name 'tp2x'"),
    (dict(trainer_layouts="tp2,tp2"), "are the same layout"),
    (dict(trainer_layouts="tp0"), "sizes must be at least 1"),
    (dict(trainer_layouts="tp16"), "needs 16 ranks, more than the 8 allowed"),
    (dict(trainer_layouts="tp2cp2", max_ranks=2), "needs 4 ranks, more than the 2 allowed"),
    (dict(trainer_layouts="tp3"), "vocabulary size 4096 is not divisible by 3"),
    (dict(trainer_layouts="cp2", seq_len=63), "sequence length 63 is not divisible by 2"),
    (dict(trainer_layouts="dp3"), "16 sequences, not divisible by 3"),
    (dict(engine_layouts="tp2"), "hf engine runs unsharded"),
    (dict(engine_layouts="tp1,cp2"), "does not support"),
    (dict(temperature=0.0), "--temperature: expected > 0"),
    (dict(trainer_timeout_s=0.0), "--trainer_timeout_s: expected > 0"),
    (dict(top_p=1.5), "--top_p"),
    (dict(seq_len=8), "--seq_len=8"),
    (dict(model="/nonexistent/qwen3"), "no such directory"),
])
def test_bad_flags_are_refused(overrides, message, tmp_path, cache_dir):
    with pytest.raises(CheckError, match=message):
        check.run(_settings(tmp_path, cache_dir, **overrides))


@pytest.mark.parametrize("kind, message", [
    ("no_config", "no config.json"),
    ("bad_json", "config.json is not valid JSON"),
    ("not_qwen3", "model_type 'llama'"),
    ("no_weights", r"no weights \(\*.safetensors"),
    ("corrupt_weights", "cannot read the weights"),
])
def test_malformed_model_directory_is_refused(kind, message, tmp_path, cache_dir):
    model = {
        "no_config": lambda: _model_dir(tmp_path, weights=b"x"),
        "bad_json": lambda: _model_dir(tmp_path, raw_config="{not json", weights=b"x"),
        "not_qwen3": lambda: _model_dir(tmp_path, config=dict(QWEN3_CONFIG, model_type="llama"), weights=b"x"),
        "no_weights": lambda: _model_dir(tmp_path, config=QWEN3_CONFIG),
        "corrupt_weights": lambda: _model_dir(tmp_path, config=QWEN3_CONFIG, weights=b"\x07not safetensors"),
    }[kind]()
    with pytest.raises(CheckError, match=message):
        check.run(_settings(tmp_path, cache_dir, model=model))


@pytest.mark.skipif(__import__("importlib").util.find_spec("sglang") is not None,
                    reason="sglang is installed here, so its absence cannot be tested")
def test_missing_sglang_says_what_to_install(tmp_path, cache_dir):
    with pytest.raises(CheckError, match=r"sglang package is not installed.*pip install 'sglang==0\.5\.17'"):
        check.run(_settings(tmp_path, cache_dir, engine="sglang", engine_layouts="tp1"))


def _no_model_loads(monkeypatch):
    """Building or loading a model fails the test: what is refused here must be refused before either."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built or loaded before the bad input was refused")

    monkeypatch.setattr(models, "load_hf_model", refuse)
    monkeypatch.setattr(models, "_build", refuse)


@pytest.mark.parametrize("overrides, cached_seed, message", [
    # tiny seed 1 not in the cache: known by its seed (the check samples with the seed that made the weights)
    (dict(seed=1), None, r"sampled from model 'tiny' generated with --seed=0, but --model=tiny with --seed=1 has "
                         r"other weights"),
    # tiny seed 1 in the cache: known by its fingerprint, read from the cache without loading the weights
    (dict(seed=1), 1, r"sampled from model 'tiny' \(fingerprint .*\), but --model=tiny has fingerprint"),
    (dict(model="qwen3-0.6b-random"), None, r"sampled from model 'tiny', not --model=qwen3-0.6b-random"),
    (dict(seq_len=8), None, r"--seq_len=8: shorter than the longest sequence of the replayed rollout \(\d+ tokens"),
])
def test_replay_with_another_model_or_a_short_seq_len_is_refused_before_any_model(
        overrides, cached_seed, message, default_run, tmp_path, monkeypatch):
    _, first_dir = default_run
    cache = str(tmp_path / "cache")
    if cached_seed is not None:
        models.resolve_model("tiny", cache_dir=cache, seed=cached_seed, log=lambda _: None)
    _no_model_loads(monkeypatch)
    with pytest.raises(CheckError, match=message):
        check.run(_settings(tmp_path, cache, rollout_data=os.path.join(first_dir, "rollout.json"), **overrides))


def test_replay_with_other_sampling_flags_is_refused(default_run, tmp_path, cache_dir):
    _, first_dir = default_run
    with pytest.raises(CheckError, match="--temperature=0.7 differs.*use --trainer_temperature"):
        check.run(_settings(tmp_path, cache_dir, temperature=0.7, explicit_flags=("temperature",),
                            rollout_data=os.path.join(first_dir, "rollout.json")))


@pytest.mark.parametrize("text, message", [
    ('{"input_ids": [1, 2]}\n{"input_ids": [1, 2\n', "line 2: not valid JSON"),
    ('{"input_ids": [1, 99999]}\n', "token id 99999 is outside"),
    ('{"prompt": "hi"}\n', "exactly one of"),
    ("\n", "no prompts in the file"),
])
def test_malformed_prompts_file_is_refused(text, message, tmp_path, cache_dir):
    path = _write(tmp_path / "prompts.jsonl", text)
    with pytest.raises(CheckError, match=message):
        check.run(_settings(tmp_path, cache_dir, prompts=path))


def test_malformed_rollout_file_is_refused(tmp_path, cache_dir):
    path = _write(tmp_path / "rollout.json", json.dumps({"format": "something else"}))
    with pytest.raises(CheckError, match="not a rollout of this check"):
        check.run(_settings(tmp_path, cache_dir, rollout_data=path))


def test_binary_bad_input_exits_2_with_a_message_and_no_traceback(tmp_path):
    proc = _run_binary([f"--report_dir={tmp_path}", "--trainer_layouts=tp1,pp2"], timeout=300)
    assert proc.returncode == 2
    assert "qwen3_parallel_check: error: --trainer_layouts: unknown layout name 'pp2'" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------------------------ the CLI: one line, exit code


@pytest.mark.parametrize("args, message", [
    (["--dtype=float16"], "flag --dtype=float16: value should be one of"),  # absl's own enum validation
    (["--num_prompts=many"], "flag --num_prompts=many"),
    (["--negative_control=typo"], "flag --negative_control=typo"),
    (["stray"], "unexpected arguments: stray"),
    (["--trainer_layouts=tp1,pp2"], "--trainer_layouts: unknown layout name 'pp2'"),
    (["--engine_layouts=tp1-fused"], "--engine_layouts: layout 'tp1-fused' asks for the fused LM head (-fused), which "
                                     "only trainer layouts have"),
    (["--report_dir={file}/sub"], "--report_dir={file}/sub: not a writable folder"),
    (["--cache_dir={file}/sub"], "--cache_dir={file}/sub: not a writable folder"),
    (["--rollout_data={tmp}/missing.json"], "cannot read a rollout from the file"),
    (["--prompts={tmp}/missing.jsonl"], "--prompts={tmp}/missing.jsonl: cannot read the file"),
    (["--engine=hf", "--sglang_extra_args='abc"], "--sglang_extra_args='abc: not a shell-quoted argument list"),
])
def test_binary_bad_input_is_one_line_and_exit_2_before_any_model(args, message, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    cache = tmp_path / "cache"
    fill = lambda text: text.format(file=a_file, tmp=tmp_path)  # noqa: E731
    args = [fill(a) for a in args]
    defaults = [f"--report_dir={tmp_path / 'report'}", f"--cache_dir={cache}"]
    proc = _run_binary([d for d in defaults if d.split("=")[0] not in {a.split("=")[0] for a in args}] + args,
                       timeout=300)
    assert proc.returncode == 2, proc.stderr
    line = processes.only_line(proc.stderr)
    assert line.startswith("qwen3_parallel_check: error: ") and fill(message) in line, line
    assert not cache.exists() or not any(cache.iterdir())  # no model was built


def test_help_exits_0_and_lists_the_checks_flags():
    proc = _run_binary(["--help"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--report_dir", "--rollout_data", "--trainer_layouts", "--sglang_extra_args"):
        assert flag in proc.stdout, flag


# The lock file a running check holds in its report folder (documented in qwen3_parallel_check.py, report.py).
LOCK_FILE = ".lock"


def _hold_lock(folder):
    """Holds `folder`'s report lock from this process, as a running check would."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(folder / LOCK_FILE), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_second_run_into_a_folder_being_written_is_refused(tmp_path):
    report_dir, cache = tmp_path / "report", tmp_path / "cache"
    fd = _hold_lock(report_dir)
    try:
        proc = _run_binary([f"--report_dir={report_dir}", f"--cache_dir={cache}", "--num_prompts=1",
                            "--trainer_layouts=tp1"], timeout=300)
    finally:
        os.close(fd)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = processes.only_line(proc.stderr)
    assert line.startswith(f"qwen3_parallel_check: error: --report_dir={report_dir}: another run is writing"), line
    assert not cache.exists() or not any(cache.iterdir())  # refused before any model was built
    assert os.listdir(report_dir) == [LOCK_FILE]


def test_the_folder_lock_of_a_killed_run_is_free(tmp_path):
    """flock is released by the kernel when its holder dies, however: a crash never leaves a folder locked."""
    folder = tmp_path / "report"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(folder / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(CheckError, match="another run is writing this folder"):
        with report.folder_lock("--report_dir", str(folder)):
            pass
    holder.kill()
    holder.wait()
    with report.folder_lock("--report_dir", str(folder)):
        pass


def test_relative_paths_are_the_callers_under_bazel_run(default_run, cache_dir, tmp_path):
    """`bazel run` starts the binary in its runfiles tree and says where the user was in BUILD_WORKING_DIRECTORY:
    relative --report_dir and --rollout_data are there. An earlier run's files in the folder do not stay."""
    _, first_dir = default_run
    caller = tmp_path / "caller"
    (caller / "saved").mkdir(parents=True)
    (caller / "saved" / "rollout.json").write_text(open(os.path.join(first_dir, "rollout.json")).read())
    (caller / "relrep").mkdir()
    (caller / "relrep" / "rollout.json").write_text("an earlier run's rollout")
    env = dict(os.environ, BUILD_WORKING_DIRECTORY=str(caller))
    proc = _run_binary(["--report_dir=relrep", "--rollout_data=saved/rollout.json", f"--cache_dir={cache_dir}",
                        "--trainer_layouts=tp1"], env=env)
    assert proc.returncode == 0, proc.stderr
    replay = _report(str(caller / "relrep"))
    assert replay["rollout"]["path"] == str(caller / "saved" / "rollout.json")
    assert replay["settings"]["report_dir"] == str(caller / "relrep")
    assert sorted(os.listdir(caller / "relrep")) == sorted([LOCK_FILE, report.JSON_NAME, report.MD_NAME,
                                                             report.PNG_NAME])
    assert not os.path.exists(os.path.join(REPO_ROOT, "relrep"))




SIGINT_ROLLOUT_COPIES = 8  # the replayed samples 8 times over: ~14 s of rank work after the ranks start, not ~2 s


def test_sigint_exits_130_with_one_line_and_no_rank_left(default_run, cache_dir, tmp_path):
    # A longer rollout, so that the ranks are still working when the signal comes even on a loaded machine (with the
    # default one they can finish before a starved test process sends it). Interrupted, it costs no more time.
    rollout = _rollout_with(default_run, tmp_path,
                            lambda r: r.__setitem__("samples", r["samples"] * SIGINT_ROLLOUT_COPIES))
    report_dir = tmp_path / "report"
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "sglang_checks.qwen3_parallel_check", f"--cache_dir={cache_dir}",
                             f"--report_dir={report_dir}", f"--rollout_data={rollout}", "--trainer_layouts=tp1,tp2"],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The check's progress log says when the trainer ranks are being started.
    processes.assert_interrupt_stops_ranks(proc, "qwen3_parallel_check", stream=proc.stderr,
                                           ready_text="trainer layouts")
    with report.folder_lock("--report_dir", str(report_dir)):  # and the folder is free again
        pass


def _rollout_with(default_run, tmp_path, mutate):
    _, first_dir = default_run
    with open(os.path.join(first_dir, "rollout.json")) as f:
        record = json.load(f)
    mutate(record)
    path = tmp_path / "bad_rollout.json"
    path.write_text(json.dumps(record))
    return str(path)


def _set(key, value):
    return lambda r: r.__setitem__(key, value)


def _set_sample(key, value):
    return lambda r: r["samples"][0].__setitem__(key, value)


@pytest.mark.parametrize("mutate, message", [
    (_set_sample("prompt_ids", "1 2 3"), "sample 0 prompt_ids must be a non-empty list of integer token ids"),
    (_set_sample("prompt_ids", [1.0, 2.0]), "sample 0 prompt_ids must be a non-empty list of integer token ids"),
    (_set_sample("completion_ids", []), "sample 0 completion_ids must be a non-empty list"),
    (_set("samples", []), "samples must be a non-empty list"),
    (_set("temperature", 0), "temperature must be a finite number > 0"),
    (_set("temperature", "0.8"), "temperature must be a finite number > 0"),
    (_set("top_p", 5), r"top_p must be a number in \(0, 1\]"),
    (_set("top_p", 0), r"top_p must be a number in \(0, 1\]"),
    (lambda r: r["samples"][1]["engine_logprobs"].__setitem__(0, float("inf")),
     "sample 1 engine_logprobs must be finite log-probs <= 0"),
    (lambda r: r["samples"][1]["engine_logprobs"].__setitem__(0, float("nan")),
     "sample 1 engine_logprobs must be finite log-probs <= 0"),
    (lambda r: r["samples"][0]["engine_logprobs"].pop(), "sample 0 engine_logprobs must be a list of"),
    (_set("seed", True), "seed must be an integer"),
    (_set("engine", "vllm"), "engine must be hf or sglang"),
    (lambda r: r.pop("top_p"), "malformed rollout .missing top_p"),
])
def test_bad_rollout_file_is_bad_input_before_any_model(mutate, message, default_run, tmp_path):
    cache = tmp_path / "cache"
    path = _rollout_with(default_run, tmp_path, mutate)
    with pytest.raises(CheckError, match=message):
        check.run(_settings(tmp_path, str(cache), rollout_data=path))
    assert not any(cache.iterdir())  # refused before the model was built


def test_trainer_timeout_is_exit_3_with_one_line_and_the_report(default_run, cache_dir, tmp_path, capsys):
    _, first_dir = default_run
    s = _settings(tmp_path, cache_dir, rollout_data=os.path.join(first_dir, "rollout.json"), trainer_layouts="tp1",
                  trainer_timeout_s=1e-3)
    assert check.run(s) == check.EXIT_TRAINER_FAILED
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("qwen3_parallel_check: error:")]
    assert len(errors) == 1 and "trainer layout tp1: rank 0 did not finish within" in errors[0], errors
    report = _report(s.report_dir)  # written with what finished: the engine-side comparisons
    assert report["trainer_error"]["layout"] == "tp1" and report["trainer_error"]["rank"] == 0
    assert report["trainer_layouts"] == {} and any(c["section"] == "train-rollout mismatch"
                                                   for c in report["comparisons"])


# ------------------------------------------------------------------------------------------------ on CUDA

def _run_on_cuda(tmp_path, cache_dir, trainer_layouts):
    settings = cli.settings(report_dir=str(tmp_path / "report"), cache_dir=cache_dir, model="qwen3-0.6b-random",
                              device="cuda", trainer_layouts=trainer_layouts, num_prompts=4, samples_per_prompt=2,
                              max_new_tokens=32)
    code = check.run(settings)
    with open(os.path.join(settings.report_dir, "report.json")) as f:
        report = json.load(f)
    failed = [c for c in report["comparisons"] if not c["passed"]]
    return code, report, failed


@pytest.mark.device("cuda")
def test_qwen3_0_6b_random_on_one_gpu(tmp_path, cache_dir):
    code, report, failed = _run_on_cuda(tmp_path, cache_dir, "tp1")
    assert code == 0, failed
    assert report["trainer"]["backend"] == "nccl" and report["model"]["vocab_size"] == 151936
    mismatch = [c for c in report["comparisons"] if c["section"] == "train-rollout mismatch"]
    assert mismatch and all(c["passed"] for c in mismatch)
    print(json.dumps({c["subject"] + " / " + c["metric"]: c["value"] for c in report["comparisons"]}, indent=1))


@pytest.mark.device("cuda")
@pytest.mark.world_size(2)
def test_qwen3_0_6b_random_trainer_layouts_on_two_gpus(tmp_path, cache_dir):
    code, report, failed = _run_on_cuda(tmp_path, cache_dir, "tp1,tp2,cp2,dp2")
    assert code == 0, failed
    assert list(report["trainer_layouts"]) == ["tp1", "tp2", "cp2", "dp2"]
    trainer_rows = [c for c in report["comparisons"] if c["section"] == "trainer layouts"]
    assert len(trainer_rows) == 3 * COMPARISONS_PER_TRAINER_LAYOUT and all(c["passed"] for c in trainer_rows)
    print(json.dumps({c["subject"] + " / " + c["metric"]: c["value"] for c in report["comparisons"]}, indent=1))


@pytest.mark.device("cuda")
@pytest.mark.world_size(2)
def test_bf16_negative_controls_fail_with_their_metric_on_two_gpus(tmp_path, cache_dir):
    """qwen3-0.6b-random in bf16 with the hf engine: under the installed bf16 tolerances every healthy run passes and
    every negative control fails with the metric that should catch it (one seed, the built-in prompts)."""
    rows = run_calibrate(tmp_path / "cal", f"--cache_dir={cache_dir}", "--model=qwen3-0.6b-random", "--dtype=bfloat16",
                         "--device=cuda", "--engine=hf", "--engine_layouts=tp1,dp2", "--trainer_layouts=tp1,tp2",
                         "--seeds=0", "--prompt_sets=builtin", "--num_prompts=4", "--max_new_tokens=32")
    assert {r["control"] for r in rows if r["kind"] == "control"} == set(controls.CONTROLS)
    assert calibrate.violations(rows, "bfloat16") == []
