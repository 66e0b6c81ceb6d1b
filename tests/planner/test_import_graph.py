"""The package's import graph (issue 40, "No hidden cycles"): no cycle, no import from a lower layer to a higher
one, and no function-local import of a package module; a function-local import is for an optional heavy
dependency only.

Every ``.py`` file under ``uniap_lightning`` is parsed with :mod:`ast` (no torch needed). An edge is any import of a
``uniap_lightning`` module, at module level or inside a function (``if TYPE_CHECKING:`` blocks excepted: they never
run). ``from a import b`` counts as ``a.b`` when ``b`` is a module, else as ``a``; importing ``a.b.c`` also runs
the ``__init__`` of every package above it, so the edge goes to those packages too (the root package, a lazy
facade that imports only :mod:`uniap_lightning._autoregister`, excepted). The layers, low to high, are in
:data:`LAYERS` and in ``docs/architecture.md`` ("Layers and imports").
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "uniap_lightning"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE

#: low to high; a module may import its own layer and those below. Longest matching prefix wins.
LAYERS: list[tuple[str, ...]] = [
    # 0: leaves: errors, limits, numbers, files, signals, the lazy facade and its Lightning registration hook
    ("uniap_lightning", "uniap_lightning._autoregister", "uniap_lightning.errors", "uniap_lightning.values",
     "uniap_lightning.limits", "uniap_lightning.yaml_limits", "uniap_lightning.files", "uniap_lightning.sigterm",
     "uniap_lightning.error_hook"),
    # 1: the planner (torch-free: profiles, cost model, solver, plans)
    ("uniap_lightning.planner",),
    # 2: the runtime: torch execution of a plan (payloads, chains, meshes, parallel wrappers, checkpoints)
    ("uniap_lightning.runtime",),
    # 3: profiling: measures layers and the runtime's strategies into planner profiles
    ("uniap_lightning.profiling",),
    # 4: adapters: models (GPT, Hugging Face families) as chains for the runtime
    ("uniap_lightning.adapters",),
    # 5: Lightning glue the strategy uses
    ("uniap_lightning.precision", "uniap_lightning.monitor_memory", "uniap_lightning.monitor",
     "uniap_lightning.callbacks", "uniap_lightning.strategy_checkpoints", "uniap_lightning.strategy_steps",
     "uniap_lightning.data"),
    # 6: setup (profile, plan, agree across ranks, apply), then 7: live re-planning
    ("uniap_lightning.setup",),
    ("uniap_lightning.rebalance",),
    # 8: the Lightning strategy, 9: the command line
    ("uniap_lightning.strategy",),
    ("uniap_lightning.cli",),
]

#: third-party packages a function may import on first use: heavy or optional, kept off the import of modules that
#: must stay light (the planner and the CLI's planning commands run without torch; transformers is an extra)
OPTIONAL_HEAVY = {
    "torch", "lightning", "torchmetrics", "transformers", "safetensors", "matplotlib", "mip", "highspy", "hydra",
    "omegaconf", "rich", "yaml", "torchao",
}

#: function-local imports of package modules that stay, each with why: the heavy dependency (of OPTIONAL_HEAVY) it
#: keeps off a path that must stay light; the import itself says so in a ``# deferred: ...`` comment (tested below)
DEFERRED_PACKAGE_IMPORTS: dict[tuple[str, str], str] = {
    ("uniap_lightning._autoregister", "uniap_lightning.strategy"):
        "the .pth hook runs at every interpreter start; the strategy (torch, Lightning) loads when a Trainer asks",
    ("uniap_lightning.cli.main", "uniap_lightning.cli.help_text"):
        "`uniap <command> --help` reads the schemas (Hydra, the planner's dataclasses); `uniap --help` and "
        "`uniap export` must not load them",
    ("uniap_lightning.cli.main", "uniap_lightning.cli.overrides"):
        "the command-line check loads omegaconf, Hydra's parser and the planner's config; `uniap --help` and "
        "`uniap export` must not",
    ("uniap_lightning.cli.main", "uniap_lightning.cli.apps"):
        "the Hydra apps load hydra, omegaconf and rich; `uniap --help` and `uniap export` must not",
    ("uniap_lightning.cli.export", "uniap_lightning.runtime.checkpoint"):
        "torch: cli.main imports cli.export, and `uniap --help` runs without torch",
    ("uniap_lightning.cli.export", "uniap_lightning.runtime.export"):
        "torch: cli.main imports cli.export, and `uniap --help` runs without torch",
    ("uniap_lightning.cli.apps", "uniap_lightning.planner.solver"):
        "mip (about 70 ms to import): `uniap evaluate` and the launcher of `uniap train` solve nothing",
    ("uniap_lightning.cli.apps", "uniap_lightning.cli.train"):
        "torch: `uniap plan`, `evaluate` and `explain` load it only to price a roofline cluster (a flat one: never)",
    ("uniap_lightning.cli.train_checks", "uniap_lightning.runtime.checks"):
        "torch: cli.overrides imports cli.train_checks, and `uniap plan` checks its command line without torch",
    ("uniap_lightning.cli.train_checks", "uniap_lightning.runtime.resume_checks"):
        "torch: cli.overrides imports cli.train_checks, and `uniap plan` checks its command line without torch",
    ("uniap_lightning.cli.train", "uniap_lightning.adapters"):
        "lightning (seconds): `uniap train` prints its setup estimate before Lightning loads (issue 42)",
    ("uniap_lightning.cli.train", "uniap_lightning.adapters.gpt"):
        "lightning (seconds): `uniap train` prints its setup estimate before Lightning loads (issue 42)",
    ("uniap_lightning.cli.train", "uniap_lightning.callbacks"):
        "lightning (seconds): `uniap train` prints its setup estimate before Lightning loads (issue 42)",
    ("uniap_lightning.cli.train", "uniap_lightning.data"):
        "lightning (seconds): `uniap train` prints its setup estimate before Lightning loads (issue 42)",
    ("uniap_lightning.cli.train", "uniap_lightning.monitor"):
        "lightning (seconds): `uniap train` prints its setup estimate before Lightning loads (issue 42)",
    ("uniap_lightning.cli.train", "uniap_lightning.strategy"):
        "lightning (seconds): `uniap train` prints its setup estimate before Lightning loads (issue 42)",
    ("uniap_lightning.cli.train", "uniap_lightning.runtime.checkpoint"):
        "torch.distributed and the runtime (about 1 s): `uniap train` prints its setup estimate first (issue 42)",
    ("uniap_lightning.cli.train", "uniap_lightning.runtime.checkpoint_safety"):
        "torch.distributed and the runtime (about 1 s): `uniap train` prints its setup estimate first (issue 42)",
    ("uniap_lightning.runtime.planning", "uniap_lightning.planner.solver"):
        "mip: a cached or pinned plan trains without the solver (its ImportError is one line)",
    ("uniap_lightning.profiling.pricing", "uniap_lightning.profiling.roofline"):
        "torch: the roofline model traces layers with it; the planner takes it as an argument, and "
        "uniap_lightning.build_problem and `uniap plan` (which hand it over) stay torch-free until a roofline "
        "cluster is priced",
}

#: parts of a heavy package that importing the package does not load, with what they cost: a module that imports the
#: package at module level may still import these inside a function (with a ``# deferred: ...`` comment, tested)
HEAVY_SUBMODULES: dict[str, str] = {
    "torch.distributed.pipelining": "loads dynamo: about 0.4 s and 230 modules beyond `import torch`; the runtime "
                                    "(imported by `uniap export` and every training rank) needs it only to build "
                                    "a pipeline schedule, profiling only to measure one",
}

# ------------------------------------------------------------------------------------------------------------------
# What remains to be fixed (issue 40). Each list can only shrink: the tests fail on a new entry, and on an entry that
# is gone (remove it then). Names are without the leading "uniap_lightning.".

#: imports from a lower layer to a higher one, with why they are still there
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}

#: groups of modules that still import each other, with why; a group may only lose modules
ALLOWED_CYCLE_GROUPS: list[tuple[set[str], str]] = []


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    local: bool  # inside a function
    line: int


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(name: str, mods: dict[str, Path]) -> str:
    parts = name.split(".")
    while ".".join(parts) not in mods:
        parts.pop()
    return ".".join(parts)


def scan(mods: dict[str, Path] | None = None) -> tuple[list[Edge], list[Edge]]:
    """(imports of package modules, function-local imports of third-party modules), both with their line."""
    mods = modules() if mods is None else mods
    ours: list[Edge] = []
    theirs: list[Edge] = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def walk(node: ast.AST, local: bool, source: str = name, package: str = package) -> None:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.orelse:
                    walk(child, local)
                return
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                ours_ = base == PACKAGE or base.startswith(PACKAGE + ".")
                targets = [f"{base}.{a.name}" if ours_ else base for a in node.names]
            for target in targets:
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    ours.append(Edge(source, _resolve(target, mods), local, node.lineno))
                elif local:
                    theirs.append(Edge(source, target, local, node.lineno))
            inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                walk(child, inner)

        for stmt in ast.parse(path.read_text(), str(path)).body:
            walk(stmt, False)
    return ours, theirs


def graph(edges: list[Edge]) -> dict[str, set[str]]:
    """Module -> modules importing it runs: the target and the packages above it (not the root facade)."""
    out: dict[str, set[str]] = {}
    for e in edges:
        if (e.source, e.target) in DEFERRED_PACKAGE_IMPORTS:
            continue
        targets = out.setdefault(e.source, set())
        parts = e.target.split(".")
        for i in range(2, len(parts) + 1):
            target = ".".join(parts[:i])
            if target != e.source and not e.source.startswith(target + "."):
                targets.add(target)
        if e.target == PACKAGE and e.source != PACKAGE:
            targets.add(PACKAGE)
    return out


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(g.get(u, ())):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (cycle := visit(v)):
                return cycle
        state[u] = 2
        path.pop()
        return None

    for u in sorted(g):
        if u not in state and (cycle := visit(u)):
            return cycle
    return None


def strongly_connected(g: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other (more than one module each)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int:
    best, at = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, at = len(p), i
    assert at >= 0, f"{module} has no layer in LAYERS"
    return at


def _short(pair: tuple[str, str]) -> tuple[str, str]:
    return tuple(n.removeprefix(PACKAGE + ".") for n in pair)  # type: ignore[return-value]


def upward(edges: list[Edge]) -> dict[tuple[str, str], Edge]:
    return {(e.source, e.target): e for e in edges
            if (e.source, e.target) not in DEFERRED_PACKAGE_IMPORTS and layer(e.target) > layer(e.source)}


def test_find_cycle_and_groups_see_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(g) == ["a", "b", "c", "a"]
    assert strongly_connected(g) == [["a", "b", "c"]]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_scan_sees_local_relative_and_package_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import b\nif TYPE_CHECKING:\n    from uniap_lightning import c\n"
        "def f():\n    from ..c import thing\n    import json\n")
    (pkg / "sub" / "b.py").write_text("")
    (pkg / "c.py").write_text("")
    mods = {"uniap_lightning": pkg / "__init__.py", "uniap_lightning.sub": pkg / "sub" / "__init__.py",
            "uniap_lightning.sub.a": pkg / "sub" / "a.py", "uniap_lightning.sub.b": pkg / "sub" / "b.py",
            "uniap_lightning.c": pkg / "c.py"}
    ours, theirs = scan(mods)
    assert [(e.target, e.local) for e in ours] == [("uniap_lightning.sub.b", False), ("uniap_lightning.c", True)]
    assert [(e.target, e.line) for e in theirs] == [("json", 7)]
    assert graph([Edge("uniap_lightning.c", "uniap_lightning.sub.b", False, 1)]) == {
        "uniap_lightning.c": {"uniap_lightning.sub", "uniap_lightning.sub.b"}}


def test_every_module_has_a_layer():
    for name in modules():
        layer(name)


def test_no_import_cycle():
    """Counting function-local imports and the package ``__init__`` an import runs (but for the groups left)."""
    ours, _ = scan()
    g = graph(ours)
    groups = [{_short((m, m))[0] for m in group} for group in strongly_connected(g)]
    allowed = [group for group, _ in ALLOWED_CYCLE_GROUPS]
    new = [sorted(group) for group in groups if not any(group <= a for a in allowed)]
    assert not new, f"new import cycles, e.g. {' -> '.join(find_cycle(g) or [])}; groups: {new}"
    shrunk = [sorted(a) for a in allowed if a not in groups]
    assert not shrunk, f"a cycle group shrank or is gone: update ALLOWED_CYCLE_GROUPS: {shrunk}; now: {groups}"


def test_no_import_from_a_lower_layer_to_a_higher_one():
    ours, _ = scan()
    found = upward(ours)
    found = {_short(k): e for k, e in found.items()}
    new = {k: f"{e.source}:{e.line} -> {e.target}" for k, e in found.items() if k not in ALLOWED_UPWARD}
    assert not new, f"{len(new)} upward imports: {sorted(new.values())}"
    gone = set(ALLOWED_UPWARD) - set(found)
    assert not gone, f"fixed, remove from ALLOWED_UPWARD: {sorted(gone)}"


def test_no_function_local_import_of_a_package_module():
    """But those of :data:`DEFERRED_PACKAGE_IMPORTS`, each of which must still be there (else remove it)."""
    ours, _ = scan()
    local = {(e.source, e.target): e for e in ours if e.local}
    new = sorted(f"{e.source}:{e.line} -> {e.target}" for k, e in local.items() if k not in DEFERRED_PACKAGE_IMPORTS)
    assert not new, (f"{len(new)} function-local imports of package modules (import them at module level, or add "
                     f"them to DEFERRED_PACKAGE_IMPORTS with the heavy dependency they keep off a light path): {new}")
    gone = sorted(set(DEFERRED_PACKAGE_IMPORTS) - set(local))
    assert not gone, f"no longer function-local, remove from DEFERRED_PACKAGE_IMPORTS: {gone}"


def test_deferred_heavy_submodules_say_so():
    """A function-local import of a part of :data:`HEAVY_SUBMODULES` (in a module that imports the package at module
    level) carries a ``# deferred: ...`` comment, as the imports of :data:`DEFERRED_PACKAGE_IMPORTS` do."""
    _, theirs = scan()
    mods = modules()
    top = _module_level_imports(mods)
    heavy = re.compile(r"\b(" + "|".join(sorted(OPTIONAL_HEAVY)) + r")\b")
    bad = []
    for e in theirs:
        if _heavy_part(e.target) is None or e.target.split(".")[0] not in top[e.source]:
            continue
        path = mods[e.source]
        node = next(n for n in ast.walk(ast.parse(path.read_text(), str(path)))
                    if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno == e.line)
        if not any(heavy.search(c) for c in _deferral_comments(path, node.lineno, node.end_lineno or node.lineno)):
            bad.append(f"{e.source}:{e.line} imports {e.target}")
    assert not bad, f"deferred imports of heavy torch parts without a '# deferred: ...' comment: {sorted(set(bad))}"


def _deferral_comments(path: Path, line: int, end: int) -> list[str]:
    """The ``# deferred: ...`` comments of the import statement at ``line``..``end``: on its lines, or on the
    comment lines just above it."""
    lines = path.read_text().splitlines()
    found = [text for text in lines[line - 1:end] if "# deferred:" in text]
    above = line - 2
    while above >= 0 and lines[above].lstrip().startswith("#"):
        found.append(lines[above])
        above -= 1
    return [text[text.index("# deferred:"):] for text in found if "# deferred:" in text]


def test_every_deferred_import_says_which_heavy_dependency_it_defers():
    """Each import of :data:`DEFERRED_PACKAGE_IMPORTS` carries ``# deferred: <why>`` naming the heavy dependency it
    keeps off the import (one of :data:`OPTIONAL_HEAVY`: ``# deferred: loads torch; uniap plan runs without it``)."""
    mods = modules()
    heavy = re.compile(r"\b(" + "|".join(sorted(OPTIONAL_HEAVY)) + r")\b")
    bad = []
    for e in scan(mods)[0]:
        if not e.local or (e.source, e.target) not in DEFERRED_PACKAGE_IMPORTS:
            continue
        path = mods[e.source]
        node = next(n for n in ast.walk(ast.parse(path.read_text(), str(path)))
                    if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno == e.line)
        comments = _deferral_comments(path, node.lineno, node.end_lineno or node.lineno)
        if not any(heavy.search(c) for c in comments):
            bad.append(f"{e.source}:{e.line} -> {e.target}: {comments or 'no # deferred: comment'}")
    bad = sorted(set(bad))
    assert not bad, (f"{len(bad)} deferred imports without a '# deferred: ...' comment naming the heavy dependency "
                     f"({', '.join(sorted(OPTIONAL_HEAVY))}) they keep off a light path: {bad}")


def test_deferral_comments_are_read_from_the_import_or_above(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    # deferred: loads torch\n    from a import (b,\n        c)  # x\n"
                    "    from d import e  # deferred: loads mip\n    from g import h\n")
    assert _deferral_comments(path, 3, 4) == ["# deferred: loads torch"]
    assert _deferral_comments(path, 5, 5) == ["# deferred: loads mip"]
    assert _deferral_comments(path, 6, 6) == []


def test_function_local_imports_are_optional_heavy_dependencies_only():
    _, theirs = scan()
    bad = sorted(f"{e.source}:{e.line} imports {e.target}" for e in theirs
                 if e.target.split(".")[0] not in OPTIONAL_HEAVY)
    assert not bad, f"{len(bad)} function-local imports of light modules (import them at module level): {bad}"


def _heavy_part(module: str) -> str | None:
    return next((part for part in HEAVY_SUBMODULES if module == part or module.startswith(part + ".")), None)


def _module_level_imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the packages it imports at module level (top-level names, and the parts of HEAVY_SUBMODULES)."""
    top: dict[str, set[str]] = {}
    for name, path in mods.items():
        names = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module)
        top[name] = {n.split(".")[0] for n in names} | {p for n in names if (p := _heavy_part(n))}
    return top


def test_no_function_local_import_of_what_the_module_imports_already():
    """A deferred ``import torch`` in a module that imports torch at module level defers nothing; a part of
    :data:`HEAVY_SUBMODULES` counts as its own package (``import torch`` does not load it)."""
    _, theirs = scan()
    top = _module_level_imports(modules())
    key = lambda target: _heavy_part(target) or target.split(".")[0]  # noqa: E731
    bad = sorted(f"{e.source}:{e.line} imports {e.target}" for e in theirs if key(e.target) in top[e.source])
    assert not bad, f"{len(bad)} function-local imports of packages the module imports at module level: {bad}"
