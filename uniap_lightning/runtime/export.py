"""Full weights written for other programs to load: one safetensors file (the default), one ``torch.save`` file,
or a Hugging Face folder (``config.json`` + ``model.safetensors``) that ``AutoModelFor...from_pretrained`` loads.

Callers: :meth:`UniAPStrategy.save_consolidated <uniap_lightning.strategy.UniAPStrategy.save_consolidated>` (live,
every rank), :func:`~uniap_lightning.runtime.checkpoint.consolidate_checkpoint` (offline) and ``uniap export``.
Every file is written atomically; a Hugging Face folder is written under a hidden name and renamed when complete, and
only replaces a folder that holds nothing but an earlier export's files.
"""

from __future__ import annotations

import copy
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

    if fmt == "torch":
        return write_bytes_atomic(path, lambda f: torch.save(state, f), what="weights file")
    if fmt != "safetensors":
        raise UniAPError(f"write_weights writes safetensors or torch files, not {fmt!r}")
    data = _safetensors_bytes(state)
    return write_bytes_atomic(path, lambda f: f.write(data), what="weights file")


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
    """An instance on the meta device (no memory, no weights drawn), with the class's own weight tying."""
    with torch.device("meta"):
        return model_class(config)


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
        prefix = _prefix(names, state)
    out = {}
    for k in names:
        v = state.get(prefix + k)
        if v is None:
            raise UniAPError(f"the weights have no {prefix + k!r} for {model_class.__name__}.{k} (a checkpoint of "
                             "another model?)")
        if tuple(v.shape) != tuple(own[k].shape):
            raise UniAPError(f"{prefix + k!r} is {tuple(v.shape)}, {model_class.__name__}.{k} is "
                             f"{tuple(own[k].shape)}")
        out[k] = v
    return out


def _prefix(names: list[str], state: dict[str, torch.Tensor]) -> str:
    """The prefix under which the model's keys appear in ``state`` (the LightningModule attribute + ``.``)."""
    probe = max(names, key=len)
    for k in state:
        if k.endswith(probe) and (len(k) == len(probe) or k[-len(probe) - 1] == "."):
            return k[: len(k) - len(probe)]
    raise UniAPError(f"the weights do not hold this model's {probe!r} under any prefix (a checkpoint of another "
                     "model?)")


def write_hf_folder(folder: str | Path, model_class: type, config: Any, state: dict[str, torch.Tensor], *,
                    prefix: str | None = None, generation_config: Any = None) -> Path:
    """A folder ``model_class.from_pretrained(folder)`` loads: ``config.json`` and ``model.safetensors``."""
    from uniap_lightning.runtime.checkpoint import partial_path, publish, remove_path

    final = Path(folder)
    _check_replaceable(final)
    weights = hf_weights(model_class, config, state, prefix)
    data = _safetensors_bytes(weights)
    partial = partial_path(final)
    remove_path(partial)
    partial.mkdir(parents=True)
    config = copy.deepcopy(config)
    config.architectures = [model_class.__name__]  # what AutoModelFor... and `uniap export` read back
    config.save_pretrained(partial)
    if generation_config is not None:
        generation_config.save_pretrained(partial)
    (partial / "model.safetensors").write_bytes(data)
    publish(partial, final)
    return final


def _check_replaceable(final: Path) -> None:
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise UniAPError(f"{final} exists and is not a folder: a Hugging Face export is a folder; give a new name")
    if final.is_dir():
        others = sorted(p.name for p in final.iterdir() if p.name not in HF_FILES)
        if others:
            raise UniAPError(f"{final} holds files an export does not write ({', '.join(others[:3])}): not replaced; "
                             "give a new or empty folder")


def model_class_of(config: Any) -> type:
    """The transformers class named first in ``config.architectures``."""
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    raise UniAPError(f"the config names no transformers model class (architectures={names or None}); export from "
                     "the live model instead (strategy.save_consolidated(path, format='hf'))")


def load_hf_config(folder: str | Path) -> Any:
    """A local folder's ``config.json`` (no code runs: no remote code, nothing fetched)."""
    from transformers import AutoConfig

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise UniAPError(f"{path} has no config.json: give the folder of the model the checkpoint was trained from "
                         "(what from_pretrained was given)")
    return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
