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

:class:`PlanMeshes` holds the plan's base layout only (the world, the pipeline lane and stage groups, the
``(replicas, tp)`` grids, the re-layout groups between activation layouts); a dimension's own groups are in its
store (:meth:`PlanMeshes.store`), read through the accessors its runtime module exports (``context.cp_group``,
``experts.ep_mesh``, ...), so a new dimension adds groups without touching this module.
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


def grid_shapes(plan: Plan) -> list[tuple[int, int]]:
    """The ``(replicas, tp)`` grids the plan's layers run on (sorted: the order they are created in)."""
    return sorted({(lp.strategy.replicas, lp.strategy.tp) for lp in plan.layers})


@dataclass
class PlanMeshes:
    """The meshes and groups of one plan, as seen from this rank.

    It names the plan's base layout and no dimension: the world ``(pp, stage)`` mesh with the pipeline lane and
    stage groups, the ``(replicas, tp)`` grids, and the re-layout groups between activation layouts. The grids are
    base, not the data dimension's: every layer runs on one, whatever its strategy (its stage's ``n`` devices as
    ``replicas = dp x cp`` times ``tp``); the tensor, experts, state-offload and data dimensions all read it; and it
    is one 2-D mesh so that FSDP2 over the replicas builds 2-D parameters from TP's DTensor shards, which no one
    dimension could own. The re-layout groups move activations between layers' layouts (:mod:`.reshard`) and
    belong to no dimension either.

    Every other group is a dimension's: its runtime module's ``groups`` hook fills ``store(name)`` (its own name,
    in :data:`~uniap_lightning.runtime.dimensions.GROUP_ORDER`) and the module exports the accessors that read it
    (``context.cp_group``, ``experts.ep_mesh``, ...).
    """

    plan: Plan
    rank: int
    device_type: str
    world: DeviceMesh
    grids: dict[tuple[int, int], DeviceMesh] = field(default_factory=dict)  # (replicas, tp) -> (pp, dp, tp) mesh
    relayout_groups: dict[tuple[Any, ...], dist.ProcessGroup] = field(default_factory=dict)  # (layout, K)
    #: each dimension's groups, by dimension name (:meth:`store`)
    stores: dict[str, dict[Any, Any]] = field(default_factory=dict)

    def store(self, name: str) -> dict[Any, Any]:
        """Dimension ``name``'s groups: the dict its ``groups`` hook fills and its accessors read (keys and values
        are the dimension's own)."""
        return self.stores.setdefault(name, {})

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

    def chunk_index(self, dp: int) -> int:
        """Which of the ``dp`` batch chunks this rank holds in layout ``dp``."""
        return self.plan.batch_chunk_of_rank(self.rank, dp)

    def relayout_group(self, layout: tuple[int, int, int], k: tuple[int, int]) -> dist.ProcessGroup:
        """The lanes that gather ``layout``'s pieces into ``k`` pieces with this rank (:mod:`.reshard`)."""
        return self.relayout_groups[(layout, k)]
