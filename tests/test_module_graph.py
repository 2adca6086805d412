"""The graph of graphdist's module imports has few circles (issue 22: at most 2), and the
kernels import only numpy, numba and math.

The graph is read from the source with `ast`, lazy (function-level) imports included: a
circle closed by a lazy import is still a circle a reader has to keep in mind, even though
Python survives it. `kernels/` is read as graphdist.kernels, the name it is installed under.
A circle is a strongly connected component of more than one module.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"graphdist": ROOT / "graphdist", "graphdist.kernels": ROOT / "kernels"}
MAX_CIRCLES = 2
LINT = Path(sys.executable).with_name("lint-imports")


def _modules(sources: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """module name -> (its file, whether it is a package's __init__)."""
    found = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if "__pycache__" in parts:
                continue
            is_package = parts[-1] == "__init__"
            name = ".".join([package] + (parts[:-1] if is_package else parts))
            found[name] = (path, is_package)
    return found


def _imported(node, module: str, is_package: bool, known) -> set[str]:
    """The graphdist modules one import statement names: `from pkg import sub` names the
    submodule where there is one, else the package."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    package = module if is_package else module.rpartition(".")[0]
    if node.level:
        base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    out = set()
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if sub in known:
            out.add(sub)
        elif target in known:
            out.add(target)
    return out


def import_graph(sources: dict[str, Path] = SOURCES) -> nx.DiGraph:
    """Every graphdist module, and an edge a -> b for each `import` of b anywhere in a."""
    modules = _modules(sources)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, name, is_package, modules) - {name}:
                    graph.add_edge(name, target)
    return graph


def circles(graph: nx.DiGraph) -> list[list[str]]:
    """The strongly connected components of more than one module, largest first."""
    found = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    return sorted(found, key=lambda c: (-len(c), c))


def _describe(graph: nx.DiGraph, circle: list[str]) -> str:
    inner = graph.subgraph(circle)
    edges = ", ".join(f"{a} -> {b}" for a, b in sorted(inner.edges))
    return f"{len(circle)} modules: {edges}"


def test_the_reader_sees_lazy_and_relative_imports(tmp_path):
    """The graph builder itself: a function-level import and a relative one are edges, and
    two modules that import each other make one circle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..a import f\nimport os\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    graph = import_graph({"pkg": pkg})
    assert set(graph.edges) == {("pkg.a", "pkg.sub.b"), ("pkg.sub.b", "pkg.a"),
                                ("pkg.sub", "pkg.sub.b"), ("pkg.c", "pkg.a")}
    assert circles(graph) == [["pkg.a", "pkg.sub.b"]]


def test_graphdist_has_at_most_two_import_circles():
    graph = import_graph()
    assert "graphdist.kernels.softmax" in graph and "graphdist.ops.core" in graph
    found = circles(graph)
    report = "\n".join(_describe(graph, c) for c in found)
    print(f"\n{len(graph)} modules, {graph.number_of_edges()} imports, {len(found)} "
          f"circles:\n{report}")
    assert len(found) <= MAX_CIRCLES, report


@pytest.mark.parametrize("pair", [
    ("graphdist.ops.attention", "graphdist.ops.nn"),       # softmax: one home, ops/softmax.py
    # compile me if called eagerly: graphdist.eager, where graphdist.function registers
    ("graphdist.distribute.strategy", "graphdist.function"),
    ("graphdist.distribute.multi_worker", "graphdist.function"),
    ("graphdist.autodiff", "graphdist.function"),
    # the default strategy registered with context; as_reduce_op beside ReduceOp
    ("graphdist.distribute.context", "graphdist.distribute.strategy"),
    ("graphdist.distribute.multi_step", "graphdist.distribute.strategy"),
    ("graphdist.device.backends", "graphdist.device.gpu"),  # Backend in device/host.py
    ("graphdist.nn.layers", "graphdist.nn.normalization"),  # BatchNorm in normalization.py
])
def test_the_circles_issue_22_broke_stay_broken(pair):
    graph = import_graph()
    together = [c for c in circles(graph) if set(pair) <= set(c)]
    assert not together, _describe(graph, together[0])


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module.partition(".")[0])
    return names


def test_kernels_import_only_numpy_numba_math_and_each_other():
    """kernels/ is installed as graphdist.kernels but stands alone: no graphdist module, and
    of the other packages only numpy and numba (and the standard library: math, collections)."""
    graph = import_graph()
    kernels = [m for m in graph if m.startswith("graphdist.kernels")]
    assert len(kernels) > 10
    outside = [(a, b) for a in kernels for b in graph.successors(a)
               if not b.startswith("graphdist.kernels")]
    assert not outside
    allowed = {"numpy", "numba"} | set(sys.stdlib_module_names)
    for path in sorted(SOURCES["graphdist.kernels"].rglob("*.py")):
        assert _top_level_imports(path) <= allowed, path.name


# ---------------------------------------------------------------- the import-linter contract

def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([str(LINT), "--no-logo", "--no-cache", "--config",
                           str(ROOT / "pyproject.toml")], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed "
                    "(pip install -e '.[test]')")
@pytest.mark.parametrize("bad", [
    "from graphdist.ir.types import ArrayType",       # the package's own modules
    "import graphdist",                               # its root, which imports them all
])
def test_a_kernel_importing_graphdist_breaks_the_contract(tmp_path, bad):
    for folder in ("graphdist", "kernels"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    assert _lint(tmp_path).returncode == 0
    path = tmp_path / "kernels" / "relu.py"
    path.write_text(path.read_text() + f"\n\ndef _wrong():\n    {bad}\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    assert "BROKEN" in done.stdout and "kernels.relu" in done.stdout, done.stdout


# ---------------------------------------------------------------- compile me if called eagerly

def test_eager_code_compiles_through_the_function_graphdist_registers():
    """value_and_grad and the strategies compile eager calls through graphdist.eager (no
    import of graphdist.function from below it): one gd.function per key, reused."""
    import numpy as np

    import graphdist as gd
    from graphdist import eager
    from graphdist.function import Function

    cache: dict = {}
    first = eager.compiled(cache, "double", lambda x: x * 2.0)
    assert isinstance(first, Function) and cache == {"double": first}
    assert eager.compiled(cache, "double", lambda x: x * 3.0) is first
    x = np.arange(3, dtype=np.float32)
    np.testing.assert_array_equal(first(x), x * 2.0)
    value, grad = gd.value_and_grad(lambda v: gd.reduce_sum(v * v))(x)
    np.testing.assert_allclose(grad, 2 * x)
    assert value == np.float32((x * x).sum())


def test_eager_code_without_a_registered_compiler_says_so(monkeypatch):
    from graphdist import eager

    monkeypatch.setattr(eager, "_compile", None)
    cache: dict = {}
    with pytest.raises(RuntimeError, match="graphdist.function is not imported"):
        eager.compiled(cache, "f", lambda x: x)
    assert cache == {}
