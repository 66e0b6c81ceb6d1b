"""The runtime's dimension registry (``uniap_lightning.runtime.dimensions``, issue 40): its orders are the ones
``docs/architecture.md`` gives, every runtime dimension is a planner dimension, the code that applies a plan
(mesh building, stage building, the stage's forward, the plan checks) loops over it and names no dimension, and
the groups are created in the registry's group order (the order ``new_group`` sees: every rank alike). One process,
no process group (the collectives are recorded, not run)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from uniap_lightning.planner import dimensions as planner_dims
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.plan import Plan
from uniap_lightning.runtime import dimensions
from uniap_lightning.runtime import groups as groups_mod
from uniap_lightning.runtime.dimensions import context, experts

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "uniap_lightning" / "runtime"

#: the functions and classes that apply a plan through the registry, by file
LOOPS = {"stage.py": ("build_stages", "StageModule"), "groups.py": ("build_meshes",),
         "__init__.py": ("check_plan_executable",)}


def _docs_list(label: str) -> list[str]:
    """The comma-separated names after ``label`` in docs/architecture.md (up to the sentence's end)."""
    text = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    found = re.search(re.escape(label) + r"[^:]*: ([a-z_, ]+)[.;(]", text)
    assert found, f"docs/architecture.md has no {label!r} line"
    return [x.strip() for x in found.group(1).split(",")]


def test_the_registry_orders_are_the_documented_ones():
    assert [d.name for d in dimensions.DIMENSIONS] == _docs_list("**The runtime registry**")
    assert list(dimensions.GROUP_ORDER) == _docs_list("**The group order**")
    # the wrap order's fixed points (torchtitan: converters, TP, CP, then FSDP last; recompute before offload)
    names = [d.name for d in dimensions.DIMENSIONS]
    assert names.index("precision") < names.index("tensor") < names.index("context") < names.index("data")
    assert names.index("experts") < names.index("data") and names.index("recompute") < names.index("offload")


def test_every_runtime_dimension_is_a_planner_dimension():
    planner = {d.name for d in planner_dims.DIMENSIONS}
    assert {d.name for d in dimensions.DIMENSIONS} <= planner
    # the one without a runtime module: compression rides on the data dimension's buckets
    assert planner - {d.name for d in dimensions.DIMENSIONS} == {"compression"}


def _definitions(path: Path, names: tuple[str, ...]) -> list[ast.AST]:
    tree = ast.parse(path.read_text())
    found = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    assert sorted(n.name for n in found) == sorted(names), path
    return found


@pytest.mark.parametrize("file", sorted(LOOPS))
def test_the_plan_appliers_name_no_dimension(file):
    fields = {f.name for f in planner_dims.FIELDS} | {"replicas", "shard", "layout"}
    dims = {d.name for d in planner_dims.DIMENSIONS}
    for node in _definitions(RUNTIME / file, LOOPS[file]):
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute):
                assert sub.attr not in fields, f"{file}: {node.name} reads .{sub.attr} (line {sub.lineno})"
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                assert sub.value not in dims, f"{file}: {node.name} names {sub.value!r} (line {sub.lineno})"
            if isinstance(sub, ast.Name):
                assert not re.match(r"(apply|check|enable)_(tp|sp|fp8|ep|expert|context|sequence|fsdp)", sub.id), \
                    f"{file}: {node.name} calls {sub.id} (line {sub.lineno})"


class _Recorder:
    """Stands for ``init_device_mesh``, ``DeviceMesh`` and ``new_group``: records each collective creation."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def init(self, device_type, shape, mesh_dim_names=None):
        self.calls.append(("init", tuple(shape), mesh_dim_names))
        return _FakeMesh(mesh_dim_names)

    def mesh(self, device_type, ranks, mesh_dim_names=None):
        self.calls.append(("mesh", tuple(ranks.shape), mesh_dim_names))
        return _FakeMesh(mesh_dim_names)

    def new_group(self, ranks):
        self.calls.append(("new_group", tuple(ranks)))
        return ("group", tuple(ranks))


class _FakeMesh:
    def __init__(self, names) -> None:
        self.names = names

    def get_group(self, name=None):
        return ("group", self.names, name)

    def __getitem__(self, key):
        return self


def test_groups_are_created_in_the_group_order(monkeypatch):
    rec = _Recorder()
    for module in (groups_mod, context, experts):
        monkeypatch.setattr(module, "init_device_mesh", rec.init)
    monkeypatch.setattr(experts, "DeviceMesh", rec.mesh)
    monkeypatch.setattr(groups_mod.dist, "new_group", rec.new_group)
    strategies = [Strategy.of(2, 1, "zero3", cp=2, cp_method="ulysses"), Strategy.of(4, 1, ep=2),
                  Strategy.of(1, 2, cp=2, cp_method="ring"), Strategy.of(2, 2, sp=True)]
    plan = Plan.from_assignment(stage_of_layer=[0] * 4, strategies=strategies, layer_names=list("abcd"), pp=1,
                                microbatches=2, schedule="1f1b", global_batch_size=16, num_devices=4,
                                virtual_stages=1)
    meshes = groups_mod.build_meshes(plan, rank=0, device_type="cpu")
    kinds = [c[2] if c[0] != "new_group" else "new_group" for c in rec.calls]
    # the world, the base grids ((replicas, tp): (2, 2), (4, 1)), the experts' two meshes, the cp groups, then
    # the relayout groups (new_group)
    expected = [("pp", "stage"), ("pp", "dp", "tp"), ("pp", "dp", "tp"), ("pp", "edp", "ep", "tp"),
                ("pp", "ep", "edp", "tp"), ("pp", "dp", "cp", "tp"), ("pp", "dp", "cp", "tp")]
    assert kinds[:len(expected)] == expected and set(kinds[len(expected):]) == {"new_group"}
    assert [c[1] for c in rec.calls[1:3]] == [(1, 2, 2), (1, 4, 1)]  # sorted, as before the registry
    assert sorted(meshes.grids) == sorted({(s.replicas, s.tp) for s in strategies})
    # each dimension's groups in its own store, under its name, read through its module's accessors
    assert sorted(meshes.stores) == sorted(dimensions.GROUP_ORDER)
    assert sorted(meshes.store("context")) == [(1, 2, 2), (2, 2, 1)]
    assert sorted(meshes.store("experts")) == [(4, 1, 2)]
    assert context.cp_group(meshes, 2, 2, 1) == ("group", ("pp", "dp", "cp", "tp"), "cp")
    assert experts.ep_mesh(meshes, 4, 1, 2).names == ("pp", "edp", "ep", "tp")
    assert experts.expert_data_group(meshes, 4, 1, 2) == ("group", ("pp", "edp", "ep", "tp"), "edp")
    assert experts.expert_data_mesh(meshes, 4, 1, 2).names == ("pp", "edp", "ep", "tp")
    assert experts.expert_layout(meshes, 4, 1, 2).names == ("pp", "ep", "edp", "tp")


def _dimension_words() -> set[str]:
    """Every word that names a dimension: the registries' names and the planner's fields, less the base layout's
    ``dp`` and ``tp`` (the grids' axes), each also singular (``expert``)."""
    words = {d.name for d in planner_dims.DIMENSIONS} | {d.name for d in dimensions.DIMENSIONS}
    words |= {f.name for f in planner_dims.FIELDS}
    words -= {"dp", "tp"}
    return words | {w.rstrip("s") for w in words}


def _dimension_names_in(source: str, cls: str) -> list[str]:
    """The members of class ``cls`` (fields, methods, properties) and the strings its code uses (docstrings aside)
    that name a dimension, word by word (``cp_groups``: ``cp``)."""
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls)
    names = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    names += [s.name for s in node.body if isinstance(s, ast.FunctionDef)]
    docs = {id(sub.body[0].value) for sub in ast.walk(node)
            if isinstance(sub, (ast.ClassDef, ast.FunctionDef)) and isinstance(sub.body[0], ast.Expr)}
    names += [c.value for c in ast.walk(node)
              if isinstance(c, ast.Constant) and isinstance(c.value, str) and id(c) not in docs]
    words = _dimension_words()
    return [n for n in names if set(re.split(r"[^a-z]+", n.lower())) & words]


def test_plan_meshes_names_no_dimension():
    """``PlanMeshes`` holds the base layout only; a dimension's groups are in its store, read by its own module's
    accessors (a new dimension adds groups without touching mesh.py)."""
    assert _dimension_names_in((RUNTIME / "mesh.py").read_text(), "PlanMeshes") == []
    # the check finds what the per-dimension fields and accessors looked like before the stores
    before = ('class PlanMeshes:\n    cp_groups: dict = None\n    expert_grids: dict = None\n'
              '    def ep_mesh(self, replicas, tp, ep):\n        """The ep mesh."""\n'
              '        return self.expert_grids[(replicas, tp, ep)]["ep"]\n'
              '    def dp_mesh(self, replicas, tp):\n        return self.grids[(replicas, tp)]["dp"]\n')
    assert _dimension_names_in(before, "PlanMeshes") == ["cp_groups", "expert_grids", "ep_mesh", "ep"]
