"""Hostile input to the exports (issue 38): a bad ``config.json`` given to ``uniap export --format hf --hf-config``,
and destinations that cannot be written (below a file, a missing folder, an immutable folder, a file under the
name), offline, through the CLI and through ``save_consolidated``. Each is one :class:`UniAPError` line that names
the file (the CLI: ``error: ...`` and exit code 2), leaves no temporary folder next to the destination and leaves
the destination as it was. One tiny GPT-2 checkpoint serves every case; everything runs in this process except one
CLI run per kind of failure."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from hf_models import hf_module  # noqa: E402

from uniap_lightning.cli import export as cli_export  # noqa: E402
from uniap_lightning.errors import UniAPError  # noqa: E402
from uniap_lightning.runtime import export  # noqa: E402
from uniap_lightning.runtime.checkpoint import consolidate_checkpoint, save_consolidated  # noqa: E402
from uniap_lightning.strategy_checkpoints import CheckpointIO  # noqa: E402


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny GPT-2 LightningModule, its DCP checkpoint folder (what the offline export reads) and its own Hugging
    Face folder (the good ``--hf-config``)."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("hostile_export")
    torch.manual_seed(0)
    module = hf_module("gpt2")
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"state_dict": module.state_dict()}, checkpoint_id=str(root / "ck"), no_dist=True)
    save_consolidated(module, root / "good", rank=0, format="hf")
    config = json.loads((root / "good" / "config.json").read_text())
    return SimpleNamespace(module=module, ck=root / "ck", good=root / "good", config=config)


def _snapshot(folder: Path) -> dict[str, Any]:
    """Every entry below ``folder`` (names, kinds, bytes): what "left as it was" compares."""
    out: dict[str, Any] = {}
    for p in sorted(folder.rglob("*")):
        out[str(p.relative_to(folder))] = p.read_bytes() if p.is_file() and not p.is_symlink() else p.is_dir()
    return out


@pytest.fixture()
def dest(tmp_path: Path, made: SimpleNamespace) -> Path:
    """An earlier export under the destination name, alone in its folder (a failed export must keep it)."""
    out = tmp_path / "out" / "model"
    out.parent.mkdir()
    shutil.copytree(made.good, out)
    return out


@contextlib.contextmanager
def _immutable(path: Path) -> Iterator[None]:
    """``chattr +i`` for the duration (root can write a chmod 555 folder, not an immutable one); skips where the
    file system or the machine does not allow it."""
    if shutil.which("chattr") is None:
        pytest.skip("no chattr on this machine")
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i is not available here: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def _one_line(err: BaseException, *needles: str) -> str:
    text = str(err)
    assert isinstance(err, UniAPError), repr(err)
    assert len(text.splitlines()) == 1, text
    for needle in needles:
        assert needle in text, (needle, text)
    return text


def _no_leftovers(parent: Path, *expected: str) -> None:
    assert sorted(p.name for p in parent.iterdir()) == sorted(expected), list(parent.iterdir())


# ---------------------------------------------------------------------------------------------- bad config.json
def _with(**fields: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(config: dict[str, Any]) -> dict[str, Any]:
        return {**config, **fields}
    return edit


def _without(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda config: {k: v for k, v in config.items() if k != key}


#: case -> (how config.json is made from the good one: raw bytes, a link target, or an edit of the dict; what the
#: one-line message says)
BAD_CONFIGS: dict[str, tuple[Any, str]] = {
    "garbage_bytes": (b"\x00\xff\xfe garbage \x80", "is not a text file"),
    "not_json": (b"model_type = gpt2\n", "is not valid JSON"),
    "symlink_to_etc_passwd": (Path("/etc/passwd"), "symbolic link out of its folder"),
    "nested_100k_deep": (b"[" * 100_000 + b"]" * 100_000, "nests lists / objects deeper"),
    "number_of_5000_digits": (b'{"model_type": "gpt2", "vocab_size": ' + b"9" * 5000 + b"}", "5000 digits"),
    "a_list": (b"[1, 2]", "not a JSON object"),
    "unknown_model_type": (_with(model_type="no_such_model"), "'no_such_model' is not a model type"),
    "model_type_not_a_string": (_with(model_type=["gpt2"]), "is not a model type"),
    "missing_model_type": (_without("model_type"), "has no model_type"),
    "negative_vocab": (_with(vocab_size=-5), "vocab_size must be a positive integer"),
    "float_vocab": (_with(vocab_size=64.5), "vocab_size must be a positive integer"),
    "huge_hidden_size": (_with(n_embd=10**12), "n_embd must be a positive integer of at most"),
    "hidden_size_past_the_weights": (_with(n_embd=4096), "hidden_size is 4,096, larger than any dimension"),
    "more_layers_than_weights": (_with(n_layer=100_000), "num_hidden_layers is 100,000, more than"),
    "heads_do_not_divide": (_with(n_head=3), "GPT2LMHeadModel cannot be built from it"),
    "vocab_of_another_model": (_with(vocab_size=50), "is (64, 32), GPT2LMHeadModel.transformer.wte.weight is (50, 32)"),
    "architectures_Trainer": (_with(architectures=["Trainer"]), "names 'Trainer', not a transformers model class"),
    "architectures_TrainingArguments": (_with(architectures=["TrainingArguments"]), "'TrainingArguments', not a"),
    "architectures___class__": (_with(architectures=["__class__"]), "names '__class__', not a transformers model"),
    "architectures_of_another_model_type": (_with(architectures=["LlamaForCausalLM"]),
                                            "'LlamaForCausalLM', not a transformers model class of model_type 'gpt2'"),
    "architectures_second_entry_Trainer": (_with(architectures=["GPT2LMHeadModel", "Trainer"]), "names 'Trainer'"),
    "architectures_a_string": (_with(architectures="GPT2LMHeadModel"), "architectures must be a list"),
    "no_architectures": (_without("architectures"), "names no transformers model class"),
}


def _bad_folder(root: Path, made: SimpleNamespace, case: str) -> Path:
    spec = BAD_CONFIGS[case][0]
    folder = root / f"cfg_{case}"
    folder.mkdir()
    target = folder / "config.json"
    if isinstance(spec, bytes):
        target.write_bytes(spec)
    elif isinstance(spec, Path):
        target.symlink_to(spec)
    else:
        target.write_text(json.dumps(spec(dict(made.config))))
    return folder


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_bad_config_json_is_one_error_and_nothing_is_written(case: str, made: SimpleNamespace, dest: Path,
                                                               tmp_path: Path, capfd: pytest.CaptureFixture[str]
                                                               ) -> None:
    folder = _bad_folder(tmp_path, made, case)
    before = _snapshot(dest)
    with pytest.raises(UniAPError) as caught:
        consolidate_checkpoint(made.ck, dest, format="hf", hf_config=folder)
    text = _one_line(caught.value, "config.json", BAD_CONFIGS[case][1])
    assert "root:" not in text  # the linked file's content is never shown
    assert _snapshot(dest) == before
    _no_leftovers(dest.parent, "model")
    # the CLI: exit code 2, one `error:` line on stderr (transformers' own warnings silenced), no traceback
    capfd.readouterr()
    code = cli_export.main([str(made.ck), str(dest), "--format", "hf", "--hf-config", str(folder)])
    out, err = capfd.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "config.json" in err, err
    assert _snapshot(dest) == before
    _no_leftovers(dest.parent, "model")


def test_the_cli_in_its_own_process_prints_one_line(made: SimpleNamespace, dest: Path, tmp_path: Path) -> None:
    """A real ``uniap export`` process (nothing captured or patched): the linked /etc/passwd and ``Trainer``."""
    before = _snapshot(dest)
    for case in ("symlink_to_etc_passwd", "architectures_Trainer"):
        folder = _bad_folder(tmp_path, made, case)
        run = subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", "export", str(made.ck), str(dest),
                              "--format", "hf", "--hf-config", str(folder)], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 2, run.stderr
        assert run.stderr.startswith("error: config.json ") and len(run.stderr.splitlines()) == 1, run.stderr
        assert "Traceback" not in run.stderr and "root:" not in run.stderr and run.stdout == ""
    assert _snapshot(dest) == before
    _no_leftovers(dest.parent, "model")


def test_the_good_config_exports_and_links_inside_are_followed(made: SimpleNamespace, tmp_path: Path) -> None:
    """The checks refuse only what is wrong: the model's own config.json exports (and loads), and so do a link
    inside its folder and the Hugging Face Hub cache's link from a snapshot to its blob."""
    import transformers as tr

    hub = tmp_path / "models--tiny" / "snapshots" / "abc123"
    hub.mkdir(parents=True)
    (tmp_path / "models--tiny" / "blobs").mkdir()
    (tmp_path / "models--tiny" / "blobs" / "f00d").write_bytes((made.good / "config.json").read_bytes())
    (hub / "config.json").symlink_to(Path("../../blobs/f00d"))
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "real.json").write_bytes((made.good / "config.json").read_bytes())
    (inside / "config.json").symlink_to("real.json")
    for i, folder in enumerate((made.good, hub, inside)):
        out = tmp_path / "exports" / f"e{i}"
        out.parent.mkdir(exist_ok=True)
        consolidate_checkpoint(made.ck, out, format="hf", hf_config=folder)
        loaded = tr.GPT2LMHeadModel.from_pretrained(out)
        for k, v in made.module.model.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0, msg=k)
    _no_leftovers(tmp_path / "exports", "e0", "e1", "e2")


def test_only_model_classes_of_the_model_type_are_reachable() -> None:
    import transformers as tr

    allowed = export.model_classes_for("gpt2")
    assert {"GPT2LMHeadModel", "GPT2Model", "GPT2ForSequenceClassification"} <= allowed
    assert not allowed & {"Trainer", "TrainingArguments", "__class__", "LlamaForCausalLM", "AutoModel"}
    assert export.model_classes_for(None) == set() and export.model_classes_for("no_such_model") == set()
    assert all(issubclass(getattr(tr, n), tr.PreTrainedModel) for n in sorted(allowed))


def test_sizes_accept_per_stage_lists_and_refuse_bad_entries() -> None:
    """Swin's ``num_heads`` is one size per stage: accepted; a bad entry or an endless list is not."""
    export.check_config_sizes({"num_heads": [2, 4], "hidden_size": 32, "head_dim": None}, "c")
    for value in ([2, -4], [1] * (export.MAX_STAGES + 1), [], [True], "32", 0, export.MAX_CONFIG_SIZE + 1):
        with pytest.raises(UniAPError, match="^c: num_heads must be a positive integer"):
            export.check_config_sizes({"num_heads": value}, "c")


# ---------------------------------------------------------------------------------------------- unwritable places
def _hf_offline(made: SimpleNamespace, path: Path) -> None:
    consolidate_checkpoint(made.ck, path, format="hf", hf_config=made.good)


def _hf_live(made: SimpleNamespace, path: Path) -> None:
    save_consolidated(made.module, path, rank=0, format="hf")


def _hf_strategy(made: SimpleNamespace, path: Path) -> None:
    """``UniAPStrategy.save_consolidated`` on one process (rank 0, broadcast is the identity)."""
    me = SimpleNamespace(global_rank=0, broadcast=lambda obj: obj, lightning_module=made.module)
    CheckpointIO.save_consolidated(me, path, format="hf")  # type: ignore[arg-type]


def _safetensors_live(made: SimpleNamespace, path: Path) -> None:
    save_consolidated(made.module, path.with_suffix(".safetensors"), rank=0)


def _torch_offline(made: SimpleNamespace, path: Path) -> None:
    consolidate_checkpoint(made.ck, path.with_suffix(".pt"), format="torch")


def _safetensors_strategy(made: SimpleNamespace, path: Path) -> None:
    me = SimpleNamespace(global_rank=0, broadcast=lambda obj: obj, lightning_module=made.module)
    CheckpointIO.save_consolidated(me, path.with_suffix(".safetensors"))  # type: ignore[arg-type]


WRITERS = {"hf_offline": _hf_offline, "hf_live": _hf_live, "hf_strategy": _hf_strategy,
           "safetensors_live": _safetensors_live, "torch_offline": _torch_offline,
           "safetensors_strategy": _safetensors_strategy}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_path_below_a_file_or_in_a_missing_folder_is_refused(writer: str, made: SimpleNamespace,
                                                               tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("keep")
    for path, needle in ((tmp_path / "afile" / "model", "afile"), (tmp_path / "missing" / "model", "missing")):
        with pytest.raises(UniAPError) as caught:
            WRITERS[writer](made, path)
        _one_line(caught.value, needle)
    assert (tmp_path / "afile").read_text() == "keep"
    _no_leftovers(tmp_path, "afile")


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_an_immutable_folder_is_refused(writer: str, made: SimpleNamespace, tmp_path: Path) -> None:
    folder = tmp_path / "locked"
    folder.mkdir()
    with _immutable(folder):
        with pytest.raises(UniAPError) as caught:
            WRITERS[writer](made, folder / "model")
        _one_line(caught.value, "locked", "not writable")
    _no_leftovers(folder)


@pytest.mark.parametrize("writer", ["hf_offline", "hf_live", "hf_strategy"])
def test_hf_export_over_a_file_or_an_immutable_earlier_export_is_refused(writer: str, made: SimpleNamespace,
                                                                        dest: Path, tmp_path: Path) -> None:
    (tmp_path / "out" / "file").write_text("keep")
    with pytest.raises(UniAPError) as caught:
        WRITERS[writer](made, tmp_path / "out" / "file")
    _one_line(caught.value, "exists and is not a folder")
    before = _snapshot(dest)
    with _immutable(dest):
        with pytest.raises(UniAPError) as caught:
            WRITERS[writer](made, dest)
        _one_line(caught.value, "cannot be replaced")
    assert _snapshot(dest) == before and (tmp_path / "out" / "file").read_text() == "keep"
    _no_leftovers(tmp_path / "out", "model", "file")


def test_the_cli_refuses_an_unwritable_destination_before_reading(made: SimpleNamespace, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("keep")

    def never(*args: Any, **kw: Any) -> None:
        raise AssertionError("the checkpoint was read before the destination was checked")

    monkeypatch.setattr("uniap_lightning.runtime.checkpoint.consolidate_checkpoint", never)
    for fmt in ("hf", "safetensors", "torch"):
        code = cli_export.main([str(made.ck), str(tmp_path / "afile" / "model"), "--format", fmt,
                                "--hf-config", str(made.good)] if fmt == "hf" else
                               [str(made.ck), str(tmp_path / "afile" / "model"), "--format", fmt])
        err = capfd.readouterr().err
        assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1 and "afile" in err, err
    _no_leftovers(tmp_path, "afile")


@pytest.mark.parametrize("rank", [0, 1])
def test_the_strategy_refuses_on_every_rank_before_gathering(rank: int, made: SimpleNamespace, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 checks the destination and broadcasts its verdict: every rank raises the same line, and none enters
    the gather (which would wait forever for a rank that has left)."""
    (tmp_path / "afile").write_text("keep")
    verdict = "Hugging Face folder 'x': the folder 'y' is not writable (read-only or immutable)"
    sent: list[Any] = []

    def broadcast(obj: Any) -> Any:  # rank 0 sends its own verdict; rank 1 receives rank 0's
        sent.append(obj)
        return obj if rank == 0 else verdict

    def never(*args: Any, **kw: Any) -> None:
        raise AssertionError("the weights were gathered for a destination that cannot be written")

    monkeypatch.setattr("uniap_lightning.runtime.checkpoint.save_consolidated", never)
    me = SimpleNamespace(global_rank=rank, broadcast=broadcast, lightning_module=made.module)
    with pytest.raises(UniAPError) as caught:
        CheckpointIO.save_consolidated(me, tmp_path / "afile" / "model", format="hf")  # type: ignore[arg-type]
    text = _one_line(caught.value)
    if rank == 0:
        assert sent == [text] and "afile" in text
    else:
        assert sent == [None] and text == verdict  # rank 1 did not check on its own
    _no_leftovers(tmp_path, "afile")


# ---------------------------------------------------------------------------------------------- failures mid-write
def test_a_write_that_fails_after_the_checks_leaves_nothing(made: SimpleNamespace, dest: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder turns unwritable after the checks (simulated by skipping them): the real OSError of the write is
    one UniAPError, for the folder and for a file."""
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(export, "check_destination", lambda path, fmt: Path(path))
    with _immutable(locked):
        for path, fmt in ((locked / "model", "hf"), (locked / "w.safetensors", None), (locked / "w.pt", None)):
            with pytest.raises(UniAPError) as caught:
                save_consolidated(made.module, path, rank=0, format=fmt)
            _one_line(caught.value, "cannot be written", "locked")
    _no_leftovers(locked)


@pytest.mark.parametrize("failure", [PermissionError(13, "Permission denied"), KeyboardInterrupt(), SystemExit(1)])
def test_the_temporary_folder_is_removed_on_any_failure(failure: BaseException, made: SimpleNamespace, dest: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure or an interrupt when the new folder is complete (the last step, the rename): the earlier export
    stays, the temporary folder is gone; an OSError becomes one UniAPError, an interrupt stays an interrupt."""
    seen: list[Path] = []

    def fail(tmp: Path, final: Path) -> None:
        seen.append(tmp)
        assert sorted(p.name for p in tmp.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
        raise failure

    monkeypatch.setattr(export, "_publish_folder", fail)
    before = _snapshot(dest)
    expected = UniAPError if isinstance(failure, OSError) else type(failure)
    with pytest.raises(expected) as caught:
        _hf_live(made, dest)
    if expected is UniAPError:
        _one_line(caught.value, "cannot be written", "Permission denied")
    assert len(seen) == 1 and seen[0].parent == dest.parent and not seen[0].exists()
    assert _snapshot(dest) == before
    _no_leftovers(dest.parent, "model")


def test_a_failed_rename_puts_the_earlier_export_back(made: SimpleNamespace, dest: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.replace
    calls: list[tuple[str, str]] = []

    def replace(src: Any, dst: Any) -> None:
        calls.append((Path(src).name, Path(dst).name))
        if Path(dst) == dest and Path(src).name.endswith(".partial"):
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    before = _snapshot(dest)
    with pytest.raises(UniAPError) as caught:
        _hf_live(made, dest)
    _one_line(caught.value, "No space left on device")
    assert len(calls) == 3  # aside, the failed rename, back
    assert _snapshot(dest) == before
    _no_leftovers(dest.parent, "model")
