"""Plans with expert parallelism (``Strategy.ep``) run under ``Trainer(strategy=UniAPStrategy(plan=...))``: the tiny
MoE GPT of :mod:`uniap_lightning.adapters.moe` matches one process (loss and parameters within 1e-5 after 5 steps)
with a capacity that drops no token (``capacity_factor = E / k``), and checkpoints hold the full experts.

The two-process cases share one spawn (:data:`CASES2`); the four-process mixes share another (:data:`CASES4`).
"""

from __future__ import annotations

from typing import Any

import pytest

import uniap_rt_helpers as h

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


CASES2 = {
    "ep2": _case(_plan({"ep": 2})),
}


@pytest.fixture(scope="module")
def two(spawn_cases: Any) -> list[dict[str, Any]]:
    return spawn_cases(2, CASES2, "expert_plans2")


def test_ep2_plan_matches_one_process(two: list[dict[str, Any]]) -> None:
    """ep=2 over the two data ranks: each holds 2 of the 4 experts of each block (replicated embedding and head);
    the expert shards' gradients are not all-reduced (each is held by one rank), divided by the 2 replicas."""
    h.assert_close_to_reference(two, "ep2", h.reference_for(CASES2["ep2"]))


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
