"""The Qwen3 parallel check: do trainer log-probs equal the rollout engine's, in every parallel layout?

Pipeline (one concern per module):
  models.py    -> a Qwen3 checkpoint directory (generated `tiny` / `qwen3-0.6b-random`, cached, or the user's) and
                  its fingerprint
  prompts.py   -> token-id prompts (built in, or a JSONL file)
  engines/     -> rollout: the engine samples completions and returns the log-prob of every sampled token;
                  each engine layout then teacher-force scores the saved rollout (engine layout consistency)
  rollout.py   -> the saved rollout (tokens, engine log-probs, settings, model fingerprint) and its replay
  trainer.py   -> trainer-side scoring with ppo_ops under each trainer layout, on real torch.distributed ranks
  metrics.py   -> the comparisons and their tolerances
  report.py    -> report.json, report.md, a PNG histogram
The binary is qwen3_parallel_check.py.
"""
