"""Megatron-core integration: the fused LM head (ppo_ops.linear_log_probs_and_entropy / linear_token_loss) in place of
GPTModel's output layer: per-token log-probs, entropies or an RL loss without [T, V] logits.

    import ppo_ops.megatron as pm
    ctx = pm.Context(entropy="grad", temperature=0.7, vocab_size=151936, token_loss=ppo)  # ppo: ppo_ops.policy_loss
    loss, out = pm.gpt_log_probs(model, tokens, position_ids, None, labels, loss_mask, ctx)  # megatron-core >= 0.16
    loss, out = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask,       # >= 0.18 (the hook)
                      **pm.processor_kwargs(ctx, model))

One computation, `output_processor`, reached two ways: megatron-core >= 0.18 calls it from GPTModel's
`output_processor` hook on the last pipeline stage; on 0.16 and 0.17 (no hook) `gpt_log_probs` runs the model's own
embedding and decoder and calls it (on >= 0.18 it calls the hook). `processor_kwargs` refuses a megatron-core without
the hook, naming gpt_log_probs. Versions before 0.16 are refused by name. tests/test_megatron.py runs on the installed
megatron-core (0.16.1 in the venv and on the GPU runners).

Megatron's layouts (each tested against its own output layer's logits path): tensor parallel (the output layer's
vocabulary shard and group), sequence parallel (hidden states all-gathered, dX reduce-scattered, as its
column-parallel layer does), tied embeddings (the gradient reaches the embedding), context parallel (each CP rank
scores its own rows; no CP collective), packed sequences, pipeline parallel (only the last stage scores), MuP (its
logit multiplier folded into the temperature). Refused by name: an output layer with a bias,
defer_embedding_wgrad_compute.

Helpers for a trainer's batches (host-side lengths, Python ints or tensors): packed_targets, zigzag_split,
zigzag_packed_index, zigzag_packed_targets, packed_keep, zigzag_packed_keep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ppo_ops import api
from ppo_ops.core import agreement, checks
from ppo_ops.core.checks import argument_error

Lengths = Union[Sequence[int], torch.Tensor]
# What a token loss's constants must be here (the end of its row-count error).
_LOSS_ROWS = (": one constant per label, in the labels' [B, S] layout ([1, T] for a packed stream), and under context "
              "parallelism this rank's rows only (gather them with zigzag_packed_index)")


@dataclasses.dataclass(frozen=True, eq=False)
class Context:
    """The options of one `output_processor` call (GPTModel.forward's `output_processor_context`).

    entropy: "none" | "value" | "grad", as in ppo_ops.linear_log_probs_and_entropy.
    temperature: the rollout's sampling temperature (both outputs use logits / temperature): a number, or one per
      label, a float32 tensor in the labels' [B, S] layout on their device (under context parallelism this rank's
      rows), e.g. each sequence's own temperature repeated over its positions.
    softcap: None, or c > 0: the logits become c * tanh(logits / c) before the temperature (Gemma 2's
      final_logit_softcapping), in the head's elementwise step. Not with MuP's logit multiplier.
    vocab_size: the true vocabulary, the one the rollout engine samples from (the Hugging Face config's vocab_size:
      151936 for Qwen3); the columns Megatron pads the output layer with (to a multiple of 128 x TP), at and past it,
      get no probability mass and no gradient. None: every column of the output layer is a token.
    keep: the sparse top-p / top-k keep set, passed as `keep=` to the head unchanged; its rows are the flattened
      [B * S] label-layout positions (row b * S + s), as the head's rows are (packed_keep builds it for packed
      samples).
    token_loss: a row-separable per-token loss as for ppo_ops.linear_token_loss (e.g. ppo_ops.policy_loss(...), one
      constant per label, in the labels' [B, S] layout: checked); the processor then returns (loss, LogProbsEntropy).
    working_memory: the bytes the head may hold beyond its outputs (the working_memory of linear_token_loss with a
      token_loss: its row blocks; else of linear_log_probs_and_entropy: the rows whose probabilities its forward
      keeps for the backward); None: the head's default; the same on every rank.
    validate: the head's value checks and collective failure (one host sync per call; False: none).
    tp_group: the tensor-parallel group, when not the output layer's or parallel_state's.
    backend: the head's backend ("auto": Triton on CUDA tensors, PyTorch elsewhere).
    reduction_order: the head's ("sglang": log-probs bit for bit SGLang's true on-policy LM head; docs/api.md).
    """

    entropy: str = "none"
    temperature: Any = 1.0
    vocab_size: Optional[int] = None
    keep: Optional[tuple] = None
    token_loss: Optional[Callable] = None
    validate: bool = True
    tp_group: Optional[Any] = None
    backend: str = "auto"
    working_memory: Optional[int] = None
    reduction_order: str = "fused"
    softcap: Optional[float] = None


def output_processor(*, hidden_states: torch.Tensor, labels: torch.Tensor, context: Context, output_layer=None,
                     output_weight: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None,
                     config=None, **unused):
    """linear_log_probs_and_entropy(hidden_states.transpose(0, 1), weight, labels, row_mask=loss_mask != 0, ...),
    or linear_token_loss(..., context.token_loss, ...): GPTModel's output processor, in Megatron's layouts.

    Args (the hook's keywords; the others it passes are accepted and unused: no logits are formed):
      hidden_states: [S, B, H] ([S / tp, B, H] under sequence parallelism: all-gathered over the TP group, the
        backward reduce-scattering dX), the output layer's input.
      labels: [B, S] integer next-token targets (global ids).
      context: a Context (the options; its token loss's constants one per label).
      output_layer: the ColumnParallelLinear output layer: its weight, TP group, sequence parallelism, dX reduction.
      output_weight: the shared embedding weight when embeddings are tied (it then gets the gradient), else None.
      loss_mask: [B, S]; 0 rows get 0, a zero gradient and no GEMM work (its values are not weights).
      config: the model's TransformerConfig (sequence_parallel, MuP's logit multiplier, deferred weight gradients).

    Returns LogProbsEntropy([B, S] fp32 each), or (loss, LogProbsEntropy) with context.token_loss (loss 0-d fp32, the
    values detached). Errors name the argument; at TP > 1 with validate the token loss's row count and the head's own
    checks raise on every rank together, before the head's first collective.
    """
    del unused
    fn = "megatron.output_processor"
    if not isinstance(context, Context):
        raise argument_error(TypeError, fn, "context",
                             f"output_processor_context must be a ppo_ops.megatron.Context, got "
                             f"{type(context).__name__}")
    if labels is None:
        raise argument_error(ValueError, fn, "labels", "labels are required: the [B, S] next-token targets to score")
    weight = output_weight if output_weight is not None else getattr(output_layer, "weight", None)
    if weight is None:
        raise argument_error(ValueError, fn, "output_weight",
                             "no weight: output_weight is None and the output layer has none")
    _check_unsupported(fn, output_layer, config)

    group = _tp_group(context, output_layer)
    sequence_parallel = group is not None and dist.get_world_size(group) > 1 and _sequence_parallel(output_layer,
                                                                                                    config)
    if sequence_parallel:
        hidden_states = gather_sequence_parallel(hidden_states, group)
        reduce_dx = False  # the gather's backward reduce-scatters dX over the group
    else:
        reduce_dx = not getattr(output_layer, "disable_grad_reduce", False)  # the layer's allreduce_dgrad
    if context.token_loss is not None and isinstance(labels, torch.Tensor):
        # After the sequence-parallel gather, which every rank makes alike: the other ranks meet this check's header
        # exchange, if it fails here, in the head's own.
        agreement.check_collectively(fn, group, context.validate, hidden_states, checks.check_token_loss_rows, fn,
                                     context.token_loss, tuple(labels.shape), "labels' [B, S] =", _LOSS_ROWS)
    _check_layout(fn, hidden_states, labels, sequence_parallel)

    options = dict(tp_group=group, entropy=context.entropy,
                   temperature=_temperature(fn, context.temperature, context.softcap, config),
                   row_mask=None if loss_mask is None else loss_mask != 0, vocab_size=context.vocab_size,
                   reduce_dx=reduce_dx, backend=context.backend, validate=context.validate,
                   working_memory=context.working_memory, keep=context.keep,
                   reduction_order=context.reduction_order,
                   **({"softcap": context.softcap} if context.softcap is not None else {}))
    head = api.linear_log_probs_and_entropy if context.token_loss is None else api.linear_token_loss
    hidden = hidden_states.transpose(0, 1)  # [B, S, H]: the labels' layout
    if context.token_loss is None:
        return head(hidden, weight, labels, **options)
    return head(hidden, weight, labels, context.token_loss, **options)


def gpt_log_probs(model, input_ids, position_ids, attention_mask, labels, loss_mask, context: Context, *,
                  packed_seq_params=None, decoder_input=None, extra_block_kwargs=None, padding_mask=None):
    """model(input_ids, position_ids, attention_mask, labels=labels, loss_mask=loss_mask,
    output_processor=output_processor, output_processor_context=context) on every megatron-core from 0.16.

    >= 0.18: that call (the hook). 0.16 and 0.17: the model's own _preprocess and decoder, as their forward runs them,
    then output_processor. `model`: a GPTModel or a wrapper reaching it through `.module` (DDP, Float16Module; the
    path without the hook runs the GPTModel's modules, not the wrapper's casts). Multi-token prediction needs the hook.
    On a CPU (a CPU-only torch) it makes what megatron-core would make on "cuda": the causal attention mask (when
    attention_mask and packed_seq_params are None) and torch.cuda.current_device() answering "cpu" for the call; it
    needs megatron-core's inference RNG tracker there (its error says so). At one TP rank a token loss whose
    constants are not one per label raises before the model runs; at TP > 1 the processor raises it on every rank.

    Returns output_processor's result on the last pipeline stage; on an earlier stage the decoder's hidden states, as
    model(...) returns them.
    """
    fn = "megatron.gpt_log_probs"
    gpt = _unwrap(model)
    if (isinstance(context, Context) and context.token_loss is not None and isinstance(labels, torch.Tensor)
            and getattr(gpt, "post_process", True)):
        group = _tp_group(context, getattr(gpt, "output_layer", None))
        if group is None or dist.get_world_size(group) == 1:  # at TP > 1 the processor checks it on every rank at once
            checks.check_token_loss_rows(fn, context.token_loss, tuple(labels.shape), "labels' [B, S] =", _LOSS_ROWS)
    device = _model_device(gpt)
    if device is not None and device.type != "cuda":
        _check_cpu_rng_tracker(fn, gpt)
        if attention_mask is None and packed_seq_params is None and isinstance(input_ids, torch.Tensor):
            attention_mask = _causal_mask(input_ids.shape[-1], device)
    with _current_device_is(device):
        return _gpt_log_probs(fn, gpt, model, input_ids, position_ids, attention_mask, labels, loss_mask, context,
                              packed_seq_params, decoder_input, extra_block_kwargs, padding_mask)


def processor_kwargs(context: Context, model=None) -> dict:
    """`dict(output_processor=output_processor, output_processor_context=context)` for GPTModel.forward, after
    checking that the model's forward (or, without a model, the installed megatron-core's GPTModel.forward) takes
    the hook: megatron-core 0.16 and 0.17 have none, and their own error would be an unexpected keyword argument.

        loss, out = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask, **pm.processor_kwargs(ctx))
    """
    fn = "megatron.processor_kwargs"
    if not isinstance(context, Context):
        raise argument_error(TypeError, fn, "context", f"context must be a ppo_ops.megatron.Context, got "
                                                       f"{type(context).__name__}")
    if model is not None:
        forward = _unwrap(model).forward
    else:
        from megatron.core.models.gpt.gpt_model import GPTModel

        forward = GPTModel.forward
    if "output_processor" not in inspect.signature(forward).parameters:
        raise argument_error(
            RuntimeError, fn, "output_processor",
            f"GPTModel.forward of megatron-core {_megatron_version()} takes no output_processor (the hook came in "
            "0.18): call ppo_ops.megatron.gpt_log_probs(model, input_ids, position_ids, attention_mask, labels, "
            "loss_mask, context), which runs the model with the fused head on 0.16 and later")
    return dict(output_processor=output_processor, output_processor_context=context)


def _gpt_log_probs(fn, gpt, model, input_ids, position_ids, attention_mask, labels, loss_mask, context,
                   packed_seq_params, decoder_input, extra_block_kwargs, padding_mask):
    if "output_processor" in inspect.signature(gpt.forward).parameters:
        extra = {} if padding_mask is None else {"padding_mask": padding_mask}
        out = model(input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels,
                    packed_seq_params=packed_seq_params, extra_block_kwargs=extra_block_kwargs, loss_mask=loss_mask,
                    output_processor=output_processor, output_processor_context=context, **extra)
        return _as_outputs(out, gpt, context)
    if "padding_mask" not in inspect.signature(gpt._preprocess).parameters:
        raise argument_error(
            RuntimeError, fn, "model",
            f"megatron-core {_megatron_version()} is not supported: gpt_log_probs needs 0.16 "
            "or 0.17 (GPTModel._preprocess with padding_mask) or >= 0.18 (the output_processor hook)")
    if getattr(gpt, "mtp_process", False):
        raise argument_error(NotImplementedError, fn, "model",
                             "multi-token prediction needs megatron-core >= 0.18 (the output_processor hook)")
    if getattr(gpt.config, "fine_grained_activation_offloading", False):
        gpt.preprocess_for_fine_grained_offloading()
    pre = gpt._preprocess(input_ids=input_ids, position_ids=position_ids, decoder_input=decoder_input,
                          inference_context=None, packed_seq_params=packed_seq_params, padding_mask=padding_mask)
    decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask = pre[:6]
    hidden_states = gpt.decoder(
        hidden_states=decoder_input, attention_mask=attention_mask, inference_context=None,
        rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
        rotary_pos_cos_sin=pre[6] if len(pre) == 7 else None, packed_seq_params=packed_seq_params,
        sequence_len_offset=sequence_len_offset, padding_mask=padding_mask, **(extra_block_kwargs or {}))
    if not gpt.post_process:
        return hidden_states
    output_weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    return output_processor(
        hidden_states=hidden_states, output_layer=gpt.output_layer, output_weight=output_weight, labels=labels,
        loss_mask=loss_mask, input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
        decoder_input=decoder_input, packed_seq_params=packed_seq_params, context=context, config=gpt.config)


# ---- megatron-core on a CPU ----

def _megatron_version() -> str:
    try:
        import megatron.core
    except ImportError:
        return "(not importable)"
    return getattr(megatron.core, "__version__", "?")


def _model_device(gpt) -> Optional[torch.device]:
    parameters = getattr(gpt, "parameters", None)
    first = next(parameters(), None) if callable(parameters) else None
    return None if first is None else first.device


@contextlib.contextmanager
def _current_device_is(device):
    """On a torch without CUDA, torch.cuda.current_device() answers `device` while the model runs: megatron-core
    0.16 to 0.19 allocate its rotary frequencies (and its sequence-parallel buffers) on the current CUDA device,
    which raises "Torch not compiled with CUDA enabled" there. Elsewhere, nothing."""
    if device is None or device.type == "cuda" or torch.cuda.is_available():
        yield
        return
    own = torch.cuda.current_device
    torch.cuda.current_device = lambda: device.type
    try:
        yield
    finally:
        torch.cuda.current_device = own


def _causal_mask(seq: int, device) -> torch.Tensor:
    """[1, 1, S, S] bool, True above the diagonal (masked out): the mask megatron-core's attention makes itself when
    given none, on "cuda" (megatron.core.transformer.utils.get_default_causal_mask), made here on the model's
    device."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]


def _check_cpu_rng_tracker(fn, gpt):
    """A megatron-core model's attention forks the model-parallel RNG state on every call (dropout 0 included); the
    training tracker keeps CUDA generator states, which a CPU run cannot add or fork."""
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        from megatron.core.transformer.module import MegatronModule
    except ImportError:
        return
    if not isinstance(gpt, MegatronModule):
        return
    try:
        with get_cuda_rng_tracker().fork():
            pass
    except Exception as err:
        raise argument_error(
            RuntimeError, fn, "model",
            f"the model is on the CPU, where megatron-core's RNG tracker cannot fork its CUDA generator states "
            f"({err}): after initialize_model_parallel, call megatron.core.tensor_parallel.random."
            "initialize_rng_tracker(inference_rng_tracker=True, force_reset=True) (its fork does nothing; dropout "
            "then draws from torch's CPU generator)") from err


# ---- sequence parallelism ----

class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group (rank order); backward: reduce-scatter along dim 0 (the sum of every
    rank's gradient, each rank keeping its own rows), as Megatron's gather_from_sequence_parallel_region does."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((x.shape[0] * dist.get_world_size(group),) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group),) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def gather_sequence_parallel(hidden_states: torch.Tensor, group) -> torch.Tensor:
    """[S / tp, B, H] on each rank of `group` -> [S, B, H] (rank r's rows at [r S / tp, (r + 1) S / tp)); the backward
    reduce-scatters the gradient. Any device and backend with all_gather_into_tensor / reduce_scatter_tensor (NCCL,
    gloo): Megatron's own mapping allocates on torch.cuda.current_device(), which a CPU tensor is not on."""
    return _GatherSequence.apply(hidden_states, group)


# ---- the processor's pieces ----

def _unwrap(model):
    """The GPTModel inside wrappers that hold it as `.module` (DDP, Float16Module)."""
    inner = model
    while not hasattr(inner, "_preprocess") and hasattr(inner, "module"):
        inner = inner.module
    return inner


def _as_outputs(out, gpt, context: Context):
    """The processor's result through a wrapper's output conversion (Float16Module turns tuples into plain ones)."""
    if not gpt.post_process or isinstance(out, (torch.Tensor, api.LogProbsEntropy)):
        return out
    if context.token_loss is None:
        return api.LogProbsEntropy(*out)
    loss, values = out
    return loss, api.LogProbsEntropy(*values)


def _tp_group(context: Context, output_layer):
    if context.tp_group is not None:
        return context.tp_group
    group = getattr(output_layer, "tp_group", None)
    if group is not None:
        return group
    try:
        from megatron.core import parallel_state
    except ImportError:
        return None
    return parallel_state.get_tensor_model_parallel_group(check_initialized=False)


def _sequence_parallel(output_layer, config) -> bool:
    flag = getattr(output_layer, "sequence_parallel", None)
    return bool(getattr(config, "sequence_parallel", False) if flag is None else flag)


def _temperature(fn, temperature, softcap, config):
    """The sampling temperature with MuP's logit multiplier folded in: (z * m) / t = z / (t / m) (a new tensor for a
    per-label one). A softcap acts on z * m, so the multiplier cannot move past it: refused with one."""
    if getattr(config, "use_mup", False) and getattr(config, "mup_output_mult", 1.0) != 1.0:
        if softcap is not None:
            raise argument_error(ValueError, fn, "softcap",
                                 "softcap with MuP's logit multiplier (config.mup_output_mult != 1): the cap acts on "
                                 "the multiplied logits, which the fused head does not form")
        return temperature / config.mup_output_mult
    return temperature


def _check_unsupported(fn, output_layer, config):
    if getattr(output_layer, "bias", None) is not None and not getattr(output_layer, "skip_bias_add", False):
        raise argument_error(NotImplementedError, fn, "output_layer",
                             "the output layer has a bias; the fused head computes hidden @ weight.T only")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise argument_error(NotImplementedError, fn, "config",
                             "defer_embedding_wgrad_compute: Megatron forms that weight gradient later from buffers "
                             "only its own output layer fills; turn it off to use the fused head")


def _check_layout(fn, hidden_states, labels, gathered):
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        raise argument_error(ValueError, fn, "hidden_states",
                             f"hidden_states must be [S, B, H], got {_shape(hidden_states)}")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or (
            tuple(labels.shape) != tuple(hidden_states.shape[1::-1])):
        note = " after the sequence-parallel gather" if gathered else " (sequence parallelism is off)"
        raise argument_error(ValueError, fn, "labels",
                             f"labels must be [B, S] = {tuple(hidden_states.shape[1::-1])} for hidden_states "
                             f"[S, B, H] = {tuple(hidden_states.shape)}{note}, got {_shape(labels)}")


def _shape(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


# ---- batches: packed samples, context-parallel splits ----

def packed_targets(tokens: torch.Tensor, total_lengths: Lengths, response_lengths: Lengths):
    """Next-token targets and the row mask of packed samples.

    tokens: [T] the packed stream: sample k occupies [start_k, start_k + total_lengths[k]), start_k the sum of the
      lengths before it; positions past the last sample are padding. The last response_lengths[k] tokens of sample k
      are its response (response_lengths[k] <= total_lengths[k]).
    Returns (targets [T] tokens' dtype, row_mask [T] bool): position i predicts tokens[i + 1] (targets[i]) wherever
    i + 1 is in the same sample, else target 0; row_mask[i] is True iff tokens[i + 1] is a response token of i's
    sample. So a sample's last position counts for no target, and a response's first token is scored at the prompt's
    last position. Pass them as labels [1, T] and loss_mask [1, T] (or multiply row_mask by a per-token mask).
    """
    fn = "megatron.packed_targets"
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        raise argument_error(ValueError, fn, "tokens", f"tokens must be a 1-D tensor [T], got {_shape(tokens)}")
    lengths, responses = _lengths(fn, total_lengths, response_lengths, tokens.numel())
    n, device = tokens.numel(), tokens.device
    if not lengths or n == 0:
        return torch.zeros_like(tokens), torch.zeros(n, dtype=torch.bool, device=device)
    ends = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(device)
    first_response = ends - torch.tensor(responses, dtype=torch.int64, device=device)
    pos = torch.arange(n, device=device)
    sample = torch.searchsorted(ends, pos, right=True)  # len(lengths) on the padding past the last sample
    inside = sample < len(lengths)
    sample = sample.clamp(max=len(lengths) - 1)
    nxt = pos + 1
    same_sample = inside & (nxt < ends[sample])
    row_mask = same_sample & (nxt >= first_response[sample])
    targets = torch.where(same_sample, tokens[nxt.clamp(max=n - 1)], torch.zeros_like(tokens))
    return targets, row_mask


def zigzag_split(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 0) -> torch.Tensor:
    """Megatron's load-balanced context-parallel split (get_batch_on_this_cp_rank) of `x` along `dim` (the sequence:
    1 for [B, S] labels and masks, 0 for [S, B, H] hidden states): the length splits into 2 * cp_size equal chunks
    and rank r keeps chunks r and 2 * cp_size - 1 - r, in that order. The length must be divisible by 2 * cp_size.
    Split targets and masks built on the whole sequence, never targets built after the split."""
    fn = "megatron.zigzag_split"
    _check_cp(fn, cp_size, cp_rank)
    if cp_size == 1:
        return x
    length = x.shape[dim]
    if length % (2 * cp_size):
        raise argument_error(ValueError, fn, "x", f"x.shape[{dim}] = {length} must be divisible by 2 * cp_size = "
                                                  f"{2 * cp_size} (pad the sequence first)")
    chunk = length // (2 * cp_size)
    return torch.cat([x.narrow(dim, cp_rank * chunk, chunk), x.narrow(dim, (2 * cp_size - 1 - cp_rank) * chunk, chunk)],
                     dim=dim)


def zigzag_packed_index(total_lengths: Lengths, cp_size: int, cp_rank: int, *, multiple_of: int = 1,
                        device=None) -> torch.Tensor:
    """Which positions of a packed stream context-parallel rank `cp_rank` holds, in its local order: int64 [T_local],
    -1 where it holds padding.

    Packed samples are split one by one (TransformerEngine's THD layout, as slime packs them): sample k is padded to
    P_k = total_lengths[k] rounded up to a multiple of 2 * cp_size, split into 2 * cp_size chunks, and the rank keeps
    chunks r and 2 * cp_size - 1 - r; the samples' pieces follow each other, and the end is padded to a multiple of
    `multiple_of` (e.g. the TP size under sequence parallelism). cp_size == 1: the stream itself (no per-sample
    padding). The attention's padded cu_seqlens are the prefix sums of P_k. Gather any per-token tensor of the
    packed stream with it (x[index.clamp(min=0)], then the padding's value where index < 0): the loss's constants
    must follow the rows this rank scores.
    """
    fn = "megatron.zigzag_packed_index"
    _check_cp(fn, cp_size, cp_rank)
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise argument_error(ValueError, fn, "multiple_of", f"multiple_of must be an int >= 1, got {multiple_of!r}")
    lengths, _ = _lengths(fn, total_lengths, None, None)
    pieces, start = [], 0
    for length in lengths:
        if cp_size == 1:
            pieces.append(torch.arange(start, start + length))
        else:
            chunk = -(-length // (2 * cp_size))
            local = torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                               torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)])
            pieces.append(torch.where(local < length, local + start, -1))
        start += length
    index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    pad = -index.numel() % multiple_of
    index = torch.cat([index, torch.full((pad,), -1, dtype=torch.int64)])
    return index if device is None else index.to(device)


def zigzag_packed_targets(tokens: torch.Tensor, total_lengths: Lengths, response_lengths: Lengths, cp_size: int,
                          cp_rank: int, *, multiple_of: int = 1):
    """packed_targets on the whole packed stream, then this context-parallel rank's rows (zigzag_packed_index):
    (tokens_local, targets_local, row_mask_local), each [T_local]; padding rows hold token 0, target 0, mask False.
    The targets come from the whole stream, so a chunk's last position predicts the next token even where another
    rank holds it."""
    targets, row_mask = packed_targets(tokens, total_lengths, response_lengths)
    index = zigzag_packed_index(total_lengths, cp_size, cp_rank, multiple_of=multiple_of, device=tokens.device)
    held = index >= 0
    at = index.clamp(min=0)
    zero = torch.zeros((), dtype=tokens.dtype, device=tokens.device)
    return (torch.where(held, tokens[at], zero), torch.where(held, targets[at], zero), held & row_mask[at])


def packed_keep(tokens: torch.Tensor, total_lengths: Lengths, response_lengths: Lengths, top_p_token_ids: Sequence,
                top_p_token_offsets: Sequence):
    """The sparse keep set of packed samples, `keep=(ids, offsets)` over the rows of packed_targets, from per-sample
    nuclei as slime records them at rollout (Sample.rollout_top_p_token_ids / rollout_top_p_token_offsets).

    top_p_token_ids[k], top_p_token_offsets[k]: sample k's nucleus, 1-D integer tensors (or lists): its response
      token j kept ids[o[j]:o[j + 1]] (o = the offsets, response_lengths[k] + 1 of them, non-decreasing, within
      ids); None (or no offsets) for a sample without one.
    Row i scores tokens[i + 1] (packed_targets), so response token j of sample k gets row start_k + P_k + j - 1 (P_k
    its prompt length); a response that starts its sample (P_k = 0) has no row for its first token, whose nucleus
    is left out. Every other row has an empty range: its full vocabulary (they are not response rows). Returns (ids
    int64, offsets int64 [T + 1]) on tokens' device; the op checks the ids against the vocabulary. Work: O(samples)
    Python steps and O(T + len(ids)) tensor work, no [T, V] mask.
    """
    fn = "megatron.packed_keep"
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1:
        raise argument_error(ValueError, fn, "tokens", f"tokens must be a 1-D tensor [T], got {_shape(tokens)}")
    lengths, responses = _lengths(fn, total_lengths, response_lengths, tokens.numel())
    nuclei = _nuclei(fn, top_p_token_ids, top_p_token_offsets, responses)
    counts = torch.zeros(tokens.numel(), dtype=torch.int64)
    pieces, start = [], 0
    for length, response, nucleus in zip(lengths, responses, nuclei):
        if nucleus is not None and response:
            ids, offsets = nucleus
            first = 1 if response == length else 0  # no row scores a sample's first token
            row0 = start + length - response - 1 + first
            counts[row0:row0 + response - first] = offsets[first + 1:] - offsets[first:-1]
            pieces.append(ids[int(offsets[first]):int(offsets[-1])].to(tokens.device))
        start += length
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    ids = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=tokens.device)
    return ids, offsets.to(tokens.device)


def zigzag_packed_keep(tokens: torch.Tensor, total_lengths: Lengths, response_lengths: Lengths,
                       top_p_token_ids: Sequence, top_p_token_offsets: Sequence, cp_size: int, cp_rank: int, *,
                       multiple_of: int = 1):
    """packed_keep on the whole packed stream, then this context-parallel rank's rows (zigzag_packed_index), in its
    local order: (ids int64, offsets int64 [T_local + 1]), the keep set of the rows zigzag_packed_targets gives this
    rank; padding rows have empty ranges."""
    ids, offsets = packed_keep(tokens, total_lengths, response_lengths, top_p_token_ids, top_p_token_offsets)
    index = zigzag_packed_index(total_lengths, cp_size, cp_rank, multiple_of=multiple_of, device=tokens.device)
    held = index >= 0
    at = index.clamp(min=0)
    counts = torch.where(held, offsets[at + 1] - offsets[at], 0)
    local = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    n_ids = int(local[-1])
    # entry e of local row i is entry e - local[i] of global row index[i]
    first = offsets[at].repeat_interleave(counts, output_size=n_ids)
    within = torch.arange(n_ids, device=ids.device) - local[:-1].repeat_interleave(counts, output_size=n_ids)
    return ids[first + within], local


def _nuclei(fn, top_p_token_ids, top_p_token_offsets, responses):
    """Per sample (ids int64, offsets int64) on the CPU, or None: checked against the response lengths."""
    if isinstance(top_p_token_ids, torch.Tensor) or isinstance(top_p_token_offsets, torch.Tensor):
        raise argument_error(TypeError, fn, "top_p_token_ids",
                             "top_p_token_ids and top_p_token_offsets must be sequences with one entry per sample "
                             "(slime's per-sample tensors), not one tensor")
    ids_list, offsets_list = list(top_p_token_ids), list(top_p_token_offsets)
    for name, values in (("top_p_token_ids", ids_list), ("top_p_token_offsets", offsets_list)):
        if len(values) != len(responses):
            raise argument_error(ValueError, fn, name, f"{name} must have one entry per sample ({len(responses)}), "
                                                       f"got {len(values)}")
    out = []
    for k, (ids, offsets, response) in enumerate(zip(ids_list, offsets_list, responses)):
        if offsets is None:
            out.append(None)
            continue
        offsets = torch.as_tensor(offsets).to("cpu")
        if offsets.numel() == 0:
            out.append(None)
            continue
        ids = torch.as_tensor([] if ids is None else ids)
        if ids.dim() != 1 or (ids.numel() and (ids.dtype.is_floating_point or ids.dtype == torch.bool)):
            raise argument_error(ValueError, fn, "top_p_token_ids",
                                 f"top_p_token_ids[{k}] must be a 1-D integer tensor, got {ids.dtype} {_shape(ids)}")
        if offsets.dim() != 1 or offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
            raise argument_error(ValueError, fn, "top_p_token_offsets",
                                 f"top_p_token_offsets[{k}] must be a 1-D integer tensor, got {offsets.dtype} "
                                 f"{_shape(offsets)}")
        offsets = offsets.to(torch.int64)
        if offsets.numel() != response + 1:
            raise argument_error(ValueError, fn, "top_p_token_offsets",
                                 f"top_p_token_offsets[{k}] must have response_lengths[{k}] + 1 = {response + 1} "
                                 f"entries, got {offsets.numel()}")
        if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[0]) < 0 or int(offsets[-1]) > ids.numel():
            raise argument_error(ValueError, fn, "top_p_token_offsets",
                                 f"top_p_token_offsets[{k}] must be non-decreasing within [0, len(top_p_token_ids"
                                 f"[{k}]) = {ids.numel()}], got {offsets.tolist()[:8]}{'...' if response > 7 else ''}")
        out.append((ids.to(torch.int64), offsets))
    return out


def _check_cp(fn, cp_size, cp_rank):
    if not isinstance(cp_size, int) or cp_size < 1:
        raise argument_error(ValueError, fn, "cp_size", f"cp_size must be an int >= 1, got {cp_size!r}")
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise argument_error(ValueError, fn, "cp_rank", f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")


def _lengths(fn, total_lengths, response_lengths, n_tokens):
    """Lists of Python ints (a tensor is read once: lengths are host-side metadata), checked."""
    def as_list(name, values):
        if isinstance(values, torch.Tensor):
            values = values.tolist()
        values = list(values)
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values):
            raise argument_error(ValueError, fn, name, f"{name} must be non-negative ints, got {values}")
        return values

    lengths = as_list("total_lengths", total_lengths)
    if n_tokens is not None and sum(lengths) > n_tokens:
        raise argument_error(ValueError, fn, "total_lengths",
                             f"total_lengths add up to {sum(lengths)}, more than the {n_tokens} tokens given")
    if response_lengths is None:
        return lengths, None
    responses = as_list("response_lengths", response_lengths)
    if len(responses) != len(lengths) or any(r > t for r, t in zip(responses, lengths)):
        raise argument_error(ValueError, fn, "response_lengths",
                             f"response_lengths must pair with total_lengths, each at most its sample's length: "
                             f"got {responses} for {lengths}")
    return lengths, responses
