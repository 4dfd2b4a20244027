"""Timing, host time, peak memory, back-to-back throughput, the device warm-up and the copy bandwidth.

- Time: after `warmup` untimed calls (the first compiles), each repetition of `step(prepare())` is bracketed by CUDA
  events (perf_counter on CPU, where numbers only exercise the plumbing); `prepare` is untimed. The repetition count
  fills about `target_ms`, clamped to [min_reps, max_reps]; p20/p50/p80 are reported. Inputs are far over the L2, so
  one input set is timed repeatedly with no cache flush.
- Host time: each call is also bracketed by perf_counter on the host, until it returns, before any synchronisation:
  what launching its work costs. A call without a host sync whose host time reaches its device time is host bound.
- Peak extra memory: max_memory_allocated during one step over memory_allocated just before it, inputs alive.
- Back to back (`steady_ms`): wall-clock ms per step over about --steady_s of steps with one synchronisation at the
  end: a training loop's throughput, with the host's share and the op's own host reads in it.
- Warm-up: on a GPU at its power limit the clock falls as the chip warms (an H200: 1980 MHz idle, 1440 MHz under
  sustained GEMMs), so before the first case bf16 GEMMs run until their time per window is steady.
- Copy bandwidth: a device-to-device copy_, bytes read plus written, in the same run; each case's GB/s is set
  against it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

DTYPE_BYTES = {"bf16": 2, "fp32": 4}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Timing:
    p20_ms: float
    p50_ms: float
    p80_ms: float
    reps: int
    host_p50_ms: Optional[float] = None  # p50 host wall time of the call (module docstring); None where not timed


def gbps(nbytes: int, ms: float) -> float:
    """Decimal GB/s (1e9 bytes per second), the unit HBM bandwidth is quoted in."""
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else math.nan


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timer:
    """Per-repetition elapsed times: CUDA events on CUDA devices, perf_counter elsewhere; and the host's perf_counter
    time of the call alone (`host`), on every device."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pairs: list = []
        self._host: list = []

    def start(self):
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._pairs.append((start, ev))
        else:
            self._pairs.append((start, time.perf_counter()))

    def host(self, start_s: float, stop_s: float) -> None:
        self._host.append((stop_s - start_s) * 1e3)

    def elapsed_ms(self) -> list[float]:
        synchronize(self.device)
        if self.device.type == "cuda":
            return [s.elapsed_time(e) for s, e in self._pairs]
        return [(e - s) * 1e3 for s, e in self._pairs]

    def host_ms(self) -> list[float]:
        return list(self._host)


def _run_reps(step, prepare, device, reps: int) -> tuple[list[float], list[float]]:
    """(device ms, host ms) of each repetition."""
    timer = _Timer(device)
    for _ in range(reps):
        x = prepare()
        t0 = timer.start()
        h0 = time.perf_counter()
        out = step(x)
        timer.host(h0, time.perf_counter())
        timer.stop(t0)
        del out, x  # free the gradient before the next repetition's prepare
    return timer.elapsed_ms(), timer.host_ms()


@dataclasses.dataclass(frozen=True)
class WarmUp:
    window_ms: list  # the median GEMM time of each window, in order
    seconds: float
    steady: bool  # the last two windows within WARM_TOLERANCE of each other (else max_s ran out)


WARM_WINDOW_S = 2.0  # seconds of GEMMs per window of the warm-up
WARM_TOLERANCE = 0.005  # steady: two consecutive windows' medians within 0.5%, under the cases' run-to-run spread
WARM_GEMM = 8192  # a [n, n] x [n, n] bf16 GEMM: 1.1 TFLOP, ~1.6 ms on an H200


def warm_up_device(device: torch.device, *, min_s: float, max_s: float) -> Optional[WarmUp]:
    """Runs bf16 GEMMs until two consecutive windows' median times agree within WARM_TOLERANCE (after at least
    min_s, at most max_s seconds); None off CUDA or when max_s is 0."""
    if device.type != "cuda" or max_s <= 0:
        return None
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn((WARM_GEMM, WARM_GEMM), generator=gen, device=device).to(torch.bfloat16)
    b = torch.randn((WARM_GEMM, WARM_GEMM), generator=gen, device=device).to(torch.bfloat16)
    out = torch.empty_like(a)
    medians: list = []
    start = time.monotonic()
    steady = False
    while True:
        timer = _Timer(device)
        window_start = time.monotonic()
        while time.monotonic() - window_start < WARM_WINDOW_S:
            for _ in range(8):  # enqueue a few before looking at the host clock again
                t0 = timer.start()
                torch.mm(a, b, out=out)
                timer.stop(t0)
            synchronize(device)
        medians.append(float(np.median(timer.elapsed_ms())))
        elapsed = time.monotonic() - start
        steady = len(medians) > 1 and abs(medians[-1] - medians[-2]) <= WARM_TOLERANCE * medians[-2]
        if (steady and elapsed >= min_s) or elapsed >= max_s:
            return WarmUp(window_ms=medians, seconds=elapsed, steady=steady)


def warm_up(step: Callable[[Any], Any], prepare: Callable[[], Any], device: torch.device, calls: int) -> float:
    """Runs `calls` steps that are not reported (the first compiles); returns an estimate of one step in ms."""
    times, _ = _run_reps(step, prepare, device, max(1, calls))
    return float(np.median(times[1:] if len(times) > 1 else times))


def time_step(
    step: Callable[[Any], Any],
    prepare: Callable[[], Any],
    device: torch.device,
    *,
    estimate_ms: float,
    min_reps: int,
    max_reps: int,
    target_ms: float,
) -> Timing:
    """p20/p50/p80 of `step(prepare())` in ms over enough repetitions to fill ~target_ms, and the p50 of the host's
    time in the call; `prepare` is not timed."""
    reps = int(min(max_reps, max(min_reps, math.ceil(target_ms / max(estimate_ms, 1e-3)))))
    times, host = _run_reps(step, prepare, device, reps)
    p20, p50, p80 = np.percentile(np.asarray(times, dtype=np.float64), [20, 50, 80])
    return Timing(p20_ms=float(p20), p50_ms=float(p50), p80_ms=float(p80), reps=reps,
                  host_p50_ms=float(np.median(host)))


STEADY_MAX_STEPS = 500  # back-to-back steps at most (a 15 ms step fills 2 s with 133)


def steady_steps(estimate_ms: float, seconds: float, min_steps: int) -> int:
    """How many back-to-back steps fill about `seconds` (the ranks agree on the estimate, so on the count)."""
    return int(min(STEADY_MAX_STEPS, max(min_steps, math.ceil(seconds * 1e3 / max(estimate_ms, 1e-3)))))


def steady_ms(step: Callable[[Any], Any], prepare: Callable[[], Any], device: torch.device, steps: int) -> float:
    """Wall-clock ms per step over `steps` steps run back to back, one synchronisation at the end: a training loop's
    throughput, with the host's share, the op's own host reads and the GPU's clock under sustained load in it.
    Per-step events (time_step) leave out the idle time an op's host read opens before the next step, and a GPU at
    its power limit runs the following step at a higher clock after such a rest; here both count, for every row and
    its baseline alike. `prepare` runs in the loop too (the LM head's does nothing: its step makes its own leaves)."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        out = step(prepare())
        del out
    synchronize(device)
    return (time.perf_counter() - start) * 1e3 / steps


def event_ms(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    """Median ms of fn() over `reps` calls after `warmup` untimed ones, CUDA events around each (the probes' pieces)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def kernel_ms(fn: Callable[[], Any], calls: int = 1, warmup: int = 1) -> dict:
    """{CUDA kernel name (90 characters): (device ms per call, launches per call)} of `calls` calls of fn() under
    torch.profiler, after `warmup` untimed ones (the probes' kernel tables)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            ms, count = totals.get(ev.name[:90], (0.0, 0))
            totals[ev.name[:90]] = (ms + ev.device_time / 1000.0 / calls, count + 1)
    return {name: (ms, count / calls) for name, (ms, count) in totals.items()}


def peak_extra_bytes(step: Callable[[Any], Any], prepare: Callable[[], Any], device: torch.device) -> Optional[int]:
    """Max allocated during one step over what was allocated before it (inputs alive); None off CUDA."""
    if device.type != "cuda":
        return None
    x = prepare()
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    out = step(x)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out, x
    return peak - baseline


@dataclasses.dataclass(frozen=True)
class CopyBandwidth:
    gbps: float  # (bytes read + bytes written) / p50
    nbytes: int  # size of the copied buffer
    timing: Timing


def copy_bandwidth(device: torch.device, nbytes: int, *, warmup: int, min_reps: int, max_reps: int,
                   target_ms: float) -> CopyBandwidth:
    """Device-to-device copy of `nbytes`, counted as 2 x nbytes moved."""
    numel = max(1, nbytes // 4)
    src = torch.randn(numel, device=device, dtype=torch.float32)  # random, not zeros: never time on zeros
    dst = torch.empty_like(src)

    def step(_):
        return dst.copy_(src)

    estimate = warm_up(step, lambda: None, device, warmup)
    timing = time_step(step, lambda: None, device, estimate_ms=estimate, min_reps=min_reps, max_reps=max_reps,
                       target_ms=target_ms)
    moved = 2 * numel * 4
    return CopyBandwidth(gbps=gbps(moved, timing.p50_ms), nbytes=numel * 4, timing=timing)
