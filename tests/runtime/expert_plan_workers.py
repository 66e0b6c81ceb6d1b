"""Models of ``test_expert_plans.py`` for the shared runners of :mod:`uniap_rt_helpers` (``{"factory": ...}``).

``moe_module``: the tiny MoE GPT (4 experts, top-2) with SGD and momentum, so a checkpoint carries optimizer state
of the expert shards too. ``hf_moe_module``: a tiny Hugging Face MoE causal LM in a plain LightningModule whose
``training_step`` returns ``self.model(**batch).loss`` (the zero-glue path); ``hf_data``: its batches as dicts.
"""

from __future__ import annotations

from typing import Any

import torch

import expert_parallel_helpers as eh


def moe_module(momentum: float = 0.0, memory_tag: str | None = None, switch_at: int | None = None,
               switch_to: dict[str, Any] | None = None, **cfg: Any) -> Any:
    """``memory_tag``: at the end of training each rank writes ``memory_<tag>_rank<r>.pt`` in the working directory
    (the run's output folder): the bytes it holds for the MoE blocks (:func:`uniap_lightning.runtime.zero.state_bytes`).
    ``switch_at``: under ``UniAPStrategy(rebalance=True)``, at the end of that batch the run switches to the plan of
    ``switch_to`` (the MoE blocks' strategy, e.g. ``{"ep": 1}``, data-parallel over every rank) by the path a
    re-plan takes (:func:`uniap_lightning.rebalance.switch.switch_plan`, then the rebalancer times the new stage);
    nothing happens in a single process."""
    from uniap_lightning.adapters.moe import MoEBlock, MoECausalLMModule, MoEGPT, MoEGPTConfig

    class SGDMoE(MoECausalLMModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=momentum)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            rebalancer = getattr(self.trainer.strategy, "_rebalancer", None)
            if batch_idx != switch_at or rebalancer is None:
                return
            import uniap_rt_helpers as h
            from uniap_lightning.rebalance.switch import switch_plan

            strategy, world = self.trainer.strategy, self.trainer.world_size
            edge, blocks = {"dp": world}, {"dp": world, **(switch_to or {})}
            plan = h.make_plan([edge, blocks, blocks, edge], [0, 0, 0, 0], pp=1, microbatches=1, world=world,
                               names=[f"chain.{i}" for i in range(4)])
            switch_plan(strategy, self.trainer, plan, rebalancer.pristine)
            rebalancer.attach(strategy)

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


def hf_moe_module(family: str, router_loss: bool = False) -> Any:
    """``mixtral``, ``qwen2_moe`` or ``olmoe`` (E=4, k=2) as users write it: ``self.model(**batch).loss``, SGD with
    momentum. ``.loss`` is the cross-entropy alone (``output_router_logits`` is off by default), or with
    ``router_loss`` plus the load-balancing term (:func:`expert_parallel_helpers.hf_model`)."""
    from hf_models import HFModule

    return HFModule(eh.hf_model(family, router_loss))
