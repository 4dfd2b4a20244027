"""Values and gradients of ppo_ops.log_probs_and_entropy (one rank) against the float64 reference.

Every case runs forward and backward with separate, non-uniform upstream weights for the log-probs and the entropy,
and compares log-probs, entropy and the logits' gradient with tests/reference.py under its named tolerances
(LOG_PROB_TOL, ENTROPY_TOL, GRAD_TOL, GRAD_DTYPE_ULP). bf16/fp16 logits are rounded BEFORE the reference sees them, so
only the library's error is measured. Both backends run every case; the Triton one under the interpreter on CPU, so
shapes stay small (the 151936-vocabulary rows are few).
"""

import pytest
import torch

import ppo_ops
from tests.core_support import (DEVICE, backend_params, make_keep_mask, make_logits, make_row_mask, make_tokens,
                                make_weights, run_op)
from tests.reference import (assert_entropy_close, assert_grad_close, assert_log_probs_close,
                             reference_log_probs_and_entropy)

PADDING_LOGIT = 50.0  # padding columns hold values that would dominate the softmax if any mass leaked into them

with_each_backend = pytest.mark.parametrize("backend", backend_params())


def _check_against_reference_once(backend, shape, *, dtype=torch.float32, entropy="grad", temperature=1.0,
                                  keep=False, rows=False, vocab_size=None, chunk_size=None, seed=0):
    logits = make_logits(shape, dtype, seed)
    if vocab_size is not None:
        logits[..., vocab_size:] = PADDING_LOGIT
    tokens = make_tokens(shape[:-1], vocab_size or shape[-1], seed + 1)
    opts = dict(entropy=entropy, temperature=temperature, vocab_size=vocab_size, chunk_size=chunk_size,
                backend=backend)
    if keep:
        opts["keep_mask"] = make_keep_mask(shape, tokens, seed + 2)
    if rows:
        opts["row_mask"] = make_row_mask(shape[:-1], seed + 3)
        tokens = torch.where(opts["row_mask"], tokens, -100)  # masked rows' tokens are not validated
    w_lp = make_weights(shape[:-1], seed + 4)
    w_ent = make_weights(shape[:-1], seed + 5, low=-1.0, high=1.0)

    got = run_op(logits, tokens, grad_log_probs=w_lp, grad_entropy=w_ent, **opts)
    ref = reference_log_probs_and_entropy(logits, tokens, grad_log_probs=w_lp,
                                          grad_entropy=w_ent if entropy == "grad" else None, **opts)
    assert_log_probs_close(got.log_probs, ref.log_probs)
    if entropy == "none":
        assert got.entropy is None
    else:
        assert_entropy_close(got.entropy, ref.entropy)
    assert_grad_close(got.grad, ref.grad, dtype)


@with_each_backend
@pytest.mark.parametrize("shape", [
    (1, 1),  # one row, one column: log-prob 0, entropy 0, gradient 0
    (3, 423),  # odd vocabulary, not a multiple of any block size
    (2, 3, 257),  # leading dimensions flatten and come back
    (16, 4096),  # a full power-of-2 block per row
    (7, 1),  # single-column rows, several of them
])
def test_shapes(backend, shape):
    _check_against_reference_once(backend, shape)


@with_each_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qwen3_vocab_rows(backend, dtype):
    # The real vocabulary (151936 = 2^7 * 1187): long sums, not a power of 2.
    _check_against_reference_once(backend, (2, 151936), dtype=dtype, temperature=1.3, keep=dtype == torch.bfloat16)


@with_each_backend
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_temperatures(backend, dtype, temperature):
    _check_against_reference_once(backend, (8, 1000), dtype=dtype, temperature=temperature)


@with_each_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_mask(backend, dtype):
    # Every third row's mask drops its target: the target must still be in the normaliser.
    _check_against_reference_once(backend, (6, 777), dtype=dtype, keep=True, temperature=0.7)


@with_each_backend
def test_row_mask(backend):
    _check_against_reference_once(backend, (2, 5, 300), rows=True)


@with_each_backend
@pytest.mark.parametrize("vocab_size", [1, 600, 639])
def test_padded_vocab(backend, vocab_size):
    # Columns >= vocab_size hold PADDING_LOGIT and are also kept by the keep mask: still no mass, zero gradient.
    _check_against_reference_once(backend, (5, 640), vocab_size=vocab_size, keep=True)


@with_each_backend
@pytest.mark.parametrize("entropy", ["none", "value", "grad"])
def test_entropy_modes(backend, entropy):
    _check_against_reference_once(backend, (4, 300), entropy=entropy, keep=True)


@with_each_backend
@pytest.mark.parametrize("chunk_size", [None, 5])
def test_all_options_together(backend, chunk_size):
    _check_against_reference_once(backend, (3, 4, 384), dtype=torch.bfloat16, temperature=0.7, keep=True, rows=True,
                                  vocab_size=350, chunk_size=chunk_size)


@with_each_backend
def test_entropy_output_kinds(backend):
    """entropy="none" returns None; "value" a tensor that needs no gradient; "grad" one that does."""
    logits = make_logits((4, 64)).to(DEVICE).requires_grad_(True)
    tokens = make_tokens((4,), 64).to(DEVICE)
    none = ppo_ops.log_probs_and_entropy(logits, tokens, backend=backend)
    value = ppo_ops.log_probs_and_entropy(logits, tokens, entropy="value", backend=backend)
    grad = ppo_ops.log_probs_and_entropy(logits, tokens, entropy="grad", backend=backend)
    assert none.entropy is None
    assert not value.entropy.requires_grad and value.log_probs.requires_grad
    assert grad.entropy.requires_grad and grad.log_probs.requires_grad
    for out in (none, value, grad):
        assert out.log_probs.dtype == torch.float32 and out.log_probs.shape == (4,)
        assert out.log_probs.device == logits.device
    assert torch.equal(value.entropy, grad.entropy.detach())


@pytest.mark.parametrize("with_keep_mask", [False, True])
def test_reference_matches_float64_autograd(with_keep_mask):
    """The reference's closed-form gradient equals float64 autograd of the textbook formulas (finite logits)."""
    shape, vocab_size, temperature = (5, 37), 30, 0.7
    logits = make_logits(shape, torch.float64).requires_grad_(True)
    tokens = make_tokens(shape[:-1], vocab_size)
    keep = make_keep_mask(shape, tokens) if with_keep_mask else torch.ones(shape, dtype=torch.bool)
    w_lp, w_ent = make_weights(shape[:-1], 4).double(), make_weights(shape[:-1], 5, -1.0, 1.0).double()
    ref = reference_log_probs_and_entropy(logits, tokens, entropy="grad", keep_mask=keep if with_keep_mask else None,
                                          temperature=temperature, vocab_size=vocab_size, grad_log_probs=w_lp,
                                          grad_entropy=w_ent)

    z = logits[:, :vocab_size] / temperature
    kept = keep[:, :vocab_size].clone()
    kept[torch.arange(shape[0]), tokens] = True
    log_probs = z.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(z.masked_fill(~kept, float("-inf")), -1)
    log_softmax = torch.log_softmax(z, -1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    (grad,) = torch.autograd.grad((w_lp * log_probs).sum() + (w_ent * entropy).sum(), logits)
    float64_exact = 1e-12  # both are float64 evaluations of the same formulas, a few ulps apart
    torch.testing.assert_close(ref.log_probs, log_probs.detach(), rtol=0, atol=float64_exact)
    torch.testing.assert_close(ref.entropy, entropy.detach(), rtol=0, atol=float64_exact)
    torch.testing.assert_close(ref.grad, grad, rtol=0, atol=float64_exact)
