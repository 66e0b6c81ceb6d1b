"""Models of ``test_expert_plans.py`` for the shared runners of :mod:`uniap_rt_helpers` (``{"factory": ...}``).

``moe_module``: the tiny MoE GPT (4 experts, top-2) with SGD and momentum, so a checkpoint carries optimizer state
of the expert shards too. ``hf_moe_module``: a tiny Hugging Face MoE causal LM in a plain LightningModule whose
``training_step`` returns ``self.model(**batch).loss`` (the zero-glue path); ``hf_data``: its batches as dicts.
"""

from __future__ import annotations

from typing import Any

import torch

import expert_parallel_helpers as eh


def moe_module(momentum: float = 0.0, **cfg: Any) -> Any:
    from uniap_lightning.adapters.moe import MoECausalLMModule, MoEGPT, MoEGPTConfig

    class SGDMoE(MoECausalLMModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=momentum)

    torch.manual_seed(0)
    return SGDMoE(MoEGPT(MoEGPTConfig(**{**eh.BASE, **cfg})).layers())


def hf_moe_module(family: str) -> Any:
    """``mixtral``, ``qwen2_moe`` or ``olmoe`` (E=4, k=2, no auxiliary loss in ``.loss``: ``output_router_logits``
    is off by default) as users write it: ``self.model(**batch).loss``, SGD with momentum."""
    from hf_models import HFModule

    return HFModule(eh.hf_model(family))
