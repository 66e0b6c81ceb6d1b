"""The profile and cluster cache keys hold the library versions, transformers' among them (a Hugging Face model's
layers run its code, so another version may time, or split, differently)."""

from __future__ import annotations

import importlib.metadata

import pytest

from uniap_lightning.profiling import cache


def test_the_transformers_version_is_part_of_the_cache_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    assert cache.versions()["transformers"] == transformers.__version__
    key = cache.cluster_key(device="cpu", backend="gloo", nodes=1, devices_per_node=2)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.0.1" if name == "transformers" else real(name))
    assert cache.versions()["transformers"] == "0.0.1"
    assert cache.cluster_key(device="cpu", backend="gloo", nodes=1, devices_per_node=2) != key


def test_without_transformers_the_keys_still_build(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "transformers":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert "transformers" not in cache.versions()


def test_the_profiler_revision_is_part_of_the_key(monkeypatch):
    """Entries cached by a profiler that recorded fewer fields (before the sequence and expert fields) get another
    key, so they are measured again rather than read without those fields."""
    from uniap_lightning.profiling import cache

    now = cache.versions()
    assert now["profiler"] == cache.PROFILER_REVISION
    monkeypatch.setattr(cache, "PROFILER_REVISION", "1")
    assert cache.versions() != now
