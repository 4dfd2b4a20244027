"""Which path a call of the fused LM head takes (ppo_ops/lm_head/paths.py), and that the path named is the path run.

- `head_path`'s table: each of the eleven paths from the arguments that choose it, with the row counts that size it
  (the host sizes the CPU suite runs: HOST_SHAPE, HOST_HELD_ROWS, HOST_LOSS_BLOCK_ROWS, HOST_TOKEN_LOSS_BYTES; and the
  CUDA sizes at Qwen3-8B's head, where they are documented figures).
- Named is run: for a call of each path on CPU (Triton under TRITON_INTERPRET=1), `path_of_call` names a path and
  spies on every path's own routines (backends, one-GEMM kernels' launchers, the token loss's block loops) record
  which ran: exactly the named path's, with the sizes it names (held rows, block rows).
- The dispatch asks `backend_key`: core/shell.select_backend follows what it returns.
"""

import inspect

import pytest
import torch

import ppo_ops
from ppo_ops.core import shell
from ppo_ops.lm_head import paths
from ppo_ops.lm_head.paths import Path
from tests.core_support import triton_skip_reason

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # head_path is a function of the device's type: no GPU needed to ask it
V, H = 256, 16  # 8 segments of 32 columns; H = 16 bf16 is 32 bytes a row: TMA-aligned
H_UNALIGNED = 12  # 24 bytes a bf16 row: not a multiple of 16, so no one-GEMM kernel takes it
T = 20  # over HOST_HELD_ROWS (16) and one HOST_LOSS_BLOCK_ROWS block (16), within one HOST_SHAPE group (32)
SEG_LEN = V // 8

needs_triton = pytest.mark.skipif(triton_skip_reason("cpu") is not None, reason=triton_skip_reason("cpu") or "")


# ---- the table ----

def _path(**overrides) -> paths.HeadPath:
    args = dict(kind="triton", dtype=torch.bfloat16, device=CPU, token_loss=False, aligned=True, needs_grad=True,
                n_rows=T, width=H, seg_len=SEG_LEN, working_memory=None)
    args.update(overrides)
    return paths.head_path(**args)


def test_general_op_paths_by_kind_dtype_alignment_and_grad():
    host = paths.HOST_SHAPE
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert _path(kind="torch", dtype=dtype).path is Path.TORCH_TILES
    assert _path(dtype=torch.float32).path is Path.FP32_TILES
    assert _path(dtype=torch.float32).backend == ("lm_head", "triton")
    chunk = _path(aligned=False)
    assert (chunk.path, chunk.backend) == (Path.CHUNK_GEMMS, ("lm_head_segments", "triton"))
    assert (chunk.block_rows, chunk.group_rows, chunk.held_rows) == (host.block_rows, host.group_rows, 0)
    assert _path(needs_grad=False).path is Path.ONE_GEMM  # no backward: nothing held
    assert _path(working_memory=0).path is Path.ONE_GEMM  # an allowance of no row
    held = _path(dtype=torch.float16)
    assert (held.path, held.held_rows, held.group_rows) == (Path.ONE_GEMM_HELD, paths.HOST_HELD_ROWS,
                                                            host.group_rows)
    assert _path(n_rows=5).held_rows == 5  # at most the call's rows


def test_token_loss_chunk_blocks_where_no_one_gemm_kernel_applies():
    host = paths.HOST_SHAPE
    for overrides in (dict(kind="torch"), dict(dtype=torch.float32), dict(aligned=False)):
        chunk = _path(token_loss=True, **overrides)
        assert chunk.path is Path.LOSS_CHUNK_BLOCKS, overrides
        assert chunk.backend[0] == "lm_head_segments"
        assert (chunk.block_rows, chunk.group_rows) == (host.loss_block_rows, host.loss_group_rows)


@needs_triton
def test_token_loss_one_block_or_blocks():
    one = _path(token_loss=True)  # 32 rows x 256 columns of fp16 and dW fit HOST_TOKEN_LOSS_BYTES
    assert (one.path, one.block_rows, one.buffer_rows) == (Path.LOSS_ONE_BLOCK, T, 32)
    many = _path(token_loss=True, working_memory=0)
    assert (many.path, many.block_rows, many.buffer_rows) == (Path.LOSS_BLOCKS, paths.HOST_LOSS_BLOCK_ROWS,
                                                              paths.HOST_LOSS_BLOCK_ROWS)
    # needs_grad does not change the token loss's blocks (a values-only call runs the same ones)
    assert _path(token_loss=True, needs_grad=False) == one


@needs_triton
def test_cuda_sizes_at_qwen3_8b_head():
    """The documented figures: 3328 held rows within HELD_BYTES, and the token loss's blocks of 2816 rows within
    TOKEN_LOSS_BYTES where one block (T = 32768) does not fit; T = 8192 is one block."""
    qwen3 = dict(device=CUDA, width=4096, seg_len=151936 // 8)
    held = _path(n_rows=32768, **qwen3)
    assert (held.path, held.held_rows, held.block_rows, held.group_rows) == (Path.ONE_GEMM_HELD, 3328, 1024, 8192)
    assert _path(token_loss=True, n_rows=8192, **qwen3).path is Path.LOSS_ONE_BLOCK
    blocks = _path(token_loss=True, n_rows=32768, **qwen3)
    assert (blocks.path, blocks.block_rows) == (Path.LOSS_BLOCKS, 2816)
    chunk = _path(token_loss=True, aligned=False, n_rows=32768, **qwen3)
    assert (chunk.block_rows, chunk.group_rows) == (1024, 1024)


def test_sglang_paths_and_their_cuda_sizes():
    """reduction_order="sglang": the general op's sglang_blocks whatever the rest; the token loss's one block at
    T = 8192 (H = 1024 and 4096) within TOKEN_LOSS_BYTES, blocks of 8192 / 2048 rows at T = 32768, the recompute where
    not even one 1024-row block fits beside the fp32 dW accumulator (the documented figures)."""
    for overrides in (dict(kind="torch"), dict(dtype=torch.float32), dict(aligned=False), dict(needs_grad=False)):
        general = _path(reduction_order="sglang", **overrides)
        assert (general.path, general.backend[0]) == (Path.SGLANG_BLOCKS, "lm_head_sglang"), overrides
    assert _path(reduction_order="sglang").block_rows == paths.HOST_SGLANG_BLOCK_ROWS
    for width, rows in ((1024, 8192), (4096, 2048)):
        qwen3 = dict(device=CUDA, width=width, seg_len=151936 // 8, token_loss=True, reduction_order="sglang")
        one = _path(n_rows=8192, **qwen3)
        assert (one.path, one.block_rows, one.buffer_rows) == (Path.SGLANG_LOSS_ONE_BLOCK, 8192, 8192)
        blocks = _path(n_rows=32768, **qwen3)
        assert (blocks.path, blocks.block_rows) == (Path.SGLANG_LOSS_BLOCKS, rows)
        assert _path(n_rows=32768, working_memory=2**29, **qwen3).path is Path.SGLANG_BLOCKS
    # dW's element size counts: at T = 6144, H = 4096 a bf16 dW lies in the logits' storage (rows >= 2 H), an fp32 one
    # (a tied fp32 weight) does not (rows < 4 H) and, held apart, takes the call over the allowance
    qwen3 = dict(n_rows=6144, device=CUDA, width=4096, seg_len=151936 // 8, token_loss=True, reduction_order="sglang")
    assert _path(**qwen3).path is Path.SGLANG_LOSS_ONE_BLOCK
    assert _path(weight_dtype=torch.float32, **qwen3).path is Path.SGLANG_LOSS_BLOCKS


# ---- the dispatch follows the path ----

def test_select_backend_follows_backend_key(monkeypatch):
    """shell.select_backend loads whatever paths.backend_key names (through the router ppo_ops/backends.py
    registers): forcing it to the torch tiles moves a token loss's call there."""
    from ppo_ops.lm_head import segment_gemms, torch_backend

    rows = torch.zeros(2, H, dtype=torch.bfloat16)
    assert shell.select_backend("linear_token_loss", "torch", rows, "lm_head", True) is segment_gemms.backend("torch")
    asked = []

    def forced(kind, dtype, token_loss, reduction_order):
        asked.append((kind, dtype, token_loss, reduction_order))
        return ("lm_head", "torch")
    monkeypatch.setattr(paths, "backend_key", forced)
    assert shell.select_backend("linear_token_loss", "torch", rows, "lm_head", True) is torch_backend.BACKEND
    assert asked == [("torch", torch.bfloat16, True, "fused")]


# ---- named is run ----

def _spies(monkeypatch):
    """{routine name: [calls]} with a spy on every path's own routines, each calling through."""
    from ppo_ops.lm_head import segment_gemms, token_loss_blocks, torch_backend

    from ppo_ops.lm_head import sglang_head

    routines = {"torch_tiles.backward": (torch_backend.TorchLinearBackend, "backward"),
                "sglang_recompute": (sglang_head.SglangHeadBackend, "grads"),
                "sglang_one_block": (sglang_head.SglangHeadBackend, "_one_block"),
                "sglang_loss_blocks": (sglang_head.SglangHeadBackend, "_blocks"),
                "chunk_forward": (segment_gemms.SegmentGemmBackend, "_chunk_forward"),
                "loss_prob_blocks": (token_loss_blocks, "_blocks_by_probs"),
                "loss_chunk_blocks": (token_loss_blocks, "_blocks_by_chunks")}
    if triton_skip_reason("cpu") is None:
        from ppo_ops.lm_head import gemm_dlogits, gemm_partials, prob_dlogits, triton_backend
        routines.update({"fp32_tiles.backward": (triton_backend.TritonLinearBackend, "backward"),
                         "chunk_dlogits_pass": (segment_gemms._TritonPasses, "dlogits"),
                         "one_gemm_forward": (gemm_partials, "forward_partials"),
                         "one_gemm_forward_probs": (gemm_partials, "forward_probs"),
                         "one_gemm_recompute": (gemm_dlogits, "dlogits"),
                         "prob_dlogits": (prob_dlogits, "dlogits")})
    calls = {name: [] for name in routines}
    for name, (owner, attr) in routines.items():
        real = getattr(owner, attr)
        static = isinstance(inspect.getattr_static(owner, attr), staticmethod)

        def spy(*args, _real=real, _calls=calls[name], **kwargs):
            _calls.append(args)
            return _real(*args, **kwargs)
        monkeypatch.setattr(owner, attr, staticmethod(spy) if static else spy)
    return calls


def _inputs(dtype, width=H, seed=0, vocab=V, rows=T):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn((rows, width), generator=gen).to(dtype).requires_grad_(True)
    weight = (torch.randn((vocab, width), generator=gen) * 0.5).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    return hidden, weight, tokens


def _run_general(hidden, weight, tokens, grad: bool, **opts):
    if not grad:
        with torch.no_grad():
            ppo_ops.linear_log_probs_and_entropy(hidden, weight, tokens, entropy="grad", **opts)
        return
    out = ppo_ops.linear_log_probs_and_entropy(hidden, weight, tokens, entropy="grad", **opts)
    torch.autograd.grad((out.log_probs.sum() + out.entropy.sum()), (hidden, weight))


def _loss(hidden, weight, tokens, **opts):
    loss, _ = ppo_ops.linear_token_loss(hidden, weight, tokens, lambda lp, ent, rows: lp + 0.5 * ent, entropy="grad",
                                        **opts)
    return loss


# path -> (call, the routines it runs; every other spied routine must not run)
_GENERAL = [
    pytest.param(Path.TORCH_TILES, dict(backend="torch", dtype=torch.bfloat16), {"torch_tiles.backward"},
                 id="torch_tiles"),
    pytest.param(Path.FP32_TILES, dict(backend="triton", dtype=torch.float32), {"fp32_tiles.backward"},
                 id="fp32_tiles", marks=needs_triton),
    pytest.param(Path.CHUNK_GEMMS, dict(backend="triton", dtype=torch.bfloat16, width=H_UNALIGNED),
                 {"chunk_forward", "chunk_dlogits_pass"}, id="chunk_gemms", marks=needs_triton),
    pytest.param(Path.ONE_GEMM, dict(backend="triton", dtype=torch.bfloat16, grad=False), {"one_gemm_forward"},
                 id="one_gemm_no_grad", marks=needs_triton),
    pytest.param(Path.ONE_GEMM, dict(backend="triton", dtype=torch.bfloat16, working_memory=0),
                 {"one_gemm_forward", "one_gemm_recompute"}, id="one_gemm_nothing_held", marks=needs_triton),
    # 16 held rows from their probabilities, the other 4 through the plain forward and the fused recompute
    pytest.param(Path.ONE_GEMM_HELD, dict(backend="triton", dtype=torch.bfloat16),
                 {"one_gemm_forward_probs", "one_gemm_forward", "prob_dlogits", "one_gemm_recompute"},
                 id="one_gemm_held", marks=needs_triton),
    pytest.param(Path.SGLANG_BLOCKS, dict(backend="torch", dtype=torch.bfloat16, reduction_order="sglang"),
                 {"sglang_recompute"}, id="sglang_blocks"),
]
V_SGLANG = 1024  # SGLang's order takes shards of at least one of its 1024-column blocks
T_SGLANG = 40  # the exact token loss's blocks cost less than one block of every row only from about 2 H rows
# The exact token loss at T_SGLANG, H = 16, V_SGLANG: one block within the host's default allowance; an allowance of
# exactly one HOST_SGLANG_BLOCK_ROWS-row block (less than one block of every row) takes the blocks; 0 the recompute.
SGLANG_BLOCKS_BYTES = paths.sglang_blocks_bytes(paths.HOST_SGLANG_BLOCK_ROWS, H, V_SGLANG // 8)


@pytest.mark.parametrize("expected, case, ran", _GENERAL)
def test_general_op_runs_the_path_it_names(expected, case, ran, monkeypatch):
    case = dict(case)
    dtype, width, grad = case.pop("dtype"), case.pop("width", H), case.pop("grad", True)
    hidden, weight, tokens = _inputs(dtype, width, vocab=V_SGLANG if "reduction_order" in case else V)
    with torch.set_grad_enabled(grad):
        named = paths.path_of_call(hidden, weight, **case)
    assert named.path is expected
    calls = _spies(monkeypatch)
    _run_general(hidden, weight, tokens, grad, **case)
    assert {name for name, c in calls.items() if c} == ran
    if expected is Path.ONE_GEMM_HELD:  # the forward held exactly the rows the path names
        (probs_call,) = calls["one_gemm_forward_probs"]
        assert probs_call[0].shape[0] == named.held_rows == paths.HOST_HELD_ROWS
    if expected is Path.CHUNK_GEMMS:  # its chunks of the rows the path names
        assert calls["chunk_forward"][0][-1] == named.block_rows


_LOSS = [
    pytest.param(Path.LOSS_CHUNK_BLOCKS, dict(backend="torch", dtype=torch.bfloat16), {"loss_chunk_blocks"},
                 id="loss_chunk_blocks_torch"),
    pytest.param(Path.LOSS_CHUNK_BLOCKS, dict(backend="triton", dtype=torch.float32),
                 {"loss_chunk_blocks", "chunk_dlogits_pass"}, id="loss_chunk_blocks_triton", marks=needs_triton),
    pytest.param(Path.LOSS_ONE_BLOCK, dict(backend="triton", dtype=torch.bfloat16),
                 {"loss_prob_blocks", "one_gemm_forward_probs", "prob_dlogits"}, id="loss_one_block",
                 marks=needs_triton),
    pytest.param(Path.LOSS_BLOCKS, dict(backend="triton", dtype=torch.bfloat16, working_memory=0),
                 {"loss_prob_blocks", "one_gemm_forward_probs", "prob_dlogits"}, id="loss_blocks",
                 marks=needs_triton),
    pytest.param(Path.SGLANG_LOSS_ONE_BLOCK, dict(backend="torch", dtype=torch.bfloat16, reduction_order="sglang"),
                 {"sglang_one_block"}, id="sglang_loss_one_block"),
    pytest.param(Path.SGLANG_LOSS_BLOCKS, dict(backend="torch", dtype=torch.bfloat16, reduction_order="sglang",
                                               working_memory=SGLANG_BLOCKS_BYTES),
                 {"sglang_loss_blocks"}, id="sglang_loss_blocks"),
    pytest.param(Path.SGLANG_BLOCKS, dict(backend="torch", dtype=torch.bfloat16, reduction_order="sglang",
                                          working_memory=0),
                 {"sglang_recompute"}, id="sglang_loss_recompute"),
]


@pytest.mark.parametrize("expected, case, ran", _LOSS)
def test_token_loss_runs_the_path_it_names(expected, case, ran, monkeypatch):
    case = dict(case)
    dtype = case.pop("dtype")
    sglang = "reduction_order" in case
    hidden, weight, tokens = _inputs(dtype, seed=1, vocab=V_SGLANG if sglang else V, rows=T_SGLANG if sglang else T)
    named = paths.path_of_call(hidden, weight, token_loss=True, **case)
    assert named.path is expected
    calls = _spies(monkeypatch)
    loss = _loss(hidden, weight, tokens, **case)
    dw_saved = loss.grad_fn.saved_tensors[1]  # dW as the forward formed it
    torch.autograd.grad(loss, (hidden, weight))
    assert {name for name, c in calls.items() if c} == ran
    if expected in paths.PROB_PATHS:  # one forward per block of the rows the path names
        blocks = calls["one_gemm_forward_probs"]
        assert len(blocks) == -(-T // named.block_rows), [b[0].shape[0] for b in blocks]
        assert all(b[0].shape[0] <= named.block_rows for b in blocks)
        # dW finished in the input dtype in the forward on one block; its fp32 accumulator on several
        assert dw_saved.dtype == (dtype if expected is Path.LOSS_ONE_BLOCK else torch.float32)
    if expected in paths.SGLANG_PATHS:
        # dW finished in the weight's dtype in the forward (one block, the recompute); its fp32 accumulator (blocks)
        assert dw_saved.dtype == (torch.float32 if expected is Path.SGLANG_LOSS_BLOCKS else dtype)
        if expected is Path.SGLANG_LOSS_BLOCKS:  # the blocks of the rows the path names
            (call,) = calls["sglang_loss_blocks"]
            assert call[3] == named.block_rows == paths.HOST_SGLANG_BLOCK_ROWS


def test_path_of_call_counts_the_kept_rows():
    hidden, weight, _ = _inputs(torch.bfloat16)
    row_mask = torch.arange(T) % 2 == 0
    if triton_skip_reason("cpu") is None:
        named = paths.path_of_call(hidden, weight, backend="triton", row_mask=row_mask)
        assert (named.path, named.held_rows) == (Path.ONE_GEMM_HELD, T // 2)
    assert paths.path_of_call(hidden, weight, backend="auto").path is Path.TORCH_TILES  # auto on CPU: torch
    with torch.no_grad():
        assert paths.path_of_call(hidden, weight, backend="torch", token_loss=True).path is Path.LOSS_CHUNK_BLOCKS
