"""The user's ``config.json`` for a Hugging Face export (:mod:`.export`).

A ``config.json`` given by the user (``uniap export --hf-config``) is hostile input: it is read through the bounded
reader of :mod:`uniap_lightning.files` (size, nesting, integer digits), must be a regular file in the folder (the Hub
cache's links to its blobs excepted), names a model type transformers knows, has positive and bounded sizes no
larger than the checkpoint's weights, and its ``architectures`` may only name a model class that transformers' auto
mappings register for that model type. Every failure is one :class:`~uniap_lightning.errors.UniAPError` naming the
file.
"""

from __future__ import annotations

import os
import stat
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import read_json

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
