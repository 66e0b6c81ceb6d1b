"""Measuring on real processes: layers (``module.profile_chain``), collectives, TP / FSDP overheads, and caches.

By job: ``timing`` (the one timer), ``measure`` (layers on a sample micro-batch), ``aggregate`` (identical layers,
noise, ranks), ``structural`` (the fallback), ``collectives`` (the cluster's links), ``strategies`` (TP / FSDP
overheads), ``cache`` (on-disk profiles and cluster measurements). The profile format lives in the torch-free
``uniap_lightning.planner.profile``; its names are re-exported here.
"""

from uniap_lightning.planner.profile import LayerProfile, ModelProfile, load_profile, save_profile

__all__ = ["LayerProfile", "ModelProfile", "load_profile", "save_profile"]
