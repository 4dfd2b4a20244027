"""ppo_ops.calculate_log_probs_and_entropy behaves as slime's function does, argument by argument.

- tp_group=None is the default group when torch.distributed is initialised (slime's own vocabulary-parallel tests
  call it so, on 2 gloo ranks), one rank otherwise. The calls of such a test are reproduced here: two gloo ranks,
  tp_group=None, keep mask on and off, chunked and whole, entropy with and without its gradient, each against the
  float64 reference on the full vocabulary (values and gradient shard). ppo_ops.legacy's function agrees.
- Every chunk_size <= 0 means no chunking: the same bits as chunk_size=-1.
- Output shapes and dtypes: log_prob [T, 1] fp32 ((0,) at T = 0), entropy [T] fp32 or None.
- log_probs_and_entropy keeps tp_group=None = one rank inside a job; a token past that one rank's vocabulary raises
  an error that names tp_group.
- keep=(ids, offsets), the one keyword beyond slime's: a sample's top-p record as slime keeps it scores as the dense
  mask built from it.
"""

import pytest
import torch
import torch.distributed as dist

import ppo_ops
import ppo_ops.legacy
from tests.core_support import CaseFailures, make_keep_mask, make_logits, make_tokens, make_weights
from tests.ranks import run_gloo
from tests.reference import (GRAD_TOL, assert_entropy_close, assert_grad_close, assert_log_probs_close,
                             reference_log_probs_and_entropy, shard_vocab)

BF16_HALF_ULP = 2.0 ** -8  # relative error of one round-to-nearest to bfloat16 (8 significand bits)
V_LOCAL = 24  # columns per rank: 48 global at TP = 2
N_ROWS = 7  # odd, so chunk_size=3 leaves a tail chunk

# (with_entropy, with_entropy_grad, keep mask, chunk_size): the calls a vocabulary-parallel test of slime's makes.
SLIME_CALLS = [
    pytest.param(False, True, False, -1, id="log_prob_only"),
    pytest.param(True, True, False, -1, id="entropy_grad"),
    pytest.param(True, False, False, -1, id="entropy_no_grad"),
    pytest.param(True, True, True, -1, id="keep_mask_entropy_grad"),
    pytest.param(False, True, True, 3, id="keep_mask_chunked"),
    pytest.param(True, True, False, 3, id="entropy_grad_chunked"),
    pytest.param(True, True, True, 0, id="keep_mask_chunk_size_zero"),
]
SLIME_CALL_VALUES = [tuple(p.values) for p in SLIME_CALLS]
# name: (the drop-in, the dtype whose rounding its gradient carries). The legacy one's log-prob gradient is bf16-rounded
# (Megatron's cross-entropy backward casts it to bfloat16), so it is checked within bf16 ulps.
_FUNCTIONS = {
    "ppo_ops": (ppo_ops.calculate_log_probs_and_entropy, torch.float32),
    "legacy": (ppo_ops.legacy.calculate_log_probs_and_entropy, torch.bfloat16),
}


def _global_inputs(seed, world_size, with_keep):
    shape = (N_ROWS, V_LOCAL * world_size)
    logits = make_logits(shape, seed=seed)
    tokens = make_tokens((N_ROWS,), shape[1], seed + 1)
    keep = make_keep_mask(shape, tokens, seed + 2) if with_keep else None
    return logits, tokens, keep, make_weights((N_ROWS,), seed + 3), make_weights((N_ROWS,), seed + 4, -1.0, 1.0)


def _check_call(fn, grad_dtype, rank, world_size, with_entropy, with_entropy_grad, with_keep, chunk_size, seed):
    """One slime-style call with tp_group=None on this rank's shard, against the full-vocabulary float64 reference."""
    logits, tokens, keep, w_lp, w_ent = _global_inputs(seed, world_size, with_keep)
    x = shard_vocab(logits, rank, world_size).clone().requires_grad_(True)
    local_keep = None if keep is None else shard_vocab(keep, rank, world_size)
    log_prob, entropy = fn(x, tokens, None, with_entropy=with_entropy, chunk_size=chunk_size,
                           log_prob_keep_mask=local_keep, with_entropy_grad=with_entropy_grad)
    grad_entropy = with_entropy and with_entropy_grad
    ref = reference_log_probs_and_entropy(logits, tokens, entropy="grad" if with_entropy else "none", keep_mask=keep,
                                          grad_log_probs=w_lp, grad_entropy=w_ent if grad_entropy else None)
    assert log_prob.shape == (N_ROWS, 1) and log_prob.dtype == torch.float32, (log_prob.shape, log_prob.dtype)
    assert_log_probs_close(log_prob[:, 0].detach(), ref.log_probs)
    if with_entropy:
        assert entropy.shape == (N_ROWS,) and entropy.dtype == torch.float32, (entropy.shape, entropy.dtype)
        assert entropy.requires_grad == with_entropy_grad
        assert_entropy_close(entropy.detach(), ref.entropy)
    else:
        assert entropy is None
    outputs, grads = [log_prob], [w_lp[:, None]]
    if grad_entropy:
        outputs.append(entropy)
        grads.append(w_ent)
    (grad,) = torch.autograd.grad(outputs, x, grads)
    expected = shard_vocab(ref.grad, rank, world_size)
    if grad_dtype == torch.float32:
        assert_grad_close(grad, expected, torch.float32)
        return
    # Only the log-prob part is bf16-rounded: bound each entry by half a bf16 ulp of that part, plus fp32 rounding.
    lp_part = reference_log_probs_and_entropy(logits, tokens, keep_mask=keep, grad_log_probs=w_lp).grad
    bound = BF16_HALF_ULP * shard_vocab(lp_part, rank, world_size).abs() + GRAD_TOL
    error = (grad.double() - expected).abs()
    assert bool((error <= bound).all()), f"legacy gradient: worst error {float((error - bound).max()):.3g} past bound"


def _slime_calls_worker(rank, world_size, fn_name):
    fn, grad_dtype = _FUNCTIONS[fn_name]
    failures = CaseFailures(rank)
    for i, (with_entropy, with_entropy_grad, with_keep, chunk_size) in enumerate(SLIME_CALL_VALUES):
        failures.run(f"call {i}", _check_call, fn, grad_dtype, rank, world_size, with_entropy, with_entropy_grad,
                     with_keep, chunk_size, 10 * i)
    failures.raise_if_any()


@pytest.mark.parametrize("fn_name", ["ppo_ops", "legacy"])
def test_slime_vocab_parallel_calls_with_tp_group_none(fn_name):
    """slime's vocabulary-parallel test calls, tp_group=None on 2 gloo ranks: the default group, full-vocabulary
    results on every rank."""
    run_gloo(2, _slime_calls_worker, fn_name)


def _one_rank_inside_a_job_worker(rank, world_size):
    """log_probs_and_entropy keeps tp_group=None = one rank: a token of the other rank's shard is out of range, and
    the error says tp_group may be the cause."""
    logits, tokens, _, _, _ = _global_inputs(seed=5, world_size=world_size, with_keep=False)
    tokens = tokens.clone()
    tokens[0] = V_LOCAL + 3  # held by rank 1 of a TP group, past one rank's vocabulary
    x = shard_vocab(logits, rank, world_size)
    with pytest.raises(ValueError, match=r"tokens must be global token ids in \[0, 24\).*tp_group"):
        ppo_ops.log_probs_and_entropy(x, tokens, tp_group=None)
    # The same call over the group it belongs to is fine.
    out = ppo_ops.log_probs_and_entropy(x, tokens, tp_group=dist.group.WORLD)
    assert_log_probs_close(out.log_probs, reference_log_probs_and_entropy(logits, tokens).log_probs)


def test_log_probs_and_entropy_keeps_tp_group_none_one_rank():
    run_gloo(2, _one_rank_inside_a_job_worker)


@pytest.mark.parametrize("fn_name,chunk_size", [
    ("ppo_ops", 0), ("ppo_ops", -5), ("ppo_ops", torch.tensor(0)),  # ppo_ops also reads one-element tensors
    ("legacy", 0), ("legacy", -5),  # the legacy reference takes Python ints, as slime's does
])
def test_every_chunk_size_at_most_zero_is_no_chunking(fn_name, chunk_size):
    fn, _ = _FUNCTIONS[fn_name]
    logits, tokens, keep, w_lp, w_ent = _global_inputs(seed=3, world_size=1, with_keep=True)
    results = []
    for size in (-1, chunk_size):
        x = logits.clone().requires_grad_(True)
        log_prob, entropy = fn(x, tokens, None, with_entropy=True, chunk_size=size, log_prob_keep_mask=keep)
        (grad,) = torch.autograd.grad([log_prob, entropy], x, [w_lp[:, None], w_ent])
        results.append((log_prob.detach(), entropy.detach(), grad))
    for a, b, name in zip(*results, ("log_prob", "entropy", "gradient")):
        assert torch.equal(a, b), f"{name}: chunk_size={chunk_size} differs from no chunking"


def test_single_rank_range_error_names_tp_group():
    logits, tokens, _, _, _ = _global_inputs(seed=4, world_size=1, with_keep=False)
    tokens = tokens.clone()
    tokens[2] = V_LOCAL
    with pytest.raises(ValueError, match=r"tokens must be global token ids in \[0, 24\), found 24.*tp_group"):
        ppo_ops.calculate_log_probs_and_entropy(logits, tokens, None)


def test_one_samples_top_p_record_as_keep():
    """keep=(ids, offsets), the one keyword beyond slime's: one sample's top-p record as slime keeps it (int32 ids
    and response length + 1 offsets, one nucleus per response row) scores as the dense mask a loop builds from it
    (float64 reference, values and gradient), and as log_probs_and_entropy's keep set bit for bit; with the dense
    mask as well it is refused, naming keep."""
    logits, tokens, _, w_lp, w_ent = _global_inputs(seed=6, world_size=1, with_keep=False)
    gen = torch.Generator().manual_seed(7)
    counts = torch.randint(1, 6, (N_ROWS,), generator=gen)
    record_ids = torch.randint(0, V_LOCAL, (int(counts.sum()),), generator=gen, dtype=torch.int32)
    record_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    keep = (record_ids.long(), record_offsets.long())
    dense = torch.zeros(N_ROWS, V_LOCAL, dtype=torch.bool)
    for row in range(N_ROWS):
        dense[row, record_ids[record_offsets[row]:record_offsets[row + 1]].long()] = True

    x = logits.clone().requires_grad_(True)
    log_prob, entropy = ppo_ops.calculate_log_probs_and_entropy(x, tokens, None, with_entropy=True, keep=keep)
    (grad,) = torch.autograd.grad([log_prob, entropy], x, [w_lp[:, None], w_ent])
    ref = reference_log_probs_and_entropy(logits, tokens, entropy="grad", keep_mask=dense, grad_log_probs=w_lp,
                                          grad_entropy=w_ent)
    assert_log_probs_close(log_prob[:, 0].detach(), ref.log_probs)
    assert_entropy_close(entropy.detach(), ref.entropy)
    assert_grad_close(grad, ref.grad, torch.float32)

    y = logits.clone().requires_grad_(True)
    out = ppo_ops.log_probs_and_entropy(y, tokens, entropy="grad", keep=keep)
    (grad_op,) = torch.autograd.grad([out.log_probs, out.entropy], y, [w_lp, w_ent])
    assert torch.equal(log_prob[:, 0], out.log_probs) and torch.equal(entropy, out.entropy)
    assert torch.equal(grad, grad_op)
    with pytest.raises(ValueError, match="calculate_log_probs_and_entropy: .*keep"):
        ppo_ops.calculate_log_probs_and_entropy(logits, tokens, None, log_prob_keep_mask=dense, keep=keep)
