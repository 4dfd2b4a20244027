"""Multi-rank test plumbing: one place for the device and spawning a process group (its rendezvous port and how a
rank leaves: ppo_ops/runtime/ranks.py, shared with the check and the bench).

- `DEVICE`: cuda when a GPU is visible (GPU targets, or plain pytest on a GPU machine), else cpu. CPU Bazel targets
  hide GPUs (CUDA_VISIBLE_DEVICES=""), so a file runs on the CPU there and on the GPU in its `_gpu` target.
- `run_ranks(world_size, worker, *args)`: starts `world_size` processes joined in a process group on loopback and
  runs `worker(rank, world_size, *args)` on each: NCCL with rank r on cuda:r when DEVICE is cuda, else gloo. A rank
  that raises fails the caller with its traceback; a rank stuck in a collective fails after RANK_TIMEOUT. With CUDA
  the ranks are spawned; on CPU they fork from a server process that imported torch once (START_METHOD), each with
  the caller's environment at the call.
- `run_gloo`: the same on gloo and CPU tensors, wherever the test runs (checks of the CPU path itself).
- `one_gpu=True` (run_ranks, results_by_tp): gloo ranks that all compute on cuda:0, so a one-GPU runner checks TP > 1
  of the compiled kernels (gloo carries the CUDA tensors' collectives through host memory: NCCL itself is not
  exercised, the `_gpuN` targets do that).
- `results_by_tp(out_dir, compute, *args)`: per-TP-size results of one computation, TP = 1 in this process and each
  TP > 1 spawned once, for the suites that compare TP sizes bit for bit.
- `world_size_param(n)`: a pytest parameter for a case that needs n ranks, marked `world_size(n)`: a GPU target runs
  it only where n GPUs are declared (tests/conftest.py), plain pytest on a GPU machine skips it with the reason.
"""

import dataclasses
import datetime
import multiprocessing
import os
import time
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ppo_ops.runtime import ranks as runtime_ranks

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DIST_BACKEND = "nccl" if DEVICE.type == "cuda" else "gloo"
RANK_TIMEOUT = datetime.timedelta(seconds=120)  # a rank stuck in a collective fails the test instead of hanging CI
# How ranks start: with CUDA, spawned (a fresh interpreter each); on CPU, forked from a server process that has
# imported torch once, as a spawned rank would import it again (a second or more of CPU per rank, on 2 cores). Each
# rank still gets the caller's environment as it is at the call (_Group.environ), as a spawned one does.
START_METHOD = "spawn" if DEVICE.type == "cuda" else "forkserver"
if START_METHOD == "forkserver":
    multiprocessing.set_forkserver_preload(["torch"])


def rank_device(rank: int, backend: str = DIST_BACKEND, one_gpu: bool = False) -> torch.device:
    """The device rank `rank` computes on: its own GPU under NCCL, the CPU under gloo, cuda:0 with one_gpu."""
    if one_gpu:
        return torch.device("cuda", 0)
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class _Group:
    """What every spawned rank of one run_ranks call is given (its rank comes from torch.multiprocessing)."""

    world_size: int
    port: int  # the rendezvous on 127.0.0.1
    backend: str  # "gloo" | "nccl"
    one_gpu: bool  # gloo ranks that all compute on cuda:0
    timeout_s: Optional[float]  # the group's collective timeout (None: RANK_TIMEOUT)
    worker: Callable  # worker(rank, world_size, *args)
    args: tuple
    environ: dict  # the caller's environment at the call: the rank's (a forked rank starts with the server's)


def _entry(rank: int, group: _Group):
    os.environ.clear()
    os.environ.update(group.environ)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    if group.backend == "nccl" or group.one_gpu:
        torch.cuda.set_device(rank_device(rank, group.backend, group.one_gpu))
    else:
        torch.set_num_threads(1)  # world_size processes share the CI machine's 2 cores
    timeout = RANK_TIMEOUT if group.timeout_s is None else datetime.timedelta(seconds=group.timeout_s)
    dist.init_process_group(group.backend, init_method=f"tcp://127.0.0.1:{group.port}", rank=rank,
                            world_size=group.world_size, timeout=timeout)
    with runtime_ranks.destroy_on_error():  # a failure propagates to torch.multiprocessing with its traceback
        group.worker(rank, group.world_size, *group.args)
    # Barrier, destroy the group, flush, exit without interpreter finalization (ppo_ops/runtime/ranks.py).
    runtime_ranks.leave()


def run_ranks(world_size: int, worker, *args, backend: str = DIST_BACKEND, one_gpu: bool = False,
              timeout_s: Optional[float] = None, deadline_s: Optional[float] = None):
    """Runs worker(rank, world_size, *args) on `world_size` spawned ranks (module docstring).

    one_gpu: gloo ranks that all compute on cuda:0 (backend must be "gloo"). timeout_s: the group's collective timeout
    (default RANK_TIMEOUT). deadline_s: the ranks must all have finished this many seconds after the spawn, or they
    are terminated and the caller fails with "hang"."""
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"{world_size} NCCL ranks need {world_size} GPUs, {torch.cuda.device_count()} visible")
    if one_gpu and (backend != "gloo" or not torch.cuda.is_available()):
        raise RuntimeError(f"one_gpu: gloo ranks on a visible GPU, got backend {backend!r}, "
                           f"{torch.cuda.device_count()} GPU(s) visible")
    spawn_args = (_Group(world_size, runtime_ranks.free_port(), backend, one_gpu, timeout_s, worker, args,
                         dict(os.environ)),)
    if deadline_s is None:
        mp.start_processes(_entry, args=spawn_args, nprocs=world_size, join=True, start_method=START_METHOD)
        return
    context = mp.start_processes(_entry, args=spawn_args, nprocs=world_size, join=False, start_method=START_METHOD)
    end = time.monotonic() + deadline_s
    while not context.join(timeout=max(0.0, end - time.monotonic())):
        if time.monotonic() >= end:
            alive = [rank for rank, proc in enumerate(context.processes) if proc.is_alive()]
            for proc in context.processes:
                if proc.is_alive():
                    proc.terminate()
            for proc in context.processes:
                proc.join(5)
            raise AssertionError(f"ranks {alive} of {world_size} still running after {deadline_s} s: a hang")


def run_gloo(world_size: int, worker, *args, **limits):
    """run_ranks over gloo: the ranks compute on CPU tensors even where a GPU is visible (`limits`: timeout_s,
    deadline_s as in run_ranks)."""
    run_ranks(world_size, worker, *args, backend="gloo", **limits)


def _save_results(rank, world_size, out_dir, compute, args, one_gpu):
    results = compute(rank, world_size, dist.group.WORLD, rank_device(rank, one_gpu=one_gpu), *args)
    torch.save(results, os.path.join(out_dir, f"tp{world_size}_rank{rank}.pt"))


def results_by_tp(out_dir: str, compute, *args, one_gpu: bool = False):
    """tp -> [per-rank results of compute(rank, world_size, group, device, *args)]: TP = 1 in this process (no group,
    on DEVICE), each TP > 1 spawned the first time it is asked for (a GPU target runs only the TP sizes its GPUs
    hold; with one_gpu, gloo ranks all on cuda:0), its ranks' results saved in out_dir. `compute` must be a
    module-level function (the ranks import it)."""
    cache = {}

    def results(tp: int):
        if tp not in cache:
            if tp == 1:
                cache[1] = [compute(0, 1, None, DEVICE, *args)]
            else:
                run_ranks(tp, _save_results, out_dir, compute, args, one_gpu,
                          backend="gloo" if one_gpu else DIST_BACKEND, one_gpu=one_gpu)
                cache[tp] = [torch.load(os.path.join(out_dir, f"tp{tp}_rank{r}.pt")) for r in range(tp)]
        return cache[tp]

    return results


def world_size_param(n: int, **kwargs):
    """pytest.param(n) for a case that runs on n ranks, marked so GPU targets place it by GPU count."""
    return pytest.param(n, marks=[pytest.mark.world_size(n)], id=kwargs.pop("id", f"tp{n}"), **kwargs)
