"""Each search option has one default and one check (issue 40): ``UniAPStrategy``'s signature gives the default
that `uniap plan`, `uniap train`'s ``strategy`` group, the shipped ``conf/train`` yaml, ``SetupOptions``,
``TrainingConfig`` and ``solve`` use, and :mod:`uniap_lightning.planner.search_options` gives the check that the
strategy and the command line both run: a bad value gets the same one line from each."""

from __future__ import annotations

import inspect
import math

import pytest
import yaml

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.config import CONF_DIR


def _strategy_defaults() -> dict[str, object]:
    from uniap_lightning.strategy import UniAPStrategy

    return {n: p.default for n, p in inspect.signature(UniAPStrategy.__init__).parameters.items() if n != "self"}


def test_the_defaults_agree_everywhere() -> None:
    from uniap_lightning.cli.overrides import compose_checked
    from uniap_lightning.planner.problem import TrainingConfig
    from uniap_lightning.planner.search_options import strategy_default
    from uniap_lightning.planner.solver import search, solve
    from uniap_lightning.setup import SetupOptions

    ours = _strategy_defaults()
    assert {n: strategy_default(n) for n in ours} == ours
    train, plan = compose_checked("fit", []).strategy, compose_checked("plan", [])
    assert {n: train[n] for n in ours} == ours  # `uniap train`'s strategy group
    assert plan.time_limit == ours["time_limit"] and plan.solver == ours["solver"]  # `uniap plan`'s own options
    assert plan.compression == ours["compression"]
    assert plan.train.schedule == ours["schedule"]  # `uniap plan`'s schedule=null reads train.schedule
    for name in ("default", "fp32_adam"):  # every shipped training config
        shipped = yaml.safe_load((CONF_DIR / "train" / f"{name}.yaml").read_text())
        assert shipped["schedule"] == ours["schedule"], name
    setup = SetupOptions()
    assert (setup.time_limit_s, setup.schedule, setup.solver) == (ours["time_limit"], ours["schedule"], ours["solver"])
    assert TrainingConfig(global_batch_size=8).schedule == ours["schedule"]
    for fn in (solve, search):
        params = inspect.signature(fn).parameters
        assert params["time_limit_s"].default == ours["time_limit"] and params["solver"].default == ours["solver"]



def test_bytes_per_parameter_are_one_table() -> None:
    """``TrainingConfig``'s default, the strategy's rule for fp32 parameters and each shipped ``conf/train`` file
    are entries of ``BYTES_PER_PARAM`` (its numbers are written there only; a yaml file copies one entry)."""
    from uniap_lightning.planner.problem import BYTES_PER_PARAM, TrainingConfig, adam_bytes

    config = TrainingConfig(global_batch_size=8)
    assert (config.weight_bytes, config.grad_bytes, config.optimizer_bytes) == BYTES_PER_PARAM["fp32_adam"]
    assert adam_bytes(4) == BYTES_PER_PARAM["fp32_adam"]  # UniAPStrategy's rule (setup._training) on fp32
    for name, entry in (("default", "bf16_adam"), ("fp32_adam", "fp32_adam")):
        shipped = yaml.safe_load((CONF_DIR / "train" / f"{name}.yaml").read_text())
        assert (shipped["weight_bytes"], shipped["grad_bytes"], shipped["optimizer_bytes"]) == BYTES_PER_PARAM[entry]
        assert f'BYTES_PER_PARAM["{entry}"]' in (CONF_DIR / "train" / f"{name}.yaml").read_text()


BAD_VALUES = [
    ("time_limit", math.inf, "inf"),  # passed the strategy's check (> 0) but not the command's
    ("time_limit", -math.inf, "-inf"),
    ("time_limit", math.nan, "nan"),
    ("time_limit", 0, "0"),
    ("time_limit", -5, "-5"),
    ("time_limit", 1e8, "1e8"),
    ("solver", "glpk", "glpk"),
    ("schedule", "zigzag", "zigzag"),
    ("virtual_stages", 0, "0"),
    ("virtual_stages", 65, "65"),
    ("pp", 0, "0"),
    ("pp", [], "[]"),
    ("pp", [2, 0], "[2,0]"),
    ("compression", "zip", "zip"),  # the strategy took a string, the command a list too, each with its own line
    ("compression", "PowerSGD", "PowerSGD"),
    ("compression", ["bf16", "zip"], "[bf16,zip]"),
    ("compression", ["auto"], "[auto]"),
    ("compression", 1, "1"),
]


def _strategy_error(name: str, value: object) -> str:
    from uniap_lightning.strategy import UniAPStrategy

    with pytest.raises(UniAPError) as err:
        UniAPStrategy(**{name: value})
    return str(err.value)


def _command_error(name: str, given: str) -> str:
    from uniap_lightning.cli.apps import check_search_options
    from uniap_lightning.cli.overrides import compose_checked

    with pytest.raises(UniAPError) as err:
        check_search_options(compose_checked("plan", [f"{name}={given}"]))
    return str(err.value)


@pytest.mark.parametrize(("name", "value", "given"), BAD_VALUES, ids=[f"{n}={g}" for n, _, g in BAD_VALUES])
def test_a_bad_value_gets_the_same_line_from_the_strategy_and_the_command(name: str, value: object,
                                                                          given: str) -> None:
    from uniap_lightning.cli.train import build_strategy
    from uniap_lightning.cli.overrides import compose_checked

    strategy = _strategy_error(name, value)
    assert "\n" not in strategy and strategy.startswith(f"{name}=")
    assert _command_error(name, given) == strategy  # uniap plan / evaluate / explain
    if name != "pp" or given != "[]":
        with pytest.raises(UniAPError) as err:  # uniap train: strategy.<name>=...
            build_strategy(compose_checked("fit", [f"strategy.{name}={given}"]))
        assert str(err.value) == strategy


def test_good_values_pass_both() -> None:
    from uniap_lightning.cli.apps import check_search_options
    from uniap_lightning.cli.overrides import compose_checked
    from uniap_lightning.strategy import UniAPStrategy

    options = UniAPStrategy(time_limit=1e7, schedule="interleaved_1f1b", virtual_stages=2, pp=[4, 2]).setup_options
    assert (options.time_limit_s, options.virtual_stages, options.pp) == (1e7, 2, (2, 4))
    check_search_options(compose_checked("plan", ["time_limit=1e7", "schedule=interleaved_1f1b", "virtual_stages=2",
                                                  "pp=[4,2]"]))


@pytest.mark.parametrize(("value", "given", "methods"), [
    (None, "null", ("none",)), ("none", "none", ("none",)), ("topk", "topk", ("none", "topk")),
    ("auto", "auto", ("none", "bf16", "powersgd", "topk")), (["topk", "bf16"], "[topk,bf16]", ("none", "bf16", "topk")),
    ([], "[]", ("none",)),
])
def test_compression_values_mean_the_same_everywhere(value: object, given: str, methods: tuple[str, ...]) -> None:
    """``compression``: the strategy, `uniap plan` / `uniap train` and the problem take the same values (a list
    too) through one check and allow the same methods."""
    from uniap_lightning.cli.apps import check_search_options
    from uniap_lightning.cli.overrides import compose_checked
    from uniap_lightning.cli.train import build_strategy
    from uniap_lightning.profiling.pricing import build_problem
    from uniap_lightning.strategy import UniAPStrategy

    assert UniAPStrategy(compression=value).setup_options.compression == methods
    trained = build_strategy(compose_checked("fit", [f"strategy.compression={given}"]))  # uniap train
    assert trained.setup_options.compression == methods
    check_search_options(compose_checked("plan", [f"compression={given}"]))
    assert build_problem(model="gpt2_small", cluster="a100_1x8", global_batch_size=16,
                         compression=value).compression == methods
