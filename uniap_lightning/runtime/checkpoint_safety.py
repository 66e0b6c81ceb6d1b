"""Reading a distributed checkpoint without running code from it, and telling a damaged one from a good one.

torch's distributed checkpoint (DCP) reader unpickles two kinds of bytes that a crafted checkpoint controls:

- ``.metadata``, read by ``FileSystemReader.read_metadata`` with a plain ``pickle.load``;
- every non-tensor entry of a shard (``BYTE_IO``: optimizer param-group values, loop state), read by
  ``DefaultLoadPlanner.load_bytes`` with ``torch.load(..., weights_only=False)``.

Either runs any code the file names. Here both go through restricted readers instead:

- :func:`read_metadata` resolves only the exact (module, name) pairs DCP writes (:data:`METADATA_GLOBALS`, plus
  torch's dtypes by name); a dotted name (pickle protocol 4 resolves ``"a.b"`` by attribute lookup, which reaches
  any import of an allowed module, e.g. ``os.system`` through ``torch.distributed.checkpoint.filesystem``) is
  refused whatever its module. The result is then checked field by field (:func:`check_metadata`): types, shard
  names that stay inside the folder, offsets and lengths;
- :class:`SafeReader` is a ``FileSystemReader`` that reads ``.metadata`` that way, and the planners
  :class:`SafeLoadPlanner` / :class:`SafeFullLoadPlanner` read ``BYTE_IO`` entries with ``weights_only=True``.

Tensor entries were already read by torch with ``weights_only=True``; ``meta.pt``, single-file checkpoints and
the compressors' state files go through :func:`load_plain` (same).

:func:`checkpoint_problem` says, without loading any weight, why a folder is not a usable checkpoint (metadata
refused, a shard missing or shorter than the metadata says, ``meta.pt`` unreadable or with impossible loop
counters), so a resume can name the damage (or skip to an older checkpoint) before any rank starts loading.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorStorageMetadata)

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import check_regular_file, read_bytes
from uniap_lightning.sigterm import reraise_interruption

#: Every global a DCP ``.metadata`` (torch 2.6-2.13) names, as exact (module, qualified name) pairs.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
})

#: A ``.metadata`` larger than this is not one DCP wrote for a model of any size we plan (it holds a few hundred
#: bytes per tensor shard).
MAX_METADATA_BYTES = 512 * 1024 * 1024

#: Loop counters in ``meta.pt`` above this are not steps any run took (2**53: still exact as a float).
MAX_COUNTER = 2**53


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if "." in name:
            raise pickle.UnpicklingError(f"the dotted global {module}:{name} (an attribute path) is never written by "
                                         "a distributed checkpoint")
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a distributed checkpoint's metadata")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are never written in a distributed checkpoint's metadata")


def read_metadata(folder: Path, *, rank: int | None = None) -> Any:
    """The checked ``Metadata`` of a DCP folder; a :class:`UniAPError` naming the file for anything else."""
    name = ".metadata" if rank is None else f"__{rank}.metadata"
    path = Path(folder) / name
    data = read_bytes(path, "the checkpoint metadata", limit_bytes=MAX_METADATA_BYTES)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        check_metadata(metadata)
    except UniAPError as err:
        raise UniAPError(f"{path}: refused to load this distributed checkpoint ({err}); UniAP never runs code from "
                         "a checkpoint file") from err
    except Exception as err:  # noqa: BLE001 - any failure means: not a checkpoint we will read
        raise UniAPError(f"{path}: refused to load this distributed checkpoint ({type(err).__name__}: {err}); "
                         "UniAP never runs code from a checkpoint file") from err
    return metadata


def _nonneg_int(value: Any, what: str) -> None:
    if type(value) is not int or value < 0:
        raise UniAPError(f"{what} is {value!r}, not a non-negative integer")


def _sizes(value: Any, what: str) -> None:
    if not isinstance(value, torch.Size):
        raise UniAPError(f"{what} is a {type(value).__name__}, not a torch.Size")
    for n in value:
        _nonneg_int(n, what)


def check_metadata(metadata: Any) -> None:
    """Every field of an unpickled DCP ``Metadata`` has the type and range torch's reader relies on; shard files
    are plain names inside the checkpoint folder (no path separators, no ``..``)."""
    if type(metadata) is not Metadata:
        raise UniAPError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise UniAPError("state_dict_metadata is not a mapping")
    for key, entry in entries.items():
        if type(key) is not str:
            raise UniAPError(f"the entry name {key!r} is not a string")
        if type(entry) is TensorStorageMetadata:
            if not isinstance(entry.properties.dtype, torch.dtype):
                raise UniAPError(f"{key}: the dtype is not a torch dtype")
            _sizes(entry.size, f"{key}: the size")
            if not isinstance(entry.chunks, list):
                raise UniAPError(f"{key}: the chunk list is not a list")
            for chunk in entry.chunks:
                _sizes(chunk.offsets, f"{key}: a chunk's offsets")
                _sizes(chunk.sizes, f"{key}: a chunk's sizes")
                if len(chunk.offsets) != len(entry.size) or len(chunk.sizes) != len(entry.size) or any(
                        o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size)):
                    raise UniAPError(f"{key}: a chunk lies outside the tensor's size {list(entry.size)}")
        elif type(entry) is not BytesStorageMetadata:
            raise UniAPError(f"{key}: a {type(entry).__name__} is not a storage record")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UniAPError("storage_data is not a mapping")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            raise UniAPError("a storage key is not DCP's MetadataIndex")
        if type(info) is not _StorageInfo:
            raise UniAPError(f"{index.fqn}: a {type(info).__name__} is not DCP's storage record")
        name = info.relative_path
        if type(name) is not str or not name or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
            raise UniAPError(f"{index.fqn}: the shard name {name!r} is not a file name inside the checkpoint folder")
        _nonneg_int(info.offset, f"{index.fqn}: the offset")
        _nonneg_int(info.length, f"{index.fqn}: the length")
        descriptors = info.transform_descriptors
        if descriptors is not None and not (isinstance(descriptors, (list, tuple))
                                            and all(type(d) is str for d in descriptors)):
            raise UniAPError(f"{index.fqn}: the transform descriptors are not a list of names")


def load_bytes_entry(read_item: Any, value: io.BytesIO) -> Any:
    """A ``BYTE_IO`` entry of a shard (plain data such as a param group's ``lr`` or ``betas``), read with
    ``weights_only=True``: a pickle that names code is refused with an error naming the entry."""
    fqn = read_item.dest_index.fqn
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UniAPError(f"the checkpoint entry {fqn!r} holds pickled Python objects beyond plain data ({first}); "
                         "UniAP never runs code from a checkpoint file") from err
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        reraise_interruption(err)
        raise UniAPError(f"the checkpoint entry {fqn!r} is damaged ({type(err).__name__}: {err})") from err


def _readers() -> tuple[type, type, type]:
    """The classes (built on first use: torch.distributed.checkpoint is a heavy import)."""
    global _CLASSES
    if _CLASSES is None:
        class SafeReader(FileSystemReader):
            """``FileSystemReader`` whose ``.metadata`` goes through :func:`read_metadata`."""

            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                metadata = read_metadata(Path(self.path), rank=kwargs.get("rank"))
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata

        class SafeLoadPlanner(DefaultLoadPlanner):
            """``DefaultLoadPlanner`` whose non-tensor entries are read with ``weights_only=True``."""

            def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
                _store_bytes(self, read_item, load_bytes_entry(read_item, value))

        class SafeFullLoadPlanner(_EmptyStateDictLoadPlanner):
            """Loads a whole checkpoint into an empty state dict (offline consolidation), safely as above."""

            def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
                _store_bytes(self, read_item, load_bytes_entry(read_item, value))

        _CLASSES = (SafeReader, SafeLoadPlanner, SafeFullLoadPlanner)
    return _CLASSES


_CLASSES: tuple[type, type, type] | None = None


def _store_bytes(planner: Any, read_item: Any, value: Any) -> None:
    """Where ``DefaultLoadPlanner.load_bytes`` puts a loaded value (flattened or not)."""
    fqn = read_item.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


def safe_reader(folder: str | Path) -> Any:
    return _readers()[0](folder)


def safe_load_planner(**kw: Any) -> Any:
    return _readers()[1](**kw)


def safe_full_load_planner(**kw: Any) -> Any:
    return _readers()[2](**kw)


# ---------------------------------------------------------------------------------------------------- integrity
def shard_problem(folder: Path, metadata: Any) -> str | None:
    """Why the shards do not hold what ``metadata`` says (a shard missing, not a file, or shorter than the last
    byte an entry needs), or ``None``. Reads sizes only."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        path = folder / name
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return f"the shard {name} is missing"
        except OSError as err:
            return f"the shard {name} cannot be read ({err.strerror or err})"
        if not stat.S_ISREG(info.st_mode):
            return f"the shard {name} is not a regular file"
        if info.st_size < end:
            return f"the shard {name} is truncated ({info.st_size} bytes, the metadata needs {end})"
    return None


def check_meta(meta: Any, path: Path, *, require_loops: bool = True) -> None:
    """``meta.pt``: Lightning's loop state, as this project's checkpoints write it. The step and epoch are
    non-negative integers below :data:`MAX_COUNTER`, every counter under ``loops`` too, and the fit loop's record of
    optimizer steps agrees with ``global_step`` (a resume would otherwise silently restart from another position)."""
    if not isinstance(meta, dict):
        raise UniAPError(f"{path}: holds a {type(meta).__name__}, not a checkpoint's loop state")
    for key in ("global_step", "epoch"):
        value = meta.get(key)
        if type(value) is not int or not 0 <= value < MAX_COUNTER:
            raise UniAPError(f"{path}: {key} is {_short(value)}, not a step count (an integer from 0)")
    loops = meta.get("loops")
    if loops is None and not require_loops:
        return
    if not isinstance(loops, dict) or not isinstance(loops.get("fit_loop"), dict):
        raise UniAPError(f"{path}: the loop state (loops.fit_loop) is missing or not Lightning's: a resume would "
                         "restart the data at step 0")
    _check_counters(loops, f"{path}: loops")
    steps = _optimizer_steps(loops)
    if steps is None:
        raise UniAPError(f"{path}: the fit loop's count of optimizer steps is missing: a resume would restart at "
                         "step 0")
    if steps != meta["global_step"]:
        raise UniAPError(f"{path}: the fit loop counts {steps} optimizer steps but global_step is "
                         f"{meta['global_step']}: the loop state was altered")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _check_counters(tree: Any, where: str, depth: int = 0) -> None:
    if depth > 32:
        raise UniAPError(f"{where}: nested deeper than Lightning's loop state")
    if isinstance(tree, dict):
        for key, value in tree.items():
            _check_counters(value, f"{where}.{key}", depth + 1)
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            _check_counters(value, f"{where}[{i}]", depth + 1)
    elif type(tree) is int and not 0 <= tree < MAX_COUNTER:
        raise UniAPError(f"{where} is {_short(tree)}, not a count of steps or batches")


def _optimizer_steps(loops: dict[str, Any]) -> int | None:
    """Completed optimizer steps as the fit loop recorded them (Lightning 2.x: automatic optimization counts in
    ``optim_progress.optimizer.step``, manual in ``optim_step_progress``; the other stays 0), or None if absent."""
    fit = loops["fit_loop"]
    auto = _dig(fit, "epoch_loop.automatic_optimization.optim_progress", "optimizer", "step", "total", "completed")
    manual = _dig(fit, "epoch_loop.manual_optimization.optim_step_progress", "total", "completed")
    found = [n for n in (auto, manual) if type(n) is int]
    return sum(found) if found else None


def _dig(tree: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(tree, dict):
            return None
        tree = tree.get(key)
    return tree


def load_plain(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True`` (tensors and plain data only), on the CPU; a file that needs more
    (pickled classes or functions, which could run code) is refused with a :class:`UniAPError`, and so is a file
    that is damaged or not a regular file."""
    path = check_regular_file(Path(path), "the checkpoint file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UniAPError(f"{path}: refused to load: it holds pickled Python objects beyond tensors and plain data "
                         f"({first}). UniAP never runs code from a checkpoint file; re-save it with plain data.") from err
    except (OSError, RuntimeError, EOFError, ValueError, MemoryError, OverflowError) as err:
        reraise_interruption(err)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UniAPError(f"{path}: not a readable checkpoint file ({type(err).__name__}: {first})") from err


def checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a usable distributed checkpoint (one line, without the folder's name), or None.
    Reads the metadata (restricted), the shards' sizes and ``meta.pt`` (plain data); no weights."""
    folder = Path(folder)
    if not folder.is_dir():
        return "it is not a folder"
    try:
        metadata = read_metadata(folder)
    except UniAPError as err:
        return str(err).replace(f"{folder / '.metadata'}: ", "the metadata: ", 1)
    problem = shard_problem(folder, metadata)
    if problem is not None:
        return problem
    try:
        check_meta(load_plain(folder / "meta.pt"), folder / "meta.pt")
    except UniAPError as err:
        return str(err).replace(f"{folder / 'meta.pt'}", "meta.pt", 1)
    return None
