"""Readable plan output (rich tables): stages, per-layer strategies folded into ranges, memory, baselines."""

from __future__ import annotations

import os

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from uniap_lightning.planner import dimensions
from uniap_lightning.planner.cluster import GIB
# the report's words for each dp_mode (with the data dimension now), named here too, where callers found them
from uniap_lightning.planner.dimensions.data import DP_MODE_LABELS  # noqa: F401
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.cost.evaluate import bubble_s
from uniap_lightning.planner.cost.tables import CandidateCosts

BASELINE_LABELS = {
    "ddp": "DDP (pp=1, replicate everything)",
    "zero2": "DDP + ZeRO-2 (pp=1, + recompute where needed to fit)",
    "fsdp": "FSDP / ZeRO-3 (pp=1)",
    "megatron": "best uniform Megatron grid (full recomputation if nothing fits without)",
    "intra_only": "intra-layer only (pp=1)",
    "inter_only": "inter-layer only (pipeline + DP)",
}


def schedule_table(plan: Plan) -> Table | None:
    """Per schedule and virtual stages the search priced: its best predicted time, the bubble that plan leaves on
    its busiest device group, and how the search ended for it (None when the search priced one schedule only).
    The chosen plan's row is marked ``CHOSEN`` (once) and shows the chosen plan's own time and bubble: its search
    record may hold none (the incumbent came from a baseline, so the solve for that candidate found "no better
    plan")."""
    chosen = (plan.schedule, plan.virtual_stages)
    best: dict[tuple[str, int], dict] = {}
    for r in plan.search:
        # a row without a schedule (a plan file before format 3, or a candidate the time limit left) is the plan's
        key = chosen if r.get("schedule") is None else (str(r["schedule"]), int(r.get("virtual_stages", 1)))
        cur = best.setdefault(key, {"tpi_s": None, "bound_s": None, "bubble_s": None, "outcomes": set()})
        cur["outcomes"].add(str(r.get("outcome", "")))
        tpi, bound = r.get("tpi_s"), r.get("bound_s")
        if tpi is not None and (cur["tpi_s"] is None or tpi < cur["tpi_s"]):
            cur["tpi_s"], cur["bubble_s"] = tpi, r.get("bubble_s")
        if bound is not None and (cur["bound_s"] is None or bound < cur["bound_s"]):
            cur["bound_s"] = bound
    if len(best) < 2:
        return None
    if plan.estimate is not None:  # the chosen row: the chosen plan itself
        mine = best.setdefault(chosen, {"tpi_s": None, "bound_s": None, "bubble_s": None, "outcomes": set()})
        mine["tpi_s"], mine["bubble_s"] = plan.estimate.tpi_s, bubble_s(plan)
    table = Table(title="Schedules (best candidate of each; same cost model)", title_justify="left")
    for col in ("schedule", "v", "ms / iteration", "bubble ms (share)", "lower bound ms", "search"):
        table.add_column(col, justify="left" if col in ("schedule", "search") else "right")
    for (name, v), cur in sorted(best.items(), key=lambda kv: (kv[0] != chosen, kv[1]["tpi_s"] is None,
                                                               kv[1]["tpi_s"] or kv[1]["bound_s"] or 0.0)):
        tpi, bubble = cur["tpi_s"], cur["bubble_s"]
        share = f"{bubble * 1e3:,.2f} ({bubble / tpi:.0%})" if tpi and bubble is not None else "-"
        outcome = "CHOSEN" if (name, v) == chosen else ", ".join(sorted(o for o in cur["outcomes"] if o))
        table.add_row(name, str(v), _ms(tpi) if tpi is not None else "-", share,
                      _ms(cur["bound_s"]) if cur["bound_s"] is not None else "-", outcome)
    return table


def _ms(s: float) -> str:
    return f"{s * 1e3:,.2f}"


def _range(names: list[str], first: int, last: int) -> str:
    return names[first] if first == last else f"{names[first]} .. {names[last]} ({last - first + 1})"


def plan_renderables(plan: Plan, *, title: str | None = None) -> Group:
    est = plan.estimate
    names = [lp.name for lp in plan.layers]
    head = Text()
    head.append(title or f"UniAP plan: {plan.model or 'model'} on {plan.cluster or 'cluster'}", style="bold")
    head.append(
        f"\n{plan.num_devices} devices, global batch {plan.global_batch_size} = {plan.microbatches} micro-batches "
        f"x {plan.micro_batch_size}, pp={plan.pp} ({plan.devices_per_stage} devices per stage), "
        f"schedule {plan.schedule}"
        + (f" with {plan.virtual_stages} stages per device ({plan.num_stages} pipeline stages)"
           if plan.virtual_stages > 1 else "")
    )
    if est is not None:
        head.append(
            f"\npredicted: {_ms(est.tpi_s)} ms per iteration, {est.samples_per_s:,.1f} samples/s, "
            + ("fits memory" if est.feasible else "DOES NOT FIT memory"),
            style="green" if est.feasible else "red bold",
        )

    several = plan.virtual_stages > 1  # a row per device group, listing its stages
    stages = Table(title="Device groups and their stages" if several else "Stages", title_justify="left",
                   show_lines=False)
    for col in ("group: stages" if several else "stage", "layers", "ranks", "strategies", "time/µbatch ms",
                "sync ms", "memory GiB / limit"):
        stages.add_column(col, justify="right" if "ms" in col or "GiB" in col else "left")
    runs = plan.strategy_runs()
    for g in range(plan.pp):
        mine = plan.stages_of_group(g)
        strat = ", ".join(
            f"{lp.strategy.label()}" + (f" [{names[a]}..{names[b]}]" if a != b else f" [{names[a]}]")
            for a, b, lp in runs
            if lp.stage in mine
        )
        mem = ""
        t = sync = ""
        if est is not None:
            used = est.stage_memory_bytes[g]
            limit = (est.stage_memory_limit_bytes or [est.memory_limit_bytes] * plan.pp)[g]
            style = "red" if used > limit else ("yellow" if used > 0.9 * limit else "green")
            mem = f"[{style}]{used / GIB:,.2f} / {limit / GIB:,.1f} ({used / limit:.0%})[/{style}]"
            t, sync = _ms(est.stage_time_s[g]), _ms(est.stage_sync_s[g])
        ranks_g = plan.ranks_of_group(g)
        ranks = f"{ranks_g[0]}-{ranks_g[-1]}" if len(ranks_g) > 1 else str(ranks_g[0])
        if est is not None and est.stage_device:
            ranks += f" ({est.stage_device[g]})"
        label = f"{g}: " + ", ".join(map(str, mine)) if several else str(g)
        spans = "; ".join(_range(names, *plan.stages[k].layers) for k in mine)
        stages.add_row(label, spans, ranks, strat, t, sync, mem)

    layers = Table(title="Per-layer strategy (consecutive equal layers folded)", title_justify="left")
    # each dimension's columns (a conditional one, say the sequence columns, only where some layer needs it)
    columns = dimensions.report_columns([lp.strategy for lp in plan.layers])
    for col in ("layers", "stage", *(c.header for c in columns)):
        layers.add_column(col)
    for a, b, lp in runs:
        layers.add_row(_range(names, a, b), str(lp.stage), *(c.cell(lp.strategy) for c in columns))

    parts = [head, stages, layers]
    schedules = schedule_table(plan)
    if schedules is not None:
        parts.append(schedules)
    if plan.baselines and est is not None:
        base = Table(title="Baselines (same cost model)", title_justify="left")
        for col in ("baseline", "ms / iteration", "samples/s", "plan speed-up"):
            base.add_column(col, justify="left" if col == "baseline" else "right")
        for key, tpi in plan.baselines.items():
            label = BASELINE_LABELS.get(key, key)
            if tpi is None:
                base.add_row(label, "[red]does not fit[/red]", "-", "-")
            else:
                base.add_row(label, _ms(tpi), f"{plan.global_batch_size / tpi:,.1f}" if tpi > 0 else "-",
                             f"{tpi / est.tpi_s:.2f}x" if est.tpi_s > 0 else "-")
        parts.append(base)
    if plan.solver is not None:
        s = plan.solver
        gap = "-" if s.gap is None else f"{s.gap:.2%}"
        parts.append(
            Text(
                f"solver: {s.name}, {s.status}, MIP gap {gap}, {s.solve_s:.2f} s; (pp, c) candidates: "
                f"{s.candidates}, solved {s.solved}, pruned by bound {s.pruned}",
                style="dim",
            )
        )
    return Group(*parts)


#: columns for output that is not a terminal (logs, CI, SLURM files, sweeps): rich would use 80 and cut the plan's
#: columns to "time/µbat…"; a log has room for every column
LOG_WIDTH = 220


def make_console(*, stderr: bool = False, **kw) -> Console:
    """A rich console: the terminal's width on a terminal; elsewhere :data:`LOG_WIDTH` columns (unless ``COLUMNS``
    says otherwise), so tables written to a file or pipe are whole."""
    console = Console(stderr=stderr, **kw)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=stderr, width=LOG_WIDTH, **kw)
    return console


def print_plan(plan: Plan, *, console: Console | None = None, title: str | None = None) -> None:
    (console or make_console()).print(plan_renderables(plan, title=title))


def explain_renderables(plan: Plan, problem, measured: dict | None = None) -> Group:
    """Per layer and per stage: strategy, predicted time and memory, measured where known; and why the other
    (pp, c) candidates lost."""
    est = plan.estimate
    costs = CandidateCosts(problem, plan.pp, plan.microbatches, schedule=plan.schedule,
                           virtual_stages=plan.virtual_stages, compression_options=plan.compression_options)
    layers = Table(title="Per layer (predicted, one device, one micro-batch)", title_justify="left")
    modes = dimensions.explain_columns()  # the dimensions' mode columns (a name: left-justified, a flag: right)
    left = {"layer", "strategy", *(c.header for c in modes if c.explain_left)}
    for col in ("#", "layer", "stage", "strategy", *(c.header for c in modes), "compute ms", "comm ms",
                "sync ms / iter", "state MiB", "activations MiB", "transient MiB"):
        layers.add_column(col, justify="left" if col in left else "right")
    for u, lp in enumerate(plan.layers):
        s = lp.strategy
        c = costs.terms(u, s)
        F = costs.in_flight(lp.stage)
        layers.add_row(str(u), lp.name, str(lp.stage), s.label(), *(m.explain(s) for m in modes),
                       _ms(c.compute_s), _ms(c.comm_s), _ms(c.sync_s), f"{c.static_bytes / 2**20:,.1f}",
                       f"{F * c.activation_bytes / 2**20:,.1f} ({F} in flight)", f"{c.transient_bytes / 2**20:,.1f}")
    stages = Table(title="Per stage: predicted vs measured", title_justify="left")
    for col in ("stage", "predicted ms / µbatch", "measured ms / µbatch", "predicted GiB", "measured peak GiB"):
        stages.add_column(col, justify="right")
    m_time = (measured or {}).get("stage_time_s") or []
    m_mem = (measured or {}).get("stage_peak_memory_bytes") or []
    for i in range(plan.pp):
        stages.add_row(
            str(i), _ms(est.stage_time_s[i]), _ms(m_time[i]) if i < len(m_time) and m_time[i] is not None else "-",
            f"{est.stage_memory_bytes[i] / GIB:,.2f}",
            f"{m_mem[i] / GIB:,.2f}" if i < len(m_mem) and m_mem[i] is not None else "-",
        )
    legend = Text(
        "a stage holds: state (weights, gradients, optimizer state as its dp mode shards them, buckets, error "
        "feedback) + micro-batches in flight x activations (a recomputed layer keeps only its input) + the largest "
        "transient (a ZeRO-3 layer's gathered weights, a recomputed layer's activations while it recomputes, NCCL's "
        "buffers for the layer's communicators); "
        "sync / iter: gradient all-reduce (or its compressed form), ZeRO-1/2 reduce-scatter and parameter "
        "all-gather, the optimizer step", style="dim")
    parts = [layers, legend, stages]
    if measured and measured.get("tpi_s") and est.tpi_s > 0:
        err = (measured["tpi_s"] - est.tpi_s) / est.tpi_s
        parts.append(Text(f"time per iteration: predicted {_ms(est.tpi_s)} ms, measured {_ms(measured['tpi_s'])} ms "
                          f"({err:+.1%})"))
    if plan.search:
        parts.append(candidates_table(plan))
    return Group(*parts)


def candidates_table(plan: Plan) -> Table:
    """Why the other candidates lost: one row per candidate the search priced (pp, micro-batches and, where the
    search priced several, schedule and virtual stages), best first. The chosen plan's row is marked ``CHOSEN``
    exactly once and shows the chosen plan's time (its search record may hold only a bound: the incumbent came
    from a baseline); a chosen plan the search has no row for (a baseline's shape) gets one."""
    est = plan.estimate
    chosen_key = (plan.pp, plan.microbatches, plan.schedule, plan.virtual_stages)

    def shape(r: dict) -> tuple:
        return (r["pp"], r["microbatches"], r.get("schedule", plan.schedule), r.get("virtual_stages", 1)
                if r.get("schedule") is not None else plan.virtual_stages)

    rows = list(plan.search)
    at = next((i for i, r in enumerate(rows) if shape(r) == chosen_key), None)
    if at is None:
        rows.append({"pp": plan.pp, "microbatches": plan.microbatches, "schedule": plan.schedule,
                     "virtual_stages": plan.virtual_stages, "outcome": "", "tpi_s": None, "bound_s": None})
        at = len(rows) - 1
    if est is not None:
        rows[at] = {**rows[at], "tpi_s": est.tpi_s}
    schedules = {(r.get("schedule"), r.get("virtual_stages")) for r in rows if r.get("schedule") is not None}
    several = len(schedules) > 1
    with_v = several and len({v for _, v in schedules}) > 1
    what = "pp, micro-batches, schedule" if several else "pp, micro-batches"
    table = Table(title=f"Why the other ({what}) candidates lost", title_justify="left")
    cols = ("pp", "micro-batches", *(("schedule",) if several else ()), *(("v",) if with_v else ()), "outcome",
            "ms / iteration", "vs chosen")
    for col in cols:
        table.add_column(col, justify="left" if col in ("outcome", "schedule") else "right")

    def key(item):
        r = item[1]
        v = r.get("tpi_s") if r.get("tpi_s") is not None else r.get("bound_s")
        return (v is None, v or 0.0, item[0] != at)

    for i, r in sorted(enumerate(rows), key=key):
        chosen = i == at
        if r.get("tpi_s") is not None:
            value = _ms(r["tpi_s"])
            vs = f"{r['tpi_s'] / est.tpi_s - 1:+.1%}" if est is not None and est.tpi_s > 0 else "-"
        elif r.get("bound_s") is not None:
            value = f">= {_ms(r['bound_s'])}"
            vs = f">= {r['bound_s'] / est.tpi_s - 1:+.1%}" if est is not None and est.tpi_s > 0 else "-"
        else:
            value, vs = "-", "-"
        outcome = "CHOSEN" if chosen else r["outcome"]
        if not chosen and r["outcome"] == "does not fit" and r.get("memory_bound_bytes") is not None:
            outcome += f" (needs >= {r['memory_bound_bytes'] / GIB:,.1f} GiB)"  # absent in a hand-made file
        sched = (r.get("schedule") or "any",) if several else ()  # "any": a candidate the time limit left unpriced
        v = (str(r.get("virtual_stages", "-")) if r.get("schedule") is not None else "-",) if with_v else ()
        table.add_row(str(r["pp"]), str(r["microbatches"]), *sched, *v, outcome, value, "" if chosen else vs)
    return table
