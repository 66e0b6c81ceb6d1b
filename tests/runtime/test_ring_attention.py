"""Ring attention (:mod:`uniap_lightning.runtime.ring`): exact against whole-sequence attention on gloo ranks.

The layer-level cases of each world size share one spawn (:mod:`ring_workers`): causal and bidirectional, with and
without key padding (a row of padding and left padding longer than a cp piece: rows that see no key see
themselves, as in :func:`~uniap_lightning.runtime.sequence.attention`), grouped-query k/v; output and q / k / v
gradients within 1e-5 in float32, to rounding in float64, both per-block paths (torch's CPU flash kernel and plain
matmuls); the elements sent equal :func:`ring_elements`. Strategy
parity (GPT, Llama, BERT under ``cp_method: ring``) is in ``test_sequence_plans.py`` and the building-block parity
in ``test_sequence_parallel.py`` (their shared spawns); here the plan checks and the planner's offer.
"""

from __future__ import annotations

from typing import Any

import pytest

import ring_workers as rw
import uniap_rt_helpers as h
from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime import ring

LAYER = {
    "causal": {"kind": "layer"},
    "causal_padded_gqa": {"kind": "layer", "padded": True, "kv_heads": 2},
    "bidirectional": {"kind": "layer", "causal": False},
    "bidirectional_padded_mqa": {"kind": "layer", "causal": False, "padded": True, "kv_heads": 1},
    "causal_padded_float64": {"kind": "layer", "padded": True, "kv_heads": 2, "dtype": "float64"},
    # bfloat16 in and out (float32 inside) against sequence.attention in bfloat16: within its rounding (values ~1-3)
    "causal_padded_bfloat16": {"kind": "layer", "padded": True, "kv_heads": 2, "dtype": "bfloat16"},
    # the plain-matmul blocks (what a non-CPU device runs) instead of torch's CPU flash kernel
    "causal_padded_gqa_matmul": {"kind": "layer", "padded": True, "kv_heads": 2, "fused": False},
    "bidirectional_padded_matmul": {"kind": "layer", "causal": False, "padded": True, "fused": False},
}
#: 2 ranks also: the chains the strategy switches (enable_context_parallel, method="ring") run ring, their elements
CHAINS = {"gpt_chain_bytes": {"kind": "chain_bytes"}, "llama_chain_bytes": {"kind": "chain_bytes", "model": "llama"}}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return h.spawn(2, {**LAYER, **CHAINS}, tmp_path_factory.mktemp("ring2"), fn=rw.worker)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return h.spawn(4, LAYER, tmp_path_factory.mktemp("ring4"), fn=rw.worker)


def _check(results: list[dict[str, Any]], name: str) -> None:
    tol = {"float64": 1e-12, "bfloat16": 3e-2}.get(LAYER[name].get("dtype", ""), 1e-5)
    for rank, res in enumerate(results):
        assert name in res, f"rank {rank} never ran {name}: {res}"
        got = res[name]
        assert "error" not in got, f"rank {rank}: {got['traceback']}"
        assert got["scale"] > 0.1  # the output is not trivially small
        assert max(got["diffs"].values()) < tol, (rank, got["diffs"])
        assert got["counted"] == got["expected"], (rank, got)


@pytest.mark.parametrize("name", list(LAYER))
def test_two_ranks_equal_whole_sequence_attention(two_ranks: list[dict[str, Any]], name: str) -> None:
    _check(two_ranks, name)


@pytest.mark.parametrize("name", list(LAYER))
def test_four_ranks_equal_whole_sequence_attention(four_ranks: list[dict[str, Any]], name: str) -> None:
    _check(four_ranks, name)


@pytest.mark.parametrize("name", list(CHAINS))
def test_chains_switched_to_ring_send_the_formula_elements(two_ranks: list[dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(two_ranks):
        assert "error" not in res[name], f"rank {rank}: {res[name]['traceback']}"
        assert res[name]["counted"] == res[name]["expected"] and res[name]["counted"][0] > 0, (rank, res[name])


def test_the_counter_formula_and_the_balanced_layout() -> None:
    # cp 2, causal: k and v once round the ring (forward), again plus dk and dv twice (backward); each rank keeps
    # one of its two query chunks and sends the other (q and out forward, dout and dq backward)
    b, s, hq, hk, d = 2, 16, 4, 2, 8
    kv, chunk = b * hk * (s // 2) * d, b * hq * (s // 4) * d
    for r in (0, 1):
        assert ring.ring_elements(rank=r, cp=2, batch=b, seq_len=s, heads=hq, kv_heads=hk, head_dim=d,
                                  causal=True) == (2 * kv + 2 * chunk, 2 * kv + 4 * kv + 2 * chunk)
    assert ring.ring_elements(rank=0, cp=2, batch=b, seq_len=s, heads=hq, kv_heads=hk, head_dim=d,
                              causal=False) == (2 * kv, 6 * kv)
    assert ring.ring_elements(rank=0, cp=1, batch=b, seq_len=s, heads=hq, kv_heads=hk, head_dim=d,
                              causal=True) == (0, 0)
    # head and tail: rank r holds query chunks r and 2c-1-r, so every rank computes 2c+1 causal chunk pairs
    for c in (2, 3, 4, 8):
        owners = [ring.zigzag_owner(j, c) for j in range(2 * c)]
        assert sorted(owners) == sorted(list(range(c)) * 2)
        work = [sum(j + 1 for j in range(2 * c) if owners[j] == r) for r in range(c)]
        assert work == [2 * c + 1] * c, work
    # at cp 4 ranks 1 and 3 send both their chunks, ranks 0 and 2 one (the other stays)
    assert [ring.zigzag_sent(r, 4) for r in range(4)] == [1, 2, 1, 2]


def test_ring_length_and_dropout_are_refused_in_one_line() -> None:
    import torch

    from uniap_lightning.adapters.gpt import GPT, GPTConfig
    from uniap_lightning.runtime.sequence import check_sequence_strategy

    with pytest.raises(UniAPError, match=r"ring attention needs the sequence length 12 divisible by 8"):
        ring.check_ring(seq_len=12, cp=4)
    ring.check_ring(seq_len=12, cp=4, causal=False)
    ring.check_ring(seq_len=16, cp=4)
    # ring has no heads condition (Ulysses would refuse 3 heads over cp 2)
    block = GPT(GPTConfig(vocab_size=16, block_size=8, n_head=3, n_embd=24)).blocks[0]
    check_sequence_strategy(block, "b", cp=2, cp_method="ring", tp=1, sp=False)
    with pytest.raises(UniAPError, match=r"divisible by cp=2"):
        check_sequence_strategy(block, "b", cp=2, cp_method="ulysses", tp=1, sp=False)
    dropping = GPT(GPTConfig(vocab_size=16, block_size=8, n_head=4, n_embd=32, dropout=0.1)).blocks[0]
    with pytest.raises(UniAPError, match=r"ring attention does not run attention dropout \(p=0.1\)") as err:
        check_sequence_strategy(dropping, "b", cp=2, cp_method="ring", tp=1, sp=False)
    assert "\n" not in str(err.value)
    x = torch.zeros(1, 2, 4, 8)  # the attention itself refuses it too, before any exchange
    with pytest.raises(UniAPError, match=r"ring attention does not run attention dropout \(p=0.1\)"):
        ring.ring_attention(x, x, x, None, dropout_p=0.1)


def test_hf_attention_dropout_is_found_in_the_config() -> None:
    from transformers import BertConfig, BertForMaskedLM

    from uniap_lightning.adapters.families.text import bert_layers
    from uniap_lightning.runtime.sequence import attention_dropout, check_sequence_strategy

    cfg = BertConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=8, attention_probs_dropout_prob=0.2)
    block = bert_layers(BertForMaskedLM(cfg))[1][0]
    assert attention_dropout(block) == pytest.approx(0.2)
    with pytest.raises(UniAPError, match="p=0.2"):
        check_sequence_strategy(block, "bert.encoder.layer.0", cp=2, cp_method="ring", tp=1, sp=False)


def test_ring_plans_need_twice_cp_in_the_sequence() -> None:
    from uniap_lightning.runtime.sequence import sequence_multiple

    plan = h.make_plan([{"cp": 2, "cp_method": "ring"}, {"cp": 2}, {"dp": 2}, {"cp": 2}], [0] * 4, pp=1,
                       microbatches=1, world=2, names=["chain.0", "chain.1", "chain.2", "chain.3"], batch=4)
    assert sequence_multiple(plan) == 4


def test_the_planner_offers_ring_where_the_cluster_runs_it(tmp_path: Any) -> None:
    """The measured CPU cluster and the shipped one offer ring; a cluster file with ``ring_attention: false`` not.
    What the planner offers, the runtime accepts (its methods and the plan checks)."""
    from dataclasses import replace

    from uniap_lightning.adapters.gpt import GPT, GPTConfig
    from uniap_lightning.planner.config import cluster_from
    from uniap_lightning.planner.cost.layer import cp_methods
    from uniap_lightning.planner.profile import LayerProfile
    from uniap_lightning.runtime.planning import local_cluster
    from uniap_lightning.runtime.sequence import CP_METHODS, check_sequence_strategy

    layer = LayerProfile(name="a", forward_s=1e-3, backward_s=2e-3, params=10, activation_bytes=1.0,
                         output_bytes=1.0, sequence_length=16, attention_heads=3)
    cpu = local_cluster(nodes=1, devices_per_node=2, device_type="cpu")
    shipped = cluster_from("local_cpu")
    for cluster in (cpu, shipped):
        assert cp_methods(layer, 2, 1, cluster) == ("ring",)  # 3 heads: Ulysses cannot split them
    off = tmp_path / "off.yaml"
    off.write_text("name: ring-off\nnodes: 1\ndevices_per_node: 2\nmemory_gib: 4\npeak_tflops: 1\n"
                   "ring_attention: false\n")
    assert cp_methods(layer, 2, 1, cluster_from(str(off))) == ()
    assert cp_methods(replace(layer, attention_heads=4), 2, 1, cluster_from(str(off))) == ("ulysses",)
    assert "ring" in CP_METHODS
    block = GPT(GPTConfig(vocab_size=16, block_size=16, n_head=3, n_embd=24)).blocks[0]
    assert "ring" in block.uniap_cp_methods()
    check_sequence_strategy(block, "chain.1", cp=2, cp_method="ring", tp=1, sp=False)


def test_ring_pricing_adds_the_load_balance_all_to_alls() -> None:
    from dataclasses import replace

    from uniap_lightning.planner.cost.comm import all_to_all_s, p2p_s
    from uniap_lightning.planner.cost.layer import context_parallel_s
    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.planner.profile import LayerProfile
    from uniap_lightning.runtime.planning import local_cluster

    cluster = local_cluster(nodes=1, devices_per_node=4, device_type="cpu")
    layer = LayerProfile(name="a", forward_s=1e-3, backward_s=2e-3, params=10, activation_bytes=1.0,
                         output_bytes=1e6, sequence_length=16, attention_heads=4, kv_heads=2)
    s = Strategy(1, 1, cp=4, cp_method="ring")
    H, kv = 1e6 * 8, 1e6 * 8 / 2
    a2a = 4 * all_to_all_s(cluster, H, 4, False)
    steps = 2 * 3 * p2p_s(cluster, 2 * kv, False) + 4 * p2p_s(cluster, 2 * kv, False)
    assert context_parallel_s(layer, s, 8, cluster, 0.0) == pytest.approx(steps + a2a)
    assert context_parallel_s(layer, s, 8, cluster, 1e9) == pytest.approx(a2a)  # the ring steps hide, not these
    assert context_parallel_s(replace(layer, attention_heads=0), s, 8, cluster, 0.0) == 0.0


def test_the_search_leaves_ring_out_for_a_model_with_attention_dropout() -> None:
    from uniap_lightning.adapters import CausalLMModule, extract_chain
    from uniap_lightning.adapters.gpt import GPT, GPTConfig
    from uniap_lightning.runtime.planning import local_cluster
    from uniap_lightning.setup import _without_ring_if_dropout

    cluster = local_cluster(nodes=1, devices_per_node=2, device_type="cpu")
    for dropout, ring_kept in ((0.0, True), (0.1, False)):
        chain = extract_chain(CausalLMModule(GPT(GPTConfig(vocab_size=16, block_size=8, dropout=dropout)).layers()))
        assert _without_ring_if_dropout(cluster, chain).ring_attention is ring_kept


@pytest.mark.parametrize("causal", [True, False])
def test_the_matmul_path_computes_long_blocks_in_row_chunks_exactly(monkeypatch, causal) -> None:
    """The plain-matmul block (every device but CPU) bounds its scores to ``MATMUL_SCORE_ELEMENTS`` by taking the
    query rows in chunks: with a budget of a few rows, forward, LSE and dq/dk/dv equal the one-chunk results
    (key padding with a row that sees no key, causal diagonal)."""
    import torch

    from uniap_lightning.runtime import ring

    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 3, 12, 4
    q, k, v, do = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(4))
    pos = torch.arange(n)
    key_valid = torch.ones(b, n, dtype=torch.bool)
    key_valid[1, :7] = False
    row_empty = torch.zeros(b, n, dtype=torch.bool)
    row_empty[1, :7] = causal  # causal: rows 0..6 of sample 1 see no valid key
    mask = ring._block_mask(pos, pos, causal, key_valid, row_empty)
    whole = ring._block_forward(q, k, v, mask, 0.5, False)
    big_d = (do * whole[0]).sum(-1)
    whole_grads = ring._block_backward(do, q, k, v, whole[0], whole[1], big_d, mask, 0.5, False)
    monkeypatch.setattr(ring, "MATMUL_SCORE_ELEMENTS", b * h * n * 5)  # 5 rows at a time: chunks 5, 5, 2
    assert [sl.stop for sl in ring._row_chunks(q, n)] == [5, 10, 12]
    chunked = ring._block_forward(q, k, v, mask, 0.5, False)
    chunked_grads = ring._block_backward(do, q, k, v, whole[0], whole[1], big_d, mask, 0.5, False)
    for a, c in zip((*whole, *whole_grads), (*chunked, *chunked_grads)):
        assert torch.allclose(a, c, atol=1e-12, equal_nan=True)
