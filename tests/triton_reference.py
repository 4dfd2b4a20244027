"""Float64 reference of the backend contract (ppo_ops/logits/triton_backend.py, ppo_ops/logits/torch_backend.py) and
the checks built on it, used by tests/test_triton_backend.py (CPU under the interpreter, and compiled on CUDA).

- `reference_partials`: the [segments, 5, T] partials in float64, from the same fp32 z = fp32(logits) * inv_temperature
  the contract defines, so MAX and TARGET_Z (selections, not sums) must match exactly; rows a row mask drops get the
  neutral partials (MAX and TARGET_Z -inf, sums 0), so they too must match exactly.
- `reference_stats` / `reference_grad`: float64 row statistics relative to the row max, as the core passes them to
  backward, and the float64 gradient they define.
- `check_once`: one forward_partials + backward_grad on `device`, both compared with the references (and, with a row
  mask, the dropped rows' gradient checked to be exactly 0).
"""

import torch

from ppo_ops.core.contracts import BackwardStats, RowInputs, ShardOptions, UpstreamGrads
from ppo_ops.core.row_stats import ENT_SUM, KEPT_SUMEXP, MAX, SUMEXP, TARGET_Z
from ppo_ops.logits import triton_backend as tb

def forward_partials(logits, row_mask, tokens, keep_mask, inv_t, n_valid, seg_len, with_entropy, chunk_rows=None,
                     vocab_start=0, **overrides):
    """tb.forward_partials on plain tensors and numbers (the tests' cases are written that way): the contract's
    dataclasses are built here."""
    return tb.forward_partials(RowInputs(logits, tokens, keep_mask, row_mask),
                               ShardOptions(inv_t, n_valid, seg_len, vocab_start, chunk_rows), with_entropy,
                               **overrides)


def backward_grad(logits, row_mask, tokens, keep_mask, inv_t, n_valid, shift, log_sum, log_sum_kept, mean_shifted,
                  g_lp, g_ent, out, chunk_rows=None, log_prob_defined=None, row_has_mass=None, vocab_start=0,
                  **overrides):
    """tb.backward_grad on plain tensors and numbers, as forward_partials above (the segment length does not apply)."""
    shard = ShardOptions(inv_t, n_valid, max(1, logits.shape[1]), vocab_start, chunk_rows)
    tb.backward_grad(RowInputs(logits, tokens, keep_mask, row_mask), shard,
                     BackwardStats(shift, log_sum, log_sum_kept, mean_shifted, log_prob_defined, row_has_mass),
                     UpstreamGrads(g_lp, g_ent), out, **overrides)


NEG_INF = float("-inf")

# --- tolerances ---
# SUMEXP / KEPT_SUMEXP / ENT_SUM: sums of same-sign terms, each with ~2 ulp of fp32 error (exp, and z - m), summed in
# fp32 tiles and rescaled per tile: relative error ~ (4 + log2(n)) ulp, under 2^-24 * 32 = 1.9e-6 for n <= 2^17.
PARTIAL_SUM_RTOL = 2e-6
# fp32 gradient against float64, per unit of upstream gradient: the 1e-6 target is for the Jacobian itself, and
# an entry is g_lp * (onehot - q) + g_ent * p * (mean - d), times 1/temperature, so its error (the fp32 rounding of
# d - log_sum, and on the GPU ex2.approx's <= 2^-22.5 relative error in p and q) scales with
# (|g_lp| + |g_ent|) / temperature. Measured on an H200 at Qwen3 rows with weights up to 3.6 per row: 1.3e-6 absolute.
GRAD_ATOL = 1e-6
# bf16/fp16 gradients: the fp32 result is rounded once to nearest (half an ulp: at most 2^-8 / 2^-11 of the value, for
# 8 / 11 significand bits), plus GRAD_ATOL.
GRAD_HALF_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


# ---------------------------------------------------------------------------------------------------------------------
# float64 references

def _z32(logits, inv_t):
    """The contract's z: fp32 logits times the fp32 inverse temperature (skipped at 1.0)."""
    z = logits.float()
    return z * inv_t if inv_t != 1.0 else z


def _kept(keep_mask, target_col, shape):
    """keep ∪ {target} as a bool [T, V] (targets of -1 live on another rank)."""
    kept = torch.zeros(shape, dtype=torch.bool) if keep_mask is None else keep_mask.clone()
    own = torch.nonzero(target_col >= 0).squeeze(1)
    kept[own, target_col[own]] = True
    return kept


def _dropped(row_mask, n_rows):
    """[T] bool: the rows a row mask drops (none without one)."""
    return torch.zeros(n_rows, dtype=torch.bool) if row_mask is None else ~row_mask.cpu()


def reference_partials(logits, row_mask, target_col, keep_mask, inv_t, n_valid, seg_len, with_entropy):
    """float64 [nseg, 5, T] partials of the contract; a dropped row is neutral, whatever its logits and target."""
    n_rows, v_local = logits.shape
    dropped = _dropped(row_mask, n_rows)
    z = _z32(logits, inv_t).double()
    cols = torch.arange(v_local)
    z = torch.where((cols < n_valid) & ~dropped[:, None], z, NEG_INF)  # a dropped row has no mass (NaN included)
    target_col = torch.where(dropped, -1, target_col)
    kept = None if keep_mask is None else _kept(keep_mask, target_col, z.shape)
    out = torch.zeros((v_local // seg_len, 5, n_rows), dtype=torch.float64)
    for j in range(v_local // seg_len):
        seg = slice(j * seg_len, (j + 1) * seg_len)
        zj = z[:, seg]
        m = zj.amax(dim=1) if seg_len else torch.full((n_rows,), NEG_INF)
        d = zj - torch.where(m == NEG_INF, 0.0, m)[:, None]
        e = torch.exp(d)
        out[j, MAX] = m
        out[j, SUMEXP] = e.sum(1)
        out[j, KEPT_SUMEXP] = out[j, SUMEXP] if kept is None else torch.where(kept[:, seg], e, 0.0).sum(1)
        out[j, ENT_SUM] = torch.where(e > 0, e * d, 0.0).sum(1) if with_entropy else 0.0
        here = (target_col >= j * seg_len) & (target_col < min((j + 1) * seg_len, n_valid))
        zt = z.gather(1, target_col.clamp(min=0)[:, None]).squeeze(1)
        out[j, TARGET_Z] = torch.where(here, zt, NEG_INF)
    return out


def reference_stats(logits, row_mask, target_col, keep_mask, inv_t, n_valid):
    """float64 global row stats relative to the row max M: (M, log_sum, log_sum_kept, mean_shifted), per row (0 for a
    dropped row, as the core passes them)."""
    p = reference_partials(logits, row_mask, target_col, keep_mask, inv_t, n_valid, logits.shape[1], True)[0]
    m = torch.where(p[MAX] == NEG_INF, 0.0, p[MAX])
    has_mass = p[SUMEXP] > 0
    log_sum = torch.where(has_mass, torch.log(p[SUMEXP]), 0.0)
    log_sum_kept = torch.where(p[KEPT_SUMEXP] > 0, torch.log(p[KEPT_SUMEXP]), 0.0)
    mean_shifted = torch.where(has_mass, p[ENT_SUM] / p[SUMEXP].clamp(min=1e-300), 0.0)
    return m, log_sum, log_sum_kept, mean_shifted


def reference_grad(logits, row_mask, target_col, keep_mask, inv_t, n_valid, stats, g_lp, g_ent):
    """float64 gradient of the contract for all T rows (rows the row mask drops are 0), from float64 stats."""
    n_total, v_local = logits.shape
    active = torch.nonzero(~_dropped(row_mask, n_total)).squeeze(1)
    m, log_sum, log_sum_kept, mean_shifted = (t[active] for t in stats)
    target_col = target_col[active]
    g_lp = None if g_lp is None else g_lp[active]
    g_ent = None if g_ent is None else g_ent[active]
    z = torch.where(torch.arange(v_local) < n_valid, _z32(logits[active], inv_t).double(), NEG_INF)
    d = z - m[:, None]
    p = torch.exp(d - log_sum[:, None])
    grad = torch.zeros_like(z)
    if g_lp is not None:
        onehot = _kept(None, target_col, z.shape).double()
        q = p if keep_mask is None else torch.where(
            _kept(keep_mask[active], target_col, z.shape), torch.exp(d - log_sum_kept[:, None]), 0.0)
        grad += g_lp.double()[:, None] * (onehot - q)
    if g_ent is not None:
        grad += g_ent.double()[:, None] * torch.where(p > 0, p * (mean_shifted[:, None] - d), 0.0)
    full = torch.zeros((n_total, v_local), dtype=torch.float64)
    full[active] = torch.where(torch.arange(v_local) < n_valid, grad * inv_t, 0.0)
    return full


# ---------------------------------------------------------------------------------------------------------------------
# checks

def assert_partials_close(got, expected, what="partials"):
    assert got.dtype == torch.float32 and got.shape == expected.shape, (got.dtype, got.shape, expected.shape)
    for ch in (MAX, TARGET_Z):  # selections of fp32 values: exact
        assert torch.equal(got[:, ch].double(), expected[:, ch]), f"{what}: channel {ch} differs"
    for ch in (SUMEXP, KEPT_SUMEXP, ENT_SUM):
        err = (got[:, ch].double() - expected[:, ch]).abs()
        bound = PARTIAL_SUM_RTOL * expected[:, ch].abs()
        assert bool((err <= bound).all()), (
            f"{what}: channel {ch} off by {(err - bound).max().item():.3g} beyond {PARTIAL_SUM_RTOL} relative")


def _rows_to_full(row_scale, n_rows, what):
    assert row_scale.shape == (n_rows,), f"{what}: row_scale must have one entry per row"
    return row_scale


def upstream_scale(g_lp, g_ent, inv_t):
    """Per-row magnitude of the upstream gradient, max(1, (|g_lp| + |g_ent|) * inv_t): the unit GRAD_ATOL is in."""
    total = torch.zeros_like(g_lp if g_lp is not None else g_ent, dtype=torch.float64)
    for g in (g_lp, g_ent):
        if g is not None:
            total += g.double().abs()
    return torch.clamp(total * inv_t, min=1.0)


def assert_kernel_grad_close(got, expected, what="grad", row_scale=None):
    assert torch.isfinite(got).all(), f"{what}: non-finite entries"
    err = (got.double() - expected).abs()
    atol = GRAD_ATOL if row_scale is None else GRAD_ATOL * _rows_to_full(row_scale, got.shape[0], what)[:, None]
    bound = atol + GRAD_HALF_ULP[got.dtype] * expected.abs()
    assert bool((err <= bound).all()), f"{what}: max excess {(err - bound).max().item():.3g}"


def make_case(n_rows, v_local, *, dtype=torch.float32, seed=0, scale=3.0, keep=False, n_rows_active=None):
    """(logits, row_mask, target_col, keep_mask, g_lp, g_ent); a row mask keeping `n_rows_active` random rows when
    given. Per-row tensors cover all rows; a dropped row's target and upstream gradients are junk the backend must
    ignore (a real target column, nonzero gradients), not the zeros the core would pass."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn((n_rows, v_local), generator=gen) * scale).to(dtype)
    row_mask = None
    if n_rows_active is not None:
        row_mask = torch.zeros(n_rows, dtype=torch.bool)
        row_mask[torch.randperm(n_rows, generator=gen)[:n_rows_active]] = True
    target_col = torch.randint(0, v_local, (n_rows,), generator=gen)
    keep_mask = (torch.rand((n_rows, v_local), generator=gen) < 0.5) if keep else None
    g_lp = torch.rand(n_rows, generator=gen) + 0.5
    g_ent = torch.rand(n_rows, generator=gen) * 2 - 1
    return logits, row_mask, target_col, keep_mask, g_lp, g_ent


def on(device, *tensors):
    """The tensors moved to `device` (None stays None)."""
    return [None if t is None else t.to(device) for t in tensors]


def check_once(logits, row_mask, target_col, keep_mask, g_lp, g_ent, *, inv_t=1.0, n_valid=None, seg_len=None,
               with_entropy=True, device="cpu", **overrides):
    """Forward partials and backward gradient on `device` against float64 (inputs are CPU tensors); returns both
    results on the CPU."""
    n_valid = logits.shape[1] if n_valid is None else n_valid
    seg_len = logits.shape[1] if seg_len is None else seg_len
    g_ent = g_ent if with_entropy else None
    d_logits, d_rows, d_target, d_keep, d_glp, d_gent = on(device, logits, row_mask, target_col, keep_mask, g_lp,
                                                            g_ent)
    got = forward_partials(d_logits, d_rows, d_target, d_keep, inv_t, n_valid, seg_len, with_entropy, None,
                              **overrides).cpu()
    assert_partials_close(got, reference_partials(logits, row_mask, target_col, keep_mask, inv_t, n_valid, seg_len,
                                                  with_entropy))
    stats = reference_stats(logits, row_mask, target_col, keep_mask, inv_t, n_valid)
    out = torch.full_like(d_logits, 7.0)  # every entry must be written
    backward_grad(d_logits, d_rows, d_target, d_keep, inv_t, n_valid, *on(device, *(s.float() for s in stats)),
                     d_glp, d_gent, out, None, **overrides)
    out = out.cpu()
    assert_kernel_grad_close(out, reference_grad(logits, row_mask, target_col, keep_mask, inv_t, n_valid, stats, g_lp,
                                                 g_ent), row_scale=upstream_scale(g_lp, g_ent, inv_t))
    assert bool((out[_dropped(row_mask, logits.shape[0])] == 0).all()), "a dropped row's gradient is not exactly 0"
    return got, out


def results_per_tp(logits, row_mask, tokens, keep_mask, stats, g_lp, g_ent, vocab_size, seg_len,
                   tp_sizes=(1, 2, 4, 8), **overrides):
    """{tp: (partials, gradient)} with rank r of each TP size holding columns [r*V/tp, (r+1)*V/tp) and its fixed
    segments: the ranks' partials stacked in rank order, their gradient shards concatenated. `stats` are the global
    row stats; `overrides` go to forward_partials (kernel, block_v, ...)."""
    v_global = logits.shape[1]
    results = {}
    for tp in tp_sizes:
        v_local = v_global // tp
        partials, grads = [], []
        for rank in range(tp):
            cols = slice(rank * v_local, (rank + 1) * v_local)
            shard, keep = logits[:, cols].contiguous(), keep_mask[:, cols].contiguous()
            local = tokens - rank * v_local
            target_col = torch.where((local >= 0) & (local < v_local), local, -1)
            n_valid = max(0, min(v_local, vocab_size - rank * v_local))
            partials.append(forward_partials(shard, row_mask, target_col, keep, 1.0, n_valid, seg_len, True, None,
                                                **overrides))
            grad = torch.empty_like(shard)
            backward_grad(shard, row_mask, target_col, keep, 1.0, n_valid, *stats, g_lp, g_ent, grad, None)
            grads.append(grad)
        results[tp] = (torch.cat(partials), torch.cat(grads, dim=1))
    return results
