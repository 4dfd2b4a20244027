"""ppo_ops.linear_log_probs_and_entropy: the fused LM head (hidden @ weight.T -> log-prob, entropy), both backends.

What is checked, per backend ("torch"; "triton" under TRITON_INTERPRET=1 on CPU, compiled on CUDA):
- identity with the logits op on the fp32 logits the same GEMM tiles produce (each backend exposes its tile GEMM as
  `tile_logits`), with and without a row mask: bitwise for the PyTorch backend (it runs the logits op's own code on
  each tile), within the logits op's fp32 tolerances for the Triton one (same logits, other reduction order);
- values and both gradients against a float64 reference, within bounds derived per element from the rounding of the
  GEMMs (see `_bounds`);
- bitwise TP invariance of log-probs, entropies and dW at TP = 1, 2, 4 (gloo on CPU, NCCL on GPUs), dX within its
  bound, and reduce_dx=False returning per-rank contributions that sum to dX; on CUDA also the compiled kernels at
  Qwen3's shapes at TP = 2 and 4 with every rank on one GPU (gloo), so a one-GPU runner checks TP > 1 too;
- row mask (dropped rows: zeros, no gradient; kept rows bitwise as without the mask), run-to-run determinism,
  caller's tensors untouched, empty input, argument errors, NumPy scalars as numbers;
- the value checks read the device once per call with validate=True and never with validate=False (counted at
  `agreement.read_to_host`), at TP = 1 and TP = 2;
- collective failure on a 2-rank gloo group (a collective timeout and a join deadline, so a hang fails): a bad token,
  a bad weight shape, a non-bool reduce_dx or a NaN weight on ONE rank makes both ranks raise the same error naming the
  rank and the argument; tp_group=None inside the job is one rank.
"""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ppo_ops
from ppo_ops.core import agreement, layout as _layout
from ppo_ops.lm_head import gemms as _gemms, paths as _paths
from tests.core_support import (CaseFailures, backend_params, compile_check_report, make_weights, triton_skip_reason)
from tests.linear_support import (HIDDEN, QWEN3_TEMPERATURE, QWEN3_TOKENS, QWEN3_TP_SHAPES, QWEN3_TP_SIZES,
                                  QWEN3_VOCAB, UNIT_ROUNDOFF, V_GLOBAL, assert_tp_invariant, qwen3_inputs,
                                  qwen3_kept_rows, tp_record)
from tests.linear_support import assert_within as _assert_within
from tests.linear_support import bounds as _bounds
from tests.linear_support import inputs as _inputs
from tests.ranks import DEVICE, results_by_tp, run_gloo, world_size_param
from tests.reference import ENTROPY_TOL, LOG_PROB_TOL

HALF = (torch.bfloat16, torch.float16)


def _segment_path(backend, dtype):
    """Whether the op takes the segment-GEMM backend (lm_head/segment_gemms.py): Triton with half precision."""
    return backend == "triton" and dtype in HALF


def _tile_logits(backend, dtype):
    """The tile_logits of the path the op takes for (backend, dtype)."""
    if _segment_path(backend, dtype):
        return _gemms.tile_logits
    if backend == "torch":
        from ppo_ops.lm_head import torch_backend
        return torch_backend.tile_logits
    from ppo_ops.lm_head import triton_backend
    return triton_backend.tile_logits


def _run(hidden, weight, tokens, g_lp=None, g_ent=None, device=DEVICE, **opts):
    """Forward (+ backward when upstream weights are given) on leaf copies: (log_probs, entropy, dX, dW) on CPU."""
    h = hidden.detach().to(device).clone().requires_grad_(True)
    w = weight.detach().to(device).clone().requires_grad_(True)
    opts = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in opts.items()}
    out = ppo_ops.linear_log_probs_and_entropy(h, w, tokens.to(device), **opts)
    outs, gs = [], []
    if g_lp is not None:
        outs.append(out.log_probs), gs.append(g_lp.to(device))
    if g_ent is not None and opts.get("entropy") == "grad":
        outs.append(out.entropy), gs.append(g_ent.to(device))
    dx = dw = None
    if outs:
        dx, dw = torch.autograd.grad(outs, (h, w), gs)
        dx, dw = dx.cpu(), dw.cpu()
    ent = None if out.entropy is None else out.entropy.detach().cpu()
    return out.log_probs.detach().cpu(), ent, dx, dw


# --- bitwise identity with the logits op on the same tiles' logits ---

def _segment_len(v_local, world_size=1):
    return _layout.segment_length(v_local, world_size)


def _check_matches_logits_op_once(backend, dtype, temperature, vocab_size, row_mask, seed):
    lead = (3, 5)
    hidden, weight, tokens = _inputs(lead, dtype, seed)
    if vocab_size is not None:
        tokens = tokens.clamp(max=vocab_size - 1)
    if row_mask is not None:
        tokens = torch.where(row_mask, tokens, -100)
    tile_logits = _tile_logits(backend, dtype)
    h2 = hidden.reshape(-1, HIDDEN).to(DEVICE)
    rows = torch.arange(h2.shape[0]) if row_mask is None else torch.nonzero(row_mask.reshape(-1)).squeeze(1)
    logits = torch.zeros((h2.shape[0], V_GLOBAL), dtype=torch.float32, device=DEVICE)
    logits[rows.to(DEVICE)] = tile_logits(h2[rows.to(DEVICE)].contiguous(), weight.to(DEVICE), _segment_len(V_GLOBAL))
    opts = dict(entropy="grad", temperature=temperature, vocab_size=vocab_size, backend=backend)
    if row_mask is not None:
        opts["row_mask"] = row_mask.to(DEVICE)
    want = ppo_ops.log_probs_and_entropy(logits.reshape(lead + (V_GLOBAL,)), tokens.to(DEVICE), **opts)
    got = ppo_ops.linear_log_probs_and_entropy(hidden.to(DEVICE), weight.to(DEVICE), tokens.to(DEVICE), **opts)
    if backend == "torch":
        # the logits op's own code on each tile
        assert torch.equal(got.log_probs, want.log_probs), "log_probs differ bitwise from the logits op"
        assert torch.equal(got.entropy, want.entropy), "entropy differs bitwise from the logits op"
    else:
        # The Triton GEMM kernels (fp32 inputs: lm_head/triton_backend.py; half precision: the segment-GEMM backend's
        # one-GEMM forward) reduce [rows x BLOCK_N] GEMM tiles, the logits op's kernel lanes of one row: reductions in
        # another order, so the logits op's own fp32 tolerances apply, which bound any correct fp32 reduction order.
        lp_err = (got.log_probs - want.log_probs).abs()
        assert bool((lp_err <= LOG_PROB_TOL * want.log_probs.abs().clamp(min=1)).all()), lp_err.max()
        assert bool(((got.entropy - want.entropy).abs() <= ENTROPY_TOL).all())


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("dtype,temperature,vocab_size,masked", [
    (torch.float32, 1.0, None, False),  # plain fp32
    (torch.bfloat16, 0.7, 250, True),  # the production dtype, a temperature, padding in the last segment, row mask
])
def test_matches_logits_op_bitwise(backend, dtype, temperature, vocab_size, masked):
    row_mask = None
    if masked:
        row_mask = torch.tensor([[True, False, True, True, False], [False] * 5, [True, True, False, True, True]])
    _check_matches_logits_op_once(backend, dtype, temperature, vocab_size, row_mask, seed=11)


# --- values and gradients against float64 ---

def _dl_roundoff(backend, dtype):
    """Rounding of dlogits before the backward GEMMs: the Triton backend (both of its paths) feeds them to its GEMMs
    in the input dtype."""
    return UNIT_ROUNDOFF[dtype] if backend == "triton" and dtype != torch.float32 else 0.0


def _held_rows(backend, dtype, hidden, weight, row_mask=None, working_memory=None):
    """[rows] bool over the flattened rows: those whose dlogits the segment-GEMM backend forms from the fp16
    probabilities its forward held (the first paths.held_rows of the kept rows within the call's
    working_memory, where the one-GEMM forward applies)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    kept = torch.ones(flat.shape[0], dtype=torch.bool) if row_mask is None else row_mask.reshape(-1).cpu()
    held = torch.zeros_like(kept)
    if not _segment_path(backend, dtype) or triton_skip_reason(DEVICE) is not None:
        return held
    from ppo_ops.lm_head import gemm_partials  # triton: present here
    if not gemm_partials.applies(flat.to(DEVICE).contiguous(), weight.to(DEVICE)):
        return held
    rows = torch.nonzero(kept).squeeze(1)
    held[rows[:_paths.held_rows(rows.numel(), _segment_len(weight.shape[0]), DEVICE, working_memory)]] = True
    return held


def _rounding(backend, dtype, hidden, weight, row_mask=None, working_memory=None):
    """The bounds' rounding terms of the path the op takes: dlogits' rounding and the rows held as probabilities."""
    return dict(dl_roundoff=_dl_roundoff(backend, dtype),
                prob_storage=_held_rows(backend, dtype, hidden, weight, row_mask, working_memory))


def _check_vs_float64_once(backend, dtype, temperature, vocab_size, masked, lead=(2, 7), v=V_GLOBAL):
    hidden, weight, tokens = _inputs(lead, dtype, seed=21, v=v)
    g_lp = make_weights(lead, 22)
    g_ent = make_weights(lead, 23, low=-1.0, high=1.0)
    row_mask = None
    if vocab_size is not None:
        tokens = tokens.clamp(max=vocab_size - 1)
    opts = dict(entropy="grad", temperature=temperature, vocab_size=vocab_size, backend=backend)
    if masked:
        row_mask = torch.rand(lead, generator=torch.Generator().manual_seed(24)) < 0.6
        row_mask.view(-1)[0], row_mask.view(-1)[-1] = True, False
        opts["row_mask"] = row_mask
    lp, ent, dx, dw = _run(hidden, weight, tokens, g_lp, g_ent, **opts)
    bounds = _bounds(hidden, weight, tokens, g_lp, g_ent, temperature=temperature, vocab_size=vocab_size,
                     row_mask=row_mask, **_rounding(backend, dtype, hidden, weight, row_mask))
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert dx.dtype == dtype and dw.dtype == dtype
    _assert_within("log_probs", lp, bounds["log_probs"])
    _assert_within("entropy", ent, bounds["entropy"])
    _assert_within("dX", dx, bounds["dx"])
    _assert_within("dW", dw, bounds["dw"])
    if masked:
        assert bool((lp[~row_mask] == 0).all() and (ent[~row_mask] == 0).all() and (dx[~row_mask] == 0).all())
    if vocab_size is not None:
        assert bool((dw[vocab_size:] == 0).all()), "padding rows of the weight got a gradient"


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("dtype,temperature,vocab_size,masked", [
    (torch.float32, 1.0, None, False),  # fp32 end to end: bounds of a few 1e-6
    (torch.bfloat16, 1.3, 200, True),  # bf16 in/out, temperature, 56 padding columns (two segments), row mask
    (torch.float16, 0.8, None, False),  # fp16 in/out
])
def test_values_and_gradients_vs_float64(backend, dtype, temperature, vocab_size, masked):
    _check_vs_float64_once(backend, dtype, temperature, vocab_size, masked)


@pytest.mark.parametrize("backend", [p for p in backend_params(DEVICE) if p.id == "triton"])
def test_chunked_path_crosses_blocks_and_groups_vs_float64(backend):
    """Rows over several row blocks and dW groups of the segment-GEMM backend (on CPU its blocks are 16 rows, groups
    32): the last block padded, dW accumulated in fp32 across groups."""
    shape = _paths.block_shape(DEVICE)
    _check_vs_float64_once(backend, torch.bfloat16, 1.0, 230, True,
                           lead=(shape.group_rows + shape.block_rows // 2 + 3,))


@pytest.mark.parametrize("backend", [p for p in backend_params(DEVICE) if p.id == "triton"])
def test_segments_of_any_width_take_the_fused_recompute_vs_float64(backend):
    """A vocabulary of 8 x 13 columns: a segment's row of dlogits is 26 bytes, no 16-byte multiple, yet the fused
    recompute writes them (its buffer is vocabulary-major: a column's rows are what TMA stores)."""
    from ppo_ops.lm_head import gemm_dlogits, gemm_partials
    v = 8 * 13
    hidden, weight = (torch.empty(shape, dtype=torch.bfloat16, device=DEVICE) for shape in ((1, HIDDEN), (v, HIDDEN)))
    assert gemm_partials.applies(hidden, weight) and gemm_dlogits.applies(hidden, weight)
    _check_vs_float64_once(backend, torch.bfloat16, 1.3, 100, True, lead=(3, 7), v=v)


def test_held_rows_at_qwen3_shape():
    """How many rows the chunked forward holds as probabilities: 1 GiB at the global vocabulary, rounded down to 256
    rows, never more than the call's rows (across dW groups); the interpreter's cap is one row block."""
    cuda, seg_len = torch.device("cuda"), 151936 // 8
    assert _paths.held_rows(32768, seg_len, cuda) == 3328
    assert 3328 * 151936 * 2 <= _paths.HELD_BYTES < 3584 * 151936 * 2
    assert _paths.held_rows(3000, seg_len, cuda) == 3000
    assert _paths.held_rows(32768, 4096 // 8, cuda) == 32768  # a small vocabulary: every row, every group
    cpu = torch.device("cpu")
    assert _paths.held_rows(43, 32, cpu) == _paths.HOST_HELD_ROWS == _paths.HOST_SHAPE.block_rows
    assert _paths.held_rows(5, 32, cpu) == 5


def test_held_rows_follow_the_working_memory():
    """A caller's working_memory sets the held rows: its bytes at 2 per logit of the global vocabulary, rounded down
    to the row step, at most the call's rows (past one dW group where it allows); 0 holds none."""
    cuda, seg_len, row_bytes = torch.device("cuda"), 151936 // 8, 151936 * 2
    assert _paths.held_rows(32768, seg_len, cuda, 0) == 0
    assert _paths.held_rows(32768, seg_len, cuda, 2**31) == 2**31 // row_bytes // 256 * 256 == 6912
    assert _paths.held_rows(32768, seg_len, cuda, int(2.5 * 2**30)) == 8704 > _paths.CUDA_SHAPE.group_rows
    assert _paths.held_rows(5000, seg_len, cuda, 10 * 2**30) == 5000
    cpu, host_row_bytes = torch.device("cpu"), 32 * 8 * 2
    assert _paths.held_rows(43, 32, cpu, 0) == 0
    assert _paths.held_rows(43, 32, cpu, 20 * host_row_bytes) == 16
    assert _paths.held_rows(43, 32, cpu, 10**9) == 43 > _paths.HOST_SHAPE.group_rows


@pytest.mark.parametrize("backend", [p for p in backend_params(DEVICE) if p.id == "triton"])
def test_working_memory_sets_the_held_rows_of_a_call(backend):
    """working_memory reaches the forward: none held at 0, half a dW group, a whole dW group, every row of a call
    past one group (never more than it allows); log-probs and entropies bitwise the same whatever is held, gradients
    within their float64 bound (the held rows' with the probabilities' rounding)."""
    shape = _paths.block_shape(DEVICE)
    lead = (shape.group_rows + 3,)
    hidden, weight, tokens = _inputs(lead, torch.bfloat16, seed=36)
    tokens = tokens.clamp(max=229)
    g_lp, g_ent = make_weights(lead, 37), make_weights(lead, 38, low=-1.0, high=1.0)
    row_bytes = _segment_len(weight.shape[0]) * 8 * 2
    step = _paths.PROB_ROWS_STEP if DEVICE.type == "cuda" else _paths.HOST_PROB_ROWS_STEP
    half = shape.group_rows // 2 // step * step
    runs = {}
    allowances = (("none", 0), ("half", half * row_bytes + row_bytes // 2), ("group", shape.group_rows * row_bytes),
                  ("all", 10 * lead[0] * row_bytes))
    for name, memory in allowances:
        h = hidden.to(DEVICE).requires_grad_(True)
        w = weight.to(DEVICE).requires_grad_(True)
        out = ppo_ops.linear_log_probs_and_entropy(h, w, tokens.to(DEVICE), entropy="grad", temperature=1.3,
                                                   vocab_size=230, backend=backend, working_memory=memory)
        held = _saved_half_tensors(out)
        expected = {"none": 0, "half": half, "group": shape.group_rows, "all": lead[0]}[name]
        assert [t.shape[1] >= expected for t in held] == ([True] if expected else []), (name, held)
        assert not held or held[0].shape[1] < expected + step, (name, held[0].shape)  # no more than allowed
        grads = torch.autograd.grad((out.log_probs, out.entropy), (h, w), (g_lp.to(DEVICE), g_ent.to(DEVICE)))
        runs[name] = (out.log_probs.detach(), out.entropy.detach(), expected, grads)
    assert 0 < runs["half"][2] < runs["group"][2] < runs["all"][2]
    for name, (lp, ent, cap, (dx, dw)) in runs.items():
        assert torch.equal(lp, runs["none"][0]) and torch.equal(ent, runs["none"][1]), name
        bounds = _bounds(hidden, weight, tokens, g_lp, g_ent, temperature=1.3, vocab_size=230,
                         dl_roundoff=_dl_roundoff(backend, torch.bfloat16), prob_storage=torch.arange(lead[0]) < cap)
        _assert_within(f"dX ({name})", dx.cpu(), bounds["dx"])
        _assert_within(f"dW ({name})", dw.cpu(), bounds["dw"])
    assert not torch.equal(runs["none"][3][1], runs["group"][3][1]), "the held rows' rounding left dW unchanged"
    # the last group's held rows came from their probabilities too: its dX rows differ from the group-only call's
    assert not torch.equal(runs["group"][3][0][shape.group_rows:], runs["all"][3][0][shape.group_rows:])


def _saved_half_tensors(out):
    """The fp16 tensors among the op's autograd node's saved ones (the held probabilities; the inputs are bf16)."""
    node = out.log_probs.grad_fn
    while not hasattr(node, "saved_tensors"):  # through the reshape back to the op's Function
        node = node.next_functions[0][0]
    return [t for t in node.saved_tensors if t is not None and t.dtype == torch.float16]


@pytest.mark.parametrize("backend", [p for p in backend_params(DEVICE) if p.id == "triton"])
@pytest.mark.parametrize("hold", ["none", "one_block", "past_a_group", "all", "all_groups"])
def test_held_probabilities_vs_float64_freed_and_reread(backend, hold, monkeypatch):
    """The chunked forward holds its first rows' logits as fp16 probabilities for the backward (none, one row block
    of a call over two dW groups, a group and half a block of it, every row of a one-group call or of the two-group
    one): log-probs and entropies bitwise those of a call holding none,
    gradients within their float64 bound (the held rows' with the probabilities' rounding), the buffer among the
    saved tensors and freed by the backward, and a second backward under retain_graph bitwise the first."""
    shape = _paths.block_shape(DEVICE)
    lead = (shape.block_rows + 5,) if hold == "all" else (shape.group_rows + shape.block_rows // 2 + 3,)
    cap = {"none": 0, "one_block": shape.block_rows,
           "past_a_group": shape.group_rows + shape.block_rows // 2}.get(hold, lead[0])
    hidden, weight, tokens = _inputs(lead, torch.bfloat16, seed=27)
    tokens = tokens.clamp(max=229)
    g_lp, g_ent = make_weights(lead, 28), make_weights(lead, 29, low=-1.0, high=1.0)
    opts = dict(entropy="grad", temperature=1.3, vocab_size=230, backend=backend)

    def call(rows_cap):
        monkeypatch.setattr(_paths, "held_rows", lambda n, seg_len, device, memory=None: min(n, rows_cap))
        h = hidden.to(DEVICE).requires_grad_(True)
        w = weight.to(DEVICE).requires_grad_(True)
        return h, w, ppo_ops.linear_log_probs_and_entropy(h, w, tokens.to(DEVICE), **opts)

    h, w, out = call(cap)
    held = _saved_half_tensors(out)
    if cap:
        assert len(held) == 1 and held[0].shape[1] >= cap and held[0].shape[0] * held[0].shape[2] == weight.shape[0]
    else:
        assert not held, "a call holding no rows saved a probability buffer"
    outs, grads = (out.log_probs, out.entropy), (g_lp.to(DEVICE), g_ent.to(DEVICE))
    first = torch.autograd.grad(outs, (h, w), grads, retain_graph=True)
    second = torch.autograd.grad(outs, (h, w), grads)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "a second backward (retain_graph) differs from the first"
    with pytest.raises(RuntimeError):
        _saved_half_tensors(out)  # freed with the rest of the saved tensors after the last backward
    _, _, plain = call(0)
    assert torch.equal(out.log_probs, plain.log_probs) and torch.equal(out.entropy, plain.entropy)
    held_rows = torch.arange(lead[0]) < cap
    bounds = _bounds(hidden, weight, tokens, g_lp, g_ent, temperature=1.3, vocab_size=230,
                     dl_roundoff=_dl_roundoff(backend, torch.bfloat16), prob_storage=held_rows)
    _assert_within("dX", first[0].cpu(), bounds["dx"])
    _assert_within("dW", first[1].cpu(), bounds["dw"])


@pytest.mark.device("cuda")
def test_held_rows_change_no_value_at_qwen3_vocabulary():
    """Compiled, at Qwen3's vocabulary and past the held rows: log-probs and entropies bitwise the same under
    no_grad, with the first rows held and with none held; dX of the rows not held bitwise the same with and without
    the held ones (the kernels that store probabilities must give the plain forward's bits)."""
    n_rows, width, vocab = 4096 + 256 + 7, 256, 151936
    hidden, weight, tokens = _inputs((n_rows,), torch.bfloat16, seed=33, v=vocab, h=width)
    hidden, weight, tokens = hidden.cuda(), weight.cuda(), tokens.cuda()
    g_lp, g_ent = make_weights((n_rows,), 34).cuda(), make_weights((n_rows,), 35, low=-1.0, high=1.0).cuda()
    k = _paths.held_rows(n_rows, vocab // 8, DEVICE)
    assert 0 < k < n_rows
    with torch.no_grad():
        plain = ppo_ops.linear_log_probs_and_entropy(hidden, weight, tokens, entropy="grad")
    runs = []
    for rows_cap in (None, 0):
        real = _paths.held_rows
        if rows_cap == 0:
            _paths.held_rows = lambda n, seg_len, device, memory=None: 0
        try:
            h = hidden.detach().requires_grad_(True)
            out = ppo_ops.linear_log_probs_and_entropy(h, weight, tokens, entropy="grad")
            (dx,) = torch.autograd.grad((out.log_probs, out.entropy), (h,), (g_lp, g_ent))
        finally:
            _paths.held_rows = real
        runs.append((out.log_probs.detach(), out.entropy.detach(), dx))
    for name, (lp, ent, _) in zip(("held", "none held"), runs):
        assert torch.equal(lp, plain.log_probs), f"{name}: log-probs differ from no_grad's"
        assert torch.equal(ent, plain.entropy), f"{name}: entropies differ from no_grad's"
    assert torch.equal(runs[0][2][k:], runs[1][2][k:]), "dX of rows not held differs with the first rows held"


@pytest.mark.parametrize("backend,dtype", [
    pytest.param("torch", torch.float32, id="torch-fp32"),  # fixed fp32 tiles
    pytest.param("torch", torch.bfloat16, id="torch-bf16"),
    *[pytest.param("triton", torch.bfloat16, id="triton-bf16", marks=p.marks)  # the segment-GEMM backend
      for p in backend_params(DEVICE) if p.id == "triton"],
])
def test_row_count_invariance_bitwise(backend, dtype):
    """A row's log-prob and entropy do not depend on how many rows the call has nor where the row sits in it: the
    GEMMs run on fixed-shape, zero-padded row blocks (or fixed tiles) and every reduction is per row. (The fp32
    Triton GEMM kernels do not promise this: a row's position in their tiles follows the call's rows.)"""
    shape = _paths.block_shape(DEVICE)
    n = 2 * shape.block_rows + 5  # three blocks, the last one partial
    hidden, weight, tokens = _inputs((n,), dtype, seed=25)
    opts = dict(entropy="value", temperature=0.9, backend=backend)
    full = _run(hidden, weight, tokens, **opts)
    # a prefix, a shifted tail, across a block edge
    for lo, hi in ((0, 3), (7, n), (shape.block_rows - 2, shape.block_rows + 9)):
        part = _run(hidden[lo:hi], weight, tokens[lo:hi], **opts)
        assert torch.equal(part[0], full[0][lo:hi]), f"rows {lo}:{hi}: log_probs differ bitwise"
        assert torch.equal(part[1], full[1][lo:hi]), f"rows {lo}:{hi}: entropy differs bitwise"


@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_no_grad_keeps_nothing(backend):
    """Under torch.no_grad (old-policy and reference passes) the outputs carry no graph, so nothing is kept for a
    backward; the values are those of the differentiable call."""
    hidden, weight, tokens = _inputs((9,), torch.bfloat16, seed=26)
    h, w = hidden.to(DEVICE).requires_grad_(True), weight.to(DEVICE).requires_grad_(True)
    with torch.no_grad():
        out = ppo_ops.linear_log_probs_and_entropy(h, w, tokens.to(DEVICE), entropy="grad", backend=backend)
    assert out.log_probs.grad_fn is None and out.entropy.grad_fn is None
    assert not out.log_probs.requires_grad and not out.entropy.requires_grad
    with_grad = ppo_ops.linear_log_probs_and_entropy(h, w, tokens.to(DEVICE), entropy="grad", backend=backend)
    assert torch.equal(out.log_probs, with_grad.log_probs.detach())
    assert torch.equal(out.entropy, with_grad.entropy.detach())


@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_log_prob_only_gradient(backend):
    """entropy='none': only the log-prob's gradient (the g_ent terms vanish)."""
    lead = (9,)
    hidden, weight, tokens = _inputs(lead, torch.bfloat16, seed=31)
    g_lp = make_weights(lead, 32)
    lp, ent, dx, dw = _run(hidden, weight, tokens, g_lp, None, entropy="none", backend=backend)
    assert ent is None
    bounds = _bounds(hidden, weight, tokens, g_lp, None, **_rounding(backend, torch.bfloat16, hidden, weight))
    _assert_within("log_probs", lp, bounds["log_probs"])
    _assert_within("dX", dx, bounds["dx"])
    _assert_within("dW", dw, bounds["dw"])


@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_log_probs_never_exceed_zero_on_dominant_targets(backend):
    """Rows whose target's logit dominates (p_target rounds to 1 in fp32): every log-prob <= 0. The half-precision
    Triton path takes the target's logit from a dot product of its own, whose rounding can put it above the GEMM's
    row max; the merge caps it there."""
    hidden, weight, tokens = _inputs((64,), torch.bfloat16, seed=36)
    w = weight.float()
    target_rows = w[tokens] / (w[tokens] ** 2).sum(-1, keepdim=True)  # x . w_target = 1
    hidden = (target_rows * 60.0 + hidden.float() * 0.05).to(torch.bfloat16)  # target logit ~60, the others O(1)
    lp, _, dx, _ = _run(hidden, weight, tokens, make_weights((64,), 37), None, entropy="value", backend=backend)
    assert bool((lp <= 0).all()), f"log-probs above 0: {lp[lp > 0].tolist()}"
    assert bool((lp > -1e-3).all()), "the targets were meant to dominate"
    assert bool(torch.isfinite(dx.float()).all())


# --- row mask, determinism, aliasing, empty input ---

@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_row_mask_keeps_kept_rows_bitwise_and_inputs_untouched(backend):
    lead = (11,)
    hidden, weight, tokens = _inputs(lead, torch.bfloat16, seed=41)
    g_lp, g_ent = make_weights(lead, 42), make_weights(lead, 43, low=-1.0, high=1.0)
    row_mask = torch.tensor([True, False, True, True, False, False, True, False, True, True, False])
    masked_tokens = torch.where(row_mask, tokens, -100)
    copies = [t.clone() for t in (hidden, weight, masked_tokens, row_mask)]
    full = _run(hidden, weight, tokens, g_lp, g_ent, entropy="grad", backend=backend)
    g_masked = torch.where(row_mask, g_lp, 0.0), torch.where(row_mask, g_ent, 0.0)
    # The unmasked run with the dropped rows' upstream gradients zeroed: their dW contribution is then 0 too.
    full0 = _run(hidden, weight, tokens, *g_masked, entropy="grad", backend=backend)
    part = _run(hidden, weight, masked_tokens, g_lp, g_ent, entropy="grad", backend=backend, row_mask=row_mask)
    for name, a, b in zip(("log_probs", "entropy"), full[:2], part[:2]):
        assert torch.equal(a[row_mask], b[row_mask]), f"{name}: kept rows differ bitwise from the unmasked run"
        assert bool((b[~row_mask] == 0).all()), f"{name}: dropped rows are not 0"
    assert torch.equal(full0[2][row_mask], part[2][row_mask]), "dX of kept rows differs from the unmasked run"
    assert bool((part[2][~row_mask] == 0).all()), "dropped rows got a hidden gradient"
    # dW sums over rows: compacting them regroups the sum (GEMM K blocks), so it is held to its bound, not to bits.
    bounds = _bounds(hidden, weight, masked_tokens, g_lp, g_ent, row_mask=row_mask,
                     **_rounding(backend, torch.bfloat16, hidden, weight, row_mask))
    _assert_within("dW (row mask)", part[3], bounds["dw"])
    for before, after in zip(copies, (hidden, weight, masked_tokens, row_mask)):
        assert torch.equal(before, after), "an input was modified"
    again = _run(hidden, weight, masked_tokens, g_lp, g_ent, entropy="grad", backend=backend, row_mask=row_mask)
    for a, b in zip(part, again):
        assert torch.equal(a, b), "not deterministic run to run"


@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_empty_and_all_dropped(backend):
    hidden, weight, tokens = _inputs((0,), torch.float32, seed=51)
    out = ppo_ops.linear_log_probs_and_entropy(hidden.to(DEVICE), weight.to(DEVICE), tokens.to(DEVICE),
                                               entropy="value", backend=backend)
    assert out.log_probs.shape == (0,) and out.entropy.shape == (0,)
    lead = (4,)
    hidden, weight, tokens = _inputs(lead, torch.float32, seed=52)
    lp, ent, dx, dw = _run(hidden, weight, torch.full(lead, -100), make_weights(lead, 53), make_weights(lead, 54),
                           entropy="grad", backend=backend, row_mask=torch.zeros(lead, dtype=torch.bool))
    assert bool((lp == 0).all() and (ent == 0).all() and (dx == 0).all() and (dw == 0).all())


# --- argument errors (before any work) ---

def _error_cases():
    h, w, t = _inputs((4,), torch.float32, seed=61)
    return [
        (dict(hidden=h.to(torch.bfloat16)), TypeError, "weight must have hidden's dtype"),
        (dict(weight=w[:, :-1]), ValueError, "weight must have shape"),
        (dict(hidden=h[0]), ValueError, "hidden must have shape"),
        (dict(tokens=t[:3]), ValueError, "tokens must have shape"),
        (dict(tokens=t.float()), TypeError, "tokens must hold integer"),
        (dict(tokens=t + V_GLOBAL), ValueError, "tokens must be global token ids"),
        (dict(row_mask=torch.ones(3, dtype=torch.bool)), ValueError, "row_mask must have shape"),
        (dict(entropy="yes"), ValueError, "entropy must be one of"),
        (dict(temperature=0.0), ValueError, "temperature must be finite and > 0"),
        (dict(vocab_size=V_GLOBAL + 1), ValueError, "vocab_size must be <="),
        (dict(reduce_dx=1), TypeError, "reduce_dx must be a bool"),
        (dict(keep_mask=torch.ones((4, V_GLOBAL), dtype=torch.bool)), TypeError, "keep_mask"),
        (dict(inplace_grad=True), TypeError, "inplace_grad"),
        (dict(working_memory=-1), ValueError, "working_memory must be a number of bytes >= 0"),
        (dict(working_memory=1.5), TypeError, "working_memory must be"),
    ]


@pytest.mark.parametrize("change,error,match", _error_cases(), ids=lambda x: None)
def test_bad_arguments_raise_naming_them(change, error, match):
    h, w, t = _inputs((4,), torch.float32, seed=61)
    args = dict(hidden=h, weight=w, tokens=t)
    args.update(change)
    with pytest.raises(error, match=match):
        ppo_ops.linear_log_probs_and_entropy(args.pop("hidden").to(DEVICE), args.pop("weight").to(DEVICE),
                                             args.pop("tokens").to(DEVICE), backend="torch",
                                             **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v)
                                                for k, v in args.items()})


def test_nan_hidden_raises():
    h, w, t = _inputs((4,), torch.float32, seed=62)
    h[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or \\+inf logits"):
        ppo_ops.linear_log_probs_and_entropy(h.to(DEVICE), w.to(DEVICE), t.to(DEVICE), backend="torch")


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_half_precision_logits_raise(backend, bad):
    """bf16 takes the segment-GEMM backend's one-GEMM forward on "triton": a NaN or +inf logit must still reach the
    core's check through the segment partials (its tl.max may drop a NaN; the sums keep it)."""
    h, w, t = _inputs((6,), torch.bfloat16, seed=64)
    w[int(t[4])] = bad  # one whole weight row: the target column of row 4 is non-finite in every row's logits
    with pytest.raises(ValueError, match="NaN or \\+inf logits"):
        ppo_ops.linear_log_probs_and_entropy(h.to(DEVICE), w.to(DEVICE), t.to(DEVICE), backend=backend)


def test_numpy_scalars_are_numbers():
    h, w, t = _inputs((4,), torch.float32, seed=63)
    t = t.clamp(max=249)
    python = ppo_ops.linear_log_probs_and_entropy(h, w, t, entropy="value", temperature=0.75, vocab_size=250,
                                                  backend="torch")
    numpy = ppo_ops.linear_log_probs_and_entropy(h, w, t, entropy="value", temperature=np.float32(0.75),
                                                 vocab_size=np.int64(250), backend="torch")
    assert torch.equal(python.log_probs, numpy.log_probs) and torch.equal(python.entropy, numpy.entropy)


# --- host reads of the value checks ---

class _ReadCounter:
    """Counts calls of agreement.read_to_host, the one function that reads device values for the checks."""

    def __enter__(self):
        self.calls, self._original = 0, agreement.read_to_host

        def counted(t):
            self.calls += 1
            return self._original(t)

        agreement.read_to_host = counted
        return self

    def __exit__(self, *exc):
        agreement.read_to_host = self._original


def _forward_backward(hidden, weight, tokens, **opts):
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    out = ppo_ops.linear_log_probs_and_entropy(h, w, tokens, entropy="grad", **opts)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    return out


@pytest.mark.parametrize("backend", backend_params(DEVICE))
@pytest.mark.parametrize("validate,reads", [(True, 1), (False, 0)])
def test_host_reads_per_call_single_rank(backend, validate, reads):
    # (With a row mask, the kept-row count is one more sync on CUDA, outside the value checks: see the docstring.)
    h, w, t = _inputs((5,), torch.float32, seed=64)
    row_mask = torch.tensor([True, False, True, True, False])
    for mask in (None, row_mask):
        with _ReadCounter() as counter:
            _forward_backward(h.to(DEVICE), w.to(DEVICE), t.to(DEVICE), backend=backend, validate=validate,
                              row_mask=None if mask is None else mask.to(DEVICE))
        assert counter.calls == reads, f"row_mask={mask is not None}: {counter.calls} host reads"


# --- collective failure on gloo (2 ranks, torch backend) ---

GLOO_TIMEOUT_S = 30  # a collective that waits this long fails the rank: a hang becomes an error
DEADLINE_S = 180  # both ranks done by then, or the test fails as a hang (a normal run takes a few seconds)
COLLECTIVE_ROWS = (5,)


def _collective_inputs():
    hidden, weight, tokens = _inputs(COLLECTIVE_ROWS, torch.float32, seed=81)
    return hidden, weight, tokens


def _collective_cases(rank, world_size):
    """name -> (the arguments this rank passes, expected error type, strings its message must hold)."""
    hidden, weight, tokens = _collective_inputs()
    v_local = V_GLOBAL // world_size
    shard = weight[rank * v_local:(rank + 1) * v_local]
    last = world_size - 1
    bad_tokens = tokens.clone()
    bad_tokens[2] = V_GLOBAL
    nan_shard = shard.clone()
    nan_shard[3, 1] = float("nan")
    ok = dict(hidden=hidden, weight=shard, tokens=tokens)
    return {
        "token_out_of_range_on_last_rank": (
            dict(ok, tokens=bad_tokens if rank == last else tokens), ValueError,
            ("tokens", f"rank {last} of {world_size}", f"[0, {V_GLOBAL})", str(V_GLOBAL))),
        "weight_wrong_shape_on_rank_0": (
            dict(ok, weight=shard[:, :-1] if rank == 0 else shard), ValueError, ("weight", "rank 0 of")),
        "reduce_dx_not_bool_on_rank_1": (
            dict(ok, reduce_dx=1 if rank == 1 else True), TypeError, ("reduce_dx", "rank 1 of")),
        "nan_weight_on_rank_0": (
            dict(ok, weight=nan_shard if rank == 0 else shard), ValueError,
            ("hidden @ weight.T", "rank 0 of", "NaN or +inf")),
    }


def _raise_and_record(args, exc_type, needles):
    """The error a call raises on this rank: (type name, message), checked against the expected type and needles."""
    args = dict(args)
    try:
        _forward_backward(args.pop("hidden"), args.pop("weight"), args.pop("tokens"), tp_group=dist.group.WORLD,
                          backend="torch", **args)
    except exc_type as exc:
        missing = [n for n in needles if n not in str(exc)]
        assert not missing, f"message lacks {missing}: {exc}"
        return type(exc).__name__, str(exc)
    raise AssertionError(f"no error raised, expected {exc_type.__name__}")


def _collective_worker(rank, world_size, out_dir, expected_tp1):
    failures, record = CaseFailures(rank), {}
    for name, (args, exc_type, needles) in _collective_cases(rank, world_size).items():
        failures.run(name, lambda a=args, e=exc_type, n=needles, k=name: record.__setitem__(
            k, _raise_and_record(a, e, n)))

    def host_reads():
        hidden, weight, tokens = _collective_inputs()
        v_local = V_GLOBAL // world_size
        shard = weight[rank * v_local:(rank + 1) * v_local]
        counts = []
        for validate in (True, False):
            with _ReadCounter() as counter:
                _forward_backward(hidden, shard, tokens, tp_group=dist.group.WORLD, backend="torch",
                                  validate=validate)
            counts.append(counter.calls)
        assert counts == [1, 0], f"host reads (validate=True, validate=False): {counts}"

    def tp_group_none_is_one_rank():
        hidden, weight, tokens = _collective_inputs()
        got = _forward_backward(hidden, weight, tokens, tp_group=None, backend="torch")
        assert torch.equal(got.log_probs, expected_tp1.log_probs) and torch.equal(got.entropy, expected_tp1.entropy)

    failures.run("host_reads", host_reads)
    failures.run("tp_group_none_is_one_rank", tp_group_none_is_one_rank)
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))
    failures.raise_if_any()


def test_failure_is_collective_and_never_hangs(tmp_path):
    world_size = 2
    hidden, weight, tokens = _collective_inputs()
    out = _forward_backward(hidden, weight, tokens, backend="torch")
    expected = ppo_ops.LogProbsEntropy(out.log_probs.detach(), out.entropy.detach())
    run_gloo(world_size, _collective_worker, str(tmp_path), expected, timeout_s=GLOO_TIMEOUT_S, deadline_s=DEADLINE_S)
    records = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    for name in _collective_cases(0, world_size):
        (type0, message0), (type1, message1) = records[0][name], records[1][name]
        assert type0 == type1, f"{name}: rank 0 raised {type0}, rank 1 {type1}"
        # A local argument error adds the rank's own details after the shared message; value errors are identical.
        shared = "every rank raises this error."
        assert message0.split(shared)[0] == message1.split(shared)[0], f"{name}: {message0!r} vs {message1!r}"


# --- tensor parallelism ---

TP_CASES = {
    # name: (dtype, temperature, vocab_size, masked, rows)
    "bf16_rows_padding": (torch.bfloat16, 0.9, 230, True, 6),  # padding: at TP=4 the last rank holds 26 padding columns
    "fp32_plain": (torch.float32, 1.0, None, False, 6),
    # on CPU: the segment-GEMM backend's first 16 rows from held probabilities, the next 16 recomputed, then a second
    # group
    "bf16_beyond_held": (torch.bfloat16, 1.0, None, False, 40),
    # every row held, past the first group (TP_WORKING_MEMORY): the second group's rows from their probabilities too
    "bf16_held_past_a_group": (torch.bfloat16, 1.0, None, False, 40),
}
TP_WORKING_MEMORY = {"bf16_held_past_a_group": 10**9}  # the cases' working_memory where not the default


def _tp_inputs(name):
    dtype, temperature, vocab_size, masked, n_rows = TP_CASES[name]
    lead = (n_rows,)
    hidden, weight, tokens = _inputs(lead, dtype, seed=71)
    if vocab_size is not None:
        tokens = tokens.clamp(max=vocab_size - 1)
    opts = dict(entropy="grad", temperature=temperature, vocab_size=vocab_size)
    if name in TP_WORKING_MEMORY:
        opts["working_memory"] = TP_WORKING_MEMORY[name]
    if masked:
        opts["row_mask"] = torch.tensor([True, True, False, True, False, True])
        tokens = torch.where(opts["row_mask"], tokens, -100)
    return hidden, weight, tokens, make_weights(lead, 72), make_weights(lead, 73, low=-1.0, high=1.0), opts


def _tp_results(rank, world_size, group, device, backends):
    results = {}
    for backend in backends:
        for name in TP_CASES:
            hidden, weight, tokens, g_lp, g_ent, opts = _tp_inputs(name)
            v_local = V_GLOBAL // world_size
            shard = weight[rank * v_local:(rank + 1) * v_local]
            for reduce_dx in (True, False) if world_size > 1 else (True,):
                results[(backend, name, reduce_dx)] = _run(hidden, shard, tokens, g_lp, g_ent, device=device,
                                                           tp_group=group, backend=backend, reduce_dx=reduce_dx,
                                                           **opts)
    return results


def _runnable_backends():
    return ["torch"] + (["triton"] if triton_skip_reason(DEVICE) is None else [])


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return results_by_tp(str(tmp_path_factory.mktemp("linear_tp")), _tp_results, _runnable_backends())


@pytest.mark.parametrize("name", list(TP_CASES))
@pytest.mark.parametrize("tp", [world_size_param(2), world_size_param(4)])
@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_tp_bitwise_invariant(tp_results, backend, tp, name):
    lp1, ent1, dx1, dw1 = tp_results(1)[0][(backend, name, True)]
    ranks = tp_results(tp)
    for rank, per_rank in enumerate(ranks):
        lp, ent, dx, _ = per_rank[(backend, name, True)]
        assert torch.equal(lp, lp1), f"TP={tp} rank {rank}: log_probs differ bitwise from TP=1"
        assert torch.equal(ent, ent1), f"TP={tp} rank {rank}: entropy differs bitwise from TP=1"
        assert torch.equal(dx, ranks[0][(backend, name, True)][2]), f"rank {rank}: dX differs between ranks"
    dw = torch.cat([per_rank[(backend, name, True)][3] for per_rank in ranks])
    assert torch.equal(dw, dw1), f"TP={tp}: concatenated dW shards differ bitwise from TP=1"

    # dX: summed over ranks in a different order than at TP=1, so held to the float64 bound instead of TP=1's bits;
    # reduce_dx=False gives each rank's own contribution, and the (fp32) sum of those is the reduced dX.
    hidden, weight, tokens, g_lp, g_ent, opts = _tp_inputs(name)
    dtype = TP_CASES[name][0]
    bounds = _bounds(hidden, weight, tokens, g_lp, g_ent, temperature=opts["temperature"],
                     vocab_size=opts["vocab_size"], row_mask=opts.get("row_mask"),
                     **_rounding(backend, dtype, hidden, weight, opts.get("row_mask"), opts.get("working_memory")))
    dx_tp = ranks[0][(backend, name, True)][2]
    _assert_within("dX (reduced)", dx_tp, bounds["dx"])
    partial_sum = sum(per_rank[(backend, name, False)][2].double() for per_rank in ranks)
    # Each contribution is rounded to the input dtype once: tp roundings of at most u |contribution|.
    contributions = sum(per_rank[(backend, name, False)][2].double().abs() for per_rank in ranks)
    ref, tol = bounds["dx"]
    assert bool(((partial_sum - ref).abs() <= tol + UNIT_ROUNDOFF[dtype] * contributions).all()), (
        "reduce_dx=False: the ranks' contributions do not sum to dX")


def _qwen3_tp_results(rank, world_size, group, device):
    """Each Qwen3 shape through the general op with both gradients on this rank's vocabulary shard."""
    results = {}
    for name, (width, n_rows) in QWEN3_TP_SHAPES.items():
        hidden, weight, tokens, row_mask, g_lp, g_ent = qwen3_inputs(width, n_rows, device)
        h = hidden.requires_grad_(True)
        w = weight.chunk(world_size)[rank].clone().requires_grad_(True)
        out = ppo_ops.linear_log_probs_and_entropy(h, w, tokens, tp_group=group, entropy="grad",
                                                   temperature=QWEN3_TEMPERATURE, vocab_size=QWEN3_TOKENS,
                                                   row_mask=row_mask)
        dx, dw = torch.autograd.grad((out.log_probs, out.entropy), (h, w), (g_lp, g_ent))
        results[name] = tp_record(world_size, dict(log_probs=out.log_probs, entropy=out.entropy), dx, dw)
    return results


@pytest.fixture(scope="module")
def qwen3_tp_results(tmp_path_factory):
    return results_by_tp(str(tmp_path_factory.mktemp("linear_qwen3_tp")), _qwen3_tp_results, one_gpu=True)


def test_qwen3_tp_shapes_pass_the_held_rows_and_one_dw_group():
    # What the one-GPU TP cases below claim to cover on CUDA: rows held as probabilities and rows recomputed, two dW
    # groups.
    cuda, seg_len = torch.device("cuda"), QWEN3_VOCAB // _layout.NUM_FIXED_SEGMENTS
    for _, n_rows in QWEN3_TP_SHAPES.values():
        kept = qwen3_kept_rows(n_rows)
        assert 0 < _paths.held_rows(kept, seg_len, cuda) < kept
        assert _paths.CUDA_SHAPE.group_rows < kept <= 2 * _paths.CUDA_SHAPE.group_rows


@pytest.mark.device("cuda")
@pytest.mark.parametrize("name", list(QWEN3_TP_SHAPES))
@pytest.mark.parametrize("tp", QWEN3_TP_SIZES)
def test_tp_bitwise_invariant_at_qwen3_shapes_on_one_gpu(qwen3_tp_results, tp, name):
    """The compiled kernels at TP = 2 and 4 with Qwen3's vocabulary (padding, temperature, a row mask; past the held
    rows, over two dW groups), every rank on the one GPU over gloo: log-probs, entropies and dW bitwise TP = 1's, dX
    the same on every rank and within a bf16 rounding of TP = 1's."""
    assert_tp_invariant(qwen3_tp_results(1)[0][name], [r[name] for r in qwen3_tp_results(tp)], name)


# --- compiled code (no GPU needed: a child process without the interpreter compiles for sm_90) ---

COMPILE_TIMEOUT_S = 600  # three kernels compiled at Qwen3 sizes, with room for a loaded CI machine


@pytest.fixture(scope="module")
def compile_report(tmp_path_factory):
    return compile_check_report("tests.linear_compile_check", tmp_path_factory.mktemp("triton_cache"),
                                COMPILE_TIMEOUT_S)


@pytest.mark.device("any")
@pytest.mark.parametrize("dtype", ["fp32", "gemm_partials bf16", "gemm_partials probs bf16", "gemm_dlogits bf16"])
def test_forward_binary_is_the_same_at_every_tp_size(compile_report, dtype):
    # One specialisation for every rank of TP = 1, 2, 4, 8 at Qwen3's vocabulary: the same code per segment.
    assert compile_report["forward_keys"][dtype] == 1


@pytest.mark.device("any")
@pytest.mark.parametrize("kernel", ["gemm_partials", "gemm_partials probs", "gemm_dlogits"])
def test_half_precision_kernels_use_wgmma_on_sm90(compile_report, kernel):
    # bf16 tiles must reach Hopper's warpgroup MMA; a kernel on mma.sync or FMAs would run at a fraction of the rate.
    assert compile_report["kernels"][f"{kernel} bf16"]["wgmma"], f"{kernel}: no wgmma.mma_async in the sm_90 PTX"


@pytest.mark.device("any")
@pytest.mark.parametrize("kernel", ["gemm_partials", "gemm_partials probs", "gemm_dlogits"])
def test_one_gemm_kernels_move_tiles_with_tma(compile_report, kernel):
    # The segment-GEMM backend's one-GEMM forward and fused recompute feed wgmma from TMA loads (the bulk tensor copy
    # engine); the recompute also stores its dlogits tiles by TMA, the token loss's forward its probabilities.
    assert compile_report["kernels"][f"{kernel} bf16"]["tma"], f"{kernel}: no cp.async.bulk.tensor in the sm_90 PTX"


def _recording_rows(gemm, accumulates: bool, width: int, seg_len: int, rows: list):
    """`gemm` that first appends its row count to `rows` when it is a backward GEMM (not a forward chunk GEMM,
    whose K is H): dl @ W_s's M, or dl^T @ X's K."""
    def recorded(*args, **kwargs):
        a, b = args[1:3] if accumulates else args[:2]
        if a.shape[1] != width:
            rows.append(a.shape[1] if a.shape[0] == seg_len and b.shape[1] == width else a.shape[0])
        return gemm(*args, **kwargs)
    return recorded


@pytest.mark.parametrize("backend", [p for p in backend_params(DEVICE) if p.id == "triton"])
@pytest.mark.parametrize("op", ["general", "token_loss"])
def test_backward_gemms_take_whole_groups_of_gemm_rows(backend, op, monkeypatch):
    """A row mask that keeps an odd number of rows (Megatron's loss mask drops the last position): every dX / dW
    GEMM still runs on a multiple of GEMM_ROW_MULTIPLE rows, since cuBLAS takes slow unaligned kernels for a
    vocabulary-major dlogits operand of any other row count; the extra rows add nothing (values against float64,
    the same as the logits op's bounds check)."""
    shape = _paths.block_shape(DEVICE)
    lead = (shape.group_rows + shape.block_rows // 2 + 3,)  # several groups, the last one's rows odd
    hidden, weight, tokens = _inputs(lead, torch.bfloat16, seed=51)
    g_lp, g_ent = make_weights(lead, 52), make_weights(lead, 53, low=-1.0, high=1.0)
    row_mask = torch.ones(lead, dtype=torch.bool)
    row_mask[-1] = False
    width, seg_len = hidden.shape[1], weight.shape[0] // _layout.NUM_FIXED_SEGMENTS
    gemm_rows = []  # the row count of each backward GEMM: dX32 (+)= dl @ W_s, dW_s (+)= dl^T @ X
    for name in ("mm_fp32", "addmm_fp32", "mm_rounded"):
        monkeypatch.setattr(_gemms, name, _recording_rows(getattr(_gemms, name), name == "addmm_fp32",
                                                          width, seg_len, gemm_rows))
    if op == "general":
        lp, ent, dx, dw = _run(hidden, weight, tokens, g_lp, g_ent, entropy="grad", backend=backend,
                               row_mask=row_mask)
    else:
        h, w = (t.detach().clone().requires_grad_(True) for t in (hidden, weight))
        g_lp_d, g_ent_d = g_lp.to(DEVICE), g_ent.to(DEVICE)

        def weighted(log_probs, entropy, rows):  # per row: g_lp * log-prob + g_ent * entropy
            return g_lp_d[rows.to(DEVICE)] * log_probs + g_ent_d[rows.to(DEVICE)] * entropy

        loss, out = ppo_ops.linear_token_loss(h.to(DEVICE), w.to(DEVICE), tokens.to(DEVICE), weighted,
                                              entropy="grad", backend=backend, row_mask=row_mask.to(DEVICE))
        dx, dw = (g.cpu() for g in torch.autograd.grad(loss, (h, w)))
        lp, ent = out.log_probs.cpu(), out.entropy.cpu()
    assert gemm_rows and all(n % _gemms.GEMM_ROW_MULTIPLE == 0 for n in gemm_rows), gemm_rows
    bounds = _bounds(hidden, weight, tokens, g_lp, g_ent, row_mask=row_mask,
                     **_rounding(backend, torch.bfloat16, hidden, weight, row_mask))
    for name, got in (("log_probs", lp), ("entropy", ent), ("dX", dx), ("dW", dw)):
        _assert_within(name, got, bounds[name.lower()])
    assert bool((dx[~row_mask] == 0).all()), "the dropped row got a hidden gradient"
