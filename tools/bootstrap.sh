#!/usr/bin/env bash
# Installs what ppo_ops needs on a fresh Debian machine, and nothing when it is all there (about a second).
#
#   1. Bazel: Debian's bazel-bootstrap (Bazel 4.2.3), only when `bazel` is missing (apt-get update first).
#   2. A Python 3.11 with the venv module (the torch wheel is cp311): python3-venv from Debian if ensurepip is missing.
#   3. .venv at the repository root, from requirements.lock with --require-hashes, wheels only, and -c constraints.txt
#      (torch stays the CPU wheel 2.13.0+cpu): pip installs no file whose sha256 the lock does not carry. Skipped when
#      .venv/.ppo_ops_lock.sha256 holds the lock's hash; written after a good install. An existing .venv is updated
#      in place, never deleted.
#
#   tools/bootstrap.sh --freeze   rewrites requirements.lock from what .venv holds now (after adding a package), with
#                                 the hashes of every file pip could install for each pin (tools/lock_hashes.py;
#                                 needs the indexes pip is configured with).
#
# Environment: PPO_OPS_PYTHON  base interpreter for a new venv (default: python3 on PATH).
#              PPO_OPS_VENV, PPO_OPS_LOCK  another venv and lock than .venv and requirements.lock (the build tests
#              run this script on a scratch venv and lock: tests/test_build_lock.py).
# Safe to run again at any time; runs with no terminal (CI=true, as root).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PPO_OPS_VENV:-$ROOT/.venv}"
LOCK="${PPO_OPS_LOCK:-$ROOT/requirements.lock}"
CONSTRAINTS="$ROOT/constraints.txt"
STAMP="$VENV/.ppo_ops_lock.sha256"  # also read by tools/python_toolchain.bzl and tests/test_build_env.py
BASE_PYTHON="${PPO_OPS_PYTHON:-python3}"
REQUIRED_PYTHON="3.11"

say() { echo "[bootstrap] $*"; }
die() {
  echo "[bootstrap] ERROR: $1" >&2
  shift
  for hint in "$@"; do echo "[bootstrap]   try: $hint" >&2; done
  exit 1
}

as_root() {
  if [[ "$(id -u)" -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null; then
    sudo "$@"
  else
    die "installing Debian packages needs root: $*" "run tools/bootstrap.sh as root, or install them yourself"
  fi
}

APT_UPDATED=0
apt_install() {
  command -v apt-get >/dev/null || die "no apt-get: this script installs Debian packages ($*)" \
    "install $* with your system's package manager, then rerun"
  if [[ "$APT_UPDATED" -eq 0 ]]; then
    say "apt-get update"
    as_root apt-get update -qq || die "apt-get update failed" "check access to the Debian mirror (/etc/apt/sources.list*)"
    APT_UPDATED=1
  fi
  say "apt-get install $* (a minute or so)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" </dev/null \
    || die "apt-get install $* failed (see apt's message above)" "apt-get install -y $*" "apt-cache policy $*"
}

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

LOCK_HEADER="# Exact versions of every package in .venv (Python $REQUIRED_PYTHON), written by tools/bootstrap.sh --freeze.
# Add a direct dependency to requirements.in, pip install it into .venv with -c constraints.txt, then --freeze.
# torch is the CPU wheel (constraints.txt holds it). sglang is not here: it pins a CUDA torch (README.md).
# Hashes: tools/bootstrap.sh installs with --require-hashes. Each pin carries the sha256 of every file of that version
# pip could install on CPython $REQUIRED_PYTHON, Linux x86_64 (glibc): wheels for cp311 / abi3 / py3 on any manylinux
# x86_64 or any platform, and the sdist where there is one, taken from every index and find-links pip is configured
# with (PyPI; torch's +cpu wheel from find-links); the comments under a pin name its files in the hashes' order."

# The pins NAME==VERSION of a lock (each first line of a pin; --hash lines and comments left out).
lock_pins() { sed -nE 's/^([A-Za-z0-9][^ =]*==[^ \\]+).*/\1/p' "$1"; }

if [[ "${1:-}" == "--freeze" ]]; then
  [[ -x "$VENV/bin/python3" ]] || die "no $VENV to freeze" "tools/bootstrap.sh"
  frozen="$("$VENV/bin/python3" -m pip freeze --all --exclude-editable --disable-pip-version-check | LC_ALL=C sort -f)"
  say "hashing the files of $(echo "$frozen" | wc -l) pins (every index and find-links pip is configured with)"
  pinned="$("$VENV/bin/python3" "$ROOT/tools/lock_hashes.py" <<<"$frozen")" \
    || die "could not collect the hashes (tools/lock_hashes.py says why above); $LOCK is unchanged" \
      "$VENV/bin/pip config list   (the indexes and find-links the hashes come from)"
  printf '%s\n%s\n' "$LOCK_HEADER" "$pinned" >"$LOCK.tmp"
  mv "$LOCK.tmp" "$LOCK"
  sha256_of "$LOCK" >"$STAMP"
  say "wrote $(basename "$LOCK") ($(echo "$frozen" | wc -l) packages, $(grep -c -- '--hash=' "$LOCK") hashes)" \
    "and the venv stamp"
  exit 0
fi
[[ $# -eq 0 ]] || die "unknown argument: $1" "tools/bootstrap.sh" "tools/bootstrap.sh --freeze"

# --- 1. Bazel ------------------------------------------------------------------------------------------------------
if ! command -v bazel >/dev/null; then
  apt_install bazel-bootstrap
  command -v bazel >/dev/null || die "bazel-bootstrap installed but no bazel on PATH" "ls -l /usr/bin/bazel*"
fi

# --- 2 and 3. The pinned venv ----------------------------------------------------------------------------------------
[[ -f "$LOCK" ]] || die "missing $LOCK" "git checkout requirements.lock"
LOCK_HASH="$(sha256_of "$LOCK")"

if [[ -x "$VENV/bin/python3" && -f "$STAMP" && "$(cat "$STAMP")" == "$LOCK_HASH" ]]; then
  say "ready: bazel, and $(basename "$VENV") matches $(basename "$LOCK")"
  exit 0
fi

if [[ ! -e "$VENV" ]]; then
  command -v "$BASE_PYTHON" >/dev/null || die "no $BASE_PYTHON to create the venv with" \
    "apt-get install python3 python3-venv" "PPO_OPS_PYTHON=/path/to/python$REQUIRED_PYTHON tools/bootstrap.sh"
  version="$("$BASE_PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  [[ "$version" == "$REQUIRED_PYTHON" ]] || die "$BASE_PYTHON is Python $version; the lock needs $REQUIRED_PYTHON" \
    "PPO_OPS_PYTHON=/path/to/python$REQUIRED_PYTHON tools/bootstrap.sh"
  if ! "$BASE_PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
    apt_install "python$REQUIRED_PYTHON-venv"
  fi
  say "creating $(basename "$VENV") with $("$BASE_PYTHON" -c 'import sys; print(sys.executable)')"
  "$BASE_PYTHON" -m venv "$VENV" || die "python -m venv $VENV failed" "apt-get install python$REQUIRED_PYTHON-venv"
elif ! "$VENV/bin/python3" -c 'import sys' 2>/dev/null; then
  die "$VENV exists but its python3 does not run (moved, or its base Python is gone)" \
    "rm -rf $VENV && tools/bootstrap.sh"
fi

venv_version="$("$VENV/bin/python3" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[[ "$venv_version" == "$REQUIRED_PYTHON" ]] || die ".venv runs Python $venv_version; the lock needs $REQUIRED_PYTHON" \
  "rm -rf $VENV && PPO_OPS_PYTHON=/path/to/python$REQUIRED_PYTHON tools/bootstrap.sh"

say "installing $(basename "$LOCK") into $(basename "$VENV") (first time: a few minutes; torch is the CPU wheel)"
rm -f "$STAMP"  # a failed install must not leave an old stamp that claims the venv is ready
# Hash-checking mode: every pin carries its files' sha256 (the lock pins the whole tree, so no dependency comes
# unhashed), and pip refuses any download that matches none. -c constraints.txt stays: pip takes unhashed constraints
# in this mode (a constraint installs nothing by itself; whatever it selects still needs a hash from the lock).
# Wheels only (every pin has one): building an sdist would install its build dependencies without any hash check,
# and where an index lists a wheel whose hash is not in the lock, pip would quietly build the sdist instead of
# refusing. The sdists' hashes stay in the lock for a pip run by hand that builds one.
# pip's messages go to stderr and to a log, so a refused hash gets its own explanation below.
pip_log="$(mktemp "${TMPDIR:-/tmp}/ppo_ops_pip.XXXXXX")"
trap 'rm -f "$pip_log"' EXIT
if ! "$VENV/bin/python3" -m pip install --require-hashes --only-binary :all: --disable-pip-version-check --no-input \
    --progress-bar off -qq -r "$LOCK" -c "$CONSTRAINTS" </dev/null 2>&1 | tee "$pip_log" >&2; then
  if grep -q "DO NOT MATCH THE HASHES" "$pip_log"; then
    refused="$(grep -m1 -oE '^ +[A-Za-z0-9][^ ]*==[^ ]+ from [^ ]+' "$pip_log" | sed 's/^ *//' || true)"
    die "pip refused ${refused:-a download}: the file does not match $(basename "$LOCK")'s sha256 for it, so nothing was installed; find out where that file came from (pip config list), and re-freeze only if the package changed on purpose" \
      "$VENV/bin/pip config list   (the indexes and find-links pip used; a mirror or cache may hold another file)" \
      "tools/bootstrap.sh --freeze   (only after installing a new version into .venv on purpose: it re-hashes every pin)"
  elif grep -q "Hashes are required in --require-hashes mode" "$pip_log"; then
    die "$(basename "$LOCK") has no hash for a package pip needs (named above): the lock must pin the whole tree, hashed" \
      "install it into .venv with -c $CONSTRAINTS, then tools/bootstrap.sh --freeze"
  fi
  die "pip could not install $(basename "$LOCK") (the package is named in pip's message above)" \
    "if it is torch (the CPU wheel 2.13.0+cpu, from pip's find-links or the PyTorch CPU index): PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu tools/bootstrap.sh" \
    "$VENV/bin/pip install -c $CONSTRAINTS PACKAGE==VERSION   (to see one package's error alone)"
fi

# Packages installed by hand that the lock does not name stay (other work may use them); say so, the build
# test //tests:test_build_env fails on them until they are added to the lock or removed.
extra="$("$VENV/bin/python3" -m pip freeze --all --exclude-editable --disable-pip-version-check \
  | LC_ALL=C sort | LC_ALL=C comm -23 - <(lock_pins "$LOCK" | LC_ALL=C sort) || true)"
if [[ -n "$extra" ]]; then
  say "warning: installed but not in $(basename "$LOCK") (add them to the lock, or pip uninstall):"
  echo "$extra" | sed 's/^/[bootstrap]     /'
fi

echo "$LOCK_HASH" >"$STAMP"
say "ready: bazel, and $(basename "$VENV") built from $(basename "$LOCK") (hash-checked)"
