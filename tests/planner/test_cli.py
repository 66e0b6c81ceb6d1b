"""`uniap plan` / `uniap evaluate` end to end, including every bad input (subprocesses, as a user runs them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from uniap_lightning.planner.plan import PLAN_FORMAT_VERSION


def uniap(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300, check=False, env=env)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "plan.json"
    res = uniap("plan", "model=bert_huge", "cluster=titanxp_2x4", "batch_size=32", f"out={out}")
    assert res.returncode == 0, res.stderr
    assert ("Stages" in res.stdout or "Device groups" in res.stdout) and "Baselines" in res.stdout
    assert "solver: " in res.stdout and "Schedules" in res.stdout  # the default search prices every schedule
    assert "predicted:" in res.stdout and "samples/s" in res.stdout
    return out


def test_plan_writes_the_documented_json(plan_file):
    data = json.loads(plan_file.read_text())
    assert data["pp"] >= 1 and data["estimate"]["feasible"] is True
    assert set(data["baselines"]) == {"ddp", "zero2", "fsdp", "megatron", "intra_only", "inter_only"}
    assert data["solver"]["status"] == "optimal"


def test_evaluate_scores_a_plan_file(plan_file):
    res = uniap("evaluate", f"plan={plan_file}", "model=bert_huge", "cluster=titanxp_2x4", "batch_size=32")
    assert res.returncode == 0, res.stderr
    tpi_ms = json.loads(plan_file.read_text())["estimate"]["tpi_s"] * 1e3
    assert f"{tpi_ms:,.2f} ms" in res.stdout


def test_evaluate_refuses_a_plan_from_another_model(plan_file):
    res = uniap("evaluate", f"plan={plan_file}", "model=gpt2_small", "cluster=titanxp_2x4", "batch_size=32")
    assert res.returncode == 2
    assert "another model" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["model=nope"], 2, "unknown model 'nope'"),
        (["cluster=nope"], 2, "unknown cluster 'nope'"),
        (["cluster=a100_1x8,../../etc/x"], 2, "is neither a shipped cluster name"),
        (["time_limit=-5"], 2, "time_limit=-5: give the search's time limit in seconds, a number > 0"),
        (["time_limit=nan"], 2, "time_limit=nan"),
        (["out=/nonexistent-dir/plan.json"], 2, "out='/nonexistent-dir/plan.json': the folder '/nonexistent-dir' does not exist"),
        (["out=/"], 2, "out='/' is a folder; give a file name"),
        (["viz=/nonexistent-dir/plan.png"], 2, "viz='/nonexistent-dir/plan.png': the folder"),
        ([f"profile={sys.executable}"], 2, "is not a text file"),
        (["profile=/"], 2, "profile file '/' is a folder, not a file"),
        (["model=llama_70b", "cluster=a100_1x8", "batch_size=64"], 2, "no plan fits in memory: the least memory"),
        (["batch_size=0"], 2, "batch_size (global_batch_size) must be a positive integer"),
        (["batch_size=6", "microbatches=[4]"], 2, "microbatches=[4]: each candidate must be a positive integer dividing batch_size=6"),
        (["pp=3"], 2, "pp=[3] is not a usable pipeline degree"),
        (["solver=glpk"], 2, "solver='glpk' must be one of"),
        (["schedule=zigzag"], 2, "schedule='zigzag' must be one of"),
        (["profile=/nonexistent.json"], 2, "profile file '/nonexistent.json' does not exist"),
        (["cluster.nodes=0"], 2, "cluster 'a100_1x8': nodes must be a positive integer, got 0"),
        (["cluster.inter_bw_gbps=-1"], 2, "cluster 'a100_1x8': inter_bw_gbps must be > 0, got -1"),
        (["model.heads=7"], 2, "model 'gpt2_small': hidden=768 is not divisible by heads=7"),
    ],
)
def test_bad_input_gets_one_clear_message(args, code, message):
    res = uniap("plan", *args)
    assert res.returncode == code, (res.stdout, res.stderr)
    assert message in res.stderr
    assert "Traceback" not in res.stderr


def test_usage_and_unknown_command():
    assert "uniap plan" in uniap().stdout
    res = uniap("frobnicate")
    assert res.returncode == 2 and "unknown command" in res.stderr


def test_multirun_sweep_prints_one_summary(tmp_path):
    res = uniap("plan", "-m", "model=tiny_gpt,gpt2_small", "cluster=local_cpu,a100_1x8", "batch_size=16",
                "baselines=false", f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = (tmp_path / "summary.csv").read_text().strip().splitlines()
    assert len(rows) == 5 and rows[0].startswith("model,cluster")
    assert "Sweep summary (4 runs)" in res.stdout


def test_explain_shows_layers_stages_and_runners_up(plan_file, tmp_path):
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"stage_time_s": [0.2, 0.21], "stage_peak_memory_bytes": [7e9, 6e9], "tpi_s": 1.6}))
    res = uniap("explain", f"plan={plan_file}", f"measured={measured}", "model=bert_huge", "cluster=titanxp_2x4",
                "batch_size=32")
    assert res.returncode == 0, res.stderr
    for text in ("Per layer", "Per stage: predicted vs measured", "Why the other", "CHOSEN", "measured"):
        assert text in res.stdout
    res = uniap("explain", "measured=/nope.json", "model=tiny_gpt", "cluster=local_cpu", "batch_size=16")
    assert res.returncode == 2 and "measured='/nope.json' does not exist" in res.stderr


@pytest.mark.parametrize(("command", "args", "message"), [
    ("evaluate", ["plan=/"], "plan file '/' is a folder, not a file"),
    ("evaluate", [f"plan={sys.executable}"], "is not a text file"),
    ("explain", [f"measured={sys.executable}"], "is not a text file"),
    ("explain", ["measured=MEASURED"], "field 'tpi_s' must be a number of seconds >= 0, got 'fast'"),
    ("explain", ["measured=NOTJSON"], "is not valid JSON"),
    # the run record (what the file measured) is checked field by field
    ("explain", ["measured=RUNSTR"], ": run must be an object, got str"),
    ("explain", ["measured=RUNDEV"], ": run.devices must be >= 1, got 0"),
    ("explain", ["measured=RUNPLAN"], ": run.plan must be an object, got list"),
    ("plan", ["profile=ZEROS"], "every layer has forward_s = backward_s = 0"),
])
def test_bad_files_get_one_clear_message(command, args, message, tmp_path):
    from uniap_lightning.profiling.pricing import build_problem

    (tmp_path / "m.json").write_text('{"tpi_s": "fast"}')
    (tmp_path / "n.json").write_text("{not json")
    zeros = build_problem(model="gpt2_small", cluster="a100_1x8", global_batch_size=16).model.to_dict()
    for layer in zeros["layers"]:
        layer.update(forward_s=0, backward_s=0, params=0, activation_bytes=0, output_bytes=0)
    (tmp_path / "z.json").write_text(json.dumps(zeros))
    runs = {"RUNSTR": "x", "RUNDEV": {"model": "m", "devices": 0, "plan": {}},
            "RUNPLAN": {"model": "m", "devices": 1, "plan": []}}
    for key, run in runs.items():
        (tmp_path / f"{key}.json").write_text(json.dumps({"tpi_s": 0.1, "run": run}))
    files = {"MEASURED": "m.json", "NOTJSON": "n.json", "ZEROS": "z.json", **{k: f"{k}.json" for k in runs}}
    for key, name in files.items():
        args = [a.replace(key, str(tmp_path / name)) for a in args]
    res = uniap(command, "model=gpt2_small", *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert message in res.stderr and "Traceback" not in res.stderr


def test_broken_cluster_yaml_is_one_clear_message(tmp_path):
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.planner.config import cluster_from

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnodes: [1\n")
    with pytest.raises(UniAPError, match="bad.yaml' is not valid YAML: .*line 2"):
        cluster_from(str(bad))
    with pytest.raises(UniAPError, match="does not exist"):
        cluster_from(str(tmp_path / "missing.yaml"))


def test_plan_with_compression_shows_modes_recompute_and_compression(tmp_path):
    out = tmp_path / "plan.json"
    res = uniap("plan", "model=gpt2_small", "cluster=a100_2x8", "batch_size=32", "compression=auto",
                "baselines=false", f"out={out}")
    assert res.returncode == 0, res.stderr
    for column in ("dp mode", "recompute", "compression"):
        assert column in res.stdout
    data = json.loads(out.read_text())
    assert data["format_version"] == PLAN_FORMAT_VERSION and data["compression_options"] == {"powersgd_rank": 1, "topk_ratio": 0.01}
    assert all({"dp_mode", "recompute", "compression"} <= set(layer) for layer in data["layers"])
    import os

    res = uniap("explain", f"plan={out}", "model=gpt2_small", "cluster=a100_2x8", "batch_size=32",
                env={**os.environ, "COLUMNS": "250"})
    assert res.returncode == 0, res.stderr
    assert "transient MiB" in res.stdout and "dp mode" in res.stdout


def test_plan_refuses_an_unknown_compression():
    res = uniap("plan", "model=gpt2_small", "compression=zip")
    assert res.returncode == 2
    assert "compression='zip' must be one of None, 'bf16', 'powersgd', 'topk', 'auto' or a list" in res.stderr
    assert "Traceback" not in res.stderr


def test_sweep_summary_prints_error_text_that_looks_like_markup(tmp_path, capsys):
    """A job's error may hold `[/...]` (gloo's source paths): the summary table prints it as text (rich used to
    parse it as markup and fail with MarkupError, losing the whole summary)."""
    import json

    from omegaconf import OmegaConf

    from uniap_lightning.cli.sweep import SweepSummary

    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "result.json").write_text(json.dumps(
        {"model": "tiny_gpt", "error": "Connection closed by peer [/__w/pytorch/pytorch/third_party/gloo/pair.cc:553]"}))
    with pytest.raises(SystemExit):  # a job that failed fails the sweep, after the summary
        SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    out = capsys.readouterr().out
    assert "Connection" in out and "tiny_gpt" in out
    assert "pair.cc:553" in (tmp_path / "summary.csv").read_text()


def test_tables_written_to_a_log_are_not_cut_to_80_columns(monkeypatch):
    """Without a terminal (logs, CI, SLURM output files, sweeps) rich would print 80 columns and cut the plan
    table's headers ("time/µbat…"); the CLI's consoles are wide there, unless COLUMNS says otherwise."""
    import io

    from uniap_lightning.planner.report import LOG_WIDTH, make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    assert make_console(file=io.StringIO()).width == LOG_WIDTH
    monkeypatch.setenv("COLUMNS", "100")
    assert make_console(file=io.StringIO()).width == 100


def test_uniap_plan_output_in_a_pipe_has_whole_headers(tmp_path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    res = subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", "plan", "model=llama_7b",
                          "cluster=h100_4x8", "batch_size=64", "baselines=false"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "…" not in res.stdout, res.stdout


def test_a_training_sweep_with_a_failed_run_exits_2(tmp_path, capsys):
    import json

    from omegaconf import OmegaConf

    from uniap_lightning.cli.sweep import SweepSummary

    for i, row in enumerate(({"model": "tiny_gpt", "final_loss": 2.5}, {"model": "tiny_llama", "error": "boom"})):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "result.json").write_text(json.dumps(row))
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, "trainer": {"devices": 2}})
    with pytest.raises(SystemExit) as stop:
        SweepSummary().on_multirun_end(config)
    assert stop.value.code == 2
    assert "error: 1 of 2 training runs failed" in capsys.readouterr().err
