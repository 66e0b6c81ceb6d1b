"""Checks of the job's shape that must fail loudly *before* any process waits for another."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from uniap_lightning.errors import UniAPError


def _tasks_per_node(value: str) -> int | None:
    """``SLURM_TASKS_PER_NODE`` looks like ``4`` or ``4(x2)`` or ``4(x2),3``; return the first count."""
    m = re.match(r"\s*(\d+)", value)
    return int(m.group(1)) if m else None


#: what srun sets in each task it starts, besides ``SLURM_NTASKS``; Lightning's SLURM environment reads the ranks
#: from them (``SLURM_NTASKS`` alone, e.g. left exported in a shell, made Lightning fail or wait for absent tasks)
SLURM_TASK_VARIABLES = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")


def check_slurm_task(env: Mapping[str, str] | None = None) -> None:
    """``SLURM_NTASKS`` set makes Lightning take this process for a task srun started (``SLURMEnvironment.detect``,
    unless the job is named ``bash`` or ``interactive``): it must then be one, with the variables srun sets, and
    ``SLURM_NTASKS_PER_NODE`` beside a count above 1 (else Lightning raises a ``RuntimeError`` about ``--ntasks``)."""
    env = os.environ if env is None else env
    ntasks = env.get("SLURM_NTASKS")
    if ntasks is None or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return
    shown = ntasks if len(ntasks) <= 20 else ntasks[:17] + "..."
    missing = [key for key in SLURM_TASK_VARIABLES if not env.get(key)]
    if missing:
        raise UniAPError(f"SLURM_NTASKS={shown} is set but not {', '.join(missing)}: this process is not a task srun "
                         "started (Lightning would take it for one); unset SLURM_NTASKS to run outside SLURM, or start "
                         "the command with srun inside an allocation (examples/slurm/train.sbatch)")
    if not (ntasks.strip().isascii() and ntasks.strip().isdigit() and 0 < int(ntasks.strip()) < 10**9):
        raise UniAPError(f"SLURM_NTASKS={shown} is not a task count: run under srun, which sets it")
    if int(ntasks) > 1 and not env.get("SLURM_NTASKS_PER_NODE"):
        raise UniAPError(f"SLURM_NTASKS={int(ntasks)} without SLURM_NTASKS_PER_NODE: Lightning needs the tasks per "
                         f"node; submit with --ntasks-per-node (and --nodes) instead of --ntasks")


def check_slurm(cluster_environment: Any, *, num_nodes: int, devices: int) -> None:
    """Under SLURM, ``devices`` must equal tasks per node and ``num_nodes`` the allocated nodes.

    Lightning checks this only in its own launcher, which is not used when SLURM starts the processes; a mismatch
    otherwise gives ranks that disagree on the world size and hang in the first collective.
    """
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not isinstance(cluster_environment, SLURMEnvironment):
        return
    env = os.environ
    ntasks = env.get("SLURM_NTASKS")
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    nodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    problems = []
    if per_node is not None and _tasks_per_node(per_node) not in (None, devices):
        problems.append(f"Trainer(devices={devices}) but SLURM runs {_tasks_per_node(per_node)} tasks per node")
    if nodes is not None and nodes.isdigit() and int(nodes) != num_nodes:
        problems.append(f"Trainer(num_nodes={num_nodes}) but SLURM allocated {nodes} nodes")
    if ntasks is not None and ntasks.isdigit() and int(ntasks) != devices * num_nodes:
        problems.append(f"devices x num_nodes = {devices * num_nodes} but SLURM_NTASKS={ntasks}")
    if problems:
        raise UniAPError(
            "the Trainer does not match the SLURM allocation: " + "; ".join(problems)
            + ". Set devices to --ntasks-per-node and num_nodes to --nodes (or launch with matching srun options)."
        )


def check_same_batch(*tensors: Any) -> None:
    """Every rank must see the same global batch (each takes its own share of it); compare checksums once.

    The strategy keeps the user's sampler (no ``DistributedSampler``), so a shuffling sampler draws its order from
    each rank's random state; seeded alike (``seed_everything``, or a seeded ``generator``) every rank gets the
    same order as one device would. Otherwise ranks would silently train on different samples - and pipeline
    stages would pair inputs with the wrong targets.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    sums = [float(t.double().sum()) if isinstance(t, torch.Tensor) else 0.0 for t in tensors]
    sizes = [float(t.numel()) if isinstance(t, torch.Tensor) else 0.0 for t in tensors]
    local = torch.tensor(sums + sizes, dtype=torch.float64)
    high, low = local.clone(), local.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    # float sums of equal tensors may differ in the last bit (summation order depends on threading)
    if not torch.allclose(high, low, rtol=1e-9, atol=1e-9):
        raise UniAPError(
            "ranks received different batches; every rank must load the same global batch (it takes its own share). "
            "Seed every rank alike before building the model and the dataloader (lightning.seed_everything(...)), or "
            "give a shuffling sampler a seeded generator."
        )


def clear_comm_errors(fn: Any, *, rank: int) -> Any:
    """Run ``fn`` (a collective or a wait on one); a backend failure, usually a peer process that died, becomes a
    :class:`UniAPError` naming this rank instead of a backend traceback."""
    try:
        return fn()
    except RuntimeError as err:
        if not _is_comm_failure(err):
            raise
        raise UniAPError(
            f"rank {rank}: a collective or pipeline transfer failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}). Another rank probably died or stopped responding; "
            "see its log for the cause."
        ) from err


def _is_comm_failure(err: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(err, (dist.DistError,)):
        return True
    text = str(err).lower()
    return any(k in text for k in ("connection closed", "connection reset", "timed out", "timeout", "gloo", "nccl",
                                   "broken pipe", "peer"))


def check_module_supported(module: Any, precision_plugin: Any) -> None:
    """What the strategy cannot run, refused at setup before any plan is made."""
    if not module.automatic_optimization:
        raise UniAPError(
            "UniAPStrategy runs the forward and backward passes itself and needs automatic optimization; "
            "remove `self.automatic_optimization = False` from the LightningModule"
        )
    if getattr(precision_plugin, "scaler", None) is not None:
        raise UniAPError(
            "fp16 mixed precision with a gradient scaler is not supported by UniAPStrategy (the pipeline computes "
            "gradients inside training_step); use precision='bf16-mixed' or '32-true'"
        )


def check_pinned_world(plan: Any, *, num_nodes: int, devices: int) -> None:
    """A pinned plan is for one number of processes."""
    if plan is not None and plan.num_devices != num_nodes * devices:
        raise UniAPError(
            f"the pinned plan is for num_devices={plan.num_devices} processes but the Trainer has "
            f"{num_nodes * devices} (devices={devices} x num_nodes={num_nodes})"
        )
