"""Re-planning a running job (issue 14): the decision logic, the stage timer, and on 4 CPU processes a rank that
turns slow during training, a re-plan that gives its stage less work, a switch inside the same ``fit`` with
parity to one process, and a checkpoint taken after the switch that resumes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from uniap_lightning.planner.decision import Strategy
from uniap_lightning.errors import UniAPError
from uniap_lightning.rebalance.decision import (
    RebalanceOptions, assess, new_speeds, predicted_gain, rank_slowness, should_switch,
)


def _plan(pp=2, world=4):
    """A plan whose rank layout the decision reads (pp stages of world / pp ranks)."""
    from uniap_lightning.planner.plan import Plan

    n = world // pp
    return Plan.from_assignment(stage_of_layer=list(range(pp)), strategies=[Strategy(n, 1)] * pp,
                                layer_names=[f"l{i}" for i in range(pp)], pp=pp, microbatches=1, schedule="1f1b",
                                global_batch_size=n, num_devices=world)


def _assess(measured, predicted=(1.0, 1.0), speeds=(1.0,) * 4, threshold=0.1, switches=0, most=3):
    return assess(measured_s=list(measured), predicted_stage_s=list(predicted), plan=_plan(),
                  speeds=tuple(speeds), threshold=threshold, switches=switches, max_rebalances=most)


def test_a_slow_rank_gets_its_measured_speed():
    check = _assess([1.0, 1.0, 1.0, 2.5])
    assert check.replan and check.speeds == (1.0, 1.0, 1.0, 0.4)
    assert "rank 3 1.00 -> 0.40" in check.reason


def test_a_common_model_error_is_not_a_slow_device():
    # every rank 30% slower than predicted: the cost model is off, no device is slower than the others
    check = _assess([1.3, 1.3, 1.3, 1.3])
    assert not check.replan and check.speeds == (1.0,) * 4


def test_below_the_threshold_nothing_happens():
    assert not _assess([1.0, 1.0, 1.0, 1.09]).replan
    assert _assess([1.0, 1.0, 1.0, 1.12]).replan
    assert not _assess([1.0, 1.0, 1.0, 1.12], threshold=0.2).replan


def test_max_rebalances_stops_replanning():
    check = _assess([1.0, 1.0, 1.0, 2.0], switches=3, most=3)
    assert not check.replan and "max_rebalances=3" in check.reason
    assert _assess([1.0, 1.0, 1.0, 2.0], switches=2, most=3).replan
    assert not _assess([1.0, 1.0, 1.0, 2.0], switches=0, most=0).replan


def test_speeds_already_known_are_kept_and_a_recovery_is_seen():
    # the running plan already assumes rank 3 at half speed: stage 1 predicted twice as long, rank 2 (full speed)
    # expected to take half of it
    speeds = (1.0, 1.0, 1.0, 0.5)
    assert rank_slowness([1.0, 1.0, 1.0, 2.0], [1.0, 2.0], _plan(), speeds) == [1.0, 1.0, 1.0, 1.0]
    assert not _assess([1.0, 1.0, 1.0, 2.0], predicted=(1.0, 2.0), speeds=speeds).replan
    recovered = _assess([1.0, 1.0, 1.0, 1.0], predicted=(1.0, 2.0), speeds=speeds)
    assert recovered.replan and recovered.speeds == (1.0,) * 4


def test_unmeasured_ranks_keep_their_speed():
    assert new_speeds([None, 1.0, 2.0, None], (1.0, 1.0, 1.0, 0.5)) == (1.0, 1.0, 0.5, 0.5)


def test_speeds_given_by_the_cluster_description_are_kept_when_measurements_agree():
    # a heterogeneous cluster described relative to a slower profiling device: ranks 0-1 twice as fast
    speeds = (2.0, 2.0, 1.0, 1.0)
    assert new_speeds([1.0, 1.0, 1.0, 1.0], speeds) == speeds
    assert not _assess([1.0, 1.0, 2.0, 2.0], predicted=(1.0, 2.0), speeds=speeds).replan


def test_switch_needs_a_different_plan_and_a_gain_above_the_threshold():
    assert predicted_gain(1.2, 1.0) == pytest.approx(0.2)
    assert should_switch(0.2, 0.1, same_plan=False)
    assert not should_switch(0.05, 0.1, same_plan=False)  # the gain is small
    assert not should_switch(0.5, 0.1, same_plan=True)
    assert predicted_gain(float("inf"), 1.0) == 0.0 and predicted_gain(1.0, 0.0) == 0.0


@pytest.mark.parametrize("field,value", [
    ("rebalance", "yes"), ("rebalance_threshold", 0), ("rebalance_threshold", -0.1), ("rebalance_threshold", True),
    ("rebalance_threshold", float("nan")), ("rebalance_check_every", 1), ("rebalance_check_every", 2.5),
    ("max_rebalances", -1), ("max_rebalances", None),
])
def test_bad_arguments_are_refused_naming_the_field(field, value):
    from uniap_lightning.strategy import UniAPStrategy

    with pytest.raises(UniAPError, match=field):
        UniAPStrategy(**{field: value})


def test_defaults():
    o = RebalanceOptions.from_arguments(rebalance=False, rebalance_threshold=0.1, rebalance_check_every=50,
                                        max_rebalances=3)
    assert o == RebalanceOptions()


def test_stage_timer_times_forward_and_backward_of_training_passes_only():
    from uniap_lightning.rebalance.timing import StageTimer

    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    timer = StageTimer(net, torch.device("cpu"))
    x = torch.randn(3, 4)
    ref = torch.autograd.grad(net(x).square().sum(), list(net.parameters()))
    timer.clear()
    for _ in range(3):
        out = net(x)
        grads = torch.autograd.grad(out.square().sum(), list(net.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(ref, grads))  # the mark is an identity for values and gradients
    with torch.no_grad():
        net(x)
    net.eval()
    net(x)
    fwd, bwd, count = timer.medians()
    assert count == 3 and len(timer.backward) == 3 and fwd > 0 and bwd > 0
    timer.remove()
    net.train()
    net(x).sum().backward()
    assert len(timer.forward) == 3


# ---------------------------------------------------------------------------------------------- multi-process
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import uniap_rt_helpers as h  # noqa: E402

WIDTH, DEPTH = 16, 8


class SlowLayer(nn.Module):
    """A layer that sleeps ``delay_s`` per sample in its forward while ``slow`` is set (a throttled device)."""

    def __init__(self, width: int, out: int, delay_s: float) -> None:
        super().__init__()
        self.lin = nn.Linear(width, out)
        self.delay_s = delay_s
        self.slow = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow and torch.is_grad_enabled():
            time.sleep(self.delay_s * x.shape[0])
        return torch.tanh(self.lin(x))


def slow_module(slow_rank: int = 3, delay_s: float = 0.002) -> Any:
    """Adam + StepLR over a chain of ``DEPTH`` equal layers between an input and an output layer; from the first
    training batch on, every layer runs slowly on process ``slow_rank`` (``dist.get_rank()``; never in a
    single-process run), as every operation of a throttled device does."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    class SlowChain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            widths = [h.IN] + [WIDTH] * (DEPTH + 1) + [h.OUT]
            self.net = nn.Sequential(*[SlowLayer(a, b, delay_s) for a, b in zip(widths, widths[1:])])
            self.loss_fn = nn.MSELoss()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            slow = dist.is_initialized() and dist.get_rank() == slow_rank
            for m in self.net.modules():
                if isinstance(m, SlowLayer):
                    m.slow = slow

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # one process (the strategy runs
            x, y = batch                                                     # the chain itself)
            loss = self.loss_fn(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)  # steps across the switch
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return SlowChain()


def _run(rank: int, world: int, case: dict[str, Any], out: Path) -> dict[str, Any]:
    import lightning.pytorch as pl

    from uniap_lightning.runtime.checkpoint import full_local_state
    from uniap_lightning.strategy import UniAPStrategy

    from uniap_lightning.monitor import UniAPMonitor

    module = h.make_module(factory="test_rebalance:slow_module", **case.get("module", {}))  # seeded as the reference
    rec = h.LossRecorder.make()
    monitor = UniAPMonitor(warmup_steps=1, window=3, metrics_file=out / f"measured-{rank}.json")
    strategy = UniAPStrategy(cluster="local_cpu", cache_dir=str(out / "cache"), monitor=monitor,
                             plan=case.get("plan"), **case.get("strategy", {}))
    trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=[rec], accelerator="cpu",
                         max_epochs=case["epochs"])  # every other Trainer argument at its default
    trainer.fit(module, h.make_data(16), ckpt_path=str(out / case["resume"]) if "resume" in case else None)
    if "save" in case:
        trainer.save_checkpoint(out / case["save"])
    return {"losses": rec.losses, "state": full_local_state(module), "train_loss":
            float(trainer.callback_metrics["train_loss"]), "first_plan": strategy.setup_result.plan,
            "plan": strategy.plan, "rebalances": strategy.rebalances, "monitor": monitor.last,
            "switched_to": [e.plan for e in strategy._rebalancer.events] if strategy._rebalancer else [],
            "checks": strategy._rebalancer.checks if strategy._rebalancer else []}


def _worker(rank: int, world: int, port: int, cases: dict[str, dict[str, Any]], out_dir: str) -> None:
    import os
    import traceback

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    os.chdir(out_dir)  # Lightning's default logger and checkpoints
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = _run(rank, world, case, Path(out_dir))
        except Exception as err:  # noqa: BLE001 - reported by the test
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            break
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


SLOW = 3
REBALANCE = {"rebalance": True, "rebalance_check_every": 4}
CASES = {
    # rank 3 turns slow from the first batch; checks at steps 4 and 8 (12 steps in 3 epochs of 4 batches)
    "switch": {"epochs": 3, "strategy": REBALANCE, "module": {"slow_rank": SLOW}, "save": "after_switch.ckpt"},
    # the checkpoint saved under the switched plan, resumed under the plan setup solves, one epoch more
    "resume": {"epochs": 4, "resume": "after_switch.ckpt", "module": {"slow_rank": -1}},
    # a pinned plan (two equal stages) is only the starting point
    "pinned": {"epochs": 2, "strategy": REBALANCE, "module": {"slow_rank": SLOW},
               "plan": h.make_plan([(2, 1, False)] * (DEPTH + 2), [0] * 5 + [1] * 5, pp=2, microbatches=2, world=4,
                                   names=[f"net.{i}" for i in range(DEPTH + 2)])},
}


def _slow_rank_work(plan: Any, rank: int) -> float:
    """Layer-samples the rank computes per step: every layer of its stage, on the samples its dp x tp share has."""
    stage = rank // plan.devices_per_stage
    return sum(plan.global_batch_size / (plan.layers[u].strategy.dp * plan.layers[u].strategy.tp) for u in plan.layers_of_stage(stage))


@pytest.fixture(scope="module")
def rebalanced(tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("rebalance")
    results = h.spawn(4, CASES, out, fn=_worker)
    for r, res in enumerate(results):
        for name in CASES:
            assert name in res and "error" not in res[name], (r, name, res.get(name, {}).get("traceback"))
    return results


def _reference(epochs: int) -> dict[str, Any]:
    return h.reference({"module": {"factory": "test_rebalance:slow_module", "slow_rank": -1}, "epochs": epochs,
                        "data": {"factory": "uniap_rt_helpers:make_data"}, "defaults": True})


@pytest.mark.slow
def test_a_slow_rank_triggers_a_switch_with_parity_to_one_process(rebalanced: Any) -> None:
    res = [r["switch"] for r in rebalanced]
    events = res[0]["rebalances"]
    same = ("step", "reason", "speeds", "old_plan", "new_plan", "predicted_gain", "measured_gain")
    assert events, res[0]["checks"]
    assert all([{k: e[k] for k in same} for e in r["rebalances"]] == [{k: e[k] for k in same} for e in events]
               for r in res), "every rank switched alike"
    first = events[0]
    assert first["step"] == 4 and first["predicted_gain"] > 0.10
    speeds = first["speeds"]  # healthy ranks' figures are noisy on shared cores; the slow one stands out
    assert speeds[SLOW] < 0.5 * min(s for r, s in enumerate(speeds) if r != SLOW), speeds
    assert _slow_rank_work(res[0]["switched_to"][0], SLOW) < _slow_rank_work(res[0]["first_plan"], SLOW)
    assert res[0]["plan"] is not None and all(r["plan"] == res[0]["plan"] for r in res)
    assert first["measured_gain"] is not None and first["switch_s"] > 0
    h.assert_close_to_reference(rebalanced, "switch", _reference(3))
    # the monitor's file (what `uniap explain measured=FILE` reads) lists the switch, and explain shows it
    from rich.console import Console

    from uniap_lightning.cli.apps import _rebalance_table

    shown = res[0]["monitor"]["rebalances"]
    assert shown[0]["step"] == 4 and shown[0]["new_plan"] == first["new_plan"]
    console = Console(width=200, record=True)
    console.print(_rebalance_table(shown))
    text = console.export_text()
    assert "Plan switches" in text and first["new_plan"][:10] in text


@pytest.mark.slow
def test_a_checkpoint_taken_after_a_switch_resumes(rebalanced: Any) -> None:
    ref = _reference(4)
    ref = {**ref, "losses": ref["losses"][12:]}
    h.assert_close_to_reference(rebalanced, "resume", ref)


@pytest.mark.slow
def test_a_pinned_plan_is_only_the_starting_point(rebalanced: Any) -> None:
    res = [r["pinned"] for r in rebalanced]
    assert res[0]["first_plan"] == CASES["pinned"]["plan"]
    assert res[0]["rebalances"] and res[0]["rebalances"][0]["step"] == 4
    assert _slow_rank_work(res[0]["switched_to"][0], SLOW) < _slow_rank_work(res[0]["first_plan"], SLOW)
    h.assert_close_to_reference(rebalanced, "pinned", _reference(2))
