"""Triton backend: the two backend-contract functions over the kernels of `_triton_kernels.py`.

`forward_partials` reads each kept row's logits once, in their own dtype, and returns the [nseg, 5, T] fp32 segment
partials (MAX, SUMEXP, KEPT_SUMEXP, ENT_SUM, TARGET_Z); `backward_grad` reads the logits once more and writes the full
gradient (in place when `out` is the logits). The row mask goes to the kernels as bytes: a dropped row's programs read
none of its logits and write neutral partials or a zero gradient row, with no host sync and no index list. The core
(ppo_ops/_function.py) does everything around them: validation, the TP all-gather of the partials, their fixed-order
merge into row stats, autograd. No fp32 [T, V] copy is ever made, so `chunk_rows` (a bound on fp32 working rows for the
torch backend) is accepted and ignored.

Forward kernel: one, `forward_partials_kernel` (lanes of CHUNK contiguous columns, see _triton_kernels.py); CHUNK is a
launch option like the tile size. Different CHUNKs give partials within the same tolerances, not the same bits, so
every rank must use the same config (they do: it depends only on the dtype and segment length).
Tile sizes: on CUDA they come from `_GPU_CONFIG` (per pass and dtype, see tools/triton_tune.py); under the interpreter
(TRITON_INTERPRET=1, CPU tensors) each loop iteration costs about a millisecond, so tiles cover a whole segment or row
up to a cap. The forward tile depends only on the segment length and dtype, never on V_local: that keeps a segment's bits
independent of the TP size. ppo_ops/api.py imports this module only when the backend is selected, so `import ppo_ops`
works without triton and TRITON_INTERPRET is read then (Triton reads it when the kernels are decorated).
"""

import os
from typing import NamedTuple, Optional

import torch
import triton  # noqa: F401  an ImportError here is how backend="auto" (ppo_ops/api.py) learns triton is absent

from ppo_ops import _triton_kernels
from ppo_ops._triton_merge import merge_partials  # noqa: F401  the core uses it in place of the torch-op merge
from ppo_ops._row_stats import NUM_PARTIALS

# (BLOCK_V, num_warps, num_stages[, chunk]) per pass and logits element size in bytes: the fastest correct variants of
# tools/triton_tune.py on H200s (T=8192, V=151936, 8 segments; tools/bench/results/triton_tune_h200.log, whose run
# has them at: forward bf16 1024/4/1 chunk 8 0.628 ms (93% of the copy bandwidth's rate), fp32 4096/8/1 chunk 4
# 1.131 ms (other chunk-4 variants within 0.3%); backward bf16 4096/4/1 1.377 ms, fp32 1024/4/1 2.508 ms).
_GPU_CONFIG = {
    ("forward", 2): (1024, 4, 1, 8),
    ("forward", 4): (4096, 8, 1, 4),
    ("backward", 2): (4096, 4, 1),
    ("backward", 4): (1024, 4, 1),
}
_INTERPRET_CHUNK = 8  # the interpreter runs the chunk CUDA runs for bf16
# Largest interpreter tile: big enough for few loop iterations, small enough for cheap numpy temporaries.
_INTERPRET_MAX_BLOCK = 1 << 16


def interpreting():
    """True when the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 was set before this module loaded)."""
    return type(_triton_kernels.forward_partials_kernel).__name__ == "InterpretedFunction"


def _check_device(name, tensor):
    if tensor.is_cuda:
        return
    if not interpreting():
        if os.environ.get("TRITON_INTERPRET") == "1":
            hint = "TRITON_INTERPRET=1 was set after the kernels were first loaded; set it before importing ppo_ops"
        else:
            hint = "set TRITON_INTERPRET=1 before importing ppo_ops to run on CPU"
        raise ValueError(
            f"triton backend needs CUDA tensors or TRITON_INTERPRET=1: `{name}` is on {tensor.device} ({hint})"
        )


def _check_logits(logits):
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"`logits` must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(
            f"`logits` must be 2-D [T, V_local] with stride(-1) == 1, got shape {tuple(logits.shape)} "
            f"and strides {logits.stride()}"
        )
    _check_device("logits", logits)


def _row_bytes(name, flags, logits):
    """A [T] bool per-row tensor (the row mask, the gradient flags) as uint8 (bool and uint8 share storage),
    contiguous, on the logits' device."""
    if flags.shape != logits.shape[:1] or flags.dtype != torch.bool:
        raise ValueError(
            f"`{name}` must be bool of shape ({logits.shape[0]},), got {flags.dtype} {tuple(flags.shape)}"
        )
    if flags.device != logits.device:
        raise ValueError(f"`{name}` must be on {logits.device} like `logits`, got {flags.device}")
    return flags.contiguous().view(torch.uint8)


def _check_row_vector(name, t, logits):
    """Per-row tensors are indexed by the row itself: one entry per row of the logits."""
    if t is not None and t.shape != logits.shape[:1]:
        raise ValueError(f"`{name}` must have shape ({logits.shape[0]},) (one entry per row), got {tuple(t.shape)}")


def _keep_bytes(keep_mask, logits):
    """The keep mask as a [T, V_local] uint8 view (bool and uint8 share storage), unit column stride."""
    if keep_mask.shape != logits.shape or keep_mask.dtype != torch.bool:
        raise ValueError(
            f"`keep_mask` must be bool of shape {tuple(logits.shape)}, got {keep_mask.dtype} {tuple(keep_mask.shape)}"
        )
    if keep_mask.stride(-1) != 1:
        keep_mask = keep_mask.contiguous()
    return keep_mask.view(torch.uint8)


class LaunchConfig(NamedTuple):
    block_v: int  # columns per tile (a power of two)
    num_warps: Optional[int]  # None under the interpreter
    num_stages: Optional[int]
    chunk: int = 1  # forward: contiguous columns per lane and tile, a power of two <= block_v (ignored by the backward)


def launch_config(pass_name, dtype, n_cols, interpreted, block_v=None, num_warps=None, num_stages=None, chunk=None):
    """Tile and launch options of a pass whose tiles cover n_cols columns (forward: a segment; backward: a row).

    The forward's config depends only on (seg_len, dtype), never on V_local, so every TP size runs the same code on a
    segment. The keywords override single fields (tools/triton_tune.py); the chunk is capped at the tile."""
    if interpreted:
        default = LaunchConfig(min(_next_pow2(n_cols), _INTERPRET_MAX_BLOCK), None, None, _INTERPRET_CHUNK)
    else:
        default = LaunchConfig(*_GPU_CONFIG[(pass_name, dtype.itemsize)])
    config = LaunchConfig(
        default.block_v if block_v is None else block_v,
        default.num_warps if num_warps is None else num_warps,
        default.num_stages if num_stages is None else num_stages,
        default.chunk if chunk is None else chunk,
    )
    if config.chunk < 1 or config.chunk & (config.chunk - 1):
        raise ValueError(f"`chunk` must be a power of two, got {config.chunk}")
    return config._replace(chunk=min(config.chunk, config.block_v))


def _options(config):
    """Compiler options of a launch (none under the interpreter, which ignores them)."""
    if config.num_warps is None:
        return {}
    # fp fusion explicit: Triton 3.9 warns that its default changes in 3.10; fused multiply-adds are the faster choice.
    return {"num_warps": config.num_warps, "num_stages": config.num_stages, "enable_fp_fusion": True}


def _segment_align(seg_len, tensor, block):
    """Alignment (elements) the forward kernel may assume for a tensor's segment starts: the largest power of two up to
    16 bytes that divides seg_len and the block, so it is the same at every TP size; 1 if this tensor's row stride or
    address does not allow it (then vector width, and so the bits, may differ from other TP sizes)."""
    align = 16 // tensor.element_size()
    while align > 1 and (seg_len % align or block % align):
        align //= 2
    if tensor.stride(0) % align or tensor.data_ptr() % (align * tensor.element_size()):
        return 1
    return align


def _next_pow2(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def forward_partials(
    logits, row_mask, tokens, keep_mask, inv_temperature, n_valid, seg_len, with_entropy, chunk_rows, vocab_start=0,
    **overrides
):
    """[V_local // seg_len, 5, T] fp32 segment partials, neutral for dropped rows (backend contract; `overrides` are
    LaunchConfig fields)."""
    del chunk_rows  # no fp32 working copy to bound
    _check_logits(logits)
    _check_row_vector("tokens", tokens, logits)
    num_rows, v_local = logits.shape
    if seg_len <= 0 or v_local % seg_len != 0:
        raise ValueError(f"`seg_len` must be a positive divisor of V_local={v_local}, got {seg_len}")
    if not 0 <= n_valid <= v_local:
        raise ValueError(f"`n_valid` must be in [0, {v_local}], got {n_valid}")
    out = torch.empty((v_local // seg_len, NUM_PARTIALS, num_rows), dtype=torch.float32, device=logits.device)
    if out.numel() == 0:
        return out
    config = launch_config("forward", logits.dtype, seg_len, interpreting(), **overrides)
    grid, args, kwargs = forward_launch_args(
        logits, row_mask, tokens, keep_mask, inv_temperature, n_valid, seg_len, with_entropy, out, config, vocab_start
    )
    _triton_kernels.forward_partials_kernel[grid](*args, **kwargs)
    return out


def forward_launch_args(logits, row_mask, tokens, keep_mask, inv_temperature, n_valid, seg_len, with_entropy,
                        out, config, vocab_start=0):
    """(grid, args, kwargs) of one forward launch: one program per (row, segment), dropped rows included (they store
    neutral partials)."""
    num_rows, v_local = out.shape[2], logits.shape[1]
    keep = None if keep_mask is None else _keep_bytes(keep_mask, logits)
    row_bytes = None if row_mask is None else _row_bytes("row_mask", row_mask, logits)
    tokens = _vector(tokens, torch.int64)
    args = (
        # data ptrs (an unused pointer gets any tensor: the constexprs switch its loads off)
        logits, tokens if row_bytes is None else row_bytes, tokens,
        logits if keep is None else keep, out,
        # shapes
        num_rows, n_valid, seg_len, v_local, int(vocab_start),
        # strides
        logits.stride(0), 0 if keep is None else keep.stride(0),
        # constants
        float(inv_temperature),
    )
    kwargs = dict(
        HAS_ROW_MASK=row_bytes is not None, HAS_KEEP=keep is not None, WITH_ENTROPY=bool(with_entropy),
        SCALE=float(inv_temperature) != 1.0, BLOCK_V=config.block_v,
        LOGITS_ALIGN=_segment_align(seg_len, logits, config.block_v),
        KEEP_ALIGN=1 if keep is None else _segment_align(seg_len, keep, config.block_v),
        CHUNK=config.chunk,
        **_options(config),
    )
    return (num_rows, v_local // seg_len), args, kwargs


def backward_grad(
    logits, row_mask, tokens, keep_mask, inv_temperature, n_valid, shift, log_sum, log_sum_kept, mean_shifted,
    grad_logprob, grad_entropy, out, chunk_rows, logprob_ok=None, row_has_mass=None, vocab_start=0, **overrides
):
    """Writes d(loss)/d(logits) into `out`, zero rows where row_mask is False (backend contract; `out` may be
    `logits`; `overrides`: LaunchConfig). The kernel applies logprob_ok / row_has_mass to the upstream gradients
    itself: no torch ops between autograd and the launch (with validate=True the host is on the critical path)."""
    del chunk_rows
    _check_logits(logits)
    if out.shape != logits.shape or out.dtype != logits.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"`out` must match logits ({logits.dtype} {tuple(logits.shape)}, stride(-1) == 1), got {out.dtype} "
            f"{tuple(out.shape)} strides {out.stride()}"
        )
    if grad_entropy is not None and mean_shifted is None:
        raise ValueError("`mean_shifted` is required when `grad_entropy` is given")
    has_keep = keep_mask is not None and grad_logprob is not None  # the keep mask only shapes q
    if has_keep and log_sum_kept is None:
        raise ValueError("`log_sum_kept` is required when `keep_mask` and `grad_logprob` are given")
    for name, t in (("tokens", tokens), ("shift", shift), ("log_sum", log_sum),
                    ("log_sum_kept", log_sum_kept), ("mean_shifted", mean_shifted), ("grad_logprob", grad_logprob),
                    ("grad_entropy", grad_entropy)):
        _check_row_vector(name, t, logits)
    num_rows, v_local = logits.shape
    if num_rows == 0 or v_local == 0:
        return
    row_bytes = None if row_mask is None else _row_bytes("row_mask", row_mask, logits)
    keep = _keep_bytes(keep_mask, logits) if has_keep else None
    config = launch_config("backward", logits.dtype, v_local, interpreting(), **overrides)
    shift = _vector(shift, torch.float32)
    unused = shift  # stands in for pointers the constexprs switch off
    _triton_kernels.backward_grad_kernel[(num_rows, _cdiv(v_local, config.block_v))](
        # data ptrs
        logits, out, unused if row_bytes is None else row_bytes, _vector(tokens, torch.int64),
        logits if keep is None else keep,
        shift, _vector(log_sum, torch.float32), _vector(log_sum_kept, torch.float32, unused),
        _vector(mean_shifted, torch.float32, unused), _vector(grad_logprob, torch.float32, unused),
        _vector(grad_entropy, torch.float32, unused),
        unused if logprob_ok is None else _row_bytes("logprob_ok", logprob_ok, logits),
        unused if row_has_mass is None else _row_bytes("row_has_mass", row_has_mass, logits),
        # shapes
        v_local, n_valid, int(vocab_start),
        # strides
        logits.stride(0), out.stride(0), 0 if keep is None else keep.stride(0),
        # constants
        float(inv_temperature),
        HAS_ROW_MASK=row_bytes is not None, HAS_KEEP=has_keep, HAS_GLP=grad_logprob is not None,
        HAS_GENT=grad_entropy is not None, HAS_LP_OK=logprob_ok is not None, HAS_MASS=row_has_mass is not None,
        SCALE=float(inv_temperature) != 1.0, BLOCK_V=config.block_v,
        ROUND_BF16_BY_BITS=out.dtype == torch.bfloat16 and interpreting(), **_options(config),
    )


def _vector(t, dtype, default=None):
    """A [T] per-row tensor as the kernels index it: contiguous, of `dtype` (no copy when it already is)."""
    if t is None:
        return default
    return t.to(dtype).contiguous()


def _cdiv(a, b):
    return -(-a // b)
