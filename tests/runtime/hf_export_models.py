"""A LightningModule whose Hugging Face model starts from a ``from_pretrained`` folder (the export tests)."""

from __future__ import annotations

from hf_models import HFModule


def pretrained_module(path: str, lr: float = 0.1) -> HFModule:
    import transformers as tr

    return HFModule(tr.AutoModelForCausalLM.from_pretrained(path), lr=lr)
