#!/usr/bin/env bash
# The issue-5 bench on two H200s in under 8 minutes: TP=1 on GPU 0, then TP=2 over NCCL on GPUs 0 and 1 (two
# spawned ranks). Results go to $OUT; tools/bench/results/README.md says how to commit them.
#
#   OUT=/some/dir tools/run_bench_gpu.sh
#
# Needs a python3 with torch and triton (the GPU image has both), plus megatron-core for the legacy provider and,
# optionally, liger-kernel (install carried wheels first, e.g. `pip install --no-deps megatron_core-*.whl
# liger_kernel-*.whl`); a provider whose package is missing is skipped with its reason in the tables.
#
# Writes to $OUT (8 files at most, as the device tool brings back): results.csv (one long-format CSV, both runs),
# results.md (targets, headline, all cases), results.png (time and memory vs T), bench_tp1.log, bench_tp2.log, gpu.txt.
#
# Time: cases run most important first (tools/bench/cases.py). Each run stops starting cases after its budget
# (--time_budget_s) and is killed by `timeout` a little later in any case; the CSV is appended case by case and the
# Markdown/PNG are rendered again at the end, so a cut run keeps everything it measured. Worst case:
# TP1_TIMEOUT_S + TP2_TIMEOUT_S + ~15 s of rendering = 455 s.
set -uo pipefail

: "${OUT:?set OUT to the output directory}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TP1_BUDGET_S="${TP1_BUDGET_S:-210}"  # TP=1: headline, TP=2 reference shape, T sweep, options, then the grid
TP1_TIMEOUT_S="${TP1_TIMEOUT_S:-280}"  # budget + imports (~15 s) + the last case started + rendering
TP2_BUDGET_S="${TP2_BUDGET_S:-95}"  # TP=2: headline shape, T sweep, options, then the triton grid
TP2_TIMEOUT_S="${TP2_TIMEOUT_S:-160}"  # budget + two ranks' imports and NCCL setup (~25 s) + last case + rendering

# NVLink multicast off in NCCL, torch symmetric memory and NVSHMEM: on these machines it can take the host's shared
# GPUs out of service (device KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Cases of very different sizes follow each other: expandable segments avoid OOMs from a fragmented cache. Peak
# numbers are allocated bytes (max_memory_allocated), which this does not change.
export PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"
export PYTHONUNBUFFERED=1

mkdir -p "$OUT"
cd "$REPO" || exit 1
{
  nvidia-smi
  "$PYTHON" -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count(), "GPUs")'
  "$PYTHON" -m pip list 2>/dev/null | grep -i -E "^(torch|triton|megatron-core|liger-kernel|absl-py|matplotlib) "
} > "$OUT/gpu.txt" 2>&1

common=(--out_dir="$OUT" --csv=results.csv --md=results.md --png=results.png)
# BENCH_ARGS: extra bench flags for both runs, after the script's own (absl: the last value wins), e.g. a CPU dry run:
#   BENCH_ARGS="--device=cpu --suite=custom --providers=torch --tokens=8 --vocab=256 --copy_mib=8" OUT=/tmp/b ...
read -r -a extra <<< "${BENCH_ARGS:-}"
# Drop per-line noise (absl info lines, megatron's "Transformer Engine and Apex" warnings) from the console copy;
# the logs in $OUT keep everything.
quiet() { grep -v -E "^I[0-9]{4} |UserWarning: Transformer Engine|^  warnings.warn" || true; }

echo "=== TP=1 on GPU 0 (budget ${TP1_BUDGET_S} s) ==="
CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$TP1_TIMEOUT_S" "$PYTHON" tools/bench/bench.py "${common[@]}" --tp=1 \
  --suite=headline,tp_ref,sweep,options,grid --time_budget_s="$TP1_BUDGET_S" "${extra[@]}" 2>&1 \
  | tee "$OUT/bench_tp1.log" | quiet
rc1=${PIPESTATUS[0]}

echo "=== TP=2 over NCCL on GPUs 0,1 (budget ${TP2_BUDGET_S} s) ==="
CUDA_VISIBLE_DEVICES=0,1 timeout -k 10 "$TP2_TIMEOUT_S" "$PYTHON" tools/bench/bench.py "${common[@]}" --tp=2 \
  --suite=tp2 --time_budget_s="$TP2_BUDGET_S" "${extra[@]}" 2>&1 | tee "$OUT/bench_tp2.log" | quiet
rc2=${PIPESTATUS[0]}

# Render from everything both runs appended (also after a timeout cut a run short).
"$PYTHON" tools/bench/bench.py "${common[@]}" --render_only 2>&1 | quiet
echo "=== exit status: TP=1 run $rc1, TP=2 run $rc2 (124: timed out; 1: a case errored or failed its check) ==="
sed -n '/^## Issue 5 targets/,/^## All cases/p' "$OUT/results.md"
[ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ]
