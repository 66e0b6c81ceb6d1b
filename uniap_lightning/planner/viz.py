"""Pictures of a plan (matplotlib, headless): ``uniap plan ... viz=plan.png``.

Four panels: the chain of layers grouped into stages and coloured by strategy (the colour names the split and the
data-parallel mode, e.g. ``z2dp4xtp2``, a compressed layer adds ``+bf16``; recomputed layers are hatched); memory per device per stage
against the limit; a pipeline timeline of one iteration's micro-batches (the bubble is the white space); the
baselines' time per iteration next to the plan's.
"""

from __future__ import annotations

from pathlib import Path

from uniap_lightning.files import write_bytes_atomic
from uniap_lightning.planner.cluster import GIB
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem
from uniap_lightning.planner.report import BASELINE_LABELS


def pipeline_timeline(plan: Plan, backward_share: float = 2 / 3) -> list[tuple[int, float, float, str, int]]:
    """``(stage, start_s, duration_s, "F"|"B", micro_batch)`` blocks of one iteration, from the estimate's
    per-stage times (forward ~1/3, backward ~2/3 of a stage's micro-batch time), ignoring transfers. GPipe runs
    all forwards then all backwards; 1F1B warms up with ``pp - i`` forwards and then alternates."""
    est = plan.estimate
    P, c = plan.pp, plan.microbatches
    fwd = [t * (1 - backward_share) for t in est.stage_time_s]
    bwd = [t * backward_share for t in est.stage_time_s]
    order: list[list[tuple[str, int]]] = []
    for i in range(P):
        if plan.schedule == "gpipe":
            ops = [("F", m) for m in range(c)] + [("B", m) for m in range(c)]
        else:
            warm = min(c, P - i)
            ops = [("F", m) for m in range(warm)]
            f_next, b_next = warm, 0
            while b_next < c:
                ops.append(("B", b_next))
                b_next += 1
                if f_next < c:
                    ops.append(("F", f_next))
                    f_next += 1
        order.append(ops)
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * P
    pos = [0] * P
    blocks = []
    progressed = True
    while progressed:
        progressed = False
        for i in range(P):
            while pos[i] < len(order[i]):
                kind, m = order[i][pos[i]]
                dep = (i - 1, "F", m) if kind == "F" and i > 0 else (i + 1, "B", m) if kind == "B" and i < P - 1 else None
                if kind == "B" and i == P - 1:
                    dep = (i, "F", m)
                if dep is not None and dep not in done:
                    break
                start = max(free[i], done.get(dep, 0.0)) if dep else free[i]
                dur = fwd[i] if kind == "F" else bwd[i]
                done[(i, kind, m)] = start + dur
                free[i] = start + dur
                blocks.append((i, start, dur, kind, m))
                pos[i] += 1
                progressed = True
    return blocks


def draw_plan(plan: Plan, problem: Problem, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    est = plan.estimate
    fig, axes = plt.subplots(2, 2, figsize=(15, 9), gridspec_kw={"height_ratios": [1, 1.2]})
    fig.suptitle(
        f"UniAP plan: {plan.model} on {plan.cluster} ({plan.num_devices} devices), batch {plan.global_batch_size}, "
        f"pp={plan.pp}, {plan.microbatches} micro-batches ({plan.schedule}) - predicted {est.tpi_s * 1e3:,.1f} ms/iter, "
        f"{est.samples_per_s:,.1f} samples/s",
        fontsize=11,
    )
    def label(lp) -> str:  # recomputation is drawn as hatching, not a colour of its own
        return lp.strategy._replace(recompute=False).label()

    labels = sorted({label(lp) for lp in plan.layers})
    cmap = plt.get_cmap("tab10")
    colour = {lab: cmap(j % 10) for j, lab in enumerate(labels)}

    ax = axes[0, 0]
    for u, lp in enumerate(plan.layers):
        ax.barh(lp.stage, 1, left=u, color=colour[label(lp)], edgecolor="white", lw=0.3,
                hatch="///" if lp.strategy.recompute else None)
    ax.set_yticks(range(plan.pp), [f"stage {i}\nranks {s.ranks[0]}-{s.ranks[-1]}" for i, s in enumerate(plan.stages)],
                  fontsize=7 if plan.pp > 8 else 9)
    ax.invert_yaxis()
    ax.set_xlabel("layer index along the chain")
    ax.set_title("Layers grouped into stages, coloured by strategy")
    handles = [Patch(color=colour[lab], label=lab) for lab in labels]
    if any(lp.strategy.recompute for lp in plan.layers):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="recomputed"))
    ax.legend(handles=handles, fontsize=8, loc="lower right")

    ax = axes[0, 1]
    mem = [m / GIB for m in est.stage_memory_bytes]
    limit = est.memory_limit_bytes / GIB
    ax.bar(range(plan.pp), mem, color=["tab:red" if m > limit else "tab:blue" for m in mem])
    ax.axhline(limit, color="black", ls="--", lw=1)
    ax.text(plan.pp - 0.5, limit, f" limit {limit:.1f} GiB", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(plan.pp))
    ax.set_xlabel("stage")
    ax.set_ylabel("GiB per device")
    ax.set_title("Predicted memory per device per stage")

    ax = axes[1, 0]
    blocks = pipeline_timeline(plan)
    for i, start, dur, kind, m in blocks:
        ax.barh(i, dur * 1e3, left=start * 1e3, color="tab:green" if kind == "F" else "tab:orange", edgecolor="black", lw=0.3)
        if plan.microbatches <= 16 and plan.pp <= 16:
            ax.text((start + dur / 2) * 1e3, i, str(m), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(plan.pp))
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_ylabel("stage")
    ax.set_title("One iteration: forward (green) / backward (orange) per micro-batch; white = bubble")

    ax = axes[1, 1]
    names = ["UniAP plan"] + [BASELINE_LABELS.get(k, k) for k in plan.baselines]
    values = [est.tpi_s] + [v if v is not None else 0.0 for v in plan.baselines.values()]
    bars = ax.barh(names, [v * 1e3 for v in values], color=["tab:green"] + ["tab:gray"] * len(plan.baselines))
    for bar, v in zip(bars[1:], list(plan.baselines.values())):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                " does not fit" if v is None else f" {v / est.tpi_s:.2f}x", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per iteration (lower is better)")
    ax.set_title("Plan vs baselines (same cost model)")

    fig.tight_layout()
    out = write_bytes_atomic(path, lambda f: fig.savefig(f, dpi=110, format=Path(path).suffix.lstrip(".") or "png"))
    plt.close(fig)
    return out
