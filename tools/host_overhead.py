"""Host (CPU) time of one ppo_ops forward + backward against its device time, on one GPU.

    python tools/host_overhead.py [--rows 8192] [--vocab 151936] [--profile]

Why: a host sync inside the op (validate=True's checks; a row mask's index list before the Triton kernels took the
mask itself) makes the GPU wait for the host to launch everything that follows it, so the step costs device time +
the host time after the sync. This tool shows
how large that is, per configuration (validate on/off, row mask off/10%), with bf16 logits and entropy="grad":
- `pipelined ms`: CUDA-event time per step over back-to-back steps (what the bench reports);
- `isolated ms`: wall time of one step between two device syncs (host and device serialised);
- `host ms`: host time of one step while the GPU is still busy with a long sleep queued before it (only meaningful
  when the step has no sync of its own: a sync waits for the sleep, which the column then flags);
- `device ms`: the sum of the step's kernel times from torch.profiler (--profile also prints its top ops).
"""

import os
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import torch  # noqa: E402

from ppo_ops.runtime import cli  # noqa: E402

_ROWS = flags.DEFINE_integer("rows", 8192, "T")
_VOCAB = flags.DEFINE_integer("vocab", 151936, "V")
_PROFILE = flags.DEFINE_bool("profile", False, "print torch.profiler's top ops of each configuration")
_REPS = 20
_SLEEP_CYCLES = 2_000_000_000  # about a second of GPU sleep: longer than the host needs for one step


def _step_fn(logits, tokens, row_mask, g_lp, g_ent, validate):
    import ppo_ops

    def step():
        out = ppo_ops.log_probs_and_entropy(logits, tokens, entropy="grad", row_mask=row_mask, validate=validate)
        return torch.autograd.grad((out.log_probs, out.entropy), logits, (g_lp, g_ent))
    return step


def _measure(step, profile):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(_REPS):
        step()
    end.record()
    torch.cuda.synchronize()
    pipelined = start.elapsed_time(end) / _REPS

    isolated = []
    for _ in range(_REPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        isolated.append((time.perf_counter() - t0) * 1e3)

    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES)
    t0 = time.perf_counter()
    step()
    host = (time.perf_counter() - t0) * 1e3
    waited = host > 100.0  # a sync inside the step waited for the sleep
    torch.cuda.synchronize()

    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_ms = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events) / 1e3
    if profile:
        print(events.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    isolated.sort()
    return pipelined, isolated[len(isolated) // 2], (f"{host:.3f} (waited on a sync)" if waited else f"{host:.3f}"), \
        device_ms


def main(argv):
    del argv
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    T, V = _ROWS.value, _VOCAB.value
    logits = (torch.randn((T, V), device=dev, generator=gen) * 2).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, V, (T,), device=dev, generator=gen)
    g_lp, g_ent = torch.randn(T, device=dev, generator=gen), torch.randn(T, device=dev, generator=gen)
    rows = torch.rand(T, device=dev, generator=gen) < 0.1
    print(f"# {torch.cuda.get_device_name()}, T={T} V={V} bf16, entropy=grad, {_REPS} reps", flush=True)
    print("| validate | row mask | pipelined ms | isolated ms | host ms | device ms (profiler) |")
    print("|---|---|---|---|---|---|")
    for validate in (False, True):
        for row_mask in (None, rows):
            step = _step_fn(logits, tokens, row_mask, g_lp, g_ent, validate)
            pipelined, isolated, host, device = _measure(step, _PROFILE.value)
            print(f"| {validate} | {'off' if row_mask is None else '10%'} | {pipelined:.3f} | {isolated:.3f} | {host} "
                  f"| {device:.3f} |", flush=True)


if __name__ == "__main__":
    cli.run(main, program="host_overhead")
