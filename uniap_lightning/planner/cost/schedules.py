"""Pipeline schedules as numbers: placement, torch's rules, in-flight activations, and a simulator.

Torch-free on purpose: the planner imports it without torch; ``tests/planner/test_schedules.py`` checks every
number here against torch 2.13's own action lists (``pipeline_order``).

Vocabulary: ``p`` device groups, ``v`` chunks per group, ``S = p * v`` stages in chain order, ``m`` micro-batches.
Placement "loop": stage k on group k % p; "v": stage k on group k for k < p, else 2p - 1 - k.
Per stage k and micro-batch: forward f_k, backward-input b_k, backward-weight w_k;
hand-off o_j across boundary j (stage j -> j + 1, forward plus backward p2p).

In-flight rule: a micro-batch's activations on stage k are held from its F until its full backward B, or, for the
split schedules, until its W (W still needs the saved inputs). ``in_flight`` is the peak count per stage.

The time per iteration the planner prices is in :mod:`~uniap_lightning.planner.cost.pipeline` (one formula, no
copy here). :func:`simulate_blocks` plays an action list out by discrete events and knows no formula: the tests
(``tests/planner/test_pipeline_shapes.py``, ``test_schedules.py``) hold the formula to it for every schedule, and
the plan picture (``planner.viz``) draws it.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from uniap_lightning.planner.plan import placed_group
# what each schedule name means and torch's rules for it (torch-free, below the cost model: TrainingConfig asks them)
from uniap_lightning.planner.schedule_rules import SCHEDULES, ScheduleInfo  # noqa: F401 - ScheduleInfo re-exported

Action = tuple[str, int, int]  # (kind in F/B/I/W, micro-batch, stage)


def group_of_stage(k: int, p: int, v: int, placement: str) -> int:
    """Device group that runs pipeline stage ``k``."""
    if placement not in ("loop", "v"):
        raise ValueError(f"unknown placement {placement!r}")
    return placed_group(k, p, placement)


def stages_of_group(g: int, p: int, v: int, placement: str) -> list[int]:
    """Stages of group ``g`` in chain order."""
    return [k for k in range(p * v) if group_of_stage(k, p, v, placement) == g]


def in_flight_of_order(order: Mapping[int, Sequence[Action]], n_stages: int, split_backward: bool) -> list[int]:
    """Peak held micro-batches per stage of an action list (held from F until B, or until W when split)."""
    release = "W" if split_backward else "B"
    peak = [0] * n_stages
    for acts in order.values():
        held = [0] * n_stages
        for kind, _, k in acts:
            if kind == "F":
                held[k] += 1
                peak[k] = max(peak[k], held[k])
            elif kind == release:
                held[k] -= 1
    return peak


def in_flight(schedule: str, p: int, v: int, m: int) -> list[int]:
    """Peak micro-batches whose activations each stage holds under torch's order.

    Closed forms read off torch 2.13 and checked on the test grid (R = m // max(1, m // p), torch's per-round
    count): gpipe m; 1f1b min(m, p - k); zb_v min(m, 2p - k); dualpipe_v m - max(0, k - p);
    zb_h1 / interleaved_zb by chunk c = k // p: last chunk min(R, p), first chunk min(m, 2R), middle chunks R.
    interleaved_1f1b varies per group with torch's warmup: a tiny counter of torch's per-group order.
    """
    info = SCHEDULES[schedule]
    reason = info.check(p, v, m)
    if reason is not None:
        raise ValueError(reason)
    if schedule == "gpipe":
        return [m] * p
    if schedule == "1f1b":
        return [min(m, p - k) for k in range(p)]
    n = p * v
    if schedule == "zb_v":
        return [min(m, n - k) for k in range(n)]
    if schedule == "dualpipe_v":
        return [m - max(0, k - p) for k in range(n)]
    if schedule in ("zb_h1", "interleaved_zb"):
        per_round = m // max(1, m // p)  # torch's microbatches_per_round
        out = []
        for k in range(n):
            chunk = k // p
            if chunk == v - 1:
                out.append(min(per_round, p))
            elif chunk == 0:
                out.append(min(m, 2 * per_round))
            else:
                out.append(per_round)
        return out
    if schedule == "interleaved_1f1b":
        return _interleaved_1f1b_in_flight(p, v, m)
    raise ValueError(f"unknown schedule {schedule!r}")


def _interleaved_1f1b_in_flight(p: int, v: int, m: int) -> list[int]:
    """Count torch's interleaved 1F1B per group: warmup forwards, then F/B pairs, then the remaining backwards.

    With R micro-batches per round, group g runs ``min((v - 1) R + 2 (p - 1 - g), m v)`` warmup forwards; its
    i-th forward is on chunk ``(i // R) % v`` and its j-th backward on chunk ``v - 1 - (j // R) % v``.
    """
    per_round = m // max(1, m // p)
    out = [0] * (p * v)
    for g in range(p):
        warm = min((v - 1) * per_round + 2 * (p - 1 - g), m * v)
        held = [0] * v
        peak = [0] * v
        n_f = n_b = 0
        while n_b < m * v:
            if n_f < m * v and (n_f < warm or n_f - warm <= n_b):
                c = (n_f // per_round) % v
                held[c] += 1
                peak[c] = max(peak[c], held[c])
                n_f += 1
            else:
                held[v - 1 - (n_b // per_round) % v] -= 1
                n_b += 1
        for c in range(v):
            out[c * p + g] = peak[c]
    return out


def simulate_blocks(
    order: Mapping[int, Sequence[Action | None]],
    f: Sequence[float],
    b: Sequence[float],
    w: Sequence[float],
    o: Sequence[float],
) -> list[tuple[int, str, int, int, float, float]]:
    """Every action's ``(group, kind, micro-batch, stage, start, duration)``, by discrete events.

    Each group runs its actions in order. ``o_j`` is the forward plus backward hand-off of boundary j, so each
    direction pays half: F(k, mb) starts after F(k-1, mb) ends plus o_{k-1} / 2; B/I(k, mb) after B/I(k+1, mb)
    ends plus o_k / 2 (the last stage's after its own F); W(k, mb) after I(k, mb). A full B costs b_k + w_k,
    I costs b_k, W costs w_k. None entries are skipped.
    """
    n = len(f)
    done: dict[tuple[str, int, int], float] = {}
    pos = {g: 0 for g in order}
    clock = {g: 0.0 for g in order}
    blocks: list[tuple[int, str, int, int, float, float]] = []
    rows = {g: [a for a in acts if a is not None] for g, acts in order.items()}
    remaining = sum(len(r) for r in rows.values())
    while remaining:
        progressed = False
        for g, acts in rows.items():
            while pos[g] < len(acts):
                kind, mb, k = acts[pos[g]]
                if kind == "F":
                    dep, cost = (("F", mb, k - 1), o[k - 1] / 2) if k > 0 else (None, 0.0)
                    dur = f[k]
                elif kind in ("B", "I"):
                    if k == n - 1:
                        dep, cost = ("F", mb, k), 0.0
                    else:
                        nxt = ("B", mb, k + 1) if ("B", mb, k + 1) in done else ("I", mb, k + 1)
                        dep, cost = nxt, o[k] / 2
                    dur = b[k] + w[k] if kind == "B" else b[k]
                elif kind == "W":
                    dep, cost, dur = ("I", mb, k), 0.0, w[k]
                else:
                    raise ValueError(f"unknown action kind {kind!r}")
                if dep is not None and dep not in done:
                    break
                start = max(clock[g], done[dep] + cost if dep is not None else 0.0)
                clock[g] = start + dur
                done[(kind, mb, k)] = clock[g]
                blocks.append((g, kind, mb, k, start, dur))
                pos[g] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("action list deadlocks: some action waits on one that never runs first")
    return blocks
