"""Forward + backward bench of per-token log-prob and entropy over vocab-split logits.

    python3 tools/bench/bench.py --suite=headline --out_dir=/tmp/bench          # one GPU, TP=1
    python3 tools/bench/bench.py --suite=tp2 --tp=2 --out_dir=/tmp/bench        # two GPUs over NCCL
    bazel run //tools:bench -- --suite=headline --out_dir=$PWD/bench_out
    python3 tools/bench/bench.py --device=cpu --suite=smoke --out_dir=/tmp/b    # plumbing only (tests)
    python3 tools/bench/bench.py --suite=whole_step --out_dir=/tmp/bench        # RL step through random Qwen3-0.6B
    bazel run //tools:bench -- --suite=lm_head --out_dir=...   # the fused LM head from hidden states (lm_head.py)
    python3 tools/bench/bench.py --suite=lm_head_pieces --out_dir=/tmp/bench    # the segment GEMMs' pieces, CUDA
    python3 tools/bench/bench.py --suite=small_call --out_dir=/tmp/bench --min_reps=200 --max_reps=4000 \
        --target_ms=1500 --providers=eager,eager_own_path,compiled,reduce_overhead,floor_eager,floor_compiled,\
floor_reduce_overhead
        # the logits op's small calls (T = 1024, 8192): eager (eager_own_path: without the replay of repeated calls),
        # torch.compile, reduce-overhead, each with its host time,
        # and the same modes of an op doing one kernel each way (floor_*: what torch itself takes on this host);
        # ~1.5 s a case, since a host's slow phases last longer than the default 50 repetitions of a small call

Families: a suite belongs to the logits op's family (logits.py: results.csv / .md / .png, named by --csv, --md,
--png) or the LM head's (lm_head.py: lm_head.csv and lm_head.md); one run measures suites of one family, each the
same way (runner.py). lm_head_pieces is no case list: it times the segment GEMMs' pieces alone (lm_head_pieces.py) at
T = 8192, or at each --tokens value given, into pieces.csv.

Flow: build the case list (named suites in priority order, or --suite=custom: the cross product of the list flags);
measure the device copy bandwidth; then for each case, while the time budget lasts: skip it with a printed reason if
its provider cannot run it, make (or reuse) its seeded inputs, check the provider's forward against the float64
reference on a few rows, warm up, measure peak extra memory over one step, time the steps (device time, and the
host's wall time in each call: host_ms). Each case is appended to the CSV as soon as it is measured (a run cut short
keeps what it measured); the Markdown and PNG are rendered from the whole CSV at the end (or alone, --render_only).
An out-of-memory case is recorded as "OOM" and the run goes on; an unexpected error is recorded with its message and
makes the exit status non-zero once everything is written.

With --rounds=N the case list runs N times in one process, every other round reversed; each row records its round,
and the targets that set one way against another (the small calls, the keep set, the Megatron step: paired.py)
judge the median over rounds of the per-round difference: on a host whose phases move a step's time by more than
the difference judged, the ways are then measured side by side, early and late.

With --tp=N the bench spawns N ranks (NCCL on CUDA, gloo on CPU; rank r uses GPU r); every rank runs every case in
lockstep and rank 0 records, per case, the slowest rank's quantiles and largest peak memory.

Exit code: 0 when every case ran or was skipped with its reason, 1 when one hit an unexpected error or failed its
check, 2 on a bad flag or an unwritable --out_dir (one line on stderr, before any case runs), 130 when interrupted.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

if __package__ in (None, ""):
    # Run as a script (python3 tools/bench/bench.py): make the repository root importable. Not resolved, so a Bazel
    # runfiles tree stays itself.
    sys.path.insert(0, str(pathlib.Path(os.path.abspath(__file__)).parents[2]))

from absl import app, flags

from ppo_ops.runtime import cli

PIECES_SUITE = "lm_head_pieces"
# The LM head's record has fixed names (its docs and tables link them).
LM_HEAD_CSV, LM_HEAD_MD = "lm_head.csv", "lm_head.md"

_SUITE = flags.DEFINE_list("suite", ["headline"], "Named case lists (tools/bench/cases.py SUITES, e.g. small_call "
                           "with --providers=eager,eager_own_path,compiled,reduce_overhead and their floor_*), "
                           "'custom', or "
                           f"'{PIECES_SUITE}'.")
_PROVIDERS = flags.DEFINE_list("providers", ["triton", "torch", "legacy", "naive", "liger", "qwen3_step"],
                               "Providers to run (filters the suites too; the LM head's suites only when given).")
_TOKENS = flags.DEFINE_list("tokens", ["4096", "8192", "16384"], f"custom: T values; {PIECES_SUITE}: its T values "
                            "when given (else 8192).")
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
_PNG = flags.DEFINE_string("png", "results.png", "Plot file name in --out_dir.")
_RENDER_ONLY = flags.DEFINE_bool("render_only", False, "Only render the report from the existing CSV (of the --suite's "
                                  "family: the LM head's suites render lm_head.md).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed calls before timing (the first compiles).", lower_bound=1)
_MIN_REPS = flags.DEFINE_integer("min_reps", 5, "Fewest timed repetitions.", lower_bound=1)
_MAX_REPS = flags.DEFINE_integer("max_reps", 50, "Most timed repetitions.", lower_bound=1)
_TARGET_MS = flags.DEFINE_float("target_ms", 150.0, "Timed device time per case to aim for (sets the repetitions).")
_COPY_MIB = flags.DEFINE_integer("copy_mib", 2048, "Buffer size of the copy-bandwidth measurement.", lower_bound=1)
_CHECK_ROWS = flags.DEFINE_integer("check_rows", 8, "First and last rows checked against the float64 reference "
                                   "(0: no check; the LM head's suites check 64 rows unless 0).", lower_bound=0)
_BUDGET = flags.DEFINE_float("time_budget_s", 0.0, "Stop starting cases after this many seconds (0: no limit).")
_WARM_MIN = flags.DEFINE_float("warm_min_s", 10.0, "CUDA: the device warm-up (bf16 GEMMs until their time is steady, "
                                "tools/bench/measure.py) runs at least this many seconds.", lower_bound=0.0)
_WARM_MAX = flags.DEFINE_float("warm_max_s", 60.0, "CUDA: ... and at most this many (0: no warm-up).", lower_bound=0.0)
_STEADY = flags.DEFINE_float("steady_s", 2.0, "lm_head suites: also time each case back to back for about this many "
                              "seconds (throughput; 0: not).", lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 1234, "Seed of the random inputs.")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "Measure the case list this many times in one process, every other "
                               "round in reverse order; each row records its round, and the targets that compare two "
                               "ways judge the median over rounds of their per-round difference (paired.py).",
                               lower_bound=1)
_LABEL = flags.DEFINE_string("label", "", f"lm_head suites and {PIECES_SUITE}: a name for this run, written on each "
                             "of its rows.")


def main(argv):
    del argv  # the flags parser refused stray arguments
    if _SUITE.value == [PIECES_SUITE]:
        return _pieces()
    try:
        # Before the runner and its providers are imported, so that a usage error comes before any of them loads.
        family, cases = (_family(), None) if _RENDER_ONLY.value else _cases()
    except ValueError as error:
        raise app.UsageError(str(error)) from error
    out_dir = _writable_folder(_OUT_DIR.value)  # before any case runs: a result lost at the end costs the run
    csv, md, png = (os.path.join(out_dir, name) for name in (_CSV.value, _MD.value, _PNG.value))
    if family == "lm_head":
        csv, md = os.path.join(out_dir, LM_HEAD_CSV), os.path.join(out_dir, LM_HEAD_MD)
    if _RENDER_ONLY.value:
        return _render_only(family, csv, md, png)
    from tools.bench import runner

    config = runner.BenchConfig(
        cases=cases,
        tp=_TP.value,
        device=_DEVICE.value,
        paths=runner.OutputPaths(csv=csv, md=md, png=png),
        warmup=_WARMUP.value,
        min_reps=_MIN_REPS.value,
        max_reps=max(_MAX_REPS.value, _MIN_REPS.value),
        target_ms=_TARGET_MS.value,
        copy_bytes=_COPY_MIB.value << 20,
        check_rows=_CHECK_ROWS.value,
        time_budget_s=_BUDGET.value,
        warm_min_s=_WARM_MIN.value,
        warm_max_s=_WARM_MAX.value,
        steady_s=_STEADY.value,
        seed=_SEED.value,
        family=family,
        label=_LABEL.value,
        rounds=_ROUNDS.value,
    )
    try:
        return runner.run(config)
    except ValueError as error:  # raised before any case runs (e.g. fewer CUDA devices than --tp)
        raise app.UsageError(str(error)) from error


def _render_only(family: str, csv: str, md: str, png: str) -> int:
    """The report of the family's record, rendered again (no torch needed)."""
    if family == "lm_head":
        from tools.bench import lm_head_report

        with open(md, "w") as f:
            f.write(lm_head_report.render(lm_head_report.read_rows(csv)))
        print(f"wrote {md} from {csv}")
        return 0
    from tools.bench import report

    report.render(csv, md, png)
    print(f"wrote {md} and {png} from {csv}")
    return 0


def _pieces() -> int:
    try:
        tokens = _ints("tokens", _TOKENS.value) if _TOKENS.present else [8192]
    except ValueError as error:
        raise app.UsageError(str(error)) from error
    if _DEVICE.value != "cuda" or _TP.value != 1:
        raise app.UsageError(f"--suite={PIECES_SUITE} times CUDA kernels on one GPU: --device=cuda --tp=1")
    out_dir = _writable_folder(_OUT_DIR.value)
    from tools.bench import lm_head_pieces

    return lm_head_pieces.run(out_dir, tokens, seed=_SEED.value, label=_LABEL.value)


def _writable_folder(path: str) -> str:
    """--out_dir as an absolute path, made and shown to take a file; else a usage error naming the flag. Relative
    paths are where the user ran the command (bazel run changes the working directory)."""
    out_dir = cli.caller_path(path)
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write_test_"):
            pass
    except OSError as error:
        raise app.UsageError(f"--out_dir={path}: not a writable folder ({error.strerror or error})") from error
    return out_dir


def _family() -> str:
    """The family of --suite ('custom' is the logits op's)."""
    from tools.bench import cases as cases_lib

    return "logits" if _SUITE.value == ["custom"] else cases_lib.suite_family(_SUITE.value)


def _cases() -> tuple[str, list]:
    """The family and the cases of the flags."""
    from tools.bench import cases as cases_lib

    tp = _TP.value
    providers = _PROVIDERS.value
    family = _family()
    known = (cases_lib.LM_HEAD_PROVIDERS + cases_lib.LM_HEAD_KEEP_PROVIDERS if family == "lm_head"
             else cases_lib.ALL_PROVIDERS + cases_lib.KEEP_SET_PROVIDERS + cases_lib.SMALL_CALL_PROVIDERS
             + cases_lib.WHOLE_STEP_PROVIDERS + cases_lib.MCORE_STEP_PROVIDERS + cases_lib.MCORE_FLASH_PROVIDERS)
    filtering = family == "logits" or _PROVIDERS.present
    unknown = sorted(set(providers) - set(known)) if filtering else []
    if unknown:
        raise ValueError(f"--providers: unknown {unknown}; expected some of {list(known)}")
    if _SUITE.value == ["custom"]:
        cases = cases_lib.cross_product(cases_lib.CustomGrid(
            providers=providers,
            tokens=_ints("tokens", _TOKENS.value),
            vocab=_ints("vocab", _VOCAB.value),
            dtypes=_choices("dtypes", _DTYPES.value, cases_lib.DTYPES),
            entropy=_choices("entropy", _ENTROPY.value, cases_lib.ENTROPY_MODES),
            keep_mask=_bools("keep_mask", _KEEP_MASK.value),
            row_frac=[_fraction(v) for v in _ROW_FRAC.value],
            validate=_bools("validate", _VALIDATE.value),
            inplace_grad=_bools("inplace_grad", _INPLACE.value),
            tp=tp,
        ))
    else:
        cases = [c for c in cases_lib.suite_cases(_SUITE.value) if not filtering or c.provider in providers]
    cases = [c for c in cases if c.tp == tp]
    for case in cases:
        if case.V % case.tp:
            raise ValueError(f"--vocab: V={case.V} must be divisible by --tp={case.tp}")
    if not cases:
        which = f" and a provider in {providers}" if filtering else ""
        raise ValueError(f"no case of --suite={','.join(_SUITE.value)} has TP={tp}{which}")
    return family, cases


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
