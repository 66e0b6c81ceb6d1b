"""Distributed checkpoints that survive a change of plan, and a consolidated single-file export.

Saving writes torch.distributed.checkpoint (DCP) shards keyed by parameter name: ``state_dict.<fqn>`` for the
weights and ``optimizer_<i>.state.<fqn>.<key>`` / ``optimizer_<i>.param_groups.<fqn>.<key>`` for the optimizers
(``flatten_optimizer_state_dict=True``; the nested form loses param-group hyper-parameters on some pipeline
stages). Since layers of other stages are ``nn.Identity`` on a rank, keys are disjoint across stages, and DCP
reshards DTensor (FSDP / TP) shards by name on load: a checkpoint saved under one plan loads under any other
plan, on any number of processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, **kw)


def model_state(module: nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options())


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=_options())


#: What a DCP ``.metadata`` file may name: DCP's own records, tensor sizes, dtypes and layouts, paths.
_DCP_METADATA_GLOBALS = {
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.",)


def check_dcp_metadata(folder: Path) -> None:
    """Refuse a DCP folder whose ``.metadata`` names anything but DCP's own records.

    torch's ``FileSystemReader`` reads ``.metadata`` with a plain ``pickle.load``, which runs any code a crafted
    file names; this reads it first with an unpickler that resolves only the globals DCP writes.
    """
    import io
    import pickle

    from uniap_lightning.errors import UniAPError

    class _Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            allowed = name in _DCP_METADATA_GLOBALS.get(module, ()) or module.startswith(_DCP_METADATA_MODULES)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                allowed = True
            if not allowed:
                raise pickle.UnpicklingError(f"{module}.{name} is not part of a distributed checkpoint's metadata")
            return super().find_class(module, name)

    path = Path(folder) / ".metadata"
    try:
        _Restricted(io.BytesIO(path.read_bytes())).load()
    except Exception as err:  # noqa: BLE001 - any failure means: not a checkpoint we will read
        raise UniAPError(f"{path}: refused to load this distributed checkpoint ({type(err).__name__}: {err}); "
                         "UniAP never runs code from a checkpoint file") from err


def load_plain(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True`` (tensors and plain data only), on the CPU; a file that needs more
    (pickled classes or functions, which could run code) is refused with a :class:`UniAPError`."""
    import pickle

    from uniap_lightning.errors import UniAPError

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UniAPError(f"{path}: refused to load: it holds pickled Python objects beyond tensors and plain data "
                         f"({first}). UniAP never runs code from a checkpoint file; re-save it with plain data.") from err
    except (OSError, RuntimeError, EOFError) as err:
        raise UniAPError(f"{path}: not a readable checkpoint file ({type(err).__name__}: {err})") from err


def load(path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], *, strict: bool = True) -> None:
    """Load weights (and optimizer states when ``optimizers`` is non-empty) in place from a DCP folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    check_dcp_metadata(path)
    state: dict[str, Any] = {"state_dict": model_state(module)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_state(module, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["state_dict"], options=_options(strict=strict))
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state[f"optimizer_{i}"], options=_options())


def load_full_weights(state_dict: dict[str, Any], module: nn.Module, *, strict: bool = True) -> None:
    """Load full (unsharded) weights, e.g. from a single-device checkpoint; each rank keeps its layers' part."""
    from uniap_lightning.errors import UniAPError
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    local = model_state(module)
    missing = sorted(set(local) - set(state_dict))
    if strict and missing:
        raise UniAPError(f"the checkpoint lacks {len(missing)} weights of this model, e.g. {missing[:3]}")
    mine = {k: v for k, v in state_dict.items() if k in local}
    set_model_state_dict(module, mine, options=_options(full_state_dict=True, strict=False))


@torch.no_grad()
def full_local_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU copies of this rank's state-dict entries (collective over each layer's mesh)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.detach().cpu().clone()
    return out


def save_consolidated(module: nn.Module, path: str | Path, *, rank: int) -> None:
    """Write every weight of the model, unsharded, into one ``torch.save`` file on rank 0 (collective)."""
    import torch.distributed as dist

    mine = full_local_state(module)
    parts: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.gather_object(mine, parts if rank == 0 else None, dst=0)
    if rank == 0:
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        save_atomic(merged, path)


def consolidate_checkpoint(checkpoint_dir: str | Path, output_file: str | Path) -> None:
    """Offline (one process, no process group): turn a DCP checkpoint folder into one file of full weights.

    torch's own ``dcp_to_torch_save`` reads the whole checkpoint (weights, optimizer states, loop state) into
    one ``torch.save`` file next to the output; the weights are then taken from it (loaded with
    ``weights_only=True``) and written to ``output_file`` through a temporary file and a rename.
    """
    import os
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    check_dcp_metadata(Path(checkpoint_dir))
    out = Path(output_file)
    fd, everything = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".all", dir=out.parent)
    os.close(fd)
    try:
        dcp_to_torch_save(str(checkpoint_dir), everything)
        weights = load_plain(Path(everything)).get("state_dict", {})
        save_atomic({k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}, out)
    finally:
        Path(everything).unlink(missing_ok=True)


def save_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save`` through :func:`~uniap_lightning.files.write_bytes_atomic`: readers never see half a file."""
    from uniap_lightning.files import write_bytes_atomic

    write_bytes_atomic(path, lambda f: torch.save(obj, f))


def save_published(final: Path, write: Any, *, lead: bool, barrier: Any, guard: Any) -> None:
    """Collective: ``write(folder)`` the checkpoint into a hidden ``.<name>.partial`` folder, then (``lead`` rank)
    rename it to ``final`` once every rank's part is on disk. A checkpoint under its real name is always complete
    (every shard, ``.metadata`` and ``meta.pt``), even if a rank is killed mid-write."""
    partial = partial_path(final)
    if lead:
        remove_path(partial)  # left by a run killed while writing
    barrier()
    guard(lambda: write(partial))
    barrier()
    if lead:
        publish(partial, final)
    barrier()


def partial_path(final: Path) -> Path:
    """Where a checkpoint is written before it is complete: hidden, next to its final name."""
    return final.with_name(f".{final.name}.partial")


def remove_path(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def publish(partial: Path, final: Path) -> None:
    """Give a complete checkpoint its real name; one already there is replaced (moved aside first, then deleted,
    so the real name never points at a half-written checkpoint)."""
    import os

    old = final.with_name(f".{final.name}.old")
    remove_path(old)
    if final.exists() or final.is_symlink():
        os.replace(final, old)
    os.replace(partial, final)
    remove_path(old)


def is_complete_checkpoint(path: Path) -> bool:
    """A distributed checkpoint folder this project published (or any with both DCP's and Lightning's metadata)."""
    return path.is_dir() and (path / ".metadata").is_file() and (path / "meta.pt").is_file()


def load_any(path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], *, guard: Any) -> dict[str, Any]:
    """Load a checkpoint saved under any plan (or by another strategy) into this rank's part of ``module``;
    returns what Lightning restores besides weights and optimizer states (loops, schedulers, callbacks).

    A distributed checkpoint folder restores weights and optimizer states, resharded by parameter name. A
    single-file Lightning checkpoint (one device, DDP) restores the weights but not the optimizer states, whose keys
    are positions in the original optimizer, not names. Nothing is unpickled beyond plain data (see
    :func:`load_plain`, :func:`check_dcp_metadata`), and both are refused before any weight is touched.
    """
    from lightning.fabric.utilities.load import _METADATA_FILENAME
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    from uniap_lightning.errors import UniAPError

    strict = getattr(module, "strict_loading", True)  # the LightningModule's choice
    if path.is_file():
        checkpoint = load_plain(path)
        load_full_weights(checkpoint["state_dict"], module, strict=strict)
        if checkpoint.pop("optimizer_states", None) and optimizers:
            rank_zero_warn(f"{path.name} is a single-file checkpoint: optimizer states start fresh under UniAP")
        return checkpoint
    if not (path / _METADATA_FILENAME).is_file():
        raise UniAPError(f"{path} is neither a checkpoint file nor a distributed checkpoint folder with "
                         f"{_METADATA_FILENAME}")
    check_dcp_metadata(path)
    metadata = load_plain(path / _METADATA_FILENAME)
    guard(lambda: load(path, module, optimizers, strict=strict))
    return metadata
