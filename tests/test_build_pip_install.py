"""The build's own test: `pip install .` from a checkout gives a working ppo_ops (pyproject.toml).

The sources pyproject.toml builds from (pyproject.toml, README.md, LICENSE, the ppo_ops package) are copied to a
scratch directory and installed with `pip install .` into a fresh venv, offline (`--no-index --no-deps
--no-build-isolation`: the Bazel sandbox has no network). The fresh venv has no pip or setuptools of its own
(`--without-pip`): a `.pth` file puts the project venv's site-packages after its own, so it sees that venv's torch,
pip and setuptools (the locked versions; Python 3.11's ensurepip would bring setuptools 65, older than the PEP 639
license fields pyproject.toml uses). Then a Python started in isolated mode from a directory outside the checkout
imports ppo_ops from the fresh venv and runs `log_probs_and_entropy` on a small CPU tensor, against a float64
reference computed here.

The project venv is this test's own interpreter's (`sys.prefix`): the pinned .venv under Bazel (tools/pytest.bzl's
toolchain) and under plain pytest alike.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest
import torch

# The checkout, or under Bazel its runfiles copy (not resolved: there the files are links into the source tree).
ROOT = pathlib.Path(__file__).absolute().parents[1]
# What pyproject.toml reads besides the package itself (its readme and license-files).
PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE")
# Subpackages the wheel must hold, and the one it must leave out (pyproject.toml says why).
SHIPPED = ("ppo_ops", "ppo_ops.compiled", "ppo_ops.core", "ppo_ops.legacy", "ppo_ops.lm_head", "ppo_ops.logits")
LEFT_OUT = "ppo_ops.runtime"
# The accuracy guarantee (docs/api.md#accuracy) for fp32 logits of moderate magnitude at temperature near 1:
# log-prob within 2e-6 x max(1, |value|), entropy within 2e-5 of float64.
LOG_PROB_TOL = 2e-6
ENTROPY_TOL = 2e-5
TEMPERATURE = 0.9
ROWS, VOCAB = 5, 97  # a small odd vocabulary: one rank, no segment alignment
INSTALL_TIMEOUT_S = 240

# Run by the fresh venv's Python from outside the checkout: where ppo_ops came from, and its results.
_RUN = """
import json, sys, torch, ppo_ops
logits, tokens = torch.load(sys.argv[1])
out = ppo_ops.log_probs_and_entropy(logits, tokens, entropy="value", temperature={temperature})
print(json.dumps({{"file": ppo_ops.__file__, "log_probs": out.log_probs.tolist(), "entropy": out.entropy.tolist()}}))
"""


def _site_packages(prefix: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))


def _copy_sources(dest: pathlib.Path) -> None:
    for name in PROJECT_FILES:
        if not (ROOT / name).is_file():
            pytest.fail(f"{name} is missing from {ROOT}: pyproject.toml needs it (under Bazel: the test's data)")
        shutil.copyfile(ROOT / name, dest / name)
    shutil.copytree(ROOT / "ppo_ops", dest / "ppo_ops", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "BUILD"))


def _fresh_venv(path: pathlib.Path) -> pathlib.Path:
    """A venv without pip that sees the project venv's packages after its own; returns its python."""
    project_site = _site_packages(pathlib.Path(sys.prefix))
    if not (project_site / "pip").is_dir() or not (project_site / "setuptools").is_dir():
        pytest.skip(f"the project venv {sys.prefix} has no pip or setuptools to install with")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(path)
    (_site_packages(path) / "project_venv.pth").write_text(f"{project_site}\n")
    return path / "bin" / "python"


def _reference(logits: torch.Tensor, tokens: torch.Tensor):
    """float64 log p(token) and entropy of softmax(logits / T)."""
    log_p = torch.log_softmax(logits.double() / TEMPERATURE, dim=-1)
    return log_p.gather(-1, tokens[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def test_pip_install_from_checkout_serves_the_op(tmp_path):
    src, elsewhere = tmp_path / "src", tmp_path / "elsewhere"
    src.mkdir()
    elsewhere.mkdir()
    _copy_sources(src)
    python = _fresh_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # Bazel's PYTHONPATH: the checkout

    install = subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
                              "--disable-pip-version-check", "--no-input", "-q", str(src)],
                             cwd=elsewhere, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert install.returncode == 0, f"pip install . failed:\n{install.stdout}\n{install.stderr}"

    site = _site_packages(tmp_path / "venv")
    installed = {".".join(p.relative_to(site).parent.parts) for p in site.glob("ppo_ops/**/__init__.py")}
    assert set(SHIPPED) <= installed, f"missing from the wheel: {sorted(set(SHIPPED) - installed)}"
    assert LEFT_OUT not in installed, f"{LEFT_OUT} must stay out of the wheel (pyproject.toml)"

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(ROWS, VOCAB, generator=gen) * 3  # logits of moderate magnitude (the guarantee's domain)
    tokens = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    torch.save((logits, tokens), tmp_path / "inputs.pt")
    run = subprocess.run([str(python), "-I", "-c", _RUN.format(temperature=TEMPERATURE), str(tmp_path / "inputs.pt")],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert run.returncode == 0, f"the installed ppo_ops failed:\n{run.stderr}"
    result = json.loads(run.stdout.strip().splitlines()[-1])

    imported = pathlib.Path(result["file"]).resolve()
    assert imported.is_relative_to(site.resolve()), f"ppo_ops imported from {imported}, not from the fresh venv"
    assert not imported.is_relative_to(ROOT)
    want_lp, want_ent = _reference(logits, tokens)
    got_lp = torch.tensor(result["log_probs"], dtype=torch.float64)
    got_ent = torch.tensor(result["entropy"], dtype=torch.float64)
    assert bool(((got_lp - want_lp).abs() <= LOG_PROB_TOL * want_lp.abs().clamp(min=1)).all()), (got_lp, want_lp)
    assert bool(((got_ent - want_ent).abs() <= ENTROPY_TOL).all()), (got_ent, want_ent)
