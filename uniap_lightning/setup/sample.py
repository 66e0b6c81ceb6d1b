"""The sample batch that setup profiles with and checks the model's chain on."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from uniap_lightning.errors import UniAPError
from uniap_lightning.profiling.estimate import PROFILE_ROWS
from uniap_lightning.profiling.measure import is_meta, training_state_kept
from uniap_lightning.runtime.chain import check_chain_contract
from uniap_lightning.runtime.payload import flatten, head, is_payload, rows as payload_rows, signature, to_device

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from uniap_lightning.runtime import Chain


@dataclass(frozen=True)
class Sample:
    """The model's input for profiling (a payload: a tensor, tuple or flat dict of tensors; ``None`` with the
    reason when there is none) and the global batch size."""

    x: Any
    why_none: str
    global_batch_size: int | None
    #: the batch's target, as many samples as ``x`` (profiling times the loss with the last layer); None: none
    y: Any = None

    def shape(self) -> Any:
        """The input's shape (a tensor) or the shapes and dtypes of its tensors with its structure (a payload):
        what ranks compare and profile cache keys hold."""
        return input_shape(self.x)


def input_shape(x: Any) -> Any:
    """``list(x.shape)`` for a tensor (as profile cache keys always held), else the payload's signature."""
    if x is None:
        return None
    return list(x.shape) if isinstance(x, torch.Tensor) else signature(x)


def input_dtype(x: Any) -> str:
    return str(x.dtype) if isinstance(x, torch.Tensor) else "payload"


def draw_batch(trainer: pl.Trainer) -> tuple[Any, str, int | None]:
    """One batch of the data the trainer is about to use (unsplit, on CPU), or ``None`` with the reason and the
    loader's ``batch_size`` when it yields nothing."""
    from lightning.pytorch.trainer.states import TrainerFn

    fn = trainer.state.fn
    loader: Any = None
    try:
        if trainer.datamodule is not None:
            loader = {
                TrainerFn.FITTING: trainer.datamodule.train_dataloader,
                TrainerFn.VALIDATING: trainer.datamodule.val_dataloader,
                TrainerFn.TESTING: trainer.datamodule.test_dataloader,
                TrainerFn.PREDICTING: trainer.datamodule.predict_dataloader,
            }[fn]()
        else:
            loop = {
                TrainerFn.FITTING: trainer.fit_loop,
                TrainerFn.VALIDATING: trainer.validate_loop,
                TrainerFn.TESTING: trainer.test_loop,
                TrainerFn.PREDICTING: trainer.predict_loop,
            }[fn]
            loader = loop._data_source.dataloader()
        if isinstance(loader, (list, tuple)):
            loader = loader[0]
        return next(iter(loader)), "", None
    except StopIteration:
        size = getattr(loader, "batch_size", None)
        return None, "the dataloader yielded no batch", int(size) if isinstance(size, int) else None
    except (KeyError, AttributeError, TypeError) as err:
        raise UniAPError(
            f"could not draw a sample batch to plan with ({err!r}); pass plan=<file> to UniAPStrategy or give the "
            "Trainer a non-empty dataloader"
        ) from err


def take_sample(chain: Chain, trainer: pl.Trainer, device: torch.device,
                context: Callable[[], AbstractContextManager[Any]]) -> Sample:
    """Draw a batch, split it, and check the chain contract on it (every layer's output, under ``context``)."""
    batch, why, loader_batch = draw_batch(trainer)
    if batch is None:
        return Sample(None, why, loader_batch)
    try:
        x, y = chain.split_batch(batch)
    except UniAPError:
        raise
    except Exception as err:  # noqa: BLE001 - a batch we cannot split is profiled structurally
        return Sample(None, f"the sample batch could not be split into (input, target): {err!r}", None)
    if isinstance(x, list):
        x = tuple(x)
    if not is_payload(x) or any(t.dim() == 0 for t in _tensors(x)):
        raise UniAPError(
            "the model's input must be a tensor, a tuple or a flat dict of tensors, each with the batch on dim 0; "
            f"got {type(x).__name__}"
        )
    counts = {int(t.shape[0]) for t in _tensors(x)}
    if len(counts) > 1:
        raise UniAPError(f"the tensors of the model's input hold different numbers of samples on dim 0 "
                         f"({sorted(counts)}); every tensor of a batch must have the batch on dim 0")
    rows = payload_rows(x)
    x = to_device(head(x, min(rows, PROFILE_ROWS)), device)
    y = _target_like(y, rows, min(rows, PROFILE_ROWS), device)
    if not any(is_meta(layer, t) for layer in chain.layers for t in _tensors(x)):
        with training_state_kept(chain.layers):
            check_chain_contract(chain, head(x, 2), context=context)
    return Sample(x, "", rows, y)


def _target_like(y: Any, rows: int, keep: int, device: torch.device) -> Any:
    """The target's first ``keep`` samples on ``device`` when it is a payload holding the batch on dim 0, else None
    (the profile then leaves the loss out)."""
    if isinstance(y, list):
        y = tuple(y)
    try:
        if y is None or not is_payload(y) or payload_rows(y) != rows:
            return None
        return to_device(head(y, keep), device)
    except Exception:  # noqa: BLE001 - a target we cannot slice: the loss is not profiled
        return None


def _tensors(x: Any) -> tuple[torch.Tensor, ...]:
    return flatten(x)
