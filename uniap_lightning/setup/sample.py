"""The sample batch that setup profiles with and checks the model's chain on."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from uniap_lightning.errors import UniAPError

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from uniap_lightning.runtime import Chain

#: rows of the sample kept for profiling (the largest micro-batch timed)
PROFILE_ROWS = 16


@dataclass(frozen=True)
class Sample:
    """The model's input for profiling (``None`` with the reason when there is none) and the global batch size."""

    x: torch.Tensor | None
    why_none: str
    global_batch_size: int | None


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
    from uniap_lightning.profiling.measure import is_meta, training_state_kept
    from uniap_lightning.runtime.chain import check_chain_contract

    batch, why, loader_batch = draw_batch(trainer)
    if batch is None:
        return Sample(None, why, loader_batch)
    try:
        x, _ = chain.split_batch(batch)
    except UniAPError:
        raise
    except Exception as err:  # noqa: BLE001 - a batch we cannot split is profiled structurally
        return Sample(None, f"the sample batch could not be split into (input, target): {err!r}", None)
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise UniAPError(f"the model's input must be a tensor with the batch on dim 0, got {type(x).__name__}")
    rows = int(x.shape[0])
    x = x[: min(rows, PROFILE_ROWS)].to(device)
    if not any(is_meta(layer, x) for layer in chain.layers):
        with training_state_kept(chain.layers):
            check_chain_contract(chain, x[:2], context=context)
    return Sample(x, "", rows)
