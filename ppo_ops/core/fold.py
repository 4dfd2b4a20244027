"""The fixed-order sum of the PyTorch code paths: one implementation for every caller whose bits must not depend on a
row's position, the other rows, the device's thread count or how a vocabulary is split.

`fold_sum` sums the last dim by halving it with element-wise adds on views: width w becomes ceil(w / 2) by adding the
last floor(w / 2) columns onto the first, until one column is left. Every add is element-wise, so each row's result is
the same sequence of fp32 roundings wherever the row sits and whatever shares its tensor. (`tensor.sum` picks its
order from the tensor's shape: on CPU a one-row reduction is split across threads, on CUDA the block shape follows the
row count.) Callers: logits/torch_backend.py (the logits op's per-segment sums), core/sparse_keep.py (the LM head's
kept-logit dots without Triton). A change here changes both backends' bits together, as it must: their bitwise tests
compare them with each other and across TP sizes.
"""

from __future__ import annotations

import torch


def fold_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ over the last dim of x in the fixed pairwise order above; consumes x (its first column holds the sums).
    Returns x[..., 0], a view."""
    width = x.shape[-1]
    while width > 1:
        half = width // 2
        x[..., :half] += x[..., width - half:width]
        width -= half
    return x[..., 0]
