"""The sparse keep set, keep=(ids, offsets) (ppo_ops/core/sparse_keep.py), of log_probs_and_entropy and
linear_log_probs_and_entropy: values and gradients against float64, against the dense keep_mask built from the same
CSR, bitwise invariance across TP = 1, 2, 4 (gloo; the one-GPU target runs every rank on its GPU) on both backends,
and every bad keep set raising one error that names `keep`, on every rank at TP = 2.

Every case's keep rows cover what top-p / top-k replay produces and what can go wrong with it: rows with no nucleus
(the full vocabulary), a nucleus with and without the target, only the target, ids listed twice, ids on every rank's
shard, a frequent id kept by most rows (its dW run crosses the kernel's tiles), ids next to the padding. The float64
reference is tests/reference.py's with the dense mask: log-prob over keep ∪ {target}, entropy over everything. A row
mask dropping rows before the first kept row, between kept rows and last, with and without keep entries on the
dropped rows, has cases of its own (the LM head and the token loss compact the kept rows).
"""

import pytest
import torch
import torch.distributed as dist

import ppo_ops
from ppo_ops.core import agreement, shell, sparse_keep
from ppo_ops.core.layout import segment_length
from tests.core_support import (backend_params, make_logits, make_row_mask, make_tokens, make_weights,
                                triton_skip_reason)
from tests.linear_support import UNIT_ROUNDOFF, assert_within, bounds, inputs as linear_inputs
from tests.ranks import DEVICE, results_by_tp, run_gloo, world_size_param
from tests.reference import (LOG_PROB_TOL, assert_entropy_close, assert_grad_close, assert_log_probs_close,
                             reference_log_probs_and_entropy, shard_vocab)

V_GLOBAL = 256  # eight fixed segments of 32: V_local = 64 at TP = 4, so TP = 1, 2, 4 are bitwise comparable
N_ROWS = 80  # LM head: more rows than the interpreter's dW tile (64 entries): the frequent id's run crosses tiles
LOGITS_ROWS = 24  # the logits op: three rows of every pattern (its Triton kernels run slowly under the interpreter)
FREQUENT_ID = 7
PADDING_LOGIT = 50.0  # padding columns hold values that would dominate the softmax if any mass leaked into them
# Sparse and dense keep sets reduce the same kept logits in different orders (fixed-point row sums vs the backends'
# fp32 segment partials): both within the float64 tolerance, so within twice it of each other, not bit for bit.
SPARSE_VS_DENSE_LOG_PROB_TOL = 2 * LOG_PROB_TOL
# The logits op's gradient on kept entries: the same formula from the same statistics, in fp32 on both paths, each
# rounded once to the logits' dtype: within the float64 gradient tolerance of each other (tests/reference.py).
SPARSE_VS_DENSE_GRAD_TOL = 2e-6

with_each_backend = pytest.mark.parametrize("backend", backend_params())


# --- keep sets ---

def keep_rows(tokens, vocab, seed=5):
    """One list of kept ids per row (tokens flattened), cycling through the patterns of the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    flat = tokens.reshape(-1).tolist()
    rows = []
    for r, t in enumerate(flat):
        pattern = r % 8
        random_ids = torch.randint(0, vocab, (6,), generator=gen).tolist()
        if pattern == 0:
            rows.append([])  # no nucleus: the full vocabulary
        elif pattern == 1:
            rows.append([FREQUENT_ID, t] + random_ids[:3])  # the target inside
        elif pattern == 2:
            rows.append([i for i in [FREQUENT_ID] + random_ids if i != t])  # the target outside
        elif pattern == 3:
            rows.append([FREQUENT_ID, random_ids[0], random_ids[0], t, t])  # duplicates, the target twice
        elif pattern == 4:
            rows.append([t])  # only the target: log-prob 0
        elif pattern == 5:
            rows.append([FREQUENT_ID] + torch.randperm(vocab, generator=gen)[:40].tolist())  # every shard
        elif pattern == 6:
            rows.append([vocab - 1, (t + 1) % vocab])  # the last real id, next to the padding
        else:
            rows.append([FREQUENT_ID, (t + 3) % vocab])
    return rows


def csr(rows, device=DEVICE):
    ids = torch.tensor([i for row in rows for i in row], dtype=torch.int64)
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    return ids.to(device), offsets.to(device)


def dense_mask(rows, vocab, lead):
    """The keep_mask of the same sets: a row without ids keeps everything."""
    mask = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for r, row in enumerate(rows):
        if row:
            mask[r, row] = True
        else:
            mask[r] = True
    return mask.reshape(lead + (vocab,))


# --- the logits op ---

def logits_case(lead=(LOGITS_ROWS,), v=V_GLOBAL, dtype=torch.float32, vocab_size=None, rows=False, seed=0):
    logits = make_logits(lead + (v,), dtype, seed)
    if vocab_size is not None:
        logits[..., vocab_size:] = PADDING_LOGIT
    tokens = make_tokens(lead, vocab_size or v, seed + 1)
    row_mask = make_row_mask(lead, seed + 3) if rows else None
    if row_mask is not None:
        tokens = torch.where(row_mask, tokens, -100)
    kept = keep_rows(torch.where(tokens < 0, 0, tokens), vocab_size or v)
    return logits, tokens, row_mask, kept


def run_logits(logits, tokens, *, keep=None, keep_mask=None, w_lp=None, w_ent=None, device=DEVICE, **opts):
    """Forward and backward on a leaf copy of `logits` (all on `device`): (log_probs, entropy, grad)."""
    x = logits.detach().to(device).clone().requires_grad_(True)
    opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    if keep is not None:
        keep = tuple(t.to(device) for t in keep)
    if keep_mask is not None:
        keep_mask = keep_mask.to(device)
    out = ppo_ops.log_probs_and_entropy(x, tokens.to(device), keep=keep, keep_mask=keep_mask, **opts)
    outputs, weights = [], []
    if w_lp is not None:
        outputs.append(out.log_probs)
        weights.append(w_lp.to(device))
    if opts.get("entropy") == "grad":
        outputs.append(out.entropy)
        weights.append(w_ent.to(device))
    grad = torch.autograd.grad(outputs, x, weights)[0]
    return out.log_probs.detach(), None if out.entropy is None else out.entropy.detach(), grad


def _check_logits_op(backend, dtype, temperature, vocab_size, rows, entropy, inplace=False):
    logits, tokens, row_mask, kept = logits_case(dtype=dtype, vocab_size=vocab_size, rows=rows)
    lead = tuple(tokens.shape)
    w_lp, w_ent = make_weights(lead, 4), make_weights(lead, 5, low=-1.0, high=1.0)
    opts = dict(entropy=entropy, temperature=temperature, vocab_size=vocab_size, row_mask=row_mask, backend=backend)
    mask = dense_mask(kept, V_GLOBAL, lead)
    got = run_logits(logits, tokens, keep=csr(kept), w_lp=w_lp, w_ent=w_ent, inplace_grad=inplace, **opts)
    ref = reference_log_probs_and_entropy(logits, tokens, keep_mask=mask, grad_log_probs=w_lp,
                                          grad_entropy=w_ent if entropy == "grad" else None, **opts)
    assert_log_probs_close(got[0].cpu(), ref.log_probs)
    assert (got[0] <= 0).all()
    if entropy == "none":
        assert got[1] is None
    else:
        assert_entropy_close(got[1].cpu(), ref.entropy)
    assert_grad_close(got[2].cpu(), ref.grad, dtype)
    # The dense mask of the same sets: the same entropies bit for bit (the same full-vocabulary pass), log-probs and
    # gradients within the tolerances above.
    dense = run_logits(logits, tokens, keep_mask=mask, w_lp=w_lp, w_ent=w_ent, **opts)
    if entropy != "none":
        assert torch.equal(got[1], dense[1])
    lp, dense_lp = got[0].cpu().double(), dense[0].cpu().double()
    finite = torch.isfinite(dense_lp)
    assert torch.equal(torch.isfinite(lp), finite)
    assert ((lp - dense_lp).abs()[finite] <= SPARSE_VS_DENSE_LOG_PROB_TOL * dense_lp.abs()[finite].clamp(min=1)).all()
    assert ((got[2].double() - dense[2].double()).abs()
            <= SPARSE_VS_DENSE_GRAD_TOL + 2 * ref.grad.abs().to(got[2].device) * _ulp(dtype)).all()


def _ulp(dtype):
    return {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]


# On CPU (the Triton kernels interpreted, seconds a case) each dtype and each temperature once; the GPU target runs the
# other two pairs too.
on_gpu_only = pytest.mark.device("cuda")


@with_each_backend
@pytest.mark.parametrize("dtype,temperature", [
    (torch.float32, 1.0),
    (torch.bfloat16, 0.7),
    pytest.param(torch.float32, 0.7, marks=on_gpu_only),
    pytest.param(torch.bfloat16, 1.0, marks=on_gpu_only),
], ids=["fp32-1.0", "bf16-0.7", "fp32-0.7", "bf16-1.0"])
def test_logits_op_vs_float64_and_dense_mask(backend, dtype, temperature):
    _check_logits_op(backend, dtype, temperature, vocab_size=None, rows=False, entropy="grad")


@with_each_backend
@pytest.mark.parametrize("entropy", ["none", "value", "grad"])
def test_logits_op_padding_row_mask_entropy_modes(backend, entropy):
    _check_logits_op(backend, torch.bfloat16, 0.7, vocab_size=V_GLOBAL - 6, rows=True, entropy=entropy)


@with_each_backend
def test_logits_op_inplace_grad(backend):
    _check_logits_op(backend, torch.bfloat16, 0.7, vocab_size=None, rows=True, entropy="grad", inplace=True)


@with_each_backend
def test_non_finite_logits_give_no_nan(backend):
    """-inf logits: a kept target at -inf has log-prob -inf, a row whose whole keep set is -inf too; no NaN anywhere,
    the gradient finite (and 0 where the log-prob is -inf for want of mass)."""
    logits, tokens, _, kept = logits_case(lead=(8,))
    logits[1, tokens[1]] = float("-inf")  # pattern 1: target inside, at -inf
    logits[2, kept[2]] = float("-inf")  # pattern 2: every kept id at -inf, the target finite
    logits[4] = float("-inf")  # pattern 4: the whole row
    w = make_weights((8,), 4)
    lp, ent, grad = run_logits(logits, tokens, keep=csr(kept), w_lp=w, w_ent=w, entropy="grad", backend=backend)
    ref = reference_log_probs_and_entropy(logits, tokens, keep_mask=dense_mask(kept, V_GLOBAL, (8,)), entropy="grad",
                                          grad_log_probs=w, grad_entropy=w)
    assert_log_probs_close(lp.cpu(), ref.log_probs)
    assert_entropy_close(ent.cpu(), ref.entropy)
    assert_grad_close(grad.cpu(), ref.grad, torch.float32)


@with_each_backend
def test_keep_leaves_other_rows_and_entropy_bitwise(backend):
    """Rows without a keep set, and every entropy, are bit for bit those of the call without keep; so is the whole
    gradient when only the entropy has one (the log-probs get no upstream gradient)."""
    logits, tokens, _, kept = logits_case(lead=(16,))
    w = make_weights((16,), 4)
    with_keep = run_logits(logits, tokens, keep=csr(kept), w_ent=w, entropy="grad", backend=backend)
    without = run_logits(logits, tokens, w_ent=w, entropy="grad", backend=backend)
    no_nucleus = torch.tensor([not row for row in kept])
    assert torch.equal(with_keep[0][no_nucleus.to(DEVICE)], without[0][no_nucleus.to(DEVICE)])
    assert torch.equal(with_keep[1], without[1])
    assert torch.equal(with_keep[2], without[2])


# --- the LM head ---

def head_case(lead=(N_ROWS,), dtype=torch.float32, vocab_size=None, rows=False, seed=11):
    hidden, weight, tokens = linear_inputs(lead, dtype, seed)
    if vocab_size is not None:
        tokens = tokens % vocab_size
    row_mask = make_row_mask(lead, seed + 3) if rows else None
    kept = keep_rows(tokens, vocab_size or V_GLOBAL, seed + 2)
    if row_mask is not None:
        tokens = torch.where(row_mask, tokens, -100)
    return hidden, weight, tokens, row_mask, kept


def run_head(hidden, weight, tokens, *, keep=None, w_lp, w_ent, device=DEVICE, tp_group=None, backward=True, **opts):
    """(log_probs, entropy, dX, dW); without `backward`, dX and dW are None (the forward of a gradient-taking call:
    the backward's interpreted kernels are most of a Triton call's time on CPU)."""
    h = hidden.detach().to(device).clone().requires_grad_(True)
    w = weight.detach().to(device).clone().requires_grad_(True)
    opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    if keep is not None:
        keep = tuple(t.to(device) for t in keep)
    out = ppo_ops.linear_log_probs_and_entropy(h, w, tokens.to(device), keep=keep, entropy="grad",
                                               tp_group=tp_group, **opts)
    dx = dw = None
    if backward:
        dx, dw = torch.autograd.grad([out.log_probs, out.entropy], [h, w], [w_lp.to(device), w_ent.to(device)])
    return out.log_probs.detach(), out.entropy.detach(), dx, dw


def _check_head(backend, dtype, temperature, vocab_size, rows):
    hidden, weight, tokens, row_mask, kept = head_case(dtype=dtype, vocab_size=vocab_size, rows=rows)
    lead = tuple(tokens.shape)
    w_lp, w_ent = make_weights(lead, 4), make_weights(lead, 5, low=-1.0, high=1.0)
    lp, ent, dx, dw = run_head(hidden, weight, tokens, keep=csr(kept), w_lp=w_lp, w_ent=w_ent, backend=backend,
                               temperature=temperature, vocab_size=vocab_size, row_mask=row_mask)
    expected = bounds(hidden, weight, tokens, w_lp, w_ent, temperature=temperature, vocab_size=vocab_size,
                      row_mask=row_mask, keep_mask=dense_mask(kept, V_GLOBAL, lead),
                      **_rounding(backend, dtype, hidden, weight, row_mask))
    assert_within("log_probs", lp.cpu(), expected["log_probs"])
    assert (lp <= 0).all()
    assert_within("entropy", ent.cpu(), expected["entropy"])
    assert_within("dx", dx.cpu(), expected["dx"])
    assert_within("dw", dw.cpu(), expected["dw"])


def _rounding(backend, dtype, hidden, weight, row_mask):
    """The bounds' rounding terms of the path the op takes (as tests/test_linear_log_probs.py derives them): the
    Triton backend rounds half-precision dlogits to the input dtype before its GEMMs, and its chunked path forms the
    first held rows' dlogits from fp16 probabilities."""
    dl_roundoff = UNIT_ROUNDOFF[dtype] if backend == "triton" and dtype != torch.float32 else 0.0
    flat = hidden.reshape(-1, hidden.shape[-1])
    kept = torch.ones(flat.shape[0], dtype=torch.bool) if row_mask is None else row_mask.reshape(-1).cpu()
    held = torch.zeros_like(kept)
    segment_path = backend == "triton" and dtype != torch.float32
    if segment_path and triton_skip_reason(DEVICE) is None:
        from ppo_ops.lm_head import gemm_partials, segment_gemms
        if gemm_partials.applies(flat.to(DEVICE).contiguous(), weight.to(DEVICE)):
            rows = torch.nonzero(kept).squeeze(1)
            held[rows[:segment_gemms.held_rows(rows.numel(), segment_length(weight.shape[0], 1), DEVICE)]] = True
    return dict(dl_roundoff=dl_roundoff, prob_storage=held)


# --- the token loss: the keep rows' log-probs in its closure, their term in each block's dlogits ---

def run_loss(hidden, weight, tokens, *, keep=None, w_lp, w_ent, device=DEVICE, tp_group=None, **opts):
    """linear_token_loss with the closure sum(w_lp * log_prob + w_ent * entropy): its gradients are run_head's."""
    h = hidden.detach().to(device).clone().requires_grad_(True)
    w = weight.detach().to(device).clone().requires_grad_(True)
    opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    if keep is not None:
        keep = tuple(t.to(device) for t in keep)
    a, b = w_lp.reshape(-1).to(device), w_ent.reshape(-1).to(device)
    loss, out = ppo_ops.linear_token_loss(h, w, tokens.to(device), lambda lp, ent, rows: a[rows] * lp + b[rows] * ent,
                                          keep=keep, entropy="grad", tp_group=tp_group, **opts)
    dx, dw = torch.autograd.grad(loss, [h, w])
    return out.log_probs, out.entropy, dx, dw


def _loss_rounding(backend, dtype, hidden, weight):
    """The token loss rounds half-precision dlogits to the input dtype; its one-GEMM blocks (Triton, where the
    one-GEMM kernels apply) form every row's dlogits from fp16 probabilities."""
    dl_roundoff = UNIT_ROUNDOFF[dtype] if dtype != torch.float32 else 0.0
    probs = False
    if backend == "triton" and dtype != torch.float32 and triton_skip_reason(DEVICE) is None:
        from ppo_ops.lm_head import segment_gemms, token_loss_blocks
        flat = hidden.reshape(-1, hidden.shape[-1]).to(DEVICE).contiguous()
        probs = token_loss_blocks.keeps_probs(segment_gemms.backend("triton").passes, flat, weight.to(DEVICE))
    return dict(dl_roundoff=dl_roundoff, prob_storage=probs)


@with_each_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_loss_vs_float64(backend, dtype):
    """The token loss with a keep set: its closure sees the keep rows' renormalised log-probs, and the keep term of
    its gradient, added into each block's dlogits, reaches dX and dW as the general op's does (several row blocks
    on CPU, a padded vocabulary, a row mask)."""
    hidden, weight, tokens, row_mask, kept = head_case(dtype=dtype, vocab_size=V_GLOBAL - 6, rows=True)
    lead = tuple(tokens.shape)
    w_lp, w_ent = make_weights(lead, 4), make_weights(lead, 5, low=-1.0, high=1.0)
    lp, ent, dx, dw = run_loss(hidden, weight, tokens, keep=csr(kept), w_lp=w_lp, w_ent=w_ent, backend=backend,
                               temperature=0.7, vocab_size=V_GLOBAL - 6, row_mask=row_mask)
    expected = bounds(hidden, weight, tokens, w_lp, w_ent, temperature=0.7, vocab_size=V_GLOBAL - 6,
                      row_mask=row_mask, keep_mask=dense_mask(kept, V_GLOBAL, lead),
                      **_loss_rounding(backend, dtype, hidden, weight))
    assert_within("log_probs", lp.cpu(), expected["log_probs"])
    assert (lp <= 0).all()
    assert_within("entropy", ent.cpu(), expected["entropy"])
    assert_within("dx", dx.cpu(), expected["dx"])
    assert_within("dw", dw.cpu(), expected["dw"])


@with_each_backend
def test_token_loss_log_probs_are_the_general_ops(backend):
    """The token loss's keep log-probs and entropies are the general op's, bit for bit (the same kept logits and
    fixed-point sums; the same full-vocabulary path on the torch backend and where both take the one-GEMM forward)."""
    hidden, weight, tokens, _, kept = head_case(dtype=torch.float32)
    w = make_weights(tuple(tokens.shape), 4)
    head = run_head(hidden, weight, tokens, keep=csr(kept), w_lp=w, w_ent=w, backend=backend, backward=False)
    loss = run_loss(hidden, weight, tokens, keep=csr(kept), w_lp=w, w_ent=w, backend=backend)
    keep_rows_ = torch.tensor([len(k) > 0 for k in kept], device=head[0].device)
    assert torch.equal(loss[0][keep_rows_], head[0][keep_rows_])


def test_bad_keep_values_in_the_token_loss_raise():
    """The token loss reads the keep set's values in its one end-of-forward read (TP = 1) and raises naming keep."""
    hidden, weight, tokens = linear_inputs((4,), torch.float32, 3)
    ids, off = csr([[1], [2, 3], [], [4]], "cpu")
    with pytest.raises(ValueError, match="non-decreasing"):
        ppo_ops.linear_token_loss(hidden, weight, tokens, lambda lp, ent, rows: -lp, backend="torch",
                                  keep=(ids, torch.tensor([0, 2, 1, 3, 4])))
    with pytest.raises(ValueError, match="keep ids"):
        ppo_ops.linear_token_loss(hidden, weight, tokens, lambda lp, ent, rows: -lp, backend="torch",
                                  keep=(torch.tensor([1, 2, 3, V_GLOBAL]), off))


@with_each_backend
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_vs_float64(backend, dtype):
    _check_head(backend, dtype, 0.7, vocab_size=None, rows=False)


@with_each_backend
def test_lm_head_padding_and_row_mask_vs_float64(backend):
    _check_head(backend, torch.bfloat16, 1.0, vocab_size=V_GLOBAL - 6, rows=True)


@with_each_backend
def test_lm_head_log_probs_are_row_count_invariant(backend):
    """A row's keep log-prob does not depend on the other rows of the call (its kept logits are its own dots, its
    sums exact), nor on a row mask that moves it."""
    hidden, weight, tokens, _, kept = head_case(dtype=torch.bfloat16)
    w = make_weights(tuple(tokens.shape), 4)
    full = run_head(hidden, weight, tokens, keep=csr(kept), w_lp=w, w_ent=w, backend=backend, backward=False)[0]
    part = run_head(hidden[20:50], weight, tokens[20:50], keep=csr(kept[20:50]), w_lp=w[20:50], w_ent=w[20:50],
                    backend=backend, backward=False)[0]
    assert torch.equal(part, full[20:50])


# --- a row mask dropping rows before and between the keep rows ---

DROPPED_ROWS = (0, 1, 2, 6, 7, 11)  # before the first kept row (the LM head's compacted row 0), between kept rows, last
DROPPED_ROWS_N = 12


def dropped_rows_case(seed=23):
    """(hidden, weight, tokens, row_mask, {with: keep rows, without: keep rows}): the rows of DROPPED_ROWS dropped by
    the row mask (token -100, as a rollout's prompt rows), the kept rows' keep sets sharing ids (a nucleus without and
    with the target, the full vocabulary, only the target, duplicates); "with", the dropped rows list every kept
    row's ids and targets (a real rollout's prompt rows carry nuclei too); "without", the dropped rows list none."""
    hidden, weight, tokens = linear_inputs((DROPPED_ROWS_N,), torch.float32, seed)
    row_mask = torch.ones(DROPPED_ROWS_N, dtype=torch.bool)
    row_mask[list(DROPPED_ROWS)] = False
    tokens = torch.where(row_mask, tokens, -100)
    gen = torch.Generator().manual_seed(seed + 1)
    patterns = iter([
        lambda t, a, b: [FREQUENT_ID, a, b],  # the first kept row: its nucleus without the target
        lambda t, a, b: [FREQUENT_ID, t, a],
        lambda t, a, b: [],  # the full vocabulary
        lambda t, a, b: [t],
        lambda t, a, b: [a, FREQUENT_ID, a, b],
        lambda t, a, b: [b, FREQUENT_ID],
    ])
    kept = [[] for _ in range(DROPPED_ROWS_N)]
    for r in torch.nonzero(row_mask).squeeze(1).tolist():
        t = int(tokens[r])
        a, b = [i for i in torch.randperm(V_GLOBAL, generator=gen).tolist() if i not in (t, FREQUENT_ID)][:2]
        kept[r] = next(patterns)(t, a, b)
    listed = sorted({i for row in kept for i in row} | set(tokens[row_mask].tolist()))
    with_entries = [row if row_mask[r] else listed[r % 3:] for r, row in enumerate(kept)]
    return hidden, weight, tokens, row_mask, {"with": with_entries, "without": kept}


@pytest.mark.parametrize("kernels", [pytest.param(False, id="torch"), pytest.param(True, id="triton", marks=[
    pytest.mark.skipif(triton_skip_reason(DEVICE) is not None, reason=triton_skip_reason(DEVICE) or "")])])
def test_entries_of_compacted_rows_are_those_of_the_call_rows(kernels):
    """The LM head's entries over its compacted rows (a row mask's kept rows) count exactly the listings that the
    entries over the call's rows with that row mask count: a dropped row's ids, which sit on compacted row 0 as an
    index, never count, nor stop the kept rows' own first listings of the same ids from counting."""
    _, _, tokens, row_mask, kept = dropped_rows_case()
    shard = sparse_keep.KeepShard(vocab_size=V_GLOBAL, v_global=V_GLOBAL, vocab_start=0, n_valid=V_GLOBAL)
    rows = torch.nonzero(row_mask).squeeze(1).to(DEVICE)
    tokens, row_mask = tokens.to(DEVICE), row_mask.to(DEVICE)
    for which in ("with", "without"):
        keep = sparse_keep.SparseKeep(*csr(kept[which]))
        call = sparse_keep.entries(keep, tokens, rows=None, row_mask=row_mask, shard=shard, kernels=False)
        compact = sparse_keep.entries(keep, tokens[rows], rows=rows, row_mask=None, shard=shard, kernels=kernels)
        n_ids = keep.ids.numel()
        assert torch.equal(compact.ok[:n_ids], call.ok[:n_ids]), which
        assert torch.equal(compact.ok[n_ids:], call.ok[n_ids:][rows]), which
        assert torch.equal(rows[compact.row[:n_ids][compact.ok[:n_ids]]], call.row[:n_ids][call.ok[:n_ids]]), which


@with_each_backend
def test_logits_op_row_mask_drops_rows_before_and_between_keep_rows(backend):
    """The logits op with a keep set and a row mask dropping rows before, between and after the keep rows, with and
    without entries on the dropped rows: against float64 (the dense keep_mask's); dropped rows get no gradient, and
    their entries change nothing."""
    hidden, weight, tokens, row_mask, kept = dropped_rows_case()
    logits = (hidden @ weight.T).contiguous()
    lead = tuple(tokens.shape)
    w_lp, w_ent = make_weights(lead, 4), make_weights(lead, 5, low=-1.0, high=1.0)
    opts = dict(entropy="grad", temperature=0.7, row_mask=row_mask, backend=backend)
    mask = dense_mask(kept["without"], V_GLOBAL, lead)
    ref = reference_log_probs_and_entropy(logits, tokens, keep_mask=mask, grad_log_probs=w_lp, grad_entropy=w_ent,
                                          **opts)
    got = {}
    for which, rows in kept.items():
        got[which] = lp, ent, grad = run_logits(logits, tokens, keep=csr(rows), w_lp=w_lp, w_ent=w_ent, **opts)
        assert_log_probs_close(lp.cpu(), ref.log_probs)
        assert_entropy_close(ent.cpu(), ref.entropy)
        assert_grad_close(grad.cpu(), ref.grad, torch.float32)
        assert not grad[~row_mask.to(grad.device)].any(), which
    for a, b in zip(got["with"], got["without"]):
        assert torch.equal(a, b)


@with_each_backend
@pytest.mark.parametrize("op", ["head", "token_loss"])
def test_lm_head_row_mask_drops_rows_before_and_between_keep_rows(backend, op):
    """linear_log_probs_and_entropy and linear_token_loss (its closure's keep log-probs and its gradients) with a keep
    set and a row mask dropping rows before its first kept row (the compacted row 0), between and after the keep
    rows, with and without entries on the dropped rows: against the float64 bounds of the dense keep_mask; the
    entries on dropped rows change no log-prob or entropy."""
    hidden, weight, tokens, row_mask, kept = dropped_rows_case()
    lead = tuple(tokens.shape)
    w_lp, w_ent = make_weights(lead, 4), make_weights(lead, 5, low=-1.0, high=1.0)
    rounding = (_rounding(backend, torch.float32, hidden, weight, row_mask) if op == "head"
                else _loss_rounding(backend, torch.float32, hidden, weight))
    expected = bounds(hidden, weight, tokens, w_lp, w_ent, temperature=0.7, row_mask=row_mask,
                      keep_mask=dense_mask(kept["without"], V_GLOBAL, lead), **rounding)
    run = run_head if op == "head" else run_loss
    got = {}
    for which, rows in kept.items():
        got[which] = lp, ent, dx, dw = run(hidden, weight, tokens, keep=csr(rows), w_lp=w_lp, w_ent=w_ent,
                                           backend=backend, temperature=0.7, row_mask=row_mask)
        for name, value in zip(("log_probs", "entropy", "dx", "dw"), (lp, ent, dx, dw)):
            assert_within(f"{name} ({which} entries on dropped rows)", value.cpu(), expected[name])
    assert torch.equal(got["with"][0], got["without"][0]) and torch.equal(got["with"][1], got["without"][1])


# --- TP = 1, 2, 4: bitwise ---

def _tp_inputs():
    logits, tokens, row_mask, kept = logits_case(dtype=torch.bfloat16, vocab_size=V_GLOBAL - 6, rows=True)
    hidden, weight, h_tokens, h_row_mask, h_kept = head_case(dtype=torch.bfloat16, vocab_size=V_GLOBAL - 6, rows=True)
    return dict(logits=(logits, tokens, row_mask, kept), head=(hidden, weight, h_tokens, h_row_mask, h_kept),
                w_lp=make_weights((N_ROWS,), 4), w_ent=make_weights((N_ROWS,), 5, low=-1.0, high=1.0))


def _tp_results(rank, world_size, group, device, backends):
    case = _tp_inputs()
    w_lp, w_ent = case["w_lp"], case["w_ent"]
    out = {}
    for backend in backends:
        logits, tokens, row_mask, kept = case["logits"]
        lp, ent, grad = run_logits(shard_vocab(logits, rank, world_size), tokens, keep=csr(kept, device),
                                   w_lp=w_lp[:LOGITS_ROWS], w_ent=w_ent[:LOGITS_ROWS], device=device, tp_group=group,
                                   entropy="grad", temperature=0.7, vocab_size=V_GLOBAL - 6, row_mask=row_mask,
                                   backend=backend)
        out[f"logits_{backend}"] = dict(log_probs=lp.cpu(), entropy=ent.cpu(), grad=grad.cpu())
        hidden, weight, h_tokens, h_row_mask, h_kept = case["head"]
        lp, ent, dx, dw = run_head(hidden, weight.chunk(world_size)[rank], h_tokens, keep=csr(h_kept, device),
                                   w_lp=w_lp, w_ent=w_ent, device=device, tp_group=group, temperature=0.7,
                                   vocab_size=V_GLOBAL - 6, row_mask=h_row_mask, backend=backend)
        out[f"head_{backend}"] = dict(log_probs=lp.cpu(), entropy=ent.cpu(), dx=dx.cpu(), dw=dw.cpu())
        lp, ent, dx, dw = run_loss(hidden, weight.chunk(world_size)[rank], h_tokens, keep=csr(h_kept, device),
                                   w_lp=w_lp, w_ent=w_ent, device=device, tp_group=group, temperature=0.7,
                                   vocab_size=V_GLOBAL - 6, row_mask=h_row_mask, backend=backend)
        out[f"loss_{backend}"] = dict(log_probs=lp.cpu(), entropy=ent.cpu(), dx=dx.cpu(), dw=dw.cpu())
    return out


def _runnable_backends(device=DEVICE):
    return ["torch"] + (["triton"] if triton_skip_reason(device) is None else [])


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return results_by_tp(str(tmp_path_factory.mktemp("sparse_keep_tp")), _tp_results, _runnable_backends(),
                         one_gpu=DEVICE.type == "cuda")


# dX at TP > 1 sums each rank's contribution (its segments and its kept ids) in another order than TP = 1 and rounds
# once to bf16, as TP = 1 does: within two bf16 roundings of the largest entry (test_linear_log_probs's bound).
DX_ACROSS_TP_MAX_REL = 2.0**-7


# TP = 2 and TP = 4 each under a fixture of their own: a sharded CPU target then runs the two spawns in two shards
# (tests/conftest.py keeps a fixture's cases together), each shard also running TP = 1 in its own process.
@pytest.fixture(scope="module")
def results_at_tp2(tp_results):
    return tp_results


@pytest.fixture(scope="module")
def results_at_tp4(tp_results):
    return tp_results


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("tp", [world_size_param(2)])
def test_tp_bitwise_invariant(results_at_tp2, backend, tp):
    _assert_tp_bitwise_invariant(results_at_tp2, backend, tp)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("tp", [world_size_param(4)])
def test_tp_bitwise_invariant_at_tp4(results_at_tp4, backend, tp):
    _assert_tp_bitwise_invariant(results_at_tp4, backend, tp)


def _assert_tp_bitwise_invariant(tp_results, backend, tp):
    tp1 = tp_results(1)[0]
    for rank, got in enumerate(tp_results(tp)):
        for op in ("logits", "head"):
            want, have = tp1[f"{op}_{backend}"], got[f"{op}_{backend}"]
            for name in ("log_probs", "entropy"):
                assert torch.equal(have[name], want[name]), f"{op} TP={tp} rank {rank}: {name} differs from TP=1"
        want, have = tp1[f"logits_{backend}"], got[f"logits_{backend}"]
        assert torch.equal(have["grad"], shard_vocab(want["grad"], rank, tp)), f"logits grad TP={tp} rank {rank}"
        for op in ("head", "loss"):  # the general op and the token loss
            want, have = tp1[f"{op}_{backend}"], got[f"{op}_{backend}"]
            for name in ("log_probs", "entropy"):
                assert torch.equal(have[name], want[name]), f"{op} TP={tp} rank {rank}: {name} differs from TP=1"
            assert torch.equal(have["dw"], want["dw"].chunk(tp)[rank]), f"{op} dW TP={tp} rank {rank}"
            dx, dx1 = have["dx"].double(), want["dx"].double()
            assert ((dx - dx1).abs() <= DX_ACROSS_TP_MAX_REL * dx1.abs().max()).all(), f"{op} dX TP={tp} rank {rank}"


# --- bad keep sets: one error naming keep, on every rank ---

def _bad_keep_cases(n_rows, vocab):
    """id -> (function of a valid (ids, offsets) -> keyword changes, exception type, text in the message)."""
    def with_ids(ids_fn):
        return lambda ids, off: dict(keep=(ids_fn(ids), off))

    def with_offsets(off_fn):
        return lambda ids, off: dict(keep=(ids, off_fn(off)))

    def set_at(t, i, value):
        t = t.clone()
        t[i] = value
        return t

    return {
        "id_equal_to_vocab": (with_ids(lambda ids: set_at(ids, 2, vocab)), ValueError, "keep ids"),
        "id_negative": (with_ids(lambda ids: set_at(ids, 0, -1)), ValueError, "keep ids"),
        "id_in_padding": (lambda ids, off: dict(keep=(set_at(ids, 1, vocab - 1), off), vocab_size=vocab - 1),
                          ValueError, "keep ids"),
        "offsets_decreasing": (with_offsets(lambda off: set_at(off, 2, off[3] + 1)), ValueError, "non-decreasing"),
        "offsets_first_not_zero": (with_offsets(lambda off: set_at(off, 0, 1)), ValueError, "offsets[0]"),
        "offsets_last_not_len": (with_offsets(lambda off: set_at(off, -1, off[-1] - 1)), ValueError, "offsets[-1]"),
        "offsets_too_short": (with_offsets(lambda off: off[:-1]), ValueError, "rows + 1"),
        "offsets_too_long": (with_offsets(lambda off: torch.cat([off, off[-1:]])), ValueError, "rows + 1"),
        "offsets_2d": (with_offsets(lambda off: off[None]), ValueError, "1-D"),
        "ids_float": (with_ids(lambda ids: ids.float()), TypeError, "integers"),
        "ids_bool": (with_ids(lambda ids: ids > 3), TypeError, "integers"),
        "offsets_float": (with_offsets(lambda off: off.double()), TypeError, "integers"),
        "ids_2d": (with_ids(lambda ids: ids[None]), ValueError, "1-D"),
        "not_a_pair": (lambda ids, off: dict(keep=(ids,)), TypeError, "pair"),
        "not_tensors": (lambda ids, off: dict(keep=(ids.tolist(), off)), TypeError, "torch.Tensor"),
        "with_keep_mask": (lambda ids, off: dict(keep=(ids, off), keep_mask=torch.ones(n_rows, BAD_V_LOCAL,
                                                                                        dtype=torch.bool)),
                           ValueError, "keep_mask"),
        "with_sglang_order": (lambda ids, off: dict(keep=(ids, off), reduction_order="sglang"), ValueError,
                              "sglang"),
    }


BAD_ROWS, BAD_V_LOCAL = 6, 32


def _call_bad(case_id, backend, device, tp_group=None, world_size=1):
    """log_probs_and_entropy with case `case_id` ("valid": a valid keep set) on rows of BAD_V_LOCAL columns per
    rank; the exception raised, or None."""
    vocab = BAD_V_LOCAL * world_size
    logits = make_logits((BAD_ROWS, BAD_V_LOCAL)).to(device)
    tokens = make_tokens((BAD_ROWS,), vocab - 2).to(device)  # none in the last column: id_in_padding pads it
    ids, off = csr([[1, 2], [3], [], [vocab - 2, 0], [5], [6, 7]], device)
    build = _valid_case if case_id == "valid" else _bad_keep_cases(BAD_ROWS, vocab)[case_id][0]
    kwargs = dict(entropy="grad", backend=backend, tp_group=tp_group)
    kwargs.update({k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in build(ids, off).items()})
    try:
        ppo_ops.log_probs_and_entropy(logits.requires_grad_(True), tokens, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the caller checks it
        return exc
    return None


def _check_raised(case_id, exc, world_size=1):
    _, exc_type, text = _bad_keep_cases(BAD_ROWS, BAD_V_LOCAL * world_size)[case_id]
    assert exc is not None, f"{case_id}: no error"
    assert type(exc) is exc_type, f"{case_id}: {type(exc).__name__}: {exc}"
    assert "keep" in str(exc) and text in str(exc), f"{case_id}: {exc}"


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("case_id", sorted(_bad_keep_cases(BAD_ROWS, BAD_V_LOCAL)))
def test_bad_keep_raises_naming_it(case_id, backend):
    _check_raised(case_id, _call_bad(case_id, backend, DEVICE))


def test_bad_keep_lm_head_and_token_loss():
    """The LM head's ops take the same checks: local ones before any work (both ops), value ones in the one read."""
    hidden, weight, tokens = linear_inputs((4,), torch.float32, 3)
    ids, off = csr([[1], [2, 3], [], [4]], "cpu")
    with pytest.raises(ValueError, match="keep ids"):
        ppo_ops.linear_log_probs_and_entropy(hidden, weight, tokens, keep=(torch.tensor([1, 2, 3, V_GLOBAL]), off))
    with pytest.raises(ValueError, match="non-decreasing"):
        ppo_ops.linear_log_probs_and_entropy(hidden, weight, tokens, keep=(ids, torch.tensor([0, 2, 1, 3, 4])))
    with pytest.raises(ValueError, match="rows \\+ 1"):
        ppo_ops.linear_token_loss(hidden, weight, tokens, lambda lp, ent, rows: -lp, keep=(ids, off[:-1]))
    with pytest.raises(TypeError, match="keep ids must hold integers"):
        ppo_ops.linear_token_loss(hidden, weight, tokens, lambda lp, ent, rows: -lp, keep=(ids.float(), off))


def _collective_worker(rank, world_size, backends):
    group = dist.group.WORLD
    failures = []
    for backend in backends:
        for case_id in sorted(_bad_keep_cases(BAD_ROWS, BAD_V_LOCAL * world_size)):
            if case_id == "with_sglang_order":
                continue  # the sglang order's own shard check may speak first at 32 columns per rank
            # Rank 1 alone has the bad keep set; rank 0's is valid: both must raise the same error, naming keep.
            exc = _call_bad(case_id, backend, "cpu", group, world_size) if rank == 1 else \
                _call_bad("valid", backend, "cpu", group, world_size)
            try:
                assert exc is not None, "no error"
                assert "keep" in str(exc), f"{type(exc).__name__}: {exc}"
                assert getattr(exc, "ppo_ops_argument", None) == "keep", f"argument {exc!r}"
            except AssertionError as err:
                failures.append(f"rank {rank}, {backend}, {case_id}: {err}")
        # Ranks whose keep sets differ: the checksum disagrees, both raise naming keep.
        ids, off = csr([[1, 2], [3], [], [rank, 0], [5], [6, 7]], "cpu")
        try:
            ppo_ops.log_probs_and_entropy(make_logits((BAD_ROWS, BAD_V_LOCAL)), make_tokens((BAD_ROWS,), 64),
                                          keep=(ids, off), tp_group=group, backend=backend)
            failures.append(f"rank {rank}, {backend}, keep differing across ranks: no error")
        except ValueError as exc:
            if "keep" not in str(exc) or "differs across" not in str(exc):
                failures.append(f"rank {rank}, {backend}, keep differing across ranks: {exc}")
    assert not failures, "\n".join(failures)


def _valid_case(ids, off):
    return dict(keep=(ids, off))


def test_the_valid_keep_set_of_the_bad_cases_is_valid():
    assert _call_bad("valid", "torch", DEVICE) is None


def test_bad_keep_raises_on_every_rank_at_tp2():
    """Gloo ranks on CPU wherever the suite runs: rank 1's bad keep set raises on both ranks, naming keep."""
    run_gloo(2, _collective_worker, _runnable_backends("cpu"), timeout_s=60, deadline_s=240)


def test_one_host_read_per_call_with_keep(monkeypatch):
    """validate=True: the keep set's value checks ride in the call's one host read (TP = 1)."""
    reads = []
    original = agreement.read_to_host
    monkeypatch.setattr(agreement, "read_to_host", lambda t: reads.append(1) or original(t))
    logits, tokens, _, kept = logits_case(lead=(8,))
    run_logits(logits, tokens, keep=csr(kept), w_lp=make_weights((8,), 4), backend="torch")
    assert len(reads) == 1


@with_each_backend
def test_validate_false_malformed_keep_is_memory_safe(backend):
    """validate=False reads nothing: a malformed keep set gives unspecified values, never a crash or NaN."""
    logits, tokens, _, kept = logits_case(lead=(8,))
    ids, off = csr(kept)
    bad_ids = ids.clone()
    bad_ids[::3] = 10**6
    bad_off = off.clone()
    bad_off[3] = off[-1] + 5
    short_off = off.clone()
    short_off[0], short_off[-1] = 3, off[-1] - 4  # ids before the first row and after the last
    for keep in ((bad_ids, off), (ids, bad_off), (ids, -off), (ids, short_off), (ids, off.flip(0))):
        lp, _, grad = run_logits(logits, tokens, keep=keep, w_lp=make_weights((8,), 4), backend=backend,
                                 validate=False)
        assert not torch.isnan(lp).any() and torch.isfinite(grad).all()


def long_rows(n_rows, vocab, seed=11):
    """Rows of 0 to 300 ids drawn from a few dozen ids, so that most are listed more than once and the repeats lie in
    other steps of the row's kernel program than the first listing; some rows list their target."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [0, 1, 15, 16, 17, 33, 64, 65, 130, 300]
    rows, tokens = [], make_tokens((n_rows,), vocab, seed)
    for r in range(n_rows):
        pool = torch.randint(0, vocab, (24,), generator=gen)
        row = pool[torch.randint(0, 24, (lengths[r % len(lengths)],), generator=gen)].tolist()
        if r % 3 == 0 and row:
            row[len(row) // 2] = int(tokens[r])
        rows.append(row)
    return rows, tokens


@pytest.mark.skipif(triton_skip_reason(DEVICE) is not None, reason=triton_skip_reason(DEVICE) or "")
@pytest.mark.parametrize("steps", [(16, 32), (64, 256)], ids=["small-steps", "as-compiled"])
def test_logits_entries_kernel_matches_the_sorted_entries(steps):
    """The logits op's per-row entries kernel (first listings by comparing steps, and by a bitmap in the scanner
    programs for rows past the pairwise bound) marks exactly the entries the sorted path marks, with the same rows,
    columns and kept logits: on one shard of three, with a row mask and the padding past vocab_size."""
    from ppo_ops.core import sparse_keep_kernels
    chunk, pairwise_max = steps
    n_rows, vocab, v_global = 30, 200, 208
    kept, tokens = long_rows(n_rows, vocab)
    ids, off = csr(kept)
    logits = make_logits((n_rows, 80), torch.float32, 2).to(DEVICE)
    row_mask = (torch.arange(n_rows) % 7 != 5).to(DEVICE)
    tokens = tokens.to(DEVICE)
    keep = sparse_keep.SparseKeep(ids, off)
    shard = sparse_keep.KeepShard(vocab_size=vocab, v_global=v_global, vocab_start=80, n_valid=80)
    want = sparse_keep.entries(keep, tokens, rows=None, row_mask=row_mask, shard=shard, kernels=False)
    row, gid, ok, local, col, z = sparse_keep_kernels.logits_entries(keep, tokens, row_mask, logits, 0.5, shard,
                                                                     chunk=chunk, pairwise_max=pairwise_max)
    assert torch.equal(ok, want.ok) and torch.equal(local, want.local)
    assert want.ok.sum() < ids.numel() // 2  # most listings are repeats
    assert torch.equal(row[want.ok], want.row[want.ok]) and torch.equal(col[local], want.col[local])
    assert torch.equal(gid, want.gid)
    want_z = torch.where(want.local, logits[want.row, want.col] * 0.5, 0.0)
    assert torch.equal(z, want_z)


def test_fixed_point_row_sums_do_not_overflow():
    """A row keeping the whole of a large vocabulary sums vocab_size + 1 terms of 2^fixed_bits at most."""
    for vocab in (1, 256, 151936, 1 << 20):
        bits = sparse_keep.fixed_bits(vocab)
        assert (vocab + 1) * 2**bits < 2**62 and bits >= 40


# --- the dlogits entry point for blocked backends (the token loss) ---

@with_each_backend
def test_add_to_dlogits_blocks_match_the_keep_gradient(backend):
    """A backend forming dlogits block by block (row blocks x column segments, a vocabulary-major buffer among them)
    with the log-prob gradient zeroed on keep rows (dense_grad), then add_to_dlogits on each block, gets the keep
    op's gradient: the same terms, each rounded once in fp32 here."""
    logits, tokens, _, kept = logits_case()
    keep = csr(kept)
    w_lp, w_ent = make_weights((LOGITS_ROWS,), 4), make_weights((LOGITS_ROWS,), 5, low=-1.0, high=1.0)
    call = shell.prepare_logits("test", logits.to(DEVICE), tokens.to(DEVICE), tp_group=None, entropy="grad",
                                keep_mask=None, temperature=0.7, row_mask=None, vocab_size=None, chunk_size=None,
                                inplace_grad=False, backend=backend, validate=True, keep=keep)
    state, _ = sparse_keep.logits_forward(call.keep, call.rows, call.tokens, None, call.plan,
                                          torch.zeros(LOGITS_ROWS, device=DEVICE))
    dense_w = sparse_keep.dense_grad(w_lp.to(DEVICE), state)
    _, _, dl = run_logits(logits, tokens, w_lp=dense_w, w_ent=w_ent, entropy="grad", temperature=0.7,
                          backend=backend)
    coef = sparse_keep.coefficients(state, w_lp.to(DEVICE))
    vocab_major = dl.T.contiguous()
    for r0 in range(0, LOGITS_ROWS, 10):
        for c0 in range(0, V_GLOBAL, 96):
            target = vocab_major.T if c0 == 96 else dl
            sparse_keep.add_to_dlogits(state, coef, target[r0:r0 + 10, c0:c0 + 96], r0, c0)
    dl[:, 96:192] = vocab_major.T[:, 96:192]
    want = run_logits(logits, tokens, keep=keep, w_lp=w_lp, w_ent=w_ent, entropy="grad", temperature=0.7,
                      backend=backend)[2]
    assert ((dl - want).abs() <= SPARSE_VS_DENSE_GRAD_TOL).all()


@pytest.mark.skipif(triton_skip_reason(DEVICE) is not None, reason=triton_skip_reason(DEVICE) or "")
def test_header_values_kernel_matches_torch():
    """The keep set's header values (validation) formed by the Triton kernel equal the torch ops' (the CPU path)."""
    from ppo_ops.core import sparse_keep_kernels
    ids, off = csr(keep_rows(make_tokens((40,), V_GLOBAL), V_GLOBAL), "cpu")
    cases = [(ids, off), (ids[:0], torch.zeros(41, dtype=torch.int64)), (ids - 3, off.flip(0)), (ids + 10**9, off + 1)]
    for case_ids, case_off in cases:
        want = sparse_keep.header_values(sparse_keep.SparseKeep(case_ids, case_off), "cpu")
        got = sparse_keep_kernels.header_values(case_ids.to(DEVICE), case_off.to(DEVICE))
        assert got.cpu().tolist() == want.tolist()
