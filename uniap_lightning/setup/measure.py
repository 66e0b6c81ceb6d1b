"""What setup measures before planning: the cluster's links and the model's profile, on the job's own ranks.

1. :meth:`Measurements.cluster` - this machine as a :class:`~uniap_lightning.planner.cluster.Cluster`, its
   collectives and pipeline slot measured on the job's process group (``profiling/collectives.py``) or read from
   the on-disk cache (rank 0 reads, every rank gets the answer); every rank takes part.
2. :meth:`Measurements.profile_everywhere` - every rank profiles the chain at once (the cores or links are shared
   as in training), the median over ranks counts, then every rank times each distinct layer under TP and FSDP
   (``profiling/strategies.py``).
3. :meth:`Measurements.profile_on_lead` - rank 0 alone: a pinned file, the cache, or measured.

Every step that can fail on one rank ends in an agreement (:mod:`.agree`), so an error reaches every rank.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import remove_if_not_regular
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.profile import ModelProfile, load_profile
from uniap_lightning.profiling.cache import (CORRUPT_ENTRY_ERRORS, check_cluster_entry, check_profile_matches,
                                             cluster_key, load_cached_json, load_cached_profile, loss_code, profile_key,
                                             save_cached_json, save_cached_profile, why)
from uniap_lightning.profiling.collectives import apply_to_cluster, describe_collectives, measure_collectives
from uniap_lightning.profiling.module import median_over_ranks, profile_chain
from uniap_lightning.profiling.strategies import attach_overheads, measure_overheads
from uniap_lightning.runtime.payload import rows
from uniap_lightning.runtime.planning import local_cluster
from uniap_lightning.runtime.sequence import sequence_info
from uniap_lightning.runtime.tensor_parallel import tp_allreduces, tp_degrees
from uniap_lightning.setup.agree import Ranks, everyone, from_lead, gather
from uniap_lightning.setup.options import SetupOptions
from uniap_lightning.setup.sample import Sample, input_dtype, input_shape

if TYPE_CHECKING:
    from uniap_lightning.runtime import Chain


def info(msg: str) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    rank_zero_info(msg)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


@dataclass
class Measurements:
    """The measuring steps of setup, sharing the job's ranks, the options and the report being filled in."""

    ranks: Ranks
    options: SetupOptions
    precision: str
    forward_context: Callable[[], AbstractContextManager[Any]]
    report: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ cluster
    def cluster(self) -> Cluster:
        """The local machine as a Cluster; with ``measure_cluster``, its links measured (or read from the cache)."""
        r = self.ranks
        base = everyone(r, "describing the local machine", lambda: local_cluster(
            nodes=r.num_nodes, devices_per_node=r.devices_per_node, device_type=r.device.type))
        if not self.options.measure_cluster or not r.distributed:
            self.report["cluster_origin"] = "constants"
            return base
        t0 = time.perf_counter()
        path = everyone(r, "computing the cluster's cache key", self._cluster_cache_path)
        cluster = from_lead(r, f"reading the cluster cache {path}", lambda: self._cached_cluster(base, path))
        origin = f"cache {path}"
        if cluster is None:
            info(f"UniAP: measuring collectives on {r.world_size} ranks (all-reduce, all-gather, reduce-scatter, "
                 "p2p), the optimizer step and gradient compression ...")
            cluster = everyone(r, "measuring the cluster's links", lambda: self._measure_cluster(base, path))
            origin = "measured"
        self.report.update(cluster_s=time.perf_counter() - t0, cluster_origin=origin)

        table = describe_collectives(cluster).replace("\n", "; ")
        info(f"UniAP: cluster links ({origin}, {self.report['cluster_s']:.1f} s), bus bandwidth / latency by "
             f"group size: {table}")
        figures = cluster.compression_ns_per_param
        if figures:
            info("UniAP: gradient compression, ns per element (powersgd: per unit of rank): "
                 + ", ".join(f"{m} {v:.2f}" for m, v in figures.items()))
        return cluster

    def _cluster_cache_path(self) -> Path:
        r = self.ranks
        key = cluster_key(device=device_name(r.device), backend=str(dist.get_backend()), nodes=r.num_nodes,
                          devices_per_node=r.devices_per_node)
        return self.options.profile_cache_dir() / f"cluster-{key}.json"

    def _cached_cluster(self, base: Cluster, path: Path) -> Cluster | None:
        if not self.options.profile_cache:
            return None
        data = load_cached_json(path.parent, path.name)
        if data is None or (isinstance(data, dict) and not data.get("compression_ns_per_param")):
            return None  # none, or measured before compression was timed: measured again
        try:  # a valid entry makes a valid cluster; anything else is measured again
            return apply_to_cluster(base, _int_group_sizes(check_cluster_entry(data)))
        except CORRUPT_ENTRY_ERRORS as err:
            warnings.warn(f"UniAP: ignoring the cache entry {path} ({type(err).__name__}: {why(err)}); it is rebuilt",
                          stacklevel=2)
            remove_if_not_regular(path)
            return None

    def _measure_cluster(self, base: Cluster, path: Path) -> Cluster:
        measured = _int_group_sizes(measure_collectives(repeats=3, devices_per_node=self.ranks.devices_per_node,
                                                        sizes_bytes=(1 << 12, 1 << 20)))
        cluster = apply_to_cluster(base, measured)
        if self.ranks.lead and self.options.profile_cache:
            try:
                save_cached_json(path.parent, path.name, measured)
            except (OSError, UniAPError):
                pass  # a read-only cache directory (or a folder under the entry's name) means "don't cache"
        return cluster

    # ------------------------------------------------------------------ profile
    def _profile_key(self, chain: Chain, x: torch.Tensor, everywhere: bool) -> str:
        o, r = self.options, self.ranks
        return profile_key(
            layers=chain.layers, names=chain.names, input_shape=input_shape(x), input_dtype=input_dtype(x),
            device=device_name(r.device), nodes=r.num_nodes, devices_per_node=r.devices_per_node,
            settings={"repeats": o.profile_repeats, "micro_batches": o.profile_micro_batches, "overheads": everywhere,
                      "loss": loss_code(chain.loss_fn), **_sequence_setting(chain)},
            precision=self.precision, tp_degrees=[tp_degrees(m) for m in chain.layers],
            tp_allreduces=[tp_allreduces(m) for m in chain.layers],
        )

    def _cached_profile(self, chain: Chain, key: str) -> ModelProfile | None:
        cached = load_cached_profile(self.options.profile_cache_dir(), key)
        if cached is None:
            return None
        try:
            check_profile_matches(cached, chain.names, _params(chain), origin="cached profile")
        except UniAPError:
            return None
        path = self.options.profile_cache_dir() / f"profile-{key}.json"
        self.report.update(profile_origin=f"cache {path}", profile_path=str(path))
        info(f"UniAP: reusing the measured profile {path}")
        return cached

    def _measure(self, chain: Chain, sample: Sample, sync: Callable[[], Any] | None) -> ModelProfile:
        o, x = self.options, sample.x
        if x is not None:
            info(f"UniAP: profiling {len(chain.layers)} layers on a sample micro-batch of shape {sample.shape()} "
                 f"({o.profile_repeats} repeats, precision {self.precision}"
                 f"{', on all ranks at once' if sync else ''}) ...")
        return profile_chain(
            chain.layers, chain.names, x, repeats=o.profile_repeats, micro_batches=o.profile_micro_batches,
            progress=lambda msg: info(f"UniAP: profiling: {msg}"), why_no_input=sample.why_none, sync=sync,
            context=self.forward_context, tp_degrees=[tp_degrees(m) for m in chain.layers],
            tp_allreduces=[tp_allreduces(m) for m in chain.layers], model=type(chain.module).__name__,
            device=device_name(self.ranks.device), loss_fn=chain.loss_fn, target=sample.y,
        )

    def _save(self, key: str | None, profile: ModelProfile) -> None:
        if key is None or profile.source != "measured" or not self.ranks.lead:
            return
        try:
            self.report["profile_path"] = str(save_cached_profile(self.options.profile_cache_dir(), key, profile))
        except (OSError, UniAPError):
            pass  # a read-only cache directory (or a folder under the entry's name) means "don't cache"

    def profile_on_lead(self, chain: Chain, sample: Sample) -> ModelProfile:
        """Rank 0 alone: the profile file, the cache or a measurement."""
        path = self.options.profile_path
        if path is not None:
            profile = load_profile(path)
            check_profile_matches(profile, chain.names, _params(chain), origin=f"profile file {path}")
            self.report.update(profile_origin=f"file {path}", profile_s=0.0)
            info(f"UniAP: planning with the profile file {path} ({profile.source})")
            return profile
        t0 = time.perf_counter()
        key = self._profile_key(chain, sample.x, False) if sample.x is not None and self.options.profile_cache else None
        cached = self._cached_profile(chain, key) if key is not None else None
        if cached is not None:
            self.report["profile_s"] = time.perf_counter() - t0
            return cached
        profile = self._measure(chain, sample, None)
        self._finish(profile, t0)
        self._save(key, profile)
        return profile

    def _finish(self, profile: ModelProfile, t0: float) -> None:
        self.report.update(profile_origin=profile.source, profile_s=time.perf_counter() - t0)
        info(f"UniAP: profiled the model in {self.report['profile_s']:.1f} s ({profile.source})")

    def profile_everywhere(self, chain: Chain, sample: Sample) -> ModelProfile:
        """Collective: every rank profiles at once and times the layers under TP / FSDP; every rank gets the
        profile (the median over ranks). Each step agrees before the next collective (see :mod:`.agree`)."""
        r, t0 = self.ranks, time.perf_counter()
        use_cache = sample.x is not None and self.options.profile_cache
        key = everyone(r, "computing the profile's cache key",
                       lambda: self._profile_key(chain, sample.x, True) if use_cache else None)
        if key is not None:
            cached = from_lead(r, "reading the profile cache", lambda: self._cached_profile(chain, key))
            if cached is not None:
                self.report["profile_s"] = time.perf_counter() - t0
                return cached
        # every rank calls the barrier once per micro-batch size, also after an error (profiling.measure)
        mine = everyone(r, "profiling the model", lambda: self._measure(chain, sample, dist.barrier))
        every_rank = gather(r, mine.to_dict())
        return everyone(r, "combining the ranks' profiles and timing the layers under TP / FSDP",
                        lambda: self._combine(chain, sample, mine, every_rank, key, t0))

    def _combine(self, chain: Chain, sample: Sample, mine: ModelProfile, every_rank: list[dict[str, Any]],
                 key: str | None, t0: float) -> ModelProfile:
        """The median over ranks with measured TP / FSDP overheads (collective), saved to the cache by rank 0."""
        profile = mine
        if all(d["source"] == "measured" for d in every_rank):  # the same test on every rank: all time, or none
            profile = median_over_ranks([ModelProfile.from_dict(d) for d in every_rank])
            if sample.x is not None:
                profile = self._time_strategies(chain, sample.x, profile)
        self._finish(profile, t0)
        self._save(key, profile)
        return profile

    def _time_strategies(self, chain: Chain, x: torch.Tensor, profile: ModelProfile) -> ModelProfile:
        """Collective: the profile with each layer's measured TP / FSDP overheads."""
        sizes = [int(m) for m in profile.meta.get("micro_batches") or [rows(x)]]
        sizes = sorted({sizes[0], sizes[len(sizes) // 2], sizes[-1]})  # smallest, middle, largest: interpolated
        t0 = time.perf_counter()
        info(f"UniAP: timing the layers under tensor parallelism and FSDP on {self.ranks.world_size} ranks "
             f"(micro-batches {sizes}) ...")
        tp_split: dict[int, float] = {}
        overheads = measure_overheads(
            chain.layers, chain.names, x, micro_batches=sizes, devices_per_node=self.ranks.devices_per_node,
            repeats=self.options.profile_repeats, progress=lambda msg: info(f"UniAP: profiling strategies: {msg}"),
            context=self.forward_context, tp_split=tp_split,
        )
        self.report["strategies_s"] = time.perf_counter() - t0
        info(f"UniAP: timed TP / FSDP overheads in {self.report['strategies_s']:.1f} s")
        return attach_overheads(profile, overheads, tp_split)


def _params(chain: Chain) -> list[int]:
    return [sum(p.numel() for p in m.parameters()) for m in chain.layers]


def _int_group_sizes(measured: dict[str, Any]) -> dict[str, Any]:
    """JSON turns the group sizes into strings; the cluster wants ints."""
    out = dict(measured)
    out["ops"] = {op: {int(p): rec for p, rec in recs.items()} for op, recs in measured["ops"].items()}
    return out


def _sequence_setting(chain: Chain) -> dict[str, Any]:
    """The layers' sequence declarations, in the profile's cache key only where some layer declares one (profiles
    measured before the fields existed lack them; keys of chains that declare nothing stay as they were)."""
    infos = [sequence_info(m) for m in chain.layers]
    return {"sequence": infos} if any(i is not None for i in infos) else {}
