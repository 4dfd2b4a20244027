"""Runs the cases of one bench family on one rank or, spawned, on each rank of a TP group in lockstep; rank 0 records.

Per case (see bench.py for the flow): skip with a reason, or make inputs, check, warm up, peak memory, time. Ranks
agree before each case whether the time budget is spent (one small all-reduce), so they never diverge on which
cases run; per-case results are all-gathered to rank 0, which has the family merge them into one row (the slowest
rank's times, the largest peak) and append it. Between cases everything but the current input set is freed; an input
set is reused by consecutive cases with the same input_key(). What differs between families (cases, inputs,
providers, the check, the row, the report) is theirs (contract.py); measuring and the ranks are here.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import gc
import importlib.metadata
import os
import platform
import time
import traceback

import torch
import torch.distributed as dist

from ppo_ops.runtime import ranks
from tools.bench import lm_head, logits, measure
from tools.bench.contract import Family, RankResult, RunInfo, preload

_DIST_TIMEOUT = datetime.timedelta(minutes=5)  # a rank stuck in a collective (e.g. its peer died) fails, not hangs


@dataclasses.dataclass(frozen=True)
class OutputPaths:
    csv: str
    md: str
    png: str


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    cases: list  # the family's cases, in the order to run
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
    family: str = "logits"  # a key of FAMILIES
    label: str = ""  # a name for this run, on each row of the families that record one
    warm_min_s: float = 10.0  # the device warm-up before the first case (measure.warm_up_device); CUDA only
    warm_max_s: float = 60.0  # 0: none
    steady_s: float = 2.0  # families that time steps back to back too: about this long per case (0: not)
    rounds: int = 1  # passes over the case list in one process, every other one reversed (paired.py)


FAMILIES = {"logits": logits.LogitsFamily, "lm_head": lm_head.LmHeadFamily}


def family_of(config: BenchConfig) -> Family:
    return FAMILIES[config.family](config)


def run(config: BenchConfig) -> int:
    """Runs every case, appends the record, renders the report; returns 1 if a row of this run is a problem (an
    unexpected error, a failed check)."""
    if config.device == "cuda" and torch.cuda.device_count() < config.tp:
        raise ValueError(f"--tp={config.tp} needs {config.tp} CUDA devices, found {torch.cuda.device_count()}"
                         + ("" if config.tp > 1 else "; use --device=cpu to exercise the plumbing"))
    family = family_of(config)
    before = len(family.record_rows())
    if config.tp == 1:
        device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" else torch.device("cpu")
        _run_rank(config, device, group=None, rank=0)
    else:
        _spawn_ranks(config)
    rows = family.record_rows()[before:]
    family.render()
    problems = [p for p in map(family.problem, rows) if p]
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


# How long a terminated rank may take to go before it is killed.
_TERMINATE_GRACE_S = 10


def _spawn_ranks(config: BenchConfig) -> None:
    """Runs `config.tp` ranks and waits for them. Whatever ends the wait (a rank's failure, Ctrl-C in this process)
    ends every rank first: torch.multiprocessing's ranks are not daemons, so the interpreter's exit would otherwise
    wait for them to finish the whole bench."""
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
    with ranks.destroy_on_error():  # a failure reaches torch.multiprocessing with its traceback
        _run_rank(config, device, group=dist.group.WORLD, rank=rank)
    # Barrier, destroy the group, flush, exit without interpreter finalization: a CI run saw a finished gloo rank
    # abort there ("terminate called without an active exception") and fail a passing bench.
    ranks.leave()


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
    """Keeps the last input set and its memo (the family's float64 references and the like); a new key frees the
    old set before allocating."""

    def __init__(self, family: Family, config: BenchConfig, device: torch.device, group, rank: int):
        self._family, self._config, self._device, self.group, self._rank = family, config, device, group, rank
        self._key, self._inputs, self._memo = None, None, {}

    def get(self, case):
        """(inputs, memo) of the case."""
        if case.input_key() != self._key:
            self.clear()
            self._inputs = self._family.make_inputs(case, self._device, seed=self._config.seed, rank=self._rank,
                                                    group=self.group)
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


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _run_case(case, family: Family, config: BenchConfig, device: torch.device, cache: _InputCache) -> RankResult:
    """This rank's measurement of one case: status, check, timing quantiles, peak extra bytes."""
    provider = family.providers[case.provider]
    reason = provider.unsupported(case, device)
    if reason:
        return RankResult(f"skipped: {reason}")
    closure = None
    try:
        inputs, memo = cache.get(case)
        closure = provider.build(case, inputs)
        checks = family.check(case, inputs, closure, memo, config.check_rows)
        estimate = measure.warm_up(closure.step, closure.prepare, device, config.warmup)
        # Every rank must time the same number of steps (each step issues collectives): agree on the estimate the
        # repetition count comes from. Ranks that each picked their own once deadlocked the TP=2 run.
        estimate = max_over_ranks(estimate, cache.group, device)
        peak = measure.peak_extra_bytes(closure.step, closure.prepare, device)
        timing = measure.time_step(closure.step, closure.prepare, device, estimate_ms=estimate,
                                   min_reps=config.min_reps, max_reps=config.max_reps, target_ms=config.target_ms)
        steady = None
        if family.times_steady and config.steady_s > 0:
            steps = measure.steady_steps(estimate, config.steady_s, config.min_reps)
            steady = max_over_ranks(measure.steady_ms(closure.step, closure.prepare, device, steps), cache.group,
                                    device)
        return RankResult("ok", checks, timing, peak, steady)
    except Exception as error:  # recorded per case so one failure does not lose the run
        if _is_oom(error):
            cache.clear()
            return RankResult("OOM")
        traceback.print_exc()
        first_line = (str(error).splitlines() or [""])[0][:200]
        return RankResult(f"error: {type(error).__name__}: {first_line}")
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


def _any_rank(flag: bool, group, device: torch.device, world_size: int) -> bool:
    if world_size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _run_rank(config: BenchConfig, device: torch.device, group, rank: int) -> None:
    world = config.tp
    family = family_of(config)
    env = environment(device)
    preload([family.providers[name] for name in sorted({c.provider for c in config.cases})])
    warm = measure.warm_up_device(device, min_s=config.warm_min_s, max_s=config.warm_max_s)
    if warm is not None and rank == 0:
        trace = " ".join(f"{ms:.3f}" for ms in warm.window_ms)
        print(f"warm-up: {warm.seconds:.0f} s of bf16 GEMMs ({measure.WARM_GEMM}^3), "
              f"{'steady' if warm.steady else 'NOT steady (max time reached)'}; median ms per "
              f"{measure.WARM_WINDOW_S:.0f} s window: {trace}", flush=True)
    copy_gbps = None
    if family.measures_copy_bandwidth:
        copy = measure.copy_bandwidth(device, config.copy_bytes, warmup=config.warmup, min_reps=config.min_reps,
                                      max_reps=config.max_reps, target_ms=config.target_ms)
        copy_gbps = max(_gather(copy.gbps, group, world))
        if rank == 0:
            print(f"{env['gpu']}: device copy {copy_gbps:.0f} GB/s (read + write, {copy.nbytes >> 20} MiB buffer); "
                  f"{len(config.cases)} cases, TP={world}", flush=True)
    elif rank == 0:
        print(f"{env['gpu']}: {len(config.cases)} cases, TP={world}", flush=True)
    # Imports (megatron-core especially) leave millions of objects that every gc.collect() would walk again; freeze
    # them so that freeing memory between cases costs milliseconds.
    gc.collect()
    gc.freeze()
    try:
        _run_cases(config, family, device, group, rank, RunInfo(env=env, copy_gbps=copy_gbps, label=config.label))
    finally:
        gc.unfreeze()  # frozen objects are never freed: nanobind (triton) would report them as leaks at exit


def round_order(cases: list, rounds: int) -> list[tuple[int, object]]:
    """(round, case) in the order they run: the case list once per round, every other round reversed, so that each
    case is measured early and late in the run and beside the cases it is compared with."""
    return [(r + 1, case) for r in range(rounds) for case in (cases if r % 2 == 0 else cases[::-1])]


def _run_cases(config: BenchConfig, family: Family, device: torch.device, group, rank: int, info: RunInfo) -> None:
    world = config.tp
    cache = _InputCache(family, config, device, group, rank)
    start = time.monotonic()
    order = round_order(config.cases, config.rounds)
    for index, (round_, case) in enumerate(order):
        over = config.time_budget_s > 0 and time.monotonic() - start > config.time_budget_s
        if _any_rank(over, group, device, world):
            if rank == 0:
                print(f"time budget of {config.time_budget_s:.0f} s spent: {len(order) - index} cases not run, "
                      f"first {order[index][1]} (round {round_})", flush=True)
            break
        results = _gather(_run_case(case, family, config, device, cache), group, world)
        if rank == 0:
            row = family.row(case, results, dataclasses.replace(info, round=round_))
            family.append(row)
            print(family.describe(row) + (f" (round {round_})" if config.rounds > 1 else ""), flush=True)
    cache.clear()
