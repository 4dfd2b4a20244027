"""Shared pytest setup for tests/, the same under Bazel (tools/pytest.bzl) and plain `pytest tests/FILE.py`.

- Import paths: pytest.ini puts the repository root on sys.path (`pythonpath = .`); this file does too, for a run
  whose ini file is not ours, so `ppo_ops`, `sglang_checks` and `tests.*` import without installing anything.
- Environment defaults: the values tools/pytest.bzl gives CPU tests, applied only where the variable is unset, so a
  plain pytest run on a CPU machine behaves as the Bazel one. TRITON_INTERPRET=1 is left out when the run names a
  GPU file (*_gpu.py, or a GPU + SGLang file named by its issue): those run compiled Triton kernels on the GPU (run
  them in their own pytest call).
- File names with a '.' (test_qwen3_0.6B_parallel_check.py, fixed by issue 6) are imported by path.
- Seeds: every test starts from torch/numpy/random seeded with $PPO_OPS_TEST_SEED (default 0).
- Sharding: a test declared with shard_count runs its share of the collected tests ($TEST_SHARD_INDEX of
  $TEST_TOTAL_SHARDS, set by Bazel).
- free_port(): a free loopback TCP port for a gloo rendezvous (MASTER_ADDR=127.0.0.1).
"""

import importlib.util
import os
import pathlib
import random
import socket
import sys


import pytest

# Not resolved: under Bazel this is the runfiles copy of the workspace, never the source tree behind its symlinks.
REPO_ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_SEED = 0
GPU_FILE_SUFFIX = "_gpu.py"

# Defaults shared by every plain-pytest run (GPU files included); tools/pytest.bzl sets the same values explicitly.
_COMMON_DEFAULTS = {
    "TORCHDYNAMO_DISABLE": "1",  # megatron-core's jit_fuser is torch.compile: same results, no 15 s compile
    "GLOO_SOCKET_IFNAME": "lo",  # multi-rank CPU tests rendezvous on loopback
    "PPO_OPS_TEST_SEED": str(DEFAULT_SEED),
}


# GPU + SGLang test files keep the names their issue fixed; they count as GPU files too.
SGLANG_GPU_FILES = ("test_qwen3_0.6B_parallel_check.py",)


def is_gpu_file(path) -> bool:
    name = pathlib.Path(str(path).split("::")[0]).name
    return name.endswith(GPU_FILE_SUFFIX) or name in SGLANG_GPU_FILES


def _names_gpu_file(args):
    return any(is_gpu_file(arg) for arg in args)


class _PathImportedModule(pytest.Module):
    """A test file whose name has a '.' (test_qwen3_0.6B_...): the default import mode would read the dot as a
    package separator, so import it by path under a dot-free module name."""

    def _getobj(self):
        name = "tests." + self.path.stem.replace(".", "_")
        spec = importlib.util.spec_from_file_location(name, self.path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module


def pytest_pycollect_makemodule(module_path, parent):
    if "." in module_path.stem:
        return _PathImportedModule.from_parent(parent, path=module_path)
    return None


def pytest_configure(config):
    for name, value in _COMMON_DEFAULTS.items():
        os.environ.setdefault(name, value)
    # Before any test module (and so any Triton kernel) is imported: Triton reads it when a kernel is decorated.
    if not _names_gpu_file(config.args):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    _skip_gpu_files_under_interpreter(items)
    _keep_this_shard(config, items)


def _skip_gpu_files_under_interpreter(items):
    gpu_items = [item for item in items if is_gpu_file(item.path)]
    if not gpu_items or os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return  # GPU files skip themselves where there is no GPU
    reason = ("GPU test collected in a run with TRITON_INTERPRET=1 (CPU files were named too): "
              "run `pytest tests/*_gpu.py` on its own")
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))


def _keep_this_shard(config, items):
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    if total <= 1:
        return
    index = int(os.environ["TEST_SHARD_INDEX"])
    kept = [item for i, item in enumerate(items) if i % total == index]
    dropped = [item for i, item in enumerate(items) if i % total != index]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def base_seed():
    """The seed every test starts from ($PPO_OPS_TEST_SEED, default 0)."""
    return int(os.environ.get("PPO_OPS_TEST_SEED", DEFAULT_SEED))


@pytest.fixture(autouse=True)
def _seed_everything():
    seed = base_seed()
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)  # also seeds every CUDA device
    yield


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT of a gloo/NCCL rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
