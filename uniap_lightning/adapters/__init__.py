"""Adapters: expose models that are not a plain ``nn.Sequential`` as a chain of layers for the strategy.

Hugging Face models of the supported families (BERT, GPT-2, Llama, T5, ViT, Swin) need none of this: a
LightningModule holding the model as an attribute and returning ``self.model(**batch).loss`` trains as it is, the
strategy builds the chain itself (:mod:`uniap_lightning.adapters.auto`). :func:`extract_chain` is how it finds the
chain of any module (``uniap_layers()``, one ``nn.Sequential``, or a Hugging Face model): call it, not
:func:`uniap_lightning.runtime.extract_chain` (which knows no model family), to see the chain the strategy splits.
What follows is for chains written by hand.

Every adapter returns a list of layers (each maps one tensor to one tensor, batch on dim 0) that wrap - not copy -
the model's own modules, plus, where it is supported, a tensor-parallel plan per layer (``uniap_tp_plan``).
:class:`CausalLMModule` turns such a list into a LightningModule that trains under ``strategy="uniap"``::

    from transformers import LlamaConfig, LlamaForCausalLM
    from uniap_lightning.adapters import CausalLMModule, hf_layers

    module = CausalLMModule(hf_layers(LlamaForCausalLM(LlamaConfig(...))), lr=3e-4)
    Trainer(strategy="uniap", devices=4).fit(module, loader)  # batches: (input_ids, labels)

Available: Hugging Face GPT-2 (``GPT2LMHeadModel``; pipeline and data parallel, no tensor parallel: its fused
``Conv1D`` QKV does not shard by heads) and Llama (``LlamaForCausalLM``; tensor parallel too), and the plain
PyTorch :class:`~uniap_lightning.adapters.gpt.GPT` (tensor parallel too).
"""

from __future__ import annotations

from uniap_lightning.adapters.auto import extract_chain
from uniap_lightning.adapters.hf import hf_layers
from uniap_lightning.adapters.lm import CausalLMModule

__all__ = ["CausalLMModule", "extract_chain", "hf_layers"]
