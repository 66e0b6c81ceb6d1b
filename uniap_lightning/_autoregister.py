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


NAME = "uniap"


def make_strategy(**kwargs: Any) -> Any:
    """What ``"uniap"`` is registered as: builds a :class:`~uniap_lightning.strategy.UniAPStrategy`, importing it
    only when a Trainer asks for one. Registering the class itself would import it (and torch, and Lightning's
    submodules) in the middle of Lightning's own import, where half-made modules break the import."""
    from uniap_lightning.strategy import UniAPStrategy  # deferred: loads torch and lightning, at every start else

    return UniAPStrategy(**kwargs)


def register(registry: Any) -> None:
    """The one place that registers ``"uniap"`` in Lightning's ``StrategyRegistry`` (idempotent)."""
    if NAME not in registry:
        registry.register(NAME, make_strategy, description="UniAP automatic hybrid parallelism")


def install() -> None:
    """Arrange registration (idempotent; registers at once if Lightning's strategies are already imported)."""
    module = sys.modules.get(TARGET)
    if module is not None:
        register(module.StrategyRegistry)
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
