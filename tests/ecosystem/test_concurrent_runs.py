"""Two `uniap train` runs and two `uniap plan` runs at once, sharing a cache folder and output files: every run
succeeds, every file left behind is complete (atomic writes), and a later run reuses the caches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _start(args: list[str], cwd: Path, cache: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "uniap_lightning.cli.main", *args], cwd=cwd,
                            env={**os.environ, "UNIAP_CACHE_DIR": str(cache)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(900)
def test_two_trains_and_two_plans_share_caches_and_outputs(tmp_path: Path) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out"
    plan_file = tmp_path / "plan.json"
    train = ["train", "trainer.devices=2", "trainer.max_steps=4", "trainer.limit_val_batches=0",
             "+trainer.enable_progress_bar=false", f"out={out}"]
    # the plan's size is not the subject (the shared files are): the tiny model solves in a second, not in 20 s
    plan = ["plan", "model=tiny_gpt", "cluster=a100_1x8", "batch_size=16", "time_limit=60", f"out={plan_file}"]
    runs = []
    for i in range(2):
        (tmp_path / f"t{i}").mkdir()
        runs.append(_start(train, tmp_path / f"t{i}", cache))
        runs.append(_start(plan, tmp_path, cache))
    outputs = [p.communicate(timeout=800)[0] for p in runs]
    for p, text in zip(runs, outputs):
        assert p.returncode == 0, text[-3000:]
    from uniap_lightning.planner.plan import Plan

    Plan.from_json(plan_file)  # complete, valid JSON written by one of the two
    for rank in (0, 1):
        assert json.loads((out / f"rank{rank}.json").read_text())["steps"] == 4
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith((".tmp", ".partial"))]
    assert not leftovers, leftovers
    for entry in cache.rglob("*.json"):
        json.loads(entry.read_text())  # no half-written cache entry

    again = _start(train, tmp_path / "t0", cache)
    text = again.communicate(timeout=600)[0]
    assert again.returncode == 0, text[-3000:]
    assert "reusing the measured profile" in text or "cache" in text
