"""The bench: forward + backward time, host time, bandwidth and peak memory of ppo_ops and its baselines.

    python3 tools/bench/bench.py --suite=headline --out_dir=/tmp/bench                 # one GPU, TP=1
    python3 tools/bench/bench.py --suite=tp2 --tp=2 --out_dir=/tmp/bench               # two GPUs over NCCL
    bazel run --config=gpu //tools:bench -- --suite=lm_head --out_dir=$PWD/bench_out
    python3 tools/bench/bench.py --smoke --out_dir=/tmp/b                              # every family on CPU, tiny
    python3 tools/bench/bench.py --render_only --out_dir=/tmp/bench                    # the report again

Families, each one module on the shared runner (runner.py): logits.py (the logits op: suites headline, tp_ref,
sweep, options, grid, tp2, sglang_order, small_call, keep_set), lm_head.py (the fused LM head: lm_head, lm_head_own,
lm_head_small, lm_head_keep, lm_head_exact, lm_head_seq), step.py (a whole RL step: whole_step, lm_head_step,
megatron_step, megatron_step_flash). One run may name suites of several families; `--suite=custom` is the cross
product of the list flags (each provider in the first family that has it: logits, step, lm_head). `--smoke` runs
every family's tiny cases (on the CPU unless --device is given, with few repetitions): the plumbing, as the tests
run it.

Every measured case is appended to one long-format CSV (--csv in --out_dir, report.COLUMNS, a `family` column) as
soon as it is measured; the Markdown report (and the PNG where --png names one) is rendered from the whole CSV at the
end. With --rounds=N the case list runs N times, every other round reversed; each row records its round and the
report pairs a row with its baseline round by round (report.py). With --tp=N the bench spawns N ranks (NCCL on CUDA,
gloo on CPU); rank 0 records the slowest rank's quantiles.

Exit code: 0 when every case ran or was skipped with its reason, 1 when one of ours hit an unexpected error or failed
its check, 2 on a bad flag or an unwritable --out_dir (one line on stderr, before any case runs), 130 when
interrupted.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import sys
import tempfile

if __package__ in (None, ""):
    # Run as a script: the repository root importable (not resolved, so a Bazel runfiles tree stays itself).
    sys.path.insert(0, str(pathlib.Path(os.path.abspath(__file__)).parents[2]))

from absl import app, flags

from ppo_ops.runtime import cli

_SUITE = flags.DEFINE_list("suite", ["headline"], "Named case lists of any family (module docstring), or 'custom'.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Every family's tiny cases (the plumbing): on the CPU unless --device is "
                           "given; --warmup, --min_reps, --max_reps, --copy_mib, --warm_max_s and --steady_s default "
                           "to the least.")
_PROVIDERS = flags.DEFINE_list("providers", None, "Only these providers (default: every provider of the suites).")
_TOKENS = flags.DEFINE_list("tokens", ["4096", "8192", "16384"], "custom: T values.")
_VOCAB = flags.DEFINE_list("vocab", ["151936"], "custom: global vocabulary sizes V.")
_DTYPES = flags.DEFINE_list("dtypes", ["bf16", "fp32"], "custom: logits dtypes (bf16, fp32).")
_ENTROPY = flags.DEFINE_list("entropy", ["none", "value", "grad"], "custom: entropy modes.")
_KEEP_MASK = flags.DEFINE_list("keep_mask", ["off", "on"], "custom: keep mask off/on.")
_ROW_FRAC = flags.DEFINE_list("row_frac", ["1.0", "0.1"], "custom: fractions of rows kept by the row mask.")
_VALIDATE = flags.DEFINE_list("validate", ["on"], "custom: ppo_ops validate on/off.")
_INPLACE = flags.DEFINE_list("inplace_grad", ["off"], "custom: ppo_ops inplace_grad off/on.")
_TP = flags.DEFINE_integer("tp", 1, "Tensor-parallel ranks; only cases with this TP run.", lower_bound=1)
_DEVICE = flags.DEFINE_enum("device", "cuda", ["cuda", "cpu"], "cpu exercises the plumbing only.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Directory for the CSV, Markdown and PNG.", required=True)
_CSV = flags.DEFINE_string("csv", "results.csv", "CSV file name in --out_dir (appended to).")
_MD = flags.DEFINE_string("md", "results.md", "Markdown file name in --out_dir.")
_PNG = flags.DEFINE_string("png", "results.png", "Plot file name in --out_dir ('': no plot).")
_RENDER_ONLY = flags.DEFINE_bool("render_only", False, "Only render the report from the existing CSV.")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls before timing (the first compiles).", lower_bound=1)
_MIN_REPS = flags.DEFINE_integer("min_reps", 5, "Fewest timed repetitions.", lower_bound=1)
_MAX_REPS = flags.DEFINE_integer("max_reps", 50, "Most timed repetitions.", lower_bound=1)
_TARGET_MS = flags.DEFINE_float("target_ms", 150.0, "Timed device time per case to aim for (sets the repetitions).")
_COPY_MIB = flags.DEFINE_integer("copy_mib", 2048, "Buffer size of the copy-bandwidth measurement.", lower_bound=1)
_CHECK_ROWS = flags.DEFINE_integer("check_rows", 8, "Rows checked against the float64 reference, the first and last "
                                   "half (0: no check; the LM head's check takes 64 rows unless 0).", lower_bound=0)
_BUDGET = flags.DEFINE_float("time_budget_s", 0.0, "Stop starting cases after this many seconds (0: no limit).")
_WARM_MIN = flags.DEFINE_float("warm_min_s", 10.0, "CUDA: the device warm-up (bf16 GEMMs until their time is steady) "
                               "runs at least this many seconds.", lower_bound=0.0)
_WARM_MAX = flags.DEFINE_float("warm_max_s", 60.0, "CUDA: ... and at most this many (0: no warm-up).", lower_bound=0.0)
_STEADY = flags.DEFINE_float("steady_s", 2.0, "The LM head's cases: also time each back to back for about this many "
                             "seconds (0: not).", lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 1234, "Seed of the random inputs.")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "Measure the case list this many times in one process, every other round "
                               "reversed; the report pairs rows round by round.", lower_bound=1)
_LABEL = flags.DEFINE_string("label", "", "A name for this run, written on each of its rows.")

# --smoke's defaults where the flag is not given: one repetition, a 1 MiB copy, no device warm-up.
SMOKE_DEFAULTS = dict(warmup=1, min_reps=1, max_reps=1, copy_mib=1, warm_max_s=0.0, steady_s=1e-3, check_rows=4)


def main(argv):
    del argv  # the flags parser refused stray arguments
    if not _RENDER_ONLY.value:
        try:  # before the runner imports its providers' packages, so that a usage error comes first
            cases = _cases()
        except ValueError as error:
            raise app.UsageError(str(error)) from error
    out_dir = _writable_folder(_OUT_DIR.value)  # before any case runs: a result lost at the end costs the run
    csv, md = os.path.join(out_dir, _CSV.value), os.path.join(out_dir, _MD.value)
    png = os.path.join(out_dir, _PNG.value) if _PNG.value else ""
    from tools.bench import report

    if _RENDER_ONLY.value:
        report.render(csv, md, png)
        print(f"wrote {md}{' and ' + png if png else ''} from {csv}")
        return 0
    from tools.bench import runner

    smoke = {k: v for k, v in SMOKE_DEFAULTS.items() if _SMOKE.value and not flags.FLAGS[k].present}
    value = {k: smoke.get(k, flags.FLAGS[k].value) for k in SMOKE_DEFAULTS}
    config = runner.BenchConfig(
        cases=cases, tp=_TP.value, device=_device(), csv=csv, warmup=value["warmup"], min_reps=value["min_reps"],
        max_reps=max(value["max_reps"], value["min_reps"]), target_ms=_TARGET_MS.value,
        copy_bytes=value["copy_mib"] << 20, check_rows=value["check_rows"], time_budget_s=_BUDGET.value,
        warm_min_s=_WARM_MIN.value, warm_max_s=value["warm_max_s"], steady_s=value["steady_s"], seed=_SEED.value,
        label=_LABEL.value, rounds=_ROUNDS.value)
    try:
        status = runner.run(config)
    except ValueError as error:  # raised before any case runs (e.g. fewer CUDA devices than --tp)
        raise app.UsageError(str(error)) from error
    report.render(csv, md, png)
    print(f"wrote {csv}, {md}{' and ' + png if png else ''}")
    return status


def _device() -> str:
    return "cpu" if _SMOKE.value and not _DEVICE.present else _DEVICE.value


def _writable_folder(path: str) -> str:
    """--out_dir as an absolute path, made and shown to take a file; else a usage error naming the flag. A relative
    path is where the user ran the command (bazel run changes the working directory)."""
    out_dir = cli.caller_path(path)
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write_test_"):
            pass
    except OSError as error:
        raise app.UsageError(f"--out_dir={path}: not a writable folder ({error.strerror or error})") from error
    return out_dir


def _cases() -> list:
    """The cases of the flags, those of --tp only, duplicates dropped (first occurrence wins)."""
    from tools.bench import lm_head, logits, step

    families = (logits, step, lm_head)  # a provider name in two families is the first one's in custom runs
    known = {p for f in families for p in f.PROVIDERS}
    providers = _PROVIDERS.value
    unknown = sorted(set(providers or ()) - known)
    if unknown:
        raise ValueError(f"--providers: unknown {unknown}; expected some of {sorted(known)}")
    suites = {name: f.SUITES[name] for f in families for name in f.SUITES}
    if _SMOKE.value:
        listed = [c for f in families for c in f.SMOKE()]
    elif _SUITE.value == ["custom"]:
        listed = _custom(families, providers or list(logits.BASELINES))
    else:
        for name in _SUITE.value:
            if name not in suites:
                raise ValueError(f"--suite: unknown suite {name!r}; expected some of {sorted(suites)} or 'custom'")
        listed = [c for name in _SUITE.value for c in suites[name]()]
    cases = list(dict.fromkeys(c for c in listed if c.tp == _TP.value and (not providers or c.provider in providers)))
    for c in cases:
        if c.V % c.tp:
            raise ValueError(f"--vocab: V={c.V} must be divisible by --tp={c.tp}")
    if not cases:
        raise ValueError(f"no case of --suite={','.join(_SUITE.value)} has TP={_TP.value}"
                         + (f" and a provider in {providers}" if providers else ""))
    return cases


def _custom(families, providers: list) -> list:
    """The cross product of the list flags; validate / inplace_grad vary only where a provider calls ppo_ops."""
    from tools.bench import lm_head, logits, step

    tokens, vocab = _ints("tokens", _TOKENS.value), _ints("vocab", _VOCAB.value)
    dtypes = _choices("dtypes", _DTYPES.value, logits.DTYPES)
    entropy = _choices("entropy", _ENTROPY.value, logits.ENTROPY_MODES)
    keep, validate = _bools("keep_mask", _KEEP_MASK.value), _bools("validate", _VALIDATE.value)
    rows, inplace = [_fraction(v) for v in _ROW_FRAC.value], _bools("inplace_grad", _INPLACE.value)
    out = []
    for p in providers:
        family = next(f for f in families if p in f.PROVIDERS)
        if family is lm_head:
            out += [lm_head.case(p, T, V=V, tp=_TP.value) for T, V in itertools.product(tokens, vocab)]
        elif family is step:
            body = p.startswith("mcore_body")  # calls no ppo_ops: one validate
            out += [step.case(p, T, V, dt, v) for T, V, dt in itertools.product(tokens, vocab, dtypes)
                    for v in ([True] if body else validate)]
        else:
            options = (itertools.product(validate, inplace) if p in logits.PPO_OPS + logits.SMALL_CALL
                       else [(None, None)])
            out += [logits.case(p, T, V, dtype=dt, entropy=e, keep_mask=k, row_frac=r, tp=_TP.value, validate=v,
                                inplace_grad=i)
                    for T, V, dt, e, k, r, (v, i) in itertools.product(tokens, vocab, dtypes, entropy, keep, rows,
                                                                       list(options))]
    return out


def _ints(name, values):
    try:
        out = [int(v) for v in values]
    except ValueError:
        raise ValueError(f"--{name}: expected integers, got {values}") from None
    if any(v < 1 for v in out):
        raise ValueError(f"--{name}: expected positive integers, got {values}")
    return out


def _choices(name, values, allowed):
    bad = [v for v in values if v not in allowed]
    if bad:
        raise ValueError(f"--{name}: {bad} not in {list(allowed)}")
    return list(values)


def _bools(name, values):
    return [v == "on" for v in _choices(name, values, ("on", "off"))]


def _fraction(value):
    try:
        f = float(value)
    except ValueError:
        f = -1.0
    if not 0.0 < f <= 1.0:
        raise ValueError(f"--row_frac: expected fractions in (0, 1], got {value!r}")
    return f


if __name__ == "__main__":
    # --help exits 0; a bad flag is one line and exit 2; Ctrl-C is one line and exit 130 (ppo_ops/runtime/cli.py).
    cli.run(main, program="bench")
