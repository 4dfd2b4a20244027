"""Runs the bench's cases on one rank or, spawned, on each rank of a TP group in lockstep; rank 0 records.

Per case (see bench.py for the flow): skip with a reason, or make inputs, check, warm up, peak memory, time. Ranks
agree before each case whether the time budget is spent (one small all-reduce), so they never diverge on which
cases run; per-case results are all-gathered to rank 0, which merges them (slowest rank's times, largest peak) and
appends one CSV row. Between cases everything but the current input set is freed; an input set is reused by
consecutive cases with the same shape and masks.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import gc
import importlib.metadata
import os
import platform
import socket
import time
import traceback

import torch
import torch.distributed as dist

from tools import rank_exit
from tools.bench import measure, report
from tools.bench.cases import Case
from tools.bench.check import check_forward, reference_rows
from tools.bench.inputs import make_inputs
from tools.bench.providers import PROVIDERS, preload

_DIST_TIMEOUT = datetime.timedelta(minutes=5)  # a rank stuck in a collective (e.g. its peer died) fails, not hangs


@dataclasses.dataclass(frozen=True)
class OutputPaths:
    csv: str
    md: str
    png: str


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    cases: list  # [Case], in the order to run
    tp: int
    device: str  # "cuda" | "cpu"
    paths: OutputPaths
    warmup: int = 2
    min_reps: int = 5
    max_reps: int = 50
    target_ms: float = 150.0
    copy_bytes: int = 2 << 30
    check_rows: int = 8
    time_budget_s: float = 0.0  # 0: no limit
    seed: int = 1234


def render(paths: OutputPaths) -> None:
    report.render(paths.csv, paths.md, paths.png)
    print(f"wrote {paths.md} and {paths.png} from {paths.csv}", flush=True)


def run(config: BenchConfig) -> int:
    """Runs every case, appends the CSV, renders Markdown and PNG; returns 1 if a case hit an unexpected error or
    failed its check."""
    if config.device == "cuda" and torch.cuda.device_count() < config.tp:
        raise ValueError(f"--tp={config.tp} needs {config.tp} CUDA devices, found {torch.cuda.device_count()}"
                         + ("" if config.tp > 1 else "; use --device=cpu to exercise the plumbing"))
    before = len(report.read_csv(config.paths.csv)) if os.path.exists(config.paths.csv) else 0
    if config.tp == 1:
        device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")
        _run_rank(config, device, group=None, rank=0)
    else:
        _spawn_ranks(config)
    rows = report.read_csv(config.paths.csv)[before:] if os.path.exists(config.paths.csv) else []
    render(config.paths)
    errors = [r for r in rows if r["status"].startswith("error")]
    failed_checks = [r for r in rows if r["check"].startswith("fail")]
    for r in errors + failed_checks:
        print(f"PROBLEM: {r['provider']} T={r['T']} {r['dtype']} entropy={r['entropy']}: {r['status']} {r['check']}")
    return 1 if errors or failed_checks else 0


# How long a terminated rank may take to go before it is killed.
_TERMINATE_GRACE_S = 10


def _spawn_ranks(config: BenchConfig) -> None:
    """Runs `config.tp` ranks and waits for them. Whatever ends the wait (a rank's failure, Ctrl-C in this process)
    ends every rank first: torch.multiprocessing's ranks are not daemons, so the interpreter's exit would otherwise
    wait for them to finish the whole bench."""
    context = torch.multiprocessing.spawn(_worker, args=(config, _free_port()), nprocs=config.tp, join=False)
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, config: BenchConfig, port: int) -> None:
    if config.time_budget_s > 0:
        # A rank still running well past the budget is stuck (a collective its peer never joined): print every
        # rank's Python stacks to the log, every minute, so the hang can be found from the log alone.
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
    with rank_exit.destroy_on_error():  # a failure reaches torch.multiprocessing with its traceback
        _run_rank(config, device, group=dist.group.WORLD, rank=rank)
    # Barrier, destroy the group, flush, exit without interpreter finalization: a CI run saw a finished gloo rank
    # abort there ("terminate called without an active exception") and fail a passing bench.
    rank_exit.leave()


def environment(device: torch.device) -> dict:
    """GPU name, versions and date recorded on every CSV row."""

    def version(dist_name: str) -> str:
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            return ""

    try:
        import ppo_ops

        ppo_version = getattr(ppo_ops, "__version__", "") or "source tree"
    except ImportError:
        ppo_version = ""
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"CPU {platform.machine()} ({os.cpu_count()} cores; timings meaningless)"
    return dict(
        device=device.type,
        gpu=gpu,
        torch=torch.__version__,
        triton=version("triton"),
        ppo_ops=ppo_version,
        liger_kernel=version("liger-kernel"),
        megatron_core=version("megatron-core"),
        # Megatron's jit_fuser is torch.compile unless TORCHDYNAMO_DISABLE=1: it changes the legacy provider's speed.
        torch_compile="off" if os.environ.get("TORCHDYNAMO_DISABLE") == "1" else "on",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


class _InputCache:
    """Keeps the last input set and its float64 references (one per entropy mode); a new key frees the old set
    before allocating."""

    def __init__(self, config: BenchConfig, device: torch.device, group, rank: int):
        self._config, self._device, self.group, self._rank = config, device, group, rank
        self._key, self._inputs, self._refs = None, None, {}

    def get(self, case: Case):
        if case.input_key() != self._key:
            self.clear()
            self._inputs = make_inputs(case, self._device, seed=self._config.seed, rank=self._rank, group=self.group)
            self._key = case.input_key()
        return self._inputs

    def reference(self, case: Case):
        """Float64 reference rows for the case's check (collective when TP > 1, like the check itself)."""
        if case.entropy not in self._refs:
            self._refs[case.entropy] = reference_rows(case, self.get(case), self._config.check_rows)
        return self._refs[case.entropy]

    def clear(self) -> None:
        self._key, self._inputs, self._refs = None, None, {}
        _free_memory(self._device)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _run_case(case: Case, config: BenchConfig, device: torch.device, cache: _InputCache) -> dict:
    """This rank's measurement of one case: status, check, timing quantiles, peak extra bytes."""
    reason = PROVIDERS[case.provider].unsupported(case, device)
    if reason:
        return {"status": f"skipped: {reason}"}
    closure = None
    try:
        inp = cache.get(case)
        closure = PROVIDERS[case.provider].build(case, inp)
        checked = config.check_rows and PROVIDERS[case.provider].checked
        check = check_forward(closure.forward(), cache.reference(case)) if checked else ""
        estimate = measure.warm_up(closure.step, closure.prepare, device, config.warmup)
        # Every rank must time the same number of steps (each step issues collectives): agree on the estimate the
        # repetition count comes from. Ranks that each picked their own once deadlocked the TP=2 run.
        estimate = _max_over_ranks(estimate, cache.group, device)
        peak = measure.peak_extra_bytes(closure.step, closure.prepare, device)
        timing = measure.time_step(closure.step, closure.prepare, device, estimate_ms=estimate,
                                   min_reps=config.min_reps, max_reps=config.max_reps, target_ms=config.target_ms)
        return {"status": "ok", "check": check, "timing": timing, "peak": peak}
    except Exception as error:  # recorded per case so one failure does not lose the run
        if _is_oom(error):
            cache.clear()
            return {"status": "OOM"}
        traceback.print_exc()
        first_line = (str(error).splitlines() or [""])[0][:200]
        return {"status": f"error: {type(error).__name__}: {first_line}"}
    finally:
        del closure
        _free_memory(device)


def _merge(case: Case, results: list[dict], env: dict, copy_gbps: float) -> dict:
    """One CSV row from all ranks' results: slowest rank's quantiles, largest peak, first problem."""
    bytes_ = measure.case_bytes(case.T, case.v_local, case.dtype, case.kept_rows, case.keep_mask)
    row = dict(
        provider=case.provider, T=case.T, V=case.V, V_local=case.v_local, dtype=case.dtype, entropy=case.entropy,
        keep_mask=report.fmt_bool(case.keep_mask), row_frac=f"{case.row_frac:.1f}", kept_rows=case.kept_rows,
        tp=case.tp, validate=report.fmt_bool(case.validate), inplace_grad=report.fmt_bool(case.inplace_grad),
        bytes_fwd=bytes_.fwd, bytes_bwd=bytes_.bwd, copy_gbps=copy_gbps,
        grad_mib=case.T * case.v_local * measure.DTYPE_BYTES[case.dtype] / measure.MIB, **env,
    )
    bad = [r for r in results if r["status"] != "ok"]
    row["status"] = bad[0]["status"] if bad else "ok"
    checks = [r.get("check", "") for r in results]
    row["check"] = next((c for c in checks if c and c != "ok"), checks[0])
    if bad:
        return row
    timings = [r["timing"] for r in results]
    row.update(
        reps=min(t.reps for t in timings),
        p20_ms=max(t.p20_ms for t in timings),
        p50_ms=max(t.p50_ms for t in timings),
        p80_ms=max(t.p80_ms for t in timings),
    )
    row["gbps"] = measure.gbps(bytes_.total, row["p50_ms"])
    row["frac_copy_bw"] = row["gbps"] / copy_gbps if copy_gbps else None
    peaks = [r["peak"] for r in results if r["peak"] is not None]
    row["peak_extra_mib"] = max(peaks) / measure.MIB if peaks else None
    return row


def _gather(obj, group, world_size: int) -> list:
    if world_size == 1:
        return [obj]
    out = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def _max_over_ranks(value: float, group, device: torch.device) -> float:
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _any_rank(flag: bool, group, device: torch.device, world_size: int) -> bool:
    if world_size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _describe(row: dict) -> str:
    head = (f"{report._label(row):22s} T={row['T']:>5} V={row['V']:>6} {row['dtype']} entropy={row['entropy']:5s} "
            f"keep={row['keep_mask']:3s} rows={row['row_frac']} tp={row['tp']}")
    if row["status"] != "ok":
        return f"{head}: {row['status']}"
    frac = row.get("frac_copy_bw")
    peak = row.get("peak_extra_mib")
    return (f"{head}: p50 {row['p50_ms']:.3f} ms [{row['p20_ms']:.3f}, {row['p80_ms']:.3f}] "
            f"{row['gbps']:.0f} GB/s" + (f" ({frac:.0%} of copy)" if frac else "")
            + (f", peak extra {peak:.1f} MiB" if peak is not None else "") + f", check {row['check'] or 'off'}")


def _run_rank(config: BenchConfig, device: torch.device, group, rank: int) -> None:
    world = config.tp
    env = environment(device)
    copy = measure.copy_bandwidth(device, config.copy_bytes, warmup=config.warmup, min_reps=config.min_reps,
                                  max_reps=config.max_reps, target_ms=config.target_ms)
    copy_gbps = max(_gather(copy.gbps, group, world))
    if rank == 0:
        print(f"{env['gpu']}: device copy {copy_gbps:.0f} GB/s (read + write, {copy.nbytes >> 20} MiB buffer); "
              f"{len(config.cases)} cases, TP={world}", flush=True)
    preload(sorted({c.provider for c in config.cases}))
    # Imports (megatron-core especially) leave millions of objects that every gc.collect() would walk again; freeze
    # them so that freeing memory between cases costs milliseconds.
    gc.collect()
    gc.freeze()
    try:
        _run_cases(config, device, group, rank, env, copy_gbps)
    finally:
        gc.unfreeze()  # frozen objects are never freed: nanobind (triton) would report them as leaks at exit


def _run_cases(config: BenchConfig, device: torch.device, group, rank: int, env: dict, copy_gbps: float) -> None:
    world = config.tp
    cache = _InputCache(config, device, group, rank)
    start = time.monotonic()
    for index, case in enumerate(config.cases):
        over = config.time_budget_s > 0 and time.monotonic() - start > config.time_budget_s
        if _any_rank(over, group, device, world):
            if rank == 0:
                left = config.cases[index:]
                print(f"time budget of {config.time_budget_s:.0f} s spent: {len(left)} cases not run, first "
                      f"{left[0]}", flush=True)
            break
        results = _gather(_run_case(case, config, device, cache), group, world)
        if rank == 0:
            row = _merge(case, results, env, copy_gbps)
            report.append_csv(config.paths.csv, [row])
            print(_describe(row), flush=True)
    cache.clear()
