"""ppo_ops.hf.token_log_probs on tiny transformers models, against the model's own logits in float64.

The model under test is a seeded tiny Qwen3ForCausalLM (hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16,
intermediate 128, vocabularies 301 and 304, tied and untied embeddings) whose final norm is scaled up so its logits
spread over tens of nats (a near-uniform distribution would hide errors). The reference is the same model copied to
float64: its own logits (model(...).logits), float64 log_softmax, gather, entropy, a loss sum(a * log_prob + b *
entropy) over the positions that count, and autograd into every parameter. Batches: unpadded, left-padded (with
position_ids from the mask, as generation makes them), right-padded, and packed (several sequences per row,
position_ids restarting, no attention_mask). Which positions count is spelled out here from the documented rule, not
taken from the module. Sharded models (FSDP2's fully_shard, FSDP) run on 2 gloo ranks, each on its own batch, against
the mean of the float64 model's gradients over both batches (what the ranks' reduction gives).

The float32 model's body rounds at every layer, so the tolerances against float64 are those of a float32 forward
and backward of the whole model; the fused head itself is held to ppo_ops' own (tighter) tolerances against the
float32 model's own logits. The bf16 run's tolerances come from the bf16 model's own logits' error against float64.
"""

import copy
import os

import pytest
import torch
from torch import nn

import ppo_ops
from ppo_ops.hf import token_log_probs
from tests.ranks import run_gloo
from tests.reference import ENTROPY_TOL, LOG_PROB_TOL

transformers = pytest.importorskip("transformers")

# --- tolerances ---
# The float32 model against its float64 copy: the body's rounding dominates (two layers, sharp logits with
# |log-prob| up to ~20); measured up to 4.2e-7 for both this module and the model's own float32 logits. Relative
# to max(1, |reference|).
BODY_FP32_LOG_PROB_TOL = 2e-6
BODY_FP32_ENTROPY_TOL = 1e-5  # absolute; entropies are O(1) nats, measured up to 3.1e-6 (the model's own: the same)
# Every parameter's gradient, float32 model vs float64: max abs error relative to the parameter's largest float64
# entry; a float32 backward through two layers, measured up to 1.4e-6 (the model's own logits path: 1.2e-6).
BODY_FP32_GRAD_REL_TOL = 1e-5
# bf16 model vs its float64 copy (the same bf16 weights): bf16's 8 significant bits in every layer, forward and
# backward. The model's own bf16 logits measured up to 8.9e-3 (log-prob, relative), 4.1e-2 (entropy, absolute),
# 3.4e-2 (gradient, relative to each parameter's largest entry); this module up to 7.4e-3, 3.7e-2, 3.1e-2 (its
# logits are accumulated in fp32 and never rounded to bf16). About 2.5x the model's own worst.
BF16_LOG_PROB_TOL = 2e-2
BF16_ENTROPY_TOL = 1e-1
BF16_GRAD_REL_TOL = 1e-1
FINAL_NORM_RANGE = (8.0, 24.0)  # final RMSNorm weights: logits of std ~3, log-probs down to ~-40

SEQ = 12
VOCABS = [301, 304]  # odd, and a multiple of 8


def _config(vocab, tied, **extra):
    return transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    tie_word_embeddings=tied, rms_norm_eps=1e-6, **extra)


def _qwen3(vocab=301, tied=True, seed=0, dtype=torch.float32):
    """A seeded tiny Qwen3ForCausalLM with SDPA attention (the float64 copy's eager attention turns a fully padded
    row into NaN)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen3ForCausalLM(_config(vocab, tied, attn_implementation="sdpa"))
        with torch.no_grad():
            model.model.norm.weight.uniform_(*FINAL_NORM_RANGE)
    return model.to(dtype).eval()


def _float64(model):
    copy64 = copy.deepcopy(model).double()
    assert copy64.config.tie_word_embeddings == (copy64.lm_head.weight is copy64.model.embed_tokens.weight)
    return copy64


def _batch(kind, vocab, seed=1):
    """input_ids [3, SEQ] and the model kwargs of one batch kind."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, SEQ), generator=gen)
    if kind == "plain":
        return ids, {}
    if kind == "left_padded":
        mask = torch.ones(3, SEQ, dtype=torch.long)
        mask[0, :4] = 0
        mask[2, :1] = 0
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return ids, {"attention_mask": mask, "position_ids": positions}
    if kind == "right_padded":
        mask = torch.ones(3, SEQ, dtype=torch.long)
        mask[1, 9:] = 0
        mask[2, 5:] = 0
        return ids, {"attention_mask": mask}
    if kind == "packed":
        lengths = [[5, 7], [12], [3, 1, 2, 6]]  # a one-token sequence: nothing of it counts
        positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
        return ids, {"position_ids": positions}
    raise AssertionError(kind)


def _expected_counted(ids, attention_mask=None, position_ids=None, row_mask=None):
    """The documented rule, position by position."""
    batch, seq = ids.shape
    out = torch.zeros(batch, seq, dtype=torch.bool)
    for b in range(batch):
        for i in range(seq - 1):
            ok = True
            if attention_mask is not None:
                ok &= bool(attention_mask[b, i]) and bool(attention_mask[b, i + 1])
            if position_ids is not None:
                pos = position_ids[b if position_ids.shape[0] > 1 else 0]
                ok &= int(pos[i + 1]) == int(pos[i]) + 1
            if row_mask is not None:
                ok &= bool(row_mask[b, i])
            out[b, i] = ok
    return out


def _upstream(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen) + 0.5, torch.rand(shape, generator=gen) * 2 - 1


def _model_log_probs(model, ids, kwargs, counted, temperature=1.0, vocab=None):
    """Log-probs and entropies from the model's own logits, in float64, 0 where a position does not count."""
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits.double()
    if vocab is not None:
        logits = logits[..., :vocab]
    logp = torch.log_softmax(logits / temperature, -1)
    targets = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
    lp = logp.gather(-1, targets[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(counted, lp, 0.0), torch.where(counted, ent, 0.0)


def _grads(model):
    """Every parameter's gradient by name (a tied weight once, under its first name)."""
    return {name: p.grad.detach().double().clone() for name, p in model.named_parameters()}


def _run_reference(model64, ids, kwargs, counted, w_lp, w_ent, temperature=1.0, vocab=None):
    model64.zero_grad(set_to_none=True)
    lp, ent = _model_log_probs(model64, ids, kwargs, counted, temperature, vocab)
    (w_lp.double() * lp + w_ent.double() * ent).sum().backward()
    return lp.detach(), ent.detach(), _grads(model64)


def _assert_values(got_lp, got_ent, ref_lp, ref_ent, counted, lp_tol, ent_tol):
    assert got_lp.dtype == torch.float32 and got_lp.shape == ref_lp.shape
    assert bool((got_lp[~counted] == 0).all()), "positions that do not count must be 0"
    lp_err = (got_lp.double() - ref_lp).abs() / ref_lp.abs().clamp(min=1)
    assert lp_err.max() <= lp_tol, f"log-prob error {lp_err.max():.3e} > {lp_tol:.1e}"
    if got_ent is not None:
        assert got_ent.dtype == torch.float32
        assert bool((got_ent[~counted] == 0).all())
        ent_err = (got_ent.double() - ref_ent).abs().max()
        assert ent_err <= ent_tol, f"entropy error {ent_err:.3e} > {ent_tol:.1e}"


def _grad_errors(got, ref):
    assert got.keys() == ref.keys()
    return {name: float((got[name] - ref[name]).abs().max() / ref[name].abs().max().clamp(min=1e-30)) for name in ref}


def _assert_grads(got, ref, tol):
    errors = _grad_errors(got, ref)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{worst}: gradient error {errors[worst]:.3e} (relative to its max) > {tol:.1e}"


# --- values and gradients against the model's own logits ---

@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("kind", ["plain", "left_padded", "right_padded", "packed"])
def test_values_and_every_gradient(kind, tied, vocab):
    model = _qwen3(vocab, tied)
    model64 = _float64(model)
    ids, kwargs = _batch(kind, vocab)
    counted = _expected_counted(ids, **kwargs)
    w_lp, w_ent = _upstream(ids.shape, 2)

    out = token_log_probs(model, ids, entropy="grad", **kwargs)
    (w_lp * out.log_probs + w_ent * out.entropy).sum().backward()
    ref_lp, ref_ent, ref_grads = _run_reference(model64, ids, kwargs, counted, w_lp, w_ent)

    _assert_values(out.log_probs, out.entropy, ref_lp, ref_ent, counted, BODY_FP32_LOG_PROB_TOL,
                   BODY_FP32_ENTROPY_TOL)
    _assert_grads(_grads(model), ref_grads, BODY_FP32_GRAD_REL_TOL)
    with torch.no_grad():  # the head alone: against the float32 model's own logits, ppo_ops' own tolerances
        own_lp, own_ent = _model_log_probs(model, ids, kwargs, counted)
    _assert_values(out.log_probs.detach(), out.entropy.detach(), own_lp, own_ent, counted, LOG_PROB_TOL,
                   ENTROPY_TOL)


@pytest.mark.parametrize("kind", ["left_padded", "packed"])
def test_bf16_within_bf16_tolerance(kind):
    """The model's dtype end to end: bf16 body, bf16 head weight and gradients, fp32 results."""
    model = _qwen3(304, tied=True, dtype=torch.bfloat16)
    model64 = _float64(model)
    ids, kwargs = _batch(kind, 304)
    counted = _expected_counted(ids, **kwargs)
    w_lp, w_ent = _upstream(ids.shape, 3)

    out = token_log_probs(model, ids, entropy="grad", **kwargs)
    (w_lp * out.log_probs + w_ent * out.entropy).sum().backward()
    ref_lp, ref_ent, ref_grads = _run_reference(model64, ids, kwargs, counted, w_lp, w_ent)

    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    _assert_values(out.log_probs.detach(), out.entropy.detach(), ref_lp, ref_ent, counted, BF16_LOG_PROB_TOL,
                   BF16_ENTROPY_TOL)
    _assert_grads(_grads(model), ref_grads, BF16_GRAD_REL_TOL)


def test_tied_weight_gets_both_gradients():
    """Tied embeddings: the one Parameter's .grad is the head's gradient plus the input embedding's, each checked
    non-negligible against an untied float64 copy that separates them."""
    model = _qwen3(301, tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = _float64(model)
    untied.lm_head.weight = nn.Parameter(untied.model.embed_tokens.weight.detach().clone())
    ids, kwargs = _batch("right_padded", 301)
    counted = _expected_counted(ids, **kwargs)
    w_lp, w_ent = _upstream(ids.shape, 4)

    out = token_log_probs(model, ids, entropy="grad", **kwargs)
    (w_lp * out.log_probs + w_ent * out.entropy).sum().backward()
    _, _, ref = _run_reference(untied, ids, kwargs, counted, w_lp, w_ent)

    head, embed = ref["lm_head.weight"], ref["model.embed_tokens.weight"]
    total = head + embed
    for part in (head, embed):
        assert part.norm() > 0.05 * total.norm()  # each contribution matters: a missing one would fail below
    got = model.model.embed_tokens.weight.grad.double()
    err = float((got - total).abs().max() / total.abs().max())
    assert err <= BODY_FP32_GRAD_REL_TOL, err


def test_packed_rows_equal_their_sequences_alone():
    """A packed row's sequences get the log-probs each has alone; positions whose next token starts another sequence
    (and a one-token sequence's position) are 0."""
    model = _qwen3(301, tied=False)
    ids, kwargs = _batch("packed", 301)
    packed = token_log_probs(model, ids, entropy="value", **kwargs)
    positions = kwargs["position_ids"]
    for b in range(ids.shape[0]):
        starts = [i for i in range(SEQ) if positions[b, i] == 0] + [SEQ]
        for start, end in zip(starts[:-1], starts[1:]):
            alone = token_log_probs(model, ids[b:b + 1, start:end], entropy="value")
            got_lp, got_ent = packed.log_probs[b, start:end], packed.entropy[b, start:end]
            assert got_lp[-1] == 0 and got_ent[-1] == 0  # the next token is the next sequence's first
            err = (got_lp - alone.log_probs[0]).abs() / alone.log_probs[0].abs().clamp(min=1)
            assert err.max() <= BODY_FP32_LOG_PROB_TOL
            assert (got_ent - alone.entropy[0]).abs().max() <= BODY_FP32_ENTROPY_TOL


@pytest.mark.parametrize("entropy", ["none", "value", "grad"])
def test_row_mask_temperature_and_entropy_modes(entropy):
    model = _qwen3(304, tied=False)
    model64 = _float64(model)
    ids, kwargs = _batch("right_padded", 304)
    row_mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(5)) < 0.7
    counted = _expected_counted(ids, row_mask=row_mask, **kwargs)
    w_lp, w_ent = _upstream(ids.shape, 6)
    if entropy != "grad":
        w_ent = torch.zeros_like(w_ent)

    out = token_log_probs(model, ids, temperature=0.7, entropy=entropy, row_mask=row_mask, **kwargs)
    loss = (w_lp * out.log_probs).sum()
    if entropy == "grad":
        loss = loss + (w_ent * out.entropy).sum()
    loss.backward()
    ref_lp, ref_ent, ref_grads = _run_reference(model64, ids, kwargs, counted, w_lp, w_ent, temperature=0.7)

    if entropy == "none":
        assert out.entropy is None
    else:
        assert out.entropy.requires_grad == (entropy == "grad")
    _assert_values(out.log_probs.detach(), None if out.entropy is None else out.entropy.detach(), ref_lp, ref_ent,
                   counted, BODY_FP32_LOG_PROB_TOL, BODY_FP32_ENTROPY_TOL)
    _assert_grads(_grads(model), ref_grads, BODY_FP32_GRAD_REL_TOL)


def test_padded_vocabulary():
    """An output embedding with more rows than config.vocab_size: the extra columns get no probability mass."""
    model = _qwen3(304, tied=True)
    model.config.vocab_size = 300
    model64 = _float64(model)
    ids, kwargs = _batch("plain", 300)
    counted = _expected_counted(ids)
    w_lp, w_ent = _upstream(ids.shape, 7)

    out = token_log_probs(model, ids, entropy="grad")
    (w_lp * out.log_probs + w_ent * out.entropy).sum().backward()
    ref_lp, ref_ent, ref_grads = _run_reference(model64, ids, kwargs, counted, w_lp, w_ent, vocab=300)

    _assert_values(out.log_probs.detach(), out.entropy.detach(), ref_lp, ref_ent, counted, BODY_FP32_LOG_PROB_TOL,
                   BODY_FP32_ENTROPY_TOL)
    _assert_grads(_grads(model), ref_grads, BODY_FP32_GRAD_REL_TOL)
    assert bool((model.lm_head.weight.grad[300:] == 0).all())  # padding rows: no head gradient, never embedded
    # working_memory reaches the general head too (a bad one is its error, naming it)
    with pytest.raises(ValueError, match="linear_log_probs_and_entropy: .*working_memory"):
        token_log_probs(model, ids, entropy="grad", working_memory=-1)


@pytest.mark.parametrize("kind", ["right_padded", "packed"])
def test_token_loss_with_policy_loss(kind):
    """linear_token_loss behind the model: PPO's loss over [B, S] constants aligned with the positions (rows are the
    flattened positions), its value and every parameter's gradient against the same loss on the float64 model's own
    log-probs."""
    model = _qwen3(301, tied=True)
    model64 = _float64(model)
    ids, kwargs = _batch(kind, 301)
    counted = _expected_counted(ids, **kwargs)
    with torch.no_grad():
        lp64, _ = _model_log_probs(model64, ids, kwargs, counted)
    gen = torch.Generator().manual_seed(8)
    # Log-ratios of +-0.05 and +-0.5: both sides of both clips (log 0.8, log 1.28), none within 0.17 of one.
    log_ratio = torch.tensor([0.5, 0.05, -0.05, -0.5])[torch.randint(0, 4, ids.shape, generator=gen)]
    old = (lp64 - log_ratio).float()
    advantages = torch.randn(ids.shape, generator=gen)
    ref_policy = (lp64 + 0.1 * torch.randn(ids.shape, generator=gen, dtype=torch.float64)).float()
    ppo = ppo_ops.policy_loss(old, advantages, clip_low=0.2, clip_high=0.28, entropy_coef=0.01, kl_coef=0.05,
                              ref_log_probs=ref_policy, loss_mask=counted, normalization="token_mean")

    loss, out = token_log_probs(model, ids, entropy="grad", token_loss=ppo, **kwargs)
    loss.backward()
    model64.zero_grad(set_to_none=True)
    ref_lp, ref_ent = _model_log_probs(model64, ids, kwargs, counted)
    ref_loss = ppo.total(ref_lp.float(), ref_ent.float())  # the shipped loss; its gradient flows into float64
    ref_loss.backward()

    assert not out.log_probs.requires_grad and out.entropy is not None
    _assert_values(out.log_probs, out.entropy, ref_lp.detach(), ref_ent.detach(), counted, BODY_FP32_LOG_PROB_TOL,
                   BODY_FP32_ENTROPY_TOL)
    loss, ref_loss = float(loss.detach()), float(ref_loss.detach())
    assert abs(loss - ref_loss) <= BODY_FP32_LOG_PROB_TOL * max(1.0, abs(ref_loss)), (loss, ref_loss)
    _assert_grads(_grads(model), _grads(model64), BODY_FP32_GRAD_REL_TOL)
    # working_memory reaches the token loss (a bad one is its error, naming it)
    with pytest.raises(ValueError, match="linear_token_loss: .*working_memory"):
        token_log_probs(model, ids, entropy="grad", token_loss=ppo, working_memory=-1, **kwargs)


def test_keep_is_passed_to_the_head():
    """A keep set (ids, offsets) over the flattened [B * S] positions reaches the head unchanged: the results equal
    the head's own on the model's last hidden states, bit for bit."""
    model = _qwen3(301, tied=True)
    ids, kwargs = _batch("right_padded", 301)
    counted = _expected_counted(ids, **kwargs)
    per_row = 7
    gen = torch.Generator().manual_seed(9)
    keep_ids = torch.stack([torch.randperm(301, generator=gen)[:per_row].sort().values for _ in range(ids.numel())])
    keep = (keep_ids.reshape(-1), torch.arange(0, ids.numel() * per_row + 1, per_row))

    got = token_log_probs(model, ids, entropy="value", keep=keep, **kwargs)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, use_cache=False, **kwargs).last_hidden_state
    targets = torch.where(counted, torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1), 0)
    want = ppo_ops.linear_log_probs_and_entropy(hidden, model.lm_head.weight.detach(), targets, entropy="value",
                                                row_mask=counted, keep=keep)
    assert torch.equal(got.log_probs.detach(), want.log_probs) and torch.equal(got.entropy, want.entropy)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_body_under_gradient_checkpointing(use_reentrant):
    """A trainer's usual setting (transformers' gradient_checkpointing_enable, training mode): each decoder layer
    runs again in the backward (counted), and values and every gradient are still the float64 model's."""
    model = _qwen3(301, tied=True)
    model64 = _float64(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    # one entry per start of a layer's MLP, inside the checkpointed forward: again in the backward's recompute (a
    # pre-hook: torch's non-reentrant recompute stops as soon as the last tensor it needs is formed)
    runs = []
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda module, args: runs.append(module))
    ids, kwargs = _batch("left_padded", 301)
    counted = _expected_counted(ids, **kwargs)
    w_lp, w_ent = _upstream(ids.shape, 12)

    out = token_log_probs(model, ids, entropy="grad", **kwargs)
    assert len(runs) == len(model.model.layers)
    (w_lp * out.log_probs + w_ent * out.entropy).sum().backward()
    assert len(runs) == 2 * len(model.model.layers), "the layers were not recomputed: checkpointing did not run"
    ref_lp, ref_ent, ref_grads = _run_reference(model64, ids, kwargs, counted, w_lp, w_ent)

    _assert_values(out.log_probs.detach(), out.entropy.detach(), ref_lp, ref_ent, counted, BODY_FP32_LOG_PROB_TOL,
                   BODY_FP32_ENTROPY_TOL)
    _assert_grads(_grads(model), ref_grads, BODY_FP32_GRAD_REL_TOL)


def test_frozen_output_embedding():
    """An output embedding that does not train (requires_grad False, as with adapters on the body): it gets no
    gradient, and every other parameter gets the float64 model's."""
    model = _qwen3(301, tied=False)
    model64 = _float64(model)
    model.lm_head.weight.requires_grad_(False)
    ids, kwargs = _batch("right_padded", 301)
    counted = _expected_counted(ids, **kwargs)
    w_lp, w_ent = _upstream(ids.shape, 13)

    out = token_log_probs(model, ids, entropy="grad", **kwargs)
    (w_lp * out.log_probs + w_ent * out.entropy).sum().backward()
    _, _, ref_grads = _run_reference(model64, ids, kwargs, counted, w_lp, w_ent)

    assert model.lm_head.weight.grad is None
    got = {name: p.grad.detach().double() for name, p in model.named_parameters() if p.requires_grad}
    _assert_grads(got, {name: g for name, g in ref_grads.items() if name != "lm_head.weight"},
                  BODY_FP32_GRAD_REL_TOL)


def test_another_architecture_gemma2_without_softcapping():
    """Not only Qwen3: Gemma 2 (scaled input embeddings, tied head, its own norms) with final_logit_softcapping=None
    is served, and matches its own logits."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = transformers.Gemma2Config(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           final_logit_softcapping=None, attn_implementation="eager")
        model = transformers.Gemma2ForCausalLM(config).eval()
    _assert_served_against_float64(model, upstream_seed=10)


def _assert_served_against_float64(model, upstream_seed):
    """A plain batch through token_log_probs: values and every parameter's gradient against the model's float64
    copy, within the float32 body's tolerances. Returns the ids and the outputs."""
    model64 = _float64(model)
    ids, kwargs = _batch("plain", 301)
    counted = _expected_counted(ids)
    w_lp, w_ent = _upstream(ids.shape, upstream_seed)

    out = token_log_probs(model, ids, entropy="grad")
    (w_lp * out.log_probs + w_ent * out.entropy).sum().backward()
    ref_lp, ref_ent, ref_grads = _run_reference(model64, ids, kwargs, counted, w_lp, w_ent)

    _assert_values(out.log_probs.detach(), out.entropy.detach(), ref_lp, ref_ent, counted, BODY_FP32_LOG_PROB_TOL,
                   BODY_FP32_ENTROPY_TOL)
    _assert_grads(_grads(model), ref_grads, BODY_FP32_GRAD_REL_TOL)
    return ids, out


def test_another_architecture_whose_base_model_is_not_its_prefix():
    """Llama 4's text causal LM keeps its body in `model` while its base_model_prefix names `language_model`, so
    transformers' `base_model` is the causal LM itself: it is served all the same (values and every gradient against
    its float64 copy), and a caller's compiled step, which runs the body itself, finds it there too."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = transformers.Llama4TextConfig(
            vocab_size=301, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=1, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, attn_implementation="eager")
        model = transformers.Llama4ForCausalLM(config).eval()
        with torch.no_grad():
            model.model.norm.weight.uniform_(*FINAL_NORM_RANGE)
    assert model.base_model is model  # what the case is about
    ids, out = _assert_served_against_float64(model, upstream_seed=11)

    compiled = torch.compile(lambda m, i: token_log_probs(m, i, entropy="value", validate=False), backend="eager",
                             fullgraph=True)
    got = compiled(model, ids)
    assert torch.equal(got.log_probs, out.log_probs.detach()) and torch.equal(got.entropy, out.entropy.detach())


def test_compiled_model(monkeypatch):
    """torch.compile(model) is served with its body compiled (the head in place of its output embedding inside the
    compiled forward): values and gradients as the eager model's within float32 rounding of the body, and no
    recompilation on later calls with new batches of the same shape."""
    from torch._dynamo.utils import counters
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # the suite's default turns dynamo off (tests/conftest.py)
    model = _qwen3(301, tied=True)
    compiled = torch.compile(model)
    torch._dynamo.reset()
    counters.clear()
    for seed in (1, 2, 3):
        ids, kwargs = _batch("right_padded", 301, seed=seed)
        w_lp, w_ent = _upstream(ids.shape, seed)
        eager = token_log_probs(model, ids, entropy="grad", **kwargs)
        model.zero_grad(set_to_none=True)
        (w_lp * eager.log_probs + w_ent * eager.entropy).sum().backward()
        want = _grads(model)
        model.zero_grad(set_to_none=True)
        got = token_log_probs(compiled, ids, entropy="grad", **kwargs)
        (w_lp * got.log_probs + w_ent * got.entropy).sum().backward()
        if seed == 1:
            graphs = counters["stats"]["unique_graphs"]
            assert graphs >= 1  # the body did compile
        counted = _expected_counted(ids, **kwargs)
        _assert_values(got.log_probs.detach(), got.entropy.detach(), eager.log_probs.detach().double(),
                       eager.entropy.detach().double(), counted, BODY_FP32_LOG_PROB_TOL, BODY_FP32_ENTROPY_TOL)
        _assert_grads(_grads(model), want, BODY_FP32_GRAD_REL_TOL)
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled on a new batch of the same shape"


# --- a trainer's wrapped model: FSDP2, FSDP, DDP ---

def _shard(model, wrap, world_size):
    """The model sharded over the gloo ranks: "fully_shard" (FSDP2 on each layer, then the root), "head_alone" (the
    same, with the output embedding sharded on its own), "fsdp" (FSDP with each layer wrapped, original parameters),
    or replicated: "ddp" (DistributedDataParallel)."""
    if wrap == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrap == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        layer = type(model.model.layers[0])
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True,
                                        auto_wrap_policy=ModuleWrapPolicy({layer}))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if wrap == "head_alone":
        fully_shard(model.lm_head, mesh=mesh)  # gathered by its own call's hook only
    return fully_shard(model, mesh=mesh)


def _full_grads(model, wrap):
    """Every parameter's gradient after the ranks' reduction, whole, by name."""
    if wrap == "ddp":
        return {name.removeprefix("module."): p.grad.double() for name, p in model.named_parameters()}
    if wrap != "fsdp":
        return {name: p.grad.full_tensor().double() for name, p in model.named_parameters()}
    from torch.distributed.fsdp import FullyShardedDataParallel
    with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
        return {name.replace("_fsdp_wrapped_module.", ""): p.grad.double().clone()
                for name, p in model.named_parameters()}


def _sharded_worker(rank, world_size, wrap, tied, with_loss, padded):
    """One rank of a sharded tiny Qwen3 (the same seeded weights on every rank), each rank on its own batch kind.
    Its values against the float64 model on its batch; every parameter's gradient after the ranks' reduction (the
    mean over ranks) against the mean of the float64 model's gradients over both batches."""
    model = _qwen3(304 if padded else 301, tied)
    vocab = 300 if padded else 301
    model.config.vocab_size = vocab  # padded: 4 rows past the vocabulary, read where the weight is whole
    model64 = _float64(model)
    sharded = _shard(model, wrap, world_size)

    def case(r):
        ids, kwargs = _batch(["right_padded", "packed"][r], vocab, seed=11 + r)
        counted = _expected_counted(ids, **kwargs)
        w_lp, w_ent = _upstream(ids.shape, 20 + r)
        return ids, kwargs, counted, w_lp, w_ent

    def ppo_loss(r, ids, kwargs, counted):
        with torch.no_grad():
            lp64, _ = _model_log_probs(model64, ids, kwargs, counted, vocab=vocab)
        gen = torch.Generator().manual_seed(30 + r)
        log_ratio = torch.tensor([0.5, 0.05, -0.05, -0.5])[torch.randint(0, 4, ids.shape, generator=gen)]
        return ppo_ops.policy_loss((lp64 - log_ratio).float(), torch.randn(ids.shape, generator=gen), clip_low=0.2,
                                   clip_high=0.28, entropy_coef=0.01, loss_mask=counted, normalization="token_mean")

    ids, kwargs, counted, w_lp, w_ent = case(rank)
    if with_loss:
        loss, out = token_log_probs(sharded, ids, entropy="grad", token_loss=ppo_loss(rank, ids, kwargs, counted),
                                    **kwargs)
    else:
        out = token_log_probs(sharded, ids, entropy="grad", **kwargs)
        loss = (w_lp * out.log_probs + w_ent * out.entropy).sum()
    loss.backward()
    got = _full_grads(sharded, wrap)

    want = None
    for r in range(world_size):
        r_ids, r_kwargs, r_counted, r_w_lp, r_w_ent = case(r)
        if with_loss:
            ppo = ppo_loss(r, r_ids, r_kwargs, r_counted)
            model64.zero_grad(set_to_none=True)
            lp, ent = _model_log_probs(model64, r_ids, r_kwargs, r_counted, vocab=vocab)
            ppo.total(lp.float(), ent.float()).backward()
            lp, ent, grads = lp.detach(), ent.detach(), _grads(model64)
        else:
            lp, ent, grads = _run_reference(model64, r_ids, r_kwargs, r_counted, r_w_lp, r_w_ent, vocab=vocab)
        if r == rank:
            _assert_values(out.log_probs.detach(), out.entropy.detach(), lp, ent, counted, BODY_FP32_LOG_PROB_TOL,
                           BODY_FP32_ENTROPY_TOL)
        want = grads if want is None else {name: want[name] + grads[name] for name in grads}
    _assert_grads(got, {name: g / world_size for name, g in want.items()}, BODY_FP32_GRAD_REL_TOL)


# id -> (wrap, tied, with_loss, padded)
SHARDED_CASES = {
    "fully_shard_tied": ("fully_shard", True, False, False),
    "fully_shard_head_alone_padded": ("head_alone", False, False, True),
    "fully_shard_token_loss": ("fully_shard", True, True, False),
    "fsdp_padded": ("fsdp", False, False, True),
    "ddp_token_loss": ("ddp", True, True, False),
}


def _every_sharded_case_worker(rank, world_size, out_dir):
    """Each case of SHARDED_CASES in turn on this rank (one spawn of the two ranks for all of them: a spawn's imports
    cost more than a case), its failure kept by case; saved as rank{rank}.pt."""
    failures = {}
    for name, case in SHARDED_CASES.items():
        try:
            _sharded_worker(rank, world_size, *case)
        except Exception as exc:  # noqa: BLE001 - reported by the case's test with its type
            failures[name] = f"rank {rank}: {type(exc).__name__}: {exc}"
    torch.save(failures, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def sharded_failures(tmp_path_factory):
    """[per rank {case id: failure}] of every case of SHARDED_CASES, run on one pair of gloo ranks."""
    pytest.importorskip("torch.distributed.fsdp", reason="this torch has no torch.distributed.fsdp")
    out_dir = tmp_path_factory.mktemp("hf_sharded")
    run_gloo(2, _every_sharded_case_worker, str(out_dir))
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("case", list(SHARDED_CASES))
def test_sharded_model(sharded_failures, case):
    """A trainer's sharded model: its parameters are whole only inside the model's forward (and the output
    embedding's own call, when that is sharded alone) and are gathered again for the backward; or a replicated one,
    whose wrapper's forward prepares the gradients' all-reduce. Values and every parameter's reduced gradient on 2
    gloo ranks against float64; a padded vocabulary read where the weight is whole (outside the forward a rank holds
    only its shard)."""
    failures = [per_rank[case] for per_rank in sharded_failures if case in per_rank]
    assert not failures, "\n".join(failures)


# --- models it cannot serve ---

_TINY = dict(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


class _ScaledHead(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, hidden):
        return 2.0 * self.linear(hidden)


def _cohere():
    return transformers.CohereForCausalLM(transformers.CohereConfig(**{k: v for k, v in _TINY.items()
                                                                       if k != "head_dim"}))  # logit_scale 0.0625


def _granite():
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(logits_scaling=4.0, **{
        k: v for k, v in _TINY.items() if k != "head_dim"}))


def _qwen3_softcapped():
    model = _qwen3()
    model.config.final_logit_softcapping = 30.0  # a setting of the known list on a model that would not apply it
    return model


def _qwen3_body():
    return _qwen3().model


def _qwen3_scaled_head():
    model = _qwen3(tied=False)
    model.lm_head = _ScaledHead(model.lm_head)
    return model


def _qwen3_float64():
    return _qwen3().double()


def _qwen3_head_with_bias():
    model = _qwen3(tied=False)
    model.lm_head = nn.Linear(64, 301, bias=True)
    return model


@pytest.mark.parametrize("build, error, class_name, says", [
    (_cohere, ValueError, "CohereForCausalLM", "logit_scale=0.0625"),
    (_granite, ValueError, "GraniteForCausalLM", "logits_scaling=4.0"),
    (_qwen3_softcapped, ValueError, "Qwen3ForCausalLM", "final_logit_softcapping=30.0"),
    (_qwen3_body, TypeError, "Qwen3Model", "no base model"),
    (_qwen3_scaled_head, TypeError, "Qwen3ForCausalLM", "_ScaledHead, not an nn.Linear"),
    (_qwen3_head_with_bias, ValueError, "Qwen3ForCausalLM", "has a bias"),
    (_qwen3_float64, TypeError, "Qwen3ForCausalLM", "is in torch.float64"),
], ids=["cohere_logit_scale", "granite_logits_scaling", "config_softcap", "base_model_only",
        "head_not_linear", "head_with_bias", "float64"])
def test_models_it_cannot_serve(build, error, class_name, says):
    """Refused with an error naming the model class and what it does, before the model runs."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build()
    ran = []
    model.register_forward_pre_hook(lambda *_: ran.append(True))
    if getattr(model, "base_model", model) is not model:
        model.base_model.register_forward_pre_hook(lambda *_: ran.append(True))
    with pytest.raises(error) as caught:
        token_log_probs(model, torch.zeros(1, 4, dtype=torch.long))
    message = str(caught.value)
    assert message.startswith("ppo_ops.hf.token_log_probs: ") and class_name in message and says in message, message
    assert not ran


class _ScalesItsLogits(transformers.Qwen3ForCausalLM):
    """A logit transform no config names: the model's forward scales what its head returned."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2.0
        return out


class _BypassesItsHead(transformers.Qwen3ForCausalLM):
    """Logits from the output embedding's weight without calling the output embedding."""

    def forward(self, input_ids=None, **kwargs):
        hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        return transformers.modeling_outputs.CausalLMOutputWithPast(
            logits=nn.functional.linear(hidden, self.lm_head.weight))


class _LastPositionOnly(transformers.Qwen3ForCausalLM):
    """A forward that computes only the last position's logits (generation's logits_to_keep=1)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, logits_to_keep=1, **kwargs)


@pytest.mark.parametrize("cls, error, says", [
    (_ScalesItsLogits, ValueError, "changes what its output embedding returns"),
    (_BypassesItsHead, ValueError, "never called its output embedding"),
    (_LastPositionOnly, ValueError, "hands its output embedding hidden states of shape (2, 1, 64)"),
], ids=["scaled_after_head", "head_not_called", "last_position_only"])
def test_models_refused_by_their_forward(cls, error, says):
    """What no config shows, the model's own forward does: refused with the model class named, and the output
    embedding's own forward back in place afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(_config(301, True, attn_implementation="sdpa")).eval()
    with pytest.raises(error) as caught:
        token_log_probs(model, torch.zeros(2, 5, dtype=torch.long))
    message = str(caught.value)
    assert message.startswith("ppo_ops.hf.token_log_probs: ") and cls.__name__ in message and says in message, message
    assert "forward" not in model.lm_head.__dict__
    assert model(input_ids=torch.zeros(1, 3, dtype=torch.long)).logits.shape[-1] == 301  # its own head again


class _OffloadHook:
    """accelerate's hook protocol (add_hook_to_module: the instance's forward runs pre_forward, the module's own
    forward kept as `_old_forward`, then post_forward), offloading as its device-map dispatch does: outside a call the
    module holds a placeholder weight, pre_forward puts the real one in and post_forward takes it out again."""

    def __init__(self, module, weight):
        self.weight, self.placeholder, self.calls = weight, torch.zeros_like(weight), []
        module.weight = nn.Parameter(self.placeholder, requires_grad=False)

    def pre_forward(self, module, *args, **kwargs):
        self.calls.append("pre")
        module.weight = nn.Parameter(self.weight, requires_grad=False)
        return args, kwargs

    def post_forward(self, module, output):
        self.calls.append("post")
        module.weight = nn.Parameter(self.placeholder, requires_grad=False)
        return output


def _add_hook(module, hook):
    module._hf_hook = hook
    module._old_forward = module.forward

    def new_forward(*args, **kwargs):
        args, kwargs = module._hf_hook.pre_forward(module, *args, **kwargs)
        return module._hf_hook.post_forward(module, module._old_forward(*args, **kwargs))

    module.forward = new_forward


def test_accelerate_style_hook_runs_around_the_head():
    """An output embedding under accelerate's hook (its weight brought in only for its own call) is served through
    the hook, and the hook is back in place afterwards; a forward replaced on the instance by anything else is
    refused before the model runs."""
    model = _qwen3(301, tied=False)
    ids, kwargs = _batch("right_padded", 301)
    counted = _expected_counted(ids, **kwargs)
    with torch.no_grad():
        want_lp, want_ent = _model_log_probs(model, ids, kwargs, counted)
        hook = _OffloadHook(model.lm_head, model.lm_head.weight.detach().clone())
        _add_hook(model.lm_head, hook)
        hooked_forward, own_forward = model.lm_head.forward, model.lm_head._old_forward
        got = token_log_probs(model, ids, entropy="value", **kwargs)
    assert hook.calls == ["pre", "post"]
    assert model.lm_head.forward is hooked_forward and model.lm_head._old_forward is own_forward
    _assert_values(got.log_probs, got.entropy, want_lp, want_ent, counted, LOG_PROB_TOL, ENTROPY_TOL)

    model = _qwen3(301, tied=False)
    model.lm_head.forward = lambda hidden: hidden  # not accelerate's protocol
    with pytest.raises(TypeError, match="Qwen3ForCausalLM's output embedding has a forward of its own instance"):
        token_log_probs(model, ids, **kwargs)


@pytest.mark.parametrize("kwargs, error, says", [
    (dict(input_ids=torch.zeros(2, 5)), TypeError, "input_ids must hold integer token ids"),
    (dict(input_ids=torch.zeros(5, dtype=torch.long)), ValueError, "input_ids must have shape [B, S]"),
    (dict(attention_mask=torch.ones(2, 4)), TypeError, "attention_mask must be a bool or integer tensor"),
    (dict(attention_mask=torch.ones(2, 4, dtype=torch.long)), ValueError, "attention_mask must have input_ids' shape"),
    (dict(row_mask=torch.ones(2, 5, dtype=torch.long)), TypeError, "row_mask must be a bool tensor"),
    (dict(position_ids=torch.zeros(3, 2, 5, dtype=torch.long)), ValueError, "position_ids must have shape [2, 5]"),
    (dict(position_ids=torch.zeros(2, 5)), TypeError, "position_ids must be an integer tensor"),
], ids=["float_ids", "one_dim_ids", "float_mask", "mask_shape", "int_row_mask", "mrope_positions", "float_positions"])
def test_bad_arguments(kwargs, error, says):
    model = _qwen3()
    args = dict(input_ids=torch.zeros(2, 5, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(error, match="^ppo_ops.hf.token_log_probs: ") as caught:
        token_log_probs(model, args.pop("input_ids"), **args)
    assert says in str(caught.value)


@pytest.mark.parametrize("shape", [(2, 4), (2, 6), (5, 2)], ids=["b_s_minus_1", "too_many", "transposed"])
def test_token_loss_constants_must_be_one_per_position(shape):
    """A token loss over [B, S - 1] constants (the natural shifted shape), more than [B, S], or [S, B]: one error
    naming token_loss and the [B, S] positions, before the model runs (no raw IndexError from the constants, no loss
    normalised over tokens that are never scored)."""
    model = _qwen3()
    ids = torch.zeros(2, 5, dtype=torch.long)
    ppo = ppo_ops.policy_loss(torch.zeros(shape), torch.ones(shape))
    calls = []
    model.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(ValueError, match="^ppo_ops.hf.token_log_probs: ") as caught:
        token_log_probs(model, ids, entropy="grad", token_loss=ppo)
    assert caught.value.ppo_ops_argument == "token_loss"
    message = str(caught.value)
    assert f"token_loss was built over constants of shape {shape}" in message and "(2, 5)" in message
    assert "[B, S]" in message and not calls, "raised before the model ran"


@pytest.mark.parametrize("bad, says", [(301, "got values in [0, 301]"), (-1, "got values in [-1, 0]")],
                         ids=["past_vocab", "negative"])
def test_input_ids_outside_the_vocabulary(bad, says):
    """An id past the vocabulary (or negative): one error naming input_ids, the values found and the model's
    vocabulary size, before the embedding's raw IndexError."""
    model = _qwen3(301)
    ids = torch.zeros(2, 5, dtype=torch.long)
    ids[1, 3] = bad
    with pytest.raises(ValueError, match="^ppo_ops.hf.token_log_probs: ") as caught:
        token_log_probs(model, ids)
    assert caught.value.ppo_ops_argument == "input_ids"
    assert "input_ids must be token ids in [0, 301)" in str(caught.value) and says in str(caught.value)
