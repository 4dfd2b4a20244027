"""Shared pytest setup for tests/, the same under Bazel (tools/pytest.bzl) and plain `pytest tests/FILE.py`.

- Import paths: pytest.ini puts the repository root on sys.path (`pythonpath = .`); this file does too, for a run
  whose ini file is not ours, so `ppo_ops`, `sglang_checks` and `tests.*` import without installing anything.
- Environment defaults: the values tools/pytest.bzl gives CPU tests, applied only where the variable is unset, so a
  plain pytest run on a CPU machine behaves as the Bazel one. TRITON_INTERPRET=1 and TORCHINDUCTOR_COMPILE_THREADS=1
  are set only where no GPU is visible: a plain run on a GPU machine runs compiled kernels on CUDA, as the `_gpu`
  Bazel targets do.
- Ranks per case: a test that needs n ranks is marked `world_size(n)` (tests/ranks.py). A GPU target
  ($PPO_OPS_GPUS GPUs, tools/pytest.bzl) deselects the cases that need more ranks than it has GPUs (they run in
  its wider `_gpuN` targets, which keep only those, and on CPU over gloo) and says so in its summary; plain pytest
  on a GPU machine skips them with the reason.
- File names with a '.' (test_qwen3_0.6B_parallel_check.py, a name users know) are imported by path.
- Seeds: every test starts from torch/numpy/random seeded with $PPO_OPS_TEST_SEED (default 0).
- Sharding: a test declared with shard_count runs its share of the collected tests ($TEST_SHARD_INDEX of
  $TEST_TOTAL_SHARDS, set by Bazel); the cases that share a fixture wider than one test run in one shard.
"""

import importlib.util
import os
import pathlib
import random
import sys
import zlib


import pytest

# Not resolved: under Bazel this is the runfiles copy of the workspace, never the source tree behind its symlinks.
REPO_ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_SEED = 0
GPUS_VAR = "PPO_OPS_GPUS"  # tools/pytest.bzl: GPUs a GPU target declares
RANKS_ABOVE_VAR = "PPO_OPS_RANKS_ABOVE"  # tools/pytest.bzl: a wider GPU target runs only cases above this many ranks

# Defaults shared by every plain-pytest run (GPU files included); tools/pytest.bzl sets the same values explicitly.
_COMMON_DEFAULTS = {
    "TORCHDYNAMO_DISABLE": "1",  # megatron-core's jit_fuser is torch.compile: same results, no 15 s compile
    "GLOO_SOCKET_IFNAME": "lo",  # multi-rank CPU tests rendezvous on loopback
    "PPO_OPS_TEST_SEED": str(DEFAULT_SEED),
}

# Defaults of a plain-pytest run where no GPU is visible; tools/pytest.bzl sets the same values for CPU targets.
_CPU_DEFAULTS = {
    "TRITON_INTERPRET": "1",  # Triton reads it when a kernel is decorated
    # Inductor compiles in the process that compiles (spawned ranks inherit it): a pool of compile workers would each
    # start and import torch, more CPU than the small kernels the tests compile. Read as inductor's config is imported.
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
}


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
    config.addinivalue_line("markers", "world_size(n): the case runs on n ranks (tests/ranks.py)")
    config.addinivalue_line("markers", 'device(name): runs only where tests/ranks.py\'s DEVICE is "cpu" or "cuda"')
    # Before any test module is imported (the values are read at import); torch only where one is unset.
    if any(name not in os.environ for name in _CPU_DEFAULTS) and not _gpu_visible():
        for name, value in _CPU_DEFAULTS.items():
            os.environ.setdefault(name, value)


def _gpu_visible() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    _keep_this_device(config, items)
    _place_by_world_size(config, items)
    _keep_this_shard(config, items)


_deselected_for_device = []


def _keep_this_device(config, items):
    """Cases marked device("cpu") or device("cuda") run only where that is the test device (the interpreter's checks on
    CPU, compiled kernels at real sizes on CUDA); device("any") and unmarked cases run everywhere."""
    marked = [(item, item.get_closest_marker("device")) for item in items]
    if not any(marker for _, marker in marked):
        return
    here = "cuda" if _gpu_visible() else "cpu"
    dropped = [item for item, marker in marked if marker and marker.args[0] not in ("any", here)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        _deselected_for_device.append((len(dropped), here))
        items[:] = [item for item in items if item not in dropped]


def _world_size(item) -> int:
    marker = item.get_closest_marker("world_size")
    return marker.args[0] if marker else 1


_deselected_for_ranks = []


def _place_by_world_size(config, items):
    declared = int(os.environ.get(GPUS_VAR, "0"))
    if declared:  # a GPU target: run exactly the cases its GPUs hold (a skip would fail it)
        above = int(os.environ.get(RANKS_ABOVE_VAR, "0"))
        kept = [item for item in items if above < _world_size(item) <= declared]
        dropped = [item for item in items if item not in kept]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            _deselected_for_ranks.append((len(dropped), declared, above))
        items[:] = kept
        return
    if _gpu_visible():
        import torch

        count = torch.cuda.device_count()
        for item in items:
            if _world_size(item) > count:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs {_world_size(item)} GPUs for its NCCL ranks, {count} visible"))


def pytest_terminal_summary(terminalreporter):
    for dropped, here in _deselected_for_device:
        other = "CUDA (the _gpu target)" if here == "cpu" else "CPU under the Triton interpreter (the CPU target)"
        terminalreporter.write_line(f"{dropped} case(s) deselected: written for {other}; this run is on {here}")
    for dropped, declared, above in _deselected_for_ranks:
        where = (f"only cases needing more than {above} ranks run here" if above else
                 "they run in this file's wider _gpuN targets (bazel test --config=gpu2 / gpu4 / gpu8) "
                 "and on CPU over gloo")
        terminalreporter.write_line(
            f"{dropped} case(s) deselected: this target declares {declared} GPU(s); {where}")


def _shared_fixtures(item) -> tuple:
    """The names of the fixtures wider than one test that `item` uses (module, class, package or session scope):
    the cases that share one such fixture share its cost, so they go to the same shard."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return ()
    return tuple(sorted(name for name, defs in info.name2fixturedefs.items()
                        if defs and defs[-1].scope != "function" and _ours(defs[-1].func)))


def _ours(func) -> bool:
    """A fixture written in this repository (not pytest's own, such as tmp_path_factory, or a plugin's)."""
    path = getattr(getattr(func, "__code__", None), "co_filename", "")
    return os.path.abspath(path).startswith(str(REPO_ROOT) + os.sep)


def _keep_this_shard(config, items):
    """This shard's cases ($TEST_SHARD_INDEX of $TEST_TOTAL_SHARDS). Cases that share a wider fixture (a module-scoped
    result computed once at every TP size, say) stay together, since each shard holding one of them would compute
    it again; the groups, then the other cases one by one, go in collection order to the shard with the fewest cases
    so far, in an order fixed by a hash of each group's first node id rather than by position: parametrized cases
    alternate their parameters (torch, triton, torch, ...), and a round robin in collection order would give one
    shard every costly one. Every shard computes the same assignment from the same collection."""
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    if total <= 1:
        return
    index = int(os.environ["TEST_SHARD_INDEX"])
    shared_by = [_shared_fixtures(item) for item in items]
    everywhere = set.intersection(*(set(f) for f in shared_by)) if shared_by else set()  # no help in choosing
    groups: dict = {}
    for position, names in enumerate(shared_by):
        shared = tuple(n for n in names if n not in everywhere)
        groups.setdefault(shared if shared else ("", position), []).append(position)
    load = [0] * total
    mine = set()
    for members in sorted(groups.values(), key=lambda m: (-len(m), zlib.crc32(items[m[0]].nodeid.encode()), m[0])):
        shard = min(range(total), key=lambda s: (load[s], s))
        load[shard] += len(members)
        if shard == index:
            mine.update(members)
    kept = [item for i, item in enumerate(items) if i in mine]
    dropped = [item for i, item in enumerate(items) if i not in mine]
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
