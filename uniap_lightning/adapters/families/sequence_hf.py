"""Ulysses and ring context parallelism for Hugging Face decoders and BERT through transformers' ``AttentionInterface``.

:func:`enable_hf_ulysses` switches the attention of a chain's decoder blocks (:class:`DecoderSequence`: the GPT-2
and Llama blocks of :mod:`.text_decoders`, also the ``hf_layers`` chain's) to the registered ``"uniap_ulysses"``
attention function, which runs :func:`uniap_lightning.runtime.sequence.ulysses_attention` over the group stored on
each attention module; Llama's blocks then give the rotary embeddings global positions
(``position_ids = cp_rank x s/c + arange(s/c)``, the slice
:func:`~uniap_lightning.runtime.sequence.shard_causal_lm_batch` gives). Masks: causal, plus the key padding mask
the :func:`~uniap_lightning.runtime.sequence.padding_mask` context sets (the tensor chain passes no attention mask).
Without a group (``group=None``) the same function runs the one-process attention, masks included. The function
dispatches on the attention module's ``uniap_cp_method``: ``"ulysses"`` (the default) or ``"ring"``
(:func:`uniap_lightning.runtime.ring.ring_attention`: same pieces, same masks, no heads condition, no attention
dropout); every ``enable_*`` function and :func:`switch_attention` take ``method``.

:func:`enable_bert_ulysses` does the same for the BERT blocks of :mod:`.families.text`: bidirectional attention
(BERT's ``is_causal`` is false) over the whole sequence with the key padding mask gathered over the cp group; each
switched attention gets its own copy of the config, so blocks left at cp 1 keep the model's attention and masks.
The embedding adds global absolute positions itself (``BertEmbed``).

:func:`llama_sp_plan` and :func:`bert_sp_plan` are the Llama and BERT blocks' tensor-parallel plans with sequence
parallelism (for :func:`uniap_lightning.runtime.sequence_tp.apply_sp`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.ring import ring_attention
from uniap_lightning.runtime.sequence import CP_METHODS, attention, check_ulysses, ulysses_attention
from uniap_lightning.runtime.sequence_tp import sp_boundary

ATTENTION_NAME = "uniap_ulysses"


def ulysses_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q/k/v ``[b, heads, s/c, d]`` -> ``([b, s/c, heads, d], None)``;
    Ulysses or ring attention over the module's group (``module.uniap_cp_method``)."""
    if attention_mask is not None:
        raise UniAPError(f"{ATTENTION_NAME} attention takes its padding mask from sequence.padding_mask, not a "
                         "4-D attention_mask (the chain calls decoder layers without one)")
    group, key_valid = getattr(module, "uniap_cp_group", None), getattr(module, "uniap_key_valid", None)
    causal = bool(getattr(module, "is_causal", True))
    if group is None:
        out = attention(query, key, value, causal=causal, key_valid=key_valid, dropout_p=dropout, scale=scaling)
    elif getattr(module, "uniap_cp_method", "ulysses") == "ring":
        out = ring_attention(query, key, value, group, causal=causal, key_valid=key_valid, scale=scaling,
                             counter=getattr(module, "uniap_cp_counter", None), dropout_p=dropout)
    else:
        out = ulysses_attention(query, key, value, group, causal=causal, key_valid=key_valid, dropout_p=dropout,
                                scale=scaling, counter=getattr(module, "uniap_cp_counter", None))
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :func:`ulysses_attention_forward` as ``"uniap_ulysses"`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention_forward)


class DecoderSequence:
    """The sequence hooks of a decoder block (GPT-2, Llama: :mod:`.text_decoders`, whose blocks the ``hf_layers``
    chain uses too) over its attention module ``_attention()``: Ulysses (heads per tensor-parallel rank divisible by
    cp) or ring attention over the context-parallel group (:func:`switch_attention` on a copy of the config, so
    blocks left at cp 1 keep the model's attention and masks); the block's ``forward`` then reads ``_cp_group``
    (Llama's rotary positions are global under cp)."""

    _cp_group: Any = None

    def _attention(self) -> nn.Module:
        raise NotImplementedError

    def _heads(self) -> tuple[int, int]:
        raise NotImplementedError

    def uniap_cp_methods(self) -> list[str]:
        return ["ulysses", "ring"]

    def uniap_enable_cp(self, group: Any, *, method: str = "ulysses", counter: Any = None) -> None:
        switch_attention(self._attention(), group, counter=counter, own_config=True, method=method,
                         heads=self._heads()[0], name=type(self).__name__)
        self._cp_group = group


def enable_hf_ulysses(layers: Iterable[nn.Module], group: Any | None, *, counter: Any = None,
                      method: str = "ulysses") -> int:
    """Run the decoder blocks' attention (:class:`DecoderSequence`) with Ulysses (or ``method="ring"``: ring
    attention) over ``group`` (``None``: one process, same function, so the key padding mask of
    :func:`~uniap_lightning.runtime.sequence.padding_mask` applies); returns how many blocks switched. Ulysses:
    checks heads against the group size up front."""
    n = 0
    for layer in layers:
        if isinstance(layer, DecoderSequence):
            layer.uniap_enable_cp(group, counter=counter, method=method)
            n += 1
    return n


def switch_attention(attn: nn.Module, group: Any | None, *, counter: Any = None, own_config: bool = False,
                     method: str = "ulysses", heads: int | None = None, name: str = "attention") -> None:
    """Point a transformers attention module (one that calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``)
    at :func:`ulysses_attention_forward` over ``group``. The config is the model's, shared by its layers: layers
    without a group run the same function in one process (causal SDPA, as before). ``own_config``: switch a copy
    of the config that only this module reads (the other layers keep the model's attention and masks). ``method``:
    ``"ulysses"`` or ``"ring"``; Ulysses first checks ``heads`` (per tensor-parallel rank: the module's sharded
    weights say the tp degree) against the group size, naming ``name``."""
    if method not in CP_METHODS:
        raise UniAPError(f"{ATTENTION_NAME}: context-parallel method {method!r} is not one of {list(CP_METHODS)}")
    if method == "ulysses" and heads is not None:
        tp = next((p.device_mesh.size() for p in attn.parameters() if hasattr(p, "device_mesh")), 1)
        check_ulysses(heads=heads, cp=1 if group is None else dist.get_world_size(group), tp=tp,
                      name=f"{name} (ulysses)")
    register()
    if own_config:
        attn.config = copy.copy(attn.config)
    attn.config._attn_implementation = ATTENTION_NAME
    attn.uniap_cp_group, attn.uniap_cp_counter, attn.uniap_key_valid = group, counter, None
    attn.uniap_cp_method = method


def llama_sp_plan(tp: int) -> dict[str, Any]:
    """Sequence parallelism for a Llama block (``LlamaSequenceBlock``): the boundary sits on the decoder layer (the
    block computes the rotary embedding for the whole sequence first), the RMSNorms run on sequence pieces, attention
    and MLP gather their input once (q/k/v and gate/up share it), o_proj and down_proj reduce-scatter."""
    gathered = ColwiseParallel(input_layouts=Replicate())
    return {
        "layer": sp_boundary(),
        "layer.input_layernorm": SequenceParallel(),
        "layer.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                              desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "layer.self_attn.q_proj": gathered,
        "layer.self_attn.k_proj": gathered,
        "layer.self_attn.v_proj": gathered,
        "layer.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "layer.post_attention_layernorm": SequenceParallel(),
        "layer.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layer.mlp.gate_proj": gathered,
        "layer.mlp.up_proj": gathered,
        "layer.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def enable_bert_ulysses(block: nn.Module, group: Any, *, counter: Any = None, method: str = "ulysses") -> None:
    """Run a ``BertBlock``'s self-attention with Ulysses (or ``method="ring"``) over ``group``: bidirectional, the
    padding mask of the
    block's sequence piece gathered over the group (the block sets it with
    :func:`~uniap_lightning.runtime.sequence.padding_mask` and passes no 4-D mask). Checks the heads per
    tensor-parallel rank against the group size."""
    attn = block.layer.attention.self
    switch_attention(attn, group, counter=counter, own_config=True, method=method, heads=attn.num_attention_heads,
                     name=type(block).__name__)


def bert_sp_plan(tp: int) -> dict[str, Any]:
    """Sequence parallelism for a ``BertBlock``. BERT is post-norm: each residual sum is normalized, so the
    activations sequence-sharded over the tp ranks are the block's input, the two residual sums and the
    LayerNorms' outputs (the next residual reads them: the norms hand their local pieces on). The boundary sits on
    the ``BertLayer`` (the block's input is a dict; the 4-D padding mask is built for the whole sequence), query /
    key / value share one all-gather of the input, the intermediate dense gathers the attention's output, and the
    two output denses reduce-scatter."""
    gathered = ColwiseParallel(input_layouts=Replicate())
    return {
        "layer": sp_boundary(),
        "layer.attention.self": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layer.attention.self.query": gathered,
        "layer.attention.self.key": gathered,
        "layer.attention.self.value": gathered,
        "layer.attention.output.dense": RowwiseParallel(output_layouts=Shard(1)),
        "layer.attention.output.LayerNorm": SequenceParallel(use_local_output=True),
        "layer.intermediate.dense": ColwiseParallel(input_layouts=Shard(1)),
        "layer.output.dense": RowwiseParallel(output_layouts=Shard(1)),
        "layer.output.LayerNorm": SequenceParallel(use_local_output=True),
    }
