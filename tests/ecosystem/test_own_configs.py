"""A user's own model / cluster / train YAML kept outside the package, through every ``uniap`` command and the
strategy: ``--config-dir DIR``, ``hydra.searchpath=[file://DIR]`` and explicit ``.yaml`` paths (issue 21 item 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.config import CONF_DIR


def _own_conf(root: Path, *, devices: int = 4) -> Path:
    """``root/conf`` laid out like the package's conf/: a 2-layer GPT ``mygpt`` and a CPU cluster ``mycpu``."""
    conf = root / "conf"
    model = yaml.safe_load((CONF_DIR / "model" / "tiny_gpt.yaml").read_text()) | {"name": "mygpt", "layers": 2}
    cluster = yaml.safe_load((CONF_DIR / "cluster" / "local_cpu.yaml").read_text()) | {
        "name": "mycpu", "devices_per_node": devices}
    train = yaml.safe_load((CONF_DIR / "train" / "default.yaml").read_text()) | {"global_batch_size": 8}
    for group, name, data in (("model", "mygpt", model), ("cluster", "mycpu", cluster), ("train", "mytrain", train)):
        (conf / group).mkdir(parents=True, exist_ok=True)
        (conf / group / f"{name}.yaml").write_text(yaml.safe_dump(data))
    return conf


def _uniap(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False,
                          env={**os.environ, "UNIAP_CACHE_DIR": str(cwd / "cache"), "COLUMNS": "200"})


# ------------------------------------------------------------------------------------ the command line, in-process
@pytest.mark.parametrize("form", ["config-dir", "searchpath", "paths"])
def test_own_configs_compose_in_every_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    from uniap_lightning.cli.overrides import check_command_line, compose_checked
    from uniap_lightning.cli.own_configs import search_dirs

    conf = _own_conf(tmp_path)
    monkeypatch.chdir(tmp_path)  # paths are relative to the current folder
    args = {"config-dir": ["--config-dir", "conf", "model=mygpt", "cluster=mycpu", "train=mytrain"],
            "searchpath": [f"hydra.searchpath=[file://{conf}]", "model=mygpt", "cluster=mycpu", "train=mytrain"],
            "paths": ["model=conf/model/mygpt.yaml", f"cluster={conf}/cluster/mycpu.yaml",
                      "train=conf/train/mytrain.yaml"]}[form]
    for command in ("plan", "explain", "evaluate", "train"):
        # `uniap train` composes a model only (its cluster is strategy.cluster)
        given = [a for a in args if not a.startswith(("cluster=", "train="))] if command == "train" else args
        hydra_args = check_command_line(command, given)
        overrides = [a for a in hydra_args if "=" in a]
        search = search_dirs("conf" if form == "config-dir" else None, overrides)
        cfg = compose_checked("fit" if command == "train" else "plan", search.override(overrides))
        assert cfg.model.name == "mygpt" and cfg.model.layers == 2
        if command != "train":
            assert cfg.cluster.name == "mycpu" and cfg.train.global_batch_size == 8


@pytest.mark.parametrize(("args", "message"), [
    (["model=missing.yaml"], "model=missing.yaml: no such file ("),
    (["cluster=conf/cluster/none.yml"], "cluster=conf/cluster/none.yml: no such file ("),
    (["model=conf.yaml"], "model=conf.yaml: "),  # a folder named like a file (made below)
    (["--config-dir", "nowhere", "model=mygpt"], "--config-dir 'nowhere': no such folder"),
    (["hydra.searchpath=[file:///no/such/dir]", "model=mygpt"], "hydra.searchpath '/no/such/dir': no such folder"),
    (["--config-dir", "conf", "model=other"], "unknown model 'other'; available: bert_huge"),
    (["model=mygpt"], "unknown model 'mygpt'"),  # the folder is not on the search path
])
def test_missing_own_configs_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str],
                                          message: str) -> None:
    from uniap_lightning.cli.overrides import check_command_line

    _own_conf(tmp_path)
    (tmp_path / "conf.yaml").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UniAPError) as err:
        check_command_line("plan", args)
    if args == ["model=conf.yaml"]:
        assert str(err.value).endswith("conf.yaml is not a file; give the path of a .yaml file")
    assert message in str(err.value) and "\n" not in str(err.value)
    if "available" in message:
        assert "mygpt" in str(err.value)  # the user's own names are listed with the shipped ones


def test_a_path_is_registered_once_and_handed_back_to_started_ranks(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from uniap_lightning.cli.own_configs import SearchPath, original_overrides, register_paths

    conf = _own_conf(tmp_path)
    monkeypatch.chdir(tmp_path)
    given = ["+model=conf/model/mygpt.yaml,tiny_gpt", "trainer.devices=2"]
    registered = register_paths(given)
    assert registered[0].startswith("+model=file_mygpt_") and registered[0].endswith(",tiny_gpt")
    assert registered[1] == "trainer.devices=2"
    assert original_overrides(registered) == [f"+model={conf}/model/mygpt.yaml,tiny_gpt", "trainer.devices=2"]
    assert SearchPath((conf,), ("pkg://my.pkg",)).override(["hydra.searchpath=[x]", "lr=1"]) == [
        "lr=1", f"hydra.searchpath=['file://{conf}','pkg://my.pkg']"]
    chosen = register_paths(["model=choice(conf/model/mygpt.yaml,tiny_gpt)"])[0]
    assert chosen.startswith("model=choice(file_mygpt_") and chosen.endswith(",tiny_gpt)")


def test_sweep_functions_are_read_as_hydra_reads_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from uniap_lightning.cli.overrides import check_command_line

    _own_conf(tmp_path)
    monkeypatch.chdir(tmp_path)
    check_command_line("plan", ["-m", "model=glob(tiny_*)", "cluster=choice(a100_1x8,conf/cluster/mycpu.yaml)"])
    with pytest.raises(UniAPError, match="unknown model 'nothere'"):  # was: model 'choice(tiny_gpt' is neither ...
        check_command_line("plan", ["-m", "model=choice(tiny_gpt,nothere)"])


def test_strategy_takes_a_cluster_of_the_users_folder_or_a_path(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from uniap_lightning.cli.own_configs import strategy_cluster
    from uniap_lightning.strategy import UniAPStrategy

    conf = _own_conf(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert strategy_cluster("mycpu", [conf]) == str(conf / "cluster" / "mycpu.yaml")
    assert strategy_cluster("a100_1x8", [conf]) == "a100_1x8" and strategy_cluster(None, [conf]) is None
    assert UniAPStrategy(cluster="conf/cluster/mycpu.yaml").setup_options.cluster.name == "mycpu"
    with pytest.raises(UniAPError, match="mycpu"):
        UniAPStrategy(cluster="mycpu")  # a name outside conf/ and no folder to find it in


# ------------------------------------------------------------------------------------------------ end to end
def test_uniap_plan_with_own_configs(tmp_path: Path) -> None:
    _own_conf(tmp_path)
    (tmp_path / "m.yaml").write_text((tmp_path / "conf" / "model" / "mygpt.yaml").read_text())
    by_dir = _uniap(["plan", "--config-dir", "conf", "model=mygpt", "cluster=mycpu", "time_limit=10",
                     "baselines=false"], tmp_path)
    assert by_dir.returncode == 0, by_dir.stderr
    assert "UniAP plan: mygpt on mycpu" in by_dir.stdout
    by_path = _uniap(["plan", "model=m.yaml", "cluster=conf/cluster/mycpu.yaml", "time_limit=10", "baselines=false"],
                     tmp_path)
    assert by_path.returncode == 0, by_path.stderr
    assert "UniAP plan: mygpt on mycpu" in by_path.stdout
    helped = _uniap(["plan", "--config-dir", "conf", "--help"], tmp_path)
    assert helped.returncode == 0 and "mygpt" in helped.stdout and "mycpu" in helped.stdout
    missing = _uniap(["explain", "model=nope.yaml"], tmp_path)
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert f"model=nope.yaml: no such file ({tmp_path / 'nope.yaml'})" in missing.stderr


def test_uniap_train_two_ranks_with_own_configs(tmp_path: Path) -> None:
    """The rank `uniap train` starts reads the same YAML path and the same --config-dir cluster."""
    _own_conf(tmp_path, devices=2)
    (tmp_path / "m.yaml").write_text((tmp_path / "conf" / "model" / "mygpt.yaml").read_text())
    res = _uniap(["train", "--config-dir", "conf", "model=m.yaml", "strategy.cluster=mycpu", "trainer.devices=2",
                  "trainer.max_steps=1", "trainer.limit_val_batches=0", "strategy.profile_repeats=1",
                  "+trainer.enable_progress_bar=false", "data.batch_size=4", "out=out"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    for rank in (0, 1):
        result = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert result["model"] == "mygpt" and result["steps"] == 1 and result["world_size"] == 2


def test_a_package_on_the_search_path_is_left_to_hydra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from uniap_lightning.cli.overrides import check_command_line, compose_checked
    from uniap_lightning.cli.own_configs import search_dirs

    package = tmp_path / "my_uniap_confs"
    (package / "model").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    model = yaml.safe_load((CONF_DIR / "model" / "tiny_gpt.yaml").read_text()) | {"name": "pkggpt"}
    (package / "model" / "pkggpt.yaml").write_text(yaml.safe_dump(model))
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["hydra.searchpath=[pkg://my_uniap_confs]", "model=pkggpt"]
    hydra_args = check_command_line("plan", args)
    assert hydra_args == args
    assert compose_checked("plan", search_dirs(None, args).override(args)).model.name == "pkggpt"


@pytest.mark.parametrize(("arg", "message"), [
    ("cluster=local_cpu", "cluster=local_cpu: this command has no cluster group; `uniap train` plans for the cluster "
                          "given as strategy.cluster=NAME"),
    ("train=fp32_adam", "train=fp32_adam: this command has no train group; `uniap train`'s training settings are"),
])
def test_groups_train_does_not_have_are_one_line(arg: str, message: str) -> None:
    from uniap_lightning.cli.overrides import check_command_line

    with pytest.raises(UniAPError) as err:
        check_command_line("train", [arg])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
