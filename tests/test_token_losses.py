"""ppo_ops.token_losses against float64 references written here in the textbook form.

The reference (`_Ref.loss`: `_reference_terms`, `_reference_normalise`) takes float64 log-probs and entropies and
computes the trainer's scalar loss the way papers write it: ratio = exp(lp - old),
pg = max(-A ratio, -A clip(ratio, 1 - cl, 1 + ch)), dual clip min(pg, -A c) where A < 0, k1/k2/k3 = x, x^2 / 2,
exp(-x) - 1 + x with x = lp - ref, then the masked token mean, the mean over sequences of each sequence's masked
token mean (a Python loop over sequences), or the masked sum.
Gradients w.r.t. log-probs and entropies come from float64 autograd of it. GRPO's advantages are recomputed per group
in float64 (`_reference_advantages`).

Inputs put every token's ratio in a band away from the clip bounds (`_ratios`): below 1 - cl, inside, above 1 + ch,
and above the dual-clip cap, with advantages of both signs and some exactly 0, so every branch of the surrogate is
taken; `_assert_every_branch_taken` checks that it was.

Tolerances are per token, relative to the magnitude of each addend of the token's term (`_Ref.scales`): the closure
computes each term with a handful of fp32 roundings of those addends.
"""

import math

import pytest
import torch

import ppo_ops
from ppo_ops import token_losses
from tests.reference import GRAD_TOL, LOG_PROB_TOL

# fp32 per-row math: ~8 roundings of 2^-24 (the log-ratio, exp, products with A, coefficients and the weight, the
# sums of the addends), each relative to the magnitude of the addend it rounds: within 16 ulps of that magnitude.
TERM_RTOL = 1e-6
# GRPO's advantages in fp32: the group mean and std of O(1) rewards, a few roundings each, relative to max(1, |A|).
ADV_RTOL = 1e-6
# fp32 sums of T <= 1024 terms, whole (pairwise inside a tensor) or over up to 12 chunks added in turn: each within
# (log2 T + chunks) ulps of Σ|terms|, 22 x 2^-24 = 1.3e-6; two such sums differ by up to twice that.
FP32_SUM_RTOL = 3e-6
# The same elementwise fp32 ops on the same values, on a row's own inputs: a row's term and gradient do not depend on
# which rows share its call, up to an ulp where a vectorised and a scalar exp might round differently.
PER_ROW_RTOL = 2.0**-22

CLIP_HIGHER = 0.28  # DAPO's clip-higher upper bound
DUAL_CLIP = 3.0  # dual-clip PPO's usual cap


# --- inputs ---

def _ratios(gen, n, clip_low, clip_high, dual_clip):
    """Ratios in bands away from every bound (1 - cl, 1 + ch, the dual cap c): below the lowest, the middle 80% of
    each gap between consecutive bounds, above the highest. Without a dual clip, 3 stands in for c (large ratios)."""
    points = sorted({1.0 - clip_low, 1.0 + clip_high, dual_clip if dual_clip is not None else 3.0})
    bands = [[0.6 * points[0], 0.95 * points[0]]]
    bands += [[lo + 0.1 * (hi - lo), hi - 0.1 * (hi - lo)] for lo, hi in zip(points, points[1:])]
    bands.append([1.1 * points[-1], 2.0 * points[-1]])
    bands = torch.tensor(bands, dtype=torch.float64)
    pick = torch.randint(0, len(bands), (n,), generator=gen)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    return bands[pick, 0] + u * (bands[pick, 1] - bands[pick, 0])


def _make_batch(seed, shape=(600,), n_seq=12, *, clip_low=0.2, clip_high=None, dual_clip=None, mask="bool",
                shuffle=False):
    """Per-token constants and fp32 log-probs / entropies of T = prod(shape) tokens in n_seq sequences."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    clip_high = clip_low if clip_high is None else clip_high
    if len(shape) == 2:  # padded [B, L] layout: one sequence per row
        seq_ids = torch.arange(shape[0]).repeat_interleave(shape[1])
    else:  # packed: sequences of random lengths (some possibly empty)
        seq_ids = torch.randint(0, n_seq, (n,), generator=gen).sort().values
    if shuffle:
        seq_ids = seq_ids[torch.randperm(n, generator=gen)]
    adv = torch.randn(n, generator=gen)
    adv[torch.rand(n, generator=gen) < 0.1] = 0.0
    old = -(torch.rand(n, generator=gen) * 4 + 0.05)
    lp = (old.double() + _ratios(gen, n, clip_low, clip_high, dual_clip).log()).float()
    ref = (old + 0.3 * torch.randn(n, generator=gen)).float()
    ent = torch.rand(n, generator=gen) * 3
    if mask == "bool":
        loss_mask = torch.rand(n, generator=gen) < 0.75
    elif mask == "float":  # per-token weights, 0 = not counted
        loss_mask = torch.tensor([0.0, 0.5, 1.0])[torch.randint(0, 3, (n,), generator=gen)]
    else:
        loss_mask = None
    batch = dict(old_log_probs=old, advantages=adv, ref_log_probs=ref, seq_ids=seq_ids, log_probs=lp, entropy=ent,
                 loss_mask=loss_mask)
    return {k: (v.reshape(shape) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _loss_kwargs(batch, opts):
    """policy_loss's keyword arguments: opts, plus the batch's tensors that the options use."""
    kwargs = dict(opts)
    kwargs["loss_mask"] = batch["loss_mask"]
    if opts.get("kl_coef", 0.0) != 0.0:
        kwargs["ref_log_probs"] = batch["ref_log_probs"]
    if opts.get("normalization") == "seq_mean":
        kwargs["seq_ids"] = batch["seq_ids"]
    return kwargs


# --- float64 reference (textbook form) ---

def _reference_terms(lp, ent, old, adv, ref, opts):
    """Unnormalised per-token terms, float64, differentiable in lp and ent."""
    cl = opts.get("clip_low", 0.2)
    ch = opts.get("clip_high") if opts.get("clip_high") is not None else cl
    ratio = torch.exp(lp - old)
    pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - cl, 1 + ch))
    if opts.get("dual_clip") is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * opts["dual_clip"]), pg)
    term = pg
    if opts.get("kl_coef", 0.0) != 0.0:
        x = lp - ref
        kl = {"k1": x, "k2": x**2 / 2, "k3": torch.exp(-x) - 1 + x}[opts.get("kl_type", "k3")]
        term = term + opts["kl_coef"] * kl
    if opts.get("entropy_coef", 0.0) != 0.0:
        term = term - opts["entropy_coef"] * ent
    return term


def _reference_normalise(term, mask, seq_ids, normalization):
    """The trainer's scalar: masked token mean, mean over sequences of masked token means, or masked sum."""
    if normalization == "sum":
        return (term * mask).sum()
    if normalization == "token_mean":
        return (term * mask).sum() / mask.sum() if mask.sum() > 0 else term.sum() * 0
    seq_means = []
    for s in torch.unique(seq_ids).tolist():
        in_s = seq_ids == s
        if mask[in_s].sum() > 0:
            seq_means.append((term[in_s] * mask[in_s]).sum() / mask[in_s].sum())
    return torch.stack(seq_means).mean() if seq_means else term.sum() * 0


def _reference_weights(mask, seq_ids, normalization):
    """Each token's weight in the scalar (for the tolerance scale), by counting."""
    if normalization == "sum":
        return mask.clone()
    if normalization == "token_mean":
        return mask / mask.sum() if mask.sum() > 0 else mask * 0
    weights = torch.zeros_like(mask)
    live = [s for s in torch.unique(seq_ids).tolist() if mask[seq_ids == s].sum() > 0]
    for s in live:
        in_s = seq_ids == s
        weights[in_s] = mask[in_s] / (len(live) * mask[in_s].sum())
    return weights


class _Ref:
    """The float64 reference of one batch and option set (advantages given explicitly for GRPO)."""

    def __init__(self, batch, opts, advantages=None):
        f64 = {k: v.detach().double().reshape(-1) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        self.adv = f64["advantages"] if advantages is None else advantages
        mask = batch["loss_mask"]
        self.mask = torch.ones_like(self.adv) if mask is None else mask.double().reshape(-1)
        self.seq_ids = batch["seq_ids"].reshape(-1)
        self.normalization = opts.get("normalization", "token_mean")
        self.old, self.ref, self.opts = f64["old_log_probs"], f64["ref_log_probs"], opts
        self.weights = _reference_weights(self.mask, self.seq_ids, self.normalization)

    def loss(self, lp, ent):
        term = _reference_terms(lp.reshape(-1), ent.reshape(-1), self.old, self.adv, self.ref, self.opts)
        return _reference_normalise(term, self.mask, self.seq_ids, self.normalization)

    def value_and_grads(self, lp, ent):
        lp = lp.detach().double().reshape(-1).requires_grad_(True)
        ent = ent.detach().double().reshape(-1).requires_grad_(True)
        loss = self.loss(lp, ent)
        g_lp, g_ent = torch.autograd.grad(loss, (lp, ent), allow_unused=True)
        return loss.detach(), g_lp, torch.zeros_like(ent) if g_ent is None else g_ent

    def scales(self, lp, ent, adv_floor=0.0):
        """Per token: the magnitude of the term's addends (value) and of its derivative's (gradient), times the
        weight. adv_floor: |A| is taken as at least this (advantages computed in fp32 carry an absolute error)."""
        lp, ent = lp.detach().double().reshape(-1), ent.detach().double().reshape(-1)
        cl = self.opts.get("clip_low", 0.2)
        ch = self.opts.get("clip_high") if self.opts.get("clip_high") is not None else cl
        ratio = torch.exp(lp - self.old)
        # The ratio the surrogate uses: |pg| = |A| r_used, and |d pg / d lp| (and the second derivative) <= it.
        r_used = torch.where(self.adv >= 0, ratio.clamp(max=1 + ch), ratio.clamp(min=1 - cl))
        if self.opts.get("dual_clip") is not None:
            r_used = torch.where(self.adv >= 0, r_used, r_used.clamp(max=self.opts["dual_clip"]))
        value = grad = self.adv.abs().clamp(min=adv_floor) * r_used
        kl_coef, ent_coef = abs(self.opts.get("kl_coef", 0.0)), abs(self.opts.get("entropy_coef", 0.0))
        x = lp - self.ref
        value = value + kl_coef * (x.abs() + torch.expm1(-x).abs() + x**2 / 2) + ent_coef * ent
        grad = grad + kl_coef * (1 + torch.exp(-x) + x.abs()) + ent_coef
        return self.weights * value, self.weights * grad


# --- checks ---

def _assert_every_branch_taken(ratio, adv, counted, opts):
    """Among counted tokens: each side of each bound, for each sign of A, has tokens (and A = 0 has some)."""
    cl = opts.get("clip_low", 0.2)
    ch = opts.get("clip_high") if opts.get("clip_high") is not None else cl
    branches = {
        "A > 0, ratio inside (or below) the clip: -A ratio": (adv > 0) & (ratio <= 1 + ch),
        "A > 0, ratio above 1 + clip_high: clipped": (adv > 0) & (ratio > 1 + ch),
        "A < 0, ratio below 1 - clip_low: clipped": (adv < 0) & (ratio < 1 - cl),
        "A < 0, ratio inside the clip: -A ratio": (adv < 0) & (ratio >= 1 - cl) & (ratio <= 1 + ch),
        "A = 0": adv == 0,
    }
    if (opts.get("dual_clip") or math.inf) > 1 + ch:
        branches["A < 0, ratio above 1 + clip_high: -A ratio"] = (
            (adv < 0) & (ratio > 1 + ch) & (ratio < (opts.get("dual_clip") or math.inf)))
    if opts.get("dual_clip") is not None:
        branches["A < 0, ratio above the dual clip: -A c"] = (adv < 0) & (ratio > opts["dual_clip"])
        if opts["dual_clip"] < 1 + ch:  # the cap applies to A < 0 only
            branches["A > 0, ratio between the dual clip and 1 + clip_high: -A ratio"] = (
                (adv > 0) & (ratio > opts["dual_clip"]) & (ratio <= 1 + ch))
    empty = [name for name, where in branches.items() if not (where & counted).any()]
    assert not empty, f"branches without a counted token: {empty}"


def _assert_within(got, expected, bound, what):
    err = (got.detach().double() - expected.double()).abs()
    bad = err > bound
    if bad.any():
        i = int(torch.argmax((err - bound).flatten()))
        raise AssertionError(f"{what}: {int(bad.sum())} of {err.numel()} out of tolerance; worst at {i}: got "
                             f"{got.flatten()[i].item():.9g}, expected {expected.flatten()[i].item():.9g}, error "
                             f"{err.flatten()[i].item():.3g} > {bound.flatten()[i].item():.3g}")


def _closure_value_and_grads(loss_fn, batch):
    lp = batch["log_probs"].clone().requires_grad_(True)
    ent = batch["entropy"].clone().requires_grad_(True)
    value = loss_fn.total(lp, ent)
    assert value.dtype == torch.float32 and value.shape == ()
    g_lp, g_ent = torch.autograd.grad(value, (lp, ent), allow_unused=True)
    return value.detach(), g_lp.reshape(-1), torch.zeros(ent.numel()) if g_ent is None else g_ent.reshape(-1)


def _check_against_reference_once(loss_fn, batch, ref, opts, adv_floor=0.0):
    value, g_lp, g_ent = _closure_value_and_grads(loss_fn, batch)
    ref_value, ref_g_lp, ref_g_ent = ref.value_and_grads(batch["log_probs"], batch["entropy"])
    value_scale, grad_scale = ref.scales(batch["log_probs"], batch["entropy"], adv_floor)
    # The weight formula itself: Σ weight * term is the textbook normalised loss.
    with torch.no_grad():
        terms = _reference_terms(batch["log_probs"].double().reshape(-1), batch["entropy"].double().reshape(-1),
                                 ref.old, ref.adv, ref.ref, opts)
    torch.testing.assert_close((ref.weights * terms).sum(), ref_value, rtol=1e-12, atol=1e-12)
    _assert_within(value, ref_value, TERM_RTOL * value_scale.sum() + FP32_SUM_RTOL * value_scale.sum(), "loss")
    _assert_within(g_lp, ref_g_lp, TERM_RTOL * grad_scale, "d loss / d log_probs")
    _assert_within(g_ent, ref_g_ent, TERM_RTOL * grad_scale, "d loss / d entropy")
    ratio = torch.exp(batch["log_probs"].double() - batch["old_log_probs"].double()).reshape(-1)
    _assert_every_branch_taken(ratio, ref.adv, ref.mask != 0, opts)
    return g_lp, ref_g_lp


# --- policy_loss ---

POLICY_CASES = {
    "ppo": {},
    "clip_higher": dict(clip_high=CLIP_HIGHER),
    "clip_low_zero": dict(clip_low=0.0, clip_high=0.3),  # the lower bound at ratio 1
    "dual_clip": dict(dual_clip=DUAL_CLIP),
    "dual_clip_below_clip_high": dict(clip_high=CLIP_HIGHER, dual_clip=1.25),  # the cap must not touch A > 0
    "entropy_bonus": dict(entropy_coef=0.01),
    "kl_k1": dict(kl_coef=0.1, kl_type="k1"),
    "kl_k2": dict(kl_coef=0.1, kl_type="k2"),
    "kl_k3": dict(kl_coef=0.1, kl_type="k3"),
    "token_mean": dict(normalization="token_mean"),
    "seq_mean": dict(normalization="seq_mean"),
    "seq_mean_unsorted_ids": dict(normalization="seq_mean"),  # tokens of a sequence need not be adjacent
    "sum": dict(normalization="sum"),
    "everything": dict(clip_high=CLIP_HIGHER, dual_clip=DUAL_CLIP, entropy_coef=0.02, kl_coef=0.05, kl_type="k3",
                       normalization="seq_mean"),
}
# Per case: the batch layout (shape, loss mask kind) so that the cases cover both layouts and all mask kinds.
POLICY_LAYOUTS = {
    "ppo": dict(mask=None),  # every token counted
    "seq_mean": dict(shape=(12, 50)),  # padded [B, L]: one sequence per row
    "sum": dict(mask="float"),  # fractional per-token weights
    "seq_mean_unsorted_ids": dict(shuffle=True, mask="float"),
    "everything": dict(shape=(16, 40)),
}


@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("case", sorted(POLICY_CASES))
def test_policy_loss_matches_float64(case, seed):
    opts = POLICY_CASES[case]
    batch = _make_batch(seed * 100 + sorted(POLICY_CASES).index(case), clip_low=opts.get("clip_low", 0.2),
                        clip_high=opts.get("clip_high"), dual_clip=opts.get("dual_clip"),
                        **POLICY_LAYOUTS.get(case, {}))
    loss_fn = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], **_loss_kwargs(batch, opts))
    _check_against_reference_once(loss_fn, batch, _Ref(batch, opts), opts)


def _autograd_value_and_grad(loss_fn, lp, ent, rows, entropy_grad):
    """The closure's terms and autograd's gradients, as a fused op without the closed form would take them."""
    lp_in = lp.detach().clone().requires_grad_(True)
    ent_in = ent.detach().clone().requires_grad_(entropy_grad)
    terms = loss_fn(lp_in, ent_in, rows)
    inputs = [lp_in] + ([ent_in] if entropy_grad else [])
    grads = torch.autograd.grad(terms, inputs, grad_outputs=torch.ones_like(terms), allow_unused=True)
    return terms.detach(), grads[0], (grads[1] if entropy_grad else None)


@pytest.mark.parametrize("entropy_grad", [True, False], ids=["entropy_grad", "entropy_value"])
@pytest.mark.parametrize("case", sorted(POLICY_CASES))
def test_closed_form_gradient_is_autograds_bitwise(case, entropy_grad):
    """value_and_grad (what the fused token loss calls per block) gives autograd's terms and gradients of __call__
    bit for bit, on every option, on rows in any order, with uncounted placeholders (-inf, NaN) and log-ratios past
    fp32's exp range among them."""
    opts = POLICY_CASES[case]
    batch = _make_batch(500 + sorted(POLICY_CASES).index(case), clip_high=opts.get("clip_high"),
                        dual_clip=opts.get("dual_clip"), **POLICY_LAYOUTS.get(case, {}))
    loss_fn = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], **_loss_kwargs(batch, opts))
    lp, ent = batch["log_probs"].reshape(-1).clone(), batch["entropy"].reshape(-1).clone()
    uncounted = torch.nonzero(loss_fn.weight == 0).squeeze(1)
    if uncounted.numel():
        lp[uncounted[::2]], ent[uncounted[1::2]] = -math.inf, math.nan
    lp[:3] = loss_fn.old_log_probs[:3] + 100.0  # ratios e^100: clipped, capped or honestly inf
    rows = torch.randperm(lp.numel(), generator=torch.Generator().manual_seed(5))[:257]
    want = _autograd_value_and_grad(loss_fn, lp[rows], ent[rows], rows, entropy_grad)
    got = loss_fn.value_and_grad(lp[rows], ent[rows], rows, entropy_grad=entropy_grad)
    for name, g, w in zip(("terms", "d / d log_probs", "d / d entropy"), got, want):
        assert (g is None) == (w is None), f"{name}: one side has no gradient"
        if w is not None:
            assert torch.equal(g.view(torch.int32), w.view(torch.int32)), f"{name}: not autograd's bits"
    assert not got[0].requires_grad


@pytest.mark.parametrize("case", ["ppo", "clip_higher", "dual_clip"])
def test_clipped_tokens_get_exactly_zero_gradient(case):
    """Without KL or entropy, a token's log-prob gradient is 0 exactly where the textbook surrogate is clipped (the
    reference says so too), and nonzero wherever it is not (A != 0, counted)."""
    opts = POLICY_CASES[case]
    batch = _make_batch(31, clip_high=opts.get("clip_high"), dual_clip=opts.get("dual_clip"))
    loss_fn = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], **_loss_kwargs(batch, opts))
    g_lp, ref_g_lp = _check_against_reference_once(loss_fn, batch, _Ref(batch, opts), opts)
    cl, ch = 0.2, opts.get("clip_high", 0.2)
    ratio = torch.exp(batch["log_probs"].double() - batch["old_log_probs"].double())
    adv, counted = batch["advantages"], batch["loss_mask"]
    clipped = ((adv > 0) & (ratio > 1 + ch)) | ((adv < 0) & (ratio < 1 - cl))
    if opts.get("dual_clip") is not None:
        clipped |= (adv < 0) & (ratio > opts["dual_clip"])
    live = counted & (adv != 0) & ~clipped
    assert (counted & clipped).any() and live.any()
    assert torch.all(ref_g_lp[counted & clipped] == 0) and torch.all(g_lp[counted & clipped] == 0)
    assert torch.all(ref_g_lp[live] != 0) and torch.all(g_lp[live] != 0)


def test_clipped_ratio_past_fp32_exp_range_stays_finite():
    """Log-ratios of 100 (exp overflows fp32 past ~88) where the surrogate is clipped, and with A = 0: finite terms
    equal to the float64 reference (where e^100 is finite) and zero gradients; the unclipped A < 0 side is honestly
    +inf without a dual clip."""
    old = torch.tensor([-100.0, -100.0, -100.0, -1.0])
    adv = torch.tensor([1.5, -0.5, 0.0, 2.0])
    lp = torch.tensor([0.0, 0.0, 0.0, -11.0])  # ratios e^100 (A > 0: clipped), e^100 (A < 0: dual cap), e^100, e^-10
    opts = dict(dual_clip=DUAL_CLIP, normalization="sum")
    loss_fn = ppo_ops.policy_loss(old, adv, **opts)
    lp_leaf = lp.clone().requires_grad_(True)
    terms = loss_fn(lp_leaf, None, torch.arange(4))
    (grad,) = torch.autograd.grad(terms.sum(), lp_leaf)
    lp64 = lp.double().requires_grad_(True)
    expected = _reference_terms(lp64, None, old.double(), adv.double(), None, opts)
    (expected_grad,) = torch.autograd.grad(expected.sum(), lp64)
    assert torch.equal(expected_grad[:3], torch.zeros(3, dtype=torch.float64))
    _assert_within(terms, expected.detach(), TERM_RTOL * expected.detach().abs(), "terms")
    _assert_within(grad, expected_grad, TERM_RTOL * expected_grad.abs(), "gradient")
    no_dual = ppo_ops.policy_loss(old, adv, normalization="sum")(lp, None, torch.arange(4))
    assert no_dual[1].item() == math.inf and torch.isfinite(no_dual[[0, 2, 3]]).all()


# --- GRPO ---

def _reference_advantages(rewards, group_size, scale_by_std, eps):
    out = torch.empty(rewards.numel(), dtype=torch.float64)
    r = rewards.double()
    for g in range(0, r.numel(), group_size):
        group = r[g:g + group_size]
        centred = group - group.sum() / group_size
        if scale_by_std:
            std = math.sqrt(float((centred**2).sum()) / (group_size - 1))  # unbiased sample std
            centred = centred / (std + eps)
        out[g:g + group_size] = centred
    return out


def _make_rewards(seed, n_seq, kind, group_size):
    gen = torch.Generator().manual_seed(seed)
    if kind == "binary":  # pass/fail verifiers; the first group all pass: A = 0 there
        rewards = (torch.rand(n_seq, generator=gen) < 0.5).float()
        rewards[:group_size] = 1.0
        return rewards
    return torch.randn(n_seq, generator=gen) * 2 + 1


@pytest.mark.parametrize("scale_by_std", [True, False])
@pytest.mark.parametrize("group_size", [2, 4, 8])
@pytest.mark.parametrize("kind", ["binary", "normal"])
def test_grpo_advantages_match_float64(scale_by_std, group_size, kind):
    rewards = _make_rewards(group_size * 10 + scale_by_std, 32, kind, group_size)
    got = ppo_ops.grpo_advantages(rewards, group_size, scale_by_std=scale_by_std)
    expected = _reference_advantages(rewards, group_size, scale_by_std, 1e-6)
    assert got.dtype == torch.float32 and got.shape == (32,)
    _assert_within(got, expected, ADV_RTOL * expected.abs().clamp(min=1.0), "advantages")
    if kind == "binary":
        assert torch.all(got[:group_size] == 0)  # equal rewards carry no signal: exactly 0, not 0 / eps noise


GRPO_CASES = {
    "grpo": dict(scale_by_std=True),  # the paper's defaults: k3 KL 0.04, seq_mean
    "dr_grpo": dict(scale_by_std=False, kl_coef=0.0, normalization="sum"),  # Dr. GRPO: no std, no length norm
    "grpo_token_mean_entropy": dict(scale_by_std=True, normalization="token_mean", entropy_coef=0.01,
                                    clip_high=CLIP_HIGHER),
    "grpo_dual_clip": dict(scale_by_std=True, dual_clip=DUAL_CLIP, kl_type="k2"),
}


@pytest.mark.parametrize("case", sorted(GRPO_CASES))
def test_grpo_loss_matches_float64(case):
    opts = dict(GRPO_CASES[case])
    seed = 50 + sorted(GRPO_CASES).index(case)
    n_seq, group_size = 16, 4
    batch = _make_batch(seed, n_seq=n_seq, clip_high=opts.get("clip_high"), dual_clip=opts.get("dual_clip"))
    rewards = _make_rewards(seed, n_seq, "binary", group_size)
    scale_by_std = opts.pop("scale_by_std")
    loss_fn = ppo_ops.grpo_loss(batch["old_log_probs"], rewards, batch["seq_ids"], group_size=group_size,
                                scale_by_std=scale_by_std, ref_log_probs=batch["ref_log_probs"],
                                loss_mask=batch["loss_mask"], **opts)
    ref_opts = dict(kl_coef=0.04, kl_type="k3", normalization="seq_mean")  # grpo_loss's defaults
    ref_opts.update(opts)
    adv = _reference_advantages(rewards, group_size, scale_by_std, 1e-6)[batch["seq_ids"]]
    _check_against_reference_once(loss_fn, batch, _Ref(batch, ref_opts, advantages=adv), ref_opts, adv_floor=1.0)


# --- row-separability ---

@pytest.mark.parametrize("seed", [71, 72, 73])
def test_row_chunks_in_any_order_sum_to_the_whole_call(seed):
    """Random partitions (an empty chunk included) of a random permutation of the rows: every row's term and
    gradient equal the whole call's, and the chunks' sums add up to the whole sum."""
    opts = POLICY_CASES["everything"]
    batch = _make_batch(seed, shape=(1000,), n_seq=20, clip_high=CLIP_HIGHER, dual_clip=DUAL_CLIP)
    loss_fn = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], **_loss_kwargs(batch, opts))
    gen = torch.Generator().manual_seed(seed)
    n = batch["log_probs"].numel()
    lp = batch["log_probs"].clone().requires_grad_(True)
    ent = batch["entropy"].clone().requires_grad_(True)

    whole = loss_fn(lp, ent, torch.arange(n))
    whole_g_lp, whole_g_ent = torch.autograd.grad(whole.sum(), (lp, ent))

    order = torch.randperm(n, generator=gen)
    cuts = torch.cat([torch.tensor([0, 0]), torch.randint(0, n, (10,), generator=gen).sort().values,
                      torch.tensor([n])])  # the repeated 0 is an empty chunk
    chunk_terms = torch.empty(n)
    total = torch.zeros(())
    g_lp, g_ent = torch.zeros(n), torch.zeros(n)
    for start, stop in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        rows = order[start:stop]
        lp_c = lp.detach()[rows].requires_grad_(True)
        ent_c = ent.detach()[rows].requires_grad_(True)
        terms = loss_fn(lp_c, ent_c, rows)
        assert terms.shape == rows.shape and terms.dtype == torch.float32
        if rows.numel():
            gl, ge = torch.autograd.grad(terms.sum(), (lp_c, ent_c))
            g_lp[rows], g_ent[rows] = gl, ge
        chunk_terms[rows] = terms.detach()
        total = total + terms.detach().sum()
    abs_sum = whole.detach().abs().sum()
    _assert_within(chunk_terms, whole.detach(), PER_ROW_RTOL * whole.detach().abs(), "per-row terms")
    _assert_within(g_lp, whole_g_lp, PER_ROW_RTOL * whole_g_lp.abs(), "per-row d / d log_probs")
    _assert_within(g_ent, whole_g_ent, PER_ROW_RTOL * whole_g_ent.abs(), "per-row d / d entropy")
    _assert_within(total, whole.detach().sum(), FP32_SUM_RTOL * abs_sum, "sum over chunks")
    torch.testing.assert_close(loss_fn.total(lp, ent), whole.sum(), rtol=0, atol=0)  # total is the whole call


# --- end to end: the unfused path ---

E2E_CASES = {
    "ppo_everything": dict(kind="policy", opts=POLICY_CASES["everything"]),
    "ppo_kl_k1_token_mean": dict(kind="policy", opts=dict(kl_coef=0.1, kl_type="k1", entropy_coef=0.05)),
    "grpo": dict(kind="grpo", opts=dict(entropy_coef=0.01)),
}


@pytest.mark.parametrize("case", sorted(E2E_CASES))
def test_end_to_end_with_log_probs_and_entropy(case):
    """log_probs_and_entropy(logits, tokens, entropy="grad") -> closure.total -> backward, against float64 logits
    through log_softmax and the same textbook loss: the logits' gradient (and the loss) match.

    Bound per logit of row t: w_t M_t (LOG_PROB_TOL max(1, |lp_t|) + GRAD_TOL + TERM_RTOL), M_t the magnitude of the
    term's derivative (its second derivative is bounded by it too): the op's log-prob error moves the row's upstream
    gradient by at most w_t M_t LOG_PROB_TOL max(1, |lp_t|), the op's gradient is within GRAD_TOL per unit of
    upstream (tests/reference.py), and the closure's own upstream within TERM_RTOL.
    """
    spec = E2E_CASES[case]
    opts = dict(spec["opts"])
    seed = 90 + sorted(E2E_CASES).index(case)
    gen = torch.Generator().manual_seed(seed)
    n_tok, vocab, n_seq, group_size = 160, 97, 8, 4
    logits = torch.randn(n_tok, vocab, generator=gen) * 2
    tokens = torch.randint(0, vocab, (n_tok,), generator=gen)
    logits64 = logits.double().requires_grad_(True)
    log_sm = torch.log_softmax(logits64, -1)
    lp64 = log_sm.gather(1, tokens[:, None])[:, 0]
    ent64 = -(log_sm.exp() * log_sm).sum(-1)

    batch = _make_batch(seed, shape=(n_tok,), n_seq=n_seq, clip_high=opts.get("clip_high"),
                        dual_clip=opts.get("dual_clip"))
    # Old log-probs placed so that the ratios against the true log-probs fall in the clip bands.
    log_ratio = batch["log_probs"].double() - batch["old_log_probs"].double()
    batch["old_log_probs"] = (lp64.detach() - log_ratio).float()
    batch["ref_log_probs"] = (lp64.detach() + 0.3 * torch.randn(n_tok, generator=gen, dtype=torch.float64)).float()
    if spec["kind"] == "grpo":
        rewards = _make_rewards(seed, n_seq, "binary", group_size)
        loss_fn = ppo_ops.grpo_loss(batch["old_log_probs"], rewards, batch["seq_ids"], group_size=group_size,
                                    ref_log_probs=batch["ref_log_probs"], loss_mask=batch["loss_mask"], **opts)
        opts.update(kl_coef=0.04, kl_type="k3", normalization="seq_mean")
        ref = _Ref(batch, opts, advantages=_reference_advantages(rewards, group_size, True, 1e-6)[batch["seq_ids"]])
        adv_floor = 1.0
    else:
        loss_fn = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], **_loss_kwargs(batch, opts))
        ref, adv_floor = _Ref(batch, opts), 0.0

    x = logits.clone().requires_grad_(True)
    out = ppo_ops.log_probs_and_entropy(x, tokens, entropy="grad")
    value = loss_fn.total(out.log_probs, out.entropy)
    (grad,) = torch.autograd.grad(value, x)

    ref_value = ref.loss(lp64, ent64)
    (ref_grad,) = torch.autograd.grad(ref_value, logits64)
    value_scale, grad_scale = ref.scales(lp64, ent64, adv_floor)
    lp_err = LOG_PROB_TOL * lp64.detach().abs().clamp(min=1.0)
    row_bound = grad_scale * (lp_err + GRAD_TOL + TERM_RTOL)
    _assert_within(grad, ref_grad, row_bound[:, None].expand_as(grad), "d loss / d logits")
    value_bound = (grad_scale * lp_err).sum() + (TERM_RTOL + FP32_SUM_RTOL) * value_scale.sum()
    _assert_within(value.detach(), ref_value.detach(), value_bound, "loss")
    ratio = torch.exp(lp64.detach() - batch["old_log_probs"].double())
    _assert_every_branch_taken(ratio, ref.adv, ref.mask != 0, opts)


# --- edge cases ---

def test_uncounted_tokens_cost_nothing_whatever_they_hold():
    """Tokens the mask drops may hold NaN / inf constants, -inf or NaN log-probs and NaN entropies (prompt rows,
    padding): the loss and every gradient equal, bitwise, those of the same batch with finite placeholders there,
    and the dropped tokens' gradients are exactly 0."""
    opts = POLICY_CASES["everything"]
    clean = _make_batch(7, clip_high=CLIP_HIGHER, dual_clip=DUAL_CLIP)
    dirty = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in clean.items()}
    out = ~clean["loss_mask"]
    assert out.any()
    junk = torch.tensor([float("nan"), float("inf"), float("-inf")]).repeat(out.numel())[:out.numel()]
    for name in ("old_log_probs", "advantages", "ref_log_probs", "log_probs", "entropy"):
        dirty[name] = torch.where(out, junk.roll(len(name)), clean[name])
    results = []
    for batch in (clean, dirty):
        loss_fn = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], **_loss_kwargs(batch, opts))
        results.append(_closure_value_and_grads(loss_fn, batch))
    for got, expected, what in zip(results[1], results[0], ("loss", "d / d log_probs", "d / d entropy")):
        assert torch.equal(got, expected), what
    assert torch.all(results[1][1][out] == 0) and torch.all(results[1][2][out] == 0)


@pytest.mark.parametrize("normalization", ["token_mean", "seq_mean", "sum"])
def test_nothing_counted_gives_zero_not_nan(normalization):
    batch = _make_batch(8, mask=None)
    batch["loss_mask"] = torch.zeros_like(batch["log_probs"], dtype=torch.bool)
    opts = dict(normalization=normalization, kl_coef=0.1, entropy_coef=0.01)
    loss_fn = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], **_loss_kwargs(batch, opts))
    value, g_lp, g_ent = _closure_value_and_grads(loss_fn, batch)
    assert value.item() == 0.0 and torch.all(g_lp == 0) and torch.all(g_ent == 0)


def test_k3_keeps_its_precision_near_zero():
    """k3 = exp(-x) - 1 + x ~ x^2 / 2 for small x = lp - ref: formed as expm1(-x) + x, its fp32 error is one
    rounding of expm1 (2^-24 |x|), i.e. a relative error of about 2^-23 / |x|; exp(-x) - 1 would round at 1 instead
    (2^-24 / (x^2 / 2): 6% at x = 1e-3)."""
    # expm1(-x) + x rounds once at |x| and once at the result: 2^-24 (2 / |x| + 1) relative <= 1.2e-4 for |x| >= 1e-3.
    k3_near_zero_rtol = 2e-4
    ref = -torch.rand(200, generator=torch.Generator().manual_seed(5)) * 3 - 1
    x = torch.logspace(-3, -1, 200) * torch.tensor([1.0, -1.0]).repeat(100)
    lp = (ref.double() + x.double()).float()
    loss_fn = ppo_ops.policy_loss(lp, torch.zeros(200), kl_coef=1.0, ref_log_probs=ref, normalization="sum")
    got = loss_fn(lp, None, torch.arange(200))
    xd = lp.double() - ref.double()
    expected = torch.exp(-xd) - 1 + xd
    _assert_within(got, expected, k3_near_zero_rtol * expected.abs(), "k3")


def test_constants_are_copied_and_never_written():
    """The closure reads the caller's tensors once: they are unchanged after construction, calls and backward, and
    editing them in place afterwards does not change the loss."""
    opts = POLICY_CASES["everything"]
    batch = _make_batch(9, clip_high=CLIP_HIGHER, dual_clip=DUAL_CLIP)
    before = {k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    loss_fn = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], **_loss_kwargs(batch, opts))
    value, g_lp, _ = _closure_value_and_grads(loss_fn, batch)
    for name, t in before.items():
        assert torch.equal(batch[name], t), f"{name} was written"
    for name in ("old_log_probs", "advantages", "ref_log_probs"):
        batch[name].add_(1.0)
    batch["loss_mask"].logical_not_()
    batch["seq_ids"].zero_()
    batch["log_probs"], batch["entropy"] = before["log_probs"], before["entropy"]
    again, g_again, _ = _closure_value_and_grads(loss_fn, batch)
    assert torch.equal(again, value) and torch.equal(g_again, g_lp)


def test_no_tensor_value_is_read_on_the_host():
    """Construction and calls need no host sync: on the meta device (shapes, no values) every read would raise."""
    batch = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in _make_batch(10).items()}
    policy = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], **_loss_kwargs(
        batch, POLICY_CASES["everything"]))
    grpo = ppo_ops.grpo_loss(batch["old_log_probs"], torch.zeros(12, device="meta"), batch["seq_ids"], group_size=4,
                             ref_log_probs=batch["ref_log_probs"], loss_mask=batch["loss_mask"], entropy_coef=0.01)
    for loss_fn in (policy, grpo):
        lp = batch["log_probs"].clone().requires_grad_(True)
        ent = batch["entropy"].clone().requires_grad_(True)
        value = loss_fn.total(lp, ent)
        g_lp, g_ent = torch.autograd.grad(value, (lp, ent))
        assert value.is_meta and g_lp.shape == lp.shape and g_ent.shape == ent.shape


def test_entropy_is_used_only_with_a_coefficient():
    batch = _make_batch(12)
    plain = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], loss_mask=batch["loss_mask"])
    bonus = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], loss_mask=batch["loss_mask"],
                                entropy_coef=0.01)
    assert not plain.needs_entropy and bonus.needs_entropy
    lp = batch["log_probs"].clone().requires_grad_(True)
    ent = batch["entropy"].clone().requires_grad_(True)
    with_ent = plain.total(lp, ent)
    assert torch.equal(with_ent, plain.total(lp))
    assert torch.autograd.grad(with_ent, ent, allow_unused=True) == (None,)
    assert bonus.total(batch["log_probs"], batch["entropy"]) != with_ent


def test_public_names():
    assert ppo_ops.token_losses is token_losses
    for name in ("TokenLoss", "policy_loss", "grpo_loss", "grpo_advantages", "token_losses"):
        assert name in ppo_ops.__all__ and hasattr(ppo_ops, name)
    np = pytest.importorskip("numpy")
    batch = _make_batch(13)
    numpy_args = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], clip_low=np.float32(0.2),
                                     kl_coef=np.float64(0.1), ref_log_probs=batch["ref_log_probs"])
    python_args = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], clip_low=0.2, kl_coef=0.1,
                                      ref_log_probs=batch["ref_log_probs"])
    assert torch.equal(numpy_args.total(batch["log_probs"]), python_args.total(batch["log_probs"]))


# --- bad input: the error type, and the argument named in its message ---

def _policy(batch, **changes):
    kwargs = dict(old_log_probs=batch["old_log_probs"], advantages=batch["advantages"])
    kwargs.update(changes)
    return lambda: ppo_ops.policy_loss(kwargs.pop("old_log_probs"), kwargs.pop("advantages"), **kwargs)


def _grpo(batch, **changes):
    kwargs = dict(old_log_probs=batch["old_log_probs"], rewards=torch.zeros(12), seq_ids=batch["seq_ids"],
                  group_size=4, kl_coef=0.0)
    kwargs.update(changes)
    return lambda: ppo_ops.grpo_loss(kwargs.pop("old_log_probs"), kwargs.pop("rewards"), kwargs.pop("seq_ids"),
                                     **kwargs)


def _call(batch, loss_opts=None, **changes):
    loss_fn = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"], **(loss_opts or {}))
    n = batch["log_probs"].numel()
    args = dict(log_probs=batch["log_probs"], entropy=batch["entropy"], rows=torch.arange(n))
    args.update(changes)
    return lambda: loss_fn(args["log_probs"], args["entropy"], args["rows"])


def _total(batch, **changes):
    loss_fn = ppo_ops.policy_loss(batch["old_log_probs"], batch["advantages"])
    args = dict(log_probs=batch["log_probs"], entropy=None)
    args.update(changes)
    return lambda: loss_fn.total(args["log_probs"], args["entropy"])


N = 600  # _make_batch's default token count
# id: (builder(batch) -> a call that must raise, exception type, argument named in the message)
BAD_INPUTS = {
    "old_log_probs_not_a_tensor": (lambda b: _policy(b, old_log_probs=[0.0] * N), TypeError, "old_log_probs"),
    "old_log_probs_integer": (lambda b: _policy(b, old_log_probs=torch.zeros(N, dtype=torch.long)), TypeError,
                              "old_log_probs"),
    "advantages_wrong_shape": (lambda b: _policy(b, advantages=torch.zeros(N, 1)), ValueError, "advantages"),
    "advantages_other_device": (lambda b: _policy(b, advantages=torch.zeros(N, device="meta")), ValueError,
                                "advantages"),
    "advantages_integer": (lambda b: _policy(b, advantages=torch.zeros(N, dtype=torch.int32)), TypeError,
                           "advantages"),
    "clip_low_one": (lambda b: _policy(b, clip_low=1.0), ValueError, "clip_low"),
    "clip_low_negative": (lambda b: _policy(b, clip_low=-0.1), ValueError, "clip_low"),
    "clip_low_nan": (lambda b: _policy(b, clip_low=float("nan")), ValueError, "clip_low"),
    "clip_low_string": (lambda b: _policy(b, clip_low="0.2"), TypeError, "clip_low"),
    "clip_low_tensor": (lambda b: _policy(b, clip_low=torch.tensor(0.2)), TypeError, "clip_low"),
    "clip_low_bool": (lambda b: _policy(b, clip_low=True), TypeError, "clip_low"),
    "clip_high_negative": (lambda b: _policy(b, clip_high=-0.01), ValueError, "clip_high"),
    "clip_high_inf": (lambda b: _policy(b, clip_high=float("inf")), ValueError, "clip_high"),
    "dual_clip_one": (lambda b: _policy(b, dual_clip=1.0), ValueError, "dual_clip"),
    "dual_clip_inf": (lambda b: _policy(b, dual_clip=float("inf")), ValueError, "dual_clip"),
    "entropy_coef_nan": (lambda b: _policy(b, entropy_coef=float("nan")), ValueError, "entropy_coef"),
    "kl_coef_inf": (lambda b: _policy(b, kl_coef=float("inf"), ref_log_probs=b["ref_log_probs"]), ValueError,
                    "kl_coef"),
    "kl_coef_without_ref_log_probs": (lambda b: _policy(b, kl_coef=0.1), ValueError, "ref_log_probs"),
    "ref_log_probs_wrong_shape": (lambda b: _policy(b, kl_coef=0.1, ref_log_probs=torch.zeros(N + 1)), ValueError,
                                  "ref_log_probs"),
    "kl_type_unknown": (lambda b: _policy(b, kl_type="k4"), ValueError, "kl_type"),
    "normalization_unknown": (lambda b: _policy(b, normalization="mean"), ValueError, "normalization"),
    "seq_mean_without_seq_ids": (lambda b: _policy(b, normalization="seq_mean"), ValueError, "seq_ids"),
    "seq_ids_float": (lambda b: _policy(b, normalization="seq_mean", seq_ids=b["seq_ids"].float()), TypeError,
                      "seq_ids"),
    "seq_ids_wrong_shape": (lambda b: _policy(b, normalization="seq_mean", seq_ids=b["seq_ids"][:-1]), ValueError,
                            "seq_ids"),
    "loss_mask_integer": (lambda b: _policy(b, loss_mask=torch.ones(N, dtype=torch.long)), TypeError, "loss_mask"),
    "loss_mask_wrong_shape": (lambda b: _policy(b, loss_mask=torch.ones(2, N // 2, dtype=torch.bool)), ValueError,
                              "loss_mask"),
    "grpo_default_kl_without_ref_log_probs": (lambda b: _grpo(b, kl_coef=0.04), ValueError, "ref_log_probs"),
    "grpo_rewards_integer": (lambda b: _grpo(b, rewards=torch.zeros(12, dtype=torch.long)), TypeError, "rewards"),
    "grpo_rewards_2d": (lambda b: _grpo(b, rewards=torch.zeros(3, 4)), ValueError, "rewards"),
    "grpo_rewards_other_device": (lambda b: _grpo(b, rewards=torch.zeros(12, device="meta")), ValueError, "rewards"),
    "grpo_group_size_not_dividing": (lambda b: _grpo(b, group_size=5), ValueError, "group_size"),
    "grpo_group_size_one": (lambda b: _grpo(b, group_size=1), ValueError, "group_size"),
    "grpo_group_size_float": (lambda b: _grpo(b, group_size=4.0), TypeError, "group_size"),
    "grpo_eps_zero": (lambda b: _grpo(b, eps=0.0), ValueError, "eps"),
    "grpo_scale_by_std_not_bool": (lambda b: _grpo(b, scale_by_std=1), TypeError, "scale_by_std"),
    "grpo_seq_ids_missing_tokens": (lambda b: _grpo(b, seq_ids=b["seq_ids"][:10]), ValueError, "seq_ids"),
    "call_entropy_none_with_entropy_coef": (lambda b: _call(b, dict(entropy_coef=0.01), entropy=None), ValueError,
                                            "entropy"),
    "call_log_probs_float64": (lambda b: _call(b, log_probs=b["log_probs"].double()), TypeError, "log_probs"),
    "call_log_probs_2d": (lambda b: _call(b, log_probs=b["log_probs"][None]), ValueError, "log_probs"),
    "call_log_probs_other_device": (lambda b: _call(b, log_probs=b["log_probs"].to("meta")), ValueError,
                                    "log_probs"),
    "call_entropy_bfloat16": (lambda b: _call(b, entropy=b["entropy"].bfloat16()), TypeError, "entropy"),
    "call_entropy_wrong_length": (lambda b: _call(b, entropy=b["entropy"][:-1]), ValueError, "entropy"),
    "call_rows_int32": (lambda b: _call(b, rows=torch.arange(N, dtype=torch.int32)), TypeError, "rows"),
    "call_rows_wrong_length": (lambda b: _call(b, rows=torch.arange(N - 1)), ValueError, "rows"),
    "call_rows_not_a_tensor": (lambda b: _call(b, rows=list(range(N))), TypeError, "rows"),
    "total_log_probs_wrong_shape": (lambda b: _total(b, log_probs=b["log_probs"].reshape(20, 30)), ValueError,
                                    "log_probs"),
    "total_entropy_wrong_shape": (lambda b: _total(b, entropy=b["entropy"][:-1]), ValueError, "entropy"),
}


@pytest.mark.parametrize("case_id", sorted(BAD_INPUTS))
def test_bad_input_raises_naming_the_argument(case_id):
    build, exc_type, name = BAD_INPUTS[case_id]
    batch = _make_batch(14)
    with pytest.raises(Exception) as info:
        build(batch)()
    assert type(info.value) is exc_type, f"{case_id}: {type(info.value).__name__}: {info.value}"
    assert name in str(info.value), f"{case_id}: message does not name {name!r}: {info.value}"


# --- a token loss counted against the rows it scores ---

HEAD_ROWS, HEAD_HIDDEN, HEAD_VOCAB = (3, 6), 8, 20  # a [3, 6] batch through a small LM head


def _head_call(constants_shape, tp_group=None, v_local=HEAD_VOCAB):
    """linear_token_loss on [3, 6] rows with a policy loss built over constants of `constants_shape`."""
    gen = torch.Generator().manual_seed(21)
    hidden = torch.randn(*HEAD_ROWS, HEAD_HIDDEN, generator=gen)
    weight = torch.randn(v_local, HEAD_HIDDEN, generator=gen)
    tokens = torch.randint(0, v_local, HEAD_ROWS, generator=gen)
    loss = ppo_ops.policy_loss(torch.zeros(constants_shape), torch.ones(constants_shape))
    return ppo_ops.linear_token_loss(hidden, weight, tokens, loss, tp_group=tp_group)


@pytest.mark.parametrize("shape", [(3, 5), (3, 7), (6, 3), (17,)], ids=["fewer", "more", "transposed", "flat_fewer"])
def test_constants_counted_against_the_rows_scored(shape):
    """Fewer constants than rows (indexed past their end), more (normalised over tokens never scored) or the rows'
    shape transposed: one ValueError naming token_loss, the constants' shape and the rows'."""
    with pytest.raises(ValueError, match="^ppo_ops.linear_token_loss: ") as caught:
        _head_call(shape)
    assert caught.value.ppo_ops_argument == "token_loss"
    assert f"constants of shape {shape}" in str(caught.value) and "(3, 6)" in str(caught.value)


@pytest.mark.parametrize("shape", [(3, 6), (18,)], ids=["rows_shape", "flat"])
def test_constants_one_per_row_are_accepted(shape):
    loss, out = _head_call(shape)
    assert loss.shape == () and out.log_probs.shape == HEAD_ROWS


def _constants_before_collectives_worker(rank, world_size):
    from tests.core_support import COLLECTIVES, CollectiveIssued, tripwire

    originals = {name: getattr(torch.distributed, name) for name in COLLECTIVES if hasattr(torch.distributed, name)}
    headers = []
    try:
        for name, original in originals.items():
            setattr(torch.distributed, name, tripwire(name, original, headers))
        # only rank 1's constants are short: rank 0 learns of it in its header exchange
        shape = (3, 5) if rank == 1 else HEAD_ROWS
        try:
            _head_call(shape, tp_group=torch.distributed.group.WORLD)
        except CollectiveIssued as err:
            raise AssertionError(f"rank {rank}: a collective before the error: {err}") from err
        except ValueError as err:
            assert err.ppo_ops_argument == "token_loss", f"rank {rank}: {err}"
            assert "rank 1" in str(err) and "token_loss" in str(err), f"rank {rank}: {err}"
        else:
            raise AssertionError(f"rank {rank}: no error")
        assert len(headers) == 1, f"rank {rank}: {len(headers)} header exchanges, expected exactly 1"
    finally:
        for name, fn in originals.items():
            setattr(torch.distributed, name, fn)


def test_constants_error_is_collective_at_tp2():
    """At TP = 2 with one rank's constants short, both ranks raise the same error naming token_loss and rank 1,
    after the one header exchange and before any other collective."""
    from tests.ranks import run_gloo

    run_gloo(2, _constants_before_collectives_worker, timeout_s=30, deadline_s=240)
