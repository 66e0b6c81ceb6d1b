"""The package's shape: the planner imports without torch, and no module-level import cycle anywhere."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import uniap_lightning

PACKAGE_DIR = Path(uniap_lightning.__file__).resolve().parent


def test_planner_imports_without_torch():
    """Every planner module, in a fresh interpreter: ``torch`` must not be loaded (the planner runs on a laptop)."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import uniap_lightning.planner as p\n"
        "names = [m.name for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]\n"
        "assert len(names) > 15, names\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning'))\n"
        "assert not heavy, heavy[:5]\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: module level, also under ``if``/``try`` (but not
    ``if TYPE_CHECKING:``), never inside functions or classes."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                stack += node.body
            stack += node.orelse
        elif isinstance(node, ast.Try):
            stack += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.With):
            stack += node.body
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> package modules it imports at module level (``from a import b`` counts as ``a.b`` when ``b``
    is a module, else as ``a``)."""
    modules = {_module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state:
                cycle = visit(v)
                if cycle:
                    return cycle
        state[u] = 2
        path.pop()
        return None

    for u in sorted(graph):
        if u not in state:
            cycle = visit(u)
            if cycle:
                return cycle
    return None


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_sees_the_planner_imports():
    graph = import_graph()
    assert "uniap_lightning.planner.cost.tables" in graph["uniap_lightning.planner.solver.milp"]
    assert "uniap_lightning.planner.solver.search" in graph["uniap_lightning.planner.solver.baselines"]


def test_no_import_cycles_in_the_package():
    """A module-level cycle makes import order matter and hides layering mistakes; none may exist."""
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


PLANNER_MAY_USE = {"uniap_lightning", "uniap_lightning.errors", "uniap_lightning.files", "uniap_lightning.values"}  # torch-free leaves


def test_planner_imports_nothing_outside_itself_but_torch_free_leaves():
    """The planner sits below everything else: it may use the errors and file helpers, nothing more."""
    graph = import_graph()
    for name, edges in graph.items():
        if name.startswith("uniap_lightning.planner"):
            outside = {e for e in edges if not e.startswith("uniap_lightning.planner") and e not in PLANNER_MAY_USE}
            assert not outside, (name, outside)


def test_walk_packages_finds_the_solver():
    import uniap_lightning.planner as planner

    names = {m.name for m in pkgutil.walk_packages(planner.__path__, planner.__name__ + ".")}
    assert "uniap_lightning.planner.solver.milp" in names
