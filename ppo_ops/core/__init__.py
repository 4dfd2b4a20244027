"""What both ops share: local checks, cross-rank agreement, the backend contracts, the vocabulary layout, the merge
math, the one call shell and the Triton helpers (ppo_ops/__init__.py gives the reading order)."""
