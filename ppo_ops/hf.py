"""Next-token log-probs (and entropies, or a per-token RL loss) of a Hugging Face transformers causal LM through
ppo_ops' fused LM head, without the model's [B, S, V] logits:

    from ppo_ops.hf import token_log_probs
    out = token_log_probs(model, input_ids, attention_mask=attention_mask, entropy="grad")
    out.log_probs[b, i]  # log p(input_ids[b, i + 1] | input_ids[b, :i + 1]), fp32

The model's own forward runs once (so FSDP / FSDP2 / DDP wrappers and accelerate's hooks run as for its logits), its
output embedding's forward replaced for that call by the head, which takes the hidden states and the weight as they
are there (gathered, where a wrapper shards it). A head sharded by tensor parallelism (a DTensor weight) is refused.
Under a caller's torch.compile the base model and the head run directly (no wrapper runs: compile such a step over an
unwrapped model).

Gemma 2's final_logit_softcapping (`logits = tanh(logits / cap) * cap` after the output embedding, in the forward of
the classes of SOFTCAPPED_MODELS) is served: the head applies it (ppo_ops' `softcap`) while the model's forward runs
with the setting off, so the model returns the head's outputs as they are. Refused with an error naming the model
class: another logit transform (a non-neutral setting of LOGIT_TRANSFORMS, the soft-capping of a model not in
SOFTCAPPED_MODELS, or a `final_logits_bias`), no base model or output embedding, an output embedding that is not a
bias-free nn.Linear; and, after its forward ran, a model that does not call its output embedding exactly once on every
position or changes what it returned before returning it as its logits.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch import nn

import ppo_ops
from ppo_ops.core.checks import FLOAT_DTYPES, argument_error, check_token_loss_rows

_FN = "hf.token_log_probs"
# What a token loss's constants must be here: one per position, the last one included (it scores nothing).
_HF_LOSS_ROWS = (": position i holds the constants of the token input_ids[b, i + 1], so build them [B, S] (not "
                 "[B, S - 1]), the last position padded and left out by the loss_mask")

# Config settings that change a causal LM's logits (or the hidden states its head sees) beyond lm_head(h), each with
# the values that leave them unchanged. Read from the model's config and its text config (multimodal models), and
# from the model object itself (some copy the setting onto it).
LOGIT_TRANSFORMS = {
    "final_logit_softcapping": (None,),  # Gemma 2/3, PaliGemma, T5Gemma: cap * tanh(logits / cap)
    "logits_soft_cap": (None,),  # RecurrentGemma: the same soft-capping
    "output_logit_soft_cap": (None,),  # xLSTM: the same soft-capping
    "logit_scale": (None, 1.0),  # Cohere, Cohere2: logits * logit_scale
    "logits_scaling": (None, 1.0),  # Granite (logits / s), HyperCLOVAX (logits * s), MiniCPM3 (hidden states / s)
    "lm_head_multiplier": (None, 1.0),  # Falcon-H1: logits * m
    "output_multiplier": (None, 1.0),  # MuseGlimmer / MuseSpark: logits * m before their soft-capping
    "logits_mup_width_multiplier": (None, 1.0),  # Inkling: hidden states / m before the head
}
# transformers' causal LMs whose forward caps its output embedding's logits as Gemma 2's does, reading
# `self.config.final_logit_softcapping` right after the output embedding (Gemma2ForCausalLM.forward:
# `logits = logits / cap; logits = torch.tanh(logits); logits = logits * cap`): the head serves the setting for them.
SOFTCAPPED_MODELS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_SOFTCAP = "final_logit_softcapping"


def token_log_probs(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    attention_mask: Optional[torch.Tensor] = None,
    position_ids: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    entropy: str = "none",
    row_mask: Optional[torch.Tensor] = None,
    keep=None,
    token_loss: Optional[Callable] = None,
    validate: bool = True,
    working_memory: Optional[int] = None,
    reduction_order: str = "fused",
):
    """log_softmax(model(input_ids, ...).logits / temperature)[b, i, input_ids[b, i + 1]] (and each position's
    entropy) as [B, S] fp32, 0 where position i does not count, without the [B, S, V] logits.

    Position i counts where attention_mask (if given) is non-zero at i and i + 1, position_ids (if given) continue
    (position_ids[b, i + 1] == position_ids[b, i] + 1: a packed row's next sequence starts at i + 1) and row_mask
    (if given) is True; never at the last position. A position that does not count gets 0, a zero gradient and no
    head compute. Gradients reach every parameter as through the model's logits (a tied embedding: one accumulated
    .grad). Not reentrant for one model (its output embedding's forward is swapped during the call).

    Args:
      model: a transformers causal LM (fp32, bf16 or fp16), possibly under DDP, FSDP or FSDP2 (module docstring).
      input_ids: [B, S] integer ids on the model's device, S >= 1, each in [0, the model's vocabulary).
      attention_mask: [B, S] bool or integer (non-zero: a real token), or None. Passed to the model.
      position_ids: [B, S] or [1, S] integer, or None. Passed to the model; packed rows come without attention_mask.
      temperature, entropy, working_memory: as ppo_ops.linear_log_probs_and_entropy's (linear_token_loss's with a
        token_loss); a per-row temperature is [B, S] float32, position i's for the token input_ids[b, i + 1]. A
        model of SOFTCAPPED_MODELS with final_logit_softcapping set gets its cap from the head (before the
        temperature, as its sampler sees the capped logits).
      row_mask: [B, S] bool or None: False positions do not count (e.g. the prompt).
      keep: ppo_ops' sparse keep set over the flattened [B * S] positions (row b * S + i predicts input_ids[b, i + 1]).
      token_loss: None, or a row-separable loss (e.g. ppo_ops.policy_loss) over [B, S] constants, position i holding
        those of the token input_ids[b, i + 1] (the last position padded, left out by its loss_mask).
      validate: ppo_ops' value checks, plus input_ids' range read before the model runs (one host sync more).
      reduction_order: the head's ("sglang": log-probs bit for bit SGLang's true on-policy LM head on the hidden
        states the model hands its output embedding; docs/api.md#sglang-reduction-order).

    Returns LogProbsEntropy(log_probs, entropy) ([B, S] fp32; entropy None with entropy="none"), or, with token_loss,
    (loss, LogProbsEntropy): the 0-d fp32 sum of the counted positions' terms and the detached values.

    Errors name the argument (a model it cannot serve: the model class): TypeError for a wrong type or dtype,
    ValueError for a wrong shape, value or token-loss row count, raised before the model runs, except what only its
    forward shows (its head not called once on every position, its logits changed after it, a DTensor weight).
    """
    causal_lm = _inside_ddp(model)
    head, config_vocab, softcap = _head(causal_lm)
    # a sharded weight (a DTensor: FSDP2, maybe offloaded to the CPU) says nothing of where the model computes
    _check_ids(input_ids, None if _is_dtensor(head.weight) else head.weight.device)
    attention_mask = _check_rows("attention_mask", attention_mask, input_ids, allow_int=True)
    row_mask = _check_rows("row_mask", row_mask, input_ids, allow_int=False)
    _check_positions(position_ids, input_ids)
    if token_loss is not None:
        check_token_loss_rows(_FN, token_loss, tuple(input_ids.shape), "input_ids' [B, S] positions", _HF_LOSS_ROWS)
    if validate is True:  # before the model's embedding, whose own error would name no argument
        _check_id_range(input_ids, _vocabulary(causal_lm, head, config_vocab), type(causal_lm).__name__)

    targets, counted = _targets(input_ids, attention_mask, position_ids, row_mask)
    opts = dict(entropy=entropy, temperature=temperature, row_mask=counted, validate=validate,
                reduction_order=reduction_order, **({"keep": keep} if keep is not None else {}),
                **({"softcap": softcap} if softcap is not None else {}))
    fused = _FusedHead(type(causal_lm).__name__, head, config_vocab, targets, token_loss, working_memory, opts)
    if torch.compiler.is_compiling():
        # Traced into a caller's compiled function: dynamo cannot trace putting the output embedding's forward back
        # (torch 2.11 refuses popping the instance attribute, 2.13 deleting it), so the body runs and the head takes
        # its last hidden states and the output embedding's weight as the module holds them (no wrapper runs here).
        body = _body(causal_lm)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False)
        return fused.results(fused.forward(body.last_hidden_state if hasattr(body, "last_hidden_state") else body[0]))
    with fused.in_place_of_forward(), _softcapping_off(causal_lm, softcap):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return fused.results(out.logits if hasattr(out, "logits") else out[0])


class _FusedHead:
    """The fused head in place of the output embedding's forward, for one call of the model's forward.

    forward(hidden) runs the head on the hidden states the model hands its output embedding and the weight as it is
    then (gathered, where a wrapper shards it), keeps what needs no gradient, and returns the outputs that carry one
    stacked as the model's "logits"; results() takes them back out of the model's output, checking that it is that
    tensor."""

    def __init__(self, model_name, head, config_vocab, targets, token_loss, working_memory, opts):
        self.model_name, self.head, self.config_vocab, self.targets = model_name, head, config_vocab, targets
        self.token_loss, self.working_memory, self.opts = token_loss, working_memory, opts
        self.returned = None  # what forward returned as the logits
        self.kept = None  # (loss or None, LogProbsEntropy)
        self.calls = 0

    @contextlib.contextmanager
    def in_place_of_forward(self):
        """self.forward in place of the output embedding's own forward during the model's call. Under accelerate's
        hooks (device_map dispatch, offloading) the instance's forward is the hook's, which calls the module's own,
        kept as `_old_forward`, between its steps: that one is swapped, so the hook still runs around the head."""
        head = self.head
        attr = "_old_forward" if _accelerate_hooked(head) else "forward"
        own = head.__dict__.get(attr)
        setattr(head, attr, self.forward)
        try:
            yield
        finally:
            if own is None:
                delattr(head, attr)
            else:
                setattr(head, attr, own)

    def forward(self, hidden):
        self.calls += 1
        if self.calls > 1:
            raise self._refused("calls its output embedding more than once in one forward")
        weight = self.head.weight
        _check_weight(self.model_name, weight)
        if weight.device != self.targets.device:
            raise argument_error(ValueError, _FN, "input_ids", "input_ids must be on the device the model computes on, "
                                 f"{weight.device} (its output embedding's weight), got {self.targets.device}")
        if hidden.dim() != 3 or hidden.shape[:2] != self.targets.shape or hidden.shape[2] != weight.shape[1]:
            raise self._refused(f"hands its output embedding hidden states of shape {tuple(hidden.shape)}, not one "
                                f"[H = {weight.shape[1]}] row per position of input_ids {tuple(self.targets.shape)}")
        hidden = hidden.to(weight.dtype)  # a no-op for a model in one dtype; else the cast such models make
        # the rows past the config's vocabulary (a padded one) get no mass; read here, where the weight is whole
        vocab = self.config_vocab
        vocab_size = vocab if vocab is not None and vocab < weight.shape[0] else None
        if self.token_loss is None:
            out = ppo_ops.linear_log_probs_and_entropy(hidden, weight, self.targets, vocab_size=vocab_size,
                                                       working_memory=self.working_memory, **self.opts)
            self.kept = (None, out)
            carried = [t for t in out if t is not None and t.requires_grad]
        else:
            loss, out = ppo_ops.linear_token_loss(hidden, weight, self.targets, self.token_loss, vocab_size=vocab_size,
                                                  working_memory=self.working_memory, **self.opts)
            self.kept = (loss, out)
            carried = [loss] if loss.requires_grad else []
        # [k, B, S] (the loss: [1]): each output a contiguous view of it again in results()
        self.returned = torch.stack(carried) if carried else hidden.new_empty(0, dtype=torch.float32)
        return self.returned

    def results(self, logits):
        if self.calls != 1:
            raise self._refused("never called its output embedding in its forward")
        if logits is not self.returned:
            raise self._refused("changes what its output embedding returns before returning it as its logits (a "
                                "scale, a cap or a cast the fused head does not make)")
        loss, out = self.kept
        if not logits.requires_grad:
            return out if loss is None else (loss, out)
        if loss is not None:
            return logits.reshape(()), out
        carried = iter(logits.unbind(0))
        log_probs = next(carried) if out.log_probs.requires_grad else out.log_probs
        entropy = next(carried) if out.entropy is not None and out.entropy.requires_grad else out.entropy
        return type(out)(log_probs, entropy)

    def _refused(self, what):
        return argument_error(ValueError, _FN, "model", f"{self.model_name} {what}: the fused head cannot stand in "
                                                        "for its output embedding")


@contextlib.contextmanager
def _softcapping_off(model, softcap):
    """The model's final_logit_softcapping off while its forward runs (the head applied it), restored after."""
    if softcap is None:
        yield
        return
    config = model.config
    setattr(config, _SOFTCAP, None)
    try:
        yield
    finally:
        setattr(config, _SOFTCAP, softcap)


def _inside_ddp(model):
    """The causal LM a DistributedDataParallel wraps (its forward, not the inner one, must run: it prepares the
    backward's gradient all-reduce), or the model itself."""
    from torch.nn.parallel import DistributedDataParallel
    return model.module if isinstance(model, DistributedDataParallel) else model


def _accelerate_hooked(module) -> bool:
    """accelerate's add_hook_to_module: an instance forward that runs `_hf_hook` around `_old_forward`."""
    return "forward" in module.__dict__ and "_old_forward" in module.__dict__ and hasattr(module, "_hf_hook")


def _is_dtensor(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def _check_weight(model_name, weight):
    """The output embedding's weight as the model's forward hands it to its head: a whole [V, H] float tensor."""
    if _is_dtensor(weight):
        raise argument_error(TypeError, _FN, "model", f"{model_name}'s output embedding weight is a DTensor inside its "
                             "forward (sharded by tensor parallelism): the fused head needs the whole weight there, as "
                             "FSDP gathers it")
    _check_dtype(model_name, weight)


def _check_dtype(model_name, weight):
    if weight.dtype not in FLOAT_DTYPES:
        raise argument_error(TypeError, _FN, "model", f"{model_name} is in {weight.dtype}: ppo_ops' head takes "
                                                      "float32, bfloat16 or float16 models")


def _head(model):
    """The output embedding (an nn.Linear, weight [V, H]), the config's vocabulary size (None: not given) and the
    softcap the head serves (None: none), after refusing what the fused head cannot compute."""
    name = type(model).__name__
    if not isinstance(model, nn.Module):
        raise argument_error(TypeError, _FN, "model", f"model must be a transformers causal LM (an nn.Module), got "
                                                      f"{name}")
    if _body(model) is None:
        raise argument_error(TypeError, _FN, "model",
                             f"{name} has no base model (model.base_model or model.model), as a causal LM has: pass "
                             "the causal LM (e.g. Qwen3ForCausalLM), not its body")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        raise argument_error(TypeError, _FN, "model", f"{name} has no output embedding (get_output_embeddings() is "
                                                      "None): not a causal LM with an LM head")
    if not isinstance(head, nn.Linear):
        raise argument_error(TypeError, _FN, "model", f"{name}'s output embedding is a {type(head).__name__}, not an "
                                                      "nn.Linear: its logits are not hidden @ weight.T")
    if head.bias is not None:
        raise argument_error(ValueError, _FN, "model", f"{name}'s output embedding has a bias, which the fused head "
                                                       "does not add")
    if "forward" in head.__dict__ and not _accelerate_hooked(head):
        raise argument_error(TypeError, _FN, "model", f"{name}'s output embedding has a forward of its own instance "
                             "(a wrapper's that is not accelerate's hook): the fused head cannot run inside it")
    configs = [getattr(model, "config", None)]
    text_config = getattr(configs[0], "get_text_config", None)
    if callable(text_config):
        configs.append(text_config())
    softcap = _served_softcap(model, configs[0])
    for setting, neutral in LOGIT_TRANSFORMS.items():
        for where, holder in [("config", c) for c in configs if c is not None] + [("model", model)]:
            value = getattr(holder, setting, None)
            if softcap is not None and setting == _SOFTCAP and where == "config" and value == softcap:
                continue  # the head applies it
            if not _neutral(value, neutral):
                raise argument_error(ValueError, _FN, "model",
                                     f"{name} transforms its logits ({where}.{setting}={_show(value)}; the fused head "
                                     f"computes hidden @ weight.T only, and serves only {_show(neutral)} there)")
    if getattr(model, "final_logits_bias", None) is not None:
        raise argument_error(ValueError, _FN, "model", f"{name} adds final_logits_bias to its logits, which the fused "
                                                       "head does not add")
    _check_dtype(name, head.weight)  # before the model runs; _check_weight sees the gathered weight again
    vocab = None
    for config in reversed(configs):  # the text config's vocabulary where there is one
        size = getattr(config, "vocab_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            vocab = size
            break
    return head, vocab, softcap


def _served_softcap(model, config):
    """The final_logit_softcapping the head serves for `model`: its config's, where the model is of
    SOFTCAPPED_MODELS (transformers' own class, whose forward caps as Gemma 2's) and the value a real > 0; else None
    (and _head's check refuses a non-neutral setting)."""
    cls = type(model)
    if cls.__name__ not in SOFTCAPPED_MODELS or not cls.__module__.startswith("transformers.models."):
        return None
    value = getattr(config, _SOFTCAP, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        return None
    return float(value)


def _body(model):
    """The causal LM's body (the module yielding its last hidden states), or None: `base_model`, or, where that
    falls back to the model itself (a base_model_prefix naming no attribute, as Llama4ForCausalLM's and
    MllamaForCausalLM's "language_model" beside their `model`), the `model` attribute."""
    for body in (getattr(model, "base_model", None), getattr(model, "model", None)):
        if isinstance(body, nn.Module) and body is not model:
            return body
    return None


def _neutral(value, neutral) -> bool:
    if isinstance(value, torch.Tensor):
        return False  # a learnt or buffered scale: never known to be neutral
    return any(value is None if n is None else (value is not None and not isinstance(value, bool)
                                                and isinstance(value, (int, float)) and value == n) for n in neutral)


def _show(value) -> str:
    if isinstance(value, tuple):
        return " or ".join(repr(v) for v in value)
    return "a tensor" if isinstance(value, torch.Tensor) else repr(value)


def _check_ids(input_ids, device):
    if not isinstance(input_ids, torch.Tensor):
        raise argument_error(TypeError, _FN, "input_ids",
                             f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise argument_error(TypeError, _FN, "input_ids",
                             f"input_ids must hold integer token ids, got {input_ids.dtype}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise argument_error(ValueError, _FN, "input_ids",
                             f"input_ids must have shape [B, S] with S >= 1, got {tuple(input_ids.shape)}")
    if device is not None and input_ids.device != device:
        raise argument_error(ValueError, _FN, "input_ids",
                             f"input_ids must be on the model's device {device}, got {input_ids.device}")


def _vocabulary(model, head, config_vocab) -> int:
    """The ids the model takes and its head scores: the least of its config's vocab_size, its output embedding's
    rows and its input embedding's (an id past any of them fails there). Read from the modules' sizes, not their
    weights, which a wrapper may hold flattened or sharded outside the forward (FSDP)."""
    sizes = [head.out_features] + ([config_vocab] if config_vocab is not None else [])
    get_input = getattr(model, "get_input_embeddings", None)
    embedding = get_input() if callable(get_input) else None
    if isinstance(getattr(embedding, "num_embeddings", None), int):
        sizes.append(embedding.num_embeddings)
    return min(sizes)


def _check_id_range(input_ids, vocab, model_name):
    """Every id in [0, vocab): one host read of input_ids' bounds (validate=True), before the model runs."""
    if input_ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(input_ids)).tolist())
    if lo < 0 or hi >= vocab:
        raise argument_error(ValueError, _FN, "input_ids",
                             f"input_ids must be token ids in [0, {vocab}) ({model_name}'s vocabulary), got values in "
                             f"[{lo}, {hi}]")


def _check_rows(name, mask, input_ids, allow_int):
    if mask is None:
        return None
    kinds = "a bool or integer" if allow_int else "a bool"
    if not isinstance(mask, torch.Tensor):
        raise argument_error(TypeError, _FN, name, f"{name} must be {kinds} tensor or None, got {type(mask).__name__}")
    if not (mask.dtype == torch.bool or (allow_int and not mask.dtype.is_floating_point and not mask.dtype.is_complex)):
        raise argument_error(TypeError, _FN, name, f"{name} must be {kinds} tensor, got {mask.dtype}")
    if mask.shape != input_ids.shape:
        raise argument_error(ValueError, _FN, name, f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got "
                                                    f"{tuple(mask.shape)}")
    if mask.device != input_ids.device:
        raise argument_error(ValueError, _FN, name, f"{name} must be on {input_ids.device} like input_ids, got "
                                                    f"{mask.device}")
    return mask


def _check_positions(position_ids, input_ids):
    if position_ids is None:
        return
    batch, seq = input_ids.shape
    if (not isinstance(position_ids, torch.Tensor) or position_ids.dtype.is_floating_point
            or position_ids.dtype.is_complex or position_ids.dtype == torch.bool):
        got = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise argument_error(TypeError, _FN, "position_ids",
                             f"position_ids must be an integer tensor or None, got {got}")
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq:
        raise argument_error(ValueError, _FN, "position_ids", f"position_ids must have shape [{batch}, {seq}] or "
                             f"[1, {seq}] (input_ids' [B, S]), got {tuple(position_ids.shape)}")
    if position_ids.device != input_ids.device:
        raise argument_error(ValueError, _FN, "position_ids",
                             f"position_ids must be on {input_ids.device} like input_ids, got {position_ids.device}")


def _targets(input_ids, attention_mask, position_ids, row_mask):
    """The next token of each position ([B, S], 0 at the last) and which positions count ([B, S] bool); no host
    sync."""
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    counted = torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    counted[:, -1] = False
    if attention_mask is not None:
        real = attention_mask != 0
        counted[:, :-1] &= real[:, :-1] & real[:, 1:]
    if position_ids is not None:
        pos = position_ids.expand(input_ids.shape)
        counted[:, :-1] &= pos[:, 1:] == pos[:, :-1] + 1
    if row_mask is not None:
        counted &= row_mask
    return torch.where(counted, targets, 0), counted
