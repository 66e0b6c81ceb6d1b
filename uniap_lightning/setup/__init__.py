"""What ``UniAPStrategy`` does at setup before training: measure, profile, choose a plan, agree on it.

:func:`run_setup` takes the chain, the trainer, this process's place in the job (:class:`~.agree.Ranks`), the
options (:class:`SetupOptions`) and the precision, and returns a frozen :class:`SetupResult`; the strategy then
only applies the plan. The steps, the same on every rank:

1. draw a sample batch, split it and check the chain contract on it (every rank; :mod:`.sample`);
2. a pinned plan: checked against the job (layers, world size, global batch, fingerprint), or else
3. the cluster (given, or measured / cached: :mod:`.measure`), the profile (on every rank at once when measuring
   the cluster, else on rank 0: a file, the cache or measured, under the precision's forward context), and on
   rank 0 a cached plan (checked against the job) or a solved one;
4. every rank gets rank 0's plan and checks it against its own chain.

Each step ends with an agreement on success (:mod:`.agree`): a failure on any rank raises the same
:class:`~uniap_lightning.errors.UniAPError`, naming the rank, on every rank within seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from uniap_lightning.adapters import extract_chain
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import TrainingConfig, adam_bytes
from uniap_lightning.planner.profile import describes_a_config
from uniap_lightning.planner.report import print_plan
from uniap_lightning.runtime import apply_plan
from uniap_lightning.runtime.planning import check_plan_matches, solve_plan
from uniap_lightning.runtime.sequence import attention_dropout
from uniap_lightning.setup.agree import Ranks, everyone, from_lead, gather, same_code_everywhere
from uniap_lightning.setup.estimate import say_estimate
from uniap_lightning.setup.measure import Measurements, info
from uniap_lightning.setup.options import SetupOptions
from uniap_lightning.setup.sample import Sample, take_sample

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from uniap_lightning.planner.profile import ModelProfile
    from uniap_lightning.runtime import Chain, Runtime


@dataclass(frozen=True)
class SetupResult:
    """What setup decided: the plan, where it came from, the cluster and profile it was planned with (``None``
    when a pinned plan needed none), and how setup went (``report``: ``profile_origin``, ``profile_path``,
    ``cluster_origin``, ``precision`` and ``*_s`` timings)."""

    plan: Plan
    origin: str
    planning_cluster: Cluster | None
    profile_origin: str
    profile: ModelProfile | None = None
    report: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # a mappingproxy does not pickle; the result does (e.g. sent between ranks or saved with a run's outputs)
        return _result, (self.plan, self.origin, self.planning_cluster, self.profile_origin, self.profile,
                         dict(self.report))

    def with_timing(self, **seconds: float) -> SetupResult:
        return replace(self, report=MappingProxyType({**self.report, **seconds}))

    def summary(self) -> str:
        r = self.report
        return (
            f"UniAP setup took {r.get('setup_s', 0.0):.1f} s (profiling {r.get('profile_s', 0.0):.1f} s "
            f"[{self.profile_origin or 'none'}], cluster {r.get('cluster_s', 0.0):.1f} s "
            f"[{r.get('cluster_origin', 'given')}], solving {r.get('solve_s', 0.0):.1f} s [{self.origin}])"
        )


def _result(plan: Plan, origin: str, cluster: Cluster | None, profile_origin: str, profile: ModelProfile | None,
            report: dict[str, Any]) -> SetupResult:
    return SetupResult(plan, origin, cluster, profile_origin, profile, MappingProxyType(report))


def run_setup(chain: Chain, trainer: pl.Trainer, *, ranks: Ranks, options: SetupOptions, precision: str = "32-true",
              forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext) -> SetupResult:
    """The plan every rank will run, agreed on by all ranks (collective: every rank calls it)."""
    m = Measurements(ranks=ranks, options=options, precision=precision, forward_context=forward_context,
                     report={"precision": precision})
    same_code_everywhere(ranks)
    sample = everyone(ranks, "drawing a sample batch and checking the model's chain",
                      lambda: take_sample(chain, trainer, ranks.device, forward_context))
    _same_sample_everywhere(ranks, sample)
    fitting = _fitting(trainer)
    cluster = options.cluster
    if options.pinned_plan is not None:
        plan, origin, profile, report = from_lead(ranks, "checking the pinned plan",
                                                  lambda: _pinned(m, chain, sample, fitting))
    else:
        _check_pipeline_degrees(options.pp, ranks.world_size, len(chain.layers))
        say_estimate(chain, sample.x, trainer, ranks=ranks, options=options, precision=precision,
                     global_batch=sample.global_batch_size, say=info)  # rank 0, before anything is measured
        if cluster is None:
            cluster = m.cluster()
        cluster = _without_ring_if_dropout(cluster, chain)
        premeasured = None
        if options.profile_path is None and options.measure_cluster and ranks.distributed:
            premeasured = m.profile_everywhere(chain, sample)
        plan, origin, profile, report = from_lead(ranks, "choosing a plan",
                                                  lambda: _solve(m, chain, sample, cluster, premeasured))
    everyone(ranks, "checking the plan against this rank's model", lambda: _check(plan, chain, ranks))
    return SetupResult(plan=plan, origin=origin, planning_cluster=cluster, profile=profile,
                       profile_origin=str(report.get("profile_origin", "")), report=MappingProxyType(report))


def _check_pipeline_degrees(pp: tuple[int, ...] | None, world_size: int, layers: int) -> None:
    """``pp=`` given to the strategy: every degree must divide the processes and have a layer per stage (checked
    on every rank alike, before anything is measured)."""
    if pp is None:
        return
    bad = [p for p in pp if world_size % p or p > layers]
    if bad:
        raise UniAPError(f"pp={list(pp)}: {bad[0]} is not a pipeline degree for {world_size} processes and a chain "
                         f"of {layers} layers (it must divide the processes and be at most the layers)")


def _fitting(trainer: pl.Trainer) -> bool:
    from lightning.pytorch.trainer.states import TrainerFn

    return trainer.state.fn == TrainerFn.FITTING


def _same_sample_everywhere(ranks: Ranks, sample: Sample) -> None:
    """Ranks that profile together must time the same sizes; ranks with other data would train wrongly anyway."""
    seen = gather(ranks, (sample.why_none or None) if sample.x is None else (repr(sample.shape()),
                                                                              sample.global_batch_size))
    if any(s != seen[0] for s in seen):
        described = "; ".join(f"rank {r}: {s if isinstance(s, str) else f'shape {s[0]}, batch {s[1]}'}"
                              for r, s in enumerate(seen))
        raise UniAPError(
            f"the ranks drew different sample batches ({described}); every rank must load the same global batch "
            "(the same dataloader, batch size and sampler) and split it alike"
        )


#: what rank 0 sends every rank: the plan, its origin, the profile it was planned with, the report
Decision = tuple[Plan, str, "ModelProfile | None", dict[str, Any]]


def _pinned(m: Measurements, chain: Chain, sample: Sample, fitting: bool) -> Decision:
    """Rank 0: the pinned plan, checked against the job (a profile only when the plan carries a fingerprint)."""
    plan = m.options.pinned_plan
    # (an analytic plan's fingerprint names a model config, not sizes a profile of this module could match)
    measured = plan.model_fingerprint and not describes_a_config(plan.model_fingerprint)
    profile = m.profile_on_lead(chain, sample) if measured else None
    check_plan_matches(plan, chain.names, world_size=m.ranks.world_size, profile=profile,
                       global_batch_size=sample.global_batch_size if fitting else None)
    return plan, "pinned", profile, m.report


def _without_ring_if_dropout(cluster: Cluster, chain: Chain) -> Cluster:
    """The cluster to search: without ring attention where a layer's attention has dropout (ring runs none, and the
    plan check would refuse it)."""
    if cluster.ring_attention and any(attention_dropout(layer) > 0 for layer in chain.layers):
        return replace(cluster, ring_attention=False)
    return cluster


def _solve(m: Measurements, chain: Chain, sample: Sample, cluster: Cluster | None,
           premeasured: ModelProfile | None) -> Decision:
    """Rank 0: a cached plan for this job, or a solved one."""
    assert cluster is not None
    profile = premeasured or m.profile_on_lead(chain, sample)
    batch = sample.global_batch_size
    if not batch:
        raise UniAPError(
            f"could not tell the global batch size to plan for ({sample.why_none}); pass plan=<file> to "
            "UniAPStrategy or give the Trainer a non-empty dataloader"
        )
    if cluster.num_devices != m.ranks.world_size:
        raise UniAPError(
            f"cluster '{cluster.name}' has {cluster.num_devices} devices but the Trainer runs {m.ranks.world_size} "
            "processes; describe the cluster you run on"
        )
    o = m.options

    def say() -> None:  # only when no cached plan fits (a cached one is announced with the plan)
        only = f", pp in {list(o.pp)}" if o.pp else ""
        info(f"UniAP: solving for {m.ranks.world_size} devices, global batch {batch}{only} "
             f"(solver={o.solver}, time limit {o.time_limit_s:g} s) ...")

    t0 = time.perf_counter()
    training = _training(chain, batch, o.schedule, o.virtual_stages)
    m.report["training"] = asdict(training)  # what the monitor's measured file records for `uniap explain`
    plan, origin = solve_plan(profile=profile, cluster=cluster, training=training,
                              solver=o.solver, time_limit_s=o.time_limit_s, cache_dir=o.plan_cache_dir(),
                              compression=o.compression, compression_options=o.compression_options_dict,
                              pp=list(o.pp) if o.pp else None, opt_ins=o.opt_ins_dict, on_solve=say)
    m.report["solve_s"] = time.perf_counter() - t0
    return plan, origin, profile, m.report


def _training(chain: Chain, global_batch_size: int, schedule: str, virtual_stages: int | None = None) -> Any:
    """Training settings with the bytes per parameter of the model's real dtypes (after the precision plugin
    converted it): weights and gradients in the parameters' dtype, two optimizer states of the same size (Adam)."""
    params = [p for layer in chain.layers for p in layer.parameters()]
    count = sum(p.numel() for p in params)
    per_param = sum(p.numel() * p.element_size() for p in params) / count if count else 4.0
    weight, grad, optimizer = adam_bytes(per_param)
    return TrainingConfig(global_batch_size=int(global_batch_size), schedule=schedule,
                          virtual_stages=virtual_stages, weight_bytes=weight, grad_bytes=grad,
                          optimizer_bytes=optimizer)


def _check(plan: Plan, chain: Chain, ranks: Ranks) -> None:
    check_plan_matches(plan, chain.names, world_size=ranks.world_size, profile=None)




def plan_and_apply(module: Any, trainer: pl.Trainer, *, ranks: Ranks, options: SetupOptions,
                   precision_plugin: Any) -> tuple[SetupResult, Runtime]:
    """What ``UniAPStrategy.setup`` runs once: the chain of ``module``, :func:`run_setup` under the precision
    plugin's forward context, the plan printed on rank 0, then applied on this rank (collective)."""
    t0 = time.perf_counter()
    chain = extract_chain(module)
    result = run_setup(chain, trainer, ranks=ranks, options=options, precision=str(precision_plugin.precision),
                       forward_context=precision_plugin.train_step_context)
    if ranks.rank == 0:
        print_plan(result.plan, title=f"UniAP plan ({result.origin})")
    runtime = apply_plan(chain, result.plan, rank=ranks.rank, device=ranks.device)
    result = result.with_timing(setup_s=time.perf_counter() - t0)
    info(result.summary())
    return result, runtime


__all__ = ["Ranks", "SetupOptions", "SetupResult", "plan_and_apply", "run_setup"]
