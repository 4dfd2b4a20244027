"""Process-group plumbing shared by the legacy ops.

Megatron's fused cross entropy calls ``torch.distributed.all_reduce(..., group=tp_group)`` and ``tp_group.rank()``
unconditionally, so the legacy path always needs a real process group, even at TP=1. The rule, the same as the
slime-compatible core API:

* an explicit ``tp_group`` is used as given;
* ``tp_group=None`` means the default group when ``torch.distributed`` is initialised;
* otherwise (TP=1, no distributed run) a private single-rank group is built once per device type, without touching
  global state: gloo for CPU tensors, NCCL for CUDA tensors (on a single-rank NCCL group the all-reduce is a device-side
  no-op copy, as in a trainer running TP=1 under Megatron, so the legacy baseline is not slowed by host round trips).
"""

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

_SINGLE_RANK_GROUPS: Dict[str, "dist.ProcessGroup"] = {}


def _single_rank_group(device: torch.device) -> "dist.ProcessGroup":
    """Returns a cached world-size-1 group for ``device``'s type (no init_process_group, no network)."""
    key = device.type
    if key not in _SINGLE_RANK_GROUPS:
        store = dist.HashStore()
        if key == "cuda" and dist.is_nccl_available():
            group = dist.ProcessGroupNCCL(store, 0, 1)
        else:
            group = dist.ProcessGroupGloo(store, 0, 1)
        _SINGLE_RANK_GROUPS[key] = group
    return _SINGLE_RANK_GROUPS[key]


def resolve_group(tp_group: Optional["dist.ProcessGroup"], device: torch.device) -> "dist.ProcessGroup":
    """Turns the caller's ``tp_group`` argument into a process group Megatron can use."""
    if tp_group is not None:
        return tp_group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return _single_rank_group(device)


def group_rank_and_size(group: "dist.ProcessGroup") -> Tuple[int, int]:
    """(rank, world size) inside ``group``, read the way Megatron reads them (``group.rank()``, ``group.size()``)."""
    return group.rank(), group.size()
