"""The backward's split into the input's gradient (B) and the parameters' gradients (W): the profile field
``weight_grad_fraction``, its default, and the profiler's measurement of it (single process, CPU)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.profile import (
    DEFAULT_WEIGHT_GRAD_FRACTION,
    LayerProfile,
    ModelProfile,
    load_profile,
    save_profile,
)

LAYER = LayerProfile(name="block", forward_s=1e-3, backward_s=2e-3, params=1000, activation_bytes=1e4,
                     output_bytes=1e3)


def _doc(**extra: object) -> dict[str, object]:
    layer = {"name": "block", "forward_s": 1e-3, "backward_s": 2e-3, "params": 1000, "activation_bytes": 1e4,
             "output_bytes": 1e3, "tp_degrees": [1], "tp_allreduces": 0, **extra}
    return {"format_version": 1, "model": "m", "source": "measured", "device": "cpu", "meta": {}, "layers": [layer]}


def test_the_field_round_trips_and_is_omitted_when_not_measured(tmp_path: Path) -> None:
    prof = ModelProfile("m", [replace(LAYER, weight_grad_fraction=0.375), LAYER, replace(LAYER, params=0)])
    save_profile(prof, tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())
    assert [("weight_grad_fraction" in lp) for lp in raw["layers"]] == [True, False, False]
    back = load_profile(tmp_path / "p.json")
    assert back.layers == prof.layers
    assert [lp.backward_split() for lp in back.layers] == [0.375, DEFAULT_WEIGHT_GRAD_FRACTION, 0.0]
    # measured 1.0 (a first layer: no input gradient) and 0.0 are kept, not taken for "absent"
    edge = ModelProfile("m", [replace(LAYER, weight_grad_fraction=1.0), replace(LAYER, weight_grad_fraction=0.0)])
    save_profile(edge, tmp_path / "e.json")
    assert [lp.backward_split() for lp in load_profile(tmp_path / "e.json").layers] == [1.0, 0.0]


def test_an_old_profile_without_the_field_reads_as_none_and_writes_back_byte_identical(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    save_profile(ModelProfile.from_dict(_doc(backward_peak_bytes=5.0)), old)
    before = old.read_bytes()
    assert b"weight_grad_fraction" not in before
    prof = load_profile(old)
    assert prof.layers[0].weight_grad_fraction is None
    assert prof.layers[0].backward_split() == DEFAULT_WEIGHT_GRAD_FRACTION == 0.5
    save_profile(prof, tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == before
    # readers ignore fields they do not know: how a reader from before this field loads a profile with it
    assert ModelProfile.from_dict(_doc(a_later_field=0.5)).layers[0] == ModelProfile.from_dict(_doc()).layers[0]
    # an explicit null is "not measured" too
    assert ModelProfile.from_dict(_doc(weight_grad_fraction=None)).layers[0].weight_grad_fraction is None


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (1.5, r"profile: layers\[0\]\.weight_grad_fraction must be in \[0, 1\], got 1\.5"),
        (-0.25, r"layers\[0\]\.weight_grad_fraction must be in \[0, 1\], got -0\.25"),
        ("half", r"layers\[0\]\.weight_grad_fraction must be a finite number, got 'half'"),
        (True, r"layers\[0\]\.weight_grad_fraction must be a finite number, got True"),
        (float("nan"), r"layers\[0\]\.weight_grad_fraction must be a finite number"),
        ([0.5], r"layers\[0\]\.weight_grad_fraction must be a finite number"),
    ],
)
def test_bad_values_are_refused_naming_the_layer_and_field(value: object, match: str) -> None:
    with pytest.raises(UniAPError, match=match) as err:
        ModelProfile.from_dict(_doc(weight_grad_fraction=value))
    assert "\n" not in str(err.value)
