"""Invariants of ppo_ops.log_probs_and_entropy on one rank, on both backends.

- Bitwise: every chunk_size gives the same bits (values and gradients); repeated runs give the same bits; int32 and
  int64 tokens, strided logits, stride-0 upstream gradients and validate=False change nothing.
- -inf logits (masked or padded vocabulary): no NaN anywhere, finite log-probs for finite kept targets; rows that are
  -inf except the target; a target whose own logit is -inf (log-prob -inf, gradient finite).
- Empty input (T == 0, and zero-size leading dimensions); a row_mask that drops every row; NaN logits in dropped rows
  (never read: no error, zeros there, the kept rows' bits unchanged).
- The caller's tensors are never modified, except with inplace_grad=True, where the returned gradient IS the logits'
  storage and equals the out-of-place gradient bitwise; another op that saved the logits before the call makes
  autograd raise (both backends), one that saved them after it gets its values, and a leaf gets its gradient.
- The slime-compatible calculate_log_probs_and_entropy agrees with log_probs_and_entropy.
"""

import pytest
import torch

import ppo_ops
from tests.core_support import (DEVICE, backend_params, make_keep_mask, make_logits, make_row_mask, make_tokens,
                                make_weights, run_op, triton_skip_reason)
from tests.reference import (assert_entropy_close, assert_grad_close, assert_log_probs_close,
                             reference_log_probs_and_entropy)

with_each_backend = pytest.mark.parametrize("backend", backend_params())
NEG_INF = float("-inf")


def _full_case(shape=(9, 320), dtype=torch.float32, vocab_size=300, seed=0):
    """Inputs with every option on: keep mask (dropping some targets), row mask, padding, temperature, weights."""
    logits = make_logits(shape, dtype, seed)
    tokens = make_tokens(shape[:-1], vocab_size, seed + 1)
    row_mask = make_row_mask(shape[:-1], seed + 3)
    opts = dict(entropy="grad", keep_mask=make_keep_mask(shape, tokens, seed + 2), row_mask=row_mask,
                temperature=0.7, vocab_size=vocab_size)
    weights = dict(grad_log_probs=make_weights(shape[:-1], seed + 4),
                   grad_entropy=make_weights(shape[:-1], seed + 5, low=-1.0, high=1.0))
    return logits, torch.where(row_mask, tokens, -100), opts, weights


def _assert_results_identical(a, b, what):
    assert torch.equal(a.log_probs, b.log_probs), f"{what}: log_probs differ"
    assert (a.entropy is None) == (b.entropy is None), f"{what}: entropy presence differs"
    if a.entropy is not None:
        assert torch.equal(a.entropy, b.entropy), f"{what}: entropy differs"
    assert torch.equal(a.grad, b.grad), f"{what}: gradient differs"


def _assert_no_nan(result):
    for name, t in zip(result._fields, result):
        if t is not None:
            assert not torch.isnan(t).any(), f"{name} has NaN at {torch.nonzero(torch.isnan(t)).tolist()[:5]}"


# --- bitwise invariances ---

@with_each_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_size_is_bitwise_invisible(backend, dtype):
    logits, tokens, opts, weights = _full_case(dtype=dtype)
    n_rows = logits.shape[0]
    base = run_op(logits, tokens, backend=backend, chunk_size=None, **opts, **weights)
    for chunk_size in (-1, 1, 2, 3, 7, n_rows, n_rows + 5):
        other = run_op(logits, tokens, backend=backend, chunk_size=chunk_size, **opts, **weights)
        _assert_results_identical(base, other, f"chunk_size={chunk_size} vs None")


@with_each_backend
def test_run_to_run_bitwise(backend):
    logits, tokens, opts, weights = _full_case(shape=(2, 4, 512), vocab_size=500)
    first = run_op(logits, tokens, backend=backend, **opts, **weights)
    for _ in range(2):
        _assert_results_identical(first, run_op(logits, tokens, backend=backend, **opts, **weights), "rerun")


@with_each_backend
def test_calls_in_any_order_are_each_their_own(backend):
    """Calls whose options differ (the prepared plans the shell keeps per call signature), interleaved, each give the
    bits the same call gives with nothing kept before it: no option of one call leaks into another's."""
    from ppo_ops.core import shell

    # 4 rows on CPU (3 kept, 1 masked), where each of its 22 calls runs the Triton kernels under the interpreter; 6 on
    # the GPU target.
    logits, tokens, opts, weights = _full_case(shape=(6 if DEVICE.type == "cuda" else 4, 320), vocab_size=300)
    tokens = tokens.clamp(min=0)  # valid ids in every row, so the variant without a row mask may run
    variants = [opts, dict(opts, temperature=1.3), dict(opts, vocab_size=310), dict(opts, entropy="value"),
                dict(opts, keep_mask=None), dict(opts, row_mask=None), dict(opts, validate=False),
                dict(opts, entropy="none")]
    alone = []
    for variant in variants:
        shell._PLANS.clear()
        alone.append(run_op(logits, tokens, backend=backend, **variant, **weights))
    shell._PLANS.clear()
    for i in (0, 1, 0, 2, 3, 1, 4, 5, 6, 7, 0, 3, 7, 2):
        _assert_results_identical(alone[i], run_op(logits, tokens, backend=backend, **variants[i], **weights),
                                  f"variant {i} after others")


@with_each_backend
def test_layout_and_dtype_variants_are_bitwise_invisible(backend):
    """int32 tokens, validate=False, logits with a row stride != V (a column slice), column-major logits and
    expanded (stride-0) upstream gradients all give the same bits as the plain call."""
    logits, tokens, opts, weights = _full_case()
    base = run_op(logits, tokens, backend=backend, **opts, **weights)
    _assert_results_identical(base, run_op(logits, tokens.int(), backend=backend, **opts, **weights), "int32 tokens")
    _assert_results_identical(base, run_op(logits, tokens, backend=backend, validate=False, **opts, **weights),
                              "validate=False")

    wide = torch.zeros(logits.shape[0], logits.shape[1] + 64)
    wide[:, 32:32 + logits.shape[1]] = logits
    x = wide.to(DEVICE).requires_grad_(True)
    strided = x[:, 32:32 + logits.shape[1]]
    assert not strided.is_contiguous()
    dev_opts = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    out = ppo_ops.log_probs_and_entropy(strided, tokens.to(DEVICE), backend=backend, **dev_opts)
    (grad,) = torch.autograd.grad([out.log_probs, out.entropy], strided,
                                  [weights["grad_log_probs"].to(DEVICE), weights["grad_entropy"].to(DEVICE)])
    assert torch.equal(out.log_probs.detach(), base.log_probs) and torch.equal(out.entropy.detach(), base.entropy)
    assert torch.equal(grad, base.grad), "strided logits: gradient differs"

    column_major = logits.t().contiguous().t()  # stride (1, T): run_op's clone keeps the strides
    assert column_major.stride() == (1, logits.shape[0])
    _assert_results_identical(base, run_op(column_major, tokens, backend=backend, **opts, **weights), "column-major")

    same_weight = run_op(logits, tokens, backend=backend,  # built on DEVICE: .to() would make them dense
                         grad_log_probs=torch.full((1,), 0.75, device=DEVICE).expand(9),
                         grad_entropy=torch.full((1,), -0.5, device=DEVICE).expand(9), **opts)
    dense_weight = run_op(logits, tokens, backend=backend, grad_log_probs=torch.full((9,), 0.75),
                          grad_entropy=torch.full((9,), -0.5), **opts)
    _assert_results_identical(same_weight, dense_weight, "stride-0 upstream gradients")


@with_each_backend
@pytest.mark.parametrize("shape,strides", [
    ((5, 1), (1, 5)),  # a column of a transposed [1, 5] tensor: stride(-1) != 1 but only one column
    ((0, 1), (1, 0)),  # what torch makes of an empty [0, 1] product
])
def test_single_column_logits_with_any_stride(backend, shape, strides):
    logits = torch.empty_strided(shape, strides)
    logits.copy_(make_logits(shape))
    assert logits.stride() == strides
    tokens = torch.zeros(shape[:-1], dtype=torch.long)
    weights = dict(grad_log_probs=make_weights(shape[:-1]), grad_entropy=make_weights(shape[:-1], 5))
    got = run_op(logits, tokens, backend=backend, entropy="grad", **weights)
    _assert_results_identical(got, run_op(logits.contiguous(), tokens, backend=backend, entropy="grad", **weights),
                              "strided vs contiguous")


# --- -inf logits ---

@with_each_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_neg_inf_logits(backend, dtype):
    """About a third of the vocabulary at -inf (top-k/top-p style masking) plus padding: finite kept targets give
    finite log-probs, entropies and gradients, matching the reference."""
    logits, tokens, opts, weights = _full_case(dtype=dtype)
    gen = torch.Generator().manual_seed(11)
    masked = torch.rand(logits.shape, generator=gen) < 0.35
    masked[torch.arange(logits.shape[0]), tokens.clamp(min=0)] = False  # targets stay finite
    logits = logits.masked_fill(masked, NEG_INF)
    got = run_op(logits, tokens, backend=backend, **opts, **weights)
    _assert_no_nan(got)
    assert torch.isfinite(got.log_probs).all() and torch.isfinite(got.entropy).all()
    ref = reference_log_probs_and_entropy(logits, tokens, **opts, **weights)
    assert_log_probs_close(got.log_probs, ref.log_probs)
    assert_entropy_close(got.entropy, ref.entropy)
    assert_grad_close(got.grad, ref.grad, dtype)


@with_each_backend
@pytest.mark.parametrize("with_keep_mask", [False, True])
def test_rows_neg_inf_except_target(backend, with_keep_mask):
    """A row whose only finite logit is the target: log-prob 0, entropy 0, gradient 0 (one-hot minus p = 0)."""
    shape = (5, 200)
    tokens = make_tokens(shape[:-1], shape[1])
    logits = torch.full(shape, NEG_INF)
    logits[torch.arange(shape[0]), tokens] = make_logits(shape[:-1])
    opts = dict(entropy="grad", keep_mask=make_keep_mask(shape, tokens) if with_keep_mask else None)
    weights = dict(grad_log_probs=make_weights(shape[:-1]), grad_entropy=make_weights(shape[:-1], 5, -1.0, 1.0))
    got = run_op(logits, tokens, backend=backend, **opts, **weights)
    assert torch.equal(got.log_probs.cpu(), torch.zeros(shape[0]))
    assert torch.equal(got.entropy.cpu(), torch.zeros(shape[0]))
    assert torch.equal(got.grad.cpu(), torch.zeros(shape))


@with_each_backend
def test_target_logit_neg_inf(backend):
    """A target at -inf: log-prob exactly -inf; entropy and gradient finite. A row entirely -inf: no NaN either."""
    shape = (4, 64)
    logits = make_logits(shape)
    tokens = make_tokens(shape[:-1], shape[1])
    logits[0, tokens[0]] = NEG_INF
    logits[1, tokens[1]] = NEG_INF
    logits[3] = NEG_INF  # nothing finite at all
    weights = dict(grad_log_probs=make_weights(shape[:-1]), grad_entropy=make_weights(shape[:-1], 5, -1.0, 1.0))
    got = run_op(logits, tokens, backend=backend, entropy="grad", **weights)
    _assert_no_nan(got)
    assert got.log_probs[0].item() == NEG_INF and got.log_probs[1].item() == NEG_INF
    assert got.log_probs[3].item() == NEG_INF
    assert torch.isfinite(got.entropy).all() and torch.isfinite(got.grad).all()
    ref = reference_log_probs_and_entropy(logits, tokens, entropy="grad", **weights)
    assert_log_probs_close(got.log_probs, ref.log_probs)
    assert_entropy_close(got.entropy[:3], ref.entropy[:3])  # row 3 has no distribution: only "finite" is asked
    assert_grad_close(got.grad[:3], ref.grad[:3], torch.float32)
    # No mass at all: the log-prob is -inf whatever the logits do, so no gradient reaches them, not even at the
    # target (one-hot minus q would give the upstream gradient there).
    assert torch.equal(got.grad[3].cpu(), torch.zeros(shape[1]))


# --- empty input and fully masked rows ---

@with_each_backend
@pytest.mark.parametrize("lead_shape", [(0,), (2, 0), (0, 3)])
def test_empty_input(backend, lead_shape):
    n_vocab = 48
    logits = make_logits(lead_shape + (n_vocab,))
    tokens = torch.zeros(lead_shape, dtype=torch.long)
    weights = dict(grad_log_probs=torch.ones(lead_shape), grad_entropy=torch.ones(lead_shape))
    got = run_op(logits, tokens, backend=backend, entropy="grad", keep_mask=torch.ones(logits.shape, dtype=torch.bool),
                 row_mask=torch.ones(lead_shape, dtype=torch.bool), chunk_size=2, **weights)
    assert got.log_probs.shape == lead_shape and got.log_probs.dtype == torch.float32
    assert got.entropy.shape == lead_shape and got.entropy.dtype == torch.float32
    assert got.grad.shape == logits.shape


@with_each_backend
def test_row_mask_all_false(backend):
    """Every row dropped: zeros everywhere, and the (invalid) tokens of dropped rows are not checked."""
    shape = (3, 5, 100)
    logits = make_logits(shape)
    tokens = torch.full(shape[:-1], -100)
    tokens[0, 0] = 10 ** 9
    got = run_op(logits, tokens, backend=backend, entropy="grad", row_mask=torch.zeros(shape[:-1], dtype=torch.bool),
                 keep_mask=torch.ones(shape, dtype=torch.bool), grad_log_probs=make_weights(shape[:-1]),
                 grad_entropy=make_weights(shape[:-1], 5))
    assert torch.equal(got.log_probs.cpu(), torch.zeros(shape[:-1]))
    assert torch.equal(got.entropy.cpu(), torch.zeros(shape[:-1]))
    assert torch.equal(got.grad.cpu(), torch.zeros(shape))


@with_each_backend
def test_row_mask_never_reads_dropped_rows(backend):
    """NaN logits in dropped rows (validate on): no error, zeros for those rows, and the kept rows' bits unchanged."""
    logits, tokens, opts, weights = _full_case()
    expected = run_op(logits, tokens, backend=backend, **opts, **weights)
    poisoned = logits.clone()
    poisoned[~opts["row_mask"]] = float("nan")
    got = run_op(poisoned, tokens, backend=backend, **opts, **weights)
    _assert_results_identical(got, expected, "NaN logits in dropped rows")
    dropped = ~opts["row_mask"].to(got.grad.device)
    assert bool((got.log_probs[dropped] == 0).all()) and bool((got.grad[dropped] == 0).all())


# --- caller's tensors and inplace_grad ---

@with_each_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_are_not_modified(backend, dtype):
    logits, tokens, opts, weights = _full_case(dtype=dtype)
    inputs = dict(logits=logits.to(DEVICE).requires_grad_(True), tokens=tokens.to(DEVICE),
                  keep_mask=opts["keep_mask"].to(DEVICE), row_mask=opts["row_mask"].to(DEVICE),
                  w_lp=weights["grad_log_probs"].to(DEVICE), w_ent=weights["grad_entropy"].to(DEVICE))
    before = {name: t.detach().clone() for name, t in inputs.items()}
    out = ppo_ops.log_probs_and_entropy(
        inputs["logits"], inputs["tokens"], entropy="grad", keep_mask=inputs["keep_mask"],
        row_mask=inputs["row_mask"], temperature=0.7, vocab_size=opts["vocab_size"], chunk_size=3, backend=backend)
    torch.autograd.backward([out.log_probs, out.entropy], [inputs["w_lp"], inputs["w_ent"]])
    for name, t in inputs.items():
        assert torch.equal(t.detach(), before[name]), f"{name} was modified"
    assert inputs["logits"].grad.data_ptr() != inputs["logits"].data_ptr()


@with_each_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_inplace_grad_aliases_logits(backend, dtype):
    """inplace_grad=True: the gradient handed back lives in the logits' storage and equals the out-of-place one."""
    logits, tokens, opts, weights = _full_case(dtype=dtype)
    expected = run_op(logits, tokens, backend=backend, **opts, **weights)

    leaf = logits.to(DEVICE).requires_grad_(True)
    x = leaf * 1  # a non-leaf, as logits coming out of an lm head are: autograd hands its gradient on as is
    dev_opts = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    out = ppo_ops.log_probs_and_entropy(x, tokens.to(DEVICE), backend=backend, inplace_grad=True, **dev_opts)
    assert torch.equal(out.log_probs.detach(), expected.log_probs)
    assert torch.equal(out.entropy.detach(), expected.entropy)
    (grad,) = torch.autograd.grad([out.log_probs, out.entropy], x,
                                  [weights["grad_log_probs"].to(DEVICE), weights["grad_entropy"].to(DEVICE)])
    assert grad.data_ptr() == x.data_ptr(), "inplace_grad=True must return the logits' own storage as the gradient"
    assert torch.equal(grad, expected.grad)
    assert torch.equal(x.detach(), expected.grad), "the logits' storage must now hold the gradient"
    assert torch.equal(leaf.detach(), logits.to(DEVICE)), "only the op's input is overwritten, not its source"


# Other uses of the same logits, each with its own saved copy of them: a plain square term and a z-loss.
_OTHER_USES = {
    "square": lambda x: (x ** 2).sum(),
    "z_loss": lambda x: (torch.logsumexp(x, dim=-1) ** 2).mean(),
}


def _float64_grad(logits, tokens, other, entropy_weight=0.5):
    """Gradient of sum(log p[target]) + entropy_weight * sum(entropy) + other(logits), in float64 autograd."""
    x = logits.double().requires_grad_(True)
    log_p = torch.log_softmax(x, dim=-1)
    loss = log_p.gather(1, tokens[:, None]).sum() - entropy_weight * (log_p.exp() * log_p).sum() + other(x)
    (grad,) = torch.autograd.grad(loss, x)
    return grad


@with_each_backend
@pytest.mark.parametrize("other", list(_OTHER_USES))
def test_inplace_grad_refuses_an_earlier_saved_use(backend, other):
    """An op that saved the logits before this call would read the gradient in their place: autograd must refuse
    (the version counter records the backward's write on every backend, raw-pointer Triton stores included)."""
    logits = make_logits((6, 96)).to(DEVICE)
    tokens = make_tokens((6,), 96).to(DEVICE)
    leaf = logits.clone().requires_grad_(True)
    x = leaf * 1
    other_loss = _OTHER_USES[other](x)
    out = ppo_ops.log_probs_and_entropy(x, tokens, entropy="grad", inplace_grad=True, backend=backend)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.log_probs.sum() + 0.5 * out.entropy.sum() + other_loss).backward()


@with_each_backend
@pytest.mark.parametrize("other", list(_OTHER_USES))
def test_inplace_grad_with_a_later_saved_use_is_exact(backend, other):
    """An op that saved the logits after this call runs its backward first (autograd goes newest first), while they
    still hold their values: the combined gradient is exact against float64."""
    logits = make_logits((6, 96)).to(DEVICE)
    tokens = make_tokens((6,), 96).to(DEVICE)
    leaf = logits.clone().requires_grad_(True)
    x = leaf * 1
    out = ppo_ops.log_probs_and_entropy(x, tokens, entropy="grad", inplace_grad=True, backend=backend)
    other_loss = _OTHER_USES[other](x)
    (out.log_probs.sum() + 0.5 * out.entropy.sum() + other_loss).backward()
    expected = _float64_grad(logits.cpu(), tokens.cpu(), _OTHER_USES[other])
    assert_grad_close(leaf.grad.cpu(), expected, torch.float32, "gradient through the op and the later use")


@with_each_backend
def test_inplace_grad_on_a_leaf(backend):
    """The documented leaf case: a leaf's own storage takes the gradient, which becomes its .grad, exact against
    float64; the leaf's values are gone (it now holds the gradient)."""
    logits = make_logits((6, 96)).to(DEVICE)
    tokens = make_tokens((6,), 96).to(DEVICE)
    leaf = logits.clone().requires_grad_(True)
    out = ppo_ops.log_probs_and_entropy(leaf, tokens, entropy="grad", inplace_grad=True, backend=backend)
    (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
    expected = _float64_grad(logits.cpu(), tokens.cpu(), lambda x: 0.0)
    assert_grad_close(leaf.grad.cpu(), expected, torch.float32, "leaf gradient")
    assert torch.equal(leaf.detach(), leaf.grad), "the leaf's storage must hold its gradient"


# --- the two public APIs ---

@pytest.mark.parametrize("n_rows", [0, 1, 6])
@pytest.mark.parametrize("with_entropy,with_entropy_grad,with_keep,chunk_size", [
    pytest.param(False, True, False, -1, id="slime_defaults"),
    pytest.param(True, True, True, 2, id="entropy_grad_keep_mask_chunked"),
    pytest.param(True, False, False, 4, id="entropy_without_grad"),
])
def test_calculate_api_matches(n_rows, with_entropy, with_entropy_grad, with_keep, chunk_size):
    shape = (n_rows, 96)
    logits = make_logits(shape).to(DEVICE)
    tokens = make_tokens((n_rows,), shape[1]).to(DEVICE)
    keep = make_keep_mask(shape, tokens.cpu()).to(DEVICE) if with_keep else None
    w_lp, w_ent = make_weights((n_rows,)).to(DEVICE), make_weights((n_rows,), 5, -1.0, 1.0).to(DEVICE)

    x_slime = logits.clone().requires_grad_(True)
    log_prob, entropy = ppo_ops.calculate_log_probs_and_entropy(
        x_slime, tokens, None, with_entropy=with_entropy, chunk_size=chunk_size, log_prob_keep_mask=keep,
        with_entropy_grad=with_entropy_grad)
    mode = "grad" if with_entropy and with_entropy_grad else ("value" if with_entropy else "none")
    x_new = logits.clone().requires_grad_(True)
    new = ppo_ops.log_probs_and_entropy(x_new, tokens, entropy=mode, keep_mask=keep, chunk_size=chunk_size)

    assert log_prob.dtype == torch.float32
    assert log_prob.shape == ((0,) if n_rows == 0 else (n_rows, 1))
    assert torch.equal(log_prob.reshape(-1), new.log_probs)
    if not with_entropy:
        assert entropy is None
    else:
        assert entropy.shape == (n_rows,) and entropy.dtype == torch.float32
        assert entropy.requires_grad == with_entropy_grad
        assert torch.equal(entropy.detach(), new.entropy.detach())

    grad_entropy = with_entropy and with_entropy_grad
    (g_slime,) = torch.autograd.grad([log_prob] + ([entropy] if grad_entropy else []), x_slime,
                                     [w_lp.reshape(log_prob.shape)] + ([w_ent] if grad_entropy else []))
    (g_new,) = torch.autograd.grad([new.log_probs] + ([new.entropy] if grad_entropy else []), x_new,
                                   [w_lp] + ([w_ent] if grad_entropy else []))
    assert torch.equal(g_slime, g_new)


def test_backends_implement_the_contract():
    """Both backends are instances of the typed contract (ppo_ops/core/contracts.py) that the Function calls."""
    from ppo_ops.core import contracts
    from ppo_ops.logits import torch_backend

    backends = [torch_backend.BACKEND]
    if triton_skip_reason("cpu") is None:
        from ppo_ops.logits import triton_backend
        backends.append(triton_backend.BACKEND)
    for backend in backends:
        assert isinstance(backend, contracts.Backend), type(backend).__name__
    assert [b.name for b in backends] == ["torch", "triton"][:len(backends)]
