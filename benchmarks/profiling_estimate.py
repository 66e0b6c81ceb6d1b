"""Setup's duration estimate against the measuring it predicts (issue 42, item 5): `uniap train` on this CPU.

Each case runs ``uniap train ... trainer.max_steps=1`` in a fresh process with an empty profile cache, reads the
estimate line (said before anything is measured) and setup's own timings of each phase (layer timing, TP/FSDP
timing, cluster links), and prints predicted vs measured as a Markdown table (ratio: measured / predicted; the
target is within 2x either way).

    python benchmarks/profiling_estimate.py                # tiny_gpt, gpt2_small (shorter sequences), ~10 min
    python benchmarks/profiling_estimate.py --cases tiny_gpt
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time

#: (label, overrides): shipped models that are practical on a CPU
CASES: dict[str, list[str]] = {
    "tiny_gpt": ["model=tiny_gpt"],
    "tiny_gpt_1dev": ["model=tiny_gpt", "trainer.devices=1"],
    "gpt2_small_seq64": ["model=gpt2_small", "data.seq_len=64", "data.batch_size=8"],
    "gpt2_small_seq128_r1": ["model=gpt2_small", "data.seq_len=128", "data.batch_size=8",
                             "strategy.profile_repeats=1"],
}

_UNIT = {"s": 1.0, "min": 60.0, "h": 3600.0}


def _seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) * _UNIT[unit]


def _duration_after(label: str, line: str) -> float:
    found = re.search(rf"{label} (\d+(?:\.\d+)? (?:s|min|h))", line)
    return _seconds(found.group(1)) if found else 0.0


def run_case(overrides: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["uniap", "train", *overrides, "trainer.max_steps=1", f"strategy.cache_dir={tmp}/cache",
               f"checkpoint_dir={tmp}/ckpt", "+trainer.enable_progress_bar=false"]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, check=False)
        wall = time.perf_counter() - t0
    text = out.stdout + out.stderr
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{text[-2000:]}")
    line = next(x for x in text.splitlines() if "setup will measure" in x)
    layers = [float(m) for m in re.findall(r"profiling: timed \d+ layers at micro-batch \d+ \(([\d.]+) s\)", text)]
    strategies = re.search(r"timed TP / FSDP overheads in ([\d.]+) s", text)
    cluster = re.search(r"cluster links \(measured, ([\d.]+) s\)", text)
    r = {
        "pred_layers": _duration_after("layer timing", line),
        "pred_strategies": _duration_after("TP/FSDP timing", line),
        "pred_cluster": _duration_after("cluster links", line),
        "layers": layers[-1] if layers else 0.0, "strategies": float(strategies.group(1)) if strategies else 0.0,
        "cluster": float(cluster.group(1)) if cluster else 0.0, "wall": wall,
    }
    r["pred_total"] = r["pred_layers"] + r["pred_strategies"] + r["pred_cluster"]
    r["total"] = r["layers"] + r["strategies"] + r["cluster"]
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {sys.platform}; seconds, predicted / measured")
    print("| case | overrides | layer timing | TP/FSDP timing | cluster links | all measuring | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in args.cases:
        r = run_case(CASES[name])

        def pair(key: str) -> str:
            return f"{r['pred_' + key]:.1f} / {r[key]:.1f}"

        ratio = r["total"] / r["pred_total"] if r["pred_total"] else float("nan")
        print(f"| {name} | `{' '.join(CASES[name])}` | {pair('layers')} | {pair('strategies')} | {pair('cluster')} "
              f"| {pair('total')} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
