"""End-of-sweep summary for ``uniap ... -m``: one table (printed, and summary.csv in the sweep folder)."""

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

COLUMNS = ("model", "cluster", "devices", "batch_size", "pp", "microbatches", "strategies", "tpi_s",
           "samples_per_s", "measured_samples_per_s", "final_loss", "train_ppl", "solve_s", "error")


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = []
        for path in sorted(sweep_dir.glob("*/result.json"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0):
            try:  # each job's own result.json; one damaged file is one row saying so, not a lost summary
                data = read_json(path, "sweep result")
            except UniAPError as err:
                data = {"error": str(err)}
            if not isinstance(data, dict):
                data = {"error": f"{path}: not a JSON object"}
            rows.append({k: data.get(k) for k in COLUMNS})
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
        failed = sum(1 for r in rows if r.get("error"))
        if failed and "trainer" in config:  # a training job that failed is a failed sweep (a plan that does not
            # fit is an answer of a planning sweep, shown in its row)
            print(f"error: {failed} of {len(rows)} training runs failed (see the error column)", file=sys.stderr)
            sys.exit(2)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}"
    return str(v)
