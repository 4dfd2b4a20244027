"""Legacy reference for ppo_ops: the pre-fusion log-prob + entropy computation, kept as yardstick and bench baseline.

* ``log_probs.legacy_log_probs``: Megatron-core's real ``fused_vocab_parallel_cross_entropy`` (negated), with the keep
  mask applied the legacy way (-inf fill on a copy, target logit restored on its owning rank). Its backward rounds
  the log-prob gradient to bfloat16 — a legacy behaviour kept on purpose.
* ``entropy.legacy_entropy``: its own vocab-parallel autograd Function (3 all-reduces; NaN where a logit is -inf).
* ``api.calculate_log_probs_and_entropy``: the slime-compatible signature and return shapes of the core's function.

This package depends on megatron-core (imported lazily on the first log-prob call) and torch only — never on the fused
ppo_ops implementation, so it stays an independent reference.
"""

from ppo_ops.legacy.api import calculate_log_probs_and_entropy
from ppo_ops.legacy.entropy import legacy_entropy
from ppo_ops.legacy.log_probs import legacy_log_probs

__all__ = ["calculate_log_probs_and_entropy", "legacy_entropy", "legacy_log_probs"]
