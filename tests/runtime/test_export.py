"""Full weights for other programs (issue 21): ``strategy.save_consolidated(path, format=...)`` writes a safetensors
file (default), a torch file or a Hugging Face folder that ``from_pretrained`` loads with the trained weights; the
offline ``consolidate_checkpoint`` and ``uniap export`` do the same from a checkpoint folder; and a run started from
``from_pretrained`` on an exported folder trains like one process started from it."""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

import uniap_rt_helpers as h

pytest.importorskip("transformers")
from hf_models import hf_batches, hf_module  # noqa: E402

from uniap_lightning.errors import UniAPError  # noqa: E402
from uniap_lightning.runtime import export  # noqa: E402

OUT = Path(tempfile.mkdtemp(prefix="uniap_export_"))
atexit.register(shutil.rmtree, OUT, ignore_errors=True)
ONE, FSDP = (1, 1, False), (2, 1, True)
NAMES = ["model.transformer.wte", "model.transformer.h.0", "model.transformer.h.1", "model.transformer.ln_f"]
LLAMA = ["model.model.embed_tokens", "model.model.layers.0", "model.model.layers.1", "model.model.norm"]


def _case(family: str, strategies: list[Any], stages: list[int], names: list[str], **kw: Any) -> dict[str, Any]:
    plan = h.make_plan(strategies, stages, names=names, pp=max(stages) + 1, world=2, microbatches=2, schedule="1f1b")
    return {"plan": plan, "module": {"factory": "hf_models:hf_module", "family": family, "lr": 0.1},
            "data": {"factory": "hf_models:hf_batches", "family": family}, "steps": 3, **kw}


TRAIN = {
    # the LM head tied to the token embedding: trained as two copies, written once
    "gpt2_tied_pp2": _case("gpt2_tied", [ONE] * 4, [0, 0, 1, 1], NAMES, export=str(OUT / "gpt2_hf"),
                           export_format="hf", save=str(OUT / "gpt2.ckpt")),
    "llama_fsdp": _case("llama", [FSDP] * 4, [0] * 4, LLAMA, export=str(OUT / "llama.safetensors")),
}
#: a second job: the model starts from the first job's exported folder (from_pretrained), under another plan
RESTART = {
    "gpt2_from_pretrained_fsdp": {
        "plan": h.make_plan([FSDP] * 4, [0] * 4, names=NAMES, pp=1, world=2, microbatches=2, schedule="1f1b"),
        "module": {"factory": "hf_export_models:pretrained_module", "path": str(OUT / "gpt2_hf"), "lr": 0.1},
        "data": {"factory": "hf_models:hf_batches", "family": "gpt2_tied", "seed": 2}, "steps": 2},
}


def _trained(spawn_cases: Any, name: str) -> dict[str, torch.Tensor]:
    results = spawn_cases(2, TRAIN, "export_train")
    h.assert_close_to_reference(results, name, h.reference_for(TRAIN[name]))
    return h.reference_for(TRAIN[name])["state"]


def test_hf_folder_loads_with_from_pretrained(spawn_cases: Any) -> None:
    import transformers as tr

    ref = _trained(spawn_cases, "gpt2_tied_pp2")
    folder = OUT / "gpt2_hf"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    loaded, info = tr.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, ref[f"model.{k}"], rtol=1e-5, atol=1e-6, msg=k)
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # the tied copy once, as save_pretrained writes it
        assert f.metadata() == {"format": "pt"}


def test_default_format_is_safetensors(spawn_cases: Any) -> None:
    from safetensors.torch import load_file

    ref = _trained(spawn_cases, "llama_fsdp")
    weights = load_file(OUT / "llama.safetensors")
    assert set(weights) == set(ref)
    for k, v in ref.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_offline_export_of_a_checkpoint_folder_and_the_cli(spawn_cases: Any, tmp_path: Path) -> None:
    import transformers as tr

    from uniap_lightning.runtime.checkpoint import consolidate_checkpoint

    ref = _trained(spawn_cases, "gpt2_tied_pp2")
    with pytest.raises(UniAPError, match="format='hf' needs hf_config"):
        consolidate_checkpoint(OUT / "gpt2.ckpt", tmp_path / "x", format="hf")
    consolidate_checkpoint(OUT / "gpt2.ckpt", tmp_path / "offline", format="hf", hf_config=OUT / "gpt2_hf")
    cli = subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", "export", str(OUT / "gpt2.ckpt"),
                          str(tmp_path / "cli"), "--format", "hf", "--hf-config", str(OUT / "gpt2_hf")],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    for folder in ("offline", "cli"):
        loaded = tr.AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        for k, v in loaded.state_dict().items():
            torch.testing.assert_close(v, ref[f"model.{k}"], rtol=1e-5, atol=1e-6, msg=f"{folder}: {k}")
    bad = subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", "export", str(tmp_path / "nothing"),
                          str(tmp_path / "y.safetensors")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and len(bad.stderr.strip().splitlines()) == 1


def test_a_run_starts_from_an_exported_folder(spawn_cases: Any) -> None:
    _trained(spawn_cases, "gpt2_tied_pp2")  # the folder exists
    results = spawn_cases(2, RESTART, "export_restart")
    name = "gpt2_from_pretrained_fsdp"
    ref = h.reference_for(RESTART[name])
    h.assert_close_to_reference(results, name, ref)
    # it started from the trained weights: the first loss is the exported model's own on the first batch
    import transformers as tr

    model = tr.AutoModelForCausalLM.from_pretrained(OUT / "gpt2_hf")
    batch = next(iter(hf_batches(16, "gpt2_tied", seed=2)))
    assert results[0][name]["losses"][0] == pytest.approx(float(model(**batch).loss), rel=1e-5)


# ---------------------------------------------------------------------------------------------- one process
def test_format_from_the_name() -> None:
    assert export.resolve_format("w.safetensors", None) == "safetensors"
    assert export.resolve_format("w", None) == "safetensors"
    assert [export.resolve_format(f"w{s}", None) for s in (".pt", ".PTH", ".bin", ".ckpt")] == ["torch"] * 4
    assert export.resolve_format("w.pt", "safetensors") == "safetensors"
    with pytest.raises(UniAPError, match="format must be one of safetensors, torch, hf, got 'onnx'"):
        export.resolve_format("w", "onnx")


def test_hf_export_in_one_process_and_what_it_refuses(tmp_path: Path) -> None:
    import transformers as tr

    from uniap_lightning.runtime.checkpoint import save_consolidated

    module = hf_module("llama")
    save_consolidated(module, tmp_path / "llama", rank=0, format="hf")
    loaded = tr.LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    for k, v in module.model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0, msg=k)
    save_consolidated(module, tmp_path / "llama", rank=0, format="hf")  # an earlier export is replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UniAPError, match="holds files an export does not write \\(notes.txt\\): not replaced"):
        save_consolidated(module, tmp_path / "mine", rank=0, format="hf")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(UniAPError, match="needs a Hugging Face model .* inside Linear"):
        save_consolidated(torch.nn.Linear(2, 2), tmp_path / "lin", rank=0, format="hf")
    other = hf_module("gpt2").state_dict()
    with pytest.raises(UniAPError, match="do not hold this model's .* under any prefix"):
        export.hf_weights(tr.LlamaForCausalLM, module.model.config, other)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no partial folder left behind
