"""A cheap semantic check of every provider before it is timed: a fast wrong answer is not a result.

The forward outputs on a few rows are compared with the float64 reference the test suite uses (tests/reference.py),
applied to the same rows of the GLOBAL logits (gathered across ranks when TP > 1). The rows are the first and the last
ones, so that an offset overflowing 32 bits at large T x V shows up. This catches wrong tokens, masks, signs, shards
or offsets; numerical accuracy is the test suite's job, so the tolerance is loose. The reference depends only on the
inputs and the entropy mode, so the bench computes it once per input set and mode and checks every provider with it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from tests.reference import reference_log_probs_and_entropy
from tools.bench.cases import Case
from tools.bench.inputs import Inputs

# Semantic check, not a precision test: Liger returns its loss in the logits' dtype (bf16 spacing is 0.0625 at
# |x| ~ 14), so allow 1% of max(1, |reference|); a wrong token, mask or shard is off by O(1) or more.
CHECK_RTOL = 1e-2


@dataclasses.dataclass(frozen=True)
class RowsReference:
    rows: torch.Tensor  # [n] int64 row indices checked
    log_probs: torch.Tensor  # [n] float64
    entropy: Optional[torch.Tensor]  # [n] float64, None when entropy == "none"


def checked_rows(T: int, n: int) -> torch.Tensor:
    """The first ceil(n/2) and the last floor(n/2) rows of T (all rows when n >= T)."""
    if n >= T:
        return torch.arange(T)
    head, tail = (n + 1) // 2, n // 2
    return torch.cat([torch.arange(head), torch.arange(T - tail, T)])


def _global_rows(x: torch.Tensor, rows: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Rows `rows` of a vocab-sharded [T, V_local] tensor, with every rank's columns, on the CPU."""
    part = x.detach()[rows.to(x.device)].contiguous()
    if world_size == 1:
        return part.cpu()
    if part.dtype == torch.bool:
        part = part.to(torch.uint8)  # all_gather of bool is not supported by every backend
    parts = [torch.empty_like(part) for _ in range(world_size)]
    dist.all_gather(parts, part, group=group)
    return torch.cat([p.cpu() for p in parts], dim=-1).to(x.dtype)


def reference_rows(case: Case, inp: Inputs, n: int) -> RowsReference:
    """Float64 log-prob (and entropy) of `n` checked rows. Collective when TP > 1: every rank must call it."""
    rows = checked_rows(case.T, n)
    logits = _global_rows(inp.logits, rows, inp.group, case.tp)
    keep = None if inp.keep_mask is None else _global_rows(inp.keep_mask, rows, inp.group, case.tp)
    row_mask = None if inp.row_mask is None else inp.row_mask[rows.to(inp.row_mask.device)].cpu()
    tokens = inp.tokens[rows.to(inp.tokens.device)].cpu()
    ref = reference_log_probs_and_entropy(logits, tokens, entropy=case.entropy, keep_mask=keep, row_mask=row_mask)
    return RowsReference(rows=rows, log_probs=ref.log_probs, entropy=ref.entropy)


def check_forward(outputs: tuple, ref: RowsReference) -> str:
    """"ok" or "fail: <what>" for `outputs` = (log_prob [T] fp32, entropy [T] fp32 or None) of one provider."""
    log_prob, entropy = outputs
    problems = [_compare("log_prob", log_prob, ref.log_probs, ref.rows)]
    if ref.entropy is not None:
        problems.append(_compare("entropy", entropy, ref.entropy, ref.rows))
    problems = [p for p in problems if p]
    return "ok" if not problems else "fail: " + "; ".join(problems)


def _compare(what: str, actual: Optional[torch.Tensor], expected: torch.Tensor, rows: torch.Tensor) -> Optional[str]:
    if actual is None:
        return f"{what} missing"
    a = actual.detach()[rows.to(actual.device)].cpu().double()
    err = (a - expected).abs()
    bound = CHECK_RTOL * expected.abs().clamp(min=1.0)
    bad = ~(err <= bound)  # NaN counts as bad
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        return f"{what} row {int(rows[i])}: {a[i].item():.6g} vs reference {expected[i].item():.6g}"
    return None
