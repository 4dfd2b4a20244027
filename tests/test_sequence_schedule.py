"""The sequence schedule of linear_token_loss (lm_head/sequence_blocks.py, lm_head/loss_function.py): a sequence-scope
loss (GSPO, GMPO, with sequence-level rollout corrections) over row blocks cut at sequence ends, each sequence's
statistic and gradient formed in its block; sequences longer than a block, or not consecutive, recomputed (a
statistics pass over their rows, the loss frozen there).

Checked against the statistics schedule (a statistics pass over every row, then the frozen loss: what a batch-scope
loss and SGLang's order take) and against float64:
    log-probs        bit for bit the statistics schedule's (a row's log-prob does not depend on its block);
    loss             float64 of the source formula (written here, a loop over sequences) at the op's own log-probs,
                     within the loss's fp32 arithmetic (LOSS_RTOL of the terms' magnitudes);
    dX, dW           within tests/linear_support.py's bounds of float64, the float64 loss's gradient as the upstream.
The batch has one-token sequences, a fully masked one, sequences longer than a block (recomputed) and, in one case,
a sequence whose rows are not consecutive. Block rows are the host's (paths.HOST_SHAPE, HOST_LOSS_BLOCK_ROWS), so
this file runs on CPU: torch for loss_chunk_blocks (8-row blocks), Triton under its interpreter for loss_blocks.
"""

import math

import numpy as np
import pytest
import torch

import ppo_ops
from ppo_ops.lm_head import loss_function, paths, sequence_blocks
from tests.linear_support import DX_ACROSS_TP_MAX_REL, UNIT_ROUNDOFF, assert_within, bounds, inputs

U32 = UNIT_ROUNDOFF[torch.float32]
CHUNK_BLOCK = paths.HOST_SHAPE.loss_block_rows  # loss_chunk_blocks' rows per block off CUDA (8)
PROB_BLOCK = paths.HOST_LOSS_BLOCK_ROWS  # loss_blocks' rows per block off CUDA (16)
# Sequence lengths: one-token sequences (0, 4), sequences that fit an 8-row block and a 16-row one, and 12 and 20,
# longer than an 8-row block (20 also than a 16-row one): recomputed. Sequence 6 is fully masked (nothing counted).
SEQ_LENS = (1, 5, 3, 7, 1, 12, 6, 2, 20, 4, 8, 3)
MASKED_SEQ = 6
T = sum(SEQ_LENS)
MAX_ABS_LOG_RATIO = 0.5  # |lp - old| of the batches below (asserted)
# A term's fp32 error relative to its magnitude: a sequence's mean log-ratio adds its L <= 20 terms one at a time
# (L ulps of L max|x|), a division and exp (a few ulps): (L + 8) u max|x| in log s, so relative in s; then ~8
# roundings of the products with A, c and the weight, and of k3's expm1 and additions.
TERM_RTOL = (max(SEQ_LENS) + 8) * U32 * MAX_ABS_LOG_RATIO + 8 * U32
# The loss: T terms summed per block, then the blocks' sums in fp32: at most T + 8 ulps of Σ|term|.
SUM_RTOL = (T + 8) * U32
LOSS_RTOL = TERM_RTOL + SUM_RTOL
ONE_BLOCK_BYTES = 2**20  # an allowance that holds every row of the batch as one loss_one_block block (~80 KB)
CLIP_LOW, CLIP_HIGH = 0.05, 0.08  # narrow, so that some sequences (GSPO) and tokens (GMPO) are clipped
IS_LOW, IS_HIGH = 0.9, 1.1  # rollout-correction caps within the batch's sequence weights (below, inside, above)

CASES = {
    "gspo": dict(kind="gspo"),
    "gmpo": dict(kind="gmpo", normalization="token_mean"),
    "gspo_seq_tis_kl_entropy": dict(kind="gspo", rollout_correction="seq_tis", rollout_is_low=IS_LOW,
                                    rollout_is_high=IS_HIGH, kl_coef=0.05, entropy_coef=0.01),
    "gmpo_seq_mis": dict(kind="gmpo", rollout_correction="seq_mis", rollout_is_low=IS_LOW, rollout_is_high=IS_HIGH),
}


# --- inputs ---

def _seq_ids(lens, interleave=False):
    ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    if interleave:  # sequence 1's last two rows after sequence 2's: its rows are not consecutive
        s1 = torch.nonzero(ids == 1)[:, 0]
        s2 = torch.nonzero(ids == 2)[:, 0]
        order = torch.cat([torch.arange(int(s1[0])), s1[:-2], s2, s1[-2:], torch.arange(int(s2[-1]) + 1, len(ids))])
        ids = ids[order]
    return ids


def _batch(seed, lp64, seq_ids):
    """Per-token fp32 constants around the float64 log-probs: old log-probs within MAX_ABS_LOG_RATIO, rollout
    log-probs whose sequence weights fall below, inside and above the caps."""
    gen = torch.Generator().manual_seed(seed)
    n = seq_ids.numel()
    old = lp64.detach() - MAX_ABS_LOG_RATIO * (2 * torch.rand(n, generator=gen, dtype=torch.float64) - 1) * 0.9
    seq_w = torch.tensor([0.8, 1.0, 1.3])[torch.arange(int(seq_ids.max()) + 1) % 3].double()
    rollout = old - seq_w.log()[seq_ids] - 0.01 * torch.randn(n, generator=gen, dtype=torch.float64)
    mask = torch.rand(n, generator=gen) < 0.85
    mask[seq_ids == MASKED_SEQ] = False
    mask[(seq_ids == 0) | (seq_ids == 4)] = True  # the one-token sequences are counted
    adv = torch.randn(int(seq_ids.max()) + 1, generator=gen, dtype=torch.float64)[seq_ids]  # GRPO-like: per sequence
    return dict(old_log_probs=old.float(), advantages=adv.float(), rollout_log_probs=rollout.float(),
                ref_log_probs=(old + 0.2 * torch.randn(n, generator=gen, dtype=torch.float64)).float(),
                loss_mask=mask, seq_ids=seq_ids)


def _build(b, opts):
    kwargs = {k: v for k, v in opts.items() if k != "kind"}
    kwargs.update(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, loss_mask=b["loss_mask"], ref_log_probs=b["ref_log_probs"],
                  rollout_log_probs=b["rollout_log_probs"])
    make = ppo_ops.gspo_loss if opts["kind"] == "gspo" else ppo_ops.gmpo_loss
    return make(b["old_log_probs"], b["advantages"], b["seq_ids"], **kwargs)


# --- float64 reference, from the formulas (ppo_ops/sequence_losses.py, rollout_correction.py) ---

def _reference(lp, ent, b, opts, scored=None, magnitude=False):
    """The scalar loss in float64, differentiable in lp and ent. scored: tokens the call scores (None: all); the
    others add no term and are left out of the statistics, the weights stay loss_mask's. magnitude: every addend by
    its absolute value (the size the fp32 roundings are relative to)."""
    old, adv = b["old_log_probs"].double(), b["advantages"].double()
    mask, seq_ids = b["loss_mask"], b["seq_ids"]
    live = mask if scored is None else mask & scored
    hi, lo = math.log1p(CLIP_HIGH), math.log1p(-CLIP_LOW)
    c = torch.where(mask, 1.0, 0.0).double()
    mode = opts.get("rollout_correction")
    terms = torch.zeros_like(lp)
    for s in seq_ids.unique().tolist():
        in_s = seq_ids == s
        if mode is not None and (in_s & mask).any():
            w = torch.exp((old - b["rollout_log_probs"].double())[in_s & mask].mean())
            low, high = opts["rollout_is_low"], opts["rollout_is_high"]
            cs = w.clamp(low, high) if mode == "seq_tis" else torch.where((w >= low) & (w <= high), w, 0.0)
            c = torch.where(in_s & mask, cs, c)
        sel = in_s & live
        if not sel.any():
            continue
        x = lp - old
        if opts["kind"] == "gspo":
            log_s = x[sel].mean()
            s_ratio = torch.exp(torch.where(adv >= 0, log_s.clamp(max=hi), log_s.clamp(min=lo)))
            pg = (adv.abs() if magnitude else -adv) * s_ratio
        else:
            x_clip = torch.where(adv >= 0, x.clamp(max=hi), x.clamp(min=lo))
            a_bar = (adv.abs() if magnitude else adv)[sel].mean()
            pg = (a_bar if magnitude else -a_bar) * torch.exp(x_clip[sel].mean()) * torch.ones_like(lp)
        terms = torch.where(sel, c * pg, terms)
    if opts.get("kl_coef"):
        x = lp - b["ref_log_probs"].double()
        kl = (x.abs() + torch.exp(-x) + 1) if magnitude else torch.exp(-x) - 1 + x
        terms = terms + torch.where(live, opts["kl_coef"] * kl, 0.0)
    if opts.get("entropy_coef"):
        terms = terms + torch.where(live, (1 if magnitude else -1) * opts["entropy_coef"] * ent, 0.0)
    m = mask.double()
    if opts.get("normalization", "seq_mean_token_mean") == "token_mean":
        return (terms * m).sum() / m.sum()
    per_seq = [(terms[seq_ids == s] * m[seq_ids == s]).sum() / m[seq_ids == s].sum()
               for s in seq_ids.unique().tolist() if m[seq_ids == s].sum() > 0]
    return torch.stack(per_seq).mean()


# --- running the op ---

def _run(hidden, weight, tokens, loss_fn, backend, *, schedule=None, row_mask=None, monkeypatch=None, **options):
    """(loss, log-probs, entropies, dX, dW) of linear_token_loss; schedule paths.STATISTICS: the statistics schedule
    forced (what the sequence schedule replaces), for comparison."""
    if schedule is not None:
        real = loss_function.schedule_of
        monkeypatch.setattr(loss_function, "schedule_of",  # the statistics pass's own loss stays row-scope
                            lambda plan, loss, *head: schedule if getattr(loss, "scope", "row") != "row"
                            else real(plan, loss, *head))
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    try:
        loss, out = ppo_ops.linear_token_loss(h, w, tokens, loss_fn, entropy="grad", backend=backend,
                                              row_mask=row_mask, **options)
        dx, dw = torch.autograd.grad(loss, (h, w))
    finally:
        if schedule is not None:
            monkeypatch.undo()
    return loss.detach(), out.log_probs, out.entropy, dx, dw


def _spy_recomputed(monkeypatch):
    """The frozen-token masks partly_frozen receives (one per call that recomputes sequences)."""
    seen = []
    partly = ppo_ops.SequenceLoss.partly_frozen
    monkeypatch.setattr(ppo_ops.SequenceLoss, "partly_frozen",
                        lambda self, lp, frozen: seen.append(frozen.clone()) or partly(self, lp, frozen))
    return seen


def _expected_recomputed(seq_ids, mask, block_rows, row_mask=None):
    """Tokens of the counted sequences longer than a block or not consecutive (in kept-row order)."""
    kept = torch.ones_like(mask) if row_mask is None else row_mask
    out = torch.zeros_like(mask)
    kept_ids = seq_ids[kept]
    for s in seq_ids.unique().tolist():
        where = torch.nonzero(kept_ids == s)[:, 0]
        if not (mask & kept & (seq_ids == s)).any() or where.numel() == 0:
            continue
        consecutive = int(where[-1] - where[0]) + 1 == where.numel()
        if where.numel() > block_rows or not consecutive:
            out |= (seq_ids == s) & kept
    return out


def _dense_keep(ids, offsets, n_rows, vocab):
    """[rows, V] bool of a sparse keep set as tests/linear_support.bounds takes it (an empty row keeps everything)."""
    dense = torch.zeros((n_rows, vocab), dtype=torch.bool)
    for r in range(n_rows):
        row = ids[offsets[r]:offsets[r + 1]]
        dense[r] = True if row.numel() == 0 else dense[r].index_fill(0, row, True)
    return dense


def _check(case, backend, dtype, block_rows, monkeypatch, *, interleave=False, row_mask=None, seed=0, keep=None,
           **options):
    opts = CASES[case]
    seq_ids = _seq_ids(SEQ_LENS, interleave)
    hidden, weight, tokens = inputs((T,), dtype, seed=100 + seed)
    logits = hidden.double() @ weight.double().T
    lsm = torch.log_softmax(logits, -1)
    lp64, ent64 = lsm.gather(1, tokens[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
    keep_mask = None
    if keep is not None:  # log-probs over keep ∪ {target}; entropies stay full
        keep_mask = _dense_keep(*keep, T, weight.shape[0])
        kept_set = keep_mask | torch.nn.functional.one_hot(tokens, weight.shape[0]).bool()
        lp64 = torch.log_softmax(torch.where(kept_set, logits, -math.inf), -1).gather(1, tokens[:, None])[:, 0]
    b = _batch(200 + seed, lp64, seq_ids)
    loss_fn = _build(b, opts)
    if row_mask is not None:
        tokens = torch.where(row_mask, tokens, -100)
    named = paths.path_of_call(hidden, weight, token_loss=loss_fn, backend=backend, row_mask=row_mask, **options)
    assert named.schedule == paths.SEQUENCES and named.block_rows == block_rows, named

    if keep is not None:
        options = dict(options, keep=keep)
    seen = _spy_recomputed(monkeypatch)
    loss, lp, ent, dx, dw = _run(hidden, weight, tokens, loss_fn, backend, row_mask=row_mask, **options)
    if block_rows >= T:  # one block: every sequence formed in it, none recomputed
        assert not seen, "a sequence recomputed although every row is one block"
    else:
        expected = _expected_recomputed(seq_ids, b["loss_mask"], block_rows, row_mask)
        assert expected.any(), "no sequence recomputed: the case does not cross a block"
        assert len(seen) == 1 and torch.equal(seen[0], expected), "not the sequences longer than a block or split"
        assert (b["loss_mask"] & ~expected).any(), "every sequence recomputed: nothing formed in its block"

    s_loss, s_lp, s_ent, s_dx, s_dw = _run(hidden, weight, tokens, loss_fn, backend, row_mask=row_mask,
                                           schedule=paths.STATISTICS, monkeypatch=monkeypatch, **options)
    assert torch.equal(lp, s_lp) and torch.equal(ent, s_ent), "log-probs or entropies depend on the schedule"
    on = torch.ones(T, dtype=torch.bool) if row_mask is None else row_mask
    assert float((b["old_log_probs"] - lp)[on].abs().max()) <= MAX_ABS_LOG_RATIO, \
        "the batch's log-ratios exceed MAX_ABS_LOG_RATIO: TERM_RTOL does not hold"

    # the loss at the op's own log-probs and entropies, in float64
    scored = None if row_mask is None else row_mask
    at_lp, at_ent = lp.double().detach(), ent.double().detach()
    ref_at = float(_reference(at_lp, at_ent, b, opts, scored))
    size = float(_reference(at_lp, at_ent, b, opts, scored, magnitude=True))
    for what, got in (("sequence schedule", loss), ("statistics schedule", s_loss)):
        assert abs(float(got) - ref_at) <= LOSS_RTOL * size, f"{what}: loss {float(got)} vs float64 {ref_at}"

    # dX, dW against float64 with the float64 loss's gradient as the upstream
    lp_ = lp64.detach().requires_grad_(True)
    ent_ = ent64.detach().requires_grad_(True)
    g_lp, g_ent = torch.autograd.grad(_reference(lp_, ent_, b, opts, scored), (lp_, ent_), allow_unused=True)
    g_ent = torch.zeros_like(ent64) if g_ent is None else g_ent
    half = dtype != torch.float32
    bd = bounds(hidden, weight, tokens, g_lp.float(), g_ent.float(), row_mask=row_mask,
                dl_roundoff=UNIT_ROUNDOFF[dtype] if half else 0.0, prob_storage=half, keep_mask=keep_mask)
    for what, got_dx, got_dw in (("sequence", dx, dw), ("statistics", s_dx, s_dw)):
        assert_within(f"{what} schedule: dX", got_dx, bd["dx"])
        assert_within(f"{what} schedule: dW", got_dw, bd["dw"])
    if row_mask is not None:
        assert bool((dx[~row_mask] == 0).all()), "a dropped row got a gradient"


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunk_blocks_match_statistics_schedule_and_float64(case, monkeypatch):
    """loss_chunk_blocks (backend torch, 8-row blocks): every case, one-token and fully masked sequences, sequences
    longer than a block recomputed."""
    _check(case, "torch", torch.float32, CHUNK_BLOCK, monkeypatch, seed=sorted(CASES).index(case))


def test_sequence_not_consecutive_is_recomputed(monkeypatch):
    """A sequence whose rows are split by another's is recomputed; the others are formed in their blocks."""
    _check("gspo_seq_tis_kl_entropy", "torch", torch.float32, CHUNK_BLOCK, monkeypatch, interleave=True, seed=7)


def test_row_mask_leaves_dropped_rows_out(monkeypatch):
    """Dropped rows are not scored: out of their sequence's statistics and the sum, the weights loss_mask's; a
    sequence whose kept rows fit a block is formed there even where its rows with the dropped ones do not."""
    row_mask = torch.rand(T, generator=torch.Generator().manual_seed(5)) < 0.75
    row_mask[0] = True
    _check("gmpo_seq_mis", "torch", torch.float32, CHUNK_BLOCK, monkeypatch, row_mask=row_mask, seed=8)


def test_sparse_keep_set(monkeypatch):
    """With a sparse keep set the loss sees each block's renormalised log-probs, the recomputed sequences' statistics
    pass too (the keep set over its own rows)."""
    gen = torch.Generator().manual_seed(70)
    counts = torch.randint(0, 6, (T,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    ids = torch.randint(0, 256, (int(offsets[-1]),), generator=gen)
    _check("gspo_seq_tis_kl_entropy", "torch", torch.float32, CHUNK_BLOCK, monkeypatch, seed=10, keep=(ids, offsets))


@pytest.mark.parametrize("case", ["gspo_seq_tis_kl_entropy", "gmpo"])
def test_prob_blocks_match_statistics_schedule_and_float64(case, monkeypatch):
    """loss_blocks (Triton, bf16, fp16 probabilities, 16-row blocks beside the fp32 dW accumulator)."""
    if not (torch.cuda.is_available() or _interpreted()):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    _check(case, "triton", torch.bfloat16, PROB_BLOCK, monkeypatch, seed=9 + sorted(CASES).index(case),
           working_memory=0)


def test_one_prob_block(monkeypatch):
    """loss_one_block (Triton, bf16, every row one block, dW finished in the forward): the sequence loss on every
    row at once, nothing cut, nothing recomputed (interleaved rows too)."""
    if not (torch.cuda.is_available() or _interpreted()):
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    _check("gmpo_seq_mis", "triton", torch.bfloat16, T, monkeypatch, interleave=True, seed=12,
           working_memory=ONE_BLOCK_BYTES)


def _interpreted():
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


def test_values_only_take_the_same_blocks(monkeypatch):
    """Under no_grad the same cut and loss: the values bit for bit those of the call with gradients."""
    b = _batch(31, torch.zeros(T, dtype=torch.float64) - 2.0, _seq_ids(SEQ_LENS))
    hidden, weight, tokens = inputs((T,), torch.float32, seed=30)
    loss_fn = _build(b, CASES["gspo"])
    loss, lp, _, _, _ = _run(hidden, weight, tokens, loss_fn, "torch")
    with torch.no_grad():
        loss_ng, out = ppo_ops.linear_token_loss(hidden, weight, tokens, loss_fn, entropy="grad", backend="torch")
    assert torch.equal(loss, loss_ng) and torch.equal(lp, out.log_probs)


def test_one_block_cuts_nothing(monkeypatch):
    """Every row in one block (fewer kept rows than a block): no cut, nothing recomputed, nothing read."""
    lens = (3, 1, 2)
    n = sum(lens)
    assert n <= CHUNK_BLOCK
    hidden, weight, tokens = inputs((n,), torch.float32, seed=40)
    b = _batch(41, torch.zeros(n, dtype=torch.float64) - 2.0, _seq_ids(lens, False))
    loss_fn = _build(b, CASES["gmpo"])
    seen = _spy_recomputed(monkeypatch)
    cuts = []
    monkeypatch.setattr(sequence_blocks, "cut", lambda *a: cuts.append(a))
    s_loss = _run(hidden, weight, tokens, loss_fn, "torch", schedule=paths.STATISTICS, monkeypatch=monkeypatch)[0]
    monkeypatch.setattr(sequence_blocks, "cut", lambda *a: cuts.append(a))
    loss = _run(hidden, weight, tokens, loss_fn, "torch")[0]
    assert not seen and not cuts
    assert abs(float(loss) - float(s_loss)) <= SUM_RTOL * abs(float(s_loss)) + 1e-30


def test_path_of_call_names_the_schedule():
    """rows for a row-scope loss (or token_loss=True), sequences for GSPO / GMPO, statistics for the top-entropy mask
    and for a sequence-scope loss in SGLang's order; the general op has none."""
    hidden, weight, _ = inputs((T,), torch.float32, seed=80)
    b = _batch(81, torch.zeros(T, dtype=torch.float64) - 2.0, _seq_ids(SEQ_LENS))
    gspo = _build(b, CASES["gspo"])
    ppo = ppo_ops.policy_loss(b["old_log_probs"], b["advantages"])
    named = {name: paths.path_of_call(hidden, weight, token_loss=loss, backend="torch", **opts).schedule
             for name, loss, opts in (("plain", True, {}), ("ppo", ppo, {}), ("gspo", gspo, {}),
                                      ("masked", ppo_ops.top_entropy_mask(gspo), {}),
                                      ("sglang", gspo, dict(reduction_order="sglang")), ("general", False, {}))}
    assert named == dict(plain=paths.ROWS, ppo=paths.ROWS, gspo=paths.SEQUENCES, masked=paths.STATISTICS,
                         sglang=paths.SEQUENCES, general="")


# --- SGLang's order: the loss once on every row, or the statistics pass ---

# Where the exact token loss's loss sees every row at once (one block; the recompute) a sequence-scope loss takes the
# sequence schedule with nothing recomputed; on sglang_loss_blocks' 16-row blocks (one block's bytes as the
# allowance) the statistics pass. (path, schedule, working_memory) per case.
SGLANG_CASES = {
    "one_block": ("sglang_loss_one_block", paths.SEQUENCES, None),
    "recompute": ("sglang_blocks", paths.SEQUENCES, 0),
    "blocks": ("sglang_loss_blocks", paths.STATISTICS, "blocks"),
}
# The exact head's gradients come from bf16 dlogits: the token loss's and the general op's upstream gradients agree
# to fp32 rounding (TERM_RTOL), which may move a dlogit by one bf16 rounding (2^-8 relative): norm-relative 2^-7.
SGLANG_GRAD_REL = 2.0**-7


@pytest.mark.parametrize("case", sorted(SGLANG_CASES))
@pytest.mark.parametrize("loss_case", ["gspo_seq_tis_kl_entropy", "gmpo"])
def test_sglang_order_against_the_general_op(case, loss_case, monkeypatch):
    """reduction_order="sglang" (torch backend): the exact token loss on each path against the general exact op with
    the same loss through autograd: log-probs and entropies bit for bit, the loss within its fp32 rounding, dX and
    dW within a bf16 rounding of the dlogits; nothing recomputed (interleaved rows too)."""
    path, schedule, memory = SGLANG_CASES[case]
    hidden, weight, tokens = inputs((T,), torch.float32, seed=90)
    if memory == "blocks":
        memory = paths.sglang_blocks_bytes(paths.HOST_SGLANG_BLOCK_ROWS, hidden.shape[1], weight.shape[0] // 8)
    opts = dict(reduction_order="sglang", working_memory=memory)
    b = _batch(91, torch.zeros(T, dtype=torch.float64) - 2.0, _seq_ids(SEQ_LENS, interleave=True))
    loss_fn = _build(b, CASES[loss_case])
    named = paths.path_of_call(hidden, weight, token_loss=loss_fn, backend="torch", **opts)
    assert (named.name, named.schedule) == (path, schedule)
    seen = _spy_recomputed(monkeypatch)
    loss, lp, ent, dx, dw = _run(hidden, weight, tokens, loss_fn, "torch", **opts)
    assert not seen, "a sequence recomputed in SGLang's order"
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    general = ppo_ops.linear_log_probs_and_entropy(h, w, tokens, entropy="grad", backend="torch",
                                                   reduction_order="sglang")
    g_loss = loss_fn(general.log_probs, general.entropy, torch.arange(T)).sum()
    g_dx, g_dw = torch.autograd.grad(g_loss, (h, w))
    assert torch.equal(lp, general.log_probs) and torch.equal(ent, general.entropy)
    size = float(_reference(lp.double().detach(), ent.double().detach(), b, CASES[loss_case], magnitude=True))
    assert abs(float(loss) - float(g_loss.detach())) <= 2 * LOSS_RTOL * size
    for name, got, want in (("dX", dx, g_dx), ("dW", dw, g_dw)):
        rel = float((got.double() - want.double()).norm() / want.double().norm())
        assert rel <= SGLANG_GRAD_REL, f"{name}: norm-relative {rel} against the general op"


# --- the cut itself ---

def _check_cut(ids, counted, block_rows):
    got = sequence_blocks.cut(torch.from_numpy(ids), torch.from_numpy(counted), block_rows)
    assert got.bounds[0][0] == 0 and got.bounds[-1][1] == ids.size
    assert all(r0 < r1 <= r0 + block_rows for r0, r1 in got.bounds), got.bounds
    assert all(a[1] == b[0] for a, b in zip(got.bounds, got.bounds[1:])), "blocks not consecutive"
    recompute = np.zeros(ids.size, bool) if got.recompute is None else got.recompute.numpy()
    block_of = np.repeat(np.arange(len(got.bounds)), [r1 - r0 for r0, r1 in got.bounds])
    for s in np.unique(ids):
        rows = np.flatnonzero(ids == s)
        live = counted[rows].any()
        whole = rows[-1] - rows[0] + 1 == rows.size and rows.size <= block_rows
        if ids.size <= block_rows:
            assert not recompute[rows].any()
        elif not live:
            assert not recompute[rows].any(), "a sequence with nothing counted recomputed"
        elif whole:
            assert not recompute[rows].any() and np.unique(block_of[rows]).size == 1, f"sequence {s} cut"
        else:
            assert recompute[rows].all(), f"sequence {s} (long or split) not recomputed"


@pytest.mark.parametrize("seed", range(20))
def test_cut_keeps_sequences_whole(seed):
    """Random packed and shuffled streams: every block at most block_rows rows, every counted sequence that fits a
    block and is consecutive whole in one block, the others (long, split) recomputed, uncounted ones never."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 30, size=rng.integers(1, 40))
    ids = np.repeat(rng.permutation(lens.size), lens)
    if seed % 3 == 0:  # some rows moved: sequences split
        i, j = rng.integers(0, ids.size, size=2)
        ids[[i, j]] = ids[[j, i]]
    counted = rng.random(ids.size) < 0.8
    counted[np.isin(ids, rng.choice(lens.size, size=lens.size // 5))] = False
    _check_cut(ids.astype(np.int64), counted, int(rng.choice([4, 8, 16, 64])))


def test_cut_packed_stream():
    """Sequences of 3, 5, 2, 10, 1, 4 rows in blocks of 8: the 2-row one moves to the next block whole, the 10-row
    one is recomputed and fills blocks up to 8 rows."""
    ids = torch.repeat_interleave(torch.arange(6), torch.tensor([3, 5, 2, 10, 1, 4]))
    got = sequence_blocks.cut(ids, torch.ones(ids.numel(), dtype=torch.bool), 8)
    assert got.bounds == ((0, 8), (8, 16), (16, 21), (21, 25))
    assert torch.equal(torch.nonzero(got.recompute).squeeze(1), torch.arange(10, 20))


# --- TP = 2 ---

def _tp2_worker(rank, world_size):
    import torch.distributed as dist

    seq_ids = _seq_ids(SEQ_LENS)
    hidden, weight, tokens = inputs((T,), torch.float32, seed=50)
    lsm = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    b = _batch(51, lsm.gather(1, tokens[:, None])[:, 0], seq_ids)
    loss_fn = _build(b, CASES["gspo_seq_tis_kl_entropy"])
    v_local = weight.shape[0] // world_size
    mine = slice(rank * v_local, (rank + 1) * v_local)

    def run(w, group, token_loss):
        hh, ww = hidden.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss, out = ppo_ops.linear_token_loss(hh, ww, tokens, token_loss, tp_group=group, backend="torch",
                                              entropy="grad")
        return (loss.detach(), out.log_probs) + torch.autograd.grad(loss, (hh, ww))

    one = run(weight, None, loss_fn)
    tp = run(weight[mine], dist.group.WORLD, loss_fn)
    assert torch.equal(tp[0], one[0]) and torch.equal(tp[1], one[1]), f"rank {rank}: loss or log-probs differ"
    assert torch.equal(tp[3], one[3][mine]), f"rank {rank}: dW differs"
    assert float((tp[2] - one[2]).abs().max()) <= DX_ACROSS_TP_MAX_REL * float(one[2].abs().max()), f"rank {rank}"

    # ranks that hold different seq_ids cut different blocks: one error on every rank, before the first merge
    other = _build(b, CASES["gspo"]) if rank == 0 else _build(dict(b, seq_ids=_seq_ids(SEQ_LENS, True)),
                                                              CASES["gspo"])
    with pytest.raises(ValueError, match="different sequence blocks") as info:
        run(weight[mine], dist.group.WORLD, other)
    assert info.value.ppo_ops_argument == "token_loss"


def test_tp2_equals_tp1_and_ranks_must_agree():
    """TP = 2 over gloo: loss, log-probs and each rank's dW rows bit for bit TP = 1's, dX within
    DX_ACROSS_TP_MAX_REL; ranks whose losses cut different blocks raise together, naming token_loss."""
    from tests.ranks import run_gloo

    run_gloo(2, _tp2_worker, timeout_s=60, deadline_s=120)


# --- bad input ---

def test_seq_ids_out_of_range_raise_before_any_block(monkeypatch):
    """seq_ids outside [0, T) (a SequenceLoss built by hand): one error naming token_loss, before the first block."""
    import dataclasses

    b = _batch(61, torch.zeros(T, dtype=torch.float64) - 2.0, _seq_ids(SEQ_LENS))
    loss_fn = _build(b, CASES["gspo"])
    bad = dataclasses.replace(loss_fn, seq_ids=loss_fn.seq_ids + T)
    hidden, weight, tokens = inputs((T,), torch.float32, seed=60)
    merged = []
    monkeypatch.setattr(loss_function.BlockLoop, "merge", lambda self, parts: merged.append(1))
    with pytest.raises(ValueError, match=r"seq_ids must be in \[0, ") as info:
        ppo_ops.linear_token_loss(hidden, weight, tokens, bad, backend="torch")
    assert info.value.ppo_ops_argument == "token_loss" and not merged
