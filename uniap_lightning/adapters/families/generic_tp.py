"""Tensor parallelism of a generic block (:mod:`.generic`), inferred from the block's structure and its attention's
code: Megatron-style (query / key / value and the MLP's input projections column-parallel, the attention's output and
the MLP's output projection row-parallel) where the projections have known names and the attention takes its head
count from the projections' width; ``None`` (no tensor parallelism) for anything else.
"""
from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from uniap_lightning.adapters.families.common import divisors_of_all

_ATTENTION_OUT = ("o_proj", "dense", "out_proj")
_MLPS = ((("gate_proj", "up_proj"), "down_proj"), (("fc1",), "fc2"), (("up_proj",), "down_proj"),
         (("dense_h_to_4h",), "dense_4h_to_h"))
#: fused query / key / value projections laid out per head (``[heads, 3 * head_dim]``: a contiguous slice of the
#: output features is whole heads with their q, k and v), recognized by the reshape in the attention's forward
_FUSED = (("query_key_value", "dense", "(*input_shape,-1,3*self.head_size)"),)  # GPT-NeoX


def _linear(m: nn.Module, name: str) -> bool:
    return isinstance(getattr(m, name, None), nn.Linear)


def _others(module: nn.Module, linears: tuple[str, ...]) -> bool:
    """Whether ``module`` holds parameters outside its ``linears``."""
    inside = {id(p) for n in linears for p in getattr(module, n).parameters()}
    return any(id(p) not in inside for p in module.parameters())


def _tensor_parallel(block: nn.Module, config: Any) -> tuple[dict[str, str], list[int]] | None:
    """Megatron-style tensor parallelism of a block with separate query / key / value projections (or a fused one
    laid out per head, :data:`_FUSED`) and an MLP of known names: ``({path: "col" | "row"}, degrees)``; ``None``
    when the block is not recognized (Falcon's fused QKV reshaped with its full head count, an attention that
    reshapes with its full head count, ...)."""
    separate = [(n, m, ("q_proj", "k_proj", "v_proj"), next(o for o in _ATTENTION_OUT if _linear(m, o)),
                 "(*input_shape,-1,self.head_dim)") for n, m in block.named_modules()
                if all(_linear(m, p) for p in ("q_proj", "k_proj", "v_proj"))
                and any(_linear(m, o) for o in _ATTENTION_OUT)]
    fused = [(n, m, (qkv,), out, shape) for n, m in block.named_modules() for qkv, out, shape in _FUSED
             if _linear(m, qkv) and _linear(m, out)]
    attention = separate + fused
    if len(attention) != 1:
        return None
    name, attn, projections, out, shape = attention[0]
    try:
        source = "".join(inspect.getsource(type(attn).forward).split())
    except (OSError, TypeError):
        return None
    # the heads come from the projections' width (``-1`` heads), so each rank runs its own whole heads
    if shape not in source or "reshape(*input_shape,-1)" not in source:
        return None
    if _others(attn, (*projections, out)):
        return None  # e.g. Qwen3's per-head query / key norms: replicated weights seeing only this rank's heads
    prefix = f"{name}." if name else ""
    plan = {**{f"{prefix}{p}": "col" for p in projections}, f"{prefix}{out}": "row"}
    mlps = []
    for n, m in block.named_modules():
        found = next(((c, r) for c, r in _MLPS if m is not attn and all(_linear(m, x) for x in c) and _linear(m, r)),
                     None)
        if found is not None:
            mlps.append((n, m, *found))
    if len(mlps) != 1:
        return None
    name, mlp, cols, row = mlps[0]
    if _others(mlp, (*cols, row)):
        return None
    prefix = f"{name}." if name else ""
    plan.update({f"{prefix}{c}": "col" for c in cols})
    plan[f"{prefix}{row}"] = "row"
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if not heads:
        return None
    return plan, divisors_of_all(heads, kv, getattr(mlp, cols[0]).out_features)
