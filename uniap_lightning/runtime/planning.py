"""Where a plan comes from at setup: pinned (a file or a Plan), the on-disk cache, or the solver.

Rank 0 plans; :mod:`uniap_lightning.setup` hands the plan (or the error) to every rank. Solved plans are cached as JSON under a key that hashes everything they depend on (profile fingerprint, cluster,
world size, global batch size, schedule, solver); a restart with the same inputs reuses the plan.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any
from pathlib import Path

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.devices import HOST_LINK_EFFICIENCY, catalogue_name, lookup_device
from uniap_lightning.errors import UniAPError
from uniap_lightning.files import CORRUPT_ENTRY_ERRORS, cache_root, foreign_entry, remove_if_not_regular, why
from uniap_lightning.planner.plan import COMPRESSION_DEFAULTS, PLAN_FORMAT_VERSION, Plan
from uniap_lightning.planner.problem import Problem, TrainingConfig
from uniap_lightning.planner.profile import ModelProfile, describes_a_config


def default_cache_dir() -> Path:
    """``$UNIAP_CACHE_DIR`` itself when set (non-empty), else ``~/.cache/uniap-lightning/plans``."""
    base = os.environ.get("UNIAP_CACHE_DIR", "").strip()
    return Path(base) if base else cache_root() / "plans"


def local_cluster(*, nodes: int, devices_per_node: int, device_type: str) -> Cluster:
    """A rough description of the machine we run on; pass ``cluster=`` to the strategy for real figures."""
    if device_type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        known = catalogue_name(props.name)
        spec = lookup_device(known) if known else None
        return Cluster(
            name=f"local-{props.name}".replace(" ", "-"),
            nodes=nodes,
            devices_per_node=devices_per_node,
            memory_gib=props.total_memory / 1024**3,
            peak_tflops=100.0,
            device=known or props.name,  # a catalogue entry where known (its peaks per dtype)
            # the catalogue's host link (PCIe / NVLink-C2C), as a cluster file naming the device gets it, so
            # offload is priced when the user allows it (cluster offload="auto"); unknown devices: none
            host_link_gbps=spec.host_link_gbps * HOST_LINK_EFFICIENCY if spec else 0.0,
        )
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Cluster(
        name="local-cpu",
        nodes=nodes,
        devices_per_node=devices_per_node,
        memory_gib=max(total / 1024**3 / devices_per_node, 0.5),
        peak_tflops=0.1,
        efficiency=1.0,
        intra_bw_gbps=2.0,
        inter_bw_gbps=1.0,
        intra_latency_us=50.0,
        inter_latency_us=100.0,
        device="cpu",  # ring attention (runtime/ring.py) runs here too: ring_attention keeps its default
    )


def cache_key(*, profile: ModelProfile, cluster: Cluster, world_size: int, training: TrainingConfig,
              solver: str, compression: tuple[str, ...] = ("none",),
              compression_options: dict[str, float] | None = None, pp: list[int] | None = None,
              opt_ins: Mapping[str, tuple[str, ...]] | None = None) -> str:
    payload = {
        "fingerprint": profile.fingerprint(),
        # measured strategy overheads change the cost model's terms, so a plan solved without them is not reused
        "overheads": sorted({(o.kind, o.degree) for lp in profile.layers for o in lp.overheads}),
        "cluster": asdict(cluster),
        "world_size": world_size,
        "training": asdict(training),
        "solver": solver,
        "plan_format": PLAN_FORMAT_VERSION,
        "compression": list(compression),  # the methods the solver could choose from, and their parameters
        "compression_options": sorted((compression_options or {}).items()),
    }
    if pp is not None:  # (absent when unrestricted: the keys of plans cached before this option stay valid)
        payload["pp"] = sorted(pp)
    for option, allowed in sorted((opt_ins or {}).items()):  # what each opt-in dimension allowed (absent when off:
        if allowed:  # older keys stay valid)
            payload[option] = list(allowed)
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _cached_plan(path: Path, *, profile: ModelProfile, world_size: int, global_batch_size: int) -> Plan | None:
    """The plan cached at ``path`` if it is readable and for this job; otherwise ``None``, with a warning naming
    the file when there was an entry (it is then solved again and replaced)."""
    if not os.path.lexists(path):
        return None
    if (foreign := foreign_entry(path)) is not None:
        warnings.warn(f"UniAP: ignoring the cached plan {path} ({foreign}); solving again", stacklevel=3)
        remove_if_not_regular(path)  # the link itself goes: its target is never read or written
        return None
    try:
        plan = Plan.from_json(path)
        check_plan_matches(plan, [lp.name for lp in profile.layers], world_size=world_size, profile=profile,
                           global_batch_size=global_batch_size)
        return plan
    except CORRUPT_ENTRY_ERRORS as err:  # a damaged entry of any shape is solved again, never a failed setup
        warnings.warn(f"UniAP: ignoring the cached plan {path} ({why(err)}); solving again", stacklevel=3)
        remove_if_not_regular(path)  # a FIFO or a dangling link there would refuse the rebuilt plan
        return None


def solve_plan(
    *,
    profile: ModelProfile,
    cluster: Cluster,
    training: TrainingConfig,
    solver: str,
    time_limit_s: float,
    cache_dir: Path,
    compression: tuple[str, ...] = ("none",),
    compression_options: dict[str, float] | None = None,
    pp: list[int] | None = None,
    opt_ins: Mapping[str, tuple[str, ...]] | None = None,
    on_solve: Any = None,
    warm_start: Plan | None = None,
    baselines: bool = True,
) -> tuple[Plan, str]:
    """Solve (or reuse from the cache) a plan; returns it and where it came from ("cache <path>" or "solver").
    ``compression``: the gradient compression methods the solver may choose per layer (always with "none"),
    ``compression_options`` their parameters (default: the plan defaults); ``pp``: the pipeline degrees to search
    (``None``: all); ``opt_ins``: each opt-in dimension's allowed values by option (absent: off); ``on_solve()`` is called when
    the cache has no plan, before solving (e.g. to say so);
    ``warm_start`` (a running plan) and ``baselines=False`` make a re-solve faster without changing its optimum
    (see :func:`uniap_lightning.planner.solver.solve`), so neither enters the cache key. Ring
    attention is searched where ``cluster.ring_attention`` says so (the runtime runs it on every device,
    :mod:`.ring`)."""
    key = cache_key(profile=profile, cluster=cluster, world_size=cluster.num_devices, training=training,
                    solver=solver, compression=compression, compression_options=compression_options, pp=pp, opt_ins=opt_ins)
    path = cache_dir / f"plan-{key}.json"
    cached = _cached_plan(path, profile=profile, world_size=cluster.num_devices,
                          global_batch_size=training.global_batch_size)
    if cached is not None:
        return cached, f"cache {path}"
    try:
        from uniap_lightning.planner.solver import solve  # deferred: loads mip; a cached or pinned plan needs none
    except ImportError as err:
        raise UniAPError(
            f"no plan was given and the planner is not available ({err}); pass plan=<file or Plan> to UniAPStrategy"
        ) from err
    problem = Problem(model=profile, cluster=cluster, training=training, compression=compression,
                      compression_options=dict(compression_options or COMPRESSION_DEFAULTS), opt_ins=dict(opt_ins or {}))
    if on_solve is not None:
        on_solve()
    # no cyclic GC while solving (see no_gc)
    plan = solve(problem, solver=solver, time_limit_s=time_limit_s, pp=pp, warm_start=warm_start, baselines=baselines)
    if not plan.model_fingerprint:
        plan = replace(plan, model_fingerprint=profile.fingerprint())
    try:  # a cache that cannot be written (read-only directory) means "don't cache", not a failed setup
        cache_dir.mkdir(parents=True, exist_ok=True)
        plan.to_json(path)  # atomic
    except (OSError, UniAPError) as err:  # UniAPError: a folder or another non-file under the entry's name
        warnings.warn(f"UniAP: could not cache the plan in {cache_dir} ({err}); continuing without", stacklevel=2)
    return plan, "solver"


def check_plan_matches(plan: Plan, names: list[str], *, world_size: int, profile: ModelProfile | None,
                       global_batch_size: int | None = None) -> None:
    """Refuse a plan made for another model, another number of processes or another global batch size.

    The plan's layer names are the chain's (FQNs in the module, as a measured profile names them) or the chain's
    names inside their container (``chain.embed`` -> ``embed``: the analytic model's names, a plan by `uniap plan`).
    The fingerprint is compared with ``profile``'s only for a plan made from a module's profile: an analytic plan's
    identifies the model config it was made for (`uniap train` compares it with its own, see
    :mod:`uniap_lightning.cli.pinned_plan`), and no measured profile has its sizes (see :meth:`ModelProfile.fingerprint`)."""
    if global_batch_size is not None and plan.global_batch_size != global_batch_size:
        raise UniAPError(
            f"the plan is for a global batch of {plan.global_batch_size} samples but the dataloader's batches have "
            f"{global_batch_size}; set the DataLoader's batch_size to {plan.global_batch_size} or use a plan made "
            f"for {global_batch_size}"
        )
    if plan.num_devices != world_size:
        raise UniAPError(
            f"the plan is for num_devices={plan.num_devices} processes but the job has {world_size} "
            "(devices x num_nodes); rerun with a matching Trainer(devices=..., num_nodes=...) or another plan"
        )
    if len(plan.layers) != len(names):
        raise UniAPError(
            f"the plan has {len(plan.layers)} layers but the model's chain has {len(names)} "
            f"({', '.join(names[:4])}{' ...' if len(names) > 4 else ''}); was the plan made for another model?"
        )
    planned = [lp.name for lp in plan.layers]
    if planned != names and planned != local_names(names):
        wrong = [(a, b) for a, b in zip(planned, names) if a != b]
        raise UniAPError(
            f"the plan's layer names do not match the model's chain (first mismatch: plan '{wrong[0][0]}' vs model "
            f"'{wrong[0][1]}', {len(wrong)} in all); was the plan made for another model?"
        )
    if (profile is not None and plan.model_fingerprint and not describes_a_config(plan.model_fingerprint)
            and plan.model_fingerprint != profile.fingerprint()):
        raise UniAPError(
            f"the plan's model_fingerprint {plan.model_fingerprint} differs from this model's "
            f"{profile.fingerprint()} (layer parameter counts or output sizes differ): the plan is for another model, "
            "or was made under another precision (output sizes in bytes follow it)"
        )


def local_names(names: list[str]) -> list[str]:
    """The layers' names inside the module that holds them all (``chain.embed`` -> ``embed``), or ``names`` when
    they do not share one parent module."""
    parents = {name.rpartition(".")[0] for name in names}
    if len(parents) != 1 or not next(iter(parents)):
        return names
    return [name.rpartition(".")[2] for name in names]
