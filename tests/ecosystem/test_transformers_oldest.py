"""The Hugging Face parity tests against the OLDEST supported transformers release (``compat.OLDEST``, 4.57), next to
the newest one the default run uses: the release is installed side by side with ``pip install --target`` into
``~/.cache/uniap/transformers-<release>`` (reused while it imports; a broken one is deleted and rebuilt; the venv's
torch and numpy are used, not copies) and a fresh interpreter runs with ``PYTHONPATH`` pointing at it.

The subset run on the oldest release (1.5-2 minutes on 2 shared CPU cores, the install included):

* ``tests/runtime/test_compat.py``: every version gate's branch on that release;
* ``tests/runtime/test_adapters.py``: the GPT-2 / Llama chains of ``adapters/hf.py`` (2-rank parity included);
* ``tests/runtime/test_hf_families.py``: the chain's loss and gradients equal the model's for every head of BERT,
  GPT-2 and Llama and for T5, ViT and Swin; padded micro-batches; prediction without labels; structural runs of
  T5 and Swin; and the 2-rank spawn group ``HEADS_TWO_RANKS`` (Llama sequence classification over 2 pipeline
  stages, BERT token classification under FSDP, BERT multiple choice over 2 stages with its export loaded back,
  GPT-2 question answering data parallel) and ``ON_4X_TWO_RANKS`` (T5 over 2 stages with its export, a solved
  Swin plan, Llama tensor parallel + FSDP, GPT-2 with its tied LM head data parallel, ViT over 2 stages), each
  matching one process within 1e-5;
* ``tests/runtime/test_hf_generic.py``: the generic split's loss and gradients for the decoder families OPT,
  Mistral, Qwen2, GPT-NeoX, Phi, Gemma, Bloom and Gemma 3 and two of their other heads (Qwen2 token
  classification, Mistral question answering).
* ``tests/runtime/test_expert_plans.py``: the load-balancing loss of ``output_router_logits=True`` rebuilt by the
  generic split (4.57 keeps the counts per top-k slot, the same value): Mixtral's loss and gradients; 4.57's
  Qwen2-MoE and OLMoE, which the generic split trains as one layer there, refused with that reason.

Not on the oldest release: tensor parallelism of BERT, T5, ViT and Swin (their 4.x attentions reshape with a fixed
number of heads, so the families offer no tensor-parallel plan there) and the generic split of the 4.x encoders
(RoBERTa, ELECTRA, DistilBERT), Falcon and the image / audio encoders, which build their masks outside
``masking_utils`` on 4.x and train as one layer there.

Without PyPI (no network, no index) the test is skipped with the reason; CI has PyPI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")  # the [hf] extra
from uniap_lightning.adapters.families.compat import OLDEST  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TARGET = Path.home() / ".cache" / "uniap" / f"transformers-{OLDEST}"
#: what ``pip install --target`` brings that the venv already has and must not be shadowed by a copy
VENV_OWNED = ("torch", "numpy", "nvidia", "triton", "functorch", "torchgen", "sympy", "mpmath", "networkx",
              "jinja2", "markupsafe")
#: pip's words for an index it cannot reach
OFFLINE = re.compile(r"NewConnectionError|Failed to establish a new connection|Temporary failure in name resolution|"
                     r"Network is unreachable|No matching distribution found|Could not find a version|"
                     r"ConnectTimeout|ReadTimeout|ProxyError|SSLError", re.I)

TESTS = [
    "tests/runtime/test_compat.py",
    "tests/runtime/test_adapters.py",
    *[f"tests/runtime/test_hf_families.py::{t}" for t in (
        "test_every_head_gives_the_models_own_loss_and_gradients",
        "test_encoder_decoder_and_vision_give_the_models_own_loss_and_gradients",
        "test_padded_micro_batches_give_the_whole_batch_loss",
        "test_batches_without_labels_predict_but_do_not_train",
        "test_decoder_classifiers_pool_the_last_real_token_with_left_padding_too",
        "test_runs_of_identical_layers_come_from_structural_identity",
        "test_hf_heads_two_ranks",
        "test_hf_families_two_ranks_on_4x")],
    *[f"tests/runtime/test_hf_generic.py::test_generic_chain_gives_the_models_own_loss_and_gradients[{f}]"
      for f in ("opt", "mistral", "qwen2", "gpt_neox", "phi", "gemma", "bloom", "gemma3", "qwen2_tc", "mistral_qa")],
    *[f"tests/runtime/test_expert_plans.py::{t}" for t in (
        "test_the_generic_split_rebuilds_the_router_loss_of_hugging_face_moe",
        "test_a_loss_term_the_split_cannot_rebuild_is_refused_with_that_reason")],
]


def _version_at(target: Path) -> str | None:
    """The transformers release a fresh interpreter imports from ``target``; ``None`` when it does not import."""
    probe = "import transformers; print(transformers.__version__, transformers.__file__)"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "PYTHONPATH": str(target)})
    if res.returncode != 0 or not res.stdout.strip():
        return None
    version, path = res.stdout.split()
    return version if Path(path).resolve().is_relative_to(target.resolve()) else None


def _install(target: Path) -> None:
    """``transformers==OLDEST.*`` and its dependencies into ``target``, built in a temporary folder beside it and
    renamed into place (a crash leaves no half-installed cache; a concurrent run's finished one is kept)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        res = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
                              "--target", str(build), f"transformers=={OLDEST}.*"],
                             capture_output=True, text=True, timeout=900, check=False)
        if res.returncode != 0:
            if OFFLINE.search(res.stdout + res.stderr):
                pytest.skip(f"cannot install transformers=={OLDEST}.* from the package index (offline?): "
                            f"{(res.stderr or res.stdout).strip().splitlines()[-1]}")
            raise AssertionError(f"pip install transformers=={OLDEST}.* failed:\n{res.stdout[-3000:]}"
                                 f"{res.stderr[-3000:]}")
        for entry in build.iterdir():  # the venv's torch / numpy, not the copies pip resolved as dependencies
            name = entry.name.split("-")[0].split(".")[0].lower()  # numpy-2.4.6.dist-info, numpy.libs: numpy
            if name in VENV_OWNED or entry.name == "bin":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        try:
            build.rename(target)
        except OSError:  # another run renamed its install into place first
            if _version_at(target) is None:
                raise
    finally:
        shutil.rmtree(build, ignore_errors=True)


def oldest_transformers() -> Path:
    """The side-by-side install of the oldest supported release: the cached one while it imports as that release,
    else a fresh one (a broken or other-version cache deleted first)."""
    version = _version_at(TARGET) if TARGET.exists() else None
    if version is not None and version.startswith(f"{OLDEST}."):
        return TARGET
    if TARGET.exists():
        shutil.rmtree(TARGET)
    _install(TARGET)
    version = _version_at(TARGET)
    assert version is not None and version.startswith(f"{OLDEST}."), (version, TARGET)
    return TARGET


def test_hf_parity_on_the_oldest_supported_transformers(tmp_path: Path) -> None:
    target = oldest_transformers()
    # the interpreter that runs the tests asserts which transformers it imported before pytest starts
    script = ("import sys, transformers, pytest\n"
              f"assert transformers.__version__.startswith({OLDEST + '.'!r}), transformers.__file__\n"
              "print('transformers', transformers.__version__, 'from', transformers.__file__, flush=True)\n"
              "sys.exit(pytest.main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-c", script, "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          "-m", "not slow", "--timeout=600", "--basetemp", str(tmp_path / "pytest"), *TESTS],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200, check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert re.search(rf"^transformers {re.escape(OLDEST)}\.\d+ from {re.escape(str(target))}", out, re.M), out[-3000:]
    summary = re.search(r"(\d+) passed", out)
    assert summary and int(summary.group(1)) >= 50 and not re.search(r"\d+ (failed|skipped|error)", out), out[-3000:]
