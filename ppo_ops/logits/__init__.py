"""The logits op: its autograd Function (function.py), its PyTorch and Triton backends and the Triton kernels."""
