"""Structured configs: the schemas of ``uniap train``'s ``strategy`` group and of the planning commands' options,
registered in Hydra's ConfigStore.

``UniAPStrategy.__init__``'s signature is the one place for each strategy option's type and default: the schema is
derived from it (:func:`strategy_schema`), and its checks are the strategy's own (``uniap train`` builds the
strategy once before any rank starts). ``conf/fit.yaml`` chooses it (``defaults: - strategy: uniap``) and copies
no value, so the CLI, its sweeps and ``UniAPStrategy(...)`` share every default; a value of the wrong type
(``strategy.time_limit=soon``) is refused when the config is composed, in one line
(:mod:`uniap_lightning.cli.overrides`).

The signature is read from the source of :mod:`uniap_lightning.strategy` (its syntax tree), not by importing it:
composing a config must not import torch and Lightning (``uniap plan`` does not need them). Types OmegaConf can
check (``bool``, ``int``, ``float``, ``str``, lists of them, each optionally ``None``) are checked; the others
(``cluster``: a name, a path or a mapping; ``monitor``: a flag or a monitor) are ``Any``, left to the strategy.
"""

from __future__ import annotations

import ast
import dataclasses
from functools import lru_cache
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import MISSING

#: ``strategy.*``'s group option in the ConfigStore (``conf/fit.yaml``: ``defaults: - strategy: uniap``)
STRATEGY_GROUP, STRATEGY_NAME = "strategy", "uniap"
STRATEGY_TARGET = "uniap_lightning.strategy.UniAPStrategy"
_STRATEGY_SOURCE = Path(__file__).resolve().parents[1] / "strategy.py"
_PRIMITIVES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}


@dataclasses.dataclass(frozen=True)
class Argument:
    """One keyword argument of ``UniAPStrategy.__init__``: its name, annotation (as written) and default."""

    name: str
    annotation: str
    default: Any

    def schema_type(self) -> Any:
        """The type OmegaConf checks the value against (``Any``: the strategy checks it)."""
        parts = [p.strip() for p in self.annotation.split("|")]
        optional = "None" in parts
        kinds = sorted({"str" if p == "Path" else p for p in parts if p != "None"})  # a path is given as a string
        if len(kinds) != 1:
            return Any
        kind = kinds[0]
        if kind in _PRIMITIVES:
            found: Any = _PRIMITIVES[kind]
        elif kind.startswith("list[") and kind.endswith("]") and kind[5:-1] in _PRIMITIVES:
            found = List[_PRIMITIVES[kind[5:-1]]]  # noqa: UP006 - OmegaConf reads typing's generics
        else:
            return Any
        return Optional[found] if optional else found  # noqa: UP007


@lru_cache(maxsize=1)
def strategy_arguments() -> tuple[Argument, ...]:
    """``UniAPStrategy.__init__``'s keyword arguments, read from its source (one without a default is ``MISSING``:
    a value the config must give)."""
    tree = ast.parse(_STRATEGY_SOURCE.read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "UniAPStrategy")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args
    if args.args[1:] or args.vararg or args.kwarg:
        raise AssertionError("UniAPStrategy.__init__ takes keyword-only arguments: the schema reads only those")
    return tuple(Argument(a.arg, ast.unparse(a.annotation) if a.annotation else "Any",
                          ast.literal_eval(d) if d is not None else MISSING)
                 for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True))


@lru_cache(maxsize=1)
def strategy_schema() -> type:
    """The ``strategy`` group's dataclass: ``_target_`` and one field per argument, with its type and default."""
    fields: list[tuple[str, Any, Any]] = [("_target_", str, dataclasses.field(default=STRATEGY_TARGET))]
    for arg in strategy_arguments():
        default = arg.default
        field = dataclasses.field(default_factory=lambda v=default: list(v)) if isinstance(default, list) else \
            dataclasses.field(default=default)
        fields.append((arg.name, arg.schema_type(), field))
    return dataclasses.make_dataclass("UniAPStrategyConfig", fields)


#: ``uniap plan`` / ``evaluate`` / ``explain``'s options (conf/plan.yaml: ``defaults: - uniap_plan_options``)
PLAN_OPTIONS_NAME = "uniap_plan_options"


@lru_cache(maxsize=1)
def plan_schema() -> type:
    """The planning commands' options: their types and defaults, the search's (``solver``, ``time_limit``) those
    of ``UniAPStrategy`` (what the strategy solves with at setup is what ``uniap plan`` shows). The values are
    checked by the commands (``uniap_lightning.cli.apps``); ``Any``: a number or a list."""
    strategy = {a.name: a.default for a in strategy_arguments()}
    return dataclasses.make_dataclass("UniAPPlanOptions", [
        ("batch_size", Optional[int], dataclasses.field(default=None)),  # noqa: UP007 - OmegaConf reads typing
        ("schedule", Optional[str], dataclasses.field(default=None)),  # noqa: UP007
        ("virtual_stages", Optional[int], dataclasses.field(default=None)),  # noqa: UP007
        ("microbatches", Any, dataclasses.field(default=None)),
        ("profile", Optional[str], dataclasses.field(default=None)),  # noqa: UP007
        ("solver", str, dataclasses.field(default=strategy["solver"])),
        ("time_limit", float, dataclasses.field(default=strategy["time_limit"])),
        ("pp", Any, dataclasses.field(default=None)),
        ("baselines", bool, dataclasses.field(default=True)),
        # true: "no plan fits" (evaluate: the plan does not fit memory) exits 0, in a sweep's row and alone
        ("allow_no_plan", bool, dataclasses.field(default=False)),
        ("compression", Any, dataclasses.field(default=strategy["compression"])),
        # None: off (UniAPStrategy's "off"); given with plan= (evaluate, explain) it is refused
        ("fp8", Optional[str], dataclasses.field(default=None)),  # noqa: UP007
        *[(key, Optional[str], dataclasses.field(default=None))  # noqa: UP007
          for key in ("out", "viz", "plan", "measured")],
        # the groups (conf/model, conf/cluster, conf/train, or the user's own), checked by the planner
        *[(group, Any, dataclasses.field(default=None)) for group in ("model", "cluster", "train")],
    ])


def declared(full_key: str) -> str | None:
    """``"UniAPStrategy's time_limit is float (default 60.0)"`` for a key of a schema here, else None."""
    parts = full_key.split("[")[0].split(".")
    if len(parts) == 2 and parts[0] == STRATEGY_GROUP:
        for arg in strategy_arguments():
            if arg.name == parts[1]:
                return f"UniAPStrategy's {arg.name} is {arg.annotation} (default {arg.default!r})"
    if len(parts) == 1:
        for field in dataclasses.fields(plan_schema()):
            if field.name == parts[0]:
                return f"`uniap plan`'s {field.name} is {_type_name(field.type)} (default {field.default!r})"
    return None


def _type_name(kind: Any) -> str:
    """``int``, ``int | None``, ``list[int] | None``, ``any``: a schema type as the signature would write it."""
    import typing

    if kind is Any:
        return "any"
    if isinstance(kind, type):
        return "None" if kind is type(None) else kind.__name__
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Union:
        return " | ".join(_type_name(a) for a in args)
    return f"{getattr(typing.get_origin(kind), '__name__', str(kind))}[{', '.join(_type_name(a) for a in args)}]"


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (again: replaces the same entries). A key a schema does not list is
    refused in one line naming the keys there are (:func:`uniap_lightning.cli.overrides.check_settings`; no ``+``
    form is suggested for a key nothing would read), and ``+strategy.x=...`` adds one only next to a
    ``strategy._target_`` subclass with arguments of its own. The groups' fields (``model.*``, ``cluster.*``,
    ``train.*``, ``data.*``) are closed too: ``+model.layer=4`` is refused with the field it is close to ("did you
    mean model.layers?", :func:`uniap_lightning.cli.overrides.group_fields`), never added."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    for group, name, schema in ((STRATEGY_GROUP, STRATEGY_NAME, strategy_schema()), (None, PLAN_OPTIONS_NAME,
                                                                                     plan_schema())):
        store.store(group=group, name=name, node=OmegaConf.structured(schema), provider=__name__)
