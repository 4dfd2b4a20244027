#!/usr/bin/env bash
# GPU parity run: the fused core vs the legacy reference (tests/test_ppo_logprob_entropy_gpu.py) on NVIDIA GPUs.
#
#   tools/run_parity_gpu.sh            # from the repository root; writes under $OUT (default tools/bench/results/parity_gpu)
#
# Two plain pytest passes over the GPU file, one log each:
#   1. TP=1 on one GPU  (CUDA_VISIBLE_DEVICES=<first GPU>, -k tp1)  -> parity_gpu_tp1.log, parity_gpu_tp1.xml
#   2. TP=2 on two GPUs (NCCL, spawned ranks, -k tp2)               -> parity_gpu_tp2.log, parity_gpu_tp2.xml
#      (on a one-GPU machine every TP=2 test skips with "needs 2 GPUs", recorded as such)
# plus versions.txt (GPU, driver, python, torch/CUDA/NCCL, triton, megatron-core, pytest, commit) and summary.txt.
#
# megatron-core is not in the device image: if it does not import, the script installs the wheels in ./.whl
# (megatron_core-0.16.1-cp312-...whl, pure dependencies torch/numpy/packaging are already there) into /tmp/site.
#
# TORCHDYNAMO_DISABLE=1 (override with PARITY_COMPILE=1): Megatron's jit_fuser is torch.compile; eager gives the same
# math (compile only fuses the same fp32 elementwise ops), no per-shape recompiles in each spawned rank (2 vocab sizes
# x chunk tails), and the same code path as the CPU suite, so a GPU-only failure points at the device, not at Inductor.
set -uo pipefail

OUT_DIR="${OUT:-tools/bench/results/parity_gpu}"
mkdir -p "$OUT_DIR"
PYTHON="${PYTHON:-python3}"

# NVLink multicast stays off on shared hosts (also inherited by the spawned NCCL ranks).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PPO_OPS_TEST_SEED=0 PYTHONHASHSEED=0
if [[ "${PARITY_COMPILE:-0}" != "1" ]]; then export TORCHDYNAMO_DISABLE=1; fi
unset TRITON_INTERPRET  # compiled Triton kernels on the GPU, never the interpreter

if ! "$PYTHON" -c "import megatron.core.fusions.fused_cross_entropy" >/dev/null 2>&1; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "installing .whl/*.whl failed" | tee "$OUT_DIR/summary.txt"; exit 2; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$PYTHON" -c "import megatron.core.fusions.fused_cross_entropy" >/dev/null 2>&1 \
    || { echo "megatron-core 0.16.1 is missing: carry its cp312 wheel in .whl/" | tee "$OUT_DIR/summary.txt"; exit 2; }
fi

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no git checkout)')"
  echo "TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-unset} NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1
  "$PYTHON" - <<'EOF'
import platform, importlib.metadata as md, torch
print("python", platform.python_version())
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as err:  # CPU builds have no NCCL
    nccl = f"unavailable ({type(err).__name__})"
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", nccl)
print("gpus visible", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for pkg in ("triton", "megatron-core", "pytest", "numpy"):
    try:
        print(pkg, md.version(pkg))
    except md.PackageNotFoundError:
        print(pkg, "not installed")
EOF
} >"$OUT_DIR/versions.txt" 2>&1
cat "$OUT_DIR/versions.txt"

# Without a visible GPU every test would skip and the run would look green: refuse instead.
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible: nothing to run" | tee "$OUT_DIR/summary.txt"
  exit 3
fi

first_gpu="${CUDA_VISIBLE_DEVICES:-0}"
first_gpu="${first_gpu%%,*}"
CUDA_VISIBLE_DEVICES="$first_gpu" "$PYTHON" -m pytest tests/test_ppo_logprob_entropy_gpu.py -k tp1 -v -ra \
  -p no:cacheprovider --junitxml="$OUT_DIR/parity_gpu_tp1.xml" 2>&1 | tee "$OUT_DIR/parity_gpu_tp1.log"
rc_tp1=${PIPESTATUS[0]}
"$PYTHON" -m pytest tests/test_ppo_logprob_entropy_gpu.py -k tp2 -v -ra \
  -p no:cacheprovider --junitxml="$OUT_DIR/parity_gpu_tp2.xml" 2>&1 | tee "$OUT_DIR/parity_gpu_tp2.log"
rc_tp2=${PIPESTATUS[0]}

{
  echo "TP=1 (one GPU): exit $rc_tp1: $(tail -n 1 "$OUT_DIR/parity_gpu_tp1.log")"
  echo "TP=2 (two GPUs, NCCL): exit $rc_tp2: $(tail -n 1 "$OUT_DIR/parity_gpu_tp2.log")"
} | tee "$OUT_DIR/summary.txt"
exit $(( rc_tp1 != 0 ? rc_tp1 : rc_tp2 ))
