"""The fused LM head: its two autograd Functions (function.py, loss_function.py) and its three backends."""
