"""What only SGLang's own kernels can check, run under SGLang's interpreter: `python -m tests.sglang_kernels_check`
(tests/test_sglang_kernels.py runs it in a child process with $PPO_OPS_SGLANG_PYTHON, because SGLang imports only
beside the packages it was installed with, not into the runner's test interpreter). Needs a CUDA GPU.

Prints one JSON object:
- "order": {case: bool} ppo_ops' reduction_order="sglang" log-probs equal, bit for bit, those of SGLang's
  batch-invariant log_softmax (`sglang.srt.batch_invariant_ops.log_softmax`, what its deterministic inference runs)
  of logits.float(): Qwen3's vocabulary (4-wide loads), one column more (1-wide) and two more (2-wide), temperature
  0.5 (x * 2 and x / 0.5 are the same float), and the module's steps for 2 and 4 shards run in this process
  (`steps_by_hand`; NCCL needs a GPU per rank, and TP = 2 over NCCL is held bitwise to TP = 1 in
  tests/test_sglang_order.py).
- "on_policy": SGLang's kernels under sglang_checks/on_policy.py against its torch stand-ins on `tiny`: the recorded
  names, dtypes and shapes (equal) and the mean |d log-prob| per sequence (close, not equal: other GEMM and
  attention kernels).
"""

import json
import os
import pathlib
import subprocess
import tempfile

import torch

from ppo_ops.logits import sglang_order as order

QWEN3_VOCAB = 151936
TEMPERATURE_CASES = {"qwen3_vocab": (QWEN3_VOCAB, 1.0), "odd_vocab_1wide": (QWEN3_VOCAB + 1, 1.0),
                     "even_vocab_2wide": (QWEN3_VOCAB + 2, 1.0), "temperature_power_of_two": (QWEN3_VOCAB, 0.5)}
ON_POLICY_LENGTHS = [7, 12, 3]  # sequences of different lengths in one flattened batch


def child_report(module: str, timeout_s: float) -> dict:
    """The JSON object `python -m module` prints under SGLang's interpreter ($PPO_OPS_SGLANG_PYTHON), run from the
    repository root without TRITON_INTERPRET; the calling test skips where the variable is not set (a plain run:
    --config=sglang sets it, and fails the target on any skip)."""
    import pytest

    sglang_python = os.environ.get("PPO_OPS_SGLANG_PYTHON")
    if not sglang_python:
        pytest.skip("PPO_OPS_SGLANG_PYTHON is not set: SGLang's interpreter (--config=sglang sets it)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo_root = pathlib.Path(os.path.abspath(__file__)).parent.parent
    done = subprocess.run([sglang_python, "-m", module], cwd=repo_root, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, f"{module} failed under SGLang's interpreter:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def steps_by_hand(logits, tokens, world_size, backend, vocab_size=None):
    """The module's steps for `world_size` shards in this process, the exchanges done here: log-probs [T]."""
    vocab_size = logits.shape[1] if vocab_size is None else vocab_size
    v_local = logits.shape[1] // world_size
    kernels = order.kernels_for(backend)
    shards = [order.Shard(logits=logits[:, r * v_local:(r + 1) * v_local].contiguous(), tokens=tokens,
                          row_mask=None, start=r * v_local, v_local=v_local,
                          n_valid=max(0, min(v_local, vocab_size - r * v_local)), vocab_size=vocab_size,
                          inv_temperature=None, kernels=kernels) for r in range(world_size)]
    row_max = torch.stack([s.local_max() for s in shards]).amax(dim=0)
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    tails = [s.tail_chains(shift) for s in shards]
    sums = [s.block_sums(shift, tails[r - 1] if s.blocks.head_continues else None) for r, s in enumerate(shards)]
    target = torch.stack([s.target_z() for s in shards]).amax(dim=0)
    return order.combine(kernels, torch.cat(sums, dim=2), row_max, target, None).log_prob


def _inputs(vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn((64, vocab), generator=gen) * 6.0).to(torch.bfloat16)
    logits[5, ::3] = float("-inf")
    tokens = torch.randint(0, vocab, (64,), generator=gen)
    return logits.cuda(), tokens.cuda()


def _sglang_log_probs(logits, tokens, temperature):
    from sglang.srt.batch_invariant_ops import log_softmax

    z = logits.float()
    if temperature != 1.0:  # SGLang's sampler divides by a tensor of temperatures
        z = z / torch.full((1,), temperature, dtype=torch.float32, device=z.device)
    return log_softmax(z, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def order_report() -> dict:
    import ppo_ops

    out = {}
    for name, (vocab, temperature) in TEMPERATURE_CASES.items():
        logits, tokens = _inputs(vocab, seed=3)
        ours = ppo_ops.log_probs_and_entropy(logits, tokens, temperature=temperature, reduction_order="sglang")
        out[name] = torch.equal(ours.log_probs, _sglang_log_probs(logits, tokens, temperature))
    for world_size in (2, 4):
        logits, tokens = _inputs(QWEN3_VOCAB, seed=5)
        out[f"shards_by_hand_{world_size}"] = torch.equal(steps_by_hand(logits, tokens, world_size, "triton"),
                                                          _sglang_log_probs(logits, tokens, 1.0))
    return out


def on_policy_report() -> dict:
    from sglang_checks import models, on_policy

    with tempfile.TemporaryDirectory() as cache:
        info = models.resolve_model("tiny", cache_dir=cache, seed=0, log=lambda m: None)
        model = models.load_hf_model(info, dtype=torch.float32, device=torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros((len(ON_POLICY_LENGTHS), max(ON_POLICY_LENGTHS)), dtype=torch.int64)
    for b, n in enumerate(ON_POLICY_LENGTHS):
        ids[b, :n] = torch.randint(0, model.config.vocab_size, (n,), generator=gen)
    ids = ids.cuda()
    ours, theirs = {}, {}
    _, _, torch_logits = on_policy.model_outputs(model, ids, ON_POLICY_LENGTHS, record=ours)
    _, _, sglang_logits = on_policy.model_outputs(model, ids, ON_POLICY_LENGTHS,
                                                  kernels=on_policy.sglang_kernels(None), record=theirs)

    def layout(value):
        return [(str(t.dtype), list(t.shape)) for t in (value if isinstance(value, list) else [value])]

    mismatched = [name for name in ours if name not in theirs or layout(ours[name]) != layout(theirs[name])]
    gaps = [float((sglang_logits[b, :n].float().log_softmax(-1) - torch_logits[b, :n].float().log_softmax(-1))
                  .abs().mean()) for b, n in enumerate(ON_POLICY_LENGTHS)]
    return {"names_equal": list(ours) == list(theirs), "layout_mismatches": mismatched, "mean_gaps": gaps}


if __name__ == "__main__":
    print(json.dumps({"order": order_report(), "on_policy": on_policy_report()}))
