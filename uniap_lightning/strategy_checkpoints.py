"""Checkpoint IO of :class:`~uniap_lightning.strategy.UniAPStrategy`: distributed checkpoints that reshard on load
(across plans), published atomically, loaded without running code from the file; and the consolidated export.
The strategy's Lightning lifecycle is in :mod:`uniap_lightning.strategy`; the mechanics in
:mod:`uniap_lightning.runtime.checkpoint`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime import checkpoint as checkpoints  # as a module: tests patch its functions
from uniap_lightning.runtime import compression_state, export
from uniap_lightning.runtime.checkpoint import model_state, optimizer_state, save_published
from uniap_lightning.runtime.resume_checks import check_lightning_version, check_resume_counters

if TYPE_CHECKING:
    from torch.optim import Optimizer


class CheckpointIO:
    """Mixed into ``UniAPStrategy`` ahead of Lightning's ``ModelParallelStrategy``, whose methods these override
    (it relies on the strategy's ``plan``, ``lightning_module``, ``optimizers``, ``broadcast``, ``barrier``,
    ``guard`` and ``global_rank``)."""

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return model_state(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return optimizer_state(self.lightning_module, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write the distributed checkpoint into a hidden ``.<name>.partial`` folder, then rename it: a checkpoint
        under its real name is always complete (every shard, ``.metadata`` and ``meta.pt``), even if a rank is
        killed mid-write. A rank whose peer dies meanwhile fails with a :class:`UniAPError`. Each rank also writes
        its gradient compressors' state there (:mod:`uniap_lightning.runtime.compression_state`)."""
        checkpoint["uniap_plan"] = self.plan.to_dict()

        def write(to: Path) -> None:
            super(CheckpointIO, self).save_checkpoint(checkpoint, to, storage_options)
            if self._runtime is not None:
                compression_state.save(self._runtime.replicated, to, rank=self.global_rank, world=self.world_size)

        save_published(Path(self.broadcast(str(filepath))), write, lead=self.global_rank == 0, barrier=self.barrier,
                       guard=self.guard)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint saved under any plan (or a single-file one from another strategy) into this plan,
        resharded by parameter name (:func:`~uniap_lightning.runtime.checkpoint.load_any`). Nothing is unpickled
        beyond plain data, whatever ``weights_only`` says: a crafted file is refused with a :class:`UniAPError`, as
        is a loop state Lightning could not resume from (:mod:`uniap_lightning.runtime.resume_checks`).
        The gradient compressors' state is restored under the same layout, else starts from zero (a warning)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        loaded = checkpoints.load_any(path, self.lightning_module, optimizers, guard=self.guard)
        # what Lightning's upgrade of the loop state and its resume rely on (one line, not a KeyError on each rank)
        where = path / "meta.pt" if path.is_dir() else path
        check_resume_counters(check_lightning_version(loaded, where), where)
        if self._runtime is not None:
            why = compression_state.load(self._runtime.replicated, path, rank=self.global_rank, world=self.world_size)
            if why is not None:
                rank_zero_warn(f"gradient compression starts with zero error feedback: {why}")
        return loaded

    def save_consolidated(self, path: str | Path, format: str | None = None) -> None:
        """Write all weights, unsharded (on rank 0; call on every rank): one safetensors file (default), one
        ``torch.save`` file (``format="torch"``, or a ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt`` path), or a Hugging
        Face folder (``format="hf"``) that the model's class loads with ``from_pretrained(path)``.

        A destination rank 0 cannot write (a missing or read-only folder, a path below a file) is refused on every
        rank with one :class:`~uniap_lightning.errors.UniAPError` before the weights are gathered: rank 0's
        verdict is broadcast, so no rank waits in a collective that another rank has left."""
        problem = None
        if self.global_rank == 0:
            try:
                export.check_destination(path, export.resolve_format(path, format))
            except UniAPError as err:
                problem = str(err)
        problem = self.broadcast(problem)
        if problem is not None:
            raise UniAPError(problem)
        checkpoints.save_consolidated(self.lightning_module, path, rank=self.global_rank, format=format)
