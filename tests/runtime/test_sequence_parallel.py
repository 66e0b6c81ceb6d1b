"""Sequence parallelism with TP and Ulysses context parallelism (:mod:`uniap_lightning.runtime.sequence`).

Multi-process parity: the plain GPT chain and a tiny Hugging Face Llama chain trained 5 SGD steps on gloo ranks
match one process (loss and every parameter within 1e-5), with and without padding (the padded Llama reference is
the same attention function in one process: the chain has no other padding support); the Ulysses all-to-alls move
the elements the cost formula says; a sequence-parallel block runs the collectives Megatron's pattern says. The
2-rank cases share one spawn; the 4-rank mixes (dp x cp, tp x cp, SP x cp) are marked slow (~25 s).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sequence_workers as sw
import uniap_rt_helpers as h
from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime import sequence as sq

TWO_RANKS = {
    "ulysses_cp2": {"kind": "train", "cp": 2},
    "ulysses_cp2_padded": {"kind": "train", "cp": 2, "padded": True},
    "ulysses_cp2_averaged": {"kind": "train", "cp": 2, "padded": True, "average": True},
    "sp_tp2": {"kind": "train", "tp": 2, "sp": True},
    "sp_tp2_padded": {"kind": "train", "tp": 2, "sp": True, "padded": True},
    "llama_cp2": {"kind": "train", "cp": 2, "model": "llama"},
    "llama_cp2_padded": {"kind": "train", "cp": 2, "model": "llama", "padded": True},
    "llama_sp_tp2": {"kind": "train", "tp": 2, "sp": True, "model": "llama"},
    # BERT masked LM, left- and right-padded, the loss on sequence pieces (labels split with their tokens)
    "bert_cp2_padded": {"kind": "train", "cp": 2, "model": "bert"},
    # ring attention (runtime/ring.py) in the same chains: GPT and Llama (grouped-query) with padding, BERT
    "ring_cp2_padded": {"kind": "train", "cp": 2, "padded": True, "method": "ring"},
    "llama_ring_cp2_padded": {"kind": "train", "cp": 2, "model": "llama", "padded": True, "method": "ring"},
    "bert_ring_cp2_padded": {"kind": "train", "cp": 2, "model": "bert", "method": "ring"},
    "bytes": {"kind": "bytes"},
    "sp_comms": {"kind": "sp_comms"},
    "sp_comms_llama": {"kind": "sp_comms", "model": "llama"},
    "sp_comms_bert": {"kind": "sp_comms", "model": "bert"},
    "bad_heads": {"kind": "bad_heads"},
}
FOUR_RANKS = {
    "dp2_cp2": {"kind": "train", "dp": 2, "cp": 2},
    "dp2_cp2_averaged": {"kind": "train", "dp": 2, "cp": 2, "average": True},
    "tp2_cp2": {"kind": "train", "tp": 2, "cp": 2},
    "sp_tp2_cp2_padded": {"kind": "train", "tp": 2, "cp": 2, "sp": True, "padded": True},
    "llama_sp_tp2_cp2": {"kind": "train", "tp": 2, "cp": 2, "sp": True, "model": "llama"},
    "bert_sp_tp2_cp2": {"kind": "train", "tp": 2, "cp": 2, "sp": True, "model": "bert"},
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return h.spawn(2, TWO_RANKS, tmp_path_factory.mktemp("sequence2"), fn=sw.worker)


def _ok(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    for rank, res in enumerate(results):
        assert name in res, f"rank {rank} never ran {name}: {res}"
        assert "error" not in res[name], f"rank {rank}: {res[name]['traceback']}"
    return [res[name] for res in results]


def _assert_parity(per_rank: list[dict[str, Any]]) -> None:
    for r in per_rank:
        assert r["moved"] > 1e-3  # training changed the weights, so parity is not trivially true
        assert r["loss_diff"] < 1e-5, r
        assert r["param_diff"] < 1e-5, r


@pytest.mark.parametrize("name", [name for name, case in TWO_RANKS.items() if case["kind"] == "train"])
def test_two_ranks_match_one_process(two_ranks: list[dict[str, Any]], name: str) -> None:
    _assert_parity(_ok(two_ranks, name))


def test_ulysses_moves_the_formula_elements(two_ranks: list[dict[str, Any]]) -> None:
    expected = sq.ulysses_elements(seq_len=sw.SEQ, batch=sw.BATCH, hidden=sw.EMBD, cp=2)
    for r in _ok(two_ranks, "bytes"):
        assert r["calls"] == 4 * r["layers"]  # q, k, v in and the output back, per block
        assert r["forward"] == expected * r["layers"]
        assert r["backward"] == r["forward"]
        assert len(set(r["by_call"])) == 1


@pytest.mark.parametrize(("name", "norm_params"), [("sp_comms", 4), ("sp_comms_llama", 2), ("sp_comms_bert", 4)])
def test_sequence_parallel_block_gathers_and_scatters_twice_per_pass(two_ranks: list[dict[str, Any]], name: str,
                                                                     norm_params: int) -> None:
    # Megatron's 2 all-gathers + 2 reduce-scatters per pass (q, k and v share one gather), plus the boundary:
    # the replicated output is all-gathered in the forward, the input's gradient in the backward; and the norm
    # weights' gradients summed over the group (DTensor leaves them partial): GPT's 2 LayerNorms have weight and
    # bias, Llama's 2 RMSNorms a weight; BERT (post-norm: the norms after the residual sums) is GPT's count
    for r in _ok(two_ranks, name):
        assert r["forward"] == {"all_gather_into_tensor": 3, "reduce_scatter_tensor": 2}
        assert r["backward"] == {"all_gather_into_tensor": 3, "reduce_scatter_tensor": 2, "all_reduce": norm_params}
        assert r["norm_grads_replicated"]
        assert r["out_shape"] == r["grad_shape"] == (sw.BATCH, sw.SEQ, sw.EMBD)


def test_heads_not_divisible_by_cp_is_one_clear_line(two_ranks: list[dict[str, Any]]) -> None:
    for r in _ok(two_ranks, "bad_heads"):
        assert r["type"] == "UniAPError"
        assert "\n" not in r["message"]
        assert "3 heads / tp=1 = 3) divisible by cp=2" in r["message"]


@pytest.mark.slow
def test_four_ranks_match_one_process(tmp_path: Any) -> None:
    results = h.spawn(4, FOUR_RANKS, tmp_path, fn=sw.worker)
    for name in FOUR_RANKS:
        _assert_parity(_ok(results, name))


def test_shifted_then_split_batch_keeps_every_pair_on_one_rank() -> None:
    ids = torch.arange(12).reshape(2, 6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    parts = [sq.shard_causal_lm_batch({"input_ids": ids, "attention_mask": mask}, r, 2) for r in range(2)]
    assert parts[1]["input_ids"].tolist() == [[3, 4, 5], [9, 10, 11]]
    assert parts[1]["position_ids"].tolist() == [[3, 4, 5], [3, 4, 5]]
    # rank 0's last target is rank 1's first token; the last position and masked labels are ignored
    assert parts[0]["targets"].tolist() == [[1, 2, 3], [-100, 8, 9]]
    assert parts[1]["targets"].tolist() == [[4, 5, -100], [10, 11, -100]]


def test_bad_degrees_are_refused_in_one_line() -> None:
    with pytest.raises(UniAPError, match=r"heads per tensor-parallel rank \(8 heads / tp=2 = 4\) divisible by cp=3"):
        sq.check_ulysses(heads=8, cp=3, tp=2)
    with pytest.raises(UniAPError, match="sequence length 7 is not divisible by cp=2"):
        sq.split_sequence(torch.zeros(1, 7), 0, 2)
    with pytest.raises(UniAPError, match="'zigzag' is not executable here"):
        sq.enable_context_parallel([], None, method="zigzag")


def test_masked_attention_without_padding_is_plain_causal_sdpa() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    plain = sq.attention(q, k, v, causal=True)
    masked = sq.attention(q, k, v, causal=True, key_valid=torch.ones(2, 8, dtype=torch.bool))
    torch.testing.assert_close(masked, plain, rtol=1e-6, atol=1e-6)
