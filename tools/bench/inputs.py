"""Seeded random inputs of one case, for one rank of the tensor-parallel group.

Rank r gets its own shard of the logits ([T, V // tp], the global columns [r * V_local, (r + 1) * V_local)) and of
the keep mask, drawn on the device from a rank-specific seed; tokens, row mask and upstream gradients are drawn on
the CPU from a shared seed, so they are identical on every rank, as in a trainer. Logits are random normals (never
zeros: they hide unwritten outputs and can run faster than real data), drawn directly in the case's dtype.

Rows the row mask drops hold the token id -100, as prompt rows do in RL trainers: ppo_ops must not validate them and
Liger-Kernel skips them as its ignore_index.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from tools.bench.cases import Case
from tools.bench.measure import TORCH_DTYPES

LOGIT_STD = 2.0  # spread of the random logits; the bench's byte counts and timings do not depend on it
KEEP_FRACTION = 0.5  # density of the random keep mask; a streaming kernel's cost does not depend on it
IGNORED_TOKEN = -100  # token id of rows dropped by the row mask (prompt rows)
_RANK_SEED_STRIDE = 1000


@dataclasses.dataclass
class Inputs:
    logits: torch.Tensor  # [T, V_local] leaf with requires_grad, the case's dtype; READ-ONLY for every provider
    tokens: torch.Tensor  # [T] int64 global ids; IGNORED_TOKEN in rows dropped by the row mask
    keep_mask: Optional[torch.Tensor]  # [T, V_local] bool, True = kept in the log-prob's normaliser; or None
    row_mask: Optional[torch.Tensor]  # [T] bool, True = row is trained on; or None (all rows)
    grad_log_prob: torch.Tensor  # [T] fp32 upstream gradient of the log-prob
    grad_entropy: torch.Tensor  # [T] fp32 upstream gradient of the entropy (used when entropy="grad")
    group: object  # the TP process group, or None at TP=1
    rank: int


def make_inputs(case: Case, device: torch.device, *, seed: int, rank: int = 0, group=None) -> Inputs:
    # O(T) values shared by all ranks come from a CPU generator: identical on every rank whatever its device.
    shared = torch.Generator().manual_seed(seed)
    local = torch.Generator(device=device).manual_seed(seed + _RANK_SEED_STRIDE * (rank + 1))
    T, v_local = case.T, case.v_local
    dtype = TORCH_DTYPES[case.dtype]

    logits = torch.randn(T, v_local, device=device, dtype=dtype, generator=local)
    logits.mul_(LOGIT_STD).requires_grad_(True)
    tokens = torch.randint(0, case.V, (T,), dtype=torch.int64, generator=shared)
    grad_log_prob = torch.randn(T, dtype=torch.float32, generator=shared)
    grad_entropy = torch.randn(T, dtype=torch.float32, generator=shared)

    keep_mask = None
    if case.keep_mask:
        keep_mask = torch.rand(T, v_local, device=device, generator=local) < KEEP_FRACTION

    row_mask = None
    if case.row_frac < 1.0:
        kept = torch.randperm(T, generator=shared)[: case.kept_rows]
        row_mask = torch.zeros(T, dtype=torch.bool)
        row_mask[kept] = True
        tokens = tokens.masked_fill(~row_mask, IGNORED_TOKEN)
        row_mask = row_mask.to(device)
    tokens, grad_log_prob, grad_entropy = (x.to(device) for x in (tokens, grad_log_prob, grad_entropy))

    return Inputs(
        logits=logits,
        tokens=tokens,
        keep_mask=keep_mask,
        row_mask=row_mask,
        grad_log_prob=grad_log_prob,
        grad_entropy=grad_entropy,
        group=group,
        rank=rank,
    )
