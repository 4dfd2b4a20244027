"""Parity of the fused core against the legacy reference, shared by the CPU and the GPU parity files.

`_assert_legacy_parity` runs one scenario of `PARITY_SCENARIOS` through both slime-compatible entry points,
``ppo_ops.calculate_log_probs_and_entropy`` (core) and ``ppo_ops.legacy.calculate_log_probs_and_entropy`` (Megatron
fused CE + separate entropy Function), on the same vocab slice of the same inputs, and compares:

* forward: log-probs within `LOGPROB_FORWARD_ATOL`, entropy within the looser `ENTROPY_FORWARD_ATOL`,
  ``entropy.requires_grad`` as the scenario asks;
* backward, as two separate passes with their own non-uniform weights so neither gradient can hide the other:
  the log-prob gradient at the legacy kernel's effective precision (`_assert_logprob_backward_close`: both sides cast
  to bfloat16, on every device — Megatron's backward rounds to bf16 on CPU as on CUDA), the entropy gradient within
  `ENTROPY_BACKWARD_ATOL`.

Cases are (vocab, scenario): 12 scenarios x PARITY_VOCABS (a small vocab and Qwen3's 151936).
Multi-rank runs go through `spawn_tp_group`: one spawned group of processes runs every case (a spawn costs seconds:
torch and megatron imports), each rank writes a JSON of ``{case id: failure text or None}``, and the pytest side
reports one test per case from it (`case_failures`).
"""

import dataclasses
import json
import os
import traceback
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

import ppo_ops
import ppo_ops.legacy
from tests.ranks import run_ranks

# --- tolerances ------------------------------------------------------------------------------------------------
# The inputs keep |logit| <= PARITY_MAX_ABS_LOGIT = 12 and every row's logsumexp below 16, so the largest magnitude
# met is < 16, where one fp32 ulp is at most 2^-20 (9.5e-7). Both sides compute in fp32, in different orders; against
# float64 the core stays within ~1 such ulp, so the budgets below are the legacy formulas' error bounds.
FP32_ULP_BELOW_16 = 2.0**-20
# Log-prob z_t − log Σexp: the Σexp over V <= 151936 columns has relative error <= ⌈log2 V⌉·2^-24 (pairwise bound),
# i.e. <= ~1 ulp on log Σexp at magnitude 8–16, plus two roundings: <= 2 ulps a side, 4 between the two sides.
LOGPROB_FORWARD_ATOL = 4 * FP32_ULP_BELOW_16
# Looser: the legacy forms max + log Σexp − Σp·z; its fp32 sum Σp·z over V <= 151936 terms totalling |Σp·z| <= 12
# has the pairwise bound 18·2^-24·12 ≈ 14 ulps, plus the roundings of p, max and log Σexp, and CUDA's reduction tree
# (serial per-thread runs) orders it differently again; measured <= 11 ulps on CPU. 32 ulps covers that bound.
ENTROPY_FORWARD_ATOL = 32 * FP32_ULP_BELOW_16
# Both log-prob gradients are cast to bf16: fp32 values a few ulps apart can round to adjacent bf16 values, one bf16
# ulp (2^-7 relative to the expected value at most) apart, never further.
LOGPROB_BACKWARD_RTOL = 2.0**-7
# Where p_target ≈ 1 the gradient w·(p − 1) cancels: fp32 error of p (<= 4 ulps of 1, 2^-23 each) times |w| <= 2.
LOGPROB_BACKWARD_ATOL = 4 * 2.0**-23 * 2
# Entropy gradient w·p·(Σp·z − z): the error of Σp·z (the 32-ulp budget above) times p <= 1 and |w| <= 2;
# measured <= 17 ulps on CPU (the peaked row, p ≈ 1).
ENTROPY_BACKWARD_ATOL = 2 * ENTROPY_FORWARD_ATOL

# --- inputs -------------------------------------------------------------------------------------------------------
PARITY_ROWS = 7  # odd: chunk_size=2 leaves a one-row tail chunk
PARITY_VOCABS = (
    512,  # small: a multiple of 128 x TP like Megatron's padded vocab, 256 columns a rank at TP=2
    151936,  # Qwen3's vocab (75968 columns a rank at TP=2): real reduction lengths
)
PARITY_MAX_ABS_LOGIT = 12.0  # bounds the magnitudes the tolerances above are derived from
PARITY_SEED = 1234


@dataclasses.dataclass(frozen=True)
class ParityScenario:
    chunk_size: int  # -1 = all rows at once; 2 = several chunks and a tail
    keep_mask: bool  # log-prob renormalised over kept ∪ {target}
    entropy: str  # "none" | "forward" (with_entropy_grad=False) | "grad"

    @property
    def id(self) -> str:
        return f"chunk{self.chunk_size}-{'keep' if self.keep_mask else 'nokeep'}-entropy_{self.entropy}"


PARITY_SCENARIOS = tuple(
    ParityScenario(chunk_size, keep_mask, entropy)
    for chunk_size in (-1, 2)
    for keep_mask in (False, True)
    for entropy in ("none", "forward", "grad")
)


def make_parity_inputs(device: torch.device, vocab: int) -> Dict[str, torch.Tensor]:
    """Global ``[PARITY_ROWS, vocab]`` inputs, identical on every rank (seeded CPU generator, moved to ``device``).

    Rows: 0, 5, 6 plain; 1 and 4 have the keep mask drop the target (restored by the renormalisation over
    kept ∪ {target}); 2 keeps nothing but the target (log-prob 0); 3 is peaked on its target (p ≈ 1: the cancelling
    gradient w·(p − 1)). Logits stay finite: the legacy entropy is NaN on -inf logits (documented legacy behaviour).
    """
    gen = torch.Generator().manual_seed(PARITY_SEED)
    rows = PARITY_ROWS
    logits = (torch.randn(rows, vocab, generator=gen) * 2.0).clamp(-8.0, 8.0)
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    tokens[4] = vocab - 1  # last column: owned by the last rank at TP=2
    tokens[3] = 7  # first rank's slice at TP=2
    logits[3] = logits[3] * 0.25 - 8.0  # the peaked row: everything else far below the target
    logits[3, tokens[3]] = PARITY_MAX_ABS_LOGIT
    keep = torch.rand(rows, vocab, generator=gen) < 0.6
    keep[1, tokens[1]] = False
    keep[4, tokens[4]] = False
    keep[2] = False
    # Non-uniform weights of both signs, 0.5 <= |w| <= 2, independent for the two backward passes.
    sign = lambda n: torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)  # noqa: E731
    w_log_prob = (0.5 + 1.5 * torch.rand(rows, generator=gen)) * sign(rows)
    w_entropy = (0.5 + 1.5 * torch.rand(rows, generator=gen)) * sign(rows)
    return {
        "logits": logits.to(device),  # [T, V] fp32
        "tokens": tokens.to(device),  # [T] int64
        "keep_mask": keep.to(device),  # [T, V] bool
        "w_log_prob": w_log_prob.unsqueeze(-1).to(device),  # [T, 1], the log-prob's shape
        "w_entropy": w_entropy.to(device),  # [T]
    }


def vocab_slice(tensor: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    """Columns ``[rank*V_local, (rank+1)*V_local)`` of a ``[T, V]`` tensor: what rank ``rank`` holds."""
    local = tensor.shape[-1] // tp_size
    return tensor[:, rank * local : (rank + 1) * local].contiguous()


def _assert_logprob_backward_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Log-prob gradients compared at the legacy kernel's effective precision: both sides cast to bfloat16.

    Megatron's fused CE backward rounds its gradient to bf16 (on CPU as on CUDA); comparing the core's fp32 gradient
    with it in fp32 would measure that rounding, not the core. Cast both, then allow one bf16 ulp.
    """
    torch.testing.assert_close(
        actual.to(torch.bfloat16),
        expected.to(torch.bfloat16),
        rtol=LOGPROB_BACKWARD_RTOL,
        atol=LOGPROB_BACKWARD_ATOL,
    )


def _run_one_side(fn: Callable, scenario: ParityScenario, logits, tokens, keep_mask, group, w_log_prob, w_entropy):
    """Forward once, then the log-prob gradient and the entropy gradient as separate backward passes."""
    x = logits.detach().clone().requires_grad_(True)
    log_prob, entropy = fn(
        x,
        tokens,
        group,
        with_entropy=scenario.entropy != "none",
        chunk_size=scenario.chunk_size,
        log_prob_keep_mask=keep_mask if scenario.keep_mask else None,
        with_entropy_grad=scenario.entropy == "grad",
    )
    wants_entropy_grad = entropy is not None and entropy.requires_grad
    (grad_log_prob,) = torch.autograd.grad(log_prob, x, w_log_prob, retain_graph=wants_entropy_grad)
    grad_entropy = torch.autograd.grad(entropy, x, w_entropy)[0] if wants_entropy_grad else None
    assert torch.equal(x.detach(), logits), f"{fn.__module__}: the caller's logits were modified"
    return log_prob.detach(), (entropy.detach() if entropy is not None else None), entropy, grad_log_prob, grad_entropy


def _assert_legacy_parity(
    scenario: ParityScenario,
    inputs: Dict[str, torch.Tensor],
    rank: int = 0,
    tp_size: int = 1,
    tp_group: Optional["dist.ProcessGroup"] = None,
    core_fn: Optional[Callable] = None,
) -> None:
    """Core vs legacy on this rank's vocab slice of ``inputs`` for one scenario; raises AssertionError on a mismatch.

    ``core_fn`` replaces the core's function (negative controls prove the comparisons catch wrong results).
    """
    core_fn = core_fn or ppo_ops.calculate_log_probs_and_entropy
    rows = inputs["tokens"].shape[0]
    logits = vocab_slice(inputs["logits"], rank, tp_size)
    keep_mask = vocab_slice(inputs["keep_mask"], rank, tp_size)
    args = (scenario, logits, inputs["tokens"], keep_mask, tp_group, inputs["w_log_prob"], inputs["w_entropy"])
    core_lp, core_ent, core_ent_raw, core_grad_lp, core_grad_ent = _run_one_side(core_fn, *args)
    leg_lp, leg_ent, leg_ent_raw, leg_grad_lp, leg_grad_ent = _run_one_side(
        ppo_ops.legacy.calculate_log_probs_and_entropy, *args
    )

    # Forward.
    assert core_lp.shape == leg_lp.shape == (rows, 1), (core_lp.shape, leg_lp.shape)
    assert core_lp.dtype == leg_lp.dtype == torch.float32, (core_lp.dtype, leg_lp.dtype)
    torch.testing.assert_close(core_lp, leg_lp, atol=LOGPROB_FORWARD_ATOL, rtol=0.0)
    if scenario.entropy == "none":
        assert core_ent is None and leg_ent is None, "entropy was not asked for"
    else:
        assert core_ent.shape == leg_ent.shape == (rows,), (core_ent.shape, leg_ent.shape)
        assert core_ent.dtype == torch.float32, core_ent.dtype
        torch.testing.assert_close(core_ent, leg_ent, atol=ENTROPY_FORWARD_ATOL, rtol=0.0)
        wants_grad = scenario.entropy == "grad"
        assert core_ent_raw.requires_grad == wants_grad, f"core entropy.requires_grad should be {wants_grad}"
        assert leg_ent_raw.requires_grad == wants_grad, f"legacy entropy.requires_grad should be {wants_grad}"

    # Backward, pass 1: the log-prob gradient alone.
    _assert_logprob_backward_close(core_grad_lp, leg_grad_lp)
    # Backward, pass 2: the entropy gradient alone.
    if scenario.entropy == "grad":
        torch.testing.assert_close(core_grad_ent, leg_grad_ent, atol=ENTROPY_BACKWARD_ATOL, rtol=0.0)


# --- multi-rank plumbing --------------------------------------------------------------------------------------------
def case_id(vocab: int, scenario: ParityScenario) -> str:
    return f"V{vocab}-{scenario.id}"


def parity_worker(rank: int, tp_size: int, group: "dist.ProcessGroup", device_type: str) -> Dict[str, Optional[str]]:
    """Runs every (vocab, scenario) case on this rank; maps case_id to None (passed) or the failure's traceback."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    results: Dict[str, Optional[str]] = {}
    for vocab in PARITY_VOCABS:
        inputs = make_parity_inputs(device, vocab)
        for scenario in PARITY_SCENARIOS:
            try:
                _assert_legacy_parity(scenario, inputs, rank, tp_size, group)
                results[case_id(vocab, scenario)] = None
            except Exception:  # recorded per case; the pytest side fails that case's test with this text
                results[case_id(vocab, scenario)] = traceback.format_exc()
    return results


def _json_results_worker(rank, world_size, worker, result_dir, worker_args):
    """Runs worker(rank, world_size, group, *worker_args) and saves its JSON-serialisable result for the parent."""
    results = worker(rank, world_size, dist.group.WORLD, *worker_args)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def spawn_tp_group(worker: Callable, world_size: int, backend: str, result_dir: str, *worker_args) -> List[Dict]:
    """Spawns ``world_size`` ranks (tests/ranks.py) that run ``worker(rank, world_size, group, *worker_args)``.

    Returns each rank's JSON-serialisable result. A crash in a rank re-raises here with its traceback.
    """
    run_ranks(world_size, _json_results_worker, worker, result_dir, worker_args, backend=backend)
    results = []
    for rank in range(world_size):
        with open(os.path.join(result_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def rank_failures(rank_results: List[Dict[str, Optional[str]]], key: str) -> str:
    """The failure texts recorded under ``key`` on all ranks, joined; empty when it passed on every rank."""
    missing = "missing from this rank's results"
    return "\n".join(
        f"--- rank {rank} ---\n{results.get(key, missing)}"
        for rank, results in enumerate(rank_results)
        if results.get(key, missing) is not None
    )


def case_failures(rank_results: List[Dict[str, Optional[str]]], vocab: int, scenario: ParityScenario) -> str:
    """`rank_failures` of one parity case (vocab, scenario)."""
    return rank_failures(rank_results, case_id(vocab, scenario))
