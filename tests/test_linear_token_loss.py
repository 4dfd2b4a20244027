"""ppo_ops.linear_token_loss: the fused LM head with a per-token loss's gradient formed inside its forward.

What is checked, per backend ("torch": the segment-GEMM backend over the logits op's PyTorch passes; "triton": over
its Triton passes, under TRITON_INTERPRET=1 on CPU with an fp32 matmul standing in for cuBLAS, compiled with cuBLAS
on CUDA):
- the loss, log-probs, entropies, dX and dW against float64 (autograd through the same closure on float64 logits),
  within the bounds of tests/linear_support.py with the closure's float64 gradients as the upstream weights, for
  simple closures and for the PPO closure of the bench (clipped surrogate, entropy bonus, k3 KL);
- log-probs and entropies bit for bit those of linear_log_probs_and_entropy where the token loss keeps fp16
  probabilities (the same one-GEMM forward), else of the logits op on the chunks' own logits;
- the upstream scalar scales dX and dW (one rounding), row_mask (dropped rows: zeros, never passed to the loss),
  rows given to the loss are indices into the flattened tokens, a second backward raises, no_grad keeps nothing;
- one gradient asked (dX or dW) gives the bits of both asked; a loss without the log-probs gives exact zeros;
- errors: a non-callable token_loss, a loss of the wrong shape or dtype, non-finite values with validate=True
  (and none with validate=False), NaN / +inf logits on the one-GEMM blocks; on 2 gloo ranks a bad token_loss or
  token on ONE rank makes both raise, naming the rank and the argument; at TP = 2 and 4 a caller's loss that raises,
  returns the wrong dtype or shape, or NaN on some ranks (one block, a middle block, reduce_dx=False, every rank)
  makes every rank raise the same error naming the faulty ranks, each keeping its own exception as the cause;
- TP = 2 and 4 (gloo on CPU, NCCL on GPUs): loss, log-probs, entropies and the concatenated dW bitwise equal to TP = 1,
  dX within its bound, reduce_dx=False giving per-rank contributions; on CUDA also the compiled kernels at Qwen3's
  shapes with the shipped PPO loss at TP = 2 and 4, every rank on one GPU (gloo), so a one-GPU runner checks TP > 1.
"""

import os

import pytest
import torch
import torch.distributed as dist

import ppo_ops
from ppo_ops.core import agreement as _agreement
from ppo_ops.core import layout as _layout
from ppo_ops.core import scale as _scale
from ppo_ops.lm_head import gemms as _gemms
from ppo_ops.lm_head import paths as _paths
from tests.core_support import backend_params, make_weights, triton_skip_reason
from tests.linear_support import (HIDDEN, QWEN3_TEMPERATURE, QWEN3_TOKENS, QWEN3_TP_SHAPES, QWEN3_TP_SIZES,
                                  QWEN3_VOCAB, UNIT_ROUNDOFF, V_GLOBAL, assert_tp_invariant, assert_within, bounds,
                                  inputs, qwen3_inputs, qwen3_kept_rows, tp_record)
from tests.ranks import DEVICE, results_by_tp, world_size_param

# The loss is a sum of per-row terms: its fp32 value errs by the terms' errors (each the term's gradient times the
# log-prob / entropy error bound) plus the fp32 additions of the sum (a few ulps of sum |term| per add).
LOSS_SUM_ULPS = 4.0
U32 = UNIT_ROUNDOFF[torch.float32]

CLIP_LOW, CLIP_HIGH, ENTROPY_COEF, KL_COEF = 0.2, 0.28, 0.01, 0.05


def _ppo(n_rows, seed):
    """A PPO closure over [n_rows] constants (the bench's form, in torch ops: runs on fp32 and float64)."""
    gen = torch.Generator().manual_seed(seed)
    old = -3.0 + torch.randn(n_rows, generator=gen)
    ref = -3.0 + torch.randn(n_rows, generator=gen)
    adv = torch.randn(n_rows, generator=gen)
    wts = torch.full((n_rows,), 1.0 / n_rows)

    def loss(log_probs, entropy, rows):
        rows = rows.cpu()
        dev = log_probs.device
        o, r, a, w = (t[rows].to(dev) for t in (old, ref, adv, wts))
        ratio = torch.exp(log_probs - o)
        surrogate = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
        d = r - log_probs
        out = surrogate + KL_COEF * (torch.exp(d) - d - 1)
        if entropy is not None:
            out = out - ENTROPY_COEF * entropy
        return out * w

    return loss


def _weighted(n_rows, seed):
    """sum_r a_r * log_prob_r + b_r * entropy_r: upstream weights a, b exactly."""
    a = make_weights((n_rows,), seed)
    b = make_weights((n_rows,), seed + 1, low=-1.0, high=1.0)

    def loss(log_probs, entropy, rows):
        rows = rows.cpu()
        out = a[rows].to(log_probs.device) * log_probs
        if entropy is not None:
            out = out + b[rows].to(log_probs.device) * entropy
        return out

    return loss


def _shipped(name):
    """The losses of ppo_ops/token_losses.py, on [n_rows] constants (they take fp32 inputs only)."""

    def make(n_rows, seed):
        from ppo_ops import token_losses

        gen = torch.Generator().manual_seed(seed)
        old = -3.0 + torch.randn(n_rows, generator=gen)
        ref = -3.0 + torch.randn(n_rows, generator=gen)
        mask = torch.rand(n_rows, generator=gen) < 0.8
        seq_ids = torch.arange(n_rows) // 4  # sequences of 4 tokens
        if name == "policy":  # DAPO's clip-higher, dual clip, entropy bonus, k3 KL, token mean over a loss mask
            loss = token_losses.policy_loss(old, torch.randn(n_rows, generator=gen), clip_low=0.2, clip_high=0.28,
                                            dual_clip=3.0, entropy_coef=0.01, kl_coef=0.05, ref_log_probs=ref,
                                            kl_type="k3", loss_mask=mask, normalization="token_mean")
        elif name == "policy_seq_mean":  # k2 KL, per-sequence means
            loss = token_losses.policy_loss(old, torch.randn(n_rows, generator=gen), kl_coef=0.1, ref_log_probs=ref,
                                            kl_type="k2", loss_mask=mask, normalization="seq_mean", seq_ids=seq_ids)
        else:  # GRPO's defaults over groups of 2 sequences
            n_seq = int(seq_ids.max()) + 1
            n_seq += n_seq % 2
            loss = token_losses.grpo_loss(old, torch.randn(n_seq, generator=gen), seq_ids, group_size=2,
                                          ref_log_probs=ref, loss_mask=mask, entropy_coef=0.02)
        return _on_device(loss)

    return make


def _on_device(loss):
    """A TokenLoss keeps its constants on their device: move them to the op's (the rows arrive there)."""
    import dataclasses

    fields = {f.name: getattr(loss, f.name) for f in dataclasses.fields(loss)}
    moved = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
    return type(loss)(**moved)


LOSSES = {"weighted": _weighted, "ppo": _ppo, "policy": _shipped("policy"),
          "policy_seq_mean": _shipped("policy_seq_mean"), "grpo": _shipped("grpo")}


def _run(hidden, weight, tokens, token_loss, device=DEVICE, scale=None, **opts):
    """(loss, log_probs, entropy, dX, dW) on CPU, from leaf copies; `scale` multiplies the loss before backward."""
    h = hidden.detach().to(device).clone().requires_grad_(True)
    w = weight.detach().to(device).clone().requires_grad_(True)
    opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    loss, out = ppo_ops.linear_token_loss(h, w, tokens.to(device), token_loss, **opts)
    dx, dw = torch.autograd.grad(loss if scale is None else loss * scale, (h, w))
    ent = None if out.entropy is None else out.entropy.cpu()
    return loss.detach().cpu(), out.log_probs.cpu(), ent, dx.cpu(), dw.cpu()


def _float64(hidden, weight, tokens, token_loss, *, temperature, vocab_size, row_mask, entropy):
    """(loss, d loss / d log_prob, d loss / d entropy) in float64 over the kept rows of the flattened call."""
    x, w = hidden.double().reshape(-1, hidden.shape[-1]), weight.double()
    z = (x @ w.T) / temperature
    if vocab_size is not None:
        z[:, vocab_size:] = float("-inf")
    lsm = torch.log_softmax(z, dim=-1)
    t = tokens.reshape(-1)
    rows = torch.arange(t.numel()) if row_mask is None else torch.nonzero(row_mask.reshape(-1)).squeeze(1)
    lp = lsm[rows, t[rows]].detach().requires_grad_(True)
    p = lsm[rows].exp()
    ent = (-(p * torch.where(p > 0, lsm[rows], 0.0)).sum(-1)).detach().requires_grad_(entropy == "grad")
    if hasattr(token_loss, "n_tokens"):  # a shipped TokenLoss takes fp32 only: the float64 values, rounded once
        rows_d = rows.to(DEVICE)
        value = token_loss(lp.float().to(DEVICE), ent.float().to(DEVICE) if entropy != "none" else None,
                           rows_d).double().cpu()
    else:
        value = token_loss(lp, ent if entropy != "none" else None, rows)
    inputs_ = [lp] + ([ent] if entropy == "grad" else [])
    grads = torch.autograd.grad(value.sum(), inputs_, allow_unused=True)
    n = t.numel()
    g_lp = torch.zeros(n, dtype=torch.float64).index_copy_(0, rows, grads[0])
    g_ent = None
    if entropy == "grad" and grads[1] is not None:
        g_ent = torch.zeros(n, dtype=torch.float64).index_copy_(0, rows, grads[1])
    terms = value.detach()
    return terms.sum(), terms.abs().sum(), g_lp, g_ent


def _keeps_probs(backend, hidden, weight):
    """Whether the call takes the one-GEMM blocks that keep fp16 probabilities (lm_head/prob_dlogits.py)."""
    if backend != "triton" or triton_skip_reason(DEVICE) is not None:
        return False
    h = hidden.reshape(-1, hidden.shape[-1]).to(DEVICE)
    return _paths.one_gemm_applies("triton", h, weight.to(DEVICE))


def _check_vs_float64_once(backend, dtype, loss_name, temperature, vocab_size, masked, entropy="grad", lead=(3, 7),
                           v=V_GLOBAL, h=HIDDEN, **extra):
    """The op against float64 (values, loss, dX, dW within their bounds); `extra`: more options of the call.
    Returns the op's (loss, log_probs, entropy, dX, dW)."""
    hidden, weight, tokens = inputs(lead, dtype, seed=91, v=v, h=h)
    if vocab_size is not None:
        tokens = tokens.clamp(max=vocab_size - 1)
    n = tokens.numel()
    row_mask = None
    if masked:
        row_mask = torch.rand(lead, generator=torch.Generator().manual_seed(92)) < 0.6
        row_mask.view(-1)[0], row_mask.view(-1)[-1] = True, False
        tokens = torch.where(row_mask, tokens, -100)
    token_loss = LOSSES[loss_name](n, 93)
    opts = dict(entropy=entropy, temperature=temperature, vocab_size=vocab_size, backend=backend, **extra)
    if masked:
        opts["row_mask"] = row_mask
    loss, lp, ent, dx, dw = _run(hidden, weight, tokens, token_loss, **opts)
    ref_loss, ref_abs, g_lp, g_ent = _float64(hidden, weight, tokens, token_loss, temperature=temperature,
                                              vocab_size=vocab_size, row_mask=row_mask, entropy=entropy)
    half = backend == "triton" or dtype != torch.float32  # the segment-GEMM backend rounds dlogits to the input dtype
    b = bounds(hidden, weight, tokens, g_lp.float().reshape(lead),
               None if g_ent is None else g_ent.float().reshape(lead), temperature=temperature,
               vocab_size=vocab_size, row_mask=row_mask, dl_roundoff=UNIT_ROUNDOFF[dtype] if half else 0.0,
               prob_storage=_keeps_probs(backend, hidden, weight))
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert lp.dtype == torch.float32 and dx.dtype == dtype and dw.dtype == dtype
    assert_within("log_probs", lp, b["log_probs"])
    if entropy != "none":
        assert_within("entropy", ent, b["entropy"])
    else:
        assert ent is None
    assert_within("dX", dx, b["dx"])
    assert_within("dW", dw, b["dw"])
    lp_tol, ent_tol = b["log_probs"][1].reshape(-1), b["entropy"][1].reshape(-1)
    loss_tol = ((g_lp.abs() * lp_tol).sum() + (0 if g_ent is None else (g_ent.abs() * ent_tol).sum())
                + LOSS_SUM_ULPS * n * U32 * ref_abs)
    assert abs(loss.double() - ref_loss) <= loss_tol, f"loss {loss.item()} vs {ref_loss.item()} (bound {loss_tol})"
    if masked:
        assert bool((lp[~row_mask] == 0).all() and (dx[~row_mask] == 0).all())
    if vocab_size is not None:
        assert bool((dw[vocab_size:] == 0).all()), "padding rows of the weight got a gradient"
    return loss, lp, ent, dx, dw


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("dtype,loss_name,temperature,vocab_size,masked,entropy", [
    (torch.float32, "weighted", 1.0, None, False, "grad"),  # upstream weights exactly: the general op's case
    (torch.bfloat16, "ppo", 1.0, None, False, "grad"),  # the production dtype and loss
    (torch.bfloat16, "ppo", 0.8, 230, True, "grad"),  # temperature, padding in the last segment, row mask
    (torch.float16, "weighted", 1.2, None, False, "value"),  # entropy without gradient
    (torch.float32, "ppo", 1.0, None, True, "none"),  # no entropy: the closure gets None
])
def test_values_and_gradients_vs_float64(backend, dtype, loss_name, temperature, vocab_size, masked, entropy):
    _check_vs_float64_once(backend, dtype, loss_name, temperature, vocab_size, masked, entropy)


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("loss_name,dtype,masked", [
    ("policy", torch.bfloat16, False),  # PPO with every term on
    ("policy_seq_mean", torch.float32, True),  # per-sequence normalisation, row mask
    ("grpo", torch.bfloat16, True),  # GRPO's group-normalised advantages
])
def test_shipped_losses_vs_float64(backend, loss_name, dtype, masked):
    pytest.importorskip("ppo_ops.token_losses")
    _check_vs_float64_once(backend, dtype, loss_name, 1.0, None, masked, entropy="grad", lead=(16,))


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("blocks", ["many"], indirect=True)
def test_many_blocks_and_dw_groups_vs_float64(backend, blocks):
    """Rows over several loss blocks and dW groups (on CPU: chunk blocks of 8 rows, dW every 16; one-GEMM blocks of
    16), the last block partial."""
    shape = _paths.block_shape(DEVICE)
    _check_vs_float64_once(backend, torch.bfloat16, "ppo", 1.0, None, True,
                           lead=(2 * shape.loss_group_rows + shape.loss_block_rows + 3,))


@pytest.mark.parametrize("backend", [p for p in backend_params(DEVICE) if p.id == "triton"])
@pytest.mark.parametrize("blocks", ["one"], indirect=True)
@pytest.mark.parametrize("width,n_rows,vocab_size", [
    (48, 21, 230),  # on CPU fewer rows than 2 H: dW in its own buffer (on CUDA 128 rows are held: in place)
    (16, 40, 230),  # at least 2 H rows: dW written into the probabilities' storage
    (16, 40, 200),  # the same with a padding-only segment (columns 224..255), whose dW rows are zeros
])
def test_one_block_vs_float64(backend, blocks, width, n_rows, vocab_size):
    """Every row one one-GEMM block: dW_s = dl_s^T X in one GEMM per segment, in the input dtype, finished in the
    forward; where the block holds 2 H rows, into the storage of dlogits already read (the first segment's through a
    temporary), else its own buffer. Values and gradients against float64, padding rows of dW zero."""
    c = _paths
    hidden, weight, tokens = inputs((n_rows,), torch.bfloat16, seed=0, h=width)
    assert _keeps_probs(backend, hidden, weight)
    seg_len = _layout.segment_length(V_GLOBAL, 1)
    path = c.head_path(kind="triton", dtype=torch.bfloat16, device=torch.device(DEVICE), token_loss=True, aligned=True,
                       needs_grad=True, n_rows=n_rows, width=width, seg_len=seg_len)
    rows, held, one = path.block_rows, path.buffer_rows, path.path is c.Path.LOSS_ONE_BLOCK
    assert one and rows == n_rows and held >= n_rows
    h = hidden.to(DEVICE).requires_grad_(True)
    w = weight.to(DEVICE).requires_grad_(True)
    loss, _ = ppo_ops.linear_token_loss(h, w, tokens.to(DEVICE), _ppo(n_rows, 1), entropy="grad", backend=backend)
    dw_saved = loss.grad_fn.saved_tensors[1]
    in_probs = dw_saved.untyped_storage().nbytes() > dw_saved.numel() * dw_saved.element_size()  # a larger buffer's
    assert in_probs == c.dw_in_probs(held, width), f"dW in the probabilities' storage: {in_probs}"
    _check_vs_float64_once(backend, torch.bfloat16, "ppo", 1.1, vocab_size, False, lead=(n_rows,), h=width)


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("width, n_rows", [
    (16, 40),  # one block whose dW is formed in its probabilities' storage (one-GEMM blocks)
    (48, 21),  # one block, dW in a buffer of its own
    (48, 100),  # many blocks beside the fp32 dW accumulator, rounded into its first half
])
def test_gradients_hold_only_their_own_bytes(backend, width, n_rows):
    """What backward hands out (and autograd may keep as .grad) owns storage of exactly its size: never a view that
    keeps the block or the fp32 accumulator it was formed in alive through the model's backward."""
    hidden, weight, tokens = inputs((n_rows,), torch.bfloat16, seed=3, h=width)
    h = hidden.to(DEVICE).requires_grad_(True)
    w = weight.to(DEVICE).requires_grad_(True)
    loss, _ = ppo_ops.linear_token_loss(h, w, tokens.to(DEVICE), _ppo(n_rows, 1), entropy="grad", backend=backend)
    loss.backward()
    for name, grad in (("dX", h.grad), ("dW", w.grad)):
        assert grad.untyped_storage().nbytes() == grad.numel() * grad.element_size(), name


@pytest.mark.parametrize("backend", [p for p in backend_params(DEVICE) if p.id == "triton"])
@pytest.mark.parametrize("seg_width, vocab_size", [(40, 300), (13, 100)])
def test_segments_ending_inside_a_tile_vs_float64(backend, seg_width, vocab_size):
    """Vocabularies of 8 x 40 (padding from 300) and 8 x 13 (segments of 26 bytes: no 16-byte multiple): every
    segment ends inside a GEMM tile, so the kept probabilities' store is clipped at the segment's width, never
    reaching the next segment's columns; the vocabulary-major buffer takes any width."""
    v = 8 * seg_width
    hidden, weight, _ = inputs((1,), torch.bfloat16, seed=0, v=v)
    assert _keeps_probs(backend, hidden, weight)
    _check_vs_float64_once(backend, torch.bfloat16, "ppo", 1.1, vocab_size, True, lead=(3, 7), v=v)


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("blocks", ["one", "many"], indirect=True)
def test_log_probs_bitwise_as_the_general_op_or_the_logits_op(backend, blocks):
    """Where the token loss keeps fp16 probabilities, its forward is the general op's one GEMM (gemm_partials, with
    the probabilities' store): log-probs and entropies bit for bit the general op's, with a gradient asked and
    under no_grad (the GEMM without the store), and the loss value the same either way. Elsewhere (chunk blocks)
    they are the logits op's on the chunks' own logits, bit for bit."""
    n = 2 * _paths.HOST_LOSS_BLOCK_ROWS + 13  # several blocks where "many" on CPU
    hidden, weight, tokens = inputs((n,), torch.bfloat16, seed=94)
    h, w, t = hidden.to(DEVICE), weight.to(DEVICE), tokens.to(DEVICE)
    if _keeps_probs(backend, h, w):
        want = ppo_ops.linear_log_probs_and_entropy(h, w, t, entropy="value", temperature=0.9, backend=backend)
    else:
        logits = _gemms.tile_logits(h, w, _layout.segment_length(V_GLOBAL, 1))
        want = ppo_ops.log_probs_and_entropy(logits, t, entropy="value", temperature=0.9, backend=backend)
    losses = []
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            loss, got = ppo_ops.linear_token_loss(h.clone().requires_grad_(True), w, t, _weighted(n, 95),
                                                  entropy="grad", temperature=0.9, backend=backend)
        assert torch.equal(got.log_probs, want.log_probs) and torch.equal(got.entropy, want.entropy), f"grad={grad}"
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1]), "the loss value differs between grad and no_grad"


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("validate,reads", [(True, 1), (False, 0)])
def test_host_reads_per_call_single_rank(monkeypatch, backend, validate, reads):
    """One host read of the value checks with validate=True (started early, read once), none without; the row
    mask's kept-row count is not a value check."""
    calls = []
    read = _agreement.read_to_host
    monkeypatch.setattr(_agreement, "read_to_host", lambda t: calls.append(t) or read(t))
    hidden, weight, tokens = inputs((20,), torch.bfloat16, seed=108)
    row_mask = torch.rand(20, generator=torch.Generator().manual_seed(109)) < 0.7
    for mask in (None, row_mask):
        calls.clear()
        _run(hidden, weight, tokens, _ppo(20, 110), entropy="grad", backend=backend, validate=validate,
             row_mask=mask)
        assert len(calls) == reads, f"row_mask={mask is not None}: {len(calls)} host reads"


@pytest.fixture
def blocks(request, monkeypatch):
    """Forces the token loss's one-GEMM layout: "one" (every row one block, dW finished in the forward) or "many"
    (blocks beside the fp32 dW accumulator), by the memory allowance the choice reads."""
    allowance = {"one": 2**40, "many": 0}[request.param]
    monkeypatch.setattr(_paths, "TOKEN_LOSS_BYTES", allowance)
    monkeypatch.setattr(_paths, "HOST_TOKEN_LOSS_BYTES", allowance)
    return request.param


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("blocks", ["one", "many"], indirect=True)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, -2.5), (torch.bfloat16, 1.0 / 3.0)])
def test_upstream_scalar_scales_the_gradients(backend, blocks, dtype, scale):
    """dX: the saved gradient times the upstream scalar in fp32, rounded once more to the input dtype. dW, where it
    is saved as its fp32 accumulator: times the scalar, rounded once (its only rounding); where the forward finished
    it (one block): like dX. 1/3 is not a bf16 number: a product that first rounded the scalar to bf16 (as a CUDA
    mul_ by a 0-d fp32 tensor does), or rounded an fp32 accumulator before scaling, fails. An upstream 1 returns the
    saved gradients' bits."""
    n = 2 * _paths.HOST_LOSS_BLOCK_ROWS + 2  # three blocks where "many" on CPU, the last one partial
    hidden, weight, tokens = inputs((n,), dtype, seed=96)
    token_loss = _ppo(n, 97)
    plain = _run(hidden, weight, tokens, token_loss, entropy="grad", backend=backend)
    h = hidden.detach().to(DEVICE).clone().requires_grad_(True)
    w = weight.detach().to(DEVICE).clone().requires_grad_(True)
    loss, _ = ppo_ops.linear_token_loss(h, w, tokens.to(DEVICE), token_loss, entropy="grad", backend=backend)
    dx_saved, dw_saved = (t.clone() for t in loss.grad_fn.saved_tensors)
    finished = blocks == "one" and _keeps_probs(backend, hidden, weight)
    assert dw_saved.dtype == (dtype if finished else torch.float32) and dw_saved.shape == weight.shape
    assert torch.equal(dw_saved.to(dtype).cpu(), plain[4]), "dW (upstream 1) is not the saved gradient rounded once"
    dx, dw = torch.autograd.grad(loss * scale, (h, w))
    assert torch.equal(loss.detach().cpu(), plain[0])
    g = torch.tensor(scale, dtype=torch.float32, device=DEVICE)
    assert torch.equal(dx, (dx_saved.float() * g).to(dtype)), "dX: not the fp32 product rounded once"
    assert torch.equal(dw, (dw_saved.float() * g).to(dtype)), "dW: not the saved gradient's fp32 product rounded once"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 0.75])
def test_scale_in_place_is_the_fp32_product_and_nothing_at_one(dtype, scale):
    """The in-place upstream scale over a tensor longer than its programs' first pass: every element the fp32
    product rounded once; at 1 the bits unchanged (-0.0 and non-finite values included)."""
    gen = torch.Generator().manual_seed(108)
    t = (torch.randn(3 * _scale.BLOCK * 2 + 17, generator=gen) * 5).to(dtype)
    t[:4] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")]).to(dtype)
    t = t.to(DEVICE)
    g = torch.tensor(scale, dtype=torch.float32, device=DEVICE)
    want = (t.float() * g).to(dtype)
    _scale.IN_PLACE_PROGRAMS, programs = 2, _scale.IN_PLACE_PROGRAMS  # programs striding over several blocks
    try:
        _scale.scale_in_place(t, g)
    finally:
        _scale.IN_PLACE_PROGRAMS = programs
    assert torch.equal(t.view(torch.int16 if dtype != torch.float32 else torch.int32)[4:],
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32)[4:])
    assert torch.equal(t[:3], want[:3]) and torch.signbit(t[0]) == torch.signbit(want[0]) and torch.isnan(t[3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scale_round_in_place_chunks_never_overwrite_unread_input(monkeypatch, dtype):
    """dW's in-place scale and rounding over many chunks (shrunk so a small tensor crosses the first chunk, doubling
    chunks and the host cap): every element is its fp32 product rounded once, also where a chunk's output lands on
    an earlier chunk's input."""
    monkeypatch.setattr(_scale, "FIRST_CHUNK", 64)
    monkeypatch.setattr(_scale, "HOST_CHUNK", 96)
    gen = torch.Generator().manual_seed(107)
    acc = (torch.randn((37, 29), generator=gen) * 3).to(DEVICE)
    g = torch.tensor(1.0 / 3.0, device=DEVICE)
    want = (acc * g).to(dtype)
    got = _scale.scale_round_in_place(acc, g, dtype)
    assert got.shape == acc.shape and got.dtype == dtype
    assert got.untyped_storage().data_ptr() == acc.untyped_storage().data_ptr(), "not in the accumulator's storage"
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_row_mask_rows_given_to_the_loss_and_inputs_untouched(backend):
    lead = (2, 6)
    hidden, weight, tokens = inputs(lead, torch.bfloat16, seed=98)
    row_mask = torch.tensor([[True, False, True, True, False, True], [False, False, True, True, True, False]])
    tokens = torch.where(row_mask, tokens, -100)
    copies = [x.clone() for x in (hidden, weight, tokens, row_mask)]
    seen = []

    def token_loss(lp, ent, rows):
        seen.append(rows.cpu())
        assert lp.shape == rows.shape and lp.dtype == torch.float32 and lp.requires_grad
        return lp * 1.0

    loss, lp, _, dx, _ = _run(hidden, weight, tokens, token_loss, backend=backend, row_mask=row_mask)
    assert torch.equal(torch.cat(seen), torch.nonzero(row_mask.reshape(-1)).squeeze(1)), "rows: kept rows' indices"
    assert bool((lp[~row_mask] == 0).all()) and bool((dx[~row_mask] == 0).all())
    assert loss.item() == pytest.approx(lp[row_mask].double().sum().item(), rel=1e-6)
    for before, after in zip(copies, (hidden, weight, tokens, row_mask)):
        assert torch.equal(before, after), "an input was modified"


@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_second_backward_raises_and_no_grad_keeps_nothing(backend):
    hidden, weight, tokens = inputs((5,), torch.float32, seed=99)
    h = hidden.to(DEVICE).requires_grad_(True)
    loss, _ = ppo_ops.linear_token_loss(h, weight.to(DEVICE), tokens.to(DEVICE), _weighted(5, 100), backend=backend)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    calls = []

    def token_loss(lp, ent, rows):
        calls.append(lp.requires_grad)
        return lp * 2.0

    with torch.no_grad():
        loss, out = ppo_ops.linear_token_loss(h, weight.to(DEVICE), tokens.to(DEVICE), token_loss, backend=backend)
    assert loss.grad_fn is None and out.log_probs.grad_fn is None, "a graph (and saved gradients) was kept"
    assert calls == [False], "under no_grad the loss needs no gradient"
    assert loss.item() == pytest.approx(2.0 * out.log_probs.double().sum().item(), rel=1e-6)


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_half_precision_logits_raise(backend, bad):
    """bf16 on "triton" takes the one-GEMM blocks (fp16 probabilities): a NaN or +inf logit must still reach the
    core's check through the segment partials, and the call raises instead of returning gradients."""
    hidden, weight, tokens = inputs((6,), torch.bfloat16, seed=104)
    weight[int(tokens[4])] = bad  # a whole weight row: that column is non-finite in every row's logits
    h = hidden.to(DEVICE).requires_grad_(True)
    with pytest.raises(ValueError, match="NaN or \\+inf logits"):
        ppo_ops.linear_token_loss(h, weight.to(DEVICE), tokens.to(DEVICE), _ppo(6, 105), entropy="grad",
                                  backend=backend)


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("name", ["policy", "policy_seq_mean", "grpo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shipped_loss_closed_form_is_the_autograd_path_bitwise(name, backend, dtype, monkeypatch):
    """A TokenLoss goes through its closed-form gradient (TokenLoss.value_and_grad, once per block), any other
    callable through autograd: the same loss wrapped as a plain closure gives the same loss, log-probs, entropies, dX
    and dW bit for bit, over several row blocks with a row mask (fp32: dX and dW carry every bit of the loss's
    gradient)."""
    from ppo_ops import token_losses

    calls = []
    closed_form = token_losses.TokenLoss.value_and_grad
    monkeypatch.setattr(token_losses.TokenLoss, "value_and_grad",
                        lambda self, *a, **k: calls.append(1) or closed_form(self, *a, **k))
    n = 2 * _paths.HOST_LOSS_BLOCK_ROWS + 5  # several blocks on CPU
    hidden, weight, tokens = inputs((n,), dtype, seed=110)
    token_loss = LOSSES[name](n, 111)
    row_mask = torch.rand(n, generator=torch.Generator().manual_seed(112)) < 0.9
    opts = dict(entropy="grad", backend=backend, row_mask=row_mask.to(DEVICE))
    closed = _run(hidden, weight, tokens, token_loss, **opts)
    assert calls, "the TokenLoss did not take its closed form"
    calls.clear()
    wrapped = _run(hidden, weight, tokens, lambda lp, ent, rows: token_loss(lp, ent, rows), **opts)
    assert not calls, "a plain closure took the closed form"
    for what, a, b in zip(("loss", "log-probs", "entropy", "dX", "dW"), closed, wrapped):
        assert torch.equal(a, b), f"{what}: the closed form differs from autograd's path"


@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_one_gradient_asked_equals_both_asked_bitwise(backend):
    """dX alone (the weight frozen) and dW alone (the hidden states frozen) are the same bits as when both are
    asked, and a loss that does not depend on the log-probs gives exact zeros (bf16: the one-GEMM blocks on
    "triton")."""
    n = 2 * _paths.HOST_LOSS_BLOCK_ROWS + 5  # several blocks on CPU
    hidden, weight, tokens = inputs((n,), torch.bfloat16, seed=106)
    token_loss = _ppo(n, 107)
    _, _, _, dx, dw = _run(hidden, weight, tokens, token_loss, entropy="grad", backend=backend)
    h, w, t = hidden.to(DEVICE), weight.to(DEVICE), tokens.to(DEVICE)
    for frozen in ("weight", "hidden"):
        hh = h.clone().requires_grad_(frozen == "weight")
        ww = w.clone().requires_grad_(frozen == "hidden")
        loss, _ = ppo_ops.linear_token_loss(hh, ww, t, token_loss, entropy="grad", backend=backend)
        (grad,) = torch.autograd.grad(loss, [hh if frozen == "weight" else ww])
        assert torch.equal(grad.cpu(), dx if frozen == "weight" else dw), f"{frozen} frozen: gradient differs"
    _, _, _, dx0, dw0 = _run(hidden, weight, tokens, lambda lp, ent, rows: torch.ones_like(lp), entropy="grad",
                             backend=backend)
    assert not dx0.any() and not dw0.any(), "a loss without the log-probs gave a nonzero gradient"


@pytest.mark.parametrize("width, seg_len", [(4096, 18992), (1024, 18992), (2048, 18992), (4096, 9496)])
def test_probability_block_rows_fill_the_allowance(width, seg_len):
    """The one-GEMM blocks' rows on CUDA (a function of H and the segment length only): a multiple of the step
    within [min, max], the block's fp16 probabilities and the fp32 dW accumulator within the allowance, and one
    step more either over it or past the maximum (the most rows that fit). Qwen3-8B's shape gets 2816."""
    c = _paths
    rows = c.loss_block_rows(width, seg_len, torch.device("cuda"))
    vocab = seg_len * _layout.NUM_FIXED_SEGMENTS
    held = lambda r: r * vocab * 2 + vocab * width * 4  # noqa: E731
    assert rows % c.PROB_ROWS_STEP == 0 and c.LOSS_BLOCK_ROWS_MIN <= rows <= c.LOSS_BLOCK_ROWS_MAX, rows
    assert held(rows) <= c.TOKEN_LOSS_BYTES, f"{rows} rows hold {held(rows)} bytes"
    step_more = rows + c.PROB_ROWS_STEP
    assert step_more > c.LOSS_BLOCK_ROWS_MAX or held(step_more) > c.TOKEN_LOSS_BYTES, f"{step_more} rows would fit"
    if (width, seg_len) == (4096, 18992):
        assert rows == 2816
    assert c.loss_block_rows(width, seg_len, torch.device("cpu")) == c.HOST_LOSS_BLOCK_ROWS


@pytest.mark.parametrize("n_rows,one,in_probs", [
    (4096, True, False), (6528, True, False), (6529, False, None), (8064, False, None),  # dW beside the block
    (8065, True, True), (8192, True, True), (9984, True, True), (9985, False, None),  # dW in the block's storage
    # (8065 rows are held as 8192: 2 H)
    (32768, False, None),
])
def test_one_block_where_it_fits_the_allowance(n_rows, one, in_probs):
    """At Qwen3-8B's shape on CUDA (H = 4096, segments of 18992, row tiles of 128) the token loss takes every row
    as one block where its probabilities, fp32 dX rows and dW (or, in the block's storage, one segment's temporary)
    fit the allowance: T = 8192 does, holding less than the many-block layout (2816 rows beside the fp32
    accumulator); T = 32768 does not."""
    c = _paths
    width, seg_len = 4096, 18992
    held = -(-n_rows // 128) * 128
    assert c.one_loss_block(n_rows, held, width, seg_len, torch.device("cuda")) == one
    if one:
        assert c.dw_in_probs(held, width) == in_probs
        held_bytes = c.one_block_bytes(n_rows, held, width, seg_len)
        assert held_bytes <= c.TOKEN_LOSS_BYTES
        vocab = seg_len * _layout.NUM_FIXED_SEGMENTS
        if n_rows == 8192:
            assert held_bytes < 2816 * vocab * 2 + vocab * width * 4


@pytest.mark.parametrize("working_memory,rows", [(None, 2816), (2**30, 1024), (0, 1024), (2**33, 8192)])
def test_working_memory_sizes_the_blocks(working_memory, rows):
    """The caller's allowance sets the one-GEMM blocks at Qwen3-0.6B's head (H = 1024) and Qwen3-8B's (H = 4096) on
    CUDA: the most rows (a multiple of the step) whose fp16 probabilities fit beside the fp32 dW accumulator, at
    least LOSS_BLOCK_ROWS_MIN (1 GiB is less than H = 4096's accumulator: the least blocks), at most
    LOSS_BLOCK_ROWS_MAX; and every row one block exactly where that fits it (T = 8192 at H = 1024 fits the
    default TOKEN_LOSS_BYTES, not 1 GiB)."""
    c, cuda, seg_len = _paths, torch.device("cuda"), 18992
    vocab = seg_len * _layout.NUM_FIXED_SEGMENTS
    assert c.loss_block_rows(4096, seg_len, cuda, working_memory) == rows
    small = c.loss_block_rows(1024, seg_len, cuda, working_memory)
    allowance = c.TOKEN_LOSS_BYTES if working_memory is None else working_memory
    fits = lambda r: r * vocab * 2 + vocab * 1024 * 4 <= allowance  # noqa: E731
    assert small % c.PROB_ROWS_STEP == 0 and c.LOSS_BLOCK_ROWS_MIN <= small <= c.LOSS_BLOCK_ROWS_MAX
    assert (fits(small) or small == c.LOSS_BLOCK_ROWS_MIN) and (small == c.LOSS_BLOCK_ROWS_MAX or not fits(small + 256))
    one = c.one_loss_block(8191, 8192, 1024, seg_len, cuda, working_memory)
    assert one == (c.one_block_bytes(8191, 8192, 1024, seg_len) <= allowance)
    assert one == (working_memory is None or working_memory >= 2**33)


@pytest.mark.parametrize("backend", [p for p in backend_params(DEVICE) if p.id == "triton"])
def test_working_memory_chooses_one_block_or_many_vs_float64(backend, monkeypatch):
    """The same call with an allowance that holds every row and with one that holds none: one block, then blocks
    beside the fp32 accumulator (on CPU 16 rows each); both within the float64 bounds, the log-probs and entropies
    bit for bit the same (a row's values do not depend on its block)."""
    layouts = []
    chosen = _paths.one_loss_block

    def recorded(*args, **kwargs):
        out = chosen(*args, **kwargs)
        layouts.append(out)  # one block?
        return out
    monkeypatch.setattr(_paths, "one_loss_block", recorded)
    runs = {}
    for working_memory in (2**40, 0):
        layouts.clear()
        runs[working_memory] = _check_vs_float64_once(backend, torch.bfloat16, "ppo", 1.0, None, True, lead=(40,),
                                                      h=16, working_memory=working_memory)
        if _keeps_probs(backend, *inputs((40,), torch.bfloat16, seed=91, h=16)[:2]):
            assert layouts == [working_memory > 0], layouts
    for i, name in ((1, "log_probs"), (2, "entropy")):
        assert torch.equal(runs[2**40][i], runs[0][i]), f"{name} depend on the blocks"


@pytest.mark.parametrize("value,error,match", [(-1, ValueError, ">= 0"), (1.5, TypeError, "an int"),
                                               (True, TypeError, "an int"), ("1GiB", TypeError, "an int")])
def test_bad_working_memory_raises_naming_it(value, error, match):
    hidden, weight, tokens = inputs((4,), torch.float32, seed=105)
    with pytest.raises(error, match=f"working_memory.*{match}"):
        ppo_ops.linear_token_loss(hidden.to(DEVICE).requires_grad_(True), weight.to(DEVICE), tokens.to(DEVICE),
                                  _weighted(4, 106), backend="torch", working_memory=value)


def _bad_losses():
    return [
        ("not_callable", 3.0, TypeError, "token_loss must be callable"),
        ("wrong_shape", lambda lp, ent, rows: lp.sum(), ValueError, "one value per row"),
        ("wrong_dtype", lambda lp, ent, rows: lp.double(), TypeError, "float32"),
        ("not_a_tensor", lambda lp, ent, rows: 1.0, TypeError, "torch.Tensor"),
        ("non_finite", lambda lp, ent, rows: lp * float("inf"), ValueError, "non-finite"),
    ]


@pytest.mark.parametrize("name,token_loss,error,match", _bad_losses(), ids=[c[0] for c in _bad_losses()])
def test_bad_token_loss_raises_naming_it(name, token_loss, error, match):
    hidden, weight, tokens = inputs((4,), torch.float32, seed=101)
    h = hidden.to(DEVICE).requires_grad_(True)
    with pytest.raises(error, match=match):
        ppo_ops.linear_token_loss(h, weight.to(DEVICE), tokens.to(DEVICE), token_loss, backend="torch")


def test_non_finite_loss_passes_without_validate():
    hidden, weight, tokens = inputs((4,), torch.float32, seed=102)
    loss, _ = ppo_ops.linear_token_loss(hidden.to(DEVICE), weight.to(DEVICE), tokens.to(DEVICE),
                                        lambda lp, ent, rows: lp * float("inf"), backend="torch", validate=False)
    assert not torch.isfinite(loss)


def test_bad_tokens_raise():
    hidden, weight, tokens = inputs((4,), torch.float32, seed=103)
    with pytest.raises(ValueError, match="tokens must be global token ids"):
        ppo_ops.linear_token_loss(hidden.to(DEVICE), weight.to(DEVICE), (tokens + V_GLOBAL).to(DEVICE),
                                  _weighted(4, 104), backend="torch")


# --- tensor parallelism ---

# name -> (dtype, rows, H): on CPU "bf16" takes one one-GEMM block with dW in its own buffer on "triton" (11 rows,
# H = 48), "bf16_dw_in_probs" one block of at least 2 H rows whose dW lies in the probabilities' storage (39 kept
# rows, H = 16); the chunk blocks (8 rows each) elsewhere
TP_CASES = {"bf16": (torch.bfloat16, 11, HIDDEN), "fp32": (torch.float32, 11, HIDDEN),
            "bf16_dw_in_probs": (torch.bfloat16, 40, 16)}


def _tp_case(name):
    dtype, n_rows, width = TP_CASES[name]
    hidden, weight, tokens = inputs((n_rows,), dtype, seed=105, h=width)
    tokens = tokens.clamp(max=229)
    row_mask = torch.ones((n_rows,), dtype=torch.bool)
    row_mask[3] = False
    return hidden, weight, torch.where(row_mask, tokens, -100), row_mask


def _tp_results(rank, world_size, group, device, backends):
    results = {}
    for backend in backends:
        for name in TP_CASES:
            hidden, weight, tokens, row_mask = _tp_case(name)
            v_local = V_GLOBAL // world_size
            shard = weight[rank * v_local:(rank + 1) * v_local]
            for reduce_dx in (True, False) if world_size > 1 else (True,):
                results[(backend, name, reduce_dx)] = _run(
                    hidden, shard, tokens, _ppo(hidden.shape[0], 106), device=device, tp_group=group,
                    backend=backend, entropy="grad", temperature=0.9, vocab_size=230, row_mask=row_mask,
                    reduce_dx=reduce_dx)
    return results


def _runnable_backends():
    return ["torch"] + (["triton"] if triton_skip_reason(DEVICE) is None else [])


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return results_by_tp(str(tmp_path_factory.mktemp("token_loss_tp")), _tp_results, _runnable_backends())


# TP = 2 and TP = 4 each under a fixture of their own: a sharded CPU target then runs the two spawns in two shards
# (tests/conftest.py keeps a fixture's cases together), each shard also running TP = 1 in its own process.
@pytest.fixture(scope="module")
def results_at_tp2(tp_results):
    return tp_results


@pytest.fixture(scope="module")
def results_at_tp4(tp_results):
    return tp_results


@pytest.mark.parametrize("name", list(TP_CASES))
@pytest.mark.parametrize("tp", [world_size_param(2)])
@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_tp_bitwise_invariant(results_at_tp2, backend, tp, name):
    _assert_tp_bitwise_invariant(results_at_tp2, backend, tp, name)


@pytest.mark.parametrize("name", list(TP_CASES))
@pytest.mark.parametrize("tp", [world_size_param(4)])
@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_tp_bitwise_invariant_at_tp4(results_at_tp4, backend, tp, name):
    _assert_tp_bitwise_invariant(results_at_tp4, backend, tp, name)


def _assert_tp_bitwise_invariant(tp_results, backend, tp, name):
    loss1, lp1, ent1, _, dw1 = tp_results(1)[0][(backend, name, True)]
    ranks = tp_results(tp)
    for rank, per_rank in enumerate(ranks):
        loss, lp, ent, dx, _ = per_rank[(backend, name, True)]
        assert torch.equal(loss, loss1), f"TP={tp} rank {rank}: loss differs bitwise from TP=1"
        assert torch.equal(lp, lp1) and torch.equal(ent, ent1), f"TP={tp} rank {rank}: log-probs / entropy differ"
        assert torch.equal(dx, ranks[0][(backend, name, True)][3]), f"rank {rank}: dX differs between ranks"
    dw = torch.cat([per_rank[(backend, name, True)][4] for per_rank in ranks])
    assert torch.equal(dw, dw1), f"TP={tp}: concatenated dW shards differ bitwise from TP=1"
    # dX: summed over ranks in another order than at TP = 1, held to the float64 bound; reduce_dx=False: per-rank
    # contributions (each rounded once) that sum to it.
    dtype = TP_CASES[name][0]
    hidden, weight, tokens, row_mask = _tp_case(name)
    _, _, g_lp, g_ent = _float64(hidden, weight, tokens, _ppo(hidden.shape[0], 106), temperature=0.9, vocab_size=230,
                                 row_mask=row_mask, entropy="grad")
    b = bounds(hidden, weight, tokens, g_lp.float(), g_ent.float(), temperature=0.9, vocab_size=230,
               row_mask=row_mask, dl_roundoff=UNIT_ROUNDOFF[dtype])
    assert_within("dX (reduced)", ranks[0][(backend, name, True)][3], b["dx"])
    partial_sum = sum(per_rank[(backend, name, False)][3].double() for per_rank in ranks)
    contributions = sum(per_rank[(backend, name, False)][3].double().abs() for per_rank in ranks)
    ref, tol = b["dx"]
    assert bool(((partial_sum - ref).abs() <= tol + UNIT_ROUNDOFF[dtype] * contributions).all())


def _qwen3_tp_results(rank, world_size, group, device):
    """Each Qwen3 shape through the token loss with the shipped PPO loss (clip-higher, dual clip, entropy bonus, k3
    KL, token mean over the kept rows) on this rank's vocabulary shard."""
    from ppo_ops import token_losses

    results = {}
    for name, (width, n_rows) in QWEN3_TP_SHAPES.items():
        hidden, weight, tokens, row_mask, _, _ = qwen3_inputs(width, n_rows, device)
        gen = torch.Generator(device=device).manual_seed(92)
        old, ref = (-3.0 + torch.randn((n_rows,), generator=gen, device=device) for _ in range(2))
        ppo = token_losses.policy_loss(old, torch.randn((n_rows,), generator=gen, device=device), clip_low=0.2,
                                       clip_high=0.28, dual_clip=3.0, entropy_coef=0.01, kl_coef=0.05,
                                       ref_log_probs=ref, kl_type="k3", loss_mask=row_mask)
        h = hidden.requires_grad_(True)
        w = weight.chunk(world_size)[rank].clone().requires_grad_(True)
        loss, out = ppo_ops.linear_token_loss(h, w, tokens, ppo, tp_group=group, entropy="grad",
                                              temperature=QWEN3_TEMPERATURE, vocab_size=QWEN3_TOKENS,
                                              row_mask=row_mask)
        dx, dw = torch.autograd.grad(loss, (h, w))
        results[name] = tp_record(world_size, dict(loss=loss, log_probs=out.log_probs, entropy=out.entropy), dx, dw)
    return results


@pytest.fixture(scope="module")
def qwen3_tp_results(tmp_path_factory):
    return results_by_tp(str(tmp_path_factory.mktemp("token_loss_qwen3_tp")), _qwen3_tp_results, one_gpu=True)


def test_qwen3_tp_shapes_take_both_block_layouts():
    # What the one-GPU TP cases below claim to cover on CUDA: Qwen3-0.6B's head in blocks beside the fp32 dW
    # accumulator, Qwen3-8B's as one block whose dW lies in its probabilities' storage.
    from ppo_ops.lm_head import gemm_partials

    cuda, seg_len = torch.device("cuda"), QWEN3_VOCAB // _layout.NUM_FIXED_SEGMENTS
    for name, (width, n_rows) in QWEN3_TP_SHAPES.items():
        kept = qwen3_kept_rows(n_rows)
        held = -(-kept // gemm_partials.GPU_CONFIG.block_m) * gemm_partials.GPU_CONFIG.block_m
        one_block = _paths.one_loss_block(kept, held, width, seg_len, cuda)
        if name == "qwen3_8b_head":
            assert one_block and _paths.dw_in_probs(held, width), name
        else:
            assert not one_block and kept > _paths.loss_block_rows(width, seg_len, cuda), name


@pytest.mark.device("cuda")
@pytest.mark.parametrize("name", list(QWEN3_TP_SHAPES))
@pytest.mark.parametrize("tp", QWEN3_TP_SIZES)
def test_tp_bitwise_invariant_at_qwen3_shapes_on_one_gpu(qwen3_tp_results, tp, name):
    """The compiled kernels at TP = 2 and 4 with Qwen3's vocabulary (padding, temperature, a row mask; two blocks
    beside the fp32 dW accumulator, and one block with dW in its probabilities' storage), every rank on the one GPU
    over gloo: loss, log-probs, entropies and dW bitwise TP = 1's, dX the same on every rank and within a bf16
    rounding of TP = 1's."""
    assert_tp_invariant(qwen3_tp_results(1)[0][name], [r[name] for r in qwen3_tp_results(tp)], name)



# --- the whole-step bench's LM-head variants, on a tiny model (CPU plumbing and agreement) ---

# fp32 tiny model: the three variants compute the same loss through different reduction orders (fused fp32 tiles,
# chunks, the logits op on [T, V] logits); their gradients agree to a few fp32 ulps of the largest entry per tensor.
WHOLE_STEP_REL_TOL = 1e-4


@pytest.mark.device("cpu")
def test_whole_step_head_variants_train_alike():
    pytest.importorskip("transformers", reason="the whole-step provider builds its model with transformers")
    from tools.bench import step

    grads = {}
    for provider in ("qwen3_step_ckpt", "qwen3_step_head", "qwen3_step_loss"):
        case = step.case(provider, 8, 256, "fp32")
        closure = step.build_hf(case, step.make_inputs(case, torch.device("cpu"), seed=0))
        closure.prepare()
        loss = closure.step(None)
        assert torch.isfinite(loss)
        grads[provider] = {n: p.grad.clone() for n, p in closure.model.named_parameters()}
    base = grads["qwen3_step_ckpt"]
    for provider in ("qwen3_step_head", "qwen3_step_loss"):
        for name, g in grads[provider].items():
            scale = base[name].abs().max().clamp(min=1e-30)
            err = ((g - base[name]).abs().max() / scale).item()
            assert err <= WHOLE_STEP_REL_TOL, f"{provider}: {name} differs from the logits path by {err:.2e}"


# --- collective failure (2 gloo ranks) ---

GLOO_TIMEOUT_S = 30  # a collective that waits this long fails the rank: a hang becomes an error
DEADLINE_S = 180  # both ranks done by then, or the test fails as a hang


class LossOfItsOwn(Exception):
    """What a caller's token_loss raises in the collective-failure cases (an exception type ppo_ops never uses)."""


def _failing_loss(kind, failing_ranks, rank, n_rows, from_row=0):
    """A good loss, except on `failing_ranks` for blocks holding a row >= from_row, where it fails as `kind` says."""
    good = _weighted(n_rows, 108)

    def token_loss(lp, ent, rows):
        if rank not in failing_ranks or int(rows.max()) < from_row:
            return good(lp, ent, rows)
        if kind == "raises":
            raise LossOfItsOwn(f"the caller's own failure on rank {rank}")
        if kind == "float64":
            return good(lp, ent, rows).double()
        if kind == "wrong_shape":
            return good(lp, ent, rows)[:-1]
        if kind == "nan":
            return good(lp, ent, rows) * float("nan")
        raise AssertionError(kind)
    return token_loss


# name -> (kind, failing ranks (None: every rank), rows, from_row, options): the caller's loss fails on some ranks
# only; on CPU 5 rows are one block of the chunk layout (8 rows), 20 rows three, the failure in the second.
COLLECTIVE_CASES = {
    "raises_on_rank_1": ("raises", (1,), 5, 0, {}),
    "float64_on_rank_1": ("float64", (1,), 5, 0, {}),
    "wrong_shape_on_rank_1": ("wrong_shape", (1,), 5, 0, {}),
    "nan_on_rank_1": ("nan", (1,), 5, 0, {}),
    "raises_on_rank_1_one_block_megatron_dx": ("raises", (1,), 5, 0, {"reduce_dx": False}),
    "raises_on_rank_1_in_a_middle_block": ("raises", (1,), 20, 8, {}),
    "raises_on_every_rank": ("raises", None, 5, 0, {}),
}
# What every rank raises, and what the faulty ranks keep as the cause.
COLLECTIVE_EXPECTED = {"raises": ("RuntimeError", "LossOfItsOwn"), "float64": ("TypeError", "TypeError"),
                       "wrong_shape": ("ValueError", "ValueError"), "nan": ("ValueError", None)}


def _collective_worker(rank, world_size, out_dir):
    v_local = V_GLOBAL // world_size
    record = {}
    for name, (kind, failing, n_rows, from_row, options) in COLLECTIVE_CASES.items():
        hidden, weight, tokens = inputs((n_rows,), torch.float32, seed=107)
        shard = weight[rank * v_local:(rank + 1) * v_local]
        failing = tuple(range(world_size)) if failing is None else failing
        try:
            ppo_ops.linear_token_loss(hidden.clone().requires_grad_(True), shard, tokens,
                                      _failing_loss(kind, failing, rank, n_rows, from_row),
                                      tp_group=dist.group.WORLD, backend="torch", **options)
            record[name] = ("no error", "", None)
        except Exception as exc:  # noqa: BLE001 - the test records whatever each rank raised
            cause = exc.__cause__
            record[name] = (type(exc).__name__, str(exc), None if cause is None else type(cause).__name__)
    if world_size == 2:
        cases = {
            "not_callable_on_rank_1": dict(token_loss=3.0 if rank == 1 else _weighted(5, 108)),
            "bad_token_on_rank_0": dict(
                token_loss=_weighted(5, 108),
                tokens=torch.where(torch.arange(5) == 2, V_GLOBAL, tokens) if rank == 0 else tokens),
            "bad_working_memory_on_rank_1": dict(token_loss=_weighted(5, 108),
                                                 working_memory=-1 if rank == 1 else None),
            "working_memory_differs": dict(token_loss=_weighted(5, 108), working_memory=4096 if rank == 1 else None),
        }
        hidden, weight, tokens = inputs((5,), torch.float32, seed=107)
        shard = weight[rank * v_local:(rank + 1) * v_local]
        for name, args in cases.items():
            try:
                ppo_ops.linear_token_loss(hidden.clone().requires_grad_(True), shard, args.get("tokens", tokens),
                                          args["token_loss"], tp_group=dist.group.WORLD, backend="torch",
                                          working_memory=args.get("working_memory"))
                record[name] = ("no error", "", None)
            except (TypeError, ValueError) as exc:
                record[name] = (type(exc).__name__, str(exc), None)
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("tp", [2, 4])
def test_failure_is_collective(tmp_path, tp):
    """A failure of the caller's loss on some ranks raises on every rank, the same error naming the faulty ranks
    (each of which keeps its own exception as the cause), instead of a wait until the group's timeout or a rank
    returning normally."""
    from tests.ranks import run_gloo

    run_gloo(tp, _collective_worker, str(tmp_path), timeout_s=GLOO_TIMEOUT_S, deadline_s=DEADLINE_S)
    records = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp)]
    for name, (kind, failing, *_rest) in COLLECTIVE_CASES.items():
        failing = tuple(range(tp)) if failing is None else failing
        exc_type, cause_type = COLLECTIVE_EXPECTED[kind]
        where = ("rank " if len(failing) == 1 else "ranks ") + ", ".join(map(str, failing)) + f" of {tp}"
        messages = set()
        for rank, (got_type, message, cause) in enumerate(records[rank][name] for rank in range(tp)):
            assert got_type == exc_type, f"{name}: rank {rank} raised {got_type}: {message}"
            assert "token_loss" in message and where in message, f"{name}: rank {rank}: {message}"
            expected_cause = cause_type if rank in failing else None
            assert cause == expected_cause, f"{name}: rank {rank}'s cause is {cause}, expected {expected_cause}"
            messages.add(message.split(" This rank's error:")[0].split(" See ")[0])
        assert len(messages) == 1, f"{name}: the ranks raised different errors: {messages}"
    if tp == 2:
        expected = {"not_callable_on_rank_1": ("TypeError", ("token_loss", "rank 1 of 2")),
                    "bad_token_on_rank_0": ("ValueError", ("tokens", "rank 0 of 2")),
                    "bad_working_memory_on_rank_1": ("ValueError", ("working_memory", "rank 1 of 2")),
                    "working_memory_differs": ("ValueError", ("working_memory", "4096"))}
        for name, (exc_type, needles) in expected.items():
            for rank, record in enumerate(records):
                got_type, message, _ = record[name]
                assert got_type == exc_type, f"{name}: rank {rank} raised {got_type}: {message}"
                assert all(n in message for n in needles), f"{name}: rank {rank}: {message}"


@pytest.mark.skipif(triton_skip_reason(DEVICE) is not None, reason=str(triton_skip_reason(DEVICE)))
def test_probability_pass_rounds_its_row_bound_and_writes_no_row_it_does_not_own(monkeypatch):
    """The dlogits pass over the forward's probabilities covers the rows rounded up to 16 where both buffers hold them
    (so the compiled pass can vectorise its contiguous row axis at an odd row count): the rows below the count get
    the same bits as with the exact bound, the rows past it exact zeros. Those rows hold what the forward left there
    (whole row tiles, from zero-filled hidden rows: finite, never the buffer's NaN scratch), which the pass's zero
    upstream gradients on those rows rely on. Where the output buffer holds only the counted rows, nothing past them
    is written."""
    from ppo_ops.core.contracts import BackwardStats, ShardOptions, UpstreamGrads
    from ppo_ops.lm_head import gemm_partials, prob_dlogits

    n_seg, seg_len, width, n_rows = 2, 40, 24, 13
    rounded_rows = 16
    held = -(-n_rows // gemm_partials.config().block_m) * gemm_partials.config().block_m  # the forward's row tiles
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(n_rows, width, generator=gen).to(torch.bfloat16).to(DEVICE)
    weight = torch.randn(n_seg * seg_len, width, generator=gen).to(torch.bfloat16).to(DEVICE)
    tokens = torch.randint(0, n_seg * seg_len, (n_rows,), generator=gen).to(DEVICE)
    shard = ShardOptions(inv_temperature=1.0, n_valid=n_seg * seg_len - 3, seg_len=seg_len, vocab_start=0)
    stats = BackwardStats(torch.zeros(n_rows, device=DEVICE), torch.full((n_rows,), 2.0, device=DEVICE), None,
                          torch.randn(n_rows, generator=gen).to(DEVICE))
    scratch = torch.full((n_seg, seg_len, held), float("nan"), dtype=torch.float16, device=DEVICE)
    _, tiles = gemm_partials.forward_probs(hidden, weight, tokens, shard, True, scratch.transpose(1, 2))
    fresh = scratch.cpu()
    past = fresh[:, :, n_rows:rounded_rows].float()
    assert torch.isfinite(past).all() and past.ge(0).all() and past.le(1).all(), "the forward's rows past the count"

    for upstream in (UpstreamGrads(*(torch.randn(n_rows, generator=gen).to(DEVICE) for _ in range(2))),
                     UpstreamGrads(torch.randn(n_rows, generator=gen).to(DEVICE), None)):
        def in_place(exact: bool, upstream=upstream):
            if exact:
                monkeypatch.setattr(prob_dlogits, "access_rows", lambda n, probs, out: n)
            else:
                monkeypatch.undo()
            storage = fresh.clone().to(DEVICE)
            prob_dlogits.dlogits(storage.transpose(1, 2), tiles, n_rows, hidden, weight, tokens, shard, stats,
                                 upstream, torch.bfloat16)
            return storage.view(torch.bfloat16).cpu()

        exact, rounded = in_place(True), in_place(False)
        assert torch.equal(rounded[:, :, :n_rows].view(torch.int16), exact[:, :, :n_rows].view(torch.int16)), \
            "the counted rows' bits depend on the bound"
        untouched = exact.view(torch.int16)[:, :, n_rows:] == fresh.view(torch.int16)[:, :, n_rows:]
        assert untouched.all(), "the exact bound wrote past the counted rows"
        assert not rounded.view(torch.int16)[:, :, n_rows:rounded_rows].any(), "rows past the count: not +0"
        assert torch.equal(rounded.view(torch.int16)[:, :, rounded_rows:], fresh.view(torch.int16)[:, :, rounded_rows:])
        assert rounded[:, :, :n_rows].float().abs().gt(0).any()

    # an output that holds only the counted rows (its columns 16-byte aligned): nothing past them is written
    out_storage = torch.full((n_seg, seg_len, rounded_rows), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = out_storage[:, :, :n_rows].transpose(1, 2)
    assert prob_dlogits.access_rows(n_rows, fresh.transpose(1, 2), out) == n_rows
    assert prob_dlogits.access_rows(n_rows, fresh.transpose(1, 2), fresh.transpose(1, 2)) == rounded_rows
    probs = fresh.clone().to(DEVICE).transpose(1, 2)
    prob_dlogits.dlogits(probs, tiles, n_rows, hidden, weight, tokens, shard, stats, upstream, torch.bfloat16, out=out)
    assert torch.isnan(out_storage[:, :, n_rows:].float()).all(), "the pass wrote past the output's rows"
    assert torch.equal(out_storage[:, :, :n_rows].cpu(), exact[:, :, :n_rows])
