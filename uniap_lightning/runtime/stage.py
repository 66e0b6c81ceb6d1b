"""Build this rank's pipeline stages from a plan (one module per stage of its device group): keep the local
layers, parallelize each, re-layout between them.

The order of the techniques is fixed: (1) drop the layers of other device groups, (2) broadcast the local
layers' initial weights from the group's first rank (ranks may have initialized differently), (3) tensor parallelism
(``sp``: its sequence-parallel plan, :func:`.sequence_tp.apply_sp`), (3b) context parallelism over the layer's cp
group (:func:`.sequence.enable_context_parallel`, after TP: it checks heads per TP rank), (4) the layer's
data-parallel mode over its ``dp x cp`` replicas (``replicate``, or ``zero1``/``zero2``/``zero3`` through FSDP2, see
:mod:`.zero`); with ``ep > 1``, (3c) first the layer's experts split over its ep mesh (:func:`apply_ep`): the expert
shards stay outside (4) (FSDP2 ignores them; replication skips them) and their gradients are summed over the ranks
holding the same experts only.
TP comes before FSDP because FSDP2 shards whatever parameters it finds, and must find the DTensor TP shards to build
2-D (dp x tp) parameters. A layer whose plan says ``recompute`` runs under non-reentrant activation checkpointing
(:func:`torch.utils.checkpoint.checkpoint`) in :meth:`StageModule.forward`, and one whose plan says ``offload``
under saved-tensor hooks that keep its activations in host memory (:class:`OffloadedActivations`): nothing is
wrapped, so parameter names (and checkpoints) stay the user's. A layer whose plan says ``precision`` fp8 has its
``nn.Linear`` modules converted to torchao's ``Float8Linear`` first (:func:`apply_fp8`, before TP, as torchtitan's
converters run before parallelizing): same parameter names, master weights in the run's precision.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions.precision import RECIPES
from uniap_lightning.planner.plan import Plan
from uniap_lightning.runtime.chain import Chain
from uniap_lightning.runtime.data_parallel import ReplicatedGrads
from uniap_lightning.runtime.experts import (AllToAllCounter, apply_batch_group, apply_expert_parallel,
                                             apply_global_routing, expert_modules, mark_expert_shards,
                                             split_expert_params)
from uniap_lightning.runtime.mesh import PlanMeshes, boundary_layout, layout_of
from uniap_lightning.runtime.payload import Spec, call_layer, flatten, spec_of, unflatten
from uniap_lightning.runtime.reshard import Layout, relayout
from uniap_lightning.runtime.sequence import enable_context_parallel
from uniap_lightning.runtime.sequence_tp import apply_sp
from uniap_lightning.runtime.tensor_parallel import apply_tp
from uniap_lightning.runtime.zero import ZERO_MODES, ZeroLayers


class OffloadedActivations:
    """One layer's tensors saved for backward in one forward, kept in host memory until its backward
    (:func:`torch.autograd.graph.saved_tensors_hooks`' pack / unpack). Parameters stay where they are (they are
    the model's, not activations); a DTensor travels as its local shard. On a CUDA device each copy to the host
    runs on ``stream`` beside the compute (pinned memory, the tensor's memory held for the copy by
    ``record_stream``), and :meth:`prefetch` starts the copies back on it, called as the gradient reaches the
    next layer (so they overlap that layer's backward, one layer ahead); a tensor not prefetched comes back when
    backward needs it. Elsewhere the copies are plain (what CPU tests run: the same path, the same numbers)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.back: dict[int, torch.Tensor] = {}  # prefetched device copies by packed index
        self.packed: list[tuple[torch.device, torch.Tensor, Any]] = []

    def pack(self, t: torch.Tensor) -> Any:
        # a weight (FSDP2's gathered one too) and its transposed view are the model's, not activations; a stage's
        # input (a leaf that requires grad, from the previous stage) is one
        if isinstance(t if t._base is None else t._base, nn.Parameter):
            return t
        if isinstance(t, DTensor):
            return (DTensor, t.device_mesh, t.placements, t.shape, t.stride(), self.pack(t.to_local()))
        if type(t) is not torch.Tensor:  # another subclass: left alone
            return t
        host = torch.empty_like(t, device="cpu", pin_memory=t.is_cuda)  # (its strides: the same kernels after)
        event = None
        if t.is_cuda:
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        else:
            host.copy_(t)
        self.packed.append((t.device, host, event))
        return len(self.packed) - 1

    def unpack(self, p: Any) -> torch.Tensor:
        if isinstance(p, tuple) and p and p[0] is DTensor:
            _, mesh, placements, shape, stride, local = p
            return DTensor.from_local(self.unpack(local), mesh, placements, run_check=False, shape=shape,
                                      stride=stride)
        if not isinstance(p, int):
            return p
        if p in self.back:
            torch.cuda.current_stream(self.back[p].device).wait_stream(self.stream)
            return self.back.pop(p)
        device, host, event = self.packed[p]
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
        return host.to(device, non_blocking=event is not None)

    def prefetch(self) -> None:
        """Start every copy back to the device (CUDA only; elsewhere the tensors are where backward reads them)."""
        for i, (device, host, event) in enumerate(self.packed):
            if event is not None and i not in self.back:
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(event)
                    self.back[i] = host.to(device, non_blocking=True)


def _when_gradient_reaches(x: Any, action: Any) -> None:
    """Run ``action()`` once, when backward first reaches one of ``x``'s tensors (none needing a gradient: never;
    the copies then come back on demand)."""
    for t in flatten(x):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            def hook(grad: torch.Tensor) -> None:
                action()
            t.register_hook(hook)
            return


class StageModule(nn.Module):
    """The local layers of one stage, with activation re-layouts between layers of different layouts
    (``(dp, cp, tp)``, :mod:`.reshard`).

    Not attached to the LightningModule (its layers are, under their original names), so checkpoint keys and
    the optimizer's parameters stay those of the user's module.

    Pipeline stages exchange flat tuples of tensors, so the forward takes the tensors of its input payload
    (:mod:`.payload`) as positional arguments, rebuilds the payload from ``in_spec``, and returns the output's
    tensors: one tensor when the output is one (the original contract), else a flat tuple, whose structure is
    ``out_spec``.
    """

    def __init__(self, layers: list[nn.Module], layouts: list[Layout | int], meshes: PlanMeshes, *,
                 in_spec: Spec = None, out_spec: Spec = None, recompute: list[bool] | None = None,
                 zero: ZeroLayers | None = None, all_to_all: AllToAllCounter | None = None,
                 offload: list[bool] | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        n = meshes.n
        self.layouts = [(x, 1, n // x) if isinstance(x, int) else tuple(x) for x in layouts]
        self.meshes = meshes
        self.recompute = recompute or [False] * len(layers)  # per layer: activation checkpointing
        self.offload = offload or [False] * len(layers)  # per layer: saved activations in host memory
        self._offload_stream: Any = None  # the side stream of the copies (CUDA, made on first use)
        self.zero = zero if zero is not None else ZeroLayers()  # zero1/zero2 switches per micro-batch
        #: the expert layers' all-to-alls (bytes sent, per exchange), shared by the stages of this rank
        self.all_to_all = all_to_all if all_to_all is not None else AllToAllCounter()
        self.in_spec, self.out_spec = in_spec, out_spec
        # the last stage under a loss on sequence pieces (pipeline: sequence.piece_loss) keeps its last layout
        self.keep_layout = False

    def _stream(self) -> Any:
        if self._offload_stream is None and torch.cuda.is_available():
            self._offload_stream = torch.cuda.Stream()
        return self._offload_stream

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        edge = boundary_layout(self.meshes.plan)
        current = edge
        x = unflatten(tensors, self.in_spec)
        waiting = None  # the previous layer's offloaded activations: fetched back as backward reaches this layer
        for layer, layout, again, off in zip(self.layers, self.layouts, self.recompute, self.offload):
            x = relayout(x, current, layout, self.meshes)
            current = layout
            if again and torch.is_grad_enabled():
                x = checkpoint(call_layer, layer, x, use_reentrant=False)
            elif off and torch.is_grad_enabled():
                box = OffloadedActivations(self._stream())
                with torch.autograd.graph.saved_tensors_hooks(box.pack, box.unpack):
                    x = call_layer(layer, x)
            else:
                x = call_layer(layer, x)
            if waiting is not None:
                _when_gradient_reaches(x, waiting.prefetch)
            waiting = box if off and not again and torch.is_grad_enabled() else None
        if waiting is not None:  # the stage's last layer: fetched back as its own backward begins
            _when_gradient_reaches(x, waiting.prefetch)
        if not self.keep_layout:
            x = relayout(x, current, edge, self.meshes)
        self.out_spec = spec_of(x)
        flat = tuple(t.contiguous() for t in flatten(x))  # sent as is (an expanded tensor is not contiguous)
        return flat[0] if self.out_spec is None else flat


def drop_other_stages(chain: Chain, plan: Plan, group: int) -> None:
    """Replace layers of other device groups with ``nn.Identity`` so their parameter names simply disappear here."""
    local = set(plan.layers_of_group(group))
    for u in range(len(chain.layers)):
        if u not in local:
            chain.replace(u, nn.Identity())


@torch.no_grad()
def broadcast_from_stage_leader(modules: list[nn.Module], meshes: PlanMeshes) -> None:
    if meshes.n == 1:
        return
    src = meshes.plan.ranks_of_group(meshes.group)[0]
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            dist.broadcast(t.data, src=src, group=meshes.stage_group)


def build_stages(chain: Chain, plan: Plan, meshes: PlanMeshes) -> tuple[list[StageModule], ReplicatedGrads]:
    """Apply the plan to this rank's layers, in place; return one stage module per pipeline stage of this rank's
    device group (in chain order) and the replicated-gradient book. The modules share that book and one
    :class:`ZeroLayers` (``modules[0].zero``), so gradient sync, ZeRO and the optimizer see every local layer once."""
    group = meshes.group
    drop_other_stages(chain, plan, group)
    indices = plan.layers_of_group(group)
    layers = [chain.layers[u] for u in indices]
    broadcast_from_stage_leader(layers, meshes)
    replicated = ReplicatedGrads(compression_options=dict(plan.compression_options))
    counter = AllToAllCounter()  # every expert layer of this rank records its all-to-alls there
    zero = ZeroLayers()
    originals = [dict(layer.named_parameters()) for layer in layers]
    for i, u in enumerate(indices):
        st = plan.layers[u].strategy
        if st.precision != "default":  # before TP: the float8 modules are what TP and FSDP2 then wrap
            converted = apply_fp8(layers[i], st.precision, float8_all_gather=st.shard and st.precision == "fp8",
                                  tp=st.tp, where=f"plan layer {u} ({chain.names[u]})")
            if converted is not layers[i]:  # the layer itself was an nn.Linear
                chain.replace(u, converted)
                layers[i] = converted
    for u, layer in zip(indices, layers):
        st = plan.layers[u].strategy
        reps = st.replicas
        if st.tp > 1:
            (apply_sp if st.sp else apply_tp)(layer, chain.names[u], meshes.tp_mesh(reps, st.tp))
        if st.cp > 1:
            enable_context_parallel([layer], meshes.cp_group(st.dp, st.cp, st.tp), method=st.cp_method)
        if reps == 1:
            continue
        mesh = meshes.dp_mesh(reps, st.tp)
        apply_batch_group(layer, mesh.get_group())
        expert: set[nn.Parameter] = set()
        if st.ep > 1:
            apply_ep(layer, meshes, reps, st.tp, st.ep, counter)
            expert = reduce_experts(layer, st, meshes, replicated, zero)
        else:  # experts replicated: still route by the global batch's counts, as one process does
            apply_global_routing(layer, mesh.get_group())
        if st.dp_mode in ZERO_MODES:
            zero.add(layer, st.dp_mode, mesh, replicated, mesh.get_group(), reps, st.compression, ignored=expert)
        else:
            replicated.add(layer, mesh.get_group(), reps, st.compression, exclude=expert)
        if st.ep > 1:
            finish_expert_zero(layer, st, mesh.get_group(), replicated)
            mark_expert_shards(layer, meshes.expert_layout(reps, st.tp, st.ep))  # (ZeRO replaced the parameters)
    repoint_aliases(chain.module, originals, layers)
    modules = []
    for k in plan.stages_of_group(group):
        us = plan.layers_of_stage(k)
        specs = {"in_spec": chain.spec_before(us[0]), "out_spec": chain.spec_after(us[-1])} if us else {}
        modules.append(StageModule([chain.layers[u] for u in us], [layout_of(plan, u) for u in us], meshes,
                                   **specs, recompute=[plan.layers[u].strategy.recompute for u in us], zero=zero,
                                   all_to_all=counter, offload=[plan.layers[u].strategy.offload for u in us]))
    return modules, replicated


#: float8 matmuls need both dimensions of every operand divisible by 16 (torch._scaled_mm)
FP8_ALIGNMENT = 16


def apply_fp8(layer: nn.Module, precision: str, *, float8_all_gather: bool = False, tp: int = 1,
              where: str = "layer") -> nn.Module:
    """``layer`` with its ``nn.Linear`` modules (the layer itself, when it is one) converted to torchao's float8
    training (``convert_to_float8_training``: dynamic scales, :data:`~uniap_lightning.planner.dimensions.precision.
    RECIPES`'s recipe; ``float8_all_gather``: FSDP2 gathers the weights in float8, tensorwise only). Parameters keep
    their names and dtype (master weights); a linear whose dimensions (after ``tp``) are not multiples of
    :data:`FP8_ALIGNMENT` stays as it is (torchtitan filters the same way). Returns the module to use. Refused in
    one line without torchao, or on a CUDA device without float8 matmuls (compute capability below 8.9); a CPU runs
    torch's float8 matmul (numerics, not speed)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise UniAPError(f"{where} runs in {precision}: it needs torchao's float8 training (pip install "
                         f"'uniap-lightning[fp8]'): {err}") from err
    params = [p for p in layer.parameters()]
    if params and params[0].is_cuda and torch.cuda.get_device_capability(params[0].device) < (8, 9):
        raise UniAPError(f"{where} runs in {precision}, but {torch.cuda.get_device_name(params[0].device)} has no "
                         "float8 matmuls (compute capability 8.9 or newer: H100, H200, L40S); plan without fp8")
    if float8_all_gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = Float8LinearConfig.from_recipe_name(RECIPES[precision])
    step = FP8_ALIGNMENT * tp

    def fits(module: nn.Module, _fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and module.in_features % step == 0
                and module.out_features % step == 0)

    return convert_to_float8_training(layer, config=config, module_filter_fn=fits)


def apply_ep(layer: nn.Module, meshes: PlanMeshes, replicas: int, tp: int, ep: int, counter: AllToAllCounter) -> None:
    """Keep this rank's ``E / ep`` experts of every MoE layer of ``layer``, route tokens over its ep mesh; capacity
    and load-balancing statistics count every replica's tokens (the layer's data group), as one process does."""
    ep_mesh = meshes.ep_mesh(replicas, tp, ep)
    apply_expert_parallel(layer, ep_group=ep_mesh.get_group(), token_group=meshes.dp_mesh(replicas, tp).get_group(),
                          counter=counter)


def reduce_experts(layer: nn.Module, st: Any, meshes: PlanMeshes, replicated: ReplicatedGrads,
                   zero: ZeroLayers) -> set[nn.Parameter]:
    """How the expert shards of an ``ep > 1`` layer hold state and reduce gradients over the ``replicas / ep`` ranks
    holding the same experts (as the planner prices them): each shard's gradient already sums its ep group's tokens
    (the backward all-to-alls), so it is summed over those ranks only and divided by all ``replicas``. ``ep =
    replicas``: one rank, nothing to sum. ``replicate``: a bucket over them. ZeRO modes: each MoE module becomes an
    FSDP2 unit of its own over them, ignoring the rest of the module (the router: the layer's unit, built after,
    leaves a nested unit's subtree alone, so it stays whole, see :func:`finish_expert_zero`). Returns the shards the
    layer's own data parallelism must leave out."""
    reps, tp, ep = st.replicas, st.tp, st.ep
    shards = split_expert_params(layer)[0]
    if reps == ep:
        replicated.add_divided(shards, reps)
        return set(shards)
    if st.dp_mode not in ZERO_MODES:
        replicated.add_params(shards, meshes.expert_data_group(reps, tp, ep), reps)
        return set(shards)
    edp = meshes.expert_data_mesh(reps, tp, ep)
    for _, m in expert_modules(layer):
        mine = {id(getattr(m, p)) for p in m.uniap_expert_params}
        rest = {p for p in m.parameters() if id(p) not in mine}
        zero.add(m, st.dp_mode, edp, replicated, edp.get_group(), reps, ignored=rest)  # (zero1: buckets / reps)
    return set()


def finish_expert_zero(layer: nn.Module, st: Any, group: Any, replicated: ReplicatedGrads) -> None:
    """After the layer's own data parallelism, for MoE modules that are FSDP2 units of their own (ZeRO, see
    :func:`reduce_experts`): zero2/zero3 reduce-scatters average over the ``replicas / ep`` ranks holding the same
    experts, so the window's gradient is divided by ``ep`` more (FSDP2's own divide factor needs a premultiplied
    sum, which gloo lacks). Parameters the unit ignores, which the layer's unit does not take either (FSDP2 leaves
    a nested unit's subtree alone: the router, ``E x h``), stay whole on every replica and are averaged."""
    from torch.distributed.tensor import DTensor

    for _, m in expert_modules(layer):
        if not hasattr(m, "_get_fsdp_state"):
            continue
        experts = set(m.uniap_expert_params)
        orphans = [p for name, p in m.named_parameters() if name.split(".")[0] not in experts
                   and not isinstance(p, DTensor)]
        replicated.add_params(orphans, group, st.replicas)
        if st.dp_mode in ("zero2", "zero3"):
            replicated.add_divided([getattr(m, name) for name in m.uniap_expert_params], st.ep)


def repoint_aliases(root: nn.Module, originals: list[dict[str, nn.Parameter]], layers: list[nn.Module]) -> None:
    """Give modules of ``root`` outside the layers that held a layer's parameter (a tie inside one layer: T5's
    ``encoder.embed_tokens`` and ``decoder.embed_tokens`` are its ``shared`` embedding, which the embedding layer
    holds) the parameter that tensor parallelism or FSDP2 registered in its place (a DTensor). Otherwise they keep
    the original parameter, which no longer trains: the state dict, the checkpoints and the consolidated export
    would carry its initial values under those names."""
    moved: dict[int, nn.Parameter] = {}
    for before, layer in zip(originals, layers, strict=True):
        after = dict(layer.named_parameters())
        for name, p in before.items():
            if name in after and after[name] is not p:
                moved[id(p)] = after[name]
    if not moved:
        return
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in moved:
                module._parameters[name] = moved[id(p)]
