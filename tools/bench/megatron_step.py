"""The Megatron whole-step bench providers: one RL step through a megatron-core GPTModel of Qwen3-0.6B's shape.

The model: megatron-core's GPTModel of Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 heads, 8 query groups,
head_dim 128, FFN 3072 with SwiGLU, RMSNorm, QK norm, rotary base 1e6, vocabulary 151936), tied embeddings, bf16
parameters (the norms too, as Megatron's Float16Module casts them), full activation recompute of every layer, seeded
random weights, TP = 1 on one GPU, with its local layer spec (no TransformerEngine) in one of two bodies:
  local   the spec's unfused attention, softmax in bf16: it forms [heads, S, S] scores, which set the body's peak
          (above anything the head holds) and do not fit one H200 at T = 32768 (docs/performance.md);
  flash   providers ending in _flash: the spec's core attention replaced by `SdpaCoreAttention` (torch's causal
          scaled_dot_product_attention, flash on an H200): no [S, S] tensor, as a trainer with TransformerEngine's
          fused attention has, so the head's own memory shows over the body's.
One packed sequence of T tokens (B = 1); labels are the next tokens, the last position masked out by loss_mask.

The timed step is what a trainer does per micro-batch: the model's forward, the log-prob of every next token and
its entropy (with gradient), ppo_ops.policy_loss (clipped surrogate with DAPO's clip range, entropy bonus, k3 KL to
a reference, token mean) and the backward through the model into every parameter's .grad. The ways to the loss (the
provider name):
  mcore_body     a trivial output processor, a function of the hidden states alone: the body's own time and peak
  mcore_logits   Megatron's output layer ([B, S, V] bf16 logits), then ppo_ops.log_probs_and_entropy: the drop-in path
  mcore_head     GPTModel.forward(..., output_processor=ppo_ops.megatron.output_processor): the fused head
  mcore_loss     the same with Context(token_loss=...): ppo_ops.linear_token_loss, the gradient formed in the forward
  mcore_loss_lean  the token loss with Context(working_memory=0): its smallest row blocks beside the fp32 dW
                 accumulator, the least memory it can take (against its default allowance's one block at T = 8192)
  mcore_loss_spare  the token loss with Context(working_memory=SPARE_WORKING_MEMORY): what a step may spare for
                 the head's blocks (4096-row blocks at this model's head: two at T = 8192 where the lean way takes
                 eight, so less host work and fewer dW accumulations per row, for 0.87 GiB more probabilities held)
  mcore_head_spare  the fused head with Context(working_memory=head_spare_memory(T)): the rows' probabilities it
                 may hold from forward to backward within what the step spares at T, so fewer rows formed again
and with a 64-id nucleus per row (the target among them, as a sampled token is), as top-p replay has it:
  mcore_logits_dense_keep   the logits path with the dense [T, V] keep_mask built from the nucleus in the step
  mcore_logits_sparse_keep  the logits path with the sparse keep=(ids, offsets)
  mcore_head_keep           the fused head with Context(keep=...)
  mcore_loss_keep           the token loss with Context(keep=...)

The output processor needs megatron-core >= 0.18 (GPTModel.forward's output_processor); CUDA only (megatron-core's
attention runs on CUDA). No reference check: the logits come from the model (the head's own suites check the ops).
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch

from ppo_ops.runtime import ranks
from tools.bench.cases import MCORE_FLASH_PROVIDERS, MCORE_STEP_PROVIDERS, QWEN3_VOCAB, Case
from tools.bench import keep_set
from tools.bench.contract import Closure, Provider, first_import_problem
from tools.bench.inputs import Inputs

MODULES = ("megatron.core", "ppo_ops")
MODEL_SEED = 1234  # the random weights: the same model in every run
QWEN3_0_6B = dict(num_layers=28, hidden_size=1024, num_attention_heads=16, num_query_groups=8, kv_channels=128,
                  ffn_hidden_size=3072)
ROTARY_BASE = 1_000_000
# The spare way's allowance: at H = 1024, V = 151936 the fp32 dW accumulator takes 0.58 GiB of it and each block row
# 2 V bytes, so 1.75 GiB gives 4096-row blocks (prob_block_rows); the step's peak is then 0.86 to 0.90 GiB over the
# flash body's at T = 8192, within a quarter of the logits path's extra (0.915 GiB; 2 GiB went over, 1.5 GiB's
# three blocks took 0.59: docs/performance.md)
SPARE_WORKING_MEMORY = 7 * 2**28
# The general head's: bytes of fp16 probabilities (2 V a row) held across the loss, per T, chosen so the step's peak
# stays within a quarter of the logits path's extra over the flash body (0.915 GiB at T = 8192, 4.03 at 32768); part
# of them lies under the body's own backward peak (docs/performance.md). Other T: SPARE_WORKING_MEMORY.
HEAD_SPARE_MEMORY = {8192: 5 * 2**28, 32768: 5 * 2**30}


def head_spare_memory(tokens: int) -> int:
    return HEAD_SPARE_MEMORY.get(tokens, SPARE_WORKING_MEMORY)


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
MAX_TOKENS = 32768  # the longest case's T: the model's max_sequence_length


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
        **QWEN3_0_6B, normalization="RMSNorm", layernorm_epsilon=1e-6, qk_layernorm=True, gated_linear_unit=True,
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


def _body_only(*, hidden_states, **unused):
    """The trivial output processor: a scalar of the hidden states alone (the body's gradient, no head)."""
    return hidden_states.float().square().mean()


def build(case: Case, inp: Inputs) -> Closure:
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
    keep = keep_set.nucleus(labels, QWEN3_VOCAB, seed=11) if with_keep else None
    validate = case.validate

    def logits_path(keep_args: dict):
        logits = model(tokens, position_ids, None)  # [B, S, V] bf16: Megatron's output layer
        out = ppo_ops.log_probs_and_entropy(logits, labels, entropy="grad", row_mask=loss_mask != 0,
                                            validate=validate, **keep_args)
        return ppo.total(out.log_probs, out.entropy)

    def processor(token_loss, working_memory=None):
        context = pm.Context(entropy="grad", token_loss=token_loss, keep=keep, validate=validate,
                             working_memory=working_memory)
        return model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask,
                     output_processor=pm.output_processor, output_processor_context=context)

    def loss_of_step():
        if kind == "body":
            return model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask,
                         output_processor=_body_only, output_processor_context=None)
        if kind == "logits_dense":
            dense = keep_set.dense_mask(keep, case.T, QWEN3_VOCAB).view(1, case.T, QWEN3_VOCAB)
            return logits_path({"keep_mask": dense})
        if kind == "logits_sparse":
            return logits_path({"keep": keep})
        if kind == "logits":
            return logits_path({})
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


def unsupported(case: Case, device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return "megatron-core's attention runs on CUDA only"
    if case.tp > 1:
        return "the Megatron step runs one model on one rank"
    problem = first_import_problem(MODULES)
    if problem:
        return problem
    import inspect

    from megatron.core.models.gpt.gpt_model import GPTModel

    if "output_processor" not in inspect.signature(GPTModel.forward).parameters:
        import megatron.core

        return f"megatron-core {megatron.core.__version__} has no output_processor hook (>= 0.18 has)"
    kind, with_keep, _ = _way(case.provider)
    if with_keep and kind != "logits_dense":
        return keep_set.missing()
    return None


# Their logits come from a model, not from the case's inputs: no reference check (see the module docstring).
PROVIDERS = tuple(Provider(name, build, unsupported, checked=False, modules=MODULES)
                  for name in MCORE_STEP_PROVIDERS + MCORE_FLASH_PROVIDERS)
