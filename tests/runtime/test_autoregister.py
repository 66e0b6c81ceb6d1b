"""``Trainer(strategy="uniap")`` works without importing uniap_lightning, after installing the package as the README
does (``pip install -e .``) and after a regular install, in a fresh environment and a fresh interpreter.

Each test makes a new virtual environment and installs only this package into it (``--no-deps``: the heavy
dependencies come from the test's own environment through ``PYTHONPATH``, which Python does not scan for ``.pth``
files, so only the new environment's site-packages can register the strategy).
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

USE_BY_NAME = """
    import lightning.pytorch as pl  # the script never imports uniap_lightning
    trainer = pl.Trainer(strategy="uniap", accelerator="cpu", devices=1, logger=False)
    print(type(trainer.strategy).__name__)
"""


@pytest.fixture(scope="module")
def dependencies_path() -> str:
    return os.pathsep.join(p for p in site.getsitepackages() if Path(p).is_dir())


def _install(env_dir: Path, *pip_args: str) -> Path:
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    out = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *pip_args], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return python


def _run(python: Path, code: str, deps: str, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": deps}
    return subprocess.run([str(python), *flags, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=python.parent)


@pytest.mark.parametrize("editable", [True, False], ids=["pip-install-e", "pip-install"])
def test_strategy_name_works_after_install_without_import(editable: bool, tmp_path: Path,
                                                          dependencies_path: str) -> None:
    python = _install(tmp_path / "env", *(["-e", str(REPO)] if editable else [str(REPO)]))
    out = _run(python, USE_BY_NAME, dependencies_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "UniAPStrategy"
    assert "could not register" not in out.stderr and "auto-registration disabled" not in out.stderr, out.stderr
    # the hook itself imports neither torch nor Lightning at start-up
    start = _run(python, "import sys; print('torch' in sys.modules, 'lightning' in sys.modules)", dependencies_path)
    assert start.returncode == 0, start.stderr
    assert start.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("first_import", [
    "from uniap_lightning import UniAPStrategy",
    "import uniap_lightning.strategy",
    "import lightning.pytorch.strategies; import uniap_lightning",
    "import uniap_lightning.callbacks",  # a module that imports Lightning itself, before the strategy exists
    "import uniap_lightning.precision",
])
def test_any_import_order_registers_once_without_warning(first_import: str) -> None:
    # a fresh interpreter of the test's own environment (where the package is installed as the README says)
    code = f"""
        {first_import}
        from lightning.pytorch.strategies import StrategyRegistry
        from uniap_lightning.strategy import UniAPStrategy
        print(isinstance(StrategyRegistry.get("uniap"), UniAPStrategy))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "True"
    assert "uniap_lightning:" not in out.stderr, out.stderr


def test_register_strategies_is_idempotent() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    from uniap_lightning.strategy import UniAPStrategy

    UniAPStrategy.register_strategies(StrategyRegistry)
    UniAPStrategy.register_strategies(StrategyRegistry)
    assert StrategyRegistry.available_strategies().count("uniap") == 1
    assert isinstance(StrategyRegistry.get("uniap"), UniAPStrategy)
