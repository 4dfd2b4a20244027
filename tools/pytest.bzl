"""Test macros: one pytest file per Bazel test, with CPU and GPU variants split by tags (as JAX's per-backend tests).

    load("//tools:pytest.bzl", "cpu_pytest", "gpu_pytest", "cpu_gpu_pytest")
    cpu_pytest(name = "test_foo", src = "test_foo.py", deps = ["//ppo_ops", ":test_support"])
    cpu_gpu_pytest(name = "test_bar", src = "test_bar.py", deps = [...], gpus = 2, wider_gpus = [4, 8])
    gpu_pytest(name = "test_baz", src = "test_baz.py", gpus = 2, tags = ["sglang"])

cpu_gpu_pytest is the usual one: a file that makes sense on both devices is declared once and runs as `test_bar`
(CPU: Triton under its interpreter, gloo for several ranks) and `test_bar_gpu` (compiled Triton on CUDA, NCCL with one
GPU per rank); `wider_gpus` adds `test_bar_gpu4`, `test_bar_gpu8` for the cases that need more ranks than `gpus`
(tests mark them `@pytest.mark.world_size(n)`; tests/conftest.py deselects what a target's GPUs cannot hold and
runs it where they can). The test file picks its device from what it sees (tests/core_support.py: cuda when visible).

A GPU target never passes by skipping (tools/pytest_main.py): it fails at once when fewer GPUs than it declares are
visible, and a test that skips inside it fails the target.

Each macro emits one py_test whose main is //tools:pytest_main.py; it runs pytest on `src` alone, from the runfiles
copy of the workspace, so the same file also runs with plain `pytest tests/FILE.py` from the repository root (where
pytest.ini and tests/conftest.py give the same imports and defaults). The interpreter is the pinned venv registered
in WORKSPACE (tools/python_toolchain.bzl). `.bazelrc` filters on the `gpu` tag: the default `bazel test //...` skips
GPU tests, `--config=gpu` runs only them, with the GPU runner's interpreter (tools/runner_toolchains.bzl).

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

# SGLang-tagged tests: the probed record of the SGLang interpreter and its path, which tools/pytest_main.py passes to
# the test as PPO_OPS_SGLANG_PYTHON (placeholders unless --config=sglang; tools/runner_toolchains.bzl).
_SGLANG_DATA = [
    "@ppo_sglang_python//:runner_env.json",
    "@ppo_sglang_python//:sglang_python.txt",
]

# Every test, CPU and GPU.
_COMMON_ENV = {
    "PPO_OPS_TEST_SEED": "0",  # read by tests/conftest.py to seed torch, numpy and random before every test
    "PYTHONHASHSEED": "0",  # stable str hashing, so set/dict iteration order is the same run to run
    # No pytest plugins from installed packages' entry points (hypothesis', anyio's): no test uses one, and pytest
    # rewrites the asserts of every module of such a package as it is imported, in every test process (about a second
    # of CPU each: the rewritten bytecode cannot be cached in the venv from inside the sandbox).
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
}

CPU_TEST_ENV = dict(_COMMON_ENV, **{
    # Triton kernels are tested on CPU tensors under the interpreter (must be set before triton is imported).
    "TRITON_INTERPRET": "1",
    # Inductor compiles in the process that compiles: its default pool of compile workers would each start and import
    # torch, more CPU than the small kernels the tests compile.
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
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

GPU_TEST_ENV = dict(_COMMON_ENV, **{
    # Compiled Triton kernels on the GPU (tests/conftest.py would otherwise default a plain run to the interpreter).
    "TRITON_INTERPRET": "0",
    # Deterministic cuBLAS (needed by torch.use_deterministic_algorithms for matmuls).
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    # NVLink multicast (NVLS) off for NCCL, torch symmetric memory and NVSHMEM: on shared multi-GPU hosts it can take
    # GPUs others use out of service.
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    # Same megatron-core setting as on CPU, so GPU results compare against the same code path.
    "TORCHDYNAMO_DISABLE": "1",
})

# Read by tools/pytest_main.py (fail unless this many GPUs are visible; a skip fails the target) and tests/conftest.py
# (deselect cases that need more ranks than GPUs).
GPUS_VAR = "PPO_OPS_GPUS"

# Set on wider_gpus targets: only the cases that need more ranks than the base GPU target holds run there.
RANKS_ABOVE_VAR = "PPO_OPS_RANKS_ABOVE"

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
    if "gpu" in tags:
        fail("%s: %s is a GPU test (tagged gpu); use gpu_pytest or cpu_gpu_pytest" % (name, src))
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

def _gpu_env(gpus, env):
    return dict(GPU_TEST_ENV, **dict({GPUS_VAR: str(gpus)}, **env))

def _gpu_test_tags(gpus, tags):
    return gpu_tags(gpus) + [t for t in tags if t not in gpu_tags(gpus)]

def gpu_pytest(name, src, deps = [], data = [], gpus = 1, size = "large", env = {}, tags = [], args = []):
    """pytest on one file on `gpus` NVIDIA GPUs only; run by `bazel test --config=gpu //...`, one at a time.
    For a file that also makes sense on CPU, use cpu_gpu_pytest."""
    if gpus < 1:
        fail("%s: gpus must be >= 1, got %d" % (name, gpus))
    if "sglang" in tags:
        data = data + _SGLANG_DATA
    _pytest(
        name = name,
        src = src,
        deps = deps,
        data = data,
        env = _gpu_env(gpus, env),
        tags = _gpu_test_tags(gpus, tags),
        args = args,
        size = size,
        timeout = None,
        shard_count = None,
    )

def cpu_gpu_pytest(
        name,
        src,
        deps = [],
        data = [],
        gpus = 1,
        wider_gpus = [],
        size = "medium",
        env = {},
        tags = [],
        args = [],
        gpu_args = [],
        shard_count = None,
        timeout = None):
    """One test file on both devices: `name` on CPU and `name_gpu` on `gpus` GPUs; `wider_gpus` (e.g. [4, 8]) adds
    `name_gpuN` with only the cases that need more than `gpus` ranks. `gpu_args` go to the GPU targets' pytest."""
    if "gpu" in tags:
        fail("%s: cpu_gpu_pytest makes the GPU targets itself; do not tag it gpu" % name)
    for wider in wider_gpus:
        if wider <= gpus:
            fail("%s: wider_gpus must each exceed gpus=%d, got %d" % (name, gpus, wider))
    cpu_pytest(
        name = name,
        src = src,
        deps = deps,
        data = data,
        size = size,
        env = env,
        tags = tags,
        args = args,
        shard_count = shard_count,
        timeout = timeout,
    )
    gpu_pytest(
        name = name + "_gpu",
        src = src,
        deps = deps,
        data = data,
        gpus = gpus,
        env = env,
        tags = tags,
        args = args + gpu_args,
    )
    below = gpus
    for wider in wider_gpus:
        gpu_pytest(
            name = "%s_gpu%d" % (name, wider),
            src = src,
            deps = deps,
            data = data,
            gpus = wider,
            env = dict(env, **{RANKS_ABOVE_VAR: str(below)}),
            tags = tags,
            args = args + gpu_args,
        )
        below = wider

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
