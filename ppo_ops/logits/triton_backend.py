"""Triton backend: the launchers of the kernels of `triton_kernels.py`, and `TritonBackend`, the backend contract
(core/contracts.py) over them.

`forward_partials` reads each kept row's logits once, in their own dtype, and returns the [nseg, 5, T] fp32 segment
partials (MAX, SUMEXP, KEPT_SUMEXP, ENT_SUM, TARGET_Z); `backward_grad` reads the logits once more and writes the full
gradient (in place when `out` is the logits). The row mask goes to the kernels as bytes: a dropped row's programs read
none of its logits and write neutral partials or a zero gradient row, with no host sync and no index list.
`merge_partials` merges the partials of every rank into row stats in one launch. The core (logits/function.py)
does everything around them: validation, the TP all-gather of the partials, autograd. No fp32 [T, V] copy is ever
made, so `chunk_rows` (a bound on fp32 working rows for the torch backend) is accepted and ignored.

Forward kernel: one, `forward_partials_kernel` (lanes of LANE_WIDTH contiguous columns, see triton_kernels.py);
the lane width is a launch option like the tile size. Different lane widths give partials within the same
tolerances, not the same bits, so every rank must use the same config (they do: it depends only on the dtype and
segment length). Merge: `merge_partials` launches `merge_partials_kernel` once per forward.
Tile sizes: on CUDA they come from `_GPU_CONFIG` (per pass and dtype; docs/performance.md); under the interpreter
(TRITON_INTERPRET=1, CPU tensors) each loop iteration costs about a millisecond, so tiles cover a whole segment or row
up to a cap. The forward tile depends only on the segment length and dtype, never on V_local: that keeps a segment's
bits independent of the TP size. Its loader (ppo_ops/backends.py) imports this module only when the shell selects
the backend, so `import ppo_ops` works without triton and TRITON_INTERPRET is read then (Triton reads it when the
kernels are decorated).
"""

import functools
from typing import NamedTuple, Optional

import torch
import triton  # noqa: F401  an ImportError here is how backend="auto" (ppo_ops/api.py) learns triton is absent

from ppo_ops.core.checks import argument_error
from ppo_ops.core.contracts import BackwardStats, RowInputs, RowStats, ShardOptions, UpstreamGrads
from ppo_ops.core import row_stats
from ppo_ops.core.row_stats import NUM_PARTIALS
from ppo_ops.core.shell import interpret_requested
from ppo_ops.core.triton_common import cdiv, interpreting, options, round_bf16_by_bits, transform_args
from ppo_ops.core.triton_launch import launcher
from ppo_ops.logits import triton_kernels

_WHERE = "logits.triton_backend"  # message prefix of this module's own checks: "ppo_ops.logits.triton_backend: ..."

# The three kernels of a call, launched with little host work: a small call is host-bound (core/triton_launch.py).
_FORWARD = launcher(triton_kernels.forward_partials_kernel)
_MERGE = launcher(triton_kernels.merge_partials_kernel)
_BACKWARD = launcher(triton_kernels.backward_grad_kernel)

# (BLOCK_V, num_warps, num_stages[, lane width]) per pass and logits element size in bytes: the fastest correct
# variants measured on H200s (docs/performance.md says how and what they gave).
_GPU_CONFIG = {
    ("forward", 2): (1024, 4, 1, 8),
    ("forward", 4): (4096, 8, 1, 4),
    ("backward", 2): (4096, 4, 1),
    ("backward", 4): (1024, 4, 1),
}
_INTERPRET_LANE_WIDTH = 8  # the interpreter runs the lane width CUDA runs for bf16
# Largest interpreter tile: big enough for few loop iterations, small enough for cheap numpy temporaries.
_INTERPRET_MAX_BLOCK = 1 << 16


def _check_device(name, tensor):
    if tensor.is_cuda:
        return
    if not interpreting():
        if interpret_requested():
            hint = "TRITON_INTERPRET=1 was set after the kernels were first loaded; set it before importing ppo_ops"
        else:
            hint = "set TRITON_INTERPRET=1 before importing ppo_ops to run on CPU"
        raise argument_error(ValueError, _WHERE, name,
                             f"triton backend needs CUDA tensors or TRITON_INTERPRET=1: {name} is on {tensor.device} "
                             f"({hint})")


def _check_logits(logits):
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise argument_error(TypeError, _WHERE, "logits",
                             f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise argument_error(ValueError, _WHERE, "logits",
                             f"logits must be 2-D [T, V_local] with stride(-1) == 1, got shape {tuple(logits.shape)} "
                             f"and strides {logits.stride()}")
    _check_device("logits", logits)


def _row_bytes(name, flags, logits):
    """A [T] bool per-row tensor (the row mask, the gradient flags) as uint8 (bool and uint8 share storage),
    contiguous, on the logits' device."""
    if flags.shape != logits.shape[:1] or flags.dtype != torch.bool:
        raise argument_error(ValueError, _WHERE, name,
                             f"{name} must be bool of shape ({logits.shape[0]},), got {flags.dtype} "
                             f"{tuple(flags.shape)}")
    if flags.device != logits.device:
        raise argument_error(ValueError, _WHERE, name,
                             f"{name} must be on {logits.device} like logits, got {flags.device}")
    return (flags if flags.is_contiguous() else flags.contiguous()).view(torch.uint8)


def _check_row_vector(name, t, logits):
    """Per-row tensors are indexed by the row itself: one entry per row of the logits."""
    if t is not None and t.shape != logits.shape[:1]:
        raise argument_error(ValueError, _WHERE, name,
                             f"{name} must have shape ({logits.shape[0]},) (one entry per row), got {tuple(t.shape)}")


def _keep_bytes(keep_mask, logits):
    """The keep mask as a [T, V_local] uint8 view (bool and uint8 share storage), unit column stride."""
    if keep_mask.shape != logits.shape or keep_mask.dtype != torch.bool:
        raise argument_error(
            ValueError, _WHERE, "keep_mask",
            f"keep_mask must be bool of shape {tuple(logits.shape)}, got {keep_mask.dtype} {tuple(keep_mask.shape)}")
    if keep_mask.stride(-1) != 1:
        keep_mask = keep_mask.contiguous()
    return keep_mask.view(torch.uint8)


class LaunchConfig(NamedTuple):
    block_v: int  # columns per tile (a power of two)
    num_warps: Optional[int]  # None under the interpreter
    num_stages: Optional[int]
    lane_width: int = 1  # forward: contiguous columns per lane and tile, a power of two <= block_v (backward: unused)


@functools.lru_cache(maxsize=256)
def launch_config(pass_name, dtype, n_cols, interpreted, block_v=None, num_warps=None, num_stages=None,
                  lane_width=None):
    """Tile and launch options of a pass whose tiles cover n_cols columns (forward: a segment; backward: a row).

    The forward's config depends only on (seg_len, dtype), never on V_local, so every TP size runs the same code on a
    segment. The keywords override single fields (tools/triton_tune.py); the lane width is capped at the tile. A
    function of its arguments, so kept per arguments: one lookup per launch."""
    if interpreted:
        default = LaunchConfig(min(_next_pow2(n_cols), _INTERPRET_MAX_BLOCK), None, None, _INTERPRET_LANE_WIDTH)
    else:
        default = LaunchConfig(*_GPU_CONFIG[(pass_name, dtype.itemsize)])
    config = LaunchConfig(
        default.block_v if block_v is None else block_v,
        default.num_warps if num_warps is None else num_warps,
        default.num_stages if num_stages is None else num_stages,
        default.lane_width if lane_width is None else lane_width,
    )
    if config.lane_width < 1 or config.lane_width & (config.lane_width - 1):
        raise argument_error(ValueError, _WHERE, "lane_width",
                             f"lane_width must be a power of two, got {config.lane_width}")
    return config._replace(lane_width=min(config.lane_width, config.block_v))


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


def forward_partials(inputs: RowInputs, shard: ShardOptions, with_entropy: bool, **overrides) -> torch.Tensor:
    """[V_local // seg_len, 5, T] fp32 segment partials, neutral for dropped rows (the contract's forward_partials;
    `overrides` are LaunchConfig fields). No fp32 working copy is made, so shard.chunk_rows does not apply."""
    logits, seg_len, n_valid = inputs.logits, shard.seg_len, shard.n_valid
    _check_logits(logits)
    _check_row_vector("tokens", inputs.tokens, logits)
    num_rows, v_local = logits.shape
    if seg_len <= 0 or v_local % seg_len != 0:
        raise argument_error(ValueError, _WHERE, "seg_len",
                             f"seg_len must be a positive divisor of V_local={v_local}, got {seg_len}")
    if not 0 <= n_valid <= v_local:
        raise argument_error(ValueError, _WHERE, "n_valid", f"n_valid must be in [0, {v_local}], got {n_valid}")
    out = torch.empty((v_local // seg_len, NUM_PARTIALS, num_rows), dtype=torch.float32, device=logits.device)
    if out.numel() == 0:
        return out
    config = launch_config("forward", logits.dtype, seg_len, interpreting(), **overrides)
    grid, kwargs = forward_launch_args(inputs, shard, with_entropy, out, config)
    _FORWARD(grid, **kwargs)
    return out


def forward_launch_args(inputs: RowInputs, shard: ShardOptions, with_entropy: bool, out: torch.Tensor,
                        config: LaunchConfig):
    """(grid, kwargs) of one forward launch into `out` [segments, 5, T], every kernel argument by name (launch:
    kernel[grid](**kwargs)): one program per (row, segment), dropped rows included (they store neutral partials)."""
    logits, seg_len = inputs.logits, shard.seg_len
    num_rows, v_local = out.shape[2], logits.shape[1]
    keep = None if inputs.keep_mask is None else _keep_bytes(inputs.keep_mask, logits)
    row_bytes = None if inputs.row_mask is None else _row_bytes("row_mask", inputs.row_mask, logits)
    tokens = _vector(inputs.tokens, torch.int64)
    kwargs = dict(
        # An unused pointer gets any tensor: the constexprs switch its loads off.
        logits_ptr=logits, row_mask_ptr=tokens if row_bytes is None else row_bytes, tokens_ptr=tokens,
        keep_ptr=logits if keep is None else keep, out_ptr=out,
        num_rows=num_rows, n_valid=shard.n_valid, seg_len=seg_len, v_local=v_local, vocab_start=int(shard.vocab_start),
        logits_row_stride=logits.stride(0), keep_row_stride=0 if keep is None else keep.stride(0),
        **transform_args(shard, logits),
        HAS_ROW_MASK=row_bytes is not None, HAS_KEEP=keep is not None, WITH_ENTROPY=bool(with_entropy),
        BLOCK_V=config.block_v,
        LOGITS_ALIGN=_segment_align(seg_len, logits, config.block_v),
        KEEP_ALIGN=1 if keep is None else _segment_align(seg_len, keep, config.block_v),
        LANE_WIDTH=config.lane_width,
        **options(config),
    )
    return (num_rows, v_local // seg_len), kwargs


def backward_grad(inputs: RowInputs, shard: ShardOptions, stats: BackwardStats, upstream: UpstreamGrads,
                  out: torch.Tensor, **overrides) -> None:
    """Writes d(loss)/d(logits) into `out`, zero rows where the row mask is False (the contract's backward_grad; `out`
    may be the logits; `overrides`: LaunchConfig fields). The kernel applies stats.log_prob_defined / row_has_mass to
    the upstream gradients itself: no torch ops between autograd and the launch (with validate=True the host is on
    the critical path)."""
    logits = inputs.logits
    _check_logits(logits)
    if out.shape != logits.shape or out.dtype != logits.dtype or out.stride(-1) != 1:
        raise argument_error(
            ValueError, _WHERE, "out",
            f"out must match logits ({logits.dtype} {tuple(logits.shape)}, stride(-1) == 1), got {out.dtype} "
            f"{tuple(out.shape)} strides {out.stride()}"
        )
    if upstream.grad_entropy is not None and stats.mean_shifted is None:
        raise argument_error(ValueError, _WHERE, "mean_shifted", "mean_shifted is required when grad_entropy is given")
    if inputs.keep_mask is not None and upstream.grad_log_prob is not None and stats.log_sum_kept is None:
        raise argument_error(ValueError, _WHERE, "log_sum_kept",
                             "log_sum_kept is required when keep_mask and grad_log_prob are given")
    for name, t in (("tokens", inputs.tokens), ("shift", stats.shift), ("log_sum", stats.log_sum),
                    ("log_sum_kept", stats.log_sum_kept), ("mean_shifted", stats.mean_shifted),
                    ("grad_log_prob", upstream.grad_log_prob), ("grad_entropy", upstream.grad_entropy)):
        _check_row_vector(name, t, logits)
    num_rows, v_local = logits.shape
    if num_rows == 0 or v_local == 0:
        return
    config = launch_config("backward", logits.dtype, v_local, interpreting(), **overrides)
    _BACKWARD((num_rows, cdiv(v_local, config.block_v)),
              **backward_launch_args(inputs, shard, stats, upstream, out, config))


def backward_launch_args(inputs: RowInputs, shard: ShardOptions, stats: BackwardStats, upstream: UpstreamGrads,
                         out: torch.Tensor, config: LaunchConfig) -> dict:
    """Every argument of a backward launch by name; the grid is (rows, cdiv(V_local, config.block_v))."""
    logits, grad_log_prob = inputs.logits, upstream.grad_log_prob
    has_keep = inputs.keep_mask is not None and grad_log_prob is not None  # the keep mask only shapes q
    row_bytes = None if inputs.row_mask is None else _row_bytes("row_mask", inputs.row_mask, logits)
    keep = _keep_bytes(inputs.keep_mask, logits) if has_keep else None
    shift = _vector(stats.shift, torch.float32)
    unused = shift  # stands in for pointers the constexprs switch off
    return dict(
        logits_ptr=logits, out_ptr=out, row_mask_ptr=unused if row_bytes is None else row_bytes,
        tokens_ptr=_vector(inputs.tokens, torch.int64), keep_ptr=logits if keep is None else keep,
        shift_ptr=shift, log_sum_ptr=_vector(stats.log_sum, torch.float32),
        log_sum_kept_ptr=_vector(stats.log_sum_kept, torch.float32, unused),
        mean_shifted_ptr=_vector(stats.mean_shifted, torch.float32, unused),
        grad_log_prob_ptr=_vector(grad_log_prob, torch.float32, unused),
        grad_entropy_ptr=_vector(upstream.grad_entropy, torch.float32, unused),
        log_prob_defined_ptr=(unused if stats.log_prob_defined is None
                              else _row_bytes("log_prob_defined", stats.log_prob_defined, logits)),
        row_has_mass_ptr=(unused if stats.row_has_mass is None
                          else _row_bytes("row_has_mass", stats.row_has_mass, logits)),
        v_local=logits.shape[1], n_valid=shard.n_valid, vocab_start=int(shard.vocab_start),
        logits_row_stride=logits.stride(0), out_row_stride=out.stride(0),
        keep_row_stride=0 if keep is None else keep.stride(0),
        **transform_args(shard, logits),
        HAS_ROW_MASK=row_bytes is not None, HAS_KEEP=has_keep, HAS_GRAD_LOG_PROB=grad_log_prob is not None,
        HAS_GRAD_ENTROPY=upstream.grad_entropy is not None, HAS_LOG_PROB_DEFINED=stats.log_prob_defined is not None,
        HAS_MASS=stats.row_has_mass is not None, BLOCK_V=config.block_v,
        ROUND_BF16_BY_BITS=round_bf16_by_bits(out.dtype), **options(config),
    )


def _vector(t, dtype, default=None):
    """A [T] per-row tensor as the kernels index it: contiguous, of `dtype` (no copy, and no torch call, when it
    already is: each would be host time on a small call's critical path)."""
    if t is None:
        return default
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


# Rows per merge program: enough to amortise the static segment loop; a power of two (tl.arange).
_MERGE_BLOCK_R = 256


def merge_partials(partials: torch.Tensor, has_keep_mask: bool) -> RowStats:
    """[segments, 5, T] fp32 partials -> RowStats, the math of row_stats.merge_partials in one launch (its fields
    views of one fp32 and one flag buffer)."""
    num_seg, _, num_rows = partials.shape
    if not partials.is_contiguous():
        partials = partials.contiguous()
    out = torch.empty((row_stats.MERGED_FIELDS, num_rows), dtype=torch.float32, device=partials.device)
    flags = torch.empty((row_stats.MERGED_FLAGS, num_rows), dtype=torch.uint8, device=partials.device)
    if num_rows:
        grid, kwargs = merge_launch_args(partials, out, flags, has_keep_mask)
        _MERGE(grid, **kwargs)
    return row_stats.merged_row_stats(out, flags, has_keep_mask)


def merge_launch_args(partials: torch.Tensor, out: torch.Tensor, flags: torch.Tensor, has_keep_mask: bool):
    """(grid, kwargs) of the merge of contiguous [segments, 5, T] partials into `out` [MERGED_FIELDS, T] fp32 and
    `flags` [MERGED_FLAGS, T] uint8."""
    num_seg, _, num_rows = partials.shape
    return (cdiv(num_rows, _MERGE_BLOCK_R),), dict(partials_ptr=partials, out_ptr=out, flags_ptr=flags,
                                                   num_rows=num_rows, NUM_SEG=num_seg, HAS_KEEP=has_keep_mask,
                                                   BLOCK_R=_MERGE_BLOCK_R)


class TritonBackend:
    """The Backend protocol (core/contracts.py): this module's launchers."""

    name = "triton"
    needs_unit_column_stride = True
    forward_partials = staticmethod(forward_partials)
    merge_partials = staticmethod(merge_partials)
    backward_grad = staticmethod(backward_grad)


BACKEND = TritonBackend()
