"""Probes a runner's interpreter for the GPU and SGLang toolchains (tools/runner_toolchains.bzl), or writes its lock.

    PYTHON tools/runner_env.py probe gpu       JSON: interpreter, versions, torch's CUDA, every distribution
    PYTHON tools/runner_env.py probe sglang    the same plus SGLang's and sglang-kernel's versions
    PYTHON tools/runner_env.py freeze          requirements_gpu.lock for this interpreter (on a new runner image)
    PYTHON tools/runner_env.py check gpu LOCK RECORD      probe, write RECORD (JSON); exit 1 with the reasons when
    PYTHON tools/runner_env.py check sglang RECORD        torch has no CUDA, a LOCK pin differs, or SGLang is missing

Standard library only, so it runs in any interpreter; it reads versions from package metadata and imports torch
only to ask which CUDA it was built for (no GPU is touched: a repository rule runs this while Bazel fetches).
"""

import importlib.metadata
import json
import platform
import re
import sys

# The GPU runner's direct dependencies: the packages ppo_ops, its tests, the legacy reference, the bench and the
# Qwen3 check import (requirements.in names the same for the CPU venv). Their versions are pinned per runner image.
GPU_PINNED = (
    "torch",
    "triton",
    "numpy",
    "pytest",
    "hypothesis",
    "absl-py",
    "megatron-core",
    "transformers",
    "safetensors",
    "matplotlib",
    "tqdm",
)

LOCK_HEADER = """\
# The GPU runner's interpreter (PPO_OPS_GPU_PYTHON): the Python version and the exact versions of ppo_ops' direct
# dependencies there. `bazel test --config=gpu` fails when the runner's interpreter differs. Written on the runner
# by `PYTHON tools/runner_env.py freeze > requirements_gpu.lock` (the runner image owns these versions; the CPU venv
# is pinned by requirements.lock).
"""


def normalize(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions():
    """{normalized name: version} of every installed distribution on sys.path (the first one found wins)."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize(name), dist.version)
    return dict(sorted(found.items()))


def torch_cuda():
    """The CUDA version torch was built with, or None for a CPU build (or no torch)."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - any import failure means no usable CUDA torch
        return None
    return torch.version.cuda


def probe(kind):
    dists = distributions()
    info = {
        "interpreter": sys.executable,
        "python": platform.python_version(),
        "torch": dists.get("torch"),
        "torch_cuda": torch_cuda(),
        "triton": dists.get("triton"),
        "distributions": dists,
    }
    if kind == "sglang":
        info["sglang"] = dists.get("sglang")
        info["sglang_kernel"] = dists.get("sglang-kernel") or dists.get("sgl-kernel")
    return info


def freeze():
    dists = distributions()
    lines = [LOCK_HEADER, f"python=={platform.python_version()}"]
    for name in GPU_PINNED:
        version = dists.get(normalize(name))
        lines.append(f"{name}=={version}" if version else f"# {name}: not installed here")
    return "\n".join(lines) + "\n"


def read_lock(path):
    """{normalized name: version} of a requirements_gpu.lock (`python==X` pins the interpreter's version)."""
    pins = {}
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name, _, version = line.partition("==")
                pins[normalize(name)] = version.strip()
    return pins


def problems_gpu(info, pins):
    """Why `info` (a probe) is not a usable GPU runner interpreter for `pins`; empty when it is."""
    found = []
    if info["torch"] is None:
        found.append("torch is not installed")
    elif info["torch_cuda"] is None:
        found.append(f"its torch {info['torch']} has no CUDA (a CPU build); the GPU runner needs a CUDA torch")
    actual = dict(info["distributions"], python=info["python"])
    for name, version in sorted(pins.items()):
        if actual.get(name) != version:
            found.append(f"{name} is {actual.get(name) or 'not installed'}, requirements_gpu.lock pins {version}")
    return found


def problems_sglang(info):
    found = []
    if info["torch_cuda"] is None:
        found.append(f"its torch {info['torch'] or '(none)'} has no CUDA; SGLang servers need CUDA")
    if info["sglang"] is None:
        found.append("sglang is not installed")
    if info["sglang_kernel"] is None:
        found.append("sglang-kernel (sgl_kernel) is not installed")
    return found


def check(kind, lock, record):
    info = probe(kind)
    with open(record, "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
        f.write("\n")
    found = problems_gpu(info, read_lock(lock)) if kind == "gpu" else problems_sglang(info)
    for line in found:
        print(f"  - {line}", file=sys.stderr)
    return 1 if found else 0


def main(argv):
    if len(argv) == 5 and argv[1:3] == ["check", "gpu"]:
        return check("gpu", argv[3], argv[4])
    if len(argv) == 4 and argv[1:3] == ["check", "sglang"]:
        return check("sglang", None, argv[3])
    if argv[1:3] in (["probe", "gpu"], ["probe", "sglang"]):
        json.dump(probe(argv[2]), sys.stdout, indent=1, sort_keys=True)
        print()
        return 0
    if argv[1:] == ["freeze"]:
        sys.stdout.write(freeze())
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
