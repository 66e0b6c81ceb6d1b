"""Parity figures of the Hugging Face families: every case of tests/runtime/test_hf_families.py (2 and 4 gloo
ranks, pinned pp / tp / FSDP plans, padded batches) against plain Lightning on one process.

    python benchmarks/hf_parity.py 2>/dev/null | grep '^|'    # one row per case (the ranks print their plans)

Columns: the largest relative difference of a step's loss; the largest absolute difference of any parameter
element; and the share of the tests' tolerance that the worst parameter element uses,
``max |a - b| / (1e-6 + 1e-5 |b|)`` (the tests pass below 1).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

import test_hf_families as t  # noqa: E402
import uniap_rt_helpers as h  # noqa: E402


def figures(results: list[dict], name: str, ref: dict) -> tuple[float, float, float]:
    for res in results:
        if "error" in res.get(name, {"error": "did not run"}):
            raise RuntimeError(f"{name}: {res.get(name, {}).get('error', 'did not run')}")
    losses = torch.tensor(results[0][name]["losses"], dtype=torch.float64)
    expected = torch.tensor(ref["losses"], dtype=torch.float64)
    loss_rel = float(((losses - expected).abs() / expected.abs()).max())
    merged = h.merge_states(results, name)
    abs_diff = used = 0.0
    for k, v in ref["state"].items():
        if not v.is_floating_point():
            continue
        d = (merged[k].double() - v.double()).abs()
        abs_diff = max(abs_diff, float(d.max()))
        used = max(used, float((d / (1e-6 + 1e-5 * v.double().abs())).max()))
    return loss_rel, abs_diff, used


def main() -> None:
    print("| case | ranks | loss rel. diff | param abs. diff | tolerance used |\n|---|---|---|---|---|", flush=True)
    for world, cases in ((2, t.TWO_RANKS), (2, t.TWO_RANKS_SLOW), (4, t.FOUR_RANKS)):
        with tempfile.TemporaryDirectory() as out:
            results = h.spawn(world, cases, Path(out))
        for name, case in cases.items():
            loss_rel, abs_diff, used = figures(results, name, h.reference_for(case))
            print(f"| {name} | {world} | {loss_rel:.1e} | {abs_diff:.1e} | {used:.2f} |", flush=True)


if __name__ == "__main__":
    main()
