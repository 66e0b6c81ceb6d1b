"""The strategy's options that setup reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.plan import Plan


@dataclass(frozen=True)
class SetupOptions:
    """The strategy's options that setup reads (see ``UniAPStrategy``'s docstring for each)."""

    cluster: Cluster | None = None
    pinned_plan: Plan | None = None
    schedule: str = "1f1b"
    solver: str = "auto"
    time_limit_s: float = 60.0
    profile_path: Path | None = None
    cache_dir: Path | None = None
    measure_cluster: bool = True
    profile_cache: bool = True
    profile_repeats: int = 3
    profile_micro_batches: tuple[int, ...] | None = None

    def profile_cache_dir(self) -> Path:
        from uniap_lightning.profiling.cache import default_profile_cache_dir

        return self.cache_dir / "profiles" if self.cache_dir is not None else default_profile_cache_dir()

    def plan_cache_dir(self) -> Path:
        from uniap_lightning.runtime.planning import default_cache_dir

        return self.cache_dir or default_cache_dir()
