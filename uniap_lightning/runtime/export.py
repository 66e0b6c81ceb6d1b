"""Full weights written for other programs to load: one safetensors file (the default), one ``torch.save`` file,
or a Hugging Face folder (``config.json`` + ``model.safetensors``) that ``AutoModelFor...from_pretrained`` loads.

Callers: :meth:`UniAPStrategy.save_consolidated <uniap_lightning.strategy.UniAPStrategy.save_consolidated>` (live,
every rank), :func:`~uniap_lightning.runtime.checkpoint.consolidate_checkpoint` (offline) and ``uniap export``.
Every file is written atomically; a Hugging Face folder is written into a hidden sibling folder with a unique name,
removed on any failure (an interrupt included), and renamed into place when complete; it only replaces a folder that
holds nothing but an earlier export's files. A destination that cannot be written (a missing or read-only folder, a
path below a file, something other than a folder under the name) is refused before the work.

A ``config.json`` given by the user (``uniap export --hf-config``) is hostile input: it is read through the bounded
reader of :mod:`uniap_lightning.files` (size, nesting, integer digits), must be a regular file in the folder (the Hub
cache's links to its blobs excepted), names a model type transformers knows, has positive and bounded sizes no
larger than the checkpoint's weights, and its ``architectures`` may only name a model class that transformers' auto
mappings register for that model type. Every failure is one :class:`~uniap_lightning.errors.UniAPError` naming the
file.

The checks of that file are :mod:`.export_config` (its names are importable from here too).
"""

from __future__ import annotations

import copy
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import check_output_file, check_output_folder, write_bytes_atomic
from uniap_lightning.runtime.export_config import (
    LAYER_COUNTS,
    MAX_CONFIG_SIZE,
    MAX_STAGES,
    SIZE_FIELDS,
    WEIGHT_DIMENSIONS,
    _first_line,
    _from_file,
    _quiet_transformers,
    check_config_against_weights,
    check_config_sizes,
    config_source,
    load_hf_config,
    model_class_of,
    model_classes_for,
)

__all__ = [
    "FORMATS", "HF_FILES", "LAYER_COUNTS", "MAX_CONFIG_SIZE", "MAX_STAGES", "SIZE_FIELDS", "TORCH_SUFFIXES",
    "WEIGHT_DIMENSIONS", "check_config_against_weights", "check_config_sizes", "check_destination", "config_source",
    "find_hf_model", "hf_weights", "load_hf_config", "model_class_of", "model_classes_for", "resolve_format",
    "write_hf_folder", "write_weights",
]

FORMATS = ("safetensors", "torch", "hf")
#: a path with one of these suffixes is written with ``torch.save`` when no format is given
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
#: what a Hugging Face export folder may hold (an existing folder with anything else is not replaced)
HF_FILES = {"config.json", "generation_config.json", "model.safetensors"}


def resolve_format(path: str | Path, format: str | None) -> str:
    """``format``, or from the suffix when ``None``: ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt`` -> torch, else
    safetensors."""
    if format is None:
        return "torch" if Path(path).suffix.lower() in TORCH_SUFFIXES else "safetensors"
    if format not in FORMATS:
        raise UniAPError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    return format


def write_weights(state: dict[str, torch.Tensor], path: str | Path, fmt: str) -> Path:
    """One file of full weights (``fmt``: ``safetensors`` or ``torch``), written atomically."""
    if fmt not in ("safetensors", "torch"):
        raise UniAPError(f"write_weights writes safetensors or torch files, not {fmt!r}")
    check_destination(path, fmt)
    if fmt == "torch":
        def write(f: Any) -> None:
            torch.save(state, f)
    else:
        data = _safetensors_bytes(state)

        def write(f: Any) -> None:
            f.write(data)
    try:
        return write_bytes_atomic(path, write, what="weights file")
    except OSError as err:  # the folder turned read-only, the disk is full: the temporary file is already removed
        raise UniAPError(f"weights file {str(path)!r} cannot be written ({err.strerror or err}); choose a writable "
                         "folder with free space") from None


def _safetensors_bytes(state: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    # own contiguous storage per entry (safetensors refuses tensors that share memory)
    plain = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    return save(plain, metadata={"format": "pt"})  # "pt": what from_pretrained expects


# ------------------------------------------------------------------------------------------ Hugging Face folders
def find_hf_model(module: nn.Module) -> tuple[str, Any]:
    """The outermost Hugging Face ``PreTrainedModel`` inside ``module`` and its state-dict prefix (``"model."``)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        raise UniAPError("format='hf' needs transformers (pip install 'uniap-lightning[hf]')") from None
    if isinstance(module, PreTrainedModel):
        return "", module
    for name, m in module.named_modules():
        if isinstance(m, PreTrainedModel):
            return f"{name}.", m
    raise UniAPError(f"format='hf' needs a Hugging Face model (a transformers PreTrainedModel) inside "
                     f"{type(module).__name__}; none found: use format='safetensors' or 'torch'")


def _blank(model_class: type, config: Any) -> nn.Module:
    """An instance on the meta device (no memory, no weights drawn), with the class's own weight tying. A config the
    class cannot be built from (heads that do not divide the width, ...) is one error naming the config."""
    try:
        with _quiet_transformers(), torch.device("meta"):
            return model_class(config)
    except Exception as err:  # noqa: BLE001 - any failure of the user's config in the class's __init__
        raise UniAPError(f"{config_source(config)}: {model_class.__name__} cannot be built from it "
                         f"({_first_line(err)}); fix the config or give the folder the run started from") from None


def hf_weights(model_class: type, config: Any, state: dict[str, torch.Tensor], prefix: str | None = None
               ) -> dict[str, torch.Tensor]:
    """``state`` (the LightningModule's keys) as ``model_class``'s own state dict: the prefix removed (found when
    ``None``), each tied weight once (under the name ``from_pretrained`` keeps); a missing or misshaped weight is
    refused."""
    blank = _blank(model_class, config)
    own = blank.state_dict()
    seen: dict[int, str] = {}
    keep = []
    for name, p in blank.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen[id(p)] = name
            keep.append(name)
    tied = {n for n, _ in blank.named_parameters(remove_duplicate=False)} - set(keep)
    names = [k for k in own if k not in tied]
    if prefix is None:
        prefix = _prefix(names, state, config)
    out = {}
    for k in names:
        v = state.get(prefix + k)
        if v is None:
            raise UniAPError(f"{_from_file(config)}the weights have no {prefix + k!r} for {model_class.__name__}.{k} "
                             "(a checkpoint of another model?)")
        if tuple(v.shape) != tuple(own[k].shape):
            raise UniAPError(f"{_from_file(config)}{prefix + k!r} is {tuple(v.shape)}, {model_class.__name__}.{k} is "
                             f"{tuple(own[k].shape)}")
        out[k] = v
    return out


def _prefix(names: list[str], state: dict[str, torch.Tensor], config: Any = None) -> str:
    """The prefix under which the model's keys appear in ``state`` (the LightningModule attribute + ``.``)."""
    probe = max(names, key=len)
    for k in state:
        if k.endswith(probe) and (len(k) == len(probe) or k[-len(probe) - 1] == "."):
            return k[: len(k) - len(probe)]
    raise UniAPError(f"{_from_file(config)}the weights do not hold this model's {probe!r} under any prefix (a "
                     "checkpoint of another model?)")


def write_hf_folder(folder: str | Path, model_class: type, config: Any, state: dict[str, torch.Tensor], *,
                    prefix: str | None = None, generation_config: Any = None) -> Path:
    """A folder ``model_class.from_pretrained(folder)`` loads: ``config.json`` and ``model.safetensors``.

    The destination is checked first (:func:`check_destination`), the config against the weights (sizes no larger
    than the checkpoint's, then every weight's shape), then everything is written into a new hidden sibling folder
    that is renamed into place; on any failure (an interrupt included) that folder is removed and the destination
    is left as it was."""
    final = check_destination(folder, "hf")
    check_config_against_weights(config, state)
    weights = hf_weights(model_class, config, state, prefix)
    data = _safetensors_bytes(weights)
    config = copy.deepcopy(config)
    config.architectures = [model_class.__name__]  # what AutoModelFor... and `uniap export` read back
    tmp = _new_sibling_folder(final)
    try:
        with _quiet_transformers():
            config.save_pretrained(tmp)
            if generation_config is not None:
                generation_config.save_pretrained(tmp)
        (tmp / "model.safetensors").write_bytes(data)
        _publish_folder(tmp, final)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise UniAPError(f"Hugging Face folder {str(final)!r} cannot be written ({err.strerror or err}); choose "
                             "a writable folder with free space") from None
        raise
    return final


def check_destination(path: str | Path, fmt: str) -> Path:
    """Refuse, before any work, a destination the export cannot write, with one :class:`UniAPError`: for a file
    (``safetensors`` / ``torch``) see :func:`~uniap_lightning.files.check_output_file`; for a Hugging Face folder
    a name that exists and is not a folder (or is a link), a missing folder or one below a file, a parent folder
    that cannot be written (read-only, immutable, read-only file system), or an earlier export that cannot be
    replaced (other files in it, or an immutable folder)."""
    path = Path(path)
    if fmt != "hf":
        return check_output_file(path, "weights file")
    what = "Hugging Face folder"
    check_output_folder(path, what)  # a file under the name or above it
    parent = path.absolute().parent
    if not parent.is_dir():
        raise UniAPError(f"{what} {str(path)!r}: the folder {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UniAPError(f"{what} {str(path)!r}: the folder {str(parent)!r} is not writable (read-only or "
                         "immutable); choose a writable folder")
    _check_replaceable(path)
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        raise UniAPError(f"{what} {str(path)!r} exists and cannot be replaced (read-only or immutable); give a new "
                         "name")
    return path


def _new_sibling_folder(final: Path) -> Path:
    """A new empty hidden folder next to ``final`` (same file system, so the final rename is atomic), its name
    unique so that two exports to one name never write into each other's folder."""
    for _ in range(100):
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(4)}.partial")
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue
        except OSError as err:
            raise UniAPError(f"Hugging Face folder {str(final)!r} cannot be written: no folder can be made in "
                             f"{str(final.parent)!r} ({err.strerror or err}); choose a writable folder") from None
    raise UniAPError(f"Hugging Face folder {str(final)!r}: no unused temporary name in {str(final.parent)!r}")


def _publish_folder(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``; an earlier export there is moved aside first and deleted after,
    or put back if the rename fails (the real name never shows half an export)."""
    old = None
    if final.is_dir() and not final.is_symlink():
        old = tmp.with_name(tmp.name.removesuffix(".partial") + ".old")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_replaceable(final: Path) -> None:
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise UniAPError(f"{final} exists and is not a folder: a Hugging Face export is a folder; give a new name")
    if final.is_dir():
        others = sorted(p.name for p in final.iterdir() if p.name not in HF_FILES)
        if others:
            raise UniAPError(f"{final} holds files an export does not write ({', '.join(others[:3])}): not replaced; "
                             "give a new or empty folder")
