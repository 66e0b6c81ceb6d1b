"""A mistyped key (issue 42 item 4): every `uniap` command answers with the nearest key it has ("did you mean
batch_size?") and never with a ``+key=...`` form to add the misspelling; a ``+key`` that nearly names a field of a
closed schema (model, cluster, training config, data settings) is refused the same way, not accepted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from uniap_lightning.errors import UniAPError


def _refusal(command: str, *args: str) -> str:
    from uniap_lightning.cli.overrides import check_command_line

    with pytest.raises(UniAPError) as err:
        check_command_line(command, list(args))
    message = str(err.value)
    assert "\n" not in message
    assert "use +" not in message and "=+" not in message, message  # no `+` form for a key nothing would read
    return message


@pytest.mark.parametrize(("command", "args", "hint"), [
    ("plan", ["batch_sise=8"], "did you mean batch_size?"),
    ("plan", ["+batch_sise=8"], "did you mean batch_size?"),
    ("evaluate", ["batch_sise=8"], "did you mean batch_size?"),
    ("explain", ["time_limt=5"], "did you mean time_limit?"),
    ("plan", ["model.layer=4"], "model.layer=4: the model config has no field 'layer' (did you mean model.layers?)"),
    ("plan", ["+model.layer=4"], "model.layer=4: the model config has no field 'layer' (did you mean model.layers?)"),
    ("explain", ["model.hiden=64"], "(did you mean model.hidden?)"),
    ("evaluate", ["+model.hiden=64"], "(did you mean model.hidden?)"),
    ("plan", ["cluster.num_node=2"], "the cluster config has no field 'num_node' (did you mean cluster.nodes?)"),
    ("plan", ["+cluster.num_node=2"], "(did you mean cluster.nodes?)"),
    ("plan", ["train.global_batch_sise=8"], "(did you mean train.global_batch_size?)"),
    ("plan", ["+train.global_batch_sise=8"], "(did you mean train.global_batch_size?)"),
    ("plan", ["-m", "model=tiny_gpt", "model.layer=2,3"], "(did you mean model.layers?)"),  # a sweep's values
    ("plan", ["-m", "batch_sise=8,16"], "did you mean batch_size?"),
    ("train", ["lr_=0.1"], "did you mean lr?"),
    ("train", ["model.layer=2"], "(did you mean model.layers?)"),
    ("train", ["+model.layer=2"], "(did you mean model.layers?)"),
    ("train", ["data.batch_sise=8"], "`uniap train` has no data setting 'batch_sise' (did you mean data.batch_size?)"),
    ("train", ["+data.batch_sise=8"], "(did you mean data.batch_size?)"),
    ("train", ["trainer.max_step=3"], "Lightning's Trainer has no argument 'max_step' (did you mean trainer.max_steps?)"),
    ("train", ["trainer.gradient_clip_vall=1"], "(did you mean trainer.gradient_clip_val?)"),  # an unlisted argument
    ("train", ["strategy.time_limt=5"], "(did you mean strategy.time_limit?)"),
    ("train", ["-m", "data.batch_sise=8,16"], "(did you mean data.batch_size?)"),
])
def test_a_near_miss_names_the_key_it_is_close_to(command: str, args: list[str], hint: str) -> None:
    message = _refusal(command, *args)
    assert hint in message, message


@pytest.mark.parametrize(("command", "args", "message"), [
    ("plan", ["model.frobnicate=1"], "model.frobnicate=1: the model config has no field 'frobnicate'; its fields: "),
    ("plan", ["+cluster.frobnicate=1"], "the cluster config has no field 'frobnicate'; its fields: "),
    ("train", ["data.frobnicate=1"], "`uniap train` has no data setting 'frobnicate'; its data settings: name, "),
])
def test_a_key_far_from_every_field_is_refused_with_the_fields(command: str, args: list[str], message: str) -> None:
    assert message in _refusal(command, *args)


def test_a_real_field_the_config_does_not_list_is_still_added_with_plus() -> None:
    from uniap_lightning.cli.overrides import check_command_line

    with pytest.raises(UniAPError, match=r"use \+trainer.gradient_clip_val=1.0 to add a key"):
        check_command_line("train", ["trainer.gradient_clip_val=1.0"])
    with pytest.raises(UniAPError, match=r"use \+model.kv_heads=4 to add a key"):
        check_command_line("plan", ["model=gpt2_small", "model.kv_heads=4"])
    for command, args in (("train", ["+trainer.gradient_clip_val=1.0", "+model.kv_heads=4"]),
                          ("plan", ["model=gpt2_small", "+model.kv_heads=4", "+train.virtual_stages=2"])):
        assert check_command_line(command, args) == args


def test_the_command_line_says_did_you_mean(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", "plan", "model=tiny_gpt", "+model.layer=2"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False,
                         env={**os.environ, "COLUMNS": "300"})
    assert res.returncode == 2
    assert res.stderr.strip() == ("error: model.layer=2: the model config has no field 'layer' (did you mean "
                                  "model.layers?)"), res.stderr
