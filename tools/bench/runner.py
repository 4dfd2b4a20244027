"""The shared runner: every family's cases measured the same way, on one rank or on each rank of a TP group.

Per case: skip it with the provider's reason, or make (or reuse) its seeded inputs, check the provider's forward
(the family's check), warm up, measure peak extra memory, time the steps (and back to back where the family asks).
Ranks agree before each case whether the time budget is spent and on the warm-up estimate (so on the number of
timed steps, each of which issues collectives); per-case results are all-gathered to rank 0, which writes one row
(the slowest rank's quantiles, the largest peak, the first problem) to the record as soon as it is measured. An
out-of-memory case is recorded as "OOM"; an unexpected error with its message.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import gc
import importlib.metadata
import os
import platform
import subprocess
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist

from ppo_ops.runtime import ranks
from tools.bench import lm_head, logits, measure, report, step
from tools.bench.common import Case, first_import_problem

FAMILIES = {m.NAME: m for m in (logits, lm_head, step)}
_DIST_TIMEOUT = datetime.timedelta(minutes=5)  # a rank stuck in a collective (its peer died) fails, not hangs
_TERMINATE_GRACE_S = 10  # how long a terminated rank may take to go before it is killed
MIB = float(1 << 20)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    cases: list  # Cases of any family, in the order to run
    tp: int
    device: str  # "cuda" | "cpu"
    csv: str  # the record, appended to
    warmup: int = 2
    min_reps: int = 5
    max_reps: int = 50
    target_ms: float = 150.0
    copy_bytes: int = 2 << 30
    check_rows: int = 8
    time_budget_s: float = 0.0  # 0: no limit
    seed: int = 1234
    label: str = ""  # a name for this run, on each of its rows
    warm_min_s: float = 10.0  # the device warm-up before the first case (measure.warm_up_device); CUDA only
    warm_max_s: float = 60.0  # 0: none
    steady_s: float = 2.0  # families that time back to back too: about this long per case (0: not)
    rounds: int = 1  # passes over the case list, every other one reversed


def run(config: BenchConfig) -> int:
    """Runs every case and appends its row; returns 1 if a row of this run is a problem (an unexpected error of
    ppo_ops or a baseline of its own, a failed check), else 0."""
    if config.device == "cuda" and torch.cuda.device_count() < config.tp:
        raise ValueError(f"--tp={config.tp} needs {config.tp} CUDA devices, found {torch.cuda.device_count()}"
                         + ("" if config.tp > 1 else "; use --device=cpu (or --smoke) to exercise the plumbing"))
    before = len(report.read_csv(config.csv))
    if config.tp == 1:
        device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")
        _run_rank(config, device, group=None, rank=0)
    else:
        _spawn_ranks(config)
    problems = [p for p in map(problem, report.read_csv(config.csv)[before:]) if p]
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


def problem(row: dict) -> Optional[str]:
    """What is wrong with a row (an unexpected error of one of our providers, a failed check), or None."""
    provider = FAMILIES[row["family"]].PROVIDERS.get(row["provider"])
    error = row["status"].startswith("error") and not (provider and provider.peer)
    if error or row.get("check", "").startswith("fail"):
        return f"{row['family']} {row['provider']} T={row['T']} V={row['V']} tp={row['tp']}: {row['status']} " \
               f"{row.get('check', '')}".rstrip()
    return None


def _spawn_ranks(config: BenchConfig) -> None:
    """Runs `config.tp` ranks; whatever ends the wait (a rank's failure, Ctrl-C here) ends every rank first:
    torch.multiprocessing's ranks are not daemons, so the interpreter's exit would wait for the whole bench."""
    context = torch.multiprocessing.spawn(_worker, args=(config, ranks.free_port()), nprocs=config.tp, join=False)
    try:
        while not context.join():
            pass
    except BaseException:
        for proc in context.processes:
            if proc.is_alive():
                proc.terminate()
        for proc in context.processes:
            proc.join(_TERMINATE_GRACE_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        raise


def _worker(rank: int, config: BenchConfig, port: int) -> None:
    if config.time_budget_s > 0:
        # A rank still running well past the budget is stuck in a collective: its stacks go to the log every minute.
        faulthandler.dump_traceback_later(config.time_budget_s + 60, repeat=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if config.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=config.tp, timeout=_DIST_TIMEOUT, device_id=device)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=config.tp, timeout=_DIST_TIMEOUT)
    with ranks.destroy_on_error():  # a failure reaches torch.multiprocessing with its traceback
        _run_rank(config, device, group=dist.group.WORLD, rank=rank)
    # Barrier, destroy, flush, exit without interpreter finalization: a finished gloo rank once aborted there
    # ("terminate called without an active exception") and failed a passing bench.
    ranks.leave()


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _commit() -> str:
    """The source tree's commit (+ where it has uncommitted changes), or "" outside a git checkout."""
    root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+" if head and dirty else "")


def environment(device: torch.device) -> dict:
    """The cells every row of one run shares: GPU, versions, commit, the run's timestamp (which names the run)."""
    others = {"liger-kernel": _version("liger-kernel"), "megatron-core": _version("megatron-core")}
    packages = " ".join(f"{k}={v}" for k, v in others.items() if v)
    # Megatron's jit_fuser is torch.compile unless TORCHDYNAMO_DISABLE=1: it changes the legacy provider's speed.
    packages += " torch.compile=" + ("off" if os.environ.get("TORCHDYNAMO_DISABLE") == "1" else "on")
    gpu = (torch.cuda.get_device_name(device) if device.type == "cuda"
           else f"CPU {platform.machine()} ({os.cpu_count()} cores; timings meaningless)")
    return dict(gpu=gpu, torch=torch.__version__, triton=_version("triton"), packages=packages.strip(),
                commit=_commit(),
                timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


class _InputCache:
    """The last input set and its memo (float64 references and the like); a new key frees the old set first."""

    def __init__(self, config: BenchConfig, device: torch.device, group, rank: int):
        self._config, self._device, self.group, self._rank = config, device, group, rank
        self._key, self._inputs, self._memo = None, None, {}

    def get(self, case: Case):
        if case.input_key() != self._key:
            self.clear()
            self._inputs = FAMILIES[case.family].make_inputs(case, self._device, seed=self._config.seed,
                                                             rank=self._rank, group=self.group)
            self._key = case.input_key()
        return self._inputs, self._memo

    def clear(self) -> None:
        self._key, self._inputs, self._memo = None, None, {}
        _free_memory(self._device)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@dataclasses.dataclass(frozen=True)
class _RankResult:
    """One rank's measurement of one case (gathered to rank 0: plain values only)."""

    status: str  # "ok", "OOM", "skipped: ...", "error: ..."
    checks: dict = dataclasses.field(default_factory=dict)  # the family's check columns
    timing: Optional[measure.Timing] = None
    peak: Optional[int] = None  # bytes; None off CUDA
    steady_ms: Optional[float] = None


def _run_case(case: Case, config: BenchConfig, device: torch.device, cache: _InputCache) -> _RankResult:
    family = FAMILIES[case.family]
    provider = family.PROVIDERS[case.provider]
    reason = provider.unsupported(case, device)
    if reason:
        return _RankResult(f"skipped: {reason}")
    closure = None
    try:
        inputs, memo = cache.get(case)
        closure = provider.build(case, inputs)
        checks = family.check(case, inputs, closure, memo, config.check_rows)
        estimate = measure.warm_up(closure.step, closure.prepare, device, config.warmup)
        # Every rank must time the same number of steps (each issues collectives): ranks that each picked their own
        # count once deadlocked the TP = 2 run.
        estimate = max_over_ranks(estimate, cache.group, device)
        peak = measure.peak_extra_bytes(closure.step, closure.prepare, device)
        timing = measure.time_step(closure.step, closure.prepare, device, estimate_ms=estimate,
                                   min_reps=config.min_reps, max_reps=config.max_reps, target_ms=config.target_ms)
        steady = None
        if family.TIMES_STEADY and config.steady_s > 0:
            steps = measure.steady_steps(estimate, config.steady_s, config.min_reps)
            steady = max_over_ranks(measure.steady_ms(closure.step, closure.prepare, device, steps), cache.group,
                                    device)
        return _RankResult("ok", checks, timing, peak, steady)
    except Exception as error:  # recorded per case so that one failure does not lose the run
        if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
            cache.clear()
            return _RankResult("OOM")
        traceback.print_exc()
        return _RankResult(f"error: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}")
    finally:
        del closure
        _free_memory(device)


def _gather(obj, group, world_size: int) -> list:
    if world_size == 1:
        return [obj]
    out = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def max_over_ranks(value: float, group, device: torch.device) -> float:
    """The largest of every rank's `value` (the value itself without a group)."""
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _any_rank(flag: bool, group, device: torch.device) -> bool:
    return bool(max_over_ranks(1.0 if flag else 0.0, group, device))


def row(case: Case, results: list[_RankResult], run: dict) -> dict:
    """One record row from every rank's result: the slowest rank's times, the largest peak and errors, the first
    problem."""
    family = FAMILIES[case.family]
    out = dict(case.fields(), **run)
    bases, floor = family.baselines(case)
    out["baseline"] = "; ".join(report.format_fields(b) for b in bases)
    out["floor"] = report.format_fields(floor) if floor else ""
    nbytes = family.bytes_moved(case)
    out["bytes"] = nbytes if nbytes is not None else ""
    bad = [r for r in results if r.status != "ok"]
    out["status"] = bad[0].status if bad else "ok"
    checks = [r.checks.get("check", "") for r in results]
    out["check"] = next((c for c in checks if c and c != "ok"), checks[0])
    for key in ("err_logprob", "err_entropy", "err_dx_rel"):
        values = [r.checks[key] for r in results if r.checks.get(key) is not None]
        out[key] = max(values) if values else None
    if bad:
        return out
    timings = [r.timing for r in results]
    out.update(reps=min(t.reps for t in timings),
               **{q: max(getattr(t, q) for t in timings) for q in ("p20_ms", "p50_ms", "p80_ms")},
               host_ms=max(t.host_p50_ms for t in timings))
    steady = [r.steady_ms for r in results if r.steady_ms is not None]
    out["steady_ms"] = max(steady) if steady else None
    peaks = [r.peak for r in results if r.peak is not None]
    out["peak_extra_mib"] = max(peaks) / MIB if peaks else None
    if nbytes is not None:
        out["gbps"] = measure.gbps(nbytes, out["p50_ms"])
        out["frac_copy_bw"] = out["gbps"] / run["copy_gbps"] if run.get("copy_gbps") else None
    return out


def round_order(cases: list, rounds: int) -> list[tuple[int, object]]:
    """(round, case) in the order they run: the case list once per round, every other round reversed, so that each
    case is measured early and late in the run and beside the cases it is compared with."""
    return [(r + 1, case) for r in range(rounds) for case in (cases if r % 2 == 0 else cases[::-1])]


def _run_rank(config: BenchConfig, device: torch.device, group, rank: int) -> None:
    run = environment(device)
    run["label"] = config.label
    for name in sorted({(c.family, c.provider) for c in config.cases}):
        first_import_problem(FAMILIES[name[0]].PROVIDERS[name[1]].modules)  # imported now, not in a timed case
    warm = measure.warm_up_device(device, min_s=config.warm_min_s, max_s=config.warm_max_s)
    if warm is not None and rank == 0:
        print(f"warm-up: {warm.seconds:.0f} s of bf16 GEMMs ({measure.WARM_GEMM}^3), "
              f"{'steady' if warm.steady else 'NOT steady (max time reached)'}; median ms per "
              f"{measure.WARM_WINDOW_S:.0f} s window: {' '.join(f'{ms:.3f}' for ms in warm.window_ms)}", flush=True)
    copy = measure.copy_bandwidth(device, config.copy_bytes, warmup=config.warmup, min_reps=config.min_reps,
                                  max_reps=config.max_reps, target_ms=config.target_ms)
    run["copy_gbps"] = max(_gather(copy.gbps, group, config.tp))
    if rank == 0:
        print(f"{run['gpu']}: device copy {run['copy_gbps']:.0f} GB/s (read + write, {copy.nbytes >> 20} MiB buffer); "
              f"{len(config.cases)} cases, TP={config.tp}", flush=True)
    # Imports (megatron-core especially) leave millions of objects that every gc.collect() would walk again.
    gc.collect()
    gc.freeze()
    try:
        cache = _InputCache(config, device, group, rank)
        start = time.monotonic()
        order = round_order(config.cases, config.rounds)
        for index, (round_, case) in enumerate(order):
            over = config.time_budget_s > 0 and time.monotonic() - start > config.time_budget_s
            if _any_rank(over, group, device):
                if rank == 0:
                    print(f"time budget of {config.time_budget_s:.0f} s spent: {len(order) - index} cases not run, "
                          f"first {order[index][1]} (round {round_})", flush=True)
                break
            results = _gather(_run_case(case, config, device, cache), group, config.tp)
            if rank == 0:
                r = row(case, results, dict(run, round=round_))
                report.append_csv(config.csv, [r])
                print(report.describe(r) + (f" (round {round_})" if config.rounds > 1 else ""), flush=True)
        cache.clear()
    finally:
        gc.unfreeze()  # frozen objects are never freed: nanobind (triton) would report them as leaks at exit
