"""The build's own tests: the pinned environment (interpreter, lock) and what a test action may see.

Run by Bazel (`//tests:test_build_env`) and by plain `pytest tests/test_build_env.py` from the repository root with
the venv's pytest. The interpreter and lock checks hold in both; the sandbox checks need a `bazel test` action.
"""

import hashlib
import importlib.metadata
import os
import pathlib
import re
import socket
import sys
import sysconfig

import pytest

LOCK_FILE = "requirements.lock"
CONSTRAINTS_FILE = "constraints.txt"
REQUIREMENTS_IN = "requirements.in"
VENV_STAMP = ".ppo_ops_lock.sha256"  # written by tools/bootstrap.sh into .venv
TOOLCHAIN_STAMP = "../ppo_python/lock_stamp.txt"  # runfiles of @ppo_python, relative to the workspace root
PINNED_TORCH = "2.13.0+cpu"
# A pin's first line; its indented `--hash=` lines and file-name comments follow (tests/test_build_lock.py).
EXACT_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^=;\s\\]+)( \\)?$")

under_bazel = pytest.mark.skipif(
    "TEST_SRCDIR" not in os.environ,
    reason="needs a `bazel test` action: checks the environment tools/pytest_main.py and .bazelrc give tests")


def _normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock_pins():
    pins = {}
    for line in pathlib.Path(LOCK_FILE).read_text().splitlines():
        if not line.strip() or line.startswith(("#", " ")):
            continue
        match = EXACT_PIN.match(line)
        assert match, f"{LOCK_FILE}: not an exact pin `name==version`: {line!r}"
        name = _normalize(match.group(1))
        assert name not in pins, f"{LOCK_FILE}: {name} pinned twice"
        pins[name] = match.group(2)
    return pins


def _requirement_names(path):
    names = []
    for line in pathlib.Path(path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.append(_normalize(re.split(r"[<>=!~\[;\s]", line, maxsplit=1)[0]))
    return names


def _workspace_root():
    # pytest.ini is a symlink into the source tree under Bazel, a plain file under pytest: both resolve to the checkout.
    return pathlib.Path("pytest.ini").resolve().parent


def test_interpreter_is_the_workspace_venv():
    prefix = pathlib.Path(sys.prefix)
    assert sys.prefix != sys.base_prefix, f"{sys.executable} is not a venv interpreter"
    assert prefix == _workspace_root() / ".venv", f"interpreter prefix {prefix}, expected {_workspace_root()}/.venv"
    assert pathlib.Path(sys.executable).parent == prefix / "bin", sys.executable


def test_venv_was_built_from_this_lock():
    lock_hash = hashlib.sha256(pathlib.Path(LOCK_FILE).read_bytes()).hexdigest()
    stamp = pathlib.Path(sys.prefix) / VENV_STAMP
    assert stamp.is_file(), f"{stamp} missing: run tools/bootstrap.sh"
    assert stamp.read_text().strip() == lock_hash, "venv is stale: run tools/bootstrap.sh"


def test_lock_pins_every_package_exactly():
    pins = _lock_pins()
    assert pins["torch"] == PINNED_TORCH
    for name in _requirement_names(REQUIREMENTS_IN):
        assert name in pins, f"{REQUIREMENTS_IN} asks for {name}, {LOCK_FILE} does not pin it"
    assert "sglang" not in pins, "sglang pins a CUDA torch; it stays out of the CPU lock"


def test_constraints_hold_torch_at_the_locked_cpu_wheel():
    assert f"torch=={PINNED_TORCH}" in pathlib.Path(CONSTRAINTS_FILE).read_text().splitlines()


def test_installed_packages_are_exactly_the_lock():
    pins = _lock_pins()
    # The venv's own site-packages only: in a shared pytest process an import may have put a vendored copy on
    # sys.path (setuptools/_vendor holds its own packaging-*.dist-info), which is not an installed package.
    site_packages = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    installed = {_normalize(dist.metadata["Name"]): dist.version
                 for dist in importlib.metadata.distributions(path=site_packages)}
    wrong = {name: (installed.get(name), version) for name, version in pins.items() if installed.get(name) != version}
    assert not wrong, f"installed vs locked: {wrong}; run tools/bootstrap.sh"
    unlocked = sorted(set(installed) - set(pins))
    assert not unlocked, f"installed but not in {LOCK_FILE}: {unlocked}; re-freeze the lock (docs/contributing.md)"


def test_imported_torch_is_the_locked_one():
    import torch

    assert torch.__version__ == PINNED_TORCH
    assert pathlib.Path(torch.__file__).is_relative_to(sys.prefix)


@under_bazel
def test_toolchain_stamp_matches_the_lock():
    # The toolchain repository re-reads the lock when it changes; every test carries the stamp as data.
    stamp = pathlib.Path(TOOLCHAIN_STAMP)
    lock_hash = hashlib.sha256(pathlib.Path(LOCK_FILE).read_bytes()).hexdigest()
    assert stamp.read_text().strip() == lock_hash


@under_bazel
def test_caches_and_home_live_in_the_test_tmpdir():
    tmp = pathlib.Path(os.environ["TEST_TMPDIR"]).resolve()
    for var in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "HF_HOME", "MPLCONFIGDIR"):
        assert pathlib.Path(os.environ[var]).resolve().is_relative_to(tmp), f"{var}={os.environ[var]}"


@under_bazel
def test_only_the_intended_environment_reaches_the_test():
    # --incompatible_strict_action_env; Bazel's test wrapper puts "." in front.
    assert [p for p in os.environ["PATH"].split(":") if p != "."] == ["/bin", "/usr/bin", "/usr/local/bin"]
    assert "PYTHONPATH" not in os.environ or all(
        not pathlib.Path(p).resolve().is_relative_to(pathlib.Path.home()) for p in os.environ["PYTHONPATH"].split(":"))
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert os.environ["TORCHDYNAMO_DISABLE"] == "1"
    assert os.environ["PYTHONHASHSEED"] == "0"


@under_bazel
def test_sys_path_holds_only_runfiles_venv_and_stdlib():
    runfiles = pathlib.Path(os.environ["TEST_SRCDIR"]).absolute()
    allowed = (runfiles, pathlib.Path(sys.prefix), pathlib.Path(sys.base_prefix))
    stray = [p for p in sys.path if p and not any(pathlib.Path(p).absolute().is_relative_to(a) for a in allowed)]
    assert not stray, f"sys.path entries outside runfiles/venv/stdlib: {stray}"


@under_bazel
def test_network_is_loopback_only():
    names = {name for _, name in socket.if_nameindex()}
    assert names == {"lo"}, f"sandboxed tests should see only loopback, see {sorted(names)}"


def test_loopback_tcp_round_trip():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname(), timeout=10) as client:
            conn, _ = server.accept()
            with conn:
                client.sendall(b"ping")
                assert conn.recv(4) == b"ping"


def test_shared_memory_is_writable():
    # torch.multiprocessing passes tensors between ranks through /dev/shm.
    path = pathlib.Path("/dev/shm") / f"ppo_ops_test_{os.getpid()}"
    path.write_bytes(b"x" * 4096)
    try:
        assert path.read_bytes() == b"x" * 4096
    finally:
        path.unlink()


GLOO_WORLD_SIZE = 2


def _gloo_all_reduce(rank, world_size, out_dir):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    pathlib.Path(out_dir, f"rank{rank}").write_text(str(value.item()))


def test_gloo_all_reduce_over_loopback(tmp_path):
    # The multi-rank CPU tests rely on this: spawned ranks rendezvous on 127.0.0.1 and all-reduce.
    from tests.ranks import run_gloo

    run_gloo(GLOO_WORLD_SIZE, _gloo_all_reduce, str(tmp_path))
    got = [float((tmp_path / f"rank{r}").read_text()) for r in range(GLOO_WORLD_SIZE)]
    assert got == [3.0, 3.0]


def test_library_imports_from_the_checkout_layout():
    import ppo_ops

    assert pathlib.Path(ppo_ops.__file__).absolute() == pathlib.Path("ppo_ops/__init__.py").absolute()
