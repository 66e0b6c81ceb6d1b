"""Pictures of a plan (matplotlib, headless): ``uniap plan ... viz=plan.png``.

Four panels:

1. the chain of layers on the device groups that run them, coloured by strategy (the colour names the split and the
   data-parallel mode, e.g. ``z2dp4xtp2``, ``dp2xcp2uxtp2+sp``, ``dp8+ep4``; a compressed layer adds ``+bf16``;
   recomputed layers are hatched); with virtual stages a group runs several pipeline stages, marked ``S0``, ``S1``..
   along the chain; a key under the legend spells out the abbreviations the plan uses;
2. memory per device per group against its limit;
3. one iteration's timeline: the schedule's own action order (torch's ``pipeline_order`` for the multi-chunk and
   zero-bubble schedules) played with the cost model's per-stage times (forward, backward, weight gradient,
   hand-offs): the white space is the bubble;
4. the baselines' time per iteration next to the plan's.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from uniap_lightning.files import write_bytes_atomic
from uniap_lightning.planner.cluster import GIB
from uniap_lightning.planner.cost.schedules import SCHEDULES as SCHEDULE_INFO
from uniap_lightning.planner.cost.schedules import simulate_blocks
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem
from uniap_lightning.planner.report import BASELINE_LABELS
from uniap_lightning.planner.cost.evaluate import stage_terms
from uniap_lightning.planner.cost.torch_orders import torch_pipeline_order

#: what each part of a strategy label means: (pattern of one part of the label, the key's line); a label's parts
#: are split at "x" and "+" (``z2dp4xtp2+sp`` -> z2dp4, tp2, sp)
LABEL_KEY = (
    (r"dp\d+", "dpN: data parallel over N, replicated"),
    (r"z[12](dp\d+)?", "z1dpN / z2dpN: data parallel over N with ZeRO-1 / ZeRO-2 (z1, z2: over the cp ranks)"),
    (r"fsdp\d*", "fsdpN: fully sharded data parallel (ZeRO-3) over N"),
    (r"cp\d+[ur]", "cpNu / cpNr: context parallel over N, Ulysses / ring attention"),
    (r"tp\d+", "tpN: tensor parallel over N"),
    (r"sp", "+sp: sequence parallel inside the tensor-parallel group"),
    (r"ep\d+", "+epN: experts split over N of the layer's replicas"),
    (r"bf16|powersgd|topk", "+bf16 / +powersgd / +topk: compressed gradients"),
)

#: one iteration's blocks: (device group, start_s, duration_s, kind F|B|I|W, micro-batch, pipeline stage)
Block = tuple[int, float, float, str, int, int]


def label_key(labels) -> list[str]:
    """The lines of :data:`LABEL_KEY` that ``labels`` (strategy labels) use, in the key's order."""
    parts = {part for lab in labels for part in re.split(r"[x+]", lab)}
    return [text for pattern, text in LABEL_KEY if any(re.fullmatch(pattern, part) for part in parts)]


def _order(plan: Plan) -> dict[int, list[tuple[str, int, int]]]:
    """Each device group's computation actions, as the runtime runs them: torch's own order for the schedule
    (1F1B below ``pp`` micro-batches runs as GPipe, as in the runtime)."""
    p, v, m = plan.pp, plan.virtual_stages, plan.microbatches
    return torch_pipeline_order("gpipe" if plan.schedule == "1f1b" and m < p else plan.schedule, p, v, m)


def pipeline_timeline(plan: Plan, problem: Problem, forward_share: float = 1 / 3) -> list[Block]:
    """One iteration's blocks under ``plan``'s schedule, from the cost model's per-stage terms
    (:func:`~uniap_lightning.planner.cost.evaluate.stage_terms`): a stage's forward is ``forward_share`` of its
    time per micro-batch; its weight-gradient part runs apart (W) where the schedule splits the backward;
    hand-offs delay the next stage by half their forward-plus-backward time each way. End-of-step sync excluded."""
    terms = stage_terms(problem, plan)
    split = SCHEDULE_INFO[plan.schedule].split_backward
    f = [t * forward_share for t in terms.stage_time_s]
    w = [min(wk, t - fk) if split else 0.0 for wk, t, fk in zip(terms.weight_s, terms.stage_time_s, f)]
    b = [t - fk - wk for t, fk, wk in zip(terms.stage_time_s, f, w)]
    blocks = simulate_blocks(_order(plan), f, b, w, terms.boundary_s)
    return [(g, start, dur, kind, mb, k) for g, kind, mb, k, start, dur in blocks]


def draw_plan(plan: Plan, problem: Problem, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    est = plan.estimate
    P, S = plan.pp, plan.num_stages
    fig, axes = plt.subplots(2, 2, figsize=(15, 9), gridspec_kw={"height_ratios": [1, 1.2]})
    chunks = f", {plan.virtual_stages} stages per group" if plan.virtual_stages > 1 else ""
    fig.suptitle(
        f"UniAP plan: {plan.model} on {plan.cluster} ({plan.num_devices} devices), batch {plan.global_batch_size}, "
        f"pp={P}{chunks}, {plan.microbatches} micro-batches ({plan.schedule}) - predicted {est.tpi_s * 1e3:,.1f} "
        f"ms/iter, {est.samples_per_s:,.1f} samples/s",
        fontsize=11,
    )

    def label(lp) -> str:  # recomputation is drawn as hatching, not a colour of its own
        return lp.strategy._replace(recompute=False).label()

    labels = sorted({label(lp) for lp in plan.layers})
    cmap = plt.get_cmap("tab10")
    colour = {lab: cmap(j % 10) for j, lab in enumerate(labels)}

    ax = axes[0, 0]
    for u, lp in enumerate(plan.layers):
        ax.barh(plan.group_of_stage(lp.stage), 1, left=u, color=colour[label(lp)], edgecolor="white", lw=0.3,
                hatch="///" if lp.strategy.recompute else None)
    if S > P:  # virtual stages: mark where each pipeline stage begins along the chain
        firsts = [u for u, lp in enumerate(plan.layers) if u == 0 or plan.layers[u - 1].stage != lp.stage]
        for u in firsts[1:]:
            ax.axvline(u, color="black", lw=0.6)
        if S <= 32:
            for u in firsts:
                k = plan.layers[u].stage
                ax.text(u + 0.1, plan.group_of_stage(k) - 0.45, f"S{k}", fontsize=6, va="top")
    devices = est.stage_device or [None] * P
    ticks = []
    for g in range(P):
        ranks = plan.ranks_of_group(g)
        ticks.append(f"group {g}\nranks {ranks[0]}-{ranks[-1]}" + (f"\n{devices[g]}" if devices[g] else ""))
    ax.set_yticks(range(P), ticks, fontsize=7 if P > 8 else 9)
    ax.invert_yaxis()
    ax.set_xlabel("layer index along the chain")
    ax.set_title("Layers on device groups, coloured by strategy" + (" (S: pipeline stage)" if S > P else ""))
    handles = [Patch(color=colour[lab], label=lab) for lab in labels]
    if any(lp.strategy.recompute for lp in plan.layers):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="recomputed"))
    legend = ax.legend(handles=handles, fontsize=8, loc="best", framealpha=0.9)
    key = label_key(labels)
    if key:
        legend.set_title("\n".join(key), prop={"size": 6})

    ax = axes[0, 1]
    mem = [m / GIB for m in est.stage_memory_bytes]
    limits = [x / GIB for x in (est.stage_memory_limit_bytes or [est.memory_limit_bytes] * P)]
    ax.bar(range(P), mem, color=["tab:red" if m > lim else "tab:blue" for m, lim in zip(mem, limits)])
    if len(set(limits)) == 1:
        ax.axhline(limits[0], color="black", ls="--", lw=1)
        ax.text(P - 0.5, limits[0], f" limit {limits[0]:.1f} GiB", va="bottom", ha="right", fontsize=8)
    else:  # devices differ: each group's own limit
        for g, lim in enumerate(limits):
            ax.hlines(lim, g - 0.4, g + 0.4, color="black", ls="--", lw=1)
    ax.set_xticks(range(P))
    ax.set_xlabel("device group")
    ax.set_ylabel("GiB per device")
    ax.set_title("Predicted memory per device per group (dashed: limit)")

    ax = axes[1, 0]
    shade = {"F": "tab:green", "B": "tab:orange", "I": "tab:orange", "W": "tab:purple"}
    try:
        blocks = pipeline_timeline(plan, problem)
    except (ImportError, ValueError) as exc:  # no torch here, or torch refuses this shape: say so in the panel
        blocks = []
        ax.text(0.5, 0.5, f"timeline not drawn: {exc}", ha="center", va="center", fontsize=8, transform=ax.transAxes)
    for g, start, dur, kind, m, k in blocks:
        ax.barh(g, dur * 1e3, left=start * 1e3, color=shade[kind], edgecolor="black", lw=0.3,
                alpha=1.0 if plan.virtual_stages == 1 or k < P else 0.6)
        if plan.microbatches * S <= 48:  # numbers only where the blocks are wide enough to read
            ax.text((start + dur / 2) * 1e3, g, str(m), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(P), [str(g) for g in range(P)], fontsize=7 if P > 8 else 9)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_ylabel("device group")
    kinds = "forward (green) / backward (orange)" + (" / weight grad (purple)"
                                                      if any(b[3] == "W" for b in blocks) else "")
    span = max((s + d for _, s, d, *_ in blocks), default=0.0)
    sync = max(est.stage_sync_s, default=0.0)
    ax.set_title(f"One iteration, {kinds} per micro-batch; white = bubble\n"
                 f"played: {span * 1e3:,.1f} ms + sync {sync * 1e3:,.1f} ms; cost formula: {est.tpi_s * 1e3:,.1f} ms",
                 fontsize=9)

    ax = axes[1, 1]
    names = ["UniAP plan"] + [textwrap.fill(BASELINE_LABELS.get(k, k), 34) for k in plan.baselines]
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
