"""Kernel/tile/warp/stage variants of the Triton backend's kernels on one GPU, against the device's copy bandwidth.

    python tools/triton_tune.py [--rows 8192] [--vocab 151936] [--dtypes bf16,fp32] [--keep]

For each logits dtype it times, with triton.testing.do_bench (p20/p50/p80 over ~100 ms of repetitions):
- forward partials (`ppo_ops.logits.triton_backend.forward_partials`) per (BLOCK_V, num_warps, num_stages, chunk)
  variant, chunk being the columns per lane (1: per-column online state; BLOCK_V: one block-wide online softmax per
  tile), with the eight fixed segments and, for the default variant, one segment per row (the layout when V_global % 8
  != 0);
- backward gradient (`ppo_ops.logits.triton_backend.backward_grad`) per variant, out of place;
- a device-to-device copy of the logits (bytes read + written): the bandwidth every case is set against.
Bytes: forward reads the logits (and the keep mask, 1 byte per element, with --keep); backward reads them and writes
the gradient (and reads the keep mask). Every variant's results on a few rows are checked against a float64 torch
reference (partials; gradient from the same fp32 row stats); a variant that fails to compile, run or check is
reported and the run goes on. The last table is the compact summary: the best variant of each pass (the forward's
label names its chunk), their sum against the floor (3 x logits bytes at copy bandwidth) and the config in
ppo_ops/logits/triton_backend.py::_GPU_CONFIG.
About 1 to 2 minutes on one H200 (compiles dominate).
"""

import functools
import os
import sys
import traceback

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import torch  # noqa: E402

from ppo_ops.runtime import cli  # noqa: E402

_ROWS = flags.DEFINE_integer("rows", 8192, "T, rows of logits")
_VOCAB = flags.DEFINE_integer("vocab", 151936, "V, columns (151936 = Qwen3); must be divisible by 8")
_DTYPES = flags.DEFINE_list("dtypes", ["bf16", "fp32"], "logits dtypes: bf16, fp32, fp16")
_KEEP = flags.DEFINE_bool("keep", False, "also pass a keep mask (log-prob renormalisation; 1 more byte per element)")
_CHECK_ROWS = flags.DEFINE_integer("check_rows", 4, "rows checked against float64 per variant")

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
# Forward: (BLOCK_V, num_warps, num_stages, chunk) per logits element size; None is ppo_ops' current default. A lane
# keeps 3-4 fp32 accumulators in registers, so lanes per thread stay few; num_stages > 1 lets Triton prefetch through
# shared memory on top of the kernel's own register double buffering. The chunk extremes are there for the record.
FORWARD_VARIANTS = {
    2: [None, (1024, 4, 1, 1), (1024, 4, 1, 1024), (1024, 4, 1, 4), (2048, 4, 1, 8), (4096, 4, 1, 8), (2048, 8, 1, 8),
        (2048, 4, 1, 16), (2048, 4, 2, 8), (512, 4, 1, 8), (1024, 8, 1, 8)],
    4: [None, (1024, 4, 1, 1), (1024, 4, 1, 1024), (1024, 4, 1, 4), (2048, 4, 1, 4), (1024, 4, 1, 8),
        (2048, 8, 1, 8), (4096, 8, 1, 8), (4096, 4, 1, 4)],
}
# Backward: (BLOCK_V, num_warps, num_stages).
BACKWARD_VARIANTS = {
    2: [None, (1024, 4, 1), (2048, 4, 1), (2048, 8, 1), (8192, 8, 1), (4096, 4, 1)],
    4: [None, (512, 4, 1), (1024, 4, 1), (1024, 8, 1), (4096, 8, 1), (2048, 4, 1)],
}
SUM_RTOL = 2e-6  # partial sums vs float64 (tests/triton_reference.py: PARTIAL_SUM_RTOL)
GRAD_ATOL = 1e-6  # fp32 gradient vs float64; plus half an ulp of the output dtype, relative
HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
QUANTILES = [0.2, 0.5, 0.8]


def _bench(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=QUANTILES)


def _reference_partials(logits_rows, target_col, keep_rows, seg_len):
    """float64 [nseg, 5, r] partials of a few rows (ppo_ops/core/row_stats.py channel order)."""
    z = logits_rows.float().double()
    r, v = z.shape
    out = torch.zeros((v // seg_len, 5, r), dtype=torch.float64, device=z.device)
    kept = torch.zeros_like(z, dtype=torch.bool) if keep_rows is None else keep_rows.clone()
    kept[torch.arange(r), target_col] = True
    for j in range(v // seg_len):
        zj = z[:, j * seg_len:(j + 1) * seg_len]
        m = zj.amax(1)
        e = torch.exp(zj - m[:, None])
        out[j, 0], out[j, 1] = m, e.sum(1)
        out[j, 2] = out[j, 1] if keep_rows is None else torch.where(kept[:, j * seg_len:(j + 1) * seg_len], e, 0).sum(1)
        out[j, 3] = (e * (zj - m[:, None])).sum(1)
        here = (target_col >= j * seg_len) & (target_col < (j + 1) * seg_len)
        out[j, 4] = torch.where(here, z[torch.arange(r), target_col], float("-inf"))
    return out


def _partials_error(got, expected):
    """Worst excess over tolerance (<= 0 passes): exact MAX/TARGET_Z, relative sums."""
    worst = 0.0
    for ch in (0, 4):
        if not torch.equal(got[:, ch].double(), expected[:, ch]):
            return float("inf")
    for ch in (1, 2, 3):
        err = (got[:, ch].double() - expected[:, ch]).abs() - SUM_RTOL * expected[:, ch].abs()
        worst = max(worst, err.max().item())
    return worst


def _reference_grad(logits_rows, target_col, keep_rows, stats, g_lp, g_ent):
    """float64 gradient of a few rows from the given (fp32) row stats."""
    shift, log_sum, log_sum_kept, mean_shifted = (s.double()[:, None] for s in stats)
    z = logits_rows.float().double()
    d = z - shift
    p = torch.exp(d - log_sum)
    onehot = torch.zeros_like(z)
    onehot[torch.arange(z.shape[0]), target_col] = 1.0
    if keep_rows is None:
        q = p
    else:
        kept = keep_rows | onehot.bool()
        q = torch.where(kept, torch.exp(d - log_sum_kept), 0.0)
    return g_lp.double()[:, None] * (onehot - q) + g_ent.double()[:, None] * p * (mean_shifted - d)


def _fmt_row(cols, widths):
    return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cols, widths)) + " |"


def _print_table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    print(_fmt_row(header, widths))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(_fmt_row(r, widths))
    print(flush=True)


def _tune_dtype(name, n_rows, vocab, keep, check_rows):
    from ppo_ops.core import row_stats as _row_stats
    from ppo_ops.core.contracts import BackwardStats, RowInputs, ShardOptions, UpstreamGrads
    from ppo_ops.logits import triton_backend as tb

    dtype = DTYPES[name]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn((n_rows, vocab), device=dev, generator=gen) * 3).to(dtype)
    target_col = torch.randint(0, vocab, (n_rows,), device=dev, generator=gen)
    keep_mask = (torch.rand((n_rows, vocab), device=dev, generator=gen) < 0.5) if keep else None
    g_lp = torch.rand(n_rows, device=dev, generator=gen) + 0.5
    g_ent = torch.rand(n_rows, device=dev, generator=gen) * 2 - 1
    nbytes = logits.numel() * logits.element_size()
    keep_bytes = logits.numel() if keep else 0
    seg8 = vocab // 8

    dst = torch.empty_like(logits)
    copy_ms = _bench(functools.partial(dst.copy_, logits))
    copy_gbs = 2 * nbytes / copy_ms[1] / 1e6
    dst = None  # frees the copy's buffer
    print(f"== {name}: T={n_rows} V={vocab} keep={keep}: logits {nbytes / 1e9:.2f} GB; device copy "
          f"{copy_ms[1]:.3f} ms = {copy_gbs:.0f} GB/s (read + write)", flush=True)

    rows = torch.linspace(0, n_rows - 1, check_rows, device=dev).long().unique()
    keep_rows = None if keep_mask is None else keep_mask[rows]
    ref_partials8 = _reference_partials(logits[rows], target_col[rows], keep_rows, seg8)
    ref_partials1 = _reference_partials(logits[rows], target_col[rows], keep_rows, vocab)

    partials = tb.forward_partials(RowInputs(logits, target_col, keep_mask, None), ShardOptions(1.0, vocab, seg8, 0),
                                   True)
    stats = _row_stats.merge_partials(partials, keep)
    row_stats = (stats.shift, stats.log_sum, stats.log_sum_kept if keep else stats.log_sum, stats.mean_shifted)
    inputs = RowInputs(logits, target_col, keep_mask, None)
    ref_grad = _reference_grad(logits[rows], target_col[rows], keep_rows, [s[rows] for s in row_stats], g_lp[rows],
                               g_ent[rows])
    grad_tol = GRAD_ATOL + HALF_ULP[dtype] * ref_grad.abs()

    table = []
    best = {}
    jobs = [("forward", v, seg8) for v in FORWARD_VARIANTS[logits.element_size()]] + [("forward", None, vocab)]
    jobs += [("backward", v, None) for v in BACKWARD_VARIANTS[logits.element_size()]]
    for pass_name, variant, seg_len in jobs:
        config = tb.launch_config(pass_name, dtype, seg_len or vocab, interpreted=False,
                                  **({} if variant is None else dict(zip(("block_v", "num_warps", "num_stages",
                                                                          "lane_width"), variant))))
        label = f"{config.block_v}/{config.num_warps}/{config.num_stages}" + (" (default)" if variant is None else "")
        if pass_name == "forward":
            label = f"chunk {config.lane_width} {label}"
        overrides = config._asdict()
        try:
            if pass_name == "forward":
                segs = vocab // seg_len
                shard = ShardOptions(1.0, vocab, seg_len, 0)
                fn = functools.partial(tb.forward_partials, inputs, shard, True, **overrides)
                got = fn()[:, :, rows]
                excess = _partials_error(got, ref_partials8 if segs == 8 else ref_partials1)
                moved = nbytes + keep_bytes
            else:
                segs = ""
                out = torch.empty_like(logits)
                fn = functools.partial(tb.backward_grad, inputs, ShardOptions(1.0, vocab, vocab, 0),
                                       BackwardStats(*row_stats), UpstreamGrads(g_lp, g_ent), out, **overrides)
                fn()
                excess = ((out[rows].double() - ref_grad).abs() - grad_tol).max().item()
                moved = 2 * nbytes + keep_bytes
            ms = _bench(fn)
            del fn  # it holds the backward's output buffer: free it before the next variant allocates its own
            if pass_name == "backward":
                del out
            gbs = moved / ms[1] / 1e6
            check = "ok" if excess <= 0 else f"FAIL (+{excess:.2g})"
            table.append([pass_name, label, segs, f"{ms[0]:.3f}", f"{ms[1]:.3f}", f"{ms[2]:.3f}", f"{gbs:.0f}",
                          f"{gbs / copy_gbs:.2f}", check])
            key = (pass_name, segs or 8)
            if excess <= 0 and ms[1] < best.get(key, (None, float("inf")))[1]:
                best[key] = (label, ms[1], moved)
        except Exception as error:  # noqa: BLE001 - one failing variant must not end the run
            table.append([pass_name, label, segs if pass_name == "forward" else "", "-", "-", "-", "-", "-",
                          f"ERROR {type(error).__name__}: {str(error).splitlines()[0][:80]}"])
            traceback.print_exc(limit=2)
        torch.cuda.empty_cache()
    _print_table(["pass", "[chunk] BLOCK_V/warps/stages", "segments", "p20 ms", "p50 ms", "p80 ms", "GB/s", "of copy",
                  "check vs float64"], table)
    return copy_gbs, nbytes, keep_bytes, best


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not torch.cuda.is_available():
        raise app.UsageError("needs a CUDA GPU")
    if _VOCAB.value % 8:
        raise app.UsageError("--vocab must be divisible by 8 (the fixed-segment layout)")
    from ppo_ops.logits import triton_backend as tb

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}", flush=True)
    summary = []
    for name in _DTYPES.value:
        try:
            copy_gbs, nbytes, keep_bytes, best = _tune_dtype(name, _ROWS.value, _VOCAB.value, _KEEP.value,
                                                             _CHECK_ROWS.value)
        except Exception as error:  # noqa: BLE001 - the other dtypes still run
            traceback.print_exc(limit=3)
            summary.append([name, f"ERROR {type(error).__name__}", "", "", "", "", "", ""])
            continue
        fwd, bwd = best.get(("forward", 8)), best.get(("backward", 8))
        if fwd is None or bwd is None:
            summary.append([name, "no passing variant", "", "", "", "", "", ""])
            continue
        total_ms = fwd[1] + bwd[1]
        floor_ms = (3 * nbytes + 2 * keep_bytes) / copy_gbs / 1e6
        summary.append([name, f"{fwd[0]} {fwd[1]:.3f} ms", f"{bwd[0]} {bwd[1]:.3f} ms", f"{total_ms:.3f}",
                        f"{floor_ms:.3f}", f"{floor_ms / total_ms:.2f}", f"{copy_gbs:.0f}",
                        f"fwd {tb._GPU_CONFIG[('forward', DTYPES[name].itemsize)]}, "
                        f"bwd {tb._GPU_CONFIG[('backward', DTYPES[name].itemsize)]}"])
    print("== summary: best passing variant per pass ([chunk] BLOCK_V/warps/stages), forward + backward "
          "against the floor")
    _print_table(["dtype", "forward (8 segments)", "backward", "fwd+bwd ms", "floor ms", "of floor", "copy GB/s",
                  "current _GPU_CONFIG"], summary)


if __name__ == "__main__":
    cli.run(main, program="triton_tune")
