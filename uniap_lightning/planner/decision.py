"""The one per-layer decision record: :class:`Strategy`.

What the planner decides for one layer inside its pipeline stage is spelled once, here, and the same frozen record
travels everywhere: the cost model prices it (:func:`~uniap_lightning.planner.cost.layer.layer_cost`), the cost
tables enumerate it, the MILP decodes into it, a :class:`~uniap_lightning.planner.plan.LayerPlan` holds it, the
plan JSON writes its fields flat into each layer's object, and the runtime (:mod:`uniap_lightning.runtime.stage`,
:mod:`uniap_lightning.runtime.mesh`) builds meshes and wrappers from it. Older shapes (version 1's ``shard: bool``)
are read only by the plan JSON reader. It imports nothing from torch or Lightning.
"""

from __future__ import annotations

from typing import NamedTuple

from uniap_lightning.errors import UniAPError

DP_MODES = ("replicate", "zero1", "zero2", "zero3")
COMPRESSIONS = ("none", "bf16", "powersgd", "topk")
# modes whose gradients are all-reduced whole, so a compressor can stand in for the all-reduce
COMPRESSIBLE_DP_MODES = ("replicate", "zero1")
DP_LABELS = {"replicate": "dp", "zero1": "z1dp", "zero2": "z2dp", "zero3": "fsdp"}


class Strategy(NamedTuple):
    """One layer's intra-stage strategy: ``dp`` data-parallel copies x ``tp`` tensor-parallel ranks (``dp * tp`` is
    the stage's device count, ``tp`` innermost); how the copies hold state (``dp_mode``: replicate / zero1 / zero2 /
    zero3); whether the layer recomputes its activations in backward; how its gradients travel (``compression``,
    replicate / zero1 only)."""

    dp: int
    tp: int
    dp_mode: str = "replicate"
    recompute: bool = False
    compression: str = "none"

    @classmethod
    def of(cls, dp: int, tp: int, dp_mode: str = "replicate", recompute: bool = False,
           compression: str = "none") -> Strategy:
        """The canonical record: one copy (``dp == 1``) has nothing to shard or compress."""
        if dp == 1:
            dp_mode, compression = "replicate", "none"
        return cls(int(dp), int(tp), str(dp_mode), bool(recompute), str(compression))

    @property
    def shard(self) -> bool:
        """Parameters sharded over the data-parallel copies (ZeRO-3 / FSDP; version 1's ``shard``)."""
        return self.dp > 1 and self.dp_mode == "zero3"

    def label(self) -> str:
        """``dp4xtp2``, ``fsdp8+rc``, ``dp2+powersgd``, ``single``."""
        parts = []
        if self.dp > 1:
            parts.append(f"{DP_LABELS.get(self.dp_mode, self.dp_mode)}{self.dp}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        out = "x".join(parts) or "single"
        if self.compression != "none":
            out += f"+{self.compression}"
        return out + ("+rc" if self.recompute else "")

    def check(self, where: str) -> None:
        """Raise :class:`UniAPError` naming ``where`` and the first field out of its vocabulary."""
        if self.dp_mode not in DP_MODES:
            raise UniAPError(f"{where}: dp_mode={self.dp_mode!r} must be one of {DP_MODES}")
        if self.compression not in COMPRESSIONS:
            raise UniAPError(f"{where}: compression={self.compression!r} must be one of {COMPRESSIONS}")
        if not isinstance(self.recompute, bool):
            raise UniAPError(f"{where}: recompute must be true or false, got {self.recompute!r}")
        if self.dp == 1 and (self.dp_mode != "replicate" or self.compression != "none"):
            raise UniAPError(
                f"{where}: dp=1 has no data-parallel copies, so dp_mode must be 'replicate' and compression 'none' "
                f"(got {self.dp_mode!r}, {self.compression!r})"
            )
        if self.compression != "none" and self.dp_mode not in COMPRESSIBLE_DP_MODES:
            raise UniAPError(
                f"{where}: compression={self.compression!r} needs dp_mode in {COMPRESSIBLE_DP_MODES} "
                f"(gradients all-reduced whole), got {self.dp_mode!r}"
            )
