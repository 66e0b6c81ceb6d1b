"""The Hugging Face families the strategy splits by itself (see :mod:`uniap_lightning.adapters.auto`).

One module per kind of model: :mod:`.text` (BERT, GPT-2, Llama), :mod:`.t5` (encoder-decoder), :mod:`.vision` (ViT,
Swin). Each registers a :class:`~uniap_lightning.adapters.family.Family` per ``model_type`` on import
(:func:`~uniap_lightning.adapters.family.register`); :mod:`.generic` is the fallback for a model type none registers.
"""

from uniap_lightning.adapters.families import t5, text, vision  # noqa: F401 - registration

__all__ = ["t5", "text", "vision"]
