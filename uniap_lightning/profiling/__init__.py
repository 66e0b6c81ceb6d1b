"""Model profiles: per-layer costs, analytic (from hyper-parameters) or read from a profile file."""

from uniap_lightning.planner.profile import LayerProfile, ModelProfile, load_profile, save_profile

__all__ = ["LayerProfile", "ModelProfile", "load_profile", "save_profile"]
