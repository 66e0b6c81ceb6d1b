"""Models of ``test_expert_plans.py`` for the shared runners of :mod:`uniap_rt_helpers` (``{"factory": ...}``).

``moe_module``: the tiny MoE GPT (4 experts, top-2) with SGD and momentum, so a checkpoint carries optimizer state
of the expert shards too. ``hf_moe_module``: a tiny Hugging Face MoE causal LM in a plain LightningModule whose
``training_step`` returns ``self.model(**batch).loss`` (the zero-glue path); ``hf_data``: its batches as dicts.
"""

from __future__ import annotations

from typing import Any

import torch

import expert_parallel_helpers as eh


def moe_module(momentum: float = 0.0, memory_tag: str | None = None, **cfg: Any) -> Any:
    """``memory_tag``: at the end of training each rank writes ``memory_<tag>_rank<r>.pt`` in the working directory
    (the run's output folder): the bytes it holds for the MoE blocks (:func:`uniap_lightning.runtime.zero.state_bytes`)."""
    from uniap_lightning.adapters.moe import MoEBlock, MoECausalLMModule, MoEGPT, MoEGPTConfig

    class SGDMoE(MoECausalLMModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=momentum)

        def on_train_end(self) -> None:
            if memory_tag is None or not hasattr(self.trainer.strategy, "runtime"):
                return
            from uniap_lightning.runtime.zero import state_bytes

            rt = self.trainer.strategy.runtime
            held = sum(state_bytes(layer, self.trainer.optimizers, rt.replicated.buckets)
                       for layer in rt.chain.layers if isinstance(layer, MoEBlock))
            torch.save(held, f"memory_{memory_tag}_rank{self.global_rank}.pt")

    torch.manual_seed(0)
    return SGDMoE(MoEGPT(MoEGPTConfig(**{**eh.BASE, **cfg})).layers())


def hf_moe_module(family: str) -> Any:
    """``mixtral``, ``qwen2_moe`` or ``olmoe`` (E=4, k=2, no auxiliary loss in ``.loss``: ``output_router_logits``
    is off by default) as users write it: ``self.model(**batch).loss``, SGD with momentum."""
    from hf_models import HFModule

    return HFModule(eh.hf_model(family))
