"""No import circle inside the stof_trt package, read from the source with ast (nothing is imported).

Every ``import`` / ``from ... import`` statement counts, wherever it stands: module level, inside functions
(lazy imports) and under ``if TYPE_CHECKING``.  A lazy import only moves a circle to run time, so it is no excuse.
Edges: ``import stof_trt.a.b`` and ``from stof_trt.a import b`` (b a submodule) point at stof_trt.a.b;
``from stof_trt.a import name`` (name not a submodule) points at stof_trt.a, the package's __init__.  The implicit
import of a parent package that every submodule import triggers is not an edge: Python has started the parent by
then, and counting it would make every package with a submodule importing a sibling a "circle".
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import stof_trt


def module_names(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} of every .py file under root (a package directory named `package`)."""
    mods = {}
    for f in sorted(root.rglob("*.py")):
        parts = [package, *f.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = f
    return mods


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """{module: modules of the package it imports} for every module under root."""
    mods = module_names(root, package)
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                for a in node.names:
                    targets.append(f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src)
            graph[mod].update(t for t in targets if t in mods)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One closed path (first module repeated at the end) per strongly connected component that has a cycle
    (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, sccs = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph[v]:
                    sccs.append(sorted(comp))
    cycles = []
    for comp in sccs:
        members = set(comp)
        path, seen = [comp[0]], {comp[0]: 0}
        while True:  # walk inside the component until a module repeats: that stretch is a cycle
            nxt = sorted(graph[path[-1]] & members)[0]
            if nxt in seen:
                cycles.append(path[seen[nxt]:] + [nxt])
                break
            seen[nxt] = len(path)
            path.append(nxt)
    return cycles


def test_stof_trt_has_no_import_circle():
    root = Path(stof_trt.__file__).resolve().parent
    graph = import_graph(root, "stof_trt")
    assert len(graph) > 30 and "stof_trt.rewrite.rewrite" in graph and "stof_trt.tune" in graph
    assert sum(map(len, graph.values())) > 50  # the edges are read: an empty graph has no circle either
    cycles = find_cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_finds_circles_through_lazy_and_relative_imports(tmp_path):
    pkg = _write(tmp_path / "pkg", {
        "__init__.py": "from .a import f\n",
        "a.py": "from . import b\n\ndef f():\n    return b\n",
        "b.py": "def g():\n    from .sub.c import h\n    return h\n",
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.a\nfrom .. import d\n",
        "d.py": "import os\n",
        "e.py": "from pkg import f\n",
    })
    graph = import_graph(pkg, "pkg")
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg.d"}
    assert graph["pkg.e"] == {"pkg"}  # a name from the package's __init__
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    (pkg / "b.py").write_text("import os\n")
    assert find_cycles(import_graph(pkg, "pkg")) == []


def test_package_is_the_only_top_level_package():
    tomllib = pytest.importorskip("tomllib")
    root = Path(stof_trt.__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        pytest.skip("not a source checkout")
    conf = tomllib.loads((root / "pyproject.toml").read_text())
    assert conf["tool"]["scikit-build"]["wheel"]["packages"] == ["stof_trt"]


_WITHOUT_GPU_STACK = r"""
import importlib, pkgutil, sys

class Blocked:  # as if torch, triton, the cuDNN frontend, transformers and onnxruntime were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton", "cudnn", "transformers", "onnxruntime"):
            raise ImportError(f"no module named {name!r} here")

sys.meta_path.insert(0, Blocked())
import stof_trt

names = [m.name for m in pkgutil.walk_packages(stof_trt.__path__, "stof_trt.") if not m.name.endswith("__main__")]
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print(len(names))
print("\n".join(failed))
"""


def test_every_module_imports_without_the_gpu_stack():
    """torch, triton, cudnn, transformers and onnxruntime are imported where they are used, so the whole package
    (the rewrite, the CLI, the benchmark statistics) imports on a CPU machine that has none of them."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _WITHOUT_GPU_STACK], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    count, *failed = r.stdout.strip().split("\n")
    assert int(count) > 30
    assert not [f for f in failed if f], "\n".join(failed)
