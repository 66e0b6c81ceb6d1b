"""Expert shards in checkpoints (:mod:`.experts`): the state-dict keys stacked over experts, a one-process state
to an ep rank's and back, and, for distributed checkpoints, every expert shard as a ``DTensor`` of the full experts
on its ``(ep, edp)`` mesh, so checkpoints reshard experts by name to any ep degree and ZeRO mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.expert_layout import check_expert_degree, expert_modules

def expert_state_keys(module: nn.Module, prefix: str = "") -> set[str]:
    """State-dict keys of ``module`` that are stacked over experts (sharded on dim 0 under expert parallelism)."""
    return {f"{prefix}{name}.{p}" if name else f"{prefix}{p}"
            for name, m in expert_modules(module) for p in m.uniap_expert_params}


def _shard(t: torch.Tensor, ep: int, index: int) -> torch.Tensor:
    check_expert_degree(t.shape[0], ep)
    size = t.shape[0] // ep
    return t[index * size:(index + 1) * size]


def shard_expert_state(state: dict[str, torch.Tensor], keys: Iterable[str], *, ep: int,
                       index: int) -> dict[str, torch.Tensor]:
    """A one-process state dict -> the state of ep rank ``index`` (its experts' slices; other entries as is)."""
    keys = set(keys)
    missing = sorted(keys - set(state))
    if missing:
        raise UniAPError(f"expert state: the checkpoint has no entry {missing[0]!r} (expert parameters expected)")
    return {k: _shard(v, ep, index).clone() if k in keys else v for k, v in state.items()}


def mark_expert_shards(module: nn.Module, layout: Any) -> list[nn.Parameter]:
    """After :func:`apply_expert_parallel` (and again after ZeRO replaced the parameters): remember each MoE layer's
    ``(ep, edp)`` mesh (``uniap_ep_mesh``, read by :func:`expert_shard_meshes`) and each expert shard's degree
    (``uniap_ep``, read by the global gradient norm); returns the shards."""
    shards = []
    for _, m in expert_modules(module):
        m.uniap_ep_mesh = layout
        for pname in m.uniap_expert_params:
            p = getattr(m, pname)
            p.uniap_ep = layout.size(0)
            shards.append(p)
    return shards


def expert_shard_meshes(module: nn.Module) -> dict[str, tuple[Any, nn.Parameter]]:
    """State-dict name -> ``((ep, edp) mesh, parameter)`` of every expert shard of ``module`` (empty without expert
    parallelism)."""
    return {f"{name}.{p}" if name else p: (m.uniap_ep_mesh, getattr(m, p)) for name, m in expert_modules(module)
            if getattr(m, "uniap_ep_mesh", None) is not None for p in m.uniap_expert_params}


def _expert_entries(state: dict[str, Any], meshes: dict[str, Any], optimizer: bool) -> list[tuple[str, Any]]:
    """``(key, (mesh, parameter))`` of the entries of a (flattened) model or optimizer state dict that are expert
    shards or their optimizer states."""
    out = []
    for key, value in state.items():
        fqn = key
        if optimizer:  # "state.<fqn>.<name>" (flatten_optimizer_state_dict); param_groups hold no tensors
            if not key.startswith("state."):
                continue
            fqn = key[len("state."):].rpartition(".")[0]
        if fqn in meshes and isinstance(value, torch.Tensor) and value.dim() > 0:
            out.append((key, meshes[fqn]))
    return out


def globalize_expert_state(state: dict[str, Any], meshes: dict[str, Any], *, optimizer: bool = False) -> None:
    """In place: every expert shard of a (flattened) model or optimizer state dict becomes a ``DTensor`` of the full
    ``[E, ...]`` experts on its ``(ep, edp)`` mesh: ``Shard(0)`` over ep, then ``Replicate()`` over the ranks
    holding the same experts, or ``Shard(0)`` where ZeRO shards them there (a ``DTensor`` on the edp mesh). So
    distributed checkpoints reshard experts by name to any ep degree and ZeRO mode, as FSDP and TP shards are
    (:func:`localize_expert_state` undoes it after a load)."""
    for key, (layout, _) in _expert_entries(state, meshes, optimizer):
        value = state[key]
        if isinstance(value, DTensor) and value.device_mesh is layout:
            continue
        if isinstance(value, DTensor):  # ZeRO over the edp ranks: the ep block's shard
            block = tuple(value.shape)
            full = (block[0] * layout.size(0), *block[1:])
            state[key] = DTensor.from_local(value.to_local(), layout, [Shard(0), Shard(0)], run_check=False,
                                            shape=torch.Size(full), stride=_contiguous_stride(full))
        else:
            state[key] = DTensor.from_local(value, layout, [Shard(0), Replicate()], run_check=False)


def localize_expert_state(state: dict[str, Any], meshes: dict[str, Any], *, optimizer: bool = False) -> None:
    """In place: the entries :func:`globalize_expert_state` wrapped, back to what the parameter is: this rank's
    plain ep block, or its ZeRO shard as a ``DTensor`` on the edp mesh."""
    for key, (layout, param) in _expert_entries(state, meshes, optimizer):
        value = state[key]
        if not (isinstance(value, DTensor) and value.device_mesh is layout):
            continue
        if isinstance(param, DTensor):
            state[key] = DTensor.from_local(value.to_local(), param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
        else:
            state[key] = value.to_local()


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))


def merge_expert_states(states: Sequence[dict[str, torch.Tensor]], keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The states of ep ranks ``0..ep-1`` -> one process's (experts concatenated in rank order; others from rank 0)."""
    keys = set(keys)
    return {k: torch.cat([s[k] for s in states]) if k in keys else v for k, v in states[0].items()}
