"""Expert parallelism: each rank of an ep group holds ``E / ep`` experts; tokens travel to them by all-to-all.

Execution (per MoE layer, :class:`ExpertParallel` installed as ``MoEMLP.experts_comm`` by
:func:`apply_expert_parallel`):

1. routing, capacity and the auxiliary loss are computed by the layer itself (:mod:`uniap_lightning.adapters.moe`);
   the per-slot, per-expert assignment counts ``[k, E]`` of every *token rank* are all-gathered first, so the
   capacity is counted over the global tokens of each expert and the drop decision is the one a single process
   makes on the concatenated batch (token ranks in order). The token group is the layer's data-parallel group
   (which contains the ep group, as in Megatron and DeepSpeed-MoE); its ranks, in ascending global rank (the
   order ``dist.new_group`` gives them), must hold the batch's chunks in that order. Under context parallelism it is
   the layer's ``dp x cp`` replicas, each holding sequence pieces: their tokens are not in one process's order, so
   only dropless layers split their sequence (``adapters.moe.MoEBlock``). Each call routes what it is given: under
   several micro-batches, each micro-batch on its own (one process accumulating them is the reference).
   ``token_group=None`` keeps everything local: capacity ``ceil(cf * N_local * k / E)`` and the load-balancing
   statistics over this rank's tokens only, i.e. each rank behaves as one process run on its own batch (what Megatron does by default); with
   no drops the two differ only in the auxiliary loss's statistics;
2. *dispatch*: the kept assignments, sorted by expert, are sent with ``all_to_all_single`` (split sizes = rows
   per destination rank; a ``[ep, E/ep]`` count exchange goes first so receivers know the splits);
3. the local experts run on their rows (regrouped expert-major);
4. *combine*: the outputs go back with the reverse all-to-all, then are weighted by their gates and summed per
   token by the layer. Backward runs the two reverse all-to-alls (:class:`_AllToAll`).

Each all-to-all adds a record to the :class:`AllToAllCounter` (bytes sent to other ranks, measured from the split
sizes at runtime). With balanced routing a rank sends ``b s k h (ep-1)/ep`` elements per all-to-all.

Gradients: an expert held by a rank receives the gradient of every token rank of its ep group through the
backward all-to-alls, so expert gradients are summed only over the ranks holding the *same* experts
(``ExpertLayout.expert_data_groups``); every other parameter over all data ranks; both divided by the number of
data ranks (:func:`reduce_gradients`; under ``strategy="uniap"`` the replicated-gradient buckets do the same,
``runtime/stage.py``). Checkpoints: :func:`shard_expert_state` / :func:`merge_expert_states` convert a one-process
state dict to an ep rank's and back; distributed checkpoints see the shards as DTensors of the full experts
(:func:`globalize_expert_state`). Data parallelism without ep (:func:`apply_global_routing`) still counts routing
over the data ranks' tokens, so it matches one process as ep does.

Findings, Hugging Face (transformers 5.25, ``modeling_{mixtral,qwen2_moe,olmoe}.py``): what expert parallelism replaces:

* Layout, all three: ``model.model.layers[i].mlp`` is ``<X>SparseMoeBlock`` with ``.gate`` (``<X>TopKRouter``:
  ``weight [E, h]``, returns ``(router_logits, top_k_weights, top_k_index)``; softmax in float32, top-k; Mixtral
  always renormalizes the k weights, Qwen2-MoE and OLMoE only if ``config.norm_topk_prob``, default False) and
  ``.experts`` (``<X>Experts``: *stacked* ``gate_up_proj [E, 2I, h]`` and ``down_proj [E, h, I]`` in ``F.linear``
  layout (out, in), SwiGLU ``down(act(gate) * up)``, no biases; ``forward(hidden [N, h], top_k_index [N, k],
  top_k_weights [N, k]) -> [N, h]``, wrapped by ``@use_experts_implementation`` which dispatches on
  ``config._experts_implementation``: "eager" loop, "grouped_mm", "batched_mm", ...). Qwen2-MoE adds a dense
  ``shared_expert`` (``Qwen2MoeMLP``) times ``sigmoid(shared_expert_gate(x))`` on every token (replicated, not
  sharded), and ``mlp_only_layers`` / ``decoder_sparse_step`` make some layers dense ``Qwen2MoeMLP``.
* No capacity: all three are dropless (our ``capacity_factor=None``); an ep wrapper must not drop either.
* Aux loss: not in the layer. With ``output_router_logits=True`` an ``OutputRecorder`` hook on ``<X>TopKRouter``
  (output 0) collects every layer's logits and ``<X>ForCausalLM.forward`` adds ``router_aux_loss_coef *
  load_balancing_loss_func(logits, E, k, attention_mask)`` (coef 0.001 Mixtral / Qwen2-MoE, 0.01 OLMoE). That
  function pools *all layers*: assignment counts and probability sums added over layers and rows (padding masked),
  then ``E * sum_e (counts_e / rows) * (probs_e / rows)`` (balanced = k): not a sum of per-layer losses. Our chain
  never runs ``ForCausalLM.forward``, so the generic split carries the statistics
  (:mod:`uniap_lightning.adapters.families.generic_router`): both sums are additive over samples, so a ``[B, 2E]``
  per-sample accumulator through the blocks rebuilds HF's value exactly, per micro-batch; the epilogue sums it over
  the layer's data ranks (its ``uniap_batch_group``, set by :func:`apply_batch_group`) for the global one.
* What an ep wrapper replaces: only ``mlp.experts`` (same call, same parameter names). :class:`HFExperts` does it
  (:func:`wrap_hf_experts`, called by :func:`apply_expert_parallel`): pairs sorted by expert,
  :meth:`ExpertParallel.run_experts` with ``expert_fn(e, x) = F.linear(act(g) * u, down_proj[e])`` where
  ``g, u = F.linear(x, gate_up_proj[e]).chunk(2, -1)``, gate-weighted rows ``index_add``-ed back; ``gate_up_proj``
  / ``down_proj`` sharded on dim 0. The router, shared expert and attention stay replicated (data-parallel
  gradients). Tested with and without the aux term (``output_router_logits``), see ``test_expert_plans.py``.
* transformers 5.25 also ships its own EP (``DistributedConfig(ep_size=..., ep_implementation="all_to_all")``
  with ``base_model_ep_plan``: ``gate_up_proj`` / ``down_proj`` as DTensor ``Shard(0)``, ``mlp.experts`` as
  ``ep_dispatch_experts`` using ``all_to_all_single_autograd``, dropless). It needs its own device mesh and
  composes with its own TP/FSDP, so it does not fit a per-layer plan; its all-to-all scheme is the same as ours.

The layout and gradients are :mod:`.expert_layout`, the checkpoint state :mod:`.expert_state` (their names are
importable from here too).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.expert_layout import (
    ExpertGroups,
    ExpertLayout,
    check_expert_degree,
    expert_modules,
    new_expert_groups,
    reduce_gradients,
    split_expert_params,
)
from uniap_lightning.runtime.expert_state import (
    _shard,
    expert_shard_meshes,
    expert_state_keys,
    globalize_expert_state,
    localize_expert_state,
    mark_expert_shards,
    merge_expert_states,
    shard_expert_state,
)

if TYPE_CHECKING:
    from uniap_lightning.adapters.moe import ExpertFn

__all__ = [
    "AllToAllCounter", "AllToAllRecord", "ExpertGroups", "ExpertLayout", "ExpertParallel", "HFExperts",
    "apply_batch_group", "apply_expert_parallel", "apply_global_routing", "check_expert_degree", "check_expert_plan",
    "expert_counts", "expert_modules", "expert_profile_fields", "expert_shard_meshes", "expert_state_keys",
    "globalize_expert_state", "localize_expert_state", "mark_expert_shards", "merge_expert_states",
    "new_expert_groups", "reduce_gradients", "shard_expert_state", "split_expert_params", "wrap_hf_experts",
]


# ------------------------------------------------------------------------------------------------ all-to-all
@dataclass(frozen=True)
class AllToAllRecord:
    name: str  # "dispatch", "combine", "dispatch.grad" (backward of dispatch), "combine.grad"
    rows_sent: int  # rows to other ranks
    rows_kept: int  # rows this rank sends to itself (no transfer)
    bytes_sent: int


@dataclass
class AllToAllCounter:
    """Every all-to-all of the expert layers that share it, in the order they ran."""

    records: list[AllToAllRecord] = field(default_factory=list)

    def add(self, name: str, send_splits: Sequence[int], own: int, row_bytes: int) -> None:
        sent = sum(send_splits) - send_splits[own]
        self.records.append(AllToAllRecord(name, sent, send_splits[own], sent * row_bytes))

    def bytes_sent(self, *, names: Iterable[str] | None = None) -> int:
        wanted = None if names is None else set(names)
        return sum(r.bytes_sent for r in self.records if wanted is None or r.name in wanted)

    def reset(self) -> None:
        self.records.clear()


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes on dim 0; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any,
                counter: AllToAllCounter, name: str) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.counter, ctx.name = send, recv, group, counter, name
        return _exchange(x, send, recv, group, counter, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        back = _exchange(grad, ctx.recv, ctx.send, ctx.group, ctx.counter, f"{ctx.name}.grad")
        return back, None, None, None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any, counter: AllToAllCounter,
              name: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, recv, send, group=group)
    row_bytes = math.prod(x.shape[1:]) * x.element_size()  # also when this rank sends no rows at all
    counter.add(name, send, dist.get_rank(group), row_bytes)
    return out


# ------------------------------------------------------------------------------------------------ execution
class ExpertParallel:
    """Runs one rank's share of an MoE layer's experts (implements ``adapters.moe.ExpertsComm``)."""

    def __init__(self, n_experts: int, *, ep_group: Any, token_group: Any, counter: AllToAllCounter) -> None:
        """``ep_group=None``: every expert here (no all-to-all), routing counted over ``token_group`` only."""
        self.ep_group, self.token_group, self.counter = ep_group, token_group, counter
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_index = 0 if ep_group is None else dist.get_rank(ep_group)
        check_expert_degree(n_experts, self.ep)
        self.n_experts, self.local = n_experts, n_experts // self.ep
        self.offset = self.ep_index * self.local
        self.token_rank = 0 if token_group is None else dist.get_rank(token_group)

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        if self.token_group is None:
            return counts.unsqueeze(0)
        parts = [torch.empty_like(counts) for _ in range(dist.get_world_size(self.token_group))]
        dist.all_gather(parts, counts.contiguous(), group=self.token_group)
        return torch.stack(parts)

    def run_experts(self, rows: torch.Tensor, rows_per_expert: torch.Tensor, expert_fn: ExpertFn) -> torch.Tensor:
        if self.ep_group is None:
            return torch.cat([expert_fn(e, r) for e, r in enumerate(rows.split(rows_per_expert.tolist()))])
        ep, local = self.ep, self.local
        send_counts = rows_per_expert.view(ep, local)  # [destination rank, its local expert]
        recv_counts = torch.empty_like(send_counts)  # [source rank, my local expert]
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.ep_group)
        self.counter.add("counts", [1] * ep, self.ep_index, local * send_counts.element_size())
        send, recv = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        got = _AllToAll.apply(rows, send, recv, self.ep_group, self.counter, "dispatch")
        # received source-major (each source's rows expert-major); the experts want expert-major
        pieces = got.split(recv_counts.reshape(-1).tolist())
        outs: list[torch.Tensor | None] = [None] * len(pieces)
        for e in range(local):
            mine = [pieces[src * local + e] for src in range(ep)]
            y = expert_fn(e, torch.cat(mine))
            for src, part in zip(range(ep), y.split([p.shape[0] for p in mine])):
                outs[src * local + e] = part
        back = torch.cat([o for o in outs if o is not None])
        return _AllToAll.apply(back, recv, send, self.ep_group, self.counter, "combine")


def apply_expert_parallel(module: nn.Module, *, ep_group: Any, token_group: Any,
                          counter: AllToAllCounter | None = None) -> AllToAllCounter:
    """Keep this rank's ``E / ep`` experts of every MoE layer of ``module`` and route tokens over ``ep_group``.

    ``token_group``: the ranks whose tokens together form the batch a single process would see (the layer's data
    group, containing ``ep_group``); ``None``: capacity and load-balancing statistics over local tokens only.
    Returns the counter every layer records its all-to-alls in. Call before building the optimizer.
    """
    counter = AllToAllCounter() if counter is None else counter
    wrap_hf_experts(module)
    ep, index = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for name, m in expert_modules(module):
        check_expert_degree(m.n_experts, ep, f"MoE layer {name!r}")
        comm = ExpertParallel(m.n_experts, ep_group=ep_group, token_group=token_group, counter=counter)
        for pname in m.uniap_expert_params:
            full = getattr(m, pname)
            setattr(m, pname, nn.Parameter(_shard(full.detach(), ep, index).clone(), full.requires_grad))
        m.experts_comm = comm
    return counter


def apply_global_routing(module: nn.Module, token_group: Any) -> int:
    """Every MoE layer of ``module`` keeps all its experts but counts capacity and load-balancing statistics over
    the tokens of ``token_group`` (the layer's data ranks), so data parallelism without ep matches one process on
    the concatenated batch too (one ``[k, E]`` all-gather per layer and micro-batch). Returns the layers changed.
    Hugging Face experts are left as they are: dropless, with the auxiliary loss outside the layer."""
    layers = expert_modules(module)
    for _, m in layers:
        m.experts_comm = ExpertParallel(m.n_experts, ep_group=None, token_group=token_group,
                                        counter=AllToAllCounter())
    return len(layers)


def apply_batch_group(module: nn.Module, group: Any) -> int:
    """Modules of ``module`` that pool statistics over the whole micro-batch (declaring ``uniap_batch_group``: the
    generic Hugging Face epilogue, which sums the routers' statistics for the load-balancing loss) get ``group``,
    the layer's data ranks (they hold the micro-batch's other samples). Returns how many."""
    found = [m for m in module.modules() if hasattr(m, "uniap_batch_group")]
    for m in found:
        m.uniap_batch_group = group
    return len(found)


class HFExperts(nn.Module):
    """A Hugging Face ``<X>Experts`` (Mixtral, Qwen2-MoE, OLMoE: stacked ``gate_up_proj [E, 2I, h]``,
    ``down_proj [E, h, I]``, SwiGLU) with the same parameter names and call, routed like :class:`MoEMLP`."""

    uniap_expert_params = ("gate_up_proj", "down_proj")

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.n_experts = experts.gate_up_proj.shape[0]
        self.gate_up_proj, self.down_proj, self.act_fn = experts.gate_up_proj, experts.down_proj, experts.act_fn
        self.experts_comm: ExpertParallel | None = None

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj[e])

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        n, k = top_k_index.shape
        expert_of = top_k_index.reshape(-1)
        order = torch.argsort(expert_of, stable=True)
        token_of = torch.arange(n, device=hidden.device).repeat_interleave(k)[order]
        rows, rows_per_expert = hidden[token_of], torch.bincount(expert_of, minlength=self.n_experts)
        if self.experts_comm is None:
            out = torch.cat([self._expert(e, r) for e, r in enumerate(rows.split(rows_per_expert.tolist()))])
        else:
            out = self.experts_comm.run_experts(rows, rows_per_expert, self._expert)
        weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(hidden).index_add(0, token_of, weighted.to(hidden.dtype))


def _hf_experts(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in module.named_modules() if type(m).__name__.endswith("Experts")
            and not isinstance(m, HFExperts)
            and isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and m.gate_up_proj.dim() == 3]


def expert_counts(module: nn.Module) -> dict[str, int]:
    """The MoE layers of ``module`` expert parallelism can split (own :class:`MoEMLP`-like modules and Hugging Face
    stacked experts), by name, with their expert counts."""
    found = {name: int(m.n_experts) for name, m in expert_modules(module)}
    found.update({name: int(m.gate_up_proj.shape[0]) for name, m in _hf_experts(module)})
    return found


def expert_profile_fields(layer: nn.Module) -> dict[str, Any]:
    """The expert fields of a layer's profile entry (``planner/profile.py``: ``experts``, ``top_k``,
    ``expert_params``, and ``capacity_factor`` where the layer drops tokens), so the planner can price ``ep`` for it;
    ``{}`` for a dense layer. Own MoE modules report their own; Hugging Face stacked experts take ``top_k`` from the
    router beside them (``mlp.gate``) and are dropless."""
    own = [m for _, m in expert_modules(layer)]
    hf = [(name, m) for name, m in _hf_experts(layer)]
    if not own and not hf:
        return {}
    counts = {int(m.n_experts) for m in own} | {int(m.gate_up_proj.shape[0]) for _, m in hf}
    if len(counts) != 1:
        raise UniAPError(f"a layer with mixture-of-experts modules of different expert counts {sorted(counts)}: "
                         "split the chain so each layer has one kind")
    params = sum(getattr(m, p).numel() for m in own for p in m.uniap_expert_params)
    params += sum(m.gate_up_proj.numel() + m.down_proj.numel() for _, m in hf)
    top_k = {int(m.top_k) for m in own}
    for name, _ in hf:
        parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
        router = getattr(parent, "gate", None)
        top_k.add(int(getattr(router, "top_k", 1)))
    out: dict[str, Any] = {"experts": counts.pop(), "top_k": max(top_k), "expert_params": int(params)}
    factors = {m.capacity_factor for m in own if m.capacity_factor is not None}
    if factors:
        out["capacity_factor"] = float(max(factors))
    return out


def check_expert_plan(layer: nn.Module, where: str, ep: int) -> None:
    """Refuse, in one line, ``ep > 1`` on a layer whose experts the runtime cannot split."""
    counts = expert_counts(layer)
    if not counts:
        raise UniAPError(f"{where}: ep={ep} (expert parallelism) but the layer has no experts the runtime can split "
                         "(mixture-of-experts modules declaring uniap_expert_params, or Hugging Face stacked experts); "
                         "plan it with ep=1")
    for name, n in counts.items():
        check_expert_degree(n, ep, f"{where} ({name or 'the layer'})")


def wrap_hf_experts(module: nn.Module) -> int:
    """Replace every Hugging Face stacked-experts module of ``module`` by :class:`HFExperts` (same parameters,
    same names; all experts still here). Returns how many; :func:`apply_expert_parallel` then shards them."""
    found = _hf_experts(module)
    for name, m in found:
        if getattr(m, "has_bias", False) or getattr(m, "is_transposed", False) or not getattr(m, "has_gate", True) \
                or not getattr(m, "is_concatenated", True):
            raise UniAPError(f"{name} ({type(m).__name__}): only bias-free, concatenated [gate; up] experts in "
                             f"F.linear layout can run expert-parallel (Mixtral, Qwen2-MoE, OLMoE)")
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, HFExperts(m))
    return len(found)
