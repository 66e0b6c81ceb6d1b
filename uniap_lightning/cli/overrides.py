"""The command line checked before Hydra runs an app: Hydra reports a bad override (grammar, a key the config does
not have, an interpolation to nowhere) as a multi-line message and exit status 1; here it is one line naming the
override and what would be accepted, raised as :class:`~uniap_lightning.errors.UniAPError` (exit status 2)."""

from __future__ import annotations

import re
from typing import Any

from uniap_lightning.errors import UniAPError

#: the config each command composes (``conf/<name>.yaml``)
CONFIG_NAME = {"plan": "plan", "evaluate": "plan", "explain": "plan", "train": "fit"}
GRAMMAR_URL = "https://hydra.cc/docs/1.2/advanced/override_grammar/basic"


def check_command_line(command: str, args: list[str]) -> list[str]:
    """Refuse a command line Hydra would refuse, and return it as Hydra is to read it: each ``model=`` /
    ``cluster=`` / ``train=`` choice is read and checked first (a name, shipped or in the user's ``--config-dir`` /
    ``hydra.searchpath`` folders, or a path to a YAML file: see :mod:`uniap_lightning.cli.own_configs`), and a
    path is replaced by the name its file is registered under."""
    from uniap_lightning.cli import own_configs

    flags = _parse_flags(command, args)
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


def _parse_flags(command: str, args: list[str]) -> Any:
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

    from uniap_lightning.planner.config import CONF_DIR

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
        OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise UniAPError(_composition_message(err, overrides)) from None
    return cfg


def _composition_message(err: Exception, overrides: list[str]) -> str:
    typed = _wrong_type(err)
    if typed:
        return typed
    text = str(err)
    added = re.search(r"To append to your config use (\+\S+)", text)
    if added:
        key = added.group(1)[1:].split("=", 1)[0]
        return (f"{_shown(added.group(1)[1:])}: the config has no key '{key}'; use {_shown(added.group(1))} to add "
                f"a key (Trainer and strategy arguments that are not listed need the +)")
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


def _wrong_type(err: Exception) -> str | None:
    """A value of the wrong type for a structured config's field (``strategy.time_limit=soon``): the key, OmegaConf's
    reason and the field's declared type and default (:func:`uniap_lightning.planner.config_schema.declared`)."""
    from omegaconf.errors import ValidationError

    cause = err if isinstance(err, ValidationError) else err.__cause__
    if not isinstance(cause, ValidationError) or not cause.full_key:
        return None
    from uniap_lightning.planner.config_schema import declared

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
