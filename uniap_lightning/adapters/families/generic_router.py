"""The load-balancing loss of Hugging Face mixture-of-experts causal LMs, rebuilt by the generic split
(:mod:`.generic`) when the model is trained with ``output_router_logits=True``.

What Hugging Face computes (``load_balancing_loss_func`` of Mixtral, Qwen2-MoE, OLMoE; the same value in
transformers 4.57 and 5.x, see below): every MoE layer's router logits ``z_l [tokens, E]`` are pooled over the
layers and the (unpadded) tokens of the forward call, ``p = softmax(z)``, the top-``k`` experts of ``p`` counted::

    C_e = sum over (layer, token) of [e in topk(p)] * mask       (assignments, no gradient)
    P_e = sum over (layer, token) of p_e * mask                  (router probabilities)
    R   = sum over (layer, token) of mask  = sum_e C_e / k       (pooled rows)
    aux = E * sum_e (C_e / R) * (P_e / R)

and the model's loss is ``cross-entropy + router_aux_loss_coef * aux``. (4.57 keeps the counts per top-k slot,
``[k, E]``, and multiplies by ``P [1, E]`` before the sum: the same sum. Its Qwen2-MoE and OLMoE slice the counts at
``E * device index``, which is the whole table on CPU and on the first GPU only.)

How the split rebuilds it exactly: ``C``, ``P`` and ``R`` are sums over tokens, so per *sample* sums add up.

* the prologue starts a ``[b, 2E]`` accumulator (``uniap_router``: counts, then probabilities) and sends the token
  mask on (``uniap_token_mask``);
* each block adds its routers' per-sample sums (:meth:`RouterLoss.statistics`; the routers' logits caught by a
  forward hook for the call, :func:`router_modules`); the accumulator crosses pipeline stages like any payload
  tensor, with the gradient of its probability half;
* the epilogue pools the micro-batch (:meth:`RouterLoss.pooled`): the detached column sums and the sample count,
  all-reduced over the layer's data ranks (``uniap_batch_group``, set by the runtime), give the micro-batch's
  ``C``, ``P``, ``R`` and ``aux``. It returns ``(logits, a [b])`` with ``a_i = coef * (aux + n E / R^2 * C . (p_i -
  p_i.detach()))``, ``n`` the micro-batch's samples: every value equals ``coef * aux``, and the mean over each
  rank's rows, averaged over ranks as the runtime averages losses, has ``coef * aux``'s gradient (through the router
  probabilities; the top-k counts have none, as in Hugging Face);
* the loss adds ``a.mean()`` to the head's loss (:meth:`RouterLoss.wrap`).

Scope: the loss is pooled per forward call, as Hugging Face pools it: one micro-batch (over all data ranks' share
of it). With one micro-batch per step this is one process on the whole batch; with several it is one process
accumulating them (the HF Trainer's gradient accumulation), since the counts of the last micro-batch are not known
when the first one's backward runs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from uniap_lightning.adapters.family import HFTarget

#: payload entries: the per-sample accumulator and the token mask the statistics are weighted by
ROUTER, TOKEN_MASK = "uniap_router", "uniap_token_mask"


@dataclass(frozen=True)
class RouterLoss:
    """The load-balancing term of a Hugging Face MoE causal LM: ``experts`` (E), ``top_k`` (k), ``coef``
    (``router_aux_loss_coef``)."""

    experts: int
    top_k: int
    coef: float

    def statistics(self, logits: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """``[b, 2E]``: per sample, over the given routers' logits (``[b * s, E]`` each) and the unmasked tokens,
        the top-k assignment counts, then the router probability sums."""
        b, E = mask.shape[0], self.experts
        weight = mask.reshape(b, -1, 1).float()
        out = torch.zeros(b, 2 * E, device=mask.device)
        for z in logits:
            probs = F.softmax(z, dim=-1)  # in the logits' dtype, as load_balancing_loss_func
            chosen = torch.topk(probs, self.top_k, dim=-1).indices
            counts = F.one_hot(chosen, E).sum(-2).float()
            out = out + torch.cat([(counts.reshape(b, -1, E) * weight).sum(1),
                                   (probs.float().reshape(b, -1, E) * weight).sum(1)], dim=-1)
        return out

    def pooled(self, acc: torch.Tensor, group: Any = None) -> torch.Tensor:
        """``[b]``: each sample's share of ``coef * aux`` of the micro-batch (see the module docstring); ``group``:
        the ranks holding the micro-batch's other samples (``None``: this rank holds all of it)."""
        E = self.experts
        probs = acc[:, E:]
        stats = torch.cat([acc[:, :E].detach().sum(0), probs.detach().sum(0), acc.new_tensor([acc.shape[0]])])
        if group is not None:
            dist.all_reduce(stats, group=group)
        counts, prob_sums, samples = stats[:E], stats[E:2 * E], stats[2 * E]
        rows = (counts.sum() / self.top_k).clamp(min=1)  # (every row counts k assignments; no rows: no term)
        aux = E * ((counts / rows) * (prob_sums / rows)).sum()
        slope = samples * E / rows ** 2 * counts  # d aux / d (one sample's probability sums), times the samples
        return self.coef * (aux + (probs - probs.detach()) @ slope)

    def wrap(self, loss: Any) -> Any:
        """The head's loss ``(model, logits, target)`` plus the mean of the epilogue's per-sample term."""

        def with_router_loss(model: Any, output: Any, target: HFTarget) -> torch.Tensor:
            logits, aux = output
            return loss(model, logits, target) + aux.mean()

        with_router_loss.uniap_head_loss = loss  # type: ignore[attr-defined]
        return with_router_loss


def router_loss_of(model: Any) -> RouterLoss | None:
    """The model's load-balancing term when its loss includes it (a head taking ``output_router_logits``, with
    ``config.output_router_logits`` on and a ``router_aux_loss_coef`` of its own, as the causal LMs have it);
    ``None`` otherwise."""
    config = model.config
    if not getattr(config, "output_router_logits", False) or \
            "output_router_logits" not in inspect.signature(model.forward).parameters:
        return None
    coef = getattr(model, "router_aux_loss_coef", None)  # (set by the causal LM heads that add the term)
    experts = getattr(model, "num_experts", None) or getattr(config, "num_local_experts", None) or \
        getattr(config, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", None)
    if coef is None or not experts or not top_k:
        return None
    return RouterLoss(int(experts), int(top_k), float(coef))


def router_modules(model: Any, block: nn.Module) -> list[tuple[str, int]]:
    """The modules of ``block`` whose output holds a router's logits, as ``(name in block, output index)``: those
    Hugging Face records as ``router_logits`` (the model's ``_can_record_outputs``: 5.x's ``<X>TopKRouter``,
    output 0; 4.57 Mixtral's sparse MoE block, output 1), else the ``gate`` of each module holding ``experts``
    (4.57 Qwen2-MoE and OLMoE: an ``nn.Linear``)."""
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    if isinstance(target, type):
        index = int(getattr(recorder, "index", 0) or 0)
        return [(name, index) for name, m in block.named_modules() if isinstance(m, target)]
    return [(f"{name}.gate" if name else "gate", 0) for name, m in block.named_modules()
            if hasattr(m, "experts") and isinstance(getattr(m, "gate", None), nn.Module)]


def caught_logits(block: nn.Module, routers: list[tuple[str, int]]) -> tuple[list[torch.Tensor], list[Any]]:
    """Forward hooks on ``block``'s routers appending their logits to the returned list (remove the handles
    after the call)."""
    seen: list[torch.Tensor] = []

    def hook(index: int) -> Any:
        def catch(_m: nn.Module, _args: Any, out: Any) -> None:
            seen.append(out[index] if isinstance(out, (tuple, list)) else out)
        return catch

    return seen, [block.get_submodule(name).register_forward_hook(hook(i)) for name, i in routers]
