"""ppo_ops: fused vocab-parallel log-prob + entropy for RL post-training of LLMs.

    from ppo_ops import log_probs_and_entropy, calculate_log_probs_and_entropy, linear_log_probs_and_entropy

Two ops, their public functions all in api.py:
  the logits op, from [..., V_local] logits: `log_probs_and_entropy` (temperature, keep mask, row mask, padded vocab,
    chunking, in-place gradient, backend choice) and `calculate_log_probs_and_entropy` (a drop-in for slime's);
  the fused LM head, from hidden states and a vocab-parallel weight, never holding [T, V] logits:
    `linear_log_probs_and_entropy`, and `linear_token_loss` (a per-token RL loss, its gradient formed in the forward;
    the losses themselves in token_losses.py, rollout_correction.py, sequence_losses.py and entropy_mask.py:
    docs/losses.md).

Reading order, for either op: api.py (arguments) -> core/shell.py (the one call shell: local checks, layout, backend
choice, and partials -> TP all-gather -> fixed-order merge) -> the op's autograd Function -> its backend -> kernels.
The core imports nothing above it: backends.py registers each backend's loader with core/registry.py (on
`import ppo_ops`), and the shell loads the one it selects (the LM head's through its router). Which modules run, per
op, backend and dtype (core/shell.py, select_backend, decides; for the LM head, lm_head/paths.py):

  logits op        logits/function.py (repeated eager calls of one signature on CUDA at one rank replay the first
                   call's launches: logits/replay.py), then
    backend torch    logits/torch_backend.py (any device, any float dtype)
    backend triton   logits/triton_backend.py -> logits/triton_kernels.py (CUDA, or CPU under TRITON_INTERPRET=1)
    reduction_order  "sglang": logits/sglang_order.py -> logits/sglang_order_kernels.py instead (the block geometry
                     both read: logits/sglang_order_geometry.py)
  LM head (both functions): lm_head/paths.py names the path a call takes (`head_path`; `path_of_call` for a call's
                   own arguments; docs/lm_head.md, the table), and the shell's backend choice is its first step; then
    general op       lm_head/function.py (linear_log_probs_and_entropy), then by path
      torch_tiles      lm_head/torch_backend.py (fixed fp32 tiles through torch.matmul, the logits op's torch code)
      fp32_tiles       lm_head/triton_backend.py (Triton GEMM tiles with the statistics fused in; fp32 only)
      chunk_gemms      lm_head/segment_gemms.py: chunk GEMMs (lm_head/gemms.py) and logits/triton_kernels.py's passes
      one_gemm(_held)  lm_head/segment_gemms.py: lm_head/gemm_partials.py (forward GEMM, statistics in its epilogue),
                       lm_head/gemm_dlogits.py (the recompute, gradient in its epilogue), lm_head/prob_dlogits.py (the
                       held rows' dlogits), library dX / dW GEMMs (lm_head/gemms.py)
    token loss       lm_head/loss_function.py (linear_token_loss) -> lm_head/segment_gemms.py ->
                     lm_head/token_loss_blocks.py (its blocks: loss_one_block and loss_blocks over the one-GEMM
                     kernels and prob_dlogits.py, loss_chunk_blocks over chunk GEMMs and the logits op's Triton or
                     torch passes); the shipped losses: token_losses.py

The shared core beside them: core/checks.py (local argument checks), core/agreement.py (cross-rank agreement, the
one host read), core/contracts.py (the backend contracts of both ops, as types), core/registry.py (the backends by
op and kind, loaded when selected, and the LM head's router), core/layout.py (vocabulary shards and segments),
core/row_stats.py (merge math), core/fold.py (the fixed-order sum behind the torch code's bitwise guarantees),
core/scale.py and core/scale_kernel.py (scaling the gradients a token loss formed in its forward),
core/sparse_keep.py, core/sparse_keep_kernels.py and core/sparse_keep_types.py (the sparse keep set's checks, row
state and gradient term for both ops; its kernels; the types both share), core/triton_common.py (what the Triton
kernels of both ops share), core/triton_launch.py (both ops' launches through Triton's own compiled kernel with less
host work).
Under torch.compile the public functions call the ops' custom operators instead (compiled/: common.py what they
share, logits_op.py, linear_op.py, token_loss_op.py), which run the same forward and backward bodies as the
autograd Functions.
Inside trainers' models, on top of the LM head: megatron.py (GPTModel's output processor, gpt_log_probs, packed and
context-parallel batch helpers, the keep set from rollout nuclei) and hf.py (a transformers causal LM's next-token
log-probs).
Not imported by `import ppo_ops`: megatron.py, hf.py, legacy/ (the yardstick: Megatron's cross entropy + an entropy
Function) and runtime/ (what the product's programs share: the CLI contract, rank groups).
"""

from ppo_ops import backends  # noqa: F401  registers the backends the call shell selects
from ppo_ops.api import (LogProbsEntropy, calculate_log_probs_and_entropy, linear_log_probs_and_entropy,
                         linear_token_loss, log_probs_and_entropy)
from ppo_ops import entropy_mask, rollout_correction, sequence_losses, token_losses
from ppo_ops.entropy_mask import EntropyMaskedLoss, top_entropy_mask
from ppo_ops.sequence_losses import SequenceLoss, gmpo_loss, gspo_loss
from ppo_ops.token_losses import TokenLoss, grpo_advantages, grpo_loss, policy_loss

__all__ = ["LogProbsEntropy", "calculate_log_probs_and_entropy", "linear_log_probs_and_entropy", "linear_token_loss",
           "log_probs_and_entropy"]
__all__ += ["EntropyMaskedLoss", "SequenceLoss", "TokenLoss", "entropy_mask", "gmpo_loss", "grpo_advantages",
            "grpo_loss", "gspo_loss", "policy_loss", "rollout_correction", "sequence_losses", "token_losses",
            "top_entropy_mask"]
