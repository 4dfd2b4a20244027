"""The bench's step family (tools/bench/step.py) and the keep set its families share, on the CPU.

CPU timings are meaningless and never asserted. What is checked: the tiny transformers model's step trains every
parameter, the same with validate on and off (validate changes no value), and the Qwen3-0.6B config matches its
public facts; the Megatron step's SDPA core attention against float64, its provider names against their ways, and
the baselines the report sets each way against (the logits path, over the body-only step); the keep set's nucleus
and its dense mask.
"""

import pytest
import torch

from tools.bench import common, step

# fp32 attention on CPU against float64: a softmax over 12 keys and a weighted sum, each within a few fp32 ulps
SDPA_ATOL = 1e-5


def test_whole_step_trains_every_parameter_the_same_with_and_without_validate():
    pytest.importorskip("transformers", reason="the whole-step provider builds its model with transformers")
    grads = {}
    for case in step.SMOKE():
        if not case.provider.startswith("qwen3"):
            continue
        closure = step.build_hf(case, step.make_inputs(case, torch.device("cpu"), seed=0))
        closure.prepare()
        assert torch.isfinite(closure.step(None))
        params = dict(closure.model.named_parameters())
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params.values())
        grads[case.validate] = {name: p.grad.clone() for name, p in params.items()}
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.equal(grads[True][k], grads[False][k]) for k in grads[True])


def test_qwen3_config_matches_its_public_facts():
    pytest.importorskip("transformers", reason="the whole-step provider builds its model with transformers")
    config = step.model_config(common.QWEN3_VOCAB, 8192)
    facts = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960)
    assert {k: getattr(config, k) for k in facts} == facts


def test_mcore_flash_body_attention_is_causal_grouped_attention():
    """SdpaCoreAttention: Megatron's layout in ([S, B, heads, d] queries, [S, B, groups, d] keys and values), [S, B,
    heads * d] out; causal softmax(q k^T / sqrt(d)) v with head h reading query group h // (heads / groups)."""
    gen = torch.Generator().manual_seed(0)
    seq, batch, heads, groups, d = 12, 2, 4, 2, 8
    q = torch.randn(seq, batch, heads, d, generator=gen)
    k = torch.randn(seq, batch, groups, d, generator=gen)
    v = torch.randn(seq, batch, groups, d, generator=gen)
    out = step.SdpaCoreAttention(config=None, layer_number=1, attn_mask_type=None)(q, k, v, None, attn_mask_type=None)
    assert out.shape == (seq, batch, heads * d)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for h in range(heads):
        g = h // (heads // groups)
        scores = torch.einsum("sbd,tbd->bst", q64[:, :, h], k64[:, :, g]) / d ** 0.5
        want = torch.einsum("bst,tbd->sbd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v64[:, :, g])
        torch.testing.assert_close(out[:, :, h * d:(h + 1) * d].double(), want, atol=SDPA_ATOL, rtol=0)


def test_mcore_provider_names_say_their_way_and_baseline():
    local = [step._way(p) for p in step.MCORE_PROVIDERS]
    assert [step._way(p) for p in step.MCORE_FLASH_PROVIDERS] == [(kind, keep, "flash") for kind, keep, _ in local]
    assert [keep for _, keep, _ in local] == [False] * 4 + [True] * 4 + [False] * 5
    assert {c.provider for c in step.SUITES["megatron_step_flash"]()} == set(step.MCORE_FLASH_PROVIDERS)

    def named(provider, **options):
        bases, floor = step.baselines(step.case(provider, **options))
        return [",".join(f"{k}={v}" for k, v in b.items()) for b in bases], floor

    assert named("mcore_loss_spare_flash") == (["provider=mcore_logits_flash"],
                                               dict(provider="mcore_body_flash", validate="on"))
    assert named("mcore_head_keep") == (["provider=mcore_head"], None)
    assert named("mcore_exact_flash") == (["provider=mcore_logits_sglang_flash", "provider=mcore_logits_flash"],
                                          dict(provider="mcore_body_flash", validate="on"))
    assert named("mcore_logits_dense_keep_flash") == (["provider=mcore_logits_flash"], None)
    assert named("mcore_body") == ([], None) and named("mcore_logits") == ([], None)
    assert named("qwen3_step", validate=False) == (["validate=on"], None)
    assert named("qwen3_step_loss") == (["provider=qwen3_step_ckpt"], None)


def test_nucleus_keeps_each_rows_target_and_its_dense_mask_each_ranks_columns():
    targets = torch.tensor([5, 0, 255, 17])
    ids, offsets = common.nucleus(targets, 256, seed=3)
    assert offsets.tolist() == [0, 64, 128, 192, 256]
    assert ids.view(4, common.NUCLEUS)[:, 0].tolist() == targets.tolist()
    full = common.dense_mask((ids, offsets), 4, 256)
    halves = [common.dense_mask((ids, offsets), 4, 128, start) for start in (0, 128)]
    assert torch.equal(torch.cat(halves, dim=1), full)
    for row in range(4):
        assert set(torch.nonzero(full[row])[:, 0].tolist()) == set(ids.view(4, -1)[row].tolist())
