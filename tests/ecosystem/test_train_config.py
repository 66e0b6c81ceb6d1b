"""``uniap train``'s ``strategy`` group reaches every ``UniAPStrategy`` argument through ``hydra.utils.instantiate``."""

from __future__ import annotations

import inspect

import pytest
from hydra import compose, initialize_config_dir

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.config import CONF_DIR


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="fit", overrides=list(overrides))


def test_every_strategy_argument_is_in_the_train_config() -> None:
    from uniap_lightning.strategy import UniAPStrategy

    params = set(inspect.signature(UniAPStrategy.__init__).parameters) - {"self"}
    listed = set(_compose().strategy) - {"_target_"}
    assert listed == params, f"missing from conf/fit.yaml: {sorted(params - listed)}; unknown: {sorted(listed - params)}"


def test_overrides_reach_the_strategy() -> None:
    from uniap_lightning.cli.train import build_strategy

    strategy = build_strategy(_compose("strategy.schedule=gpipe", "strategy.time_limit=7", "strategy.monitor=false",
                                       "strategy.profile_micro_batches=[2,4]", "strategy.cluster=a100_1x8",
                                       "strategy.profile_repeats=5"))
    options = strategy.setup_options
    assert options.schedule == "gpipe" and options.time_limit_s == 7.0
    assert list(options.profile_micro_batches) == [2, 4] and options.profile_repeats == 5
    assert options.cluster.name == "a100_1x8"


@pytest.mark.parametrize("override, message", [
    ("strategy.schedule=zigzag", "schedule='zigzag'"),
    ("strategy.time_limit=-5", "time_limit=-5: give the search's time limit in seconds, a number > 0"),
    ("strategy.cluster=nowhere", "unknown cluster 'nowhere'"),
    ("+strategy.no_such_option=1", "no_such_option"),
])
def test_bad_strategy_values_get_one_clear_error(override: str, message: str) -> None:
    from uniap_lightning.cli.train import build_strategy

    with pytest.raises(UniAPError, match=message):
        build_strategy(_compose(override))
