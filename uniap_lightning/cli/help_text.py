"""``uniap <command> --help``: what the command does, every option with its type and default, examples and exit
statuses, generated from what the command line is checked against, so help and tool cannot drift:

- the planning commands' options: the schema :func:`~uniap_lightning.planner.config_schema.plan_schema` (type,
  default, and the line printed for each);
- ``strategy.*``: ``UniAPStrategy.__init__``'s signature and docstring
  (:func:`~uniap_lightning.planner.config_schema.strategy_arguments`);
- ``model.*``, ``cluster.*``, ``train.*``: the fields of ``ModelSpec``, ``Cluster`` and ``TrainingConfig`` (what
  :func:`~uniap_lightning.cli.overrides.group_fields` accepts), their ``#:`` comments, and the values of the
  command's default choice (``conf/plan.yaml``'s defaults list);
- ``uniap train``'s own keys, ``data.*`` and ``trainer.*``: ``conf/fit.yaml``, its values and end-of-line comments.

Hydra's own help (``--hydra-help``) is left to Hydra.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf

from uniap_lightning.cli.apps import EXIT_DOES_NOT_FIT, EXIT_FAILED
from uniap_lightning.cli.interrupts import INTERRUPTED_EXIT_CODE
from uniap_lightning.cli.overrides import CONFIG_NAME, group_fields, parse_flags
from uniap_lightning.cli.own_configs import SearchPath, available, group_values, load, search_dirs
from uniap_lightning.cli.ranks import PREEMPTED_EXIT_CODE
from uniap_lightning.cli.train_checks import DATA_KEYS, OWN_TRAINER_ARGUMENTS
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.analytic import ModelSpec
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.config import CONF_DIR
from uniap_lightning.planner.config_schema import (
    STRATEGY_GROUP,
    type_name,
    first_sentence,
    plan_schema,
    strategy_arguments,
)
from uniap_lightning.planner.problem import TrainingConfig

#: the widest line the help prints
WIDTH = 100
#: the commands whose help is generated here (``export`` has its own argparse help)
COMMANDS = ("plan", "evaluate", "explain", "train")

#: what each command does: one line after its name, then one or two more
ABOUT = {
    "plan": ("find the fastest parallelization plan for a model on a cluster",
             "Prices every pipeline split, schedule and per-layer strategy (data, tensor, context, expert "
             "parallel, ZeRO, recomputation) with the cost model and solves a MILP, in seconds and without the "
             "cluster. Prints the plan, its baselines and the solver's status; writes JSON (out=) or a PNG (viz=)."),
    "evaluate": ("score a given plan file with the same cost model (a what-if)",
                 "Reads plan=FILE (from `uniap plan out=` or written by hand) and prints its predicted time per "
                 "iteration and memory per stage, as `uniap plan` prices its own."),
    "explain": ("a plan per stage and layer, and why the other candidates lost",
                "Solves (or reads plan=FILE) and prints the predicted time and memory of each stage and layer and "
                "the best plan of every other candidate; with measured=FILE, side by side with a run."),
    "train": ("train a shipped (or your own) GPT-style model with Trainer(strategy=\"uniap\")",
              "Trains on the shipped character-level corpus: profiles the model, plans, and starts the other ranks "
              "on this machine (or runs under srun); logs loss and perplexity to lightning_logs/."),
}

EXAMPLES = {
    "plan": ["uniap plan model=llama_7b cluster=h100_4x8 batch_size=64",
             "uniap plan model=llama_70b cluster=h100_32x8 batch_size=512 out=plan.json viz=plan.png",
             "uniap plan -m model=gpt2_small,llama_7b cluster=a100_1x8,h100_4x8    # a sweep, with a summary"],
    "evaluate": ["uniap plan model=tiny_gpt cluster=local_cpu out=plan.json",
                 "uniap evaluate plan=plan.json model=tiny_gpt cluster=local_cpu",
                 "uniap evaluate plan=plan.json model=tiny_gpt cluster=local_cpu cluster.intra_bw_gbps=0.1"],
    "explain": ["uniap explain model=gpt2_small cluster=a100_1x8",
                "uniap explain model=tiny_gpt cluster=local_cpu plan=plan.json",
                "uniap explain measured=LOG_DIR/uniap_measured.json    # a run's measurements (the monitor's file)"],
    "train": ["uniap train model=tiny_gpt trainer.devices=2 trainer.max_steps=30",
              "uniap train model=tiny_gpt trainer.devices=4 strategy.cluster=local_cpu out=results/",
              "uniap train -m model=tiny_gpt,tiny_llama trainer.devices=2    # a sweep, with a summary"],
}

_SWEEP = "A sweep (-m) prints its summary, then exits with its worst job's status."
EXIT_STATUSES = {
    "plan": [(0, "a plan was found (or none fits, with allow_no_plan=true)"),
             (EXIT_FAILED, "refused or failed: a bad option, or no plan fits memory")],
    "evaluate": [(0, "the plan was scored and fits memory (or does not, with allow_no_plan=true)"),
                 (EXIT_FAILED, "refused or failed: a bad option or plan file"),
                 (EXIT_DOES_NOT_FIT, "the plan does not fit memory")],
    "explain": [(0, "done (no plan fits: also 0 with allow_no_plan=true)"),
                (EXIT_FAILED, "refused or failed: a bad option or file, or no plan fits memory")],
    "train": [(0, "trained"), (EXIT_FAILED, "refused or failed: a bad option, or a rank failed"),
              (INTERRUPTED_EXIT_CODE, "interrupted (Ctrl-C)"),
              (PREEMPTED_EXIT_CODE, "stopped by SIGTERM (once training started, a checkpoint is written; "
                                    "resume=auto continues)")],
}

#: what `uniap train` itself sets on the Trainer: never a trainer.* option
_TRAINER_NOTE = ("Any lightning.pytorch.Trainer argument (trainer.<argument>=value; +trainer.<argument>= for one "
                 f"conf/fit.yaml does not set), except {', '.join(OWN_TRAINER_ARGUMENTS)}, which `uniap train` sets "
                 "itself. conf/fit.yaml sets:")
#: the types of conf/fit.yaml's keys whose default (null) does not say it
_FIT_TYPES = {"resume": "str | None", "out": "str | None", "data.seq_len": "int | None"}
#: cluster YAML keys that are not Cluster fields (read by planner.config.cluster_from)
_CLUSTER_EXTRA = {"device_groups": ("list | None", None, "instead of the rank_* lists: [{name, count, memory_gib, "
                                    "speed}, ...] in rank order, counts summing to nodes x devices_per_node")}


def print_help(command: str, args: list[str]) -> int:
    """``uniap <command> ... --help``: print :func:`command_help` for the command line's config folders and group
    choices; exit status 0, or 2 with one ``error:`` line (a missing ``--config-dir``, an unknown ``model=``)."""
    try:
        flags = parse_flags(command, args)
        overrides = list(flags.overrides or [])
        text = command_help(command, search_dirs(flags.config_dir, overrides), tuple(overrides))
    except UniAPError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    print(text, end="")
    return 0


def command_help(command: str, search: SearchPath = SearchPath(), overrides: tuple[str, ...] = ()) -> str:
    """The text ``uniap <command> --help`` prints. ``search``: the user's config folders (``--config-dir``,
    ``hydra.searchpath``), whose names are listed with the shipped ones; ``overrides``: the command line's, whose
    ``model=`` / ``cluster=`` / ``train=`` choice (one, not a sweep) is the one whose values are shown."""
    if command not in COMMANDS:
        raise ValueError(f"no generated help for {command!r}; commands: {', '.join(COMMANDS)}")
    short, long = ABOUT[command]
    out = [f"uniap {command}: {short}", *_wrap(long, ""), "",
           f"usage: uniap {command} [key=value ...] [-m] [--config-dir DIR] [--cfg job] [--hydra-help]", "",
           "Every option is a Hydra override, key=value; -m sweeps comma-separated values (a=1,2). Options are",
           "shown as key: type = default.", ""]
    config_name = CONFIG_NAME[command]
    chosen = _default_choices(config_name) | {group: values[0] for _, group, values in group_values(list(overrides))
                                              if len(values) == 1 and group in _groups(config_name)}
    values = {group: load(group, name, search) or {} for group, name in chosen.items() if group != STRATEGY_GROUP}
    if config_name == "plan":
        out += _planning_options(search.dirs, chosen, values)
    else:
        out += _train_options(search.dirs, chosen, values)
    out += ["", "Examples:", *[f"  {line}" for line in EXAMPLES[command]], "", "Exit status:",
            *[line for code, why in EXIT_STATUSES[command] for line in _wrap(f"{code:<4}{why}", "  ", indent="      ")],
            *_wrap(_SWEEP, "  ")]
    out += ["", "Hydra's own options: uniap " + command + " --hydra-help; the composed config: --cfg job."]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------ the sections
def _planning_options(search_dirs: tuple[Path, ...], chosen: dict[str, str],
                      values: dict[str, dict[str, Any]]) -> list[str]:
    fields = [f for f in dataclasses.fields(plan_schema()) if f.name not in _groups("plan")]
    out = ["Options:"]
    for f in fields:
        out += _option(f.name, type_name(f.type), f.default, f.metadata.get("help", ""))
    for group, cls, extra in (("model", ModelSpec, {}), ("cluster", Cluster, _CLUSTER_EXTRA),
                              ("train", TrainingConfig, {})):
        out += ["", *_group_header(group, chosen.get(group), search_dirs)]
        out += _dataclass_fields(group, cls, extra, values.get(group, {}))
    return out


def _train_options(search_dirs: tuple[Path, ...], chosen: dict[str, str],
                   values: dict[str, dict[str, Any]]) -> list[str]:
    fit = _fit_yaml()
    groups = _groups("fit")
    out = ["Options:"]
    for key, value in fit.items():
        if key not in groups and key not in ("defaults", "hydra", "data", "trainer"):
            out += _option(key, _FIT_TYPES.get(key, _value_type(value)), value, _fit_comment(key))
    out += ["", *_group_header("model", chosen.get("model"), search_dirs)]
    out += _dataclass_fields("model", ModelSpec, {}, values.get("model", {}))
    clusters = ", ".join(available("cluster", list(search_dirs)))
    out += ["", f"{STRATEGY_GROUP}.*: UniAPStrategy's arguments (built with hydra.utils.instantiate)"]
    out += _wrap(f"strategy.cluster takes a cluster config's name ({clusters}) or a .yaml path; null: this "
                 "machine, its collectives measured at setup.", "  ")
    for arg in strategy_arguments():
        out += _option(f"{STRATEGY_GROUP}.{arg.name}", arg.annotation, arg.default, arg.help)
    out += ["", "data.*: the data `uniap train` loads"]
    for key in DATA_KEYS:
        value = fit["data"].get(key)
        out += _option(f"data.{key}", _FIT_TYPES.get(f"data.{key}", _value_type(value)), value,
                       _fit_comment(key, under="data"))
    out += ["", "trainer.*: Lightning's Trainer", *_wrap(_TRAINER_NOTE, "  ")]
    for key, value in fit["trainer"].items():
        out += _option(f"trainer.{key}", None, value, _fit_comment(key, under="trainer"))  # Lightning's type
    return out


def _group_header(group: str, chosen: str | None, search_dirs: tuple[Path, ...]) -> list[str]:
    what = {"model": "the model", "cluster": "the cluster", "train": "the training settings"}[group]
    names = ", ".join(available(group, list(search_dirs)))
    return [*_wrap(f"{group}.*: {what}: {group}=NAME or {group}=path/to/file.yaml (default: {chosen}), then "
                   f"{group}.<field>=value for any field below. [x]: {chosen}'s value where it differs from the "
                   "default.", "", indent="  "), *_wrap(f"names: {names}", "  ")]


def _dataclass_fields(group: str, cls: type, extra: dict[str, tuple[str, Any, str]],
                      chosen: dict[str, Any]) -> list[str]:
    """One entry per field ``group=`` accepts (:func:`~uniap_lightning.cli.overrides.group_fields`), in the
    dataclass's order."""
    comments = field_comments(cls)
    accepted = group_fields("plan", group) or ()
    rows: list[tuple[str, str, Any, str]] = []
    for f in dataclasses.fields(cls):
        if f.name in accepted:
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING)
            rows.append((f.name, str(f.type), default, comments.get(f.name, "")))
    rows += [(name, *extra[name]) for name in accepted if name in extra]
    out = []
    for name, kind, default, text in rows:
        given = chosen.get(name, default)
        differs = name in chosen and (default is MISSING or given != default)
        out += _option(f"{group}.{name}", kind, default, text, chosen=_yaml(given) if differs else None)
    return out


# --------------------------------------------------------------------------------------------------- helpers
def _option(key: str, kind: str | None, default: Any, text: str, *, chosen: str | None = None) -> list[str]:
    """``  key: type = default [chosen config's value]``, and what it does below it."""
    typed = f"{key}: {kind}" if kind else key
    head = f"  {typed} = {'(required)' if default is MISSING else _yaml(default)}"
    if chosen is not None:
        head += f" [{chosen}]"
    lines = _wrap(head, "", indent="      ")
    return lines + (_wrap(_plain(text), "      ") if text else [])


def _wrap(text: str, first: str, *, indent: str | None = None) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=first if indent is None else indent,
                         break_on_hyphens=False) or [first]


def _yaml(value: Any) -> str:
    """A value as it is written on the command line: null, true, 60.0, [1, 2], auto."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and value == "":
        return "''"
    return str(value)


def _value_type(value: Any) -> str:
    return "any" if value is None else type(value).__name__


def _plain(text: str) -> str:
    """Docstring markup as plain text: ``x`` -> x, :class:`~a.b.C` -> C, :mod:`a.b` -> a.b, one line."""
    text = re.sub(r":\w+:`~?([^`]*)`", lambda m: m.group(1).rsplit(".", 1)[-1] if m.group(0).count("~") else
                  m.group(1), text)
    return " ".join(text.replace("``", "").split())


def field_comments(cls: type) -> dict[str, str]:
    """A dataclass's field comments, from its source: the ``#:`` lines above a field, else the comment at the end
    of its line (``dtype: str = "bf16"  # token | patch``)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    found: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        field = re.match(r"    (\w+)\s*:", line)
        if not field or line.startswith("     "):
            continue
        above = []
        for before in range(number - 1, 0, -1):
            if not lines[before - 1].strip().startswith("#:"):
                break
            above.insert(0, lines[before - 1].strip()[2:].strip())
        trailing = comments.get(number)
        if above:
            found[field.group(1)] = first_sentence(" ".join(above))
        elif trailing and not line.strip().startswith("#"):
            found[field.group(1)] = trailing.lstrip("#").strip()
    return found


def _groups(config_name: str) -> tuple[str, ...]:
    """The config groups of a command's config (``model``, ``cluster``, ``train``; ``model``, ``strategy``)."""
    return tuple(_default_choices(config_name)) + (("model", "cluster", "train") if config_name == "plan" else ())


def _default_choices(config_name: str) -> dict[str, str]:
    """``{"model": "gpt2_small", ...}``: each group's choice in the config's defaults list."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / f"{config_name}.yaml"))
    return {k: v for d in raw.get("defaults", []) if isinstance(d, dict) for k, v in d.items()
            if not k.startswith("override ")}


def _fit_yaml() -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "fit.yaml"))


def _fit_comment(key: str, *, under: str | None = None) -> str:
    """The end-of-line comment of ``key`` in conf/fit.yaml (under ``under:`` when given)."""
    inside = under is None
    for line in (CONF_DIR / "fit.yaml").read_text(encoding="utf-8").splitlines():
        if under is not None and re.match(r"\w", line):
            inside = line.startswith(f"{under}:")
            continue
        match = re.match(rf"(\s*){re.escape(key)}:[^#]*#\s*(.*)$", line)
        if inside and match and (under is None) == (match.group(1) == ""):
            return match.group(2)
    return ""
