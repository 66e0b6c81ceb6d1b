"""End-of-sweep summary for ``uniap ... -m``: one table (printed, and summary.csv in the sweep folder), then the
sweep's exit status: that of its worst job, as the job would have exited alone (a CI script can tell a sweep
where a job failed or found no plan from one where every job gave a plan; ``allow_no_plan=true`` accepts
"no plan fits" rows)."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.table import Table
from rich.text import Text

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import read_json, write_text_atomic
from uniap_lightning.planner.report import make_console

COLUMNS = ("model", "cluster", "devices", "batch_size", "pp", "schedule", "microbatches", "strategies", "tpi_s",
           "samples_per_s", "measured_samples_per_s", "final_loss", "train_ppl", "solve_s", "error")


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows, codes = [], []
        for path in sorted(sweep_dir.glob("*/result.json"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0):
            try:  # each job's own result.json; one damaged file is one row saying so, not a lost summary
                data = read_json(path, "sweep result")
            except UniAPError as err:
                data = {"error": str(err)}
            if not isinstance(data, dict):
                data = {"error": f"{path}: not a JSON object"}
            rows.append({k: data.get(k) for k in COLUMNS})
            codes.append((exit_code(data), bool(data.get("no_plan"))))
        if not rows:
            return
        cols = [c for c in COLUMNS if any(r.get(c) is not None for r in rows)]
        buf = io.StringIO(newline="")
        writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        write_text_atomic(sweep_dir / "summary.csv", buf.getvalue())
        table = Table(title=f"Sweep summary ({len(rows)} runs) -> {sweep_dir / 'summary.csv'}", title_justify="left")
        for c in cols:
            table.add_column(c)
        for r in rows:
            table.add_row(*[Text(_fmt(r.get(c))) for c in cols])  # Text: error text is never read as rich markup
        make_console().print(table)
        worst = worst_exit_code([code for code, _ in codes])
        if worst:
            failed = sum(1 for code, no_plan in codes if code and not no_plan)
            no_plan = sum(1 for code, no_plan in codes if code and no_plan)
            runs = "training runs" if "trainer" in config else "runs"
            said = [f"{failed} of {len(rows)} {runs} failed"] if failed else []
            if no_plan:
                said.append(f"{no_plan} of {len(rows)} {runs} found no plan that fits")
            hint = "; allow_no_plan=true accepts rows where no plan fits" if no_plan else ""
            print(f"error: {', '.join(said)} (see the error column{hint}): exit status {worst}", file=sys.stderr)
            sys.exit(worst)


def exit_code(result: Any) -> int:
    """The status a job would have exited with alone: its recorded ``exit_code``; a job that recorded none (a
    damaged result.json, or one written before the field): 2 if it has an error, else 0."""
    if not isinstance(result, dict):
        return 2
    code = result.get("exit_code")
    if isinstance(code, int) and not isinstance(code, bool) and 0 <= code <= 255:
        return code
    return 2 if result.get("error") else 0


def worst_exit_code(codes: list[int]) -> int:
    """The sweep's status: 0 if every job succeeded; else a failure (2, or any status but 3) before evaluate's
    "the plan does not fit memory" (3), the larger first among failures."""
    failures = [c for c in codes if c not in (0, 3)]
    if failures:
        return max(failures)
    return 3 if 3 in codes else 0


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}"
    return str(v)
