"""Shared pieces of the fused LM head's test files (tests/test_linear_log_probs.py, tests/test_linear_token_loss.py):
seeded inputs, the float64 reference with per-element error bounds derived from the GEMMs' rounding, and the check
against them.
"""

import torch

from tests.core_support import make_tokens
from tests.reference import ENTROPY_TOL, LOG_PROB_TOL, reference_log_probs_and_entropy

# --- tolerances: unit roundoffs, and how the bounds of `_bounds` use them ---
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # u of each dtype
U32 = UNIT_ROUNDOFF[torch.float32]
# An fp32 accumulation may lose a full ulp per add instead of half (tensor cores truncate when aligning addends).
ACCUM_ULPS = 2.0
# A few fp32 ulps of exp, log and the subtractions that form log p from the logits.
ELEMENTWISE_ULPS = 8.0
# The token loss's one-GEMM blocks keep each logit as e = e^(z - tile max) rounded once to fp16: relative error
# 2^-11 (fp16's unit roundoff) where e >= 2^-14, absolute 2^-25 (half the subnormal spacing) below.
PROB_STORE_ROUNDOFF = 2.0**-11
PROB_STORE_SUBNORMAL = 2.0**-25
# Their pass takes z - M from ln e with the GPU's approximate log (CUDA's __logf: <= 3 ulp of |ln e| <= 17, or
# 2^-21.41 on [0.5, 2]): an absolute error of at most 2^-17 in z - M.
PROB_LOG_ERROR = 2.0**-17
# First-order bounds; the factor covers second-order terms (products of relative errors, all << 1 here).
SAFETY = 2.0

V_GLOBAL = 256  # eight fixed segments of 32: V_local = 64 at TP = 4
HIDDEN = 48  # not a power of two: K tiles with a tail
INPUT_SCALE = 1.0  # hidden ~ N(0, 1); weight ~ N(0, 1/H) * WEIGHT_SCALE
WEIGHT_SCALE = 3.0  # logits of O(3): a peaked but not one-hot distribution


def inputs(lead, dtype, seed, v=V_GLOBAL, h=HIDDEN):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(lead + (h,), generator=gen) * INPUT_SCALE).to(dtype)
    weight = (torch.randn((v, h), generator=gen) * (WEIGHT_SCALE / h**0.5)).to(dtype)
    tokens = make_tokens(lead, v, seed + 1)
    return hidden, weight, tokens


# --- the float64 reference and the derived bounds ---

def bounds(hidden, weight, tokens, g_lp, g_ent, *, temperature=1.0, vocab_size=None, row_mask=None,
            dl_roundoff=0.0, prob_storage=False, keep_mask=None):
    """Float64 reference (log_probs, entropy, dX, dW) and per-element error bounds (same shapes).

    Logits: fp32 accumulation of H exact products (bf16/fp16 products are exact in fp32) errs by at most
    eps_z = gamma_H * (|X| @ |W|^T), gamma_n = ACCUM_ULPS * n * u32; E_r = inv_t * max_c eps_z is the row's bound.
    log p = (z - M) - log S errs by at most eps_r = 2 E_r + (gamma_V + ELEMENTWISE_ULPS * u32) (z and log S each move by
    E_r; S is a sum of V terms). Then, with p, d = z / t and mean = E_p[d] of the reference:
      log-prob: |dlp| <= LOG_PROB_TOL-style fp32 error of the logits op + 2 E_r   (d lp / d z has l1 norm <= 2)
      entropy:  |dH| <= ENTROPY_TOL + E_r * sum_c p |d - mean|                    (d H / d z_c = p_c (mean - d_c))
      dlogits:  |d dl| <= inv_t * eps_r * S_dl + dl_roundoff * |dl|,
                S_dl = |g_lp| (1[c = t] + p) + |g_ent| p (|d - mean| + sum_c p |d - mean| + 2);
                dl_roundoff is the rounding of dlogits to the GEMM's input dtype (0 when the GEMM takes fp32);
                prob_storage (rows whose dlogits come from fp16 probabilities: True for all, or a [rows] bool
                mask of the flattened rows): p moves by u16 p + s16 and z - M (from log e) by
                u16 where e is normal (p |d(z - M)| <= s16 below), which adds inv_t (u16 p + s16) S_st,
                S_st = |g_lp| + |g_ent| (|d - mean| + 1); the approximate log adds inv_t p |g_ent| PROB_LOG_ERROR
      dX = dl @ W, dW = dl^T @ X: that error through the GEMM, plus gamma_K (|dl| @ |W|) for its fp32 accumulation
                (K = V or T), plus one rounding u_out |ref| of the result to the input dtype.
    keep_mask ([rows, V] bool, the dense form of a sparse keep set): the log-prob term of S_dl takes q, the softmax
    over keep ∪ target, instead of p, and dW carries one more rounding to the input dtype (the keep term is added to
    the finished dW, which was rounded without it: u_out (|ref| + |keep term|) more).
    Every bound is multiplied by SAFETY (second-order terms).
    """
    x = hidden.detach().double().reshape(-1, hidden.shape[-1])
    w = weight.detach().double()
    n_rows, v, h = x.shape[0], w.shape[0], x.shape[1]
    inv_t = 1.0 / temperature
    logits = x @ w.T
    ref = reference_log_probs_and_entropy(
        logits, tokens.reshape(-1), entropy="grad", temperature=temperature, vocab_size=vocab_size, keep_mask=keep_mask,
        row_mask=None if row_mask is None else row_mask.reshape(-1),
        grad_log_probs=None if g_lp is None else g_lp.reshape(-1),
        grad_entropy=None if g_ent is None else g_ent.reshape(-1))
    dl = ref.grad
    valid = torch.arange(v) < (v if vocab_size is None else vocab_size)
    rows_on = torch.ones(n_rows, dtype=torch.bool) if row_mask is None else row_mask.reshape(-1)

    gamma = lambda n: ACCUM_ULPS * n * U32  # noqa: E731
    eps_z = gamma(h) * (x.abs() @ w.abs().T)
    e_row = inv_t * torch.where(valid, eps_z, 0.0).amax(dim=1)
    eps_r = 2 * e_row + gamma(v) + ELEMENTWISE_ULPS * U32

    d = torch.where(valid, logits * inv_t, float("-inf"))
    p = torch.softmax(d, dim=1)
    d0 = torch.where(valid, d, 0.0)
    mean = (p * d0).sum(1, keepdim=True)
    spread = (p * (d0 - mean).abs()).sum(1, keepdim=True)  # sum_c p |d - mean|
    onehot = torch.zeros_like(p).scatter_(1, tokens.reshape(-1, 1).clamp(0, v - 1), 1.0)
    q = p
    if keep_mask is not None:
        q = torch.softmax(torch.where(keep_mask.reshape(n_rows, v) | (onehot > 0), d, float("-inf")), dim=1)
    s_dl = torch.zeros_like(p)
    if g_lp is not None:
        s_dl += g_lp.reshape(-1, 1).double().abs() * (onehot + q)
    if g_ent is not None:
        s_dl += g_ent.reshape(-1, 1).double().abs() * p * ((d0 - mean).abs() + spread + 2)
    s_dl = torch.where(valid & rows_on[:, None], s_dl, 0.0)
    dl_err = inv_t * eps_r[:, None] * s_dl + dl_roundoff * dl.abs()
    rows_st = rows_on & (prob_storage if isinstance(prob_storage, torch.Tensor) else bool(prob_storage))
    if rows_st.any():
        on_st = valid & rows_st[:, None]
        s_st = torch.zeros_like(p)
        if g_lp is not None:
            s_st += g_lp.reshape(-1, 1).double().abs()
        if g_ent is not None:
            s_st += g_ent.reshape(-1, 1).double().abs() * ((d0 - mean).abs() + 1)
        s_st = torch.where(on_st, s_st, 0.0)
        dl_err = dl_err + inv_t * (PROB_STORE_ROUNDOFF * p + PROB_STORE_SUBNORMAL) * s_st
        if g_ent is not None:
            log_err = PROB_LOG_ERROR * p * g_ent.reshape(-1, 1).double().abs()
            dl_err = dl_err + inv_t * torch.where(on_st, log_err, 0.0)

    u_out = UNIT_ROUNDOFF[hidden.dtype]
    dx_ref, dw_ref = dl @ w, dl.T @ x
    dx_tol = SAFETY * (dl_err @ w.abs() + gamma(v) * (dl.abs() @ w.abs())) + u_out * dx_ref.abs()
    dw_tol = SAFETY * (dl_err.T @ x.abs() + gamma(n_rows) * (dl.abs().T @ x.abs())) + u_out * dw_ref.abs()
    if keep_mask is not None and g_lp is not None:
        # The full-vocabulary dW (the keep term left out) is rounded first: |it| <= |ref| + |keep term|.
        keep_term = (g_lp.reshape(-1, 1).double().abs() * (onehot + q) * inv_t).T @ x.abs()
        dw_tol = dw_tol + u_out * (dw_ref.abs() + keep_term)
    lp_tol = LOG_PROB_TOL * ref.log_probs.abs().clamp(min=1) + SAFETY * 2 * e_row
    ent_tol = ENTROPY_TOL + SAFETY * e_row * spread[:, 0]
    lead = tuple(hidden.shape[:-1])
    zero = ~rows_on
    lp_tol, ent_tol = lp_tol.masked_fill(zero, 0.0), ent_tol.masked_fill(zero, 0.0)
    return dict(log_probs=(ref.log_probs.reshape(lead), lp_tol.reshape(lead)),
                entropy=(ref.entropy.reshape(lead), ent_tol.reshape(lead)),
                dx=(dx_ref.reshape(hidden.shape), dx_tol.reshape(hidden.shape)), dw=(dw_ref, dw_tol))


def assert_within(name, got, ref_and_tol):
    ref, tol = ref_and_tol
    assert got is not None and got.shape == ref.shape, f"{name}: shape {None if got is None else got.shape}"
    err = (got.double() - ref).abs()
    assert not torch.isnan(err).any(), f"{name}: NaN"
    worst = (err - tol).argmax()
    assert bool((err <= tol).all()), (
        f"{name}: error {err.flatten()[worst]:.3e} over its bound {tol.flatten()[worst]:.3e} at flat index "
        f"{int(worst)} (max relative to bound {float((err / tol.clamp(min=1e-300)).max()):.2f})")


# --- TP > 1 of the compiled kernels at Qwen3's shapes, on one GPU (gloo ranks on cuda:0, tests/ranks.py) ---

QWEN3_VOCAB, QWEN3_TOKENS = 151936, 151669  # Qwen3's LM head: 151936 columns, 267 of them padding
# name -> (H, rows): Qwen3-0.6B's head past one token-loss block (8192 rows) and the general op's held rows (3328),
# over two dW groups; Qwen3-8B's past the held rows, the token loss as one block of at least 2 H rows (dW in the
# probabilities' storage).
QWEN3_TP_SHAPES = {"qwen3_0.6b_head": (1024, 12000), "qwen3_8b_head": (4096, 9000)}
QWEN3_TP_SIZES = (2, 4)
QWEN3_TEMPERATURE = 0.7
QWEN3_DROP_EVERY = 97  # the row mask drops every 97th row: kept rows move between blocks and groups
# dX at TP > 1 adds the same per-segment fp32 products in another order (each rank's segments, then the ranks) and
# rounds once to bf16, as TP = 1 does: one bf16 rounding each side (2 x 2^-8 of the largest entry); the fp32
# reassociation of 8 segment sums is orders of magnitude below it.
DX_ACROSS_TP_MAX_REL = 2.0**-7


def qwen3_inputs(width, n_rows, device, seed=91):
    """bf16 hidden [n_rows, H] and weight [QWEN3_VOCAB, H] (logits of O(3)), tokens of the real vocabulary with
    -100 on dropped rows, the row mask, and upstream weights for log-probs and entropies; drawn on `device` from a
    seeded generator, so every process on that kind of GPU draws the same values."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn((n_rows, width), generator=gen, device=device).to(torch.bfloat16)
    weight = (torch.randn((QWEN3_VOCAB, width), generator=gen, device=device) * (WEIGHT_SCALE / width**0.5)).to(
        torch.bfloat16)
    tokens = torch.randint(0, QWEN3_TOKENS, (n_rows,), generator=gen, device=device)
    row_mask = torch.arange(n_rows, device=device) % QWEN3_DROP_EVERY != QWEN3_DROP_EVERY - 1
    g_lp = torch.rand((n_rows,), generator=gen, device=device) + 0.5
    g_ent = torch.rand((n_rows,), generator=gen, device=device) * 2 - 1
    return hidden, weight, torch.where(row_mask, tokens, -100), row_mask, g_lp, g_ent


def qwen3_kept_rows(n_rows: int) -> int:
    """The rows qwen3_inputs' row mask keeps."""
    return n_rows - n_rows // QWEN3_DROP_EVERY


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes: bitwise equality of large shards without saving them."""
    import hashlib

    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def tp_record(world_size, values: dict, dx, dw) -> dict:
    """What one rank of one case keeps for assert_tp_invariant: its values and dX on the CPU, the digest of its dW
    shard; at TP = 1 the digests of dW's slices as each rank of QWEN3_TP_SIZES holds them."""
    record = dict(values={k: v.detach().cpu() for k, v in values.items()}, dx=dx.cpu(), dw=digest(dw))
    if world_size == 1:
        record["dw_slices"] = {tp: [digest(piece) for piece in dw.chunk(tp)] for tp in QWEN3_TP_SIZES}
    return record


def assert_tp_invariant(tp1: dict, ranks: list, what: str):
    """Every rank's values bitwise TP = 1's, its dW shard bitwise TP = 1's slice, dX the same on every rank and within
    DX_ACROSS_TP_MAX_REL of TP = 1's."""
    tp = len(ranks)
    for rank, record in enumerate(ranks):
        for name, value in tp1["values"].items():
            assert torch.equal(record["values"][name], value), f"{what} TP={tp} rank {rank}: {name} differs from TP=1"
        assert torch.equal(record["dx"], ranks[0]["dx"]), f"{what} TP={tp}: dX differs between ranks 0 and {rank}"
    shards = [record["dw"] for record in ranks]
    bad = [r for r, (got, want) in enumerate(zip(shards, tp1["dw_slices"][tp])) if got != want]
    assert not bad, f"{what} TP={tp}: the dW shards of ranks {bad} differ bitwise from TP=1's slices"
    dx, dx1 = ranks[0]["dx"].double(), tp1["dx"].double()
    worst = float((dx - dx1).abs().max() / dx1.abs().max())
    assert worst <= DX_ACROSS_TP_MAX_REL, f"{what} TP={tp}: dX off TP=1's by {worst:.2e} of its largest entry"
