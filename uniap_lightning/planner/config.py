"""Build problems from the shipped configs (``conf/``) or from plain dicts, without Hydra.

``conf/`` is the single source of truth: ``conf/model/<name>.yaml`` (analytic transformer descriptions),
``conf/cluster/<name>.yaml``, ``conf/train/<name>.yaml``. The Hydra apps in :mod:`uniap_lightning.cli` compose
the same files; this module lets Python code (and tests) use them directly.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from uniap_lightning.planner.config_schema import register as register_schemas
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.errors import UniAPError
from uniap_lightning.files import check_yaml_limits, read_text
from uniap_lightning.planner.dimensions import OPT_INS, opt_ins
from uniap_lightning.planner.problem import Problem, TrainingConfig, compression_methods
from uniap_lightning.planner.analytic import ModelSpec, RooflinePricer, analytic_profile
from uniap_lightning.planner.profile import ModelProfile, load_profile

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # uniap_lightning/conf: packaged with the wheel
register_schemas()  # conf/fit.yaml's `strategy` is a structured config: in Hydra's ConfigStore before any compose
_CONF_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def available(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def load_group(group: str, name: str) -> dict[str, Any]:
    """A shipped entry by name (``conf/<group>/<name>.yaml``), or a YAML file given explicitly as a path (the
    name ends in ``.yaml`` / ``.yml``; it must exist). Names never reach outside ``conf/<group>``."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name)
    elif _CONF_NAME.fullmatch(name) and ".." not in name:
        path = CONF_DIR / group / f"{name}.yaml"
        if not path.is_file():
            raise UniAPError(f"unknown {group} {name!r}; available: {', '.join(available(group))} "
                             f"(or give a path to a .yaml file)")
    else:
        raise UniAPError(f"{group} {name!r} is neither a shipped {group} name ({', '.join(available(group))}) nor "
                         "a path to a .yaml file")
    text = read_text(path, f"{group} file")
    check_yaml_limits(text, f"{group} file {str(path)!r}")  # an alias bomb would otherwise load until killed
    try:
        data = OmegaConf.to_container(OmegaConf.create(text), resolve=True)
    except Exception as err:  # noqa: BLE001 - yaml / omegaconf raise many types for a bad document
        why = " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
        raise UniAPError(f"{group} file {str(path)!r} is not valid YAML: {why[:300]}") from err
    if not isinstance(data, dict):
        raise UniAPError(f"{group} file {str(path)!r} must hold a mapping of fields, got {type(data).__name__}")
    return data  # type: ignore[return-value]


def cluster_from(cfg: str | dict[str, Any] | Cluster) -> Cluster:
    if isinstance(cfg, Cluster):
        return cfg
    return Cluster.from_dict(load_group("cluster", cfg) if isinstance(cfg, str) else dict(cfg))


def model_spec_from(cfg: str | dict[str, Any]) -> ModelSpec:
    return ModelSpec.from_dict(load_group("model", cfg) if isinstance(cfg, str) else dict(cfg))


def training_from(cfg: str | dict[str, Any] | TrainingConfig | None = None, **overrides: Any) -> TrainingConfig:
    if isinstance(cfg, TrainingConfig):
        data = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    else:
        data = load_group("train", cfg or "default") if not isinstance(cfg, dict) else dict(cfg)
    data.update({k: v for k, v in overrides.items() if v is not None})
    known = set(TrainingConfig.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise UniAPError(f"training config has unknown field(s) {unknown}; known: {sorted(known)}")
    if data.get("microbatches") is not None:
        mb = data["microbatches"]
        data["microbatches"] = tuple(mb) if isinstance(mb, (list, tuple)) else (mb,)
    return TrainingConfig(**data)


def build_problem(
    *,
    model: str | dict[str, Any] | None = None,
    cluster: str | dict[str, Any] | Cluster,
    training: str | dict[str, Any] | TrainingConfig | None = None,
    profile: str | Path | ModelProfile | None = None,
    compression: str | list[str] | tuple[str, ...] | None = None,
    roofline: RooflinePricer | None = None,
    **overrides: Any,
) -> Problem:
    """A problem from a model config (analytic profile) or a profile file, a cluster and training settings.
    ``compression``: None (off), a method, "auto" (all) or a list: what the solver may choose per layer.
    ``roofline``: what prices a model config on a cluster whose ``compute_model`` is ``"roofline"`` (torch's,
    passed in from above the planner: :func:`uniap_lightning.profiling.pricing.roofline`;
    ``uniap_lightning.build_problem`` is this function with it given).
    ``overrides``: the opt-in dimensions' options by name (:data:`~uniap_lightning.planner.dimensions.OPT_INS`,
    as ``UniAPStrategy`` takes them; None: off), the rest training settings."""
    allowed = opt_ins({k: overrides.pop(k) for k in OPT_INS if k in overrides})
    cl = cluster_from(cluster)
    if profile is not None:
        prof = profile if isinstance(profile, ModelProfile) else load_profile(profile)
    elif model is not None:
        prof = analytic_profile(model_spec_from(model), cl, roofline)
    else:
        raise UniAPError("give a model (a name from conf/model or a dict) or a profile file")
    return Problem(prof, cl, training_from(training, **overrides), compression=compression_methods(compression),
                   opt_ins=allowed)
