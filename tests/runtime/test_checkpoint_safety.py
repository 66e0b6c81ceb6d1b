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


# ------------------------------------------------------------------------------- gadgets that pass naive checks
def _dotted_global_gadget(marker: Path) -> bytes:
    """A protocol-4 pickle that calls ``Path.touch(marker)`` through names an allow-list by module prefix admits:
    the global ``torch.distributed.checkpoint.filesystem`` : ``Path.touch`` (a dotted name, resolved through that
    module's own ``from pathlib import Path``) applied to ``pathlib.PosixPath(marker)``."""
    P = pickle

    def text(s: str) -> bytes:
        raw = s.encode()
        return P.SHORT_BINUNICODE + bytes([len(raw)]) + raw

    return (P.PROTO + bytes([4]) + text("torch.distributed.checkpoint.filesystem") + text("Path.touch")
            + P.STACK_GLOBAL + text("pathlib") + text("PosixPath") + P.STACK_GLOBAL + text(str(marker))
            + P.TUPLE1 + P.REDUCE + P.TUPLE1 + P.REDUCE + P.STOP)


def test_the_dotted_global_gadget_is_live_and_refused_everywhere(tmp_path: Path) -> None:
    from uniap_lightning.runtime.checkpoint import check_dcp_metadata, consolidate_checkpoint
    from uniap_lightning.runtime.checkpoint_safety import checkpoint_problem

    control = tmp_path / "control"
    pickle.loads(_dotted_global_gadget(control))  # a plain unpickler runs it: the gadget is real
    assert control.exists()

    folder = _real_dcp_folder(tmp_path)
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(_dotted_global_gadget(marker))
    with pytest.raises(UniAPError, match="dotted global"):
        check_dcp_metadata(folder)
    with pytest.raises(UniAPError, match="refused"):
        consolidate_checkpoint(folder, tmp_path / "out.pt")
    with pytest.raises(UniAPError, match="refused"):
        _strategy().load_checkpoint(folder)
    assert "dotted global" in (checkpoint_problem(folder) or "")
    assert not marker.exists()


def _folder_with_bytes_entry(tmp_path: Path, value: object) -> Path:
    """A real DCP folder whose optimizer param group holds ``value`` as a non-tensor (BYTE_IO) entry."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "bytes.ckpt"
    dcp.save({"state_dict": {"w": torch.ones(3)}, "optimizer_0": {"param_groups.w.lr": value}},
             checkpoint_id=folder, no_dist=True)
    return folder


def test_a_pickle_in_a_shards_byte_entry_is_live_and_refused(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from uniap_lightning.runtime.checkpoint import consolidate_checkpoint, dcp_read
    from uniap_lightning.runtime.checkpoint_safety import safe_load_planner

    control = tmp_path / "control"
    folder = _folder_with_bytes_entry(tmp_path, _Payload(control))
    dcp.load({"optimizer_0": {"param_groups.w.lr": 0.0}}, checkpoint_id=folder, no_dist=True)  # torch's own reader
    assert control.exists()  # runs it: the gadget is real
    control.unlink()

    with pytest.raises(UniAPError, match="optimizer_0.param_groups.w.lr.*pickled Python objects"):
        consolidate_checkpoint(folder, tmp_path / "out.pt")
    state = {"state_dict": {"w": torch.zeros(3)}, "optimizer_0": {"param_groups.w.lr": 0.0}}
    with pytest.raises(UniAPError, match="never runs code"):
        dcp_read(state, folder, planner=safe_load_planner(), no_dist=True)
    assert not control.exists()


def test_plain_byte_entries_still_load(tmp_path: Path) -> None:
    from uniap_lightning.runtime.checkpoint import consolidate_checkpoint, dcp_read
    from uniap_lightning.runtime.checkpoint_safety import safe_load_planner

    folder = _folder_with_bytes_entry(tmp_path, (0.9, 0.999))
    state = {"state_dict": {"w": torch.zeros(3)}, "optimizer_0": {"param_groups.w.lr": None}}
    dcp_read(state, folder, planner=safe_load_planner(), no_dist=True)
    assert state["optimizer_0"]["param_groups.w.lr"] == (0.9, 0.999)
    assert torch.equal(state["state_dict"]["w"], torch.ones(3))
    consolidate_checkpoint(folder, tmp_path / "out.pt")
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], torch.ones(3))


def test_a_shard_name_outside_the_folder_is_refused(tmp_path: Path) -> None:
    from uniap_lightning.runtime.checkpoint_safety import read_metadata

    folder = _real_dcp_folder(tmp_path)
    metadata = read_metadata(folder)
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UniAPError, match="not a file name inside the checkpoint folder"):
        read_metadata(folder)


# --------------------------------------------------------------------------------------------- damaged folders
@pytest.mark.parametrize("damage", ["missing", "truncated", "a folder"])
def test_a_missing_or_short_shard_is_named_before_anything_loads(tmp_path: Path, damage: str) -> None:
    from uniap_lightning.runtime.checkpoint import checked_metadata
    from uniap_lightning.runtime.checkpoint_safety import checkpoint_problem

    folder = _real_dcp_folder(tmp_path)
    shard = next(folder.glob("*.distcp"))
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        shard.unlink()
        shard.mkdir()
    word = {"missing": "is missing", "truncated": "is truncated", "a folder": "is not a regular file"}[damage]
    with pytest.raises(UniAPError, match=f"is damaged: the shard {shard.name} {word}.*older checkpoint"):
        checked_metadata(folder)
    assert word in (checkpoint_problem(folder) or "")


def test_a_shard_with_bad_bytes_is_damaged_not_a_traceback(tmp_path: Path) -> None:
    from uniap_lightning.runtime.checkpoint import dcp_read
    from uniap_lightning.runtime.checkpoint_safety import safe_load_planner

    folder = _real_dcp_folder(tmp_path)
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(b"\x00" * shard.stat().st_size)
    with pytest.raises(UniAPError, match="is damaged .*older checkpoint"):
        dcp_read({"state_dict": {"w": torch.zeros(3)}}, folder, planner=safe_load_planner(), no_dist=True)


def _meta(step: int = 5) -> dict:
    progress = {"optimizer": {"step": {"total": {"ready": step, "completed": step},
                                       "current": {"ready": step, "completed": step}}}}
    return {"epoch": 0, "global_step": step, "loops": {"fit_loop": {
        "epoch_loop.automatic_optimization.optim_progress": progress,
        "epoch_loop.manual_optimization.optim_step_progress": {"total": {"ready": 0, "completed": 0}},
        "epoch_loop.batch_progress": {"total": {"ready": step, "completed": step}}}}}


def _tampered(kind: str) -> dict:
    meta = _meta()
    if kind == "huge step":
        meta["global_step"] = 10**30
    elif kind == "negative counter":
        meta["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] = -4
    elif kind == "no loops":
        del meta["loops"]
    elif kind == "no step counter":
        del meta["loops"]["fit_loop"]["epoch_loop.automatic_optimization.optim_progress"]
    elif kind == "steps disagree":
        meta["global_step"] = 2
    elif kind == "float step":
        meta["global_step"] = 5.0
    return meta


@pytest.mark.parametrize("kind", ["huge step", "negative counter", "no loops", "no step counter", "steps disagree",
                                  "float step"])
def test_a_tampered_loop_state_is_refused(tmp_path: Path, kind: str) -> None:
    from uniap_lightning.runtime.checkpoint_safety import check_meta, checkpoint_problem

    check_meta(_meta(), tmp_path / "meta.pt")  # the untampered one passes
    with pytest.raises(UniAPError, match="meta.pt: "):
        check_meta(_tampered(kind), tmp_path / "meta.pt")
    folder = _real_dcp_folder(tmp_path)
    torch.save(_tampered(kind), folder / "meta.pt")
    assert (checkpoint_problem(folder) or "").startswith("meta.pt: ")
    torch.save(_meta(), folder / "meta.pt")
    assert checkpoint_problem(folder) is None


def test_special_files_are_refused_without_blocking(tmp_path: Path) -> None:
    import os

    from uniap_lightning.runtime.checkpoint import load_plain
    from uniap_lightning.runtime.checkpoint_safety import checkpoint_problem

    fifo = tmp_path / "fifo.ckpt"
    os.mkfifo(fifo)
    with pytest.raises(UniAPError, match="is a FIFO, not a file"):
        load_plain(fifo)
    with pytest.raises(UniAPError, match="is a character device, not a file"):
        load_plain(Path("/dev/zero"))
    folder = _real_dcp_folder(tmp_path)
    (folder / ".metadata").unlink()
    os.mkfifo(folder / ".metadata")
    assert "is a FIFO, not a file" in (checkpoint_problem(folder) or "")


# ------------------------------------------------------------------------------------ another model's checkpoint
def test_a_checkpoint_of_another_model_names_what_differs(tmp_path: Path) -> None:
    from uniap_lightning.runtime.checkpoint import check_fits, checked_metadata

    folder = _real_dcp_folder(tmp_path)  # state_dict.w: [3]
    metadata = checked_metadata(folder)
    check_fits(folder, metadata, {"state_dict": {"w": torch.zeros(3)}}, strict=True)
    with pytest.raises(UniAPError, match=r"does not fit this model: 1 shapes differ \(e.g. state_dict.w: saved "
                                         r"\[3\], this model \[4\]\)"):
        check_fits(folder, metadata, {"state_dict": {"w": torch.zeros(4)}}, strict=True)
    with pytest.raises(UniAPError, match="1 entries of this model are not in it .*state_dict.v.*1 weights in it are "
                                         "not in this model .*state_dict.w"):
        check_fits(folder, metadata, {"state_dict": {"v": torch.zeros(3)}}, strict=True)
    with pytest.raises(UniAPError, match="optimizer_0.state.w.exp_avg"):
        check_fits(folder, metadata, {"state_dict": {"w": torch.zeros(3)},
                                      "optimizer_0": {"state.w.exp_avg": torch.zeros(3)}}, strict=False)
