"""Hydra apps. Each is a thin wrapper: compose the config, call the Python API, print, write files."""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from uniap_lightning.planner.report import make_console
from rich.markup import escape
from rich.table import Table

from uniap_lightning.cli import measured as recorded
from uniap_lightning.cli.own_configs import hydra_search_path, original_overrides
from uniap_lightning.cli.ranks import report_error_to_launcher
from uniap_lightning.planner import fields as F
from uniap_lightning.planner.config import CONF_DIR, build_problem
# a roofline cluster's layers are traced with torch above the planner: handed in (torch loads on first use)
from uniap_lightning.profiling.pricing import roofline
from uniap_lightning.planner.cost import evaluate
from uniap_lightning.planner.dimensions import OPT_INS
from uniap_lightning.errors import InfeasibleError, UniAPError
from uniap_lightning.files import check_output_file, read_json, write_json_atomic
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.problem import Problem, compression_methods
from uniap_lightning.planner.report import explain_renderables, print_plan
from uniap_lightning.planner.viz import draw_plan
from uniap_lightning.planner.search_options import (DEFAULT_SCHEDULE, check_pipeline_degrees, check_schedule_name,
                                                   check_solver, check_time_limit, check_virtual_stages)
from uniap_lightning.values import flag
from uniap_lightning.values import short as _short

CONF = str(CONF_DIR)
#: exit statuses: a refused or failed command (bad input, no plan fits, a training run that failed), and
#: `uniap evaluate`'s plan that does not fit memory. A sweep (``-m``) exits with its worst job's status
#: (:mod:`uniap_lightning.cli.sweep`); ``allow_no_plan=true`` makes "no plan fits" (and evaluate's plan that does
#: not fit) status 0, in a sweep and alone.
EXIT_FAILED, EXIT_DOES_NOT_FIT = 2, 3


def _problem(cfg: DictConfig) -> Problem:
    model = OmegaConf.to_container(cfg.model, resolve=True)
    cluster = OmegaConf.to_container(cfg.cluster, resolve=True)
    train = OmegaConf.to_container(cfg.train, resolve=True)
    mb = cfg.microbatches
    if mb is not None:
        mb = list(mb) if OmegaConf.is_list(mb) else [mb]
    return build_problem(
        compression=_compression(cfg),
        roofline=roofline,
        **{option: cfg.get(option) for option in OPT_INS},
        model=model,
        cluster=cluster,
        training=train,
        profile=cfg.profile,
        global_batch_size=cfg.batch_size,
        schedule=cfg.schedule,
        virtual_stages=cfg.get("virtual_stages"),
        microbatches=mb,
    )


def _check_options(cfg: DictConfig, *, outputs: tuple[str, ...] = ()) -> None:
    """Refuse bad command-line values before any profile is read or any solver runs; the search's options with
    UniAPStrategy's own checks (:mod:`uniap_lightning.planner.search_options`: the same verdict, the same line)."""
    check_search_options(cfg)
    flag(cfg.get("baselines"), "baselines")
    _allow_no_plan(cfg)
    for key in outputs:
        if cfg.get(key):
            check_output_file(cfg[key], f"{key}=")


#: `uniap plan`'s options that steer the search: with a plan to score (``plan=``) they would be ignored
SEARCH_OPTIONS = ("schedule", "virtual_stages", "pp", "microbatches", "compression", *OPT_INS)


def _check_pinned(cfg: DictConfig, plan: Any) -> None:
    """``uniap evaluate`` / ``explain`` with ``plan=``: the plan has its own schedule, virtual stages, pipeline
    degree, micro-batches and per-layer compression, so a search option given with it is refused (one line)."""
    for key in SEARCH_OPTIONS:
        value = cfg.get(key)
        if value is not None:
            shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            own = (f"{key}={getattr(plan, key)!r}" if hasattr(plan, key) else
                   OPT_INS[key].pinned if key in OPT_INS else "compression per layer")
            raise UniAPError(f"{key}={_short(shown)} steers the planner's search, but plan={cfg.plan} is scored as it "
                             f"is, with its own {own}: drop {key}= (or plan= to solve)")


def _measured(path: str) -> dict[str, Any]:
    """The monitor's metrics file (``uniap_measured.json``), with the fields ``uniap explain`` reads checked."""
    data = read_json(path, "measured=")
    if not isinstance(data, dict):
        raise UniAPError(f"measured={path!r}: expected a JSON object as the monitor writes, got {type(data).__name__}")
    tpi = data.get("tpi_s")
    if tpi is not None and (isinstance(tpi, bool) or not isinstance(tpi, (int, float)) or not math.isfinite(tpi)
                            or tpi < 0):
        raise UniAPError(f"measured={path!r}: field 'tpi_s' must be a number of seconds >= 0, got {_short(tpi)}")
    for key in ("stage_time_s", "stage_peak_memory_bytes"):
        values = data.get(key)
        if values is None:
            continue
        if not isinstance(values, list) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values):
            raise UniAPError(f"measured={path!r}: field {key!r} must be a list of numbers >= 0, got {_short(values)}")
    if data.get("rebalances") is not None:
        _check_rebalances(data["rebalances"], f"measured={path!r}: rebalances")
    return data


def _check_rebalances(events: Any, where: str) -> None:
    """The monitor's ``rebalances``: a list of switch records; the fields the table prints must have their
    types (a wrong one is one error line, not a traceback while printing)."""
    for i, e in enumerate(F.array(events, where)):
        w = f"{where}[{i}]"
        F.obj(e, w)
        if e.get("step") is not None:
            F.integer(e["step"], f"{w}.step", low=0)
        for key in ("old_plan", "new_plan", "reason"):
            if e.get(key) is not None:
                F.string(e[key], f"{w}.{key}")
        for key in ("predicted_gain", "measured_gain", "switch_s"):
            F.optional_number(e.get(key), f"{w}.{key}")


def check_search_options(cfg: DictConfig) -> None:
    """The options `uniap plan` shares with UniAPStrategy, each checked by the strategy's function (``schedule``
    and ``virtual_stages`` when given: null takes ``train``'s, which ``TrainingConfig`` checks the same way)."""
    check_time_limit(cfg.get("time_limit"))
    check_solver(cfg.get("solver"))
    schedule = cfg.get("schedule")
    if schedule is not None:
        check_schedule_name(schedule)
    check_virtual_stages(cfg.get("virtual_stages"), schedule if schedule is not None else DEFAULT_SCHEDULE)
    _pp(cfg)
    compression_methods(_compression(cfg))  # the strategy's check: the same values, the same line


def _compression(cfg: DictConfig) -> Any:
    """``compression=`` as given (a list from ``compression=[bf16,topk]``)."""
    value = cfg.get("compression")
    return OmegaConf.to_container(value) if OmegaConf.is_list(value) else value


def _pp(cfg: DictConfig) -> list[int] | None:
    """The pipeline degrees to search (``pp=4`` or ``pp=[2,4]``), or None for all."""
    degrees = check_pipeline_degrees(list(cfg.pp) if OmegaConf.is_list(cfg.pp) else cfg.pp)
    return None if degrees is None else list(degrees)


def _allow_no_plan(cfg: DictConfig) -> bool:
    """``allow_no_plan=true``: a model that does not fit (no plan fits; evaluate: the plan does not fit memory) is
    an answer, exit status 0, not a failure (``uniap train`` has no such option: a run that cannot train failed)."""
    return flag(cfg.get("allow_no_plan", False), "allow_no_plan")


def _multirun() -> bool:
    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:
        return False


def _record(result: dict[str, Any]) -> None:
    """In a sweep, leave a result.json in the job's folder for the end-of-sweep summary."""
    if _multirun():
        out = Path(HydraConfig.get().runtime.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / "result.json", result)


def _fail(err: UniAPError, cfg: DictConfig) -> None:
    """One line on stderr and exit status 2, or, in a sweep, the job's row (its error and the status it would
    have exited with alone: the sweep exits with the worst). "No plan fits" with ``allow_no_plan=true``: status 0."""
    no_plan = isinstance(err, InfeasibleError)
    try:
        allowed = no_plan and _allow_no_plan(cfg)
    except UniAPError:
        allowed = False
    code = 0 if allowed else EXIT_FAILED
    if not report_error_to_launcher(str(err)):  # a rank `uniap train` started: rank 0 prints the one line
        label = "[bold yellow]no plan (allow_no_plan=true):[/bold yellow]" if allowed else "[bold red]error:[/bold red]"
        make_console(stderr=True, soft_wrap=True).print(f"{label} {escape(str(err))}", highlight=False)
    _record({"model": cfg.model.get("name"), "cluster": (cfg.get("cluster") or {}).get("name"), "error": str(err),
             "no_plan": no_plan, "exit_code": code})
    if not _multirun() and code:
        sys.exit(code)


def run_plan(cfg: DictConfig) -> None:
    from uniap_lightning.planner.solver import solve  # deferred: loads mip (~70 ms); evaluate and train don't solve

    console = make_console()
    try:
        _check_options(cfg, outputs=("out", "viz"))
        problem = _problem(cfg)
        with console.status("[bold]solving[/bold]") as status:
            plan = solve(
                problem,
                solver=cfg.solver,
                time_limit_s=float(cfg.time_limit),
                pp=_pp(cfg),
                baselines=bool(cfg.baselines),
                progress=lambda msg: status.update(f"[bold]solving[/bold] {msg}"),
            )
    except UniAPError as err:
        _fail(err, cfg)
        return
    print_plan(plan, console=console)
    try:  # checked before solving; refused here only if the name became a device / FIFO / folder meanwhile
        if cfg.out:
            plan.to_json(cfg.out)
            console.print(f"plan written to {cfg.out}")
        if cfg.viz:
            draw_plan(plan, problem, cfg.viz)
            console.print(f"picture written to {cfg.viz}")
    except UniAPError as err:
        _fail(err, cfg)
        return
    _record(
        {
            "model": problem.model.model,
            "cluster": problem.cluster.name,
            "devices": problem.num_devices,
            "batch_size": plan.global_batch_size,
            "pp": plan.pp,
            "schedule": plan.schedule,
            "microbatches": plan.microbatches,
            "strategies": ", ".join(sorted({lp.strategy.label() for lp in plan.layers})),
            "tpi_s": plan.estimate.tpi_s,
            "samples_per_s": plan.estimate.samples_per_s,
            "solve_s": plan.solver.solve_s if plan.solver else None,
            "baselines": plan.baselines,
            "exit_code": 0,
        }
    )


def run_evaluate(cfg: DictConfig) -> None:
    console = make_console()
    try:
        if not cfg.plan:
            raise UniAPError("give the plan to score: uniap evaluate plan=plan.json model=... cluster=...")
        _check_options(cfg)
        plan = Plan.from_json(Path(cfg.plan))
        _check_pinned(cfg, plan)
        problem = _problem(cfg)
        plan = plan.with_report(estimate=evaluate(problem, plan))
    except UniAPError as err:
        _fail(err, cfg)
        return
    plan = plan.with_report(solver=None)
    print_plan(plan, console=console, title=f"Evaluated plan {cfg.plan}: {problem.model.model} on {problem.cluster.name}")
    feasible = plan.estimate.feasible
    code = 0 if feasible or _allow_no_plan(cfg) else EXIT_DOES_NOT_FIT
    _record({"model": problem.model.model, "cluster": problem.cluster.name, "pp": plan.pp, "schedule": plan.schedule,
             "tpi_s": plan.estimate.tpi_s, "samples_per_s": plan.estimate.samples_per_s, "feasible": feasible,
             **({} if feasible else {"error": "the plan does not fit memory", "no_plan": True}), "exit_code": code})
    if code and not _multirun():
        sys.exit(code)


def run_explain(cfg: DictConfig) -> None:
    from uniap_lightning.planner.solver import solve  # deferred: loads mip (~70 ms); evaluate and train don't solve

    console = make_console()
    note = title = None
    try:
        _check_options(cfg)
        measured = _measured(cfg.measured) if cfg.get("measured") else None
        run = recorded.recorded_run(measured, cfg.measured) if measured else None
        chosen = run is not None and not (recorded.given_on_command_line() & set(recorded.CHOOSING))
        found = recorded.recorded_problem(run, cfg.measured) if chosen else None
        if found is not None:  # the model, cluster and plan the file was measured with
            problem, plan = found
            plan = plan.with_report(estimate=evaluate(problem, plan))
            title = f"The plan measured in {cfg.measured}: {recorded.describe(run)}"
        else:
            problem = _problem(cfg)
            plan = Plan.from_json(Path(cfg.plan)) if cfg.plan else None
            if plan is not None:
                _check_pinned(cfg, plan)
            if run is not None:
                recorded.check_same_run(run, problem, plan, cfg.measured)
            elif measured is not None:
                note = (f"note: {cfg.measured} does not record which model, cluster and plan it measured "
                        f"(written by an older version); compared with model {problem.model.model} on "
                        f"{problem.cluster.name}")
            if plan is not None:
                plan = plan.with_report(estimate=evaluate(problem, plan))
            else:
                with console.status("[bold]solving[/bold]"):
                    plan = solve(problem, solver=cfg.solver, time_limit_s=float(cfg.time_limit), pp=_pp(cfg),
                                 baselines=bool(cfg.baselines))
    except UniAPError as err:
        _fail(err, cfg)
        return
    if note:
        console.print(note, markup=False, highlight=False)
    print_plan(plan, console=console, **({"title": title} if title else {}))
    console.print(explain_renderables(plan, problem, measured))
    if measured and measured.get("rebalances"):
        console.print(_rebalance_table(measured["rebalances"]))
    _record({"model": problem.model.model, "cluster": problem.cluster.name, "devices": problem.num_devices,
             "pp": plan.pp, "schedule": plan.schedule, "microbatches": plan.microbatches,
             "tpi_s": plan.estimate.tpi_s, "samples_per_s": plan.estimate.samples_per_s, "exit_code": 0})


def _rebalance_table(events: list[Any]) -> Any:
    """The plan switches of a ``rebalance=True`` run, from the monitor's file."""
    table = Table(title="Plan switches during training (rebalance=True)")
    for col in ("step", "from", "to", "why", "predicted", "measured", "switch s"):
        table.add_column(col)
    pct = lambda v: "-" if not isinstance(v, (int, float)) else f"{v:+.0%}"  # noqa: E731
    for e in events if isinstance(events, list) else []:
        if isinstance(e, dict):
            table.add_row(str(e.get("step", "?")), escape(str(e.get("old_plan", ""))), escape(str(e.get("new_plan", ""))),
                          escape(str(e.get("reason", ""))), pct(e.get("predicted_gain")), pct(e.get("measured_gain")),
                          f"{e['switch_s']:.2f}" if isinstance(e.get("switch_s"), (int, float)) else "-")
    return table


def quiet_solver_banner() -> None:
    """python-mip logs "Using Python-MIP package version X" at INFO when first imported; with Hydra's logging on
    stdout that line came before every error and once per training rank. Its warnings still show. (Called before
    a command runs: mip is imported by the solver, which no module loads at import.)"""
    logging.getLogger("mip").setLevel(logging.WARNING)


@hydra.main(version_base="1.3", config_path=CONF, config_name="plan")
def plan_main(cfg: DictConfig) -> None:
    run_plan(cfg)


@hydra.main(version_base="1.3", config_path=CONF, config_name="plan")
def evaluate_main(cfg: DictConfig) -> None:
    run_evaluate(cfg)


@hydra.main(version_base="1.3", config_path=CONF, config_name="plan")
def explain_main(cfg: DictConfig) -> None:
    run_explain(cfg)


@hydra.main(version_base="1.3", config_path=CONF, config_name="fit")
def train_main(cfg: DictConfig) -> None:
    from uniap_lightning.cli.train import run_train  # deferred: loads torch; planning on a flat cluster never does

    # the ranks it starts get the command line as given (a YAML path, not the name it is registered under) and the
    # user's config folders (--config-dir is a flag, hydra.searchpath a Hydra override: neither is a task override)
    overrides = hydra_search_path().override(original_overrides(list(HydraConfig.get().overrides.task)))
    try:
        result = run_train(cfg, overrides)
    except UniAPError as err:
        _fail(err, cfg)
        return
    if result["rank"] == 0:
        _record({k: result[k] for k in ("model", "final_loss", "train_ppl", "samples_per_s", "measured_samples_per_s")}
                | {"devices": result["world_size"], "pp": result["plan"]["pp"],
                   "schedule": result["plan"].get("schedule"), "microbatches": result["plan"]["microbatches"],
                   "exit_code": 0})
