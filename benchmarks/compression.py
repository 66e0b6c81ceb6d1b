"""Gradient compression on the shipped GPT: bytes per step and loss, none vs bf16 vs PowerSGD vs top-k.

    python benchmarks/compression.py [--devices 2] [--steps 150] [--seeds 0 1 2] [--methods none bf16 ...]

Trains `uniap train`'s default model (conf/model/tiny_gpt: 4 blocks, hidden 64, on the shipped character corpus,
AdamW lr 3e-3, global batch 16, shuffled) with ``Trainer(strategy=UniAPStrategy(plan=...))`` on ``--devices`` CPU
processes (gloo; the cores shared out as `uniap train` does), each run with a pinned plan: one stage, every layer
data-parallel over all devices (``replicate``) with one compression method. Per run, on rank 0:

- bytes per optimizer step: *counted* (the payloads handed to the gradient collectives,
  ``ReplicatedGrads.counter``), the *formula* per parameter tensor (``wire_bytes_per_step``: what the counter
  must equal) and the *cost model*'s per-layer figure from the profile fields (``params``, ``matrix_dims``,
  ``vector_params``, ``param_tensors``, as ``planner/cost/layer.py`` prices it);
- the loss: the global mean training loss, averaged over the last ``--tail`` steps (one batch is noisy).

Each method runs with every seed (model init and data order); the table gives medians over seeds, the loss
relative to uncompressed training, and the byte ratio (uncompressed / method): the figure the seed's
"communication down to a tenth" claim is checked against. PowerSGD and top-k start with the uncompressed warm-up
(``compression_options`` ``start_iter`` / ``start_fraction``, default 2% of the steps; ``-nowarm`` / ``-warmN``
labels: none / N%), so bytes per step are given in steady state (what the cost model prices; counted == formula
on every step, warm-up included) and over the whole run. ``-dgc`` labels: top-k with Deep Gradient Compression's
momentum correction (``dgc_momentum`` 0.9; with ``--optimizer sgd`` only, the optimizer then runs momentum 0).
``--json`` writes every run's numbers and loss curve.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from uniap_lightning.planner.decision import Strategy

#: method label -> (plan compression, compression_options)
METHODS: dict[str, tuple[str, dict[str, float]]] = {
    "powersgd-r4-nowarm": ("powersgd", {"powersgd_rank": 4, "start_fraction": 0.0}),
    "topk-10%-nowarm": ("topk", {"topk_ratio": 0.1, "start_fraction": 0.0}),
    "powersgd-r4-warm2": ("powersgd", {"powersgd_rank": 4, "start_fraction": 0.02}),
    "powersgd-r4-warm5": ("powersgd", {"powersgd_rank": 4, "start_fraction": 0.05}),
    "powersgd-r4-warm20": ("powersgd", {"powersgd_rank": 4, "start_fraction": 0.2}),
    "topk-10%-warm2": ("topk", {"topk_ratio": 0.1, "start_fraction": 0.02}),
    "topk-10%-warm5": ("topk", {"topk_ratio": 0.1, "start_fraction": 0.05}),
    "topk-10%-warm20": ("topk", {"topk_ratio": 0.1, "start_fraction": 0.2}),
    "none": ("none", {}),
    "bf16": ("bf16", {}),
    "powersgd-r1": ("powersgd", {"powersgd_rank": 1}),
    "powersgd-r2": ("powersgd", {"powersgd_rank": 2}),
    "powersgd-r4": ("powersgd", {"powersgd_rank": 4}),
    "powersgd-r8": ("powersgd", {"powersgd_rank": 8}),
    "powersgd-r16": ("powersgd", {"powersgd_rank": 16}),
    "topk-1%": ("topk", {"topk_ratio": 0.01}),
    "topk-10%": ("topk", {"topk_ratio": 0.1}),
    "topk-25%": ("topk", {"topk_ratio": 0.25}),
    "topk-5%": ("topk", {"topk_ratio": 0.05}),
    # Deep Gradient Compression's momentum correction: with --optimizer sgd only (the optimizer runs momentum 0)
    "topk-1%-dgc": ("topk", {"topk_ratio": 0.01, "dgc_momentum": 0.9}),
    "topk-5%-dgc": ("topk", {"topk_ratio": 0.05, "dgc_momentum": 0.9}),
    "topk-10%-dgc": ("topk", {"topk_ratio": 0.1, "dgc_momentum": 0.9}),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cost_model_bytes(layers: list[Any], method: str, options: dict[str, float]) -> int:
    """Per-step bytes as the cost model prices them, per layer from the profile's fields."""
    from uniap_lightning.profiling.structural import powersgd_dims

    total = 0.0
    for layer in layers:
        params = sum(p.numel() for p in layer.parameters() if p.requires_grad)
        tensors = sum(1 for p in layer.parameters() if p.requires_grad)
        dims = powersgd_dims(layer)
        if method == "none":
            total += 4 * params
        elif method == "bf16":
            total += 2 * params
        elif method == "powersgd":
            total += 4 * options["powersgd_rank"] * dims["matrix_dims"] + 4 * dims["vector_params"]
        else:
            total += 8 * max(math.ceil(options["topk_ratio"] * params), tensors)
    return int(total)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import warnings

    import lightning.pytorch as pl
    from hydra import compose, initialize_config_dir

    from uniap_lightning.cli.train import build_module
    from uniap_lightning.planner.config import CONF_DIR
    from uniap_lightning.planner.plan import COMPRESSION_DEFAULTS, Plan
    from uniap_lightning.adapters import extract_chain
    from uniap_lightning.strategy import UniAPStrategy

    warnings.filterwarnings("ignore")
    runs = []
    for label in args.methods:
        method, options = METHODS[label]
        options = {**COMPRESSION_DEFAULTS, **options}
        for seed in args.seeds:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose(config_name="fit", overrides=[f"seed={seed}", f"data.batch_size={args.batch}"])
            pl.seed_everything(seed, verbose=False)
            module, data, _ = build_module(cfg)
            if args.optimizer == "sgd":  # the PowerSGD paper's setting: SGD with momentum (and its error feedback)
                # DGC applies the momentum itself, before top-k: the optimizer then runs without
                momentum = 0.0 if options.get("dgc_momentum") else 0.9
                module.configure_optimizers = lambda m=module, mo=momentum: torch.optim.SGD(
                    m.parameters(), lr=args.lr, momentum=mo)
            chain = extract_chain(module)
            plan = Plan.from_assignment(
                stage_of_layer=[0] * len(chain.names), layer_names=chain.names, pp=1, microbatches=1,
                strategies=[Strategy(world, 1, "replicate", False, method)] * len(chain.names), schedule="1f1b",
                global_batch_size=args.batch, num_devices=world, compression_options=options)
            strategy = UniAPStrategy(plan=plan, monitor=False)
            losses: list[float] = []
            steps: list[tuple[int, int]] = []

            class Record(pl.Callback):
                def on_before_optimizer_step(self, trainer: Any, *a: Any) -> None:
                    rg = strategy.runtime.replicated
                    steps.append((rg.counter.step_bytes, rg.wire_bytes_per_step(),
                                  rg.wire_bytes_per_step(steady=True)))

                def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *a: Any) -> None:
                    losses.append(float(outputs["loss"]))  # the global mean (TrainLossLogger runs first)

            trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps,
                                 callbacks=[Record()], logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                                 num_sanity_val_steps=0)
            t0 = time.perf_counter()
            trainer.fit(module, data)
            seconds = time.perf_counter() - t0
            counted = [c for c, _, _ in steps]
            start = strategy.runtime.replicated.start_step() if method in ("powersgd", "topk") else 0
            steady = counted[start:]
            runs.append({
                "method": label, "seed": seed, "steps": len(steps), "seconds": seconds, "start_step": start,
                "bytes_counted": statistics.median(steady), "bytes_counted_all_equal": len(set(steady)) == 1,
                "bytes_counted_run": sum(counted) / len(counted),
                "bytes_counted_equal_formula_every_step": all(c == f for c, f, _ in steps),
                "bytes_formula": steps[-1][2],
                "bytes_cost_model": _cost_model_bytes(chain.layers, method, options),
                "final_loss": sum(losses[-args.tail:]) / len(losses[-args.tail:]), "losses": losses,
            })
            if rank == 0:
                r = runs[-1]
                print(f"{label:12s} seed {seed}: loss {r['final_loss']:.4f}, {r['bytes_counted']:.0f} bytes/step "
                      f"counted ({r['bytes_formula']} formula), {seconds:.0f} s", flush=True)
    if rank == 0:
        with open(os.path.join(out, "runs.json"), "w") as f:
            json.dump(runs, f)


def table(runs: list[dict[str, Any]], world: int, steps: int) -> str:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["method"], []).append(r)
    base_loss = statistics.median(r["final_loss"] for r in by["none"]) if "none" in by else None
    base_bytes = statistics.median(r["bytes_counted"] for r in by["none"]) if "none" in by else None
    lines = [f"{world} processes, {steps} steps, seeds {sorted({r['seed'] for r in runs})} (medians over seeds)",
             "| method | compressed from step | bytes/step steady, counted | = formula (every step) | cost model "
             "| ratio steady | bytes/step whole run | ratio whole run | final loss | vs none | worst seed vs none |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, rs in by.items():
        counted = statistics.median(r["bytes_counted"] for r in rs)
        run_bytes = statistics.median(r["bytes_counted_run"] for r in rs)
        same = all(r["bytes_counted"] == r["bytes_formula"] and r["bytes_counted_all_equal"]
                   and r["bytes_counted_equal_formula_every_step"] for r in rs)
        loss = statistics.median(r["final_loss"] for r in rs)
        rel = f"{100 * (loss / base_loss - 1):+.2f}%" if base_loss else "-"
        worst = "-"
        if "none" in by:
            pairs = {r["seed"]: r["final_loss"] for r in by["none"]}
            worst = f"{100 * max(r['final_loss'] / pairs[r['seed']] - 1 for r in rs if r['seed'] in pairs):+.2f}%"
        ratio = f"{base_bytes / counted:.1f}x" if base_bytes else "-"
        ratio_run = f"{base_bytes / run_bytes:.1f}x" if base_bytes else "-"
        lines.append(f"| {label} | {rs[0]['start_step']} | {counted:,.0f} | {'yes' if same else 'NO'} | "
                     f"{rs[0]['bytes_cost_model']:,} | {ratio} | {run_bytes:,.0f} | {ratio_run} | {loss:.4f} | {rel} | "
                     f"{worst} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tail", type=int, default=10, help="steps averaged for the final loss")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                        help="adamw: `uniap train`'s (lr 3e-3); sgd: SGD with momentum 0.9 at --lr")
    parser.add_argument("--lr", type=float, default=0.3, help="SGD's learning rate")
    parser.add_argument("--json", help="write every run (numbers and loss curves) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(args.devices, _port(), args, out), nprocs=args.devices,
                           start_method="spawn")
        with open(os.path.join(out, "runs.json")) as f:
            runs = json.load(f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": args.devices, "steps": args.steps, "runs": runs}, f)
    print(f"optimizer: {'AdamW lr 3e-3' if args.optimizer == 'adamw' else f'SGD momentum 0.9 lr {args.lr}'}")
    print(table(runs, args.devices, args.steps))


if __name__ == "__main__":
    main()
