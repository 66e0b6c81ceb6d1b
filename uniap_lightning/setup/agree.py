"""Agreement on success between the ranks at setup, so that one rank's error never leaves the others waiting.

Setup is a fixed sequence of steps, the same on every rank. A step is either *local* work that every rank does
(:func:`everyone`) or work that rank 0 does for all (:func:`from_lead`); each ends with one collective that carries
``(ok, message)`` from every rank (or from rank 0). A failure anywhere therefore reaches every rank at that
collective, and every rank raises the same :class:`UniAPError` naming the first failing rank, within seconds: no
rank goes on to a later collective that the failed rank will never join.

What this cannot cover: a step whose own code runs collectives (measuring links, timing layers under TP / FSDP)
and fails on one rank in the middle of them. Those steps only run deterministic code on identical inputs on every
rank, so they fail on all ranks alike or not at all; the step after them agrees as usual.
"""

from __future__ import annotations

import functools
import hashlib
import traceback
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import uniap_lightning
from uniap_lightning.errors import UniAPError

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in the job."""

    rank: int
    world_size: int
    num_nodes: int
    devices_per_node: int
    device: torch.device

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()


def _failure(err: BaseException, rank: int, step: str) -> str:
    if not isinstance(err, UniAPError):
        traceback.print_exc()  # an unexpected error: its traceback stays useful on the rank where it happened
    text = str(err).splitlines()[0] if str(err) else ""
    what = text if isinstance(err, UniAPError) else f"{type(err).__name__}: {text}"
    return f"UniAP setup failed on rank {rank} while {step}: {what}"


def everyone(ranks: Ranks, step: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank, then agree: if it raised anywhere, raise the first failure on every rank."""
    if not ranks.distributed:
        return fn()  # one process: the error as raised, traceback included
    value: Any = None
    failure: str | None = None
    cause: BaseException | None = None
    try:
        value = fn()
    except Exception as err:  # noqa: BLE001 - every error must reach the other ranks
        failure, cause = _failure(err, ranks.rank, step), err
    failures: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f), None)
    if first is not None:
        raise UniAPError(first) from cause
    return value


def from_lead(ranks: Ranks, step: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and send its result (or its failure) to every rank."""
    if not ranks.distributed:
        return fn()
    box: list[Any] = [(None, None)]
    cause: BaseException | None = None
    if ranks.lead:
        try:
            box = [(fn(), None)]
        except Exception as err:  # noqa: BLE001 - every error must reach the other ranks
            box, cause = [(None, _failure(err, 0, step))], err
    dist.broadcast_object_list(box, src=0)
    value, failure = box[0]
    if failure is not None:
        raise UniAPError(failure) from cause
    return value


def gather(ranks: Ranks, value: T) -> list[T]:
    """Every rank's ``value``, in rank order, on every rank (call only after an agreement: all ranks are here)."""
    if not ranks.distributed:
        return [value]
    out: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(out, value)
    return out


@functools.cache
def code_identity() -> tuple[str, str, str]:
    """``(uniap_lightning version, digest of its Python sources, torch version)`` of this process."""
    root = Path(uniap_lightning.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return uniap_lightning.__version__, digest.hexdigest()[:12], torch.__version__


def same_code_everywhere(ranks: Ranks) -> None:
    """Ranks running other code (a node with another install, sources edited while the job started) would call
    other collectives and wait for each other forever: refuse at once, naming the ranks and what differs."""
    seen = gather(ranks, code_identity())
    if any(s != seen[0] for s in seen):
        groups: dict[tuple[str, str, str], list[int]] = {}
        for r, s in enumerate(seen):
            groups.setdefault(s, []).append(r)
        described = "; ".join(f"ranks {rs}: uniap-lightning {v} (sources {d}), torch {t}"
                              for (v, d, t), rs in groups.items())
        raise UniAPError(f"the ranks run different code ({described}): install the same uniap-lightning and torch "
                         "on every node, and do not edit the sources while a job starts")
