"""Registers every backend of both ops, and the LM head's router (lm_head/paths.py, backend_key), with the core
(core/registry.py), which imports nothing above itself.

Each loader imports its module only when the shell first selects it, so `import ppo_ops` works without triton and
TRITON_INTERPRET is read when a Triton backend is first chosen. `ppo_ops/__init__.py` imports this module.
"""

from ppo_ops.core import registry


def _logits_torch():
    from ppo_ops.logits import torch_backend
    return torch_backend.BACKEND


def _logits_triton():
    from ppo_ops.logits import triton_backend
    return triton_backend.BACKEND


def _lm_head_torch():
    from ppo_ops.lm_head import torch_backend
    return torch_backend.BACKEND


def _lm_head_triton():
    from ppo_ops.lm_head import triton_backend
    return triton_backend.BACKEND


def _lm_head_router():
    from ppo_ops.lm_head import paths
    return paths.backend_key


def _segments(passes):
    def load():
        from ppo_ops.lm_head import segment_gemms
        return segment_gemms.backend(passes)
    return load


def _sglang(kind):
    def load():
        from ppo_ops.lm_head import sglang_head
        return sglang_head.backend(kind)
    return load


registry.register("logits", "torch", _logits_torch)
registry.register("logits", "triton", _logits_triton)
registry.register("lm_head", "torch", _lm_head_torch)
registry.register("lm_head", "triton", _lm_head_triton)
registry.register("lm_head_segments", "torch", _segments("torch"))
registry.register("lm_head_segments", "triton", _segments("triton"))
registry.register("lm_head_sglang", "torch", _sglang("torch"))
registry.register("lm_head_sglang", "triton", _sglang("triton"))
registry.register_router("lm_head", _lm_head_router)
