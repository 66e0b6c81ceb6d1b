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
import re
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import MISSING, OmegaConf

from uniap_lightning.planner.dimensions import OPT_INS
from uniap_lightning.planner.plan import SCHEDULES

#: ``strategy.*``'s group option in the ConfigStore (``conf/fit.yaml``: ``defaults: - strategy: uniap``)
STRATEGY_GROUP, STRATEGY_NAME = "strategy", "uniap"
STRATEGY_TARGET = "uniap_lightning.strategy.UniAPStrategy"
_STRATEGY_SOURCE = Path(__file__).resolve().parents[1] / "strategy.py"
_PRIMITIVES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}


@dataclasses.dataclass(frozen=True)
class Argument:
    """One keyword argument of ``UniAPStrategy.__init__``: its name, annotation (as written), default, and what the
    class docstring's ``Arguments:`` says of it (``uniap train --help`` prints it)."""

    name: str
    annotation: str
    default: Any
    help: str = ""

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
    entries = _argument_entries(ast.get_docstring(cls) or "")
    return tuple(Argument(a.arg, ast.unparse(a.annotation) if a.annotation else "Any",
                          ast.literal_eval(d) if d is not None else MISSING, _argument_help(a.arg, entries))
                 for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True))


def _argument_entries(docstring: str) -> dict[str, str]:
    """``{"cluster": "the cluster the planner should assume: ...", ...}``: the ``Arguments:`` section's entries
    (``name: text`` at one indent, continued deeper), each joined into one line."""
    entries: dict[str, str] = {}
    lines = docstring.split("Arguments:", 1)[-1].splitlines() if "Arguments:" in docstring else []
    name = None
    for line in lines:
        entry = re.match(r"    (\w+): (.*)$", line)
        if entry:
            name = entry.group(1)
            entries[name] = entry.group(2).strip()
        elif name is not None and line.startswith("        "):
            entries[name] += " " + line.strip()
        elif line.strip():
            break
    return entries


def _argument_help(name: str, entries: dict[str, str]) -> str:
    """The first sentence of an argument's own entry; for one described inside another's entry, the sentence that
    starts with it there (``virtual_stages``: ...), else a pointer to that entry."""
    if name in entries:
        return first_sentence(entries[name])
    for other, text in entries.items():
        if f"``{name}``:" in text:
            return first_sentence(text[text.index(f"``{name}``:") + len(name) + 5:].strip()) + f" (see {STRATEGY_GROUP}.{other})"
    return next((f"see {STRATEGY_GROUP}.{other}" for other, text in entries.items() if f"``{name}``" in text), "")


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (one followed by a capital or a literal)."""
    return re.split(r"(?<=\.)\s+(?=[A-Z`])", text, maxsplit=1)[0]


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
    """The planning commands' options: their types, defaults and what each does (``uniap plan --help`` prints
    them: :mod:`uniap_lightning.cli.help_text`), the search's (``solver``, ``time_limit``, ``compression``) those of
    ``UniAPStrategy`` (what the strategy solves with at setup is what ``uniap plan`` shows). The values are checked
    by the commands (``uniap_lightning.cli.apps``); ``Any``: a number or a list."""
    strategy = {a.name: a.default for a in strategy_arguments()}
    return dataclasses.make_dataclass("UniAPPlanOptions", [
        _option("batch_size", Optional[int], None,  # noqa: UP007 - OmegaConf reads typing's generics
                "the global batch (samples per optimizer step); null: train.global_batch_size"),
        _option("schedule", Optional[str], None,  # noqa: UP007
                f"the pipeline schedule: auto (the search chooses) | {' | '.join(SCHEDULES)}; null: train.schedule"),
        _option("virtual_stages", Optional[int], None,  # noqa: UP007
                "pipeline stages per device (interleaved schedules: >= 2); null: searched, 1 to "
                "train.max_virtual_stages"),
        _option("microbatches", Any, None, "micro-batch counts to consider (a number or a list); null: "
                "train.microbatches"),
        _option("profile", Optional[str], None,  # noqa: UP007
                "a profile file (JSON, measured by the strategy) to plan with instead of the analytic model"),
        _option("solver", str, strategy["solver"], "the MILP backend: auto (HiGHS if installed, else CBC) | cbc | "
                "highs | gurobi"),
        _option("time_limit", float, strategy["time_limit"], "seconds for the whole search; past it the plan "
                "reports its MIP gap"),
        _option("pp", Any, None, "restrict the pipeline degree (a number or a list); null: every degree"),
        _option("baselines", bool, True, "also score DDP, ZeRO, FSDP and Megatron grids (and print the plan's "
                "speed-up over each)"),
        _option("allow_no_plan", bool, False, "true: \"no plan fits\" (evaluate: the plan does not fit memory) "
                "is an answer, exit status 0, alone and as a sweep's row"),
        _option("compression", Any, strategy["compression"], "gradient compression the planner may choose per "
                "layer: null (off) | bf16 | powersgd | topk | auto (all) | a list; it changes numerics, so it is "
                "opt-in"),
        # each opt-in dimension's option, as it declares it (None: off); given with plan= (evaluate, explain) it is
        # refused
        *[_option(o.option, Optional[o.type], None, o.help) for o in OPT_INS.values()],  # noqa: UP007
        _option("out", Optional[str], None, "write the plan as JSON to this file"),  # noqa: UP007
        _option("viz", Optional[str], None, "write a picture of the plan (PNG) to this file"),  # noqa: UP007
        _option("plan", Optional[str], None,  # noqa: UP007
                "evaluate, explain: the plan file (JSON) to score as it is, instead of solving"),
        _option("measured", Optional[str], None,  # noqa: UP007
                "explain: the metrics JSON the strategy's monitor wrote (stage_time_s, ...), shown against the "
                "predictions"),
        # the groups (conf/model, conf/cluster, conf/train, or the user's own), checked by the planner
        *[_option(group, Any, None, f"the {group} config: a name, a .yaml path, or {group}.<field>=value")
          for group in ("model", "cluster", "train")],
    ])


def _option(name: str, kind: Any, default: Any, help_: str) -> tuple[str, Any, Any]:
    """One field of :func:`plan_schema`: its name, type, default and the line ``--help`` prints for it."""
    return name, kind, dataclasses.field(default=default, metadata={"help": help_})


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
                return f"`uniap plan`'s {field.name} is {type_name(field.type)} (default {field.default!r})"
    return None


def type_name(kind: Any) -> str:
    """``int``, ``int | None``, ``list[int] | None``, ``any``: a schema type as the signature would write it."""
    if kind is Any:
        return "any"
    if isinstance(kind, type):
        return "None" if kind is type(None) else kind.__name__
    args = typing.get_args(kind)
    if typing.get_origin(kind) is typing.Union:
        return " | ".join(type_name(a) for a in args)
    return f"{getattr(typing.get_origin(kind), '__name__', str(kind))}[{', '.join(type_name(a) for a in args)}]"


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (again: replaces the same entries). A key a schema does not list is
    refused in one line naming the keys there are (:func:`uniap_lightning.cli.overrides.check_settings`; no ``+``
    form is suggested for a key nothing would read), and ``+strategy.x=...`` adds one only next to a
    ``strategy._target_`` subclass with arguments of its own. The groups' fields (``model.*``, ``cluster.*``,
    ``train.*``, ``data.*``) are closed too: ``+model.layer=4`` is refused with the field it is close to ("did you
    mean model.layers?", :func:`uniap_lightning.cli.overrides.group_fields`), never added."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, name, schema in ((STRATEGY_GROUP, STRATEGY_NAME, strategy_schema()), (None, PLAN_OPTIONS_NAME,
                                                                                     plan_schema())):
        store.store(group=group, name=name, node=OmegaConf.structured(schema), provider=__name__)
