"""``uniap explain measured=FILE``: what the monitor's measured file belongs to (its ``run`` record: the plan, and
the cluster description, model profile and training settings it was planned with; see
:func:`uniap_lightning.monitor.run_record`).

With no ``model=`` / ``cluster=`` / ``plan=`` / ``profile=`` on the command line, explain re-scores the recorded
problem and plan; given ones must describe the same run (model name and number of devices), else one error line.
A file without the record (written before it existed) is compared with the command line's model and cluster, with
a note saying so.
"""

from __future__ import annotations

from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner import fields as F
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem, TrainingConfig
from uniap_lightning.planner.profile import ModelProfile

#: command-line keys that choose what to explain
CHOOSING = ("model", "cluster", "plan", "profile")


def given_on_command_line() -> set[str]:
    """The top-level keys the user set on the command line (``model=x``, ``cluster.nodes=2`` -> ``cluster``)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = list(HydraConfig.get().overrides.task)
    except (ValueError, ImportError):  # not inside a Hydra app (a direct call)
        return set()
    keys = set()
    for arg in task:
        key = arg.lstrip("+~").split("=", 1)[0]
        keys.add(key.split(".", 1)[0].split("@", 1)[0])
    return keys


def recorded_run(data: dict[str, Any], path: str) -> dict[str, Any] | None:
    """The file's ``run`` record with the fields used here checked; ``None`` for a file without one."""
    run = data.get("run")
    if run is None:
        return None
    where = f"measured={path!r}: run"
    F.obj(run, where)
    F.string(run.get("model"), f"{where}.model")
    F.integer(run.get("devices"), f"{where}.devices", low=1)
    if run.get("cluster") is not None:
        F.string(run["cluster"], f"{where}.cluster")
    F.obj(run.get("plan"), f"{where}.plan")
    for key in ("cluster_spec", "profile", "training"):
        if run.get(key) is not None:
            F.obj(run[key], f"{where}.{key}")
    return run


def describe(run: dict[str, Any]) -> str:
    return f"model {run['model'] or '(unnamed)'} on {run.get('cluster') or '?'} ({run['devices']} devices)"


def check_same_run(run: dict[str, Any], problem: Any, plan: Any, path: str) -> None:
    """The command line's model / cluster / plan describe the run the file measured."""
    ours = {"model": problem.model.model, "devices": problem.cluster.num_devices}
    if plan is not None:
        ours["devices"] = plan.num_devices
    theirs = {"model": run["model"], "devices": run["devices"]}
    if (run["model"] and ours["model"] != theirs["model"]) or ours["devices"] != theirs["devices"]:
        raise UniAPError(
            f"measured={path} was measured with {describe(run)}, not model {ours['model']} on "
            f"{problem.cluster.name} ({ours['devices']} devices); run `uniap explain measured={path}` without "
            "model=/cluster=/plan= to explain it with the model, cluster and plan it was measured with")


def recorded_problem(run: dict[str, Any], path: str) -> tuple[Any, Any] | None:
    """The recorded problem and plan (``None`` when the record lacks the profile or the cluster description:
    a pinned plan with no profile)."""
    if not (run.get("cluster_spec") and run.get("profile")):
        return None
    where = f"measured={path}: run"
    try:
        plan = Plan.from_dict(run["plan"], origin=f"{where}.plan")
        cluster = Cluster.from_dict(run["cluster_spec"])
        profile = ModelProfile.from_dict(run["profile"], origin=f"{where}.profile")
        training = dict(run.get("training") or {})
        if isinstance(training.get("microbatches"), list):
            training["microbatches"] = tuple(training["microbatches"])
        problem = Problem(model=profile, cluster=cluster, training=TrainingConfig(**training),
                          compression=tuple(sorted({lp.strategy.compression for lp in plan.layers} | {"none"})),
                          compression_options=dict(plan.compression_options))
    except UniAPError as err:
        raise UniAPError(f"{where}: {err}") from None
    except TypeError as err:  # an unknown training field
        raise UniAPError(f"{where}.training: {err}") from None
    return problem, plan
