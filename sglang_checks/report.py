"""The report folder: report.json (everything), report.md (the table a person reads first), logprob_diff_hist.png.

report.json keys: passed, settings (every flag), versions, model, rollout, engine_layouts, engines (per engine layout:
engine, version, launch command, start-up time), negative_control, expect_bitwise, calibration (where the tolerances
come from), trainer_layouts, comparisons (section, subject, metric, value, tolerance, tolerance_name, passed,
details), tolerances (each with its reason), timings_s; with --sglang_dump_tensors also layer_diff (per engine
layout, layer_diff.py's result: the scoring passes, per tensor name the shapes, dtypes, max |diff| and differing
elements, and the first tensor that differs), summarised in a section of report.md; with --train_steps also
train_steps (train_steps.py: the optimizer's settings, the reward, and per step every number: reward, entropy, loss,
gradient norm, ratio, mismatch, the weight sync's results, time, peak memory), a per-step table in report.md and
train_steps.png, the per-step curves.
The PNG has one panel of per-token (trainer - engine) log-prob differences per engine log-prob series, one of
(layout - tp1) trainer log-prob differences, over the completion tokens, and one of every comparison's value against
its tolerance (value / tolerance; a bar past 1 is a FAIL).

Every file is written whole (`write_atomic`: a temporary file beside it, renamed over it), report.json last; a run
holds the folder's lock (`folder_lock`, flock on `.lock`) from its start to its end, so a second run into the same
folder is refused instead of mixing its files with the first's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import os
import tempfile
from typing import Dict, Iterator, List, Union

import numpy as np

from sglang_checks.errors import CheckError
from sglang_checks.metrics import Comparison

JSON_NAME = "report.json"
MD_NAME = "report.md"
PNG_NAME = "logprob_diff_hist.png"
TRAIN_PNG_NAME = "train_steps.png"  # the per-step curves of --train_steps (train_steps.py), beside the histogram
ROLLOUT_NAME = "rollout.json"
# Held (flock) by the run writing the folder; the kernel releases it when that process ends, however it ends, so a
# crash never leaves the folder locked. The empty file itself may stay: only the lock on it counts.
LOCK_NAME = ".lock"


@contextlib.contextmanager
def folder_lock(flag: str, folder: str) -> Iterator[None]:
    """Holds `folder`'s lock for the block; a folder another run holds is bad input (CheckError naming `flag`), so
    two runs never mix their files in one folder."""
    path = os.path.join(folder, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise CheckError(f"{flag}={folder}: cannot create the lock file {LOCK_NAME} ({exc.strerror or exc})") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise CheckError(f"{flag}={folder}: cannot lock {path} ({exc.strerror or exc})") from exc
            raise CheckError(f"{flag}={folder}: another run is writing this folder (it holds {path}); wait for it "
                             f"to finish or choose another {flag}") from exc
        yield
    finally:
        os.close(fd)  # releases the lock


def write_atomic(path: str, data: Union[str, bytes]) -> None:
    """Writes the whole file or nothing: a temporary file beside it, then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would differ from an ordinary file's mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: str, report: dict) -> None:
    write_atomic(path, json.dumps(report, indent=1, default=_plain))


def _plain(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e-3 and abs(value) < 1e4:
        return f"{value:.4g}"
    return f"{value:.3e}"


def write_markdown(path: str, report: dict, comparisons: List[Comparison], note: str = "") -> None:
    failed = [c for c in comparisons if not c.passed]
    verdict = "PASS" if not failed else f"FAIL ({len(failed)} of {len(comparisons)} comparisons out of tolerance)"
    s = report["settings"]
    r = report["rollout"]
    bitwise = "; --expect_bitwise: teacher-forced and engine layout differences must be 0" \
        if report.get("expect_bitwise") else ""
    lines = [
        "# Qwen3 parallel check",
        "",
        f"**{verdict}**",
        "",
        f"- model: `{report['model']['name']}` (fingerprint `{report['model']['fingerprint'][:16]}`)",
        f"- engine: `{s['engine']}`, engine layouts `{s['engine_layouts']}`; rollout sampled by "
        f"`{r['engine']} {r['engine_layout']}` at temperature {r['temperature']}, top-p {r['top_p']}, "
        f"engine log-prob kind `{r['logprob_kind']}`",
        f"- trainer: numerics `{report['trainer'].get('numerics', 'hf')}`, temperature "
        f"{report['trainer']['temperature']}, layouts `{','.join(report['trainer_layouts'])}`, backend "
        f"`{report['trainer']['backend']}`",
        f"- rollout: {r['sequences']} sequences, {r['completion_tokens']} completion tokens, trainer sequence length "
        f"{r['seq_len']}{' (replayed from ' + r['path'] + ')' if r.get('replayed') else ''}",
        f"- tolerances: {report.get('calibration', 'defaults')}{bitwise}",
    ]
    if report.get("negative_control", "none") != "none":
        lines.append(f"- **negative control `{report['negative_control']}`** (a fault injected on purpose; a FAIL is "
                     f"the expected outcome)")
    for e in report.get("engines", []):
        startup = f", started in {e['startup_s']:.1f} s" if e.get("startup_s") else ""
        lines.append(f"- engine layout `{e['layout']}`: {e['engine']} {e['version']}{startup}; `{e['command']}`")
    lines += [
        "",
        "| section | subject | metric | value | tolerance | result |",
        "|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        cells = [c.section, c.subject, c.metric, _fmt(c.value), _fmt(c.tolerance), "pass" if c.passed else "**FAIL**"]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines += _layer_diff_lines(report.get("layer_diff"))
    lines += _train_steps_lines(report.get("train_steps"))
    lines += ["", "Tolerances:", ""]
    lines += [f"- `{name}` = {_fmt(t['value'])}: {t['reason']}" for name, t in report["tolerances"].items()]
    lines += ["", f"Histogram of per-token differences: `{PNG_NAME}`. Everything else: `{JSON_NAME}`.", ""]
    if note:
        lines += [note, ""]
    write_atomic(path, "\n".join(lines))


def _layer_diff_lines(diffs) -> List[str]:
    """report.md's layer-diff section: per engine layout its one-line summary, the first differing tensor's row and
    the dtype mismatches (the full table is report.json's layer_diff)."""
    if not diffs:
        return []
    lines = ["", "## Layer diff (engine tensor dump vs trainer, teacher-forced scoring)", ""]
    for layout, result in diffs.items():
        lines.append(f"- engine `{layout}`: {result['summary']}")
        first = result.get("first_difference")
        if first:
            row = next(t for t in result["tensors"] if t["name"] == first["name"])
            lines.append(f"  - `{first['name']}`: engine {row['engine_shape']} {row['engine_dtype']}, trainer "
                         f"{row['trainer_shape']} {row['trainer_dtype']}")
        mismatched = [t["name"] for t in result.get("tensors", []) if t["dtype_mismatch"]]
        if mismatched:
            lines.append(f"  - dtypes differ at {len(mismatched)} tensors, first `{mismatched[0]}`")
    return lines


def _train_steps_lines(record) -> List[str]:
    """report.md's per-step table of --train_steps (every number is in report.json's train_steps.rows)."""
    if not record:
        return []
    reference = record.get("reference_trainer")
    lines = ["", f"## GRPO training steps (weights synced into the engine after each; curves: `{TRAIN_PNG_NAME}`)",
             "",
             f"{record['steps']} steps of {record['optimizer']} at lr {record['lr']:g} on {record['master_weights']} "
             f"master weights, trainer numerics `{record.get('numerics', 'hf')}`, loss {record['loss']}, reward: "
             f"{record['reward']['name']} (TARGET_MODULUS = {record['reward']['target_modulus']}); reward "
             f"{_fmt(record['reward_first'])} at step 0, {_fmt(record['reward_last'])} at step {record['steps']} "
             f"(rise {record['reward_rise']:+.4f}). Engine layouts `{','.join(record['engine_layouts'])}` (the first "
             f"samples); trainer layouts `{','.join(record['trainer_layouts'])}` score every step (only tp1 trains). "
             f"Policy reward: the probability the trainer's policy puts on the target ids at the step's completion "
             f"positions."]
    if reference:
        bands = record["reference_bands"]
        lines += ["", f"Reference (`ref`): the textbook PyTorch trainer replaying the same rollouts; bands: |d policy "
                      f"reward| <= {bands['policy_reward']:g}, |d loss| <= {bands['loss']:g}."]
    header = ["step", "reward", "policy reward", "entropy", "loss", "grad norm", "ratio mean", "max \\|ratio-1\\|",
              "mean \\|trainer-engine\\|", "k3 KL", "tensors differing", "probe max \\|d\\|", "time (s)",
              "peak memory (MiB)"]
    if reference:
        header += ["ref policy reward", "ref entropy", "ref loss", "ref grad norm"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in record["rows"]:
        differing = sum(e["tensors_differing"] for e in r["sync"])
        checked = sum(e["tensors"] for e in r["sync"])
        probe = max(e["probe_max_abs_diff"] for e in r["sync"])
        cells = [str(r["step"]), f"{r['reward_mean']:.4f}", f"{r['policy_reward']:.4f}", f"{r['entropy_mean']:.4f}",
                 _fmt(r["loss"]), _fmt(r["grad_norm"]), f"{r['ratio_mean']:.6f}", _fmt(r["ratio_max_abs_dev"]),
                 _fmt(r["mismatch_mean_abs"]), _fmt(r["kl_k3"]), f"{differing} of {checked}", _fmt(probe),
                 f"{r['step_time_s']:.2f}", f"{r['peak_memory_bytes'] / 2**20:.0f}"]
        if reference:
            ref = r["reference"]
            cells += [f"{ref['policy_reward']:.4f}", f"{ref['entropy_mean']:.4f}", _fmt(ref["loss"]),
                      _fmt(ref["grad_norm"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# The panels of train_steps.png: (title, [(row key, label)]); keys under "reference." are the reference trainer's.
_TRAIN_CURVES = (
    ("reward", [("reward_mean", "sampled reward"), ("policy_reward", "policy reward"),
                ("reference.policy_reward", "policy reward (reference)")]),
    ("trainer - engine", [("mismatch_mean_abs", "mean |trainer - engine| log-prob"), ("kl_k3", "k3 KL")]),
    ("max |ratio - 1| (ratio = exp(trainer - engine))", [("ratio_max_abs_dev", "max |ratio - 1|")]),
    ("mean entropy (nats)", [("entropy_mean", "ppo_ops"), ("reference.entropy_mean", "reference")]),
    ("GRPO loss", [("loss", "ppo_ops"), ("reference.loss", "reference")]),
    ("gradient norm (before clipping)", [("grad_norm", "ppo_ops"), ("reference.grad_norm", "reference")]),
)


def _curve(rows, key: str):
    if key.startswith("reference."):
        return None if "reference" not in rows[0] else [r["reference"][key.split(".", 1)[1]] for r in rows]
    return [r[key] for r in rows]


def write_train_curves(path: str, record: dict) -> None:
    """train_steps.png: one panel per entry of _TRAIN_CURVES over the steps, both trainers where both ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for ax, (title, series) in zip(axes.flat, _TRAIN_CURVES):
        for key, label in series:
            values = _curve(rows, key)
            if values is not None:
                ax.plot(steps, values, marker="o", label=label, linestyle="--" if "reference" in key else "-")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


def write_histogram(path: str, mismatch: Dict[str, np.ndarray], layouts: Dict[str, np.ndarray],
                    comparisons: List[Comparison] = ()) -> None:
    """mismatch: label -> per-token (trainer - engine); layouts: layout name -> per-token (layout - tp1);
    comparisons: each value against its tolerance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(20, 5), gridspec_kw={"width_ratios": [1, 1, 1.2]})
    _threshold_panel(axes[2], comparisons)
    for ax, series, title in ((axes[0], mismatch, "trainer - engine log-prob (completion tokens)"),
                              (axes[1], layouts, "trainer layout - tp1 log-prob (completion tokens)")):
        values = [v for v in series.values() if v.size]
        if not values:
            ax.text(0.5, 0.5, "nothing to compare", ha="center", va="center", transform=ax.transAxes)
        else:
            lo = min(float(v.min()) for v in values)
            hi = max(float(v.max()) for v in values)
            span = max(hi - lo, 1e-12)  # all-equal series still get a visible bin
            bins = np.linspace(lo - 0.05 * span, hi + 0.05 * span, 61)
            for label, v in series.items():
                if v.size:
                    ax.hist(v, bins=bins, histtype="step", linewidth=1.5,
                            label=f"{label} (max |d| {_fmt(float(np.abs(v).max()))})")
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("difference (nats)")
        ax.set_ylabel("tokens")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())


# Where a value of 0 is drawn on the log axis of value / tolerance (0 is exact agreement; log(0) does not exist).
_ZERO_RATIO = 1e-6


def _threshold_panel(ax, comparisons: List[Comparison]) -> None:
    """Healthy vs threshold: one bar per comparison, value / tolerance on a log axis, the threshold at 1."""
    if not comparisons:
        ax.text(0.5, 0.5, "no comparisons", ha="center", va="center", transform=ax.transAxes)
        return
    ratios, labels, colors = [], [], []
    for c in comparisons:
        if c.tolerance > 0:
            ratio = c.value / c.tolerance if c.value > 0 else _ZERO_RATIO
        else:  # a bitwise demand: 0 passes, anything else is off the scale
            ratio = _ZERO_RATIO if c.value == 0 else 1e3
        ratios.append(ratio if np.isfinite(ratio) else 1e3)
        labels.append(f"{c.subject[:34]}: {c.metric[:28]}")
        colors.append("tab:green" if c.passed else "tab:red")
    y = np.arange(len(ratios))
    ax.barh(y, ratios, color=colors, left=_ZERO_RATIO * 0.5)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1, label="threshold (value = tolerance)")
    ax.set_xscale("log")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=5)
    ax.invert_yaxis()
    ax.set_xlabel("value / tolerance")
    ax.set_title("every comparison vs its threshold (green pass, red FAIL)", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")


def write_all(report_dir: str, report: dict, comparisons: List[Comparison], mismatch, layouts) -> Dict[str, str]:
    os.makedirs(report_dir, exist_ok=True)
    paths = {name: os.path.join(report_dir, name) for name in (JSON_NAME, MD_NAME, PNG_NAME)}
    report = dict(report, comparisons=[c.as_dict() for c in comparisons],
                  passed=all(c.passed for c in comparisons))
    try:
        import matplotlib  # noqa: F401 - optional: GPU images may lack it; the numbers are all in the JSON
    except ImportError:
        paths.pop(PNG_NAME)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(report_dir, PNG_NAME))  # an earlier run's picture would not be this run's
        write_markdown(paths[MD_NAME], report, comparisons,
                       note=f"(no {PNG_NAME}: matplotlib is not installed for this interpreter)")
    else:
        write_histogram(paths[PNG_NAME], mismatch, layouts, comparisons)
        if report.get("train_steps"):
            paths[TRAIN_PNG_NAME] = os.path.join(report_dir, TRAIN_PNG_NAME)
            write_train_curves(paths[TRAIN_PNG_NAME], report["train_steps"])
        write_markdown(paths[MD_NAME], report, comparisons)
    write_json(paths[JSON_NAME], report)  # last: a report.json is there only when the rest of the report is
    return paths
