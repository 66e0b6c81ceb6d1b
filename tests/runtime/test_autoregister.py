"""``Trainer(strategy="uniap")`` works without importing uniap_lightning, through the ``.pth`` hook."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    # A fresh interpreter processes the shipped .pth through site.addsitedir, as at start-up, then runs `code`.
    script = f"import site; site.addsitedir({str(REPO)!r})\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_pth_hook_does_not_import_torch_or_lightning() -> None:
    out = _run("import sys; print('torch' in sys.modules, 'lightning' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_trainer_accepts_uniap_by_name() -> None:
    out = _run(
        """
        import lightning.pytorch as pl
        trainer = pl.Trainer(strategy="uniap", accelerator="cpu", devices=1, logger=False)
        print(type(trainer.strategy).__name__)
        from lightning.pytorch.strategies import StrategyRegistry
        print("uniap" in StrategyRegistry)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["UniAPStrategy", "True"]


def test_register_strategies_is_idempotent() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from uniap_lightning.strategy import UniAPStrategy

    UniAPStrategy.register_strategies(StrategyRegistry)
    UniAPStrategy.register_strategies(StrategyRegistry)
    assert StrategyRegistry["uniap"]["strategy"] is UniAPStrategy
