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

The families are their own modules: :mod:`.text_heads` (what they share: the head by class name, per-token and
last-token heads, each head's loss), :mod:`.text_bert` and :mod:`.text_decoders` (GPT-2, Llama); this module
registers them.
"""

from __future__ import annotations

from typing import Any

from uniap_lightning.adapters.family import Family, register
from uniap_lightning.adapters.families.text_bert import (
    BERT_HEADS,
    BERT_INPUTS,
    BERT_TIES,
    BertBlock,
    BertClassifierHead,
    BertEmbed,
    BertMLMHead,
    BertSequenceBlock,
    BertSequenceEmbed,
    BertTokenHead,
    bert_head,
    bert_layers,
)
from uniap_lightning.adapters.families.text_decoders import (
    GPT2_HEADS,
    GPT2_TIES,
    LLAMA_HEADS,
    GPT2Block,
    GPT2Embed,
    GPT2SequenceBlock,
    GPT2SequenceEmbed,
    LlamaBlock,
    LlamaEmbed,
    LlamaSequenceBlock,
    LlamaSequenceEmbed,
    NormLMHead,
    gpt2_head,
    gpt2_layers,
    llama_head,
    llama_layers,
)
from uniap_lightning.adapters.families.text_heads import DECODER_INPUTS, LastTokenScore, TokenHead, head_kind

__all__ = [
    "BERT_HEADS", "BERT_INPUTS", "BERT_TIES", "DECODER_INPUTS", "GPT2_HEADS", "GPT2_TIES", "LLAMA_HEADS", "BertBlock",
    "BertClassifierHead", "BertEmbed", "BertMLMHead", "BertSequenceBlock", "BertSequenceEmbed", "BertTokenHead",
    "GPT2Block", "GPT2Embed", "GPT2SequenceBlock", "GPT2SequenceEmbed", "LastTokenScore", "LlamaBlock", "LlamaEmbed",
    "LlamaSequenceBlock", "LlamaSequenceEmbed", "NormLMHead", "TokenHead", "bert_head", "bert_layers", "gpt2_head",
    "gpt2_layers", "head_kind", "llama_head", "llama_layers",
]


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
