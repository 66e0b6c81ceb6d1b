"""Encoder-decoder LMs with no hand-written family (issue 20): the generic seq2seq split
(``uniap_lightning.adapters.families.seq2seq``) gives the model's own loss and gradients on padded batches cut into
micro-batches (labels as given, the decoder's inputs shifted as the model shifts them), trains under pinned pipeline /
FSDP / tensor-parallel plans and a solved one like one process, and trains as one layer what it cannot split."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from typing import Any

import pytest
import torch

import uniap_rt_helpers as h

pytest.importorskip("transformers")  # the [hf] extra
from hf_seq2seq_models import MORE, ONE_LAYER, SEQ2SEQ, seq2seq_batches, seq2seq_module, seq2seq_names  # noqa: E402

from uniap_lightning.errors import UniAPError  # noqa: E402


def _chain_loss(chain: Any, batch: dict[str, torch.Tensor], pieces: int = 4) -> torch.Tensor:
    from uniap_lightning.runtime.payload import call_layer, chunk

    x, y = chain.split_batch(batch)
    losses = []
    for xm, ym in zip(chunk(x, pieces), chunk(y, pieces)):
        for layer in chain.layers:
            xm = call_layer(layer, xm)
        losses.append(chain.loss_fn(xm, ym))
    return torch.stack(losses).mean()


def _grads(model: Any, chain: Any) -> dict[str, torch.Tensor]:
    """Gradients by parameter name, the tied copies' summed as the runtime sums them (runtime/ties.py)."""
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for a, b, name_a, name_b in chain.ties:
        pa, pb = chain.layers[a].get_parameter(name_a), chain.layers[b].get_parameter(name_b)
        na = next(n for n, p in model.named_parameters() if p is pa)
        nb = next(n for n, p in model.named_parameters() if p is pb)
        grads[na] = grads[na] + grads.pop(nb)
    return grads


def _loss_and_grads(family: str) -> None:
    from uniap_lightning.adapters import extract_chain

    module = seq2seq_module(family)
    model = module.model
    batch = next(iter(seq2seq_batches(8, family)))
    assert (batch["labels"] == -100).any()
    expected = model(**batch).loss
    expected.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    chain = extract_chain(module)
    assert chain.names == seq2seq_names(family)
    loss = _chain_loss(chain, batch)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert len(chain.ties) == 1  # the LM head is tied to the token embedding: a copy on the last layer
    grads = _grads(model, chain)
    assert set(grads) == set(reference)
    for n, g in reference.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("family", list(SEQ2SEQ))
def test_seq2seq_chain_gives_the_models_own_loss_and_gradients(family: str) -> None:
    _loss_and_grads(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MORE))
def test_seq2seq_chain_more_families(family: str) -> None:
    _loss_and_grads(family)


def test_given_decoder_inputs_are_used_as_given() -> None:
    """A batch with ``decoder_input_ids`` (and a decoder padding mask) is not shifted again: the chain's logits are
    the model's own on those inputs."""
    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.runtime.payload import call_layer

    module = seq2seq_module("bart")
    model = module.model
    batch = next(iter(seq2seq_batches(4, "bart")))
    decoder = {"decoder_input_ids": batch["labels"].clamp(min=0).roll(1, -1),
               "decoder_attention_mask": (batch["labels"] != -100).long()}
    decoder["decoder_attention_mask"][:, 0] = 1
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], **decoder}
    with torch.no_grad():
        expected = model(**inputs).logits
        chain = extract_chain(module)
        x, y = chain.split_batch(inputs)
        assert y is None and set(x) == set(inputs)
        for layer in chain.layers:
            x = call_layer(layer, x)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


def test_a_batch_without_attention_mask() -> None:
    """Without ``attention_mask`` (no padding) the model attends to every token; so does the chain (the masks, always
    materialized, keep the structure the blocks were set up with)."""
    from uniap_lightning.adapters import extract_chain

    module = seq2seq_module("bart")
    batch = next(iter(seq2seq_batches(4, "bart")))
    del batch["attention_mask"]
    with torch.no_grad():
        expected = module.model(**batch).loss
        chain = extract_chain(module)
        torch.testing.assert_close(_chain_loss(chain, batch, pieces=2), expected, rtol=1e-6, atol=1e-6)


def test_t5_through_the_generic_path_matches_the_hand_written_family() -> None:
    """T5's stacks run one dropout module before and after their blocks and pass the relative position bias from
    block to block: the generic path trains it as one layer (with one warning), whose loss and gradients are the
    hand-written family's; the hand-written family keeps winning in dispatch."""
    from hf_models import hf_batches, hf_module

    from uniap_lightning.adapters.families.seq2seq import seq2seq_family
    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.runtime.chain import Chain

    batch = next(iter(hf_batches(8, "t5")))
    results = []
    for generic in (False, True):
        module = hf_module("t5")
        model = module.model
        if generic:
            with pytest.warns(UserWarning, match="T5ForConditionalGeneration trains as ONE layer"):
                family = seq2seq_family(model)
            pairs = family.layers(model)
            assert [p for _, p in pairs] == [["shared", "encoder", "decoder", "lm_head"]]
            from uniap_lightning.adapters.auto import _split_for

            chain = Chain(module=module, layers=[layer for layer, _ in pairs], names=["model.shared"],
                          loss_fn=lambda out, t, m=model: family.loss(m, out, _hf_target(t)),
                          split_batch=_split_for(family, model), parts=[[f"model.{p}" for p in pairs[0][1]]])
        else:
            chain = extract_chain(module)
            assert len(chain.layers) == 7  # the hand-written split: embedding, 2 + 2 blocks, encoder end, head
        loss = _chain_loss(chain, batch)
        loss.backward()
        results.append((loss.detach(), _grads(model, chain)))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    assert set(grads_a) == set(grads_b)
    for n, g in grads_a.items():
        torch.testing.assert_close(grads_b[n], g, rtol=1e-5, atol=1e-6, msg=n)


def _hf_target(target: dict[str, torch.Tensor]) -> Any:
    from uniap_lightning.adapters.auto import HFTarget

    return HFTarget(target["labels"], target["global_scale"])


def _one_layer(family: str) -> None:
    from uniap_lightning.adapters import extract_chain

    module = seq2seq_module(family)
    model = module.model
    batch = next(iter(seq2seq_batches(8, "bart")))
    model.eval()  # (LayerDrop drops no block: the reference is deterministic)
    expected = model(**batch).loss
    with pytest.warns(UserWarning, match=f"{type(model).__name__} trains as ONE layer.*{ONE_LAYER[family][1]}"):
        chain = extract_chain(module)
    assert chain.names == seq2seq_names(family)
    torch.testing.assert_close(_chain_loss(chain, batch), expected, rtol=1e-6, atol=1e-6)


def test_layerdrop_trains_as_one_layer() -> None:
    """LayerDrop skips blocks at random in training: no split can reproduce it, the model trains as one layer
    with one warning naming why, on its own loss."""
    _one_layer("bart_layerdrop")


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in ONE_LAYER if f != "bart_layerdrop"])
def test_what_the_split_cannot_reproduce_trains_as_one_layer(family: str) -> None:
    _one_layer(family)


def _tiny_bart(cls: str, **kw: Any) -> Any:
    import transformers as tr

    torch.manual_seed(0)
    return getattr(tr, cls)(tr.BartConfig(
        vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0, attention_dropout=0.0,
        pad_token_id=0, eos_token_id=2, **kw))


def test_a_seq2seq_classifier_trains_as_one_layer() -> None:
    """BART's sequence classifier pools the decoder's states at the last <eos> in its top-level forward: one layer
    (one warning), its own loss on micro-batches."""
    from uniap_lightning.adapters import extract_chain

    module = h.make_module(factory="hf_models:HFModule", model=_tiny_bart("BartForSequenceClassification",
                                                                          num_labels=3))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 32, (8, 6), generator=g)
    ids[:, -1] = 2  # every sample ends with <eos>
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 3, (8,), generator=g)}
    expected = module.model(**batch).loss
    with pytest.warns(UserWarning, match="BartForSequenceClassification trains as ONE layer.*pools"):
        chain = extract_chain(module)
    assert chain.names == ["model.model"]
    torch.testing.assert_close(_chain_loss(chain, batch), expected, rtol=1e-6, atol=1e-6)


def test_another_seq2seq_head_is_refused_at_setup() -> None:
    from uniap_lightning.adapters import extract_chain

    module = h.make_module(factory="hf_models:HFModule", model=_tiny_bart("BartForQuestionAnswering"))
    with pytest.raises(UniAPError, match=r"BartForQuestionAnswering.*encoder-decoder LMs.*uniap_layers"):
        extract_chain(module)


def test_labels_longer_than_the_decoder_positions_are_refused_in_one_line() -> None:
    from uniap_lightning.adapters import extract_chain

    chain = extract_chain(seq2seq_module("whisper"))
    batch = next(iter(seq2seq_batches(2, "whisper")))
    batch["labels"] = torch.ones(2, 13, dtype=torch.long)  # Whisper's tiny config: 12 decoder positions
    with pytest.raises(UniAPError, match="13 decoder tokens.*at most 12"):
        chain.split_batch(batch)


def test_tensor_parallel_where_the_attention_allows_it() -> None:
    """BART's blocks (self- and cross-attention reshaping by -1 heads, fc1 / fc2) are tensor parallel up to the head
    count; Whisper's attention reshapes its keys with its full head count, so its blocks stay whole."""
    from uniap_lightning.adapters import extract_chain

    bart = extract_chain(seq2seq_module("bart"))
    assert [layer.uniap_tp_degrees() for layer in bart.layers[:-1]] == [[1], [1, 2, 4], [1, 2, 4], [1], [1, 2, 4],
                                                                       [1, 2, 4]]
    assert bart.layers[4].uniap_tp_allreduces() == 3 and bart.layers[1].uniap_tp_allreduces() == 2
    whisper = extract_chain(seq2seq_module("whisper"))
    assert [layer.uniap_tp_degrees() for layer in whisper.layers[:-1]] == [[1]] * 6
    assert whisper.layers[-1].uniap_tp_degrees()[-1] == 64  # the LM head over the vocabulary


PLANS = tempfile.mkdtemp(prefix="uniap_hf_seq2seq_plans_")
atexit.register(shutil.rmtree, PLANS, ignore_errors=True)
ONE, REPL, FSDP, TP = (1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)


def case(family: str, strategies: list[tuple[int, int, bool]], stages: list[int], *, world: int = 2,
         **kw: Any) -> dict[str, Any]:
    plan = h.make_plan(strategies, stages, names=seq2seq_names(family), pp=max(stages) + 1, world=world,
                       microbatches=kw.pop("microbatches", 2), schedule="1f1b")
    return {"plan": plan, "module": {"factory": "hf_seq2seq_models:seq2seq_module", "family": family, "lr": 0.1},
            "data": {"factory": "hf_seq2seq_models:seq2seq_batches", "family": family}, "steps": 3, **kw}


TWO_RANKS = {
    # the encoder's padding mask and the decoder's embedded inputs cross the boundary; the tied LM head copy on
    # the other stage
    "bart_pp2": case("bart", [ONE] * 7, [0, 0, 0, 1, 1, 1, 1], export=f"{PLANS}/bart.pt"),
    "bart_fsdp": case("bart", [FSDP] * 7, [0] * 7),
    # the encoder's output crosses the boundary inside the decoder (with the decoder's masks); validation too
    "whisper_pp2": case("whisper", [ONE] * 7, [0, 0, 0, 0, 0, 1, 1], limit_val_batches=2),
    # self- and cross-attention, MLP and the LM head tensor parallel
    "bart_tp2": case("bart", [REPL, TP, TP, FSDP, TP, TP, TP], [0] * 7),
    # no plan: the strategy profiles the chain, solves and applies the plan
    "mbart_solved": {**case("mbart", [REPL] * 7, [0] * 7), "plan": None,
                     "strategy": {"measure_cluster": False, "cache_dir": PLANS}},
}


def _check_export(case: dict[str, Any], folder: Any) -> None:
    """The consolidated file holds the model's own state-dict keys (the tied embedding once per name, equal) and
    loads with ``from_pretrained``."""
    from safetensors.torch import save_file

    from hf_seq2seq_models import build_seq2seq

    state = torch.load(case["export"], weights_only=True)
    hf = {k.removeprefix("model."): v for k, v in state.items()}
    model = build_seq2seq(case["module"]["family"])
    assert set(hf) <= set(model.state_dict()), set(hf) - set(model.state_dict())
    model.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in hf.items()}, folder / "model.safetensors")
    loaded, info = type(model).from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for k, v in loaded.state_dict().items():
        if k in hf:
            torch.testing.assert_close(v, hf[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_seq2seq_two_ranks(name: str, spawn_cases: Any, tmp_path: Any) -> None:
    results = spawn_cases(2, TWO_RANKS, "hf_seq2seq_two_ranks")
    reference = h.reference_for(TWO_RANKS[name])
    h.assert_close_to_reference(results, name, reference)
    if "export" in TWO_RANKS[name]:
        _check_export(TWO_RANKS[name], tmp_path)
    if "limit_val_batches" in TWO_RANKS[name]:
        assert [r[name]["val_loss"] for r in results] == pytest.approx([reference["val_loss"]] * 2, rel=1e-5)
    if TWO_RANKS[name]["plan"] is None:
        assert results[0][name]["origin"] == "solver"


FOUR_RANKS = {
    "bart_pp2_x_tp2": case("bart", [REPL, TP, TP, REPL, TP, TP, TP], [0, 0, 0, 0, 1, 1, 1], world=4),
    "whisper_pp2_x_fsdp2": case("whisper", [FSDP] * 7, [0, 0, 0, 1, 1, 1, 1], world=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_seq2seq_four_ranks(name: str, spawn_cases: Any) -> None:
    results = spawn_cases(4, FOUR_RANKS, "hf_seq2seq_four_ranks")
    h.assert_close_to_reference(results, name, h.reference_for(FOUR_RANKS[name]))
