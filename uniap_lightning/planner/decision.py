"""The one per-layer decision record: :class:`Strategy`.

What the planner decides for one layer inside its pipeline stage is spelled once, here, and the same frozen record
travels everywhere: the cost model prices it (:func:`~uniap_lightning.planner.cost.layer.layer_cost`), the cost
tables enumerate it, the MILP decodes into it, a :class:`~uniap_lightning.planner.plan.LayerPlan` holds it, the
plan JSON writes its fields flat into each layer's object, and the runtime (:mod:`uniap_lightning.runtime.stage`,
:mod:`uniap_lightning.runtime.mesh`) builds meshes and wrappers from it. Older shapes (version 1's ``shard: bool``)
are read only by the plan JSON reader. It imports nothing from torch or Lightning.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from uniap_lightning.planner import dimensions as _dims
# the vocabularies live with their dimensions (uniap_lightning.planner.dimensions); named here too, where callers
# have always found them
from uniap_lightning.planner.dimensions.compression import COMPRESSIONS
from uniap_lightning.planner.dimensions.context import CP_LABELS, CP_METHODS
from uniap_lightning.planner.dimensions.data import COMPRESSIBLE_DP_MODES, DP_LABELS, DP_MODES, ZERO_LABELS

__all__ = ["COMPRESSIBLE_DP_MODES", "COMPRESSIONS", "CP_LABELS", "CP_METHODS", "DP_LABELS", "DP_MODES", "Strategy",
           "ZERO_LABELS"]


class Strategy(NamedTuple):
    """One layer's intra-stage strategy on its stage's device grid ``dp x cp x tp`` (the stage's device count,
    ``tp`` innermost): ``dp`` data-parallel copies, each sample's sequence split over ``cp`` context-parallel
    ranks (attention by ``cp_method``), ``tp`` tensor-parallel ranks (``sp``: with sequence parallelism, the parts
    tensor parallelism does not split run on sequence shards); how the copies hold state (``dp_mode``: replicate /
    zero1 / zero2 / zero3, over the ``dp x cp`` ranks that hold the same weights); whether the layer recomputes its
    activations in backward; how its gradients travel (``compression``, replicate / zero1 only); ``ep``: the
    experts of a mixture-of-experts layer split over ``ep`` of the ``dp x cp`` replicas (consecutive blocks of
    ``ep``, as in Megatron and DeepSpeed-MoE: expert parallelism overlaps the data ranks, so it changes neither
    the grid nor the layout); each rank holds ``E / ep`` experts, tokens reach them by all-to-all, and the
    ``replicas / ep`` ranks holding the same experts reduce their gradients together; ``offload``: the layer's
    tensors saved for backward wait in host memory between its forward and its backward; ``precision``: its
    ``nn.Linear`` products in float8 (``"fp8"``: tensorwise scales, ``"fp8_rowwise"``) or in the run's own
    precision (``"default"``); ``state_offload``: its parameters, gradients and optimizer state wait in host memory
    and its optimizer steps there (FSDP2's CPU offload; zero3 or no replicas)."""

    dp: int
    tp: int
    dp_mode: str = "replicate"
    recompute: bool = False
    compression: str = "none"
    cp: int = 1
    cp_method: str = "none"
    sp: bool = False
    ep: int = 1
    offload: bool = False
    precision: str = "default"
    state_offload: bool = False

    # The fields above are the registry's (uniap_lightning.planner.dimensions: RECORD order, each dimension's
    # types and defaults), written out so that type checkers and readers see them; tests/planner/test_dimensions.py
    # holds the two equal.

    @classmethod
    def of(cls, *args: Any, **kwargs: Any) -> Strategy:
        """The canonical record (same arguments as the constructor): each dimension resets what means nothing in
        the rest of the record (one copy of the weights, ``dp * cp == 1``, has nothing to shard, compress or split
        over experts; one sequence shard no attention method; one tensor-parallel rank no sequence
        parallelism) and the fields are cast to their types."""
        return cls(*_dims.canonical(cls(*args, **kwargs)._asdict()))

    @property
    def replicas(self) -> int:
        """Ranks that hold the same weights and reduce their gradients together: ``dp x cp``."""
        return self.dp * self.cp

    @property
    def layout(self) -> tuple[int, int]:
        """How the layer's input and output are split over the stage: ``(dp, cp)`` (batch, then sequence); what
        resharding between layers depends on."""
        return (self.dp, self.cp)

    @property
    def shard(self) -> bool:
        """Parameters sharded over the data-parallel copies (ZeRO-3 / FSDP; version 1's ``shard``)."""
        return self.replicas > 1 and self.dp_mode == "zero3"

    def label(self) -> str:
        """``dp4xtp2``, ``fsdp8+rc``, ``dp2+powersgd``, ``dp2xcp2uxtp2+sp``, ``dp8+ep4`` (experts over 4 of the
        8 replicas: not a grid dimension), ``dp2+off`` (activations offloaded), ``fsdp8+fp8`` (float8 matmuls;
        ``+fp8r``: rowwise scales), ``single``: each dimension's
        fragment, in the registry's order."""
        return _dims.label(self)

    def check(self, where: str, experts: int | None = None) -> None:
        """Raise :class:`UniAPError` naming ``where`` and the first field out of its vocabulary, then the first
        rule between fields broken (each dimension's); ``experts``: the layer's expert count where known (0: a
        dense layer), which ``ep`` must divide."""
        _dims.check(self, where, experts)
