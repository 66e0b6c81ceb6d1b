"""What the text families (:mod:`.text`: BERT, GPT-2, Llama) share: the head a model has (by its class name), the
heads that act per token or at each row's last non-padding token, and each head's loss and count (the Family of one
head). Layers pass a dict payload (:data:`Payload`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from uniap_lightning.adapters.family import Family, HFTarget, count_next_tokens, count_tokens
from uniap_lightning.adapters.families.common import (
    View,
    causal_lm_loss,
    count_labels,
    count_per_column,
    question_answering_labels,
    question_answering_loss,
    sequence_classification_loss,
    token_loss,
)
from uniap_lightning.errors import UniAPError

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


#: the batch entries a decoder (GPT-2, Llama) takes
DECODER_INPUTS = ("input_ids", "attention_mask")
