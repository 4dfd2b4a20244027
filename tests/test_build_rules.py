"""The build's own tests: what tools/pytest.bzl's macros declare, and the tag filters in .bazelrc.

A test cannot run Bazel inside Bazel, so this file executes the Starlark itself: tools/pytest.bzl and tests/BUILD
are kept to the Python-compatible subset of Starlark, and run here with a stub `native` that records each py_test.
That checks the real macros (tags, environment, sizes) and every target tests/BUILD declares with them.
"""

import builtins
import fnmatch
import pathlib
import shlex

import pytest

MACROS_FILE = pathlib.Path("tools/pytest.bzl")
TESTS_BUILD_FILE = pathlib.Path("tests/BUILD")
BAZELRC = pathlib.Path(".bazelrc")

GPU_TAGS = {"gpu", "requires-gpu-nvidia", "exclusive"}
GPU_REPRODUCIBILITY_ENV = {
    "TRITON_INTERPRET": "0",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONHASHSEED": "0",
    "PPO_OPS_TEST_SEED": "0",
}
CPU_ENV = {
    "TRITON_INTERPRET": "1",
    "TORCHDYNAMO_DISABLE": "1",
    "PYTHONHASHSEED": "0",
    "PPO_OPS_TEST_SEED": "0",
    "OMP_NUM_THREADS": "1",
}


class StarlarkError(Exception):
    """What Starlark's fail() raises here."""


class _Native:
    """Stand-in for Starlark's `native` module: records every rule call as (kind, attrs); glob sees `files`."""

    def __init__(self, files=()):
        self.rules = []
        self.files = list(files)

    def glob(self, patterns):
        return sorted(f for f in self.files if any(fnmatch.fnmatch(f, p) for p in patterns))

    def existing_rules(self):
        return {attrs["name"]: dict(attrs, kind=kind) for kind, attrs in self.rules if "name" in attrs}

    def __getattr__(self, kind):
        def record(*args, **attrs):  # exports_files, glob, ... take positional arguments too
            self.rules.append((kind, attrs))
        return record


def _fail(message):
    raise StarlarkError(message)


def _load_macros(native):
    scope = {"native": native, "fail": _fail}
    exec(compile(MACROS_FILE.read_text(), str(MACROS_FILE), "exec"), scope)
    return scope


class _BuildScope(dict):
    """Globals of a BUILD file: the loaded macros, plus a recorder for every other native rule or function."""

    def __init__(self, native):
        super().__init__(native=native)
        self._native = native

    def __missing__(self, name):
        if name.startswith("_"):  # not a Starlark name (e.g. pytest's __tracebackhide__ lookup)
            raise KeyError(name)
        if hasattr(builtins, name):  # len, range, dict, ...: Starlark has the same built-ins
            return getattr(builtins, name)
        return getattr(self._native, name)


def _declared_tests(build_file, files=()):
    """{target name: py_test attrs} for every test the BUILD file declares through tools/pytest.bzl."""
    native = _Native(files)
    scope = _BuildScope(native)

    def load(label, *names):
        assert label == "//tools:pytest.bzl", f"{build_file}: unexpected load of {label}"
        macros = _load_macros(native)
        for name in names:
            scope[name] = macros[name]

    scope["load"] = load
    exec(compile(build_file.read_text(), str(build_file), "exec"), scope)
    return {attrs["name"]: attrs for kind, attrs in native.rules if kind == "py_test"}


def _tests_of(macro_name, **kwargs):
    native = _Native()
    _load_macros(native)[macro_name](**kwargs)
    assert all(kind == "py_test" for kind, _ in native.rules)
    return {attrs["name"]: attrs for _, attrs in native.rules}


def _one_test(macro_name, **kwargs):
    (attrs,) = _tests_of(macro_name, **kwargs).values()
    return attrs


def test_cpu_macro_runs_pytest_on_one_file_under_the_interpreter():
    attrs = _one_test("cpu_pytest", name="test_x", src="test_x.py", deps=["//ppo_ops"])
    assert attrs["srcs"] == ["test_x.py", "//tools:pytest_main.py"]
    assert attrs["main"] == "//tools:pytest_main.py"
    assert attrs["args"] == ["$(rootpath test_x.py)"]
    assert attrs["deps"] == ["//ppo_ops"]
    assert {"//:pytest.ini", "//tests:conftest.py", "@ppo_python//:lock_stamp.txt"} <= set(attrs["data"])
    assert CPU_ENV.items() <= attrs["env"].items()
    assert attrs["size"] == "medium"
    assert not GPU_TAGS & set(attrs["tags"])
    assert attrs["legacy_create_init"] is False
    assert "shard_count" not in attrs and "timeout" not in attrs


def test_cpu_macro_passes_options_through():
    attrs = _one_test("cpu_pytest", name="t", src="test_t.py", size="large", env={"EXTRA": "1"}, tags=["slow"],
                      args=["-k", "edge"], shard_count=3, timeout="long")
    assert attrs["env"]["EXTRA"] == "1" and attrs["env"]["TRITON_INTERPRET"] == "1"
    assert attrs["args"] == ["$(rootpath test_t.py)", "-k", "edge"]
    assert (attrs["size"], attrs["shard_count"], attrs["timeout"], attrs["tags"]) == ("large", 3, "long", ["slow"])


def test_gpu_macro_tags_a_single_gpu_test():
    attrs = _one_test("gpu_pytest", name="t", src="test_t.py")
    assert set(attrs["tags"]) == GPU_TAGS
    assert GPU_REPRODUCIBILITY_ENV.items() <= attrs["env"].items()
    assert attrs["env"]["PPO_OPS_GPUS"] == "1"  # tools/pytest_main.py fails the target unless 1 GPU is visible
    assert attrs["size"] == "large"


@pytest.mark.parametrize("gpus", [2, 4, 8])  # the multi-GPU machines on offer
def test_gpu_macro_tags_multi_gpu_tests_with_their_count(gpus):
    attrs = _one_test("gpu_pytest", name="t", src="test_t.py", gpus=gpus, tags=["gpu", "nccl"])
    assert set(attrs["tags"]) == GPU_TAGS | {"multiaccelerator", f"gpus_{gpus}", "nccl"}
    assert len(attrs["tags"]) == len(set(attrs["tags"])), "a tag given twice is kept once"
    assert attrs["env"]["PPO_OPS_GPUS"] == str(gpus)


def test_one_declaration_gives_a_cpu_and_gpu_targets():
    tests = _tests_of("cpu_gpu_pytest", name="t", src="test_t.py", deps=["//ppo_ops"], gpus=2, wider_gpus=[4, 8],
                      args=["-x"], gpu_args=["-k", "cuda"])
    assert sorted(tests) == ["t", "t_gpu", "t_gpu4", "t_gpu8"]
    assert all(attrs["srcs"][0] == "test_t.py" and attrs["deps"] == ["//ppo_ops"] for attrs in tests.values())
    cpu = tests["t"]
    assert not GPU_TAGS & set(cpu["tags"]) and CPU_ENV.items() <= cpu["env"].items()
    assert cpu["args"] == ["$(rootpath test_t.py)", "-x"]
    gpu = tests["t_gpu"]
    assert set(gpu["tags"]) == GPU_TAGS | {"multiaccelerator", "gpus_2"}
    assert gpu["env"]["PPO_OPS_GPUS"] == "2" and "PPO_OPS_RANKS_ABOVE" not in gpu["env"]
    assert gpu["args"] == ["$(rootpath test_t.py)", "-x", "-k", "cuda"]
    # The wider targets run only what the narrower one cannot hold: ranks in (2, 4], then (4, 8].
    for name, gpus, above in (("t_gpu4", 4, 2), ("t_gpu8", 8, 4)):
        assert f"gpus_{gpus}" in tests[name]["tags"]
        env = tests[name]["env"]
        assert (env["PPO_OPS_GPUS"], env["PPO_OPS_RANKS_ABOVE"]) == (str(gpus), str(above))


def test_sglang_tests_carry_the_recorded_sglang_interpreter():
    attrs = _one_test("gpu_pytest", name="t", src="test_t.py", gpus=2, tags=["sglang"])
    assert {"@ppo_sglang_python//:runner_env.json", "@ppo_sglang_python//:sglang_python.txt"} <= set(attrs["data"])


@pytest.mark.parametrize("macro_name, kwargs, message", [
    ("cpu_pytest", dict(name="t", src="test_t.py", tags=["gpu"]), "use gpu_pytest"),
    ("cpu_pytest", dict(name="t", src="test_t.txt"), "one .py test file"),
    ("gpu_pytest", dict(name="t", src="test_t.py", gpus=0), "gpus must be >= 1"),
    ("cpu_gpu_pytest", dict(name="t", src="test_t.py", gpus=2, wider_gpus=[2]), "must each exceed"),
    ("cpu_gpu_pytest", dict(name="t", src="test_t.py", tags=["gpu"]), "do not tag it gpu"),
])
def test_macros_reject_misuse(macro_name, kwargs, message):
    with pytest.raises(StarlarkError, match=message.replace("*", r"\*")):
        _one_test(macro_name, **kwargs)


def test_declared_targets_split_cleanly_into_cpu_and_gpu():
    declared = _declared_tests(TESTS_BUILD_FILE)
    assert "test_build_rules" in declared, "this file's own target is missing from tests/BUILD"
    for name, attrs in declared.items():
        if "PPO_OPS_GPUS" in attrs["env"]:
            assert GPU_TAGS <= set(attrs["tags"]), f"{name}: GPU test without {GPU_TAGS - set(attrs['tags'])}"
            assert attrs["env"]["NCCL_NVLS_ENABLE"] == "0", name
        else:
            assert not GPU_TAGS & set(attrs["tags"]), f"{name}: CPU test tagged {GPU_TAGS & set(attrs['tags'])}"
            assert attrs["env"]["TRITON_INTERPRET"] == "1", name


# What --config=gpu2 must run on two GPUs (--config=gpu the one-GPU targets among them): every suite that makes sense
# there (the core suites, Triton, memory, errors, TP invariance and the multi-rank core over NCCL, parity, the Qwen3
# check).
GPU_SUITES = {
    "test_core_values_gpu": 1, "test_core_invariants_gpu": 1, "test_core_errors_gpu": 1, "test_core_properties_gpu": 1,
    "test_core_reliability_gpu": 1, "test_core_reliability_gpu2": 2,
    "test_core_memory_gpu": 1, "test_core_parallel_gpu": 2, "test_triton_backend_gpu": 1,
    "test_tp_invariance_gpu": 1, "test_tp_invariance_gpu2": 2,
    "test_tp_invariance_gpu4": 4, "test_tp_invariance_gpu8": 8,
    "test_ppo_logprob_entropy_gpu": 1, "test_ppo_logprob_entropy_gpu2": 2,
    "test_linear_log_probs_gpu": 1, "test_linear_log_probs_gpu2": 2,
    "test_linear_token_loss_gpu": 1, "test_linear_token_loss_gpu2": 2,
    "test_qwen3_parallel_check_gpu": 1, "test_qwen3_parallel_check_gpu2": 2, "test_qwen3_0.6B_parallel_check": 2,
}


def test_gpu_suites_are_declared_with_their_gpu_counts():
    declared = _declared_tests(TESTS_BUILD_FILE)
    for name, gpus in GPU_SUITES.items():
        assert name in declared, f"GPU target {name} missing from tests/BUILD"
        assert declared[name]["env"]["PPO_OPS_GPUS"] == str(gpus), name


def test_undeclared_check_names_test_files_without_a_target(tmp_path):
    build = "\n".join([
        'load("//tools:pytest.bzl", "cpu_gpu_pytest", "cpu_pytest", "undeclared_tests_check")',
        'cpu_pytest(name = "test_a", src = "test_a.py")',
        'cpu_gpu_pytest(name = "test_b", src = "test_b.py", gpus = 2)',
        'undeclared_tests_check(name = "test_check", src = "test_check.py")',
    ])
    files = ["test_a.py", "test_b.py", "test_c.py", "test_d_gpu.py", "test_check.py", "helper.py"]
    path = tmp_path / "BUILD"
    path.write_text(build)
    check = _declared_tests(path, files)["test_check"]
    assert check["env"]["PPO_OPS_UNDECLARED_TEST_FILES"] == "test_c.py test_d_gpu.py"


def _bazelrc_flags():
    flags = {}
    for line in BAZELRC.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words:
            flags.setdefault(words[0], []).extend(words[1:])
    return flags


def test_bazelrc_default_runs_cpu_tests_and_gpu_config_only_gpu_tests():
    flags = _bazelrc_flags()
    assert "--test_tag_filters=-gpu" in flags["test"]
    assert "--test_tag_filters=gpu,-gpus_2,-gpus_4,-gpus_8,-sglang" in flags["test:gpu"]  # a one-GPU runner
    assert "--local_test_jobs=1" in flags["test:gpu"]  # one GPU test at a time
    assert "--extra_toolchains=@ppo_gpu_python//:py_toolchain" in flags["build:gpu"]
    assert "--repo_env=PPO_OPS_BUILD_CONFIG=gpu" in flags["build:gpu"]
    assert flags["test:gpu2"][-1] == "--test_tag_filters=gpu,-gpus_4,-gpus_8,-sglang"
    assert flags["test:gpu4"][-1] == "--test_tag_filters=gpu,-gpus_8,-sglang"
    assert flags["test:gpu8"][-1] == "--test_tag_filters=gpu,-sglang"
    assert "--config=gpu" in flags["build:sglang"] and flags["test:sglang"][-1] == "--test_tag_filters=sglang"
    assert "--repo_env=PPO_OPS_BUILD_CONFIG=sglang" in flags["build:sglang"]


def test_bazelrc_keeps_actions_hermetic():
    build = _bazelrc_flags()["build"]
    assert "--incompatible_strict_action_env" in build
    assert "--sandbox_default_allow_network=false" in build
    assert "--spawn_strategy=sandboxed" in build
