"""Float64 reference of ppo_ops' core semantics, and the tolerances a result is held to against it.

`reference_log_probs_and_entropy` takes the same arguments as `ppo_ops.log_probs_and_entropy`, applied to the GLOBAL
logits (what a single rank sees at TP=1). It computes with explicit float64 formulas, no autograd, so -inf logits never
meet 0 * inf:

    z        = logits / temperature, columns >= vocab_size removed (padding: no mass, zero gradient)
    log_prob = z[t] - logsumexp_{c in keep ∪ {t}} z_c        (the target is kept even where keep_mask drops it)
    entropy  = -Σ_c p_c log p_c,  p = softmax(z) over every valid column (keep_mask does not apply)
    dL/dz_c  = g_lp * (1[c == t] - q_c) + g_ent * p_c * (E_p[z] - z_c),  q = softmax of z over keep ∪ {t}
    dL/dlogits = dL/dz / temperature

Rows whose row_mask is False give 0 everywhere (their tokens may be anything, e.g. -100). -inf logits carry no mass:
a target whose logit is -inf has log-prob -inf (gradient still finite: 1 - q at the target); a row without any finite
kept logit gets a zero log-prob gradient, and a row without any finite logit entropy 0 and a zero entropy gradient.

Tensor-parallel tests build global inputs, give rank r the columns `shard_vocab(x, r, world_size)` and compare each
rank's gradient with `shard_vocab(reference.grad, r, world_size)`.

For bf16/fp16 logits, pass the reference the SAME rounded logits (it upcasts to float64), so that a comparison
measures the library's error only; `assert_grad_close` rounds the reference gradient to the logits' dtype first.
"""

from typing import NamedTuple, Optional

import torch

# --- tolerances (the library's accuracy targets) ---
LOG_PROB_TOL = 2e-6  # fp32 math on O(10) logits; applied as LOG_PROB_TOL * max(1, |reference|)
ENTROPY_TOL = 2e-5  # absolute; fp32 sums over up to 151936 columns (pairwise fold keeps the error ~log2(V) ulps)
GRAD_TOL = 1e-6  # absolute, fp32 gradient; entries are bounded by |upstream weights| / temperature = O(1)
# One ulp of the returned gradient's dtype, relative (significand bits 24, 8, 11): the fp32 result and the float64
# reference may round to neighbouring representable values.
GRAD_DTYPE_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


class Reference(NamedTuple):
    log_probs: torch.Tensor  # float64, logits.shape[:-1]
    entropy: Optional[torch.Tensor]  # float64, logits.shape[:-1]; None when entropy == "none"
    grad: Optional[torch.Tensor]  # float64, logits.shape; None unless an upstream weight was given


def reference_log_probs_and_entropy(
    logits,
    tokens,
    *,
    entropy="none",
    keep_mask=None,
    temperature=1.0,
    row_mask=None,
    vocab_size=None,
    grad_log_probs=None,
    grad_entropy=None,
    # Accepted so a test can pass the library's keyword arguments unchanged; they do not change the math.
    tp_group=None,
    chunk_size=None,
    inplace_grad=False,
    backend="auto",
    validate=True,
) -> Reference:
    """Float64 log-prob/entropy (and gradient) of GLOBAL `logits` [..., V]; see the module docstring.

    grad_log_probs / grad_entropy: upstream weights of shape logits.shape[:-1]; the returned `grad` is
    d(Σ grad_log_probs * log_probs + Σ grad_entropy * entropy) / d logits (either may be None = zero).
    """
    del tp_group, chunk_size, inplace_grad, backend, validate
    assert entropy in ("none", "value", "grad"), entropy
    lead_shape, n_vocab = logits.shape[:-1], logits.shape[-1]
    x = logits.detach().to(device="cpu", dtype=torch.float64).reshape(-1, n_vocab)
    n_rows = x.shape[0]
    rows_on = _flat(row_mask, n_rows, torch.ones(n_rows, dtype=torch.bool))
    safe_tokens = torch.where(rows_on, _flat(tokens, n_rows, None).long(), 0).clamp(0, max(n_vocab - 1, 0))

    valid = torch.arange(n_vocab) < (n_vocab if vocab_size is None else vocab_size)
    z = torch.where(valid, x / temperature, float("-inf"))
    # Every quantity below is invariant to a per-row shift; shifting by the row max keeps float64's precision for
    # logits near fp32's range (unshifted, log Σ e^z would lose log V next to |z| ~ 3e38).
    row_max = z.amax(-1, keepdim=True) if n_vocab > 0 else torch.zeros(n_rows, 1, dtype=torch.float64)
    z = z - torch.where(torch.isfinite(row_max), row_max, 0.0)
    target = torch.zeros_like(z, dtype=torch.bool)
    if n_vocab > 0:
        target.scatter_(1, safe_tokens[:, None], True)
    kept = valid.expand_as(z)  # no keep mask: the log-prob is normalised over the whole valid vocabulary
    if keep_mask is not None:
        kept = valid & (target | keep_mask.detach().cpu().reshape(-1, n_vocab))

    lse = torch.logsumexp(z, dim=-1)
    lse_kept = torch.logsumexp(torch.where(kept, z, float("-inf")), dim=-1)
    z_target = torch.where(target, z, 0.0).sum(-1)  # -inf when the target's logit is -inf (or padding)
    log_probs = torch.where(z_target == float("-inf"), float("-inf"), z_target - lse_kept)

    finite_lse = torch.isfinite(lse)
    p = torch.where(finite_lse[:, None], torch.exp(z - torch.where(finite_lse, lse, 0.0)[:, None]), 0.0)
    z_or_zero = torch.where(p > 0, z, 0.0)  # p == 0 where z == -inf: keep 0 * inf out of the sums
    mean_z = (p * z_or_zero).sum(-1)
    entropy_value = torch.where(finite_lse, lse - mean_z, 0.0)

    grad = None
    if grad_log_probs is not None or grad_entropy is not None:
        finite_kept = torch.isfinite(lse_kept)
        q = torch.where(kept & finite_kept[:, None],
                        torch.exp(z - torch.where(finite_kept, lse_kept, 0.0)[:, None]), 0.0)
        grad_z = torch.zeros_like(z)
        if grad_log_probs is not None:
            # No finite kept logit: the log-prob is -inf whatever the logits do, so its gradient is 0.
            g = torch.where(finite_kept, _flat(grad_log_probs, n_rows, None).double(), 0.0)
            grad_z += g[:, None] * (target.double() - q)
        if grad_entropy is not None:
            g = _flat(grad_entropy, n_rows, None).double()
            grad_z += g[:, None] * p * (mean_z[:, None] - z_or_zero)
        grad_z = torch.where(valid & rows_on[:, None], grad_z / temperature, 0.0)
        grad = grad_z.reshape(logits.shape)

    log_probs = torch.where(rows_on, log_probs, 0.0).reshape(lead_shape)
    entropy_out = None if entropy == "none" else torch.where(rows_on, entropy_value, 0.0).reshape(lead_shape)
    return Reference(log_probs, entropy_out, grad)


def _flat(t, n_rows, default):
    if t is None:
        return default
    return t.detach().cpu().reshape(n_rows)


# --- tensor-parallel helpers ---

def shard_vocab(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of the last (vocabulary) dimension, as a fresh contiguous tensor."""
    n_vocab = x.shape[-1]
    assert n_vocab % world_size == 0, f"global vocab {n_vocab} must split evenly over {world_size} ranks"
    width = n_vocab // world_size
    return x[..., rank * width:(rank + 1) * width].clone()


# --- comparisons ---

def assert_log_probs_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "log_probs"):
    """fp32 result vs float64 reference: same -inf positions, else |error| <= LOG_PROB_TOL * max(1, |expected|)."""
    _check_fp32(actual, expected, what)
    a, e = actual.detach().cpu().double(), expected.double()
    assert not torch.isnan(a).any(), f"{what}: NaN at {torch.nonzero(torch.isnan(a)).tolist()[:5]}"
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e) and torch.equal(a[inf_a], e[inf_e]), \
        f"{what}: infinities differ: got {a[inf_a | inf_e].tolist()[:5]}, expected {e[inf_a | inf_e].tolist()[:5]}"
    _check_within(a[~inf_e], e[~inf_e], LOG_PROB_TOL * e[~inf_e].abs().clamp(min=1.0), what)


def assert_entropy_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "entropy"):
    """fp32 result vs float64 reference: finite and |error| <= ENTROPY_TOL."""
    _check_fp32(actual, expected, what)
    a = actual.detach().cpu().double()
    assert torch.isfinite(a).all(), f"{what}: non-finite at {torch.nonzero(~torch.isfinite(a)).tolist()[:5]}"
    _check_within(a, expected.double(), torch.full_like(a, ENTROPY_TOL), what)


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "grad"):
    """Gradient in the logits' `dtype` vs the float64 reference rounded to `dtype`: finite, and
    |error| <= GRAD_TOL + GRAD_DTYPE_ULP[dtype] * |expected|."""
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected the logits' dtype {dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    a = actual.detach().cpu().double()
    assert torch.isfinite(a).all(), f"{what}: non-finite at {torch.nonzero(~torch.isfinite(a)).tolist()[:5]}"
    e = expected.to(dtype).double()
    _check_within(a, e, GRAD_TOL + GRAD_DTYPE_ULP[dtype] * e.abs(), what)


def _check_fp32(actual, expected, what):
    assert actual.dtype == torch.float32, f"{what}: dtype {actual.dtype}, expected torch.float32"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"


def _check_within(actual, expected, bound, what):
    err = (actual - expected).abs()
    bad = err > bound
    if bad.any():
        i = int(torch.argmax((err - bound).flatten()))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} entries out of tolerance; worst at flat index {i}: "
            f"got {actual.flatten()[i].item():.9g}, expected {expected.flatten()[i].item():.9g}, "
            f"error {err.flatten()[i].item():.3g} > bound {bound.flatten()[i].item():.3g}")
