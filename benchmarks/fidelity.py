"""Cost-model fidelity: predicted vs measured time per iteration and peak memory, for many pinned plans.

    python benchmarks/fidelity.py [--world 4] [--steps 8] [--warmup 3] [--markdown BENCHMARKS_fidelity.md]

One small GPT (``uniap_lightning.adapters.gpt``: 4 blocks, width 192, 64 tokens, vocab 256; global batch 16; Adam)
trains on ``--world`` CPU processes (gloo, one thread each) under a series of pinned plans (pipeline degrees,
DDP / FSDP / tensor-parallel mixes, micro-batch counts) plus the planner's own choice. Before training, every rank
takes part in the measurements the strategy makes at setup: collectives on the job's process group
(``measure_collectives`` -> the cluster's per-collective tables), the layer profile (all ranks profile at once, as
they will train at once: the CPU cores are shared; the median over ranks is used), timed at the per-device
micro-batch sizes the plans use, and the TP / FSDP overheads of each distinct layer
(``uniap_lightning.profiling.strategies``). Predictions are ``evaluate(problem, plan)`` with that measured profile and cluster;
measurements come from :class:`uniap_lightning.monitor.UniAPMonitor` (median step time of ``--steps`` steps after
``--warmup``, the slowest rank; peak memory per rank as the monitor defines it on CPU), each plan run ``--rounds``
times in rotating order and the median run reported (with the spread of the runs). On a CPU the monitor's peak
memory counts tensor bytes (``uniap_lightning.monitor_memory``), so glibc's settings no longer matter (this script
used to pin its mmap threshold at 64 KiB, which slowed every step).

Prints one row per plan and the summary: median absolute relative error (time, memory), Spearman rank correlation
of predicted vs measured time, and where the planner's choice ranks among the measured times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from uniap_lightning.planner.decision import Strategy

B, SEQ, VOCAB, WIDTH, HEADS, BLOCKS = 16, 64, 256, 192, 4, 4


def _module() -> Any:
    from uniap_lightning.adapters import CausalLMModule
    from uniap_lightning.adapters.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    layers = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=BLOCKS, n_head=HEADS, n_embd=WIDTH)).layers()
    return CausalLMModule(layers, lr=1e-3)


def _data(steps: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (steps * B, SEQ), generator=g)
    return DataLoader(TensorDataset(ids, ids), batch_size=B, shuffle=False, drop_last=True)


def _plans(world: int, names: list[str]) -> dict[str, Any]:
    """Pinned plans: (strategies per layer, stage per layer, pp, microbatches, schedule)."""
    from uniap_lightning.planner.plan import Plan

    L = len(names)
    w = world

    def mk(strats: Any, stages: list[int] | None = None, pp: int = 1, c: int = 1, schedule: str = "1f1b") -> Plan:
        if isinstance(strats, tuple):
            strats = [strats] * L
        return Plan.from_assignment(stage_of_layer=stages or [0] * L, strategies=strats, layer_names=names, pp=pp,
                                    microbatches=c, schedule=schedule, global_batch_size=B, num_devices=w)

    h = w // 2
    two = [0] * (L // 2) + [1] * (L - L // 2)
    plans = {
        f"ddp{w} c1": mk((w, 1, False)),
        f"fsdp{w} c1": mk((w, 1, True)),
        f"ddp{w} c4": mk((w, 1, False), c=4),
        f"tp{w} c1": mk((1, w, False)),
        f"dp{h}xtp2 c2": mk((h, 2, False), c=2),
        f"embed fsdp{w}, blocks dp{h}xtp2, head tp{w} c1": mk([(w, 1, True)] + [(h, 2, False)] * (L - 2) + [(1, w, False)]),
        f"pp2 dp{h} c2 1f1b": mk((h, 1, False), two, pp=2, c=2),
        f"pp2 fsdp{h} c4 gpipe": mk((h, 1, True), two, pp=2, c=4, schedule="gpipe"),
        f"pp2 tp{h} c4 1f1b": mk((1, h, False), two, pp=2, c=4),
    }
    if w >= 4:
        four = [0, 0, 1, 2, 3, 3] if L == 6 else [min(u * 4 // L, 3) for u in range(L)]
        plans["pp4 c4 1f1b"] = mk((w // 4, 1, False), four, pp=4, c=4)
        plans["pp4 c8 1f1b"] = mk((w // 4, 1, False), four, pp=4, c=8)
    return plans


def _worker(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    import warnings

    import lightning.pytorch as pl
    import torch.distributed as dist

    from uniap_lightning.planner.cost import evaluate
    from uniap_lightning.monitor import UniAPMonitor
    from uniap_lightning.planner.plan import Plan
    from uniap_lightning.planner.problem import Problem, TrainingConfig
    from uniap_lightning.profiling.collectives import apply_to_cluster, measure_collectives
    from uniap_lightning.profiling.module import median_over_ranks, profile_layers
    from uniap_lightning.planner.profile import ModelProfile
    from uniap_lightning.profiling.strategies import attach_overheads, measure_overheads
    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.runtime.planning import local_cluster
    from uniap_lightning.runtime.tensor_parallel import tp_allreduces, tp_degrees
    from uniap_lightning.strategy import UniAPStrategy

    import uniap_lightning.strategy as strategy_module

    strategy_module._print_plan = lambda *a, **k: None  # one line per plan here, not the full plan report
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    log: dict[str, Any] = {"rows": [], "setup": {}}

    def say(msg: str) -> None:
        if rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    try:
        t0 = time.perf_counter()
        measured = measure_collectives(repeats=5, devices_per_node=world, sizes_bytes=(1 << 12, 1 << 20))
        cluster = apply_to_cluster(local_cluster(nodes=1, devices_per_node=world, device_type="cpu"), measured)
        log["setup"]["cluster_s"] = time.perf_counter() - t0
        say(f"collectives measured in {log['setup']['cluster_s']:.1f} s: all-reduce GB/s "
            f"{ {p: round(r['bw_gbps'], 3) for p, r in measured['ops']['all_reduce'].items()} }, latency us "
            f"{ {p: round(r['latency_us']) for p, r in measured['ops']['all_reduce'].items()} }")
        module = _module()
        chain = extract_chain(module)
        ids, target = chain.split_batch(next(iter(_data(1))))
        t0 = time.perf_counter()
        prof = profile_layers(
            chain.layers, chain.names, ids, repeats=args["profile_repeats"], warmup=2,
            micro_batches=[1, 2, 4, 8, 16], tp_degrees=[tp_degrees(m) for m in chain.layers],
            tp_allreduces=[tp_allreduces(m) for m in chain.layers], model="fidelity-gpt", device="cpu",
            sync=dist.barrier, flush_bytes=args["profile_flush_bytes"],
            loss_fn=None if args["no_loss"] else chain.loss_fn, target=target,
        )
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, prof.to_dict())  # as the strategy does: the median over the ranks
        profile = median_over_ranks([ModelProfile.from_dict(d) for d in everyone])
        log["setup"]["profile_s"] = time.perf_counter() - t0
        say(f"profiled {profile.num_layers} layers at micro-batches 1..16 in {log['setup']['profile_s']:.1f} s")
        # as the strategy does at setup: every rank times the distinct layers under TP / FSDP (smallest, middle
        # and largest profiled micro-batch); the formula-only profile shows what the measured terms change
        formula_profile = profile
        if not args["no_overheads"]:
            t0 = time.perf_counter()
            tp_split: dict[int, float] = {}
            over = measure_overheads(chain.layers, chain.names, ids, micro_batches=[1, 4, 16],
                                     devices_per_node=world, repeats=args["profile_repeats"], tp_split=tp_split)
            profile = attach_overheads(profile, over, tp_split)
            log["setup"]["overheads_s"] = time.perf_counter() - t0
            say(f"timed TP / FSDP overheads in {log['setup']['overheads_s']:.1f} s")
        log["profile"] = profile.to_dict()
        plans = _plans(world, chain.names)
        # the planner's own choice, from the same measured profile and cluster
        chosen: list[Any] = [None]
        if rank == 0:
            import gc

            from uniap_lightning.planner.solver import solve

            gc.disable()
            try:
                t0 = time.perf_counter()
                pl_plan = solve(Problem(model=profile, cluster=cluster, training=TrainingConfig(global_batch_size=B)),
                                time_limit_s=60)
                log["setup"]["solve_s"] = time.perf_counter() - t0
                chosen[0] = pl_plan.to_dict()
            finally:
                gc.enable()
        dist.broadcast_object_list(chosen, src=0)
        plans["PLANNER"] = Plan.from_dict(chosen[0])
        names = list(plans)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for rnd in range(args["rounds"]):  # rotating order, so a burst of outside load hits every plan alike
            for name in names[rnd % len(names):] + names[: rnd % len(names)]:
                plan = plans[name]
                problem = Problem(model=profile, cluster=cluster,
                                  training=TrainingConfig(global_batch_size=B, schedule=plan.schedule))
                est = evaluate(problem, plan)
                est_formula = evaluate(Problem(model=formula_profile, cluster=cluster, training=problem.training), plan)
                # pinned as is (the profile was measured above)
                plan = dataclasses.replace(plan, model_fingerprint="").with_report(estimate=est)
                mon = UniAPMonitor(warmup_steps=args["warmup"], window=args["steps"], repeat=False,
                                   time_error_threshold=10.0, metrics_file=Path(out) / "measured.json")
                strategy = UniAPStrategy(plan=plan, monitor=mon, measure_cluster=False)
                trainer = pl.Trainer(
                    accelerator="cpu", devices=world, strategy=strategy, max_steps=args["warmup"] + args["steps"],
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    use_distributed_sampler=False,
                )
                t0 = time.perf_counter()
                trainer.fit(_module(), _data(args["warmup"] + args["steps"]))
                m = mon.last or {}
                row = {"plan": name, "pp": plan.pp, "c": plan.microbatches, "schedule": plan.schedule,
                       "layers": [[lp.strategy.dp, lp.strategy.tp, lp.strategy.shard, lp.stage] for lp in plan.layers],
                       "pred_tpi_s": est.tpi_s, "pred_formula_tpi_s": est_formula.tpi_s, "meas_tpi_s": m.get("tpi_s"),
                       "pred_mem": [est.stage_memory_bytes[r // plan.devices_per_stage] for r in range(world)],
                       "meas_mem": m.get("rank_peak_memory_bytes"), "wall_s": time.perf_counter() - t0,
                       "stage_time_s": est.stage_time_s, "sync_s": est.stage_sync_s, "boundary_s": est.boundary_s}
                runs[name].append(row)
                say(f"[round {rnd + 1}] {name:45s} predicted {est.tpi_s * 1e3:8.1f} ms  measured "
                    f"{row['meas_tpi_s'] * 1e3:8.1f} ms  ({row['wall_s']:.0f} s)")
                del trainer, strategy
        for name in names:  # the median run by step time (its memory figures come with it)
            done = sorted((r for r in runs[name] if r.get("meas_tpi_s")), key=lambda r: r["meas_tpi_s"])
            if done:
                row = dict(done[(len(done) - 1) // 2])
                row["meas_tpi_runs_s"] = [r["meas_tpi_s"] for r in runs[name]]
                log["rows"].append(row)
    except Exception:  # noqa: BLE001
        log["error"] = traceback.format_exc()
        print(f"rank {rank}: {log['error']}", file=sys.stderr, flush=True)
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(log, indent=1, default=str))
    dist.destroy_process_group()


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else float("nan")


def _span(row: dict[str, Any]) -> str:
    xs = [x for x in row.get("meas_tpi_runs_s") or [row["meas_tpi_s"]] if x]
    return f"{min(xs) * 1e3:,.0f}-{max(xs) * 1e3:,.0f}" if len(xs) > 1 else "1 run"


def summarize(log: dict[str, Any], world: int) -> str:
    rows = [r for r in log["rows"] if r.get("meas_tpi_s")]
    lines = [f"world={world} CPU processes (gloo), model: GPT {BLOCKS} blocks x width {WIDTH}, seq {SEQ}, "
             f"vocab {VOCAB}, global batch {B}, Adam fp32",
             f"setup: collectives {log['setup'].get('cluster_s', 0):.1f} s, profile {log['setup'].get('profile_s', 0):.1f} s, "
             f"TP/FSDP overheads {log['setup'].get('overheads_s', 0):.1f} s, solve {log['setup'].get('solve_s', 0):.1f} s",
             "",
             "| plan | pp | c | sched | predicted ms/it | measured ms/it (runs) | time err | formulas only: predicted "
             "ms/it (err) | predicted MiB (max rank) | measured MiB (max rank) | mem err (median over ranks) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    t_err, f_err, m_err = [], [], []
    for r in rows:
        te = (r["meas_tpi_s"] - r["pred_tpi_s"]) / r["pred_tpi_s"]
        t_err.append(abs(te))
        fp = r.get("pred_formula_tpi_s") or r["pred_tpi_s"]
        fe = (r["meas_tpi_s"] - fp) / fp
        f_err.append(abs(fe))
        me = [(m - p) / p for m, p in zip(r["meas_mem"] or [], r["pred_mem"]) if p > 0]
        mem_med = statistics.median([abs(x) for x in me]) if me else float("nan")
        m_err.extend(abs(x) for x in me)
        lines.append(
            f"| {r['plan']} | {r['pp']} | {r['c']} | {r['schedule']} | {r['pred_tpi_s'] * 1e3:,.1f} | "
            f"{r['meas_tpi_s'] * 1e3:,.1f} ({_span(r)}) | {te:+.1%} | {fp * 1e3:,.1f} ({fe:+.1%}) | {max(r['pred_mem']) / 2**20:,.1f} | "
            f"{max(r['meas_mem'] or [0]) / 2**20:,.1f} | {mem_med:.1%} |"
        )
    pinned = [r for r in rows if r["plan"] != "PLANNER"]
    rho = spearman([r["pred_tpi_s"] for r in pinned], [r["meas_tpi_s"] for r in pinned])
    rho_f = spearman([r.get("pred_formula_tpi_s") or r["pred_tpi_s"] for r in pinned], [r["meas_tpi_s"] for r in pinned])
    lines.append("")
    lines.append(f"- median |time error|: {statistics.median(t_err):.1%} over {len(rows)} plans (goal <= 10%); "
                 f"formulas only: {statistics.median(f_err):.1%}")
    lines.append(f"- Spearman rank correlation, predicted vs measured time (pinned plans): {rho:.2f} (goal >= 0.8); "
                 f"formulas only: {rho_f:.2f}")
    fastest = [min(x for x in r.get("meas_tpi_runs_s") or [r["meas_tpi_s"]] if x) for r in rows]
    f_err_min = [abs(m - r["pred_tpi_s"]) / r["pred_tpi_s"] for m, r in zip(fastest, rows)]
    rho_min = spearman([r["pred_tpi_s"] for r in pinned], [m for m, r in zip(fastest, rows) if r["plan"] != "PLANNER"])
    lines.append(f"- with each plan's fastest run instead of its median run (outside load only ever slows a run): "
                 f"median |time error| {statistics.median(f_err_min):.1%}, Spearman {rho_min:.2f}")
    lines.append(f"- median |memory error| over plans x ranks: {statistics.median(m_err):.1%} (goal <= 15%); "
                 f"within 15%: {sum(e <= 0.15 for e in m_err)}/{len(m_err)}")
    planner = next((r for r in rows if r["plan"] == "PLANNER"), None)
    if planner:
        meas = sorted(rows, key=lambda r: r["meas_tpi_s"])
        rank = [r["plan"] for r in meas].index("PLANNER") + 1
        best = meas[0]
        desc = ", ".join(f"{'fsdp' if s else 'dp'}{d}xtp{t}@{st}" for d, t, s, st in planner["layers"])
        same = [r["plan"] for r in pinned if (r["layers"], r["pp"], r["c"], r["schedule"]) ==
                (planner["layers"], planner["pp"], planner["c"], planner["schedule"])]
        if same:
            desc += f"; the same layout as the pinned '{same[0]}'"
        lines.append(f"- planner's choice (pp={planner['pp']}, c={planner['c']}, {planner['schedule']}: {desc}) is "
                     f"#{rank} of {len(rows)} by measured time: {planner['meas_tpi_s'] * 1e3:,.1f} ms vs the measured "
                     f"fastest '{best['plan']}' {best['meas_tpi_s'] * 1e3:,.1f} ms "
                     f"({planner['meas_tpi_s'] / best['meas_tpi_s'] - 1:+.1%})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-repeats", type=int, default=5)
    ap.add_argument("--profile-flush-bytes", type=int, default=None,
                    help="bytes written before each timed layer run (default: the library's; 0: hot caches)")
    ap.add_argument("--no-loss", action="store_true", help="profile without the loss (as profiles were before)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs per plan, in rotating order; the median run counts (default 3)")
    ap.add_argument("--no-overheads", action="store_true",
                    help="do not time TP / FSDP overheads (predict with the cost formulas alone)")
    ap.add_argument("--markdown", type=str, default=None, help="append the table to this file")
    ap.add_argument("--json", type=str, default=None, help="write the raw results here")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        args = {"steps": a.steps, "warmup": a.warmup, "profile_repeats": a.profile_repeats,
                "no_overheads": a.no_overheads, "rounds": max(a.rounds, 1),
                "profile_flush_bytes": a.profile_flush_bytes, "no_loss": a.no_loss}
        mp.start_processes(_worker, args=(a.world, port, args, out), nprocs=a.world, start_method="spawn")
        log = json.loads(Path(out, "result.json").read_text())
    if a.json:
        Path(a.json).write_text(json.dumps(log, indent=1))
    if "error" in log:
        print(log["error"], file=sys.stderr)
    text = summarize(log, a.world) + f"\n- benchmark wall time: {time.perf_counter() - t0:.0f} s\n"
    print(text)
    if a.markdown:
        with open(a.markdown, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
