"""The step hooks of :class:`~uniap_lightning.strategy.UniAPStrategy`: how a training, validation, test or
predict batch runs through the plan. The strategy runs the chain itself (the module's ``*_step`` methods are not
called): every rank takes its share of the global batch, and the loss it returns is the one a single device would
compute. The strategy's Lightning lifecycle is in :mod:`uniap_lightning.strategy`; the schedule's mechanics in
:mod:`uniap_lightning.runtime.step` and the runtime's runner."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

if TYPE_CHECKING:
    from torch.optim import Optimizer


class Steps:
    """Mixed into ``UniAPStrategy`` ahead of Lightning's ``ModelParallelStrategy``, whose step hooks these override
    (it relies on the strategy's ``runtime``, ``train_step_state``, ``precision_plugin``, ``lightning_module``,
    ``guard`` and Lightning's ``pre_backward`` / ``post_backward``)."""

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of the whole batch through the plan (the module's ``training_step`` is not called).
        Returns this rank's local loss; the global mean replaces it in ``on_train_batch_end`` (``TrainLossLogger``),
        where it is also logged, after the gradient averaging and optimizer step had time to overlap its all-reduce.
        """
        with self.train_step_state.timed():
            args, kwargs = self.precision_plugin.convert_input((args, kwargs))
            x, y = self.runtime.chain.split_batch(args[0])
            return self.train_step_state.run(x, y, accumulate=self.lightning_module.trainer.accumulate_grad_batches,
                                             context=self.precision_plugin.train_step_context)

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Hand the gradients computed in ``training_step`` back (Lightning zeroed ``.grad`` in between), then put
        the replicated layers' averages in, so ``on_after_backward``, clipping and the optimizer see averaged
        gradients (as with DDP)."""
        with self.train_step_state.timed():
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
            self.train_step_state.hand_back()
            closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
            self.post_backward(closure_loss)
            return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning calls this only on the last batch of an accumulation window, whose ``training_step`` and
        ``backward`` run inside ``closure``: marked, so replicated gradients are reduced once per optimizer step."""

        def closing_closure() -> Any:
            with self.train_step_state.closing():
                return closure()

        with self.train_step_state.timed():
            return super().optimizer_step(optimizer, closing_closure, model, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.precision_plugin.val_step_context():
            return self._eval_step("val_loss", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.precision_plugin.test_step_context():
            return self._eval_step("test_loss", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The chain's output for the whole batch, on every rank (the module's ``predict_step`` is not called)."""
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        x = self.runtime.chain.prediction_input(args[0])
        with self.precision_plugin.predict_step_context():
            return self.guard(lambda: self.runtime.runner.predict_step(x))

    def _eval_step(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        args, kwargs = self.precision_plugin.convert_input((args, kwargs))
        x, y = self.runtime.chain.split_batch(args[0])
        loss = self.guard(lambda: self.runtime.runner.eval_step(x, y, self.runtime.chain.loss_fn))
        # the same global mean on every rank; sync_dist averages the epoch's value once, at the epoch's end
        self.lightning_module.log(name, loss, prog_bar=True, sync_dist=True)
        return loss
