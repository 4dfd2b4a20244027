"""ppo_ops: fused vocab-parallel log-prob + entropy for RL post-training of LLMs.

    from ppo_ops import log_probs_and_entropy, calculate_log_probs_and_entropy

`log_probs_and_entropy` is the full API (temperature, keep mask, row mask, padded vocab, chunking, in-place gradient,
backend choice); `calculate_log_probs_and_entropy` is a drop-in for slime's function of the same name. Reading order:
api.py (arguments) -> _validate.py (checks, cross-rank agreement, the one host read) -> _function.py (autograd,
communication) -> _backend.py (the backend contract) <- _torch_backend.py, _triton_backend.py (-> _triton_kernels.py)
-> _row_stats.py (merge math) and _layout.py (vocabulary shards and segments). The fused LM head from hidden states:
linear.py (log-probs and entropy) and linear_loss.py (a token loss, its gradient formed in the forward) -> _linear_shell.py
(their shared preparation and merge) -> _linear_function.py, _linear_loss_function.py (autograd) -> _linear_backend.py
(its contract) <- _linear_chunked.py (library GEMMs + the logits op's passes), _linear_torch.py, _linear_triton.py.
"""

from ppo_ops.api import LogProbsEntropy, calculate_log_probs_and_entropy, log_probs_and_entropy
from ppo_ops.linear import linear_log_probs_and_entropy
from ppo_ops.linear_loss import linear_token_loss
from ppo_ops import token_losses
from ppo_ops.token_losses import TokenLoss, grpo_advantages, grpo_loss, policy_loss

__all__ = ["LogProbsEntropy", "calculate_log_probs_and_entropy", "linear_log_probs_and_entropy", "linear_token_loss",
           "log_probs_and_entropy"]
__all__ += ["TokenLoss", "grpo_advantages", "grpo_loss", "policy_loss", "token_losses"]
