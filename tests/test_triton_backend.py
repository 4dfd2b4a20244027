"""Contract-level tests of the Triton backend (ppo_ops/logits/triton_backend.py): under TRITON_INTERPRET=1 on CPU
tensors (the CPU target), and compiled on CUDA at Qwen3 sizes (the `_gpu` target; the last section).

`forward_partials` is checked, for lanes of 1, 8 and a whole tile's columns (LANE_WIDTH, see
ppo_ops/logits/triton_kernels.py; per-column lanes' online state has its own test over many small tiles), channel by
channel against the float64 partials of tests/triton_reference.py (MAX and TARGET_Z exactly: selections of the same fp32
z), `backward_grad` against the float64 gradient defined by float64 row statistics, given them rounded to fp32 as the
core passes them. Edge cases have their own tests: -inf logits and rows, NaN/inf padding, targets on another rank,
multi-tile online rescaling, strided and in-place tensors, empty inputs, row masks (a dropped row is never read: NaN
logits there give exactly neutral partials and a zero gradient row, and kept rows keep the bits of an unmasked run);
then determinism, bitwise invariance of a segment's partials and of the gradient under vocabulary sharding (the backend
half of the TP-invariance claim), bad input. Last, the kernels are compiled for sm_90 in a child process (the
interpreter accepts code the compiler rejects), which also shows the forward's compiled code is the same at every TP
size.

End-to-end numerics through the public API run for both backends in tests/test_core_*.py; tests/test_tp_invariance.py
checks bitwise TP invariance over ranks. Tests marked `device("cpu")` (the interpreter's contract checks, the
module's default) or `device("cuda")` (compiled kernels) run where tests/ranks.py's DEVICE is that device and are
deselected elsewhere (tests/conftest.py); the sm_90 compile checks run on both.
"""

import dataclasses

import pytest
import torch

from tests.core_support import DEVICE, compile_check_report, triton_skip_reason

_SKIP = triton_skip_reason(DEVICE)
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)
pytestmark = pytest.mark.device("cpu")  # the interpreter's contract checks; compiled ones are marked cuda below

# Imported after the skip: these load the kernels, which must see TRITON_INTERPRET first (tests/conftest.py sets it).
from ppo_ops.logits import triton_backend as tb  # noqa: E402
from ppo_ops.core.row_stats import ENT_SUM, MAX, SUMEXP, TARGET_Z, empty_partials  # noqa: E402
from tests.triton_reference import (NEG_INF, assert_kernel_grad_close, assert_partials_close, backward_grad,  # noqa: E402
                                    check_once, forward_partials, make_case, reference_grad, reference_partials,
                                    reference_stats, results_per_tp)

COMPILE_TIMEOUT_S = 300  # the child compiles 15 kernels for sm_90 (about 20 s on 2 cores); a hang fails the test
# The forward's lane width: per-column lanes, the bf16 default (one 16-byte vector per lane), one lane per tile (a
# block-wide online softmax; the lane width is capped at the tile). Every forward test runs each.
LANE_WIDTHS = [1, 8, 1 << 16]


# ---------------------------------------------------------------------------------------------------------------------
# values

@pytest.mark.parametrize("shape,seg_len", [
    ((5, 96), 12),  # eight segments of a non-power-of-2 length
    ((3, 96), 96),  # one segment (the layout when V_global is not divisible by 8)
    ((4, 1000), 125),  # odd segment length: no vector alignment
    ((2, 151936), 18992),  # Qwen3's vocabulary in its eight fixed segments: long sums
])
@pytest.mark.parametrize("lane_width", LANE_WIDTHS)
def test_shapes(shape, seg_len, lane_width):
    check_once(*make_case(*shape), seg_len=seg_len, lane_width=lane_width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inv_t", [1.0, 1.0 / 0.7, 1.0 / 1.3])
@pytest.mark.parametrize("lane_width", LANE_WIDTHS)
def test_dtypes_and_temperatures(dtype, inv_t, lane_width):
    inv_t = float(torch.tensor(inv_t, dtype=torch.float32))  # the core passes an fp32-representable value
    check_once(*make_case(4, 256, dtype=dtype), inv_t=inv_t, seg_len=32, lane_width=lane_width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lane_width", LANE_WIDTHS)
def test_keep_mask(dtype, lane_width):
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(6, 128, dtype=dtype, keep=True)
    keep_mask[0, target_col[0]] = False  # the target joins the kept set even where the mask drops it
    keep_mask[1] = False  # only the target is kept: log_prob 0, q one-hot
    check_once(logits, row_mask, target_col, keep_mask, g_lp, g_ent, seg_len=16, lane_width=lane_width)


def test_keep_mask_strided_is_read_correctly():
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(4, 64, keep=True)
    keep_t = keep_mask.t().contiguous().t()  # column-major: stride(-1) != 1
    check_once(logits, row_mask, target_col, keep_t, g_lp, g_ent, seg_len=8)


@pytest.mark.parametrize("n_active", [0, 1, 5])
def test_row_subset(n_active):
    # Only kept rows are computed; the others get neutral partials and a zero gradient (check_once checks both).
    check_once(*make_case(9, 64, n_rows_active=n_active, keep=True), seg_len=16)


@pytest.mark.parametrize("n_valid", [70, 60, 0])
@pytest.mark.parametrize("lane_width", LANE_WIDTHS)
def test_padding_is_never_read_as_vocabulary(n_valid, lane_width):
    # 70: segment 5 is split and 6-7 are all padding; 60: a boundary; 0: a shard that is all padding.
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(4, 96, keep=True)
    target_col = target_col.clamp(max=max(n_valid - 1, 0))
    if n_valid == 0:
        target_col[:] = -1
    logits[:, n_valid:] = float("nan")
    logits[0, n_valid:] = float("inf")
    got, grad = check_once(logits, row_mask, target_col, keep_mask, g_lp, g_ent, n_valid=n_valid, seg_len=12,
                           lane_width=lane_width)
    assert bool((grad[:, n_valid:] == 0).all())


def test_targets_on_another_rank():
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(5, 64, keep=True)
    target_col[::2] = -1
    got, _ = check_once(logits, row_mask, target_col, keep_mask, g_lp, g_ent, seg_len=16)
    assert bool((got[:, TARGET_Z, ::2] == NEG_INF).all())


@pytest.mark.parametrize("lane_width", LANE_WIDTHS)
def test_neg_inf_logits(lane_width):
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(6, 64, keep=True)
    logits[0, ::3] = NEG_INF  # scattered
    logits[1] = NEG_INF  # a whole row: no mass anywhere
    logits[2, :16] = NEG_INF  # a whole segment
    logits[3, target_col[3]] = NEG_INF  # the target: log_prob -inf, gradient finite
    keep_mask[4] = False
    logits[4, target_col[4]] = NEG_INF  # empty kept set
    g_lp[[1, 4]] = 0.0  # as the core passes them: no log-prob gradient where the kept set has no mass,
    g_ent[1] = 0.0  # no entropy gradient where the row has none
    got, grad = check_once(logits, row_mask, target_col, keep_mask, g_lp, g_ent, seg_len=16, lane_width=lane_width)
    assert not torch.isnan(got).any()
    assert bool((got[:, MAX, 1] == NEG_INF).all()) and bool((got[:, SUMEXP:ENT_SUM + 1, 1] == 0).all())
    assert bool((grad[1] == 0).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("lane_width", LANE_WIDTHS)
@pytest.mark.parametrize("block_v", [None, 4])  # one tile per segment; four tiles, the bad value in the third
def test_nan_and_pos_inf_logits_reach_max(bad, lane_width, block_v):
    # The core rejects bad logits by looking at the merged MAX (NaN or +inf); tl.max alone would drop a NaN.
    logits, _, target_col, _, _, _ = make_case(3, 64)
    logits[1, 41] = bad
    got = forward_partials(logits, None, target_col, None, 1.0, 64, 16, True, None, block_v=block_v,
                           lane_width=lane_width)
    flagged = torch.isnan(got[:, MAX]) | (got[:, MAX] == float("inf"))
    assert flagged[2, 1] and int(flagged.sum()) == 1  # only segment 2 of row 1


@pytest.mark.parametrize("lane_width", LANE_WIDTHS)
def test_online_rescaling_across_tiles(lane_width):
    # Tiles of 4 columns, logits rising along the row: the running max grows at (almost) every tile, which rescales
    # s, sk and w (with the (m_old - m_new) * s term); a -inf first tile exercises the start from an empty state.
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(3, 64, keep=True, scale=1.0)
    logits += torch.linspace(-20, 20, 64)
    logits[1, :4] = NEG_INF
    check_once(logits, row_mask, target_col, keep_mask, g_lp, g_ent, seg_len=32, block_v=4, lane_width=lane_width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lanes_online_state(dtype):
    # Per-column lanes (lane width 1): each lane's online state over 12 tiles of 8 columns (plus a partial, masked 13th
    # and padding), each lane seeing its own sequence: new maxima in some lanes and not others, repeated maxima (d = 0),
    # lanes that stay -inf for several tiles (empty state, then a first finite value), a lane that is -inf throughout
    # (drops out of the merge), a whole -inf tile, and a row with a single finite logit.
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(5, 104, dtype=dtype, keep=True, scale=4.0)
    logits[0, 3::8] = NEG_INF  # lane 3 empty throughout
    logits[0, 5:40:8] = NEG_INF  # lane 5 empty for five tiles
    logits[1, 16:24] = NEG_INF  # a whole tile
    logits[2, 6::8] = logits[2, 6]  # lane 6: the same value in every tile (no new max after the first)
    logits[3] = NEG_INF
    logits[3, 77] = 1.5  # one finite logit in the row
    logits[4] += torch.linspace(-30, 30, 104).to(dtype)  # rising: a new max in every lane at every tile
    target_col[3] = 77  # the target is that logit: log_prob 0 whatever the keep mask
    check_once(logits, row_mask, target_col, keep_mask, g_lp, g_ent, n_valid=100, seg_len=104, block_v=8,
               lane_width=1, inv_t=float(torch.tensor(1.0 / 0.7, dtype=torch.float32)))


@pytest.mark.parametrize("lane_width", LANE_WIDTHS)
def test_entropy_channel_off(lane_width):
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(3, 64)
    got, _ = check_once(logits, row_mask, target_col, keep_mask, g_lp, g_ent, seg_len=16, with_entropy=False,
                        lane_width=lane_width)
    assert bool((got[:, ENT_SUM] == 0).all())


@pytest.mark.parametrize("which", ["log_prob", "entropy", "none"])
def test_backward_with_one_upstream_gradient(which):
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(4, 64, keep=True)
    stats = reference_stats(logits, row_mask, target_col, keep_mask, 1.0, 64)
    g_lp = g_lp if which == "log_prob" else None
    g_ent = g_ent if which == "entropy" else None
    out = torch.full_like(logits, 7.0)
    backward_grad(logits, row_mask, target_col, keep_mask, 1.0, 64, *(s.float() for s in stats), g_lp, g_ent, out,
                     None)
    assert_kernel_grad_close(out, reference_grad(logits, row_mask, target_col, keep_mask, 1.0, 64, stats, g_lp, g_ent))


def test_strided_rows_and_inplace_gradient():
    # Logits and gradient as column slices of wider buffers (row stride != V_local); then in place (out is logits).
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(5, 64, dtype=torch.bfloat16, n_rows_active=3)
    wide = torch.zeros((5, 80), dtype=torch.bfloat16)
    wide[:, 8:72] = logits
    view = wide[:, 8:72]
    stats = [s.float() for s in reference_stats(logits, row_mask, target_col, None, 1.0, 64)]
    got = forward_partials(view, row_mask, target_col, None, 1.0, 64, 16, True, None)
    assert torch.equal(got, forward_partials(logits, row_mask, target_col, None, 1.0, 64, 16, True, None))
    expected = torch.empty_like(logits)
    backward_grad(logits, row_mask, target_col, None, 1.0, 64, *stats, g_lp, g_ent, expected, None)
    before = wide.clone()
    backward_grad(view, row_mask, target_col, None, 1.0, 64, *stats, g_lp, g_ent, view, None)
    assert torch.equal(view, expected)
    assert torch.equal(wide[:, :8], before[:, :8]) and torch.equal(wide[:, 72:], before[:, 72:])


def test_inputs_are_not_mutated():
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(4, 64, keep=True, n_rows_active=3)
    originals = [t.clone() for t in (logits, row_mask, target_col, keep_mask, g_lp, g_ent)]
    check_once(logits, row_mask, target_col, keep_mask, g_lp, g_ent, seg_len=16)
    for before, after in zip(originals, (logits, row_mask, target_col, keep_mask, g_lp, g_ent)):
        assert torch.equal(before, after)


def test_empty_inputs():
    logits = torch.zeros((0, 64))
    none = torch.zeros(0, dtype=torch.int64)
    assert forward_partials(logits, None, none, None, 1.0, 64, 16, True, None).shape == (4, 5, 0)
    empty = torch.zeros(0)
    backward_grad(logits, None, none, None, 1.0, 64, empty, empty, None, empty, empty, empty, logits, None)
    # Every row dropped: neutral partials and zero gradient rows, NaN logits never read.
    logits = torch.full((3, 64), float("nan"))
    no_row = torch.zeros(3, dtype=torch.bool)
    target_col, stats = torch.zeros(3, dtype=torch.int64), torch.ones(3)
    got = forward_partials(logits, no_row, target_col, None, 1.0, 64, 16, True, None)
    assert torch.equal(got, empty_partials(4, 3, "cpu"))
    backward_grad(logits, no_row, target_col, None, 1.0, 64, stats, stats, None, stats, stats, stats, logits, None)
    assert bool((logits == 0).all())


# ---------------------------------------------------------------------------------------------------------------------
# bits: determinism and sharding invariance

@pytest.mark.parametrize("lane_width", LANE_WIDTHS)
def test_deterministic_and_row_independent(lane_width):
    logits, _, target_col, keep_mask, _, _ = make_case(8, 96, keep=True)
    full = forward_partials(logits, None, target_col, keep_mask, 1.0, 90, 12, True, None, lane_width=lane_width)
    assert torch.equal(full, forward_partials(logits, None, target_col, keep_mask, 1.0, 90, 12, True, 3,
                                                 lane_width=lane_width))
    row_mask = torch.zeros(8, dtype=torch.bool)
    row_mask[[1, 4, 7]] = True
    part = forward_partials(logits, row_mask, target_col, keep_mask, 1.0, 90, 12, True, None, lane_width=lane_width)
    # a row's bits do not depend on which other rows run
    assert torch.equal(part[:, :, row_mask], full[:, :, row_mask])


# (lane_width, block_v, keep) of the row-mask forward: every lane width at every tile size (per 12-column segment: one
# partial tile only, 3 whole tiles, both), with and without a keep mask in turn, so each lane width and each tile size
# also runs both ways. Each case is two interpreted launches of seconds; the backward has no lane width (its own test).
ROW_MASK_FORWARD_CASES = [(lane, block_v, (i + j) % 2 == 0)
                          for i, lane in enumerate(LANE_WIDTHS) for j, block_v in enumerate((None, 4, 8))]


def _row_mask_case(keep):
    """Logits, target columns, keep mask and upstream weights of the row-mask tests, the dropped rows' logits NaN."""
    logits, _, target_col, keep_mask, g_lp, g_ent = make_case(8, 96, keep=keep)
    row_mask = torch.tensor([True, False, False, True, True, False, True, False])
    masked = logits.clone()
    masked[~row_mask] = float("nan")
    return logits, masked, row_mask, target_col, keep_mask, g_lp, g_ent


ROW_MASK_N_VALID, ROW_MASK_SEG_LEN = 90, 12
ROW_MASK_INV_T = float(torch.tensor(1 / 0.7, dtype=torch.float32))


@pytest.mark.parametrize("lane_width,block_v,keep", ROW_MASK_FORWARD_CASES)
def test_row_mask_forward_never_reads_dropped_rows(lane_width, block_v, keep):
    # Dropped rows hold NaN logits (a real target column too): had a program read any of them, NaN would reach its
    # partials. Kept rows: the bits of an unmasked run.
    logits, masked, row_mask, target_col, keep_mask, _, _ = _row_mask_case(keep)
    n_valid, seg_len, inv_t = ROW_MASK_N_VALID, ROW_MASK_SEG_LEN, ROW_MASK_INV_T
    opts = dict(lane_width=lane_width, block_v=block_v)

    unmasked = forward_partials(logits, None, target_col, keep_mask, inv_t, n_valid, seg_len, True, None, **opts)
    got = forward_partials(masked, row_mask, target_col, keep_mask, inv_t, n_valid, seg_len, True, None, **opts)
    assert torch.equal(got[:, :, row_mask], unmasked[:, :, row_mask])
    neutral = empty_partials(96 // seg_len, int((~row_mask).sum()), "cpu")
    assert torch.equal(got[:, :, ~row_mask], neutral)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("block_v", [None, 4, 8])  # per 12-column segment: a partial tile only; 3 whole tiles; both
def test_row_mask_backward_never_reads_dropped_rows(block_v, keep):
    # Dropped rows hold NaN logits, and NaN row statistics and upstream gradients: had a program read or used any of
    # them, NaN would reach its gradient row. Kept rows: the bits of an unmasked run.
    logits, masked, row_mask, target_col, keep_mask, g_lp, g_ent = _row_mask_case(keep)
    n_valid, inv_t = ROW_MASK_N_VALID, ROW_MASK_INV_T
    stats = [s.float() for s in reference_stats(logits, None, target_col, keep_mask, inv_t, n_valid)]
    expected = torch.empty_like(logits)
    backward_grad(logits, None, target_col, keep_mask, inv_t, n_valid, *stats, g_lp, g_ent, expected, None,
                     block_v=block_v)
    junk = [torch.where(row_mask, t, float("nan")) for t in (*stats, g_lp, g_ent)]
    grad = torch.full_like(logits, 7.0)  # every entry must be written
    backward_grad(masked, row_mask, target_col, keep_mask, inv_t, n_valid, *junk, grad, None, block_v=block_v)
    assert torch.equal(grad[row_mask], expected[row_mask])
    assert bool((grad[~row_mask] == 0).all())
    backward_grad(masked, row_mask, target_col, keep_mask, inv_t, n_valid, *junk, masked, None, block_v=block_v)
    assert torch.equal(masked, grad)  # in place: the NaN rows are overwritten with zeros, never read


# (dtype, lane_width, block_v): every lane width at both tile sizes (one tile per segment; four tiles per segment), the
# dtypes in turn, so each lane width and each tile size also runs in both dtypes (each case is 15 interpreted
# forward launches, one per rank of TP = 1, 2, 4, 8).
SHARD_CASES = [(dtype, lane, block_v) for i, lane in enumerate(LANE_WIDTHS) for j, block_v in enumerate((None, 8))
               for dtype in [(torch.float32, torch.bfloat16)[(i + j) % 2]]]


@pytest.mark.parametrize("dtype,lane_width,block_v", SHARD_CASES,
                         ids=lambda v: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else None)
def test_shards_give_the_same_bits(dtype, lane_width, block_v):
    # Backend half of TP invariance: rank r of a TP group holds columns [r*V/tp, (r+1)*V/tp) and the fixed segments
    # inside them. Its partials must equal, bit for bit, the same segments computed at TP=1, and its gradient (given
    # the same row stats) the same columns of the TP=1 gradient.
    n_rows, v_global, vocab_size = 4, 256, 250  # 6 padding columns, all on the last rank
    logits, row_mask, tokens, keep_mask, g_lp, g_ent = make_case(n_rows, v_global, dtype=dtype, keep=True,
                                                                 n_rows_active=3)
    tokens = tokens.clamp(max=vocab_size - 1)
    seg_len = v_global // 8
    stats = [s.float() for s in reference_stats(logits, row_mask, tokens, keep_mask, 1.0, vocab_size)]
    results = results_per_tp(logits, row_mask, tokens, keep_mask, stats, g_lp, g_ent, vocab_size, seg_len,
                             lane_width=lane_width, block_v=block_v)
    for tp in (2, 4, 8):
        assert torch.equal(results[tp][0], results[1][0]), f"partials differ at TP={tp}"
        assert torch.equal(results[tp][1], results[1][1]), f"gradient differs at TP={tp}"


# ---------------------------------------------------------------------------------------------------------------------
# bad input

def test_errors_name_the_argument():
    logits, _, target_col, _, _, _ = make_case(2, 64)
    with pytest.raises(TypeError, match="ppo_ops.logits.triton_backend: logits must"):
        forward_partials(logits.double(), None, target_col, None, 1.0, 64, 16, True, None)
    with pytest.raises(ValueError, match="stride"):
        forward_partials(logits.t().contiguous().t(), None, target_col, None, 1.0, 64, 16, True, None)
    with pytest.raises(ValueError, match="ppo_ops.logits.triton_backend: seg_len must"):
        forward_partials(logits, None, target_col, None, 1.0, 64, 24, True, None)
    with pytest.raises(ValueError, match="ppo_ops.logits.triton_backend: n_valid must"):
        forward_partials(logits, None, target_col, None, 1.0, 65, 16, True, None)
    with pytest.raises(ValueError, match="ppo_ops.logits.triton_backend: keep_mask must"):
        forward_partials(logits, None, target_col, torch.ones(2, 64, dtype=torch.uint8), 1.0, 64, 16, True, None)
    with pytest.raises(ValueError, match="lane_width must be a power of two"):
        forward_partials(logits, None, target_col, None, 1.0, 64, 16, True, None, lane_width=6)
    stats = [torch.zeros(2)] * 4
    with pytest.raises(ValueError, match="ppo_ops.logits.triton_backend: out must"):
        backward_grad(logits, None, target_col, None, 1.0, 64, *stats, stats[0], None, logits.half(), None)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setattr(tb, "interpreting", lambda: False)
    logits, _, target_col, _, _, _ = make_case(2, 64)
    with pytest.raises(ValueError, match="triton backend needs CUDA tensors or TRITON_INTERPRET=1"):
        forward_partials(logits, None, target_col, None, 1.0, 64, 16, True, None)


# ---------------------------------------------------------------------------------------------------------------------
# compiled code (no GPU needed: Triton compiles for sm_90 with its bundled ptxas, in a child process without the
# interpreter, see tests/triton_compile_check.py)

any_device = pytest.mark.device("any")  # compiles in a child process, whatever this process runs on


@pytest.fixture(scope="module")
def compile_report(tmp_path_factory):
    return compile_check_report("tests.triton_compile_check", tmp_path_factory.mktemp("triton_cache"),
                                COMPILE_TIMEOUT_S)


@any_device
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_forward_binary_is_the_same_at_every_tp_size(compile_report, dtype):
    # Same specialization => same compiled kernel => same bits per (row, segment) at TP = 1, 2, 4, 8, even where the
    # row stride (V_local = 1000 at TP=8) is not a multiple of 16 while it is at TP=1 (8000).
    assert compile_report["forward_keys"][dtype] == 1


@any_device
@pytest.mark.parametrize("case", [f"{p} {d} keep={k}" for p in ("forward", "backward")
                                  for d in ("bf16", "fp32") for k in (False, True)])
def test_kernels_compile_for_sm90_with_vector_loads(compile_report, case):
    # The interpreter accepts code the compiler rejects; both kernels must compile as an H200 runs them, reading the
    # logits (and writing the gradient) with 16-byte vector accesses: the bandwidth-critical part.
    ptx = compile_report["ptx"][case]
    assert ptx["v4_load"], f"{case}: logits not read with 16-byte vector loads"
    if case.startswith("backward"):
        assert ptx["v4_store"], f"{case}: gradient not written with 16-byte vector stores"


@any_device
def test_temperature_scaling_is_rounded_before_use(compile_report):
    # MAX holds fp32(logit * inv_t); d = z - m must come from that same rounded z, not from an FMA of the unrounded
    # product (on an H200 that put the entropy partial 2.3e-6 off, beyond PARTIAL_SUM_RTOL).
    assert compile_report["forward_scaled_mul_rn"]


@any_device
@pytest.mark.parametrize("case", [f"{p} {t}" for p in ("forward", "backward") for t in ("rows", "softcap")])
def test_transforms_compile_for_sm90(compile_report, case):
    # A per-row temperature and a softcap take code only the compiler sees (inline PTX behind COMPILED): the
    # flush-to-zero ex2 in the forward's exponentials and in the gradient pass with a temperature, the approximate
    # reciprocal of the softcap's tanh; the logits still read with 16-byte vector loads.
    ptx = compile_report["transforms"][case]
    assert ptx["v4_load"], f"{case}: logits not read with 16-byte vector loads"
    assert ptx["ex2_ftz"], f"{case}: no flush-to-zero ex2"
    assert ptx["rcp"] == case.endswith("softcap"), f"{case}: the approximate reciprocal where the softcap is {ptx}"


@any_device
@pytest.mark.parametrize("keep", [False, True])
def test_fused_merge_compiles_for_sm90(compile_report, keep):
    # The interpreter runs kernels that read non-constexpr module globals; the compiler rejects them.
    assert compile_report["merge"][f"keep={keep}"]


# --- the fused merge (merge_partials_kernel) against the torch-op merge it replaces ----------------------------------
# Both compute the same formulas in fp32; they differ only in exp/log implementations (numpy's under the interpreter,
# torch's on the CPU): a few ulps of the merged sums.
MERGE_RTOL = 4e-6  # ~32 ulps: one exp per segment and one log per row, each a few ulps apart, through 8 segments


@pytest.mark.parametrize("has_keep", [False, True])
def test_fused_merge_matches_torch_merge(has_keep):
    from ppo_ops.core import row_stats as _row_stats
    merge_partials = tb.merge_partials

    gen = torch.Generator().manual_seed(1)
    n_seg, n_rows = 8, 300  # more rows than one program's block: the row mask at the end of the last block
    p = torch.zeros(n_seg, _row_stats.NUM_PARTIALS, n_rows)
    p[:, _row_stats.MAX] = torch.randn(n_seg, n_rows, generator=gen) * 5
    p[:, _row_stats.SUMEXP] = torch.rand(n_seg, n_rows, generator=gen) * 100 + 1
    p[:, _row_stats.KEPT_SUMEXP] = p[:, _row_stats.SUMEXP] * torch.rand(n_seg, n_rows, generator=gen)
    p[:, _row_stats.ENT_SUM] = -torch.rand(n_seg, n_rows, generator=gen) * 50
    p[:, _row_stats.TARGET_Z] = float("-inf")
    p[3, _row_stats.TARGET_Z] = torch.randn(n_rows, generator=gen)
    p[5, _row_stats.MAX, :10] = float("-inf")  # an empty segment
    p[5, 1:4, :10] = 0.0
    p[:, _row_stats.MAX, 20] = float("-inf")  # a row without mass
    p[:, 1:4, 20] = 0.0
    p[2, _row_stats.MAX, 30] = float("nan")  # bad input must be flagged
    p[2, _row_stats.SUMEXP, 30] = float("nan")

    expected = _row_stats.merge_partials(p, has_keep)
    got = merge_partials(p, has_keep)
    for field in (f.name for f in dataclasses.fields(expected)):
        want, have = getattr(expected, field), getattr(got, field)
        if want is None:
            assert have is None, field
        elif want.dtype == torch.bool:
            assert torch.equal(want, have), field
        else:
            assert torch.allclose(have, want, rtol=MERGE_RTOL, atol=MERGE_RTOL, equal_nan=True), field
    assert bool(got.bad_input[30]) and not bool(got.bad_input[31])
    assert not bool(got.row_has_mass[20]) and bool(got.row_has_mass[21])


# ---------------------------------------------------------------------------------------------------------------------
# compiled kernels on one GPU: Qwen3-size values vs float64, bitwise shard invariance, determinism, T x V > 2^31

on_cuda = pytest.mark.device("cuda")
QWEN3_VOCAB = 151936  # 8 segments of 18992 = 16 * 1187


@on_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("keep", [False, True])
def test_qwen3_rows(dtype, keep):
    inv_t = float(torch.tensor(1 / 0.7, dtype=torch.float32))
    check_once(*make_case(48, QWEN3_VOCAB, dtype=dtype, keep=keep, n_rows_active=40), inv_t=inv_t,
               seg_len=QWEN3_VOCAB // 8, device=DEVICE)


@on_cuda
@pytest.mark.parametrize("n_valid", [QWEN3_VOCAB, QWEN3_VOCAB - 293])  # 293: Qwen3's padding, splits a vector
def test_one_segment_per_rank_and_padding(n_valid):
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(16, QWEN3_VOCAB, dtype=torch.bfloat16, keep=True)
    logits[:, n_valid:] = float("nan")  # never read as vocabulary
    check_once(logits, row_mask, target_col.clamp(max=n_valid - 1), keep_mask, g_lp, g_ent, n_valid=n_valid,
               device=DEVICE)


@on_cuda
def test_online_rescaling_across_small_tiles():
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(8, 4096, keep=True, scale=1.0)
    logits += torch.linspace(-30, 30, 4096)  # the running max grows at every tile
    check_once(logits, row_mask, target_col, keep_mask, g_lp, g_ent, seg_len=2048, device=DEVICE, block_v=256)


@on_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v_global,vocab_size", [(QWEN3_VOCAB, QWEN3_VOCAB - 293), (8000, 7990)])
def test_compiled_shards_give_the_same_bits(dtype, v_global, vocab_size):
    # Each TP rank's forward partials (its fixed segments) and gradient shard equal those of TP=1 bit for bit. 8000:
    # V_local = 1000 at TP=8 is not a multiple of 16 (another vector alignment than at TP=1 unless the kernel pins it).
    logits, row_mask, tokens, keep_mask, g_lp, g_ent = make_case(24, v_global, dtype=dtype, keep=True, n_rows_active=20)
    tokens = tokens.clamp(max=vocab_size - 1)
    stats = [s.float().to(DEVICE) for s in reference_stats(logits, row_mask, tokens, keep_mask, 1.0, vocab_size)]
    logits, row_mask, keep_mask, g_lp, g_ent = (t.to(DEVICE) for t in (logits, row_mask, keep_mask, g_lp, g_ent))
    tokens = tokens.to(DEVICE)
    results = results_per_tp(logits, row_mask, tokens, keep_mask, stats, g_lp, g_ent, vocab_size, v_global // 8)
    for tp in (2, 4, 8):
        assert torch.equal(results[tp][0], results[1][0]), f"partials differ at TP={tp}"
        assert torch.equal(results[tp][1], results[1][1]), f"gradient differs at TP={tp}"


@on_cuda
def test_deterministic_run_to_run():
    logits, row_mask, target_col, keep_mask, g_lp, g_ent = make_case(512, QWEN3_VOCAB, dtype=torch.bfloat16, keep=True)
    args = [t.to(DEVICE) for t in (logits, target_col, keep_mask)]
    first = forward_partials(args[0], None, args[1], args[2], 1.0, QWEN3_VOCAB, QWEN3_VOCAB // 8, True, None)
    for _ in range(3):
        again = forward_partials(args[0], None, args[1], args[2], 1.0, QWEN3_VOCAB, QWEN3_VOCAB // 8, True, None)
        assert torch.equal(again, first)
    stats = [s.float().to(DEVICE) for s in reference_stats(logits, None, target_col, keep_mask, 1.0, QWEN3_VOCAB)]
    grads = []
    for _ in range(2):
        grads.append(torch.empty_like(args[0]))
        backward_grad(args[0], None, args[1], args[2], 1.0, QWEN3_VOCAB, *stats, g_lp.to(DEVICE),
                         g_ent.to(DEVICE), grads[-1], None)
    assert torch.equal(grads[0], grads[1])


@on_cuda
def test_int64_offsets():
    # T x V > 2^31 elements (4.3 GB of bf16): the last rows' offsets overflow int32. Forward over all rows and with a
    # row mask keeping the last two; backward in place (no second 4.3 GB buffer) with only the last two rows kept.
    n_rows = 2**31 // QWEN3_VOCAB + 2
    small, _, target_col, _, g_lp, g_ent = make_case(2, QWEN3_VOCAB, dtype=torch.bfloat16)
    logits = torch.zeros((n_rows, QWEN3_VOCAB), dtype=torch.bfloat16, device=DEVICE)
    logits[-2:] = small.to(DEVICE)
    assert logits.numel() > 2**31
    seg_len = QWEN3_VOCAB // 8
    expected = reference_partials(small, None, target_col, None, 1.0, QWEN3_VOCAB, seg_len, True)
    targets = torch.zeros(n_rows, dtype=torch.int64, device=DEVICE)
    targets[-2:] = target_col.to(DEVICE)
    everything = forward_partials(logits, None, targets, None, 1.0, QWEN3_VOCAB, seg_len, True, None)
    assert_partials_close(everything[:, :, -2:].cpu(), expected)
    row_mask = torch.zeros(n_rows, dtype=torch.bool, device=DEVICE)
    row_mask[-2:] = True
    last = forward_partials(logits, row_mask, targets, None, 1.0, QWEN3_VOCAB, seg_len, True, None)
    assert_partials_close(last[:, :, -2:].cpu(), expected)
    assert torch.equal(last[:, :, :-2], empty_partials(last.shape[0], n_rows - 2, DEVICE))

    def last_two(values):  # [2] per-row values of the small case -> [T], zeros elsewhere (as the core passes them)
        full = torch.zeros(n_rows, dtype=torch.float32, device=DEVICE)
        full[-2:] = values.float().to(DEVICE)
        return full

    stats = [last_two(s) for s in reference_stats(small, None, target_col, None, 1.0, QWEN3_VOCAB)]
    backward_grad(logits, row_mask, targets, None, 1.0, QWEN3_VOCAB, *stats, last_two(g_lp), last_two(g_ent),
                     logits, None)
    stats64 = reference_stats(small, None, target_col, None, 1.0, QWEN3_VOCAB)
    assert_kernel_grad_close(logits[-2:].cpu(), reference_grad(small, None, target_col, None, 1.0, QWEN3_VOCAB, stats64,
                                                        g_lp, g_ent))
    assert int(torch.count_nonzero(logits[:-2])) == 0


# --- the direct launch (core/triton_launch.py): Triton's own kernel, fewer host steps ---------------------------------

def test_launch_key_separates_what_triton_specialises():
    """Calls Triton would compile differently get different keys; calls it runs with one kernel share a key."""
    from ppo_ops.core.triton_launch import specialization_key

    names, constexpr = ("x_ptr", "n", "BLOCK"), (False, False, True)

    def key(x, n, block=64, **options):
        return specialization_key(names, constexpr, dict(x_ptr=x, n=n, BLOCK=block, **options))

    base = torch.empty(64, dtype=torch.bfloat16)
    aligned, other_aligned, misaligned = base[:32], base[8:40], base[1:33]  # 16-byte steps are 8 bf16 elements
    assert key(aligned, 17) == key(other_aligned, 33)  # neither 1 nor a multiple of 16: one kernel for every such n
    assert key(aligned, 17) != key(misaligned, 17)
    assert key(aligned, 17) != key(aligned.float(), 17)
    assert key(aligned, 17) != key(aligned, 32)
    assert key(aligned, 17) != key(aligned, 1)
    assert key(aligned, 17) != key(aligned, 2 ** 31 + 1)  # a 64-bit integer
    assert key(aligned, 17) != key(aligned, 17, block=128)  # a constexpr's value
    assert key(aligned, 17, num_warps=4) != key(aligned, 17, num_warps=8)


def test_launch_key_of_a_tensor_descriptor():
    """A host TMA descriptor is keyed as Triton compiles it: its dtype and block shape (and padding); its base,
    shape and strides are launch arguments, so descriptors of other sizes share a key."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ppo_ops.core.triton_launch import specialization_key

    names, constexpr = ("x_desc", "n"), (False, False)

    def key(t, block):
        return specialization_key(names, constexpr, dict(x_desc=TensorDescriptor.from_tensor(t, block), n=17))

    small, large = torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(256, 128, dtype=torch.bfloat16)
    assert key(small, [16, 32]) == key(large, [16, 32])
    assert key(small, [16, 32]) != key(small, [32, 32])
    assert key(small, [16, 32]) != key(small.half(), [16, 32])


def test_generated_launch_key_is_the_definitions():
    """The straight-line function a Launcher generates from one call's arguments gives, for every later call, the key
    specialization_key defines and the arguments in signature order (an absent one's default): also when an argument
    comes as another kind than the call it was generated from."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ppo_ops.core.triton_launch import key_and_arguments, specialization_key

    names = ("x_ptr", "n", "scale", "flag", "desc", "stride", "BLOCK")
    constexpr = (False, False, False, False, False, False, True)
    defaults = (None, None, None, None, None, 7, None)
    base = torch.empty(4096, dtype=torch.bfloat16)
    example = dict(x_ptr=base[:64], n=17, scale=0.5, flag=True, desc=TensorDescriptor.from_tensor(base.view(64, 64),
                   [16, 32]), BLOCK=64, num_warps=4)
    generated = key_and_arguments(names, constexpr, defaults, example)
    variants = [
        example,
        dict(example, x_ptr=base[1:65]), dict(example, x_ptr=base[4:68]),  # 2- and 8-byte aligned
        dict(example, x_ptr=base[:64].float()),
        dict(example, x_ptr=torch.nn.Parameter(base[:64].float())),  # a tensor subclass
        dict(example, x_ptr=3),  # another kind than the example's
        dict(example, n=1), dict(example, n=24), dict(example, n=32), dict(example, n=2 ** 31 + 1),
        dict(example, n=-2 ** 31 - 1), dict(example, n=True),
        dict(example, n=base[:8]), dict(example, n=None),
        dict(example, scale=2), dict(example, scale=torch.tensor(0.5)),
        dict(example, flag=False), dict(example, flag=None),
        dict(example, desc=TensorDescriptor.from_tensor(base.view(32, 128).half(), [16, 32])),
        dict(example, stride=4096), dict(example, stride=16),
        dict(example, BLOCK=128),
        dict(example, num_warps=8, num_stages=3), dict(reversed(list(dict(example, num_stages=3).items()))),
        {k: v for k, v in example.items() if k not in ("flag", "num_warps")},
        # as many keywords as the example, but another option in place of its one, or of a parameter
        dict({k: v for k, v in example.items() if k != "num_warps"}, num_stages=3),
        dict({k: v for k, v in example.items() if k != "flag"}, num_stages=3),
    ]
    for kwargs in variants:
        want_args = tuple(kwargs[n] if n in kwargs else d for n, d in zip(names, defaults))
        key, args = generated(kwargs)
        assert key == specialization_key(names, constexpr, kwargs), kwargs
        assert len(args) == len(want_args) and all(a is b for a, b in zip(args, want_args)), kwargs
    # The order the options are written in does not make another key; their values do.
    assert generated(dict(example, num_stages=3))[0] == generated(variants[-4])[0]
    assert generated(variants[-5])[0] != generated(dict(example, num_stages=3))[0]


def test_launch_binds_positions_as_a_call_does():
    """Launcher(kernel)(grid, *args, **kwargs) takes arguments as kernel[grid](...) does: positions in signature
    order, then names; too many positions or one argument twice is refused."""
    from ppo_ops.core.triton_launch import bind_arguments

    names = ("a_ptr", "n", "BLOCK")
    assert bind_arguments(names, (1, 2), {"BLOCK": 64}) == {"a_ptr": 1, "n": 2, "BLOCK": 64}
    assert bind_arguments(names, (), {"n": 2, "a_ptr": 1}) == {"a_ptr": 1, "n": 2}
    with pytest.raises(TypeError, match="4 positional arguments for 3 parameters"):
        bind_arguments(names, (1, 2, 3, 4), {})
    with pytest.raises(TypeError, match=r"by position and by name: \['n'\]"):
        bind_arguments(names, (1, 2), {"n": 3})


@on_cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_direct_launch_is_tritons_own(offset):
    """Launcher runs the CompiledKernel `kernel[grid](**kwargs)` picks for the same arguments (misaligned logits: the
    other specialisation), with the same results, on the second call of a key as on the first."""
    from ppo_ops.core.contracts import RowInputs, ShardOptions
    from ppo_ops.core.triton_launch import Launcher
    from ppo_ops.logits import triton_kernels

    seg_len = QWEN3_VOCAB // 8
    base = torch.randn(40, QWEN3_VOCAB + 1, device=DEVICE).to(torch.bfloat16)
    logits = base[:, offset:offset + QWEN3_VOCAB]
    tokens = torch.randint(0, QWEN3_VOCAB, (40,), device=DEVICE)
    shard = ShardOptions(inv_temperature=1.0, n_valid=QWEN3_VOCAB, seg_len=seg_len, vocab_start=0)
    config = tb.launch_config("forward", logits.dtype, seg_len, False)
    outs = [torch.full((8, 5, 40), float("nan"), device=DEVICE) for _ in range(3)]
    launcher = Launcher(triton_kernels.forward_partials_kernel)
    for out in outs[:2]:  # the first call of a key goes through Triton, the second straight to its launcher
        grid, kwargs = tb.forward_launch_args(RowInputs(logits, tokens, None, None), shard, True, out, config)
        launcher(grid, **kwargs)
    grid, kwargs = tb.forward_launch_args(RowInputs(logits, tokens, None, None), shard, True, outs[2], config)
    own = triton_kernels.forward_partials_kernel[grid](**kwargs)
    torch.cuda.synchronize()
    assert list(launcher._compiled.values()) == [own]
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[2])
