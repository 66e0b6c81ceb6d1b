"""Checkpoint files a user may receive cannot run code: a crafted single-file checkpoint, ``meta.pt`` or DCP
``.metadata`` is refused with a clear error before anything is unpickled beyond plain data."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from uniap_lightning.errors import UniAPError


class _Payload:
    """Unpickling this object creates a file: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (self.marker,))


def _real_dcp_folder(tmp_path: Path) -> Path:
    """A real distributed checkpoint folder (DCP shards + .metadata + meta.pt), written by one process."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "real.ckpt"
    dcp.save({"state_dict": {"w": torch.ones(3)}}, checkpoint_id=folder, no_dist=True)
    torch.save({"epoch": 0, "global_step": 1, "loops": {}}, folder / "meta.pt")
    return folder


def _strategy():
    from uniap_lightning.strategy import UniAPStrategy

    return UniAPStrategy()


def test_crafted_single_file_checkpoint_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "evil": _Payload(marker)}, tmp_path / "bad.ckpt")
    for weights_only in (None, True, False):
        with pytest.raises(UniAPError, match="refused to load"):
            _strategy().load_checkpoint(tmp_path / "bad.ckpt", weights_only=weights_only)
    assert not marker.exists()


def test_crafted_meta_pt_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    folder = _real_dcp_folder(tmp_path)
    marker = tmp_path / "ran"
    torch.save({"epoch": 0, "evil": _Payload(marker)}, folder / "meta.pt")
    with pytest.raises(UniAPError, match="meta.pt: refused to load"):
        _strategy().load_checkpoint(folder)
    assert not marker.exists()


def test_crafted_dcp_metadata_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    from uniap_lightning.runtime.checkpoint import check_dcp_metadata, consolidate_checkpoint

    folder = _real_dcp_folder(tmp_path)
    check_dcp_metadata(folder)  # the real one passes
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UniAPError, match="refused to load this distributed checkpoint"):
        check_dcp_metadata(folder)
    with pytest.raises(UniAPError, match="refused"):
        consolidate_checkpoint(folder, tmp_path / "out.pt")
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists() and not list(tmp_path.glob(".out.pt.*"))


def test_random_bytes_are_a_clear_error(tmp_path: Path) -> None:
    from uniap_lightning.runtime.checkpoint import load_plain

    (tmp_path / "noise.ckpt").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(UniAPError, match="noise.ckpt"):
        load_plain(tmp_path / "noise.ckpt")
    folder = _real_dcp_folder(tmp_path)
    shutil.copy(tmp_path / "noise.ckpt", folder / ".metadata")
    with pytest.raises(UniAPError, match=".metadata"):
        _strategy().load_checkpoint(folder)
