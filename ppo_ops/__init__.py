"""ppo_ops: fused vocab-parallel log-prob + entropy for RL post-training of LLMs.

    from ppo_ops import log_probs_and_entropy, calculate_log_probs_and_entropy, linear_log_probs_and_entropy

Two ops, their public functions all in api.py:
  the logits op, from [..., V_local] logits: `log_probs_and_entropy` (temperature, keep mask, row mask, padded vocab,
    chunking, in-place gradient, backend choice) and `calculate_log_probs_and_entropy` (a drop-in for slime's);
  the fused LM head, from hidden states and a vocab-parallel weight, never holding [T, V] logits:
    `linear_log_probs_and_entropy`, and `linear_token_loss` (a per-token RL loss, its gradient formed in the forward;
    the losses themselves in token_losses.py).

Reading order, for either op: api.py (arguments) -> core/shell.py (the one call shell: local checks, layout, backend
choice, and partials -> TP all-gather -> fixed-order merge) -> the op's autograd Function -> its backends -> their
kernels. The logits op: logits/function.py -> logits/torch_backend.py, logits/triton_backend.py (->
logits/triton_kernels.py). The LM head: lm_head/function.py and lm_head/loss_function.py -> lm_head/torch_backend.py
(fixed fp32 tiles), lm_head/triton_backend.py (Triton GEMM tiles, fp32), lm_head/chunked.py (library GEMMs + the logits
op's passes: half precision, and the token loss). The shared core beside them: core/checks.py (local argument checks),
core/agreement.py (cross-rank agreement, the one host read), core/contracts.py (the backend contracts of both ops),
core/layout.py (vocabulary shards and segments), core/row_stats.py (merge math), core/triton_common.py (what the
Triton kernels of both ops share).
"""

from ppo_ops.api import (LogProbsEntropy, calculate_log_probs_and_entropy, linear_log_probs_and_entropy,
                         linear_token_loss, log_probs_and_entropy)
from ppo_ops import token_losses
from ppo_ops.token_losses import TokenLoss, grpo_advantages, grpo_loss, policy_loss

__all__ = ["LogProbsEntropy", "calculate_log_probs_and_entropy", "linear_log_probs_and_entropy", "linear_token_loss",
           "log_probs_and_entropy"]
__all__ += ["TokenLoss", "grpo_advantages", "grpo_loss", "policy_loss", "token_losses"]
