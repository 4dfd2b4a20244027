"""The block geometry of SGLang's log_softmax kernel, shared by the reduction order's definition (sglang_order.py)
and its Triton kernels (sglang_order_kernels.py), so that neither imports the other for it.

One program of WARPS warps per row, THREADS threads in all, over blocks of BLOCK columns from global column 0; each
thread adds CHAIN values of a block in sequence (sglang_order.py, `chain_offsets` and `block_tree`, spells out the
order).
"""

from ppo_ops.core.checks import SGLANG_BLOCK

BLOCK = SGLANG_BLOCK  # columns per block of SGLang's kernel (core/checks.py refuses shards narrower than one)
THREADS = 128  # 4 warps of 32
WARPS = 4
CHAIN = BLOCK // THREADS  # values each thread adds in sequence
