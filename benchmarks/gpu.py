"""One GPU: ``Trainer(strategy="uniap")`` against Lightning's own single-device strategy, and ``uniap train``.

    python benchmarks/gpu.py [--runs 3] [--steps 40] [--warmup 10] [--batch 8] [--fp8] [--json FILE] [--markdown FILE]

Needs a CUDA device (it exits with a clear line without one). Everything runs in under 5 minutes on one H200.
``--smoke`` runs the same code on the CPU with a 2-block GPT of width 64 (a check of the script, not a benchmark).

1. **Strategy vs Lightning.** The same ~220M-parameter GPT (``uniap_lightning.adapters.gpt``: 12 blocks, width
   1,024, 16 heads, 1,024 tokens, vocabulary 32,768; AdamW; ``precision="bf16-mixed"``; global batch ``--batch``
   sequences) trains with ``Trainer(accelerator="gpu", devices=1)`` (Lightning's ``SingleDeviceStrategy``) and with
   ``Trainer(..., strategy="uniap")`` (default arguments: the strategy profiles the model on this GPU, measures the
   device, solves and trains the plan). The two alternate ``--runs`` times in one process, in rotating order, each a
   fresh ``Trainer`` and model from the same seed; the first uniap run profiles, the later ones reuse its cache (as a
   user's second run would), and each run's setup time is reported.
   Step time: a callback stamps ``time.perf_counter()`` after ``torch.cuda.synchronize()`` at the end of every
   optimizer step (the same callback for both); a run's figure is the median step after ``--warmup`` steps, and the
   table shows the median over runs and the paired ratio (median over runs of uniap / lightning, back-to-back runs).
   Peak memory: ``torch.cuda.max_memory_allocated`` over the fit, less what was still allocated when the run started
   (stats reset and garbage collected before each run).
   Predicted: the plan's ``estimate`` (time per iteration and the stage's memory) from the strategy's cost model.
   ``--fp8`` adds a third run each time, ``UniAPStrategy(fp8="auto")`` (issue 41): the planner may put layers'
   matmuls in float8 (torchao) where the device has fp8 (the local cluster names H100 / H200 / GH200 by their
   catalogue entries); its row shows its step time and memory, measured and predicted, beside bf16's, and how many
   layers the plan runs in fp8 (paired ratio fp8 / bf16 below the table).
2. **The CLI.** ``uniap train`` on the GPU (``python -m uniap_lightning.cli.main train ...``: the shipped
   ``gpt2_small`` model (124M) on the shipped corpus, ``trainer.accelerator=gpu trainer.devices=1
   trainer.precision=bf16-mixed``), checked for exit code 0 and its loss line.

3. **Offload** (``--offload``, issue 40; ``benchmarks/gpu_offload.py``, which runs alone too): the strategy's plan
   with only its offload fields changed (none, activation offload on every block, state offload on every block),
   pinned, alternating ``--runs`` times; measured step time and peak memory against each plan's prediction and the
   paired ratios offload / none (``--offload-steps``, ``--offload-warmup``, ``--host-link-gbps``).

Prints one table; ``--json`` / ``--markdown`` write the same results (atomically).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

MODEL = dict(vocab_size=32768, block_size=1024, n_layer=12, n_head=16, n_embd=1024)
SMOKE_MODEL = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)  # --smoke: the script on a CPU


def _module() -> Any:
    from uniap_lightning.adapters import CausalLMModule
    from uniap_lightning.adapters.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return CausalLMModule(GPT(GPTConfig(**MODEL)).layers(), lr=3e-4)


def _data(batch: int, steps: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (batch * steps, MODEL["block_size"]), generator=g)
    return DataLoader(TensorDataset(ids, ids), batch_size=batch, shuffle=False, drop_last=True)


class StepClock:
    """Stamps the end of every optimizer step (after the device is done with it)."""

    def __init__(self) -> None:
        import lightning.pytorch as pl

        class _Clock(pl.Callback):
            def __init__(self) -> None:
                self.stamps: list[float] = []
                self.start = 0.0

            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                _sync()
                self.start = time.perf_counter()

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                _sync()
                self.stamps.append(time.perf_counter())

        self.callback = _Clock()

    def median_step_s(self, warmup: int) -> float:
        s = self.callback.stamps
        steps = [b - a for a, b in zip(s[warmup:], s[warmup + 1:])]
        return statistics.median(steps)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak(base: int) -> int:
    return torch.cuda.max_memory_allocated() - base if torch.cuda.is_available() else 0


def _release() -> int:
    """Frees what earlier runs left (a run's peak is counted above what is still allocated before it starts)."""
    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _fit(kind: str, args: argparse.Namespace, cache: str) -> dict[str, Any]:
    import lightning.pytorch as pl

    from uniap_lightning import UniAPStrategy

    clock = StepClock()
    kw: dict[str, Any] = {}
    if kind in ("uniap", "uniap_fp8"):
        # the strategy's defaults, with the cache in this run's folder (not the user's home)
        kw["strategy"] = UniAPStrategy(cache_dir=cache, fp8="auto" if kind == "uniap_fp8" else "off")
    trainer = pl.Trainer(accelerator=args.accelerator, devices=1, precision="bf16-mixed", max_steps=args.steps,
                         callbacks=[clock.callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kw)
    base = _release()
    module = _module()
    t0 = time.perf_counter()
    trainer.fit(module, _data(args.batch, args.steps))
    total = time.perf_counter() - t0
    out: dict[str, Any] = {
        "kind": kind,
        "step_s": clock.median_step_s(args.warmup),
        "peak_bytes": _peak(base),
        "leftover_bytes": base,
        "params": sum(p.numel() for p in module.parameters()),
        "setup_s": clock.callback.start - t0 if clock.callback.start else None,
        "total_s": total,
        "loss": float(trainer.callback_metrics.get("train_loss", float("nan"))),
    }
    if kind in ("uniap", "uniap_fp8"):
        strategy = trainer.strategy
        est = strategy.plan.estimate
        out["plan_origin"] = strategy.plan_origin
        plan = strategy.plan
        recompute = sum(layer.strategy.recompute for layer in plan.layers)
        fp8 = sum(layer.strategy.precision != "default" for layer in plan.layers)
        out["plan"] = (f"pp={plan.pp}, {plan.microbatches} micro-batch(es), {plan.schedule}, "
                       f"recompute {recompute}/{len(plan.layers)} layers, fp8 {fp8}/{len(plan.layers)} layers")
        if est is not None:
            out["predicted_step_s"] = est.tpi_s
            out["predicted_bytes"] = max(est.stage_memory_bytes)
    del trainer, module, clock
    _release()
    return out


def _cli(args: argparse.Namespace, cache: str) -> dict[str, Any]:
    # a fresh job: not the rendezvous of this process's own fits (Lightning left MASTER_PORT etc. in the environment)
    launcher = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                "GROUP_RANK"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env = {**env, "UNIAP_CACHE_DIR": cache, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    model = "tiny_llama" if args.smoke else "gpt2_small"
    extra = [] if args.smoke else ["trainer.precision=bf16-mixed", "trainer.val_check_interval=5",
                                   "trainer.limit_val_batches=0"]
    cmd = [sys.executable, "-m", "uniap_lightning.cli.main", "train", f"model={model}",
           f"trainer.accelerator={args.accelerator}", "trainer.devices=1", f"trainer.max_steps={args.cli_steps}",
           *extra, f"checkpoint_dir={cache}/ckpt"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=cache)
    wall = time.perf_counter() - t0
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"command": " ".join(cmd[2:]), "rc": proc.returncode, "wall_s": wall, "tail": tail}


def _table(rows: list[dict[str, Any]], pairs: list[float], cli: dict[str, Any] | None, device: str,
           fp8_pairs: list[float] | None = None) -> str:
    def med(kind: str, key: str) -> float | None:
        vals = [r[key] for r in rows if r["kind"] == kind and r.get(key) is not None]
        return statistics.median(vals) if vals else None

    ms = lambda v: "-" if v is None else f"{v * 1e3:.2f} ms"  # noqa: E731
    gb = lambda v: "-" if v is None else f"{v / 1e9:.2f} GB"  # noqa: E731
    sec = lambda v: "-" if v is None else f"{v:.1f} s"  # noqa: E731
    lines = [f"device: {device}; model: GPT {MODEL} ({rows[0]['params'] / 1e6:.0f}M parameters), bf16-mixed, AdamW",
             "",
             "| strategy | step (median of runs) | predicted step | peak memory | predicted memory | setup (first / later) |",
             "| --- | --- | --- | --- | --- | --- |"]
    kinds = (("lightning", "Lightning SingleDeviceStrategy"), ("uniap", 'strategy="uniap"'),
             ("uniap_fp8", 'strategy="uniap", fp8="auto"'))
    for kind, label in kinds:
        if not any(r["kind"] == kind for r in rows):
            continue
        setups = [r["setup_s"] for r in rows if r["kind"] == kind]
        later = statistics.median(setups[1:]) if len(setups) > 1 else None
        lines.append(f"| {label} | {ms(med(kind, 'step_s'))} | {ms(med(kind, 'predicted_step_s'))} | "
                     f"{gb(med(kind, 'peak_bytes'))} | {gb(med(kind, 'predicted_bytes'))} | "
                     f"{sec(setups[0] if setups else None)} / {sec(later)} |")
    if pairs:
        lines += ["", f"paired step-time ratio uniap / lightning: median {statistics.median(pairs):.4f} "
                      f"(runs: {', '.join(f'{p:.4f}' for p in pairs)})"]
    if fp8_pairs:
        lines.append(f"paired step-time ratio fp8 / bf16 (both uniap): median {statistics.median(fp8_pairs):.4f} "
                     f"(runs: {', '.join(f'{p:.4f}' for p in fp8_pairs)})")
    for kind in ("uniap", "uniap_fp8"):
        u = [r for r in rows if r["kind"] == kind and r.get("predicted_step_s")]
        if u:
            err = statistics.median(r["step_s"] / r["predicted_step_s"] - 1 for r in u)
            merr = statistics.median(r["peak_bytes"] / r["predicted_bytes"] - 1 for r in u)
            lines.append(f"measured vs predicted ({kind}): step {err:+.1%}, peak memory {merr:+.1%}; plan: "
                         f"{u[0].get('plan')} ({u[0].get('plan_origin')} on the first run)")
    if cli is not None:
        lines += ["", f"`{cli['command']}`: exit code {cli['rc']} in {cli['wall_s']:.1f} s"]
        lines += ["    " + t for t in cli["tail"][-6:]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cli-steps", type=int, default=20)
    p.add_argument("--no-cli", action="store_true")
    p.add_argument("--fp8", action="store_true", help='also run UniAPStrategy(fp8="auto") each time (issue 41)')
    p.add_argument("--smoke", action="store_true", help="the script on the CPU with a tiny model (no benchmark)")
    p.add_argument("--offload", action="store_true", help="then plans differing only in offload (gpu_offload.py)")
    p.add_argument("--json")
    p.add_argument("--markdown")
    import gpu_offload  # benchmarks/ is on the path (this script's folder)

    gpu_offload.add_arguments(p)
    args = p.parse_args(argv)
    args.accelerator = "cpu" if args.smoke else "gpu"
    if args.smoke:
        MODEL.update(SMOKE_MODEL)
    elif not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    if args.steps <= args.warmup + 2:
        p.error("--steps must exceed --warmup by at least 3")
    if args.offload:
        gpu_offload.check_arguments(p, args)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.backends.cuda.matmul.allow_tf32 = True
    device = "cpu (--smoke)" if args.smoke else torch.cuda.get_device_name(0)
    rows: list[dict[str, Any]] = []
    pairs: list[float] = []
    fp8_pairs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="uniap_gpu_bench_") as cache:
        for run in range(args.runs):
            order = ("lightning", "uniap") if run % 2 == 0 else ("uniap", "lightning")
            if args.fp8:
                order = (*order, "uniap_fp8") if run % 2 == 0 else ("uniap_fp8", *order)
            got = {}
            for kind in order:
                got[kind] = _fit(kind, args, cache)
                rows.append(got[kind])
                print(f"run {run + 1}/{args.runs} {kind}: {got[kind]['step_s'] * 1e3:.2f} ms/step, "
                      f"peak {got[kind]['peak_bytes'] / 1e9:.2f} GB, loss {got[kind]['loss']:.4f}", flush=True)
            pairs.append(got["uniap"]["step_s"] / got["lightning"]["step_s"])
            if args.fp8:
                fp8_pairs.append(got["uniap_fp8"]["step_s"] / got["uniap"]["step_s"])
        cli = None if args.no_cli else _cli(args, cache)
        offload = gpu_offload.run(sys.modules[__name__], args, cache) if args.offload else None
    table = _table(rows, pairs, cli, device, fp8_pairs)
    if offload is not None:
        table += "\n\n" + gpu_offload.table(offload, device)
    print(table)
    from uniap_lightning.files import write_text_atomic

    if args.json:
        write_text_atomic(args.json, json.dumps({"device": device, "model": MODEL, "runs": rows, "pairs": pairs,
                                                 "fp8_pairs": fp8_pairs, "cli": cli, "offload": offload},
                                                indent=2))
    if args.markdown:
        write_text_atomic(args.markdown, table + "\n")
    return 0 if cli is None or cli["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
