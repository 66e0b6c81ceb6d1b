"""Exit statuses a CI script can read (issue 42 item 3): a sweep (``-m``) exits with the status its worst job would
have exited with alone, after printing its summary; ``allow_no_plan=true`` accepts "no plan fits" rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from uniap_lightning.cli.sweep import SweepSummary, exit_code, worst_exit_code


def uniap(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300, check=False, env={**os.environ, "COLUMNS": "400"})


def test_a_sweep_with_a_failed_job_exits_as_that_job_does_alone(tmp_path):
    alone = uniap("plan", "model=tiny_gpt", "pp=3", "baselines=false", cwd=tmp_path)
    assert alone.returncode == 2 and "not a usable pipeline degree" in alone.stderr
    res = uniap("plan", "-m", "model=tiny_gpt", "pp=2,3", "baselines=false", f"hydra.sweep.dir={tmp_path / 's'}",
                cwd=tmp_path)
    assert res.returncode == alone.returncode, (res.stdout[-2000:], res.stderr[-2000:])
    assert "Sweep summary (2 runs)" in res.stdout  # the summary still prints, before the status
    assert "not a usable pipeline degree" in (tmp_path / "s" / "summary.csv").read_text()
    assert "error: 1 of 2 runs failed (see the error column): exit status 2" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_sweep_where_no_plan_fits_fails_unless_allowed(tmp_path):
    alone = uniap("plan", "model=llama_70b", "cluster=a100_1x8", "baselines=false", cwd=tmp_path)
    assert alone.returncode == 2 and "no plan fits" in alone.stderr
    sweep = ("plan", "-m", "model=tiny_gpt,llama_70b", "cluster=a100_1x8", "baselines=false")
    res = uniap(*sweep, f"hydra.sweep.dir={tmp_path / 'a'}", cwd=tmp_path)
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-2000:])
    assert "Sweep summary (2 runs)" in res.stdout and "no plan fits" in res.stdout
    assert "1 of 2 runs found no plan that fits" in res.stderr and "allow_no_plan=true" in res.stderr
    res = uniap(*sweep, "allow_no_plan=true", f"hydra.sweep.dir={tmp_path / 'b'}", cwd=tmp_path)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
    assert "Sweep summary (2 runs)" in res.stdout and "no plan fits" in (tmp_path / "b" / "summary.csv").read_text()
    assert "exit status" not in res.stderr


def test_allow_no_plan_alone_exits_0_and_says_no_plan(tmp_path):
    res = uniap("plan", "model=llama_70b", "cluster=a100_1x8", "baselines=false", "allow_no_plan=true", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "no plan (allow_no_plan=true): no plan fits" in res.stderr and "error:" not in res.stderr
    res = uniap("plan", "model=tiny_gpt", "allow_no_plan=maybe", cwd=tmp_path)
    assert res.returncode == 2 and "allow_no_plan" in res.stderr and "Traceback" not in res.stderr


def _summary(tmp_path, rows, config=None):
    for i, row in enumerate(rows):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "result.json").write_text(row if isinstance(row, str) else json.dumps(row))
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, **(config or {})}))


@pytest.mark.parametrize(("rows", "code"), [
    ([{"model": "a", "exit_code": 0}, {"model": "b", "exit_code": 3, "no_plan": True, "error": "does not fit"}], 3),
    ([{"exit_code": 3, "no_plan": True, "error": "x"}, {"exit_code": 2, "error": "boom"}], 2),
    ([{"exit_code": 0}, {"error": "written before exit_code"}], 2),  # an older result.json: its error fails
    ([{"exit_code": 0}, "{damaged"], 2),
    ([{"exit_code": 0}, {"exit_code": 0, "no_plan": True, "error": "no plan fits"}], 0),  # allow_no_plan=true
])
def test_the_sweep_exits_with_its_worst_job(tmp_path, capsys, monkeypatch, rows, code):
    monkeypatch.setenv("COLUMNS", "400")
    if code == 0:
        _summary(tmp_path, rows)
        assert "Sweep" in capsys.readouterr().out and (tmp_path / "summary.csv").exists()
        return
    with pytest.raises(SystemExit) as stop:
        _summary(tmp_path, rows)
    assert stop.value.code == code
    out = capsys.readouterr()
    assert "Sweep" in out.out and (tmp_path / "summary.csv").exists()  # the summary first
    assert f"exit status {code}" in out.err


def test_exit_code_reading():
    assert exit_code({"exit_code": 143}) == 143
    assert exit_code({"exit_code": True, "error": "x"}) == 2 and exit_code({"exit_code": "0"}) == 0
    assert exit_code([1]) == 2
    assert worst_exit_code([0, 0]) == 0 and worst_exit_code([3, 0]) == 3 and worst_exit_code([3, 2]) == 2
    assert worst_exit_code([2, 143, 3]) == 143
