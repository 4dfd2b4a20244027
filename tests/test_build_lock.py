"""The hashed lock: requirements.lock's hashes, and tools/bootstrap.sh's hash-checked install, offline.

- requirements.lock: every pin carries sha256 hashes in the layout pip reads (the one tools/lock_hashes.py writes),
  one named file per hash, each a file of that pin that pip could install on CPython 3.11, Linux x86_64; torch's
  include its +cpu manylinux x86_64 wheel.
- tools/bootstrap.sh itself, on a scratch venv and lock (PPO_OPS_VENV, PPO_OPS_LOCK) with pip reading one local
  find-links folder and nothing else (no index, no machine pip config): a wrong hash is refused with bootstrap's
  one-line explanation, nothing installed and no stamp; the right hashes install and stamp; --freeze re-hashes every
  pin from that folder.
- tools/lock_hashes.py on a local index and find-links folder: which files count, a conflict and a missing file fail.

Run by Bazel (`//tests:test_build_lock`, sandboxed without network) and by plain pytest from the repository root.
About 30 s under Bazel on 2 cores (20 s under plain pytest): two scratch venvs.
"""

import base64
import ensurepip
import hashlib
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

from tools import lock_hashes

LOCK_FILE = pathlib.Path("requirements.lock")
BOOTSTRAP = pathlib.Path("tools/bootstrap.sh")
LOCK_HASHES = pathlib.Path("tools/lock_hashes.py")
VENV_STAMP = ".ppo_ops_lock.sha256"  # written by tools/bootstrap.sh into the venv
TORCH_WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
WRONG_HASH = "0" * 64


def _sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def _make_wheel(folder, name, version, tag="py3-none-any"):
    """A minimal installable wheel (one module) in folder; returns its path."""
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n".encode(),
    }
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
              f"{len(data)}" for path, data in files.items()] + [f"{dist_info}/RECORD,,"]
    wheel = pathlib.Path(folder) / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return wheel


def _write_lock(path, blocks):
    """A lock in requirements.lock's layout: a header, then format_pin's blocks from {(name, version): {file: hash}}."""
    body = "\n".join(lock_hashes.format_pin(name, version, files) for (name, version), files in blocks.items())
    path.write_text(f"# scratch lock\n{body}\n")
    return path


# --- requirements.lock --------------------------------------------------------------------------------------------


def test_every_pin_carries_the_hashes_of_its_named_files():
    pins = lock_hashes.parse_lock(LOCK_FILE.read_text())  # raises on a line pip would read differently
    assert len(pins) > 10
    for name, (version, hashes, files) in pins.items():
        assert hashes, f"{LOCK_FILE}: {name}=={version} has no --hash"
        assert len(hashes) == len(set(hashes)) == len(files), (
            f"{LOCK_FILE}: {name}=={version} has {len(hashes)} hashes for {len(files)} named files")
        for filename in files:
            assert lock_hashes.installable(filename, name, version), (
                f"{LOCK_FILE}: {filename} is not a file of {name}=={version} for CPython 3.11 on Linux x86_64")
    assert {"pip", "setuptools"} <= set(pins), "pip and setuptools are installed by the lock too: hashed like the rest"


def test_lock_is_exactly_what_lock_hashes_writes():
    # The scratch installs below prove pip reads format_pin's layout; the real lock is that layout to the byte.
    pins = lock_hashes.parse_lock(LOCK_FILE.read_text())
    body = [line for line in LOCK_FILE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    expected = "\n".join(lock_hashes.format_pin(name, version, dict(zip(files, hashes)))
                         for name, (version, hashes, files) in pins.items())
    assert "\n".join(body) == expected
    names = list(pins)
    assert names == sorted(names, key=str.upper), "pins are sorted as tools/bootstrap.sh --freeze sorts them"


def test_torch_carries_its_cpu_wheel():
    version, hashes, files = lock_hashes.parse_lock(LOCK_FILE.read_text())["torch"]
    assert version == "2.13.0+cpu"
    assert TORCH_WHEEL in files, f"torch's files in {LOCK_FILE}: {files}"
    local = pathlib.Path("/opt/wheels") / TORCH_WHEEL  # pip's find-links on these machines, where there is one
    if local.is_file():
        assert hashes[files.index(TORCH_WHEEL)] == _sha256(local)


def test_header_says_what_the_hashes_cover():
    header = "\n".join(line for line in LOCK_FILE.read_text().splitlines() if line.startswith("#"))
    for words in ("--require-hashes", "CPython 3.11", "Linux x86_64", "sdist", "find-links"):
        assert words in header, f"{LOCK_FILE}'s header does not say {words!r}"


# --- tools/bootstrap.sh on a scratch venv and lock ----------------------------------------------------------------


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheels")
    _make_wheel(folder, "tinypkg", "1.0")
    _make_wheel(folder, "otherpkg", "2.0")
    return folder


def _bootstrap(tmp_path, wheels, lock, *args):
    """Runs tools/bootstrap.sh on the scratch venv tmp_path/venv; pip sees only `wheels` and ensurepip's wheels."""
    bundled = pathlib.Path(ensurepip.__file__).parent / "_bundled"  # the pip and setuptools a new venv starts with
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "PPO_OPS_PYTHON": sys.executable,
        "PPO_OPS_VENV": str(tmp_path / "venv"),
        "PPO_OPS_LOCK": str(lock),
        "PIP_CONFIG_FILE": os.devnull,  # not this machine's indexes, find-links or constraints
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": f"{wheels} {bundled}",
        "PIP_NO_CACHE_DIR": "1",
    }
    return subprocess.run(["bash", str(BOOTSTRAP), *args], env=env, capture_output=True, text=True, timeout=240,
                          stdin=subprocess.DEVNULL, check=False)


def _installed(venv):
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    return {p.name.split("-")[0] for p in site_packages.glob("*.dist-info")}


def test_a_wrong_hash_is_refused_with_a_clear_message(tmp_path, wheels):
    tiny, other = wheels / "tinypkg-1.0-py3-none-any.whl", wheels / "otherpkg-2.0-py3-none-any.whl"
    lock = _write_lock(tmp_path / "wrong.lock", {
        ("otherpkg", "2.0"): {other.name: _sha256(other)},
        ("tinypkg", "1.0"): {tiny.name: WRONG_HASH},
    })
    result = _bootstrap(tmp_path, wheels, lock)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in result.stderr  # pip's own report, with both hashes
    assert f"Expected sha256 {WRONG_HASH}" in result.stderr and f"Got        {_sha256(tiny)}" in result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("[bootstrap] ERROR:")]
    assert error == [f"[bootstrap] ERROR: pip refused tinypkg==1.0 from {tiny.as_uri()}: the file does not match "
                     "wrong.lock's sha256 for it, so nothing was installed; find out where that file came from "
                     "(pip config list), and re-freeze only if the package changed on purpose"], result.stderr
    assert "[bootstrap]   try: tools/bootstrap.sh --freeze" in result.stderr
    venv = tmp_path / "venv"
    assert not (venv / VENV_STAMP).exists(), "a refused install must not stamp the venv as built from the lock"
    assert not {"tinypkg", "otherpkg"} & _installed(venv), "pip installs nothing when one file fails its hash"

    # A pin without any hash (or a dependency the lock lacks) is refused too, with its own explanation.
    lock.write_text(f"tinypkg==1.0\notherpkg==2.0 \\\n    --hash=sha256:{_sha256(other)}\n")
    result = _bootstrap(tmp_path, wheels, lock)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ("[bootstrap] ERROR: wrong.lock has no hash for a package pip needs (named above): the lock must pin the "
            "whole tree, hashed") in result.stderr
    assert not {"tinypkg", "otherpkg"} & _installed(venv)


def test_right_hashes_install_and_freeze_rehashes_every_pin(tmp_path, wheels):
    tiny = wheels / "tinypkg-1.0-py3-none-any.whl"
    lock = _write_lock(tmp_path / "right.lock", {("tinypkg", "1.0"): {tiny.name: _sha256(tiny)}})
    result = _bootstrap(tmp_path, wheels, lock)
    assert result.returncode == 0, result.stdout + result.stderr
    venv = tmp_path / "venv"
    assert "tinypkg" in _installed(venv)
    assert (venv / VENV_STAMP).read_text().strip() == _sha256(lock)

    # --freeze: every installed distribution (pip and setuptools too) pinned with its file's hash, from find-links.
    result = _bootstrap(tmp_path, wheels, lock, "--freeze")
    assert result.returncode == 0, result.stdout + result.stderr
    pins = lock_hashes.parse_lock(lock.read_text())
    assert set(pins) == {"pip", "setuptools", "tinypkg"}
    assert pins["tinypkg"] == ("1.0", [_sha256(tiny)], [tiny.name])
    bundled = pathlib.Path(ensurepip.__file__).parent / "_bundled"
    for name in ("pip", "setuptools"):
        version, hashes, files = pins[name]
        assert hashes == [_sha256(bundled / files[0])] and files == [f"{name}-{version}-py3-none-any.whl"]
    assert "--require-hashes" in lock.read_text().splitlines()[3]  # the header
    assert (venv / VENV_STAMP).read_text().strip() == _sha256(lock)

    result = _bootstrap(tmp_path, wheels, lock)  # the stamp matches the new lock: nothing to do
    assert result.returncode == 0 and "matches" in result.stdout, result.stdout + result.stderr


# --- tools/lock_hashes.py on local sources --------------------------------------------------------------------------


def _index(root, name, files):
    """A PEP 503 index at root/simple listing files (name -> bytes) stored in root/files; one link has no hash."""
    (root / "files").mkdir(parents=True, exist_ok=True)
    links = []
    for i, (filename, data) in enumerate(files.items()):
        (root / "files" / filename).write_bytes(data)
        fragment = "" if i == 0 else f"#sha256={hashlib.sha256(data).hexdigest()}"
        links.append(f'<a href="../../files/{filename}{fragment}">{filename}</a>')
    (root / "simple" / name).mkdir(parents=True)
    (root / "simple" / name / "index.html").write_text("<html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    return (root / "simple").as_uri()


def _lock_hashes(pins, *args):
    return subprocess.run([sys.executable, str(LOCK_HASHES), "--no-pip-config", *args], input=pins,
                          capture_output=True, text=True, timeout=60, check=False)


def test_lock_hashes_takes_every_installable_file_and_only_those(tmp_path):
    wanted = ["demo-1.0-py3-none-any.whl", "demo-1.0-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
              "demo-1.0-cp38-abi3-manylinux_2_28_x86_64.whl", "demo-1.0.tar.gz"]
    unwanted = ["demo-1.0-cp311-cp311-win_amd64.whl", "demo-1.0-cp311-cp311-macosx_11_0_arm64.whl",
                "demo-1.0-cp311-cp311-manylinux_2_17_aarch64.whl", "demo-1.0-cp311-cp311-musllinux_1_2_x86_64.whl",
                "demo-1.0-cp312-cp312-manylinux_2_17_x86_64.whl", "demo-1.1-py3-none-any.whl",
                "demo-1.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "demo-1.0-py2-none-any.whl"]
    index = _index(tmp_path / "index", "demo", {f: f.encode() for f in wanted + unwanted})
    links = tmp_path / "links"
    links.mkdir()
    (links / "big-2.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"cpu")
    (links / "big-2.0-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"cuda")  # 2.0 is not 2.0+cpu
    result = _lock_hashes("demo==1.0\nbig==2.0+cpu\n", "--index", index, "--find-links", str(links))
    assert result.returncode == 0, result.stderr
    digest = lambda data: hashlib.sha256(data).hexdigest()
    assert result.stdout == "\n".join([
        lock_hashes.format_pin("demo", "1.0", {f: digest(f.encode()) for f in wanted}),
        lock_hashes.format_pin("big", "2.0+cpu", {"big-2.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl": digest(b"cpu")}),
    ]) + "\n"


def test_lock_hashes_fails_on_a_conflict_or_a_missing_file(tmp_path):
    index = _index(tmp_path / "index", "demo", {"demo-1.0-py3-none-any.whl": b"published"})
    links = tmp_path / "links"
    links.mkdir()
    (links / "demo-1.0-py3-none-any.whl").write_bytes(b"another file under the same name")
    result = _lock_hashes("demo==1.0\n", "--index", index, "--find-links", str(links))
    assert result.returncode == 1 and result.stdout == ""
    assert "demo-1.0-py3-none-any.whl" in result.stderr and "two different files under one name" in result.stderr

    result = _lock_hashes("demo==1.0\nabsent==3.0\n", "--index", index)
    assert result.returncode == 1 and result.stdout == ""
    assert "lock_hashes: no file that pip could install on CPython 3.11, Linux x86_64 for absent==3.0" in result.stderr
