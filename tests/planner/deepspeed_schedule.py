"""DeepSpeed's pipeline schedule as it runs, for the tests of blocking hand-offs: the command list of
``TrainSchedule.steps()`` (deepspeed/runtime/pipe/schedule.py at v0.16.5, transcribed: ``2 (m + S - 1)`` steps, even
stages run forwards on even steps and backwards on odd ones, each step's exchanges before its pass) played by
discrete events in which every send meets its receive (DeepSpeed's p2p refuses ``async_op``: both stages wait for
the transfer). Imports no formula of the planner."""

from __future__ import annotations

from typing import Sequence


def train_schedule(stages: int, m: int, k: int) -> list[tuple[str, int]]:
    """Stage ``k``'s commands: ``sa``/``ra`` send/receive activation, ``sg``/``rg`` gradient, ``F``/``B`` passes."""
    def step(t: int) -> tuple[int, bool]:  # TrainSchedule._step_to_micro_batch and its four *_id helpers
        if t % 2 == 0 and k % 2 == 0:
            return t // 2 - k // 2, True
        if t % 2 == 1 and k % 2 == 1:
            return (t - 1) // 2 - k // 2, True
        if t % 2 == 0 and k % 2 == 1:
            return t // 2 - stages + (k + 1) // 2, False
        return (t - 1) // 2 - stages + 1 + k // 2, False

    out: list[tuple[str, int]] = []
    prev = -1
    for t in range(2 * (m + stages - 1)):
        mb, forward = step(t)
        here, before = 0 <= mb < m, 0 <= prev < m
        if forward and k > 0:
            out += [("sg", prev)] * before + [("ra", mb)] * here
        elif not forward and k < stages - 1:
            out += [("rg", mb)] * here + [("sa", prev)] * before
        if here:
            out.append(("F" if forward else "B", mb))
        prev = mb
    return out


def simulate(f: Sequence[float], b: Sequence[float], o: Sequence[float], m: int) -> float:
    """Makespan of ``m`` micro-batches; ``o[j]``: boundary ``j``'s hand-off, forward plus backward (half each way)."""
    S = len(f)
    cmds = [train_schedule(S, m, k) for k in range(S)]
    pos, clock = [0] * S, [0.0] * S
    partner = {"sa": (1, "ra"), "ra": (-1, "sa"), "sg": (-1, "rg"), "rg": (1, "sg")}
    while any(pos[k] < len(cmds[k]) for k in range(S)):
        moved = False
        for k in range(S):
            while pos[k] < len(cmds[k]):
                op, mb = cmds[k][pos[k]]
                if op in ("F", "B"):
                    clock[k] += f[k] if op == "F" else b[k]
                else:
                    d, match = partner[op]
                    j = k + d
                    if pos[j] >= len(cmds[j]) or cmds[j][pos[j]] != (match, mb):
                        break  # the other side is not there yet
                    clock[k] = clock[j] = max(clock[k], clock[j]) + o[min(k, j)] / 2
                    pos[j] += 1
                pos[k] += 1
                moved = True
        if not moved:
            raise RuntimeError("the command lists deadlock")
    return max(clock)
