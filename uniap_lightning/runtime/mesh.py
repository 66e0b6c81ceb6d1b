"""Device meshes and process groups for one plan.

Rank layout (see :mod:`uniap_lightning.planner.plan`): ``world = pp * n``; device group ``g`` owns ranks
``[g*n, (g+1)*n)`` and runs the plan's pipeline stages placed on it (``virtual_stages`` of them); the rank at
position ``r`` inside its group is on pipeline *lane* ``r``, and lane ``r`` is the pipeline ``r, n+r, 2n+r, ...``.
Inside a group a layer with strategy ``(dp, cp, tp)`` sees the group's ranks as a ``dp x cp x tp`` grid with
``tp`` innermost, then ``cp``: its tensor-parallel mesh is the ``tp`` ranks of a row, its context-parallel group the
``cp`` ranks of the same dp and tp index, and its *replica* mesh the ``dp x cp`` ranks of the same tp index (they hold
the same weights: gradient averaging and ZeRO sharding run over it, as :attr:`Strategy.replicas` prices it). A layer
with expert parallelism ``ep`` splits those replicas into blocks of ``ep`` consecutive ones (its *ep* mesh, which
splits the experts) and the ranks at the same position of every block (its *expert data* group, which holds the
same experts and sums their gradients).

Every mesh is built as a *world* mesh with a leading ``pp`` dimension and then sliced, because
``init_device_mesh`` and ``new_group`` are collective over the whole world: each rank must create every group
in the same order, including groups it is not a member of. Building them all up front, in an order derived from
the plan alone, keeps that true without any negotiation between ranks: :func:`uniap_lightning.runtime.groups.
build_meshes` does, each dimension's groups by its runtime module (:mod:`uniap_lightning.runtime.dimensions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from uniap_lightning.planner.plan import Plan
from uniap_lightning.runtime.reshard import piece_of_lane

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh


def layout_of(plan: Plan, u: int) -> tuple[int, int, int]:
    """Layer ``u``'s activation layout ``(dp, cp, tp)`` (:mod:`.reshard`)."""
    st = plan.layers[u].strategy
    return (st.dp, st.cp, st.tp)


def boundary_layout(plan: Plan) -> tuple[int, int, int]:
    """The layout every stage starts and ends with: whole sequences, the micro-batch split over the ``n`` lanes
    (``(n, 1, 1)``); a micro-batch smaller than ``n`` (or one ``n`` does not divide; any ``pp``: tp and cp ranks
    share a micro-batch) is split into ``g = gcd(b, n)`` chunks, each held by ``n / g`` consecutive lanes
    (:attr:`Plan.boundary_chunks`). Pipeline lane ``r`` sends its chunk to lane ``r`` of the next stage, which holds
    the same chunk there."""
    n = plan.devices_per_stage
    g = plan.boundary_chunks
    return (g, 1, n // g)


def layout_transitions(plan: Plan) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """Every ``(from, to)`` activation re-layout the plan needs (layouts ``(dp, cp, tp)``), sorted."""
    edge = boundary_layout(plan)
    pairs: set[tuple[tuple[int, int, int], tuple[int, int, int]]] = set()
    for stage in range(plan.num_stages):
        current = edge
        for u in plan.layers_of_stage(stage):
            nxt = layout_of(plan, u)
            if _pieces(nxt) != _pieces(current):
                pairs.add((current, nxt))
            current = nxt
        if _pieces(current) != _pieces(edge):
            pairs.add((current, edge))
    return sorted(pairs)


def _pieces(layout: tuple[int, int, int]) -> tuple[int, ...]:
    """What a layout means for activations: which piece each lane holds (layouts with cp 1 and the same dp hold
    the same pieces whatever their tp)."""
    n = layout[0] * layout[1] * layout[2]
    return tuple(x for lane in range(n) for x in piece_of_lane(lane, layout))


@dataclass
class PlanMeshes:
    """The meshes and groups of one plan, as seen from this rank."""

    plan: Plan
    rank: int
    device_type: str
    world: DeviceMesh
    grids: dict[tuple[int, int], DeviceMesh] = field(default_factory=dict)  # (replicas, tp) -> (pp, dp, tp) mesh
    cp_groups: dict[tuple[int, int, int], dist.ProcessGroup] = field(default_factory=dict)  # (dp, cp, tp)
    relayout_groups: dict[tuple[Any, ...], dist.ProcessGroup] = field(default_factory=dict)  # (layout, K)
    expert_grids: dict[tuple[int, int, int], DeviceMesh] = field(default_factory=dict)  # (replicas, tp, ep)
    #: the same ranks as ``expert_grids`` with ``ep`` before ``edp``: an expert's place in the full ``[E, ...]``
    #: tensor is its ep block, then its ZeRO shard inside the block (checkpoints, :mod:`.experts`)
    expert_layouts: dict[tuple[int, int, int], DeviceMesh] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.plan.devices_per_stage

    @property
    def group(self) -> int:
        """This rank's device group (torch's pipeline rank)."""
        return self.plan.group_of_rank(self.rank)

    @property
    def lane(self) -> int:
        return self.plan.lane_of_rank(self.rank)

    @property
    def lane_group(self) -> dist.ProcessGroup:
        """The pipeline group of this rank: one rank per stage, same position inside each stage."""
        return self.world.get_group("pp")

    @property
    def stage_group(self) -> dist.ProcessGroup:
        return self.world.get_group("stage")

    def grid(self, replicas: int, tp: int) -> DeviceMesh:
        """The ``(replicas, tp)`` mesh of this rank's stage (a 2-D slice of a ``(pp, dp, tp)`` world mesh whose
        ``dp`` dimension holds the ``dp x cp`` replicas)."""
        return self.grids[(replicas, tp)]["dp", "tp"]

    def tp_mesh(self, replicas: int, tp: int) -> DeviceMesh:
        return self.grids[(replicas, tp)]["tp"]

    def dp_mesh(self, replicas: int, tp: int) -> DeviceMesh:
        """The replica mesh: the ``dp x cp`` ranks with this rank's tensor-parallel index."""
        return self.grids[(replicas, tp)]["dp"]

    def cp_group(self, dp: int, cp: int, tp: int) -> dist.ProcessGroup:
        """The ``cp`` ranks with this rank's dp and tp index (cp rank order = sequence piece order)."""
        return self.cp_groups[(dp, cp, tp)]

    def chunk_index(self, dp: int) -> int:
        """Which of the ``dp`` batch chunks this rank holds in layout ``dp``."""
        return self.plan.batch_chunk_of_rank(self.rank, dp)

    def ep_mesh(self, replicas: int, tp: int, ep: int) -> DeviceMesh:
        """The ``ep`` replicas that split a layer's experts with this rank (a consecutive block of the ``replicas``
        with this rank's tensor-parallel index, as ``Strategy.ep`` plans it; its rank order is the experts')."""
        return self.expert_grids[(replicas, tp, ep)]["ep"]

    def expert_data_group(self, replicas: int, tp: int, ep: int) -> dist.ProcessGroup:
        """The ``replicas / ep`` ranks that hold this rank's experts (same position in every ep block): expert
        gradients are summed over them only."""
        return self.expert_grids[(replicas, tp, ep)].get_group("edp")

    def expert_data_mesh(self, replicas: int, tp: int, ep: int) -> DeviceMesh:
        """The ranks holding this rank's experts, as a mesh (ZeRO over them shards the expert shards further)."""
        return self.expert_grids[(replicas, tp, ep)]["edp"]

    def expert_layout(self, replicas: int, tp: int, ep: int) -> DeviceMesh:
        """The ``(ep, edp)`` mesh of this rank's experts: dim 0 splits the experts, dim 1 holds the same ones."""
        return self.expert_layouts[(replicas, tp, ep)]["ep", "edp"]

    def relayout_group(self, layout: tuple[int, int, int], k: tuple[int, int]) -> dist.ProcessGroup:
        """The lanes that gather ``layout``'s pieces into ``k`` pieces with this rank (:mod:`.reshard`)."""
        return self.relayout_groups[(layout, k)]
