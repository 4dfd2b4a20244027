"""The check's flags, defined once, and the settings built from them (shared by qwen3_parallel_check and calibrate).

Every flag is an absl holder; `settings_from_flags` reads the holders (their parsed values, or their defaults when
nothing was parsed), so no default is restated anywhere else.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Optional, Tuple

from absl import flags

from sglang_checks import check, controls, logprob_kinds, models, tolerances, trainer
from sglang_checks.engines import sglang_engine
from ppo_ops.runtime import cli as runtime_cli
from sglang_checks.errors import CheckError

_MODEL = flags.DEFINE_string(
    "model", "tiny", "`tiny` (small Qwen3 from --seed, CPU), `qwen3-0.6b-random` (Qwen3-0.6B architecture, seeded "
    "random weights, GPU) or a local Hugging Face Qwen3 checkpoint directory.")
_CACHE_DIR = flags.DEFINE_string("cache_dir", None, "Where generated models are cached (default: "
                                 "$XDG_CACHE_HOME or ~/.cache, then ppo_ops/models).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated model's weights and of sampling.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Model dtype for the engine and the trainer; picks the default tolerances.")
_DEVICE = flags.DEFINE_enum("device", "auto", ["auto", "cpu", "cuda"],
                            "Device of the hf engine and the trainer (auto: cuda when visible). cuda runs trainer "
                            "ranks over NCCL, one GPU each; cpu over gloo.")
_CPU_THREADS = flags.DEFINE_integer("cpu_threads", 1, "torch threads per process (the tiny model gains nothing "
                                    "from more; raise it for bigger models on CPU).")
_ENGINE = flags.DEFINE_enum("engine", "hf", ["hf", "sglang"], "Rollout engine: hf (embedded transformers) or "
                            "sglang (a launched SGLang server per engine layout).")
_ENGINE_LAYOUTS = flags.DEFINE_string("engine_layouts", "tp1", "Engine layouts, e.g. tp1,tp2,dp2 (hf: tp1 and dpN "
                                      "only). The first samples the rollout; each teacher-force scores it.")
_TRAINER_LAYOUTS = flags.DEFINE_string("trainer_layouts", "tp1,tp2,tp4,cp2,dp2,tp2-fused",
                                       "Trainer layouts: tpN (vocabulary), cpN (sequence), dpN (batch), combined "
                                       "like tp2cp2; each is compared with tp1 (added when missing). A name ending "
                                       "in -fused scores with ppo_ops' fused LM head (linear_token_loss, no logits) "
                                       "and is compared with tp1-unfused, the same head unfused (fp32 logits, no "
                                       "keep mask; sglang_checks/trainer.py); --trainer_numerics=hf only.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Rollout sampling temperature.")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Rollout top-p.")
_TRAINER_TEMPERATURE = flags.DEFINE_float("trainer_temperature", None, "Temperature the trainer scores at (default: "
                                          "the rollout's). Another value reproduces a classic RL bug; the check "
                                          "then fails.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 24, "Completion length limit.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "How many built-in prompts (1-8), or the first N of --prompts.")
_SAMPLES_PER_PROMPT = flags.DEFINE_integer("samples_per_prompt", 2, "Completions per prompt (a GRPO group).")
_PROMPTS = flags.DEFINE_string("prompts", None, "JSONL file of prompts: {\"input_ids\": [...]} or {\"text\": ...} "
                               "per line.")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "Always generate --max_new_tokens tokens.")
_ROLLOUT_DATA = flags.DEFINE_string("rollout_data", None, "Replay this saved rollout.json instead of sampling.")
_REPORT_DIR = flags.DEFINE_string("report_dir", None, "Report folder (default: reports/qwen3_parallel_check under "
                                  "the workspace with `bazel run`, else under the current directory).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 0, "Trainer sequence length (padded); 0: the longest sequence rounded "
                                "up so every CP size divides it.")
_ENTROPY_COEF = flags.DEFINE_float("entropy_coef", 0.01, "Entropy bonus in the surrogate loss (0: entropy is only "
                                   "reported, not differentiated).")
_MAX_RANKS = flags.DEFINE_integer("max_ranks", 8, "Most ranks a trainer layout may use (with NCCL also at most one "
                                  "per visible GPU).")
_TRAIN_STEPS = flags.DEFINE_integer(
    "train_steps", 0, "After the check, this many GRPO steps of one tp1 trainer in this process (AdamW on fp32 master "
    "weights, reward.py's token reward), each followed by a weight sync into every engine layout (hf: in place; "
    "SGLang: /update_weights_from_disk), a new rollout and the check of that step: synced weights equal the "
    "trainer's, trainer-engine mismatch and ratio within tolerance, every trainer layout against tp1 "
    "(sglang_checks/train_steps.py). 0: no training. `bazel run` of the check passes --train_steps=8 "
    "--samples_per_prompt=4 (BUILD).")
_LR = flags.DEFINE_float("lr", 1e-3, "AdamW learning rate of --train_steps.")
_TRAIN_HEAD = flags.DEFINE_enum(
    "train_head", "logits", ["logits", "fused"], "What --train_steps trains with: logits (h @ W^T, then ppo_ops' "
    "logits op) or fused (ppo_ops.linear_token_loss, the GRPO loss in the head's forward; SGLang's exact order under "
    "--trainer_numerics=sglang_on_policy).")
_REFERENCE_TRAINER = flags.DEFINE_bool(
    "reference_trainer", False, "With --train_steps: replay every step's rollout through a textbook PyTorch trainer "
    "(fp32 log_softmax + gather + softmax entropy, the same GRPO loss, AdamW and masters) from the same initial "
    "weights; its first step's loss and gradient norm must agree with the ppo_ops trainer's within trainer_rtol, its "
    "policy reward and loss stay within the bands of tolerances.py at every step.")
_TRAINER_TIMEOUT = flags.DEFINE_float("trainer_timeout_s", 900.0, "Time limit of all trainer layouts together.")
_TOLERANCES = {name: flags.DEFINE_float(name, None, f"Default: the calibrated value for --dtype when installed "
                                        f"(tolerances.py), else {default.float32:g} (float32) / "
                                        f"{default.bfloat16:g} (bfloat16): {default.reason}.")
               for name, default in tolerances.DEFAULTS.items()}
_SGLANG_PYTHON = flags.DEFINE_string("sglang_python", sys.executable, "Interpreter that has sglang installed.")
_SGLANG_PORT = flags.DEFINE_integer("sglang_port", 0, "Port of the SGLang server on 127.0.0.1 (0: a free one).")
_SGLANG_START_TIMEOUT = flags.DEFINE_float("sglang_start_timeout_s", 900.0, "How long a server may take to start.")
_SGLANG_REQUEST_TIMEOUT = flags.DEFINE_float("sglang_request_timeout_s", 600.0, "Time limit of one request.")
_DETERMINISTIC = flags.DEFINE_bool("deterministic_inference", False, "Launch SGLang with "
                                   "--enable-deterministic-inference (batch-invariant kernels) and seed its sampling.")
_RL_ON_POLICY_TARGET = flags.DEFINE_enum(
    "sglang_rl_on_policy_target", None, list(sglang_engine.RL_ON_POLICY_TARGETS),
    "Launch SGLang with --rl-on-policy-target (true on-policy: sampler log-probs from log_softmax of bf16 logits / T; "
    "implies deterministic inference).")
_SGLANG_ATTENTION_BACKEND = flags.DEFINE_string("sglang_attention_backend", None, "SGLang --attention-backend "
                                                "(unset: SGLang's choice). Pass triton when the SGLang install of "
                                                "--sglang_python has no FA3 kernels.")
_SGLANG_SAMPLING_BACKEND = flags.DEFINE_string("sglang_sampling_backend", None, "SGLang --sampling-backend (unset: "
                                               "SGLang's choice). Pass pytorch when the SGLang install of "
                                               "--sglang_python has no FlashInfer sampling kernels.")
_SGLANG_DISABLE_CUSTOM_ALL_REDUCE = flags.DEFINE_bool("sglang_disable_custom_all_reduce", False,
                                                      "SGLang --disable-custom-all-reduce (NCCL all-reduce). Pass "
                                                      "it when the SGLang install of --sglang_python has no FA3 / "
                                                      "FlashInfer sampling kernels.")
_SGLANG_MM_FEATURE_TRANSPORT = flags.DEFINE_enum("sglang_mm_feature_transport", None, ["cpu", "cuda_ipc"],
                                                 "SGLang --mm-feature-transport (unset: SGLang's choice). Pass cpu "
                                                 "when the SGLang install of --sglang_python has no FA3 / FlashInfer "
                                                 "sampling kernels.")
_SGLANG_DISABLE_CUDA_GRAPH = flags.DEFINE_bool("sglang_disable_cuda_graph", False, "No decode CUDA graphs either "
                                               "(faster start-up; piecewise prefill graphs are always off).")
_SGLANG_SKIP_WARMUP = flags.DEFINE_bool("sglang_skip_server_warmup", False, "SGLang --skip-server-warmup.")
_EXPECT_BITWISE = flags.DEFINE_bool(
    "expect_bitwise", False, "Demand bitwise agreement: teacher-forced trainer - engine log-probs and engine layout "
    "differences must be exactly 0 (for configurations that claim it, e.g. deterministic inference with a trainer "
    "of the same numerics); any other value FAILs naming the metric.")
_NEGATIVE_CONTROL = flags.DEFINE_enum(
    "negative_control", controls.NONE, list(controls.NAMES),
    "Testing aid: inject a known fault the check must FAIL on (sglang_checks/controls.py): "
    + "; ".join([f"{name}: {what}" for name, (what, _) in controls.CONTROLS.items()]
                + [f"{name}: {what} (caught only with --expect_bitwise)"
                   for name, what in controls.BITWISE_CONTROLS.items()]) + ".")
_SGLANG_MEM_FRACTION = flags.DEFINE_float("sglang_mem_fraction", None, "SGLang --mem-fraction-static.")
_SGLANG_EXTRA_ARGS = flags.DEFINE_string("sglang_extra_args", "", "More server arguments, shell-quoted.")
_TRAINER_NUMERICS = flags.DEFINE_enum(
    "trainer_numerics", trainer.HF, list(trainer.NUMERICS),
    "The trainer's forward: hf (transformers' Qwen3ForCausalLM, eager attention, in --dtype) or sglang_on_policy "
    "(SGLang's --rl-on-policy-target forward op by op, with its batch-invariant kernels and log_softmax order, "
    "sglang_checks/on_policy.py; needs --engine=sglang --sglang_rl_on_policy_target=fsdp "
    "--sglang_attention_backend=triton --dtype=bfloat16 on CUDA, and imports sglang from --sglang_python's site "
    "folder).")
_SGLANG_DUMP_TENSORS = flags.DEFINE_bool(
    "sglang_dump_tensors", False, "Launch SGLang with --debug-tensor-dump-output-folder <report_dir>/engine_dump/"
    "<engine layout> (every forward pass's module outputs; SGLang then runs without CUDA graphs and warmup) and, "
    "with --trainer_numerics=sglang_on_policy, name the first tensor where trainer and engine part "
    "(sglang_checks/layer_diff.py; report.json's layer_diff).")
_SGLANG_LOGPROB_KIND = flags.DEFINE_enum(
    "sglang_logprob_kind", logprob_kinds.TEMPERATURE, [logprob_kinds.TEMPERATURE, logprob_kinds.RAW],
    "What SGLang's sampled log-probs are: temperature (0.5.17 default: log softmax(logits / T)) or raw (also sets "
    "SGLANG_RETURN_ORIGINAL_LOGPROB=1 for the server). The trainer computes the same kind.")


def default_report_dir() -> str:
    root = os.environ.get("BUILD_WORKSPACE_DIRECTORY") or os.getcwd()
    return os.path.join(root, "reports", "qwen3_parallel_check")


def _path(value: Optional[str]) -> Optional[str]:
    """A path flag's value as the caller meant it: relative to where they ran the command (also under bazel run)."""
    return None if value is None else runtime_cli.caller_path(value)


def _executable(value: str) -> str:
    """An interpreter: a bare name is looked up on PATH by the OS; a relative path is the caller's."""
    return value if os.sep not in value else runtime_cli.caller_path(value)


def _server_args(value: str) -> Tuple[str, ...]:
    try:
        return tuple(shlex.split(value))
    except ValueError as exc:  # an unbalanced quote: bad input, not a crash
        raise CheckError(f"--sglang_extra_args={value}: not a shell-quoted argument list ({exc})") from exc


def _value(holder):
    """The holder's parsed value, or its default when no command line was parsed (tests, calibrate's callers)."""
    return flags.FLAGS[holder.name].value


def settings(**overrides) -> check.Settings:
    """The check's settings from the flag holders, then `overrides` (field names as in check.Settings). Relative
    paths, in flags and overrides alike, are the caller's (runtime_cli.caller_path)."""
    explicit = tuple(name for name in flags.FLAGS if flags.FLAGS[name].present)
    values = dict(
        report_dir=_value(_REPORT_DIR) or default_report_dir(),
        model=_value(_MODEL), cache_dir=_value(_CACHE_DIR) or models.default_cache_dir(), seed=_value(_SEED),
        dtype=_value(_DTYPE), device=_value(_DEVICE), cpu_threads=_value(_CPU_THREADS), engine=_value(_ENGINE),
        engine_layouts=_value(_ENGINE_LAYOUTS), trainer_layouts=_value(_TRAINER_LAYOUTS),
        temperature=_value(_TEMPERATURE), top_p=_value(_TOP_P), trainer_temperature=_value(_TRAINER_TEMPERATURE),
        max_new_tokens=_value(_MAX_NEW_TOKENS), num_prompts=_value(_NUM_PROMPTS),
        samples_per_prompt=_value(_SAMPLES_PER_PROMPT), prompts=_value(_PROMPTS), ignore_eos=_value(_IGNORE_EOS),
        rollout_data=_value(_ROLLOUT_DATA), explicit_flags=explicit, seq_len=_value(_SEQ_LEN),
        entropy_coef=_value(_ENTROPY_COEF), train_steps=_value(_TRAIN_STEPS), lr=_value(_LR),
        reference_trainer=_value(_REFERENCE_TRAINER), train_head=_value(_TRAIN_HEAD),
        max_ranks=_value(_MAX_RANKS), trainer_timeout_s=_value(_TRAINER_TIMEOUT),
        tolerances={name: _value(holder) for name, holder in _TOLERANCES.items()},
        expect_bitwise=_value(_EXPECT_BITWISE), negative_control=_value(_NEGATIVE_CONTROL),
        trainer_numerics=_value(_TRAINER_NUMERICS), sglang_dump_tensors=_value(_SGLANG_DUMP_TENSORS),
        sglang=sglang_engine.ServerOptions(
            python=_executable(_value(_SGLANG_PYTHON)), port=_value(_SGLANG_PORT),
            start_timeout_s=_value(_SGLANG_START_TIMEOUT),
            request_timeout_s=_value(_SGLANG_REQUEST_TIMEOUT), deterministic=_value(_DETERMINISTIC),
            rl_on_policy_target=_value(_RL_ON_POLICY_TARGET), attention_backend=_value(_SGLANG_ATTENTION_BACKEND),
            sampling_backend=_value(_SGLANG_SAMPLING_BACKEND),
            disable_custom_all_reduce=_value(_SGLANG_DISABLE_CUSTOM_ALL_REDUCE),
            mm_feature_transport=_value(_SGLANG_MM_FEATURE_TRANSPORT),
            disable_cuda_graph=_value(_SGLANG_DISABLE_CUDA_GRAPH), skip_server_warmup=_value(_SGLANG_SKIP_WARMUP),
            mem_fraction_static=_value(_SGLANG_MEM_FRACTION), extra_args=_server_args(_value(_SGLANG_EXTRA_ARGS)),
            logprob_kind=_value(_SGLANG_LOGPROB_KIND)))
    unknown = set(overrides) - set(values)
    if unknown:
        raise TypeError(f"settings: unknown fields {sorted(unknown)}")
    values.update(overrides)
    for name in ("report_dir", "cache_dir", "prompts", "rollout_data"):
        values[name] = _path(values[name])
    if values["model"] not in models.PRESETS:  # a local checkpoint directory
        values["model"] = _path(values["model"])
    return check.Settings(**values)


settings_from_flags = settings  # what the binaries call after parsing

