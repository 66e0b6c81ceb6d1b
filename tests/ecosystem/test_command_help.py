"""`uniap <command> --help`: generated from the schemas the command line is checked against (subprocesses, as a
user runs them; each a second or two, no solver and no torch)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from uniap_lightning.cli.help_text import WIDTH, field_comments
from uniap_lightning.cli.overrides import group_fields
from uniap_lightning.cli.train_checks import DATA_KEYS
from uniap_lightning.planner.analytic import ModelSpec
from uniap_lightning.planner.config import available
from uniap_lightning.planner.config_schema import type_name, plan_schema, strategy_arguments


def _help(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", *args], capture_output=True, text=True,
                          timeout=120, check=False, cwd=cwd)


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    found = {}
    for command in ("plan", "evaluate", "explain", "train"):
        res = _help(command, "--help")
        assert res.returncode == 0 and not res.stderr, res.stderr
        found[command] = res.stdout
    return found


def _yaml(value: object) -> str:
    """A default as the help writes it (and the command line takes it)."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("command", ["plan", "evaluate", "explain", "train"])
def test_help_names_the_command_and_is_not_hydras(helps: dict[str, str], command: str) -> None:
    text = helps[command]
    assert text.startswith(f"uniap {command}: ")
    assert "powered by Hydra" not in text and "== Config ==" not in text
    assert "Examples:" in text and "Exit status:" in text and f"  uniap {command} " in text
    wide = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not wide, wide


def test_plan_help_lists_every_schema_option_with_its_type_and_default(helps: dict[str, str]) -> None:
    text = helps["plan"]
    groups = ("model", "cluster", "train")
    for field in dataclasses.fields(plan_schema()):
        if field.name in groups:  # a group: its header, its default choice and its fields
            assert re.search(rf"^{field.name}\.\*: .*\(default: \w+\)", text, re.M), field.name
            continue
        line = f"  {field.name}: {type_name(field.type)} = {_yaml(field.default)}\n"
        assert line in text, line
        assert field.metadata["help"].split(":")[0][:40] in " ".join(text.split()), field.name
    for group in groups:
        for name in group_fields("plan", group) or ():
            assert f"  {group}.{name}: " in text, f"{group}.{name}"
        assert ", ".join(available(group))[:60] in " ".join(text.split())


def test_plan_help_shows_the_chosen_configs_values(helps: dict[str, str]) -> None:
    assert "  model.layers: int = 0 [12]\n" in helps["plan"]  # gpt2_small, plan.yaml's default
    chosen = _help("plan", "--help", "model=tiny_gpt").stdout
    assert "  model.layers: int = 0 [4]\n" in chosen and "(default: tiny_gpt)" in chosen
    comments = field_comments(ModelSpec)
    assert comments["embedding"] == "token | patch" and comments["dropout"].startswith("dropout probability")


def test_train_help_lists_the_strategy_data_and_trainer_options(helps: dict[str, str]) -> None:
    text = helps["train"]
    for arg in strategy_arguments():
        assert f"  strategy.{arg.name}: {arg.annotation} = {_yaml(arg.default)}\n" in text, arg.name
    assert "      seconds the solver may spend.\n" in text  # from UniAPStrategy's docstring
    for key in DATA_KEYS:
        assert f"  data.{key}: " in text
    assert "Any lightning.pytorch.Trainer argument" in text and "  trainer.max_steps = 30\n" in text
    for key in ("lr", "seed", "checkpoint_dir", "resume", "out"):
        assert re.search(rf"^  {key}: ", text, re.M), key
    assert "  143 " in text and "  130 " in text


def test_help_lists_own_configs_and_refuses_a_missing_folder(tmp_path: Path) -> None:
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text("name: mine\nlayers: 2\n")
    res = _help("plan", "--config-dir", "conf", "model=mine", "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "mine" in res.stdout and "  model.layers: int = 0 [2]\n" in res.stdout
    missing = _help("train", "--config-dir", "nowhere", "--help", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.startswith("error: --config-dir 'nowhere': no such folder")


def test_hydra_help_stays_hydras() -> None:
    res = _help("plan", "--hydra-help")
    assert res.returncode == 0 and "Hydra" in res.stdout and "--hydra-help" in res.stdout


@pytest.mark.parametrize("command", ["plan", "evaluate", "explain", "train"])
def test_every_example_composes(command: str) -> None:
    """The examples' command lines pass the checks the command runs first (keys, types, group names); running them
    is the docs' tests' job."""
    from uniap_lightning.cli.help_text import EXAMPLES
    from uniap_lightning.cli.overrides import check_command_line

    for line in EXAMPLES[command]:
        words = line.split("#")[0].split()
        assert words[0] == "uniap" and words[1] in ("plan", "evaluate", "explain", "train"), line
        check_command_line(words[1], words[2:])
