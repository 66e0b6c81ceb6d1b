"""When to re-plan and when to switch: pure arithmetic on measured and predicted stage times (no torch).

Every rank times its own stage's forward and backward per micro-batch (:mod:`.timing`). At a check the ranks
share their medians (one all-gather) and each computes, from the same numbers, the same decision:

1. **Speed factors.** A rank's *slowness* is its measured time per micro-batch over what the plan predicts for it
   (the predicted stage time, rescaled by the rank's own speed against the slowest of its stage). Slowness is
   taken relative to the least slow rank, so a cost model that is off by the same factor everywhere does not look
   like a slow device; the new speed of a rank is its current speed divided by that relative slowness, rescaled
   so that the fastest speed stays what it was (1.0 unless the cluster description said otherwise).
2. **Re-plan?** When some rank's speed moved by more than ``threshold`` from the speed the running plan was
   scored with, rank 0 re-solves on the cluster with the new speeds.
3. **Switch?** The running plan re-scored on that cluster against the new plan: switch when the predicted gain
   ``current / new - 1`` exceeds ``threshold`` (and fewer than ``max_rebalances`` switches happened).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from uniap_lightning.errors import UniAPError

if TYPE_CHECKING:
    from uniap_lightning.planner.plan import Plan


@dataclass(frozen=True)
class RebalanceOptions:
    """``UniAPStrategy(rebalance=..., rebalance_threshold=..., rebalance_check_every=..., max_rebalances=...)``."""

    enabled: bool = False
    threshold: float = 0.10
    check_every: int = 50
    max_rebalances: int = 3

    @classmethod
    def from_arguments(cls, *, rebalance: Any, rebalance_threshold: Any, rebalance_check_every: Any,
                       max_rebalances: Any) -> RebalanceOptions:
        """Check the strategy's arguments; a bad value raises a :class:`UniAPError` naming it."""
        if not isinstance(rebalance, bool):
            raise UniAPError(f"rebalance must be True or False, got {rebalance!r}")
        t = rebalance_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t < 10:
            raise UniAPError(f"rebalance_threshold must be a number > 0 (a fraction, e.g. 0.10 for 10%), got {t!r}")
        for name, v, low in (("rebalance_check_every", rebalance_check_every, 2), ("max_rebalances", max_rebalances, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise UniAPError(f"{name} must be an integer >= {low}, got {v!r}")
        return cls(rebalance, float(t), int(rebalance_check_every), int(max_rebalances))


def rank_slowness(measured_s: list[float | None], predicted_stage_s: list[float], plan: Plan,
                  speeds: tuple[float, ...]) -> list[float | None]:
    """Per rank: measured seconds per micro-batch over the seconds predicted for that rank (``None``: unmeasured).

    The plan predicts a stage's time at the speed of its slowest rank; a faster rank of the stage, timed on its own
    work, is expected to take proportionally less. ``plan``: the running plan (its rank layout)."""
    out: list[float | None] = []
    for r, m in enumerate(measured_s):
        group = plan.group_of_rank(r)
        slowest = min(speeds[q] for q in plan.ranks_of_group(group))
        expected = predicted_stage_s[group] * slowest / speeds[r]
        out.append(m / expected if m is not None and m > 0 and expected > 0 else None)
    return out


def new_speeds(slowness: list[float | None], speeds: tuple[float, ...]) -> tuple[float, ...]:
    """Current speeds corrected by each rank's slowness relative to the least slow rank, rescaled so that the
    fastest speed is the current fastest."""
    known = [s for s in slowness if s is not None]
    if not known:
        return tuple(speeds)
    base = min(known)
    raw = [v if s is None else v * base / s for v, s in zip(speeds, slowness)]
    scale = max(speeds) / max(raw)
    return tuple(float(f"{v * scale:.4g}") for v in raw)  # 4 significant digits: stable, never 0


def speeds_moved(new: tuple[float, ...], old: tuple[float, ...], threshold: float) -> list[int]:
    """Ranks whose speed changed by more than ``threshold`` (relative)."""
    return [r for r, (a, b) in enumerate(zip(new, old)) if abs(a / b - 1) > threshold]


def predicted_gain(current_tpi_s: float, new_tpi_s: float) -> float:
    """How much faster the new plan is predicted to be: ``current / new - 1`` (0.25: 25% more steps per second)."""
    if not (new_tpi_s > 0 and math.isfinite(current_tpi_s)):
        return 0.0
    return current_tpi_s / new_tpi_s - 1


@dataclass(frozen=True)
class Check:
    """What a check found (identical on every rank): whether to re-solve, the new speeds, and why."""

    replan: bool
    speeds: tuple[float, ...]
    reason: str


def assess(*, measured_s: list[float | None], predicted_stage_s: list[float], plan: Plan,
           speeds: tuple[float, ...], threshold: float, switches: int, max_rebalances: int) -> Check:
    """Step 1 and 2 of the module docstring, from every rank's median seconds per micro-batch."""
    slow = rank_slowness(measured_s, predicted_stage_s, plan, speeds)
    new = new_speeds(slow, speeds)
    moved = speeds_moved(new, speeds, threshold)
    if not moved:
        return Check(False, speeds, "every rank runs at the speed the plan assumes (within the threshold)")
    what = ", ".join(f"rank {r} {speeds[r]:.2f} -> {new[r]:.2f}" for r in moved[:6]) + (" ..." if len(moved) > 6 else "")
    if switches >= max_rebalances:
        return Check(False, new, f"speeds moved ({what}) but max_rebalances={max_rebalances} switches happened")
    return Check(True, new, f"measured speed changed: {what}")


def should_switch(gain: float, threshold: float, same_plan: bool) -> bool:
    """Step 3: a different plan whose predicted gain exceeds the threshold."""
    return not same_plan and gain > threshold
