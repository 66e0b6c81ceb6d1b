"""What ``UniAPStrategy`` measures at setup before planning: the cluster's links and the model's profile.

A mixin of :class:`uniap_lightning.strategy.UniAPStrategy` (kept apart from the training lifecycle so each file
holds one concern). In order, when the strategy plans by itself:

1. :meth:`SetupMeasurements._local_cluster` - this machine as a :class:`~uniap_lightning.planner.cluster.Cluster`, its
   collectives and pipeline slot measured on the job's process group (``profiling/collectives.py``), or read from
   the on-disk cache; every rank takes part.
2. :meth:`SetupMeasurements._profile` - the layer profile: a pinned file, the cache, or measured
   (``profiling/module.py``); with several processes every rank measures at once (each size in step, the median
   over ranks counts), then :meth:`_time_strategies` times each distinct layer under TP and FSDP
   (``profiling/strategies.py``). Rank 0 plans with the result.

Each phase says on rank 0 what it measures and how long it took.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.errors import UniAPError

if TYPE_CHECKING:
    from uniap_lightning.planner.profile import ModelProfile
    from uniap_lightning.runtime import Chain


class SetupMeasurements:
    """Cluster and model measurements at setup (mixed into ``UniAPStrategy``, whose attributes it reads)."""

    def _local_cluster(self) -> Cluster:
        """The local machine as a Cluster; with ``measure_cluster``, its links measured on this process group
        (or read from the cache). Called on every rank."""
        import time

        import torch.distributed as dist

        from uniap_lightning.profiling.cache import cluster_key, load_cached_json, save_cached_json
        from uniap_lightning.runtime.planning import local_cluster

        base = local_cluster(nodes=self.num_nodes, devices_per_node=self.num_processes,
                             device_type=self.root_device.type)
        if not self._measure_cluster or self.world_size < 2 or not dist.is_initialized():
            self.setup_report["cluster_origin"] = "constants"
            return base
        from uniap_lightning.profiling.collectives import apply_to_cluster, measure_collectives

        t0 = time.perf_counter()
        cache_dir = self._profile_cache_dir()
        key = cluster_key(device=_device_name(self.root_device), backend=str(dist.get_backend()),
                          nodes=self.num_nodes, devices_per_node=self.num_processes)
        name = f"cluster-{key}.json"
        cached = None
        if self.global_rank == 0 and self._profile_cache:
            cached = load_cached_json(cache_dir, name)
        cached = self.broadcast(cached, src=0)
        if cached is not None:
            measured, origin = cached, f"cache {cache_dir / name}"
        else:
            _info(f"UniAP: measuring collectives on {self.world_size} ranks (all-reduce, all-gather, reduce-scatter, "
                  "p2p) ...")
            measured = measure_collectives(repeats=3, devices_per_node=self.num_processes,
                                           sizes_bytes=(1 << 12, 1 << 20))
            measured["ops"] = {op: {int(p): r for p, r in recs.items()} for op, recs in measured["ops"].items()}
            origin = "measured"
            if self.global_rank == 0 and self._profile_cache:
                try:
                    save_cached_json(cache_dir, name, measured)
                except OSError:
                    pass
        measured["ops"] = {op: {int(p): r for p, r in recs.items()} for op, recs in measured["ops"].items()}
        cluster = apply_to_cluster(base, measured)
        self.setup_report["cluster_s"] = time.perf_counter() - t0
        self.setup_report["cluster_origin"] = origin
        from uniap_lightning.profiling.collectives import describe_collectives

        table = describe_collectives(cluster).replace("\n", "; ")
        _info(f"UniAP: cluster links ({origin}, {self.setup_report['cluster_s']:.1f} s), bus bandwidth / latency by "
              f"group size: {table}")
        return cluster

    def _profile_cache_dir(self) -> Path:
        from uniap_lightning.profiling.cache import default_profile_cache_dir

        return self._cache_dir / "profiles" if self._cache_dir is not None else default_profile_cache_dir()

    def _profile(self, chain: Chain, batch: Any, why: str = "", *, everywhere: bool = False) -> ModelProfile | None:
        """The model's profile (file, cache or measured). ``everywhere``: collective, every rank measures at once
        and also times the layers under TP / FSDP (:mod:`uniap_lightning.profiling.strategies`); rank 0 gets the
        profile, the other ranks ``None``."""
        import time

        import torch.distributed as dist

        from uniap_lightning.profiling.cache import (
            check_profile_matches,
            load_cached_profile,
            profile_key,
            save_cached_profile,
        )
        from uniap_lightning.profiling.module import profile_chain
        from uniap_lightning.planner.profile import load_profile
        from uniap_lightning.runtime.tensor_parallel import tp_allreduces, tp_degrees

        params = [sum(p.numel() for p in m.parameters()) for m in chain.layers]
        everywhere = everywhere and dist.is_initialized() and self.world_size > 1
        lead = self.global_rank == 0
        if self._profile_path is not None:
            profile = load_profile(self._profile_path)
            check_profile_matches(profile, chain.names, params, origin=f"profile file {self._profile_path}")
            self.setup_report.update(profile_origin=f"file {self._profile_path}", profile_s=0.0)
            _info(f"UniAP: planning with the profile file {self._profile_path} ({profile.source})")
            return profile
        t0 = time.perf_counter()
        x = None
        if batch is not None:
            try:
                x, _ = chain.split_batch(batch)
                x = x[: min(int(x.shape[0]), 16)].to(self.root_device)
            except Exception as err:  # noqa: BLE001 - a batch we cannot split is profiled structurally
                x, why = None, f"the sample batch could not be split into (input, target): {err!r}"
        kw = dict(
            tp_degrees=[tp_degrees(m) for m in chain.layers], tp_allreduces=[tp_allreduces(m) for m in chain.layers],
            model=type(self.lightning_module).__name__, device=_device_name(self.root_device),
        )
        cache_dir, key = self._profile_cache_dir(), None
        if x is not None and self._profile_cache:
            key = profile_key(
                layers=chain.layers, names=chain.names, input_shape=list(x.shape), input_dtype=str(x.dtype),
                device=_device_name(self.root_device), nodes=self.num_nodes, devices_per_node=self.num_processes,
                settings={"repeats": self._profile_repeats, "micro_batches": self._profile_micro_batches,
                          "overheads": everywhere},
            )
            cached = load_cached_profile(cache_dir, key) if lead else None
            if cached is not None:
                try:
                    check_profile_matches(cached, chain.names, params, origin="cached profile")
                except UniAPError:
                    cached = None
            hit = self.broadcast(cached is not None) if everywhere else cached is not None
            if hit:
                self.setup_report.update(profile_origin=f"cache {cache_dir / f'profile-{key}.json'}",
                                         profile_s=time.perf_counter() - t0)
                _info(f"UniAP: reusing the measured profile {cache_dir / f'profile-{key}.json'}")
                return cached if lead else None
        if x is not None:
            _info(f"UniAP: profiling {len(chain.layers)} layers on a sample micro-batch of shape {tuple(x.shape)} "
                  f"({self._profile_repeats} repeats{', on all ranks at once' if everywhere else ''}) ...")
        profile = profile_chain(
            chain.layers, chain.names, x, repeats=self._profile_repeats, micro_batches=self._profile_micro_batches,
            progress=lambda msg: _info(f"UniAP: profiling: {msg}"), why_no_input=why,
            sync=dist.barrier if everywhere else None, **kw,
        )
        if everywhere:
            from uniap_lightning.profiling.module import median_over_ranks
            from uniap_lightning.planner.profile import ModelProfile

            everyone: list[Any] = [None] * self.world_size
            dist.all_gather_object(everyone, profile.to_dict())
            if all(d["source"] == "measured" for d in everyone):
                profile = median_over_ranks([ModelProfile.from_dict(d) for d in everyone])
                if x is not None:
                    profile = self._time_strategies(chain, x, profile)
        elapsed = time.perf_counter() - t0
        self.setup_report.update(profile_origin=profile.source, profile_s=elapsed)
        _info(f"UniAP: profiled the model in {elapsed:.1f} s ({profile.source})")
        if key is not None and profile.source == "measured" and lead:
            try:
                path = save_cached_profile(cache_dir, key, profile)
                self.setup_report["profile_path"] = str(path)
            except OSError:
                pass
        return profile

    def _time_strategies(self, chain: Chain, x: torch.Tensor, profile: ModelProfile) -> ModelProfile:
        """Collective: the profile with each layer's measured TP / FSDP overheads."""
        import time

        from uniap_lightning.profiling.strategies import attach_overheads, measure_overheads

        sizes = [int(m) for m in profile.meta.get("micro_batches") or [int(x.shape[0])]]
        sizes = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})  # smallest, middle, largest: interpolated
        t0 = time.perf_counter()
        _info(f"UniAP: timing the layers under tensor parallelism and FSDP on {self.world_size} ranks "
              f"(micro-batches {sizes}) ...")
        overheads = measure_overheads(
            chain.layers, chain.names, x, micro_batches=sizes, devices_per_node=self.num_processes,
            repeats=self._profile_repeats, progress=lambda msg: _info(f"UniAP: profiling strategies: {msg}"),
        )
        self.setup_report["strategies_s"] = time.perf_counter() - t0
        _info(f"UniAP: timed TP / FSDP overheads in {self.setup_report['strategies_s']:.1f} s")
        return attach_overheads(profile, overheads)


def _info(msg: str) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    rank_zero_info(msg)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type
