"""The top-p replay shape of the keep-set rows: a 64-id nucleus per row as a sparse keep set, and its dense mask.

A rollout's nucleus holds the sampled token (the next row's target) and the other ids that carried the top-p mass;
here the target and NUCLEUS - 1 seeded random ids. `nucleus` gives the CSR keep set `(ids, offsets)` ppo_ops takes
(global ids, the same on every rank); `dense_mask` the [T, V_local] bool keep_mask built from it, as a trainer
without the sparse form builds it (1.2 GB at T = 8192 and Qwen3's vocabulary).
"""

from __future__ import annotations

import inspect

import torch

NUCLEUS = 64  # kept ids per row


def nucleus(targets: torch.Tensor, vocab: int, seed: int) -> tuple:
    """(ids [T * NUCLEUS] int64, offsets [T + 1] int64): each row's target first, then NUCLEUS - 1 random ids."""
    flat = targets.reshape(-1)
    gen = torch.Generator(device=flat.device).manual_seed(seed)
    rest = torch.randint(0, vocab, (flat.numel(), NUCLEUS - 1), generator=gen, device=flat.device)
    ids = torch.cat([flat.reshape(-1, 1).to(torch.int64), rest], dim=1).reshape(-1)
    offsets = torch.arange(flat.numel() + 1, device=flat.device, dtype=torch.int64) * NUCLEUS
    return ids, offsets


def dense_mask(keep: tuple, n_rows: int, v_local: int, vocab_start: int = 0) -> torch.Tensor:
    """[n_rows, v_local] bool: True at this rank's columns of each row's kept ids (nucleus's layout: NUCLEUS a row)."""
    ids = keep[0].view(n_rows, NUCLEUS) - vocab_start
    local = (ids >= 0) & (ids < v_local)
    mask = torch.zeros((n_rows, v_local), dtype=torch.bool, device=ids.device)
    mask.scatter_(1, torch.where(local, ids, 0), local)
    return mask


def missing() -> str | None:
    """Why this ppo_ops cannot take a sparse keep set, or None."""
    import ppo_ops

    if "keep" not in inspect.signature(ppo_ops.log_probs_and_entropy).parameters:
        return "this ppo_ops has no sparse keep set (keep=)"
    return None
