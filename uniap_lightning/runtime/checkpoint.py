"""Distributed checkpoints that survive a change of plan, and a consolidated single-file export.

Saving writes torch.distributed.checkpoint (DCP) shards keyed by parameter name: ``state_dict.<fqn>`` for the
weights and ``optimizer_<i>.state.<fqn>.<key>`` / ``optimizer_<i>.param_groups.<fqn>.<key>`` for the optimizers
(``flatten_optimizer_state_dict=True``; the nested form loses param-group hyper-parameters on some pipeline
stages). Since layers of other stages are ``nn.Identity`` on a rank, keys are disjoint across stages, and DCP
reshards DTensor (FSDP / TP) shards by name on load: a checkpoint saved under one plan loads under any other
plan, on any number of processes. Expert-parallel shards (plain tensors holding ``E / ep`` experts) are handed to DCP
as DTensors sharded on dim 0 over their ep mesh (:func:`~.experts.globalize_expert_state`), so a checkpoint holds the
full experts and their optimizer states and loads under any ep degree. A weight that torchao wraps for float8
all-gather (``precision`` fp8 under ZeRO-3) is handed over as the full-precision tensor inside it
(:func:`plain_weights`): checkpoints hold plain tensors whatever the plan's precision.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor

from uniap_lightning.runtime.checkpoint_safety import load_plain  # noqa: F401 - also imported from here
from uniap_lightning.errors import UniAPError
from uniap_lightning.files import check_output_file, write_bytes_atomic
from uniap_lightning.runtime import export
from uniap_lightning.runtime.checkpoint_safety import (check_meta, read_metadata, safe_full_load_planner,
                                                       safe_load_planner, safe_reader, shard_problem)
from uniap_lightning.runtime.experts import (expert_shard_meshes, globalize_expert_state, localize_expert_state,
                                             shard_expert_state)
from uniap_lightning.sigterm import reraise_interruption


def _options(**kw: Any) -> Any:
    return StateDictOptions(flatten_optimizer_state_dict=True, **kw)


def model_state(module: nn.Module) -> dict[str, Any]:
    """The module's state dict for DCP; expert-parallel shards as ``DTensor`` s of the full experts."""
    state = get_model_state_dict(module, options=_options())
    globalize_expert_state(state, expert_shard_meshes(module))
    return plain_weights(state)


def _plain(t: Any) -> Any:
    if isinstance(t, DTensor):
        local = t._local_tensor
        inner = _plain(local)
        return t if inner is local else DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False,
                                                             shape=t.shape, stride=t.stride())
    inner = getattr(t, "_tensor", None)  # torchao's WeightWithDynamicFloat8CastTensor: the weight it wraps
    return inner if type(t) is not torch.Tensor and type(inner) is torch.Tensor else t


def plain_weights(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor subclass that wraps a plain tensor (torchao's float8 all-gather weights)
    replaced by that tensor, the same storage (so loading into it loads the weight): DCP then writes and reads
    plain tensors (a subclass would be pickled, and the safe reader refuses pickles)."""
    return {k: _plain(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's flattened state dict for DCP; expert-parallel shards' states as ``DTensor`` s."""
    state = get_optimizer_state_dict(module, optimizer, options=_options())
    globalize_expert_state(state, expert_shard_meshes(module), optimizer=True)
    return state


def check_dcp_metadata(folder: Path) -> None:
    """Refuse a DCP folder whose ``.metadata`` names anything but DCP's own records, or whose records are not
    well formed (see :func:`~uniap_lightning.runtime.checkpoint_safety.read_metadata`): nothing in it runs."""
    read_metadata(Path(folder))


def _first_failure(err: BaseException) -> BaseException:
    """The first rank's exception inside DCP's ``CheckpointException`` (else ``err``)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return err


def dcp_read(state: dict[str, Any], path: Path, *, planner: Any, no_dist: bool = False, whole: bool = False) -> None:
    """``dcp.load`` through the safe reader and ``planner``; whatever fails while reading (a shard with bad bytes,
    an entry that names code) is one :class:`UniAPError` that names the checkpoint, on every rank. ``whole``: fill
    an empty ``state`` with everything in the checkpoint (``dcp.load`` would fill a copy; torch's own
    ``dcp_to_torch_save`` calls the loader underneath for this, and so does this)."""
    try:
        if whole:
            _load_state_dict(state, storage_reader=safe_reader(path), planner=planner, no_dist=no_dist)
        else:
            dcp.load(state, storage_reader=safe_reader(path), planner=planner, no_dist=no_dist)
    except (CheckpointException, Exception) as err:  # noqa: BLE001 - CheckpointException is a BaseException
        reraise_interruption(err)  # SIGTERM or Ctrl-C mid-read: the checkpoint is fine, the run was stopped
        cause = _first_failure(err)
        if isinstance(cause, UniAPError):
            raise UniAPError(f"checkpoint {path}: {cause}") from cause
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
        raise UniAPError(f"checkpoint {path} is damaged ({type(cause).__name__}: {first}); use an older "
                         "checkpoint") from cause


def load(path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer], *, strict: bool = True) -> None:
    """Load weights (and optimizer states when ``optimizers`` is non-empty) in place from a DCP folder: the
    checkpoint is checked against this model first (:func:`check_fits`), then read without running code."""
    metadata = checked_metadata(path)
    state: dict[str, Any] = {"state_dict": model_state(module)}
    for i, opt in enumerate(optimizers):
        state[f"optimizer_{i}"] = optimizer_state(module, opt)
    check_fits(path, metadata, state, strict=strict)
    dcp_read(state, path, planner=safe_load_planner())
    meshes = expert_shard_meshes(module)
    localize_expert_state(state["state_dict"], meshes)
    for i in range(len(optimizers)):
        localize_expert_state(state[f"optimizer_{i}"], meshes, optimizer=True)
    set_model_state_dict(module, state["state_dict"], options=_options(strict=strict))
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state[f"optimizer_{i}"], options=_options())


def checked_metadata(path: Path) -> Any:
    """The checkpoint's DCP metadata, refused if it names code and reported as damaged if a shard is missing or
    shorter than the metadata says."""
    metadata = read_metadata(Path(path))
    problem = shard_problem(Path(path), metadata)
    if problem is not None:
        raise UniAPError(f"checkpoint {path} is damaged: {problem}; use an older checkpoint")
    return metadata


def _flat_shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """DCP's flattened key of every entry of ``state`` -> its global shape (None for non-tensors)."""
    flat, _ = flatten_state_dict(state)
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in flat.items()}


def check_fits(path: Path, metadata: Any, state: dict[str, Any], *, strict: bool) -> None:
    """Refuse, on every rank alike and before any weight is read, a checkpoint of another model: weights this
    model has and the checkpoint lacks (``strict``), weights of other shapes, weights the checkpoint has that no
    rank's part of this model has (another layer count), optimizer states of another optimizer. Collective when
    a process group is up (each rank knows only its stages' names)."""
    saved = metadata.state_dict_metadata
    mine = _flat_shapes(state)
    parts: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    wanted: dict[str, tuple[int, ...] | None] = {}
    for part in parts:
        wanted.update(part)
    problems = []
    missing = sorted(k for k in wanted if k not in saved and (strict or not k.startswith("state_dict.")))
    if missing:
        problems.append(f"{len(missing)} entries of this model are not in it (e.g. {', '.join(missing[:3])})")
    extra = sorted(k for k in saved if k.startswith("state_dict.") and k not in wanted)
    if extra and strict:
        problems.append(f"{len(extra)} weights in it are not in this model (e.g. {', '.join(extra[:3])})")
    shapes = []
    for key, shape in sorted(wanted.items()):
        entry = saved.get(key)
        size = getattr(entry, "size", None)
        if shape is not None and size is not None and tuple(size) != shape:
            shapes.append(f"{key}: saved {list(size)}, this model {list(shape)}")
    if shapes:
        problems.append(f"{len(shapes)} shapes differ (e.g. {'; '.join(shapes[:2])})")
    if problems:
        raise UniAPError(f"checkpoint {path} does not fit this model: {'; '.join(problems)}. Was it saved from "
                         "another model or configuration (layer count, sizes, sequence length, optimizer)?")


def load_full_weights(state_dict: dict[str, Any], module: nn.Module, *, strict: bool = True,
                      path: Path | None = None) -> None:
    """Load full (unsharded) weights, e.g. from a single-device checkpoint; each rank keeps its layers' part.
    Missing weights (``strict``) and weights of another shape are one :class:`UniAPError` before any is copied."""
    where = f"checkpoint {path}" if path is not None else "the checkpoint"
    local = model_state(module)  # expert shards as DTensors of the full experts: shapes compare with full ones
    missing = sorted(set(local) - set(state_dict))
    if strict and missing:
        raise UniAPError(f"{where} lacks {len(missing)} weights of this model, e.g. {missing[:3]}")
    mine = {k: v for k, v in state_dict.items() if k in local}
    shapes = [f"{k}: saved {list(v.shape)}, this model {list(local[k].shape)}" for k, v in sorted(mine.items())
              if isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(local[k].shape)]
    bad = sorted(k for k, v in mine.items() if not isinstance(v, torch.Tensor))
    if shapes or bad:
        what = f"{len(shapes)} shapes differ (e.g. {'; '.join(shapes[:2])})" if shapes else f"{bad[:3]} are not tensors"
        raise UniAPError(f"{where} does not fit this model: {what}")
    for key, (layout, _) in expert_shard_meshes(module).items():  # this rank's ep block of the full experts
        if key in mine:
            mine[key] = shard_expert_state(mine, [key], ep=layout.size(0), index=layout.get_local_rank(0))[key]
    set_model_state_dict(module, mine, options=_options(full_state_dict=True, strict=False))


@torch.no_grad()
def full_local_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU copies of this rank's state-dict entries (collective over each layer's mesh)."""
    state = module.state_dict(keep_vars=True)
    globalize_expert_state(state, expert_shard_meshes(module))  # experts gathered over their ep mesh
    out = {}
    for name, t in state.items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[name] = full.detach().cpu().clone()
    return out


def save_consolidated(module: nn.Module, path: str | Path, *, rank: int, format: str | None = None) -> None:
    """Write every weight of the model, unsharded, on rank 0 (collective): one safetensors file (default), one
    ``torch.save`` file (``format="torch"``, or a ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt`` path with no format), or
    a Hugging Face folder (``format="hf"``: ``config.json`` + ``model.safetensors`` that the model's class loads with
    ``from_pretrained``). See :mod:`uniap_lightning.runtime.export`."""
    fmt = export.resolve_format(path, format)
    found = export.find_hf_model(module) if fmt == "hf" else None  # before any collective: every rank alike
    mine = full_local_state(module)
    parts: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.gather_object(mine, parts if rank == 0 else None, dst=0)
    if rank == 0:
        merged: dict[str, torch.Tensor] = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        if found is not None:
            prefix, model = found
            export.write_hf_folder(path, type(model), model.config, merged, prefix=prefix,
                                   generation_config=getattr(model, "generation_config", None))
        else:
            export.write_weights(merged, path, fmt)


def consolidate_checkpoint(checkpoint_dir: str | Path, output_file: str | Path, *, format: str | None = None,
                           hf_config: str | Path | None = None) -> None:
    """Offline (one process, no process group): turn a DCP checkpoint folder into full weights: one safetensors
    file (default), one ``torch.save`` file (``format="torch"`` or a ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt``
    name), or a Hugging Face folder (``format="hf"``, with ``hf_config``: the folder of the model the run started
    from, whose ``config.json`` is copied).

    The whole checkpoint is read into memory through the same safe reader as a resume (no pickle that names code
    is loaded, from ``.metadata`` or from any entry of a shard), then its weights are written through a temporary
    file (or folder) and a rename.
    """
    fmt = export.resolve_format(output_file, format)
    config = None
    if fmt == "hf":
        if hf_config is None:
            raise UniAPError("format='hf' needs hf_config: the folder of the Hugging Face model the run started from "
                             "(its config.json is copied next to the weights)")
        config = export.load_hf_config(hf_config)
        model_class = export.model_class_of(config)
    elif hf_config is not None:
        raise UniAPError(f"hf_config is for format='hf' only (the format here is {fmt!r})")
    folder = Path(checkpoint_dir)
    checked_metadata(folder)
    out = Path(output_file) if fmt == "hf" else check_output_file(output_file, "output file")
    everything: dict[str, Any] = {}
    dcp_read(everything, folder, planner=safe_full_load_planner(), no_dist=True, whole=True)
    weights = {k: v for k, v in everything.get("state_dict", {}).items() if isinstance(v, torch.Tensor)}
    if config is not None:
        export.write_hf_folder(out, model_class, config, weights)
    else:
        export.write_weights(weights, out, fmt)


def save_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save`` through :func:`~uniap_lightning.files.write_bytes_atomic`: readers never see half a file."""
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
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def publish(partial: Path, final: Path) -> None:
    """Give a complete checkpoint its real name; one already there is replaced (moved aside first, then deleted,
    so the real name never points at a half-written checkpoint)."""
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

    strict = getattr(module, "strict_loading", True)  # the LightningModule's choice
    if path.is_file():
        checkpoint = load_plain(path)
        if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
            raise UniAPError(f"{path}: not a Lightning checkpoint (no state_dict of weights)")
        check_meta(checkpoint, path, require_loops=False)
        load_full_weights(checkpoint["state_dict"], module, strict=strict, path=path)
        if checkpoint.pop("optimizer_states", None) and optimizers:
            rank_zero_warn(f"{path.name} is a single-file checkpoint: optimizer states start fresh under UniAP")
        return checkpoint
    if not (path / _METADATA_FILENAME).is_file():
        raise UniAPError(f"{path} is neither a checkpoint file nor a distributed checkpoint folder with "
                         f"{_METADATA_FILENAME}")
    checked_metadata(path)
    metadata = load_plain(path / _METADATA_FILENAME)
    check_meta(metadata, path / _METADATA_FILENAME)
    guard(lambda: load(path, module, optimizers, strict=strict))
    return metadata
