"""The core (ppo_ops/core) imports nothing above it, and the call shell still selects the same backends through the
registry that ppo_ops/backends.py fills.

- Every module under ppo_ops/core, read with `ast`: no import of a ppo_ops module outside ppo_ops.core, at module
  level or inside a function (a lazy import of a backend counts).
- `shell.select_backend` for each (op, backend, dtype, fused_loss) on CPU returns the very objects the backend modules
  hold (Triton kinds under TRITON_INTERPRET=1, as tests/conftest.py sets on CPU).
- A lookup of an unregistered backend is a RuntimeError naming the op and kind.
- `import ppo_ops` registers every backend without importing triton, and works with triton absent.
- No two modules of ppo_ops import each other, directly or through others: the import graph of every module under
  ppo_ops/ (module-level and function-level imports alike) has no cycle, and a cycle is reported by its modules.
"""

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import ppo_ops
from ppo_ops.core import registry, shell
from tests.core_support import triton_skip_reason

# Not resolved: under Bazel the runfiles copy of the workspace (as tests/conftest.py).
REPO_ROOT = pathlib.Path(os.path.abspath(__file__)).parent.parent
CORE = REPO_ROOT / "ppo_ops" / "core"
CORE_PACKAGE = "ppo_ops.core"


# ---- the core's imports ----

def _imported_modules(tree: ast.AST, package: str):
    """(line, module) for every import anywhere in `tree` (functions and classes included), relative ones resolved
    against `package`; `from A import b` yields A.b, which is what it may import. importlib.import_module / __import__
    with a literal name count too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def _outside_core(module: str) -> bool:
    top = module.split(".")
    return top[0] == "ppo_ops" and module != CORE_PACKAGE and not module.startswith(CORE_PACKAGE + ".")


def upward_imports(source: str, filename: str, package: str = CORE_PACKAGE):
    """'file:line imports module' for each import of a ppo_ops module outside the core."""
    tree = ast.parse(source, filename=filename)
    return [f"{filename}:{line} imports {module}" for line, module in sorted(_imported_modules(tree, package))
            if _outside_core(module)]


def test_core_modules_import_nothing_above_the_core():
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 5, f"no core modules found under {CORE}"
    offending = []
    for path in files:
        offending += upward_imports(path.read_text(), str(path.relative_to(REPO_ROOT)))
    assert not offending, ("ppo_ops/core must import nothing above it (register a loader in ppo_ops/backends.py, "
                           "or move the helper into the core):\n  " + "\n  ".join(offending))


@pytest.mark.parametrize("source, line, found", [
    ("from ppo_ops.logits import torch_backend", 1, "ppo_ops.logits.torch_backend"),
    ("def f():\n    from ppo_ops.lm_head import segment_gemms\n", 2, "ppo_ops.lm_head.segment_gemms"),
    ("def f():\n    import ppo_ops.api\n", 2, "ppo_ops.api"),
    ("from .. import hf", 1, "ppo_ops.hf"),
    ("from ..megatron import gpt_log_probs", 1, "ppo_ops.megatron.gpt_log_probs"),
    ("from ppo_ops import backends", 1, "ppo_ops.backends"),
    ("import importlib\nimportlib.import_module('ppo_ops.logits.triton_backend')", 2,
     "ppo_ops.logits.triton_backend"),
])
def test_the_check_finds_upward_imports(source, line, found):
    assert upward_imports(source, "core/x.py") == [f"core/x.py:{line} imports {found}"]


@pytest.mark.parametrize("source", [
    "from ppo_ops.core import checks",
    "from . import row_stats",
    "from .contracts import RowStats",
    "def f():\n    from ppo_ops.core import sparse_keep_kernels\n",
    "import torch\nimport triton",
])
def test_the_check_allows_core_and_third_party_imports(source):
    assert upward_imports(source, "core/x.py") == []


# ---- no import cycle anywhere in ppo_ops ----

PACKAGE_ROOT = REPO_ROOT / "ppo_ops"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict) -> dict:
    """{module: sorted modules of `sources` it imports}, from `sources` ({module name: (source, is_package)}). An
    edge goes to the module an import names: `import a.b` and `from a import b` (b a module) to a.b, `from a import
    name` (name not a module) and `import a` to a (a package's __init__ is a module like any other)."""
    graph = {}
    for name, (source, is_package) in sources.items():
        package = name if is_package else name.rpartition(".")[0]
        targets = set()
        for _line, imported in _imported_modules(ast.parse(source, filename=name), package):
            if imported in sources:  # a module, or `from a import b` with a.b a module
                targets.add(imported)
            elif imported.rpartition(".")[0] in sources:  # `from a import name`: a itself
                targets.add(imported.rpartition(".")[0])
        graph[name] = sorted(targets - {name})
    return graph


def import_cycles(graph: dict) -> list:
    """Every cycle's modules (Tarjan's strongly connected components of more than one module), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _ppo_ops_sources() -> dict:
    return {_module_name(path): (path.read_text(), path.name == "__init__.py")
            for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def test_no_two_ppo_ops_modules_import_each_other():
    sources = _ppo_ops_sources()
    assert len(sources) > 40 and "ppo_ops.core.shell" in sources, sorted(sources)
    graph = import_graph(sources)
    cycles = import_cycles(graph)
    assert not cycles, ("import cycles among ppo_ops' modules (move what both need into a module of its own):\n  "
                        + "\n  ".join(" <-> ".join(c) for c in cycles))


@pytest.mark.parametrize("modules, cycles", [
    # direct, one side through a function-level import
    ({"p.a": "from p import b", "p.b": "def f():\n    from p.a import x\n"}, [["p.a", "p.b"]]),
    # through a third module
    ({"p.a": "import p.b", "p.b": "from p import c", "p.c": "from p.a import y"}, [["p.a", "p.b", "p.c"]]),
    # relative imports
    ({"p.a": "from . import b", "p.b": "from .a import z"}, [["p.a", "p.b"]]),
    # a shared third module breaks it
    ({"p.a": "from p import shared", "p.b": "from p.shared import z\nfrom p import a", "p.shared": "import torch"},
     []),
    # a name of a package is an edge to its __init__
    ({"p": "from p import a", "p.a": "from p import name", "p.b": "import p.a"}, [["p", "p.a"]]),
    ({"p": "from p import b", "p.a": "from p import name", "p.b": "import torch"}, []),
])
def test_the_cycle_check_finds_cycles(modules, cycles):
    sources = {name: (source, name == "p") for name, source in modules.items()}
    assert import_cycles(import_graph(sources)) == cycles


# ---- backend selection through the registry ----

def _backend_objects():
    """name -> the object the backend module itself holds."""
    from ppo_ops.lm_head import segment_gemms
    from ppo_ops.lm_head import torch_backend as lm_head_torch
    from ppo_ops.logits import torch_backend as logits_torch
    objects = {"logits/torch": logits_torch.BACKEND, "lm_head/torch": lm_head_torch.BACKEND,
               "segments/torch": segment_gemms.backend("torch")}
    if triton_skip_reason("cpu") is None:
        from ppo_ops.lm_head import triton_backend as lm_head_triton
        from ppo_ops.logits import triton_backend as logits_triton
        objects.update({"logits/triton": logits_triton.BACKEND, "lm_head/triton": lm_head_triton.BACKEND,
                        "segments/triton": segment_gemms.backend("triton")})
    return objects


_HALF = (torch.bfloat16, torch.float16)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _expected(op, backend, dtype, fused_loss):
    """select_backend's rules on CPU tensors, written out: auto is torch on CPU; the LM head's token loss, and its
    half-precision inputs under triton, take the segment-GEMM backend."""
    kind = "torch" if backend in ("auto", "torch") else "triton"
    if op == "logits":
        return f"logits/{kind}"
    if fused_loss or (kind == "triton" and dtype in _HALF):
        return f"segments/{kind}"
    return f"lm_head/{kind}"


_CASES = [pytest.param(op, backend, dtype, fused, id=f"{op}-{backend}-{str(dtype)[6:]}{'-loss' if fused else ''}",
                       marks=[pytest.mark.skipif(backend == "triton" and triton_skip_reason("cpu") is not None,
                                                 reason=triton_skip_reason("cpu") or "")])
          for op in ("logits", "lm_head") for backend in ("auto", "torch", "triton") for dtype in _DTYPES
          for fused in ((False,) if op == "logits" else (False, True))]


@pytest.mark.parametrize("op, backend, dtype, fused_loss", _CASES)
def test_select_backend_returns_the_backend_modules_objects(op, backend, dtype, fused_loss):
    rows = torch.zeros(2, 8, dtype=dtype)
    chosen = shell.select_backend("log_probs_and_entropy", backend, rows, op, fused_loss)
    assert chosen is _backend_objects()[_expected(op, backend, dtype, fused_loss)]


def test_every_backend_is_registered():
    ops = ("logits", "lm_head", "lm_head_segments", "lm_head_sglang")
    assert set(registry.registered()) == {(op, kind) for op in ops for kind in ("torch", "triton")}


def test_an_unregistered_backend_is_a_clear_error(monkeypatch):
    monkeypatch.delitem(registry._LOADERS, ("logits", "torch"))
    with pytest.raises(RuntimeError, match=r"no backend registered for op 'logits', kind 'torch' \(registered: "
                                           r"lm_head/torch, .*ppo_ops/backends\.py"):
        shell.select_backend("log_probs_and_entropy", "torch", torch.zeros(2, 8), "logits")
    # Through the public function too (the shell raises it from its local checks).
    with pytest.raises(RuntimeError, match="no backend registered for op 'logits', kind 'torch'"):
        ppo_ops.log_probs_and_entropy(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), backend="torch")
    with pytest.raises(RuntimeError, match="no backend registered for op 'nope', kind 'torch'"):
        registry.load("nope", "torch")


def test_a_loader_must_be_callable():
    with pytest.raises(TypeError, match="loader of \\('logits', 'torch'\\) must be callable"):
        registry.register("logits", "torch", None)


def _run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_registers_every_backend_and_loads_no_triton_module():
    out = _run_python("""
        import sys
        import ppo_ops.core.shell  # any ppo_ops import runs ppo_ops/__init__.py, which registers the backends
        from ppo_ops.core import registry
        print(len(registry.registered()))
        print(sorted(m for m in sys.modules if m == "triton" or m.startswith(("triton.", "ppo_ops.logits.triton",
                                                                             "ppo_ops.lm_head.triton"))))
    """)
    assert out.split("\n")[:2] == ["8", "[]"], out


def test_import_and_torch_backend_work_without_triton():
    out = _run_python("""
        import sys
        sys.modules["triton"] = None  # `import triton` raises ImportError
        import torch
        import ppo_ops
        result = ppo_ops.log_probs_and_entropy(torch.zeros(2, 8), torch.tensor([1, 2]), backend="auto")
        print(round(float(result.log_probs[0]), 4))
    """)
    assert out.strip() == str(round(-torch.log(torch.tensor(8.0)).item(), 4))
