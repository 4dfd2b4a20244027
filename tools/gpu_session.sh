#!/usr/bin/env bash
# Every GPU step of one lease in one call (device time is scarce; see ../.library/device/METHOD.md).
#
#   tools/gpu_session.sh PHASE...     # from the repository root on the GPU machine; results under $OUT
#
# Phases (run in the order given):
#   versions  GPU, driver, torch/triton/NCCL versions
#   tune      tools/triton_tune.py: Triton forward/backward variants vs the device copy bandwidth (one GPU)
#   tests     the core and Triton test files on CUDA with plain pytest (the files Bazel runs), one GPU
#   parity    tools/run_parity_gpu.sh: fused core vs legacy, TP=1 on one GPU and TP=2 over NCCL on two
#   qwen3     tools/run_qwen3_check_gpu.sh: the Qwen3 parallel check, qwen3-0.6b-random, hf engine, NCCL layouts
#   bench     tools/run_bench_gpu.sh: the bench, TP=1 and TP=2
#   overhead  tools/host_overhead.py --profile: host vs device time of one step (what a host sync costs), one GPU
#   bench_tp2 the bench's tp2 suite alone over NCCL on two GPUs, 90 s of cases (a quick TP=2 check)
# Each phase writes into $OUT/work/PHASE and is bundled into $OUT/PHASE.tgz as soon as it ends (the device tool
# returns at most 8 files, and what a cut-off call left under $OUT still comes back). Phases share one time budget,
# SESSION_BUDGET_S (default 570 s, under the tool's 600 s per call): each gets min(its limit, what is left); one that
# cannot get 30 s is skipped. A one-line-per-phase summary is printed last.
set -uo pipefail

OUT_ROOT="${OUT:-/tmp/gpu_out}"
WORK="$OUT_ROOT/work"
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0 PPO_OPS_TEST_SEED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast here
export CUBLAS_WORKSPACE_CONFIG=:4096:8
export TRITON_INTERPRET=0  # compiled kernels on the GPU (tests/conftest.py only defaults it to 1)

# Carried wheels (megatron-core for the legacy path, liger-kernel for the bench), installed beside the image's packages.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

BUDGET=${SESSION_BUDGET_S:-570}
declare -a SUMMARY
run_phase() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local dir="$WORK/$name" start=$SECONDS rc left=$((BUDGET - SECONDS - 20))
  if (( left < 30 )); then SUMMARY+=("$name skipped: ${left}s of the budget left"); return; fi
  (( limit > left )) && limit=$left
  mkdir -p "$dir"
  echo "=== $name (limit ${limit}s) ==="
  OUT="$dir" timeout --signal=INT --kill-after=10 "$limit" "$@" 2>&1 | tee "$dir/$name.log" | tail -n 40
  rc=${PIPESTATUS[0]}
  SUMMARY+=("$name rc=$rc $((SECONDS - start))s")
  tar -czf "$OUT_ROOT/$name.tgz" -C "$WORK" "$name"
  printf '%s\n' "${SUMMARY[@]}" > "$OUT_ROOT/summary.txt"
}

for phase in "$@"; do
  case "$phase" in
    versions)
      run_phase versions 60 bash -c 'nvidia-smi; python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.device_count())"' ;;
    tune)
      run_phase tune 200 python3 tools/triton_tune.py ;;
    tests)
      run_phase tests 240 python3 -m pytest -q -p no:cacheprovider --junitxml="$WORK/tests/junit.xml" \
        tests/test_triton_backend.py tests/test_triton_backend_gpu.py tests/test_core_values.py \
        tests/test_core_invariants.py tests/test_core_errors.py tests/test_core_properties.py ;;
    parity)
      run_phase parity 300 bash tools/run_parity_gpu.sh ;;
    qwen3)
      run_phase qwen3 420 bash tools/run_qwen3_check_gpu.sh ;;
    bench)
      run_phase bench 500 bash tools/run_bench_gpu.sh ;;
    overhead)
      run_phase overhead 120 python3 tools/host_overhead.py --profile ;;
    bench_tp2)
      run_phase bench_tp2 200 env CUDA_VISIBLE_DEVICES=0,1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        bash -c 'python3 tools/bench/bench.py --tp=2 --suite=tp2 --time_budget_s=90 --out_dir="$OUT"' ;;
    *)
      echo "unknown phase: $phase" >&2; exit 2 ;;
  esac
done

rm -rf "$WORK"
echo "=== summary ==="
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT_ROOT/summary.txt"
