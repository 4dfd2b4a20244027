"""Probe: the fused LM head's segment-GEMM backend (its chunk path) timed piece by piece, on one CUDA GPU.

    python3 tools/probes/lm_head_pieces.py --out_dir=/tmp/pieces [--tokens=8192,32768] [--label=R1]

At (T, H, V) = (T, 4096, 151936), bf16, TP = 1, T = 8192 unless --tokens names others: one cuBLAS GEMM of the whole
logits; the chunk GEMMs, the partials pass and the forward-only op at several row-block sizes; the gradient pass; the
dX and dW GEMMs (bf16 out and fp32 accumulator, several K); linear_token_loss fwd + bwd at several chunk shapes, with
its peak extra memory; and, measured but not adopted, the partials pass on a second stream and the chunk GEMMs with
bf16 output. Each piece is the median of PIECE_REPS calls after one warm-up, CUDA events around each call. Rows
(label, T, piece, ms, what) are appended to pieces.csv in --out_dir.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(os.path.abspath(__file__)).parents[2]))  # the repository root

from absl import app, flags

from ppo_ops.runtime import cli
from tools.bench import lm_head, measure, report
from tools.bench.common import QWEN3_VOCAB

LM_HEAD_HIDDEN = lm_head.HIDDEN
GIB = float(1 << 30)
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Directory of pieces.csv (appended to).", required=True)
_TOKENS = flags.DEFINE_list("tokens", ["8192"], "T values.")
_SEED = flags.DEFINE_integer("seed", 1234, "Seed of the random inputs.")
_LABEL = flags.DEFINE_string("label", "", "A name for this run, written on each of its rows.")

FIELDS = ("label", "T", "piece", "ms", "what")
FILE_NAME = "pieces.csv"
PIECE_REPS = 5
TOKEN_LOSS_REPS = 3  # a whole fwd + bwd at T = 8192 is ~60 ms: fewer calls
SEGMENTS = 8  # the vocabulary's fixed segments at TP = 1
CHUNK_ROWS = (512, 1024, 2048)
DW_K = (1024, 2048, 4096, 8192)
TOKEN_LOSS_SHAPES = ((1024, 1024), (512, 2048), (1024, 2048), (512, 1024))  # (loss_block_rows, loss_group_rows)


def event_ms(fn, reps: int = PIECE_REPS) -> float:
    """Median ms of fn() over `reps` calls after one warm-up (measure.event_ms)."""
    return measure.event_ms(fn, reps)


class _Pieces:
    """One T's pieces: the inputs, the segment views and the rows measured so far."""

    def __init__(self, T: int, seed: int, label: str):
        from tools.probes import internals

        self.internals = internals
        self.T, self.label, self.rows = T, label, []
        self.inp = lm_head.make_inputs(lm_head.case("gemms", T), torch.device("cuda"), seed=seed)
        self.seg_len = QWEN3_VOCAB // SEGMENTS
        self.passes = internals.triton_passes()
        self.shard = internals.shard(QWEN3_VOCAB, self.seg_len)
        self.default = internals.DEFAULT_CHUNK_SHAPE

    def record(self, piece: str, ms: float, what: str) -> None:
        self.rows.append(dict(label=self.label, T=self.T, piece=piece, ms=f"{ms:.3f}", what=what))
        print(f"{piece}: {ms:.3f} ms  ({what})", flush=True)

    def x_rows(self, block: int, rows: int) -> torch.Tensor:
        return self.inp.hidden[block * rows:(block + 1) * rows]

    def w_segment(self, s: int) -> torch.Tensor:
        return self.inp.weight[s * self.seg_len:(s + 1) * self.seg_len]

    def chunk(self, rows: int, dtype=torch.float32) -> torch.Tensor:
        return torch.empty((rows, self.seg_len), dtype=dtype, device=self.inp.hidden.device)


def _chunk_gemms(p: _Pieces, rows: int, out: torch.Tensor, mm) -> None:
    for b in range(p.T // rows):
        for s in range(SEGMENTS):
            mm(p.x_rows(b, rows), p.w_segment(s).T, out)


def _partials_on_one_chunk(p: _Pieces, rows: int, chunk: torch.Tensor, part: torch.Tensor) -> None:
    for _ in range(p.T // rows):
        for s in range(SEGMENTS):
            p.passes.partials(chunk, rows, p.inp.tokens[:rows], p.shard.segment(s * p.seg_len), True, part)


def _forward_nograd(p: _Pieces) -> None:
    import ppo_ops

    with torch.no_grad():
        ppo_ops.linear_log_probs_and_entropy(p.inp.hidden, p.inp.weight, p.inp.tokens, entropy="value",
                                             validate=False)


def _row_blocks(p: _Pieces) -> None:
    """The chunk GEMMs, the partials pass and the forward-only op at each row-block size."""
    for rows in CHUNK_ROWS:
        chunk = p.chunk(rows)
        blocks = p.T // rows
        p.record(f"chunk_gemms_rows{rows}", event_ms(functools.partial(_chunk_gemms, p, rows, chunk,
                                                                       p.internals.mm_fp32)),
                 f"{blocks * SEGMENTS} GEMMs [{rows}, H] x [H, {p.seg_len}] fp32 out")
        part = torch.empty((5, rows), dtype=torch.float32, device=chunk.device)
        p.internals.mm_fp32(p.x_rows(0, rows), p.w_segment(0).T, chunk)
        p.record(f"partials_pass_rows{rows}", event_ms(functools.partial(_partials_on_one_chunk, p, rows, chunk, part)),
                 f"{blocks * SEGMENTS} partials launches on one chunk (L2-warm: the same chunk each time)")
        with p.internals.chunk_shape(block_rows=rows):
            p.record(f"forward_nograd_rows{rows}", event_ms(functools.partial(_forward_nograd, p)),
                     "the op under no_grad, validate off")
        del chunk, part


def _dlogits_pass(p: _Pieces, rows: int, chunk, vec, g, dl) -> None:
    stats, upstream = p.internals.dlogits_inputs(vec, g)
    for _ in range(p.T // rows):
        for s in range(SEGMENTS):
            p.passes.dlogits(chunk, rows, p.inp.tokens[:rows], p.shard.segment(s * p.seg_len), stats, upstream,
                             dl[:rows])


def _dx_gemms(p: _Pieces, m: int, dx32, dl) -> None:
    for s in range(SEGMENTS):
        p.internals.addmm_fp32(dx32[:m], dl[:m], p.w_segment(s))


def _dw_rounded(p: _Pieces, n: int, k: int, dl, dw) -> None:
    for _ in range(n):
        p.internals.mm_rounded(dl[:k].T, p.inp.hidden[:k], dw)


def _dw_accumulated(p: _Pieces, n: int, k: int, dl, acc) -> None:
    for _ in range(n):
        p.internals.addmm_fp32(acc, dl[:k].T, p.inp.hidden[:k])


def _backward_pieces(p: _Pieces) -> None:
    """The gradient pass, the dX GEMMs and the dW GEMMs at several K."""
    device = p.inp.hidden.device
    rows, dw_rows = p.default.block_rows, p.default.group_rows
    chunk = p.chunk(rows)
    p.internals.mm_fp32(p.x_rows(0, rows), p.w_segment(0).T, chunk)
    dl = torch.empty((dw_rows, p.seg_len), dtype=torch.bfloat16, device=device)
    vec = torch.zeros(rows, device=device)
    g = torch.rand(rows, device=device)
    p.record("dlogits_pass", event_ms(functools.partial(_dlogits_pass, p, rows, chunk, vec, g, dl)),
             f"{p.T // rows * SEGMENTS} gradient launches, fp32 chunk -> bf16 dlogits")
    dl.normal_()
    dx32 = torch.zeros((dw_rows, LM_HEAD_HIDDEN), dtype=torch.float32, device=device)
    m = min(p.T, dw_rows)
    p.record("dx_gemms", event_ms(functools.partial(_dx_gemms, p, m, dx32, dl)),
             f"{SEGMENTS} x (dX32[{m}] += dl[{m}, {p.seg_len}] @ W_s), fp32 accumulator")
    dw = torch.empty((p.seg_len, LM_HEAD_HIDDEN), dtype=torch.bfloat16, device=device)
    acc = torch.zeros((p.seg_len, LM_HEAD_HIDDEN), dtype=torch.float32, device=device)
    for k in DW_K:
        if k > m:
            continue
        n = (p.T // k) * SEGMENTS
        p.record(f"dw_gemms_k{k}_bf16out", event_ms(functools.partial(_dw_rounded, p, n, k, dl, dw)),
                 f"{n} x dW_s = dl^T @ X, K = {k}, bf16 out")
        p.record(f"dw_gemms_k{k}_fp32acc", event_ms(functools.partial(_dw_accumulated, p, n, k, dl, acc)),
                 f"{n} x dW32_s += dl^T @ X, K = {k}, fp32 accumulator")


def _token_loss_step(p: _Pieces, closure):
    import ppo_ops

    x, w = p.inp.leaves()
    loss, _ = ppo_ops.linear_token_loss(x, w, p.inp.tokens, closure, entropy="grad", validate=False)
    return torch.autograd.grad(loss, [x, w])


def _token_loss_shapes(p: _Pieces) -> None:
    closure = p.inp.ppo_loss()
    step = functools.partial(_token_loss_step, p, closure)
    for loss_rows, loss_dw_rows in TOKEN_LOSS_SHAPES:
        with p.internals.chunk_shape(loss_block_rows=loss_rows, loss_group_rows=loss_dw_rows):
            ms = event_ms(step, reps=TOKEN_LOSS_REPS)
            peak = measure.peak_extra_bytes(lambda _: step(), lambda: None, p.inp.hidden.device)
            p.record(f"token_loss_rows{loss_rows}_dwrows{loss_dw_rows}", ms,
                     f"linear_token_loss fwd+bwd, PPO closure, validate off; peak extra {peak / GIB:.3f} GiB")


def _two_streams(p: _Pieces, rows: int, chunks, part, side) -> None:
    """GEMMs on the current stream, the partials pass of each chunk on `side` (two chunks in flight)."""
    main = torch.cuda.current_stream()
    done = [None, None]
    for i in range(p.T // rows * SEGMENTS):
        b, s = divmod(i, SEGMENTS)
        c = chunks[i % 2]
        if done[i % 2] is not None:
            main.wait_event(done[i % 2])
        p.internals.mm_fp32(p.x_rows(b, rows), p.w_segment(s).T, c)
        ready = torch.cuda.Event()
        ready.record(main)
        with torch.cuda.stream(side):
            side.wait_event(ready)
            p.passes.partials(c, rows, p.inp.tokens[b * rows:(b + 1) * rows], p.shard.segment(s * p.seg_len), True,
                              part[b, s])
            done[i % 2] = torch.cuda.Event()
            done[i % 2].record(side)
    main.wait_stream(side)


def _not_adopted(p: _Pieces) -> None:
    """Measured, not adopted: the partials pass on a second stream overlapping the next chunk's GEMM; the chunk GEMMs
    with bf16 output."""
    rows = p.default.block_rows
    chunks = [p.chunk(rows) for _ in range(2)]
    part = torch.empty((p.T // rows, SEGMENTS, 5, rows), dtype=torch.float32, device=p.inp.hidden.device)
    p.record("forward_two_streams", event_ms(functools.partial(_two_streams, p, rows, chunks, part,
                                                               torch.cuda.Stream())),
             "GEMMs on one stream, partials on another (no merge)")
    bf = p.chunk(rows, torch.bfloat16)
    p.record(f"chunk_gemms_rows{rows}_bf16out",
             event_ms(functools.partial(_chunk_gemms, p, rows, bf, lambda a, b, out: torch.mm(a, b, out=out))),
             "the chunk GEMMs with bf16 output instead")


def _gemm1(p: _Pieces) -> torch.Tensor:
    return p.inp.hidden @ p.inp.weight.T


def run(out_dir: str, tokens: list[int], *, seed: int, label: str) -> int:
    """Times the pieces at each T and appends them to out_dir/pieces.csv; returns the exit status."""
    path = os.path.join(out_dir, FILE_NAME)
    for T in tokens:
        p = _Pieces(T, seed, label)
        p.record("gemm1", event_ms(functools.partial(_gemm1, p)), "one cuBLAS GEMM, bf16 logits [T, V]")
        _row_blocks(p)
        _backward_pieces(p)
        _token_loss_shapes(p)
        _not_adopted(p)
        report.append_csv(path, p.rows, columns=FIELDS)
        del p
        torch.cuda.empty_cache()
    print(f"wrote {path}")
    return 0


def main(argv):
    del argv
    try:
        tokens = [int(t) for t in _TOKENS.value]
    except ValueError as error:
        raise app.UsageError(f"--tokens: expected integers, got {_TOKENS.value}") from error
    if not torch.cuda.is_available():
        raise app.UsageError("the pieces are CUDA kernels: run on a GPU")
    out_dir = cli.caller_path(_OUT_DIR.value)
    os.makedirs(out_dir, exist_ok=True)
    return run(out_dir, tokens, seed=_SEED.value, label=_LABEL.value)


if __name__ == "__main__":
    cli.run(main, program="lm_head_pieces")
