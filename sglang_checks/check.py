"""The check from start to end, given its settings: validate, model, rollout, engine layouts, trainer layouts, report.

Order matters for bad input: everything that can be checked without running a model (the report folder and its
lock, layout names, rank budgets, divisibility, the sglang install, the port, a replayed rollout against --model and
--seq_len) is checked first, so a typo costs no time and starts no process.
`run` returns the exit code: 0 when every comparison is within its tolerance, 1 otherwise, 3 when a trainer rank
crashed or timed out (one line on stderr naming the layout and rank; the report holds what finished); bad input
raises CheckError (the binary turns it into exit code 2).

The trainer's numerics (--trainer_numerics): `hf`, transformers' forward; or `sglang_on_policy`, SGLang's
--rl-on-policy-target forward op by op with its own kernels (on_policy.py, validated up front against the engine
flags it mirrors), so teacher-forced scores can be held to exact equality. With --sglang_dump_tensors every server
dumps its passes into <report_dir>/engine_dump/<layout>/, and after scoring layer_diff.py names the first tensor
where the trainer's on-policy forward and the engine part (report.json's layer_diff).

With --train_steps=N the check is followed by N GRPO steps of one trainer in this process, each step's weights synced
into every engine layout and read back there, each step's rollout compared as the check's own, under every trainer
layout too, and with --reference_trainer replayed through a textbook trainer (train_steps.py); their comparisons
join the check's and decide the exit code with them.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from sglang_checks import controls
from sglang_checks import layouts as layouts_lib
from sglang_checks import layer_diff, logprob_kinds, metrics, models, prompts, report, rollout as rollout_lib
from sglang_checks import tolerances, train_steps, trainer
from sglang_checks.engines import SamplingSettings, hf_engine, sglang_engine
from sglang_checks.errors import CheckError


EXIT_FAIL = 1  # a comparison out of tolerance
EXIT_BAD_INPUT = 2  # CheckError: a flag, a path, a rollout file, prompts
EXIT_TRAINER_FAILED = 3  # a trainer rank crashed or timed out (the report holds what finished)
ENGINE_DUMP_NAME = "engine_dump"  # --sglang_dump_tensors: <report_dir>/engine_dump/<engine layout>/


@dataclasses.dataclass
class Settings:
    """Every knob of the check, named as its flag (sglang_checks/cli.py: the help, the defaults, and `cli.settings`,
    which builds this from the flag holders; no default is restated here)."""

    report_dir: str
    model: str
    cache_dir: str
    seed: int
    dtype: str
    device: str
    cpu_threads: int
    engine: str
    engine_layouts: str
    trainer_layouts: str
    temperature: float
    top_p: float
    trainer_temperature: Optional[float]
    max_new_tokens: int
    num_prompts: int
    samples_per_prompt: int
    prompts: Optional[str]
    ignore_eos: bool
    rollout_data: Optional[str]
    explicit_flags: Tuple[str, ...]  # names of the flags the user set (replay conflicts, --num_prompts)
    seq_len: int
    entropy_coef: float
    train_steps: int  # GRPO steps after the check (train_steps.py); 0: none
    lr: float
    reference_trainer: bool  # replay the training steps through the textbook trainer (train_steps.py)
    train_head: str  # what the training steps train with: train_steps.TRAIN_HEADS
    max_ranks: int
    trainer_timeout_s: float
    tolerances: Dict[str, Optional[float]]
    expect_bitwise: bool
    negative_control: str
    trainer_numerics: str
    sglang_dump_tensors: bool
    sglang: sglang_engine.ServerOptions


def _log(message: str) -> None:
    print(f"[qwen3_parallel_check] {message}", file=sys.stderr, flush=True)


def _progress(iterable, desc: str):
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, file=sys.stderr, leave=False, disable=None)


def _check_values(s: Settings) -> None:
    # engine, dtype, device, negative_control, ...: DEFINE_enum flags, validated by absl when parsed.
    if not s.temperature > 0:
        raise CheckError(f"--temperature: expected > 0, got {s.temperature}")
    if s.trainer_temperature is not None and not s.trainer_temperature > 0:
        raise CheckError(f"--trainer_temperature: expected > 0, got {s.trainer_temperature}")
    if not 0 < s.top_p <= 1:
        raise CheckError(f"--top_p: expected 0 < top_p <= 1, got {s.top_p}")
    for name in ("max_new_tokens", "samples_per_prompt", "num_prompts", "max_ranks", "cpu_threads"):
        if getattr(s, name) < 1:
            raise CheckError(f"--{name}: expected >= 1, got {getattr(s, name)}")
    if not s.trainer_timeout_s > 0:
        raise CheckError(f"--trainer_timeout_s: expected > 0, got {s.trainer_timeout_s}")
    if s.seq_len < 0:
        raise CheckError(f"--seq_len: expected 0 (automatic) or a positive length, got {s.seq_len}")
    if not np.isfinite(s.entropy_coef):
        raise CheckError(f"--entropy_coef: expected a finite number, got {s.entropy_coef}")
    if s.rollout_data and s.prompts:
        raise CheckError("--prompts and --rollout_data: give one; a replayed rollout already has its prompts")
    for name, value in s.tolerances.items():
        if value is not None and not value >= 0:
            raise CheckError(f"--{name}: expected a tolerance >= 0, got {value}")
    train_steps.check_settings(s)


def _check_control(s: Settings, trainer_layouts, engine_layouts) -> None:
    """A negative control needs something to break: generated weights for the seed + 1 ones, a layout to fault."""
    flag = f"--negative_control={s.negative_control}"
    if s.negative_control in (controls.TRAINER_WEIGHTS, controls.ENGINE_LAYOUT_WEIGHTS) and \
            s.model not in models.PRESETS:
        raise CheckError(f"{flag}: needs a generated model ({', '.join(models.PRESETS)}) to draw other weights "
                         f"from, got --model={s.model}")
    if s.negative_control == controls.ENGINE_LAYOUT_WEIGHTS and len(engine_layouts) < 2:
        raise CheckError(f"{flag}: needs at least two --engine_layouts (the last one gets other weights)")
    if s.negative_control == controls.VOCAB_OFFSET and not any(layout.tp > 1 for layout in trainer_layouts):
        raise CheckError(f"{flag}: needs a tensor-parallel trainer layout (tp2 or more) in --trainer_layouts")


def _device(s: Settings) -> torch.device:
    if s.device == "cuda" and not torch.cuda.is_available():
        raise CheckError("--device=cuda: no CUDA GPU is visible to torch")
    if s.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(s.device)


def _versions(s: Settings) -> Dict[str, str]:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "numpy": np.__version__}
    try:
        import ppo_ops

        out["ppo_ops"] = getattr(ppo_ops, "__version__", "unversioned")
    except ImportError:
        out["ppo_ops"] = "missing"
    if s.engine == "sglang":
        out["sglang"] = sglang_engine.check_installed(s.sglang.python)
        out["sglang_python"] = s.sglang.python
    return out


@dataclasses.dataclass
class Plan:
    """What the early validation settled (validate_inputs): everything a run needs before it builds a model."""

    device: torch.device
    backend: str  # "gloo" or "nccl"
    trainer_layouts: List[layouts_lib.Layout]
    engine_layouts: List[layouts_lib.Layout]
    replay: Optional[rollout_lib.Rollout]  # the rollout file's contents (--rollout_data), validated
    prompt_ids: Optional[List[List[int]]]  # the prompts to sample (None when replaying)
    info: Optional[models.ModelInfo] = None  # a local checkpoint already fingerprinted for the replay check
    sglang_site: Optional[str] = None  # where the on-policy trainer imports sglang from (--trainer_numerics)


def check_writable(flag: str, path: str) -> None:
    """The folder exists (or is made) and takes a file, so no result is lost at the end of a long run."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test_"):
            pass
    except OSError as exc:
        raise CheckError(f"{flag}={path}: not a writable folder ({exc.strerror or exc})") from exc


def validate_inputs(s: Settings) -> Plan:
    """Checks every input that needs no model: folders, layout names, rank budgets, the engine's prerequisites, the
    rollout file or the prompts. The check and the calibration both start here."""
    check_writable("--report_dir", s.report_dir)
    check_writable("--cache_dir", s.cache_dir)
    _check_values(s)
    _check_numerics(s)
    device = _device(s)
    if s.trainer_numerics == trainer.SGLANG_ON_POLICY and device.type != "cuda":
        raise CheckError(f"--trainer_numerics={s.trainer_numerics}: runs SGLang's CUDA kernels; expected "
                         f"--device=cuda (or auto with a GPU visible), got {device.type}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    trainer_layouts = _parse_trainer_layouts(s, backend)
    engine_layouts = _parse_engine_layouts(s)
    site = None
    if s.trainer_numerics == trainer.SGLANG_ON_POLICY:
        from sglang_checks import on_policy

        site = sglang_engine.site_dir(s.sglang.python)
        on_policy.import_sglang(site)  # before any model or server: an interpreter that cannot is bad input
    _check_control(s, trainer_layouts, engine_layouts)
    replay, prompt_ids = _rollout_source(s)
    num_sequences = len(replay.samples) if replay else len(prompt_ids) * s.samples_per_prompt
    vocab_size, _ = models.peek(s.model)
    for layout in trainer_layouts:
        layouts_lib.check_trainer_layout(layout, flag="--trainer_layouts", vocab_size=vocab_size,
                                         num_sequences=num_sequences)
    info = _check_replay_fits(replay, s) if replay else None
    return Plan(device, backend, trainer_layouts, engine_layouts, replay, prompt_ids, info, site)


# What --trainer_numerics=sglang_on_policy mirrors: SGLang's Qwen3 under --rl-on-policy-target fsdp with the triton
# backend's deterministic extend kernel, bf16 activations and weights (its on-policy path casts activations to bf16
# before every GEMM, so the weights must be bf16 too). Each entry: (flag, the value it needs, the setting's value).
def _on_policy_needs(s: Settings):
    return (("--engine", "sglang", s.engine),
            ("--sglang_rl_on_policy_target", "fsdp", s.sglang.rl_on_policy_target),
            ("--sglang_attention_backend", "triton", s.sglang.attention_backend),
            ("--dtype", "bfloat16", s.dtype))


def _check_numerics(s: Settings) -> None:
    if s.trainer_numerics == trainer.SGLANG_ON_POLICY:
        for flag, needed, value in _on_policy_needs(s):
            if value != needed:
                raise CheckError(f"--trainer_numerics={s.trainer_numerics}: mirrors SGLang's on-policy forward with "
                                 f"its triton kernels in bf16; expected {flag}={needed}, got {flag}={value}")

    if s.sglang_dump_tensors and s.engine != "sglang":
        raise CheckError(f"--sglang_dump_tensors: dumps an SGLang server's tensors; expected --engine=sglang, got "
                         f"--engine={s.engine}")


def _parse_trainer_layouts(s: Settings, backend: str) -> List[layouts_lib.Layout]:
    """--trainer_layouts with tp1 added, each within the rank budget (NCCL: also one rank per visible GPU) and the
    sequence length; the vocabulary and batch are checked once the rollout source is known."""
    if backend == "nccl":
        rank_limit = min(s.max_ranks, torch.cuda.device_count())
        limit_reason = f"one rank per visible GPU with NCCL, and --max_ranks={s.max_ranks}"
    else:
        rank_limit, limit_reason = s.max_ranks, f"--max_ranks={s.max_ranks}"
    trainer_layouts = layouts_lib.with_baseline(layouts_lib.parse_layouts(
        s.trainer_layouts, flag="--trainer_layouts", allowed_dims=("tp", "cp", "dp"), fused=True))
    for layout in trainer_layouts:
        layouts_lib.check_rank_budget(layout, flag="--trainer_layouts", max_ranks=rank_limit, what=limit_reason)
        layouts_lib.check_trainer_layout(layout, flag="--trainer_layouts", seq_len=s.seq_len or None)
    return trainer_layouts


def _parse_engine_layouts(s: Settings) -> List[layouts_lib.Layout]:
    """--engine_layouts for the chosen engine; for SGLang also its install, the visible GPUs and --sglang_port."""
    engine = hf_engine if s.engine == "hf" else sglang_engine
    engine_layouts = layouts_lib.parse_layouts(s.engine_layouts, flag="--engine_layouts",
                                               allowed_dims=engine.ALLOWED_DIMS)
    if s.engine == "hf":
        for layout in engine_layouts:
            hf_engine.check_layout(layout, "--engine_layouts")
    else:
        sglang_engine.check_installed(s.sglang.python)
        for layout in engine_layouts:
            sglang_engine.check_layout(layout, "--engine_layouts", torch.cuda.device_count())
        if s.sglang.port:
            sglang_engine.check_port_free(s.sglang.host, s.sglang.port)
    return engine_layouts


def _check_replay_fits(replay: rollout_lib.Rollout, s: Settings) -> Optional[models.ModelInfo]:
    """The replayed rollout against --seq_len and --model, without building or loading a model: a generated model is
    known by its name and seed (its fingerprint when cached; the check samples with the seed that made the weights),
    a local checkpoint by the fingerprint of its weight files (returned, so it is not computed twice)."""
    if s.seq_len and s.seq_len < replay.longest:
        raise CheckError(f"--seq_len={s.seq_len}: shorter than the longest sequence of the replayed rollout "
                         f"({replay.longest} tokens, {s.rollout_data})")
    flag = f"--rollout_data={s.rollout_data}"
    if s.model not in models.PRESETS:
        info = models.resolve_model(s.model, cache_dir=s.cache_dir, seed=s.seed, log=_log)
        rollout_lib.check_model(replay, info.fingerprint, info.name, s.rollout_data)
        return info
    if replay.model_name != s.model:
        raise CheckError(f"{flag}: the rollout was sampled from model {replay.model_name!r}, not --model={s.model}; "
                         f"replay it with the model that sampled it, or drop --rollout_data")
    cached = models.cached_fingerprint(s.model, cache_dir=s.cache_dir, seed=s.seed)
    if cached is not None:
        rollout_lib.check_model(replay, cached, s.model, s.rollout_data)
    elif replay.seed != s.seed:
        raise CheckError(f"{flag}: the rollout was sampled from model {replay.model_name!r} generated with "
                         f"--seed={replay.seed}, but --model={s.model} with --seed={s.seed} has other weights; "
                         f"replay it with --seed={replay.seed}, or drop --rollout_data")
    return None


@dataclasses.dataclass
class Models:
    """The checkpoints and loaded models a run uses (the controls can give the trainer or an engine other weights)."""

    info: models.ModelInfo  # the model under check (the engine's)
    model: object  # its transformers model, for the hf engine and the trainer
    trainer_model: object  # the trainer's model: `model`, or other weights under the trainer_weights control
    other: Optional[models.ModelInfo] = None  # the seed + 1 checkpoint of the weight controls
    other_model: object = None


def load_models(s: Settings, plan: Plan) -> Models:
    info = plan.info or models.resolve_model(s.model, cache_dir=s.cache_dir, seed=s.seed, log=_log)
    dtype = getattr(torch, s.dtype)
    model = models.load_hf_model(info, dtype=dtype, device=plan.device)
    out = Models(info=info, model=model, trainer_model=model)
    if s.negative_control in (controls.TRAINER_WEIGHTS, controls.ENGINE_LAYOUT_WEIGHTS):
        out.other = models.resolve_model(s.model, cache_dir=s.cache_dir, seed=s.seed + controls.WEIGHTS_SEED_OFFSET,
                                         log=_log)
        if s.negative_control == controls.TRAINER_WEIGHTS or s.engine == "hf":
            out.other_model = models.load_hf_model(out.other, dtype=dtype, device=plan.device)
        if s.negative_control == controls.TRAINER_WEIGHTS:
            out.trainer_model = out.other_model
    if s.negative_control == controls.TRAINER_WEIGHT_ULP:
        out.trainer_model = controls.one_ulp_off(model)
    return out


def run(s: Settings) -> int:
    """The whole check, top to bottom: validate, models, sample + engine scores, trainer scores, compare, report.
    Returns the exit code (0: all comparisons within tolerance, 1: some not). The report folder is this run's
    alone while it runs (report.folder_lock; another run's folder is bad input) and holds only its files."""
    check_writable("--report_dir", s.report_dir)
    with report.folder_lock("--report_dir", s.report_dir):
        return _run(s)


def _clear_outputs(s: Settings) -> None:
    """Removes what an earlier run wrote into the report folder, so that it holds this run's files only (a replayed
    rollout.json that is this run's input stays)."""
    names = [report.JSON_NAME, report.MD_NAME, report.PNG_NAME, report.TRAIN_PNG_NAME, report.ROLLOUT_NAME]
    names += [n for n in os.listdir(s.report_dir) if n.startswith("sglang_") and n.endswith(".log")]
    shutil.rmtree(os.path.join(s.report_dir, ENGINE_DUMP_NAME), ignore_errors=True)
    for name in names:
        path = os.path.join(s.report_dir, name)
        if s.rollout_data and os.path.exists(path) and os.path.samefile(path, s.rollout_data):
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _run(s: Settings) -> int:
    start = time.monotonic()
    plan = validate_inputs(s)
    _clear_outputs(s)
    torch.set_num_threads(s.cpu_threads)
    m = load_models(s, plan)
    if plan.replay:  # a generated model's fingerprint is known once it is built
        rollout_lib.check_model(plan.replay, m.info.fingerprint, m.info.name, s.rollout_data)
    timings = {"model_s": time.monotonic() - start}

    t0 = time.monotonic()
    os.makedirs(s.report_dir, exist_ok=True)
    rollout, engine_scores, engine_infos = _sample_and_score_with_engines(s, plan, m)
    timings["engines_s"] = time.monotonic() - t0

    t0 = time.monotonic()
    scores = _pack_and_view(s, plan, m.trainer_model, rollout)
    info = m.info
    del m  # the ranks get what they need through their inputs; free the models first
    diffs = _layer_diffs(s, plan, rollout, scores) if s.sglang_dump_tensors else None
    _run_trainer_layouts(s, plan, scores)
    timings["trainer_s"] = time.monotonic() - t0

    tol = tolerances.resolve_all(s.tolerances, s.dtype)
    comparisons, mismatch_hist, layout_hist = compare(
        rollout, scores.packed, scores.results, engine_scores, scores.view, tol, engine=s.engine,
        first_layout=plan.engine_layouts[0].name, bitwise=s.expect_bitwise,
        shifted=s.negative_control == controls.SHIFTED_LOGPROBS)
    train_record = None
    if s.train_steps:
        t0 = time.monotonic()
        _log(f"{s.train_steps} GRPO training steps, weights synced into {s.engine} "
             f"{','.join(layout.name for layout in plan.engine_layouts)}")
        train_record, train_comparisons = train_steps.run(s, plan, info, _train_prompts(plan, rollout), tol,
                                                          sample_rollout=sample_rollout, log=_log)
        comparisons += train_comparisons
        timings["train_steps_s"] = time.monotonic() - t0
    timings["total_s"] = time.monotonic() - start
    summary = _summary(s, plan, info=info, rollout=rollout, engine_infos=engine_infos, scores=scores, tol=tol,
                       timings=timings)
    if diffs is not None:
        summary["layer_diff"] = diffs
    if train_record is not None:
        summary["train_steps"] = train_record
    paths = report.write_all(s.report_dir, summary, comparisons, mismatch_hist, layout_hist)
    return _verdict(comparisons, paths, scores.error)


@dataclasses.dataclass
class _TrainerScores:
    """The trainer side of a run: the packed rollout, the model's view of it in this process, each layout's result."""

    seq_len: int
    packed: rollout_lib.Packed
    view: TrainerView
    record: Optional[dict] = None  # the on-policy forward's tensors by dumper name (--sglang_dump_tensors)
    results: List[trainer.LayoutResult] = dataclasses.field(default_factory=list)  # the layouts that finished
    error: Optional[trainer.TrainerRankError] = None  # the rank that crashed or timed out


def _pack_and_view(s: Settings, plan: Plan, model, rollout: rollout_lib.Rollout) -> _TrainerScores:
    """Packs the rollout at --seq_len (0: the automatic length) and runs the trainer's model over it once."""
    seq_len = s.seq_len or layouts_lib.auto_seq_len(rollout.longest, plan.trainer_layouts)
    if seq_len < rollout.longest:
        raise CheckError(f"--seq_len={s.seq_len}: shorter than the longest rollout sequence ({rollout.longest})")
    packed = rollout_lib.pack(rollout, seq_len)
    kernels = record = None
    if s.trainer_numerics == trainer.SGLANG_ON_POLICY:
        from sglang_checks import on_policy

        kernels = on_policy.sglang_kernels(plan.sglang_site)
        record = {} if s.sglang_dump_tensors else None
    view = trainer_view(model, packed, rollout, trainer_temperature(s, rollout), trainer_top_p(s, rollout),
                        numerics=s.trainer_numerics, kernels=kernels, record=record)
    return _TrainerScores(seq_len, packed, view, record)


def _layer_diffs(s: Settings, plan: Plan, rollout: rollout_lib.Rollout, scores: _TrainerScores) -> dict:
    """Per engine layout: layer_diff of its dump against the trainer's record (or why it was skipped). The record
    is freed after."""
    sequences = [sample.prompt_ids + sample.completion_ids for sample in rollout.samples]
    out = {}
    for layout in plan.engine_layouts:
        folder = os.path.join(s.report_dir, ENGINE_DUMP_NAME, layout.name)
        if scores.record is None:
            out[layout.name] = {"engine_dump": folder, "summary": f"skipped: the trainer records SGLang's tensor "
                                f"names only with --trainer_numerics={trainer.SGLANG_ON_POLICY}"}
        elif layout.tp > 1:
            out[layout.name] = {"engine_dump": folder, "summary": "skipped: a tensor-parallel dump holds each "
                                "rank's shards; compare an engine layout with tp1"}
        else:
            try:
                out[layout.name] = layer_diff.diff(folder, scores.record, sequences)
            except Exception as exc:  # noqa: BLE001 - a diagnostic: a bad dump must not cost the run its report
                out[layout.name] = {"engine_dump": folder, "summary": f"failed: {type(exc).__name__}: {exc}"}
        _log(f"layer diff, engine {layout.name}: {out[layout.name]['summary']}")
    scores.record = None
    return out


def trainer_inputs(view: TrainerView, packed: rollout_lib.Packed, entropy_coef: float,
                   sglang_site: Optional[str] = None) -> trainer.TrainerInputs:
    """What every trainer rank is given: the view's hidden states and LM head on the CPU, the packed targets."""
    return trainer.TrainerInputs(
        hidden=view.hidden.cpu(), lm_head=view.lm_head.cpu(), targets=packed.targets, row_mask=packed.row_mask,
        keep_mask=None if view.keep is None else view.keep.cpu(), advantages=packed.advantages,
        temperature=view.temperature, entropy_coef=entropy_coef, numerics=view.numerics, sglang_site=sglang_site)


def _run_trainer_layouts(s: Settings, plan: Plan, scores: _TrainerScores) -> None:
    """Every trainer layout on one group of ranks; fills `scores.results`, and `scores.error` when a rank crashed or
    timed out (the results are then those of the layouts that finished)."""
    inputs = trainer_inputs(scores.view, scores.packed, s.entropy_coef, plan.sglang_site)
    world = max(layout.world_size for layout in plan.trainer_layouts)
    _log(f"trainer layouts {','.join(layout.name for layout in plan.trainer_layouts)} on {world} {plan.backend} "
         f"ranks")
    faulty = tuple(layout.name for layout in plan.trainer_layouts if layout.tp > 1) \
        if s.negative_control == controls.VOCAB_OFFSET else ()
    bar = _progress(range(len(plan.trainer_layouts)), desc="trainer layouts")
    try:
        scores.results = trainer.run_layouts(inputs, plan.trainer_layouts, backend=plan.backend,
                                             threads=s.cpu_threads, timeout_s=s.trainer_timeout_s,
                                             progress=lambda layout: bar.update(1), vocab_offset_layouts=faulty)
    except trainer.TrainerRankError as exc:  # report what finished, then exit 3 with one line
        scores.error, scores.results = exc, exc.finished
    bar.close()


def _summary(s: Settings, plan: Plan, *, info: models.ModelInfo, rollout: rollout_lib.Rollout, engine_infos,
             scores: _TrainerScores, tol: Dict[str, float], timings: Dict[str, float]) -> dict:
    """report.json's record of the run: settings, versions, model, rollout, engines, trainer, tolerances, timings."""
    error = scores.error
    return {
        "settings": dataclasses.asdict(s),
        "versions": _versions(s),
        "model": dataclasses.asdict(info),
        "rollout": {**rollout_lib.settings_dict(rollout), "replayed": plan.replay is not None,
                    "path": s.rollout_data or os.path.join(s.report_dir, report.ROLLOUT_NAME),
                    "sequences": len(rollout.samples), "completion_tokens": rollout.num_completion_tokens,
                    "longest": rollout.longest, "seq_len": scores.seq_len},
        "trainer": {"temperature": scores.view.temperature, "top_p": scores.view.top_p, "backend": plan.backend,
                    "entropy_coef": s.entropy_coef, "logprob_kind": rollout.logprob_kind,
                    "numerics": scores.view.numerics, "sglang_site": plan.sglang_site},
        "engine_layouts": [layout.name for layout in plan.engine_layouts],
        "engines": engine_infos,
        "negative_control": s.negative_control,
        "expect_bitwise": s.expect_bitwise,
        "calibration": tolerances.source(s.dtype),
        "trainer_layouts": trainer_losses(scores.results),
        "trainer_error": None if error is None else {"message": str(error), "layout": error.layout,
                                                     "rank": error.rank, "detail": error.detail},
        "tolerances": {name: {"value": tol[name], "reason": tolerances.reason(name, s.dtype)} for name in tol},
        "timings_s": timings,
    }


def _train_prompts(plan: Plan, rollout: rollout_lib.Rollout) -> List[List[int]]:
    """The prompts the training steps sample: the check's own, or a replayed rollout's (one per prompt index)."""
    if plan.prompt_ids is not None:
        return plan.prompt_ids
    by_index = {}
    for sample in rollout.samples:
        by_index.setdefault(sample.prompt_index, sample.prompt_ids)
    return [by_index[i] for i in sorted(by_index)]


def trainer_losses(results: List[trainer.LayoutResult]) -> Dict[str, dict]:
    """report.json's trainer_layouts: each layout's losses and gradient norms by loss variant, in order; a fused
    layout's baseline (tp1-unfused) is listed before the first fused layout."""
    out = {}
    for r in results:
        if r.baseline is not None:
            out.setdefault(r.baseline.layout.name, r.baseline.losses)
        out[r.layout.name] = r.losses
    return out


def _verdict(comparisons: List[metrics.Comparison], paths: Dict[str, str],
             error: Optional[trainer.TrainerRankError]) -> int:
    """One line on stdout (PASS or FAIL, where the report is) or, after a trainer rank failed, one on stderr; a log
    line per comparison out of tolerance. Returns the exit code."""
    if error is not None:
        print(f"qwen3_parallel_check: error: {error} (report with what finished: {paths[report.MD_NAME]})",
              file=sys.stderr, flush=True)
        return EXIT_TRAINER_FAILED
    failed = [c for c in comparisons if not c.passed]
    for c in failed:
        _log(f"FAIL {c.section}: {c.subject}: {c.metric} = {c.value:.3e} > tolerance {c.tolerance:.1e} "
             f"({c.tolerance_name})")
    verdict = "PASS" if not failed else f"FAIL ({len(failed)} of {len(comparisons)} comparisons out of tolerance)"
    beside = " and ".join(os.path.basename(p) for name, p in paths.items() if name != report.MD_NAME)
    print(f"qwen3_parallel_check: {verdict}; report: {paths[report.MD_NAME]} (with {beside} beside it)", flush=True)
    return 0 if not failed else EXIT_FAIL


def trainer_temperature(s: Settings, rollout) -> float:
    if s.trainer_temperature is not None:
        return s.trainer_temperature
    if s.negative_control == controls.TRAINER_TEMPERATURE:
        return rollout.temperature * controls.TEMPERATURE_FACTOR
    return rollout.temperature


def trainer_top_p(s: Settings, rollout) -> float:
    return controls.CONTROL_TOP_P if s.negative_control == controls.TRAINER_TOP_P else rollout.top_p


@dataclasses.dataclass
class TrainerView:
    """The trainer's model outputs on a packed rollout, in this process (TP = 1): what every comparison starts from."""

    hidden: torch.Tensor  # [B, S, H]
    lm_head: torch.Tensor  # [V, H]
    logits: torch.Tensor  # [B, S, V], model dtype, model device
    temperature: float
    top_p: float
    top_p_set: Optional[torch.Tensor]  # [B, S, V] bool, the top-p set at the trainer's temperature (None: top_p 1)
    keep: Optional[torch.Tensor]  # the keep mask for the rollout's log-prob kind
    numerics: str = trainer.HF  # --trainer_numerics: which forward made it, and ppo_ops' reduction order


def trainer_view(model, packed, rollout, temperature: float, top_p: float, *, numerics: str = trainer.HF,
                 kernels=None, record=None) -> TrainerView:
    """The trainer's model outputs on the packed rollout; under sglang_on_policy from on_policy.py with `kernels`,
    every step's tensor recorded into `record` (a dict, or None)."""
    lengths = [len(sample.prompt_ids) + len(sample.completion_ids) for sample in rollout.samples]
    hidden, head, logits = trainer.model_outputs(model, packed.input_ids, numerics=numerics, lengths=lengths,
                                                 kernels=kernels, record=record)
    top_p_set = logprob_kinds.top_p_keep_mask(logits.float() / temperature, top_p)
    _, keep = logprob_kinds.trainer_arguments(rollout.logprob_kind, temperature, top_p_set)
    return TrainerView(hidden, head, logits, temperature, top_p, top_p_set, keep, numerics)


def _rollout_source(s: Settings):
    """(replayed rollout, None) or (None, prompt token ids), validated without building or loading the model."""
    vocab_size, tokenizer_dir = models.peek(s.model)
    if s.rollout_data:
        replay = rollout_lib.load(s.rollout_data)
        rollout_lib.check_vocab(replay, vocab_size, s.rollout_data)
        _check_replay_flags(replay, s)
        return replay, None
    tokenize = prompts.Tokenize(tokenizer_dir)
    if s.prompts:
        limit = s.num_prompts if "num_prompts" in s.explicit_flags else 0
        prompt_ids = prompts.load_prompts(s.prompts, vocab_size=vocab_size, tokenize=tokenize, limit=limit)
    else:
        prompt_ids = prompts.built_in_prompts(s.num_prompts, tokenize)
    _check_prompt_lengths(prompt_ids, s)
    return None, prompt_ids


def sample_rollout(s: Settings, engine, layout: layouts_lib.Layout, info: models.ModelInfo,
                   prompt_ids: List[List[int]], seed: int) -> rollout_lib.Rollout:
    """--samples_per_prompt completions of every prompt from `engine` at the check's sampling settings and `seed`."""
    sampling = SamplingSettings(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                seed=seed, eos_token_id=None if s.ignore_eos else info.eos_token_id)
    samples = engine.generate(prompt_ids, s.samples_per_prompt, sampling)
    return rollout_lib.Rollout(
        model_name=info.name, model_fingerprint=info.fingerprint, engine=s.engine, engine_layout=layout.name,
        logprob_kind=engine.sampled_logprob_kind, temperature=s.temperature, top_p=s.top_p,
        max_new_tokens=s.max_new_tokens, seed=seed, samples=samples)


def _sample_and_score_with_engines(s: Settings, plan: Plan, m: Models):
    """The first engine layout samples the rollout (unless replayed); every layout teacher-force scores it.
    Under the engine_layout_weights control the last layout serves the other weights.
    Returns the rollout, each layout's scores by name, and each engine's info for the report."""
    rollout, scores, infos = plan.replay, {}, []
    for index, layout in enumerate(plan.engine_layouts):
        other = s.negative_control == controls.ENGINE_LAYOUT_WEIGHTS and index == len(plan.engine_layouts) - 1
        with open_engine(s, layout, m.other_model if other and s.engine == "hf" else m.model, plan.device,
                         m.info) as engine:
            if other and s.engine == "sglang":
                engine.load_weights(m.other.path)
            if index == 0 and rollout is None:
                _log(f"sampling {len(plan.prompt_ids) * s.samples_per_prompt} completions with {s.engine} "
                     f"{layout.name}")
                rollout = sample_rollout(s, engine, layout, m.info, plan.prompt_ids, s.seed)
                path = os.path.join(s.report_dir, report.ROLLOUT_NAME)
                rollout_lib.save(rollout, path)
                _log(f"rollout saved to {path} (replay it with --rollout_data={path})")
            _log(f"teacher-forced scoring with {s.engine} {layout.name}")
            scores[layout.name] = engine.score(rollout.samples)
            infos.append(engine.info())
    return rollout, scores, infos


def compare(rollout, packed, results, engine_scores, view: TrainerView, tol, *, engine: str, first_layout: str,
            bitwise: bool = False, shifted: bool = False):
    """Every comparison, plus the per-token differences for the histogram. `results` may be empty (no trainer
    layouts run); `shifted` is the shifted_logprobs control."""
    mask = packed.row_mask.numpy()
    comparisons, layout_hist = trainer_layout_comparisons(results, mask, tol)
    scored = {name: to_rows(values, rollout, packed.targets.shape[1]) for name, values in engine_scores.items()}
    for name in scored:
        if name != first_layout:
            comparisons += metrics.engine_layout_comparisons(first_layout, name, scored[first_layout], scored[name],
                                                             mask, tol, bitwise)
    mismatch_hist = {}
    engine_lp = packed.engine_logprobs.numpy()
    sampled_lp = trainer_logprobs(view.logits, packed, rollout.logprob_kind, view.temperature, view.top_p_set,
                                  view.numerics)
    raw_lp = trainer_logprobs(view.logits, packed, logprob_kinds.RAW, view.temperature, None, view.numerics)
    if shifted:
        sampled_lp, raw_lp = controls.shift_by_one(sampled_lp, mask), controls.shift_by_one(raw_lp, mask)
    subject = f"{rollout.engine} {rollout.engine_layout} sampled ({rollout.logprob_kind})"
    outside = metrics.outside_top_p_share(view.top_p_set, packed.targets.to(view.logits.device),
                                          packed.row_mask.to(view.logits.device))
    comparisons += metrics.mismatch_comparisons(subject, sampled_lp, engine_lp, mask, tol, outside_share=outside)
    mismatch_hist[subject] = (sampled_lp - engine_lp)[mask]
    for name, rows in scored.items():
        subject = f"{engine} {name} teacher-forced (raw)"
        comparisons += metrics.mismatch_comparisons(subject, raw_lp, rows, mask, tol, bitwise=bitwise)
        mismatch_hist[subject] = (raw_lp - rows)[mask]
    return comparisons, mismatch_hist, layout_hist


def trainer_layout_comparisons(results, mask: np.ndarray, tol) -> Tuple[List[metrics.Comparison], dict]:
    """Every trainer layout's result against tp1 (a fused layout's against its own baseline), and the per-token
    differences for the histogram. `results` in layout order, tp1 first (or empty)."""
    comparisons: List[metrics.Comparison] = []
    layout_hist = {}
    for result in results[1:]:
        base = result.baseline or results[0]  # a fused layout's own baseline (trainer.py), else tp1
        comparisons += metrics.trainer_comparisons(base, result, mask, tol)
        label = result.layout.name if base is results[0] else f"{result.layout.name} - {base.layout.name}"
        layout_hist[label] = (result.log_probs - base.log_probs)[mask]
    return comparisons, layout_hist


def open_engine(s: Settings, layout, model, device, info):
    if s.engine == "hf":
        return hf_engine.HFEngine(model, layout, device, progress=_progress)
    options = dataclasses.replace(s.sglang, dtype=s.dtype, seed=s.seed, log_dir=s.report_dir)
    if s.sglang_dump_tensors:
        options = dataclasses.replace(options, tensor_dump_dir=os.path.join(s.report_dir, ENGINE_DUMP_NAME,
                                                                            layout.name))
    if s.trainer_numerics == trainer.SGLANG_ON_POLICY:  # the server picks the trainer's batch-invariant matmul
        from sglang_checks import on_policy

        options = dataclasses.replace(options, extra_env=options.extra_env + tuple(on_policy.SGLANG_ENV.items()))
    return sglang_engine.SGLangEngine(info.path, layout, options)


def _check_replay_flags(replay, s: Settings) -> None:
    """Sampling flags given together with --rollout_data must agree with the rollout (its log-probs used them)."""
    for name in ("temperature", "top_p", "max_new_tokens"):
        if name not in s.explicit_flags:
            continue
        given, saved = getattr(s, name), getattr(replay, name)
        if given != saved:
            hint = "; to score at another temperature use --trainer_temperature" if name == "temperature" else ""
            raise CheckError(f"--{name}={given} differs from the replayed rollout's {name}={saved} "
                             f"({s.rollout_data}){hint}")


def _check_prompt_lengths(prompt_ids, s: Settings) -> None:
    if s.seq_len:
        longest = max(len(p) for p in prompt_ids) + s.max_new_tokens
        if longest > s.seq_len:
            raise CheckError(f"--seq_len={s.seq_len}: prompts of up to {longest - s.max_new_tokens} tokens plus "
                             f"--max_new_tokens={s.max_new_tokens} need up to {longest}")


def to_rows(scores: List[List[float]], rollout, seq_len: int) -> np.ndarray:
    """Per-sample completion log-probs -> [B, S] at the rows that predict them (as rollout.pack lays out)."""
    rows = np.zeros((len(rollout.samples), seq_len), dtype=np.float32)
    for b, (sample, values) in enumerate(zip(rollout.samples, scores)):
        first = len(sample.prompt_ids) - 1
        rows[b, first:first + len(values)] = values
    return rows


def trainer_logprobs(logits, packed, kind: str, trainer_temperature: float, top_p_set,
                     numerics: str = trainer.HF) -> np.ndarray:
    """The trainer's log-probs of `kind` at TP=1 (in this process, no process group), [B, S] fp32."""
    temperature, keep = logprob_kinds.trainer_arguments(kind, trainer_temperature, top_p_set)
    device = logits.device
    with torch.no_grad():
        out = trainer.log_probs_and_entropy(logits, packed.targets.to(device), numerics=numerics,
                                            temperature=temperature, keep_mask=keep,
                                            row_mask=packed.row_mask.to(device))
    return out.log_probs.float().cpu().numpy()
