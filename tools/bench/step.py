"""The whole RL step's family: one training step through a model that calls ppo_ops (T tokens, bf16, TP = 1).

Suites:
  whole_step     a random Qwen3-0.6B (transformers' Qwen3ForCausalLM from its public config: hidden 1024, 28
                 layers, 16 heads, 8 KV heads, head_dim 128, FFN 3072, tied embeddings) at T = 8192, the logits path,
                 validate on and off: what the op's one host read costs in a whole step
  lm_head_step   the same model with gradient checkpointing at T = 8192 and 32768: the logits path
                 (qwen3_step_ckpt), the fused head (qwen3_step_head: final hidden states and the tied weight into
                 linear_log_probs_and_entropy) and linear_token_loss (qwen3_step_loss)
  megatron_step  a megatron-core GPTModel of Qwen3-0.6B's shape (RMSNorm, QK norm, SwiGLU, rotary base 1e6, tied
                 embeddings, bf16 parameters, full recompute of every layer, local spec) at T = 8192 and 32768, one
                 packed sequence, each way to the loss below (megatron-core >= 0.18, CUDA)
  megatron_step_flash  the same ways (providers ending in _flash) on a body whose core attention is torch's causal
                 SDPA (flash on an H200): no [S, S] scores, which set the local body's peak and do not fit one H200
                 at T = 32768

The step: the model's forward, the log-prob of every next token and its entropy (with gradient), the loss and the
backward into every parameter's .grad. The transformers model's loss is (sum w log_prob + 0.01 sum entropy) / T (w
the per-token advantages); the Megatron model's ppo_ops.policy_loss (DAPO's clip range, entropy bonus, k3 KL, token
mean). The Megatron ways (mcore_<way>[_flash]):
  body           a trivial output processor of the hidden states alone: the body's own time and peak (the floor)
  logits         Megatron's output layer ([B, S, V] bf16 logits), then ppo_ops.log_probs_and_entropy
  head           GPTModel.forward(..., output_processor=ppo_ops.megatron.output_processor): the fused head
  loss           the same with Context(token_loss=...): linear_token_loss; loss_lean: with working_memory=0;
                 loss_spare: with SPARE_WORKING_MEMORY (4096-row blocks at this head)
  head_spare     the fused head holding rows' probabilities within head_spare_memory(T)
  logits_sglang  the sglang-order logits path: an output processor forms bf16 [T, V] logits with SGLang's
                 batch-invariant matmul (ppo_ops' reproduction, lm_head/sglang_matmul.py; cuBLAS GEMMs back), then
                 log_probs_and_entropy(reduction_order="sglang"): a trainer exact with SGLang without the fused head
  exact          Context(token_loss=..., reduction_order="sglang"): the token loss bit for bit on SGLang's log-probs
  logits_dense_keep / logits_sparse_keep / head_keep / loss_keep  with a 64-id nucleus per row (the target among
                 them): the dense [T, V] keep_mask built in the step, or the sparse keep set

Cases whose V is not Qwen3's get a tiny transformers model of that vocabulary (2 layers, hidden 64): the CPU smoke.
Not checked against a float64 reference: the logits come from the model (the other families check the ops).
"""

from __future__ import annotations

import datetime
import inspect
import os
from typing import Optional

import torch

from ppo_ops.runtime import ranks
from tools.bench.common import (QWEN3_VOCAB, Case, Closure, Provider, dense_mask, first_import_problem, keep_missing,
                                nucleus, registry)
from tools.bench.measure import TORCH_DTYPES

NAME = "step"
TIMES_STEADY = False  # a step is hundreds of ms: the per-step events are the measure
HF_PROVIDERS = ("qwen3_step", "qwen3_step_ckpt", "qwen3_step_head", "qwen3_step_loss")
MCORE_WAYS = ("body", "logits", "head", "loss", "logits_dense_keep", "logits_sparse_keep", "head_keep", "loss_keep",
              "loss_lean", "loss_spare", "head_spare", "logits_sglang", "exact")
MCORE_PROVIDERS = tuple(f"mcore_{w}" for w in MCORE_WAYS)
MCORE_FLASH_PROVIDERS = tuple(f"{p}_flash" for p in MCORE_PROVIDERS)
MODEL_SEED = 1234  # the random weights: the same model in every run
ENTROPY_COEF = 0.01  # the transformers step's entropy bonus
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, vocab_size=QWEN3_VOCAB, tie_word_embeddings=True,
                  rope_theta=1e6, max_position_embeddings=40960)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, tie_word_embeddings=True, rope_theta=1e6)
MAX_TOKENS = 32768  # the Megatron model's max_sequence_length
MCORE_QWEN3_0_6B = dict(num_layers=28, hidden_size=1024, num_attention_heads=16, num_query_groups=8, kv_channels=128,
                        ffn_hidden_size=3072)
ROTARY_BASE = 1_000_000

# The spare way's allowance: at H = 1024, V = 151936 the fp32 dW accumulator takes 0.58 GiB of it and each block row
# 2 V bytes, so 1.75 GiB gives 4096-row blocks (ppo_ops.lm_head.paths.loss_block_rows), which keeps the step's peak
# over the flash body's within a quarter of the logits path's extra at T = 8192 (docs/performance.md)
SPARE_WORKING_MEMORY = 7 * 2**28
# The general head's: bytes of fp16 probabilities (2 V a row) held across the loss, per T, chosen so the step's peak
# stays within a quarter of the logits path's extra over the flash body (0.915 GiB at T = 8192, 4.03 at 32768); part
# of them lies under the body's own backward peak (docs/performance.md). Other T: SPARE_WORKING_MEMORY.
HEAD_SPARE_MEMORY = {8192: 5 * 2**28, 32768: 5 * 2**30}


def head_spare_memory(tokens: int) -> int:
    return HEAD_SPARE_MEMORY.get(tokens, SPARE_WORKING_MEMORY)




def case(provider: str, T: int = 8192, V: int = QWEN3_VOCAB, dtype: str = "bf16", validate: bool = True) -> Case:
    return Case(NAME, provider, T, V, dtype=dtype, validate=validate)


SUITES = dict(
    whole_step=lambda: [case("qwen3_step", validate=v) for v in (True, False)],
    lm_head_step=lambda: [case(p, T) for T in (8192, 32768) for p in HF_PROVIDERS[1:]],
    megatron_step=lambda: [case(p, T) for T in (8192, 32768) for p in MCORE_PROVIDERS],
    megatron_step_flash=lambda: [case(p, T) for T in (8192, 32768) for p in MCORE_FLASH_PROVIDERS],
)


def SMOKE() -> list[Case]:
    """A tiny model of Qwen3's architecture (T = 8, V = 256, fp32), validate on and off; the Megatron step skips
    off CUDA."""
    return [case("qwen3_step", 8, 256, "fp32", v) for v in (True, False)] + [case("mcore_head_flash", 8, 256, "fp32")]


def bytes_moved(c: Case) -> None:
    return None


def baselines(c: Case) -> tuple[list[dict], Optional[dict]]:
    """The transformers step's ways against its logits path (validate off against on); the Megatron ways against
    the logits path over the body-only step, a keep set's way against the same way without one."""
    if c.provider == "qwen3_step":
        return ([dict(validate="on")] if not c.validate else []), None
    if c.provider in HF_PROVIDERS:
        return ([dict(provider="qwen3_step_ckpt")] if c.provider != "qwen3_step_ckpt" else []), None
    way, keep, attention = _way(c.provider)
    suffix = "_flash" if attention == "flash" else ""
    if way == "body" or (way == "logits" and not keep):
        return [], None
    if keep:
        plain = "logits" if way.startswith("logits") else way
        return [dict(provider=f"mcore_{plain}{suffix}")], None
    if way == "exact":  # against the logits path it replaces (SGLang's order), then Megatron's own
        return ([dict(provider=f"mcore_logits_sglang{suffix}"), dict(provider=f"mcore_logits{suffix}")],
                dict(provider=f"mcore_body{suffix}", validate="on"))
    return [dict(provider=f"mcore_logits{suffix}")], dict(provider=f"mcore_body{suffix}", validate="on")


class StepInputs:
    """The sampled tokens [T] and the per-token advantages [T] fp32, from the shared seed."""

    def __init__(self, c: Case, device: torch.device, seed: int):
        shared = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, c.V, (c.T,), dtype=torch.int64, generator=shared).to(device)
        self.advantages = torch.randn(c.T, dtype=torch.float32, generator=shared).to(device)


def make_inputs(c: Case, device: torch.device, *, seed: int, rank: int = 0, group=None) -> StepInputs:
    return StepInputs(c, device, seed)


def check(c: Case, inputs, closure: Closure, memo: dict, check_rows: int) -> dict:
    return {}


# --- the transformers model ---


def model_config(vocab: int, tokens: int):
    from transformers import Qwen3Config

    if vocab == QWEN3_VOCAB:
        return Qwen3Config(**QWEN3_0_6B)
    return Qwen3Config(**TINY, vocab_size=vocab, max_position_embeddings=max(64, tokens))


def build_hf(c: Case, inp: StepInputs) -> Closure:
    """prepare() clears the parameters' gradients, step() runs the whole step and returns the loss."""
    import ppo_ops
    from transformers import Qwen3ForCausalLM

    device = inp.tokens.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(MODEL_SEED)
        model = Qwen3ForCausalLM(model_config(c.V, c.T))
    model = model.to(device=device, dtype=TORCH_DTYPES[c.dtype]).train()
    if c.provider != "qwen3_step":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, targets, weights = inp.tokens.reshape(1, -1), torch.roll(inp.tokens, -1), inp.advantages

    def token_loss(log_probs, entropy, rows):  # the loss below, one term per token
        return (weights[rows] * log_probs + ENTROPY_COEF * entropy) / c.T

    def step(_):
        if c.provider in ("qwen3_step_head", "qwen3_step_loss"):
            hidden = model.model(input_ids=ids).last_hidden_state[0]  # [T, H], after the final norm
            args = (hidden, model.lm_head.weight, targets)
            if c.provider == "qwen3_step_loss":
                loss, _ = ppo_ops.linear_token_loss(*args, token_loss, entropy="grad", validate=c.validate)
                loss.backward()
                return loss
            out = ppo_ops.linear_log_probs_and_entropy(*args, entropy="grad", validate=c.validate)
        else:
            out = ppo_ops.log_probs_and_entropy(model(input_ids=ids).logits[0], targets, entropy="grad",
                                                validate=c.validate)
        loss = ((weights * out.log_probs).sum() + ENTROPY_COEF * out.entropy.sum()) / c.T
        loss.backward()
        return loss

    closure = Closure(prepare=lambda: model.zero_grad(set_to_none=True), step=step)
    closure.model = model
    return closure


def _unsupported_hf(c: Case, device: torch.device) -> Optional[str]:
    if c.tp > 1:
        return "the whole step runs one model on one rank"
    return first_import_problem(("transformers", "ppo_ops"))


# --- the Megatron model ---

def _way(provider: str) -> tuple:
    """(kind, with a keep set, attention) of a provider name: mcore_<kind>[_keep][_flash]."""
    flash = provider.endswith("_flash")
    name = provider.removesuffix("_flash")
    keep = name.endswith("_keep")
    return name.removeprefix("mcore_").removesuffix("_keep"), keep, "flash" if flash else "local"


class SdpaCoreAttention(torch.nn.Module):
    """Megatron's core-attention slot (DotProductAttention's place in the layer spec) filled by torch's
    scaled_dot_product_attention: causal, each query group's key and value shared by its heads (repeat_interleave,
    as Megatron's own), the default 1 / sqrt(head_dim) scale. Takes the keywords megatron-core builds and calls it
    with and ignores those it has no use for (masks: the attention is causal over the one packed sequence)."""

    def __init__(self, config=None, layer_number=None, attn_mask_type=None, attention_type=None,
                 attention_dropout=None, softmax_scale=None, **unused):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, *unused_args, **unused):
        """query [S, B, heads, d], key and value [S, B, groups, d] -> [S, B, heads * d]."""
        seq, batch, heads = query.shape[:3]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, heads or groups, S, d]
        if k.shape[1] != heads:
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)


def _init_megatron() -> None:
    """A one-rank process group and megatron-core's parallel state (TP = PP = CP = 1), once per process."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ranks.free_port()}", rank=0, world_size=1,
                                timeout=datetime.timedelta(minutes=5))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(MODEL_SEED)


_MODEL: dict = {}  # attention -> the model: every case of one attention steps the same weights (rotary: any T)


def build_model(attention: str = "local"):
    """Qwen3-0.6B's shape as a megatron-core GPTModel (module docstring), bf16, on the current CUDA device, with the
    local spec's core attention ("local") or SdpaCoreAttention ("flash"); one per process and attention (the weights do
    not change: a step only writes .grad, which each case's prepare clears; the same seed gives both the same
    weights), the other one dropped first."""
    if attention in _MODEL:
        return _MODEL[attention]
    _MODEL.clear()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    _init_megatron()
    config = TransformerConfig(
        **MCORE_QWEN3_0_6B, normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0,
        attention_softmax_in_fp32=False,
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        torch.manual_seed(MODEL_SEED)
        spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        if attention == "flash":
            spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
        model = GPTModel(config, spec,
                         vocab_size=QWEN3_VOCAB, max_sequence_length=MAX_TOKENS, position_embedding_type="rope",
                         rotary_base=ROTARY_BASE, share_embeddings_and_output_weights=True)
    # Every parameter in bf16, as Megatron's Float16Module casts a bf16 model: the local spec's norms are torch
    # modules created in fp32, which would carry the activations in fp32 through every layer
    _MODEL[attention] = model.to(device="cuda", dtype=torch.bfloat16).train()
    return _MODEL[attention]


class _SglangLogits(torch.autograd.Function):
    """bf16 logits [T, V] from SGLang's batch-invariant matmul (its bits), the gradients by cuBLAS."""

    @staticmethod
    def forward(ctx, hidden, weight):
        from ppo_ops.lm_head import sglang_matmul

        ctx.save_for_backward(hidden, weight)
        out = torch.empty((hidden.shape[0], weight.shape[0]), dtype=torch.bfloat16, device=hidden.device)
        return sglang_matmul.bf16_logits(hidden.bfloat16(), weight.bfloat16(), out, None, "triton")

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        return (grad @ weight.to(grad.dtype)).to(hidden.dtype), (grad.t() @ hidden.to(grad.dtype)).to(weight.dtype)


def _sglang_logits_processor(*, hidden_states, labels, loss_mask, context, output_layer=None, output_weight=None,
                             **unused):
    """The sglang-order logits path as an output processor: [S, B, H] hidden -> bf16 logits -> the logits op."""
    import ppo_ops

    weight = output_weight if output_weight is not None else output_layer.weight
    hidden = hidden_states.transpose(0, 1).reshape(-1, hidden_states.shape[-1])
    logits = _SglangLogits.apply(hidden, weight)
    return ppo_ops.log_probs_and_entropy(logits, labels.reshape(-1), entropy="grad",
                                         row_mask=loss_mask.reshape(-1) != 0, validate=context,
                                         reduction_order="sglang")


def _body_only(*, hidden_states, **unused):
    """The trivial output processor: a scalar of the hidden states alone (the body's gradient, no head)."""
    return hidden_states.float().square().mean()


def build_mcore(case: Case, inp: StepInputs) -> Closure:
    """prepare() clears the parameters' gradients; step() runs the whole step and returns the loss."""
    import ppo_ops
    import ppo_ops.megatron as pm

    kind, with_keep, attention = _way(case.provider)
    model = build_model(attention)
    device = inp.tokens.device
    tokens = inp.tokens.reshape(1, -1)
    position_ids = torch.arange(case.T, device=device).reshape(1, -1)
    labels = torch.roll(tokens, -1, dims=1)
    loss_mask = torch.ones_like(tokens, dtype=torch.float32)
    loss_mask[0, -1] = 0.0  # the last position has no next token
    gen = torch.Generator(device=device).manual_seed(7)
    old = -5.0 + torch.randn(tokens.shape, generator=gen, device=device)
    ppo = ppo_ops.policy_loss(old, torch.randn(tokens.shape, generator=gen, device=device), clip_low=0.2,
                              clip_high=0.28, entropy_coef=0.01, kl_coef=0.01,
                              ref_log_probs=old + 0.1 * torch.randn(tokens.shape, generator=gen, device=device),
                              kl_type="k3", loss_mask=loss_mask != 0, normalization="token_mean")
    keep = nucleus(labels, QWEN3_VOCAB, seed=11) if with_keep else None
    validate = case.validate

    def logits_path(keep_args: dict):
        logits = model(tokens, position_ids, None)  # [B, S, V] bf16: Megatron's output layer
        out = ppo_ops.log_probs_and_entropy(logits, labels, entropy="grad", row_mask=loss_mask != 0,
                                            validate=validate, **keep_args)
        return ppo.total(out.log_probs, out.entropy)

    def processor(token_loss, working_memory=None, reduction_order="fused"):
        context = pm.Context(entropy="grad", token_loss=token_loss, keep=keep, validate=validate,
                             working_memory=working_memory, reduction_order=reduction_order)
        return model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask,
                     output_processor=pm.output_processor, output_processor_context=context)

    def loss_of_step():
        if kind == "body":
            return model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask,
                         output_processor=_body_only, output_processor_context=None)
        if kind == "logits_dense":
            dense = dense_mask(keep, case.T, QWEN3_VOCAB).view(1, case.T, QWEN3_VOCAB)
            return logits_path({"keep_mask": dense})
        if kind == "logits_sparse":
            return logits_path({"keep": keep})
        if kind == "logits":
            return logits_path({})
        if kind == "logits_sglang":
            out = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask,
                        output_processor=_sglang_logits_processor, output_processor_context=validate)
            return ppo.total(out.log_probs.view(tokens.shape), out.entropy.view(tokens.shape))
        if kind == "exact":
            loss, _ = processor(ppo, reduction_order="sglang")
            return loss
        if kind in ("head", "head_spare"):
            out = processor(None, head_spare_memory(case.T) if kind == "head_spare" else None)
            return ppo.total(out.log_probs, out.entropy)
        working_memory = {"loss": None, "loss_lean": 0, "loss_spare": SPARE_WORKING_MEMORY}[kind]
        loss, _ = processor(ppo, working_memory)
        return loss

    def prepare():
        model.zero_grad(set_to_none=True)

    def step(_):
        loss = loss_of_step()
        loss.backward()
        return loss

    return Closure(prepare=prepare, step=step)


def _unsupported_mcore(case: Case, device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return "megatron-core's attention runs on CUDA only"
    if case.tp > 1:
        return "the Megatron step runs one model on one rank"
    problem = first_import_problem(("megatron.core", "ppo_ops"))
    if problem:
        return problem
    from megatron.core.models.gpt.gpt_model import GPTModel

    if "output_processor" not in inspect.signature(GPTModel.forward).parameters:
        import megatron.core

        return f"megatron-core {megatron.core.__version__} has no output_processor hook (>= 0.18 has)"
    kind, with_keep, _ = _way(case.provider)
    if with_keep and kind != "logits_dense":
        return keep_missing()
    return None


PROVIDERS = registry(*(Provider(p, build_hf, _unsupported_hf, modules=("transformers", "ppo_ops"))
                       for p in HF_PROVIDERS),
                     *(Provider(p, build_mcore, _unsupported_mcore, modules=("megatron.core", "ppo_ops"))
                       for p in MCORE_PROVIDERS + MCORE_FLASH_PROVIDERS))
