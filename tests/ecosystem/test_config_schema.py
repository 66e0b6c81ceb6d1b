"""The ``strategy`` group is a structured config derived from ``UniAPStrategy.__init__``: one type and one default
per option for `uniap train`, its sweeps and the strategy itself (issue 21 item 1)."""

from __future__ import annotations

import inspect

import pytest

from uniap_lightning.errors import UniAPError


def _fit(*overrides: str):
    from uniap_lightning.cli.overrides import compose_checked

    return compose_checked("fit", list(overrides))


def test_the_schema_is_the_strategys_signature() -> None:
    from uniap_lightning.planner.config_schema import strategy_arguments
    from uniap_lightning.strategy import UniAPStrategy

    params = {n: p for n, p in inspect.signature(UniAPStrategy.__init__).parameters.items() if n != "self"}
    args = {a.name: a for a in strategy_arguments()}
    assert list(args) == list(params)
    for name, p in params.items():
        assert args[name].default == p.default, name
        assert args[name].annotation == p.annotation, name  # the annotation as written (postponed evaluation)


def test_uniap_train_defaults_are_the_strategys_defaults() -> None:
    from uniap_lightning.strategy import UniAPStrategy

    strategy = _fit().strategy
    for name, p in inspect.signature(UniAPStrategy.__init__).parameters.items():
        if name != "self":
            assert strategy[name] == p.default, name
    assert strategy.time_limit == 60.0  # was 30 in conf/fit.yaml against 60 in UniAPStrategy


@pytest.mark.parametrize(("override", "message"), [
    ("strategy.time_limit=soon", "strategy.time_limit: Value 'soon' of type 'str' could not be converted to Float; "
                                 "UniAPStrategy's time_limit is float (default 60.0)"),
    ("strategy.profile_repeats=2.5", "strategy.profile_repeats: Value '2.5' of type 'float' could not be converted to "
                                     "Integer; UniAPStrategy's profile_repeats is int (default 3)"),
    ("strategy.measure_cluster=maybe", "strategy.measure_cluster: Value 'maybe' is not a valid bool"),
    ("strategy.profile_micro_batches=[2,x]",
     "strategy.profile_micro_batches[1]: Value 'x' of type 'str' could not be converted to Integer; UniAPStrategy's "
     "profile_micro_batches is list[int]"),
    # no `+strategy.time_limt=5` suggested: UniAPStrategy has no such argument (the + form is refused too)
    ("strategy.time_limt=5", "strategy.time_limt=5: UniAPStrategy has no argument 'time_limt' (did you mean "
                             "strategy.time_limit?); its arguments: cluster, plan, schedule"),
    ("plan:time_limit=soon", "time_limit: Value 'soon' of type 'str' could not be converted to Float; `uniap plan`'s "
                             "time_limit is float (default 60.0)"),
    ("plan:batch_size=1.5", "batch_size: Value '1.5' of type 'float' could not be converted to Integer; `uniap plan`'s "
                            "batch_size is int | None (default None)"),
    ("plan:baselines=maybe",
     "baselines: Value 'maybe' is not a valid bool (type str); `uniap plan`'s baselines is bool"),
])
def test_a_value_of_the_wrong_type_is_one_line(override: str, message: str) -> None:
    from uniap_lightning.cli.overrides import check_command_line

    command, _, override = override.rpartition(":") if override.startswith("plan:") else ("train", "", override)
    with pytest.raises(UniAPError) as err:
        check_command_line(command, [override])
    assert str(err.value) == message or str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_typed_values_are_converted_and_open_keys_stay_possible() -> None:
    cfg = _fit("strategy.time_limit=7", "strategy.profile_micro_batches=[2,4]", "strategy.cluster={name: x}",
               "strategy.plan=plan.json", "strategy._target_=my_package.MyStrategy", "+strategy.my_subclass_option=1")
    assert cfg.strategy.time_limit == 7.0 and isinstance(cfg.strategy.time_limit, float)
    assert list(cfg.strategy.profile_micro_batches) == [2, 4] and cfg.strategy.cluster.name == "x"
    assert cfg.strategy.my_subclass_option == 1  # a strategy._target_ subclass may take arguments of its own


def test_the_planning_commands_search_as_the_strategy_does() -> None:
    """`uniap plan`'s solver and time limit default to UniAPStrategy's: the plan it shows is the one setup solves."""
    from uniap_lightning.cli.overrides import compose_checked
    from uniap_lightning.strategy import UniAPStrategy

    params = inspect.signature(UniAPStrategy.__init__).parameters
    cfg = compose_checked("plan", [])
    assert cfg.solver == params["solver"].default and cfg.time_limit == params["time_limit"].default
    assert cfg.compression == params["compression"].default and cfg.baselines is True and cfg.pp is None
    assert compose_checked("plan", ["time_limit=5", "pp=[2,4]"]).time_limit == 5.0


@pytest.mark.parametrize(("args", "message"), [
    (["-m", "time_limit=5,soon"], "time_limit: Value 'soon' of type 'str' could not be converted to Float"),
    (["-m", "time_limt=5,6"], "time_limt=5: `uniap plan` (and evaluate, explain) has no setting 'time_limt' (did you "
                              "mean time_limit?)"),
    (["-m", "model=tiny_gpt,gpt2_small", "batch_size=range(8,24,8)", "baselines=true,maybe"],
     "baselines: Value 'maybe' is not a valid bool"),
])
def test_every_value_of_a_sweep_is_checked_before_the_first_job(args: list[str], message: str) -> None:
    from uniap_lightning.cli.overrides import check_command_line

    with pytest.raises(UniAPError) as err:
        check_command_line("plan", args)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_sweep_variants_give_each_value_once() -> None:
    from uniap_lightning.cli.overrides import _sweep_variants

    assert _sweep_variants(["a=1,2", "b=x", "+c=choice(p,q)"]) == [
        ["a=1", "b=x", "+c=p"], ["a=2", "b=x", "+c=p"], ["a=1", "b=x", "+c=q"]]
    assert _sweep_variants(["model=glob(tiny_*)", "a=1,2"]) == []  # Hydra expands globs against the names
