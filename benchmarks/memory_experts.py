"""Predicted vs measured memory per rank for expert-parallel (ep) plans of the tiny MoE GPT (CPU, gloo; issue 23).

    python benchmarks/memory_experts.py [--world 2] [--layers 2] [--width 64] [--seq 64] [--batch 4]
                                        [--experts 4] [--capacity none,1.0,1.25] [--plans ep1,ep2]
                                        [--markdown out.md] [--json out.json]

:class:`uniap_lightning.adapters.moe.MoEGPT` (``--layers`` MoE blocks, 4 heads, ``--experts`` experts, top-2, AdamW)
trained 2 steps by ``Trainer(strategy=UniAPStrategy(plan=...))`` on ``--world`` gloo processes, one micro-batch of
``--batch`` samples per step, every layer data-parallel over all ranks (``replicate``); the MoE blocks add ``ep``:
``ep1`` (every expert on every rank; routing counted over all ranks' tokens), ``ep2``, ``ep4`` (``E / ep`` experts
per rank, tokens moved by all-to-all; with ``--world 4``, ``ep2`` is ep 2 x dp 2); ``cp2_ep2``: every layer's
sequence over 2 ranks (Ulysses; dp over the others), the experts over 2 of the ``dp x cp`` replicas (dropless
capacities only: a block that may drop tokens does not split its sequence). ``--capacity``: the capacity factors to
run (``none``: dropless), one run of every plan each.

Measured and predicted exactly as ``memory_sequence.py`` does (this script runs its per-rank probe with the MoE GPT
in place of the GPT): **static** (parameters, gradients, AdamW state, buckets, from the live tensors), **kept**
(bytes the forward creates and keeps until the chain's output, without the output's own bytes) and **peak** (the
most live bytes from the output to the end of the backward), in the second step; predicted: the planner's
``CandidateCosts.terms`` of the same plan on the project's own profile of these layers (with their expert fields,
``profiling.module.with_expert_fields``), kept = the layers' ``activation_bytes``, peak = kept + the largest
``transient_bytes``. The router sends each token where its weights say, so a rank's share of the rows differs from
the balanced ``tokens x k`` the planner assumes (and a capacity factor caps it): the table shows each rank.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_sequence as ms  # noqa: E402  (the probe, the prediction and the table)

PLANS = ("ep1", "ep2", "ep4", "cp2_ep2")


def moe_layers(args: Any) -> list[torch.nn.Module]:
    from uniap_lightning.adapters.moe import MoEGPT, MoEGPTConfig

    torch.manual_seed(0)
    cfg = MoEGPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width,
                       n_experts=args.experts, top_k=2, capacity_factor=args.capacity_factor)
    return MoEGPT(cfg).layers()


def ep_strategies(name: str, world: int, n: int) -> list[Any]:
    """``epN``: every layer data-parallel over ``world`` ranks, the MoE blocks' experts split over ``N`` of them."""
    from uniap_lightning.planner.decision import Strategy

    if name not in PLANS:
        raise SystemExit(f"unknown plan {name!r}: one of {', '.join(PLANS)}")
    if name == "cp2_ep2":  # every layer's sequence over 2 ranks (Ulysses), data parallelism over the others
        cp = {"cp": 2, "cp_method": "ulysses"}
        return [Strategy.of(world // 2, 1, **cp)] + [Strategy.of(world // 2, 1, ep=2, **cp)] * (n - 2) + \
            [Strategy.of(world // 2, 1, **cp)]
    ep = int(name[2:])
    if world % ep:
        raise SystemExit(f"plan {name} needs --world divisible by {ep}")
    edge = Strategy.of(world, 1)
    return [edge] + [Strategy.of(world, 1, ep=ep)] * (n - 2) + [edge]


def _moe_profile(args: Any, ids: torch.Tensor) -> Any:
    from uniap_lightning.profiling.module import with_expert_fields

    return with_expert_fields(_SEQUENCE_PROFILE(args, ids), moe_layers(args))


_SEQUENCE_PROFILE = ms._profile


def _rank_run(rank: int, world: int, port: int, args: Any, out_dir: str) -> None:
    """``memory_sequence``'s per-rank run with the MoE GPT, its module class and the ep plans (this process only)."""
    import uniap_lightning.adapters as adapters
    from uniap_lightning.adapters.moe import MoECausalLMModule

    ms.gpt_layers, ms.plan_strategies, ms._profile = moe_layers, ep_strategies, _moe_profile
    adapters.CausalLMModule = MoECausalLMModule  # the loss adds the auxiliary load-balancing loss
    ms._rank_run(rank, world, port, args, out_dir)


def run(args: Any) -> list[dict[str, Any]]:
    """Every plan at every capacity factor of ``args.capacities``; rows as ``memory_sequence.run`` gives them, with
    ``capacity`` added."""
    import shutil
    import tempfile

    import torch.multiprocessing as mp

    rows = []
    for cf in args.capacities:
        args.capacity_factor = cf
        out = tempfile.mkdtemp(prefix="uniap_memexp_")
        mp.start_processes(_rank_run, args=(args.world, ms._free_port(), args, out), nprocs=args.world,
                           start_method="spawn")
        ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(args.world)]
        shutil.rmtree(out, ignore_errors=True)
        rows += [{**r, "capacity": cf} for r in ms.rows_of(ranks, args.plans)]
    return rows


def table(rows: list[dict[str, Any]], args: Any) -> str:
    lines = [f"MoE GPT {args.layers} blocks, width {args.width}, 4 heads, {args.experts} experts top-2, seq "
             f"{args.seq}, micro-batch {args.batch}, {args.world} ranks, AdamW; per rank (MiB): measured / predicted "
             "(ratio)", "",
             "| capacity | plan | rank | static (params, grads, AdamW, buckets) | activations kept after forward | "
             "backward peak (kept + transient) |", "|---|---|---|---|---|---|"]
    for r in rows:
        p = r["predicted"]
        cells = [f"{ms._mb(r[k])} / {ms._mb(p[k])} ({ms._ratio(r[k], p[k])})" for k in ("static", "kept", "peak")]
        cf = "dropless" if r["capacity"] is None else f"{r['capacity']:g}"
        lines.append(f"| {cf} | {r['plan']} | {r['rank']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2, help="MoE blocks (plus embedding and head)")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="samples per micro-batch (one per step)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--capacity", default="none,1.0,1.25", help="capacity factors, 'none': dropless")
    ap.add_argument("--plans", default="ep1,ep2")
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.plans = [p for p in args.plans.split(",") if p]
    args.capacities = [None if c == "none" else float(c) for c in args.capacity.split(",") if c]
    if args.batch % args.world:
        sys.exit("--world must divide --batch")
    ms.report(run(args), args, table)


if __name__ == "__main__":
    main()
