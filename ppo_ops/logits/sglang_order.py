"""The logits op in SGLang's reduction order (reduction_order="sglang"): log-probs bit for bit those of SGLang's
batch-invariant log_softmax, at any TP size.

What SGLang computes. Under deterministic inference and `--rl-on-policy-target` SGLang (0.5.17) scores tokens with
`log_softmax(logits.float())`, which its batch-invariant mode routes to `_log_softmax_kernel`
(sglang/srt/batch_invariant_ops/batch_invariant_ops.py): one Triton program of 4 warps per row over the whole
vocabulary, in blocks of 1024 columns from column 0:

    M = max_c z_c                                   (exact in any order)
    S = ((0 + B_0) + B_1) + ... + B_last            B_b = tl.sum over block b of e_c = exp(z_c - M), 0 past the vocab
    log_prob(t) = (z_t - M) - log S

(z = logits: SGLang's scoring has no temperature. With temperature T != 1 the public function first divides the
logits as SGLang's sampler does, bf16(bf16(logits) / T), and runs this module at T = 1 (ppo_ops/api.py); the module's
own scaling, z = logits * fl32(1 / T), serves only callers that pass a plan with another temperature.) `tl.sum`
over a 1024-wide fp32 block has one tree,
read off the kernel's sm_90 code under Triton 3.6: the load gives each of the 128 threads W contiguous columns per
repetition, the repetitions 128·W columns apart (W = 4 for a vocabulary of a multiple of 4 columns: 16-byte loads;
2 or 1 otherwise); a thread adds its 8 values in column order, starting from the first; the 32 lanes of a warp then
combine by butterfly, xor 16, 8, 4, 2, 1; the 4 warps as (w0 + w2) + (w1 + w3). `chain_offsets` and `block_tree`
spell that order out addition by addition, so this module depends on no compiler's choice of reduction: the torch
backend and the Triton kernels (sglang_order_kernels.py) add in exactly this order (the Triton kernels also use
Triton's exp and log, which is what makes them equal to SGLang's kernel on a GPU; the torch backend's exp differs in
the last bit).

Vocab-parallel. The blocks are global (column 0 of rank 0 starts block 0), so a rank's shard generally begins and
ends inside a block. A thread's 8 values run in column order, so a block split at a shard boundary is the left
rank's values first: the left rank hands its 128 per-thread partial chains (and those of the entropy sum) to the
right rank, which continues them with its own columns and finishes the block. Every block is therefore reduced in
exactly SGLang's order whatever the TP size, and every rank adds all block sums in global order: log-probs,
entropies and backward's statistics are bitwise identical at every TP size. A block may span at most two ranks:
shards of at least 1024 columns (refused otherwise, before any collective).

Communication at TP > 1 (after the header exchange when validate=True): an all-reduce (max) of the row max [T];
when the shard boundaries are not multiples of 1024, an all-gather of the boundary chains [T, 2, 128] fp32; an
all-gather of each rank's finished block sums and target logit [T, 2·blocks + 1] fp32 (1.2 KB per row at V = 151936,
TP = 2). At TP = 1 none. Backward is the logits op's own (the same saved row statistics: M, log S, E_p[z] - M).

Entropy: H = log S - W / S with W = Σ e_c (z_c - M), each block's W_b reduced in the same order as B_b. A keep mask
is refused (SGLang's scoring has none).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.distributed as dist

from ppo_ops.core import agreement, shell
from ppo_ops.core.contracts import RowInputs, RowStats
from ppo_ops.logits.sglang_order_geometry import BLOCK, CHAIN, THREADS, WARPS

SUM, ENT = 0, 1  # the two chains: Σ e and Σ e (z - M)


def vector_width(vocab_size: int) -> int:
    """Columns per thread per repetition in SGLang's kernel: its rows are vocab_size fp32 values, so a row starts at
    a multiple of 16 bytes when vocab_size % 4 == 0 (4-wide loads), of 8 bytes when it is even, else of 4."""
    return 4 if vocab_size % 4 == 0 else (2 if vocab_size % 2 == 0 else 1)


def chain_offsets(width: int, device=None) -> torch.Tensor:
    """[CHAIN, THREADS] int64: the block column of value q of thread t, in the order the thread adds them."""
    q = torch.arange(CHAIN, dtype=torch.int64).unsqueeze(1)
    t = torch.arange(THREADS, dtype=torch.int64).unsqueeze(0)
    return ((q // width) * (THREADS * width) + t * width + q % width).to(device)


def block_tree(chains: torch.Tensor) -> torch.Tensor:
    """[..., THREADS] per-thread chains -> [...] block sums: the butterfly over lanes, then the warps."""
    v = chains.unflatten(-1, (WARPS, THREADS // WARPS))
    half = THREADS // WARPS // 2
    while half >= 1:  # lane l adds lane l ^ half; addition commutes, so l's value is v[l] + v[l + half]
        v = v[..., :half] + v[..., half:2 * half]
        half //= 2
    w = v[..., 0]
    return (w[..., 0] + w[..., 2]) + (w[..., 1] + w[..., 3])


@dataclasses.dataclass(frozen=True)
class ShardBlocks:
    """The blocks a shard of global columns [start, start + n_valid) touches (n_valid: its real vocabulary)."""

    first: int  # global index of its first block
    count: int  # blocks it touches (0: no real vocabulary)
    head_continues: bool  # its first block began on the previous rank: it continues that rank's chains
    tail_continues: bool  # its last block goes on into the next rank: it hands its chains on, unfinished

    @property
    def finished(self) -> int:
        """Blocks whose sums this rank produces (all it touches but a continuing tail)."""
        return self.count - int(self.tail_continues)


def shard_blocks(start: int, v_local: int, n_valid: int, vocab_size: int) -> ShardBlocks:
    if n_valid <= 0:
        return ShardBlocks(start // BLOCK, 0, False, False)
    first, last = start // BLOCK, (start + n_valid - 1) // BLOCK
    end = start + v_local
    return ShardBlocks(first, last - first + 1, head_continues=start % BLOCK != 0,
                       tail_continues=n_valid == v_local and end % BLOCK != 0 and vocab_size > end)


# ---- the torch backend's pieces ----

def _scaled(x: torch.Tensor, inv_temperature: Optional[float]) -> torch.Tensor:
    """z = x * (1 / T) in fp32, as the rest of the op (and its backward) scales."""
    z = x.to(torch.float32)
    return z if inv_temperature is None else z * inv_temperature


def torch_row_max(logits, n_valid, inv_temperature, rows_kept):
    m = torch.full((logits.shape[0],), float("-inf"), dtype=torch.float32, device=logits.device)
    if n_valid > 0:
        # Exact in the logits' own dtype; rounding is monotone, so the max of the quotients is the quotient of the max.
        m = _scaled(logits[:, :n_valid].amax(dim=1), inv_temperature)
    return torch.where(rows_kept, m, torch.full_like(m, float("-inf"))) if rows_kept is not None else m


def torch_block_sums(logits, shift, shard: ShardBlocks, start, n_valid, width, inv_temperature, head_chains,
                     chunk_rows: int = 1024):
    """(sums [T, 2, finished], tail chains [T, 2, THREADS] or None) of this shard, in SGLang's order."""
    rows = logits.shape[0]
    sums = torch.zeros((rows, 2, shard.finished), dtype=torch.float32, device=logits.device)
    tail = torch.zeros((rows, 2, THREADS), dtype=torch.float32, device=logits.device) if shard.tail_continues \
        else None
    if shard.count == 0:
        return sums, tail
    offsets = chain_offsets(width, logits.device).reshape(-1)
    lead = start - shard.first * BLOCK  # where column 0 of the shard sits in its first block
    for r0 in range(0, rows, chunk_rows):
        r1 = min(rows, r0 + chunk_rows)
        z = _scaled(logits[r0:r1, :n_valid], inv_temperature)
        shifted = z - shift[r0:r1, None]
        e = torch.exp(shifted)
        padded = torch.zeros((2, r1 - r0, shard.count * BLOCK), dtype=torch.float32, device=logits.device)
        padded[SUM, :, lead:lead + n_valid] = e
        padded[ENT, :, lead:lead + n_valid] = torch.where(e > 0, e * shifted, torch.zeros_like(e))
        values = padded.view(2, r1 - r0, shard.count, BLOCK)[..., offsets]
        values = values.view(2, r1 - r0, shard.count, CHAIN, THREADS)
        chains = torch.zeros((2, r1 - r0, shard.count, THREADS), dtype=torch.float32, device=logits.device)
        if shard.head_continues:
            chains[:, :, 0] = head_chains[r0:r1].transpose(0, 1)
        for q in range(CHAIN):
            chains = chains + values[:, :, :, q]
        if shard.tail_continues:
            tail[r0:r1] = chains[:, :, -1].transpose(0, 1)
            chains = chains[:, :, :-1]
        sums[r0:r1] = block_tree(chains).permute(1, 0, 2)
    return sums, tail


def torch_combine(sums, shift, target_z, rows_kept):
    """Global block sums [T, 2, blocks] (in global order) -> (log_prob, entropy, log S, W / S, has_mass)."""
    s = torch.zeros_like(shift)
    w = torch.zeros_like(shift)
    for b in range(sums.shape[2]):
        s = s + sums[:, SUM, b]
        w = w + sums[:, ENT, b]
    has_mass = s > 0
    if rows_kept is not None:
        has_mass = has_mass & rows_kept
    s_safe = torch.where(has_mass, s, torch.ones_like(s))
    log_s = torch.log(s_safe)
    ratio = torch.where(has_mass, w / s_safe, torch.zeros_like(w))
    log_prob = torch.where(has_mass, (target_z - shift) - log_s, torch.full_like(s, float("-inf")))
    entropy = torch.where(has_mass, log_s - ratio, torch.zeros_like(s))
    return log_prob, entropy, torch.where(has_mass, log_s, torch.zeros_like(s)), ratio, has_mass


def target_logit(logits, tokens, start, n_valid, inv_temperature):
    """[T] fp32 z of each row's target where this shard holds it, else -inf."""
    local = tokens.to(torch.int64) - start
    owned = (local >= 0) & (local < n_valid)
    col = torch.where(owned, local, torch.zeros_like(local))
    if logits.shape[1] == 0:
        return torch.full((logits.shape[0],), float("-inf"), device=logits.device)
    z = _scaled(logits.gather(1, col.unsqueeze(1)).squeeze(1), inv_temperature)
    return torch.where(owned, z, torch.full_like(z, float("-inf")))


# ---- the call ----

@dataclasses.dataclass(frozen=True)
class Shard:
    """One rank's part of a call, and the steps it computes between the collectives (row_stats runs them; a test
    can run the shards of several ranks in one process and do the exchanges itself)."""

    logits: torch.Tensor  # [T, V_local]
    tokens: torch.Tensor  # [T]
    row_mask: Optional[torch.Tensor]  # [T] bool or None
    start: int  # global column of the shard's first column
    v_local: int
    n_valid: int  # real vocabulary columns of the shard
    vocab_size: int
    inv_temperature: Optional[float]  # None: 1
    kernels: "Kernels"

    @property
    def blocks(self) -> ShardBlocks:
        return shard_blocks(self.start, self.v_local, self.n_valid, self.vocab_size)

    @property
    def width(self) -> int:
        return vector_width(self.vocab_size)

    def local_max(self) -> torch.Tensor:
        return self.kernels.row_max(self.logits, self.n_valid, self.inv_temperature, self.row_mask)

    def tail_chains(self, shift) -> torch.Tensor:
        """[T, 2, THREADS]: the chains of the last block, for the next rank (zeros where it has none to hand on)."""
        if not self.blocks.tail_continues:
            return torch.zeros((self.logits.shape[0], 2, THREADS), dtype=torch.float32, device=self.logits.device)
        return self.kernels.tail_chains(self.logits, shift, self.blocks, self.start, self.n_valid, self.width,
                                        self.inv_temperature)

    def block_sums(self, shift, head_chains) -> torch.Tensor:
        """[T, 2, blocks finished here], continuing `head_chains` (the previous rank's tail) in the first block."""
        return self.kernels.block_sums(self.logits, shift, self.blocks, self.start, self.n_valid, self.width,
                                       self.inv_temperature, head_chains, self.row_mask)

    def target_z(self) -> torch.Tensor:
        return target_logit(self.logits, self.tokens, self.start, self.n_valid, self.inv_temperature)


def combine(kernels, sums, row_max, target_z, row_mask) -> RowStats:
    """Global block sums [T, 2, blocks] in global order, the global row max and target z -> RowStats."""
    shift = _shift(row_max)
    log_prob, entropy, log_s, ratio, has_mass = kernels.combine(sums, shift, target_z, row_mask)
    bad = torch.isnan(row_max) | (row_max == float("inf"))
    return RowStats(log_prob=log_prob, entropy=entropy, shift=shift, log_sum=log_s, log_sum_kept=None,
                    mean_shifted=ratio, bad_input=bad, log_prob_defined=has_mass, row_has_mass=has_mass)


def _shift(row_max):
    return torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))


def row_stats(plan, inputs: RowInputs) -> RowStats:
    """The row statistics of a call in SGLang's order: max, boundary chains, block sums, combine; the collectives
    between the steps at TP > 1 (module docstring)."""
    layout = plan.layout
    mine = _shard(plan, inputs, layout.rank)
    rows, device = inputs.logits.shape[0], inputs.logits.device
    local_max = mine.local_max()
    if layout.group is None:
        shift = _shift(local_max)
        return combine(mine.kernels, mine.block_sums(shift, None), local_max, mine.target_z(), inputs.row_mask)

    if plan.validate:  # the header exchange (the call's one host read) first; amax propagates NaN
        shell.check_across_ranks(plan, inputs.tokens, inputs.row_mask,
                                 (torch.isnan(local_max) | (local_max == float("inf"))).any())
    row_max = local_max.clone()
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=layout.group)
    shift = _shift(row_max)
    every = [shard_blocks(*_geometry(layout, r)) for r in range(layout.world_size)]
    head = None
    if any(blocks.tail_continues for blocks in every):
        tails = _all_gather(mine.tail_chains(shift), layout)
        head = tails[layout.rank - 1] if mine.blocks.head_continues else None
    sums = mine.block_sums(shift, head)
    width = max(blocks.finished for blocks in every)
    payload = torch.zeros((rows, 2 * width + 1), dtype=torch.float32, device=device)
    payload[:, :2 * sums.shape[2]].view(rows, 2, sums.shape[2]).copy_(sums)
    payload[:, -1] = mine.target_z()
    gathered = _all_gather(payload, layout)
    parts = [gathered[r, :, :2 * b.finished].view(rows, 2, b.finished) for r, b in enumerate(every) if b.finished]
    return combine(mine.kernels, torch.cat(parts, dim=2), row_max, gathered[:, :, -1].amax(dim=0), inputs.row_mask)


def _geometry(layout, rank: int):
    """(start, v_local, n_valid, vocab_size) of rank `rank`'s shard, as shard_blocks takes them."""
    start = rank * layout.v_local
    return start, layout.v_local, max(0, min(layout.v_local, layout.vocab_size - start)), layout.vocab_size


def _shard(plan, inputs: RowInputs, rank: int) -> Shard:
    """This rank's Shard of the call."""
    layout = plan.layout
    start, v_local, n_valid, vocab_size = _geometry(layout, rank)
    return Shard(logits=inputs.logits, tokens=inputs.tokens, row_mask=inputs.row_mask, start=start,
                 v_local=v_local, n_valid=n_valid, vocab_size=vocab_size,
                 inv_temperature=None if plan.shard.inv_temperature == 1.0 else plan.shard.inv_temperature,
                 kernels=kernels_for(plan.backend.name))


def _all_gather(t: torch.Tensor, layout) -> torch.Tensor:
    """[world, *t.shape]: every rank's `t`, rank-major."""
    out = torch.empty((layout.world_size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    agreement.all_gather_into(out, t, layout.group)
    return out.view((layout.world_size,) + tuple(t.shape))


@dataclasses.dataclass(frozen=True)
class Kernels:
    """A backend's implementation of the steps (the torch functions above, or sglang_order_kernels.py's)."""

    row_max: object
    block_sums: object
    tail_chains: object
    combine: object


def _torch_block_sums(logits, shift, shard, start, n_valid, width, inv_temperature, head, row_mask):
    return torch_block_sums(logits, shift, shard, start, n_valid, width, inv_temperature, head)[0]


def _torch_tail_chains(logits, shift, shard, start, n_valid, width, inv_temperature):
    """The last block's chains alone: its columns as a one-block shard (a continuing tail needs a shard of at least
    one block, so that block starts inside this shard)."""
    last = shard.first + shard.count - 1
    lo = last * BLOCK - start
    tail = ShardBlocks(last, 1, head_continues=False, tail_continues=True)
    return torch_block_sums(logits[:, lo:n_valid], shift, tail, start + lo, n_valid - lo, width, inv_temperature,
                            None)[1]


_TORCH = Kernels(row_max=torch_row_max, block_sums=_torch_block_sums, tail_chains=_torch_tail_chains,
                 combine=torch_combine)


@functools.lru_cache(maxsize=None)
def _triton_kernels() -> Kernels:
    """The Triton steps (sglang_order_kernels.py), imported on first use: triton may be absent."""
    from ppo_ops.logits import sglang_order_kernels as k
    return Kernels(row_max=torch_row_max, block_sums=k.block_sums, tail_chains=k.tail_chains, combine=k.combine)


def kernels_for(backend_name: str) -> Kernels:
    """The steps' implementation of a backend ("torch" or "triton"; the row max is torch's for both)."""
    return _triton_kernels() if backend_name == "triton" else _TORCH
