"""What the product's programs share at run time, apart from the kernels: the Qwen3 check (//sglang_checks), the bench
(//tools/bench) and the developer tools, and the test suite's rank groups.

  cli.py    the command-line contract of the absl programs (help exits 0, bad input one line and exit 2, Ctrl-C one
            line and exit 130, caller-relative paths)
  ranks.py  spawned torch.distributed ranks: free_port, and how a rank leaves after its work

Never imported by ppo_ops/__init__.py: the kernel library stays free of absl. Import the modules directly
(`from ppo_ops.runtime import cli, ranks`); torch is imported only inside the functions that need it.
"""
