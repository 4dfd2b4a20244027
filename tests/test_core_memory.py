"""Peak extra memory of ppo_ops.log_probs_and_entropy, forward + backward, measured for real: the torch backend on CPU
(the CPU target; torch.profiler), both backends on CUDA (the `_gpu` target; the CUDA allocator's peak).

Measurement: torch.profiler with profile_memory=True records every CPU allocation and free made through torch's
allocator, each with the allocator's running "Total Allocated"; the peak of that count over the call, minus the
count before it, is the peak extra memory (the logits already exist; the returned gradient counts). A self-test
checks the measurement on a known allocation pattern.

Bounds (at T=512, V=32768, where one fp32 [T, V] buffer is 64 MiB):
- entropy with gradient: at most two fp32 [T, V_local] buffers plus the returned gradient;
- chunk_size=c: at most the gradient plus CHUNK_BUFFERS fp32 [c, V_local] buffers;
- row_mask keeping R rows: at most the gradient plus two fp32 [R, V_local] buffers (dropped rows cost no work).
Each test also measures the naive computation (log_softmax + gather + softmax entropy, with autograd) in the same way
and requires it to exceed the bound: the bound is tight enough to catch a memory-hungry implementation.
On CUDA: the Triton backend within the returned gradient plus O(T) row statistics; the torch backend within the same
two fp32 buffers plus the gradient as on CPU.
"""

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ppo_ops
from tests.core_support import make_keep_mask, make_logits, make_tokens, make_weights

pytestmark = pytest.mark.device("cpu")  # the profiler's CPU allocations; the CUDA measurements are marked below

N_ROWS, N_VOCAB = 512, 32768
FP32_BUFFER = N_ROWS * N_VOCAB * 4  # 64 MiB
SLACK = 1 << 20  # O(T) row statistics, tokens, masks' index lists and allocator rounding: far below one buffer
CHUNK_ROWS = 64
CHUNK_BUFFERS = 4  # O(c * V_local): twice the two fp32 buffers the unchunked bound allows, per chunk of rows
KEPT_ROWS = 64


def peak_extra_bytes(fn, trace_dir) -> int:
    """Peak of torch's CPU 'Total Allocated' while fn() runs, minus its value before fn() (profiler trace)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    path = trace_dir / "memory_trace.json"
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    cpu = [a for a in events if a.get("Device Type") == 0]  # 0: CPU
    assert cpu, "the profiler recorded no CPU allocation: the measurement does not work here"
    baseline = cpu[0]["Total Allocated"] - cpu[0]["Bytes"]
    return max(a["Total Allocated"] for a in cpu) - baseline


def _inputs(dtype, keep=False, rows=False):
    logits = make_logits((N_ROWS, N_VOCAB), dtype).requires_grad_(True)
    tokens = make_tokens((N_ROWS,), N_VOCAB)
    opts = {}
    if keep:
        opts["keep_mask"] = make_keep_mask((N_ROWS, N_VOCAB), tokens)
    if rows:
        row_mask = torch.zeros(N_ROWS, dtype=torch.bool)
        row_mask[torch.randperm(N_ROWS, generator=torch.Generator().manual_seed(0))[:KEPT_ROWS]] = True
        opts["row_mask"] = row_mask
    weights = (make_weights((N_ROWS,)), make_weights((N_ROWS,), 5, -1.0, 1.0))
    return logits, tokens, opts, weights


def _ppo_ops_call(logits, tokens, opts, weights, **extra):
    def run():
        out = ppo_ops.log_probs_and_entropy(logits, tokens, entropy="grad", backend="torch", **opts, **extra)
        grad = torch.autograd.grad([out.log_probs, out.entropy], logits, list(weights))[0]
        assert grad.shape == logits.shape and grad.dtype == logits.dtype
        run.grad = grad  # keep the returned gradient alive until the measurement ends
    return run


def _naive_call(logits, tokens, opts, weights):
    def run():
        z = logits.float()
        log_p = torch.log_softmax(z, dim=-1)
        log_probs = log_p.gather(-1, tokens[:, None])[:, 0]
        entropy = -(log_p.exp() * log_p).sum(-1)
        if "row_mask" in opts:
            log_probs, entropy = log_probs * opts["row_mask"], entropy * opts["row_mask"]
        run.grad = torch.autograd.grad([log_probs, entropy], logits, list(weights))[0]
    return run


def _check_bound(tmp_path, inputs, bound, what, **extra):
    peak = peak_extra_bytes(_ppo_ops_call(*inputs, **extra), tmp_path)
    naive = peak_extra_bytes(_naive_call(*inputs), tmp_path)
    mib = 1 << 20
    assert naive > bound, f"naive {naive / mib:.1f} MiB within the {what} bound {bound / mib:.1f} MiB: bound too loose"
    assert peak <= bound, f"ppo_ops peak extra {peak / mib:.1f} MiB > {what} bound {bound / mib:.1f} MiB"


def test_measurement_on_a_known_pattern(tmp_path):
    mib = 1 << 20

    def pattern():
        a = torch.empty(8 * mib, dtype=torch.uint8)
        b = torch.empty(8 * mib, dtype=torch.uint8)
        c = torch.empty(8 * mib, dtype=torch.uint8)  # peak: 24 MiB
        del a, b
        d = torch.empty(4 * mib, dtype=torch.uint8)  # 12 MiB now
        del c, d

    peak = peak_extra_bytes(pattern, tmp_path)
    assert 24 * mib <= peak <= 24 * mib + SLACK


@pytest.mark.parametrize("dtype,keep", [
    (torch.float32, False),
    (torch.float32, True),  # the keep mask's rows must not cost a [T, V] copy either
    (torch.bfloat16, False),  # fp32 working buffers over bf16 logits; the gradient is bf16
])
def test_entropy_grad_within_two_fp32_buffers_plus_gradient(tmp_path, dtype, keep):
    inputs = _inputs(dtype, keep=keep)
    grad_bytes = N_ROWS * N_VOCAB * dtype.itemsize
    _check_bound(tmp_path, inputs, 2 * FP32_BUFFER + grad_bytes + SLACK, "two fp32 buffers + gradient")


@pytest.mark.parametrize("dtype,keep", [(torch.float32, True), (torch.bfloat16, False)])
def test_chunk_size_bounds_working_memory(tmp_path, dtype, keep):
    inputs = _inputs(dtype, keep=keep)
    grad_bytes = N_ROWS * N_VOCAB * dtype.itemsize
    chunk_bytes = CHUNK_BUFFERS * CHUNK_ROWS * N_VOCAB * 4
    _check_bound(tmp_path, inputs, grad_bytes + chunk_bytes + SLACK, f"chunk_size={CHUNK_ROWS}",
                 chunk_size=CHUNK_ROWS)


def test_row_mask_skips_dropped_rows(tmp_path):
    inputs = _inputs(torch.float32, rows=True)
    kept_fp32_buffer = KEPT_ROWS * N_VOCAB * 4
    _check_bound(tmp_path, inputs, FP32_BUFFER + 2 * kept_fp32_buffer + SLACK,
                 f"gradient + two fp32 [{KEPT_ROWS}, V] buffers")


# --- CUDA: the allocator's own peak -----------------------------------------------------------------------------------

def _cuda_peak_extra_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.device("cuda")
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype,keep", [(torch.bfloat16, False), (torch.float32, True)])
def test_cuda_peak_extra_memory(backend, dtype, keep):
    logits, tokens, opts, weights = _inputs(dtype, keep=keep)
    logits = logits.detach().cuda().requires_grad_(True)
    tokens = tokens.cuda()
    opts = {k: v.cuda() for k, v in opts.items()}
    weights = tuple(w.cuda() for w in weights)
    grad_bytes = N_ROWS * N_VOCAB * dtype.itemsize

    def run_backend():
        out = ppo_ops.log_probs_and_entropy(logits, tokens, entropy="grad", backend=backend, **opts)
        run_backend.grad = torch.autograd.grad([out.log_probs, out.entropy], logits, list(weights))[0]

    run_backend()  # compile and warm the allocator outside the measurement
    del run_backend.grad
    peak = _cuda_peak_extra_bytes(run_backend)
    naive = _cuda_peak_extra_bytes(_naive_call(logits, tokens, opts, weights))
    bound = grad_bytes + SLACK if backend == "triton" else 2 * FP32_BUFFER + grad_bytes + SLACK
    mib = 1 << 20
    assert naive > bound, f"naive {naive / mib:.1f} MiB within the bound {bound / mib:.1f} MiB: bound too loose"
    assert peak <= bound, f"{backend} peak extra {peak / mib:.1f} MiB > bound {bound / mib:.1f} MiB"
