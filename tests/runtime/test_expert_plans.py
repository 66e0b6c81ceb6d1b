"""Plans with expert parallelism (``Strategy.ep``) run under ``Trainer(strategy=UniAPStrategy(plan=...))``: the tiny
MoE GPT of :mod:`uniap_lightning.adapters.moe` matches one process (loss and parameters within 1e-5 after 5 steps)
with a capacity that drops no token (``capacity_factor = E / k``), checkpoints hold the full experts, and tiny Hugging
Face Mixtral / Qwen2-MoE / OLMoE models train through the zero-glue path (``self.model(**batch).loss``) likewise.
Also: ep with Ulysses cp (dropless blocks), several micro-batches (against one process accumulating them), plan
switches across ep degrees inside the fit (``rebalance=True``'s path), and memory per rank against the planner
(``benchmarks/memory_experts.py``).

The default two-process cases share one spawn (:data:`CASES2`); the four-process mixes (:data:`CASES4`,
:data:`MICRO4`) and the other two Hugging Face families (:data:`HF_SLOW`) are ``slow``, one spawn each.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import uniap_rt_helpers as h

HAS_HF = importlib.util.find_spec("transformers") is not None  # the [hf] extra

NAMES = ["chain.0", "chain.1", "chain.2", "chain.3"]  # embedding, two MoE blocks, head
NO_DROP = {"capacity_factor": 2.0}  # = E / k: an expert can take every token
MODULE = {"factory": "expert_parallel_helpers:lightning_module", **NO_DROP}
DATA = {"factory": "uniap_rt_helpers:make_data", "lm": True}


def _plan(blocks: dict[str, Any], *, world: int = 2, edges: dict[str, Any] | None = None, pp: int = 1,
          microbatches: int = 1) -> Any:
    """Embedding and head as ``edges`` says (replicated over every rank by default), both MoE blocks as ``blocks``."""
    n = world // pp
    edge = {"dp": n, **(edges or {})}
    stages = [0, 0, 0, 0] if pp == 1 else [0, 0, 1, 1]
    return h.make_plan([edge, {"dp": n, **blocks}, {"dp": n, **blocks}, edge], stages, pp=pp,
                       microbatches=microbatches, world=world, names=NAMES)


def _case(plan: Any, **extra: Any) -> dict[str, Any]:
    return {"module": MODULE, "data": DATA, "steps": 5, "plan": plan, **extra}


HF_NAMES = ["model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1", "model.model.norm"]


def _hf_case(family: str) -> dict[str, Any]:
    edge, block = {"dp": 2}, {"dp": 2, "ep": 2}
    plan = h.make_plan([edge, block, block, edge], [0, 0, 0, 0], pp=1, microbatches=1, world=2, names=HF_NAMES)
    return {"module": {"factory": "expert_plan_workers:hf_moe_module", "family": family},
            "data": {"factory": "hf_models:hf_batches", "family": "llama"}, "steps": 5, "plan": plan}


def _hf_router_case(family: str, *, ep: int = 2, pp: int = 1) -> dict[str, Any]:
    """``family`` trained with its load-balancing loss (``output_router_logits=True``) on 2 ranks: the MoE blocks
    with ep over both (dp 2), dp 2 alone (``ep=1``), or 2 pipeline stages (``pp=2``). One micro-batch: Hugging Face
    pools the loss over each forward call, so one process on the whole batch is the reference."""
    edge, block = ({"dp": 1}, {"dp": 1}) if pp == 2 else ({"dp": 2}, {"dp": 2, "ep": ep})
    plan = h.make_plan([edge, block, block, edge], [0, 0, 1, 1] if pp == 2 else [0, 0, 0, 0], pp=pp, microbatches=1,
                       world=2, names=HF_NAMES)
    return {"module": {"factory": "expert_plan_workers:hf_moe_module", "family": family, "router_loss": True},
            "data": {"factory": "hf_models:hf_batches", "family": "llama"}, "steps": 3, "plan": plan}


#: one case per family by default (:data:`CASES2`), the others ``slow`` (:data:`HF_SLOW`)
HF_ROUTER = {"hf_mixtral_router_ep2": _hf_router_case("mixtral"), "hf_qwen2_moe_router_ep1": _hf_router_case(
    "qwen2_moe", ep=1), "hf_olmoe_router_pp2": _hf_router_case("olmoe", pp=2)} if HAS_HF else {}
HF_ROUTER_SLOW = {"hf_mixtral_router_ep1": _hf_router_case("mixtral", ep=1),
                  "hf_qwen2_moe_router_ep2": _hf_router_case("qwen2_moe"),
                  "hf_olmoe_router_ep2": _hf_router_case("olmoe"),
                  "hf_olmoe_router_ep1": _hf_router_case("olmoe", ep=1),
                  # the blocks tensor-parallel (both ranks hold the same samples: the statistics counted once)
                  "hf_qwen2_moe_router_tp2": {**_hf_router_case("qwen2_moe"), "plan": h.make_plan(
                      [{"dp": 2}, {"dp": 1, "tp": 2}, {"dp": 1, "tp": 2}, {"dp": 1, "tp": 2}], [0] * 4, pp=1,
                      microbatches=1, world=2, names=HF_NAMES)},
                  # ZeRO-3 everywhere (the routers sharded, gathered for each forward)
                  "hf_olmoe_router_zero3": {**_hf_router_case("olmoe"), "plan": h.make_plan(
                      [{"dp": 2, "dp_mode": "zero3"}] * 4, [0] * 4, pp=1, microbatches=1, world=2,
                      names=HF_NAMES)}} if HAS_HF else {}
MOMENTUM = {"factory": "expert_plan_workers:moe_module", "momentum": 0.9, **NO_DROP}
EP1, EP2 = _plan({}), _plan({"ep": 2})
def _memory(tag: str) -> dict[str, Any]:
    """The MoE GPT (plain SGD) recording the bytes each rank holds for its MoE blocks (``expert_plan_workers``)."""
    return {"factory": "expert_plan_workers:moe_module", "memory_tag": tag, **NO_DROP}


CP2 = {"dp": 1, "cp": 2}
#: two CPU processes, for what rebalance=True measures and solves at setup beside a pinned plan
CPU2 = {"name": "cpu2", "nodes": 1, "devices_per_node": 2, "memory_gib": 4, "peak_tflops": 0.01}
CASES2 = {
    "ep2": {**_case(EP2), "module": _memory("ep2")},
    "dp2": _case(EP1),
    # validation runs the experts' all-to-alls without gradients
    "ep2_eval": {**_case(EP2, limit_val_batches=2), "epochs": 1},
    # capacity 0.5 drops about half the assignments: counted over both ranks' tokens, the same ones as one process
    "ep2_drops": {**_case(EP2), "module": {**MODULE, "capacity_factor": 0.5}},
    # clipping by the global norm (each expert shard counted once) and an accumulation window of two batches
    "ep2_clip_accumulate": _case(EP2, clip=0.05, accumulate=2),
    # checkpoints across expert-parallel degrees (SGD with momentum: the expert shards' optimizer state travels too)
    "save_ep2": {"module": MOMENTUM, "data": DATA, "epochs": 1, "plan": EP2, "save": "ep2.ckpt"},
    "resume_ep1": {"module": MOMENTUM, "data": DATA, "epochs": 2, "plan": EP1, "resume": "ep2.ckpt"},
    "save_ep1": {"module": MOMENTUM, "data": DATA, "epochs": 1, "plan": EP1, "save": "ep1.ckpt"},
    "resume_ep2": {"module": MOMENTUM, "data": DATA, "epochs": 2, "plan": EP2, "resume": "ep1.ckpt",
                   "export": "ep2_full.pt"},
    **({"hf_mixtral": {**_hf_case("mixtral"), "export": "mixtral_hf", "export_format": "hf"}} if HAS_HF else {}),
    # Hugging Face MoE with the load-balancing loss in .loss: ep 2, ep 1 (dp 2), two pipeline stages
    **HF_ROUTER,
    # two micro-batches per step: routing, capacity and the auxiliary loss per micro-batch (as Megatron and
    # DeepSpeed-MoE), each over both ranks' share of it; without drops and with them (capacity 0.5)
    # a plan switch inside the fit (the path rebalance=True takes after a re-plan) from ep2 to ep1 after 3 of 6
    # steps, and back: the experts' shards and their momentum travel through the switch's checkpoint
    **{f"switch_{a}_to_{b}": {"module": {**MOMENTUM, "switch_at": 2, "switch_to": {"ep": int(b[2])}}, "data": DATA,
                              "steps": 6, "plan": _plan({"ep": int(a[2])}),
                              "strategy": {"rebalance": True, "rebalance_check_every": 1000, "cluster": CPU2}}
       for a, b in (("ep2", "ep1"), ("ep1", "ep2"))},
    # Ulysses cp 2 in every layer (the batch whole on both ranks, each sequence split), the experts over the 2
    # replicas (dropless: a split sequence reorders the router's tokens, which decides drops)
    "cp2_ep2": _case(h.make_plan([CP2, {**CP2, "ep": 2}, {**CP2, "ep": 2}, CP2], [0, 0, 0, 0], pp=1, microbatches=1,
                                 world=2, names=NAMES)),
    "ep2_micro2": _case(_plan({"ep": 2}, microbatches=2)),
    "ep2_micro2_drops": {**_case(_plan({"ep": 2}, microbatches=2)), "module": {**MODULE, "capacity_factor": 0.5}},
    # a single-file Lightning checkpoint of one process (full [E, ...] experts) loaded into ep=2: each rank takes
    # its own block of experts (:func:`_single_device_moe_checkpoint` writes it before the spawn)
    "from_single_file_ep2": {"module": MODULE, "data": DATA, "plan": EP2, "validate_only": True,
                             "resume": "moe_single.ckpt", "limit_val_batches": 2},
}


def _single_device_moe_checkpoint(path: Path) -> None:
    """One process trains the MoE GPT for one epoch and writes a single-file Lightning checkpoint to ``path``, and
    its validation loss on two batches beside it (``<path>.val_loss.pt``)."""
    import lightning.pytorch as pl

    case = {"module": MODULE, "data": DATA, "epochs": 1, "limit_val_batches": 2}
    module = h.make_module(**MODULE)
    trainer = pl.Trainer(devices=1, **h.trainer_kwargs(case))
    trainer.fit(module, h._data(case))
    trainer.save_checkpoint(path)
    torch.save(trainer.validate(module, h._data(case), verbose=False)[0]["val_loss"],
               path.with_name(f"{path.name}.val_loss.pt"))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("expert_plans2")
    _single_device_moe_checkpoint(out / "moe_single.ckpt")
    return h.spawn(2, CASES2, out), out


@pytest.fixture(scope="module")
def two(spawned: tuple[list[dict[str, Any]], Path]) -> list[dict[str, Any]]:
    return spawned[0]


def test_expert_profile_fields_of_the_moe_gpt_and_mixtral_layers() -> None:
    """What a profile needs for the planner to price ep (``experts``, ``top_k``, ``expert_params``,
    ``capacity_factor``), read from the chain's layers; nothing for dense ones."""
    from expert_plan_workers import moe_module

    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.runtime.experts import expert_profile_fields

    layers = extract_chain(moe_module(**NO_DROP)).layers
    h_, ffn = 32, 128
    assert expert_profile_fields(layers[1]) == {"experts": 4, "top_k": 2, "capacity_factor": 2.0,
                                                "expert_params": 4 * (h_ * ffn + ffn + ffn * h_ + h_)}
    assert expert_profile_fields(layers[0]) == {} and expert_profile_fields(layers[3]) == {}
    if HAS_HF:
        from expert_plan_workers import hf_moe_module

        block = extract_chain(hf_moe_module("mixtral")).layers[1]
        assert expert_profile_fields(block) == {"experts": 4, "top_k": 2, "expert_params": 4 * 3 * 32 * 64}


def test_a_measured_profile_carries_the_expert_fields_and_the_planner_offers_ep() -> None:
    """``strategy='uniap'`` without a pinned plan: the profile measured at setup carries each MoE layer's expert
    fields, so the search may split its experts (ep 2 or 4 of 4 replicas); dense layers stay at ep 1."""
    from expert_plan_workers import moe_module

    from uniap_lightning.planner.cost.layer import strategies_for
    from uniap_lightning.planner.profile import ModelProfile
    from uniap_lightning.profiling.module import profile_chain
    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.runtime.planning import local_cluster

    import expert_parallel_helpers as eh

    chain = extract_chain(moe_module(**NO_DROP))
    ids = torch.randint(0, eh.VOCAB, (4, eh.SEQ), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # measured, not the structural fallback
        prof = profile_chain(chain.layers, chain.names, ids, repeats=1, micro_batches=[4])
    prof = ModelProfile.from_dict(prof.to_dict())  # the fields survive the file format
    block, head = prof.layers[1], prof.layers[-1]
    assert (block.experts, block.top_k, block.capacity_factor) == (4, 2, 2.0) and 0 < block.expert_params < block.params
    assert head.experts == 0
    cluster = local_cluster(nodes=1, devices_per_node=4, device_type="cpu")
    assert {s.ep for s in strategies_for(block, 4, cluster, 8) if s.dp == 4} == {1, 2, 4}
    assert {s.ep for s in strategies_for(head, 4, cluster, 8)} == {1}


def test_the_planner_splits_the_sequence_of_dropless_moe_blocks_only() -> None:
    """A dropless MoE block (``capacity_factor >= E / k``) declares its attention, so its profile has the sequence
    fields and the planner offers Ulysses cp with every ep over the ``dp x cp`` replicas (the ``cp2_ep*`` parity
    cases run such plans). A block that may drop tokens declares nothing (a split sequence hands the router its
    tokens in another order than one process, which decides the drops): no cp is offered, and a pinned cp plan
    is refused in one line from the plan and the chain alone (before any process group)."""
    from expert_plan_workers import moe_module

    from uniap_lightning.errors import UniAPError
    from uniap_lightning.planner.cost.layer import strategies_for
    from uniap_lightning.profiling.module import with_expert_fields, with_sequence_fields
    from uniap_lightning.profiling.structural import structural_profile
    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.runtime import check_plan_executable
    from uniap_lightning.runtime.planning import local_cluster

    import expert_parallel_helpers as eh

    ids = torch.randint(0, eh.VOCAB, (4, eh.SEQ), generator=torch.Generator().manual_seed(0))
    cluster = local_cluster(nodes=1, devices_per_node=4, device_type="cpu")
    offered = {}
    for name, cf in (("dropless", 2.0), ("drops", 1.25)):
        chain = extract_chain(moe_module(capacity_factor=cf))
        prof = with_expert_fields(with_sequence_fields(structural_profile(chain.layers, chain.names, ids),
                                                       chain.layers, ids), chain.layers)
        assert prof.layers[1].experts == 4
        offered[name] = {(s.cp, s.ep) for s in strategies_for(prof.layers[1], 4, cluster, 8)}
    assert {(2, 1), (2, 2), (4, 4), (1, 4)} <= offered["dropless"]
    assert offered["drops"] == {(1, 1), (1, 2), (1, 4)}
    cp_ep = {**CP2, "ep": 2}
    plan = h.make_plan([CP2, cp_ep, cp_ep, CP2], [0, 0, 0, 0], pp=1, microbatches=1, world=2, names=NAMES)
    check_plan_executable(plan, extract_chain(moe_module(**NO_DROP)))
    with pytest.raises(UniAPError, match=r"plan layer 'chain.1' \(MoEBlock\): cp=2 needs the layer's attention "
                                         r"heads") as err:
        check_plan_executable(plan, extract_chain(moe_module(capacity_factor=1.25)))
    assert "\n" not in str(err.value)


def test_ep_not_dividing_the_experts_is_refused_in_one_line_before_any_process_group() -> None:
    """Three experts cannot split over ep=2: one ``UniAPError`` line naming the layer, from the plan and the chain
    alone (every rank fails alike, before any collective)."""
    from expert_plan_workers import moe_module

    from uniap_lightning.errors import UniAPError
    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.runtime import check_plan_executable

    chain = extract_chain(moe_module(n_experts=3, top_k=2))
    with pytest.raises(UniAPError, match=r"plan layer 'chain.1' \(moe\): expert parallelism ep=2 must divide the "
                                         r"number of experts E=3") as err:
        check_plan_executable(EP2, chain)
    assert "\n" not in str(err.value)


def test_ep2_plan_matches_one_process(two: list[dict[str, Any]]) -> None:
    """ep=2 over the two data ranks: each holds 2 of the 4 experts of each block (replicated embedding and head);
    each expert shard is held by one rank, so its gradient is only divided by the 2 replicas, not exchanged."""
    h.assert_close_to_reference(two, "ep2", h.reference_for(CASES2["ep2"]))


def test_dp2_without_ep_routes_by_the_global_batch(two: list[dict[str, Any]]) -> None:
    """ep=1 with two data ranks: every rank holds every expert, but capacity and the auxiliary loss's statistics
    count both ranks' tokens (one small all-gather per layer), so the run matches one process exactly; with local
    statistics the auxiliary loss differs (router weights off by ~5e-5 after 8 steps)."""
    h.assert_close_to_reference(two, "dp2", h.reference_for(CASES2["dp2"]))
    for res in two:
        assert res["dp2"]["local_shapes"]["chain.1.moe.w_in"] == (4, 32, 128)
        assert res["dp2"]["all_to_all"] == []


def test_ep2_validation_matches_one_process(two: list[dict[str, Any]]) -> None:
    """The validation loop at the end of the epoch (no gradients; capacity and auxiliary loss over both ranks'
    tokens) under ep=2: the same validation loss as one process, and training goes on to match it too."""
    h.assert_close_to_reference(two, "ep2_eval", h.reference_for(CASES2["ep2_eval"]))
    ref = h.reference_for(CASES2["ep2_eval"])
    for res in two:
        assert res["ep2_eval"]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)


def test_ulysses_cp2_with_ep2_matches_one_process(two: list[dict[str, Any]]) -> None:
    """Every layer with its sequence split over the 2 ranks (Ulysses attention in the MoE blocks), the experts split
    over the same 2 replicas: each rank routes its sequence pieces' tokens (capacity and the auxiliary loss's
    expert fractions counted over both ranks' tokens; each piece's auxiliary term per token, so the loss's mean over
    the gathered whole sequences is one process's); dropless, the run equals one process."""
    h.assert_close_to_reference(two, "cp2_ep2", h.reference_for(CASES2["cp2_ep2"]))
    for res in two:
        assert [lp["cp"] for lp in res["cp2_ep2"]["plan"]["layers"]] == [2, 2, 2, 2]
        assert res["cp2_ep2"]["local_shapes"]["chain.1.moe.w_in"] == (2, 32, 128)
        assert any(name == "dispatch" and b > 0 for name, b in res["cp2_ep2"]["all_to_all"])


def test_ep2_with_dropped_tokens_drops_what_one_process_drops(two: list[dict[str, Any]]) -> None:
    """What happens when tokens are dropped (capacity factor 0.5, ``ceil(0.5 * N * k / E)`` assignments per expert
    over the global batch): a dropped slot adds nothing (the token keeps its residual and its other slot); capacity is
    counted over both ranks' tokens in one process's order, so the drops and the run equal one process's."""
    h.assert_close_to_reference(two, "ep2_drops", h.reference_for(CASES2["ep2_drops"]))


def test_ep2_clips_by_the_global_norm_and_accumulates(two: list[dict[str, Any]]) -> None:
    """``gradient_clip_val`` (small enough to clip every step) sums each expert shard's squares once, and expert
    gradients accumulate over a window of two batches before their reduction."""
    h.assert_close_to_reference(two, "ep2_clip_accumulate", h.reference_for(CASES2["ep2_clip_accumulate"]))


def test_ep2_plan_splits_the_experts_and_exchanges_tokens(two: list[dict[str, Any]]) -> None:
    """Each rank holds half of each block's stacked expert weights; every step ran the all-to-alls (dispatch,
    combine and their backward) and sent tokens to the other rank."""
    for res in two:
        shapes = res["ep2"]["local_shapes"]
        assert shapes["chain.1.moe.w_in"] == (2, 32, 128) and shapes["chain.2.moe.b_out"] == (2, 32)
        assert shapes["chain.1.moe.router.weight"] == (4, 32)  # the router stays replicated
        names = [name for name, _ in res["ep2"]["all_to_all"]]
        assert names.count("dispatch") == names.count("combine") == 2 * 5  # two MoE blocks, five steps
        assert names.count("dispatch.grad") == names.count("combine.grad") == 2 * 5
        assert sum(b for name, b in res["ep2"]["all_to_all"] if name == "dispatch") > 0


def test_ep_activations_and_static_bytes_per_rank_match_the_planner() -> None:
    """``benchmarks/memory_experts.py``'s smallest case (issue 23): the MoE GPT with capacity factor 1.0 (tokens
    dropped, unevenly over the ranks) under ep1 and ep2 on 2 gloo ranks. Per rank, the planner's activations (its
    one-process profile of the layers) are within 15% of what the forward keeps (measured: 0.97-1.02), its backward
    peak within 15% (0.88-0.93: the profile's backward peak errs high), its static bytes within 1% (1.000); the
    experts' static bytes halve under ep2."""
    from argparse import Namespace

    args = Namespace(world=2, layers=2, width=64, seq=64, batch=4, experts=4, capacities=[1.0], plans=["ep1", "ep2"])
    rows = h.benchmark("memory_experts").run(args)
    assert [(r["plan"], r["rank"]) for r in rows] == [("ep1", 0), ("ep1", 1), ("ep2", 0), ("ep2", 1)]
    for r in rows:
        p = r["predicted"]
        assert r["kept"] > 0 and abs(r["kept"] / p["kept"] - 1) <= 0.15, r
        assert abs(r["peak"] / p["peak"] - 1) <= 0.15, r
        assert abs(r["static"] / p["static"] - 1) <= 0.01, r
    assert rows[2]["static"] < 0.6 * rows[0]["static"]


def accumulated_reference(case: dict[str, Any]) -> dict[str, Any]:
    """One process that runs the plan's micro-batches one after the other and accumulates their gradients (Lightning's
    ``accumulate_grad_batches``): a micro-batch ``j`` of the plan is the global batch's ``j``-th ``1 / c`` (each rank
    its share of it, ``pipeline.lane_slice``), so the loader with batch ``B / c`` gives the same micro-batches.
    Lightning records each micro-batch's loss divided by ``c``: a step's loss (their mean) is their sum."""
    c = case["plan"].microbatches
    ref = dict(h.reference_for({**case, "batch": case.get("batch", 16) // c, "accumulate": c}))
    ref["losses"] = torch.tensor(ref["losses"]).view(-1, c).sum(1).tolist()
    ref.pop("train_loss", None)  # the last micro-batch's, not the step's
    return ref


@pytest.mark.parametrize("name", ["ep2_micro2", "ep2_micro2_drops"])
def test_ep2_with_two_micro_batches_matches_one_process_accumulating_them(two: list[dict[str, Any]],
                                                                          name: str) -> None:
    """Two micro-batches per step: the own MoE routes each micro-batch by itself (capacity ``ceil(cf N k / E)`` of
    the micro-batch's ``N`` tokens over both ranks, the auxiliary loss's statistics over them), as Megatron and
    DeepSpeed-MoE do, so the run equals one process that accumulates the same micro-batches (not one process on the
    whole batch: with drops, or through the auxiliary loss, the two differ)."""
    ref = accumulated_reference(CASES2[name])
    h.assert_close_to_reference(two, name, ref)
    if name.endswith("drops"):  # one process on the whole batch drops other tokens (dropless: 1e-5 apart, aux only)
        whole = h.reference_for(CASES2[name])["state"]
        assert max((whole[k] - v).abs().max().item() for k, v in ref["state"].items()) > 1e-4


@pytest.mark.parametrize("name", ["switch_ep2_to_ep1", "switch_ep1_to_ep2"])
def test_a_plan_switch_across_expert_parallel_degrees_keeps_uninterrupted_training(two: list[dict[str, Any]],
                                                                                  name: str) -> None:
    """``rebalance=True``'s in-fit switch (:func:`uniap_lightning.rebalance.switch.switch_plan`) between plans that
    differ in ep: the distributed checkpoint it writes holds the full experts and their momentum (DTensors over the
    ep mesh), the new plan loads its own shards, and the run ends where one uninterrupted process does."""
    h.assert_close_to_reference(two, name, h.reference_for(CASES2[name]))
    ep_after = CASES2[name]["module"]["switch_to"]["ep"]
    for res in two:
        assert res[name]["local_shapes"]["chain.1.moe.w_in"] == (4 // ep_after, 32, 128)


@pytest.mark.parametrize("name", ["resume_ep1", "resume_ep2"])
def test_a_checkpoint_resumes_across_expert_parallel_degrees(two: list[dict[str, Any]], name: str) -> None:
    """Saved at ep=2 (each rank holds 2 of 4 experts) and resumed at ep=1 (every rank all 4), and the reverse:
    the checkpoint holds the full experts and their momentum, so the resumed run ends where one uninterrupted
    process does (the losses after the resume too)."""
    _check_resumed(two, name, CASES2[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resume_dp4", "resume_ep2_zero2"])
def test_a_checkpoint_resumes_across_zero_sharded_experts(four: list[dict[str, Any]], name: str) -> None:
    """Saved with the expert shards ZeRO-3-sharded over the ranks holding the same experts, resumed with every
    expert whole on every rank, and the reverse (into ZeRO-2): the same end as one uninterrupted process."""
    _check_resumed(four, name, ZERO_CKPT[name])


def _check_resumed(results: list[dict[str, Any]], name: str, case: dict[str, Any]) -> None:
    ref = h.reference_for({k: v for k, v in case.items() if k != "resume"})
    for res in results:
        assert "error" not in res[name], res[name].get("traceback")
        assert res[name]["losses"] == pytest.approx(ref["losses"][4:], rel=1e-5)  # the second epoch's four
    merged = h.merge_states(results, name)
    assert sorted(merged) == sorted(ref["state"])
    for k, v in ref["state"].items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_the_consolidated_export_of_an_ep2_run_holds_every_expert(spawned: tuple[list[dict[str, Any]], Path]
                                                                  ) -> None:
    """``save_consolidated`` gathers the expert shards: the file has the full ``[E, ...]`` weights of the run."""
    two, out = spawned
    full = torch.load(out / "ep2_full.pt", weights_only=True)
    merged = h.merge_states(two, "resume_ep2")
    assert full["chain.1.moe.w_in"].shape == (4, 32, 128)
    for k, v in merged.items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=0)


def test_a_single_file_checkpoint_loads_each_ranks_own_experts_under_ep2(spawned: tuple[list[dict[str, Any]], Path]
                                                                         ) -> None:
    """A one-process single-file checkpoint holds the full ``[E, ...]`` experts; under ep=2 rank ``r`` must hold
    experts ``2r, 2r + 1`` of it (not every rank the first block), every other weight whole, and validate as the
    one process did."""
    two, out = spawned
    saved = torch.load(out / "moe_single.ckpt", weights_only=True)["state_dict"]
    expert_keys = [k for k in saved if ".moe.w_" in k or ".moe.b_" in k]
    assert len(expert_keys) == 2 * 4  # two MoE blocks: w_in, b_in, w_out, b_out each
    for r, res in enumerate(two):
        got = res["from_single_file_ep2"]
        assert "error" not in got, got.get("traceback")
        for k in expert_keys:
            assert saved[k].shape[0] == 4 and got["local"][k].shape[0] == 2, k
            torch.testing.assert_close(got["local"][k], saved[k][2 * r:2 * r + 2], rtol=0, atol=0,
                                       msg=lambda m, k=k, r=r: f"rank {r} {k}: {m}")
        for k, v in got["local"].items():
            if k not in expert_keys:
                torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    for res in two:
        assert res["from_single_file_ep2"]["val_loss"] == pytest.approx(
            torch.load(out / "moe_single.ckpt.val_loss.pt"), rel=1e-5)
    assert not torch.equal(two[0]["from_single_file_ep2"]["local"][expert_keys[0]],
                           two[1]["from_single_file_ep2"]["local"][expert_keys[0]])


# ------------------------------------------------------------------------------------------------ 4 processes
CASES4 = {
    # ep groups (0, 1), (2, 3); ranks 0 and 2 (1 and 3) hold the same experts and sum their gradients
    "ep2_dp4": {**_case(_plan({"ep": 2}, world=4)), "module": _memory("ep2_dp4")},
    # one expert per rank: the same-experts group is one rank (no gradient collective for experts)
    "ep4_dp4": {**_case(_plan({"ep": 4}, world=4)), "module": _memory("ep4_dp4")},
    # two pipeline stages of two ranks, one MoE block each, experts split over each stage's two ranks
    "ep2_pp2": _case(_plan({"ep": 2}, world=4, pp=2)),
    # ZeRO on the parts that are not experts: FSDP2 shards attention, norms and router, ignores the expert shards
    # ZeRO: FSDP2 shards attention and norms over the 4 replicas and the expert shards over the 2 ranks holding
    # the same experts (an FSDP2 unit per MoE module; gradients divided by all 4 replicas); the router stays whole
    "ep2_zero3": {**_case(_plan({"ep": 2, "dp_mode": "zero3"}, world=4, edges={"dp_mode": "zero2"})),
                  "module": _memory("ep2_zero3")},
    "ep2_zero2": _case(_plan({"ep": 2, "dp_mode": "zero2"}, world=4)),
    "ep2_zero1": _case(_plan({"ep": 2, "dp_mode": "zero1"}, world=4)),
    "ep4_zero2": _case(_plan({"ep": 4, "dp_mode": "zero2"}, world=4, edges={"dp_mode": "zero1"})),
    # dp 2 x cp 2 (Ulysses) with the experts over 2 or all 4 of the dp x cp replicas (ep groups: consecutive
    # replicas of the layer's replica mesh, as the planner's Strategy.ep says); the embedding and head dp 4
    # (the hidden states and the per-token auxiliary loss re-laid out between (4, 1) and (2, 2))
    **{f"cp2_ep{ep}_dp2": _case(_plan({"dp": 2, "cp": 2, "ep": ep}, world=4, edges={"dp": 4}))
       for ep in (2, 4)},
    # the same with ring attention (load-balanced inside the attention; the experts see contiguous pieces)
    "ring_cp2_ep2_dp2": _case(_plan({"dp": 2, "cp": 2, "cp_method": "ring", "ep": 2}, world=4, edges={"dp": 4})),
    # recomputation: the backward runs the blocks' forward again, all-to-alls included
    "ep2_recompute": _case(_plan({"ep": 2, "recompute": True}, world=4)),
}
#: Mixtral (dropless, no batch statistics: routing per micro-batch is one process's) on 2 stages x 2 ranks with 2
#: micro-batches under 1F1B: the all-to-alls of one micro-batch's backward interleave with another's forward
HF_PP = {**_hf_case("mixtral"),
         "plan": h.make_plan([{"dp": 2}, {"dp": 2, "ep": 2}, {"dp": 2, "ep": 2}, {"dp": 2}], [0, 0, 1, 1], pp=2,
                             microbatches=2, world=4, names=HF_NAMES)}
#: checkpoints between ZeRO-sharded expert shards and whole ones (SGD with momentum)
ZERO_CKPT = {
    "save_ep2_zero3": {"module": MOMENTUM, "data": DATA, "epochs": 1, "save": "z3.ckpt",
                       "plan": _plan({"ep": 2, "dp_mode": "zero3"}, world=4)},
    "resume_dp4": {"module": MOMENTUM, "data": DATA, "epochs": 2, "resume": "z3.ckpt", "plan": _plan({}, world=4)},
    "save_dp4": {"module": MOMENTUM, "data": DATA, "epochs": 1, "save": "dp4.ckpt", "plan": _plan({}, world=4)},
    "resume_ep2_zero2": {"module": MOMENTUM, "data": DATA, "epochs": 2, "resume": "dp4.ckpt",
                         "plan": _plan({"ep": 2, "dp_mode": "zero2"}, world=4)},
}
#: the own MoE (its routing has batch statistics) on 2 stages x 2 ranks with ep=2 and 2 micro-batches under 1F1B,
#: dropless and with drops: per micro-batch routing, against one process accumulating the micro-batches
MICRO4 = {f"ep2_pp2_micro2{tag}": {**_case(_plan({"ep": 2}, world=4, pp=2, microbatches=2)),
                                   "module": {**MODULE, **cfg}}
          for tag, cfg in (("", {}), ("_drops", {"capacity_factor": 0.5}))}
#: Qwen2-MoE with ep=2 x tp=2 in the same layers (dp=2): attention and shared expert tensor-parallel, the stacked
#: experts split over the two ranks of each tensor-parallel index
HF_EP_TP = {**_hf_case("qwen2_moe"),
            "plan": h.make_plan([{"dp": 2, "tp": 2}, {"dp": 2, "tp": 2, "ep": 2}, {"dp": 2, "tp": 2, "ep": 2},
                                 {"dp": 4}], [0, 0, 0, 0], pp=1, microbatches=1, world=4, names=HF_NAMES)}


@pytest.fixture(scope="module")
def spawned4(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    cases = {**CASES4, **ZERO_CKPT, **MICRO4,
             **({"hf_qwen2_moe_ep2_tp2": HF_EP_TP, "hf_mixtral_ep2_pp2": HF_PP} if HAS_HF else {})}
    out = tmp_path_factory.mktemp("expert_plans4")
    return h.spawn(4, cases, out), out


@pytest.fixture(scope="module")
def four(spawned4: tuple[list[dict[str, Any]], Path]) -> list[dict[str, Any]]:
    return spawned4[0]


def _predicted_static_bytes(plan: Any) -> float:
    """The planner's ``static_bytes`` for the two MoE blocks under ``plan`` (fp32 weights and gradients, plain SGD:
    no optimizer state), from a profile of the block's parameter counts."""
    from expert_plan_workers import moe_module

    from uniap_lightning.planner.config import cluster_from
    from uniap_lightning.planner.cost.layer import Pricing, layer_cost
    from uniap_lightning.planner.problem import TrainingConfig
    from uniap_lightning.planner.profile import LayerProfile

    block = moe_module(**NO_DROP).chain[1]
    expert = sum(getattr(block.moe, p).numel() for p in block.moe.uniap_expert_params)
    params = list(block.parameters())
    lp = LayerProfile(name="block", forward_s=1e-3, backward_s=2e-3, params=sum(p.numel() for p in params),
                      activation_bytes=0.0, output_bytes=0.0, param_tensors=len(params), experts=4, top_k=2,
                      expert_params=expert)
    st = plan.layers[1].strategy
    training = TrainingConfig(global_batch_size=plan.global_batch_size, optimizer_bytes=0)
    cost = layer_cost(lp, st, Pricing(plan.global_batch_size, plan.num_devices), cluster=cluster_from("local_cpu"),
                      training=training)
    return 2 * cost.static_bytes


def _check_memory(out: Path, tag: str, plan: Any, world: int) -> list[float]:
    predicted = _predicted_static_bytes(plan)
    ratios = [torch.load(out / f"memory_{tag}_rank{r}.pt", weights_only=True) / predicted for r in range(world)]
    assert all(abs(r - 1) < 0.05 for r in ratios), (tag, ratios)  # the issue asks 15%; the router alone differs
    return ratios


def test_ep2_memory_per_rank_equals_the_planners(spawned: tuple[list[dict[str, Any]], Path]) -> None:
    """The bytes each rank holds for the MoE blocks after training (parameters, gradients, bucket slots; live
    tensors) equal the planner's ``static_bytes`` for ep=2: the expert shards count once per rank, whole."""
    assert _check_memory(spawned[1], "ep2", EP2, 2) == pytest.approx([1.0, 1.0], abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["ep2_dp4", "ep4_dp4", "ep2_zero3"])
def test_four_process_ep_memory_per_rank_matches_the_planners(spawned4: tuple[list[dict[str, Any]], Path],
                                                              tag: str) -> None:
    """ep2 x dp4 (expert buckets over the same-experts pairs), ep4 (no expert bucket: one rank holds each shard),
    ep2 with ZeRO-3 (expert shards sharded over the same-experts pairs): the first two equal the planner's, ZeRO-3
    is 1.7% above (the router, whole next to the experts' FSDP2 unit, which the planner shards over the replicas)."""
    _check_memory(spawned4[1], tag, CASES4[tag]["plan"], 4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES4))
def test_expert_parallel_mixes_on_four_processes_match_one_process(four: list[dict[str, Any]], name: str) -> None:
    """ep with dp=4 (two same-experts pairs, or ep=4), with dp 2 x cp 2 (Ulysses), with pp=2, with ZeRO-1/2/3 on the
    rest, with recomputation."""
    h.assert_close_to_reference(four, name, h.reference_for(CASES4[name]))
    st = CASES4[name]["plan"].layers[1].strategy
    zero = st.dp_mode != "replicate"
    for res in four:
        shapes = res[name]["local_shapes"]
        w_in = shapes.get("chain.1.moe.w_in", shapes.get("chain.2.moe.w_in"))
        assert w_in == (4 // st.ep // (st.replicas // st.ep if zero else 1), 32, 128)  # ZeRO: over the same-experts
        if zero and "chain.1.moe.router.weight" in shapes:
            assert shapes["chain.1.q.weight"] == (32 // 4, 32)  # attention: over the 4 replicas
            # the router: whole next to an experts' FSDP2 unit (FSDP2 leaves a nested unit's subtree alone)
            assert shapes["chain.1.moe.router.weight"] == ((4, 32) if st.replicas > st.ep else (1, 32))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MICRO4))
def test_ep2_over_two_pipeline_stages_with_two_micro_batches_matches_one_process_accumulating_them(
        four: list[dict[str, Any]], name: str) -> None:
    """pp=2 x dp=2, ep=2 in each stage's MoE block, 2 micro-batches (1F1B: one micro-batch's all-to-alls interleave
    with the other's): each micro-batch routed on its own, as one process accumulating them (see the 2-rank test)."""
    h.assert_close_to_reference(four, name, accumulated_reference(MICRO4[name]))


# ------------------------------------------------------------------------------------------------ Hugging Face
HF_SLOW = {**{f"hf_{family}": _hf_case(family) for family in ("qwen2_moe", "olmoe")},  # the same path as Mixtral's
           **HF_ROUTER_SLOW}


@pytest.fixture(scope="module")
def hf_two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return h.spawn(2, HF_SLOW, tmp_path_factory.mktemp("expert_plans_hf"))


def _check_hf(results: list[dict[str, Any]], name: str, case: dict[str, Any]) -> None:
    h.assert_close_to_reference(results, name, h.reference_for(case))
    for res in results:
        shapes = res[name]["local_shapes"]
        assert shapes["model.model.layers.0.mlp.experts.gate_up_proj"][0] == 2
        assert shapes["model.model.layers.1.mlp.experts.down_proj"][0] == 2


@pytest.mark.skipif(not HAS_HF, reason="needs the [hf] extra (transformers)")
def test_hugging_face_mixtral_with_ep2_matches_one_process(two: list[dict[str, Any]]) -> None:
    """Zero glue: ``self.model(**batch).loss`` of a tiny Mixtral under a pinned ep=2 plan (its stacked
    ``mlp.experts`` split 2 + 2, padded batches) ends where one process does."""
    _check_hf(two, "hf_mixtral", CASES2["hf_mixtral"])


@pytest.mark.skipif(not HAS_HF, reason="needs the [hf] extra (transformers)")
def test_mixtral_trained_with_ep2_exports_a_hugging_face_folder_with_every_expert(
        spawned: tuple[list[dict[str, Any]], Path]) -> None:
    """``save_consolidated(format="hf")`` after the ep=2 run: ``MixtralForCausalLM.from_pretrained`` loads all 4
    experts of each layer, equal to the trained ones."""
    from transformers import MixtralForCausalLM

    two, out = spawned
    model = MixtralForCausalLM.from_pretrained(out / "mixtral_hf")
    merged = h.merge_states(two, "hf_mixtral")
    loaded = model.state_dict()
    assert loaded["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    for k, v in merged.items():
        torch.testing.assert_close(loaded[k.removeprefix("model.")], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_HF, reason="needs the [hf] extra (transformers)")
@pytest.mark.parametrize("name", [n for n in HF_SLOW if n not in HF_ROUTER_SLOW])
def test_hugging_face_moe_with_ep2_matches_one_process(hf_two: list[dict[str, Any]], name: str) -> None:
    """Qwen2-MoE (with its replicated shared expert) and OLMoE, as Mixtral above."""
    _check_hf(hf_two, name, HF_SLOW[name])


def _check_router(results: list[dict[str, Any]], name: str, case: dict[str, Any]) -> None:
    h.assert_close_to_reference(results, name, h.reference_for(case))
    if case["plan"].layers[1].strategy.ep == 2:
        for res in results:
            assert res[name]["local_shapes"]["model.model.layers.0.mlp.experts.gate_up_proj"][0] == 2


@pytest.mark.skipif(not HAS_HF, reason="needs the [hf] extra (transformers)")
@pytest.mark.parametrize("name", list(HF_ROUTER))
def test_hugging_face_moe_with_its_router_loss_matches_one_process(two: list[dict[str, Any]], name: str) -> None:
    """``output_router_logits=True`` (``.loss`` = cross-entropy + ``router_aux_loss_coef`` x the load-balancing loss,
    pooled over the layers and the batch's real tokens): Mixtral with ep=2, Qwen2-MoE with ep=1 over 2 data ranks
    (the routers' statistics summed over both), OLMoE over 2 pipeline stages (the per-sample statistics cross the
    boundary with their gradient) end where one process does, loss and weights within 1e-5."""
    _check_router(two, name, HF_ROUTER[name])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_HF, reason="needs the [hf] extra (transformers)")
@pytest.mark.parametrize("name", list(HF_ROUTER_SLOW))
def test_hugging_face_moe_with_its_router_loss_more(hf_two: list[dict[str, Any]], name: str) -> None:
    """The other (family, ep) pairs of the test above (every family with ep=2 and with ep=1), tensor-parallel
    blocks and ZeRO-3."""
    _check_router(hf_two, name, HF_SLOW[name])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_HF, reason="needs the [hf] extra (transformers)")
def test_qwen2_moe_with_ep_and_tp_in_the_same_layers_matches_one_process(four: list[dict[str, Any]]) -> None:
    """ep=2 x tp=2 x dp=2 on four processes: the attention and the shared expert are tensor-parallel (DTensor
    shards), the routed experts split over the ep ranks of each tensor-parallel index (both tp ranks of an ep rank
    hold the same experts and see the same tokens)."""
    _check_hf(four, "hf_qwen2_moe_ep2_tp2", HF_EP_TP)
    for res in four:
        assert res["hf_qwen2_moe_ep2_tp2"]["local_shapes"]["model.model.layers.0.self_attn.q_proj.weight"] == (16, 32)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_HF, reason="needs the [hf] extra (transformers)")
def test_mixtral_with_ep_over_two_pipeline_stages_and_micro_batches_matches_one_process(
        four: list[dict[str, Any]]) -> None:
    """pp=2 x dp=2 with ep=2 in each stage's MoE block, 2 micro-batches (1F1B): Hugging Face routing has no batch
    statistics (dropless, no auxiliary loss in ``.loss`` by default), so micro-batching keeps one process's result."""
    h.assert_close_to_reference(four, "hf_mixtral_ep2_pp2", h.reference_for(HF_PP))



# ------------------------------------------------------------------------------------------------ router loss
@pytest.mark.skipif(not HAS_HF, reason="needs the [hf] extra (transformers)")
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_the_generic_split_rebuilds_the_router_loss_of_hugging_face_moe(family: str) -> None:
    """One process, a padded batch: the chain's loss (cross-entropy + ``router_aux_loss_coef`` x the load-balancing
    loss, rebuilt from per-sample statistics carried through the blocks) is the model's own ``.loss``, with the same
    gradients, the routers' included; cut into two micro-batches, each one's loss is the model's own on it (Hugging
    Face pools the term per forward call). Transformers 4.57's Qwen2-MoE and OLMoE, which the generic split trains
    as one layer, are refused with the reason (one layer sees no router statistics)."""
    import transformers
    from expert_parallel_helpers import ROUTER_COEF, hf_model
    from hf_models import HFModule, hf_batches

    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.runtime.payload import call_layer, chunk

    model = hf_model(family, router_loss=True)
    batch = next(iter(hf_batches(8, "llama")))
    out = model(**batch)
    assert ROUTER_COEF * float(out.aux_loss.detach()) > 1.0  # the term weighs in the loss and its gradients
    out.loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    if family != "mixtral" and int(transformers.__version__.split(".")[0]) < 5:
        with pytest.raises(UniAPError, match="the one-layer fallback cannot rebuild"):
            extract_chain(HFModule(model))
        return
    chain = extract_chain(HFModule(model))
    x, y = chain.split_batch(batch)
    for layer in chain.layers:
        x = call_layer(layer, x)
    loss = chain.loss_fn(x, y)
    loss.backward()
    torch.testing.assert_close(loss, out.loss, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-6, msg=n)
    with torch.no_grad():
        x, y = chain.split_batch(batch)
        for xm, ym, lo in zip(chunk(x, 2), chunk(y, 2), (0, 4)):
            for layer in chain.layers:
                xm = call_layer(layer, xm)
            half = {k: v[lo:lo + 4] for k, v in batch.items()}
            own = model(**half)
            scale = (half["labels"][:, 1:] != -100).sum() / (batch["labels"][:, 1:] != -100).sum() * 2
            ce = own.loss - ROUTER_COEF * own.aux_loss  # the whole batch's normalization for the cross-entropy
            torch.testing.assert_close(chain.loss_fn(xm, ym), ce * scale + ROUTER_COEF * own.aux_loss, rtol=1e-6,
                                       atol=1e-6)


@pytest.mark.skipif(not HAS_HF, reason="needs the [hf] extra (transformers)")
def test_a_loss_term_the_split_cannot_rebuild_is_refused_with_that_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family whose load-balancing loss differs from the pooled top-k formula (here: Mixtral's, doubled), or a
    model adding an auxiliary term the split does not recognize, is refused at setup naming the extra term, not as
    "its own loss is not the causal LM cross-entropy"."""
    import transformers.models.mixtral.modeling_mixtral as mixtral
    from expert_plan_workers import hf_moe_module

    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.adapters.families import generic
    from uniap_lightning.errors import UniAPError

    original = mixtral.load_balancing_loss_func
    monkeypatch.setattr(mixtral, "load_balancing_loss_func", lambda *a, **k: 2 * original(*a, **k))
    with pytest.raises(UniAPError, match=r"its loss adds a term the split cannot rebuild: its own loss \(.*\) is not "
                                         r"the causal LM cross-entropy \(.*\) \+ router_aux_loss_coef x the pooled"):
        extract_chain(hf_moe_module("mixtral", router_loss=True))
    monkeypatch.undo()
    monkeypatch.setattr(generic, "router_loss_of", lambda model: None)  # a term the split does not look for
    with pytest.raises(UniAPError, match=r"its loss adds a term the split cannot rebuild: its own loss \(.*\) is the "
                                         r"causal LM cross-entropy \(.*\) \+ .*aux_loss="):
        extract_chain(hf_moe_module("mixtral", router_loss=True))
