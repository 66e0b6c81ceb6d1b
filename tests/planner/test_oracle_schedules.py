"""Schedules and virtual stages in the exact search: for every schedule the planner prices, the MILP's optimum of a
candidate equals brute force over every split into ``pp * v`` stages and every strategy of every layer (seeded,
small instances), and the whole search (``schedule="auto"``) finds the best of all of them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from bruteforce_pipeline import assert_milp_equals_brute_force, brute_force_all
from planner_factories import random_problem

from uniap_lightning.planner.cost.tables import CostTables
from uniap_lightning.planner.solver import search

# (seed, layers, nodes, devices per node, memory GiB): 2 and 4 devices, memory from loose to binding
CASES = [(0, 5, 1, 2, 40.0), (1, 4, 1, 4, 40.0), (2, 5, 1, 2, 4.0), (3, 4, 2, 2, 4.0), (4, 6, 1, 2, 8.0),
         (5, 4, 1, 4, 1.0)]
#: the default run checks two shapes (loose memory on 2 devices, binding memory on 2 x 2); the rest run with -m slow
DEFAULT_CASES = {0, 3}


def _cases(cases):
    return [c if c[0] in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow) for c in cases]


def _problem(seed, layers, nodes, per_node, memory, schedule="auto"):
    p = random_problem(seed, num_layers=layers, nodes=nodes, per_node=per_node, memory_gib=memory)
    # measured weight-gradient shares and split overheads on some layers, so zero-bubble pricing sees more than
    # the defaults
    model = p.model
    model = replace(model, layers=[replace(lp, weight_grad_fraction=(0.2 + 0.1 * u) if u % 2 else None,
                                           backward_split_overhead=(1.1 + 0.05 * u) if u % 3 else None)
                                   for u, lp in enumerate(model.layers)])
    return replace(p, model=model, training=replace(p.training, schedule=schedule, max_virtual_stages=3))


def _candidates(problem):
    for pp in problem.pp_candidates():
        if pp == 1:
            continue
        for c in problem.training.microbatch_candidates():
            for schedule, v in problem.training.schedule_candidates(pp, c, problem.model.num_layers):
                yield pp, c, schedule, v


@pytest.mark.parametrize("case", _cases(CASES), ids=lambda c: f"seed{c[0]}-L{c[1]}-{c[2]}x{c[3]}-{c[4]}G")
def test_each_schedule_candidate_milp_equals_brute_force(case):
    problem = _problem(*case)
    seen = set()
    for pp, c, schedule, v in _candidates(problem):
        seen.add((schedule, v))
        assert_milp_equals_brute_force(problem, pp, c, schedule, v)
    assert len(seen) >= 2  # more than GPipe/1F1B priced


@pytest.mark.parametrize("case", _cases(CASES[:4]), ids=lambda c: f"seed{c[0]}")
def test_auto_search_finds_the_best_schedule(case):
    problem = _problem(*case)
    oracle = brute_force_all(problem)
    plan = search(problem, solver="cbc", time_limit_s=120, workers=1)
    assert plan.solver.status == "optimal"
    assert plan.estimate.tpi_s == pytest.approx(oracle.estimate.tpi_s, rel=1e-6)
    assert {(r["schedule"], r["virtual_stages"]) for r in plan.search} >= {("1f1b", 1)}


def test_split_schedules_pay_the_profiled_overhead_and_the_others_do_not() -> None:
    """``backward_split_overhead`` r: a layer's backward costs r times as much under a zero-bubble schedule (its W
    is the share of that slower backward); GPipe and 1F1B run the backward whole and pay nothing."""
    base = random_problem(0, num_layers=4, nodes=1, per_node=2, memory_gib=40.0)
    over = replace(base, model=replace(base.model, layers=[
        replace(lp, backward_split_overhead=1.3, weight_grad_fraction=0.4) for lp in base.model.layers]))
    plain = replace(base, model=replace(base.model, layers=[replace(lp, weight_grad_fraction=0.4)
                                                            for lp in base.model.layers]))
    for sched in ("1f1b", "zb_h1"):
        t_over = CostTables(over, 2, 4, schedule=sched)
        t_plain = CostTables(plain, 2, 4, schedule=sched)
        for u in range(1, 4):
            s = t_plain.strategies[u][0]
            a, b = t_over.terms(u, s), t_plain.terms(u, s)
            backward = b.compute_s * (1 - base.model.layers[u].forward_fraction)
            assert a.split_extra_s == pytest.approx(0.3 * backward) and b.split_extra_s == 0.0
            assert a.weight_grad_s == pytest.approx(1.3 * b.weight_grad_s)  # W of the slower split backward
            extra = a.split_extra_s if sched == "zb_h1" else 0.0
            assert t_over.layer_time_s(0, a) == pytest.approx(t_plain.layer_time_s(0, b) + extra)
