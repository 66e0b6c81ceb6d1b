"""The plan's tables (issue 42 item 6): where candidates of several schedules appear a schedule column says which,
``CHOSEN`` marks exactly one row, and the chosen row shows the chosen plan's own time (and bubble)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.report import candidates_table, explain_renderables, schedule_table
from uniap_lightning.planner.solver import solve


def _text(renderable) -> str:
    out = io.StringIO()
    Console(file=out, width=250, color_system=None).print(renderable)
    return out.getvalue()


def _rows(text: str, title: str) -> list[list[str]]:
    """The body rows of the table titled ``title`` (cells stripped)."""
    lines = text[text.index(title):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┡")) + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith("│"):
            break
        rows.append([c.strip() for c in line.strip("│").split("│")])
    return rows


def _header(text: str, title: str) -> list[str]:
    line = next(line for line in text[text.index(title):].splitlines() if line.startswith("┃"))
    return [c.strip() for c in line.strip("┃").split("┃")]


@pytest.fixture(scope="module")
def solved():
    problem = build_problem(model="tiny_gpt", cluster="a100_1x8")
    return problem, solve(problem, time_limit_s=60.0)


def _incumbent_from_a_baseline(plan):
    """The plan as a search whose incumbent came from a baseline leaves it: the chosen candidate's record holds a
    bound and "no better plan (infeasible)", no time (`uniap plan model=llama_7b cluster=h100_4x8 batch_size=64`)."""
    rows = []
    for r in plan.search:
        if (r["pp"], r["microbatches"], r.get("schedule"), r.get("virtual_stages")) == (
                plan.pp, plan.microbatches, plan.schedule, plan.virtual_stages):
            r = {**r, "outcome": "no better plan (infeasible)", "tpi_s": None, "bubble_s": None,
                 "bound_s": plan.estimate.tpi_s}
        rows.append(r)
    return plan.with_report(search=rows)


def test_the_search_priced_several_schedules(solved):
    _, plan = solved
    assert len({r.get("schedule") for r in plan.search}) > 1


@pytest.mark.parametrize("from_baseline", [False, True])
def test_explain_marks_one_candidate_chosen_with_its_schedule_and_time(solved, from_baseline):
    problem, plan = solved
    if from_baseline:
        plan = _incumbent_from_a_baseline(plan)
    text = _text(explain_renderables(plan, problem))
    title = "Why the other (pp, micro-batches, schedule) candidates lost"
    header = _header(text, title)
    assert "schedule" in header
    rows = [dict(zip(header, r)) for r in _rows(text, title)]
    assert len(rows) == len(plan.search)
    chosen = [r for r in rows if r["outcome"] == "CHOSEN"]
    assert len(chosen) == 1, chosen
    assert chosen[0]["schedule"] == plan.schedule
    assert (int(chosen[0]["pp"]), int(chosen[0]["micro-batches"])) == (plan.pp, plan.microbatches)
    assert chosen[0]["ms / iteration"] == f"{plan.estimate.tpi_s * 1e3:,.2f}"
    assert {r["schedule"] for r in rows} == {r.get("schedule") for r in plan.search}


@pytest.mark.parametrize("from_baseline", [False, True])
def test_schedule_table_fills_the_chosen_row(solved, from_baseline):
    _, plan = solved
    if from_baseline:
        plan = _incumbent_from_a_baseline(plan)
    text = _text(schedule_table(plan))
    header = _header(text, "Schedules")
    rows = [dict(zip(header, r)) for r in _rows(text, "Schedules")]
    chosen = [r for r in rows if r["search"] == "CHOSEN"]
    assert len(chosen) == 1, rows
    row = chosen[0]
    assert (row["schedule"], int(row["v"])) == (plan.schedule, plan.virtual_stages)
    assert row["ms / iteration"] == f"{plan.estimate.tpi_s * 1e3:,.2f}"
    assert re.fullmatch(r"[\d,.]+ \(\d+%\)", row["bubble ms (share)"]), row


def test_a_chosen_plan_the_search_has_no_row_for_gets_one(solved):
    _, plan = solved
    others = [r for r in plan.search if (r["pp"], r["microbatches"], r.get("schedule")) != (
        plan.pp, plan.microbatches, plan.schedule)]
    text = _text(candidates_table(plan.with_report(search=others)))
    rows = _rows(text, "Why the other")
    assert len(rows) == len(others) + 1
    assert sum(1 for r in rows if "CHOSEN" in r) == 1


def test_one_schedule_needs_no_schedule_column(solved):
    _, plan = solved
    mine = [r for r in plan.search if r.get("schedule") == plan.schedule]
    text = _text(candidates_table(plan.with_report(search=mine)))
    assert "schedule" not in _header(text, "Why the other (pp, micro-batches) candidates lost")
    assert sum(1 for r in _rows(text, "Why the other") if "CHOSEN" in r) == 1
