"""One vocab-parallel test case: its description, its global inputs, and the check of one rank's result.

A `ShardedCase` says which options are on. `global_inputs` builds the GLOBAL logits (and masks, tokens, upstream
weights) from seeds, so every rank of a gloo group builds the same ones. `check_rank` runs the op on this rank's
vocabulary shard and compares with the float64 reference on the global logits: log-probs and entropy (replicated on
every rank) and the gradient shard (against the matching slice of the reference gradient). Given the same call's
TP=1 result, it also checks the TP>1 result is bitwise identical to it (fixed-segment layout, V_global % 8 == 0).

Used by tests/test_core_parallel.py (a fixed matrix) and tests/test_core_properties.py (hypothesis-drawn cases).
"""

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

import ppo_ops
from tests.ranks import DEVICE, rank_device
from tests.core_support import (Result, make_keep_mask, make_logits, make_row_mask, make_tokens, make_weights,
                                run_op)
from tests.reference import (assert_entropy_close, assert_grad_close, assert_log_probs_close,
                             reference_log_probs_and_entropy, shard_vocab)

NEG_INF = float("-inf")
PADDING_LOGIT = 50.0  # padding columns hold values that would dominate the softmax if any mass leaked into them
NEG_INF_FRACTION = 0.35  # share of logits set to -inf when a case asks for masked vocabulary (targets stay finite)


@dataclasses.dataclass(frozen=True)
class ShardedCase:
    name: str
    lead: tuple  # leading (row) shape
    v_local: int  # columns per rank
    dtype: torch.dtype = torch.float32
    entropy: str = "grad"
    temperature: float = 1.0
    keep: str = "off"  # "off" (no mask) | "random" (some rows drop their target) | "target_only" | "all"
    rows: str = "off"  # "off" (no mask) | "random" | "none" (every row dropped)
    padding: Optional[int] = None  # vocab_size = V_global - padding
    neg_inf: bool = False
    chunk_size: Optional[int] = None
    inplace_grad: bool = False
    scale: float = 2.0  # standard deviation of the logits
    seed: int = 0


def global_inputs(case: ShardedCase, world_size: int):
    """(global logits, tokens, op options with global masks, upstream weights)."""
    v_global = case.v_local * world_size
    vocab_size = None if case.padding is None else v_global - case.padding
    shape = case.lead + (v_global,)
    logits = make_logits(shape, case.dtype, case.seed, case.scale)
    if vocab_size is not None:
        logits[..., vocab_size:] = PADDING_LOGIT
    tokens = make_tokens(case.lead, vocab_size or v_global, case.seed + 1)
    if case.neg_inf:
        gen = torch.Generator().manual_seed(case.seed + 6)
        masked = (torch.rand(shape, generator=gen) < NEG_INF_FRACTION).view(-1, v_global)
        masked[torch.arange(masked.shape[0]), tokens.reshape(-1)] = False
        logits = logits.masked_fill(masked.view(shape), NEG_INF)
    opts = dict(entropy=case.entropy, temperature=case.temperature, vocab_size=vocab_size,
                chunk_size=case.chunk_size)
    if case.keep == "random":
        opts["keep_mask"] = make_keep_mask(shape, tokens, case.seed + 2)
    elif case.keep in ("target_only", "all"):
        opts["keep_mask"] = torch.full(shape, case.keep == "all")
    if case.rows != "off":
        rows = make_row_mask(case.lead, case.seed + 3) if case.rows == "random" else torch.zeros(case.lead, dtype=bool)
        opts["row_mask"] = rows
        tokens = torch.where(rows, tokens, -100)  # dropped rows' tokens are never checked
    weights = dict(grad_log_probs=make_weights(case.lead, case.seed + 4),
                   grad_entropy=make_weights(case.lead, case.seed + 5, low=-1.0, high=1.0))
    return logits, tokens, opts, weights


def has_fixed_segments(case: ShardedCase, world_size: int) -> bool:
    """The layout whose bits do not depend on the TP size (ppo_ops/core/layout.py): V_global % 8 == 0, TP divides 8."""
    return (case.v_local * world_size) % 8 == 0 and 8 % world_size == 0


def _on_cpu(result: Result) -> Result:
    return Result(*(None if t is None else t.cpu() for t in result))


def tp1_result(case: ShardedCase, world_size: int, backend: str, device=DEVICE) -> Result:
    """The same call on the global logits at TP=1 (no process group in this process), on `device`: the device the
    ranks it is compared with compute on (bits are compared per device type)."""
    logits, tokens, opts, weights = global_inputs(case, world_size)
    return _on_cpu(run_op(logits, tokens, device=device, backend=backend, **opts, **weights))


def _run_rank(case, logits, tokens, opts, weights, rank, world_size, backend):
    device = rank_device(rank, dist.get_backend())  # a gloo group computes on CPU tensors, also on a GPU machine
    x = shard_vocab(logits, rank, world_size)
    local = dict(opts)
    if "keep_mask" in local:
        local["keep_mask"] = shard_vocab(local["keep_mask"], rank, world_size)
    tp_group = dist.group.WORLD  # explicit: tp_group=None is one rank
    if not case.inplace_grad:
        return _on_cpu(run_op(x, tokens, device=device, backend=backend, tp_group=tp_group, **local, **weights))
    # inplace_grad: the op's input must be a non-leaf (as lm-head logits are), whose storage receives the gradient.
    local = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in local.items()}
    y = x.to(device).requires_grad_(True) * 1
    out = ppo_ops.log_probs_and_entropy(y, tokens.to(device), backend=backend, tp_group=tp_group, inplace_grad=True,
                                        **local)
    outputs, grads = [out.log_probs], [weights["grad_log_probs"].to(device)]
    if case.entropy == "grad":
        outputs.append(out.entropy)
        grads.append(weights["grad_entropy"].to(device))
    (grad,) = torch.autograd.grad(outputs, y, grads)
    assert grad.data_ptr() == y.data_ptr(), "inplace_grad=True did not return the logits' storage"
    return _on_cpu(Result(out.log_probs.detach(), None if out.entropy is None else out.entropy.detach(), grad))


def check_rank(case: ShardedCase, rank: int, world_size: int, backend: str, tp1: Optional[Result] = None):
    """Runs `case` on this rank's shard (inside an initialised gloo group) and checks it; see the module docstring."""
    logits, tokens, opts, weights = global_inputs(case, world_size)
    got = _run_rank(case, logits, tokens, opts, weights, rank, world_size, backend)

    ref = reference_log_probs_and_entropy(
        logits, tokens, grad_log_probs=weights["grad_log_probs"],
        grad_entropy=weights["grad_entropy"] if case.entropy == "grad" else None, **opts)
    assert_log_probs_close(got.log_probs, ref.log_probs)
    if case.entropy == "none":
        assert got.entropy is None, "entropy='none' must return None"
    else:
        assert_entropy_close(got.entropy, ref.entropy)
    assert_grad_close(got.grad, shard_vocab(ref.grad, rank, world_size), case.dtype)

    if tp1 is not None:
        assert torch.equal(got.log_probs, tp1.log_probs), "log_probs differ bitwise from TP=1"
        if got.entropy is not None:
            assert torch.equal(got.entropy, tp1.entropy), "entropy differs bitwise from TP=1"
        assert torch.equal(got.grad, shard_vocab(tp1.grad, rank, world_size)), "gradient differs bitwise from TP=1"
