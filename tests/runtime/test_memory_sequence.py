"""Context parallelism's memory per rank, predicted vs measured (issue 22): the smallest case of
``benchmarks/memory_sequence.py`` (the shipped GPT, 2 blocks, width 64, sequence 128, Ulysses cp 2 on 2 gloo ranks
under ``Trainer(strategy=UniAPStrategy(plan=...))``), and ring attention cp 2. Memory is deterministic: the planner's activations from the
project's own profile are within 15% of what each rank keeps after the forward, and its static bytes (weights,
gradients, AdamW, buckets) within 1%; each block's activations within 1%."""

from __future__ import annotations

from argparse import Namespace

import uniap_rt_helpers as h


def test_cp2_activations_and_static_bytes_per_rank_match_the_planner() -> None:
    args = Namespace(world=2, layers=2, width=64, seq=128, batch=2, plans=["cp2", "cp2_ring"])
    rows = h.benchmark("memory_sequence").run(args)
    assert [(r["plan"], r["rank"]) for r in rows] == [("cp2", 0), ("cp2", 1), ("cp2_ring", 0), ("cp2_ring", 1)]
    for r in rows:
        p = r["predicted"]
        assert r["kept"] > 0 and abs(r["kept"] / p["kept"] - 1) <= 0.15, (r["kept"], p["kept"])
        assert abs(r["static"] / p["static"] - 1) <= 0.01, (r["static"], p["static"])
        # per block (what its forward adds: its output for its input, the same size), within 1%: the planner counts
        # attention's output twice under Ulysses and ring attention (one output more than one process; without it,
        # 6% short here)
        for u in (1, 2):
            assert abs(r["kept_by_layer"][u] / r["predicted_by_layer"][u] - 1) <= 0.01, r
