"""The shipped measured sets (benchmarks/data/measured/*.csv) are well-formed and their configs load.

Fast: reads the CSVs and the configs, prices nothing (``python benchmarks/measured.py`` does that)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

from uniap_lightning.planner.config import cluster_from, load_group, model_spec_from

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data" / "measured"
COLUMNS = ["file", "nodes", "num_gpus", "dp", "pp", "tp", "mbs", "gbs", "microbatches", "layers_per_stage",
           "measured_time_s", "measured_mem_bytes"]


def _sets() -> dict[str, tuple[str, str]]:
    spec = importlib.util.spec_from_file_location("measured_benchmark", ROOT / "benchmarks" / "measured.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.SETS


SETS = _sets()
CSVS = sorted(p.name for p in DATA.glob("*.csv"))


def test_every_shipped_csv_is_registered():
    assert CSVS, "no measured set shipped"
    assert sorted(SETS) == CSVS


@pytest.mark.parametrize("name", CSVS)
def test_rows_are_well_formed(name: str):
    model, cluster_name = SETS[name]
    spec = model_spec_from(model)
    cluster = cluster_from(cluster_name)
    chain = sum(seg.layers for seg in spec.blocks()) + 2  # blocks + embedding + head
    readme = (DATA / "README.md").read_text()
    assert f"`{name}`" in readme, f"{name} has no paragraph in {DATA / 'README.md'}"
    with (DATA / name).open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert rows
    files = [r["file"] for r in rows]
    assert len(set(files)) == len(files), "a source file twice"
    for r in rows:
        where = f"{name}: {r['file']}"
        assert r["file"].endswith(".json"), where
        n = {k: int(r[k]) for k in ("nodes", "num_gpus", "dp", "pp", "tp", "mbs", "gbs", "microbatches")}
        assert all(v > 0 for v in n.values()), where
        assert n["dp"] * n["pp"] * n["tp"] == n["num_gpus"], where
        assert n["num_gpus"] == n["nodes"] * cluster.devices_per_node, where
        assert n["microbatches"] * n["mbs"] * n["dp"] == n["gbs"], where
        split = [int(x) for x in r["layers_per_stage"].split("-")]
        assert len(split) == n["pp"] and all(x > 0 for x in split), where
        assert sum(split) == chain, f"{where}: layers_per_stage {split} do not sum to the chain ({chain})"
        assert float(r["measured_time_s"]) > 0, where
        assert float(r["measured_mem_bytes"]) > 0, where


@pytest.mark.parametrize("name", CSVS)
def test_configs_load(name: str):
    model, cluster_name = SETS[name]
    assert model_spec_from(model).name == load_group("model", model)["name"]
    assert cluster_from(load_group("cluster", cluster_name)).devices_per_node > 0
