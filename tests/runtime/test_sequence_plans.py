"""Plans with context parallelism (Ulysses, ``cp``) and sequence parallelism (``sp``) run under
``Trainer(strategy="uniap")``: 5 SGD steps match one process (loss and every parameter within 1e-5).

Cases are pinned plans (``make_plan`` with dict strategies) over the plain GPT chain and the Hugging Face Llama
chain (``uniap_rt_helpers.make_lm_module``), and Hugging Face BERT as users train it (``hf_models``: the model's own
loss on padded dict batches); the 2-rank cases share one spawn, the 4-rank ones another (the heavier ones slow).
"""

from __future__ import annotations

from typing import Any

import pytest

import uniap_rt_helpers as h

NAMES = ["chain.0", "chain.1", "chain.2", "chain.3"]  # embedding, block, block, norm + head
CP2 = {"cp": 2}
ONE = {"dp": 2}  # cp 1 on two ranks: the batch over both


def _plan(strategies: list[Any], stages: list[int] | None = None, *, pp: int = 1, microbatches: int = 1,
          world: int = 2, batch: int = 16) -> Any:
    return h.make_plan(strategies, stages or [0] * 4, pp=pp, microbatches=microbatches, world=world, names=NAMES,
                       batch=batch)


def padded_lm_data(batch_size: int, n: int = 64, seed: int = 1) -> Any:
    """Token ids with the last 3 labels of every sample -100 (padding the loss ignores): the second half of each
    sequence holds more ignored tokens than the first."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, h.VOCAB, (n, h.SEQ), generator=g)
    labels = ids.clone()
    labels[:, -3:] = -100
    return DataLoader(TensorDataset(ids, labels), batch_size=batch_size, drop_last=True)


def gpt_loss_on_pieces() -> Any:
    """The plain GPT (``make_lm_module("gpt")``'s) whose loss declares its next-token form
    (``uniap_sequence_loss``), so the strategy computes it on each cp rank's sequence piece
    (``sequence.piece_loss``) instead of gathering the logits."""
    import torch

    from uniap_lightning.adapters import CausalLMModule
    from uniap_lightning.adapters.gpt import GPT, GPTConfig

    class PiecesLM(CausalLMModule):
        def uniap_loss(self, logits: Any, labels: Any) -> Any:
            return super().uniap_loss(logits, labels)

        uniap_loss.uniap_sequence_loss = "next_token"  # type: ignore[attr-defined]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    return PiecesLM(GPT(GPTConfig(vocab_size=h.VOCAB, block_size=h.SEQ, n_layer=2, n_head=4, n_embd=32)).layers())


GPT = {"module": {"lm": "gpt"}}
#: the GPT whose next-token loss runs on the sequence pieces, on padded LM data
GPT_PIECES = {"module": {"factory": "test_sequence_plans:gpt_loss_on_pieces"},
              "data": {"factory": "test_sequence_plans:padded_lm_data"}}
#: BERT's chain (``hf_models``): embedding, two encoder blocks, the head; right-padded batches (attention-mask zeros)
BERT_NAMES = ["model.bert.embeddings", "model.bert.encoder.layer.0", "model.bert.encoder.layer.1"]


def bert(family: str, strategies: list[Any], stages: list[int] | None = None, *, world: int = 2,
         **kw: Any) -> dict[str, Any]:
    head = {"bert_mlm": "model.cls", "bert_tc": "model.classifier", "bert_qa": "model.qa_outputs"}.get(
        family, "model.bert.pooler")
    stages = stages or [0] * 4
    plan = h.make_plan(strategies, stages, pp=max(stages) + 1, microbatches=kw.pop("microbatches", 1), world=world,
                       names=[*BERT_NAMES, head])
    return {"plan": plan, "module": {"factory": "hf_models:hf_module", "family": family},
            "data": {"factory": "hf_models:hf_batches", "family": family}, **kw}


#: GPT-2 and Llama as users train them (``hf_models``: ``self.model(**batch).loss``, right-padded batches): embedding,
#: two decoder blocks, the final norm + LM head
DECODER_NAMES = {"gpt2": ["transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.ln_f"],
                 "llama": ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]}


def decoder(family: str, strategies: list[Any], stages: list[int] | None = None, *, world: int = 2,
            **kw: Any) -> dict[str, Any]:
    names = DECODER_NAMES[family.split("_")[0]]
    stages = stages or [0] * 4
    plan = h.make_plan(strategies, stages, pp=max(stages) + 1, microbatches=kw.pop("microbatches", 1), world=world,
                       names=[f"model.{n}" for n in names])
    return {"plan": plan, "module": {"factory": "hf_models:hf_module", "family": family},
            "data": {"factory": "hf_models:hf_batches", "family": family}, **kw}


CP_SP = _plan([CP2, {"tp": 2, "sp": True}, CP2, CP2], microbatches=2)  # cp, then tp + sp, then cp again
PLAIN = _plan([ONE] * 4)
RING2 = {"cp": 2, "cp_method": "ring"}
RING = _plan([RING2] * 4)

TWO_RANKS = {
    "gpt_cp2": {"module": {"lm": "gpt"}, "plan": _plan([CP2] * 4)},
    "gpt_tp2_sp": {"module": {"lm": "gpt"}, "plan": _plan([{"tp": 2}, {"tp": 2, "sp": True}, {"tp": 2, "sp": True},
                                                           {"tp": 2}])},
    "gpt_cp2_padded": {"module": {"lm": "gpt"}, "plan": _plan([CP2] * 4),
                       "data": {"factory": "test_sequence_plans:padded_lm_data"}},
    # the next-token loss on each rank's sequence half (labels shifted over whole sequences first), validation too
    "gpt_cp2_loss_on_pieces": {**GPT_PIECES, "plan": _plan([ONE, CP2, CP2, CP2], microbatches=2),
                               "limit_val_batches": 2},
    "gpt_cp2_next_to_dp2": {"module": {"lm": "gpt"}, "plan": _plan([ONE, CP2, ONE, CP2], microbatches=2)},
    "gpt_cp2_zero3_rc": {**GPT, "plan": _plan([{"cp": 2, "dp_mode": "zero3", "recompute": True}] * 4)},
    "gpt_cp2_zero2_rc": {**GPT, "plan": _plan([{"cp": 2, "dp_mode": "zero2", "recompute": True}, CP2] * 2,
                                              microbatches=2)},
    "llama_cp2": {"module": {"lm": "llama"}, "plan": _plan([CP2] * 4)},
    # one sample per micro-batch on two ranks (what makes cp worth it): both lanes hold the sample at the edges
    "gpt_cp2_one_sample": {**GPT, "batch": 2, "plan": _plan([CP2, {"tp": 2}, CP2, {"tp": 2}], microbatches=2,
                                                            batch=2)},
    "validate_cp2_one_sample": {**GPT, "batch": 2, "plan": _plan([CP2, {"tp": 2}, CP2, {"tp": 2}], microbatches=2,
                                                                 batch=2), "validate_only": True,
                                "limit_val_batches": 3},
    "gpt2_cp2": {"module": {"lm": "gpt2"}, "plan": _plan([CP2, ONE, CP2, CP2], microbatches=2)},
    # BERT pretraining (the decoder tied to the word embeddings): bidirectional Ulysses with the padding mask
    # gathered over the cp ranks, global absolute positions
    # the MLM head on sequence halves too: its loss on the pieces (sequence.piece_loss), validation as well
    "bert_mlm_cp2": bert("bert_mlm", [CP2] * 4, limit_val_batches=2),
    # ZeRO-3 and recomputation on the cp blocks (the recomputed forward sets the padding mask again), ZeRO-2 head
    "bert_mlm_cp2_zero3_rc": bert("bert_mlm", [CP2, {"cp": 2, "dp_mode": "zero3", "recompute": True},
                                               {"cp": 2, "dp_mode": "zero3", "recompute": True},
                                               {"cp": 2, "dp_mode": "zero2"}], microbatches=2),
    # post-norm sequence parallelism in the blocks, the vocabulary-parallel embedding, the head over the batch
    "bert_mlm_tp2_sp": bert("bert_mlm", [{"tp": 2}, {"tp": 2, "sp": True}, {"tp": 2, "sp": True}, ONE],
                            microbatches=2),
    # checkpoints: saved under cp/sp, resumed without them, and the other way round
    "save_cp_sp": {**GPT, "plan": CP_SP, "epochs": 1, "save": "cp_sp.ckpt"},
    "save_plain": {**GPT, "plan": PLAIN, "epochs": 1, "save": "plain.ckpt"},
    "resume_cp_sp_as_plain": {**GPT, "plan": PLAIN, "epochs": 2, "resume": "cp_sp.ckpt"},
    "resume_plain_as_cp_sp": {**GPT, "plan": CP_SP, "epochs": 2, "resume": "plain.ckpt"},
    # no plan: the measured profile declares the sequence; one sample per step on one stage of two ranks leaves
    # GPT-2's blocks (no tensor-parallel plan) nothing but cp 2 (the embedding and head may take tp 2 instead)
    "solved_one_sample": {"module": {"lm": "gpt2"}, "batch": 1,
                          "strategy": {"cache_dir": "uniap_cache", "profile_repeats": 1, "pp": 1,
                                       "measure_cluster": False}},
    # ring attention (runtime/ring.py): GPT on labels with padding, Llama (grouped-query k/v passed compact), BERT
    # (bidirectional, the key padding mask, right-padded batches), ring next to dp 2
    "gpt_cp2_ring_padded": {**GPT, "plan": RING, "data": {"factory": "test_sequence_plans:padded_lm_data"}},
    "llama_cp2_ring": {"module": {"lm": "llama"}, "plan": _plan([RING2, RING2, ONE, RING2], microbatches=2)},
    "bert_mlm_cp2_ring": bert("bert_mlm", [RING2] * 4),
    # GPT-2 and Llama through the zero-glue path (the model's own causal loss on the gathered logits): Ulysses cp
    # (global learned / rotary positions, grouped-query k/v), ring next to dp 2, Llama's blocks with tp 2 + sp
    "hf_gpt2_cp2": decoder("gpt2", [CP2] * 4),
    "hf_llama_cp2": decoder("llama", [CP2, CP2, CP2, ONE], microbatches=2),
    "hf_llama_ring_next_to_dp2": decoder("llama", [ONE, RING2, RING2, RING2], microbatches=2),
    "hf_llama_tp2_sp": decoder("llama", [{"tp": 2}, {"tp": 2, "sp": True}, {"tp": 2, "sp": True}, ONE],
                               microbatches=2),
    # left padding (rows whose first keys are all padding, on one cp rank's whole piece): Llama with Ulysses and
    # with ring, BERT's masked LM with Ulysses
    "hf_llama_cp2_left_padded": {**decoder("llama", [CP2] * 4),
                                 "data": {"factory": "hf_models:hf_batches", "family": "llama", "left": True}},
    "hf_llama_ring_left_padded": {**decoder("llama", [RING2] * 4),
                                  "data": {"factory": "hf_models:hf_batches", "family": "llama", "left": True}},
    "bert_mlm_cp2_left_padded": {**bert("bert_mlm", [CP2] * 4),
                                 "data": {"factory": "hf_models:hf_batches", "family": "bert_mlm", "left": True}},
    # zero-glue Llama: a checkpoint taken under cp 2 resumes under dp 2
    "save_hf_llama_cp2": decoder("llama", [CP2] * 4, epochs=1, save="hf_llama_cp2.ckpt"),
    "resume_hf_llama_cp2_as_dp2": decoder("llama", [ONE] * 4, epochs=2, resume="hf_llama_cp2.ckpt"),
}
PARITY = [k for k in TWO_RANKS if not k.startswith(("save_", "resume_", "ring_", "solved_", "validate_"))]


@pytest.mark.parametrize("name", PARITY)
def test_two_ranks_match_one_process(spawn_cases: Any, name: str) -> None:
    results = spawn_cases(2, TWO_RANKS, "sequence_plans2")
    h.assert_close_to_reference(results, name, h.reference_for(TWO_RANKS[name]))


def test_validation_loss_under_cp_matches_one_process(spawn_cases: Any) -> None:
    import lightning.pytorch as pl

    results = spawn_cases(2, TWO_RANKS, "sequence_plans2")
    case = TWO_RANKS["validate_cp2_one_sample"]
    trainer = pl.Trainer(devices=1, **h.trainer_kwargs(case))
    ref = trainer.validate(h.make_module(**case["module"]), h.make_data(2, lm=True))[0]["val_loss"]
    for res in results:
        assert "error" not in res["validate_cp2_one_sample"], res["validate_cp2_one_sample"].get("traceback")
        assert res["validate_cp2_one_sample"]["val_loss"] == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("name", ["bert_mlm_cp2", "gpt_cp2_loss_on_pieces"])
def test_validation_loss_on_sequence_pieces_matches_one_process(spawn_cases: Any, name: str) -> None:
    results = spawn_cases(2, TWO_RANKS, "sequence_plans2")
    ref = h.reference_for(TWO_RANKS[name])
    for res in results:
        assert "error" not in res[name], res[name].get("traceback")
        assert res[name]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)


@pytest.mark.parametrize("name", ["resume_cp_sp_as_plain", "resume_plain_as_cp_sp", "resume_hf_llama_cp2_as_dp2"])
def test_checkpoint_resumes_across_sequence_plans(spawn_cases: Any, name: str) -> None:
    """A checkpoint of the first epoch resumed under the other plan ends where one process ends after two."""
    import torch

    results = spawn_cases(2, TWO_RANKS, "sequence_plans2")
    case = TWO_RANKS[name]
    ref = h.reference({"module": case["module"], **({"data": case["data"]} if "data" in case else {}), "epochs": 2})
    second = ref["losses"][len(ref["losses"]) // 2:]  # the second epoch's steps
    for r, res in enumerate(results):
        assert "error" not in res[name], (r, res[name].get("traceback"))
        torch.testing.assert_close(torch.tensor(res[name]["losses"]), torch.tensor(second), rtol=1e-5, atol=1e-7)
    merged = h.merge_states(results, name)
    assert set(merged) == set(ref["state"])
    for k, v in ref["state"].items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_the_search_picks_cp_and_the_plan_runs(spawn_cases: Any) -> None:
    """Trainer(strategy="uniap") without a plan: profile -> search -> a cp plan -> one process's results (the CPU
    cluster offers ring attention too; the search picks it for GPT-2's blocks today)."""
    results = spawn_cases(2, TWO_RANKS, "sequence_plans2")
    case = TWO_RANKS["solved_one_sample"]
    h.assert_close_to_reference(results, "solved_one_sample", h.reference_for(case))
    layers = results[0]["solved_one_sample"]["plan"]["layers"]
    assert all(lp["cp"] == 2 and lp["cp_method"] in ("ulysses", "ring") for lp in layers[1:3]), layers


@pytest.mark.parametrize("ring", [True, False])
def test_the_runtime_search_offers_ring_attention_as_the_cluster_says(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                                      ring: bool) -> None:
    """Ring attention runs on any device: the measured CPU cluster offers it, a cluster that turns it off not."""
    import dataclasses

    import uniap_lightning.planner.solver as solver
    from uniap_lightning.planner.problem import TrainingConfig
    from uniap_lightning.planner.profile import LayerProfile, ModelProfile
    from uniap_lightning.runtime.planning import local_cluster, solve_plan

    seen = []

    def fake_solve(problem: Any, **kw: Any) -> Any:
        seen.append(problem.cluster.ring_attention)
        raise RuntimeError("stop")

    monkeypatch.setattr(solver, "solve", fake_solve)
    cluster = local_cluster(nodes=1, devices_per_node=2, device_type="cpu")
    assert cluster.ring_attention
    cluster = dataclasses.replace(cluster, ring_attention=ring)
    layer = LayerProfile(name="a", forward_s=1e-3, backward_s=2e-3, params=10, activation_bytes=1.0, output_bytes=1.0,
                         sequence_length=8, attention_heads=3)
    with pytest.raises(RuntimeError, match="stop"):
        solve_plan(profile=ModelProfile(model="m", layers=[layer]), cluster=cluster,
                   training=TrainingConfig(global_batch_size=2), solver="highs", time_limit_s=5, cache_dir=tmp_path)
    assert seen == [ring]


def test_heads_not_divisible_is_refused_before_any_collective() -> None:
    """cp=2 over a GPT with 3 heads: one line naming the numbers, from the checks every rank runs alike."""
    from uniap_lightning.adapters import CausalLMModule, extract_chain
    from uniap_lightning.adapters.gpt import GPT, GPTConfig
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.runtime import check_plan_executable

    module = CausalLMModule(GPT(GPTConfig(vocab_size=h.VOCAB, block_size=h.SEQ, n_head=3, n_embd=24)).layers())
    chain = extract_chain(module)
    with pytest.raises(UniAPError, match=r"chain.1.*\(3 heads / tp=1 = 3\) divisible by cp=2; choose cp in \[1, 3\]"):
        check_plan_executable(_plan([CP2] * 4), chain)
    with pytest.raises(UniAPError, match="sp=true needs a sequence-parallel tensor-parallel plan"):
        check_plan_executable(_plan([{"tp": 2, "sp": True}] + [{"tp": 2}] * 3), chain)


def test_sequence_length_the_plan_cannot_split_is_refused() -> None:
    import torch

    from uniap_lightning.errors import UniAPError
    from uniap_lightning.runtime.sequence import check_sequence_length, sequence_multiple

    plan = _plan4([{"cp": 2, "tp": 2, "sp": True}, {"dp": 4}, {"cp": 4}, {"cp": 2, "tp": 2}])
    assert sequence_multiple(plan) == 4
    check_sequence_length(plan, torch.zeros(8, 12, dtype=torch.long))
    with pytest.raises(UniAPError, match="sequence length 6 is not divisible by 4.*pad sequences to a multiple of 4"):
        check_sequence_length(plan, torch.zeros(8, 6, dtype=torch.long))


def _plan4(strategies: list[Any], stages: list[int] | None = None, **kw: Any) -> Any:
    return _plan(strategies, stages, world=4, **kw)


FOUR_RANKS = {
    "dp2_cp2": {**GPT, "plan": _plan4([{"dp": 2, "cp": 2}] * 4)},
    # two samples per micro-batch on four ranks: the edges hold one sample per pair of lanes
    "dp2_cp2_two_samples": {**GPT, "batch": 4, "plan": _plan4([{"dp": 2, "cp": 2}, {"dp": 2, "tp": 2},
                                                               {"cp": 4}, {"dp": 2, "cp": 2}], microbatches=2,
                                                              batch=4)},
    "cp2_pp2": {**GPT, "plan": _plan4([CP2] * 4, [0, 0, 1, 1], pp=2, microbatches=2)},
    # one sample per micro-batch on two stages of 2 lanes (issue 39): both lanes of a stage hold the sample at its
    # boundaries; cp 2 and tp 2 layers share it
    "cp2_tp2_pp2_one_sample": {**GPT, "batch": 2, "plan": _plan4([CP2, {"tp": 2}, CP2, {"tp": 2}], [0, 0, 1, 1], pp=2,
                                                                 microbatches=2, batch=2)},
}
FOUR_RANKS_SLOW = {
    # (no sequence split) a vocabulary-parallel embedding replicated over dp: DTensor's replicated gradient is kept
    # as the weight's shard (tensor_parallel.grads_like_params)
    "dp2_tp2": {**GPT, "plan": _plan4([{"dp": 2, "tp": 2}] * 4)},
    "cp2_tp2_sp": {**GPT, "plan": _plan4([{"cp": 2, "tp": 2}, {"cp": 2, "tp": 2, "sp": True},
                                          {"cp": 2, "tp": 2, "sp": True}, {"cp": 2, "tp": 2}])},
    # layouts (1, 2, 2) and (2, 2, 1) order the sequence pieces differently: the relayout gathers whole sequences
    "cp2_tp2_next_to_dp2_cp2": {**GPT, "plan": _plan4([{"dp": 2, "cp": 2}, {"cp": 2, "tp": 2, "sp": True},
                                                       {"dp": 4}, {"cp": 4}], microbatches=2)},
    # (1, 4, 1) <-> (1, 2, 2): quarters gathered into halves on their lanes, halves cut into quarters (K = (1, 2))
    "cp4_next_to_cp2_tp2": {**GPT, "plan": _plan4([{"cp": 4}, {"cp": 2, "tp": 2}, {"cp": 4}, {"cp": 2, "tp": 2}])},
    "dp2_cp2_zero3_rc": {**GPT, "plan": _plan4([{"dp": 2, "cp": 2, "dp_mode": "zero3", "recompute": True}] * 4)},
    "cp2_tp2_zero2_rc": {**GPT, "plan": _plan4([{"cp": 2, "tp": 2, "dp_mode": "zero2", "recompute": True}] * 4)},
    "llama_dp2_cp2_pp": {"module": {"lm": "llama"}, "plan": _plan4([{"dp": 1, "cp": 2}] * 4, [0, 1, 1, 1], pp=2,
                                                                   microbatches=2)},
    # the next-token loss on pieces: the head dp 2 x cp 2, and tp 2 lanes holding the same piece (cp 2 x tp 2)
    "gpt_dp2_cp2_loss_on_pieces": {**GPT_PIECES, "plan": _plan4([{"dp": 2, "cp": 2}] * 4, microbatches=2)},
    "gpt_cp2_tp2_loss_on_pieces": {**GPT_PIECES, "plan": _plan4([{"cp": 2, "tp": 2}] * 4)},
    "bert_mlm_dp2_cp2": bert("bert_mlm", [{"dp": 2, "cp": 2}] * 4, world=4),
    # Ulysses over the heads each TP rank holds (4 heads / tp 2 / cp 2), sequence pieces cut again by sp
    "bert_mlm_cp2_tp2_sp": bert("bert_mlm", [{"cp": 2, "tp": 2}, {"cp": 2, "tp": 2, "sp": True},
                                             {"cp": 2, "tp": 2, "sp": True}, {"cp": 2, "dp": 2}], world=4),
    # two pipeline stages of cp2 lanes: the last stage's loss on its pieces under the 1F1B schedule
    "bert_mlm_cp2_pp2": bert("bert_mlm", [{"dp": 1, "cp": 2}] * 4, [0, 0, 1, 1], world=4, microbatches=2),
    # token classification on sequence quarters (the head too; its logits gathered into whole sequences)
    "bert_tc_cp4": bert("bert_tc", [{"cp": 4}] * 4, world=4),
    # question answering: a token-wise head on sequence halves, its loss (start / end positions) on whole sequences
    "bert_qa_dp2_cp2": bert("bert_qa", [{"dp": 2, "cp": 2}] * 4, world=4),
    # sequence classification pools the first token: the head (no sequence declaration) gets whole sequences
    "bert_sc_dp2_cp2": bert("bert", [{"dp": 2, "cp": 2}] * 3 + [{"dp": 4}], world=4),
    # ring attention: dp 2 x cp 2, and cp 2 x tp 2 (ring over the heads each TP rank holds)
    "gpt_ring_dp2_cp2": {**GPT, "plan": _plan4([{"dp": 2, **RING2}] * 4)},
    "gpt_ring_cp2_tp2": {**GPT, "plan": _plan4([{"tp": 2, **RING2}] * 4)},
    # sequence parallelism in the blocks, ring over the pieces' heads; BERT (bidirectional, padding) next to dp 2
    "gpt_ring_cp2_tp2_sp": {**GPT, "plan": _plan4([{"tp": 2, **RING2}, {"tp": 2, "sp": True, **RING2},
                                                   {"tp": 2, "sp": True, **RING2}, {"tp": 2, **RING2}])},
    "bert_mlm_ring_dp2_cp2": bert("bert_mlm", [{"dp": 2, **RING2}] * 4, world=4),
    # ZeRO-3 and recomputation (the recomputed forward runs the ring again), two pipeline stages of ring lanes
    "gpt_ring_dp2_cp2_zero3_rc": {**GPT, "plan": _plan4([{"dp": 2, **RING2, "dp_mode": "zero3", "recompute": True}]
                                                        * 4)},
    "gpt_ring_cp2_pp2": {**GPT, "plan": _plan4([RING2] * 4, [0, 0, 1, 1], pp=2, microbatches=2)},
    # GPT-2 and Llama through the zero-glue path: dp 2 x cp 2; Llama's blocks cp 2 x tp 2 + sp; two pipeline stages
    # of cp 2 lanes with ZeRO-3 and recomputation; a token classifier (its head on whole sequences) next to cp 2
    "hf_gpt2_dp2_cp2": decoder("gpt2", [{"dp": 2, "cp": 2}] * 4, world=4),
    "hf_llama_cp2_tp2_sp": decoder("llama", [{"cp": 2, "tp": 2}, {"cp": 2, "tp": 2, "sp": True},
                                             {"cp": 2, "tp": 2, "sp": True}, {"dp": 4}], world=4, microbatches=2),
    "hf_llama_cp2_pp2_zero3_rc": decoder("llama", [{"cp": 2}] + [{"cp": 2, "dp_mode": "zero3", "recompute": True}] * 3,
                                         [0, 0, 1, 1], world=4, microbatches=2),
    "hf_llama_tc_dp2_cp2": decoder("llama_tc", [{"dp": 2, "cp": 2}] * 3 + [{"dp": 4}], world=4),
}


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_four_ranks_match_one_process(spawn_cases: Any, name: str) -> None:
    results = spawn_cases(4, FOUR_RANKS, "sequence_plans4")
    h.assert_close_to_reference(results, name, h.reference_for(FOUR_RANKS[name]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR_RANKS_SLOW))
def test_four_ranks_more_sequence_plans(spawn_cases: Any, name: str) -> None:
    results = spawn_cases(4, FOUR_RANKS_SLOW, "sequence_plans4_slow")
    h.assert_close_to_reference(results, name, h.reference_for(FOUR_RANKS_SLOW[name]))


# ---------------------------------------------------------------------------------------------- profiles
def test_measured_profile_declares_the_sequence_and_the_planner_offers_cp_and_sp() -> None:
    """The GPT and Llama chains' profiles carry sequence_length / heads / sequence_parallel from the adapters'
    uniap_sequence(), so the search offers cp (Ulysses and ring) and sp on their layers (and only cp 1 without them)."""
    import torch

    from uniap_lightning.planner.cost.layer import strategies_for
    from uniap_lightning.planner.profile import ModelProfile
    from uniap_lightning.profiling.module import profile_chain, with_sequence_fields
    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.runtime.planning import local_cluster
    from uniap_lightning.runtime.tensor_parallel import tp_degrees

    cluster = local_cluster(nodes=1, devices_per_node=4, device_type="cpu")
    ids = torch.randint(0, h.VOCAB, (4, h.SEQ), generator=torch.Generator().manual_seed(0))
    for kind, heads, kv in (("gpt", 4, 4), ("llama", 4, 2)):
        chain = extract_chain(h.make_lm_module(kind))
        prof = profile_chain(chain.layers, chain.names, ids, repeats=1, micro_batches=[4],
                             tp_degrees=[tp_degrees(m) for m in chain.layers])
        again = ModelProfile.from_dict(prof.to_dict())  # the fields survive the file format
        emb, block, head = again.layers[0], again.layers[1], again.layers[3]
        assert (emb.sequence_length, emb.attention_heads, emb.sequence_parallel) == (h.SEQ, 0, False), kind
        assert (block.sequence_length, block.attention_heads, block.kv_heads, block.sequence_parallel) == \
            (h.SEQ, heads, kv, True), kind
        assert head.sequence_length == h.SEQ and head.attention_heads == 0
        # the default causal-LM loss shifts labels inside: whole sequences, the gather stays priced
        assert not with_sequence_fields(prof, chain.layers, ids, chain.loss_fn).layers[3].loss_on_pieces
        offered = strategies_for(block, 4, cluster, 8)
        # ring too: the CPU cluster runs it (runtime/ring.py) and 2 cp divides the sequence
        assert {(s.cp, s.cp_method) for s in offered} == {(1, "none"), (2, "ulysses"), (4, "ulysses"), (2, "ring"),
                                                          (4, "ring")}, kind
        assert any(s.sp and s.tp == 2 for s in offered)
    # a chain that declares nothing: no sequence fields, no cp
    module = h.make_module()
    chain = extract_chain(module)
    prof = profile_chain(chain.layers, chain.names, torch.randn(4, h.IN), repeats=1, micro_batches=[4])
    assert all(lp.sequence_length is None for lp in prof.layers)
    assert {s.cp for s in strategies_for(prof.layers[1], 2, cluster, 8)} == {1}


def test_bert_profile_declares_the_sequence_and_the_planner_offers_cp_and_sp() -> None:
    """BERT (Hugging Face, as users train it) from a measured profile: the blocks declare 4 heads and sequence
    parallelism, the embedding and the masked-LM head are token-wise, so the search offers Ulysses cp and sp on
    the blocks. The sequence classifier's pooler (first token) declares nothing: whole sequences only. Multiple
    choice (``[batch, choices, seq]``) declares nothing anywhere."""
    from hf_models import hf_batches, hf_module

    from uniap_lightning.errors import UniAPError
    from uniap_lightning.planner.cost.layer import strategies_for
    from uniap_lightning.profiling.module import profile_chain, with_sequence_fields
    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.runtime import check_plan_executable
    from uniap_lightning.runtime.planning import local_cluster
    from uniap_lightning.runtime.sequence import sequence_info
    from uniap_lightning.runtime.tensor_parallel import tp_degrees

    cluster = local_cluster(nodes=1, devices_per_node=4, device_type="cpu")
    chain = extract_chain(hf_module("bert_mlm"))
    batch = next(iter(hf_batches(4, "bert_mlm")))
    sample = {k: batch[k] for k in ("input_ids", "attention_mask")}
    prof = profile_chain(chain.layers, chain.names, sample, repeats=1, micro_batches=[4],
                         tp_degrees=[tp_degrees(m) for m in chain.layers])
    emb, block, head = prof.layers[0], prof.layers[1], prof.layers[3]
    seq = sample["input_ids"].shape[1]
    assert (emb.sequence_length, emb.attention_heads, emb.sequence_parallel) == (seq, 0, False)
    assert (block.sequence_length, block.attention_heads, block.kv_heads, block.sequence_parallel) == \
        (seq, 4, 4, True)
    assert (head.sequence_length, head.attention_heads) == (seq, 0)
    offered = strategies_for(block, 4, cluster, 8)
    assert {(s.cp, s.cp_method) for s in offered} == {(1, "none"), (2, "ulysses"), (4, "ulysses"), (2, "ring"),
                                                      (4, "ring")}
    assert any(s.sp and s.tp == 2 for s in offered) and any(s.cp == 2 and s.tp == 2 for s in offered)
    assert {s.cp for s in strategies_for(head, 4, cluster, 8)} == {1, 2, 4}
    # the masked-LM loss is per token: it runs on the pieces, and the profile tells the planner (no gather priced)
    assert not head.loss_on_pieces
    assert with_sequence_fields(prof, chain.layers, sample, chain.loss_fn).layers[3].loss_on_pieces
    classifier = extract_chain(hf_module("bert"))
    infos = [sequence_info(m) for m in classifier.layers]
    assert infos[1]["attention_heads"] == 4 and infos[3] is None
    with pytest.raises(UniAPError, match=r"model.bert.pooler.*declares no sequence behaviour"):
        check_plan_executable(bert("bert", [CP2] * 4)["plan"], classifier)
    assert all(sequence_info(m) is None for m in extract_chain(hf_module("bert_mc")).layers)


def test_decoder_profiles_declare_the_sequence_and_the_planner_offers_cp_and_sp() -> None:
    """GPT-2 and Llama as users train them (``self.model(**batch).loss``) from a measured profile: the blocks
    declare their heads (Llama's grouped-query k/v; sequence parallelism where a tensor-parallel plan exists), the
    embedding and the LM head are token-wise, so the search offers cp (Ulysses, ring) and Llama's sp. The sequence
    classifiers (their embedding finds each row's last real token) declare nothing: whole sequences only."""
    from hf_models import hf_batches, hf_module

    from uniap_lightning.errors import UniAPError
    from uniap_lightning.planner.cost.layer import strategies_for
    from uniap_lightning.profiling.module import profile_chain
    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.runtime import check_plan_executable
    from uniap_lightning.runtime.planning import local_cluster
    from uniap_lightning.runtime.sequence import sequence_info
    from uniap_lightning.runtime.tensor_parallel import tp_degrees

    cluster = local_cluster(nodes=1, devices_per_node=4, device_type="cpu")
    for family, heads, kv, sp in (("gpt2", 2, 2, False), ("llama", 4, 2, True)):
        chain = extract_chain(hf_module(family))
        batch = next(iter(hf_batches(4, family)))
        sample = {k: batch[k] for k in ("input_ids", "attention_mask")}
        prof = profile_chain(chain.layers, chain.names, sample, repeats=1, micro_batches=[4],
                             tp_degrees=[tp_degrees(m) for m in chain.layers])
        emb, block, head = prof.layers[0], prof.layers[1], prof.layers[3]
        seq = sample["input_ids"].shape[1]
        assert (emb.sequence_length, emb.attention_heads) == (seq, 0)
        assert (block.sequence_length, block.attention_heads, block.kv_heads, block.sequence_parallel) == \
            (seq, heads, kv, sp), family
        assert (head.sequence_length, head.attention_heads) == (seq, 0)
        offered = strategies_for(block, 4, cluster, 8)
        assert {(2, "ulysses"), (2, "ring")} <= {(s.cp, s.cp_method) for s in offered}, family
        assert any(s.sp for s in offered) == sp
    for family in ("gpt2_sc", "llama_sc"):
        classifier = extract_chain(hf_module(family))
        assert all(sequence_info(m) is None for m in classifier.layers)
    with pytest.raises(UniAPError, match=r"declares no sequence behaviour"):
        check_plan_executable(decoder("llama_sc", [CP2] * 4)["plan"], extract_chain(hf_module("llama_sc")))


def test_encoder_batches_split_with_their_labels_and_attention_is_bidirectional() -> None:
    """BERT's pieces: labels stay with their tokens (nothing shifted), token types split alike; bidirectional
    attention with a key padding mask is what Hugging Face's masks give (padding queries see the real keys, not
    themselves); a row of padding sees itself (no empty softmax)."""
    import torch
    import torch.nn.functional as F

    from uniap_lightning.runtime import sequence as sq

    ids = torch.arange(12).reshape(2, 6)
    batch = {"input_ids": ids, "labels": ids.masked_fill(ids % 3 == 0, -100), "token_type_ids": (ids >= 3).long(),
             "global_scale": torch.ones(2)}
    parts = [sq.shard_token_batch(batch, r, 2) for r in range(2)]
    assert parts[1]["input_ids"].tolist() == [[3, 4, 5], [9, 10, 11]]
    assert parts[1]["labels"].tolist() == [[-100, 4, 5], [-100, 10, 11]]
    assert parts[0]["token_type_ids"].tolist() == [[0, 0, 0], [1, 1, 1]] and parts[1]["global_scale"].shape == (2,)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 6, 4, generator=g) for _ in range(3))
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[0, :2] = valid[1, -3:] = False
    valid[2] = False
    out = sq.attention(q, k, v, causal=False, key_valid=valid)
    expected = F.scaled_dot_product_attention(q[:2], k[:2], v[:2], attn_mask=valid[:2, None, None, :])
    torch.testing.assert_close(out[:2], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[2], v[2], rtol=1e-6, atol=1e-6)  # each padding query sees only itself


def test_a_per_token_loss_runs_on_the_last_layers_sequence_pieces() -> None:
    """piece_loss: lane r of the last layer's (dp 2, cp 2, tp 1) layout gets batch chunk r // 2 and sequence piece
    r % 2 of every micro-batch's labels (the scale rows with the batch), and its loss counts c times; a loss that
    is not per token, or a last layer with cp 1, keeps whole sequences (None)."""
    import torch

    from uniap_lightning.runtime.sequence import piece_loss

    def loss(out: Any, target: Any) -> Any:
        return out.sum() * target["global_scale"][0]

    loss.uniap_sequence_loss = "token"  # type: ignore[attr-defined]
    plan = _plan4([{"dp": 4}] * 3 + [{"dp": 2, "cp": 2}], microbatches=2, batch=8)
    y = {"labels": torch.arange(64).reshape(8, 8), "global_scale": torch.full((8,), 0.5)}
    fn, targets = piece_loss(plan, loss, y, 3)
    assert [t["labels"].tolist() for t in targets] == [[[20, 21, 22, 23], [28, 29, 30, 31]],
                                                       [[52, 53, 54, 55], [60, 61, 62, 63]]]
    assert [t["global_scale"].shape for t in targets] == [(2,), (2,)]
    assert float(fn(torch.ones(2, 4, 3), targets[0])) == 2 * 24 * 0.5
    assert piece_loss(_plan4([{"dp": 4}] * 4, microbatches=2, batch=8), loss, y, 3) is None
    assert piece_loss(plan, lambda out, target: out.sum(), y, 3) is None
    # a causal LM's next-token mean (CausalLMModule.uniap_loss, declared): labels shifted before the split, each
    # piece's summed cross-entropy over its chunk's count; the c pieces of a chunk add up to c x the chunk's mean.
    # Undeclared (CausalLMModule as shipped: the planner prices the gather before the loss), whole sequences.
    assert piece_loss(plan, h.make_lm_module("gpt").uniap_loss, torch.zeros(8, 8, dtype=torch.long), 3) is None
    module = gpt_loss_on_pieces()
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 5, (8, 8), generator=g)
    labels[1, 2:5] = labels[6, 0] = -100
    logits = torch.randn(8, 8, 5, generator=g)
    for lane in range(4):
        pieces = [piece_loss(plan, module.uniap_loss, labels, r) for r in (lane - lane % 2, lane - lane % 2 + 1)]
        pd = lane // 2
        for m in range(2):
            rows = slice(4 * m + 2 * pd, 4 * m + 2 * pd + 2)
            total = sum(fn(logits[rows, 4 * k:4 * k + 4], targets[m]) for k, (fn, targets) in enumerate(pieces))
            torch.testing.assert_close(total / 2, module.uniap_loss(logits[rows], labels[rows]))


# ---------------------------------------------------------------------------------------------- layouts
def test_relayout_groups_and_common_pieces() -> None:
    """Which pieces lanes hold, what a move gathers to, and who gathers together (no processes needed)."""
    from uniap_lightning.runtime.reshard import common_pieces, gather_classes, moves_of, piece_of_lane

    assert [piece_of_lane(r, (2, 2, 1)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [piece_of_lane(r, (1, 2, 2)) for r in range(4)] == [(0, 0), (0, 0), (0, 1), (0, 1)]
    assert common_pieces((4, 1, 1), (2, 2, 1)) == (2, 1)  # batch pairs gathered, then cut along the sequence
    assert common_pieces((1, 2, 2), (1, 4, 1)) == (1, 2)  # sequence halves stay on their lanes, cut in two
    assert common_pieces((2, 2, 1), (1, 4, 1)) == (1, 1)  # lane 1: second half of sample 0, then a quarter of both
    assert common_pieces((2, 2, 1), (1, 2, 2)) == (1, 1)  # halves sit on other lanes: whole sequences
    assert gather_classes((4, 1, 1), (2, 1)) == [[0, 1], [2, 3]]
    assert gather_classes((1, 2, 2), (1, 1)) == [[0, 2], [1, 3]]  # one lane per piece, same tp index
    assert moves_of((4, 1, 1), (4, 1, 1)) == []
    assert moves_of((2, 1, 2), (1, 1, 4)) == [((2, 1, 2), (1, 1))]  # a gather, no slice
