"""BERT, GPT-2 and Llama (with padding masks) as chains, with every head of the family Hugging Face has for
training on text: masked LM (BERT), causal LM (GPT-2, Llama), sequence classification, token classification, question
answering, and multiple choice (BERT). The head is chosen by the model's class (``...ForTokenClassification``) and
its modules; the loss is the model's own, whole-batch normalized (see :class:`~uniap_lightning.adapters.auto.HFTarget`).

Layers pass a dict: ``hidden`` (the hidden states) and the batch's integer ``attention_mask`` (when it has one),
which every block turns into its 4-D attention mask itself (a constant of the block, rebuilt per stage, not sent).
Every tensor keeps the batch dimension first: multiple choice keeps ``[batch, choices, seq, ...]`` (each BERT block
flattens the choices for its own call); the decoders' sequence classifiers get the index of each row's last
non-padding token (``last``) from the first layer, which alone sees ``input_ids``. Question answering heads return
``[batch, seq, 2]`` logits (start, end); their target is the batch's ``start_positions`` and ``end_positions``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.auto import Family, HFTarget, count_next_tokens, count_tokens, register
from uniap_lightning.adapters.hf import GlobalPositions
from uniap_lightning.adapters.families import compat
from uniap_lightning.adapters.families.common import (
    View,
    causal_lm_loss,
    colwise,
    count_labels,
    count_per_column,
    divisors_of_all,
    question_answering_labels,
    question_answering_loss,
    replicate,
    rowwise,
    sequence_classification_loss,
    token_loss,
)

Payload = dict[str, torch.Tensor]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


#: Hugging Face's class-name endings of the heads (the first match along the model's class hierarchy)
_KINDS = (("ForCausalLM", "causal_lm"), ("LMHeadModel", "causal_lm"), ("ForMaskedLM", "masked_lm"),
          ("ForSequenceClassification", "sequence_classification"),
          ("ForTokenClassification", "token_classification"), ("ForQuestionAnswering", "question_answering"),
          ("ForMultipleChoice", "multiple_choice"))


def head_kind(model: Any) -> str | None:
    """The head of ``model`` by its class (or a base class) name, e.g. ``"token_classification"``; ``None`` for
    none the strategy knows (a bare ``BertModel``, ``BertForPreTraining``, ``GPT2DoubleHeadsModel``)."""
    for cls in type(model).__mro__:
        for ending, kind in _KINDS:
            if cls.__name__.endswith(ending):
                return kind
    return None


def _has(model: Any, *names: str) -> bool:
    return all(isinstance(getattr(model, n, None), nn.Module) for n in names)


def _unsupported_head(model: Any, supported: str) -> Exception:
    from uniap_lightning.errors import UniAPError

    return UniAPError(
        f"{type(model).__name__}: the strategy splits {supported} of this family; for other heads define "
        "uniap_layers() (and uniap_loss) on your LightningModule"
    )


def _last_non_padding(ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Each row's last token that is not padding, as Hugging Face's sequence classifiers find it (the rightmost
    token not equal to ``pad_token_id``, so left and right padding both work; the last position without one)."""
    if pad_token_id is None:
        return torch.full(ids.shape[:1], ids.shape[-1] - 1, dtype=torch.long, device=ids.device)
    non_pad = (ids != pad_token_id).to(torch.int32)
    return (torch.arange(ids.shape[-1], device=ids.device, dtype=torch.int32) * non_pad).argmax(-1)


def _pooled(embed: View, config: Any) -> View:
    """``embed`` (the first layer of a decoder) also sends each row's last non-padding index on, as ``last``."""
    embed.pool_last = True
    embed.pad_token_id = config.pad_token_id
    return embed


def _pool_index(layer: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    if not getattr(layer, "pool_last", False):
        return {}
    return {"last": _last_non_padding(ids, layer.pad_token_id)}


class LastTokenScore(View):
    """A decoder's sequence classifier: the final norm and ``score`` at each row's last non-padding token (pooling
    first: both act per token) -> ``[batch, labels]``. The index is clamped to the sequence: a no-op on real
    batches, it keeps the pipeline's shape inference (a stage run on uninitialized inputs) in bounds."""

    def forward(self, d: Payload) -> torch.Tensor:
        hidden = d["hidden"]
        last = d["last"].clamp(0, hidden.shape[1] - 1)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self.score(self.norm(pooled))


class TokenHead(View):
    """Per-token logits: ``out(dropout(norm(hidden)))`` (token classification, question answering; the norm of a
    decoder, the dropout of a token classifier, where the model has them)."""

    def __init__(self, out: nn.Module, norm: nn.Module | None = None, dropout: nn.Module | None = None) -> None:
        super().__init__(out=out, norm=nn.Identity() if norm is None else norm,
                         dropout=nn.Identity() if dropout is None else dropout)

    def forward(self, d: Payload) -> torch.Tensor:
        return self.out(self.dropout(self.norm(d["hidden"])))


def _family(kind: str, inputs: tuple[str, ...], layers: Any, **kw: Any) -> Family:
    """The Family of one head: its loss and the count its loss averages over."""
    count = {"causal_lm": count_next_tokens, "sequence_classification": count_labels,
             "question_answering": count_per_column}.get(kind, count_tokens)
    loss = {"causal_lm": causal_lm_loss, "sequence_classification": sequence_classification_loss,
            "question_answering": question_answering_loss}.get(kind, _token_loss)
    labels = question_answering_labels if kind == "question_answering" else None
    return Family(layers=layers, loss=loss, inputs=inputs, count=count, labels=labels, **kw)


def _token_loss(model: Any, logits: torch.Tensor, target: HFTarget) -> torch.Tensor:
    """Cross-entropy over the labelled items (masked LM, token classification, multiple choice)."""
    return token_loss(logits, target.labels, target)


# labels stay with their tokens: exact on the sequence pieces a context-parallel head leaves (sequence.piece_loss)
_token_loss.uniap_sequence_loss = "token"  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------------ BERT
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
            from uniap_lightning.runtime.sequence import position_offset

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
            from uniap_lightning.runtime.sequence import padding_mask

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
        from uniap_lightning.adapters.families.sequence_hf import bert_sp_plan

        return bert_sp_plan(tp)

    def uniap_cp_methods(self) -> list[str]:
        return ["ulysses", "ring"]

    def uniap_enable_cp(self, group: Any, *, method: str = "ulysses", counter: Any = None) -> None:
        from uniap_lightning.adapters.families.sequence_hf import enable_bert_ulysses

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


# ------------------------------------------------------------------------------------------------------ GPT-2
class GPT2Embed(View):
    """Token + learned position embedding; under context parallelism (:class:`GPT2SequenceEmbed`) its input is a
    contiguous piece of each sequence and the positions are global (``cp_rank x s/c`` onwards)."""

    _cp_group: Any = None

    def forward(self, d: Payload) -> dict[str, Any]:
        from uniap_lightning.runtime.sequence import position_offset

        ids = d["input_ids"]
        start = position_offset(self._cp_group, ids.shape[1])
        pos = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
        return {"hidden": self.drop(self.wte(ids) + self.wpe(pos)), "input_ids": None, **_pool_index(self, ids)}


class GPT2Block(View):
    """A GPT-2 block with its causal + padding mask rebuilt. No tensor-parallel plan: GPT-2's ``Conv1D`` projections
    (fused QKV) are not ``nn.Linear``, which DTensor's styles shard."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__(block=block)
        self.config = config

    _cp_group: Any = None

    def forward(self, d: Payload) -> dict[str, torch.Tensor]:
        with _attention_masks(self, self.block, d) as mask:
            return {"hidden": _first(self.block(d["hidden"], attention_mask=mask))}


@contextmanager
def _attention_masks(block: Any, module: nn.Module, d: Payload) -> Iterator[Any]:
    """The ``attention_mask`` a decoder block passes ``module``: the causal + padding mask of whole sequences, or
    under context parallelism (``block._cp_group``) none, the switched attention being causal over the whole
    sequence with this piece's key padding mask (gathered over the cp group inside attention,
    :func:`uniap_lightning.runtime.sequence.padding_mask`) set for the call."""
    from uniap_lightning.runtime.sequence import padding_mask

    if block._cp_group is None:
        yield _causal_mask(block.config, d)
        return
    mask = d.get("attention_mask")
    with padding_mask([module], None if mask is None else mask.bool()):
        yield None


class _DecoderSequence:
    """The sequence hooks of a zero-glue decoder block (GPT-2, Llama) over its attention module ``_attention()``:
    Ulysses (heads per tensor-parallel rank divisible by cp) or ring attention over the context-parallel group
    (:func:`~.sequence_hf.switch_attention` on a copy of the config, so blocks left at cp 1 keep the model's
    attention and masks); the block's ``forward`` then reads ``_cp_group``."""

    def _attention(self) -> nn.Module:
        raise NotImplementedError

    def _heads(self) -> tuple[int, int]:
        raise NotImplementedError

    def uniap_cp_methods(self) -> list[str]:
        return ["ulysses", "ring"]

    def uniap_enable_cp(self, group: Any, *, method: str = "ulysses", counter: Any = None) -> None:
        from uniap_lightning.adapters.families.sequence_hf import switch_attention

        switch_attention(self._attention(), group, counter=counter, own_config=True, method=method,
                         heads=self._heads()[0], name=type(self).__name__)
        self._cp_group = group


class GPT2SequenceEmbed(GlobalPositions, GPT2Embed):
    """:class:`GPT2Embed` that may run on pieces of the sequence (token-wise; global positions under cp)."""


class GPT2SequenceBlock(_DecoderSequence, GPT2Block):
    """:class:`GPT2Block` with the sequence dimension: Ulysses or ring context parallelism (no sequence
    parallelism: GPT-2 has no tensor-parallel plan here)."""

    def _attention(self) -> nn.Module:
        return self.block.attn

    def _heads(self) -> tuple[int, int]:
        return self.config.n_head, self.config.n_head

    def uniap_sequence(self) -> dict[str, Any]:
        heads = self.config.n_head
        return {"attention_heads": heads, "kv_heads": heads, "sequence_parallel": False}


def _causal_mask(config: Any, d: Payload) -> Any:
    hidden = d["hidden"]
    pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    return compat.causal_mask(config, hidden, d.get("attention_mask"), pos)


class NormLMHead(View):
    """Final norm + LM head; tensor parallel over the vocabulary (logits gathered). Token-wise: under context
    parallelism it may run on sequence pieces (the model's own causal loss then sees the gathered logits)."""

    def uniap_sequence(self) -> dict[str, Any]:
        return {"attention_heads": 0}

    def forward(self, d: Payload) -> torch.Tensor:
        return self.lm_head(self.norm(d["hidden"]))

    def uniap_tp_degrees(self) -> list[int]:
        return divisors_of_all(self.lm_head.out_features)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"lm_head": colwise(output_layouts=replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1


def _decoder_head(model: Any, kind: str | None, norm: nn.Module, prefix: str, norm_name: str, supported: str,
                  classifier: str) -> tuple[nn.Module, list[str]]:
    """The head layer of a decoder (GPT-2, Llama) whose body is ``model.<prefix>`` with final norm ``norm``."""
    fqn = f"{prefix}.{norm_name}"
    if kind == "causal_lm" and _has(model, "lm_head"):
        return NormLMHead(norm=norm, lm_head=model.lm_head), [fqn, "lm_head"]
    if kind == "sequence_classification" and _has(model, "score"):
        return LastTokenScore(norm=norm, score=model.score), [fqn, "score"]
    if kind == "token_classification" and _has(model, "dropout", classifier):
        return TokenHead(out=getattr(model, classifier), norm=norm, dropout=model.dropout), [fqn, classifier]
    if kind == "question_answering" and _has(model, "qa_outputs"):
        return TokenHead(out=model.qa_outputs, norm=norm), [fqn, "qa_outputs"]
    raise _unsupported_head(model, supported)


GPT2_HEADS = ("GPT2LMHeadModel, GPT2ForSequenceClassification, GPT2ForTokenClassification and "
              "GPT2ForQuestionAnswering")
DECODER_INPUTS = ("input_ids", "attention_mask")
GPT2_TIES = (("transformer.wte", "lm_head"),)


def gpt2_head(model: Any) -> Family:
    """The Family of this GPT-2 model's head."""
    compat.check_supported()
    kind, t = head_kind(model), getattr(model, "transformer", None)
    if not isinstance(t, nn.Module):
        raise _unsupported_head(model, GPT2_HEADS)
    head = _decoder_head(model, kind, t.ln_f, "transformer", "ln_f", GPT2_HEADS, "classifier")
    embed_cls, block_cls = (GPT2SequenceEmbed, GPT2SequenceBlock) if _decoder_sequence(kind) else (GPT2Embed, GPT2Block)
    embed = embed_cls(wte=t.wte, wpe=t.wpe, drop=t.drop)
    if kind == "sequence_classification":
        embed = _pooled(embed, model.config)

    def layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
        return [
            (embed, ["transformer.wte", "transformer.wpe"]),
            *[(block_cls(b, t.config), [f"transformer.h.{i}"]) for i, b in enumerate(t.h)],
            head,
        ]

    return _family(kind, DECODER_INPUTS, layers, ties=GPT2_TIES)


def gpt2_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    return gpt2_head(model).layers(model)


# ------------------------------------------------------------------------------------------------------ Llama
class LlamaEmbed(View):
    def forward(self, d: Payload) -> dict[str, Any]:
        ids = d["input_ids"]
        return {"hidden": self.embed_tokens(ids), "input_ids": None, **_pool_index(self, ids)}

    def uniap_tp_degrees(self) -> list[int]:
        return divisors_of_all(self.embed_tokens.num_embeddings)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"embed_tokens": rowwise(input_layouts=replicate(), output_layouts=replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1


class LlamaBlock(View):
    """A Llama decoder layer; the rotary table (no parameters) and the causal + padding mask are rebuilt here.
    Tensor parallel: q/k/v and gate/up column-parallel, o and down row-parallel."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        super().__init__(layer=layer)
        self.config = config
        self.rotary = LlamaRotaryEmbedding(config=config)

    _cp_group: Any = None

    def forward(self, d: Payload) -> dict[str, torch.Tensor]:
        from uniap_lightning.runtime.sequence import position_offset

        hidden = d["hidden"]
        start = position_offset(self._cp_group, hidden.shape[1])  # global rotary positions under cp
        pos = torch.arange(start, start + hidden.shape[1], device=hidden.device).unsqueeze(0)
        with _attention_masks(self, self.layer, d) as mask:
            out = self.layer(hidden, attention_mask=mask, position_ids=pos,
                             position_embeddings=self.rotary(hidden, pos))
        return {"hidden": _first(out)}

    def uniap_tp_degrees(self) -> list[int]:
        c = self.config
        return divisors_of_all(c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        attn = {f"layer.self_attn.{p}": colwise() for p in ("q_proj", "k_proj", "v_proj")}
        mlp = {f"layer.mlp.{p}": colwise() for p in ("gate_proj", "up_proj")}
        return {**attn, **mlp, "layer.self_attn.o_proj": rowwise(), "layer.mlp.down_proj": rowwise()}

    def uniap_tp_allreduces(self) -> int:
        return 2


class LlamaSequenceEmbed(GlobalPositions, LlamaEmbed):
    """:class:`LlamaEmbed` that may run on pieces of the sequence (token-wise; the rotary positions are the
    blocks')."""


class LlamaSequenceBlock(_DecoderSequence, LlamaBlock):
    """:class:`LlamaBlock` with the sequence dimension: Ulysses or ring context parallelism (grouped-query k/v),
    global rotary positions under cp, and sequence parallelism with tensor parallelism
    (:func:`~.sequence_hf.llama_sp_plan`: the decoder layer is the boundary, as in the ``hf_layers`` chain)."""

    def _attention(self) -> nn.Module:
        return self.layer.self_attn

    def _heads(self) -> tuple[int, int]:
        return self.config.num_attention_heads, self.config.num_key_value_heads

    def uniap_sequence(self) -> dict[str, Any]:
        heads, kv = self._heads()
        return {"attention_heads": heads, "kv_heads": kv, "sequence_parallel": True}

    def uniap_sp_plan(self, tp: int) -> dict[str, Any]:
        from uniap_lightning.adapters.families.sequence_hf import llama_sp_plan

        return llama_sp_plan(tp)


def _decoder_sequence(kind: str | None) -> bool:
    """Whether a decoder's zero-glue chain declares the sequence dimension: its causal LM, token classification and
    question answering heads (not the sequence classifier: its embedding finds each row's last real token on whole
    sequences), on transformers 5.x (where cp and sp are tested)."""
    return kind in ("causal_lm", "token_classification", "question_answering") and compat.at_least(
        compat.BERT_HEADS_FROM_SHAPE)


LLAMA_HEADS = ("LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification and "
               "LlamaForQuestionAnswering")


def llama_head(model: Any) -> Family:
    """The Family of this Llama model's head."""
    compat.check_supported()
    kind = head_kind(model)
    prefix = getattr(model, "base_model_prefix", "model")  # LlamaForQuestionAnswering: "transformer"
    m = getattr(model, prefix, None)
    if not isinstance(m, nn.Module) or not _has(m, "embed_tokens", "norm"):
        raise _unsupported_head(model, LLAMA_HEADS)
    head = _decoder_head(model, kind, m.norm, prefix, "norm", LLAMA_HEADS, "score")
    sequence = _decoder_sequence(kind)
    embed = (LlamaSequenceEmbed if sequence else LlamaEmbed)(embed_tokens=m.embed_tokens)
    block_cls = LlamaSequenceBlock if sequence else LlamaBlock
    if kind == "sequence_classification":
        embed = _pooled(embed, model.config)

    def layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
        return [
            (embed, [f"{prefix}.embed_tokens"]),
            *[(block_cls(layer, m.config), [f"{prefix}.layers.{i}"]) for i, layer in enumerate(m.layers)],
            head,
        ]

    return _family(kind, DECODER_INPUTS, layers, ties=((f"{prefix}.embed_tokens", "lm_head"),))


def llama_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    return llama_head(model).layers(model)


def _chooser(head: Any, inputs: tuple[str, ...]) -> Family:
    """The registered Family of a model_type: it hands over to the Family of the model's head."""

    def unused(*args: Any) -> Any:
        raise AssertionError("the Family of the model's head is used")

    return Family(layers=unused, loss=unused, inputs=inputs, count=unused, head=head)


# masked LM labels are -100 where unmasked; BERT's MLM decoder is tied to the word embeddings by default: an equal
# copy, with summed gradients (runtime/ties.py). Likewise GPT-2's LM head (tie_word_embeddings=True by default).
register("bert", _chooser(bert_head, BERT_INPUTS))
register("gpt2", _chooser(gpt2_head, DECODER_INPUTS))
register("llama", _chooser(llama_head, DECODER_INPUTS))
