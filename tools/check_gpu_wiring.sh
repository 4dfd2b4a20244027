#!/usr/bin/env bash
# Proves the GPU runner wiring on a machine without CUDA (run by .ci/run after the CPU suite, in about half a minute):
#   1. `--config=gpu` without PPO_OPS_GPU_PYTHON fails the build, naming the variable (never a green run);
#   2. with a CPU-only interpreter (the CPU venv) it fails, naming that interpreter's CPU torch;
#   3. the GPU targets exist with their tags and GPU counts (bazel query).
# Prints one `gpu-wiring PASSED: ...` or `gpu-wiring FAILED: ...` line per check; exits 1 if any failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

failed=0
check() {  # name, condition status (0 = holds), detail shown on failure
  if [[ "$2" -eq 0 ]]; then echo "gpu-wiring PASSED: $1"; else echo "gpu-wiring FAILED: $1"; printf '%s\n' "$3" | tail -n 15 | sed 's/^/    /'; failed=1; fi
}

# A GPU target that builds nothing else; --nobuild stops after analysis, where the toolchain's repository is probed.
target=//tests:test_core_values_gpu

out="$(env -u PPO_OPS_GPU_PYTHON bazel test --config=gpu --nobuild "$target" 2>&1)"; rc=$?
[[ $rc -ne 0 && "$out" == *"--config=gpu needs the GPU runner's CUDA Python: set PPO_OPS_GPU_PYTHON"* ]]
check "--config=gpu without PPO_OPS_GPU_PYTHON fails naming the variable" $? "$out"

cpu_torch="$(.venv/bin/python3 -c 'import torch; print(torch.__version__)')"
out="$(bazel test --config=gpu --nobuild --repo_env=PPO_OPS_GPU_PYTHON="$PWD/.venv/bin/python3" "$target" 2>&1)"; rc=$?
[[ $rc -ne 0 && "$out" == *"its torch $cpu_torch has no CUDA"* ]]
check "--config=gpu with a CPU-only interpreter fails naming its torch $cpu_torch" $? "$out"

# name, tags and PPO_OPS_GPUS of every GPU target, against the table below.
expected="$(cat <<'EOF'
test_compile_gpu 1
test_core_errors_gpu 1
test_core_invariants_gpu 1
test_core_memory_gpu 1
test_core_parallel_gpu 2
test_core_parallel_gpu4 4
test_core_properties_gpu 1
test_core_reliability_gpu 1
test_core_reliability_gpu2 2
test_core_values_gpu 1
test_linear_log_probs_gpu 1
test_linear_log_probs_gpu2 2
test_linear_log_probs_gpu4 4
test_linear_token_loss_gpu 1
test_linear_token_loss_gpu2 2
test_linear_token_loss_gpu4 4
test_logit_transforms_gpu 1
test_logits_replay_gpu 1
test_megatron_gpu 1
test_megatron_gpu2 2
test_objectives_gpu 1
test_ppo_logprob_entropy_gpu 1
test_ppo_logprob_entropy_gpu2 2
test_qwen3_0.6B_parallel_check 2
test_qwen3_parallel_check_gpu 1
test_qwen3_parallel_check_gpu2 2
test_sglang_head_gpu 1
test_sglang_head_vs_sglang 1
test_sglang_kernels 1
test_sglang_order_gpu 1
test_sglang_order_gpu2 2
test_sparse_keep_gpu 1
test_tp_invariance_gpu 1
test_tp_invariance_gpu2 2
test_tp_invariance_gpu4 4
test_tp_invariance_gpu8 8
test_triton_backend_gpu 1
EOF
)"
xml="$(bazel query --output=xml 'attr(tags, "\bgpu\b", tests(//tests:all))' 2>/dev/null)"
actual="$(printf '%s\n' "$xml" | python3 -c '
import sys, xml.etree.ElementTree as ET
for rule in ET.fromstring(sys.stdin.read()).iter("rule"):
    name = rule.get("name").split(":")[1]
    tags = [s.get("value") for ls in rule.iter("list") if ls.get("name") == "tags" for s in ls.iter("string")]
    env = dict(tuple(s.get("value") for s in p.iter("string"))
               for d in rule.iter("dict") if d.get("name") == "env" for p in d.iter("pair"))
    gpus = env.get("PPO_OPS_GPUS", "?")
    n = int(gpus) if gpus.isdigit() else 0
    ok = {"gpu", "requires-gpu-nvidia", "exclusive"} <= set(tags) and (n < 2 or {"multiaccelerator", f"gpus_{n}"} <= set(tags))
    print(name, gpus if ok else "bad-tags:" + ",".join(tags))
' | LC_ALL=C sort)"
[[ "$actual" == "$(printf '%s\n' "$expected" | LC_ALL=C sort)" ]]
check "GPU targets declared with their tags and GPU counts (bazel query)" $? "$(diff <(printf '%s\n' "$expected" | LC_ALL=C sort) <(printf '%s\n' "$actual"))"

exit $failed
