"""calibrate: measure every metric of the check on healthy setups and under every negative control; derive thresholds.

    bazel run //sglang_checks:calibrate -- --out_dir=/tmp/cal_cpu                      # CPU fp32, tiny, hf engine
    bazel run //sglang_checks:calibrate -- --engine=sglang --model=qwen3-0.6b-random --dtype=bfloat16 \\
        --engine_layouts=tp1,tp2,dp2 --trainer_layouts=tp1,tp2,cp2,dp2 --sglang_python=... --out_dir=/tmp/cal_sgl
    bazel run //sglang_checks:calibrate -- ... --include=/tmp/cal_sgl/measurements.json --install

Takes every flag of qwen3_parallel_check (the same sampling, model, engine and SGLang settings; sglang_checks/cli.py)
plus the few below. Healthy configurations: every engine layout samples a rollout for every sampling seed (--seeds)
and prompt set (--prompt_sets: the built-in prompts, and random token ids), and teacher-force scores the rollouts of
the first layout; the trainer scores all of them (in this process at TP = 1 for the train-rollout comparisons, and
under every trainer layout on one spawned group of ranks). Each engine layout is started ONCE (an SGLang server
start costs 1-2.5 min) and serves every seed, prompt set and control. Negative controls (controls.py) run against the
first seed's and prompt set's rollout; engine_layout_weights reloads the last engine layout with other weights at the
end (SGLang: /update_weights_from_disk on the running server), so it costs no extra start.

Derivation, per tolerance (tolerances.py names): healthy max = the largest value of its comparisons over all healthy
configurations (at least HEALTHY_FLOOR); broken min = over the controls that must be caught by it (controls.py), the
smallest of each control's largest value. threshold = sqrt(healthy max * broken min), the geometric middle, so it
sits `margin` = sqrt(broken min / healthy max) times above the worst healthy value and as far below the best broken
one. Written to --out_dir: measurements.json (every value), calibration.json (the thresholds, in the format
tolerances.py reads), calibration.md (the table). --include merges earlier measurements (e.g. the other engine's)
before deriving; --install copies calibration.json to sglang_checks/calibration/<dtype>.json in the source tree, where
the check picks it up as its default tolerances.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time
from typing import Dict, List, Optional, Tuple

from absl import flags

from sglang_checks import check, cli, controls, layouts as layouts_lib, metrics, models, prompts, report, tolerances
from sglang_checks import rollout as rollout_lib, trainer
from sglang_checks.engines import hf_engine
from sglang_checks.errors import CheckError
from ppo_ops.runtime import cli as runtime_cli

flags.adopt_module_key_flags(cli)  # --help lists the check's flags too (calibrate takes all of them)

_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where measurements.json, calibration.json and calibration.md go.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Sampling seeds of the healthy rollouts (the model's weights "
                           "stay those of --seed).")
_PROMPT_SETS = flags.DEFINE_list("prompt_sets", ["builtin", "random"], "Prompt sets: builtin (the check's "
                                 "prompts) and random (seeded random token ids).")
_INCLUDE = flags.DEFINE_list("include", [], "measurements.json files of earlier calibrate runs to merge before "
                             "deriving (same dtype).")
_INSTALL = flags.DEFINE_bool("install", False, "Copy calibration.json to sglang_checks/calibration/<dtype>.json in "
                             "the source tree (the check's default tolerances from then on).")

# Healthy values below fp32's resolution of O(1) log-probs (eps 1.2e-7) are rounding noise or exact zeros; the
# healthy side is taken as at least this, so a threshold always sits above rounding.
HEALTHY_FLOOR = 1.2e-7
# A separation (broken min / healthy max) below MIN_MARGIN**2 leaves the threshold within 2x of one side: flagged.
MIN_MARGIN = 2.0
# Random prompt set: lengths drawn from this range (as short and as long as the built-in prompts, in tokens).
RANDOM_PROMPT_LENGTHS = (4, 32)
VOCAB_OFFSET_LAYOUT = "tp2_vocab_offset"


def _log(message: str) -> None:
    print(f"[calibrate] {message}", file=sys.stderr, flush=True)


def prompt_set(name: str, n: int, info, seed: int) -> List[List[int]]:
    if name == "builtin":
        return prompts.built_in_prompts(n, prompts.Tokenize(info.path if info.has_tokenizer else None))
    if name == "random":
        import numpy as np

        rng = np.random.default_rng(seed)
        return [rng.integers(0, info.vocab_size, rng.integers(*RANDOM_PROMPT_LENGTHS)).tolist() for _ in range(n)]
    raise CheckError(f"--prompt_sets: unknown prompt set {name!r}; expected builtin or random")


@dataclasses.dataclass
class Row:
    """One measured value: a comparison of a healthy configuration or of a control's run."""

    kind: str  # "healthy" or "control"
    control: str
    engine: str
    config: str  # engine layout / seed / prompt set it came from
    section: str
    subject: str
    metric: str
    tolerance_name: str
    value: float


def _rows(kind, control, engine, config, comparisons) -> List[Row]:
    return [Row(kind, control, engine, config, c.section, c.subject, c.metric, c.tolerance_name, float(c.value))
            for c in comparisons if c.tolerance_name in tolerances.DEFAULTS]


def _config(layout_name: str, key: tuple) -> str:
    """Where a healthy engine row comes from: the layout that sampled, the sampling seed, the prompt set."""
    seed, prompt_set_name = key
    return f"{layout_name} sampled, seed {seed}, {prompt_set_name}"


def measure(s: check.Settings, seeds: List[int], prompt_sets: List[str]) -> Tuple[List[Row], List[dict]]:
    """Every healthy configuration and every control; returns the rows and the engines' info."""
    plan = check.validate_inputs(s)
    view = _trainer_view_of(s, plan)
    m = _load_both_models(s, plan)
    sets = {name: prompt_set(name, s.num_prompts, m.info, seed=1000 + n) for n, name in enumerate(prompt_sets)}
    keys = [(seed, name) for seed in seeds for name in prompt_sets]
    runs = _sample_and_score_on_every_engine_layout(s, plan, m, sets, keys)
    tol = tolerances.resolve_all({}, s.dtype)
    rows, packed, views = _healthy_engine_rows(s, plan, m.model, runs, keys, tol, view)
    rows += _control_rows(s, m, runs, packed[keys[0]], views[keys[0]], keys[0], tol, view)
    del m  # the trainer ranks need the memory the models hold
    rows += _trainer_rows(s, plan, packed, views, keys, tol)
    return rows, runs.infos


def _trainer_view_of(s: check.Settings, plan: check.Plan):
    """check.trainer_view in the run's trainer numerics (--trainer_numerics: on-policy views run SGLang's kernels)."""
    kernels = None
    if s.trainer_numerics == trainer.SGLANG_ON_POLICY:
        from sglang_checks import on_policy

        kernels = on_policy.sglang_kernels(plan.sglang_site)

    def view(model, packed, rollout, temperature, top_p):
        return check.trainer_view(model, packed, rollout, temperature, top_p, numerics=s.trainer_numerics,
                                  kernels=kernels)
    return view


def _load_both_models(s: check.Settings, plan: check.Plan) -> check.Models:
    """The model under check and the other weights (seed + 1) of the weight controls, both loaded."""
    info = models.resolve_model(s.model, cache_dir=s.cache_dir, seed=s.seed, log=_log)
    other = models.resolve_model(s.model, cache_dir=s.cache_dir, seed=s.seed + controls.WEIGHTS_SEED_OFFSET,
                                 log=_log) if s.model in models.PRESETS else None
    if other is None:
        raise CheckError(f"--model={s.model}: the weight controls need a generated model ({', '.join(models.PRESETS)})")
    import torch

    dtype = getattr(torch, s.dtype)
    model = models.load_hf_model(info, dtype=dtype, device=plan.device)
    return check.Models(info=info, model=model, trainer_model=model, other=other,
                        other_model=models.load_hf_model(other, dtype=dtype, device=plan.device))


@dataclasses.dataclass
class _EngineRuns:
    """What the engine layouts produced, by (sampling seed, prompt set) key."""

    first: str  # the first engine layout's name: its rollouts are the ones every layout scores
    last: str  # the last one's: it serves the other weights of engine_layout_weights
    canonical: Dict[tuple, rollout_lib.Rollout]  # the first layout's rollouts
    own: Dict[str, Dict[tuple, rollout_lib.Rollout]]  # every layout's own rollouts
    scores: Dict[str, Dict[tuple, list]]  # every layout's teacher-forced scores of the canonical rollouts
    other_scores: Optional[list]  # the last layout's scores of the first rollout with the other weights
    infos: List[dict]  # each engine's info for the report


def _sample_and_score_on_every_engine_layout(s: check.Settings, plan: check.Plan, m: check.Models,
                                             sets: Dict[str, List[List[int]]], keys: List[tuple]) -> _EngineRuns:
    """Each engine layout started once: it samples a rollout per key, teacher-force scores the first layout's, and,
    when it is the last of several, scores the first rollout again with the other weights."""
    layouts = plan.engine_layouts
    runs = _EngineRuns(first=layouts[0].name, last=layouts[-1].name, canonical={}, own={}, scores={},
                       other_scores=None, infos=[])
    for index, layout in enumerate(layouts):
        t0 = time.monotonic()
        with check.open_engine(s, layout, m.model, plan.device, m.info) as engine:
            runs.own[layout.name] = {key: check.sample_rollout(s, engine, layout, m.info, sets[key[1]], key[0])
                                     for key in keys}
            if index == 0:
                runs.canonical = dict(runs.own[layout.name])
            runs.scores[layout.name] = {key: engine.score(runs.canonical[key].samples) for key in keys}
            runs.infos.append(engine.info())
            if layout.name == runs.last and len(layouts) > 1:  # engine_layout_weights, on the last layout
                runs.other_scores = _score_with_other_weights(s, engine, layout, plan, m,
                                                              runs.canonical[keys[0]].samples)
        _log(f"engine layout {layout.name}: {time.monotonic() - t0:.1f} s")
    return runs


def _score_with_other_weights(s: check.Settings, engine, layout, plan: check.Plan, m: check.Models, samples):
    """SGLang reloads the running server with the other weights; the hf engine scores on a second model."""
    if s.engine == "sglang":
        engine.load_weights(m.other.path)
        return engine.score(samples)
    with hf_engine.HFEngine(m.other_model, layout, plan.device) as other_engine:
        return other_engine.score(samples)


def _healthy_engine_rows(s: check.Settings, plan: check.Plan, model, runs: _EngineRuns, keys: List[tuple], tol,
                         view):
    """Per key: the first layout's rollout against the trainer at TP = 1 and against every layout's scores, and every
    other layout's own rollout against the trainer. Returns the rows and, per key, the first layout's packed rollout
    and trainer view (the controls and the trainer layouts start from them)."""
    rows: List[Row] = []
    packed, views = {}, {}
    for key in keys:
        r = runs.canonical[key]
        packed[key] = rollout_lib.pack(r, layouts_lib.auto_seq_len(r.longest, plan.trainer_layouts))
        views[key] = view(model, packed[key], r, r.temperature, r.top_p)
        engine_scores = {name: runs.scores[name][key] for name in runs.scores}
        comparisons, _, _ = check.compare(r, packed[key], [], engine_scores, views[key], tol, engine=s.engine,
                                          first_layout=runs.first)
        rows += _rows("healthy", controls.NONE, s.engine, _config(runs.first, key), comparisons)
        for name, by_key in runs.own.items():
            if name == runs.first:
                continue
            o = by_key[key]
            p = rollout_lib.pack(o, layouts_lib.auto_seq_len(o.longest, plan.trainer_layouts))
            comparisons, _, _ = check.compare(o, p, [], {}, view(model, p, o, o.temperature, o.top_p),
                                              tol, engine=s.engine, first_layout=runs.first)
            rows += _rows("healthy", controls.NONE, s.engine, _config(name, key), comparisons)
    return rows, packed, views


def _control_rows(s: check.Settings, m: check.Models, runs: _EngineRuns, p0, v0, key0: tuple, tol,
                  view) -> List[Row]:
    """Every negative control but vocab_offset (a trainer layout: _trainer_rows), on the first key's rollout."""
    r0 = runs.canonical[key0]
    all_scores0 = {name: runs.scores[name][key0] for name in runs.scores}

    def control(name, view, engine_scores, **kw):
        comparisons, _, _ = check.compare(r0, p0, [], engine_scores, view, tol, engine=s.engine,
                                          first_layout=runs.first, **kw)
        return _rows("control", name, s.engine, _config(runs.first, key0), comparisons)

    rows = control(controls.TRAINER_TEMPERATURE, view(
        m.model, p0, r0, r0.temperature * controls.TEMPERATURE_FACTOR, r0.top_p), {})
    rows += control(controls.TRAINER_TOP_P, view(m.model, p0, r0, r0.temperature, controls.CONTROL_TOP_P), {})
    rows += control(controls.TRAINER_WEIGHTS, view(m.other_model, p0, r0, r0.temperature, r0.top_p), all_scores0)
    if s.expect_bitwise:  # a fault only exact equality can see
        rows += control(controls.TRAINER_WEIGHT_ULP, view(controls.one_ulp_off(m.model), p0, r0, r0.temperature,
                                                           r0.top_p), all_scores0)
    rows += control(controls.SHIFTED_LOGPROBS, v0, all_scores0, shifted=True)
    if runs.other_scores is not None:
        rows += control(controls.ENGINE_LAYOUT_WEIGHTS, v0,
                        {runs.first: runs.scores[runs.first][key0], runs.last: runs.other_scores})
    return rows


def _trainer_rows(s: check.Settings, plan: check.Plan, packed, views, keys: List[tuple], tol) -> List[Row]:
    """Every trainer layout on every key's rollout, on one spawned group of ranks; the first key's also under a
    tp2 layout with the vocab_offset fault. Empties `views` once the ranks' inputs are built (their memory)."""
    key0 = keys[0]
    jobs = []
    for key in keys:
        layouts = list(plan.trainer_layouts)
        faulty = ()
        if key == key0 and _ranks_available(plan) >= 2:
            layouts.append(layouts_lib.Layout(VOCAB_OFFSET_LAYOUT, tp=2))
            faulty = (VOCAB_OFFSET_LAYOUT,)
        elif key == key0:
            _log(f"{controls.VOCAB_OFFSET}: not run (its tp2 trainer layout needs two ranks; NCCL puts one on each "
                 f"GPU and {_ranks_available(plan)} is visible)")
        jobs.append(trainer.Job(check.trainer_inputs(views[key], packed[key], s.entropy_coef,
                                                     sglang_site=plan.sglang_site), layouts, faulty))
    views.clear()
    t0 = time.monotonic()
    results = trainer.run_jobs(jobs, backend=plan.backend, threads=s.cpu_threads, timeout_s=s.trainer_timeout_s)
    _log(f"trainer layouts, {len(jobs)} rollouts: {time.monotonic() - t0:.1f} s")
    rows: List[Row] = []
    for key, job_results in zip(keys, results):
        mask = packed[key].row_mask.numpy()
        for result in job_results[1:]:
            comparisons = metrics.trainer_comparisons(result.baseline or job_results[0], result, mask, tol)
            if result.layout.name == VOCAB_OFFSET_LAYOUT:
                rows += _rows("control", controls.VOCAB_OFFSET, s.engine, _config(plan.engine_layouts[0].name, key0),
                              comparisons)
            else:
                seed, prompt_set_name = key
                rows += _rows("healthy", controls.NONE, s.engine, f"trainer {result.layout.name}, seed {seed}, "
                              f"{prompt_set_name}", comparisons)
    return rows


def _ranks_available(plan: check.Plan) -> int:
    if plan.backend != "nccl":
        return 2
    import torch

    return torch.cuda.device_count()


def derive(rows: List[dict]) -> List[dict]:
    """One entry per tolerance: healthy max, broken min, threshold, margin (see the module docstring)."""
    out = []
    for name in tolerances.DEFAULTS:
        healthy = [r for r in rows if r["kind"] == "healthy" and r["tolerance_name"] == name]
        by_control = {}
        for r in rows:
            if (r["kind"] == "control" and r["tolerance_name"] == name and r["control"] in controls.CONTROLS
                    and name in controls.CONTROLS[r["control"]][1]):
                if r["control"] not in by_control or r["value"] > by_control[r["control"]]["value"]:
                    by_control[r["control"]] = r
        entry = {"name": name, "healthy_n": len(healthy), "controls": sorted(by_control)}
        if not healthy or not by_control:
            entry.update(status="not measured")
            out.append(entry)
            continue
        worst = max(healthy, key=lambda r: r["value"])
        best = min(by_control.values(), key=lambda r: r["value"])
        h, b = max(worst["value"], HEALTHY_FLOOR), best["value"]
        entry.update(healthy_max=worst["value"], healthy_where=f"{worst['engine']}: {worst['config']}: "
                     f"{worst['subject']}: {worst['metric']}", broken_min=b,
                     broken_where=f"{best['control']}: {best['subject']}: {best['metric']}")
        if not (math.isfinite(b) and b > h):
            entry.update(status="NOT SEPARATED")
        else:
            margin = math.sqrt(b / h)
            entry.update(value=math.sqrt(h * b), margin=margin, status="ok" if margin >= MIN_MARGIN else "weak")
        out.append(entry)
    return out


def violations(rows: List[dict], dtype: str) -> List[str]:
    """Where the tolerances in use for `dtype` (tolerances.resolve) do not do their job on measured rows: a healthy
    value above its threshold (a false FAIL), or a negative control whose largest value on a metric that must catch it
    is not above the threshold (a fault that would PASS). Empty when every healthy run passes and every control fails
    with its metric."""
    found = []
    for r in rows:
        limit = tolerances.resolve(r["tolerance_name"], None, dtype)
        if r["kind"] == "healthy" and r["value"] > limit:
            found.append(f"healthy {r['engine']} {r['config']}: {r['subject']}: {r['metric']} = {r['value']:.3g} > "
                         f"{r['tolerance_name']} {limit:.3g}")
    for control, (_, caught_by) in controls.CONTROLS.items():
        for name in caught_by:
            values = [r["value"] for r in rows
                      if r["kind"] == "control" and r["control"] == control and r["tolerance_name"] == name]
            limit = tolerances.resolve(name, None, dtype)
            if not values:
                found.append(f"control {control}: no {name} comparison measured")
            elif max(values) <= limit:
                found.append(f"control {control}: largest {name} value {max(values):.3g} <= {limit:.3g}: it would pass")
    return found


# The comparisons exact equality is demanded of (--expect_bitwise): trainer vs engine teacher-forced, engine layouts,
# trainer layouts. Sampled log-probs come from the engine's decode kernels, another reduction order.
BITWISE_TOLERANCES = ("mismatch_tol", "kl_tol", "engine_layout_tol", "trainer_logprob_atol", "trainer_rtol")


def _exact_subject(r: dict) -> bool:
    if r["tolerance_name"] not in BITWISE_TOLERANCES or "sampled" in r["subject"]:
        return False
    # A fused layout's gradients come from the head's own dX and dW GEMMs, not from the logits path's: they are held
    # to trainer_rtol; its log-probs and entropies (trainer_logprob_atol) are exact.
    return not (r["tolerance_name"] == "trainer_rtol" and f"{layouts_lib.FUSED_SUFFIX} vs " in r["subject"])


def bitwise_table(rows: List[dict]) -> List[dict]:
    """Under --expect_bitwise: per healthy configuration the largest exact-equality value (must be 0), per control
    the largest value of the metrics that catch it (must not be 0; a bitwise control: of the exact-equality ones)."""
    out = []
    for config in sorted({r["config"] for r in rows if r["kind"] == "healthy"}):
        values = [r["value"] for r in rows if r["kind"] == "healthy" and r["config"] == config and _exact_subject(r)]
        if values:
            out.append({"kind": "healthy", "what": config, "max": max(values), "ok": max(values) == 0.0})
    for control in sorted({r["control"] for r in rows if r["kind"] == "control"}):
        caught_by = controls.CONTROLS.get(control, (None, ()))[1]
        values = [r["value"] for r in rows if r["kind"] == "control" and r["control"] == control
                  and (r["tolerance_name"] in caught_by if caught_by else _exact_subject(r))]
        if values:
            out.append({"kind": "control", "what": control, "max": max(values), "ok": max(values) > 0.0})
    return out


def bitwise_markdown(table: List[dict]) -> str:
    lines = ["", "#### Exact equality (--expect_bitwise)", "",
             "Healthy: the largest trainer-engine (teacher-forced), engine-layout and trainer-layout difference, "
             "which must be 0. Controls: the largest value of the metrics that catch each, which must not be.", "",
             "| | configuration or control | largest value | verdict |", "|---|---|---|---|"]
    lines += [f"| {e['kind']} | {e['what']} | {e['max']:.3g} | {'ok' if e['ok'] else 'VIOLATED'} |" for e in table]
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def markdown(table: List[dict], *, source: str, dtype: str) -> str:
    lines = [f"### {dtype}: {source}", "",
             "| tolerance | healthy max | broken min (control) | derived threshold | margin | in use | status |",
             "|---|---|---|---|---|---|---|"]
    for e in table:
        in_use = tolerances.resolve(e["name"], None, dtype)
        broken = f"{_fmt(e.get('broken_min'))} ({', '.join(e['controls'])})" if e.get("controls") else "-"
        lines.append(f"| `{e['name']}` | {_fmt(e.get('healthy_max'))} | {broken} | {_fmt(e.get('value'))} | "
                     f"{_fmt(e.get('margin'))}x | {in_use:.3g} | {e['status']} |")
    lines += ["", "Where the extremes come from:", ""]
    for e in table:
        if "healthy_where" in e:
            lines.append(f"- `{e['name']}`: worst healthy {e['healthy_where']}; best broken {e['broken_where']}")
    return "\n".join(lines) + "\n"


def _source_tree() -> str:
    return os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv):
    del argv  # the flags parser refused stray arguments
    try:
        s = cli.settings_from_flags()
        if not _OUT_DIR.value:
            raise CheckError("--out_dir: required (where the calibration table goes)")
        try:
            seeds = [int(x) for x in _SEEDS.value]
        except ValueError as exc:
            raise CheckError(f"--seeds: expected integers, got {_SEEDS.value}") from exc
        out = runtime_cli.caller_path(_OUT_DIR.value)
        check.check_writable("--out_dir", out)
        with report.folder_lock("--out_dir", out):  # one calibration at a time writes a folder
            return _calibrate(dataclasses.replace(s, report_dir=os.path.join(out, "logs")), out, seeds)
    except CheckError as exc:
        print(f"calibrate: error: {runtime_cli.one_line(exc)}", file=sys.stderr, flush=True)
        return check.EXIT_BAD_INPUT


def _calibrate(s: check.Settings, out: str, seeds: List[int]) -> int:
    included = _read_included(_INCLUDE.value, s.dtype)
    t0 = time.monotonic()
    rows, infos = measure(s, seeds, _PROMPT_SETS.value)
    runs = [_run_record(s, seeds, rows, infos, wall_s=time.monotonic() - t0)]
    runs += [r for inc in included for r in inc.get("runs", [inc])]
    all_rows = [row for r in runs for row in r["rows"]]
    table = derive(all_rows)
    calibration = _write_tables(out, s.dtype, runs, table)
    exact = bitwise_table(all_rows) if s.expect_bitwise else []
    if exact:
        with open(os.path.join(out, "calibration.md"), "a") as f:
            f.write(bitwise_markdown(exact))
        print(bitwise_markdown(exact))
        if not all(e["ok"] for e in exact):
            print("calibrate: exact equality VIOLATED (calibration.md)")
            return 1
    if _INSTALL.value:
        _install(calibration, s.dtype)
    bad = [e["name"] for e in table if e["status"] not in ("ok", "weak")]
    print(f"calibrate: {len(all_rows)} values, wrote {out}/calibration.md, calibration.json, measurements.json"
          + (f"; NOT separated or not measured: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


def _read_included(paths: List[str], dtype: str) -> List[dict]:
    """The measurements.json files of --include, each checked to be of `dtype`."""
    included = []
    for path in map(runtime_cli.caller_path, paths):
        try:
            with open(path) as f:
                included.append(json.load(f))
        except (OSError, ValueError) as exc:
            raise CheckError(f"--include={path}: cannot read measurements ({exc})") from exc
        if included[-1].get("dtype") != dtype:
            raise CheckError(f"--include={path}: measured in {included[-1].get('dtype')}, not --dtype={dtype}")
    return included


def _run_record(s: check.Settings, seeds: List[int], rows: List[Row], infos: List[dict], *, wall_s: float) -> dict:
    """This run in measurements.json: what was measured where, and every row."""
    import torch

    device = torch.cuda.get_device_name(0) if s.device != "cpu" and torch.cuda.is_available() else "CPU"
    return {"engine": s.engine, "model": s.model, "dtype": s.dtype, "device": device, "engines": infos,
            "engine_layouts": s.engine_layouts, "trainer_layouts": s.trainer_layouts, "seeds": seeds,
            "prompt_sets": _PROMPT_SETS.value, "num_prompts": s.num_prompts,
            "samples_per_prompt": s.samples_per_prompt, "max_new_tokens": s.max_new_tokens,
            "date": datetime.date.today().isoformat(), "wall_s": round(wall_s, 1),
            "rows": [dataclasses.asdict(r) for r in rows]}


def _write_tables(out: str, dtype: str, runs: List[dict], table: List[dict]) -> dict:
    """measurements.json, calibration.json and calibration.md into `out`, the table also on stdout; returns the
    calibration (the thresholds in the format tolerances.py reads)."""
    source = "; ".join(f"{r['engine']} engine, {r['model']}, {r['dtype']}, {r['device']}, engine layouts "
                       f"{r['engine_layouts']}, seeds {r['seeds']}, prompt sets {r['prompt_sets']}, {r['date']}"
                       for r in runs)
    measurements = {"dtype": dtype, "runs": runs}
    report.write_atomic(os.path.join(out, "measurements.json"), json.dumps(measurements, indent=1))
    calibration = {"source": source, "dtype": dtype,
                   "thresholds": {e["name"]: {k: e[k] for k in ("value", "healthy_max", "broken_min", "margin")}
                                  for e in table if e["status"] in ("ok", "weak")},
                   "table": table}
    report.write_atomic(os.path.join(out, "calibration.json"), json.dumps(calibration, indent=1))
    report.write_atomic(os.path.join(out, "calibration.md"), markdown(table, source=source, dtype=dtype))
    print(markdown(table, source=source, dtype=dtype))
    return calibration


def _install(calibration: dict, dtype: str) -> None:
    """--install: the calibration becomes the check's default tolerances for `dtype` (tolerances.py reads it)."""
    target = os.path.join(_source_tree(), "sglang_checks", "calibration", f"{dtype}.json")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    report.write_atomic(target, json.dumps(calibration, indent=1))  # the check never reads half a table
    print(f"calibrate: installed {target}")


if __name__ == "__main__":
    # --help exits 0; a bad flag is one line and exit 2; Ctrl-C is one line and exit 130 (ppo_ops/runtime/cli.py).
    runtime_cli.run(main, program="calibrate")
