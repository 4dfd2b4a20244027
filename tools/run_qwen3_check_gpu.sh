#!/usr/bin/env bash
# The Qwen3 parallel check (issue 6) on NVIDIA GPUs, for the lead to run on two H200s (about 4-6 minutes):
#
#   OUT=/some/dir tools/run_qwen3_check_gpu.sh
#
#   1. The check itself: qwen3-0.6b-random (Qwen3-0.6B architecture, seeded random weights), the embedded hf engine
#      on cuda:0, trainer layouts tp1,tp2,cp2,dp2 on two NCCL ranks        -> $OUT/report.{md,json}, the PNG, rollout.json
#   2. tests/test_qwen3_parallel_check_gpu.py with plain pytest (one GPU, then two)        -> gpu_tests.log, gpu_tests.xml
# plus versions.txt and summary.txt (exit codes). SGLang is not run: it cannot be installed on these machines
# (tests/test_qwen3_0.6B_parallel_check.py skips there with the reason).
#
# Needs a python3 with torch, transformers, absl-py, tqdm, matplotlib, safetensors, pytest (the GPU image has them).
# The generated model is built once into $MODEL_CACHE and shared by both steps.
set -uo pipefail

: "${OUT:?set OUT to the output directory}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
CHECK_TIMEOUT_S="${CHECK_TIMEOUT_S:-240}"
TESTS_TIMEOUT_S="${TESTS_TIMEOUT_S:-320}"
export PPO_OPS_MODEL_CACHE="${MODEL_CACHE:-/tmp/qwen3_check_models}"

# NVLink multicast stays off on shared hosts (inherited by the spawned NCCL ranks); compiled Triton, never the
# interpreter; unbuffered output so a cut run still shows where it was.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0 PPO_OPS_TEST_SEED=0
unset TRITON_INTERPRET

mkdir -p "$OUT"
cd "$REPO" || exit 1
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no git checkout)')"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1
  "$PYTHON" -c 'import platform, torch, transformers, triton; print("python", platform.python_version(), "torch",
    torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton",
    triton.__version__, "gpus", torch.cuda.device_count())' 2>&1
} > "$OUT/versions.txt"
cat "$OUT/versions.txt"

echo "== 1. qwen3_parallel_check: qwen3-0.6b-random, hf engine, trainer layouts tp1,tp2,cp2,dp2 on NCCL"
timeout "$CHECK_TIMEOUT_S" "$PYTHON" -m sglang_checks.qwen3_parallel_check \
  --model=qwen3-0.6b-random --device=cuda --trainer_layouts=tp1,tp2,cp2,dp2 --num_prompts=4 \
  --max_new_tokens=32 --cache_dir="$PPO_OPS_MODEL_CACHE" --report_dir="$OUT/report" 2>&1 | tee "$OUT/check.log"
check_rc=${PIPESTATUS[0]}
for f in report.md report.json logprob_diff_hist.png rollout.json; do
  [[ -f "$OUT/report/$f" ]] && cp "$OUT/report/$f" "$OUT/$f"
done
rm -rf "$OUT/report"

echo "== 2. tests/test_qwen3_parallel_check_gpu.py"
timeout "$TESTS_TIMEOUT_S" "$PYTHON" -m pytest tests/test_qwen3_parallel_check_gpu.py -v -s -ra \
  -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

{
  echo "qwen3_parallel_check exit code: $check_rc (0 pass, 1 a comparison out of tolerance, 2 bad input, 124 timeout)"
  echo "pytest exit code: $tests_rc"
  grep -E "^(\*\*PASS|\*\*FAIL)" "$OUT/report.md" 2>/dev/null
  tail -n 1 "$OUT/gpu_tests.log"
} | tee "$OUT/summary.txt"
[[ "$check_rc" -eq 0 && "$tests_rc" -eq 0 ]]
