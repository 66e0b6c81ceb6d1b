"""Switching a running job to another plan, inside the same ``Trainer.fit``.

Applying a plan changes the user's module in place (layers of other stages become ``nn.Identity``, local layers
get DTensor parameters and FSDP2 / tensor-parallel hooks), so a plan cannot be applied on top of another.
:class:`Pristine` keeps a copy of every layer as the user built it, taken at setup before the first plan is
applied: parameters on the meta device (no memory), buffers real (non-persistent buffers such as causal masks are
in no checkpoint). A switch (collective, every rank at the same step boundary):

1. writes the model and optimizer states as a distributed checkpoint (DCP, keyed by parameter name) into a
   temporary folder (under ``$UNIAP_REBALANCE_DIR`` or the trainer's ``default_root_dir``: it must be reachable
   from every rank, as checkpoints are);
2. puts fresh copies of the pristine layers back into the module (materialized only for this rank's new stage),
   finds the chain again and applies the new plan (meshes, stage, TP / FSDP / replication, pipeline);
3. rebuilds the optimizers and LR schedulers through Lightning (``configure_optimizers``), loads the weights and
   optimizer states from the checkpoint, resharded by name for the new plan (the path resuming across plans
   takes), and hands the schedulers their previous state: the LR schedule continues where it was.

The data order and step counter are untouched, so training goes on as if nothing had happened.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from torch import nn

from uniap_lightning.adapters import extract_chain
from uniap_lightning.precision import global_norm_clipper
from uniap_lightning.runtime import apply_plan
from uniap_lightning.runtime.chain import Chain
from uniap_lightning.runtime.checkpoint import load, model_state, optimizer_state

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from uniap_lightning.planner.plan import Plan
    from uniap_lightning.runtime import Runtime


def _layer_fqns(chain: Chain) -> list[list[str]]:
    """The module paths holding each layer (the layer itself, or an adapter view's parts)."""
    return [list(p) for p in chain.parts] if chain.parts is not None else [[n] for n in chain.names]


def _meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy whose parameters live on the meta device (nothing copied) and whose buffers are real."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    return copy.deepcopy(module, memo)


def _materialize(meta: nn.Module, device: torch.device) -> nn.Module:
    """A fresh module from a meta copy: zero parameters on ``device`` (the checkpoint fills them), buffers copied."""
    fresh = copy.deepcopy(meta)
    for sub in fresh.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and p.is_meta:
                sub._parameters[name] = nn.Parameter(torch.zeros(p.shape, dtype=p.dtype, device=device),
                                                     requires_grad=p.requires_grad)
    return fresh.to(device)


class Pristine:
    """The chain's layers as the user built them (see the module docstring)."""

    def __init__(self, chain: Chain) -> None:
        self.fqns = _layer_fqns(chain)
        self.copies = {fqn: _meta_copy(chain.module.get_submodule(fqn)) for fqns in self.fqns for fqn in fqns}

    def restore(self, module: nn.Module, local_layers: set[int], device: torch.device) -> None:
        """Put copies back at their paths in ``module``: real ones for ``local_layers``, meta ones for the others
        (the plan replaces those by ``nn.Identity`` at once)."""
        for u, fqns in enumerate(self.fqns):
            for fqn in fqns:
                meta = self.copies[fqn]
                fresh = _materialize(meta, device) if u in local_layers else copy.deepcopy(meta)
                parent_name, _, child = fqn.rpartition(".")
                setattr(module.get_submodule(parent_name) if parent_name else module, child, fresh)


def _scratch_dir(trainer: pl.Trainer, broadcast: Any, rank: int) -> Path:
    root = Path(os.environ.get("UNIAP_REBALANCE_DIR") or trainer.default_root_dir or ".")
    path = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        path = tempfile.mkdtemp(prefix=".uniap-rebalance-", dir=root)
    return Path(broadcast(path))


def switch_plan(strategy: Any, trainer: pl.Trainer, plan: Plan, pristine: Pristine) -> float:
    """Run ``plan`` from now on (collective; see the module docstring). Returns the seconds it took."""
    t0 = time.perf_counter()
    module, rank, device = strategy.lightning_module, strategy.global_rank, strategy.root_device
    old: Runtime = strategy.runtime
    folder = _scratch_dir(trainer, strategy.broadcast, rank)
    try:
        optimizers = [getattr(o, "_optimizer", o) for o in strategy.optimizers]
        state: dict[str, Any] = {"state_dict": model_state(module)}
        for i, opt in enumerate(optimizers):
            state[f"optimizer_{i}"] = optimizer_state(module, opt)
        strategy.guard(lambda: dcp.save(state, checkpoint_id=folder))
        schedulers = [cfg.scheduler.state_dict() for cfg in strategy.lr_scheduler_configs]
        del state, optimizers
        strategy.optimizers, strategy.lr_scheduler_configs = [], []  # the old parameters go with the old plan
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            pristine.restore(module, set(plan.layers_of_rank(rank)), device)
            chain = extract_chain(module)
            chain.input_spec, chain.specs = old.chain.input_spec, old.chain.specs
            runtime = strategy.guard(lambda: apply_plan(chain, plan, rank=rank, device=device))
        strategy.install_runtime(runtime)
        strategy.precision_plugin.bind_global_norm(global_norm_clipper(plan.devices_per_stage, device=device,
                                                                       guard=strategy.guard))
        strategy.setup_optimizers(trainer)
        _optimizers_to_device(strategy.optimizers, device)
        strategy.guard(lambda: load(folder, module, [getattr(o, "_optimizer", o) for o in strategy.optimizers]))
        for cfg, sched in zip(strategy.lr_scheduler_configs, schedulers):
            cfg.scheduler.load_state_dict(sched)
        strategy.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return time.perf_counter() - t0
