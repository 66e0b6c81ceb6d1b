"""One GPU: the same GPT trained with plans that differ only in offload (issue 40's proof), measured and predicted.

    python benchmarks/gpu_offload.py [--runs 3] [--offload-steps 20] [--offload-warmup 5] [--batch 8]
                                     [--host-link-gbps G] [--smoke] [--json FILE] [--markdown FILE]
    python benchmarks/gpu.py --offload ...      (the same, after gpu.py's own runs, in the same plan cache)

The model, data, precision and step clock are ``benchmarks/gpu.py``'s (the ~220M-parameter GPT, bf16-mixed, AdamW,
global batch ``--batch``; ``--smoke``: the 2-block GPT of width 64 on the CPU, a check of the script, not a
benchmark). First a short fit with ``UniAPStrategy()``'s defaults plans the job (profile, cluster, solve; a cache
hit after gpu.py's runs). From that plan three are derived by changing only the offload fields of every block
(the chain's layers between the embedding and the head; each other field, the stages and the micro-batches stay):

- ``none``: no layer offloads (the strategy's own plan: the local cluster does not allow offload);
- ``activations``: ``offload=True`` (``runtime/dimensions/offload.py``: saved tensors to pinned host memory in
  forward, back before backward, on a side stream);
- ``state``: ``state_offload=True`` (``runtime/dimensions/state_offload.py``: FSDP2's ``CPUOffloadPolicy``, the
  optimizer steps on the host).

A block the planner's rules refuse the field (say a recomputed layer for activation offload) keeps the strategy's
choice; the table says how many layers each plan offloads. Each plan is priced by the planner's ``evaluate`` on the
strategy's own problem (its measured profile, its training config) and cluster with offload allowed and the host
link of the catalogue device (``--host-link-gbps`` overrides: the device's PCIe / NVLink-C2C figure x
``HOST_LINK_EFFICIENCY``; the strategy's plan re-priced there must give the strategy's own estimate, which the
table checks), then pinned: ``UniAPStrategy(plan=...)``. The three alternate ``--runs`` times in rotating order,
each a fresh ``Trainer`` and model from the same seed: per run the median step after ``--offload-warmup`` steps
(the end of each optimizer step after ``torch.cuda.synchronize()``) and ``torch.cuda.max_memory_allocated`` less
what was allocated before the run (as gpu.py); the table shows medians over runs beside the predictions and the
paired ratios offload / none (per run, back to back) beside the predicted ratio.

On the CPU (``--smoke``) nothing here is a measurement: no device memory (``n/a``), and the CPU has no host link,
so the predictions price the copies over a nominal link (the local cluster's intra-node figure, or
``--host-link-gbps``), only so the same code runs. What a GPU run must still confirm (issue 40): that activation
offload lowers the measured peak by about what the plan predicts (its saved activations leave the device; one
layer's come back with a prefetch beside them) and that its copies hide behind compute as priced (PCIe 5.0 on an
H200: the step time ratio); that state offload removes the parameter, gradient and optimizer bytes from the peak
and that the host's optimizer step costs what the link bound says (its time is priced as the state read once
over the host link; a slow host CPU shows as a measured step above the prediction); and the losses equal across
the three plans (numerics do not change). Sized for one H200: 3 runs x 3 plans x 20 steps, the state-offload
steps bound by the host's AdamW over 220M parameters (about 1 s each), a few minutes in all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

#: the plans compared, in the first run's order (later runs rotate it)
VARIANTS = ("none", "activations", "state")
LABELS = {"none": "no offload", "activations": "activation offload (every block)",
          "state": "state offload (every block)"}
FIELDS = {"activations": "offload", "state": "state_offload"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options this section adds to gpu.py's (``--runs``, ``--batch``, ``--smoke`` are shared)."""
    p.add_argument("--offload-steps", type=int, default=20, help="optimizer steps per offload run")
    p.add_argument("--offload-warmup", type=int, default=5, help="steps left out of each offload run's median")
    p.add_argument("--host-link-gbps", type=float, default=None,
                   help="host link to price offload with (default: the catalogue device's effective figure)")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.offload_steps <= args.offload_warmup + 1:
        p.error("--offload-steps must exceed --offload-warmup by at least 2")


def blocks(plan: Any) -> list[int]:
    """The GPT chain's blocks: every layer between the embedding (first) and the head (last)."""
    return list(range(1, len(plan.layers) - 1))


def derive(plan: Any, variant: str) -> tuple[Any, int]:
    """``plan`` with only its offload fields changed: both off everywhere, then ``variant``'s on every block whose
    strategy the planner's rules accept with it. Returns the plan (no report) and how many layers offload."""
    from uniap_lightning.errors import UniAPError

    layers, offloaded = [], 0
    on = set(blocks(plan))
    for u, lp in enumerate(plan.layers):
        s = lp.strategy._replace(offload=False, state_offload=False)
        if variant in FIELDS and u in on:
            t = s._replace(**{FIELDS[variant]: True})
            try:
                t.check(f"layer {lp.name}")
                s, offloaded = t, offloaded + 1
            except UniAPError:  # e.g. a recomputed layer: it keeps the strategy's choice
                pass
        layers.append(replace(lp, strategy=s))
    return replace(plan, layers=layers, report=type(plan.report)()), offloaded


def pricing(result: Any, host_link_gbps: float | None) -> tuple[Any, float]:
    """``evaluate`` over the strategy's own problem (``result``: its SetupResult) on its planning cluster with
    offload allowed over the host link; returns the pricing function and the link (GB/s, one direction)."""
    from uniap_lightning.planner.cost.evaluate import evaluate
    from uniap_lightning.planner.devices import HOST_LINK_EFFICIENCY, lookup_device
    from uniap_lightning.planner.problem import Problem, TrainingConfig

    cluster = result.planning_cluster
    if host_link_gbps is None:
        spec = lookup_device(cluster.device)
        # a device the catalogue lacks (the CPU of --smoke): a nominal link, only so the pricing runs
        host_link_gbps = spec.host_link_gbps * HOST_LINK_EFFICIENCY if spec is not None else cluster.intra_bw_gbps
    problem = Problem(model=result.profile, cluster=replace(cluster, offload="auto", host_link_gbps=host_link_gbps),
                      training=TrainingConfig(**result.report["training"]))
    return (lambda plan: evaluate(problem, plan)), host_link_gbps


def _fit(bench: Any, args: argparse.Namespace, cache: str, plan: Any, steps: int) -> tuple[dict[str, Any], Any]:
    import lightning.pytorch as pl

    from uniap_lightning import UniAPStrategy

    clock = bench.StepClock()
    strategy = UniAPStrategy(cache_dir=cache, plan=plan)
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, precision="bf16-mixed", max_steps=steps,
                         callbacks=[clock.callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         strategy=strategy)
    base = bench._release()
    module = bench._module()
    t0 = time.perf_counter()
    trainer.fit(module, bench._data(args.batch, steps))
    out = {"step_s": clock.median_step_s(args.offload_warmup) if steps > args.offload_warmup + 1 else None,
           "peak_bytes": bench._peak(base) if args.accelerator == "gpu" else None, "leftover_bytes": base,
           "total_s": time.perf_counter() - t0,
           "loss": float(trainer.callback_metrics.get("train_loss", float("nan")))}
    result = strategy.setup_result
    del trainer, module, clock, strategy
    bench._release()
    return out, result


def run(bench: Any, args: argparse.Namespace, cache: str) -> dict[str, Any]:
    """The section: plan once, derive and price the three plans, run them ``--runs`` times in rotating order."""
    _, result = _fit(bench, args, cache, None, 1)  # the strategy's own plan (its defaults), one step
    price, link = pricing(result, args.host_link_gbps)
    plans, predicted = {}, {}
    for v in VARIANTS:
        plan, n = derive(result.plan, v)
        est = price(plan)
        plans[v] = plan.with_report(estimate=est)
        predicted[v] = {"step_s": est.tpi_s, "bytes": max(est.stage_memory_bytes), "layers": n,
                        "feasible": est.feasible}
    own = result.plan.estimate
    rows: list[dict[str, Any]] = []
    pairs: dict[str, dict[str, list[float]]] = {v: {"step": [], "memory": []} for v in VARIANTS[1:]}
    for r in range(args.runs):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        got = {}
        for v in order:
            got[v], _ = _fit(bench, args, cache, plans[v], args.offload_steps)
            rows.append({"variant": v, "run": r + 1, **got[v]})
            step = "-" if got[v]["step_s"] is None else f"{got[v]['step_s'] * 1e3:.2f} ms/step"
            peak = "n/a" if got[v]["peak_bytes"] is None else f"{got[v]['peak_bytes'] / 1e9:.2f} GB"
            print(f"offload run {r + 1}/{args.runs} {v}: {step}, peak {peak}, loss {got[v]['loss']:.5f}", flush=True)
        for v in VARIANTS[1:]:
            if got[v]["step_s"] and got["none"]["step_s"]:
                pairs[v]["step"].append(got[v]["step_s"] / got["none"]["step_s"])
            if got[v]["peak_bytes"] and got["none"]["peak_bytes"]:
                pairs[v]["memory"].append(got[v]["peak_bytes"] / got["none"]["peak_bytes"])
    return {"host_link_gbps": link, "plan": _describe(result.plan), "plan_origin": result.origin,
            "strategy_estimate": None if own is None else {"step_s": own.tpi_s,
                                                           "bytes": max(own.stage_memory_bytes)},
            "predicted": predicted, "runs": rows, "pairs": pairs}


def _describe(plan: Any) -> str:
    s = plan.layers[1].strategy if len(plan.layers) > 2 else plan.layers[0].strategy
    return (f"pp={plan.pp}, {plan.microbatches} micro-batch(es), {plan.schedule}, {len(plan.layers)} layers; "
            f"blocks {s.label()}")


def table(res: dict[str, Any], device: str) -> str:
    def med(v: str, key: str) -> float | None:
        vals = [r[key] for r in res["runs"] if r["variant"] == v and r.get(key) is not None]
        return statistics.median(vals) if vals else None

    ms = lambda v: "-" if v is None else f"{v * 1e3:.2f} ms"  # noqa: E731
    gb = lambda v: "n/a" if v is None else f"{v / 1e9:.2f} GB" if v >= 1e8 else f"{v / 1e6:.2f} MB"  # noqa: E731
    pred = res["predicted"]
    n = len({r["run"] for r in res["runs"]})
    lines = [f"offload (issue 40) on {device}: the strategy's plan ({res['plan']}; {res['plan_origin']}) with only "
             f"the offload fields changed; host link {res['host_link_gbps']:.1f} GB/s per direction",
             "",
             f"| plan | layers offloaded | step (median of {n} runs) | predicted step | peak memory | "
             "predicted memory | loss |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for v in VARIANTS:
        p = pred[v]
        lines.append(f"| {LABELS[v]} | {p['layers']} | {ms(med(v, 'step_s'))} | {ms(p['step_s'])} | "
                     f"{gb(med(v, 'peak_bytes'))} | {gb(p['bytes'])}{'' if p['feasible'] else ' (over)'} | "
                     f"{med(v, 'loss'):.5f} |")
    lines.append("")
    for v in VARIANTS[1:]:
        pr = res["pairs"][v]
        step = (f"median {statistics.median(pr['step']):.3f} (runs: {', '.join(f'{x:.3f}' for x in pr['step'])})"
                if pr["step"] else "-")
        mem = (f"median {statistics.median(pr['memory']):.3f} (runs: {', '.join(f'{x:.3f}' for x in pr['memory'])})"
               if pr["memory"] else "n/a")
        ratio = pred[v]["step_s"] / pred["none"]["step_s"], pred[v]["bytes"] / pred["none"]["bytes"]
        lines.append(f"paired ratio {v} / none: step {step}, predicted {ratio[0]:.3f}; "
                     f"peak memory {mem}, predicted {ratio[1]:.3f}")
    for v in VARIANTS:
        step, peak = med(v, "step_s"), med(v, "peak_bytes")
        err = "-" if step is None else f"{step / pred[v]['step_s'] - 1:+.1%}"
        merr = "n/a" if peak is None else f"{peak / pred[v]['bytes'] - 1:+.1%}"
        lines.append(f"measured vs predicted ({v}): step {err}, peak memory {merr}")
    own = res["strategy_estimate"]
    if own is not None:
        same = all(abs(pred["none"][k] / own[k] - 1) < 1e-9 for k in ("step_s", "bytes"))
        lines.append(f"the strategy's own estimate {ms(own['step_s'])}, {gb(own['bytes'])}: "
                     f"{'equal to' if same else 'DIFFERS from'} its plan re-priced with offload allowed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import gpu as bench

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="the script on the CPU with a tiny model (no benchmark)")
    p.add_argument("--json")
    p.add_argument("--markdown")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.smoke:
        bench.MODEL.update(bench.SMOKE_MODEL)
    elif not torch.cuda.is_available():
        print("benchmarks/gpu_offload.py needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    args.accelerator = "cpu" if args.smoke else "gpu"
    check_arguments(p, args)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.backends.cuda.matmul.allow_tf32 = True
    device = "cpu (--smoke)" if args.smoke else torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory(prefix="uniap_gpu_offload_") as cache:
        res = run(bench, args, cache)
    text = table(res, device)
    print(text)
    from uniap_lightning.files import write_text_atomic

    if args.json:
        write_text_atomic(args.json, json.dumps({"device": device, "model": bench.MODEL, "offload": res}, indent=2))
    if args.markdown:
        write_text_atomic(args.markdown, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
