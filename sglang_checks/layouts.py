"""Parallel layout names (`tp2`, `cp2`, `dp2`, `tp2cp2`, ...): parsing, rank placement and validation.

A layout name is one or more factors `tp<N>`, `cp<N>`, `dp<N>` written together, each at most once; its world size is
the product. A trainer layout may end in `-fused` (e.g. `tp2-fused`): its ranks score with ppo_ops' fused LM head
(linear_token_loss from the hidden states and the LM-head shard, never forming logits) instead of forming logits and
calling the logits op (trainer.py). Ranks are placed Megatron-style with TP fastest: rank = (d * cp + c) * tp + t.
Each check that a layout needs (divides the vocabulary, the sequence, the batch; fits the ranks there are) raises
CheckError naming the flag, the layout and what was expected, before any process is started.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import List, Optional, Sequence, Tuple

from sglang_checks.errors import CheckError

_FACTOR = re.compile(r"(tp|cp|dp)([0-9]+)")
_DIM_MEANING = {"tp": "tensor parallel (vocabulary split)", "cp": "context parallel (sequence split)",
                "dp": "data parallel (batch split)"}

# How a trainer layout's ranks score (trainer.py). LOGITS: logits shard h @ W_t^T in the model's dtype, then the logits
# op. FUSED: the fused LM head, ppo_ops.linear_token_loss (no keep mask). UNFUSED: the fused head's specification
# without fusion, the logits op on h @ W_t^T formed in fp32 and never rounded, without a keep mask: the baseline of
# the FUSED layouts (trainer.py adds it; it has no name suffix a user could write).
LOGITS, FUSED, UNFUSED = "logits", "fused", "unfused"
FUSED_SUFFIX = "-fused"


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel layout. `name` is as the user wrote it; tp, cp, dp are its factors (1 when absent); `head` how a
    trainer layout scores (LOGITS, FUSED, UNFUSED)."""

    name: str
    tp: int = 1
    cp: int = 1
    dp: int = 1
    head: str = LOGITS

    @property
    def fused(self) -> bool:
        return self.head == FUSED

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def canonical(self) -> Tuple[int, int, int, str]:
        return (self.tp, self.cp, self.dp, self.head)

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(d, c, t) of `rank`: its batch part, sequence part and vocabulary part."""
        return rank // (self.tp * self.cp), (rank // self.tp) % self.cp, rank % self.tp

    def rank_of(self, d: int, c: int, t: int) -> int:
        return (d * self.cp + c) * self.tp + t

    def tp_groups(self) -> List[List[int]]:
        """Ranks sharing one (batch, sequence) part: they split the vocabulary between them."""
        return [[self.rank_of(d, c, t) for t in range(self.tp)] for d in range(self.dp) for c in range(self.cp)]

    def data_groups(self) -> List[List[int]]:
        """Ranks holding the same vocabulary part: their LM-head gradients and losses are summed."""
        return [[self.rank_of(d, c, t) for d in range(self.dp) for c in range(self.cp)] for t in range(self.tp)]


def parse_layout(name: str, *, flag: str, allowed_dims: Sequence[str], fused: bool = False) -> Layout:
    """Parses one layout name; `allowed_dims` limits which factors this side supports, `fused` whether a name may end
    in -fused (the trainer's)."""
    text = name.strip().lower()
    head = LOGITS
    if text.endswith(FUSED_SUFFIX):
        if not fused:
            raise CheckError(f"{flag}: layout {name!r} asks for the fused LM head ({FUSED_SUFFIX}), which only trainer "
                             f"layouts have")
        text, head = text[:-len(FUSED_SUFFIX)], FUSED
    factors = _FACTOR.findall(text)
    if not text or "".join(d + n for d, n in factors) != text:
        raise CheckError(
            f"{flag}: unknown layout name {name!r}; expected factors like tp2, cp2, dp2 written together "
            f"(e.g. tp2cp2{', tp2-fused' if fused else ''}), from: {', '.join(allowed_dims)}")
    sizes = {}
    for dim, count in factors:
        if dim in sizes:
            raise CheckError(f"{flag}: layout {name!r} names {dim} twice")
        if dim not in allowed_dims:
            raise CheckError(
                f"{flag}: layout {name!r} uses {dim} ({_DIM_MEANING[dim]}), which this side does not support; "
                f"supported: {', '.join(allowed_dims)}")
        size = int(count)
        if size < 1:
            raise CheckError(f"{flag}: layout {name!r} has {dim}{count}; sizes must be at least 1")
        sizes[dim] = size
    return Layout(name=text + (FUSED_SUFFIX if head == FUSED else ""), head=head, **sizes)


def parse_layouts(text: str, *, flag: str, allowed_dims: Sequence[str], fused: bool = False) -> List[Layout]:
    """Parses a comma-separated list; rejects an empty list and two names for the same layout."""
    names = [part for part in (p.strip() for p in text.split(",")) if part]
    if not names:
        raise CheckError(f"{flag}: expected a comma-separated list of layouts such as tp1,tp2, got {text!r}")
    layouts = [parse_layout(n, flag=flag, allowed_dims=allowed_dims, fused=fused) for n in names]
    seen = {}
    for layout in layouts:
        if layout.canonical in seen:
            raise CheckError(f"{flag}: {seen[layout.canonical]!r} and {layout.name!r} are the same layout")
        seen[layout.canonical] = layout.name
    return layouts


def with_baseline(layouts: List[Layout]) -> List[Layout]:
    """The trainer's TP=1 baseline first (added when the user did not list it), then the rest in the given order."""
    base = [layout for layout in layouts if layout.canonical == (1, 1, 1, LOGITS)]
    rest = [layout for layout in layouts if layout.canonical != (1, 1, 1, LOGITS)]
    return (base or [Layout(name="tp1")]) + rest


def check_rank_budget(layout: Layout, *, flag: str, max_ranks: int, what: str) -> None:
    if layout.world_size > max_ranks:
        raise CheckError(
            f"{flag}: layout {layout.name!r} needs {layout.world_size} ranks, more than the {max_ranks} allowed "
            f"({what})")


def check_trainer_layout(layout: Layout, *, flag: str, vocab_size: Optional[int] = None, seq_len: Optional[int] = None,
                         num_sequences: Optional[int] = None) -> None:
    """The vocabulary, the padded sequence and the batch must split evenly across the layout's ranks (None: skip)."""
    if vocab_size is not None and vocab_size % layout.tp:
        raise CheckError(
            f"{flag}: layout {layout.name!r} splits the vocabulary into {layout.tp} parts, but the model's vocabulary "
            f"size {vocab_size} is not divisible by {layout.tp}")
    if seq_len is not None and seq_len % layout.cp:
        raise CheckError(
            f"{flag}: layout {layout.name!r} splits the sequence into {layout.cp} parts, but the trainer sequence "
            f"length {seq_len} is not divisible by {layout.cp} (see --seq_len)")
    if num_sequences is not None and num_sequences % layout.dp:
        raise CheckError(
            f"{flag}: layout {layout.name!r} splits the batch into {layout.dp} parts, but the rollout has "
            f"{num_sequences} sequences, not divisible by {layout.dp}")


def auto_seq_len(longest: int, layouts: Sequence[Layout]) -> int:
    """The shortest trainer sequence length >= `longest` that every layout's CP size divides."""
    multiple = 1
    for layout in layouts:
        multiple = multiple * layout.cp // math.gcd(multiple, layout.cp)
    return -(-longest // multiple) * multiple
