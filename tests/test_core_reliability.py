"""Reliability of ppo_ops.log_probs_and_entropy: collective failure, one host sync, explicit TP, extreme values.

One rank, in process (both backends; Triton under the interpreter on CPU, compiled on a GPU):
- finite logits up to fp32's range and the smallest temperature `validate` accepts match the float64 reference (the
  Triton kernels once gave NaN entropies once the scaled row max passed ~2e31);
- NumPy scalars and one-element tensors are accepted as numbers and give the same bits as Python numbers;
- the value checks read the device exactly once per call with validate=True and never with validate=False (counted at
  `agreement.read_to_host`, the one function that reads device values; on CUDA also with torch's sync debug mode, at
  TP=1 and, with two GPUs, at TP=2 over NCCL: these run only compiled, without TRITON_INTERPRET);
- with two GPUs, every public function on tensors of a GPU that is not the current one gives the bits it gives with
  that GPU current (Triton launches on the current device).

Gloo groups of 2 and 3 ranks (one spawn per size running every case; a 30 s collective timeout and a join deadline,
so a hang fails the test instead of stalling CI):
- a bad argument, an out-of-range token, NaN logits, a different row count or temperature on ONE rank (or two) makes
  every rank raise the same error type naming the rank(s) and the argument, with values (not bits) in the message;
- tp_group=None inside an initialised job is one rank (the full-vocabulary result, bitwise);
- validate=False gives the same bits as validate=True, issues no host read, and a rank with T = 0 still takes part in
  the collective: with every rank at T = 0 the call returns, with T = 0 on one rank only the others fail by the
  group's timeout instead of waiting forever;
- one host read per call at TP > 1 with validate=True.
"""

import datetime
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ppo_ops
from ppo_ops.core import agreement, checks
from ppo_ops.runtime import ranks as runtime_ranks
from tests.core_support import (DEVICE, CaseFailures, backend_params, make_logits, make_tokens, make_weights,
                                run_gloo, run_op, triton_skip_reason)
from tests.reference import (assert_entropy_close, assert_grad_close, assert_log_probs_close,
                             reference_log_probs_and_entropy, shard_vocab)

FLT_MAX = torch.finfo(torch.float32).max
BF16_MAX = torch.finfo(torch.bfloat16).max
GLOO_TIMEOUT_S = 30  # a collective that waits this long fails the rank (a hang becomes an error)
DEADLINE_S = 240  # every rank of a spawn done by then, or the test fails as a hang (normal runs take ~20 s)
SHORT_TIMEOUT_S = 5  # the subgroup of the one case that must end by a timeout (T = 0 on one rank, validate=False)


# --- extreme finite values vs the float64 reference (one rank) ---

def _uniform(shape, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand(shape, generator=gen, dtype=torch.float64)


def _extreme_case(name):
    """(logits, tokens, temperature) of a named case; 3 rows x 64 columns (8 segments of 8)."""
    shape = (3, 64)
    tokens = make_tokens(shape[:1], shape[1])
    if name == "fp32_max_everywhere":
        return torch.full(shape, FLT_MAX), tokens, 1.0
    if name == "near_fp32_max":  # every row max far above 2e31
        return _uniform(shape, 0.0, FLT_MAX, 0).float(), tokens, 1.0
    if name == "full_fp32_range":  # shifts between lanes and segments overflow fp32; targets at the row max
        logits = _uniform(shape, -FLT_MAX, FLT_MAX, 1).float()
        return logits, logits.argmax(-1), 1.0
    if name == "segments_at_both_ends":  # segment 0 near -fp32 max, the rest near +fp32 max: merge shifts overflow
        logits = _uniform(shape, 0.9 * FLT_MAX, FLT_MAX, 4)
        logits[:, :8] = -logits[:, :8]
        logits = logits.float()
        return logits, logits.argmax(-1), 1.0
    if name == "smallest_temperature":  # 1 / temperature is fp32's max: scaled logits up to it
        return _uniform(shape, 0.0, 1.0, 2).float(), tokens, checks.MIN_TEMPERATURE
    if name == "tiny_power_of_two_temperature_bf16":  # 2^-127: the gradient scaled back by it is exact in bf16
        return _uniform(shape, 0.0, 1.0, 3).to(torch.bfloat16), tokens, 2.0 ** -127
    if name == "bf16_max_everywhere":
        return torch.full(shape, BF16_MAX, dtype=torch.bfloat16), tokens, 1.0
    raise KeyError(name)


EXTREME_CASES = ["fp32_max_everywhere", "near_fp32_max", "full_fp32_range", "segments_at_both_ends",
                 "smallest_temperature", "tiny_power_of_two_temperature_bf16", "bf16_max_everywhere"]
# Upstream weights small enough that |d loss / d logits| <= |weights| / temperature stays below fp32's max at the
# smallest temperature (a larger true gradient is not representable: inf would be its correct rounding).
EXTREME_WEIGHT = 0.45


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case", EXTREME_CASES)
def test_extreme_finite_logits_match_float64(backend, case):
    logits, tokens, temperature = _extreme_case(case)
    weights = dict(grad_log_probs=make_weights(tokens.shape, 4, EXTREME_WEIGHT / 2, EXTREME_WEIGHT),
                   grad_entropy=make_weights(tokens.shape, 5, -EXTREME_WEIGHT / 2, EXTREME_WEIGHT / 2))
    got = run_op(logits, tokens, backend=backend, entropy="grad", temperature=temperature, **weights)
    ref = reference_log_probs_and_entropy(logits, tokens, entropy="grad", temperature=temperature, **weights)
    assert_log_probs_close(got.log_probs, ref.log_probs)
    assert_entropy_close(got.entropy, ref.entropy)
    # The gradient carries 1 / temperature (up to fp32's max): compare it per unit of scaled logit, d loss / d z.
    assert torch.isfinite(got.grad).all(), "non-finite gradient"
    assert_grad_close((got.grad.double().cpu() * temperature).to(logits.dtype), ref.grad * temperature, logits.dtype)


# --- numbers: Python, NumPy, one-element tensors ---

@pytest.mark.parametrize("backend", backend_params())
def test_numpy_scalars_and_tensors_are_numbers(backend):
    logits = make_logits((4, 32))
    tokens = make_tokens((4,), 30)
    plain = run_op(logits, tokens, backend=backend, entropy="value", temperature=float(np.float32(0.7)),
                   vocab_size=30, chunk_size=2)
    for temperature, vocab_size, chunk_size in (
        (np.float32(0.7), np.int64(30), np.int32(2)),
        (torch.tensor(0.7, dtype=torch.float32), torch.tensor(30), torch.tensor(2)),
        (np.float64(np.float32(0.7)), 30, 2),
    ):
        got = run_op(logits, tokens, backend=backend, entropy="value", temperature=temperature,
                     vocab_size=vocab_size, chunk_size=chunk_size)
        assert torch.equal(got.log_probs, plain.log_probs) and torch.equal(got.entropy, plain.entropy), \
            (type(temperature), type(vocab_size))


def test_smallest_temperature_is_accepted_and_half_of_it_is_not():
    logits, tokens = make_logits((2, 16)), make_tokens((2,), 16)
    ppo_ops.log_probs_and_entropy(logits.to(DEVICE) * 0, tokens.to(DEVICE), temperature=checks.MIN_TEMPERATURE)
    with pytest.raises(ValueError, match="temperature must be >= .*fit in float32"):
        ppo_ops.log_probs_and_entropy(logits.to(DEVICE), tokens.to(DEVICE), temperature=checks.MIN_TEMPERATURE / 2)


# --- host syncs (one rank) ---

class _ReadCounter:
    """Counts calls of agreement.read_to_host, the one function that reads device values."""

    def __init__(self, monkeypatch=None):
        self.calls = 0
        original = agreement.read_to_host

        def counted(t):
            self.calls += 1
            return original(t)

        self._original, self._counted = original, counted

    def __enter__(self):
        agreement.read_to_host = self._counted
        return self

    def __exit__(self, *exc):
        agreement.read_to_host = self._original


def _forward_backward(logits, tokens, **opts):
    x = logits.detach().clone().requires_grad_(True)
    out = ppo_ops.log_probs_and_entropy(x, tokens, entropy="grad", **opts)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    return out


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("validate,reads", [(True, 1), (False, 0)])
def test_host_reads_per_call_single_rank(backend, validate, reads):
    logits, tokens = make_logits((5, 32)).to(DEVICE), make_tokens((5,), 32).to(DEVICE)
    row_mask = torch.tensor([True, False, True, True, False], device=DEVICE)
    with _ReadCounter() as counter:
        _forward_backward(logits, tokens, backend=backend, validate=validate, row_mask=row_mask)
    assert counter.calls == reads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA synchronisations: needs a GPU")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="counts the compiled kernels' syncs; the interpreter copies device tensors to the host")
@pytest.mark.parametrize("validate,syncs", [(True, 1), (False, 0)])
def test_cuda_synchronisations_per_call(validate, syncs):
    """The Triton backend (the CUDA default) on a GPU: torch's sync debug mode flags every synchronising call."""
    logits, tokens = make_logits((64, 4096)).cuda(), make_tokens((64,), 4096).cuda()
    _forward_backward(logits, tokens, validate=validate)  # compile and warm up outside the count
    torch.cuda.synchronize()
    assert _count_cuda_syncs(lambda: _forward_backward(logits, tokens, validate=validate)) == syncs


def _count_cuda_syncs(fn) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return len([w for w in caught if "called a synchronizing CUDA operation" in str(w.message)])


def _nccl_sync_worker(rank, world_size, port, out_dir):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    with runtime_ranks.destroy_on_error():
        v_global = 4096 * world_size
        logits = shard_vocab(make_logits((64, v_global)), rank, world_size).cuda()
        tokens = make_tokens((64,), v_global).cuda()
        counts = {}
        for validate in (True, False):
            call = lambda: _forward_backward(logits, tokens, tp_group=dist.group.WORLD, validate=validate)  # noqa
            call()  # compile and warm up outside the count
            torch.cuda.synchronize()
            counts[validate] = _count_cuda_syncs(call)
        torch.save(counts, f"{out_dir}/rank{rank}.pt")
    runtime_ranks.leave()


# Two NCCL ranks: it runs in the _gpu2 target (conftest places it by world size); on CPU it is deselected, since the
# interpreter copies device tensors to the host and there are no CUDA syncs to count.
@pytest.mark.device("cuda")
@pytest.mark.world_size(2)
def test_cuda_synchronisations_per_call_tp2(tmp_path):
    """TP=2 over NCCL: one synchronising call per forward + backward with validate=True (the header table's read),
    none with validate=False, on every rank."""
    torch.multiprocessing.spawn(_nccl_sync_worker, args=(2, runtime_ranks.free_port(), str(tmp_path)), nprocs=2,
                                join=True)
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == {True: 1, False: 0}, f"rank {rank}"


# --- tensors on a GPU other than the current one (two GPUs: the _gpu2 target) ---

def _every_op_on(device):
    """Forward and backward of the four public functions on `device`, their outputs and gradients on the host."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 2048, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(300, 256, generator=gen).to(torch.bfloat16)
    weight = (0.05 * torch.randn(2048, 256, generator=gen)).to(torch.bfloat16)
    tokens = torch.randint(0, 2048, (300,), generator=gen)
    out = {}
    x = logits.to(device).requires_grad_(True)
    r = ppo_ops.log_probs_and_entropy(x, tokens[:64].to(device), entropy="grad")
    (r.log_probs.sum() + r.entropy.sum()).backward()
    out["logits op"] = (r.log_probs, r.entropy, x.grad)
    x = logits.to(device).requires_grad_(True)
    lp, ent = ppo_ops.calculate_log_probs_and_entropy(x, tokens[:64].to(device), None, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    out["slime drop-in"] = (lp, ent, x.grad)
    h, w = hidden.to(device).requires_grad_(True), weight.to(device).requires_grad_(True)
    r = ppo_ops.linear_log_probs_and_entropy(h, w, tokens.to(device), entropy="grad")
    (r.log_probs.sum() + r.entropy.sum()).backward()
    out["fused head"] = (r.log_probs, r.entropy, h.grad, w.grad)
    h, w = hidden.to(device).requires_grad_(True), weight.to(device).requires_grad_(True)
    loss, r = ppo_ops.linear_token_loss(h, w, tokens.to(device), lambda lp, ent, rows: -(lp + 0.01 * ent),
                                        entropy="grad")
    loss.backward()
    out["token loss"] = (loss, r.log_probs, r.entropy, h.grad, w.grad)
    return {name: [t.detach().cpu() for t in ts] for name, ts in out.items()}


@pytest.mark.device("cuda")
@pytest.mark.world_size(2)
def test_tensors_on_a_gpu_that_is_not_current():
    """Triton launches on the current device and stream: every function makes its tensors' device current, so
    inputs on cuda:1 while cuda:0 is current give the bits they give with cuda:1 current."""
    results = {}
    for current in (1, 0):
        with torch.cuda.device(current):
            results[current] = _every_op_on("cuda:1")
    for name, want in results[1].items():
        for i, (got, expected) in enumerate(zip(results[0][name], want)):
            assert torch.equal(got, expected), f"{name}: output {i} differs with cuda:0 current"


# --- gloo: every rank fails together ---

V_LOCAL, N_ROWS = 16, 4


def _inputs(world_size, seed=0):
    v_global = V_LOCAL * world_size
    return make_logits((N_ROWS, v_global), seed=seed), make_tokens((N_ROWS,), v_global, seed + 1)


def _raises_on_every_rank(exc_type, *needles, absent=()):
    """A case body: calls fn and checks its error (type, and every needle in the message)."""
    def check(fn):
        try:
            fn()
        except exc_type as exc:
            message = str(exc)
            missing = [n for n in needles if n not in message]
            present = [a for a in absent if a in message]
            assert not missing and not present, f"message lacks {missing} / has {present}: {message}"
            return
        except Exception as exc:  # noqa: BLE001 - a wrong type is a failure, reported with its message
            raise AssertionError(f"raised {type(exc).__name__}: {exc}; expected {exc_type.__name__}") from exc
        raise AssertionError(f"no error raised, expected {exc_type.__name__}")
    return check


def _call_on_rank(rank, world_size, *, logits=None, tokens=None, **opts):
    g_logits, g_tokens = _inputs(world_size)
    x = shard_vocab(g_logits, rank, world_size) if logits is None else logits
    t = g_tokens if tokens is None else tokens
    opts.setdefault("tp_group", dist.group.WORLD)
    opts.setdefault("entropy", "grad")
    return ppo_ops.log_probs_and_entropy(x, t, **opts)


def _collective_error_cases(rank, world_size, backends):
    """(name, body) pairs; each body runs on every rank and must not hang."""
    last = world_size - 1
    v_global = V_LOCAL * world_size
    g_logits, g_tokens = _inputs(world_size)
    x = shard_vocab(g_logits, rank, world_size)
    cases = []

    bad_tokens = g_tokens.clone()
    bad_tokens[0] = v_global
    cases.append(("token_out_of_range_on_last_rank", lambda: _raises_on_every_rank(
        ValueError, "tokens", f"rank {last}", f"[0, {v_global})", str(v_global))(
        lambda: _call_on_rank(rank, world_size, tokens=bad_tokens if rank == last else None))))

    wrong_keep = torch.ones(N_ROWS, V_LOCAL + 1, dtype=torch.bool)
    cases.append(("keep_mask_wrong_shape_on_rank_1", lambda: _raises_on_every_rank(
        ValueError, "keep_mask", "rank 1")(
        lambda: _call_on_rank(rank, world_size, keep_mask=wrong_keep if rank == 1 else None))))

    cases.append(("tokens_float_on_rank_0", lambda: _raises_on_every_rank(TypeError, "tokens", "rank 0")(
        lambda: _call_on_rank(rank, world_size, tokens=g_tokens.float() if rank == 0 else None))))

    for backend in backends:
        nan_logits = x.clone()
        nan_logits[2, 3] = float("nan")
        cases.append((f"nan_logits_on_rank_0_{backend}", lambda b=backend, n=nan_logits: _raises_on_every_rank(
            ValueError, "logits", "rank 0", "NaN")(
            lambda: _call_on_rank(rank, world_size, logits=n if rank == 0 else None, backend=b))))

    cases.append(("different_temperatures", lambda: _raises_on_every_rank(
        ValueError, "temperature", "1.0", "0.7", absent=("1065353216",))(
        lambda: _call_on_rank(rank, world_size, temperature=0.7 if rank == last else 1.0))))

    cases.append(("zero_rows_on_rank_0_validate", lambda: _raises_on_every_rank(
        ValueError, "number of rows T", f"{[0] + [N_ROWS] * last}")(
        lambda: _call_on_rank(rank, world_size, logits=x[:0] if rank == 0 else None,
                              tokens=g_tokens[:0] if rank == 0 else None))))

    cases.append(("temperature_overflow_on_rank_0", lambda: _raises_on_every_rank(
        ValueError, "temperature", "rank 0")(
        lambda: _call_on_rank(rank, world_size, temperature=1e-39 if rank == 0 else 1.0))))

    if world_size >= 3:
        cases.append(("keep_mask_wrong_on_two_ranks", lambda: _raises_on_every_rank(
            ValueError, "keep_mask", "ranks 1, 2")(
            lambda: _call_on_rank(rank, world_size, keep_mask=wrong_keep if rank >= 1 else None))))
    return cases


def _check_tp_group_none_is_one_rank(rank, world_size, expected):
    """tp_group=None inside an initialised job: log_probs_and_entropy computes the full-vocabulary logits on this rank
    alone (bitwise TP=1); slime's drop-in takes the default group, as slime's function does, so a shard gives the
    full-vocabulary values (tests/test_slime_drop_in.py has that API's own cases)."""
    g_logits, g_tokens = _inputs(world_size)
    got = run_op(g_logits, g_tokens, device="cpu", entropy="grad", tp_group=None,
                 grad_log_probs=make_weights((N_ROWS,)))
    assert torch.equal(got.log_probs, expected.log_probs) and torch.equal(got.entropy, expected.entropy)
    assert torch.equal(got.grad, expected.grad)
    log_prob, _ = ppo_ops.calculate_log_probs_and_entropy(shard_vocab(g_logits, rank, world_size), g_tokens, None,
                                                          with_entropy=True)
    assert_log_probs_close(log_prob[:, 0].detach(), expected.log_probs)


def _check_validate_false(rank, world_size):
    """Same bits as validate=True, no host read; every rank at T = 0 returns (the collective still runs)."""
    g_logits, g_tokens = _inputs(world_size)
    x = shard_vocab(g_logits, rank, world_size)
    with _ReadCounter() as on:
        checked = _forward_backward(x, g_tokens, tp_group=dist.group.WORLD, validate=True)
    with _ReadCounter() as off:
        fast = _forward_backward(x, g_tokens, tp_group=dist.group.WORLD, validate=False)
    with _ReadCounter() as single:
        _forward_backward(g_logits, g_tokens, tp_group=None, validate=True)
    assert (on.calls, off.calls, single.calls) == (1, 0, 1), (on.calls, off.calls, single.calls)
    assert torch.equal(checked.log_probs, fast.log_probs) and torch.equal(checked.entropy, fast.entropy)
    for validate in (False, True):
        out = _call_on_rank(rank, world_size, logits=x[:0], tokens=g_tokens[:0], validate=validate)
        assert out.log_probs.shape == (0,) and out.entropy.shape == (0,)


def _check_zero_rows_on_one_rank_without_validate(rank, world_size, group):
    """validate=False, T = 0 on rank 0 only: rank 0's partials are empty and it returns; the others must not wait
    forever: the group's (short) timeout turns their wait into an error."""
    g_logits, g_tokens = _inputs(world_size)
    x = shard_vocab(g_logits, rank, world_size)
    if rank == 0:
        out = ppo_ops.log_probs_and_entropy(x[:0], g_tokens[:0], tp_group=group, validate=False)
        assert out.log_probs.shape == (0,)
        return
    with pytest.raises(RuntimeError):
        ppo_ops.log_probs_and_entropy(x, g_tokens, tp_group=group, validate=False)


def _reliability_worker(rank, world_size, backends, expected_tp1):
    failures = CaseFailures(rank)
    for name, body in _collective_error_cases(rank, world_size, backends):
        failures.run(name, body)
    failures.run("tp_group_none_is_one_rank", _check_tp_group_none_is_one_rank, rank, world_size, expected_tp1)
    failures.run("validate_false", _check_validate_false, rank, world_size)
    # Last, on a group of its own: the wait it ends by timeout leaves that group unusable.
    short = dist.new_group(list(range(world_size)), timeout=datetime.timedelta(seconds=SHORT_TIMEOUT_S))
    failures.run("zero_rows_on_one_rank_validate_false", _check_zero_rows_on_one_rank_without_validate, rank,
                 world_size, short)
    failures.raise_if_any()


@pytest.mark.parametrize("world_size", [2, 3])
def test_failure_is_collective_and_never_hangs(world_size):
    backends = ["torch"] + ([] if triton_skip_reason("cpu") else ["triton"])
    g_logits, g_tokens = _inputs(world_size)
    expected = run_op(g_logits, g_tokens, device="cpu", entropy="grad", grad_log_probs=make_weights((N_ROWS,)))
    run_gloo(world_size, _reliability_worker, backends, expected, timeout_s=GLOO_TIMEOUT_S, deadline_s=DEADLINE_S)
