"""BERT (sequence classification or masked LM, with padding masks), GPT-2 and Llama (causal LMs, with padding
masks) as chains.

Layers pass a dict: ``hidden`` (the hidden states) and the batch's integer ``attention_mask`` (when it has one),
which every block turns into its 4-D attention mask itself (a constant of the block, rebuilt per stage, not sent).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.auto import Family, HFTarget, count_next_tokens, count_tokens, register
from uniap_lightning.adapters.families.common import (
    View,
    causal_lm_loss,
    classification_loss,
    colwise,
    divisors_of_all,
    replicate,
    rowwise,
    token_loss,
)

Payload = dict[str, torch.Tensor]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


# ------------------------------------------------------------------------------------------------------ BERT
class BertEmbed(View):
    """input_ids (+ token_type_ids) -> hidden; the attention mask travels on."""

    def forward(self, d: Payload) -> dict[str, Any]:
        hidden = self.embeddings(input_ids=d["input_ids"], token_type_ids=d.get("token_type_ids"))
        return {"hidden": hidden, "input_ids": None, "token_type_ids": None}

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

    def __init__(self, layer: nn.Module, config: Any) -> None:
        super().__init__(layer=layer)
        self.config = config

    def forward(self, d: Payload) -> dict[str, torch.Tensor]:
        from transformers.masking_utils import create_bidirectional_mask

        mask = create_bidirectional_mask(config=self.config, inputs_embeds=d["hidden"],
                                         attention_mask=d.get("attention_mask"))
        return {"hidden": _first(self.layer(d["hidden"], attention_mask=mask))}

    def uniap_tp_degrees(self) -> list[int]:
        return divisors_of_all(self.config.num_attention_heads, self.config.intermediate_size)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"layer.attention.self.query": colwise(), "layer.attention.self.key": colwise(),
                "layer.attention.self.value": colwise(), "layer.attention.output.dense": rowwise(),
                "layer.intermediate.dense": colwise(), "layer.output.dense": rowwise()}

    def uniap_tp_allreduces(self) -> int:
        return 2


class BertClassifierHead(View):
    """Pooler (first token, dense, tanh) + dropout + classifier -> logits."""

    def forward(self, d: Payload) -> torch.Tensor:
        return self.classifier(self.dropout(self.pooler(d["hidden"])))


class BertMLMHead(View):
    """The masked-LM head (dense, activation, norm, decoder to the vocabulary) -> logits per token. Its decoder is
    tied to the word embeddings by default: an equal copy here (see ``runtime/ties.py``)."""

    def forward(self, d: Payload) -> torch.Tensor:
        return self.predictions(d["hidden"])


def bert_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    bert = model.bert
    if hasattr(model, "cls") and hasattr(model.cls, "predictions") and not hasattr(model.cls, "seq_relationship"):
        head: tuple[nn.Module, list[str]] = (BertMLMHead(predictions=model.cls.predictions), ["cls"])
    elif bert.pooler is not None and hasattr(model, "classifier"):
        head = (BertClassifierHead(pooler=bert.pooler, dropout=model.dropout, classifier=model.classifier),
                ["bert.pooler", "classifier"])
    else:
        raise _unsupported_head(model, "BertForSequenceClassification and BertForMaskedLM")
    return [
        (BertEmbed(embeddings=bert.embeddings), ["bert.embeddings"]),
        *[(BertBlock(layer, bert.config), [f"bert.encoder.layer.{i}"]) for i, layer in enumerate(bert.encoder.layer)],
        head,
    ]


def bert_loss(model: Any, logits: torch.Tensor, target: HFTarget) -> torch.Tensor:
    """The model's own: masked-LM cross-entropy over the labelled tokens, or the classification loss."""
    if hasattr(model, "cls"):
        return token_loss(logits, target.labels, target)
    return classification_loss(model, logits, target)


def _unsupported_head(model: Any, supported: str) -> Exception:
    from uniap_lightning.errors import UniAPError

    return UniAPError(
        f"{type(model).__name__}: the strategy splits {supported} of this family; for other heads define "
        "uniap_layers() (and uniap_loss) on your LightningModule"
    )


# ------------------------------------------------------------------------------------------------------ GPT-2
class GPT2Embed(View):
    def forward(self, d: Payload) -> dict[str, Any]:
        ids = d["input_ids"]
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return {"hidden": self.drop(self.wte(ids) + self.wpe(pos)), "input_ids": None}


class GPT2Block(View):
    """A GPT-2 block with its causal + padding mask rebuilt. No tensor-parallel plan: GPT-2's ``Conv1D`` projections
    (fused QKV) are not ``nn.Linear``, which DTensor's styles shard."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__(block=block)
        self.config = config

    def forward(self, d: Payload) -> dict[str, torch.Tensor]:
        return {"hidden": _first(self.block(d["hidden"], attention_mask=_causal_mask(self.config, d)))}


def _causal_mask(config: Any, d: Payload) -> Any:
    from transformers.masking_utils import create_causal_mask

    hidden = d["hidden"]
    pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    return create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=d.get("attention_mask"),
                              cache=None, position_ids=pos)


class NormLMHead(View):
    """Final norm + LM head; tensor parallel over the vocabulary (logits gathered)."""

    def forward(self, d: Payload) -> torch.Tensor:
        return self.lm_head(self.norm(d["hidden"]))

    def uniap_tp_degrees(self) -> list[int]:
        return divisors_of_all(self.lm_head.out_features)

    def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
        return {"lm_head": colwise(output_layouts=replicate())}

    def uniap_tp_allreduces(self) -> int:
        return 1


def gpt2_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    t = model.transformer
    return [
        (GPT2Embed(wte=t.wte, wpe=t.wpe, drop=t.drop), ["transformer.wte", "transformer.wpe"]),
        *[(GPT2Block(b, t.config), [f"transformer.h.{i}"]) for i, b in enumerate(t.h)],
        (NormLMHead(norm=t.ln_f, lm_head=model.lm_head), ["transformer.ln_f", "lm_head"]),
    ]


# ------------------------------------------------------------------------------------------------------ Llama
class LlamaEmbed(View):
    def forward(self, d: Payload) -> dict[str, Any]:
        return {"hidden": self.embed_tokens(d["input_ids"]), "input_ids": None}

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

    def forward(self, d: Payload) -> dict[str, torch.Tensor]:
        hidden = d["hidden"]
        pos = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        out = self.layer(hidden, attention_mask=_causal_mask(self.config, d), position_ids=pos,
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


def llama_layers(model: Any) -> list[tuple[nn.Module, list[str]]]:
    m = model.model
    return [
        (LlamaEmbed(embed_tokens=m.embed_tokens), ["model.embed_tokens"]),
        *[(LlamaBlock(layer, m.config), [f"model.layers.{i}"]) for i, layer in enumerate(m.layers)],
        (NormLMHead(norm=m.norm, lm_head=model.lm_head), ["model.norm", "lm_head"]),
    ]


# count_tokens: masked-LM labels are -100 where unmasked; a classifier's labels (one per row) all count
register("bert", Family(layers=bert_layers, loss=bert_loss, inputs=("input_ids", "attention_mask", "token_type_ids"),
                        count=count_tokens, ties=(("bert.embeddings.word_embeddings", "cls.predictions.decoder"),)))
# tie_word_embeddings=True (GPT-2's default): the LM head gets an equal copy of the token embedding, with summed
# gradients (runtime/ties.py)
register("gpt2", Family(layers=gpt2_layers, loss=causal_lm_loss, inputs=("input_ids", "attention_mask"),
                        count=count_next_tokens, ties=(("transformer.wte", "lm_head"),)))
register("llama", Family(layers=llama_layers, loss=causal_lm_loss, inputs=("input_ids", "attention_mask"),
                         count=count_next_tokens, ties=(("model.embed_tokens", "lm_head"),)))
