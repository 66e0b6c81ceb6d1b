"""The gradient compressors' state in checkpoints: error feedback, PowerSGD's warm-started ``Q``, DGC's momentum.

The state is per rank (each replica keeps the residual of *its* gradients), so every rank writes its own file into
the distributed checkpoint's folder, ``<checkpoint>/uniap_compression/rank<r>.pt`` (written atomically, plain
tensors and data only, loaded with ``weights_only=True``), beside DCP's shards. With the state goes its *layout*:
world size, rank, and per bucket the method, group size, dtype and local gradient shapes, plus the options that
shape the state (``powersgd_rank``, ``topk_ratio``, ``dgc_momentum``).

Resuming under the same plan on the same ranks restores every compressor exactly, so the resumed run continues as
the uninterrupted one would. Resuming under another layout (another plan, world size or compression options), or
from a checkpoint without the folder, starts the error feedback from zero and PowerSGD from a fresh ``Q`` (as
torch's ``powerSGD_hook`` does when registered again), with a warning that says why; it never fails. The warm-up
position is not part of this state: it follows the Trainer's ``global_step``, which the checkpoint restores.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map_only

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.plan import COMPRESSION_DEFAULTS, COMPRESSION_RUNTIME_DEFAULTS
from uniap_lightning.runtime.checkpoint import load_plain, save_atomic

if TYPE_CHECKING:
    from uniap_lightning.runtime.data_parallel import ReplicatedGrads

FOLDER = "uniap_compression"
FORMAT_VERSION = 1
#: options whose value changes what the state means
_SHAPING_OPTIONS = ("powersgd_rank", "topk_ratio", "dgc_momentum")


def has_state(replicated: ReplicatedGrads) -> bool:
    """Whether any layer of this rank compresses with error feedback (bf16 keeps nothing)."""
    return any(len(g) > 3 and g[3] in ("powersgd", "topk") for g in replicated.groups)


def layout(replicated: ReplicatedGrads, rank: int, world: int) -> dict[str, Any]:
    """What the saved state must match to be restored (builds the buckets if the first step has not)."""
    replicated.build()
    opts = {**_runtime_defaults(), **replicated.compression_options}
    return {
        "version": FORMAT_VERSION, "rank": rank, "world": world,
        "options": {k: float(opts[k]) for k in _SHAPING_OPTIONS if k in opts},
        "buckets": [[b.compressor.method if b.compressor is not None else "none", b.size, str(b.buffer.dtype),
                     [list(s.shape) for s in b.slots]] for b in replicated.buckets],
    }


def save(replicated: ReplicatedGrads, folder: str | Path, *, rank: int, world: int) -> None:
    """Write this rank's compressor state into the checkpoint ``folder`` (nothing when no layer has any)."""
    if not has_state(replicated):
        return
    buckets = [b.compressor.state_dict() if b.compressor is not None else {} for b in replicated.buckets]
    path = Path(folder) / FOLDER / f"rank{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomic({"layout": layout(replicated, rank, world), "buckets": _to(buckets, torch.device("cpu"))}, path)


def load(replicated: ReplicatedGrads, folder: str | Path, *, rank: int, world: int) -> str | None:
    """Restore this rank's compressor state from the checkpoint ``folder``; returns why it did not (the
    compressors then start from zero), or ``None`` when restored or there is nothing to restore."""
    if not has_state(replicated):
        return None
    path = Path(folder) / FOLDER / f"rank{rank}.pt"
    if not path.is_file():
        return f"the checkpoint has no compression state for rank {rank} ({FOLDER}/{path.name})"
    try:
        saved = load_plain(path)
    except UniAPError as err:  # optional state: an unreadable file is a reason to start from zero, never a failure
        return str(err)
    mine = layout(replicated, rank, world)
    if not isinstance(saved, dict) or saved.get("layout") != mine:
        return "the checkpoint's compression state was saved under another plan, world size or options"
    for bucket, state in zip(replicated.buckets, saved["buckets"]):
        if bucket.compressor is not None:
            device = bucket.buffer.device
            bucket.compressor.load_state_dict(_to(state, device))
    return None


def _runtime_defaults() -> dict[str, float]:
    return {**COMPRESSION_DEFAULTS, **COMPRESSION_RUNTIME_DEFAULTS}


def _to(state: Any, device: torch.device) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.detach().to(device), state)
