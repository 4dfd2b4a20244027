"""The model under check: a Qwen3 checkpoint directory, generated from a seed or given by the user, and its fingerprint.

`--model` is `tiny` (a small Qwen3 for CPU), `qwen3-0.6b-random` (the real Qwen3-0.6B architecture with seeded random
weights, for GPU) or the path of a local Hugging Face Qwen3 checkpoint. Generated models are written once as ordinary
checkpoints (config.json + model.safetensors, so SGLang can serve them too) under
`<cache_dir>/<name>-seed<seed>-<config hash>/`, built in a temporary folder and renamed into place, so a half-written
model is never reused.

Peaked random models: with Hugging Face's init (std 0.02) the final hidden state has unit RMS, so the logits have std
about 0.02 * sqrt(hidden) (0.16 for `tiny`, 0.64 for 0.6B) and softmax is nearly uniform (entropy ~ log V): sampling
would be noise. The final RMSNorm weight is therefore set to a constant `final_norm_scale`, which multiplies every
logit by it. Measured over random contexts: `tiny` at 28 gives logit std 4.5 and a mean entropy of 2.5 nats
(max 4.3); `qwen3-0.6b-random` at 10 gives logit std 6.4 and a mean entropy of 2.4 nats (max 4.2). `tiny` unties
its LM head: a 2-layer model with tied embeddings mostly predicts its input token back (98% of argmaxes).

The fingerprint is a SHA-256 over the weights (tensor name, dtype, shape, bytes, in name order; independent of how the
checkpoint is sharded), so a saved rollout can be checked against the model it is replayed with.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Optional

import torch

from sglang_checks.errors import CheckError

# Architecture of each generated model (Qwen3Config fields) and the constant its final RMSNorm weight is set to.
PRESETS: Dict[str, Dict[str, Any]] = {
    "tiny": dict(
        config=dict(
            vocab_size=4096,  # divisible by 128 * TP for TP up to 32 (Megatron padding rule), and by 8 segments
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
        ),
        dtype="float32",
        final_norm_scale=28.0,
    ),
    # Qwen3-0.6B's public config.json, stored in bf16 as the real checkpoint is.
    "qwen3-0.6b-random": dict(
        config=dict(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645, max_window_layers=28,
        ),
        dtype="bfloat16",
        final_norm_scale=10.0,
    ),
}

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Where the checkpoint is and what the check needs to know about it."""

    name: str  # `tiny`, `qwen3-0.6b-random`, or the user's path
    path: str  # the checkpoint directory
    fingerprint: str
    vocab_size: int
    eos_token_id: Optional[List[int]]  # ids that end a completion (None: generation never stops early)
    has_tokenizer: bool
    generated: bool
    seed: Optional[int]


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ppo_ops", "models")


def resolve_model(spec: str, *, cache_dir: str, seed: int, log: Callable[[str], None] = print) -> ModelInfo:
    """Returns the checkpoint for `--model=spec`, generating (and caching) it first for the built-in names."""
    if spec in PRESETS:
        return _generated(spec, cache_dir=cache_dir, seed=seed, log=log)
    return _local(spec)


def load_hf_model(info: ModelInfo, *, dtype: torch.dtype, device: torch.device):
    """The checkpoint as a transformers Qwen3ForCausalLM in eval mode (eager attention: same kernels everywhere)."""
    from transformers import Qwen3ForCausalLM

    try:
        model = Qwen3ForCausalLM.from_pretrained(info.path, dtype=dtype, attn_implementation="eager")
    except Exception as exc:  # a corrupt or incomplete checkpoint: report it as bad input, not a crash
        raise CheckError(f"--model={info.name}: could not load the checkpoint in {info.path}: {exc}") from exc
    return model.to(device).eval()


def state_checksums(model) -> Dict[str, str]:
    """SHA-256 of every tensor of a loaded model's state dict (dtype, shape and bytes), by name: what the training
    steps compare between the trainer and the engine after a weight sync (train_steps.py)."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous().cpu()
        digest = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = digest.hexdigest()
    return out


def _config_hash(preset: Dict[str, Any], seed: int) -> str:
    blob = json.dumps({"preset": preset, "seed": seed}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _generated_path(name: str, cache_dir: str, seed: int) -> str:
    return os.path.join(cache_dir, f"{name}-seed{seed}-{_config_hash(PRESETS[name], seed)}")


def cached_fingerprint(name: str, *, cache_dir: str, seed: int) -> Optional[str]:
    """The fingerprint of generated model `name` for `seed` when it is already in the cache (None when it would
    have to be built): read from its fingerprint.json, no weights touched."""
    try:
        with open(os.path.join(_generated_path(name, cache_dir, seed), "fingerprint.json")) as f:
            return json.load(f)["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _generated(name: str, *, cache_dir: str, seed: int, log: Callable[[str], None]) -> ModelInfo:
    preset = PRESETS[name]
    path = _generated_path(name, cache_dir, seed)
    meta_path = os.path.join(path, "fingerprint.json")
    if not os.path.isfile(meta_path):
        log(f"building {name} (seed {seed}) into {path}")
        _build(preset, seed, path)
    with open(meta_path) as f:
        meta = json.load(f)
    eos = preset["config"].get("eos_token_id")
    return ModelInfo(name=name, path=path, fingerprint=meta["fingerprint"], vocab_size=preset["config"]["vocab_size"],
                     eos_token_id=None if eos is None else [eos], has_tokenizer=False, generated=True, seed=seed)


def _build(preset: Dict[str, Any], seed: int, path: str) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**preset["config"])
    # Initialise on CPU from a private RNG state: the same weights on every machine, the caller's RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(preset["final_norm_scale"])
    model = model.to(getattr(torch, preset["dtype"]))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(path) or ".")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        meta = {"fingerprint": checkpoint_fingerprint(tmp), "seed": seed,
                "final_norm_scale": preset["final_norm_scale"]}
        with open(os.path.join(tmp, "fingerprint.json"), "w") as f:
            json.dump(meta, f, indent=1)
        try:
            os.replace(tmp, path)
        except OSError:  # another run finished the same model first: keep theirs
            if not os.path.isfile(os.path.join(path, "fingerprint.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def peek(spec: str):
    """(vocabulary size, tokenizer directory or None) of --model=spec without building or loading weights."""
    if spec in PRESETS:
        return PRESETS[spec]["config"]["vocab_size"], None
    config = _local_config(spec)
    has_tokenizer = any(os.path.isfile(os.path.join(spec, n)) for n in ("tokenizer.json", "tokenizer_config.json"))
    return config["vocab_size"], os.path.abspath(spec) if has_tokenizer else None


def _local(spec: str) -> ModelInfo:
    config = _local_config(spec)
    eos = _eos_ids(spec, config)
    has_tokenizer = any(os.path.isfile(os.path.join(spec, n)) for n in ("tokenizer.json", "tokenizer_config.json"))
    return ModelInfo(name=spec, path=os.path.abspath(spec), fingerprint=checkpoint_fingerprint(spec),
                     vocab_size=config["vocab_size"], eos_token_id=eos, has_tokenizer=has_tokenizer, generated=False,
                     seed=None)


def _local_config(spec: str) -> Dict[str, Any]:
    """config.json of a local checkpoint directory, checked; the weights must exist (not read here)."""
    flag = f"--model={spec}"
    if not os.path.isdir(spec):
        raise CheckError(
            f"{flag}: no such directory, and not a built-in model ({', '.join(PRESETS)}); expected a local Hugging "
            f"Face Qwen3 checkpoint directory")
    config_path = os.path.join(spec, "config.json")
    if not os.path.isfile(config_path):
        raise CheckError(f"{flag}: no config.json in the directory; expected a Hugging Face Qwen3 checkpoint")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckError(f"{flag}: config.json is not valid JSON ({exc})") from exc
    if not isinstance(config, dict) or config.get("model_type") != "qwen3":
        found = config.get("model_type") if isinstance(config, dict) else type(config).__name__
        raise CheckError(f"{flag}: config.json has model_type {found!r}; this check supports Qwen3 (qwen3)")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if not isinstance(config.get(key), int) or config[key] < 1:
            raise CheckError(f"{flag}: config.json needs a positive integer {key!r}, got {config.get(key)!r}")
    if not any(glob.glob(os.path.join(spec, p)) for p in _WEIGHT_PATTERNS):
        raise CheckError(f"{flag}: no weights (*.safetensors or pytorch_model*.bin) in the directory")
    return config


def _eos_ids(path: str, config: Dict[str, Any]) -> Optional[List[int]]:
    """End-of-sequence ids: generation_config.json's (what serving uses), else config.json's."""
    eos = config.get("eos_token_id")
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        try:
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id", eos)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckError(f"--model={path}: generation_config.json is not valid JSON ({exc})") from exc
    if eos is None:
        return None
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def checkpoint_fingerprint(path: str) -> str:
    """SHA-256 over the weights: safetensors tensors in name order (any sharding), else the raw .bin files."""
    digest = hashlib.sha256()
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        from safetensors import safe_open

        where = {}
        try:
            for file in files:
                with safe_open(file, framework="pt") as f:
                    where.update({key: file for key in f.keys()})
            for key in sorted(where):
                with safe_open(where[key], framework="pt") as f:
                    tensor = f.get_tensor(key).contiguous()
                digest.update(f"{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
                digest.update(tensor.view(torch.uint8).numpy().tobytes())
        except Exception as exc:  # truncated or not a safetensors file
            raise CheckError(f"--model={path}: cannot read the weights ({exc})") from exc
        return digest.hexdigest()
    for file in sorted(glob.glob(os.path.join(path, "pytorch_model*.bin"))):
        digest.update(os.path.basename(file).encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()
