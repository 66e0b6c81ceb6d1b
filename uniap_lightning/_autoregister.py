"""Register ``strategy="uniap"`` with Lightning without ``import uniap_lightning`` in the user's script.

Lightning has no entry-point discovery for strategies, so the wheel ships ``uniap_lightning_autoregister.pth``
(one line that calls :func:`install` and, should that fail, only prints why). At interpreter start it only appends a
tiny finder to ``sys.meta_path`` - no torch, no Lightning. When ``lightning.pytorch.strategies`` is imported for
the first time, the finder removes itself, lets the normal import run, then registers :class:`UniAPStrategy` in
``StrategyRegistry``. (``.pth`` files are skipped under ``python -S`` / ``-I``; there, import uniap_lightning.)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

TARGET = "lightning.pytorch.strategies"


class _RegisterAfterExec(importlib.abc.Loader):
    """Wraps the real loader of the target module; registers the strategy once the module body has run."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if _strategy_module_importing():
            return  # our strategy module is what imported Lightning; it calls register() when its class exists
        try:
            register(module.StrategyRegistry)
        except Exception as err:  # never break Lightning's import because of us
            print(f"uniap_lightning: could not register strategy 'uniap' ({err!r})", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    """One-shot: answers only for the target module, then steps out of ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != TARGET:
            return None
        uninstall()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisterAfterExec(spec.loader)
        return spec


STRATEGY_MODULE = "uniap_lightning.strategy"


def register(registry: Any) -> None:
    """The one place that registers ``"uniap"`` in Lightning's ``StrategyRegistry`` (idempotent)."""
    from uniap_lightning.strategy import UniAPStrategy

    UniAPStrategy.register_strategies(registry)


def _strategy_module_importing() -> bool:
    """True while ``uniap_lightning.strategy`` runs its own body (it imports Lightning before defining the class:
    importing it again from Lightning's import would find a half-made module)."""
    module = sys.modules.get(STRATEGY_MODULE)
    return module is not None and not hasattr(module, "UniAPStrategy")


def install() -> None:
    """Arrange registration (idempotent; registers at once if Lightning's strategies are already imported)."""
    module = sys.modules.get(TARGET)
    if module is not None:
        if not _strategy_module_importing():
            register(module.StrategyRegistry)
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
