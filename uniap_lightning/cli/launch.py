"""Starting `uniap train`'s other ranks on this machine, and ending them: with ``trainer.devices > 1`` outside
SLURM (and not already a launched rank) the launching process starts ranks 1 .. N-1 as Lightning's launcher
would (the same command, ``LOCAL_RANK`` set, the cores shared out), then trains as rank 0
(:mod:`uniap_lightning.cli.train`); when it fails or is stopped it ends them here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from omegaconf import DictConfig

from uniap_lightning.cli.ranks import PREEMPTED_EXIT_CODE, SETUP_STOP_LINE, error_file_for, rank_error
from uniap_lightning.errors import UniAPError


def _free_port() -> int:
    """A TCP port free on this machine now, for the ranks' rendezvous (``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_other_ranks(cfg: DictConfig, overrides: list[str]) -> list[subprocess.Popen]:
    """Ranks 1 .. N-1 started on this machine (none under SLURM, in a launched rank, or with one device); this
    process becomes rank 0 (its environment is set for the rendezvous, its torch thread pool resized)."""
    devices, nodes = int(cfg.trainer.devices), int(cfg.trainer.num_nodes)
    if devices <= 1 or "LOCAL_RANK" in os.environ or "SLURM_NTASKS" in os.environ:
        return []
    if nodes != 1:
        raise UniAPError(
            f"trainer.num_nodes={nodes}: outside SLURM `uniap train` starts processes on this machine only; "
            "use examples/slurm/train.sbatch for several nodes"
        )
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(devices),
               NODE_RANK="0", OMP_NUM_THREADS=threads_per_rank(devices))
    children = []
    for rank in range(1, devices):
        report = error_file_for(rank)  # the rank writes its error line here; rank 0 prints it (one line in all)
        child = subprocess.Popen([sys.executable, "-m", "uniap_lightning.cli.main", "train", *overrides],
                                 env=dict(env, LOCAL_RANK=str(rank), UNIAP_RANK_ERROR_FILE=str(report)))
        child.uniap_error_file = report  # type: ignore[attr-defined]
        children.append(child)
    shared = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "OMP_NUM_THREADS")
    os.environ.update({k: env[k] for k in shared}, LOCAL_RANK="0")
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # this process's pool was sized before the variable was set
    return children


def threads_per_rank(devices: int) -> str:
    """The cores shared out between the ranks, as Lightning's own launchers do (``OMP_NUM_THREADS`` wins if set):
    with more compute threads than cores the ranks' thread pools preempt each other, and a step can take many
    times what profiling measured."""
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // devices))


def stopped_by_sigterm(children: list[subprocess.Popen], *, wait_s: float = 3.0) -> int | None:
    """The first started rank that stopped on SIGTERM before training (it handed :data:`SETUP_STOP_LINE` over),
    waiting up to ``wait_s`` for ranks still running (this rank's error came from one leaving, a moment ago)."""
    deadline = time.monotonic() + wait_s
    for rank, child in enumerate(children, start=1):
        try:
            code = child.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            continue
        if code in (PREEMPTED_EXIT_CODE, -signal.SIGTERM) and (code < 0 or rank_error(child) == SETUP_STOP_LINE):
            return rank
    return None


#: seconds the ranks this process started get to end by themselves once it has failed, before they are killed
CHILD_GRACE_S = 15.0


def end_children(children: list[subprocess.Popen], *, grace_s: float | None) -> None:
    """Wait for the started ranks (at most ``grace_s`` each, then kill them); ``None``: wait as long as they run."""
    for child in children:
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
