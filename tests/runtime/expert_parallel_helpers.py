"""The tiny MoE GPT, its data, a training loop and the multi-process worker of ``test_expert_parallel.py``.

A case is a dict: ``cfg`` (``MoEGPTConfig`` overrides), ``ep``, ``token_scope`` (``"data"``: capacity and
load-balancing statistics over every data rank's tokens; ``"local"``: over this rank's only), ``steps`` (0: one
forward only), ``kind`` (``"train"``, ``"balanced"`` for the crafted balanced routing, ``"bad_ep"``).
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from uniap_lightning.adapters.moe import MoECausalLMModule, MoEGPT, MoEGPTConfig, MoEMLP

VOCAB, SEQ, BATCH = 64, 8, 8  # BATCH: the concatenated batch over all data ranks
BASE = dict(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, n_experts=4, top_k=2)


def make_module(**cfg: Any) -> MoECausalLMModule:
    torch.manual_seed(0)
    return MoECausalLMModule(MoEGPT(MoEGPTConfig(**{**BASE, **cfg})).layers())


def make_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def moe_layers(module: Any) -> list[MoEMLP]:
    return [m for m in module.modules() if isinstance(m, MoEMLP)]


#: the load-balancing coefficient of the ``router_loss`` models: large, so a wrong auxiliary gradient shows in the
#: weights after a few steps (Hugging Face's defaults are 0.001 and 0.01)
ROUTER_COEF = 0.5


def hf_model(family: str, router_loss: bool = False) -> Any:
    """A tiny Hugging Face MoE causal LM (random weights, E=4, k=2): ``mixtral``, ``qwen2_moe`` or ``olmoe``;
    ``router_loss``: trained with its load-balancing loss (``output_router_logits=True``, coefficient
    :data:`ROUTER_COEF`)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False, num_experts_per_tok=2,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if router_loss:
        common.update(output_router_logits=True, router_aux_loss_coef=ROUTER_COEF)
    torch.manual_seed(0)
    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4))
    if family == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=64))
    return tf.OlmoeForCausalLM(tf.OlmoeConfig(**common, num_experts=4))


def hf_loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def chain_loss(module: Any, ids: torch.Tensor) -> torch.Tensor:
    return module.uniap_loss(module(ids), ids)


def train(module: Any, ids: torch.Tensor, steps: int, after_backward: Any = None, loss_of: Any = chain_loss
          ) -> dict[str, Any]:
    """SGD steps on ``ids`` (no optimizer state: parity is not blurred by Adam's noise amplification)."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses, dropped = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(module, ids)
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        losses.append(loss.item())
        dropped.append([int(m.last_dropped) for m in moe_layers(module)])
    return {"losses": losses, "dropped": dropped,
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()}}


def reference(cfg: dict[str, Any], ids: torch.Tensor, steps: int) -> dict[str, Any]:
    """One process; also the top-k experts each layer chose for every token in the first forward."""
    module = make_module(**cfg)
    routes: list[torch.Tensor] = []
    hooks = [m.router.register_forward_hook(lambda _m, _i, out, k=m.top_k: routes.append(out.topk(k).indices))
             for m in moe_layers(module)]
    first = module.uniap_loss(module(ids), ids).item()
    first_dropped = [int(m.last_dropped) for m in moe_layers(module)]
    for hook in hooks:
        hook.remove()
    result = train(make_module(**cfg), ids, steps) if steps else {"losses": [first], "dropped": [first_dropped]}
    return {**result, "routes": routes}


def balanced_tokens(n: int, hidden: int) -> torch.Tensor:
    """Token ``i`` prefers experts ``i % 4`` then ``(i + 1) % 4`` (with the router of :func:`balanced_layer`)."""
    x = torch.zeros(n, hidden)
    i = torch.arange(n)
    x[i, i % 4] = 2.0
    x[i, (i + 1) % 4] = 1.0
    return x


def own_tokens(n: int, hidden: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tokens prefer experts ``2 rank`` and ``2 rank + 1``: with ep=2 they all stay on their rank
    (every all-to-all sends zero rows)."""
    x = torch.zeros(n, hidden)
    i = torch.arange(n)
    x[i, 2 * rank + i % 2] = 2.0
    x[i, 2 * rank + 1 - i % 2] = 1.0
    return x


def layer_tokens(kind: str, n: int, hidden: int, rank: int) -> torch.Tensor:
    return balanced_tokens(n, hidden) if kind == "balanced" else own_tokens(n, hidden, rank)


def balanced_layer(hidden: int, capacity_factor: float = 1.0) -> MoEMLP:
    torch.manual_seed(0)
    layer = MoEMLP(hidden, 4 * hidden, 4, top_k=2, capacity_factor=capacity_factor)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4, hidden) * 5.0)
    return layer


def _run_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    from uniap_lightning.runtime import experts

    groups = experts.new_expert_groups(experts.ExpertLayout(tuple(range(world)), case.get("ep", 2)), rank)
    token_group = groups.data if case.get("token_scope", "data") == "data" else None
    kind = case.get("kind", "train")
    if kind == "bad_ep":
        try:
            experts.apply_expert_parallel(make_module(n_experts=3), ep_group=groups.ep, token_group=token_group)
        except ValueError as err:
            return {"error_message": f"{type(err).__name__}: {err}"}
        return {"error_message": None}
    if kind in ("balanced", "own"):
        hidden, b, s = case["hidden"], case["b"], case["s"]
        layer = balanced_layer(hidden, case.get("capacity_factor", 1.0))
        counter = experts.apply_expert_parallel(layer, ep_group=groups.ep, token_group=token_group)
        x = layer_tokens(kind, b * s, hidden, rank).view(b, s, hidden).requires_grad_()  # as activations do
        y, aux = layer(x)
        (y.sum() + aux).backward()
        return {"records": _records(counter), "dropped": int(layer.last_dropped), "y": y.detach(),
                "x_grad": x.grad, "grads": {k: p.grad for k, p in layer.named_parameters()}}
    module = hf_model(case["hf"]) if "hf" in case else make_module(**case.get("cfg", {}))
    counter = experts.apply_expert_parallel(module, ep_group=groups.ep, token_group=token_group)
    n = BATCH // groups.data_size
    index = list(range(world)).index(rank)
    ids = make_ids()[index * n:(index + 1) * n]
    loss_of = hf_loss if "hf" in case else chain_loss
    if not case.get("steps"):
        loss = module.uniap_loss(module(ids), ids)
        return {"losses": [loss.item()], "dropped": [[int(m.last_dropped) for m in moe_layers(module)]],
                "records": _records(counter)}
    first_step: list[Any] = []

    def reduce() -> None:
        experts.reduce_gradients(module, groups)
        if not first_step:
            first_step.append(_records(counter))

    result = train(module, ids, case["steps"], reduce, loss_of)
    return {**result, "records": first_step[0], "expert_keys": sorted(experts.expert_state_keys(module))}


def _records(counter: Any) -> list[dict[str, Any]]:
    return [dataclasses.asdict(r) for r in counter.records]


def worker(rank: int, world: int, port: int, cases: dict[str, dict[str, Any]], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = _run_case(rank, world, case)
        except Exception as err:  # recorded, so the test names the case and shows the traceback
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            break
    dist.destroy_process_group()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def lightning_module(**cfg: Any) -> MoECausalLMModule:
    """The MoE GPT as a LightningModule with SGD (for runs under ``strategy="uniap"``)."""

    class SGDMoE(MoECausalLMModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    return SGDMoE(MoEGPT(MoEGPTConfig(**{**BASE, **cfg})).layers())
