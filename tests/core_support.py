"""Shared helpers of the core test suite (tests/test_core_*.py).

- `DEVICE`: "cuda" when a GPU is present (the same files run on an H200 with plain pytest), else "cpu".
- `backend_params(device)`: pytest parameters for the two backends; Triton on CPU tensors needs the interpreter
  (TRITON_INTERPRET=1, set by tests/conftest.py and the Bazel macro before triton is imported), else it is skipped.
- Seeded inputs (`make_*`), built on the CPU with their own generator so every rank and every run sees the same values.
- `run_op`: one forward + backward of `ppo_ops.log_probs_and_entropy` on a private leaf copy of the logits.
- `run_gloo`, `run_ranks`: process groups on loopback (tests/ranks.py).
"""

import os
from typing import NamedTuple, Optional

import pytest
import torch

from ppo_ops.core import agreement

from tests.ranks import DEVICE  # noqa: E402  cuda when a GPU is visible, else cpu
BACKENDS = ("torch", "triton")


def triton_skip_reason(device) -> Optional[str]:
    """Why the Triton backend cannot run on tensors of `device` here, or None when it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton on CPU tensors needs TRITON_INTERPRET=1 (set before triton is imported)"
    return None


def backend_params(device=DEVICE):
    """pytest.param per backend, the Triton one skipped where it has no hardware/interpreter to run on."""
    reason = triton_skip_reason(device)
    return [
        pytest.param("torch", id="torch"),
        pytest.param("triton", id="triton", marks=[pytest.mark.skipif(reason is not None, reason=reason or "")]),
    ]


# --- seeded inputs (CPU tensors; move them with .to(DEVICE)) ---

def make_logits(shape, dtype=torch.float32, seed=0, scale=2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype)


def make_tokens(shape, n_vocab, seed=1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_vocab, shape, generator=gen, dtype=torch.long)


def make_keep_mask(logits_shape, tokens, seed=2, density=0.6, drop_target_every=3) -> torch.Tensor:
    """Random bool mask; every `drop_target_every`-th row (flattened) has its target column dropped explicitly."""
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(logits_shape, generator=gen) < density
    flat, flat_tokens = keep.view(-1, logits_shape[-1]), tokens.reshape(-1)
    for row in range(0, flat.shape[0], drop_target_every):
        flat[row, flat_tokens[row]] = False
    return keep


def make_row_mask(shape, seed=3, density=0.7) -> torch.Tensor:
    """Random bool mask with at least one True and (when there are two rows or more) one False."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=gen) < density
    flat = mask.view(-1)
    if flat.numel() >= 1:
        flat[0] = True
    if flat.numel() >= 2:
        flat[-1] = False
    return mask


def make_weights(shape, seed=4, low=0.5, high=1.5) -> torch.Tensor:
    """Non-uniform upstream gradient weights in [low, high)."""
    gen = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand(shape, generator=gen)


# --- one call of the op ---

class Result(NamedTuple):
    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]
    grad: Optional[torch.Tensor]  # d(Σ w_lp * log_probs + Σ w_ent * entropy) / d logits, None without weights


def run_op(logits, tokens, *, grad_log_probs=None, grad_entropy=None, device=DEVICE, **opts) -> Result:
    """Forward (and backward when a weight is given) of ppo_ops.log_probs_and_entropy on a leaf copy of `logits`.

    Tensor options (keep_mask, row_mask) are moved to `device`; `grad_entropy` is used only with entropy="grad".
    """
    import ppo_ops

    x = logits.detach().to(device).clone().requires_grad_(True)
    opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    out = ppo_ops.log_probs_and_entropy(x, tokens.to(device), **opts)
    outputs, weights = [], []
    if grad_log_probs is not None:
        outputs.append(out.log_probs)
        weights.append(grad_log_probs.to(device))
    if grad_entropy is not None and opts.get("entropy") == "grad":
        outputs.append(out.entropy)
        weights.append(grad_entropy.to(device))
    grad = torch.autograd.grad(outputs, x, weights)[0] if outputs else None
    return Result(out.log_probs.detach(), None if out.entropy is None else out.entropy.detach(), grad)


# --- process groups: tests/ranks.py (re-exported here for the suites that import them from this module) ---
from tests.ranks import run_gloo, run_ranks  # noqa: E402,F401


class CaseFailures:
    """Collects per-case failures on one rank so every case runs (and every rank keeps issuing the same collectives);
    `raise_if_any` fails the rank at the end with all of them."""

    def __init__(self, rank):
        self.rank, self.items = rank, []

    def run(self, name, fn, *args):
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported below with its type
            self.items.append(f"rank {self.rank}, case {name}: {type(exc).__name__}: {exc}")

    def raise_if_any(self):
        if self.items:
            raise AssertionError("\n".join(self.items))


def compile_check_report(module: str, cache_dir, timeout_s: float) -> dict:
    """Runs `python -m module` (a compile check: kernels compiled for sm_90 with no GPU and no interpreter) in a child
    process with its own Triton cache; returns the JSON report of its last line."""
    import json
    import pathlib
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    repo_root = pathlib.Path(os.path.abspath(__file__)).parent.parent  # not resolved: Bazel's runfiles copy stays
    done = subprocess.run([sys.executable, "-m", module], env=env, cwd=repo_root, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, f"compile check failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- a tripwire on torch.distributed: which collectives a failing call issues (tests/test_core_errors.py,
# tests/test_token_losses.py) ----

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "all_reduce",
                "all_to_all", "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "reduce",
                "reduce_scatter", "reduce_scatter_tensor", "scatter", "send", "recv", "isend", "irecv")
HEADER_NUMEL = len(agreement.HEADER)


class CollectiveIssued(Exception):
    """Raised by the tripwire standing in for every torch.distributed collective but the header exchange."""


def tripwire(name, original, headers):
    """Lets through the fixed-size header all-gather (an int64 vector of HEADER_FIELDS, counted in `headers`), the one
    collective allowed before an error; anything else fires."""
    def fire(*args, **kwargs):
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if (name in ("all_gather_into_tensor", "all_gather_single") and len(inputs) == 2
                and inputs[1].dtype == torch.int64 and inputs[1].numel() == HEADER_NUMEL):
            headers.append(name)
            return original(*args, **kwargs)
        raise CollectiveIssued(f"torch.distributed.{name} was called")
    return fire
