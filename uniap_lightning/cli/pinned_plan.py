"""``uniap train ... strategy.plan=FILE``: a plan made offline by ``uniap plan`` for the same model config, checked
against the run before any rank starts, its global batch and process count taken where the command line does not
give them.

The workflow: ``uniap plan model=X cluster=Y out=plan.json`` for the cluster (before the job gets it), then in the
job ``uniap train model=X strategy.plan=plan.json [trainer.devices=N]``. The layers ``uniap train`` builds are named
as the analytic model names them (``embed, block0 .., lm_head``), and an analytic plan's fingerprint is that of the
model config it was made for (:func:`uniap_lightning.planner.analytic.config_fingerprint`), so this compares the
plan with the config ``uniap train`` builds from. What the command line gives is kept and checked: a plan for
another batch, another number of processes or another model is one error line naming what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.analytic import ModelSpec, config_fingerprint, lm_layer_names
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.profile import describes_a_config


def given_keys(overrides: Sequence[str]) -> set[str]:
    """The config keys a command line sets (``trainer.devices=4``, ``+x=1``, ``++x=1``; not ``~x`` deletions)."""
    keys = set()
    for item in overrides:
        key, eq, _ = str(item).partition("=")
        if eq and not key.startswith("~"):
            keys.add(key.lstrip("+"))
    return keys


def pin_plan(cfg: DictConfig, overrides: Sequence[str]) -> list[str]:
    """Check ``strategy.plan`` (a file) against the run and take its batch and process count into ``cfg`` where
    ``overrides`` (the command line) does not set them; the returned notes say what was taken. Nothing without a
    plan file (a plan given as an object, from Python, is checked by the strategy)."""
    path = cfg.strategy.get("plan") if OmegaConf.is_dict(cfg.get("strategy")) else None
    if not isinstance(path, str) or not path:
        return []
    where = f"strategy.plan={path}"
    plan = Plan.from_json(path)  # a UniAPError naming the file
    _check_model(cfg, plan, where)
    given = given_keys(overrides)
    return _take_batch(cfg, plan, where, given) + _take_devices(cfg, plan, where, given)


def _spec(cfg: DictConfig) -> ModelSpec:
    model: dict[str, Any] = OmegaConf.to_container(cfg.model, resolve=True)  # type: ignore[assignment]
    seq_len = cfg.data.get("seq_len") if OmegaConf.is_dict(cfg.get("data")) else None
    if seq_len is not None:  # the sequence length the model is built for
        model["seq_len"] = seq_len
    return ModelSpec.from_dict(model)


def _check_model(cfg: DictConfig, plan: Plan, where: str) -> None:
    spec = _spec(cfg)
    names = lm_layer_names(spec.layers)
    planned = [lp.name for lp in plan.layers]
    again = f"plan it for this model: uniap plan model={spec.name} cluster=... out={where.partition('=')[2]}"
    if planned not in (names, [f"chain.{n}" for n in names]):
        shown = ", ".join(planned[:3]) + (" ..." if len(planned) > 3 else "")
        raise UniAPError(f"{where} has {len(planned)} layers ({shown}) but model={spec.name} has {len(names)} "
                         f"({names[0]}, {names[1]} .. {names[-1]}): the plan is for another model; {again}")
    if describes_a_config(plan.model_fingerprint) and plan.model_fingerprint != config_fingerprint(spec):
        raise UniAPError(
            f"{where} was made by `uniap plan` for other layer sizes than model={spec.name} (hidden={spec.hidden}, "
            f"heads={spec.heads}, ffn={spec.ffn}, vocab={spec.vocab}, seq_len={spec.seq_len}, dtype={spec.dtype}): "
            f"{again} and the same model.* / data.seq_len overrides")


def _take_batch(cfg: DictConfig, plan: Plan, where: str, given: set[str]) -> list[str]:
    batch, planned = cfg.data.get("batch_size"), plan.global_batch_size
    if batch == planned:
        return []
    if "data.batch_size" in given:
        raise UniAPError(f"{where} is for a global batch of {planned} samples but data.batch_size={batch}: drop "
                         f"data.batch_size (the plan's {planned} is taken) or plan with batch_size={batch}")
    cfg.data.batch_size = planned
    return [f"data.batch_size={planned}: the global batch of {where}"]


def _take_devices(cfg: DictConfig, plan: Plan, where: str, given: set[str]) -> list[str]:
    devices, nodes, planned = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1), plan.num_devices
    if not isinstance(devices, int) or not isinstance(nodes, int) or devices < 1 or nodes < 1:
        return []  # refused as it is by the trainer checks
    if devices * nodes == planned:
        return []
    if {"trainer.devices", "trainer.num_nodes"} & given or planned % nodes:
        fix = (f"give trainer.devices={planned // nodes}" if planned % nodes == 0 else
               f"give trainer.devices and trainer.num_nodes that multiply to {planned}")
        raise UniAPError(f"{where} is for {planned} processes but trainer.devices={devices} x trainer.num_nodes="
                         f"{nodes} is {devices * nodes}: {fix}, or plan for a cluster of {devices * nodes} devices")
    cfg.trainer.devices = planned // nodes
    return [f"trainer.devices={planned // nodes}: the processes of {where}"]
