"""Which path a call of the fused LM head takes, and the row counts that size it: `head_path` decides, the dispatch
(core/shell.select_backend through `backend_key`, the segment-GEMM backend, the token loss's blocks) follows what it
returns, and `path_of_call` answers the question for a call's own arguments.

The paths (docs/lm_head.md has the table with memory and GEMM counts):

    torch_tiles        linear_log_probs_and_entropy, backend "torch" (or "auto" on CPU): lm_head/torch_backend.py,
                       fixed fp32 tiles through torch.matmul and the logits op's PyTorch code.
    fp32_tiles         the general op, backend "triton" (or "auto" on CUDA), fp32 inputs: lm_head/triton_backend.py,
                       Triton GEMM tiles with the statistics fused in.
    chunk_gemms        the general op, triton, bf16 / fp16 operands the one-GEMM kernels do not take (rows not 16-byte
                       aligned): library GEMMs into one fp32 chunk per block and segment, the logits op's Triton passes.
    one_gemm           the general op, triton, bf16 / fp16, aligned: the forward one GEMM with the statistics in its
                       epilogue (gemm_partials.py), the backward the same GEMM with the gradient in its epilogue
                       (gemm_dlogits.py); nothing held (no gradient wanted, or a working_memory of no row).
    one_gemm_held      one_gemm with a gradient: the forward also holds the first `held_rows` rows' logits as fp16
                       probabilities, whose dlogits the backward forms without a second GEMM (prob_dlogits.py).
    loss_one_block     linear_token_loss, triton, bf16 / fp16, aligned, every row one block within the allowance: dW
                       finished in its forward, one GEMM per segment (K = T).
    loss_blocks        the same where one block does not fit: blocks of `block_rows` rows beside an fp32 dW
                       accumulator.
    loss_chunk_blocks  linear_token_loss otherwise (backend torch, fp32, unaligned rows): blocks of fp32 chunks and the
                       logits op's passes (Triton or PyTorch, as the kind says).
    sglang_blocks      either op with reduction_order="sglang": lm_head/sglang_head.py, SGLang's bf16 logits in row
                       blocks of `block_rows` and the logits op's SGLang order; the backward span by span (half a
                       segment: sglang_gemm_span) over every row, each span's logits formed again. The token loss
                       takes it where not even one sglang_loss_blocks block fits its allowance (it then runs those
                       phases inside its forward).
    sglang_loss_one_block  linear_token_loss, reduction_order="sglang", every row one block within the allowance: the
                       forward's logits held (row- or span-major, `buffer_rows` rows), the caller's loss, then per
                       span the gradient pass in place, dX and dW_s = dl_s^T X once (K = T); no logit formed twice.
    sglang_loss_blocks the same where one block does not fit: blocks of `block_rows` rows (a multiple of the forward's
                       row block) beside an fp32 dW accumulator.

A token loss's schedule (`HeadPath.schedule`, from the loss's `scope`; docs/losses.md has the table with costs):

    rows        a row-scope loss (TokenLoss, any closure): the path's row blocks, the loss's gradient per block.
    sequences   a sequence-scope loss (SequenceLoss: GSPO, GMPO) on loss_one_block, loss_blocks, loss_chunk_blocks:
                the path's row blocks cut at sequence ends (lm_head/sequence_blocks.py), each sequence's statistic
                and gradient formed in its block; only sequences longer than a block or not consecutive get a
                statistics pass, over their rows.
    statistics  a batch-scope loss (EntropyMaskedLoss), and a sequence-scope one in SGLang's order: a statistics pass
                over every row (the forward without gradients), then the loss frozen there through the row blocks.

Glossary (one word each; every row count of the head is one of these):
    segment  the fixed vocabulary segments of core/layout.py (V_global / 8 columns, whichever rank holds them); every
             GEMM's vocabulary side and every partial is per segment.
    tile     a GEMM kernel's [BLOCK_M, BLOCK_N] output tile; its BLOCK_M is the kernel's row tile.
    block    rows whose logits are formed together and whose statistics are merged together: a chunk GEMM's rows
             (`BlockShape.block_rows`), a token-loss block (the rows the caller's loss sees at once).
    chunk    one block's fp32 logits over one segment, written by a library GEMM and read by the logits op's passes.
    group    rows whose dlogits one dX GEMM and one dW GEMM read per segment (dW's K): `BlockShape.group_rows`.
    held     the general op's first `held_rows` rows, whose probabilities its forward keeps for the backward.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

import torch

from ppo_ops.core import layout

HALF = (torch.bfloat16, torch.float16)


class Path(enum.Enum):
    TORCH_TILES = "torch_tiles"
    FP32_TILES = "fp32_tiles"
    CHUNK_GEMMS = "chunk_gemms"
    ONE_GEMM = "one_gemm"
    ONE_GEMM_HELD = "one_gemm_held"
    LOSS_ONE_BLOCK = "loss_one_block"
    LOSS_BLOCKS = "loss_blocks"
    LOSS_CHUNK_BLOCKS = "loss_chunk_blocks"
    SGLANG_BLOCKS = "sglang_blocks"
    SGLANG_LOSS_ONE_BLOCK = "sglang_loss_one_block"
    SGLANG_LOSS_BLOCKS = "sglang_loss_blocks"


# A token loss's schedules (module docstring).
ROWS, SEQUENCES, STATISTICS = "rows", "sequences", "statistics"


def loss_schedule(scope: str, reduction_order: str = "fused", whole_rows: bool = False) -> str:
    """The schedule of a token loss of `scope` ("row" | "sequence" | "batch"). In SGLang's order the loss sees its
    token-loss block's rows at once and a block is not cut at sequence ends, so a sequence-scope loss takes the
    sequence schedule only where one call sees every row (`whole_rows`: sglang_scores_whole), else the statistics
    pass."""
    if scope == "row":
        return ROWS
    if scope == "sequence" and (reduction_order != "sglang" or whole_rows):
        return SEQUENCES
    return STATISTICS


ONE_GEMM_PATHS = (Path.ONE_GEMM, Path.ONE_GEMM_HELD)  # the general op's one-GEMM forward and fused recompute
PROB_PATHS = (Path.LOSS_ONE_BLOCK, Path.LOSS_BLOCKS)  # the token loss's one-GEMM blocks (fp16 probabilities)
SGLANG_PATHS = (Path.SGLANG_BLOCKS, Path.SGLANG_LOSS_ONE_BLOCK, Path.SGLANG_LOSS_BLOCKS)  # reduction_order="sglang"


@dataclasses.dataclass(frozen=True)
class HeadPath:
    """The path of one call and the row counts that size it (0: not a size of this path)."""

    path: Path
    backend: tuple  # its key in core/registry.py: ("lm_head" | "lm_head_segments", "torch" | "triton")
    block_rows: int = 0  # rows per block (chunk_gemms, one_gemm*: the backward's step; loss_*, sglang_*: the loss's
    #                      block; sglang_blocks: the forward's row block)
    group_rows: int = 0  # rows per dX / dW group (dW's K) where groups are not the blocks themselves
    held_rows: int = 0  # one_gemm_held: the call's first rows whose fp16 probabilities the forward holds
    buffer_rows: int = 0  # loss_one_block / loss_blocks: rows of the probabilities' buffer (block rows up to a tile);
    #                       sglang_loss_*: rows of the held logits (block rows up to a multiple of 8)
    schedule: str = ""  # a token loss's: ROWS, SEQUENCES or STATISTICS (loss_schedule); "" for the general op

    @property
    def name(self) -> str:
        return self.path.value


# ---- blocks and groups of the chunk path and the general op's backward ----

@dataclasses.dataclass(frozen=True)
class BlockShape:
    """Block and group rows of the segment-GEMM backend. Part of the bit-exactness contract: every call on a device
    uses the same ones (a GEMM's shape fixes its summation order)."""

    block_rows: int  # general op: rows per chunk GEMM (forward and the backward's recompute)
    group_rows: int  # general op backward: dlogits rows per dX / dW GEMM, a multiple of block_rows
    loss_block_rows: int  # token loss, chunk blocks: rows per block, whose logits over all local segments are held
    loss_group_rows: int  # token loss, chunk blocks: dlogits rows per dW GEMM (its K), a multiple of loss_block_rows


# CUDA: a chunk GEMM of 1024 rows fills the chip at Qwen3's shapes while its fp32 chunk stays small; the general op's
# groups of 8192 rows read and write the fp32 dW accumulator once per 8192 rows of GEMM work; the token loss's chunk
# blocks trade their logits' memory (loss_block_rows x V_local fp32) against the dW accumulator's traffic (once per
# loss_group_rows). The sizes measured behind these choices: docs/performance.md, "The fused LM head".
CUDA_SHAPE = BlockShape(block_rows=1024, group_rows=8192, loss_block_rows=1024, loss_group_rows=1024)
# Elsewhere (the CPU suite, Triton's interpreter): small, so tiny test shapes cross block and group boundaries.
HOST_SHAPE = BlockShape(block_rows=16, group_rows=32, loss_block_rows=8, loss_group_rows=16)


def block_shape(device: torch.device) -> BlockShape:
    return CUDA_SHAPE if device.type == "cuda" else HOST_SHAPE


# ---- held rows: the general op's one_gemm_held ----

# The general op's one-GEMM forward, in a call that a backward follows, also keeps the first rows' logits as fp16
# probabilities within their tiles, at most the call's working_memory bytes at the global vocabulary (default
# HELD_BYTES; a multiple of PROB_ROWS_STEP rows): their backward forms each group's dlogits of those rows in a
# memory-bound pass instead of a second GEMM over them. The default keeps them well under the fp32 [T, V] logits of
# the logits path: 1 GiB is 3328 rows at Qwen3's vocabulary (151936); a caller who can spare more saves more of the
# second GEMM (docs/performance.md, "The fused LM head", runs H1-H4).
HELD_BYTES = 2**30
HOST_HELD_ROWS = 16  # the interpreter's default: the tests' row counts cross it (one block of HOST_SHAPE)
PROB_ROWS_STEP = 256  # held rows and loss block rows come in steps of the probabilities' pass (prob_dlogits.PASS_ROWS)
HOST_PROB_ROWS_STEP = 16  # the interpreter's step (its forward's row tile), so the tests' small allowances hold rows


def held_rows(n_rows: int, seg_len: int, device: torch.device, working_memory: Optional[int] = None) -> int:
    """How many of a call's first rows the general op's forward keeps as probabilities for its backward: 2 bytes
    a logit at the global vocabulary within working_memory (None: HELD_BYTES, or HOST_HELD_ROWS rows off CUDA), in
    steps of PROB_ROWS_STEP, at most the call's rows. A function of the row count, the segment length and the
    allowance only (the global vocabulary), so the same on every rank and TP size."""
    on_cuda = device.type == "cuda"
    if working_memory is None and not on_cuda:
        cap = HOST_HELD_ROWS
    else:
        step = PROB_ROWS_STEP if on_cuda else HOST_PROB_ROWS_STEP
        allowance = HELD_BYTES if working_memory is None else working_memory
        cap = allowance // (seg_len * layout.NUM_FIXED_SEGMENTS * 2) // step * step
    return max(0, min(n_rows, cap))


# ---- the token loss's one-GEMM blocks: loss_one_block and loss_blocks ----

# The one-GEMM blocks hold 2 bytes per logit (fp16 probabilities, then dlogits in place), within TOKEN_LOSS_BYTES
# (the working memory the token loss allows itself beside dX and dW):
# - one block (every row at once) where its probabilities, its fp32 dX rows and dW fit: dW_s = dl_s^T X is then one
#   GEMM per segment (K = T) written straight in the input dtype, no fp32 accumulator, and, where the block has at
#   least 2 H rows, into the probabilities' own storage (bytes of segments whose dlogits were read; only the first
#   segment's dW goes through a temporary): T = 8192 at H = 4096 and Qwen3's vocabulary;
# - otherwise blocks of the most rows, a multiple of PROB_ROWS_STEP in [LOSS_BLOCK_ROWS_MIN, LOSS_BLOCK_ROWS_MAX],
#   that fit beside the [V_local, H] fp32 dW accumulator: 2816 rows at H = 4096, 8192 at H = 1024 (Qwen3's
#   vocabulary). dW's K is these rows, and each block's dW GEMMs read and write the whole accumulator, so the fewer
#   blocks the better.
# Both count the global vocabulary (a function of H, the segment length and the row count, the same on every rank and
# TP size: dW's GEMM shapes, hence its bits, are). The block rows swept, with their peaks: docs/performance.md.
TOKEN_LOSS_BYTES = 25 * 2**27  # 3.125 GiB
LOSS_BLOCK_ROWS_MIN, LOSS_BLOCK_ROWS_MAX = 1024, 8192
HOST_LOSS_BLOCK_ROWS = 16  # the interpreter: tiny test shapes cross blocks (a multiple of its GEMM tile's 16 rows)
HOST_TOKEN_LOSS_BYTES = 48 * 1024  # the interpreter: at the tests' shapes (V = 256, H = 48) one block up to ~32 rows


def loss_allowance(device: torch.device, working_memory: Optional[int] = None) -> int:
    """The bytes the token loss's blocks may hold: the caller's working_memory, else the device's default."""
    if working_memory is not None:
        return working_memory
    return TOKEN_LOSS_BYTES if device.type == "cuda" else HOST_TOKEN_LOSS_BYTES


def loss_block_rows(width: int, seg_len: int, device: torch.device, working_memory: Optional[int] = None) -> int:
    """Rows per block of loss_blocks (beside the fp32 dW accumulator): a function of H, the segment length and the
    allowance only; LOSS_BLOCK_ROWS_MIN where the allowance holds fewer (the least the blocked layout takes). The
    vocabulary counted is the global one (layout.NUM_FIXED_SEGMENTS segments), an upper bound of V_local."""
    if device.type != "cuda":
        return HOST_LOSS_BLOCK_ROWS
    vocab = seg_len * layout.NUM_FIXED_SEGMENTS
    fit = (loss_allowance(device, working_memory) - vocab * width * 4) // (vocab * 2)
    return max(LOSS_BLOCK_ROWS_MIN, min(LOSS_BLOCK_ROWS_MAX, fit // PROB_ROWS_STEP * PROB_ROWS_STEP))


def dw_in_probs(buffer_rows: int, width: int) -> bool:
    """Whether one block's dW fits into its probabilities' storage: segment s's dW (seg_len x H) then lies over the
    dlogits of segments below s only, for every s >= 1 (buffer_rows >= 2 H; the first goes through a temporary)."""
    return buffer_rows >= 2 * width


def one_block_bytes(n_rows: int, buffer_rows: int, width: int, seg_len: int) -> int:
    """What one token-loss block of n_rows rows (buffer_rows: rounded up to the forward's row tile) holds at the
    global vocabulary: its probabilities, its fp32 dX rows, and dW (a temporary of one segment where dw_in_probs)."""
    vocab = seg_len * layout.NUM_FIXED_SEGMENTS
    dw = seg_len * width * 2 if dw_in_probs(buffer_rows, width) else vocab * width * 2
    return buffer_rows * vocab * 2 + n_rows * width * 4 + dw


def one_loss_block(n_rows: int, buffer_rows: int, width: int, seg_len: int, device: torch.device,
                   working_memory: Optional[int] = None) -> bool:
    """Whether the token loss takes every row as one block (loss_one_block: dW finished in its forward)."""
    return one_block_bytes(n_rows, buffer_rows, width, seg_len) <= loss_allowance(device, working_memory)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def one_gemm_row_tile() -> int:
    """The one-GEMM forward's row tile (BLOCK_M), which the probabilities' buffer rows are a multiple of. Imports the
    Triton module: only asked on the paths that run it."""
    from ppo_ops.lm_head import gemm_partials
    return gemm_partials.config().block_m


# ---- SGLang's order: sglang_blocks, sglang_loss_one_block, sglang_loss_blocks ----

# Rows per forward block of lm_head/sglang_head.py: its bf16 logits (block rows x V_local, 311 MB at V = 151936) bound
# the forward's memory, and 1024 rows fill the chip at Qwen3's shapes. Small elsewhere, so tests cross blocks.
SGLANG_BLOCK_ROWS = 1024
HOST_SGLANG_BLOCK_ROWS = 16


def sglang_block_rows(device: torch.device) -> int:
    return SGLANG_BLOCK_ROWS if device.type == "cuda" else HOST_SGLANG_BLOCK_ROWS


# The gradient's GEMMs run per span of the vocabulary: a fixed segment (V_global / 8 columns) cut in
# SGLANG_GEMM_SPLIT equal spans where each stays a multiple of 8 columns (cuBLAS's aligned kernels), else the whole
# segment. The backward's every-row logits are one span wide: half a segment holds 148 MiB instead of 297 at
# T = 8192 and Qwen3's vocabulary, which takes the general op at H = 4096 from 0.27 to 0.24 of the sglang-order
# logits path's peak (docs/performance.md, row 22). A function of the global vocabulary only, so dW's bits stay
# TP = 1's.
SGLANG_GEMM_SPLIT = 2


def sglang_gemm_span(seg_len: int) -> int:
    """Columns per gradient GEMM of the exact head (the comment above)."""
    span = seg_len // SGLANG_GEMM_SPLIT
    return span if seg_len % SGLANG_GEMM_SPLIT == 0 and span % _GEMM_ROW_MULTIPLE == 0 else seg_len


# The exact token loss holds its blocks' bf16 logits (2 bytes a logit) within the same allowance as the other token
# losses (TOKEN_LOSS_BYTES, or the call's working_memory), counted at the global vocabulary, so that the path and its
# block rows (dW's K, hence dW's bits) are the same on every rank and TP size:
# - one block (every row at once) where its logits (segment-major, rows rounded up to a multiple of 8), the forward's
#   row-major block it scores (one SGLANG_BLOCK_ROWS block), its fp32 dX rows and dW fit. dW_s = dl_s^T X is one GEMM
#   per GEMM span (K = T), written in the weight's dtype, into the logits' own storage where the rows hold it (span
#   s's dW then lies over the dlogits of spans below s; the first goes through a temporary): T = 8192 at H = 4096
#   and Qwen3's vocabulary (2.9 GiB);
# - otherwise blocks of the most rows, a multiple of the forward's row block up to SGLANG_LOSS_BLOCK_ROWS_MAX, whose
#   row-major logits, one span's dlogits and fp32 dX rows fit beside the fp32 [V_local, H] dW accumulator: 2048
#   rows at H = 4096, 8192 at H = 1024 (Qwen3's vocabulary);
# - where not even one forward row block fits beside the accumulator, sglang_blocks: every logit formed twice, the
#   least memory.
SGLANG_LOSS_BLOCK_ROWS_MAX = 8192
HOST_SGLANG_LOSS_BLOCK_ROWS_MAX = 64  # the interpreter: four of its forward row blocks
HOST_SGLANG_LOSS_BYTES = 2**20  # the interpreter: one block at the tests' shapes (V = 2048, H = 160) up to 64 rows
_GEMM_ROW_MULTIPLE = 8  # gemms.GEMM_ROW_MULTIPLE (gemms.py imports this module): the dX / dW GEMMs' row counts


def sglang_loss_allowance(device: torch.device, working_memory: Optional[int] = None) -> int:
    """The bytes the exact token loss's blocks may hold: the caller's working_memory, else the device's default."""
    if working_memory is not None:
        return working_memory
    return TOKEN_LOSS_BYTES if device.type == "cuda" else HOST_SGLANG_LOSS_BYTES


def sglang_dw_in_logits(buffer_rows: int, width: int, dw_bytes: int) -> bool:
    """Whether one block's dW (dw_bytes an element) fits into its segment-major logits' storage with segment s's dW
    over the dlogits of segments below s only, for every s >= 1: buffer_rows * 2 >= width * dw_bytes."""
    return buffer_rows * 2 >= width * dw_bytes


def sglang_one_block_row_major(n_rows: int, width: int, seg_len: int, dw_bytes: int, device: torch.device) -> bool:
    """Whether sglang_loss_one_block keeps every row's logits row-major ([R8, V_local], the forward's blocks written
    straight into it, the GEMMs on column views of it) rather than span-major (each forward block copied in, dW
    written into the consumed spans): where that holds no more bytes, as at H = 1024 and Qwen3's vocabulary (a
    1024-row forward block is dW's size there), it saves the copy, a read and a write of every logit."""
    return _one_block_bytes(n_rows, width, seg_len, dw_bytes, device, True) <= _one_block_bytes(
        n_rows, width, seg_len, dw_bytes, device, False)


def sglang_one_block_bytes(n_rows: int, width: int, seg_len: int, dw_bytes: int, device: torch.device) -> int:
    """What sglang_loss_one_block holds at the global vocabulary, in the layout sglang_one_block_row_major picks:
    every row's bf16 logits, the fp32 dX rows, dW; span-major also the forward's row block it scores them in, and dW
    as one span's temporary where sglang_dw_in_logits."""
    return min(_one_block_bytes(n_rows, width, seg_len, dw_bytes, device, row_major)
               for row_major in (True, False))


def _one_block_bytes(n_rows, width, seg_len, dw_bytes, device, row_major: bool) -> int:
    vocab = seg_len * layout.NUM_FIXED_SEGMENTS
    rows = round_up(n_rows, _GEMM_ROW_MULTIPLE)
    held = rows * vocab * 2 + rows * width * 4
    if row_major:
        return held + vocab * width * dw_bytes
    scored = min(n_rows, sglang_block_rows(device)) * vocab * 2
    dw = sglang_gemm_span(seg_len) if sglang_dw_in_logits(rows, width, dw_bytes) else vocab
    return held + scored + dw * width * dw_bytes


def sglang_blocks_bytes(block_rows: int, width: int, seg_len: int) -> int:
    """What sglang_loss_blocks holds at the global vocabulary with blocks of block_rows rows: one block's row-major
    bf16 logits, one GEMM span's dlogits of it, its fp32 dX rows, the fp32 dW accumulator."""
    vocab = seg_len * layout.NUM_FIXED_SEGMENTS
    return block_rows * (vocab * 2 + sglang_gemm_span(seg_len) * 2 + width * 4) + vocab * width * 4


def sglang_loss_block_rows(width: int, seg_len: int, device: torch.device,
                           working_memory: Optional[int] = None) -> int:
    """Rows per block of sglang_loss_blocks: the most, a multiple of sglang_block_rows up to the device's maximum,
    that fit the allowance (sglang_blocks_bytes); 0 where not even one forward row block does. A function of H, the
    segment length and the allowance only."""
    step = sglang_block_rows(device)
    most = SGLANG_LOSS_BLOCK_ROWS_MAX if device.type == "cuda" else HOST_SGLANG_LOSS_BLOCK_ROWS_MAX
    fixed = sglang_blocks_bytes(0, width, seg_len)
    per_row = sglang_blocks_bytes(1, width, seg_len) - fixed
    fit = max(0, sglang_loss_allowance(device, working_memory) - fixed) // per_row
    return min(most, fit // step * step)


def sglang_scores_whole(path: HeadPath, n_rows: int) -> bool:
    """Whether the exact token loss calls the caller's loss once on every kept row: on sglang_loss_one_block and on
    the recompute (sglang_blocks: the forward's blocks scored, then the loss), not on sglang_loss_blocks' blocks
    unless one holds every row."""
    return path.path is not Path.SGLANG_LOSS_BLOCKS or n_rows <= path.block_rows


def sglang_path(backend: tuple, *, device: torch.device, token_loss: bool, n_rows: int, width: int, seg_len: int,
                dw_bytes: int, working_memory: Optional[int] = None) -> HeadPath:
    """head_path for reduction_order="sglang": the general op's sglang_blocks; the token loss's one block, blocks, or
    sglang_blocks by the allowance (the comment above). dw_bytes: the weight's element size (dW's)."""
    step = sglang_block_rows(device)
    if token_loss:
        if (sglang_one_block_bytes(n_rows, width, seg_len, dw_bytes, device)
                <= sglang_loss_allowance(device, working_memory)):
            return HeadPath(Path.SGLANG_LOSS_ONE_BLOCK, backend, block_rows=n_rows,
                            buffer_rows=round_up(n_rows, _GEMM_ROW_MULTIPLE))
        rows = sglang_loss_block_rows(width, seg_len, device, working_memory)
        if rows:
            return HeadPath(Path.SGLANG_LOSS_BLOCKS, backend, block_rows=rows,
                            buffer_rows=min(rows, round_up(n_rows, _GEMM_ROW_MULTIPLE)))
    return HeadPath(Path.SGLANG_BLOCKS, backend, block_rows=step)


# ---- the decision ----

def backend_key(kind: str, dtype: torch.dtype, token_loss: bool, reduction_order: str = "fused") -> tuple:
    """The backend a call's path runs on, as its core/registry.py key: SGLang's order for reduction_order="sglang";
    the segment-GEMM backend for every other token loss and for half precision under triton; the fp32-tile backends
    otherwise. What core/shell.select_backend loads."""
    if reduction_order == "sglang":
        return ("lm_head_sglang", kind)
    if token_loss or (kind == "triton" and dtype in HALF):
        return ("lm_head_segments", kind)
    return ("lm_head", kind)


def head_path(*, kind: str, dtype: torch.dtype, device: torch.device, token_loss: bool, aligned: bool,
              needs_grad: bool, n_rows: int, width: int, seg_len: int,
              working_memory: Optional[int] = None, reduction_order: str = "fused",
              weight_dtype: Optional[torch.dtype] = None, loss_scope: str = "row") -> HeadPath:
    """The path of a call (_head_path), with a token loss's schedule for a loss of `loss_scope` (loss_schedule)."""
    path = _head_path(kind=kind, dtype=dtype, device=device, token_loss=token_loss, aligned=aligned,
                      needs_grad=needs_grad, n_rows=n_rows, width=width, seg_len=seg_len,
                      working_memory=working_memory, reduction_order=reduction_order, weight_dtype=weight_dtype)
    if not token_loss:
        return path
    whole = reduction_order == "sglang" and sglang_scores_whole(path, n_rows)
    return dataclasses.replace(path, schedule=loss_schedule(loss_scope, reduction_order, whole))


def _head_path(*, kind: str, dtype: torch.dtype, device: torch.device, token_loss: bool, aligned: bool,
               needs_grad: bool, n_rows: int, width: int, seg_len: int,
               working_memory: Optional[int] = None, reduction_order: str = "fused",
               weight_dtype: Optional[torch.dtype] = None) -> HeadPath:
    """The path of a call: kind "torch" | "triton" (core/shell.backend_kind resolves backend="auto"); dtype and device
    of the hidden states; token_loss: linear_token_loss; aligned: the kept rows and the weight are what the one-GEMM
    kernels take (gemm_partials.applies: rows contiguous and 16-byte aligned); needs_grad: a backward follows;
    n_rows: the kept rows; width: H; seg_len: the segment length (core/layout.py); working_memory: the call's;
    reduction_order: the call's ("sglang": sglang_path, whatever the kind, dtype and alignment); weight_dtype: the
    weight's (None: dtype), whose element size sizes dW in the SGLang-order token loss's memory."""
    backend = backend_key(kind, dtype, token_loss, reduction_order)
    if reduction_order == "sglang":
        dw_bytes = torch.finfo(weight_dtype or dtype).bits // 8
        return sglang_path(backend, device=device, token_loss=token_loss, n_rows=n_rows, width=width,
                           seg_len=seg_len, dw_bytes=dw_bytes, working_memory=working_memory)
    one_gemm = kind == "triton" and dtype in HALF and aligned
    shape = block_shape(device)
    if token_loss:
        if not one_gemm:
            return HeadPath(Path.LOSS_CHUNK_BLOCKS, backend, block_rows=shape.loss_block_rows,
                            group_rows=shape.loss_group_rows)
        buffer_rows = round_up(n_rows, one_gemm_row_tile())
        if one_loss_block(n_rows, buffer_rows, width, seg_len, device, working_memory):
            return HeadPath(Path.LOSS_ONE_BLOCK, backend, block_rows=n_rows, buffer_rows=buffer_rows)
        rows = loss_block_rows(width, seg_len, device, working_memory)
        return HeadPath(Path.LOSS_BLOCKS, backend, block_rows=rows, buffer_rows=min(rows, buffer_rows))
    if backend[0] == "lm_head":
        return HeadPath(Path.TORCH_TILES if kind == "torch" else Path.FP32_TILES, backend)
    sizes = dict(block_rows=shape.block_rows, group_rows=shape.group_rows)
    if not one_gemm:
        return HeadPath(Path.CHUNK_GEMMS, backend, **sizes)
    held = held_rows(n_rows, seg_len, device, working_memory) if needs_grad else 0
    if held:
        return HeadPath(Path.ONE_GEMM_HELD, backend, held_rows=held, **sizes)
    return HeadPath(Path.ONE_GEMM, backend, **sizes)


def one_gemm_applies(kind: str, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """head_path's `aligned` for these operands: the one-GEMM kernels' own test (gemm_partials.applies), asked only
    under triton with half precision (where triton is importable)."""
    if kind != "triton" or hidden.dtype not in HALF:
        return False
    from ppo_ops.lm_head import gemm_partials
    return gemm_partials.applies(hidden, weight)


def path_of_call(hidden: torch.Tensor, weight: torch.Tensor, *, token_loss=False, backend: str = "auto",
                 row_mask: Optional[torch.Tensor] = None, tp_group=None, vocab_size: Optional[int] = None,
                 working_memory: Optional[int] = None, needs_grad: Optional[bool] = None,
                 reduction_order: str = "fused") -> HeadPath:
    """The path that linear_log_probs_and_entropy (token_loss=False) or linear_token_loss (True, or the loss itself)
    takes for these arguments (the same names and defaults as theirs), decided by head_path as the call decides it;
    with the loss given, `schedule` is its loss's (a plain True: a row-scope loss's). needs_grad None: as the call
    infers it (grad mode on and hidden or weight requiring grad). Reads the row mask's kept-row count on the host."""
    loss_scope = "row" if isinstance(token_loss, bool) else getattr(token_loss, "scope", "row")
    token_loss = token_loss is not False
    from ppo_ops.core import checks, shell

    fn_name = "linear_token_loss" if token_loss else "linear_log_probs_and_entropy"
    kind = shell.backend_kind(fn_name, backend, hidden, "hidden")
    _group, world_size, _rank = checks.check_tp_group(fn_name, tp_group)
    seg_len = layout.make_layout(_group, world_size, _rank, weight.shape[0], vocab_size).seg_len
    flat = hidden.reshape(-1, hidden.shape[-1])
    kept = flat if row_mask is None else flat.index_select(0, torch.nonzero(row_mask.reshape(-1)).squeeze(1))
    kept = kept.contiguous()  # as the call compacts its kept rows (lm_head/function.py)
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return head_path(kind=kind, dtype=hidden.dtype, device=hidden.device, token_loss=token_loss,
                     aligned=one_gemm_applies(kind, kept, weight), needs_grad=needs_grad, n_rows=kept.shape[0],
                     width=kept.shape[1], seg_len=seg_len, working_memory=working_memory,
                     reduction_order=reduction_order, weight_dtype=weight.dtype, loss_scope=loss_scope)
