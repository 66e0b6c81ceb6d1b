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


# ------------------------------------------------------------------- the allow-list: globals without a dot in them
def _text(s: str) -> bytes:
    raw = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def _stack_global(module: str, name: str) -> bytes:
    """Protocol 4's way to name a global (``find_class(module, name)``)."""
    return _text(module) + _text(name) + pickle.STACK_GLOBAL


def _old_global(module: str, name: str) -> bytes:
    """Protocols 0-3's way (``c module\\nname\\n``): the other path into ``find_class``."""
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _call1(callable_: bytes, arg: bytes) -> bytes:
    return callable_ + arg + pickle.TUPLE1 + pickle.REDUCE


_PROTO4 = pickle.PROTO + bytes([4])


def _gadget(kind: str, marker: Path) -> bytes:
    """A hand-made pickle that creates ``marker`` through one global that has no dot in its name (the dotted-name
    rule alone lets each through; only the (module, name) allow-list stops it)."""
    touch = f"import pathlib; pathlib.Path({str(marker)!r}).touch()"
    shell = f"touch '{marker}'"
    if kind == "builtins.exec":
        body = _call1(_stack_global("builtins", "exec"), _text(touch))
    elif kind == "builtins.eval":
        body = _call1(_old_global("builtins", "eval"), _text(f"__import__('pathlib').Path({str(marker)!r}).touch()"))
    elif kind == "posix.system":
        body = _call1(_stack_global("posix", "system"), _text(shell))
    elif kind == "os.system":
        body = _call1(_old_global("os", "system"), _text(shell))
    elif kind == "subprocess.Popen":
        # Popen(["touch", marker]) kept in memo 0, then getattr(<it>, "wait")(): the file exists when loads returns
        # (Popen is named first, so it is the global a correct reader refuses)
        popen = _call1(_stack_global("subprocess", "Popen"),
                       pickle.MARK + _text("touch") + _text(str(marker)) + pickle.LIST)
        body = (popen + pickle.MEMOIZE + pickle.POP + _stack_global("builtins", "getattr") + pickle.MARK
                + pickle.BINGET + bytes([0]) + _text("wait") + pickle.TUPLE + pickle.REDUCE + pickle.EMPTY_TUPLE
                + pickle.REDUCE)
    elif kind == "builtins.getattr":
        # getattr(PosixPath(marker), "touch")(): pathlib.PosixPath is on the allow-list, getattr is the gadget
        path = _call1(_stack_global("pathlib", "PosixPath"), _text(str(marker)))
        body = (_stack_global("builtins", "getattr") + path + _text("touch") + pickle.TUPLE2 + pickle.REDUCE
                + pickle.EMPTY_TUPLE + pickle.REDUCE)
    elif kind == "__reduce__ os.system":  # what pickle.dumps writes for an object that reduces to os.system
        return pickle.dumps(_ShellPayload(shell), protocol=2)
    else:
        raise AssertionError(kind)
    return _PROTO4 + body + pickle.STOP


class _ShellPayload:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):  # noqa: ANN204
        import os

        return (os.system, (self.command,))


GADGETS = ["builtins.exec", "builtins.eval", "posix.system", "os.system", "subprocess.Popen", "builtins.getattr",
           "__reduce__ os.system"]


@pytest.mark.parametrize("kind", GADGETS)
def test_undotted_code_globals_are_live_and_refused_in_one_line(tmp_path: Path, kind: str) -> None:
    """Each gadget runs under a plain unpickler (the control marker appears); as a checkpoint's ``.metadata`` it is
    refused by every reader with one line that names the global, and its marker never appears."""
    from uniap_lightning.runtime.checkpoint import check_dcp_metadata, consolidate_checkpoint
    from uniap_lightning.runtime.checkpoint_safety import checkpoint_problem

    control = tmp_path / "control"
    pickle.loads(_gadget(kind, control))
    assert control.exists(), f"the {kind} gadget did not run under pickle.loads"

    folder = _real_dcp_folder(tmp_path)
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(_gadget(kind, marker))
    named = "posix.system" if kind == "__reduce__ os.system" else kind
    with pytest.raises(UniAPError, match="refused to load this distributed checkpoint") as err:
        check_dcp_metadata(folder)
    assert not marker.exists(), f"the {kind} payload ran while reading the metadata"
    assert "\n" not in str(err.value) and f"{named} is not part of a distributed checkpoint" in str(err.value)
    with pytest.raises(UniAPError, match="refused") as err:
        consolidate_checkpoint(folder, tmp_path / "out.pt")
    assert "\n" not in str(err.value)
    with pytest.raises(UniAPError, match="refused") as err:
        _strategy().load_checkpoint(folder)
    assert "\n" not in str(err.value)
    assert named in (checkpoint_problem(folder) or "")
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()


def _only_global(module: str, name: str) -> bytes:
    return _PROTO4 + _stack_global(module, name) + pickle.STOP


def test_the_metadata_reader_admits_exactly_its_listed_globals() -> None:
    """Every (module, name) of ``METADATA_GLOBALS`` and every torch dtype resolves to the object itself; globals off
    the list, with a dot in their name or not, in allowed modules or not, are refused by name."""
    import importlib
    import io
    import re

    from uniap_lightning.runtime.checkpoint_safety import METADATA_GLOBALS, _MetadataUnpickler

    def unpickle(module: str, name: str) -> object:
        return _MetadataUnpickler(io.BytesIO(_only_global(module, name))).load()

    assert len(METADATA_GLOBALS) >= 10
    for module, name in sorted(METADATA_GLOBALS):
        assert unpickle(module, name) is getattr(importlib.import_module(module), name), (module, name)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        assert unpickle("torch", str(dtype).removeprefix("torch.")) is dtype
    unlisted = [("builtins", "exec"), ("builtins", "eval"), ("builtins", "getattr"), ("builtins", "__import__"),
                ("os", "system"), ("posix", "system"), ("subprocess", "Popen"), ("pathlib", "Path"),
                ("torch", "load"), ("torch", "dtype"), ("torch", "tensor"), ("collections", "namedtuple"),
                ("torch.distributed.checkpoint.metadata", "dataclass"), ("torch.serialization", "load"),
                ("pathlib", "PosixPath.touch"), ("torch.distributed.checkpoint.filesystem", "Path.touch"),
                ("collections", "OrderedDict.fromkeys"), ("torch", "Size.__new__"), ("torch", "float32.to"),
                ("nosuchmodule", "anything")]
    for module, name in unlisted:
        with pytest.raises(pickle.UnpicklingError, match=rf"{re.escape(module)}[.:]{re.escape(name)}"):
            unpickle(module, name)
