"""Multi-process cases for the sequence dimension (:mod:`uniap_lightning.runtime.sequence`) on gloo ranks.

A case is a dict with ``kind``:
- ``"train"``: a chain trained ``steps`` SGD steps on a dp x cp x tp mesh (``dp``, ``cp``, ``tp``); ``sp``: sequence
  parallelism in the TP blocks; ``padded``: a batch with attention-mask zeros and ignored labels; ``average``: the
  loss scaled by cp and gradients averaged over dp x cp; ``model: "llama"``: the Hugging Face Llama chain (else
  the plain GPT); ``model: "bert"``: Hugging Face BERT's masked-LM chain on padded batches (left and right padding,
  token types), the loss on sequence pieces (:func:`~uniap_lightning.runtime.sequence.shard_token_batch`) against
  the model's own loss in one process; ``method: "ring"``: ring attention instead of Ulysses. Every rank also trains the one-process reference itself and reports the
  largest differences.
- ``"bytes"``: the elements one Ulysses forward and backward send; ``"sp_comms"``: the collectives of one
  sequence-parallel block; ``"bad_heads"``: the error for heads not divisible by cp.
"""

from __future__ import annotations

import copy
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH, EMBD, HEADS = 64, 16, 4, 32, 4


def _model(heads: int = HEADS, embd: int = EMBD) -> Any:
    from uniap_lightning.adapters.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=heads, n_embd=embd))


class Chain(torch.nn.Sequential):
    def layers(self) -> list[torch.nn.Module]:
        return list(self)


def _llama() -> Chain:
    """A tiny Hugging Face Llama chain (4 heads, 2 key/value heads: grouped-query attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from uniap_lightning.adapters import hf_layers

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=EMBD, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ,
                      tie_word_embeddings=False, initializer_range=0.2)  # sharp attention: positions matter
    return Chain(*hf_layers(LlamaForCausalLM(cfg)))


def _batches(steps: int, *, padded: bool) -> list[dict[str, torch.Tensor]]:
    """Random token batches; padded: row 0 left-padded by 5, row 1 right-padded by 3, two labels ignored."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone()}
        if padded:
            mask = torch.ones(BATCH, SEQ, dtype=torch.long)
            mask[0, :5] = 0
            mask[1, -3:] = 0
            batch["attention_mask"] = mask
            batch["labels"][2, 7] = batch["labels"][3, 12] = -100
        out.append(batch)
    return out


def _reference(model: Any, batches: list[dict[str, torch.Tensor]], dp: int) -> tuple[list[float], dict[str, Any]]:
    """One process: the CausalLMModule loss (labels masked where the attention mask is 0), averaged over the dp
    slices of the batch as data parallelism does."""
    import torch.nn.functional as F

    from uniap_lightning.runtime.sequence import padding_mask

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        total = 0.0
        for ids, labels, mask in zip(*(_dp_slices(batch, k, dp) for k in ("input_ids", "labels", "attention_mask"))):
            if mask is not None:
                labels = labels.masked_fill(mask == 0, -100)
            with padding_mask(model.layers(), None if mask is None else mask.bool()):
                logits = model(ids)
            total = total + F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1)) / dp
        opt.zero_grad()
        total.backward()
        opt.step()
        losses.append(float(total.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _dp_slices(batch: dict[str, torch.Tensor], key: str, dp: int) -> list[Any]:
    if key not in batch:
        return [None] * dp
    return list(batch[key].chunk(dp))


def _groups(dp: int, cp: int, tp: int) -> tuple[Any, Any, Any]:
    """Mesh (dp, cp, tp): this rank's cp group, its dp x cp group (same tp index) and its tp sub-mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    world, rank = dp * cp * tp, dist.get_rank()
    replica = None
    for t in range(tp):  # every rank creates every group, in the same order
        g = dist.new_group([r for r in range(world) if r % tp == t])
        if rank % tp == t:
            replica = g
    return mesh["cp"].get_group(), replica, mesh["tp"]


def _bert() -> Any:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(
        vocab_size=VOCAB, hidden_size=EMBD, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=64,
        max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
        initializer_range=0.2))  # sharp attention: positions and the padding mask matter


def _bert_batches(steps: int) -> list[dict[str, torch.Tensor]]:
    """Masked-LM batches: row 0 left-padded by 5, row 1 right-padded by 3; token type 1 on the second half (so it
    differs between the cp pieces); about a third of the real tokens labelled, at least one per row."""
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(steps):
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[0, :5] = 0
        mask[1, -3:] = 0
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g) * mask
        chosen = (torch.rand(BATCH, SEQ, generator=g) < 0.35) & (mask == 1)
        chosen[:, 6] = True
        types = (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ) * mask
        out.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": types,
                    "labels": ids.masked_fill(~chosen, -100)})
    return out


def train_bert(case: dict[str, Any]) -> dict[str, Any]:
    """BERT's masked-LM chain on dp x cp x tp ranks (sp: :func:`bert_sp_plan` in the blocks), the loss on each
    rank's sequence piece, against the model's own loss in one process (averaged over the dp slices)."""
    from uniap_lightning.adapters.families.sequence_hf import bert_sp_plan
    from uniap_lightning.adapters.families.text import bert_layers
    from uniap_lightning.runtime.payload import call_layer
    from uniap_lightning.runtime.sequence import (enable_context_parallel, global_loss, reduce_gradients,
                                                  sequence_loss, shard_token_batch)
    from uniap_lightning.runtime.sequence_tp import apply_sp
    from uniap_lightning.runtime.tensor_parallel import apply_tp

    dp, cp, tp = case.get("dp", 1), case.get("cp", 1), case.get("tp", 1)
    batches = _bert_batches(case.get("steps", 5))
    model, reference = _bert(), _bert()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_losses = []
    for batch in batches:
        loss = sum(reference(**{k: v.chunk(dp)[i] for k, v in batch.items()}).loss for i in range(dp)) / dp
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(float(loss.detach()))
    ref_state = {k: v.detach().clone() for k, v in reference.state_dict().items()}

    cp_group, replica_group, tp_mesh = _groups(dp, cp, tp)
    rank = dist.get_rank()
    dp_rank, cp_rank = rank // (cp * tp), (rank // tp) % cp
    layers = [layer for layer, _ in bert_layers(model)]
    for i, block in enumerate(layers[1:-1]):
        if tp > 1 and case.get("sp"):
            apply_sp(block, f"blocks.{i}", tp_mesh, plan=bert_sp_plan(tp))
        elif tp > 1:
            apply_tp(block, f"blocks.{i}", tp_mesh)
    if cp > 1:
        enable_context_parallel(layers, cp_group, method=case.get("method", "ulysses"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        shard = shard_token_batch({k: v.chunk(dp)[dp_rank] for k, v in batch.items()}, cp_rank, cp)
        x: Any = {k: shard[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
        for layer in layers:
            x = call_layer(layer, x)
        loss = sequence_loss(x, shard["labels"], cp_group)
        opt.zero_grad()
        loss.backward()
        reduce_gradients(model.parameters(), replica_group, dp=dp)
        opt.step()
        reported = global_loss(loss, cp_group)
        dist.all_reduce(reported, group=replica_group)
        losses.append(float(reported) / (dp * cp))
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "param_diff": max(float((state[k] - ref_state[k]).abs().max()) for k in ref_state),
        "moved": max(float((ref_state[k] - v).abs().max()) for k, v in _bert().state_dict().items()),
        "losses": losses,
    }


def train(case: dict[str, Any]) -> dict[str, Any]:
    if case.get("model") == "bert":
        return train_bert(case)
    from uniap_lightning.runtime.sequence import (enable_context_parallel, global_loss, padding_mask,
                                                  reduce_gradients, sequence_loss, shard_causal_lm_batch)
    from uniap_lightning.runtime.sequence_tp import apply_sp
    from uniap_lightning.runtime.tensor_parallel import apply_tp

    dp, cp, tp = case.get("dp", 1), case.get("cp", 1), case.get("tp", 1)
    steps = case.get("steps", 5)
    batches = _batches(steps, padded=case.get("padded", False))
    llama = case.get("model") == "llama"
    model = _llama() if llama else _model()
    reference = copy.deepcopy(model)
    if llama and case.get("padded"):  # the chain has no padding otherwise: the same attention function, one process
        from uniap_lightning.adapters.families.sequence_hf import enable_hf_ulysses

        enable_hf_ulysses(reference.layers(), None)
    ref_losses, ref_state = _reference(reference, batches, dp)

    cp_group, replica_group, tp_mesh = _groups(dp, cp, tp)
    rank = dist.get_rank()
    dp_rank, cp_rank = rank // (cp * tp), (rank // tp) % cp
    if tp > 1:
        for i, block in enumerate(model.layers()[1:-1]):
            if case.get("sp") and llama:
                from uniap_lightning.adapters.families.sequence_hf import llama_sp_plan

                apply_sp(block, f"blocks.{i}", tp_mesh, plan=llama_sp_plan(tp))
            else:
                (apply_sp if case.get("sp") else apply_tp)(block, f"blocks.{i}", tp_mesh)
    if cp > 1 and llama:
        from uniap_lightning.adapters.families.sequence_hf import enable_hf_ulysses

        enable_hf_ulysses(model.layers(), cp_group, method=case.get("method", "ulysses"))
    elif cp > 1:
        enable_context_parallel(model.layers(), cp_group, method=case.get("method", "ulysses"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        mine = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
        shard = shard_causal_lm_batch(mine, cp_rank, cp)
        mask = shard["attention_mask"].bool() if "attention_mask" in shard else None
        with padding_mask(model.layers(), mask):
            logits = model(shard["input_ids"])
        # "average": what a runtime that averages over its group does (ReplicatedGrads, FSDP over dp x cp)
        scale = cp if case.get("average") else 1
        loss = sequence_loss(logits, shard["targets"], cp_group, scale=scale)
        opt.zero_grad()
        loss.backward()
        reduce_gradients(model.parameters(), replica_group, dp=dp * cp if case.get("average") else dp)
        opt.step()
        reported = global_loss(loss, cp_group, scale=scale)
        dist.all_reduce(reported, group=replica_group)  # each dp replica's loss once per cp rank: sum / (dp cp)
        losses.append(float(reported) / (dp * cp))
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "param_diff": max(float((state[k] - ref_state[k]).abs().max()) for k in ref_state),
        "moved": max(float((ref_state[k] - model_init).abs().max())
                     for k, model_init in (_llama() if llama else _model()).state_dict().items()),
        "losses": losses,
    }


def count_bytes(case: dict[str, Any]) -> dict[str, Any]:
    from uniap_lightning.runtime.sequence import AllToAllCounter, enable_context_parallel, split_sequence

    cp, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    counter = AllToAllCounter()
    enable_context_parallel(model.layers(), dist.group.WORLD, counter=counter)
    ids = split_sequence(_batches(1, padded=False)[0]["input_ids"], rank, cp)
    model(ids).sum().backward()
    return {"forward": counter.forward_elements, "backward": counter.backward_elements, "calls": counter.calls,
            "by_call": list(counter.by_call), "layers": len(model.blocks)}


def sp_comms(case: dict[str, Any]) -> dict[str, Any]:
    """Collectives of one sequence-parallel block (tp = all ranks), forward and backward, by op name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from uniap_lightning.runtime.sequence_tp import apply_sp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if case.get("model") == "llama":
        from uniap_lightning.adapters.families.sequence_hf import llama_sp_plan

        block = _llama()[1]
        apply_sp(block, "layers.1", mesh, plan=llama_sp_plan(mesh.size()))
        norms = [block.layer.input_layernorm.weight, block.layer.post_attention_layernorm.weight]
    elif case.get("model") == "bert":  # post-norm: the norms after each residual sum, a dict in and out
        from uniap_lightning.adapters.families.sequence_hf import bert_sp_plan
        from uniap_lightning.adapters.families.text import bert_layers

        block = bert_layers(_bert())[1][0]
        apply_sp(block, "bert.encoder.layer.0", mesh, plan=bert_sp_plan(mesh.size()))
        out = block.layer.output
        norms = [block.layer.attention.output.LayerNorm.weight, out.LayerNorm.bias, out.dense.bias]
    else:
        block = _model().blocks[0]
        apply_sp(block, "blocks.0", mesh)
        norms = [block.ln_1.weight, block.ln_2.bias]
    x = torch.randn(BATCH, SEQ, EMBD, requires_grad=True)
    forward, backward = CommDebugMode(), CommDebugMode()
    with forward:
        y = block({"hidden": x})["hidden"] if case.get("model") == "bert" else block(x)
    with backward:
        y.sum().backward()
    ops = [{str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()} for mode in (forward, backward)]
    return {"forward": ops[0], "backward": ops[1], "out_shape": tuple(y.shape), "grad_shape": tuple(x.grad.shape),
            "norm_grads_replicated": all(pl.is_replicate() for p in norms for pl in p.grad.placements)}


def bad_heads(case: dict[str, Any]) -> dict[str, Any]:
    from uniap_lightning.runtime.sequence import enable_context_parallel

    model = _model(heads=3, embd=24)
    try:
        enable_context_parallel(model.layers(), dist.group.WORLD)
    except Exception as err:  # the test checks the type and the message
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None}


KINDS = {"train": train, "bytes": count_bytes, "sp_comms": sp_comms, "bad_heads": bad_heads}


def worker(rank: int, world: int, port: int, cases: dict[str, dict[str, Any]], out_dir: str,
           kinds: dict[str, Any] | None = None) -> None:
    """Run every case with ``kinds[case["kind"]]`` (default :data:`KINDS`) in one gloo group; results (or the first
    failure) saved per rank."""
    kinds = KINDS if kinds is None else kinds
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = kinds[case["kind"]](case)
        except Exception as err:  # recorded, so the test names the failing case
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            break  # the process group may be unusable after a failure
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()
