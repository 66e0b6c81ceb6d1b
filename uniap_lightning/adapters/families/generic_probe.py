"""The generic split's setup probes (:mod:`.generic`): deterministic batches built from a model's config (token
ids, images, raw audio, log-mel features; no random numbers drawn), which inputs its base model takes, and eval mode
for the probes (no dropout) with each module's own mode restored after.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.families.generic_trace import _refuse
from uniap_lightning.errors import UniAPError


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout on the probes), each module's own mode restored after."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.train(training)


#: the batch entry a model's forward takes first, by modality
_MAIN = ("input_ids", "pixel_values", "input_values", "input_features")
#: the main inputs the setup probe masks (``[batch, seq]`` or ``[batch, samples]``: a mask per position)
_MASKED = ("input_ids", "input_values")


def _main_input(model: Any) -> str:
    params = inspect.signature(model.forward).parameters
    main = next((k for k in _MAIN if k in params), None)
    if main is None:
        raise _refuse(model, f"its forward takes none of {list(_MAIN)}")
    return main


def _wave(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return torch.sin(torch.arange(n, device=device, dtype=torch.float32) * 0.37).reshape(shape).to(dtype)


def _audio_length(config: Any, frames: int = 6) -> int:
    """Samples a raw-audio encoder turns into ``frames`` frames (its feature extractor's kernels and strides)."""
    length = frames
    for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride))):
        length = (length - 1) * stride + kernel
    return length


def _probe(model: Any, rows: int, device: torch.device, padded: bool = True) -> dict[str, torch.Tensor]:
    """A deterministic batch built from the config (no random numbers drawn): token ids (the last sample's last
    token is padding when ``padded``), images of the configured size and channels, raw audio of a few frames (the
    last sample's tail masked when ``padded`` and the model takes a mask) or the configured log-mel features."""
    main = _main_input(model)
    config = model.config
    dtype = next(model.parameters()).dtype
    takes_mask = "attention_mask" in inspect.signature(model.forward).parameters
    if main == "pixel_values":
        vision = getattr(config, "vision_config", None) or config
        size = vision.image_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return {"pixel_values": _wave((rows, int(vision.num_channels), h, w), device, dtype)}
    if main == "input_values":
        length = _audio_length(config)
        batch = {"input_values": _wave((rows, length), device, dtype)}
        if takes_mask:
            mask = torch.ones(rows, length, dtype=torch.long, device=device)
            if padded:
                mask[-1, length * 2 // 3:] = 0
            batch["attention_mask"] = mask
        return batch
    if main == "input_features":
        frames = 2 * int(config.max_source_positions)
        return {"input_features": _wave((rows, int(config.num_mel_bins), frames), device, dtype)}
    vocab = int(getattr(config, "vocab_size", 0) or 2)
    seq = 4
    ids = (torch.arange(rows * seq, device=device).reshape(rows, seq) * 7 + 3) % max(vocab - 1, 1) + 1
    mask = torch.ones(rows, seq, dtype=torch.long, device=device)
    if padded:
        mask[-1, -1] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _accepted(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``kwargs`` the model's forward takes (the base model's flags, e.g. ``use_cache``, are not every head's)."""
    params = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _base_inputs(base: nn.Module) -> tuple[tuple[str, ...], dict[str, Any]]:
    params = inspect.signature(base.forward).parameters
    main = next((k for k in _MAIN if k in params), None)
    if main is None:
        raise UniAPError(f"its base model takes none of {list(_MAIN)}")
    inputs = (main, *(k for k in ("attention_mask", "token_type_ids", "position_ids")
                      if k in params and (main != "input_features" or k != "attention_mask")))
    extra = {k: False for k in ("use_cache", "output_attentions", "output_hidden_states") if k in params}
    return inputs, extra
