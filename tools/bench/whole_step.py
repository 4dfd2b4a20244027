"""The whole-step bench provider `qwen3_step`: one RL training step through a random Qwen3-0.6B.

A `Qwen3ForCausalLM` built from Qwen3-0.6B's public config (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim
128, intermediate 3072, vocab 151936, tied embeddings, rope_theta 1e6) with seeded random weights, in the case's dtype.
The timed step is what a trainer does per micro-batch: the model's forward over T tokens, ppo_ops computing the
log-prob of every next token and the entropy (with gradient) from the [T, V] logits, a PPO-style loss
(Σ w * log_prob + 0.01 Σ entropy) / T, and the backward through the model into every parameter's .grad. The
`validate` option of the case goes to ppo_ops, so the two rows (validate on/off) show what the one host sync per call
costs inside a whole step rather than in isolation.

Variants (the provider name; suite lm_head_step, T = 8192 and 32768, all three with gradient checkpointing of the
decoder layers, so the LM head's memory is what stands out):
  qwen3_step_ckpt  the logits path above: the model's [T, V] logits, ppo_ops.log_probs_and_entropy, the loss
  qwen3_step_head  the fused head: the final hidden states and the tied LM-head weight into
                   ppo_ops.linear_log_probs_and_entropy (no [T, V] logits), then the same loss
  qwen3_step_loss  ppo_ops.linear_token_loss with the same loss as a per-token closure: its gradient formed in the
                   head's forward, the logits formed once
The loss is the same in all three, so their gradients agree within the ops' tolerances.

Cases whose V is not the Qwen3 vocabulary get a tiny model of that vocabulary (2 layers, hidden 64): the CPU smoke
path of tests/test_bench_whole_step.py. The forward is not checked against the float64 reference of the case's
random logits (the logits here come from the model); the core suites check the op itself.
"""

from __future__ import annotations

from typing import Optional

import torch

from tools.bench.cases import HEAD_STEP_PROVIDERS, QWEN3_VOCAB, WHOLE_STEP_PROVIDERS, Case
from tools.bench.contract import Closure, Provider, first_import_problem
from tools.bench.inputs import Inputs
from tools.bench.measure import TORCH_DTYPES

MODULES = ("transformers", "ppo_ops")
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, vocab_size=QWEN3_VOCAB, tie_word_embeddings=True,
                  rope_theta=1e6, max_position_embeddings=40960)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, tie_word_embeddings=True, rope_theta=1e6)
ENTROPY_COEF = 0.01  # the entropy bonus of the loss (any non-zero value sends a gradient through the entropy)
MODEL_SEED = 1234  # the random weights: the same model in every run


def model_config(vocab: int, tokens: int):
    from transformers import Qwen3Config

    if vocab == QWEN3_VOCAB:
        fields = dict(QWEN3_0_6B)
    else:
        fields = dict(TINY, vocab_size=vocab, max_position_embeddings=max(64, tokens))
    return Qwen3Config(**fields)


def build_model(case: Case, device: torch.device):
    """The case's random model, in training mode, parameters in the case's dtype on `device`."""
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(MODEL_SEED)
        model = Qwen3ForCausalLM(model_config(case.V, case.T))
    return model.to(device=device, dtype=TORCH_DTYPES[case.dtype]).train()


def build(case: Case, inp: Inputs):
    """prepare() clears the parameters' gradients, step() runs the whole step."""
    import ppo_ops

    model = build_model(case, inp.tokens.device)
    if case.provider in HEAD_STEP_PROVIDERS:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = inp.tokens.reshape(1, -1)  # the sampled tokens, as the model's input
    targets = torch.roll(inp.tokens, -1)  # next-token targets (the last wraps around: a valid id all the same)
    weights = inp.grad_log_prob  # per-token advantages

    def token_loss(log_probs, entropy, rows):  # the loss below, one term per token
        return (weights[rows] * log_probs + ENTROPY_COEF * entropy) / case.T

    def log_probs_and_entropy(validate: bool):
        if case.provider in ("qwen3_step_head", "qwen3_step_loss"):
            hidden = model.model(input_ids=ids).last_hidden_state[0]  # [T, H], after the final norm
            return ppo_ops.linear_log_probs_and_entropy(hidden, model.lm_head.weight, targets, entropy="grad",
                                                        validate=validate)
        logits = model(input_ids=ids).logits[0]  # [T, V] in the model's dtype
        return ppo_ops.log_probs_and_entropy(logits, targets, entropy="grad", validate=validate)

    def prepare():
        model.zero_grad(set_to_none=True)

    def step(_):
        if case.provider == "qwen3_step_loss":
            hidden = model.model(input_ids=ids).last_hidden_state[0]
            loss, _ = ppo_ops.linear_token_loss(hidden, model.lm_head.weight, targets, token_loss, entropy="grad",
                                                validate=case.validate)
        else:
            out = log_probs_and_entropy(case.validate)
            loss = ((weights * out.log_probs).sum() + ENTROPY_COEF * out.entropy.sum()) / case.T
        loss.backward()
        return loss

    def forward():
        with torch.no_grad():
            out = log_probs_and_entropy(case.validate)
        return out.log_probs.float(), out.entropy.float()

    return Closure(prepare=prepare, step=step, forward=forward)


def unsupported(case: Case, device: torch.device) -> Optional[str]:
    if case.tp > 1:
        return "the whole-step case runs one model on one rank"
    if case.entropy != "grad" or case.keep_mask or case.row_frac < 1.0:
        return "the whole-step case trains on log-prob + entropy with grad, no masks"
    return first_import_problem(MODULES)


# Their logits come from a model, not from the case's inputs: no reference check (see the module docstring).
PROVIDERS = tuple(Provider(name, build, unsupported, checked=False, modules=MODULES) for name in WHOLE_STEP_PROVIDERS)
