"""The sparse keep set of both ops: `keep=(ids, offsets)`, a CSR list of kept token ids per row, for top-p / top-k
replay without any [T, V] mask or logits.

Semantics (slime's). Rows are the call's flattened rows (tokens.reshape(-1)); row r keeps the global ids
ids[offsets[r]:offsets[r+1]]. Its log-prob is renormalised over K_r = those ids ∪ {target} (a set: an id listed twice
counts once, and the target always counts); a row with offsets[r] == offsets[r+1] keeps the full vocabulary. The
entropy is always the full distribution's. `keep_mask` (dense) stays for callers who have one; the two exclude each
other.

A layer around the unchanged backends. The op runs as without `keep` (full-vocabulary log-probs, entropies and
their gradients), then, for the keep rows only:
  forward   the kept logits z_e of every entry e (an id of K_r, or the row's target): gathered from the logits
            (logits op) or formed as an fp32 dot hidden[r] . weight[id] (LM head: sparse_keep_kernels.py on CUDA,
            fixed-size torch chunks elsewhere), by the rank whose shard holds the id; at TP > 1 one all-reduce (sum)
            of the [ids + rows] fp32 vector in which every rank leaves 0 where it holds no id (exact: x + 0 = x), so
            every rank holds every kept logit; then per row M = max over K_r, S = Σ_{K_r} e^(z - M) and
            log_prob = (z_t - M) - log S, replacing the full-vocabulary log-prob. S is summed in 64-bit fixed point
            (each term rounded to 2^-FIXED_BITS, S >= 1 because the max term is 1): integer sums are exact whatever
            their order, so a row's S depends on nothing but its own kept logits: the same bits at every TP size and
            row count, on every device and backend.
  backward  the full-vocabulary path gets the log-prob's upstream gradient zeroed on keep rows (their entropy term
            and the other rows go through it as before); the keep rows' term d lp / d z_j = [j == target] - q_j,
            q = e^(z - M) / S over K_r, times 1 / temperature and the upstream gradient, is added for each kept
            entry: logits op, written once into the dense gradient (its entropy term recomputed in fp32 beside it,
            one rounding to the logits' dtype); LM head, dX[r] += Σ_j c_j W[j] (fixed order per row, before the dX
            all-reduce) and dW[v] += Σ_{rows r keeping v} c_rv X[r] (entries sorted by (id, row), a segment sum in
            that order, then one rounding of dW + the sum to dW's dtype). No atomics.

Determinism and TP invariance. The kept logits are formed by one code path per entry, wherever the entry lands
(a gather; or a dot whose reduction order depends on H only), the exchange is exact, and every rank then reduces
each row in the same fixed-point sums: keep log-probs are bitwise identical across TP sizes (and run to run) on
each backend; so are the logits op's gradients and the LM head's dW (each kept id's rows summed in (id, row) order
by the rank that holds it). The keep log-probs come from these kept logits, not from the full-vocabulary pass:
for the LM head the dot's fp32 sum differs from the GEMM's in the last bits, and the target's logit comes from the
same dot as the other kept ids, so log_prob <= 0 always.

Validation (validate=True) goes through core/agreement.py with the op's other values: local shape/dtype checks in
`check` (an argument error, raised on every rank by the call shell); value checks on the device (`header_values`:
offsets[0] == 0, offsets[-1] == len(ids), non-decreasing offsets, ids in [0, vocab_size), and, across ranks, the
number of ids and a checksum of ids and offsets) read in the call's one host read. With validate=False nothing is
read: malformed offsets and ids out of range are clamped or dropped (memory-safe, the result unspecified).

A backend that forms dlogits in row blocks (the token loss) takes the keep set through these functions, in order:
lm_head_forward (once, after the call's header exchange, for all rows), replace_log_probs (a block's log-probs,
before the loss sees them), dense_grad (the block's log-prob gradient for its full-vocabulary dlogits),
coefficients (the keep term of the block's entries) and add_to_dlogits (into each block x segment of dlogits before
its dX / dW GEMMs): the keep term then rides in those GEMMs, with no add_dx / add_dw pass.

Paths: Triton kernels (sparse_keep_kernels.py) on CUDA, and on CPU under the interpreter with a Triton backend; torch
ops elsewhere. The two agree within fp32 rounding, not bit for bit; each is deterministic and TP-invariant.

Cost: O(len(ids) + rows) memory and work besides the op's own (the entries' indices, kept logits and coefficients,
saved for the backward). The LM head sorts its entries by (id, row), which finds duplicates and orders its dW sum;
the logits op, which needs no order, finds each row's first listings in one kernel over the rows without a sort
(with Triton kernels; bitmaps of the vocabulary for rows of more than 256 ids, 128 * V / 8 bytes while it runs). At
TP > 1 one more all-reduce of 4 bytes per id and per row. The LM head adds about 2 * len(ids) * H
multiply-adds forward and 4 * len(ids) * H backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ppo_ops.core.checks import argument_error
from ppo_ops.core.fold import fold_sum
from ppo_ops.core.sparse_keep_types import Entries, FullStats, KeepShard, KeepState, SparseKeep

NEG_INF = float("-inf")
# Bits of the fixed-point row sums (see `fixed_bits`), at most: terms e^(z - M) <= 1 are rounded to 2^-44.
MAX_FIXED_BITS = 44
# The fixed-point prefix sums are split at this bit, so that neither half overflows int64 for any realistic length.
_SPLIT_BITS = 22
# Entries per chunk of the torch fallbacks of the LM head (forward dots, dX, dW): bounds their [chunk, H] temporaries.
TORCH_CHUNK = 1024
# Header entries of a keep set (core/agreement.py): ids count, checksum, offsets error bits, id min, id max.
HEADER_VALUES = 5
NO_KEEP_HEADER = (-1, 0, 0, 0, 0)
# Offsets error bits (header_values).
FIRST_NOT_ZERO, LAST_NOT_LEN, DECREASING = 1, 2, 4


# ---- local checks (no value read) ----

def check(fn_name: str, keep, n_rows: int, device, keep_mask=None, reduction_order: str = "fused"
          ) -> Optional[SparseKeep]:
    """The keep argument's local checks: a pair (ids, offsets) of 1-D integer tensors on `device`, offsets of
    n_rows + 1 entries; not together with keep_mask or reduction_order="sglang". Returns it as int64 (device copies,
    no sync), or None."""
    if keep is None:
        return None

    def fail(exc_type, detail):
        raise argument_error(exc_type, fn_name, "keep", f"keep {detail}")

    if keep_mask is not None:
        fail(ValueError, "and keep_mask were both given: pass the sparse keep=(ids, offsets) or the dense keep_mask, "
                         "not both")
    if reduction_order == "sglang":
        fail(ValueError, "must be None with reduction_order='sglang' (SGLang's log_softmax normalises over the full "
                         "vocabulary)")
    if not isinstance(keep, (tuple, list)) or len(keep) != 2:
        fail(TypeError, f"must be a pair (ids, offsets) of integer tensors (CSR over the rows), got "
                        f"{type(keep).__name__}" + (f" of length {len(keep)}" if isinstance(keep, (tuple, list))
                                                    else ""))
    for name, t in zip(("ids", "offsets"), keep):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            fail(TypeError, f"{name} must hold integers (int64 or any integer dtype), got {t.dtype}")
        if t.dim() != 1:
            fail(ValueError, f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.device != torch.device(device):
            fail(ValueError, f"{name} must be on {device} like the op's other tensors, got {t.device}")
    ids, offsets = keep
    if offsets.numel() != n_rows + 1:
        fail(ValueError, f"offsets must have rows + 1 = {n_rows + 1} entries (CSR over the {n_rows} flattened rows of "
                         f"tokens), got {offsets.numel()}")
    if ids.numel() + n_rows >= 1 << 40:
        fail(ValueError, f"ids has {ids.numel()} entries: at most 2^40 - rows are supported")
    return SparseKeep(ids.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous())


# ---- value checks: device-side, read in the call's one host read (core/agreement.py) ----

def _checksum(values: torch.Tensor) -> torch.Tensor:
    """Position-weighted checksum of an int64 vector, exact in int64 (as agreement's of the tokens)."""
    if values.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=values.device)
    weights = torch.arange(values.numel(), device=values.device, dtype=torch.int64) % 65521 + 1
    return ((values.remainder(2147483647) * weights).remainder(2147483647)).sum()


def header_values(keep: Optional[SparseKeep], device) -> torch.Tensor:
    """[HEADER_VALUES] int64 on the device, no sync: the number of ids (-1 without keep), a checksum of ids and
    offsets, the offsets' error bits (FIRST_NOT_ZERO | LAST_NOT_LEN | DECREASING), the ids' min and max (0, 0 when
    there are none)."""
    if keep is None:
        return torch.tensor(NO_KEEP_HEADER, dtype=torch.int64).to(device, non_blocking=True)
    ids, off = keep.ids, keep.offsets
    if ids.is_cuda and use_kernels(ids, "triton"):
        from ppo_ops.core import sparse_keep_kernels
        return sparse_keep_kernels.header_values(ids, off)
    n = ids.numel()
    bits = ((off[0] != 0).to(torch.int64) * FIRST_NOT_ZERO + (off[-1] != n).to(torch.int64) * LAST_NOT_LEN)
    if off.numel() > 1:
        bits = bits + (off[1:] < off[:-1]).any().to(torch.int64) * DECREASING
    bounds = (torch.stack(torch.aminmax(ids)) if n else torch.zeros(2, dtype=torch.int64, device=ids.device))
    count = torch.tensor([n], dtype=torch.int64).to(ids.device, non_blocking=True)
    return torch.cat([count, _checksum(torch.cat([ids, off])).reshape(1), bits.reshape(1), bounds])


def value_error(fn_name: str, values, vocab_size: int, where: str = "") -> Optional[Exception]:
    """The error that read header values (header_values, as ints) call for, or None. `where` names the ranks."""
    n_ids, _, bits, lo, hi = values
    if n_ids < 0:
        return None
    problems = []
    if bits & FIRST_NOT_ZERO:
        problems.append("offsets[0] must be 0")
    if bits & LAST_NOT_LEN:
        problems.append(f"offsets[-1] must equal len(ids) = {n_ids}")
    if bits & DECREASING:
        problems.append("offsets must be non-decreasing")
    if problems:
        return argument_error(ValueError, fn_name, "keep", f"keep{where}: " + "; ".join(problems) +
                              " (keep=(ids, offsets) is CSR over the rows)")
    if n_ids and (lo < 0 or hi >= vocab_size):
        return argument_error(ValueError, fn_name, "keep",
                              f"keep ids{where} must be global token ids in [0, {vocab_size}), found "
                              f"{lo if lo < 0 else hi}")
    return None


# ---- the entries: every row's kept ids and its target, deduplicated ----

def fixed_bits(vocab_size: int) -> int:
    """Fraction bits of the fixed-point row sums: a row sums at most vocab_size + 1 terms <= 1 (its distinct ids
    and the target), so (vocab_size + 1) * 2^bits < 2^62 holds and the sum never overflows."""
    return min(MAX_FIXED_BITS, 62 - (vocab_size + 1).bit_length())


def use_kernels(tensor: torch.Tensor, backend_name: str) -> bool:
    """Whether the sparse work runs as Triton kernels (sparse_keep_kernels.py): on CUDA tensors when triton imports,
    and on CPU under the interpreter when the op's backend is a Triton one; else as torch ops (the CPU path). The
    two paths give the same values within fp32 rounding, not the same bits; each is deterministic and TP-invariant."""
    if not tensor.is_cuda and "triton" not in backend_name:
        return False
    try:
        from ppo_ops.core import sparse_keep_kernels  # noqa: F401
    except ImportError:
        return False
    return True


def entries(keep: SparseKeep, tokens: torch.Tensor, *, rows: Optional[torch.Tensor], row_mask: Optional[torch.Tensor],
            shard: KeepShard, kernels: bool) -> Entries:
    """The entries of `keep` over R = len(tokens) rows: `rows` maps them to the call's rows where the LM head
    compacted them (R kept rows of a row mask; None: the rows are the call's); `row_mask` (call rows) drops rows
    otherwise. Device-side, no sync; malformed offsets give unspecified entries, never an access out of bounds
    (validation reports them)."""
    vocab_size, v_global, vocab_start, n_valid = shard.vocab_size, shard.v_global, shard.vocab_start, shard.n_valid
    if kernels:
        from ppo_ops.core import sparse_keep_kernels
        row, gid, ok, local, col, order = sparse_keep_kernels.entries(keep, tokens, rows, row_mask, shard)
        return Entries(keep.ids.numel(), tokens.numel(), row, gid, ok, local, col, order, keep.offsets, rows,
                       row_mask, vocab_start, n_valid)
    device = tokens.device
    ids, n_ids = keep.ids, keep.ids.numel()
    n_all = keep.offsets.numel() - 1
    n_rows = tokens.numel()
    off = torch.cummax(keep.offsets.clamp(0, n_ids), 0).values
    start_all, end_all = off[:-1], off[1:]
    pos = torch.arange(n_ids, device=device)
    call_row = torch.searchsorted(off, pos, right=True) - 1  # in [-1, n_all]
    row_ok = (call_row >= 0) & (call_row < n_all)
    call_row = call_row.clamp(0, max(n_all - 1, 0))
    if rows is not None:
        to_compact = torch.full((n_all,), -1, dtype=torch.int64, device=device)
        to_compact[rows] = torch.arange(n_rows, device=device)
        row = to_compact[call_row] if n_all else call_row
        row_ok &= row >= 0
        row = row.clamp(min=0)
        row_start, row_end = start_all[rows], end_all[rows]
        keep_row = row_end > row_start
    else:
        row = call_row
        row_start, row_end = start_all, end_all
        keep_row = row_end > row_start
        if row_mask is not None:
            keep_row &= row_mask
    tok = tokens.to(torch.int64)
    if n_rows == 0:
        row_ok = torch.zeros_like(row_ok)
        tok_of = torch.zeros_like(ids)
        keep_of = torch.zeros_like(row_ok)
    else:
        tok_of, keep_of = tok[row], keep_row[row]
    id_ok = row_ok & keep_of & (ids >= 0) & (ids < vocab_size) & (ids != tok_of)
    target_ok = keep_row & (tok >= 0) & (tok < vocab_size)
    gid = torch.cat([ids, tok]).clamp(-1, v_global)
    ent_row = torch.cat([row, torch.arange(n_rows, device=device)])
    is_id = torch.cat([torch.ones(n_ids, dtype=torch.int64, device=device),
                       torch.zeros(n_rows, dtype=torch.int64, device=device)])
    # (id, row), a target before an id equal to it: duplicates sit side by side; the first of each counts.
    # Only entries that may count take part (as the kernel path's first *valid* entry): the others share key -1,
    # ahead of every (id, row). Their `row` is only an index: a dropped row's ids sit on compacted row 0 (and, with
    # validate=False, ids outside the CSR on row 0 or the last row), and ranked among that row's own listings they
    # would take the place of its first listing of the same id, which then would not count.
    valid = torch.cat([id_ok, target_ok])
    key = torch.where(valid, ((gid + 1) * max(n_rows, 1) + ent_row) * 2 + is_id, -1)
    sorted_key, order = torch.sort(key, stable=True)
    first = torch.ones_like(sorted_key, dtype=torch.bool)
    first[1:] = sorted_key[1:] != sorted_key[:-1]
    unique = torch.empty_like(first).scatter_(0, order, first)
    ok = unique & valid
    col = gid - vocab_start
    local = ok & (col >= 0) & (col < n_valid)
    col = col.clamp(0, max(n_valid - 1, 0))
    return Entries(n_ids, n_rows, ent_row, gid, ok, local, col, order, off, rows, row_mask, vocab_start, n_valid,
                   row_start, row_end, keep_row)


# ---- the keep rows' log-probs ----

def _exchange(z: torch.Tensor, group) -> torch.Tensor:
    """TP > 1: the one all-reduce of the keep set (every rank holds 0 where another rank's shard holds the id).
    Adding 0.0 at TP = 1 turns a -0.0 into 0.0 as the sum does at TP > 1."""
    if group is not None:
        dist.all_reduce(z, group=group)
        return z
    return z + 0.0


def _row_sums(values_fixed: torch.Tensor, ent: Entries) -> torch.Tensor:
    """[R] exact int64 sums of each row's fixed-point terms: its ids' (prefix sums over the CSR order, split in two
    halves so neither overflows) plus its target's."""
    ids_part = values_fixed[:ent.n_ids]
    lo = ids_part & ((1 << _SPLIT_BITS) - 1)
    hi = ids_part >> _SPLIT_BITS
    zero = torch.zeros(1, dtype=torch.int64, device=values_fixed.device)
    p_lo = torch.cat([zero, torch.cumsum(lo, 0)])
    p_hi = torch.cat([zero, torch.cumsum(hi, 0)])
    s, e = ent.row_start, ent.row_end
    return ((p_hi[e] - p_hi[s]) << _SPLIT_BITS) + (p_lo[e] - p_lo[s]) + values_fixed[ent.n_ids:]


def keep_state(ent: Entries, z: torch.Tensor, vocab_size: int, inv_temperature: float, kernels: bool,
               dense_log_prob: torch.Tensor) -> tuple:
    """(KeepState, the rows' log-probs: the keep log-prob on keep rows, `dense_log_prob` [R] elsewhere) from the
    exchanged kept logits `z` [E]: per row M = max over the keep set, S = Σ e^(z - M) in fixed point (each term
    truncated to a multiple of 2^-fixed_bits, summed exactly in int64), log_prob = (z_t - M) - log S."""
    bits = fixed_bits(vocab_size)
    if kernels:
        from ppo_ops.core import sparse_keep_kernels
        m, log_s, defined, keep_row, log_prob, out = sparse_keep_kernels.log_probs(z, ent, dense_log_prob, bits)
        return KeepState(ent, z, m, log_s, defined, keep_row, log_prob, inv_temperature, kernels), out
    n_rows = ent.n_rows
    zk = torch.where(ent.ok, z, NEG_INF)
    m = torch.full((n_rows,), NEG_INF, dtype=torch.float32, device=z.device)
    m = m.scatter_reduce(0, ent.row, zk, "amax")  # exact whatever the order
    m = torch.where(torch.isfinite(m), m, 0.0)
    e = torch.exp(zk - m[ent.row])  # 0 where not kept; <= 1 (NaN / +inf logits only under bad input)
    e = torch.nan_to_num(e, nan=0.0).clamp_(0.0, 1.0)
    total = _row_sums((e * float(2 ** bits)).to(torch.int64), ent)
    s = (total.to(torch.float64) * 2.0 ** -bits).to(torch.float32)
    defined = ent.keep_row & (s > 0)
    log_s = torch.log(torch.where(defined, s, 1.0))
    z_t = zk[ent.n_ids:]
    log_prob = torch.where(defined, (z_t - m) - log_s, NEG_INF)
    state = KeepState(ent, z, m, log_s, defined, ent.keep_row, log_prob, inv_temperature, kernels)
    return state, torch.where(ent.keep_row, log_prob, dense_log_prob)


def replace_log_probs(log_prob: torch.Tensor, state: KeepState, r0: int = 0, r1: Optional[int] = None) -> torch.Tensor:
    """The log-probs of rows r0 .. r1 - 1 (the state's rows) with the keep rows' replaced by their keep log-probs."""
    r1 = state.ent.n_rows if r1 is None else r1
    return torch.where(state.keep_row[r0:r1], state.log_prob[r0:r1], log_prob)


def dense_grad(grad_log_prob: Optional[torch.Tensor], state: KeepState, r0: int = 0,
               r1: Optional[int] = None) -> Optional[torch.Tensor]:
    """The upstream log-prob gradient of rows r0 .. r1 - 1 for the full-vocabulary path: 0 on keep rows."""
    if grad_log_prob is None:
        return None
    r1 = state.ent.n_rows if r1 is None else r1
    return torch.where(state.keep_row[r0:r1], 0.0, grad_log_prob)


def coefficients(state: KeepState, grad_log_prob: torch.Tensor, r0: int = 0, r1: Optional[int] = None) -> torch.Tensor:
    """[E] fp32 c_e = inv_t * g_r * ([e is the target] - q_e) for the entries this rank holds, of rows r0 .. r1 - 1
    whose keep set has mass (`grad_log_prob` [r1 - r0], those rows' upstream gradient); 0 for every other entry."""
    ent = state.ent
    r1 = ent.n_rows if r1 is None else r1
    if r1 <= r0:
        return torch.zeros_like(state.z)
    if state.kernels:
        from ppo_ops.core import sparse_keep_kernels
        return sparse_keep_kernels.coefficients(state, grad_log_prob, r0, r1)
    in_block = (ent.row >= r0) & (ent.row < r1)
    g = grad_log_prob.to(torch.float32)[(ent.row - r0).clamp(0, r1 - r0 - 1)]
    use = ent.local & in_block & state.defined[ent.row]
    q = torch.exp(torch.where(use, state.z, NEG_INF) - state.shift[ent.row] - state.log_sum[ent.row])
    delta = torch.zeros_like(q)
    delta[ent.n_ids:] = 1.0
    return torch.where(use, (g * (delta - q)) * state.inv_temperature, 0.0)


# ---- the logits op ----

def logits_forward(keep: SparseKeep, logits: torch.Tensor, tokens: torch.Tensor, row_mask: Optional[torch.Tensor],
                   plan, dense_log_prob: torch.Tensor) -> tuple:
    """The logits op's keep rows: entries, kept logits gathered from this rank's shard (then exchanged), their
    log-probs. `logits` [T, V_local], `tokens` [T], `dense_log_prob` [T] are the call's, `plan` its Plan. Returns
    (KeepState, the call's log-probs with the keep rows' replaced)."""
    layout, shard = plan.layout, plan.shard
    vocab = KeepShard.of(plan)
    kernels = use_kernels(logits, plan.backend.name)
    if kernels:  # one launch per row: entries, first listings and kept logits, no sort (no order needed here)
        from ppo_ops.core import sparse_keep_kernels
        row, gid, ok, local, col, z = sparse_keep_kernels.logits_entries(keep, tokens, row_mask, logits,
                                                                         shard.inv_temperature, vocab)
        ent = Entries(keep.ids.numel(), tokens.numel(), row, gid, ok, local, col, None, keep.offsets, None, row_mask,
                      shard.vocab_start, shard.n_valid)
    else:
        ent = entries(keep, tokens, rows=None, row_mask=row_mask, shard=vocab, kernels=False)
        z = torch.zeros(ent.row.numel(), dtype=torch.float32, device=logits.device)
        if z.numel() and logits.shape[0] and logits.shape[1]:
            z = torch.where(ent.local, logits[ent.row, ent.col].to(torch.float32) * shard.inv_temperature, 0.0)
    z = _exchange(z, layout.group)
    return keep_state(ent, z, layout.vocab_size, shard.inv_temperature, kernels, dense_log_prob)


def logits_backward(state: KeepState, grad_log_prob: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor],
                    shift: torch.Tensor, log_sum: torch.Tensor, mean_shifted: Optional[torch.Tensor],
                    out: torch.Tensor) -> None:
    """Writes the keep rows' kept entries of the logits op's gradient `out` [T, V_local] (which the backend wrote with
    the log-prob gradient zeroed on keep rows): inv_t * (g_lp (delta - q) + g_ent p (mean - d)) in fp32 for each
    entry this rank holds, d = z - shift and p = e^(d - log_sum) from the full-vocabulary statistics, rounded once
    to out's dtype. Each (row, column) is written by one entry: no accumulation, no atomics."""
    if grad_log_prob is None or state.ent.row.numel() == 0:
        return
    ent = state.ent
    if state.kernels:
        from ppo_ops.core import sparse_keep_kernels
        sparse_keep_kernels.write_logits_grad(out, state, grad_log_prob,
                                              FullStats(grad_entropy, shift, log_sum, mean_shifted))
        return
    value = coefficients(state, grad_log_prob)
    if grad_entropy is not None and mean_shifted is not None:
        d = state.z - shift[ent.row]
        p = torch.exp(d - log_sum[ent.row])
        ent_term = torch.where(p > 0, grad_entropy.to(torch.float32)[ent.row] * p * (mean_shifted[ent.row] - d), 0.0)
        value = value + ent_term * state.inv_temperature
    idx = torch.nonzero(ent.local & state.defined[ent.row]).squeeze(1)  # the CPU path: no device sync
    out[ent.row[idx], ent.col[idx]] = value[idx].to(out.dtype)


# ---- the LM head ----

def lm_head_forward(keep: SparseKeep, hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                    rows: Optional[torch.Tensor], plan, dense_log_prob: torch.Tensor) -> tuple:
    """The LM head's keep rows, computed once for all R rows of the call: `hidden` [R, H], `tokens` [R] and
    `dense_log_prob` [R] are the rows the Function works on (the kept rows of a row mask, compacted; `rows` their
    indices into the call's rows, or None), `weight` this rank's [V_local, H]. Forms the kept logits
    z = inv_t * (hidden[r] . weight[id]) in fp32 for the ids this rank holds, exchanges them (one all-reduce at
    TP > 1) and returns (KeepState, the R rows' log-probs with the keep rows' replaced). At TP > 1 every rank must
    call it after the header exchange (the call's validation), since the all-reduce's size is len(ids) + R."""
    layout, shard = plan.layout, plan.shard
    kernels = use_kernels(hidden, plan.backend.name)
    ent = entries(keep, tokens, rows=rows, row_mask=None, shard=KeepShard.of(plan), kernels=kernels)
    z = torch.zeros(ent.row.numel(), dtype=torch.float32, device=hidden.device)
    if z.numel() and hidden.shape[0]:
        if kernels:
            from ppo_ops.core import sparse_keep_kernels
            sparse_keep_kernels.keep_dots(hidden, weight, ent, shard.inv_temperature, z)
        else:
            _torch_dots(hidden, weight, ent, shard.inv_temperature, z)
    z = _exchange(z, layout.group)
    return keep_state(ent, z, layout.vocab_size, shard.inv_temperature, kernels, dense_log_prob)


def add_dx(state: KeepState, grad_log_prob: torch.Tensor, dx: torch.Tensor, weight: torch.Tensor, r0: int = 0,
           r1: Optional[int] = None) -> None:
    """dX rows r0 .. r1 - 1 (`dx` fp32 [r1 - r0, H], this rank's contribution before any dX all-reduce) += the keep
    rows' term Σ_e c_e W[id_e] over the entries this rank holds, in a fixed order per row (its ids in CSR order,
    then its target). `grad_log_prob` [r1 - r0]: those rows' upstream log-prob gradient."""
    r1 = state.ent.n_rows if r1 is None else r1
    if r1 <= r0 or state.ent.row.numel() == 0:
        return
    coef = coefficients(state, grad_log_prob, r0, r1)
    ent = state.ent
    if state.kernels:
        from ppo_ops.core import sparse_keep_kernels
        sparse_keep_kernels.keep_dx(dx, weight, coef, ent, r0, r1)
        return
    use = ent.local & (ent.row >= r0) & (ent.row < r1)
    # Row by row in entry order: the ids part is in CSR order and the targets follow it.
    _ordered_add_rows(dx, ent.row - r0, weight, ent.col, coef, use)


def add_dw(state: KeepState, grad_log_prob: torch.Tensor, dw: torch.Tensor, hidden: torch.Tensor) -> None:
    """dW (`dw` [V_local, H], weight's dtype or an fp32 accumulator) += the keep rows' term: for each id v this rank
    holds, Σ c_e X[row_e] over its entries in (id, row) order, summed in fp32 and added to dW's row with one
    rounding. `grad_log_prob` [R]: every row's upstream log-prob gradient (0 or anything on rows without keep)."""
    if state.ent.row.numel() == 0:
        return
    coef = coefficients(state, grad_log_prob)
    ent = state.ent
    if state.kernels:
        from ppo_ops.core import sparse_keep_kernels
        sparse_keep_kernels.keep_dw(dw, hidden, coef, ent)
        return
    _torch_dw(dw, hidden, coef, ent)


def add_to_dlogits(state: KeepState, coef: torch.Tensor, dl: torch.Tensor, r0: int, c0: int) -> None:
    """For a backend that forms dlogits in blocks (the token loss's row blocks): adds the keep rows'
    log-prob term to the block `dl` [n_rows, n_cols] (any strides, e.g. the transpose of a vocabulary-major buffer),
    whose element (i, j) is row r0 + i (of the state's rows) and local column c0 + j: dl[i, j] += coef_e for each
    entry this rank holds in that window (`coef` from coefficients(): inv_t * g * (delta - q), 0 elsewhere). The
    full-vocabulary part must have been formed with dense_grad()'s upstream gradient (0 on keep rows). One rounding
    to dl's dtype per kept entry (after the full-vocabulary part's own); each element is written by one entry, no
    atomics. The block's dX and dW GEMMs then carry the keep term: nothing else to add."""
    ent = state.ent
    if ent.row.numel() == 0 or dl.numel() == 0:
        return
    n_rows, n_cols = dl.shape
    rows, cols = ent.row - r0, state.col - c0
    write = state.local & (rows >= 0) & (rows < n_rows) & (cols >= 0) & (cols < n_cols) & (coef != 0)
    if state.kernels:
        from ppo_ops.core import sparse_keep_kernels
        sparse_keep_kernels.add_rows_cols(dl, rows, cols, coef, write)
    else:
        idx = torch.nonzero(write).squeeze(1)  # CPU (or CUDA without triton): a host sync there
        r, c = rows[idx], cols[idx]
        dl[r, c] = (dl[r, c].to(torch.float32) + coef[idx]).to(dl.dtype)


# ---- torch fallbacks of the LM head's sparse work (fixed orders; CPU: sequential index_add_) ----

def _torch_dots(hidden, weight, ent: Entries, inv_temperature, z) -> None:
    """z[e] = inv_t * (hidden[row_e] . weight[col_e]) in fp32 for local entries, in chunks of TORCH_CHUNK entries."""
    row, col, local = ent.row, ent.col, ent.local
    for a in range(0, z.numel(), TORCH_CHUNK):
        b = min(z.numel(), a + TORCH_CHUNK)
        prod = hidden[row[a:b]].to(torch.float32) * weight[col[a:b]].to(torch.float32)
        dots = fold_sum(prod) * inv_temperature
        z[a:b] = torch.where(local[a:b], dots, 0.0)


def _ordered_add_rows(dst, dst_rows, src, src_rows, coef, use) -> None:
    """dst[dst_rows[e]] += coef[e] * src[src_rows[e]] for the entries where `use`, in entry order per destination
    row: CPU index_add_ adds sequentially; CUDA (without triton) index_put_ with accumulate sorts stably and adds
    each destination's rows in order."""
    idx = torch.nonzero(use).squeeze(1)  # CPU; on CUDA without triton a host sync
    for a in range(0, idx.numel(), TORCH_CHUNK):
        sel = idx[a:a + TORCH_CHUNK]
        part = coef[sel, None] * src[src_rows[sel]].to(torch.float32)
        if dst.is_cuda:
            dst.index_put_((dst_rows[sel],), part.to(dst.dtype), accumulate=True)
        else:
            dst.index_add_(0, dst_rows[sel], part.to(dst.dtype))


def _torch_dw(dw, hidden, coef, ent: Entries) -> None:
    """The dW term in (id, row) order: per id an fp32 sum from 0 in that order, then dW[id] = round(dW[id] + sum)."""
    order, row, col, local = ent.order, ent.row, ent.col, ent.local
    sel = order[local[order]]  # local entries in (id, row) order (a host sync on CUDA without triton)
    if sel.numel() == 0:
        return
    ids_sorted = col[sel]
    unique, counts = torch.unique_consecutive(ids_sorted, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    group = max(1, TORCH_CHUNK // 8)  # ids per fp32 accumulator [group, H]
    for i in range(0, unique.numel(), group):
        j = min(unique.numel(), i + group)
        lo, hi = (ends[i - 1] if i else 0), ends[j - 1]
        acc = torch.zeros((j - i, hidden.shape[1]), dtype=torch.float32, device=dw.device)
        slot = torch.repeat_interleave(torch.arange(j - i, device=dw.device), counts[i:j])
        part_sel = sel[lo:hi]
        for a in range(0, hi - lo, TORCH_CHUNK):
            b = min(hi - lo, a + TORCH_CHUNK)
            e = part_sel[a:b]
            part = coef[e, None] * hidden[row[e]].to(torch.float32)
            if acc.is_cuda:
                acc.index_put_((slot[a:b],), part, accumulate=True)
            else:
                acc.index_add_(0, slot[a:b], part)
        ids = unique[i:j]
        dw[ids] = (dw[ids].to(torch.float32) + acc).to(dw.dtype)
