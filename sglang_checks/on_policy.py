"""Qwen3's forward as SGLang 0.5.17 runs it with `--rl-on-policy-target fsdp`, op by op, for the trainer side.

Under --rl-on-policy-target SGLang enables deterministic inference, and with it batch-invariant mode
(model_executor/model_runner.py:maybe_enable_batch_invariant_mode -> batch_invariant_ops.enable_batch_invariant_mode():
aten::mm / addmm / bmm / _log_softmax / mean.dim / rms_norm run as SGLang's Triton kernels on CUDA), and its Qwen3
follows "HF in fp32 under bf16 autocast". This module repeats that forward on the flattened tokens of a batch
(varlen, as an engine pass holds them), for a teacher-forced prefill with no cached prefix:

  embed      models/qwen2.py:Qwen2Model: VocabParallelEmbedding with params_dtype fp32 -> fp32 rows
  per layer  models/qwen3.py:Qwen3DecoderLayer.forward through layers/communicator.py:prepare_attn / prepare_mlp
             (TP = 1: no collective): input_layernorm (layer 0: residual = its input; later: fused residual add),
             Qwen3Attention.forward: hidden -> bf16, qkv_proj, split, q_norm / k_norm over heads
             (models/utils.py:apply_qk_norm, the unfused path under deterministic inference: reshape(-1, head_dim)),
             rotary_emb, q, k -> bf16, attn, o_proj; post_attention_layernorm (residual add);
             Qwen2MLP.forward: x -> bf16, gate_up_proj, SiluAndMul.forward_native, down_proj
  norms      layers/layernorm.py:RMSNorm.forward_native (forward_cuda sends every on-policy norm there): x -> fp32,
             + residual in fp32 (fp32_residual keeps it fp32), variance = x.pow(2).mean(-1) (aten::mean.dim),
             x * rsqrt(var + eps), then weight(fp32) * x.to(orig_dtype) (cast_x_before_out_mul; orig_dtype is the
             override fp32 for the decoder norms and the final norm, the input's dtype (bf16) for q_norm / k_norm,
             whose fp32 weight promotes the product to fp32)
  linears    layers/quantization/unquant.py:UnquantizedLinearMethod.apply: F.linear(x, W) -> aten::mm, with the fused
             qkv and gate_up weights SGLang builds (rows q|k|v and gate|up)
  RoPE       layers/rotary_embedding/base.py:RotaryEmbedding: the fp32 cos/sin cache of _compute_cos_sin_cache
             (inv_freq on the CPU, then moved; positions and cos/sin on the model's device) and forward_native with
             SGLang's own apply_rotary_emb under torch.compile(dynamic=True). SGLang's class itself is not built:
             its constructor reads the server's published runtime config (runtime_context.get_exec()), which only a
             server process has; the cache recipe and forward_native's few tensor ops are repeated here.
  attention  layers/attention/triton_backend.py:forward_extend -> _forward_extend_unified (deterministic mode):
             SGLang's kernels/ops/attention/extend_attention.py:build_unified_kv_indices and
             extend_attention_fwd_unified (its block sizes chosen inside, by head dim and GPU), called with the
             backend's arguments: sm_scale = head_dim ** -0.5, k/v scale 1.0, no logit cap, causal, page size 1
  logits     layers/logits_processor.py:_compute_lm_head: torch.matmul(hidden.bfloat16(), lm_head.weight.T.bfloat16())
             (the tied head is the fp32 embedding)

Every step records its output under the name SGLang's tensor dumper gives the module that makes it
(debug_utils/tensor_dump_forward_hook.py: leaf modules under "model."; a tuple output is a list, None dropped), so
layer_diff.py can compare the two forwards tensor by tensor. Names: model.embed_tokens, then per layer
model.layers.N.{input_layernorm, self_attn.qkv_proj, self_attn.q_norm, self_attn.k_norm, self_attn.rotary_emb,
self_attn.attn, self_attn.o_proj, post_attention_layernorm, mlp.gate_up_proj, mlp.act_fn, mlp.down_proj}, then
model.norm.

Kernels: `sglang_kernels(site_dir)` uses SGLang's installed code (CUDA; sglang imported with its site folder
appended to sys.path, so this interpreter's own packages win); `TORCH_KERNELS` are stand-ins (the same ops with
plain matmuls, a plain causal softmax attention and eager RoPE) that run anywhere, so the op sequence is testable on
a CPU. `activation_dtype` is SGLang's bf16 (its `.bfloat16()` casts and the linear weights' dtype); float32 gives an
all-fp32 forward to check the math against transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from sglang_checks.errors import CheckError

# The server and the trainer must pick the same batch-invariant matmul: SGLang's Triton one (DeepGEMM, its default
# where installed, is another kernel). Read by batch_invariant_ops at import, so set before sglang is imported.
SGLANG_ENV = {"SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM": "0"}

Record = Optional[Dict[str, object]]


@dataclasses.dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [H] fp32
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, H] activation dtype, rows q | k | v
    q_norm: torch.Tensor  # [D] fp32
    k_norm: torch.Tensor  # [D] fp32
    o: torch.Tensor  # [H, Hq * D]
    post_norm: torch.Tensor  # [H] fp32
    gate_up: torch.Tensor  # [2 I, H], rows gate | up
    down: torch.Tensor  # [H, I]


@dataclasses.dataclass(frozen=True)
class Qwen3Weights:
    """The checkpoint's weights in the dtypes SGLang's on-policy Qwen3 holds them."""

    embed: torch.Tensor  # [V, H] fp32 (params_dtype fp32)
    layers: Tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [H] fp32
    lm_head: torch.Tensor  # [V, H]: the fp32 embedding when tied, else activation dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    max_positions: int
    activation_dtype: torch.dtype

    @classmethod
    def from_hf(cls, model, activation_dtype: torch.dtype = torch.bfloat16) -> "Qwen3Weights":
        """From a transformers Qwen3ForCausalLM (its parameters are the checkpoint's when loaded in its dtype)."""
        config = model.config
        if getattr(config, "attention_bias", False):
            raise ValueError("on_policy: Qwen3 with attention biases is not mirrored (SGLang adds them in F.linear)")
        sd = {name: p.detach() for name, p in model.state_dict().items()}
        f32, act = torch.float32, activation_dtype
        layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            layers.append(LayerWeights(
                input_norm=sd[p + "input_layernorm.weight"].to(f32),
                qkv=torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).to(act),
                q_norm=sd[p + "self_attn.q_norm.weight"].to(f32),
                k_norm=sd[p + "self_attn.k_norm.weight"].to(f32),
                o=sd[p + "self_attn.o_proj.weight"].to(act),
                post_norm=sd[p + "post_attention_layernorm.weight"].to(f32),
                gate_up=torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]).to(act),
                down=sd[p + "mlp.down_proj.weight"].to(act)))
        embed = sd["model.embed_tokens.weight"].to(f32)
        tied = config.tie_word_embeddings or "lm_head.weight" not in sd
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 1000000.0))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(embed=embed, layers=tuple(layers), final_norm=sd["model.norm.weight"].to(f32),
                   lm_head=embed if tied else sd["lm_head.weight"].to(act), num_heads=config.num_attention_heads,
                   num_kv_heads=config.num_key_value_heads, head_dim=head_dim, eps=config.rms_norm_eps,
                   rope_theta=float(theta), max_positions=config.max_position_embeddings, activation_dtype=act)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None, *,
             cast_x_before_out_mul: bool = True, override_orig_dtype: Optional[torch.dtype] = None,
             fp32_residual: bool = False):
    """layers/layernorm.py:RMSNorm.forward_native, line for line (no variance_size_override, no post-residual add).
    Returns the output, or (output, residual) when a residual is given."""
    if not x.is_contiguous():
        x = x.contiguous()
    orig_dtype = override_orig_dtype or x.dtype
    x = x.to(torch.float32)
    if residual is not None:
        x = x + residual.to(torch.float32)
        residual = x.clone() if fp32_residual else x.to(orig_dtype)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if cast_x_before_out_mul:
        x = weight * x.to(orig_dtype)
    else:
        x = (x * weight).to(orig_dtype)
    return x if residual is None else (x, residual)


# The decoder layers' and the final norm's kwargs under rl_on_policy_target (models/qwen3.py, models/qwen2.py).
_DECODER_NORM = dict(cast_x_before_out_mul=True, override_orig_dtype=torch.float32, fp32_residual=True)


def rope_cos_sin_cache(head_dim: int, max_positions: int, base: float, device: torch.device) -> torch.Tensor:
    """RotaryEmbedding._compute_cos_sin_cache under rl_on_policy_target: [max_positions, head_dim] fp32, cos | sin.
    SGLang builds it at model construction, before batch-invariant mode is on; so must the caller."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
    inv_freq = inv_freq.to(device)
    t = torch.arange(max_positions, dtype=torch.float, device=device)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def apply_rotary_emb_eager(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool):
    """The math of layers/rotary_embedding/utils.py:apply_rotary_emb (neox style), for the stand-in kernels."""
    assert is_neox_style, "Qwen3 uses neox-style RoPE"
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_forward_native(apply, cache: torch.Tensor, head_dim: int, positions: torch.Tensor, query: torch.Tensor,
                          key: torch.Tensor):
    """RotaryEmbedding.forward_native (rotary_dim = head_dim, neox style, no offsets)."""
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    out = []
    for x in (query, key):
        shape = x.shape
        x = x.view(num_tokens, -1, head_dim)
        x_rot, x_pass = x[..., :head_dim], x[..., head_dim:]
        x_rot = apply(x_rot, cos, sin, True)
        out.append(torch.cat((x_rot, x_pass), dim=-1).reshape(shape))
    return out[0], out[1]


class TorchKernels:
    """Stand-ins that run anywhere: aten ops as they are, eager RoPE, a plain causal softmax attention per sequence
    (scores in the inputs' dtype, softmax in fp32, as transformers' eager attention)."""

    name = "torch"
    apply_rotary = staticmethod(apply_rotary_emb_eager)

    def batch_invariant(self):
        return contextlib.nullcontext()

    def attention(self, q, k, v, seq_lens: Sequence[int], *, num_heads: int, num_kv_heads: int, head_dim: int,
                  scaling: float) -> torch.Tensor:
        out = torch.empty_like(q)
        group, start = num_heads // num_kv_heads, 0
        for n in seq_lens:
            rows = slice(start, start + n)
            qs = q[rows].view(n, num_heads, head_dim).transpose(0, 1)
            ks = k[rows].view(n, num_kv_heads, head_dim).transpose(0, 1).repeat_interleave(group, dim=0)
            vs = v[rows].reshape(n, num_kv_heads, head_dim).transpose(0, 1).repeat_interleave(group, dim=0)
            scores = torch.matmul(qs, ks.transpose(1, 2)) * scaling
            future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
            weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(qs.dtype)
            out[rows] = torch.matmul(weights, vs).transpose(0, 1).reshape(n, num_heads * head_dim)
            start += n
        return out


TORCH_KERNELS = TorchKernels()


def import_sglang(site_dir: Optional[str]) -> None:
    """Makes SGLang's kernels importable here: its site folder appended to sys.path (where this interpreter does not
    already import sglang), SGLANG_ENV set before SGLang reads it, and its batch-invariant ops imported. SGLang 0.5.17
    registers its own transformers configs on import and needs the transformers it was installed with (with another
    one, e.g. 5.17 beside a 5.12 bundle, the registration raises): then a CheckError says to run the check with
    SGLang's interpreter."""
    for key, value in SGLANG_ENV.items():
        os.environ[key] = value
    if site_dir and site_dir not in sys.path:
        sys.path.append(site_dir)
    try:
        import sglang.srt.batch_invariant_ops  # noqa: F401  what the trainer runs; also SGLang's config registration
    except Exception as exc:  # noqa: BLE001 - whatever the import raises, the remedy is the same
        import transformers

        raise CheckError(
            "--trainer_numerics=sglang_on_policy: SGLang's kernels do not import into this interpreter "
            f"({sys.executable}, transformers {transformers.__version__}"
            f"{', sglang from ' + site_dir if site_dir else ''}): {type(exc).__name__}: {exc}. Run the check with "
            "SGLang's own interpreter (the --sglang_python one, e.g. `<sglang_python> -m "
            "sglang_checks.qwen3_parallel_check ...`), whose packages SGLang was installed with") from exc


def enable_batch_invariant_mode(site_dir: Optional[str]) -> None:
    """SGLang's batch-invariant mode for the rest of the process, as its model runner enables it (trainer ranks)."""
    import_sglang(site_dir)
    from sglang.srt.batch_invariant_ops import enable_batch_invariant_mode as enable

    enable()


class SGLangKernels:
    """SGLang's own code: batch-invariant mode, compiled apply_rotary_emb, the unified deterministic extend kernel."""

    name = "sglang"

    def __init__(self, site_dir: Optional[str]):
        import_sglang(site_dir)
        from sglang.kernels.ops.attention import extend_attention
        from sglang.srt import batch_invariant_ops
        from sglang.srt.layers.rotary_embedding.utils import apply_rotary_emb

        self._bio = batch_invariant_ops
        self._extend = extend_attention
        # As RotaryEmbedding.__init__ wraps it under rl_on_policy_target (disable=_is_npu, False on CUDA). The
        # server inherits the check's environment, so TORCHDYNAMO_DISABLE=1 (as tests/conftest.py sets) makes both
        # run it eagerly, and both compile it otherwise.
        self.apply_rotary = torch.compile(dynamic=True, disable=False)(apply_rotary_emb)

    @contextlib.contextmanager
    def batch_invariant(self):
        """Batch-invariant mode for the block (left on when it already was, e.g. in a trainer rank)."""
        if self._bio.is_batch_invariant_mode_enabled():
            yield
            return
        self._bio.enable_batch_invariant_mode()
        try:
            yield
        finally:
            self._bio.disable_batch_invariant_mode()

    def attention(self, q, k, v, seq_lens: Sequence[int], *, num_heads: int, num_kv_heads: int, head_dim: int,
                  scaling: float) -> torch.Tensor:
        """TritonAttnBackend._forward_extend_unified for a batch of prefills without a cached prefix: the K/V
        "cache" is the batch's own k, v (slot t = token t), the extend part is every token."""
        device, bs = q.device, len(seq_lens)
        k_buffer = k.reshape(-1, num_kv_heads, head_dim).contiguous()
        v_buffer = v.reshape(-1, num_kv_heads, head_dim).contiguous()
        extend_seq_lens = torch.tensor(list(seq_lens), dtype=torch.int32, device=device)
        extend_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32, device=device),
                                      torch.cumsum(extend_seq_lens[:-1], dim=0)]).to(torch.int32)
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=device)
        qo_indptr[1:] = torch.cumsum(extend_seq_lens, dim=0)
        kv_indptr, kv_indices, prefix_lens = self._extend.build_unified_kv_indices(
            torch.zeros(bs + 1, dtype=torch.int32, device=device),  # no prefix
            torch.empty(0, dtype=torch.int64, device=device),
            extend_start_loc, extend_seq_lens,
            torch.arange(q.shape[0], dtype=torch.int64, device=device),  # out_cache_loc: slot of each token
            bs)
        o = torch.empty_like(q)
        self._extend.extend_attention_fwd_unified(
            q.view(-1, num_heads, head_dim), o.view(-1, num_heads, head_dim), k_buffer, v_buffer, 1.0, 1.0,
            qo_indptr, kv_indptr, kv_indices, prefix_lens.to(torch.int32), max(seq_lens), custom_mask=None,
            mask_indptr=None, sm_scale=scaling, logit_cap=0.0, is_causal=True, sliding_window_size=-1, sinks=None,
            window_start_pos=None, xai_temperature_len=-1, page_size=1)
        return o


def sglang_kernels(site_dir: Optional[str]) -> SGLangKernels:
    return SGLangKernels(site_dir)


def _put(record: Record, name: str, value) -> None:
    """What SGLang's TensorDumper.add_tensor stores for a module output: a CPU tensor, or a list for a tuple."""
    if record is None:
        return
    if isinstance(value, (tuple, list)):
        tensors = [t.detach().cpu() for t in value if t is not None]
        record[name] = tensors[0] if len(tensors) == 1 else tensors
    else:
        record[name] = value.detach().cpu()


def forward(w: Qwen3Weights, input_ids: torch.Tensor, seq_lens: Sequence[int], kernels=TORCH_KERNELS,
            record: Record = None, cache: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(final hidden states [T, H] fp32, logits [T, V] activation dtype) of the flattened tokens `input_ids` [T]
    (sequences of `seq_lens` tokens, one after another, each from position 0). Call inside
    kernels.batch_invariant(); build `cache` (rope_cos_sin_cache) outside it, as SGLang does."""
    act, d = w.activation_dtype, w.head_dim
    q_size, kv_size = w.num_heads * d, w.num_kv_heads * d
    device = input_ids.device
    positions = torch.cat([torch.arange(n, dtype=torch.int64, device=device) for n in seq_lens])
    if cache is None:
        cache = rope_cos_sin_cache(d, w.max_positions, w.rope_theta, device)

    hidden = F.embedding(input_ids, w.embed)
    _put(record, "model.embed_tokens", hidden)
    residual = None
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}."
        if residual is None:  # communicator.prepare_attn: the first layer's residual is its input
            residual = hidden
            hidden = rms_norm(hidden, layer.input_norm, w.eps, **_DECODER_NORM)
            _put(record, p + "input_layernorm", hidden)
        else:
            hidden, residual = rms_norm(hidden, layer.input_norm, w.eps, residual, **_DECODER_NORM)
            _put(record, p + "input_layernorm", (hidden, residual))

        qkv = F.linear(hidden.to(act), layer.qkv)
        _put(record, p + "self_attn.qkv_proj", qkv)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q_by_head = rms_norm(q.reshape(-1, d), layer.q_norm, w.eps)
        _put(record, p + "self_attn.q_norm", q_by_head)
        k_by_head = rms_norm(k.reshape(-1, d), layer.k_norm, w.eps)
        _put(record, p + "self_attn.k_norm", k_by_head)
        q, k = rotary_forward_native(kernels.apply_rotary, cache, d, positions, q_by_head.view(q.shape),
                                     k_by_head.view(k.shape))
        _put(record, p + "self_attn.rotary_emb", (q, k))
        attn = kernels.attention(q.to(act), k.to(act), v, seq_lens, num_heads=w.num_heads,
                                 num_kv_heads=w.num_kv_heads, head_dim=d, scaling=d ** -0.5)
        _put(record, p + "self_attn.attn", attn)
        hidden = F.linear(attn, layer.o)
        _put(record, p + "self_attn.o_proj", hidden)

        hidden, residual = rms_norm(hidden, layer.post_norm, w.eps, residual, **_DECODER_NORM)
        _put(record, p + "post_attention_layernorm", (hidden, residual))
        gate_up = F.linear(hidden.to(act), layer.gate_up)
        _put(record, p + "mlp.gate_up_proj", gate_up)
        half = gate_up.shape[-1] // 2
        hidden = F.silu(gate_up[..., :half]) * gate_up[..., half:]
        _put(record, p + "mlp.act_fn", hidden)
        hidden = F.linear(hidden, layer.down)
        _put(record, p + "mlp.down_proj", hidden)

    hidden, residual = rms_norm(hidden, w.final_norm, w.eps, residual, **_DECODER_NORM)
    _put(record, "model.norm", (hidden, residual))
    logits = torch.matmul(hidden.to(act), w.lm_head.T.to(act))
    return hidden, logits


def model_outputs(model, input_ids: torch.Tensor, lengths: List[int], *, kernels=TORCH_KERNELS,
                  activation_dtype: torch.dtype = torch.bfloat16, record: Record = None):
    """(hidden [B, S, H] fp32, LM head [V, H] in the activation dtype, logits [B, S, V]) of right-padded rows
    `input_ids` [B, S] whose first lengths[b] tokens are real; padding rows are 0 (no forward sees them). The real
    tokens run as one flattened batch, as an engine pass holds them; `record` gets every step's output."""
    w = Qwen3Weights.from_hf(model, activation_dtype)
    device = w.embed.device
    flat = torch.cat([input_ids[b, :n] for b, n in enumerate(lengths)]).to(device)
    cache = rope_cos_sin_cache(w.head_dim, w.max_positions, w.rope_theta, device)
    with torch.no_grad(), kernels.batch_invariant():
        hidden, logits = forward(w, flat, lengths, kernels, record, cache)
    batch, seq = input_ids.shape
    hidden_out = hidden.new_zeros(batch, seq, hidden.shape[-1])
    logits_out = logits.new_zeros(batch, seq, logits.shape[-1])
    start = 0
    for b, n in enumerate(lengths):
        hidden_out[b, :n] = hidden[start:start + n]
        logits_out[b, :n] = logits[start:start + n]
        start += n
    return hidden_out, w.lm_head.to(activation_dtype), logits_out
