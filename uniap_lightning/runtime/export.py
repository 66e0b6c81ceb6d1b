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
"""

from __future__ import annotations

import copy
import os
import secrets
import shutil
import stat
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from uniap_lightning.errors import UniAPError

FORMATS = ("safetensors", "torch", "hf")
#: a path with one of these suffixes is written with ``torch.save`` when no format is given
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
#: what a Hugging Face export folder may hold (an existing folder with anything else is not replaced)
HF_FILES = {"config.json", "generation_config.json", "model.safetensors"}
#: the largest size a config field may hold (vocabularies, widths, layer counts, positions): 16 M, past any real model
MAX_CONFIG_SIZE = 2**24
#: the longest per-stage list a size field may hold (Swin's ``num_heads``: one per stage)
MAX_STAGES = 64
#: config fields that are sizes (a positive integer, or absent / null), under their own names or transformers' aliases
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_inner",
               "n_positions", "n_ctx", "d_model", "d_ff", "num_layers", "num_heads", "num_decoder_layers",
               "encoder_layers", "decoder_layers", "ffn_dim")
#: sizes that are a dimension of some weight (an embedding's rows, a layer's width): at most the largest one
WEIGHT_DIMENSIONS = ("vocab_size", "hidden_size", "d_model")
#: counts of layers: each layer holds at least one weight, so at most the number of weights
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")


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
    from uniap_lightning.files import write_bytes_atomic

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
    from uniap_lightning.files import check_output_file, check_output_folder

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


# ------------------------------------------------------------------------------------------ the user's config.json
#: where each config read by :func:`load_hf_config` came from (keyed by ``id``; configs are unhashable), for messages
_SOURCES: dict[int, tuple[weakref.ref[Any], Path]] = {}


def config_source(config: Any) -> str:
    """How messages name ``config``: its ``config.json`` when :func:`load_hf_config` read it, else the model's."""
    entry = _SOURCES.get(id(config))
    if entry is not None and entry[0]() is config:
        return f"config.json {str(entry[1])!r}"
    return f"the {type(config).__name__} of the model"


def _from_file(config: Any) -> str:
    """``"config.json '...': "`` before a message about a config read from a file, else nothing."""
    entry = _SOURCES.get(id(config))
    return f"{config_source(config)}: " if entry is not None and entry[0]() is config else ""


def _remember_source(config: Any, path: Path) -> None:
    key = id(config)
    _SOURCES[key] = (weakref.ref(config, lambda _: _SOURCES.pop(key, None)), path)


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' own warnings off (a hostile config makes it log several lines; the CLI prints one)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _first_line(err: BaseException, limit: int = 200) -> str:
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut short: a hostile value is never echoed at length."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def model_class_of(config: Any) -> type:
    """The transformers model class named first in ``config.architectures``. Only a :class:`PreTrainedModel` that
    transformers' auto mappings register for the config's own ``model_type`` is accepted: the export instantiates
    the class, so a config must not be able to name anything else (``Trainer``, ``TrainingArguments``, another
    model type's class)."""
    import transformers

    named = config_source(config)
    names = getattr(config, "architectures", None) or []
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise UniAPError(f"{named}: architectures must be a list of class names, got {_shown(names)}")
    if not names:
        raise UniAPError(f"{named} names no transformers model class (architectures=None); export from the live "
                         "model instead (strategy.save_consolidated(path, format='hf'))")
    model_type = getattr(config, "model_type", None)
    allowed = model_classes_for(model_type)
    for name in names:
        if name not in allowed:
            raise UniAPError(f"{named}: architectures names {_shown(name)}, not a transformers model class of "
                             f"model_type {_shown(model_type)} (one of {', '.join(sorted(allowed)[:6]) or 'none'}); "
                             "fix architectures")
    name = names[0]
    try:
        cls = getattr(transformers, name)
    except Exception as err:  # noqa: BLE001 - a lazily imported module that fails to import
        raise UniAPError(f"{named}: transformers cannot import {name} ({_first_line(err)})") from None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise UniAPError(f"{named}: architectures names {name}, which is not a transformers model class")
    return cls


def model_classes_for(model_type: Any) -> set[str]:
    """The class names transformers' auto mappings (``MODEL_*_MAPPING_NAMES``) register for ``model_type``."""
    from transformers.models.auto import modeling_auto

    found: set[str] = set()
    if not isinstance(model_type, str):
        return found
    for attr in dir(modeling_auto):
        if attr.startswith("MODEL") and attr.endswith("MAPPING_NAMES"):
            table = getattr(modeling_auto, attr)
            value = table.get(model_type) if isinstance(table, dict) else None
            if isinstance(value, str):
                found.add(value)
            elif isinstance(value, (list, tuple)):
                found.update(v for v in value if isinstance(v, str))
    return found


def load_hf_config(folder: str | Path) -> Any:
    """A local folder's ``config.json``, read as hostile input: through the bounded reader (size, nesting, integer
    digits), a regular file in the folder (a link out of it is refused, except the Hub cache's link from a
    snapshot to its blob), a known ``model_type`` and sane sizes (:func:`check_config_sizes`). No code runs,
    nothing is fetched, and transformers' own reader never opens the file (no second, unbounded read)."""
    from uniap_lightning.files import read_json

    folder = Path(folder)
    path = folder / "config.json"
    named = f"config.json {str(path)!r}"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise UniAPError(f"{folder} has no config.json: give the folder of the model the checkpoint was trained from "
                         "(what from_pretrained was given)") from None
    except OSError as err:
        raise UniAPError(f"{named} cannot be read ({err.strerror or err}); give the folder of the model the "
                         "checkpoint was trained from") from None
    if stat.S_ISLNK(mode) and not _link_inside(path, folder):
        raise UniAPError(f"{named} is a symbolic link out of its folder: not read; copy the model's config.json "
                         "into the folder")
    data = read_json(path, "config.json")
    if not isinstance(data, dict):
        raise UniAPError(f"{named} holds {type(data).__name__}, not a JSON object: give the model's own config.json")
    model_type = data.get("model_type")
    if model_type is None:
        raise UniAPError(f"{named} has no model_type: give the config.json that save_pretrained wrote (it names "
                         "the model type, e.g. \"llama\")")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        import transformers

        raise UniAPError(f"{named}: model_type {_shown(model_type)} is not a model type transformers "
                         f"{transformers.__version__} knows; fix model_type or upgrade transformers")
    check_config_sizes(data, named)
    try:
        with _quiet_transformers():
            config = CONFIG_MAPPING[model_type].from_dict(dict(data))
    except Exception as err:  # noqa: BLE001 - any field the config class refuses
        raise UniAPError(f"{named} is not a valid {model_type} config ({_first_line(err)})") from None
    check_config_sizes({k: getattr(config, k, None) for k in SIZE_FIELDS}, named)  # the aliases resolved too
    _remember_source(config, path)
    return config


def _link_inside(link: Path, folder: Path) -> bool:
    """Whether a symbolic link points into ``folder`` itself, or is the Hugging Face Hub cache's link from
    ``snapshots/<revision>/config.json`` to ``blobs/<hash>`` of the same model."""
    target = Path(os.path.realpath(link))
    home = Path(os.path.realpath(folder))
    if target.is_relative_to(home):
        return True
    return home.parent.name == "snapshots" and target.parent == home.parent.parent / "blobs"


def check_config_sizes(values: dict[str, Any], named: str) -> None:
    """Every size field present (:data:`SIZE_FIELDS`) is a positive integer no larger than
    :data:`MAX_CONFIG_SIZE`, a short list of them (one per stage, as Swin's heads), or null: a negative vocabulary
    or a billion-wide layer is refused before a model is built from it."""

    def size(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_CONFIG_SIZE

    for key in SIZE_FIELDS:
        value = values.get(key)
        if value is None or size(value):
            continue
        if isinstance(value, (list, tuple)) and 0 < len(value) <= MAX_STAGES and all(size(v) for v in value):
            continue
        raise UniAPError(f"{named}: {key} must be a positive integer of at most {MAX_CONFIG_SIZE:,} (or a list of "
                         f"at most {MAX_STAGES} of them, one per stage), got {_shown(value)}")


def check_config_against_weights(config: Any, state: dict[str, torch.Tensor]) -> None:
    """The config's sizes against the weights it will describe, before a model is built from it: a width or
    vocabulary larger than every dimension of every weight, or more layers than weights, is another model's
    config (and building it would take minutes). The exact shapes are checked after (:func:`hf_weights`)."""
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    if not tensors:
        return
    largest = max((max(t.shape) for t in tensors if t.dim()), default=1)
    named = config_source(config)
    for key in WEIGHT_DIMENSIONS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > largest:
            raise UniAPError(f"{named}: {key} is {value:,}, larger than any dimension of the checkpoint's weights "
                             f"(at most {largest:,}): the config of another model? give the folder the run started "
                             "from")
    for key in LAYER_COUNTS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > len(tensors):
            raise UniAPError(f"{named}: {key} is {value:,}, more than the checkpoint's {len(tensors):,} weights: "
                             "the config of another model? give the folder the run started from")
