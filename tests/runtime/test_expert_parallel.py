"""Expert parallelism (``runtime/experts.py``) on the tiny MoE GPT (``adapters/moe.py``) against one process.

Two gloo processes with ``ep = 2`` over the same two data ranks (each rank its own half of the batch, as Megatron
and DeepSpeed-MoE overlap ep with data parallelism) run every case of :data:`CASES` in one spawn; the reference is
one process on the concatenated batch, with gradients averaged as the one-process mean.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import expert_parallel_helpers as eh
import uniap_rt_helpers as h
from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime import experts

HAS_HF = importlib.util.find_spec("transformers") is not None  # the [hf] extra
NO_DROP = {"capacity_factor": 2.0}  # = E / k: an expert can take every token, nothing is ever dropped
DROPS = {"capacity_factor": 0.5}
CASES = {
    "no_drop": {"cfg": NO_DROP, "steps": 5},
    "drops": {"cfg": DROPS, "steps": 5},
    "drops_local": {"cfg": DROPS, "token_scope": "local", "steps": 0},
    "balanced": {"kind": "balanced", "hidden": 8, "b": 2, "s": 4},
    "own": {"kind": "own", "hidden": 8, "b": 2, "s": 4},
    "none_kept": {"kind": "balanced", "hidden": 8, "b": 2, "s": 4, "capacity_factor": 0.0},
    **({f"hf_{family}": {"hf": family, "steps": 3} for family in ("mixtral", "qwen2_moe", "olmoe")} if HAS_HF else {}),
    "bad_ep": {"kind": "bad_ep"},  # last: it leaves no collective half done, but keep failures late anyway
}
HIDDEN = eh.BASE["n_embd"]


def _spawn(world: int, cases: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    results = h.spawn(world, cases, out, fn=eh.worker)
    for r, res in enumerate(results):
        for name in cases:
            assert name in res, f"rank {r} did not run case {name} (an earlier case failed)"
            assert "error" not in res[name], f"rank {r}, case {name}: {res[name]['error']}\n{res[name]['traceback']}"
    return results


@pytest.fixture(scope="module")
def ep2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(2, CASES, tmp_path_factory.mktemp("ep2"))


def _assert_parity(results: list[dict[str, Any]], name: str, ref: dict[str, Any]) -> None:
    losses = torch.tensor([res[name]["losses"] for res in results]).mean(0)  # each rank: mean over its half
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    keys = results[0][name]["expert_keys"]
    for k in set(results[0][name]["state"]) - set(keys):  # non-expert parameters stay replicated
        torch.testing.assert_close(results[0][name]["state"][k], results[1][name]["state"][k], rtol=0, atol=0)
    merged = experts.merge_expert_states([res[name]["state"] for res in results], keys)
    assert set(merged) == set(ref["state"])
    for k, v in ref["state"].items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_ep2_matches_one_process_when_nothing_drops(ep2: list[dict[str, Any]]) -> None:
    ref = eh.reference(NO_DROP, eh.make_ids(), 5)
    assert len(ep2[0]["no_drop"]["expert_keys"]) == 4 * eh.BASE["n_layer"]
    assert all(d == [0, 0] for res in ep2 for d in res["no_drop"]["dropped"])
    _assert_parity(ep2, "no_drop", ref)
    assert ref["losses"][-1] < ref["losses"][0] - 0.1  # it trains


def test_ep2_drops_the_same_tokens_as_one_process(ep2: list[dict[str, Any]]) -> None:
    """Capacity over every data rank's tokens (``token_group`` = the data group): the ep ranks drop exactly the
    assignments one process drops on the concatenated batch, at every step, so training stays equal."""
    ref = eh.reference(DROPS, eh.make_ids(), 5)
    per_step = [[a + b for a, b in zip(x, y)] for x, y in zip(ep2[0]["drops"]["dropped"], ep2[1]["drops"]["dropped"])]
    assert per_step == ref["dropped"]
    assert all(d > 0 for step in ref["dropped"] for d in step)  # capacity 0.5 does drop in every layer
    _assert_parity(ep2, "drops", ref)


def test_local_capacity_behaves_as_one_process_per_rank(ep2: list[dict[str, Any]]) -> None:
    """``token_group=None``: capacity ``ceil(cf * N_local * k / E)`` and the load-balancing statistics over each
    rank's own tokens. Each rank then computes exactly what one process computes on its half alone, which differs
    from one process on the concatenated batch once tokens drop."""
    ids, n = eh.make_ids(), eh.BATCH // 2
    halves = [eh.reference(DROPS, ids[r * n:(r + 1) * n], 0) for r in range(2)]
    for r, res in enumerate(ep2):
        assert res["drops_local"]["dropped"] == halves[r]["dropped"]
        assert res["drops_local"]["losses"][0] == pytest.approx(halves[r]["losses"][0], rel=1e-6)
    whole = eh.reference(DROPS, ids, 0)
    local_mean = sum(res["drops_local"]["losses"][0] for res in ep2) / 2
    assert abs(local_mean - whole["losses"][0]) > 1e-4  # the documented difference is real here
    # the same number drops (capacity 0.5 fills every expert either way), but not the same tokens of each rank
    assert [res["drops_local"]["dropped"][0] for res in ep2] != [res["drops"]["dropped"][0] for res in ep2]


def test_all_to_all_bytes_balanced_routing_equal_the_formula(ep2: list[dict[str, Any]]) -> None:
    case = CASES["balanced"]
    b, s, k, hid, ep = case["b"], case["s"], 2, case["hidden"], 2
    elements = b * s * k * hid * (ep - 1) // ep
    for res in ep2:
        records = res["balanced"]["records"]
        assert res["balanced"]["dropped"] == 0
        assert [r["name"] for r in records] == ["counts", "dispatch", "combine", "combine.grad", "dispatch.grad"]
        for r in records[1:]:
            assert r["bytes_sent"] == elements * 4, r  # float32
            assert r["rows_kept"] == b * s * k // ep
        assert records[0]["bytes_sent"] == (4 // ep) * 8  # the [ep, E/ep] int64 count exchange


def test_all_to_all_bytes_equal_the_split_sizes_of_the_routing(ep2: list[dict[str, Any]]) -> None:
    """First training step of ``no_drop``: the rows each rank sends are its tokens' assignments to the other
    rank's experts, read from one process's routing of the same weights and tokens."""
    ids, n_tok = eh.make_ids(), eh.BATCH * eh.SEQ // 2
    routes = eh.reference(NO_DROP, ids, 0)["routes"]  # per layer [tokens, k] experts of the first forward
    local = eh.BASE["n_experts"] // 2
    owner = [route // local for route in routes]  # rank holding each assignment's expert
    sent = [[int((o[r * n_tok:(r + 1) * n_tok] != r).sum()) for r in range(2)] for o in owner]  # [layer][rank]
    for rank, res in enumerate(ep2):
        records = res["no_drop"]["records"]
        names = [r["name"] for r in records]
        assert names == ["counts", "dispatch", "combine"] * 2 + ["combine.grad", "dispatch.grad"] * 2
        forward = [records[1], records[4]]  # dispatch per layer
        combine = [records[2], records[5]]
        backward = {0: records[8:10], 1: records[6:8]}  # backward runs the last layer first
        for layer in range(2):
            other = 1 - rank
            assert forward[layer]["rows_sent"] == sent[layer][rank]
            assert combine[layer]["rows_sent"] == sent[layer][other]  # outputs go back to their tokens
            comb_grad, disp_grad = backward[layer]
            assert disp_grad["rows_sent"] == sent[layer][other]
            assert comb_grad["rows_sent"] == sent[layer][rank]
            for r in (forward[layer], combine[layer], comb_grad, disp_grad):
                assert r["bytes_sent"] == r["rows_sent"] * HIDDEN * 4
    total = sum(r["bytes_sent"] for res in ep2 for r in res["no_drop"]["records"] if r["name"] != "counts")
    assert total == 4 * sum(sum(s) for s in sent) * HIDDEN * 4  # two all-to-alls forward, two backward


def test_experts_not_divisible_by_ep_is_one_clear_line(ep2: list[dict[str, Any]]) -> None:
    for res in ep2:
        msg = res["bad_ep"]["error_message"]
        assert msg is not None and "\n" not in msg
        assert msg.startswith("UniAPError: MoE layer 'chain.1.moe': expert parallelism ep=2 must divide"), msg
    state = eh.make_module().state_dict()
    with pytest.raises(UniAPError, match=r"ep=3 must divide the number of experts E=4"):
        experts.shard_expert_state(state, experts.expert_state_keys(eh.make_module()), ep=3, index=0)
    with pytest.raises(UniAPError, match=r"ep=2 must divide the 3 data ranks"):
        experts.ExpertLayout((0, 1, 2), 2)


@pytest.mark.parametrize("kind", ["balanced", "own"])
def test_one_layer_outputs_and_gradients_equal_one_process(ep2: list[dict[str, Any]], kind: str) -> None:
    """One MoE layer, loss ``sum(y) + aux`` per rank: outputs, input gradients and each rank's expert gradients
    (no reduction needed: the backward all-to-alls bring every token rank's share) equal one process's on the
    concatenated tokens with loss ``sum(y) + 2 aux`` (each rank's aux is one term of the mean). ``own``: every
    token's experts are on its own rank, so all four all-to-alls send zero rows and must still run."""
    case = CASES[kind]
    n, hid = case["b"] * case["s"], case["hidden"]
    layer = eh.balanced_layer(hid)
    x = torch.cat([eh.layer_tokens(kind, n, hid, r) for r in range(2)]).view(2 * case["b"], case["s"], hid)
    x.requires_grad_()
    y, aux = layer(x)
    (y.sum() + 2 * aux).backward()
    local = layer.n_experts // 2
    for r, res in enumerate(ep2):
        got = res[kind]
        assert got["dropped"] == 0
        torch.testing.assert_close(got["y"], y.detach()[r * case["b"]:(r + 1) * case["b"]], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["x_grad"], x.grad[r * case["b"]:(r + 1) * case["b"]], rtol=1e-5, atol=1e-6)
        for name in layer.uniap_expert_params:
            torch.testing.assert_close(got["grads"][name], getattr(layer, name).grad[r * local:(r + 1) * local],
                                       rtol=1e-5, atol=1e-6)
        if kind == "own":
            assert [rec["rows_sent"] for rec in got["records"][1:]] == [0, 0, 0, 0]
    router = ep2[0][kind]["grads"]["router.weight"] + ep2[1][kind]["grads"]["router.weight"]
    torch.testing.assert_close(router, layer.router.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_hugging_face_experts_ep2_match_the_unwrapped_model(ep2: list[dict[str, Any]], family: str) -> None:
    """Hugging Face MoE models with their ``mlp.experts`` replaced by ``HFExperts`` and sharded over ep=2: 3 SGD
    steps equal one process running the model as Hugging Face ships it (its ``grouped_mm`` experts). Loss without
    the aux term (``output_router_logits=False``, the default; the aux term needs the chain, see experts.py)."""
    if not HAS_HF:
        pytest.skip("needs transformers (the [hf] extra)")
    name = f"hf_{family}"
    model = eh.hf_model(family)
    ref = eh.train(model, eh.make_ids(), 3, loss_of=eh.hf_loss)
    assert len(ep2[0][name]["expert_keys"]) == 2 * 2  # gate_up_proj and down_proj of both layers
    _assert_parity(ep2, name, ref)


def test_every_token_dropped_still_runs_the_exchanges(ep2: list[dict[str, Any]]) -> None:
    """Capacity 0: no rank sends or keeps a row; the layer outputs zeros, and all four all-to-alls still run (a rank
    skipping one would hang the others)."""
    for res in ep2:
        got = res["none_kept"]
        assert got["dropped"] == 2 * 4 * 2  # all b*s*k assignments
        assert torch.count_nonzero(got["y"]) == 0
        assert [(r["name"], r["rows_sent"], r["rows_kept"]) for r in got["records"][1:]] == [
            ("dispatch", 0, 0), ("combine", 0, 0), ("combine.grad", 0, 0), ("dispatch.grad", 0, 0)]
        assert torch.count_nonzero(got["grads"]["w_in"]) == 0 and torch.count_nonzero(got["grads"]["router.weight"])


# ------------------------------------------------------------------------------------------------ one process
def test_keep_mask_matches_a_brute_force_of_the_global_order() -> None:
    """Slot-major, then token rank, then token: each rank's mask from the gathered counts equals the brute force on
    the concatenated batch."""
    from uniap_lightning.adapters.moe import keep_mask

    gen = torch.Generator().manual_seed(3)
    ranks, n, k, n_experts, cap = 3, 7, 2, 4, 4
    experts_of = [torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(n)]) for _ in range(ranks)]
    counts = torch.stack([torch.nn.functional.one_hot(e, n_experts).sum(0) for e in experts_of])
    whole = torch.cat(experts_of)
    load, expected = [0] * n_experts, torch.zeros(ranks * n, k, dtype=torch.bool)
    for j in range(k):
        for t in range(ranks * n):
            e = int(whole[t, j])
            expected[t, j] = load[e] < cap
            load[e] += 1
    got = torch.cat([keep_mask(experts_of[r], counts, r, cap) for r in range(ranks)])
    assert torch.equal(got, expected)
    assert 0 < int((~expected).sum()) < expected.numel()


def test_shard_and_merge_expert_state_round_trip() -> None:
    module = eh.make_module()
    state, keys = module.state_dict(), experts.expert_state_keys(module)
    assert "chain.1.moe.w_in" in keys and "chain.1.moe.router.weight" not in keys
    shards = [experts.shard_expert_state(state, keys, ep=2, index=i) for i in range(2)]
    assert shards[1]["chain.1.moe.w_in"].shape == (2, HIDDEN, 4 * HIDDEN)
    torch.testing.assert_close(shards[1]["chain.1.moe.w_out"], state["chain.1.moe.w_out"][2:], rtol=0, atol=0)
    merged = experts.merge_expert_states(shards, keys)
    assert set(merged) == set(state)
    for key, value in state.items():
        assert torch.equal(merged[key], value), key


def test_aux_loss_is_the_coefficient_when_routing_is_balanced() -> None:
    layer = eh.balanced_layer(8)
    _, aux = layer(eh.balanced_tokens(16, 8))
    assert aux.item() == pytest.approx(layer.aux_loss_coef, rel=1e-6)
    assert int(layer.last_dropped) == 0


def test_gradient_rule_splits_expert_from_other_trainable_parameters() -> None:
    module = eh.make_module()
    module.chain[0].wpe.weight.requires_grad_(False)
    expert, other = experts.split_expert_params(module)
    names = {id(p): n for n, p in module.named_parameters()}
    assert sorted(names[id(p)] for p in expert) == sorted(experts.expert_state_keys(module))
    assert "chain.1.moe.router.weight" in {names[id(p)] for p in other}
    assert "chain.0.wpe.weight" not in {names[id(p)] for p in expert + other}


def test_capacity_formula_and_layout_groups() -> None:
    from uniap_lightning.adapters.moe import capacity

    assert capacity(1.25, 64, 2, 4) == math.ceil(1.25 * 64 * 2 / 4) == 40
    assert capacity(None, 64, 2, 4) == 128
    layout = experts.ExpertLayout((0, 1, 2, 3), 2)
    assert layout.ep_groups() == [(0, 1), (2, 3)]
    assert layout.expert_data_groups() == [(0, 2), (1, 3)]


# ------------------------------------------------------------------------------------------------ strategy
PP_CASE = {"module": {"factory": "expert_parallel_helpers:lightning_module", **NO_DROP},
           "data": {"factory": "uniap_rt_helpers:make_data", "lm": True}, "steps": 3,
           "plan": h.make_plan([(1, 1, False)] * 4, [0, 0, 1, 1], pp=2, microbatches=1,
                               names=["chain.0", "chain.1", "chain.2", "chain.3"])}


def test_moe_chain_carries_the_aux_loss_across_a_pipeline_stage(spawn_cases: Any) -> None:
    """``strategy="uniap"`` with pp=2 (no expert parallelism yet): the ``(hidden, aux [B])`` tuple crosses the stage
    boundary and the loss (cross-entropy + aux) matches one process. One micro-batch: with several, routing,
    capacity and the auxiliary loss are per micro-batch, as in every pipelined MoE."""
    results = spawn_cases(2, {"moe_pp2": PP_CASE}, "moe_pp2")
    h.assert_close_to_reference(results, "moe_pp2", h.reference_for(PP_CASE))


# ------------------------------------------------------------------------------------------------ ep=2 x dp=2
@pytest.mark.slow
def test_ep2_dp2_four_processes_match_one_process(tmp_path: Path) -> None:
    """Four data ranks, ep groups (0, 1) and (2, 3): expert gradients summed over (0, 2) and (1, 3) only."""
    cases = {"no_drop": CASES["no_drop"], "drops": CASES["drops"]}
    results = _spawn(4, cases, tmp_path)
    for name, cfg in (("no_drop", NO_DROP), ("drops", DROPS)):
        ref = eh.reference(cfg, eh.make_ids(), 5)
        losses = torch.tensor([res[name]["losses"] for res in results]).mean(0)
        torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
        keys = results[0][name]["expert_keys"]
        for pair in ((0, 1), (2, 3)):
            merged = experts.merge_expert_states([results[r][name]["state"] for r in pair], keys)
            for k, v in ref["state"].items():
                torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
