#!/bin/bash
# Probe: the fused LM head's GPU checks in one call (docs/performance.md, "The fused LM head"): both ops against
# float64 at a small shape (sanity), the bench's lm_head_own suite with its float64 columns (bench), the chunk path's
# pieces alone (pieces: tools/probes/lm_head_pieces.py), the whole step's lm_head_step suite (whole), then the GPU
# tests of both LM-head test files through their Bazel GPU targets (tests). The GPU tests' interpreter is
# PPO_OPS_GPU_PYTHON, by default the python3 on PATH.
#   tools/probes/lm_head_gpu.sh OUT_DIR LABEL [SKIP]   (SKIP: words among sanity bench pieces whole tests)
# Everything it prints goes to OUT_DIR/run.log; the bench's record (results.csv, results.md) and pieces.csv to
# OUT_DIR/b. Limits are per step, so one that hangs or runs long leaves time to the rest.
set -u
OUT=$1
LABEL=$2
SKIP=${3:-}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT/b"
LOG="$OUT/run.log"
step() { case " $SKIP " in *" $1 "*) echo "== skip $1" | tee -a "$LOG"; return 1;; esac; echo "== $1 $(date -u +%T)" | tee -a "$LOG"; }
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; } \
  2>&1 | tee -a "$LOG"
if step sanity; then
timeout 120 python3 - <<'PY' 2>&1 | tee -a "$LOG"
import torch, ppo_ops
torch.manual_seed(0)
T, H, V = 3000, 512, 151936 // 8 * 8
x = torch.randn(T, H, device="cuda").bfloat16(); w = (torch.randn(V, H, device="cuda") * 3 / H**0.5).bfloat16()
t = torch.randint(0, V, (T,), device="cuda"); a = torch.randn(T, device="cuda"); b = torch.rand(T, device="cuda")
xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
lsm = torch.log_softmax(xd @ wd.T, -1); lp = lsm.gather(1, t[:, None])[:, 0]; ent = -(lsm.exp() * lsm).sum(-1)
(a * lp + b * ent).sum().backward()
for name in ("general", "token_loss"):
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    if name == "general":
        out = ppo_ops.linear_log_probs_and_entropy(xa, wa, t, entropy="grad")
        (a * out.log_probs + b * out.entropy).sum().backward()
    else:
        loss, out = ppo_ops.linear_token_loss(xa, wa, t, lambda l, e, r: a[r] * l + b[r] * e, entropy="grad")
        loss.backward()
    rel = lambda g, r: ((g.double() - r).abs().max() / r.abs().max()).item()
    print(name, "lp", (out.log_probs.double() - lp).abs().max().item(), "ent", (out.entropy.double() - ent).abs().max().item(),
          "dX rel", rel(xa.grad, xd.grad), "dW rel", rel(wa.grad, wd.grad), flush=True)
PY
fi
if step bench; then
timeout 300 python3 tools/bench/bench.py --suite=lm_head_own --label="$LABEL" --out_dir="$OUT/b" --min_reps=5 \
  --max_reps=20 --png= 2>&1 | tee -a "$LOG"
fi
if step pieces; then
timeout 150 python3 tools/probes/lm_head_pieces.py --label="$LABEL" --out_dir="$OUT/b" 2>&1 | tee -a "$LOG"
fi
if step whole; then
timeout 200 python3 tools/bench/bench.py --suite=lm_head_step --label="$LABEL" --out_dir="$OUT/b" --png= \
  --min_reps=3 --max_reps=5 2>&1 | tee -a "$LOG"
fi
if step tests; then
GPU_PYTHON=${PPO_OPS_GPU_PYTHON:-$(command -v python3)}
timeout 900 bazel test --config=gpu --repo_env=PPO_OPS_GPU_PYTHON="$GPU_PYTHON" //tests:test_linear_log_probs_gpu \
  //tests:test_linear_token_loss_gpu 2>&1 | tail -40 | tee -a "$LOG"
fi
echo "== done $(date -u +%T)" | tee -a "$LOG"
