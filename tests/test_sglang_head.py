"""The fused LM head with reduction_order="sglang" (ppo_ops/lm_head/sglang_head.py, sglang_matmul.py).

- The logits: the Triton kernel's K loop (tiles of 64 in order, fp32, one bf16 rounding) against a torch reference
  of that loop, and the property the head rests on: any rectangle of the logits has the bits of the whole.
- The order's logic: log-probs and entropies bit for bit the logits op's reduction_order="sglang" on the head's own
  bf16 logits (both backends, temperature 1 and 0.7, bf16 and a tied fp32 weight), as the logits op is pinned to its
  scalar statement; values and every gradient against float64 of those logits.
- linear_token_loss on each of its paths (one block, blocks, the recompute; working_memory steers them): the general
  op's log-probs bit for bit, and its dX and dW where the path runs the same GEMMs; every gradient against float64; a
  call without a gradient and one with every row masked.
- TP = 2 and 4 (gloo): log-probs, entropies and dW shards bit for bit TP = 1's, the token loss on each path too; dX
  within fp32 summation.
- Row masks, the named paths, the Megatron processor and ppo_ops.hf passing the option, and the refusals.
- Against SGLang's own matmul and log_softmax on a GPU: tests/test_sglang_head_vs_sglang.py (--config=sglang).
"""

import pytest
import torch

import ppo_ops
import ppo_ops.hf
import ppo_ops.megatron as pm
from ppo_ops.lm_head import paths, sglang_matmul
from tests.core_support import backend_params, triton_skip_reason
from tests.ranks import DEVICE, results_by_tp, run_gloo, world_size_param
from tests.reference import ENTROPY_TOL, LOG_PROB_TOL

V = 2048  # two of SGLang's 1024-column blocks
PADDED_VOCAB = 2000  # the last block ends in padding
V_TP = 6144  # TP = 4: shards of 1536 columns, two of the three boundaries inside SGLang's blocks
PADDED_VOCAB_TP = 6000  # the last rank's shard ends in padding
H = 160  # three K tiles of 64, the last one partial
ROWS = 37  # three of the host's 16-row blocks, the last one partial
TP_SIZES = (1, 2, 4)
# The gradients are formed from bf16 dlogits (rounded, 2^-9 relative) by fp32-accumulated GEMMs and returned in bf16
# (one more rounding); against float64 their norm-relative error stays under one bf16 ulp (measured 2e-3).
BF16_GRAD_REL = 2.0**-7
# Elements of the Triton kernel that may round to the neighbouring bf16 value of a torch reference adding the same
# K tiles: inside a tile the two sum 64 fp32 products in different orders.
K_ORDER_ULPS = 1


def _inputs(seed=0, weight_dtype=torch.bfloat16, rows=ROWS, vocab=V, width=H):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn((rows, width), generator=gen) * 1.5).to(weight_dtype)
    weight = (torch.randn((vocab, width), generator=gen) * width ** -0.5 * 3).to(weight_dtype)
    tokens = torch.randint(0, min(vocab, PADDED_VOCAB), (rows,), generator=gen)
    return hidden.to(DEVICE), weight.to(DEVICE), tokens.to(DEVICE)


# The order's backends here: both on the host; on CUDA the Triton one alone (the torch backend is refused there:
# test_cuda_with_the_torch_backend_is_refused).
ORDER_BACKENDS = [p for p in backend_params(DEVICE) if DEVICE.type != "cuda" or p.values[0] == "triton"]
HOST_OR_GPU_BACKEND = "triton" if DEVICE.type == "cuda" else "torch"


def _logits(hidden, weight, temperature, kind):
    out = torch.empty((hidden.shape[0], weight.shape[0]), dtype=torch.bfloat16, device=hidden.device)
    return sglang_matmul.bf16_logits(hidden.to(torch.bfloat16), weight.to(torch.bfloat16), out,
                                     None if temperature == 1.0 else temperature, kind)


# ---- the logits ----

@pytest.mark.parametrize("backend", backend_params(DEVICE))
def test_kernel_adds_k_tiles_in_order_and_any_rectangle_has_the_bits_of_the_whole(backend):
    hidden, weight, _ = _inputs(seed=1, rows=70, vocab=300)  # 2 x 3 of the interpreter's tiles
    whole = _logits(hidden, weight, 1.0, backend)
    acc = torch.zeros((70, 300), dtype=torch.float32, device=hidden.device)
    for k0 in range(0, H, sglang_matmul.BLOCK_K):
        acc = acc + hidden[:, k0:k0 + 64].float() @ weight[:, k0:k0 + 64].float().t()
    ref = acc.to(torch.bfloat16)
    ulp = (ref.float().abs() * 2.0**-7).clamp_min(torch.finfo(torch.float32).tiny)
    assert ((whole.float() - ref.float()).abs() <= K_ORDER_ULPS * ulp).all()
    part = torch.empty((70, 300), dtype=torch.bfloat16, device=hidden.device)
    sglang_matmul.bf16_logits(hidden[3:69], weight[17:290], part[3:69, 17:290], None, backend)
    if backend == "triton":  # the kernel's bits depend on the K loop only
        assert torch.equal(part[3:69, 17:290], whole[3:69, 17:290])


def test_temperature_divides_as_sglangs_sampler():
    hidden, weight, _ = _inputs(seed=2, rows=8, vocab=64)
    plain = _logits(hidden, weight, 1.0, "torch")
    divisor = torch.full((8, 1), 0.7, dtype=torch.float32, device=plain.device)
    assert torch.equal(_logits(hidden, weight, 0.7, "torch"), plain.bfloat16().div(divisor).bfloat16())


# ---- the order's logic, and float64 ----

@pytest.mark.parametrize("backend", ORDER_BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32_tied"])
def test_log_probs_are_the_logits_ops_on_the_heads_logits(backend, temperature, weight_dtype):
    hidden, weight, tokens = _inputs(seed=3, weight_dtype=weight_dtype)
    out = ppo_ops.linear_log_probs_and_entropy(hidden, weight, tokens, entropy="value", temperature=temperature,
                                               vocab_size=PADDED_VOCAB, backend=backend, reduction_order="sglang")
    want = ppo_ops.log_probs_and_entropy(_logits(hidden, weight, temperature, backend), tokens, entropy="value",
                                         vocab_size=PADDED_VOCAB, backend=backend, reduction_order="sglang")
    assert torch.equal(out.log_probs, want.log_probs)
    assert torch.equal(out.entropy, want.entropy)
    # The logits op at the same temperature on the undivided logits divides as the head does: the same bits.
    undivided = ppo_ops.log_probs_and_entropy(_logits(hidden, weight, 1.0, backend), tokens, entropy="value",
                                              temperature=temperature, vocab_size=PADDED_VOCAB, backend=backend,
                                              reduction_order="sglang")
    assert torch.equal(out.log_probs, undivided.log_probs)
    assert torch.equal(out.entropy, undivided.entropy)


def _float64_reference(hidden, weight, tokens, temperature, g_lp, g_ent, vocab_size, backend):
    """Log-probs, entropies, dX and dW in float64 from the head's own bf16 logits (the logits SGLang forms)."""
    z = _logits(hidden, weight, temperature, backend).double().cpu()[:, :vocab_size].requires_grad_(True)
    log_p = torch.log_softmax(z, dim=-1)
    lp = log_p.gather(1, tokens.cpu()[:, None]).squeeze(1)
    ent = -(log_p.exp() * log_p).sum(-1)
    (dz,) = torch.autograd.grad([lp, ent], z, [g_lp.double().cpu(), g_ent.double().cpu()])
    dlogits = torch.zeros((z.shape[0], weight.shape[0]), dtype=torch.float64)
    dlogits[:, :vocab_size] = dz / temperature
    h16 = hidden.to(torch.bfloat16).double().cpu()
    w16 = weight.to(torch.bfloat16).double().cpu()
    return lp.detach(), ent.detach(), dlogits @ w16, dlogits.t() @ h16


def _rel(got, ref):
    return float((got.double().cpu() - ref).norm() / ref.norm())


@pytest.mark.parametrize("backend", ORDER_BACKENDS)
def test_values_and_gradients_match_float64(backend):
    hidden, weight, tokens = _inputs(seed=4)
    gen = torch.Generator().manual_seed(5)
    g_lp, g_ent = torch.rand(ROWS, generator=gen).to(DEVICE), torch.rand(ROWS, generator=gen).to(DEVICE)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = ppo_ops.linear_log_probs_and_entropy(h, w, tokens, entropy="grad", temperature=0.7,
                                               vocab_size=PADDED_VOCAB, backend=backend, reduction_order="sglang")
    dx, dw = torch.autograd.grad([out.log_probs, out.entropy], [h, w], [g_lp, g_ent])
    lp, ent, ref_dx, ref_dw = _float64_reference(hidden, weight, tokens, 0.7, g_lp, g_ent, PADDED_VOCAB, backend)
    assert ((out.log_probs.double().cpu() - lp).abs() <= LOG_PROB_TOL * lp.abs().clamp_min(1)).all()
    assert ((out.entropy.double().cpu() - ent).abs() <= ENTROPY_TOL).all()
    assert _rel(dx, ref_dx) <= BF16_GRAD_REL
    assert _rel(dw, ref_dw) <= BF16_GRAD_REL
    assert dw[PADDED_VOCAB:].eq(0).all()  # padding columns: no gradient


# The token loss's paths (paths.sglang_path) at the tests' shapes: (path, H, weight dtype, allowance). At H = 160 one
# block of 37 rows (40 for the GEMMs) holds no dW in its logits' storage (that takes 2 H rows) and costs less than
# 16-row blocks beside the fp32 dW accumulator, so the host's default allowance takes it, row-major (dW apart either
# way); at H = 32 the host's one block writes dW into its span-major logits' storage (less than dW beside row-major
# logits); an allowance of exactly one 16-row block (paths.sglang_blocks_bytes) takes the blocks. "blocks": that
# allowance; 0: not even one forward row block, the recompute.
_TOKEN_LOSS_PATHS = {
    "one_block": ("sglang_loss_one_block", H, torch.bfloat16, None),
    "one_block_dw_in_logits": ("sglang_loss_one_block", 32, torch.bfloat16, None),
    "blocks_fp32_tied": ("sglang_loss_blocks", 16, torch.float32, "blocks"),
    "blocks": ("sglang_loss_blocks", 16, torch.bfloat16, "blocks"),
    "recompute_fp32_tied": ("sglang_blocks", H, torch.float32, 0),
}
# Every path under the torch backend (CPU only: CUDA refuses it in SGLang's order); under the Triton kernels
# (interpreted on CPU, slow) one block and the blocks.
_TOKEN_LOSS_CASES = (
    [pytest.param("torch", case, id=f"torch-{case}", marks=pytest.mark.device("cpu"))
     for case in ("one_block", "one_block_dw_in_logits", "blocks_fp32_tied", "recompute_fp32_tied")]
    + [pytest.param("triton", case, id=f"triton-{case}",
                    marks=pytest.mark.skipif(triton_skip_reason(DEVICE) is not None,
                                             reason=triton_skip_reason(DEVICE) or ""))
       for case in ("one_block",)]
    # span-major logits at the host's 16-row forward blocks (on CUDA a 1024-row block makes these shapes row-major)
    + [pytest.param("triton", "one_block_dw_in_logits", id="triton-one_block_dw_in_logits",
                    marks=[pytest.mark.device("cpu"),
                           pytest.mark.skipif(triton_skip_reason(DEVICE) is not None,
                                              reason=triton_skip_reason(DEVICE) or "")])]
    # Blocks of the host's 16-row forward blocks: on CUDA a block is 1024 rows, and the blocks path at that size is
    # checked against SGLang itself up to T = 32768 (test_sglang_head_vs_sglang).
    + [pytest.param("triton", "blocks", id="triton-blocks",
                    marks=[pytest.mark.device("cpu"),
                           pytest.mark.skipif(triton_skip_reason(DEVICE) is not None,
                                              reason=triton_skip_reason(DEVICE) or "")])])
LOSS_BLOCK_ROWS = paths.HOST_SGLANG_BLOCK_ROWS  # the blocks cases' rows per block: three blocks of ROWS


def _allowance(memory, width, vocab=V):
    """A case's working_memory: "blocks" is exactly one LOSS_BLOCK_ROWS-row block's bytes."""
    return paths.sglang_blocks_bytes(LOSS_BLOCK_ROWS, width, vocab // 8) if memory == "blocks" else memory


@pytest.mark.parametrize("backend, case", _TOKEN_LOSS_CASES)
def test_token_loss_paths_against_the_general_op_and_float64(backend, case):
    """Log-probs and entropies bit for bit the general op's on every path; dX and dW too where the path runs the
    backward's GEMMs on the same operands (one block, the recompute); every gradient within bf16 of float64."""
    path, width, weight_dtype, memory = _TOKEN_LOSS_PATHS[case]
    hidden, weight, tokens = _inputs(seed=6, weight_dtype=weight_dtype, width=width)
    advantages = torch.randn(ROWS, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    working_memory = _allowance(memory, width)

    def loss(lp, ent, rows):
        return -advantages[rows] * lp - 0.25 * ent

    opts = dict(entropy="grad", temperature=0.7, vocab_size=PADDED_VOCAB, backend=backend, reduction_order="sglang")
    named = paths.path_of_call(hidden, weight, token_loss=True, backend=backend, vocab_size=PADDED_VOCAB,
                               working_memory=working_memory, reduction_order="sglang")
    assert named.name == path
    if path == "sglang_loss_one_block" and DEVICE.type == "cpu":  # the layout the case names
        row_major = paths.sglang_one_block_row_major(ROWS, width, V // 8, weight.element_size(), hidden.device)
        assert row_major == (case == "one_block")
        assert paths.sglang_dw_in_logits(40, width, weight.element_size()) == (case == "one_block_dw_in_logits")
    if path == "sglang_loss_blocks":
        assert named.block_rows == LOSS_BLOCK_ROWS
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    total, fused = ppo_ops.linear_token_loss(h1, w1, tokens, loss, working_memory=working_memory, **opts)
    total.backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    general = ppo_ops.linear_log_probs_and_entropy(h2, w2, tokens, **opts)
    loss(general.log_probs, general.entropy, torch.arange(ROWS, device=DEVICE)).sum().backward()
    assert torch.equal(fused.log_probs, general.log_probs) and torch.equal(fused.entropy, general.entropy)
    if path != "sglang_loss_blocks":  # blocks: dW's K is a block's rows, its sum split at the blocks
        assert torch.equal(h1.grad, h2.grad)
        assert torch.equal(w1.grad, w2.grad)
    g_ent = torch.full((ROWS,), -0.25, device=DEVICE)
    lp, ent, ref_dx, ref_dw = _float64_reference(hidden, weight, tokens, 0.7, -advantages, g_ent, PADDED_VOCAB,
                                                 backend)
    assert ((fused.log_probs.double().cpu() - lp).abs() <= LOG_PROB_TOL * lp.abs().clamp_min(1)).all()
    assert ((fused.entropy.double().cpu() - ent).abs() <= ENTROPY_TOL).all()
    assert _rel(h1.grad, ref_dx) <= BF16_GRAD_REL
    assert _rel(w1.grad, ref_dw) <= BF16_GRAD_REL
    assert w1.grad.dtype == weight_dtype and w1.grad[PADDED_VOCAB:].eq(0).all()


def test_token_loss_without_a_gradient_and_with_every_row_masked():
    """No gradient wanted: the same loss and log-probs as with one. Every row masked: zero loss, zero gradients."""
    hidden, weight, tokens = _inputs(seed=13, width=16)
    opts = dict(entropy="grad", reduction_order="sglang")

    def loss(lp, ent, rows):
        return -lp - 0.25 * ent

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    total, out = ppo_ops.linear_token_loss(h, w, tokens, loss, **opts)
    with torch.no_grad():
        total_ng, out_ng = ppo_ops.linear_token_loss(hidden, weight, tokens, loss, **opts)
    assert torch.equal(total_ng, total.detach()) and torch.equal(out_ng.log_probs, out.log_probs)
    none = torch.zeros(ROWS, dtype=torch.bool, device=DEVICE)
    total, out = ppo_ops.linear_token_loss(h, w, tokens, loss, row_mask=none, **opts)
    dx, dw = torch.autograd.grad(total, [h, w])
    assert float(total.detach()) == 0.0 and out.log_probs.eq(0).all()
    assert dx.eq(0).all() and dw.eq(0).all() and dw.dtype == weight.dtype


def test_row_mask_drops_rows_and_keeps_the_others_bits():
    hidden, weight, tokens = _inputs(seed=8)
    row_mask = (torch.rand(ROWS, generator=torch.Generator().manual_seed(9)) > 0.4).to(DEVICE)
    h = hidden.clone().requires_grad_(True)
    out = ppo_ops.linear_log_probs_and_entropy(h, weight, tokens, entropy="grad", row_mask=row_mask,
                                               backend=HOST_OR_GPU_BACKEND, reduction_order="sglang")
    (out.log_probs.sum() + out.entropy.sum()).backward()
    alone = ppo_ops.linear_log_probs_and_entropy(hidden[row_mask], weight, tokens[row_mask], entropy="value",
                                                 backend=HOST_OR_GPU_BACKEND, reduction_order="sglang")
    assert torch.equal(out.log_probs[row_mask], alone.log_probs)
    assert torch.equal(out.entropy[row_mask], alone.entropy)
    assert out.log_probs[~row_mask].eq(0).all() and h.grad[~row_mask].eq(0).all()


# ---- TP ----

def _tp_run(rank, world_size, tp_group, device):
    hidden, weight, tokens = _inputs(seed=10, vocab=V_TP)
    v_local = V_TP // world_size
    out = {}
    for backend in ("torch", "triton"):
        if (backend == "triton" and not _triton_runs(device)) or (backend == "torch" and device.type == "cuda"):
            continue  # the torch backend is refused on CUDA in SGLang's order
        h = hidden.to(device).requires_grad_(True)
        w = weight[rank * v_local:(rank + 1) * v_local].to(device).requires_grad_(True)
        res = ppo_ops.linear_log_probs_and_entropy(h, w, tokens.to(device), tp_group=tp_group, entropy="grad",
                                                   temperature=0.7, vocab_size=PADDED_VOCAB_TP, backend=backend,
                                                   reduction_order="sglang")
        g = torch.linspace(0.5, 1.5, ROWS, device=device)
        dx, dw = torch.autograd.grad([res.log_probs, res.entropy], [h, w], [g, g.flip(0)])
        out[backend] = (res.log_probs.detach().cpu(), res.entropy.detach().cpu(), dx.cpu(), dw.cpu())
    # The token loss on each of its paths (its header exchange and end read are its own): the torch backend on the
    # host (Triton on a GPU) and H = 16, to keep the CPU run short; the path is a function of the global vocabulary,
    # the same at every TP size.
    hidden, weight, tokens = _inputs(seed=10, vocab=V_TP, width=16)
    g = torch.linspace(0.5, 1.5, ROWS, device=device)
    for case, memory in (("token_loss_one_block", None), ("token_loss_blocks", "blocks"), ("token_loss_recompute", 0)):
        h = hidden.to(device).requires_grad_(True)
        w = weight[rank * v_local:(rank + 1) * v_local].to(device).requires_grad_(True)
        loss, res = ppo_ops.linear_token_loss(h, w, tokens.to(device),
                                              lambda lp, ent, rows: g[rows] * lp + 0.5 * ent, tp_group=tp_group,
                                              entropy="grad", temperature=0.7, vocab_size=PADDED_VOCAB_TP,
                                              backend="triton" if device.type == "cuda" else "torch",
                                              reduction_order="sglang", working_memory=_allowance(memory, 16, V_TP))
        dx, dw = torch.autograd.grad(loss, [h, w])
        out[case] = (res.log_probs.cpu(), res.entropy.cpu(), dx.cpu(), dw.cpu())
    return out


def _triton_runs(device) -> bool:
    from tests.core_support import triton_skip_reason
    return triton_skip_reason(device) is None


@pytest.fixture(scope="module", name="tp_results")
def tp_results_fixture(tmp_path_factory):
    return results_by_tp(str(tmp_path_factory.mktemp("sglang_head")), _tp_run)


@pytest.mark.parametrize("tp", [world_size_param(tp) for tp in TP_SIZES[1:]])
def test_bitwise_identical_across_tp_sizes(tp_results, tp):
    base = tp_results(1)[0]
    for rank, per_rank in enumerate(tp_results(tp)):
        for backend, (lp, ent, dx, _) in per_rank.items():
            assert torch.equal(lp, base[backend][0]), f"{backend} TP={tp} rank {rank}: log_probs differ from TP=1"
            assert torch.equal(ent, base[backend][1]), f"{backend} TP={tp} rank {rank}: entropy differs from TP=1"
            # dX sums the ranks' fp32 parts in another order, then rounds to bf16 once
            assert _rel(dx, base[backend][2].double()) <= BF16_GRAD_REL
    for backend in base:
        shards = torch.cat([per_rank[backend][3] for per_rank in tp_results(tp)], dim=0)
        assert torch.equal(shards, base[backend][3]), f"{backend} TP={tp}: dW shards differ from TP=1"


# ---- the path, the integrations, the refusals ----

@pytest.mark.device("cpu")  # the host's block sizes; CUDA's are checked against SGLang (test_sglang_head_vs_sglang)
def test_the_path_is_named_and_working_memory_steers_the_token_loss():
    """The general op: sglang_blocks whatever the allowance. The token loss (H = 16: 16-row blocks cost less than one
    block of every row, 32-row blocks more): one block within its bytes (the host's default holds it), blocks below
    them down to one forward row block's, the recompute below that."""
    hidden, weight, _ = _inputs(width=16)

    def named(token_loss=True, working_memory=None):
        return paths.path_of_call(hidden, weight, token_loss=token_loss, working_memory=working_memory,
                                  reduction_order="sglang")
    for working_memory in (None, 0, 2**40):
        general = named(token_loss=False, working_memory=working_memory)
        assert (general.name, general.backend[0]) == ("sglang_blocks", "lm_head_sglang")
    one_block = paths.sglang_one_block_bytes(ROWS, 16, V // 8, 2, hidden.device)
    blocks = paths.sglang_blocks_bytes(LOSS_BLOCK_ROWS, 16, V // 8)
    assert blocks < one_block < paths.sglang_blocks_bytes(2 * LOSS_BLOCK_ROWS, 16, V // 8)
    for working_memory in (None, one_block):
        one = named(working_memory=working_memory)
        assert (one.name, one.block_rows, one.buffer_rows) == ("sglang_loss_one_block", ROWS, 40)
    for working_memory in (one_block - 1, blocks):
        many = named(working_memory=working_memory)
        assert (many.name, many.block_rows, many.buffer_rows) == ("sglang_loss_blocks", LOSS_BLOCK_ROWS,
                                                                  LOSS_BLOCK_ROWS)
    for working_memory in (blocks - 1, 0):
        assert named(working_memory=working_memory).name == "sglang_blocks"


def test_megatron_context_passes_the_order():
    hidden, weight, tokens = _inputs(seed=11, rows=12)
    labels = tokens.view(2, 6)
    context = pm.Context(entropy="value", reduction_order="sglang")
    out = pm.output_processor(hidden_states=hidden.view(2, 6, H).transpose(0, 1), labels=labels, context=context,
                              output_weight=weight)
    want = ppo_ops.linear_log_probs_and_entropy(hidden.view(2, 6, H), weight, labels, entropy="value",
                                                reduction_order="sglang")
    assert torch.equal(out.log_probs, want.log_probs) and torch.equal(out.entropy, want.entropy)


def test_hf_passes_the_order():
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 2048, (2, 9), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        got = ppo_ops.hf.token_log_probs(model, ids, reduction_order="sglang").log_probs
        hidden = model.model(input_ids=ids).last_hidden_state
        z = _logits(hidden.reshape(-1, 64), model.lm_head.weight, 1.0, "torch").view(2, 9, 2048)
        want = ppo_ops.log_probs_and_entropy(z[:, :-1], ids[:, 1:], reduction_order="sglang").log_probs
    assert torch.equal(got[:, :-1], want) and got[:, -1].eq(0).all()


def test_keep_is_refused():
    hidden, weight, tokens = _inputs()
    keep = (torch.tensor([1, 2]), torch.tensor([0] + [2] * ROWS))
    with pytest.raises(ValueError, match="keep must be None with reduction_order='sglang'"):
        ppo_ops.linear_log_probs_and_entropy(hidden, weight, tokens, keep=keep, reduction_order="sglang")


def test_unknown_order_is_refused():
    hidden, weight, tokens = _inputs()
    with pytest.raises(ValueError, match="reduction_order must be one of"):
        ppo_ops.linear_token_loss(hidden, weight, tokens, lambda lp, ent, rows: -lp, reduction_order="sglng")


def test_refused_inside_torch_compile(monkeypatch):
    hidden, weight, tokens = _inputs()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ValueError, match="not available inside torch.compile"):
        ppo_ops.linear_log_probs_and_entropy(hidden, weight, tokens, reduction_order="sglang")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA refusal needs a GPU")
def test_cuda_with_the_torch_backend_is_refused():
    hidden, weight, tokens = _inputs()
    with pytest.raises(ValueError, match="needs backend='triton'"):
        ppo_ops.linear_log_probs_and_entropy(hidden, weight, tokens, backend="torch", reduction_order="sglang")


def _small_shard_rank(rank, world_size):
    hidden, weight, tokens = _inputs(vocab=1024)
    with pytest.raises(ValueError, match="at least 1024 vocabulary columns per tensor-parallel rank"):
        ppo_ops.linear_log_probs_and_entropy(hidden.cpu(), weight[rank * 512:(rank + 1) * 512].cpu(), tokens.cpu(),
                                             tp_group=torch.distributed.group.WORLD, reduction_order="sglang")


def test_shards_under_one_block_are_refused_on_every_rank():
    run_gloo(2, _small_shard_rank)
