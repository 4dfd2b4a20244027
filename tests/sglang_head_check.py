"""The fused LM head with reduction_order="sglang" against SGLang's own kernels, run under SGLang's interpreter:
`python -m tests.sglang_head_check [--quick]` (tests/test_sglang_head_vs_sglang.py runs it in a child process with
$PPO_OPS_SGLANG_PYTHON: SGLang imports only beside the packages it was installed with). Needs a CUDA GPU.

SGLang's side is what its true on-policy LM head runs (sglang_checks/on_policy.py, logits): its batch-invariant
matmul `matmul_persistent(hidden.bfloat16(), weight.T.bfloat16())` (what aten::mm runs in batch-invariant mode with
SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM=0), then its batch-invariant `log_softmax` of the fp32 logits; at a
temperature T the logits first as its sampler divides them, `logits.bfloat16().div(temperatures).bfloat16()`. Its
log_softmax runs on row chunks (it is one program per row, so chunking does not change a bit) to bound memory.

Prints one JSON object: per case (head x rows x temperature) whether the head's bf16 logits equal SGLang's (every
element), whether its log-probs equal SGLang's (every row) and how many rows differ, the token loss's log-probs
equal to the general op's, shards by hand for TP = 2 and 4 (each rank's logits from its weight slice equal SGLang's
columns; the order's steps on them give SGLang's log-probs), and a control: one weight moved by one ulp changes the
log-probs. Also, informational: the share of rows where the head's log-prob rounded to bf16 equals SGLang's sampler's
own bf16 log_softmax of the divided logits (what it returns for sampled tokens under --rl-on-policy-target).
"""

import json
import os
import sys

os.environ.setdefault("SGLANG_BATCH_INVARIANT_OPS_ENABLE_MM_DEEPGEMM", "0")  # before sglang is imported

import torch  # noqa: E402

from tests.sglang_kernels_check import steps_by_hand  # noqa: E402

VOCAB = 151936  # Qwen3's
HEADS = {  # name: (H, weight dtype, hidden dtype); Qwen3-0.6B ties its head to the fp32 embedding
    "qwen3_0.6b_tied_fp32": (1024, torch.float32, torch.float32),
    "untied_4096_bf16": (4096, torch.bfloat16, torch.bfloat16),
}
ROWS = [1, 7, 1000, 4099, 32768]  # odd sizes: no multiple of a tile
QUICK_ROWS = [1, 7, 1000, 4099]
TEMPERATURES = [1.0, 0.7]
REFERENCE_CHUNK_ROWS = 4096


def _inputs(width, w_dtype, h_dtype, rows, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn((VOCAB, width), generator=gen, device="cuda") * width ** -0.5 * 2).to(w_dtype)
    hidden = (torch.randn((rows, width), generator=gen, device="cuda") * 2).to(h_dtype)
    tokens = torch.randint(0, VOCAB, (rows,), generator=gen, device="cuda")
    return hidden, weight, tokens


def sglang_logits(hidden, weight):
    from sglang.srt.batch_invariant_ops.batch_invariant_ops import matmul_persistent
    return matmul_persistent(hidden.bfloat16(), weight.T.bfloat16())


def sglang_divided(logits, temperature):
    if temperature == 1.0:
        return logits
    temps = torch.full((logits.shape[0], 1), temperature, dtype=torch.float32, device=logits.device)
    return logits.bfloat16().div(temps).bfloat16()


def sglang_log_probs(logits, tokens, temperature, fp32=True):
    """SGLang's log_softmax (fp32 input: its scoring; fp32=False: the sampler's bf16 input) at the targets."""
    from sglang.srt.batch_invariant_ops import log_softmax
    z = sglang_divided(logits, temperature)
    out = []
    for r0 in range(0, z.shape[0], REFERENCE_CHUNK_ROWS):
        chunk = z[r0:r0 + REFERENCE_CHUNK_ROWS]
        lp = log_softmax(chunk.float() if fp32 else chunk, dim=-1)
        out.append(lp.gather(1, tokens[r0:r0 + REFERENCE_CHUNK_ROWS, None]).squeeze(1).float())
    return torch.cat(out)


def case_report(name, width, w_dtype, h_dtype, rows, temperature, seed) -> dict:
    import ppo_ops
    from ppo_ops.lm_head import sglang_matmul

    hidden, weight, tokens = _inputs(width, w_dtype, h_dtype, rows, seed)
    theirs_logits = sglang_logits(hidden, weight)
    ours_logits = torch.empty_like(theirs_logits)
    sglang_matmul.bf16_logits(hidden.bfloat16(), weight.bfloat16(), ours_logits, None, "triton")
    logits_equal = torch.equal(ours_logits, theirs_logits)
    del ours_logits
    theirs = sglang_log_probs(theirs_logits, tokens, temperature)
    ours = ppo_ops.linear_log_probs_and_entropy(hidden, weight, tokens, temperature=temperature, entropy="value",
                                                reduction_order="sglang")
    loss, loss_out = ppo_ops.linear_token_loss(hidden, weight, tokens, lambda lp, ent, r: -lp,
                                               temperature=temperature, reduction_order="sglang")
    sampler = sglang_log_probs(theirs_logits, tokens, temperature, fp32=False)
    report = {
        "logits_equal": logits_equal,
        "log_probs_equal": torch.equal(ours.log_probs, theirs),
        "rows_differing": int((ours.log_probs != theirs).sum()),
        "max_abs_diff": float((ours.log_probs - theirs).abs().max()),
        "token_loss_equal": torch.equal(loss_out.log_probs, ours.log_probs),
        "entropy_finite": bool(torch.isfinite(ours.entropy).all()),
        "sampler_bf16_share_equal": float((ours.log_probs.bfloat16().float() == sampler).float().mean()),
    }
    if rows == 4099:  # shards by hand, and the control, once per head and temperature
        for world in (2, 4):
            v_local = VOCAB // world
            parts = []
            for r in range(world):
                part = torch.empty((rows, v_local), dtype=torch.bfloat16, device="cuda")
                sglang_matmul.bf16_logits(hidden.bfloat16(), weight[r * v_local:(r + 1) * v_local].bfloat16(), part,
                                          None if temperature == 1.0 else temperature, "triton")
                parts.append(part)
            ranks = torch.cat(parts, dim=1)
            report[f"shards_{world}_logits_equal"] = torch.equal(ranks, sglang_divided(theirs_logits, temperature))
            report[f"shards_{world}_log_probs_equal"] = torch.equal(
                steps_by_hand(ranks, tokens, world, "triton"), theirs)
        # One weight one bf16 ulp off (as the matmul sees it: SGLang casts the weight to bf16 first).
        moved = weight.bfloat16().clone()
        bits = moved.view(-1)[12345:12346].view(torch.int16)
        bits += 1
        moved = moved.to(w_dtype)
        control = ppo_ops.linear_log_probs_and_entropy(hidden, moved, tokens, temperature=temperature,
                                                       reduction_order="sglang").log_probs
        report["control_one_ulp_differs"] = not torch.equal(control, theirs)
    return report


def main(quick: bool) -> dict:
    out = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
    for name, (width, w_dtype, h_dtype) in HEADS.items():
        for rows in (QUICK_ROWS if quick else ROWS):
            for temperature in TEMPERATURES:
                key = f"{name}/T={rows}/temp={temperature}"
                out[key] = case_report(name, width, w_dtype, h_dtype, rows, temperature, seed=rows + 17)
                print(key, json.dumps(out[key]), file=sys.stderr, flush=True)  # progress, for a run cut short
                torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv[1:])))
