"""The command line checked before Hydra runs an app: Hydra reports a bad override (grammar, a key the config does
not have, an interpolation to nowhere) as a multi-line message and exit status 1; here it is one line naming the
override and what would be accepted, raised as :class:`~uniap_lightning.errors.UniAPError` (exit status 2)."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from typing import Any

from uniap_lightning.cli import own_configs
from uniap_lightning.cli.train_checks import DATA_KEYS, OWN_TRAINER_ARGUMENTS
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.analytic import ModelSpec
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.config import CONF_DIR, TrainingConfig
from uniap_lightning.planner.config_schema import STRATEGY_TARGET, declared, plan_schema, strategy_arguments
from uniap_lightning.planner.decision import CP_METHODS, DP_MODES

#: the config each command composes (``conf/<name>.yaml``)
CONFIG_NAME = {"plan": "plan", "evaluate": "plan", "explain": "plan", "train": "fit"}
GRAMMAR_URL = "https://hydra.cc/docs/1.2/advanced/override_grammar/basic"


def check_command_line(command: str, args: list[str]) -> list[str]:
    """Refuse a command line Hydra would refuse, and return it as Hydra is to read it: each ``model=`` /
    ``cluster=`` / ``train=`` choice is read and checked first (a name, shipped or in the user's ``--config-dir`` /
    ``hydra.searchpath`` folders, or a path to a YAML file: see :mod:`uniap_lightning.cli.own_configs`), and a
    path is replaced by the name its file is registered under."""
    flags = parse_flags(command, args)
    overrides = list(flags.overrides or [])
    _parse_overrides(overrides)
    search = own_configs.search_dirs(flags.config_dir, overrides)
    own_configs.check_groups(overrides, search)
    registered = own_configs.register_paths(overrides)
    if _composes_one_config(flags):
        for variant in _sweep_variants(registered) if flags.multirun else [registered]:
            compose_checked(CONFIG_NAME[command], search.override(variant))
    renamed = dict(zip(overrides, registered))
    return [renamed.get(arg, arg) for arg in args]


def parse_flags(command: str, args: list[str]) -> Any:
    """Hydra's own argument parser, with its errors as one line instead of a usage text."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.prog = f"uniap {command}"

    def refuse(message: str) -> None:
        raise UniAPError(f"{message}; options are key=value overrides (see `uniap {command} --help`)")

    parser.error = refuse  # type: ignore[method-assign]
    return parser.parse_args(args)


def _parse_overrides(overrides: list[str]) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except OverrideParseException as err:
            raise UniAPError(_grammar_message(override, err)) from None
        except ValueError as err:  # Python refuses to read an integer of more than 4,300 digits
            raise UniAPError(f"{_shown(override)}: the value cannot be read ({str(err).split(';')[0]}); no setting "
                             "takes a number that long") from None


def _grammar_message(override: str, err: Exception) -> str:
    odd = next(((i, ch) for i, ch in enumerate(override) if not (ch.isascii() and ch.isprintable())), None)
    if odd is not None:
        i, ch = odd
        return (f"{_shown(override)}: the character {ch!r} at position {i} is not in Hydra's override grammar: keys "
                f"are ASCII, and a value with other characters must be quoted, e.g. model.name='{ch}'")
    return (f"{_shown(override)} is not a valid override ({_why(err)}): write key=value, e.g. model.layers=4, and "
            f"quote values with spaces or symbols ({GRAMMAR_URL})")


#: the most configs a sweep's command line is composed as before it runs
MAX_SWEEP_CHECKS = 64


def _sweep_variants(overrides: list[str]) -> list[list[str]]:
    """The command lines that together give every value of a sweep once (``a=1,2 b=x,y``: ``a=1 b=x``, ``a=2 b=x``,
    ``a=1 b=y``), so a bad value or key is refused before the first job rather than as Hydra's multi-line error
    in its own job. ``glob(...)`` sweeps are Hydra's to expand: such a sweep is not checked here."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    choices = []
    for text, override in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        if not override.is_sweep_override():
            choices.append([text])
        elif isinstance(override.value(), Glob):
            return []
        else:
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()] or [text])
    first = [c[0] for c in choices]
    variants = [first] + [first[:i] + [value] + first[i + 1:] for i, c in enumerate(choices) for value in c[1:]]
    return variants[:MAX_SWEEP_CHECKS]


def _composes_one_config(flags: Any) -> bool:
    """Not --help / --cfg / --info, not another primary config (``--config-dir`` only adds folders to the search
    path: composed here too). A sweep (``-m``) is composed once per value (:func:`_sweep_variants`)."""
    return not (flags.help or flags.hydra_help or flags.cfg or flags.info or flags.shell_completion
                or flags.config_name or flags.config_path or flags.experimental_rerun)


def compose_checked(config_name: str, overrides: list[str]) -> Any:
    """The config Hydra will compose, with its interpolations resolved (``hydra.*`` aside: it is Hydra's own)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
        OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise UniAPError(_composition_message(err, overrides, config_name)) from None
    check_settings(config_name, cfg, overrides)
    return cfg


#: what each config is for, in messages
_COMMAND = {"plan": "`uniap plan` (and evaluate, explain)", "fit": "`uniap train`"}
#: what the planner decides per layer itself: no command-line option sets it (``+cp=2`` would be ignored)
PLANNER_CHOOSES = {"dp": "data-parallel degree", "tp": "tensor-parallel degree", "cp": "context-parallel degree",
                   "cp_method": "context-parallel method", "sp": "sequence parallelism",
                   "ep": "expert-parallel degree", "dp_mode": "replica mode (ZeRO stage)",
                   "recompute": "activation recomputation"}


def known_settings(config_name: str) -> tuple[str, ...]:
    """The top-level keys a config has (``plan``: the planning options' schema; ``fit``: ``conf/fit.yaml``'s keys
    and groups): a ``+key`` beyond them would be read by nothing."""
    if config_name == "plan":
        return tuple(f.name for f in dataclasses.fields(plan_schema()))
    return _fit_settings()


def _fit_settings() -> tuple[str, ...]:
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "fit.yaml"))
    groups = [next(iter(d)) for d in raw.get("defaults", []) if isinstance(d, dict)
              and not next(iter(d)).startswith("override ")]
    return tuple(groups + [k for k in raw if k not in ("defaults", "hydra")])


def check_settings(config_name: str, cfg: Any, overrides: list[str]) -> None:
    """Refuse a key added with ``+`` (or ``++``) that nothing reads: a top-level key the config does not have
    (``uniap plan +cp=-1``), or a ``strategy.*`` key that ``UniAPStrategy`` has no argument for (a
    ``strategy._target_`` subclass may take keys of its own). Keys under the groups (``+trainer.*``, ``+model.*``,
    ``+data.*``, ...) are checked by the commands against what Lightning and the model specs accept."""
    if config_name not in _COMMAND:
        return
    known = known_settings(config_name)
    for key in cfg:
        if key not in known:
            raise UniAPError(unknown_setting(config_name, str(key), overrides))
    # `+model.layer=4`: a key added under a group whose fields are known (group_fields) must be one of them (a
    # near-miss is answered with the field it is close to); `+trainer.*` is Lightning's to refuse, with the
    # argument it is close to (train_checks.check_trainer_arguments), and `+strategy.*` is checked below
    for override in overrides:
        if override.startswith("+"):
            group, _, rest = override.lstrip("+").partition("=")[0].partition(".")
            if rest and "." not in rest and group not in ("strategy", "trainer"):
                fields = group_fields(config_name, group)
                if fields is not None and rest not in fields:
                    raise UniAPError(_unknown_field(config_name, group, rest, fields, overrides))
    strategy = cfg.get("strategy") if config_name == "fit" else None
    if strategy is not None and hasattr(strategy, "keys"):
        if strategy.get("_target_") == STRATEGY_TARGET:
            for key in strategy:
                if key != "_target_" and key not in _strategy_arguments():
                    raise UniAPError(_unknown_argument(str(key), overrides))


#: "<who> has no <what> 'x'" for a key a group does not have, in messages
_GROUP = {"model": ("the model config", "field"), "cluster": ("the cluster config", "field"),
          "train": ("the training config", "field"), "data": ("`uniap train`", "data setting"),
          "trainer": ("Lightning's Trainer", "argument")}


def group_fields(config_name: str, group: str) -> tuple[str, ...] | None:
    """The keys a group of a command's config may hold, each read by something (``model``: ``ModelSpec``'s fields;
    ``cluster`` / ``train``: the cluster's and training config's; ``data``: `uniap train`'s data settings;
    ``trainer``: Lightning's ``Trainer`` arguments, which imports Lightning), or None for a group not known here
    (``strategy`` has its own check). A key beyond them is refused by the command that reads the group, so a
    near-miss (``model.layer=4``) is answered with the key it is close to, never with a ``+`` form to add it."""
    if group == "model" and config_name in _COMMAND:
        return tuple(sorted(ModelSpec.__dataclass_fields__))
    if group == "cluster" and config_name == "plan":
        return tuple(sorted({*Cluster.__dataclass_fields__, "device_groups"}))
    if group == "train" and config_name == "plan":
        return tuple(sorted(TrainingConfig.__dataclass_fields__))
    if group == "data" and config_name == "fit":
        return DATA_KEYS
    if group == "trainer" and config_name == "fit":
        return _trainer_arguments()
    return None


def _trainer_arguments() -> tuple[str, ...] | None:
    try:
        import lightning.pytorch as pl
    except ImportError:  # checked again when the command runs
        return None
    return tuple(sorted(set(inspect.signature(pl.Trainer.__init__).parameters) - {"self", *OWN_TRAINER_ARGUMENTS}))


def _unknown_field(config_name: str, group: str, key: str, fields: tuple[str, ...], overrides: list[str]) -> str:
    """One line for ``group.key`` that the group's schema does not have: the nearest field (``did you mean
    model.layers?``) or the fields there are; no ``+`` form (the command would refuse the added key)."""
    given = _given(f"{group}.{key}", overrides)
    who, what = _GROUP.get(group, (group, "key"))
    message = f"{given}: {who} has no {what} {key!r}"
    close = difflib.get_close_matches(key, fields, n=1)
    if close:
        return f"{message} (did you mean {group}.{close[0]}?)"
    if group == "trainer":  # Lightning's arguments are many: the near ones only
        return f"{message}; see lightning.pytorch.Trainer's arguments"
    return f"{message}; its {what}s: {', '.join(fields)}"


def _strategy_arguments() -> tuple[str, ...]:
    return tuple(a.name for a in strategy_arguments())


def _given(key: str, overrides: list[str]) -> str:
    """The override that set ``key`` (``+cp=-1``), shown without its ``+``; the key alone if none did."""
    for override in overrides:
        name, _, _ = override.lstrip("+~").partition("=")
        if name == key:
            return _shown(override.lstrip("+~"))
    return key


def unknown_setting(config_name: str, key: str, overrides: list[str]) -> str:
    """One line for a top-level key a command does not have: no ``+`` form is suggested (nothing would read it);
    a close name, or what the planner decides itself (with the values it chooses among), and the keys there are."""
    known = known_settings(config_name)
    given = _given(key, overrides)
    command = _COMMAND.get(config_name, "this command")
    message = f"{given}: {command} has no setting {key!r}"
    if key in PLANNER_CHOOSES:
        message += f": {_chooses(key, given)}; " + (
            "restrict the search with pp=, schedule=, virtual_stages=, microbatches= or compression="
            if config_name == "plan" else "restrict its search with strategy.pp=, strategy.schedule=, "
            "strategy.virtual_stages= or strategy.compression=, or pin a plan with strategy.plan=")
    else:
        close = difflib.get_close_matches(key, known, n=1)
        if close:
            message += f" (did you mean {close[0]}?)"
        if config_name == "fit":
            message += "; UniAPStrategy's arguments are strategy.*, Trainer arguments trainer.*"
    return f"{message}; its settings: {', '.join(known)}"


def _chooses(key: str, given: str) -> str:
    """"the planner chooses each layer's context-parallel method among 'ulysses', 'ring' itself ('x' is none of
    them)": what the planner decides for a key of :data:`PLANNER_CHOOSES`, with the values it chooses among."""
    choices = {"cp_method": [m for m in CP_METHODS if m != "none"], "dp_mode": list(DP_MODES)}.get(key)
    value = given.partition("=")[2]
    among = f" among {', '.join(repr(c) for c in choices)}" if choices else ""
    bad = f" ({value!r} is none of them)" if choices and value and value not in choices else ""
    return f"the planner chooses each layer's {PLANNER_CHOOSES[key]}{among} itself{bad}"


def _unknown_argument(key: str, overrides: list[str]) -> str:
    """``strategy.X`` that ``UniAPStrategy`` has no argument for."""
    arguments = _strategy_arguments()
    close = difflib.get_close_matches(key, arguments, n=1)
    hint = f" (did you mean strategy.{close[0]}?)" if close else ""
    given = _given(f"strategy.{key}", overrides)
    chooses = f"; {_chooses(key, given)}" if key in PLANNER_CHOOSES else ""
    return f"{given}: UniAPStrategy has no argument {key!r}{hint}{chooses}; its arguments: {', '.join(arguments)}"


def _composition_message(err: Exception, overrides: list[str], config_name: str = "") -> str:
    typed = _wrong_type(err)
    if typed:
        return typed
    text = str(err)
    added = re.search(r"To append to your config use (\+\S+)", text)
    if added:
        key = added.group(1)[1:].split("=", 1)[0]
        # a `+` form is suggested only where something reads the added key: a top-level key nothing reads, and a
        # UniAPStrategy argument there is not, are refused with what there is instead
        if "." not in key and config_name in _COMMAND:
            return unknown_setting(config_name, key, overrides)
        group, _, rest = key.partition(".")
        if group == "strategy" and "." not in rest and config_name == "fit" and _plain_strategy(overrides):
            return _unknown_argument(rest, overrides)
        fields = group_fields(config_name, group) if "." not in rest else None
        if fields is not None and rest not in fields:  # a near-miss or a key nothing reads: no `+` form
            return _unknown_field(config_name, group, rest, fields, overrides)
        return (f"{_shown(added.group(1)[1:])}: the config has no key '{key}'; use {_shown(added.group(1))} to add "
                f"a key (Trainer arguments and model fields that are not listed need the +)")
    no_group = re.search(r"Could not override '([^']*)'\. No match in the defaults list", text)
    if no_group:
        group = no_group.group(1)
        given = next((o for o in overrides if o.lstrip("+~").partition("=")[0] == group), group)
        instead = {"cluster": "; `uniap train` plans for the cluster given as strategy.cluster=NAME (or a .yaml path), "
                              "or for the machine it runs on",
                   "train": "; `uniap train`'s training settings are trainer.*, data.*, lr and seed"}.get(group, "")
        return f"{_shown(given)}: this command has no {group} group{instead}"
    missing_key = re.search(r"Interpolation key '([^']*)' not found\s+full_key: (\S+)", text)
    if missing_key:
        return (f"{missing_key.group(2)}: the interpolation ${{{missing_key.group(1)}}} names no key of the config; "
                f"give a value or an existing key")
    return f"the command line does not compose a config: {_why(err)}"


def _plain_strategy(overrides: list[str]) -> bool:
    """No ``strategy._target_=`` override: the strategy is ``UniAPStrategy`` itself, whose arguments are all
    listed (a subclass may take keys of its own, added with ``+strategy.X=``)."""
    return not any(o.lstrip("+~").partition("=")[0] == "strategy._target_" for o in overrides)


def _wrong_type(err: Exception) -> str | None:
    """A value of the wrong type for a structured config's field (``strategy.time_limit=soon``): the key, OmegaConf's
    reason and the field's declared type and default (:func:`uniap_lightning.planner.config_schema.declared`)."""
    from omegaconf.errors import ValidationError

    cause = err if isinstance(err, ValidationError) else err.__cause__
    if not isinstance(cause, ValidationError) or not cause.full_key:
        return None
    key = str(cause.full_key)
    reason = (str(cause.msg).splitlines() or ["not of the field's type"])[0]
    hint = declared(key)
    return f"{key}: {reason}" + (f"; {hint}" if hint else "")


def _why(err: Exception) -> str:
    """Hydra's message in one line: its first informative lines, without the pointers to the docs."""
    lines = [line.strip() for line in str(err).splitlines()]
    noise = ("See ", "full_key:", "object_type=", "Config search", "provider=")
    keep = [line for line in lines if line and not line.startswith(noise)]
    return "; ".join(keep[1:3] if len(keep) > 1 and keep[0].startswith("Error parsing override") else keep[:3])[:300]


def _shown(override: str) -> str:
    """An override for a message: printable and short."""
    text = override if override.isprintable() else repr(override)
    return text if len(text) <= 80 else text[:77] + "..."
