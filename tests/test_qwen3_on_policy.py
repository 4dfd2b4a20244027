"""The trainer's SGLang on-policy Qwen3 forward (sglang_checks/on_policy.py).

CPU: the stand-in kernels' forward in fp32 against transformers' Qwen3ForCausalLM on the generated `tiny` model
(the math), the bf16 / fp32 mixed forward's dtypes and recorded names against what SGLang's tensor dumper writes, and
its distance from the fp32 model. SGLang's kernels against the stand-ins: tests/test_sglang_kernels.py (under SGLang's
interpreter, the SGLang runner configuration).
"""


import pytest
import torch

from sglang_checks import models, on_policy

pytestmark = pytest.mark.device("cpu")

# fp32 forward vs transformers' fp32 forward: the same ops but separate q/k/v and gate/up GEMMs (transformers) vs
# fused ones, and a varlen batch vs padded rows; the GEMMs round differently (measured max 6e-6 on logits of up to
# ~20, the final norm scale being 28), so ~10x that.
FP32_LOGITS_ATOL = 5e-5
# The bf16 / fp32 mixed forward vs the fp32 model, mean |d log-prob| over the vocabulary: bf16 activations into every
# GEMM give 0.03 on `tiny` (max 0.15). A sanity bound against wrong wiring (weights, layer order), not a test of the
# casts: one wrong cast moves the log-probs by about as much as bf16 rounding does. The casts are held by the dtype
# asserts, and exactness by layer_diff against the engine's dump on the GPU.
BF16_MEAN_LOGPROB_ATOL = 0.1

LENGTHS = [7, 12, 3]  # sequences of different lengths in one flattened batch (one shorter than the rest)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    info = models.resolve_model("tiny", cache_dir=str(tmp_path_factory.mktemp("cache")), seed=0, log=lambda m: None)
    return models.load_hf_model(info, dtype=torch.float32, device=torch.device("cpu"))


def _padded_ids(vocab):
    gen = torch.Generator().manual_seed(3)
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.int64)
    for b, n in enumerate(LENGTHS):
        ids[b, :n] = torch.randint(0, vocab, (n,), generator=gen)
    return ids


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_fp32_forward_matches_transformers(tiny):
    ids = _padded_ids(tiny.config.vocab_size)
    hidden, head, logits = on_policy.model_outputs(tiny, ids, LENGTHS, activation_dtype=torch.float32)
    reference = _hf_logits(tiny, ids)
    assert hidden.dtype == torch.float32 and logits.dtype == torch.float32
    assert torch.equal(head, tiny.lm_head.weight)  # `tiny` unties its head
    for b, n in enumerate(LENGTHS):  # padding is causal-invisible: compare the real rows only
        torch.testing.assert_close(logits[b, :n], reference[b, :n], atol=FP32_LOGITS_ATOL, rtol=0)
        assert not logits[b, n:].any()


def _expected_names(num_layers):
    names = ["model.embed_tokens"]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names += [p + n for n in ("input_layernorm", "self_attn.qkv_proj", "self_attn.q_norm", "self_attn.k_norm",
                                  "self_attn.rotary_emb", "self_attn.attn", "self_attn.o_proj",
                                  "post_attention_layernorm", "mlp.gate_up_proj", "mlp.act_fn", "mlp.down_proj")]
    return names + ["model.norm"]


def test_on_policy_forward_records_sglangs_names_dtypes_and_shapes(tiny):
    config = tiny.config
    ids = _padded_ids(config.vocab_size)
    record = {}
    hidden, head, logits = on_policy.model_outputs(tiny, ids, LENGTHS, record=record)
    tokens, heads, kv_heads, dim = sum(LENGTHS), config.num_attention_heads, config.num_key_value_heads, 16
    assert list(record) == _expected_names(config.num_hidden_layers)  # forward order, SGLang's dumper names
    fp32, bf16 = torch.float32, torch.bfloat16
    assert record["model.embed_tokens"].dtype == fp32  # params_dtype fp32 under rl_on_policy_target
    assert record["model.layers.0.input_layernorm"].dtype == fp32  # layer 0: no residual yet, one tensor
    out, residual = record["model.layers.1.input_layernorm"]  # later layers: (output, fp32 residual)
    assert out.dtype == residual.dtype == fp32
    layer = "model.layers.0."
    assert record[layer + "self_attn.qkv_proj"].dtype == bf16
    assert record[layer + "self_attn.q_norm"].shape == (tokens * heads, dim)
    assert record[layer + "self_attn.q_norm"].dtype == fp32  # fp32 weight * bf16 x promotes to fp32
    assert record[layer + "self_attn.k_norm"].shape == (tokens * kv_heads, dim)
    q, k = record[layer + "self_attn.rotary_emb"]
    assert q.shape == (tokens, heads * dim) and k.shape == (tokens, kv_heads * dim) and q.dtype == fp32
    assert record[layer + "self_attn.attn"].dtype == bf16
    for name in ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.act_fn", "mlp.down_proj"):
        assert record[layer + name].dtype == bf16, name
    final, final_residual = record["model.norm"]
    assert final.dtype == final_residual.dtype == fp32
    assert hidden.dtype == fp32 and logits.dtype == bf16 and head.dtype == bf16
    flat = torch.cat([hidden[b, :n] for b, n in enumerate(LENGTHS)])
    assert torch.equal(flat, final)  # the returned hidden states are the final norm's output

    reference = _hf_logits(tiny, ids).log_softmax(-1)
    for b, n in enumerate(LENGTHS):
        gap = (logits[b, :n].float().log_softmax(-1) - reference[b, :n]).abs().mean()
        assert gap < BF16_MEAN_LOGPROB_ATOL, (b, gap)


def test_rms_norm_mirrors_sglangs_forward_native():
    """The fused residual path keeps an fp32 residual; cast_x_before_out_mul multiplies after the cast."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=gen).bfloat16()
    residual = torch.randn(5, 8, generator=gen)
    weight = torch.randn(8, generator=gen)
    out, new_residual = on_policy.rms_norm(x, weight, 1e-6, residual, override_orig_dtype=torch.float32,
                                           fp32_residual=True)
    summed = x.float() + residual
    assert torch.equal(new_residual, summed)
    expected = weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(out, expected)
    plain = on_policy.rms_norm(x, weight, 1e-6)  # q_norm / k_norm: orig dtype bf16, fp32 weight promotes
    xf = x.float()
    assert plain.dtype == torch.float32
    assert torch.equal(plain, weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16())
