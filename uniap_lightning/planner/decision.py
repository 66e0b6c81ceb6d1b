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
#: how a layer's attention runs over a split sequence: "none" (cp = 1), Ulysses all-to-alls (any device) or ring
#: attention (``runtime/ring.py``; any device)
CP_METHODS = ("none", "ulysses", "ring")
CP_LABELS = {"ulysses": "u", "ring": "r"}
ZERO_LABELS = {"zero1": "z1", "zero2": "z2", "zero3": "fsdp"}


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
    ``replicas / ep`` ranks holding the same experts reduce their gradients together."""

    dp: int
    tp: int
    dp_mode: str = "replicate"
    recompute: bool = False
    compression: str = "none"
    cp: int = 1
    cp_method: str = "none"
    sp: bool = False
    ep: int = 1

    @classmethod
    def of(cls, dp: int, tp: int, dp_mode: str = "replicate", recompute: bool = False,
           compression: str = "none", cp: int = 1, cp_method: str = "none", sp: bool = False, ep: int = 1) -> Strategy:
        """The canonical record: one copy of the weights (``dp * cp == 1``) has nothing to shard, compress or
        split over experts, one sequence shard no attention method, one tensor-parallel rank no sequence
        parallelism."""
        if dp * cp == 1:
            dp_mode, compression, ep = "replicate", "none", 1
        if cp == 1:
            cp_method = "none"
        if tp == 1:
            sp = False
        return cls(int(dp), int(tp), str(dp_mode), bool(recompute), str(compression), int(cp), str(cp_method),
                   bool(sp), int(ep))

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
        8 replicas: not a grid dimension), ``single``."""
        parts = []
        if self.dp > 1:
            parts.append(f"{DP_LABELS.get(self.dp_mode, self.dp_mode)}{self.dp}")
        elif self.cp > 1 and self.dp_mode != "replicate":  # the mode over the context-parallel ranks alone
            parts.append(ZERO_LABELS[self.dp_mode])
        if self.cp > 1:
            parts.append(f"cp{self.cp}{CP_LABELS.get(self.cp_method, self.cp_method)}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        out = "x".join(parts) or "single"
        if self.sp:
            out += "+sp"
        if self.ep > 1:
            out += f"+ep{self.ep}"
        if self.compression != "none":
            out += f"+{self.compression}"
        return out + ("+rc" if self.recompute else "")

    def check(self, where: str, experts: int | None = None) -> None:
        """Raise :class:`UniAPError` naming ``where`` and the first field out of its vocabulary; ``experts``: the
        layer's expert count where known (0: a dense layer), which ``ep`` must divide."""
        if self.dp_mode not in DP_MODES:
            raise UniAPError(f"{where}: dp_mode={self.dp_mode!r} must be one of {DP_MODES}")
        if self.compression not in COMPRESSIONS:
            raise UniAPError(f"{where}: compression={self.compression!r} must be one of {COMPRESSIONS}")
        if not isinstance(self.recompute, bool):
            raise UniAPError(f"{where}: recompute must be true or false, got {self.recompute!r}")
        if self.cp_method not in CP_METHODS:
            raise UniAPError(f"{where}: cp_method={self.cp_method!r} must be one of {CP_METHODS}")
        if not isinstance(self.sp, bool):
            raise UniAPError(f"{where}: sp must be true or false, got {self.sp!r}")
        if (self.cp > 1) != (self.cp_method != "none"):
            raise UniAPError(f"{where}: cp={self.cp} needs cp_method " + (
                f"'ulysses' or 'ring', got {self.cp_method!r}" if self.cp > 1 else f"'none', got {self.cp_method!r}"))
        if self.sp and self.tp == 1:
            raise UniAPError(f"{where}: sp (sequence parallelism) needs tp > 1, got tp=1")
        if self.replicas == 1 and (self.dp_mode != "replicate" or self.compression != "none"):
            raise UniAPError(
                f"{where}: dp=1 has no data-parallel copies, so dp_mode must be 'replicate' and compression 'none' "
                f"(got {self.dp_mode!r}, {self.compression!r})"
            )
        if self.compression != "none" and self.dp_mode not in COMPRESSIBLE_DP_MODES:
            raise UniAPError(
                f"{where}: compression={self.compression!r} needs dp_mode in {COMPRESSIBLE_DP_MODES} "
                f"(gradients all-reduced whole), got {self.dp_mode!r}"
            )
        self._check_ep(where, experts)

    def _check_ep(self, where: str, experts: int | None) -> None:
        ep = self.ep
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise UniAPError(f"{where}: ep must be a positive integer, got {ep!r}")
        if ep == 1:
            return
        if self.replicas % ep:
            raise UniAPError(f"{where}: ep={ep} must divide the dp*cp = {self.replicas} replicas (expert parallelism "
                             "splits the experts over data ranks)")
        if self.compression != "none":
            raise UniAPError(f"{where}: ep={ep} needs compression 'none' (expert and other gradients are reduced "
                             f"over different groups), got {self.compression!r}")
        if experts is not None and experts == 0:
            raise UniAPError(f"{where}: ep={ep} on a layer without experts (only mixture-of-experts layers split "
                             "over ep)")
        if experts is not None and experts % ep:
            raise UniAPError(f"{where}: ep={ep} must divide the layer's {experts} experts")
