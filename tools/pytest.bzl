"""Test macros: one pytest file per Bazel test, split into CPU and GPU variants by tags (as JAX's per-backend tests).

    load("//tools:pytest.bzl", "cpu_pytest", "gpu_pytest")
    cpu_pytest(name = "test_foo", src = "test_foo.py", deps = ["//ppo_ops", ":test_support"])
    gpu_pytest(name = "test_foo_gpu", src = "test_foo_gpu.py", deps = ["//ppo_ops"], gpus = 2)

Each macro emits one py_test whose main is //tools:pytest_main.py; it runs pytest on `src` alone, from the runfiles
copy of the workspace, so the same file also runs with plain `pytest tests/FILE.py` from the repository root (where
pytest.ini and tests/conftest.py give the same imports and defaults). The interpreter is the pinned venv registered
in WORKSPACE (tools/python_toolchain.bzl). `.bazelrc` filters on the `gpu` tag: the default `bazel test //...` skips
GPU tests, `--config=gpu` runs only them.

Kept to the Python-compatible subset of Starlark: tests/test_build_rules.py executes this file with a stub `native`
to check the tags and environment each macro produces.
"""

# Every test also gets: the pytest config (rootdir, pythonpath), the shared conftest, and the hash of the lock the
# venv was built from (so a new lock reruns cached tests).
_COMMON_DATA = [
    "//:pytest.ini",
    "//tests:conftest.py",
    "@ppo_python//:lock_stamp.txt",
]

_PYTEST_MAIN = "//tools:pytest_main.py"

# Read by tests/conftest.py to seed torch, numpy and random before every test.
_SEED_ENV = {
    "PPO_OPS_TEST_SEED": "0",
    "PYTHONHASHSEED": "0",  # stable str hashing, so set/dict iteration order is the same run to run
}

CPU_TEST_ENV = dict(_SEED_ENV, **{
    # Triton kernels are tested on CPU tensors under the interpreter (must be set before triton is imported).
    "TRITON_INTERPRET": "1",
    # megatron-core's jit_fuser is torch.compile: same results without it, and no 15 s compile per process.
    "TORCHDYNAMO_DISABLE": "1",
    # One intra-op thread per test: Bazel already runs one test per core (--local_test_jobs), and multi-rank tests
    # spawn several processes; more threads would oversubscribe a 2-core CI machine.
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # gloo binds to loopback; the sandbox gives tests no other interface.
    "GLOO_SOCKET_IFNAME": "lo",
    # CPU tests see no GPU, so they behave the same on a GPU runner as on a CPU machine.
    "CUDA_VISIBLE_DEVICES": "",
})

GPU_TEST_ENV = dict(_SEED_ENV, **{
    # Deterministic cuBLAS (needed by torch.use_deterministic_algorithms for matmuls).
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    # NVLink multicast (NVLS) off for NCCL, torch symmetric memory and NVSHMEM, as the lent GPU machines require.
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    # Same megatron-core setting as on CPU, so GPU results compare against the same code path.
    "TORCHDYNAMO_DISABLE": "1",
})

def gpu_tags(gpus):
    """Tags of a GPU test needing `gpus` GPUs; each tag's reason is next to it."""
    tags = [
        "gpu",  # selects the test into --config=gpu and out of the default run (.bazelrc tag filters)
        "requires-gpu-nvidia",  # the runner must have an NVIDIA GPU (executors route on requires-* tags)
        "exclusive",  # nothing else runs at the same time: the test assumes the whole GPU(s) and their memory
    ]
    if gpus > 1:
        tags.append("multiaccelerator")  # needs several GPUs of one host (NCCL)
        tags.append("gpus_%d" % gpus)  # how many, for schedulers that place tests by GPU count
    return tags

def _pytest(name, src, deps, data, env, tags, args, size, timeout, shard_count):
    if not src.endswith(".py"):
        fail("%s: src must be one .py test file, got %r" % (name, src))
    attrs = {}
    if timeout != None:
        attrs["timeout"] = timeout
    if shard_count != None:
        attrs["shard_count"] = shard_count
    native.py_test(
        name = name,
        srcs = [src, _PYTEST_MAIN],
        main = _PYTEST_MAIN,
        # The runner gets the test file's runfiles path first; anything after goes to pytest unchanged.
        args = ["$(rootpath %s)" % src] + args,
        deps = deps,
        data = _COMMON_DATA + data,
        env = env,
        tags = tags,
        size = size,
        python_version = "PY3",
        srcs_version = "PY3",
        # No generated __init__.py files: the runfiles tree keeps the source tree's packages, as plain pytest sees it.
        legacy_create_init = False,
        **attrs
    )

def cpu_pytest(name, src, deps = [], data = [], size = "medium", env = {}, tags = [], args = [], shard_count = None, timeout = None):
    """pytest on one CPU test file; Triton runs under its interpreter. Included in the default `bazel test //...`."""
    if "gpu" in tags or src.endswith("_gpu.py"):
        fail("%s: %s is a GPU test (tagged gpu or named *_gpu.py); use gpu_pytest" % (name, src))
    _pytest(
        name = name,
        src = src,
        deps = deps,
        data = data,
        env = dict(CPU_TEST_ENV, **env),
        tags = tags,
        args = args,
        size = size,
        timeout = timeout,
        shard_count = shard_count,
    )

def gpu_pytest(name, src, deps = [], data = [], gpus = 1, size = "large", env = {}, tags = [], args = []):
    """pytest on one *_gpu.py file on `gpus` NVIDIA GPUs; run by `bazel test --config=gpu //...`, one at a time."""
    if gpus < 1:
        fail("%s: gpus must be >= 1, got %d" % (name, gpus))
    # GPU + SGLang tests keep the file name their issue fixed (tests/test_qwen3_0.6B_parallel_check.py); they are
    # recognised by their `sglang` tag instead of the *_gpu.py suffix.
    if not src.endswith("_gpu.py") and "sglang" not in tags:
        fail("%s: GPU test files are named *_gpu.py (plain pytest runs them apart from CPU files), got %r" % (name, src))
    _pytest(
        name = name,
        src = src,
        deps = deps,
        data = data,
        env = dict(GPU_TEST_ENV, **env),
        tags = gpu_tags(gpus) + [t for t in tags if t not in gpu_tags(gpus)],
        args = args,
        size = size,
        timeout = None,
        shard_count = None,
    )

def _file_name(label):
    return label.split(":")[-1].split("/")[-1]

def undeclared_tests_check(name, src):
    """Call last in a BUILD file: a CPU test that fails while a test_*.py file here has no test target.

    The list is computed at loading time from file names only, so editing a test file does not rerun this check;
    adding or removing one does. `src` is the checking test file (it asserts the list it is given is empty).
    """
    declared = [
        _file_name(rule["srcs"][0])
        for rule in native.existing_rules().values()
        if rule["kind"] == "py_test" and rule.get("srcs")
    ]
    undeclared = [f for f in native.glob(["test_*.py"]) if f not in declared and f != src]
    cpu_pytest(
        name = name,
        src = src,
        env = {"PPO_OPS_UNDECLARED_TEST_FILES": " ".join(undeclared)},
    )
