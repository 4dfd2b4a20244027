"""Bad input to ppo_ops.log_probs_and_entropy / calculate_log_probs_and_entropy: a clear error, raised before any
collective, of the right type, whose message names the offending argument.

BAD_INPUTS lists every bad input as (changes to a valid call, expected exception, argument named). Each runs on one
rank for both backends, and again on a 2-rank gloo group whose torch.distributed collectives are replaced by a
tripwire that lets through only the fixed-size header exchange (exactly one per call; a sanity case shows the tripwire
does fire for a valid call), so "raised together, before any collective that could mismatch" is checked for real.
Double backward (create_graph through the op, and a second backward after inplace_grad) raises RuntimeError.
"""

import pytest
import torch
import torch.distributed as dist

import ppo_ops
from tests.core_support import (COLLECTIVES, DEVICE, CollectiveIssued, backend_params, make_logits, make_tokens,
                                run_gloo, triton_skip_reason, tripwire)

N_ROWS, V_LOCAL = 4, 16


def _with(t, index, value):
    t = t.clone()
    t.view(-1)[index] = value
    return t


# id: (builder(logits, tokens, v_global) -> keyword changes to a valid call, exception type, argument in the message)
BAD_INPUTS = {
    "token_equal_to_v_global": (lambda x, t, v: dict(tokens=_with(t, 1, v)), ValueError, "tokens"),
    "token_far_above_v_global": (lambda x, t, v: dict(tokens=_with(t, 0, 10 ** 9)), ValueError, "tokens"),
    "token_negative": (lambda x, t, v: dict(tokens=_with(t, 2, -1)), ValueError, "tokens"),
    "token_ignore_index_in_kept_row": (lambda x, t, v: dict(tokens=_with(t, 3, -100),
                                                            row_mask=torch.ones(N_ROWS, dtype=torch.bool)),
                                       ValueError, "tokens"),
    # A target in the padding has no mass (log-prob -inf): rejected like any id outside the true vocabulary.
    "token_in_padding": (lambda x, t, v: dict(tokens=_with(t, 0, v - 1), vocab_size=v - 1), ValueError, "tokens"),
    "tokens_float": (lambda x, t, v: dict(tokens=t.float()), TypeError, "tokens"),
    "tokens_bool": (lambda x, t, v: dict(tokens=t > 3), TypeError, "tokens"),
    "tokens_too_long": (lambda x, t, v: dict(tokens=torch.cat([t, t[:1]])), ValueError, "tokens"),
    "tokens_too_short": (lambda x, t, v: dict(tokens=t[:-1]), ValueError, "tokens"),
    "tokens_extra_dim": (lambda x, t, v: dict(tokens=t[:, None]), ValueError, "tokens"),
    "logits_int64": (lambda x, t, v: dict(logits=x.long()), TypeError, "logits"),
    "logits_int32": (lambda x, t, v: dict(logits=x.int()), TypeError, "logits"),
    "logits_float64": (lambda x, t, v: dict(logits=x.double()), TypeError, "logits"),
    "keep_mask_wrong_shape": (lambda x, t, v: dict(keep_mask=torch.ones(N_ROWS, V_LOCAL + 1, dtype=torch.bool)),
                              ValueError, "keep_mask"),
    "keep_mask_row_shape": (lambda x, t, v: dict(keep_mask=torch.ones(N_ROWS, dtype=torch.bool)),
                            ValueError, "keep_mask"),
    "keep_mask_uint8": (lambda x, t, v: dict(keep_mask=torch.ones(N_ROWS, V_LOCAL, dtype=torch.uint8)),
                        TypeError, "keep_mask"),
    "keep_mask_float": (lambda x, t, v: dict(keep_mask=torch.ones(N_ROWS, V_LOCAL)), TypeError, "keep_mask"),
    "row_mask_wrong_shape": (lambda x, t, v: dict(row_mask=torch.ones(N_ROWS + 1, dtype=torch.bool)),
                             ValueError, "row_mask"),
    "row_mask_logits_shape": (lambda x, t, v: dict(row_mask=torch.ones(N_ROWS, V_LOCAL, dtype=torch.bool)),
                              ValueError, "row_mask"),
    "row_mask_int": (lambda x, t, v: dict(row_mask=torch.ones(N_ROWS, dtype=torch.int64)), TypeError, "row_mask"),
    "chunk_size_zero": (lambda x, t, v: dict(chunk_size=0), ValueError, "chunk_size"),
    "chunk_size_minus_two": (lambda x, t, v: dict(chunk_size=-2), ValueError, "chunk_size"),
    "chunk_size_very_negative": (lambda x, t, v: dict(chunk_size=-1000), ValueError, "chunk_size"),
    "temperature_zero": (lambda x, t, v: dict(temperature=0.0), ValueError, "temperature"),
    "temperature_negative": (lambda x, t, v: dict(temperature=-1.0), ValueError, "temperature"),
    "temperature_nan": (lambda x, t, v: dict(temperature=float("nan")), ValueError, "temperature"),
    "temperature_inf": (lambda x, t, v: dict(temperature=float("inf")), ValueError, "temperature"),
    "temperature_minus_inf": (lambda x, t, v: dict(temperature=float("-inf")), ValueError, "temperature"),
    "vocab_size_above_v_global": (lambda x, t, v: dict(vocab_size=v + 1), ValueError, "vocab_size"),
    "vocab_size_zero": (lambda x, t, v: dict(vocab_size=0), ValueError, "vocab_size"),
    "entropy_unknown": (lambda x, t, v: dict(entropy="full"), ValueError, "entropy"),
    "entropy_bool": (lambda x, t, v: dict(entropy=True), ValueError, "entropy"),
    "backend_unknown": (lambda x, t, v: dict(backend="cuda"), ValueError, "backend"),
    # 1 / temperature overflows fp32: the temperature is blamed, not the logits.
    "temperature_reciprocal_overflows": (lambda x, t, v: dict(temperature=1e-39), ValueError, "temperature"),
    "temperature_string": (lambda x, t, v: dict(temperature="0.7"), TypeError, "temperature"),
    "temperature_two_element_tensor": (lambda x, t, v: dict(temperature=torch.tensor([0.5, 0.7])), ValueError,
                                       "temperature"),
    "vocab_size_float": (lambda x, t, v: dict(vocab_size=float(v)), TypeError, "vocab_size"),
    "vocab_size_float_tensor": (lambda x, t, v: dict(vocab_size=torch.tensor(float(v))), TypeError, "vocab_size"),
    "chunk_size_float": (lambda x, t, v: dict(chunk_size=2.0), TypeError, "chunk_size"),
    "validate_not_bool": (lambda x, t, v: dict(validate="yes"), TypeError, "validate"),
    "logits_and_tokens_on_meta": (lambda x, t, v: dict(logits=x.to("meta"), tokens=t.to("meta")), ValueError,
                                  "logits"),
    # inplace_grad on logits whose rows share storage: every row would write the same gradient elements.
    "inplace_grad_expanded_logits": (lambda x, t, v: dict(logits=x[:1].expand(N_ROWS, -1), inplace_grad=True),
                                     ValueError, "inplace_grad"),
    "inplace_grad_overlapping_logits": (lambda x, t, v: dict(logits=torch.as_strided(x.clone(), (N_ROWS, V_LOCAL),
                                                                                     (V_LOCAL // 2, 1)),
                                                             inplace_grad=True), ValueError, "inplace_grad"),
}


def _valid_call(v_global, device):
    logits = make_logits((N_ROWS, V_LOCAL))
    tokens = make_tokens((N_ROWS,), v_global)
    return logits.to(device), tokens.to(device)


def _call_bad(case_id, backend, device, v_global, tp_group=None):
    """Calls log_probs_and_entropy with case `case_id`; returns (raised exception or None, expected type, name)."""
    build, exc_type, name = BAD_INPUTS[case_id]
    logits, tokens = _valid_call(v_global, device)
    kwargs = dict(logits=logits, tokens=tokens, entropy="grad", backend=backend, tp_group=tp_group)
    kwargs.update({k: (v.to(device) if isinstance(v, torch.Tensor) and not v.is_meta else v)
                   for k, v in build(logits, tokens, v_global).items()})
    try:
        ppo_ops.log_probs_and_entropy(kwargs.pop("logits"), kwargs.pop("tokens"), **kwargs)
    except Exception as exc:  # noqa: BLE001 - the caller checks its type
        return exc, exc_type, name
    return None, exc_type, name


def _check_raised(case_id, exc, exc_type, name):
    assert exc is not None, f"{case_id}: no error raised, expected {exc_type.__name__} naming {name!r}"
    assert type(exc) is exc_type, f"{case_id}: raised {type(exc).__name__}: {exc}; expected {exc_type.__name__}"
    assert name in str(exc), f"{case_id}: message does not name {name!r}: {exc}"


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case_id", sorted(BAD_INPUTS))
def test_bad_input_single_rank(case_id, backend):
    _check_raised(case_id, *_call_bad(case_id, backend, DEVICE, V_LOCAL))


# id: (builder(tokens) -> keyword changes to a valid slime-style call, exception type, argument in the message)
BAD_CALCULATE_INPUTS = {
    "tokens_out_of_range": (lambda t: dict(tokens=_with(t, 0, V_LOCAL)), ValueError, "tokens"),
    "tokens_float": (lambda t: dict(tokens=t.float()), TypeError, "tokens"),
    "keep_mask_wrong_shape": (lambda t: dict(log_prob_keep_mask=torch.ones(N_ROWS, 3, dtype=torch.bool)),
                              ValueError, "keep_mask"),
    "keep_mask_not_bool": (lambda t: dict(log_prob_keep_mask=torch.ones(N_ROWS, V_LOCAL)), TypeError, "keep_mask"),
    # slime reads every chunk_size <= 0 as "no chunking" (tests/test_slime_drop_in.py); a non-integer is still bad.
    "chunk_size_float": (lambda t: dict(chunk_size=2.5), TypeError, "chunk_size"),
}


@pytest.mark.parametrize("case_id", sorted(BAD_CALCULATE_INPUTS))
def test_bad_input_calculate_api(case_id):
    changes, exc_type, name = BAD_CALCULATE_INPUTS[case_id]
    logits, tokens = _valid_call(V_LOCAL, DEVICE)
    kwargs = dict(with_entropy=True)
    kwargs.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in changes(tokens).items()})
    tokens = kwargs.pop("tokens", tokens)
    with pytest.raises(Exception) as info:
        ppo_ops.calculate_log_probs_and_entropy(logits, tokens, None, **kwargs)
    _check_raised(case_id, info.value, exc_type, name)


@pytest.mark.parametrize("backend", backend_params())
def test_nan_and_pos_inf_logits_raise(backend):
    for bad in (float("nan"), float("inf")):
        logits, tokens = _valid_call(V_LOCAL, DEVICE)
        logits[1, 3] = bad
        with pytest.raises(ValueError, match="logits"):
            ppo_ops.log_probs_and_entropy(logits, tokens, entropy="value", backend=backend)


# --- double backward ---

@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("entropy", ["none", "grad"])
def test_double_backward_raises(backend, entropy):
    logits, tokens = _valid_call(V_LOCAL, DEVICE)
    x = logits.requires_grad_(True)
    out = ppo_ops.log_probs_and_entropy(x, tokens, entropy=entropy, backend=backend)
    loss = out.log_probs.sum() + (out.entropy.sum() if entropy == "grad" else 0)
    with pytest.raises(RuntimeError):
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        grad.pow(2).sum().backward()


@pytest.mark.parametrize("backend", backend_params())
def test_second_backward_after_inplace_grad_raises(backend):
    logits, tokens = _valid_call(V_LOCAL, DEVICE)
    x = logits.requires_grad_(True) * 1
    out = ppo_ops.log_probs_and_entropy(x, tokens, entropy="grad", inplace_grad=True, backend=backend)
    loss = out.log_probs.sum() + out.entropy.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace_grad"):
        loss.backward()


@pytest.mark.parametrize("backend", backend_params())
def test_inplace_grad_views_as_the_readme_says(backend):
    """inplace_grad=True takes a view sliced along the first dim (logits[0, :-1] of [1, S, V]) and writes the
    gradient into the caller's logits; it refuses the shifted view logits[:, :-1] of [B > 1, S, V] (its rows do not
    flatten without a copy) with an error naming inplace_grad."""
    gen = torch.Generator().manual_seed(5)
    full = torch.randn((2, 6, V_LOCAL), generator=gen).to(DEVICE)
    tokens = torch.randint(0, V_LOCAL, (2, 5), generator=gen).to(DEVICE)
    one = full[:1].clone()
    leaf = one[0, :-1].clone().requires_grad_(True)
    ppo_ops.log_probs_and_entropy(leaf, tokens[0], backend=backend).log_probs.sum().backward()
    view = one[0, :-1].requires_grad_(True)  # a view of the caller's [1, S, V] logits
    ppo_ops.log_probs_and_entropy(view, tokens[0], inplace_grad=True, backend=backend).log_probs.sum().backward()
    assert torch.equal(one[0, :-1], leaf.grad), "the gradient was not written into the caller's logits"
    with pytest.raises(ValueError, match="inplace_grad"):
        ppo_ops.log_probs_and_entropy(full[:, :-1], tokens, inplace_grad=True, backend=backend)


# --- before any collective that could mismatch (gloo, 2 ranks) ---



def _errors_before_collectives_worker(rank, world_size, backends):
    v_global = V_LOCAL * world_size
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    headers, failures = [], []
    try:
        for name, original in originals.items():
            setattr(dist, name, tripwire(name, original, headers))
        # Sanity: a valid call at TP=2 does issue a collective after the header, so the tripwire can catch one.
        logits, tokens = _valid_call(v_global, "cpu")
        try:
            ppo_ops.log_probs_and_entropy(logits, tokens, tp_group=dist.group.WORLD)
            failures.append("valid TP=2 call issued no collective: the tripwire cannot work")
        except CollectiveIssued:
            pass
        for backend in backends:
            for case_id in sorted(BAD_INPUTS):
                del headers[:]
                exc, exc_type, name = _call_bad(case_id, backend, "cpu", v_global, tp_group=dist.group.WORLD)
                try:
                    _check_raised(case_id, exc, exc_type, name)
                    assert len(headers) == 1, f"{case_id}: {len(headers)} header exchanges, expected exactly 1"
                except AssertionError as err:
                    failures.append(f"rank {rank}, backend {backend}: {err}")
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    if failures:
        raise AssertionError("\n".join(failures))


def test_bad_input_raises_before_any_collective():
    """At TP=2 (validate=True) every bad input raises after the one fixed-size header exchange and before any other
    collective, on both ranks, with the argument named."""
    backends = ["torch"] + ([] if triton_skip_reason("cpu") else ["triton"])
    run_gloo(2, _errors_before_collectives_worker, backends, timeout_s=30, deadline_s=240)


def test_bad_tp_group_type():
    logits, tokens = _valid_call(V_LOCAL, DEVICE)
    for bogus in ("bogus", 0, object()):
        with pytest.raises(TypeError, match="tp_group must be a torch.distributed.ProcessGroup"):
            ppo_ops.log_probs_and_entropy(logits, tokens, tp_group=bogus)
