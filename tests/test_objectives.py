"""The RL objectives of ppo_ops.token_losses beyond PPO / GRPO (rollout correction, CISPO, the aggregations and the
metrics) against float64 references written here plainly from their sources.

Reference (`_reference_loss`): for every token, in float64,
    w_t = exp(old_t - rollout_t); sequence level: w_t = exp(mean over the sequence's counted tokens of old - rollout)
    c_t = clamp(w_t, low, high) (tis), w_t if w_t <= high [and >= low] else 0 (mis), w_t if low <= w_t <= high else
          0 (icepop); 1 without a correction; 0 where not counted
    r_t = exp(lp_t - old_t); pg_t = max(-A r, -A clip(r, 1 - cl, 1 + ch)) (PPO, dual clip min(pg, -A c) where A < 0)
          or -A sg(clip(r, 1 - cl, 1 + ch)) lp_t (CISPO, MiniMax-M1 eq. 4)
    term_t = c_t pg_t + kl_coef k3_t - entropy_coef H_t
then the trainer's aggregation with a Python loop over sequences (verl's agg_loss modes, Dr. GRPO's constant).
Gradients w.r.t. log-probs and entropies come from float64 autograd of it; through the logits op and the fused head,
from float64 autograd through log_softmax of float64 logits.

The batch has sequences of one token, a fully masked sequence, and per-sequence rollout offsets that put the
correction weights below, inside and above the caps at both levels (`_assert_corrections_taken` checks it).
"""

import dataclasses
import math

import pytest
import torch

import ppo_ops
from ppo_ops import token_losses
from tests.core_support import backend_params
from tests.linear_support import UNIT_ROUNDOFF, assert_within, bounds, inputs
from tests.ranks import DEVICE, world_size_param
from tests.reference import GRAD_TOL, LOG_PROB_TOL

# fp32 per-row math: ~8 roundings of 2^-24 (log-ratio, exp, products with A, c_t and the weight, the addends' sums),
# each relative to the magnitude of the addend it rounds (as tests/test_token_losses.py).
TERM_RTOL = 1e-6
# fp32 sums of T <= 240 terms over at most a few chunks: (log2 T + chunks) ulps of Σ|terms|, doubled for two sums.
FP32_SUM_RTOL = 3e-6
# A metric computed in float64 and rounded once to fp32 (half an ulp), against the reference's float64 value summed in
# another order: within one fp32 ulp, at most 2^-23 of the value.
METRIC_RTOL = 2.0**-23
# The fused head's loss: each term's fp32 error (its upstream times the log-prob / entropy bound) plus the fp32
# additions of the row blocks' sums: a few ulps of Σ|term| per addition (tests/test_linear_token_loss.py's).
LOSS_SUM_ULPS = 4.0

CLIP_LOW, CLIP_HIGH = 0.2, 0.28
IS_LOW, IS_HIGH = 0.5, 2.0  # IcePop's alpha (0.5) and verl's rollout_is_threshold (2.0)
# Sequence lengths: one-token sequences (0, 3), long and short ones; sequence 5 is fully masked.
SEQ_LENS = (1, 30, 25, 1, 40, 18, 33, 22, 50, 20)
MASKED_SEQ = 5
T = sum(SEQ_LENS)
# Per-sequence rollout weight exp(old - rollout) before a little token noise: below IS_LOW, inside, above IS_HIGH.
SEQ_WEIGHTS = (0.35, 1.0, 3.0, 0.8, 2.5, 1.2, 0.4, 1.5, 2.8, 0.9)


# --- inputs ---

def _ratio_bands(gen, n, cl, ch):
    """Ratios r = exp(lp - old) in bands away from every bound (1 - cl, 1 + ch, the dual-clip cap 3): below the
    lowest, the middle 80% of each gap, above the highest; each band equally likely."""
    points = sorted({1.0 - cl, 1.0 + ch, 3.0})
    bands = [[0.6 * points[0], 0.95 * points[0]]]
    bands += [[lo + 0.1 * (hi - lo), hi - 0.1 * (hi - lo)] for lo, hi in zip(points, points[1:])]
    bands.append([1.1 * points[-1], 1.5 * points[-1]])
    bands = torch.tensor(bands, dtype=torch.float64)
    pick = torch.randint(0, len(bands), (n,), generator=gen)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    return bands[pick, 0] + u * (bands[pick, 1] - bands[pick, 0])


def _batch(seed, *, shuffle=False, lp64=None, cl=CLIP_LOW, ch=CLIP_HIGH):
    """fp32 per-token tensors of the T = sum(SEQ_LENS) tokens. lp64: the true float64 log-probs (the old ones are
    placed so that the ratios against them fall in the bands); else log-probs are drawn."""
    gen = torch.Generator().manual_seed(seed)
    seq_ids = torch.repeat_interleave(torch.arange(len(SEQ_LENS)), torch.tensor(SEQ_LENS))
    n = seq_ids.numel()
    log_r = _ratio_bands(gen, n, cl, ch).log()
    if lp64 is None:
        old = -(torch.rand(n, generator=gen, dtype=torch.float64) * 4 + 0.05)
        lp = old + log_r
    else:
        lp, old = lp64.detach(), lp64.detach() - log_r
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[torch.rand(n, generator=gen) < 0.1] = 0.0
    log_w = torch.tensor(SEQ_WEIGHTS, dtype=torch.float64).log()[seq_ids] + 0.03 * torch.randn(
        n, generator=gen, dtype=torch.float64)
    mask = torch.rand(n, generator=gen) < 0.85
    mask[seq_ids == MASKED_SEQ] = False
    mask[0] = mask[SEQ_LENS[0] + SEQ_LENS[1] + SEQ_LENS[2]] = True  # the one-token sequences are counted
    b = dict(old_log_probs=old, advantages=adv, rollout_log_probs=old - log_w,
             ref_log_probs=old + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64), log_probs=lp,
             entropy=torch.rand(n, generator=gen, dtype=torch.float64) * 3)
    b = {k: v.float() for k, v in b.items()}
    b.update(loss_mask=mask, seq_ids=seq_ids)
    if shuffle:  # a sequence's tokens need not be adjacent for a row-scope loss
        perm = torch.randperm(n, generator=gen)
        b = {k: v[perm] for k, v in b.items()}
    return b


def _build(b, opts):
    kwargs = dict(clip_low=CLIP_LOW, clip_high=CLIP_HIGH)  # the reference's defaults
    kwargs.update(opts)
    for name in ("loss_mask", "seq_ids", "rollout_log_probs", "ref_log_probs"):
        kwargs[name] = b[name]
    return ppo_ops.policy_loss(b["old_log_probs"], b["advantages"], **kwargs)


# --- float64 reference, from the formulas ---

def _reference_correction(b, opts):
    """c_t (float64 [T]) and the level's weight w_t, as the module docstring of rollout_correction writes them."""
    old, rollout = b["old_log_probs"].double(), b["rollout_log_probs"].double()
    counted, seq_ids = b["loss_mask"], b["seq_ids"]
    log_w = torch.where(counted, old - rollout, 0.0)
    mode = opts.get("rollout_correction")
    if mode is None:
        return counted.double(), torch.exp(log_w)
    if mode.startswith("seq_"):
        for s in seq_ids.unique().tolist():
            in_s = seq_ids == s
            if (in_s & counted).any():
                log_w[in_s] = log_w[in_s & counted].mean()
    w = torch.exp(log_w)
    high, low = opts["rollout_is_high"], opts.get("rollout_is_low")
    if mode.endswith("tis"):
        c = w.clamp(min=0.0 if low is None else low, max=high)
    else:
        inside = (w <= high) & ((w >= low) if low is not None else True)
        c = torch.where(inside, w, 0.0)
    return torch.where(counted, c, 0.0), w


def _reference_terms(lp, ent, b, opts):
    """The per-token addends (c pg, kl, entropy) in float64, differentiable in lp and ent."""
    old, adv = b["old_log_probs"].double(), b["advantages"].double()
    cl, ch = opts.get("clip_low", CLIP_LOW), opts.get("clip_high", CLIP_HIGH)
    ratio = torch.exp(lp - old)
    if opts.get("surrogate", "ppo") == "cispo":
        pg = -adv * torch.clamp(ratio, 1 - cl, 1 + ch).detach() * lp
    else:
        pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - cl, 1 + ch))
        if opts.get("dual_clip") is not None:
            pg = torch.where(adv < 0, torch.minimum(pg, -adv * opts["dual_clip"]), pg)
    c, _ = _reference_correction(b, opts)
    addends = [c * pg]
    if opts.get("kl_coef", 0.0):
        x = lp - b["ref_log_probs"].double()
        addends.append(opts["kl_coef"] * (torch.exp(-x) - 1 + x))
    if opts.get("entropy_coef", 0.0):
        addends.append(-opts["entropy_coef"] * ent)
    return addends


def _aggregate(term, b, opts):
    """The trainer's scalar from per-token terms (verl agg_loss; Dr. GRPO's constant)."""
    mask, seq_ids = b["loss_mask"].double(), b["seq_ids"]
    mode = opts.get("normalization", "token_mean")
    if mode == "sum":
        return (term * mask).sum()
    if mode == "token_mean":
        return (term * mask).sum() / mask.sum()
    if mode == "seq_sum_over_constant":
        return (term * mask).sum() / opts["normalization_constant"]
    per_seq = []
    for s in seq_ids.unique().tolist():
        in_s = seq_ids == s
        if mask[in_s].sum() > 0:
            total = (term[in_s] * mask[in_s]).sum()
            per_seq.append(total if mode == "seq_mean_token_sum" else total / mask[in_s].sum())
    return torch.stack(per_seq).mean()


def _reference_loss(lp, ent, b, opts):
    return _aggregate(sum(_reference_terms(lp, ent, b, opts)), b, opts)


def _reference_value_and_grads(lp, ent, b, opts):
    lp = lp.detach().double().requires_grad_(True)
    ent = ent.detach().double().requires_grad_(True)
    value = _reference_loss(lp, ent, b, opts)
    g_lp, g_ent = torch.autograd.grad(value, (lp, ent), allow_unused=True)
    return value.detach(), g_lp, torch.zeros_like(ent) if g_ent is None else g_ent


def _scales(b, opts):
    """Per token: the magnitudes of the value's and the derivative's parts (what the closure's fp32 roundings are
    relative to), times the token's weight in the scalar (the aggregation's derivative w.r.t. the token's term)."""
    lp, ent = b["log_probs"].double(), b["entropy"].double()
    old, adv = b["old_log_probs"].double(), b["advantages"].double()
    cl, ch = opts.get("clip_low", CLIP_LOW), opts.get("clip_high", CLIP_HIGH)
    c, _ = _reference_correction(b, opts)
    ratio = torch.exp(lp - old)
    if opts.get("surrogate", "ppo") == "cispo":  # |A c clip(r) lp|, derivative |A c clip(r)|
        grad = (adv * c).abs() * ratio.clamp(1 - cl, 1 + ch)
        value = grad * lp.abs()
    else:  # the ratio the surrogate uses bounds the value and the derivative
        r_used = torch.where(adv >= 0, ratio.clamp(max=1 + ch), ratio.clamp(min=1 - cl))
        if opts.get("dual_clip") is not None:
            r_used = torch.where(adv >= 0, r_used, r_used.clamp(max=opts["dual_clip"]))
        value = grad = (adv * c).abs() * r_used
    kl, ent_coef = abs(opts.get("kl_coef", 0.0)), abs(opts.get("entropy_coef", 0.0))
    x = lp - b["ref_log_probs"].double()
    value = value + kl * (x.abs() + torch.exp(-x) + 1) + ent_coef * ent
    grad = grad + kl * (1 + torch.exp(-x)) + ent_coef
    weight = torch.autograd.functional.jacobian(lambda t: _aggregate(t, b, opts), torch.zeros_like(lp)).abs()
    return weight * value, weight * grad


def _assert_within(got, expected, bound, what):
    err = (got.double() - expected).abs()
    assert bool((err <= bound).all()), f"{what}: max error over bound {float((err - bound).max()):.3e}"


def _closure_value_and_grads(loss_fn, b):
    lp = b["log_probs"].clone().requires_grad_(True)
    ent = b["entropy"].clone().requires_grad_(True)
    value = loss_fn.total(lp, ent)
    g_lp, g_ent = torch.autograd.grad(value, (lp, ent), allow_unused=True)
    return value.detach(), g_lp, torch.zeros_like(ent) if g_ent is None else g_ent


def _assert_corrections_taken(b, opts):
    """Among counted tokens, the correction keeps some weights and changes (truncates or drops) others."""
    if opts.get("rollout_correction") is None:
        return
    c, w = _reference_correction(b, opts)
    counted = b["loss_mask"]
    assert (counted & (c == w)).any() and (counted & (c != w)).any(), "the caps were not exercised"


# --- the closure against float64 ---

CASES = {
    "token_tis": dict(rollout_correction="token_tis", rollout_is_high=IS_HIGH),
    "token_tis_low": dict(rollout_correction="token_tis", rollout_is_high=IS_HIGH, rollout_is_low=IS_LOW),
    "token_mis": dict(rollout_correction="token_mis", rollout_is_high=IS_HIGH, dual_clip=3.0),
    "token_icepop": dict(rollout_correction="token_icepop", rollout_is_high=IS_HIGH, rollout_is_low=IS_LOW,
                         kl_coef=0.05, entropy_coef=0.01),
    "seq_tis": dict(rollout_correction="seq_tis", rollout_is_high=IS_HIGH, normalization="seq_mean_token_mean"),
    "seq_mis": dict(rollout_correction="seq_mis", rollout_is_high=IS_HIGH, rollout_is_low=IS_LOW,
                    normalization="seq_mean_token_sum"),
    "seq_icepop": dict(rollout_correction="seq_icepop", rollout_is_high=IS_HIGH, rollout_is_low=IS_LOW,
                       normalization="seq_sum_over_constant", normalization_constant=10 * 64.0),
    "cispo": dict(surrogate="cispo", clip_low=1.0, clip_high=4.0),  # MiniMax-M1: no lower bound
    "cispo_token_tis": dict(surrogate="cispo", clip_high=0.28, rollout_correction="token_tis",
                            rollout_is_high=IS_HIGH, kl_coef=0.05, normalization="sum"),
    "seq_mean_token_sum": dict(normalization="seq_mean_token_sum", entropy_coef=0.01),
    "dr_grpo": dict(normalization="seq_sum_over_constant", normalization_constant=10 * 64.0),
}
SHUFFLED = {"seq_tis", "cispo_token_tis"}  # sequence tokens not adjacent


@pytest.mark.parametrize("case", sorted(CASES))
def test_objective_matches_float64_and_closed_form_is_autograds(case):
    """Loss and gradients within the per-token bounds of the float64 reference; value_and_grad (the fused head's
    path) autograd's bits of __call__ on rows in any order."""
    opts = CASES[case]
    cl = opts.get("clip_low", CLIP_LOW)
    b = _batch(10 + sorted(CASES).index(case), shuffle=case in SHUFFLED, cl=min(cl, 0.9),
               ch=opts.get("clip_high", CLIP_HIGH))
    loss_fn = _build(b, opts)
    value, g_lp, g_ent = _closure_value_and_grads(loss_fn, b)
    ref_value, ref_g_lp, ref_g_ent = _reference_value_and_grads(b["log_probs"], b["entropy"], b, opts)
    value_scale, grad_scale = _scales(b, opts)
    _assert_within(value, ref_value, (TERM_RTOL + FP32_SUM_RTOL) * value_scale.sum(), "loss")
    _assert_within(g_lp, ref_g_lp, TERM_RTOL * grad_scale, "d loss / d log_probs")
    _assert_within(g_ent, ref_g_ent, TERM_RTOL * grad_scale, "d loss / d entropy")
    assert bool((g_lp[~b["loss_mask"]] == 0).all()), "an uncounted token got a gradient"
    _assert_corrections_taken(b, opts)

    rows = torch.randperm(g_lp.numel(), generator=torch.Generator().manual_seed(3))[:97]
    lp = b["log_probs"][rows].clone().requires_grad_(True)
    ent = b["entropy"][rows].clone().requires_grad_(True)
    terms = loss_fn(lp, ent, rows)
    want = (terms.detach(),) + torch.autograd.grad(terms, (lp, ent), torch.ones_like(terms), allow_unused=True)
    got = loss_fn.value_and_grad(b["log_probs"][rows], b["entropy"][rows], rows)
    for name, g, w in zip(("terms", "d / d log_probs", "d / d entropy"), got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert torch.equal(g.view(torch.int32), w.view(torch.int32)), f"{name}: not autograd's bits"


@pytest.mark.parametrize("mode", ["token_tis", "token_mis", "token_icepop", "seq_tis", "seq_mis", "seq_icepop"])
def test_correction_at_its_caps(mode):
    """Weights exactly at a cap are inside it (kept unchanged), just past it truncated (tis) or dropped (mis,
    icepop). Log-weights are dyadic, so the sequence means are exact and w equals the cap bit for bit."""
    d_high, d_low = 0.75, -0.5
    high = float(torch.exp(torch.tensor(d_high, dtype=torch.float64)))
    low = float(torch.exp(torch.tensor(d_low, dtype=torch.float64)))
    # one-token-wide sequences of 2 tokens each: at high, just past high, at low, just below low, inside
    log_w = torch.tensor([d_high, d_high, d_high + 2**-10, d_high + 2**-10, d_low, d_low, d_low - 2**-10,
                          d_low - 2**-10, 0.25, 0.25])
    seq_ids = torch.arange(10) // 2
    old = torch.full((10,), -1.0)
    adv = torch.ones(10)
    lp = old.clone()
    loss_fn = ppo_ops.policy_loss(old, adv, normalization="sum", seq_ids=seq_ids, rollout_log_probs=old - log_w,
                                  rollout_correction=mode, rollout_is_high=high, rollout_is_low=low)
    _, g_lp, _ = loss_fn.value_and_grad(lp, None, torch.arange(10))
    w = torch.exp(log_w.double())
    if mode.endswith("tis"):
        want = w.clamp(low, high)
    else:
        want = torch.where((w >= low) & (w <= high), w, 0.0)
    # ratio 1, A = 1, "sum": d term / d lp = -c exactly (c rounded once to fp32)
    assert torch.equal(-g_lp, want.float()), f"{mode}: {(-g_lp).tolist()} vs {want.tolist()}"


def test_row_chunks_sum_to_the_whole_with_sequence_level_weights():
    """A sequence-level correction with a sequence-normalised aggregation stays row-separable: random row chunks in
    any order sum to the whole call (seq_ids not sorted)."""
    b = _batch(41, shuffle=True)
    loss_fn = _build(b, CASES["seq_mis"])
    terms = loss_fn(b["log_probs"], b["entropy"], torch.arange(T))
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(4))
    parts = torch.stack([loss_fn(b["log_probs"][r], b["entropy"][r], r).sum() for r in perm.split(37)])
    assert torch.equal(loss_fn(b["log_probs"][perm], b["entropy"][perm], perm), terms[perm]), "a row's term moved"
    _assert_within(parts.sum(), terms.sum().double(), FP32_SUM_RTOL * terms.abs().sum().double(), "chunked loss")


# --- metrics ---

@pytest.mark.parametrize("case", ["token_icepop", "seq_mis", "cispo_token_tis"])
def test_metrics_match_float64(case):
    opts = CASES[case]
    b = _batch(60 + sorted(CASES).index(case), ch=opts.get("clip_high", CLIP_HIGH))
    loss_fn = _build(b, opts)
    got = loss_fn.metrics(b["log_probs"])
    counted, seq_ids = b["loss_mask"], b["seq_ids"]
    old, rollout, lp = (b[k].double() for k in ("old_log_probs", "rollout_log_probs", "log_probs"))
    adv = b["advantages"].double()
    cl, ch = opts.get("clip_low", CLIP_LOW), opts.get("clip_high", CLIP_HIGH)
    c, w = _reference_correction(b, opts)
    r = torch.exp(lp - old)
    if opts.get("surrogate") == "cispo":
        clipped = (r > 1 + ch) | (r < 1 - cl)
    else:
        clipped = ((adv > 0) & (r > 1 + ch)) | ((adv < 0) & (r < 1 - cl))
    diffs = [(rollout - old)[(seq_ids == s) & counted].mean() for s in seq_ids.unique().tolist()
             if ((seq_ids == s) & counted).any()]
    x = (old - rollout)[counted]
    want = {
        "clipped_share": clipped[counted].double().mean(),
        "dual_clipped_share": ((adv < 0) & (r > opts.get("dual_clip", math.inf)))[counted].double().mean(),
        "ppo_kl": (old - lp)[counted].mean(),
        "rollout_k3_kl": (torch.exp(x) - 1 - x).mean(),
        "rollout_log_ppl_diff": torch.stack(diffs).mean(),
        "rollout_corrected_share": (c != w)[counted].double().mean(),
        "rollout_weight_mean": c[counted].mean(),
    }
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == torch.float32 and got[name].shape == ()
        # ppo_kl: fp32 log-ratios (one rounding each, of |lp - old| <= 5) summed in fp32
        tol = FP32_SUM_RTOL * 5 if name == "ppo_kl" else METRIC_RTOL * abs(float(value))
        assert abs(float(got[name]) - float(value)) <= tol, f"{name}: {float(got[name])} vs {float(value)}"
    assert 0 < float(got["clipped_share"]) < 1 and 0 < float(got["rollout_corrected_share"]) < 1


def test_nothing_counted_gives_zero_metrics_and_loss():
    b = _batch(70)
    b["loss_mask"] = torch.zeros_like(b["loss_mask"])
    loss_fn = _build(b, CASES["seq_icepop"])
    assert float(loss_fn.total(b["log_probs"], b["entropy"])) == 0.0
    assert all(float(v) == 0.0 for v in loss_fn.metrics(b["log_probs"]).values())


def test_inputs_not_written_and_correction_weights_detached():
    b = _batch(71)
    before = {k: v.clone() for k, v in b.items()}
    rollout = b["rollout_log_probs"].clone().requires_grad_(True)
    loss_fn = ppo_ops.policy_loss(b["old_log_probs"], b["advantages"], rollout_log_probs=rollout,
                                  rollout_correction="token_tis", loss_mask=b["loss_mask"])
    value = loss_fn.total(b["log_probs"].clone().requires_grad_(True))
    assert not loss_fn.pg_coef.requires_grad and value.requires_grad
    for k, v in b.items():
        assert torch.equal(v, before[k]), k


# --- through the logits op and the fused head ---

def _logits_case(seed, n_vocab=53):
    gen = torch.Generator().manual_seed(seed)
    n = sum(SEQ_LENS)
    logits = torch.randn(n, n_vocab, generator=gen) * 2
    tokens = torch.randint(0, n_vocab, (n,), generator=gen)
    return logits, tokens


@pytest.mark.parametrize("case", ["seq_icepop", "cispo_token_tis"])
def test_through_the_logits_op(case):
    """log_probs_and_entropy -> total -> backward against float64 logits through log_softmax and the reference.
    Bound per logit of row t: M_t (LOG_PROB_TOL max(1, |lp_t|) + GRAD_TOL + TERM_RTOL), M_t the row's derivative
    magnitude times its weight (as tests/test_token_losses.py's end-to-end test)."""
    opts = CASES[case]
    logits, tokens = _logits_case(80 + sorted(CASES).index(case))
    logits64 = logits.double().requires_grad_(True)
    log_sm = torch.log_softmax(logits64, -1)
    lp64, ent64 = log_sm.gather(1, tokens[:, None])[:, 0], -(log_sm.exp() * log_sm).sum(-1)
    b = _batch(90, lp64=lp64, ch=opts.get("clip_high", CLIP_HIGH))
    loss_fn = _build(b, opts)
    x = logits.clone().requires_grad_(True)
    out = ppo_ops.log_probs_and_entropy(x, tokens, entropy="grad")
    value = loss_fn.total(out.log_probs, out.entropy)
    (grad,) = torch.autograd.grad(value, x)
    ref_value = _reference_loss(lp64, ent64, b, opts)
    (ref_grad,) = torch.autograd.grad(ref_value, logits64)
    b64 = dict(b, log_probs=lp64.detach().float(), entropy=ent64.detach().float())
    value_scale, grad_scale = _scales(b64, opts)
    lp_err = LOG_PROB_TOL * lp64.detach().abs().clamp(min=1.0)
    _assert_within(grad, ref_grad, (grad_scale * (lp_err + GRAD_TOL + TERM_RTOL))[:, None].expand_as(grad),
                   "d loss / d logits")
    _assert_within(value.detach(), ref_value.detach(),
                   (grad_scale * lp_err).sum() + (TERM_RTOL + FP32_SUM_RTOL) * value_scale.sum(), "loss")


# Triton under the CPU interpreter takes minutes for this call's 15 row blocks; the torch backend makes the same
# per-block loss calls, and the GPU target runs both.
FUSED_BACKENDS = [p for p in backend_params(DEVICE) if p.values[0] == "torch" or DEVICE.type == "cuda"]


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_through_the_fused_head(backend):
    """linear_token_loss with a sequence-level correction and CISPO over several row blocks: the loss, dX and dW
    within tests/linear_support.py's bounds of float64 (the reference's gradient as the upstream weights), and the
    closed form gives the bits of the same loss taken through autograd (a plain closure)."""
    from ppo_ops.lm_head import paths

    opts = dict(CASES["cispo_token_tis"], rollout_correction="seq_icepop", rollout_is_low=IS_LOW)
    dtype = torch.float32
    lead = (sum(SEQ_LENS),)
    assert lead[0] > paths.HOST_LOSS_BLOCK_ROWS, "one row block only: sequences would not span blocks"
    hidden, weight, tokens = inputs(lead, dtype, seed=120)
    x, w = hidden.double(), weight.double()
    lsm = torch.log_softmax(x @ w.T, -1)
    lp64 = lsm.gather(1, tokens[:, None])[:, 0]
    ent64 = -(lsm.exp() * lsm).sum(-1)
    b = _batch(121, lp64=lp64, ch=opts["clip_high"])
    loss_fn = _build(b, opts)
    on_device = loss_fn if DEVICE.type == "cpu" else _to_device(loss_fn)

    def run(token_loss):
        h = hidden.detach().clone().to(DEVICE).requires_grad_(True)
        wt = weight.detach().clone().to(DEVICE).requires_grad_(True)
        loss, out = ppo_ops.linear_token_loss(h, wt, tokens.to(DEVICE), token_loss, entropy="grad", backend=backend)
        dx, dw = torch.autograd.grad(loss, (h, wt))
        return loss.detach().cpu(), out.log_probs.cpu(), dx.cpu(), dw.cpu()

    loss, lp, dx, dw = run(on_device)
    _, g_lp, g_ent = _reference_value_and_grads(lp64, ent64, b, opts)
    bd = bounds(hidden, weight, tokens, g_lp.float(), g_ent.float(),
                dl_roundoff=UNIT_ROUNDOFF[dtype] if backend == "triton" else 0.0)
    assert_within("dX", dx, bd["dx"])
    assert_within("dW", dw, bd["dw"])
    ref_value = _reference_loss(lp64, ent64, b, opts)
    terms = torch.stack(_reference_terms(lp64, ent64, b, opts)).sum(0)
    loss_tol = ((g_lp.abs() * bd["log_probs"][1]).sum() + (g_ent.abs() * bd["entropy"][1]).sum()
                + LOSS_SUM_ULPS * lead[0] * UNIT_ROUNDOFF[torch.float32] * (terms.abs() * b["loss_mask"]).sum())
    assert abs(float(loss) - float(ref_value)) <= float(loss_tol)

    wrapped = run(lambda lp_, ent_, rows: on_device(lp_, ent_, rows))
    for what, a, c in zip(("loss", "log-probs", "dX", "dW"), (loss, lp, dx, dw), wrapped):
        assert torch.equal(a, c), f"{what}: the closed form differs from autograd's path"


def _to_device(loss):
    import dataclasses

    fields = {f.name: getattr(loss, f.name) for f in dataclasses.fields(loss)}
    moved = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
    return type(loss)(**moved)


# --- bad input: one error naming the argument, at construction ---

def _bad(**changes):
    def build():
        b = _batch(99)
        kwargs = dict(loss_mask=b["loss_mask"], seq_ids=b["seq_ids"], rollout_log_probs=b["rollout_log_probs"],
                      rollout_correction="token_tis")
        kwargs.update(changes)
        return ppo_ops.policy_loss(b["old_log_probs"], b["advantages"], **kwargs)
    return build


BAD_INPUTS = {
    "mode_unknown": (_bad(rollout_correction="tis"), ValueError, "rollout_correction"),
    "high_negative": (_bad(rollout_is_high=-1.0), ValueError, "rollout_is_high"),
    "high_zero": (_bad(rollout_is_high=0.0), ValueError, "rollout_is_high"),
    "high_inf": (_bad(rollout_is_high=math.inf), ValueError, "rollout_is_high"),
    "high_string": (_bad(rollout_is_high="2"), TypeError, "rollout_is_high"),
    "low_negative": (_bad(rollout_is_low=-0.5), ValueError, "rollout_is_low"),
    "low_above_high": (_bad(rollout_is_low=3.0), ValueError, "rollout_is_low"),
    "icepop_without_low": (_bad(rollout_correction="token_icepop"), ValueError, "rollout_is_low"),
    "seq_level_without_seq_ids": (_bad(rollout_correction="seq_tis", seq_ids=None), ValueError, "seq_ids"),
    "correction_without_rollout": (_bad(rollout_log_probs=None), ValueError, "rollout_log_probs"),
    "rollout_wrong_shape": (_bad(rollout_log_probs=torch.zeros(T, 1)), ValueError, "rollout_log_probs"),
    "rollout_integer": (_bad(rollout_log_probs=torch.zeros(T, dtype=torch.long)), TypeError, "rollout_log_probs"),
    "surrogate_unknown": (_bad(surrogate="gspo"), ValueError, "surrogate"),
    "cispo_dual_clip": (_bad(surrogate="cispo", dual_clip=3.0), ValueError, "dual_clip"),
    "ppo_clip_low_one": (_bad(clip_low=1.0), ValueError, "clip_low"),
    "cispo_clip_low_above_one": (_bad(surrogate="cispo", clip_low=1.5), ValueError, "clip_low"),
    "constant_missing": (_bad(normalization="seq_sum_over_constant"), ValueError, "normalization_constant"),
    "constant_negative": (_bad(normalization="seq_sum_over_constant", normalization_constant=-4.0), ValueError,
                          "normalization_constant"),
    "constant_unused": (_bad(normalization_constant=4.0), ValueError, "normalization_constant"),
    "seq_mean_token_sum_without_seq_ids": (_bad(normalization="seq_mean_token_sum", seq_ids=None), ValueError,
                                           "seq_ids"),
    "metrics_wrong_shape": (lambda: _bad()().metrics(torch.zeros(T, 1)), ValueError, "log_probs"),
}


@pytest.mark.parametrize("case_id", sorted(BAD_INPUTS))
def test_bad_input_raises_naming_the_argument(case_id):
    build, exc_type, name = BAD_INPUTS[case_id]
    with pytest.raises(exc_type) as info:
        build()
    assert info.value.ppo_ops_argument == name and name in str(info.value), f"{case_id}: {info.value}"


def test_public_names():
    assert token_losses.NORMALIZATIONS[:5] == ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                               "seq_sum_over_constant", "sum")
    assert ppo_ops.rollout_correction.MODES == ("token_tis", "token_mis", "token_icepop", "seq_tis", "seq_mis",
                                                "seq_icepop")


# --- sequence scope: GSPO, GMPO ---

U32 = UNIT_ROUNDOFF[torch.float32]
MAX_ABS_LOG_RATIO = 2.0  # |lp - old| of the batches below (asserted): the ratio bands span [0.48, 4.5]
# A sequence's mean log-ratio: index_add_ adds its L <= 50 terms one at a time in fp32 (L ulps of Σ|x| <= L max|x|),
# then a division and exp (a few ulps): an absolute error in log s, hence a relative one in s, of at most
# (L + 8) u max|x|.
SEQ_RTOL = (max(SEQ_LENS) + 8) * U32 * MAX_ABS_LOG_RATIO

SEQ_CASES = {
    "gspo": dict(kind="gspo", clip_low=0.2, clip_high=0.28),
    "gspo_seq_tis_kl_entropy": dict(kind="gspo", clip_low=0.2, clip_high=0.28, rollout_correction="seq_tis",
                                    rollout_is_high=IS_HIGH, kl_coef=0.05, entropy_coef=0.01,
                                    normalization="token_mean"),
    "gmpo": dict(kind="gmpo"),
    "gmpo_icepop_token_sum": dict(kind="gmpo", rollout_correction="token_icepop", rollout_is_high=IS_HIGH,
                                  rollout_is_low=IS_LOW, normalization="seq_mean_token_sum"),
}
SEQ_SHUFFLED = {"gmpo"}  # sequence tokens not adjacent


def _seq_opts(opts):
    """The options as the reference reads them (clip bounds filled in with the loss's defaults)."""
    from ppo_ops import sequence_losses as sl

    out = dict(opts)
    gspo = opts["kind"] == "gspo"
    out.setdefault("clip_low", sl.GSPO_CLIP_LOW if gspo else sl.GMPO_CLIP_LOW)
    out.setdefault("clip_high", sl.GSPO_CLIP_HIGH if gspo else sl.GMPO_CLIP_HIGH)
    out.setdefault("normalization", "seq_mean_token_mean")
    return out


def _build_seq(b, opts):
    kwargs = {k: v for k, v in opts.items() if k != "kind"}
    for name in ("loss_mask", "rollout_log_probs", "ref_log_probs"):
        kwargs[name] = b[name]
    make = ppo_ops.gspo_loss if opts["kind"] == "gspo" else ppo_ops.gmpo_loss
    return make(b["old_log_probs"], b["advantages"], b["seq_ids"], **kwargs)


def _reference_seq_pg(lp, b, opts, magnitude=False):
    """Per token c_t pg_t of GSPO / GMPO in float64, a Python loop over sequences (sequences_losses' docstring).
    magnitude: |A| in place of -A (the clip sides from A's sign): the sizes the fp32 roundings are relative to."""
    old, adv = b["old_log_probs"].double(), b["advantages"].double()
    counted, seq_ids, m = b["loss_mask"], b["seq_ids"], b["loss_mask"].double()
    hi, lo = math.log(1 + opts["clip_high"]), math.log(1 - opts["clip_low"])
    scale = adv.abs() if magnitude else -adv
    pg = torch.zeros_like(lp)
    for s in seq_ids.unique().tolist():
        in_s = (seq_ids == s) & counted
        if not in_s.any():
            continue
        x = lp - old
        big_m = m[in_s].sum()
        if opts["kind"] == "gspo":
            log_s = (m[in_s] * x[in_s]).sum() / big_m
            val = scale * torch.exp(torch.where(adv >= 0, log_s.clamp(max=hi), log_s.clamp(min=lo)))
        else:
            x_clip = torch.where(adv >= 0, x.clamp(max=hi), x.clamp(min=lo))
            ratio = torch.exp((m[in_s] * x_clip[in_s]).sum() / big_m)
            a_bar = (m[in_s] * (adv.abs() if magnitude else adv)[in_s]).sum() / big_m
            val = (a_bar if magnitude else -a_bar) * ratio * torch.ones_like(lp)
        pg = torch.where(in_s, val, pg)
    c, _ = _reference_correction(b, opts)
    return c * pg


def _reference_seq_loss(lp, ent, b, opts):
    rest = _reference_terms(lp, ent, b, dict(opts, rollout_correction=None))[1:]  # KL, entropy
    return _aggregate(_reference_seq_pg(lp, b, opts) + sum(rest, torch.zeros_like(lp)), b, opts)


def _seq_bounds(b, opts):
    """(value bound, per-token gradient bound) of the fp32 loss against the reference: SEQ_RTOL + TERM_RTOL
    relative to the magnitudes of the sequence terms and their derivatives, TERM_RTOL to the KL / entropy parts."""
    lp = b["log_probs"].double().requires_grad_(True)
    mag = _aggregate(_reference_seq_pg(lp, b, opts, magnitude=True), b, opts)
    (g_mag,) = torch.autograd.grad(mag, lp)
    mag = float(mag.detach())
    rest_opts = dict(opts, rollout_correction=None, clip_low=0.2, clip_high=0.2)
    value_rest, grad_rest = _scales(dict(b, advantages=torch.zeros_like(b["advantages"])), rest_opts)
    rtol = SEQ_RTOL + TERM_RTOL
    value = rtol * mag + TERM_RTOL * value_rest.sum() + FP32_SUM_RTOL * (mag + value_rest.sum())
    return value, rtol * g_mag.abs() + TERM_RTOL * grad_rest


def _assert_seq_clips_taken(b, opts):
    """GSPO: some counted sequences clipped, some not; GMPO: some counted tokens clipped, some not."""
    lp = b["log_probs"].double()
    with_clip = _reference_seq_pg(lp, b, opts, magnitude=True)
    no_clip = _reference_seq_pg(lp, b, dict(opts, clip_low=1 - 1e-12, clip_high=1e12), magnitude=True)
    counted = b["loss_mask"] & (b["advantages"] != 0)
    assert (counted & (with_clip != no_clip)).any() and (counted & (with_clip == no_clip)).any()


@pytest.mark.parametrize("case", sorted(SEQ_CASES))
def test_sequence_loss_matches_float64_and_freezes_exactly(case):
    """GSPO / GMPO against the float64 reference (values, gradients w.r.t. log-probs and entropies); the frozen
    TokenLoss (what the fused head's gradient pass evaluates) has the loss's value and gradient at that point, and
    its closed form gives autograd's bits."""
    opts = _seq_opts(SEQ_CASES[case])
    b = _batch(200 + sorted(SEQ_CASES).index(case), shuffle=case in SEQ_SHUFFLED)
    assert float((b["log_probs"] - b["old_log_probs"]).abs().max()) <= MAX_ABS_LOG_RATIO
    loss_fn = _build_seq(b, opts)
    assert loss_fn.scope == "sequence"
    value, g_lp, g_ent = _closure_value_and_grads(loss_fn, b)
    lp = b["log_probs"].double().requires_grad_(True)
    ent = b["entropy"].double().requires_grad_(True)
    ref_value = _reference_seq_loss(lp, ent, b, opts)
    ref_g_lp, ref_g_ent = torch.autograd.grad(ref_value, (lp, ent), allow_unused=True)
    ref_g_ent = torch.zeros_like(ent) if ref_g_ent is None else ref_g_ent
    value_bound, grad_bound = _seq_bounds(b, opts)
    _assert_within(value, ref_value.detach(), value_bound, "loss")
    _assert_within(g_lp, ref_g_lp, grad_bound, "d loss / d log_probs")
    _assert_within(g_ent, ref_g_ent, grad_bound, "d loss / d entropy")
    assert bool((g_lp[~b["loss_mask"]] == 0).all()), "an uncounted token got a gradient"
    _assert_seq_clips_taken(b, opts)

    frozen = loss_fn.freeze(b["log_probs"])
    assert isinstance(frozen, token_losses.TokenLoss) and frozen.scope == "row"
    f_value, f_g_lp, f_g_ent = _closure_value_and_grads(frozen, b)
    _assert_within(f_value, value.double(), FP32_SUM_RTOL * value_bound / (SEQ_RTOL + TERM_RTOL), "frozen loss")
    assert torch.equal(f_g_lp, g_lp) and torch.equal(f_g_ent, g_ent), "the frozen gradient is not the loss's"
    rows = torch.randperm(T, generator=torch.Generator().manual_seed(9))[:97]
    lp_r = b["log_probs"][rows].clone().requires_grad_(True)
    ent_r = b["entropy"][rows].clone().requires_grad_(True)
    terms = frozen(lp_r, ent_r, rows)
    want = (terms.detach(),) + torch.autograd.grad(terms, (lp_r, ent_r), torch.ones_like(terms), allow_unused=True)
    got = frozen.value_and_grad(b["log_probs"][rows], b["entropy"][rows], rows)
    for name, g, w in zip(("terms", "d / d log_probs", "d / d entropy"), got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert torch.equal(g, w), f"{name}: not autograd's bits"


def test_sequence_loss_through_the_logits_op():
    opts = _seq_opts(SEQ_CASES["gspo_seq_tis_kl_entropy"])
    logits, tokens = _logits_case(210)
    logits64 = logits.double().requires_grad_(True)
    log_sm = torch.log_softmax(logits64, -1)
    lp64, ent64 = log_sm.gather(1, tokens[:, None])[:, 0], -(log_sm.exp() * log_sm).sum(-1)
    b = _batch(211, lp64=lp64)
    loss_fn = _build_seq(b, opts)
    x = logits.clone().requires_grad_(True)
    out = ppo_ops.log_probs_and_entropy(x, tokens, entropy="grad")
    (grad,) = torch.autograd.grad(loss_fn.total(out.log_probs, out.entropy), x)
    (ref_grad,) = torch.autograd.grad(_reference_seq_loss(lp64, ent64, b, opts), logits64)
    # per row: its upstream's bound, plus the logits op's error per unit of upstream (GRAD_TOL), plus the upstream
    # moved by the log-probs' error (LOG_PROB_TOL max(1, |lp|) relative, to first order)
    _, grad_bound = _seq_bounds(dict(b, log_probs=lp64.detach().float(), entropy=ent64.detach().float()), opts)
    scale = grad_bound / (SEQ_RTOL + TERM_RTOL)
    lp_err = LOG_PROB_TOL * lp64.detach().abs().clamp(min=1.0)
    row_bound = grad_bound + scale * (GRAD_TOL + lp_err.max() * max(SEQ_LENS))
    _assert_within(grad, ref_grad, row_bound[:, None].expand_as(grad), "d loss / d logits")


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_sequence_loss_through_the_fused_head(backend, monkeypatch):
    """linear_token_loss with GSPO over row blocks shorter than most sequences (blocks of 8 rows, sequences up to
    50): the sequence schedule recomputes those (a statistics pass over their rows, the loss frozen there) and forms
    the one-token ones in their blocks; loss, dX, dW within tests/linear_support.py's bounds of float64 with the
    reference's gradient as the upstream weights; the statistics pass's log-probs of the recomputed rows are the
    gradient pass's (the frozen loss's value is its own exactly)."""
    from ppo_ops.lm_head import paths

    opts = _seq_opts(SEQ_CASES["gspo_seq_tis_kl_entropy"])
    hidden, weight, tokens = inputs((T,), torch.float32, seed=220)
    lsm = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    lp64, ent64 = lsm.gather(1, tokens[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
    b = _batch(221, lp64=lp64)
    loss_fn = _build_seq(b, opts)
    if DEVICE.type != "cpu":
        loss_fn = dataclasses.replace(loss_fn, rest=_to_device(loss_fn.rest), advantages=loss_fn.advantages.to(DEVICE),
                                      mask=loss_fn.mask.to(DEVICE), seq_ids=loss_fn.seq_ids.to(DEVICE))
    seen = []  # the statistics pass's log-probs, as freeze receives them
    freeze = ppo_ops.SequenceLoss.freeze
    monkeypatch.setattr(ppo_ops.SequenceLoss, "freeze",
                        lambda self, lp, *a: seen.append((lp,) + a) or freeze(self, lp, *a))
    h = hidden.clone().to(DEVICE).requires_grad_(True)
    w = weight.clone().to(DEVICE).requires_grad_(True)
    loss, out = ppo_ops.linear_token_loss(h, w, tokens.to(DEVICE), loss_fn, entropy="grad", backend=backend)
    # every counted sequence longer than a block (the fully masked one adds nothing: never recomputed)
    recomputed = torch.tensor([n > paths.HOST_SHAPE.loss_block_rows and i != MASKED_SEQ
                               for i, n in enumerate(SEQ_LENS)]).repeat_interleave(torch.tensor(SEQ_LENS)).to(DEVICE)
    assert len(seen) == 1 and torch.equal(seen[0][1], recomputed), "not the sequences longer than a block"
    assert torch.equal(seen[0][0][recomputed], out.log_probs.reshape(-1)[recomputed]), \
        "the gradient pass's log-probs differ from the statistics pass's (the frozen loss is then first-order only)"
    dx, dw = (g.cpu() for g in torch.autograd.grad(loss, (h, w)))
    lp64_ = lp64.detach().requires_grad_(True)
    ent64_ = ent64.detach().requires_grad_(True)
    ref_value = _reference_seq_loss(lp64_, ent64_, b, opts)
    g_lp, g_ent = torch.autograd.grad(ref_value, (lp64_, ent64_))
    bd = bounds(hidden, weight, tokens, g_lp.float(), g_ent.float(),
                dl_roundoff=U32 if backend == "triton" else 0.0)
    assert_within("log_probs", out.log_probs.cpu(), bd["log_probs"])
    assert_within("dX", dx, bd["dx"])
    assert_within("dW", dw, bd["dw"])
    value_bound, _ = _seq_bounds(dict(b, log_probs=lp64.detach().float(), entropy=ent64.detach().float()), opts)
    loss_tol = (value_bound + (g_lp.abs() * bd["log_probs"][1]).sum() + (g_ent.abs() * bd["entropy"][1]).sum()
                + LOSS_SUM_ULPS * T * U32 * abs(float(ref_value.detach())))
    assert abs(float(loss.detach()) - float(ref_value.detach())) <= float(loss_tol)


def _tp_worker(rank, world_size):
    import torch.distributed as dist

    from tests.linear_support import DX_ACROSS_TP_MAX_REL

    hidden, weight, tokens = inputs((T,), torch.float32, seed=230)
    lsm = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    b = _batch(231, lp64=lsm.gather(1, tokens[:, None])[:, 0])
    losses = {"gmpo_icepop_token_sum": _build_seq(b, _seq_opts(SEQ_CASES["gmpo_icepop_token_sum"])),
              "seq_icepop": _build(b, CASES["seq_icepop"]), "cispo_token_tis": _build(b, CASES["cispo_token_tis"])}

    def run(w, group, loss_fn):
        hh = hidden.clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        loss, out = ppo_ops.linear_token_loss(hh, ww, tokens, loss_fn, tp_group=group, backend="torch")
        return (loss.detach(), out.log_probs) + torch.autograd.grad(loss, (hh, ww))

    v_local = weight.shape[0] // world_size
    mine = slice(rank * v_local, (rank + 1) * v_local)
    for name, loss_fn in losses.items():
        one = run(weight, None, loss_fn)
        tp = run(weight[mine], dist.group.WORLD, loss_fn)
        where = f"{name}, TP = {world_size} rank {rank}"
        assert torch.equal(tp[0], one[0]) and torch.equal(tp[1], one[1]), f"{where}: loss or log-probs differ"
        assert torch.equal(tp[3], one[3][mine]), f"{where}: dW differs"
        assert float((tp[2] - one[2]).abs().max()) <= DX_ACROSS_TP_MAX_REL * float(one[2].abs().max()), where


@pytest.mark.parametrize("tp", [world_size_param(2), world_size_param(4)])
def test_losses_at_tp_equal_tp1(tp):
    """The fused token loss at TP = 2 and 4 over gloo, with a sequence-scope loss (GMPO with IcePop) and two
    row-scope ones (a sequence-level IcePop correction, CISPO with token TIS): the loss, log-probs and each rank's dW
    rows bit for bit TP = 1's (the log-probs, hence the losses' constants and statistics, are TP-invariant); dX
    within DX_ACROSS_TP_MAX_REL (its fp32 sum over the ranks' segments in another order)."""
    from tests.ranks import run_gloo

    run_gloo(tp, _tp_worker, timeout_s=60, deadline_s=180)


SEQ_BAD_INPUTS = {
    "seq_ids_wrong_shape": (lambda b: ppo_ops.gspo_loss(b["old_log_probs"], b["advantages"], b["seq_ids"][:-1]),
                            ValueError, "seq_ids"),
    "seq_ids_float": (lambda b: ppo_ops.gspo_loss(b["old_log_probs"], b["advantages"], b["seq_ids"].float()),
                      TypeError, "seq_ids"),
    "clip_low_negative": (lambda b: ppo_ops.gmpo_loss(b["old_log_probs"], b["advantages"], b["seq_ids"],
                                                      clip_low=-0.1), ValueError, "clip_low"),
    "dual_clip": (lambda b: ppo_ops.gspo_loss(b["old_log_probs"], b["advantages"], b["seq_ids"], dual_clip=3.0),
                  TypeError, "dual_clip"),
    "advantages_wrong_shape": (lambda b: ppo_ops.gspo_loss(b["old_log_probs"], b["advantages"][:-1], b["seq_ids"]),
                               ValueError, "advantages"),
    "cap_negative": (lambda b: ppo_ops.gspo_loss(b["old_log_probs"], b["advantages"], b["seq_ids"],
                                                 rollout_log_probs=b["rollout_log_probs"],
                                                 rollout_correction="seq_tis", rollout_is_high=-2.0),
                     ValueError, "rollout_is_high"),
}


@pytest.mark.parametrize("case_id", sorted(SEQ_BAD_INPUTS))
def test_sequence_loss_bad_input_raises_naming_the_argument(case_id):
    build, exc_type, name = SEQ_BAD_INPUTS[case_id]
    with pytest.raises(exc_type) as info:
        build(_batch(98))
    assert info.value.ppo_ops_argument == name and name in str(info.value), f"{case_id}: {info.value}"


# --- batch scope: the top-entropy-share mask ---

ENTROPY_QUANTILE = 0.8  # "80/20": the top 20% of counted tokens by entropy keep their policy-gradient term
# Entropies from the fused head (fp32) against float64 ones: no counted entropy but the threshold's own lies this close
# (relative) to the threshold, so an fp32 entropy error (~1e-6 relative) cannot move a token across it (asserted).
TAU_MARGIN = 1e-5


def _reference_keep(ent64, b):
    """k_t in float64: counted tokens with H_t >= quantile(counted entropies, q) (TRL's get_high_entropy_mask)."""
    counted = b["loss_mask"]
    tau = torch.quantile(ent64[counted], ENTROPY_QUANTILE)
    gap = (ent64[counted] - tau).abs()
    assert bool(((gap > TAU_MARGIN * tau) | (gap == 0)).all()), "an entropy sits next to the threshold"
    return counted & (ent64 >= tau)


def _reference_masked_loss(lp, ent, b, opts, keep):
    terms = _reference_terms(lp, ent, b, opts)
    terms[0] = terms[0] * keep.double()  # the policy-gradient term only
    return _aggregate(sum(terms), b, opts)


@pytest.mark.parametrize("case", ["token_icepop", "cispo_token_tis"])
def test_top_entropy_mask_matches_float64(case):
    """The masked loss against float64 (the mask from float64 entropies), through `total` (the logits op's route)
    and through the frozen TokenLoss (the fused head's); the share it drops is 1 - q of the counted tokens."""
    opts = CASES[case]
    b = _batch(300 + sorted(CASES).index(case), ch=opts.get("clip_high", CLIP_HIGH))
    loss_fn = ppo_ops.top_entropy_mask(_build(b, opts), ENTROPY_QUANTILE)
    assert loss_fn.scope == "batch"
    keep = _reference_keep(b["entropy"].double(), b)
    lp = b["log_probs"].double().requires_grad_(True)
    ent = b["entropy"].double().requires_grad_(True)
    ref_value = _reference_masked_loss(lp, ent, b, opts, keep)
    ref_g_lp, ref_g_ent = torch.autograd.grad(ref_value, (lp, ent), allow_unused=True)
    ref_g_ent = torch.zeros_like(ent) if ref_g_ent is None else ref_g_ent
    value_scale, grad_scale = _scales(b, opts)
    for route, fn in (("total", loss_fn), ("frozen", loss_fn.freeze(b["log_probs"], None, b["entropy"]))):
        value, g_lp, g_ent = _closure_value_and_grads(fn, b)
        _assert_within(value, ref_value.detach(), (TERM_RTOL + FP32_SUM_RTOL) * value_scale.sum(), f"{route}: loss")
        _assert_within(g_lp, ref_g_lp, TERM_RTOL * grad_scale, f"{route}: d loss / d log_probs")
        _assert_within(g_ent, ref_g_ent, TERM_RTOL * grad_scale, f"{route}: d loss / d entropy")
    counted = int(b["loss_mask"].sum())
    share = float(loss_fn.metrics(b["log_probs"], b["entropy"])["entropy_masked_share"])
    dropped = (counted - int(keep.sum())) / counted  # a count over a count: fp32's division rounds it once
    assert share == float(torch.tensor(dropped, dtype=torch.float32)) and abs(share - ENTROPY_QUANTILE) <= 1 / counted


def test_top_entropy_mask_through_the_fused_head():
    """linear_token_loss with the mask over GSPO (a batch statistic over a sequence-scope loss): the statistics pass
    gives every entropy, the threshold and the sequences' ratios; dX, dW within float64's bounds; without the
    entropy asked, one error naming `entropy` before any work."""
    opts = _seq_opts(SEQ_CASES["gspo"])
    hidden, weight, tokens = inputs((T,), torch.float32, seed=320)
    lsm = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    lp64, ent64 = lsm.gather(1, tokens[:, None])[:, 0], -(lsm.exp() * lsm).sum(-1)
    b = _batch(321, lp64=lp64)
    loss_fn = ppo_ops.top_entropy_mask(_build_seq(b, opts), ENTROPY_QUANTILE)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, out = ppo_ops.linear_token_loss(h, w, tokens, loss_fn, entropy="value", backend="torch")
    dx, dw = torch.autograd.grad(loss, (h, w))
    keep = _reference_keep(ent64.detach(), b)
    lp = lp64.detach().requires_grad_(True)
    pg = _reference_seq_pg(lp, b, opts) * keep.double()
    ref_value = _aggregate(pg, b, opts)
    (g_lp,) = torch.autograd.grad(ref_value, lp)
    bd = bounds(hidden, weight, tokens, g_lp.float(), None)
    assert_within("dX", dx, bd["dx"])
    assert_within("dW", dw, bd["dw"])
    assert abs(float(loss.detach()) - float(ref_value.detach())) <= float(
        (SEQ_RTOL + TERM_RTOL) * ref_value.detach().abs() + (g_lp.abs() * bd["log_probs"][1]).sum())
    with pytest.raises(ValueError, match='entropy="value" or "grad"') as info:
        ppo_ops.linear_token_loss(h, w, tokens, loss_fn, backend="torch")
    assert info.value.ppo_ops_argument == "entropy"


ENTROPY_BAD_INPUTS = {
    "quantile_negative": (lambda b: ppo_ops.top_entropy_mask(_build(b, {}), -0.1), ValueError, "quantile"),
    "quantile_above_one": (lambda b: ppo_ops.top_entropy_mask(_build(b, {}), 1.5), ValueError, "quantile"),
    "quantile_nan": (lambda b: ppo_ops.top_entropy_mask(_build(b, {}), math.nan), ValueError, "quantile"),
    "loss_not_shipped": (lambda b: ppo_ops.top_entropy_mask(lambda lp, ent, rows: lp), TypeError, "loss"),
    "total_without_entropy": (lambda b: ppo_ops.top_entropy_mask(_build(b, {})).total(b["log_probs"]), ValueError,
                              "entropy"),
    "rows_not_all": (lambda b: ppo_ops.top_entropy_mask(_build(b, {}))(b["log_probs"][:5], b["entropy"][:5],
                                                                      torch.arange(5)), ValueError, "rows"),
}


@pytest.mark.parametrize("case_id", sorted(ENTROPY_BAD_INPUTS))
def test_top_entropy_mask_bad_input_raises_naming_the_argument(case_id):
    build, exc_type, name = ENTROPY_BAD_INPUTS[case_id]
    with pytest.raises(exc_type) as info:
        build(_batch(97))
    assert info.value.ppo_ops_argument == name and name in str(info.value), f"{case_id}: {info.value}"


def test_sequence_loss_row_mask_leaves_dropped_rows_out_of_the_statistics():
    """Rows a row_mask drops are never scored: they add no term and the fused head's sequence statistics leave them
    out, while the weights stay those of loss_mask (as for a row-scope loss). GMPO with a row_mask equals, within
    float64's bounds, the reference with those tokens out of the statistics and the sum, and the dropped rows get a
    zero dX."""
    opts = _seq_opts(SEQ_CASES["gmpo"])
    hidden, weight, tokens = inputs((T,), torch.float32, seed=240)
    lsm = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    lp64 = lsm.gather(1, tokens[:, None])[:, 0]
    b = _batch(241, lp64=lp64)
    row_mask = torch.rand(T, generator=torch.Generator().manual_seed(242)) < 0.8
    row_mask[0] = True  # the first one-token sequence stays
    loss_fn = _build_seq(b, opts)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, _ = ppo_ops.linear_token_loss(h, w, torch.where(row_mask, tokens, -100), loss_fn, row_mask=row_mask,
                                        backend="torch")
    dx, dw = torch.autograd.grad(loss, (h, w))
    b_kept = dict(b, loss_mask=b["loss_mask"] & row_mask)
    lp = lp64.detach().requires_grad_(True)
    ref_value = _aggregate(_reference_seq_pg(lp, b_kept, opts), b, opts)
    (g_lp,) = torch.autograd.grad(ref_value, lp)
    bd = bounds(hidden, weight, tokens, g_lp.float(), None, row_mask=row_mask)
    assert_within("dX", dx, bd["dx"])
    assert_within("dW", dw, bd["dw"])
    assert bool((dx[~row_mask] == 0).all())
    assert abs(float(loss.detach()) - float(ref_value.detach())) <= float(
        (SEQ_RTOL + TERM_RTOL) * ref_value.detach().abs() + (g_lp.abs() * bd["log_probs"][1]).sum())


def test_grpo_loss_takes_the_same_objectives_options():
    """grpo_loss passes the objectives' options through: with a sequence-level correction, CISPO and a sequence
    aggregation it is policy_loss on its group-normalised advantages, bit for bit."""
    b = _batch(250)
    rewards = torch.randn(len(SEQ_LENS), generator=torch.Generator().manual_seed(251))
    opts = dict(surrogate="cispo", clip_high=0.28, normalization="seq_mean_token_sum",
                rollout_log_probs=b["rollout_log_probs"], rollout_correction="seq_mis", rollout_is_high=IS_HIGH,
                loss_mask=b["loss_mask"], kl_coef=0.0)
    grpo = ppo_ops.grpo_loss(b["old_log_probs"], rewards, b["seq_ids"], group_size=2, **opts)
    adv = ppo_ops.grpo_advantages(rewards, 2)[b["seq_ids"]]
    policy = ppo_ops.policy_loss(b["old_log_probs"], adv, seq_ids=b["seq_ids"], **opts)
    for got, want in zip(_closure_value_and_grads(grpo, b), _closure_value_and_grads(policy, b)):
        assert torch.equal(got, want)
