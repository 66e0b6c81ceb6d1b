"""BERT as a chain (:mod:`.text`): embeddings, one layer per ``BertLayer`` (its padding mask rebuilt from the batch's
integer ``attention_mask``; multiple choice keeps ``[batch, choices, seq, ...]`` and each block flattens the choices
for its own call), and the head (masked LM, sequence classification, token classification, question answering,
multiple choice). Megatron-style tensor parallelism; on transformers 5.x, Ulysses or ring context parallelism and
sequence parallelism (every head but multiple choice).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.family import Family
from uniap_lightning.adapters.chain_layers import GlobalPositions
from uniap_lightning.adapters.families import compat
from uniap_lightning.adapters.families.common import View, colwise, divisors_of_all, replicate, rowwise
from uniap_lightning.adapters.families.sequence_hf import bert_sp_plan, enable_bert_ulysses
from uniap_lightning.adapters.families.text_heads import (
    Payload,
    TokenHead,
    _family,
    _first,
    _has,
    _unsupported_head,
    head_kind,
)
from uniap_lightning.runtime.sequence import padding_mask, position_offset


class BertEmbed(View):
    """input_ids (+ token_type_ids) -> hidden; the attention mask travels on. Under context parallelism
    (:class:`BertSequenceEmbed`) its input is a contiguous piece of each sequence (token types sliced alike) and the
    absolute positions are global: ``cp_rank x s/c + arange(s/c)``."""

    _cp_group: Any = None

    def forward(self, d: Payload) -> dict[str, Any]:
        ids, types = d["input_ids"], d.get("token_type_ids")
        flat = ids.reshape(-1, ids.shape[-1])  # multiple choice: [batch, choices, seq] -> one row per choice
        pos = None
        if self._cp_group is not None:
            start = position_offset(self._cp_group, flat.shape[1])
            pos = torch.arange(start, start + flat.shape[1], device=ids.device).unsqueeze(0)
        hidden = self.embeddings(input_ids=flat, token_type_ids=None if types is None else types.reshape(flat.shape),
                                 position_ids=pos)
        return {"hidden": hidden.reshape(*ids.shape, hidden.shape[-1]), "input_ids": None, "token_type_ids": None}

    def uniap_tp_degrees(self) -> list[int]:
        return divisors_of_all(self.embeddings.word_embeddings.num_embeddings)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"embeddings.word_embeddings": rowwise(input_layouts=replicate(), output_layouts=replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1


class BertBlock(View):
    """One ``BertLayer``; its padding mask rebuilt from the batch's ``attention_mask``. Megatron-style tensor
    parallelism: query/key/value and the intermediate dense column-parallel, the two output denses row-parallel
    (the attention reshapes with ``-1`` heads, so each rank runs ``heads / tp`` whole heads)."""

    _cp_group: Any = None

    def __init__(self, layer: nn.Module, config: Any) -> None:
        super().__init__(layer=layer)
        self.config = config

    def forward(self, d: Payload) -> dict[str, torch.Tensor]:
        shape = d["hidden"].shape  # [batch, (choices,) seq, hidden]
        hidden = d["hidden"].reshape(-1, *shape[-2:])
        mask = d.get("attention_mask")
        mask = None if mask is None else mask.reshape(hidden.shape[:2])
        if self._cp_group is not None:  # Ulysses: this piece's padding mask, gathered over the group in attention
            with padding_mask([self.layer], None if mask is None else mask.bool()):
                out = self.layer(hidden, attention_mask=None)
        else:
            out = self.layer(hidden, attention_mask=compat.bidirectional_mask(self.config, hidden, mask))
        return {"hidden": _first(out).reshape(shape)}

    def uniap_tp_degrees(self) -> list[int]:
        if not compat.at_least(compat.BERT_HEADS_FROM_SHAPE):  # 4.x: a fixed number of heads per rank
            return [1]
        return divisors_of_all(self.config.num_attention_heads, self.config.intermediate_size)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"layer.attention.self.query": colwise(), "layer.attention.self.key": colwise(),
                "layer.attention.self.value": colwise(), "layer.attention.output.dense": rowwise(),
                "layer.intermediate.dense": colwise(), "layer.output.dense": rowwise()}

    def uniap_tp_allreduces(self) -> int:
        return 2


class BertSequenceEmbed(GlobalPositions, BertEmbed):
    """:class:`BertEmbed` that may run on pieces of the sequence (every head but multiple choice, whose inputs are
    ``[batch, choices, seq]``): token-wise, global positions under context parallelism."""


class BertSequenceBlock(BertBlock):
    """:class:`BertBlock` with the sequence dimension (every head but multiple choice, transformers 5.x): Ulysses
    context parallelism (bidirectional attention, :func:`~.sequence_hf.enable_bert_ulysses`) and sequence
    parallelism with tensor parallelism (:func:`~.sequence_hf.bert_sp_plan`)."""

    def uniap_sequence(self) -> dict[str, Any]:
        heads = self.config.num_attention_heads
        return {"attention_heads": heads, "kv_heads": heads, "sequence_parallel": True}

    def uniap_sp_plan(self, tp: int) -> dict[str, Any]:
        return bert_sp_plan(tp)

    def uniap_cp_methods(self) -> list[str]:
        return ["ulysses", "ring"]

    def uniap_enable_cp(self, group: Any, *, method: str = "ulysses", counter: Any = None) -> None:
        enable_bert_ulysses(self, group, counter=counter, method=method)
        self._cp_group = group


class BertTokenHead(TokenHead):
    """BERT's token classification / question answering head: token-wise, so it may run on sequence pieces (token
    classification's loss then runs on the pieces too, ``sequence.piece_loss``; question answering's logits are
    gathered into whole sequences for its loss over start / end positions)."""

    def uniap_sequence(self) -> dict[str, Any]:
        return {"attention_heads": 0}


class BertClassifierHead(View):
    """Pooler (first token, dense, tanh) + dropout + classifier -> logits (multiple choice: one score per choice,
    ``[batch, choices]``)."""

    def forward(self, d: Payload) -> torch.Tensor:
        hidden = d["hidden"]
        logits = self.classifier(self.dropout(self.pooler(hidden.reshape(-1, *hidden.shape[-2:]))))
        return logits.reshape(hidden.shape[0], -1) if hidden.dim() == 4 else logits


class BertMLMHead(View):
    """The masked-LM head (dense, activation, norm, decoder to the vocabulary) -> logits per token. Its decoder is
    tied to the word embeddings by default: an equal copy here (see ``runtime/ties.py``)."""

    def forward(self, d: Payload) -> torch.Tensor:
        return self.predictions(d["hidden"])

    def uniap_sequence(self) -> dict[str, Any]:
        return {"attention_heads": 0}  # token-wise: under cp its loss runs on the pieces (sequence.piece_loss)


BERT_HEADS = ("BertForMaskedLM, BertForSequenceClassification, BertForTokenClassification, "
              "BertForQuestionAnswering and BertForMultipleChoice")
BERT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
BERT_TIES = (("bert.embeddings.word_embeddings", "cls.predictions.decoder"),)


def bert_head(model: Any) -> Family:
    """The Family of this BERT model's head."""
    compat.check_supported()
    kind, bert = head_kind(model), getattr(model, "bert", None)
    if not isinstance(bert, nn.Module):
        kind = None
    if kind == "masked_lm" and _has(model, "cls") and _has(model.cls, "predictions"):
        head: tuple[nn.Module, list[str]] = (BertMLMHead(predictions=model.cls.predictions), ["cls"])
    elif kind in ("sequence_classification", "multiple_choice") and bert.pooler is not None and _has(
            model, "dropout", "classifier"):
        head = (BertClassifierHead(pooler=bert.pooler, dropout=model.dropout, classifier=model.classifier),
                ["bert.pooler", "classifier"])
    elif kind == "token_classification" and _has(model, "dropout", "classifier"):
        head = (BertTokenHead(out=model.classifier, dropout=model.dropout), ["classifier"])
    elif kind == "question_answering" and _has(model, "qa_outputs"):
        head = (BertTokenHead(out=model.qa_outputs), ["qa_outputs"])
    else:
        raise _unsupported_head(model, BERT_HEADS)
    # the sequence dimension (cp, sp): not for multiple choice ([batch, choices, seq]: dim 1 is not the sequence),
    # nor before transformers 5.0 (no tensor-parallel plan there either; Ulysses and sp are tested on 5.x only)
    sequence = kind != "multiple_choice" and compat.at_least(compat.BERT_HEADS_FROM_SHAPE)
    embed_cls, block_cls = (BertSequenceEmbed, BertSequenceBlock) if sequence else (BertEmbed, BertBlock)

    def layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
        return [
            (embed_cls(embeddings=bert.embeddings), ["bert.embeddings"]),
            *[(block_cls(layer, bert.config), [f"bert.encoder.layer.{i}"])
              for i, layer in enumerate(bert.encoder.layer)],
            head,
        ]

    return _family(kind, BERT_INPUTS, layers, ties=BERT_TIES)


def bert_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    return bert_head(model).layers(model)
