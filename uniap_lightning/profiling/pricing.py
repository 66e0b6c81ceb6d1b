"""The roofline model handed to the planner, torch-free to import.

A cluster whose ``compute_model`` is ``"roofline"`` (every shipped cluster naming a catalogue device) prices a model
config by tracing each layer with torch (:mod:`uniap_lightning.profiling.roofline`). The planner sits below
profiling and imports no torch, so it takes that pricer as an argument
(:data:`~uniap_lightning.planner.analytic.RooflinePricer`: ``analytic_profile(..., roofline=)``,
``build_problem(..., roofline=)``) and refuses a roofline cluster without one. This module is what the layers above
pass it:

* :func:`roofline`: the pricer; torch loads on its first call, so a cluster priced flat never loads it;
* :func:`build_problem` and :func:`analytic_profile`: the planner's, with :func:`roofline` given (what
  ``uniap_lightning.build_problem`` and ``uniap plan`` use).
"""

from __future__ import annotations

from typing import Any

from uniap_lightning.planner import analytic, config
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.model_spec import ModelSpec
from uniap_lightning.planner.problem import Problem
from uniap_lightning.planner.profile import ModelProfile

__all__ = ["analytic_profile", "build_problem", "roofline"]


def roofline(spec: ModelSpec, cluster: Cluster, flat: ModelProfile) -> ModelProfile:
    """:func:`uniap_lightning.profiling.roofline.roofline_profile` (the planner's
    :data:`~uniap_lightning.planner.analytic.RooflinePricer`), loaded on first use."""
    # deferred: loads torch (profiling.roofline traces layers with it); a cluster priced flat plans without it
    from uniap_lightning.profiling.roofline import roofline_profile

    return roofline_profile(spec, cluster, flat)


def build_problem(**kwargs: Any) -> Problem:
    """:func:`uniap_lightning.planner.config.build_problem` (the same keyword arguments) with ``roofline`` given:
    :func:`roofline` unless the caller hands its own."""
    kwargs.setdefault("roofline", roofline)
    return config.build_problem(**kwargs)


def analytic_profile(spec: ModelSpec, cluster: Cluster) -> ModelProfile:
    """:func:`uniap_lightning.planner.analytic.analytic_profile` with :func:`roofline` given."""
    return analytic.analytic_profile(spec, cluster, roofline)
