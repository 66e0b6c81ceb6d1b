"""Hostile files as inputs, outputs and cache entries: devices, FIFOs, symbolic links, oversized files, deeply
nested or huge-integer JSON, YAML alias bombs, and values of the wrong JSON type. Each is one clear UniAPError
(one ``error:`` line from the CLI), a warning and a rebuild (cache entries), or written through (links) - never a
hang, a traceback or a replaced device."""

from __future__ import annotations

import copy
import json
import os
import random
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import (
    MAX_DOCUMENT_BYTES,
    check_output_file,
    check_output_folder,
    read_json,
    read_text,
    write_text_atomic,
)
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.config import cluster_from
from uniap_lightning.profiling.pricing import build_problem
from uniap_lightning.planner.plan import Plan
from uniap_lightning.planner.profile import ModelProfile, load_profile

DEV_FULL = Path("/dev/full")
needs_dev_full = pytest.mark.skipif(not DEV_FULL.exists(), reason="no /dev/full here")
#: a safety net only: every case below must answer at once; a regression that blocks fails instead of hanging
quick = pytest.mark.timeout(60)

ALIAS_BOMB = "name: bomb\na: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
DEEP_JSON = "[" * 100_000 + "]" * 100_000


def _is_char_device(path: Path) -> bool:
    return stat.S_ISCHR(os.stat(path).st_mode)


def _fifo(tmp_path: Path, name: str = "fifo.json") -> Path:
    path = tmp_path / name
    os.mkfifo(path)
    return path


# ================================================================================ outputs
@needs_dev_full
def test_dev_full_as_output_is_refused_and_not_replaced() -> None:
    for call in (lambda: write_text_atomic(DEV_FULL, "x"), lambda: check_output_file(DEV_FULL, "out=")):
        with pytest.raises(UniAPError, match=r"'/dev/full' is not a regular file \(a character device\); give a "
                                             "file name"):
            call()
        assert _is_char_device(DEV_FULL)


@quick
def test_fifo_socket_and_folder_outputs_are_refused_and_kept(tmp_path: Path) -> None:
    import socket

    fifo = _fifo(tmp_path)
    sock_path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        for path, kind in ((fifo, "a FIFO"), (sock_path, "a socket")):
            for call in (lambda: write_text_atomic(path, "x"), lambda: check_output_file(path, "out=")):
                with pytest.raises(UniAPError, match=f"is not a regular file \\({kind}\\)"):
                    call()
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    with pytest.raises(UniAPError, match="is a folder; give a file name"):
        write_text_atomic(tmp_path, "x")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind


def test_a_symlink_under_an_output_name_is_replaced_never_written_through(tmp_path: Path) -> None:
    target = tmp_path / "real" / "plan.json"
    target.parent.mkdir()
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert check_output_file(link, "out=") == link
    write_text_atomic(link, "new")
    assert not link.is_symlink() and link.read_text() == "new"  # the link itself was replaced by our file
    assert target.read_text() == "old" and stat.S_IMODE(os.stat(target).st_mode) == 0o640  # the target untouched


def test_a_hard_link_under_an_output_name_keeps_its_other_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    entry = tmp_path / "plan.json"
    os.link(victim, entry)
    write_text_atomic(entry, "{}")
    assert entry.read_text() == "{}" and victim.read_text() == "precious"
    assert os.stat(victim).st_nlink == 1 and os.stat(entry).st_ino != os.stat(victim).st_ino


def test_a_new_file_gets_the_umask_mode_not_0600(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "out.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "out.json").st_mode) == 0o640


@needs_dev_full
def test_dangling_links_and_links_to_non_files_are_replaced_as_links(tmp_path: Path) -> None:
    dangling, to_fifo, to_dev = tmp_path / "dangling.json", tmp_path / "to_fifo.json", tmp_path / "to_dev.json"
    dangling.symlink_to(tmp_path / "nowhere" / "x.json")
    fifo = _fifo(tmp_path)
    to_fifo.symlink_to(fifo)
    to_dev.symlink_to(DEV_FULL)
    for link in (dangling, to_fifo, to_dev):
        assert check_output_file(link, "out=") == link
        write_text_atomic(link, "x")
        assert not link.is_symlink() and link.read_text() == "x"
    assert _is_char_device(DEV_FULL) and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert not (tmp_path / "nowhere").exists()


def test_a_write_into_a_missing_or_file_parent_is_one_line(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(UniAPError, match=r"cannot be written: a folder above it is a file"):
        write_text_atomic(afile / "x.json", "x")
    with pytest.raises(UniAPError, match=r"cannot be written in the folder .*missing.* \(No such file or directory\)"):
        write_text_atomic(tmp_path / "missing" / "x.json", "x")
    assert afile.read_text() == ""


def test_an_output_folder_must_be_a_folder_or_makeable(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("")
    assert check_output_folder(tmp_path / "new" / "deeper", "out=")
    assert check_output_folder(tmp_path, "out=")
    with pytest.raises(UniAPError, match=r"out='.*file' exists and is not a folder \(a file\); give a folder name"):
        check_output_folder(afile, "out=")
    with pytest.raises(UniAPError, match=r"out='.*file/sub': '.*file' is not a folder \(a file\)"):
        check_output_folder(afile / "sub", "out=")
    with pytest.raises(UniAPError, match=r"exists and is not a folder \(a FIFO\)"):
        check_output_folder(_fifo(tmp_path), "out=")


# ================================================================================ inputs
@quick
def test_a_fifo_input_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path)  # no writer: a blocking open would wait forever
    with pytest.raises(UniAPError, match=r"profile file '.*fifo.json' is a FIFO, not a file"):
        load_profile(fifo)
    with pytest.raises(UniAPError, match=r"plan file '.*fifo.json'.* is a FIFO, not a file"):
        Plan.from_json(fifo)
    yaml_fifo = _fifo(tmp_path, "cluster.yaml")
    with pytest.raises(UniAPError, match=r"cluster file '.*cluster.yaml' is a FIFO, not a file"):
        cluster_from(str(yaml_fifo))


@quick
def test_endless_devices_are_refused() -> None:
    for dev in ("/dev/zero", "/dev/urandom"):
        if Path(dev).exists():
            with pytest.raises(UniAPError, match="is a character device, not a file"):
                read_text(dev, "profile file")


@quick
def test_an_oversized_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_DOCUMENT_BYTES + 1)  # sparse: no disk used
    with pytest.raises(UniAPError, match=r"big.json' is 256.0 MiB; files over 256 MiB are not read"):
        read_json(big, "profile file")
    small = tmp_path / "small.json"
    small.write_text('{"a": 1}')
    assert read_json(small, "x") == {"a": 1}
    with pytest.raises(UniAPError, match="over 0 MiB|files over"):
        read_text(small, "x", limit_bytes=4)


# ================================================================================ JSON documents
@quick
@pytest.mark.parametrize(("text", "match"), [
    (DEEP_JSON, "nests lists / objects deeper than 64 levels"),
    ("[" * 65 + "]" * 65, "nests lists / objects 65 levels deep; at most 64 are read"),
    ('{"a": ' + "1" * 5000 + "}", "has an integer of 5000 digits; at most 64 are read"),
    ('{"a": -' + "7" * 400 + "}", "has an integer of 400 digits"),
], ids=["deep", "65-levels", "5000-digits", "400-digits"])
def test_hostile_json_is_one_clear_error(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "doc.json"
    path.write_text(text)
    for load in (lambda: read_json(path, "profile file"), lambda: load_profile(path), lambda: Plan.from_json(path),
                 lambda: Plan.from_json(text if len(text) >= 4096 else text + " " * 4096)):
        with pytest.raises(UniAPError, match=match):
            load()


def test_64_levels_still_load(tmp_path: Path) -> None:
    path = tmp_path / "doc.json"
    path.write_text("[" * 64 + "]" * 64)
    assert read_json(path, "x") == json.loads("[" * 64 + "]" * 64)


# ================================================================================ YAML documents
@quick
@pytest.mark.parametrize(("text", "match"), [
    (ALIAS_BOMB, "expands to more than 100,000 nodes once its aliases are followed"),
    ("name: x\n" + "a: " + "[" * 100_000 + "]" * 100_000 + "\n", "nests lists / mappings deeper than 64 levels"),
    ("name: x\na0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 100)),
     "deeper than 64 levels once its aliases are followed"),
    ("name: x\nloop: &r [*r]\n", "has an alias that refers to itself"),
    ("name: x\na: aaaaaaaaaa\n" + "".join(f"b{i}: '{('${b%d}' % (i - 1)) * 10}'\n" for i in range(1, 12))
     .replace("${b0}", "${a}"), "interpolations resolve to more than 16 MiB"),
    ("name: x\na: ${a}\n", "the interpolation at a refers to itself"),
    ("name: x\nb: ${name}\nnodes: " + "1" * 5000 + "\n", "is not valid YAML: Exceeds the limit"),
    ("name: x\nnodes: " + "1" * 400 + "\ndevices_per_node: 1\nmemory_gib: 1\npeak_tflops: 1\n",
     "devices; at most 16,777,216 are planned for"),
], ids=["alias-bomb", "deep", "alias-chain", "self-alias", "interpolation-bomb", "self-interpolation",
        "5000-digits", "400-digits"])
def test_hostile_yaml_is_refused_before_loading(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(UniAPError, match=f"cluster( file '.*cluster.yaml')?.*{match}"):
        cluster_from(str(path))


def test_yaml_with_ordinary_aliases_and_interpolations_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("base: &base {memory_gib: 16, speed: 1.0}\n"
                    "name: mixed\nnodes: 1\ndevices_per_node: 2\npeak_tflops: 10\n"
                    "device: ${name}-gpu\ncompute_model: flat\n"
                    "device_groups: [{<<: *base, name: a, count: 1}, {<<: *base, name: b, count: 1, speed: 0.5}]\n")
    from uniap_lightning.planner.config import load_group

    data = load_group("cluster", str(path))
    data.pop("base")
    cluster = Cluster.from_dict(data)
    assert cluster.device == "mixed-gpu" and cluster.rank_speed == (1.0, 0.5)


# ================================================================================ strict types
def _plan_doc() -> dict[str, Any]:
    from uniap_lightning.planner.solver import solve

    return solve(build_problem(model="tiny_gpt", cluster="local_cpu", global_batch_size=8), time_limit_s=30,
                 baselines=False).to_dict()


@pytest.fixture(scope="module")
def plan_doc() -> dict[str, Any]:
    return _plan_doc()


def _v1(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["format_version"] = 1
    doc.pop("compression_options", None)
    for layer in doc["layers"]:
        for key in ("dp_mode", "recompute", "compression"):
            layer.pop(key, None)
        layer["shard"] = False
    return doc


@pytest.mark.parametrize("shard", ["false", "true", 0, 1, None, []])
def test_a_v1_shard_must_be_a_json_boolean(plan_doc: dict[str, Any], tmp_path: Path, shard: Any) -> None:
    doc = _v1(plan_doc)
    doc["layers"][0]["shard"] = shard
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(doc))
    name = doc["layers"][0]["name"]
    with pytest.raises(UniAPError, match=rf"plan file '.*v1.json': plan layer 0 \({re.escape(name)}\): shard must be "
                                         r"true or false \(a JSON boolean\)"):
        Plan.from_json(path)
    doc["layers"][0]["shard"] = False
    assert Plan.from_dict(doc).layers[0].strategy.dp_mode == "replicate"


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d["layers"][0].update(dp=True), r"plan layer 0 \(.*\): dp must be an integer, got True"),
    (lambda d: d["layers"][0].update(dp="1"), r"dp must be an integer, got '1'"),
    (lambda d: d["layers"][0].update(dp=1.5), r"dp must be an integer, got 1.5"),
    (lambda d: d["layers"][0].update(dp=-1), r"dp must be >= 1, got -1"),
    (lambda d: d["layers"][0].update(dp=0), r"dp must be >= 1, got 0"),
    (lambda d: d["layers"][0].update(tp=10**400), r"tp is out of range \(got an integer of about 401 digits\)"),
    (lambda d: d["layers"][0].update(stage="0"), r"stage must be an integer"),
    (lambda d: d["layers"][0].update(recompute="false"), r"recompute must be true or false"),
    (lambda d: d["layers"][0].update(recompute=0), r"recompute must be true or false"),
    (lambda d: d["layers"][0].update(dp_mode=["zero3"]), r"dp_mode must be a string"),
    (lambda d: d["layers"][0].update(name=7), r"plan layer 0.name must be a string"),
    (lambda d: d.update(pp="1"), r"plan field 'pp' must be an integer"),
    (lambda d: d.update(num_devices=10**12), r"plan field 'num_devices' must be <= 2147483647"),
    (lambda d: d.update(global_batch_size=8.5), r"plan field 'global_batch_size' must be an integer"),
    (lambda d: d.update(schedule=1), r"plan field 'schedule' must be a string"),
    (lambda d: d.update(model=None), r"plan field 'model' must be a string"),
    (lambda d: d["stages"][0].update(ranks=["0"]), r"plan stages\[0\].ranks\[0\] must be an integer"),
    (lambda d: d["estimate"].update(feasible="true"), r"plan estimate.feasible must be true or false"),
    (lambda d: d["estimate"].update(tpi_s=float("nan")), r"plan estimate.tpi_s must be a finite number"),
    (lambda d: d["estimate"].update(stage_time_s=[]), r"plan estimate.stage_time_s must list \d+ numbers \(one per stage"),
    (lambda d: d["solver"].update(solved="3"), r"plan solver.solved must be an integer"),
    (lambda d: d.update(baselines={"ddp": "fast"}), r"plan baselines.ddp must be a number"),
    (lambda d: d.update(search=[{"pp": 1}]), r"plan search\[0\] is missing the field 'microbatches'"),
    (lambda d: d.update(search=[{"pp": 1, "microbatches": 1, "outcome": "feasible", "resolves": -1}]),
     r"plan search\[0\].resolves must be >= 0, got -1"),
    (lambda d: d.update(search=[{"pp": 1, "microbatches": 1, "outcome": "feasible", "resolves": "2"}]),
     r"plan search\[0\].resolves must be an integer"),
    (lambda d: d.update(compression_options={"powersgd_rank": True}), r"powersgd_rank must be an integer >= 1"),
])
def test_plan_fields_must_have_their_json_types(plan_doc: dict[str, Any], edit: Callable, match: str) -> None:
    doc = copy.deepcopy(plan_doc)
    edit(doc)
    with pytest.raises(UniAPError, match=match):
        Plan.from_dict(doc)


def test_integral_floats_and_every_current_field_still_load(plan_doc: dict[str, Any]) -> None:
    doc = copy.deepcopy(plan_doc)
    doc["layers"][0]["dp"] = float(doc["layers"][0]["dp"])
    doc["pp"] = float(doc["pp"])
    plan = Plan.from_dict(doc)
    assert isinstance(plan.layers[0].strategy.dp, int) and isinstance(plan.pp, int)
    assert Plan.from_json(Plan.from_dict(plan_doc).to_json()).to_dict() == Plan.from_dict(plan_doc).to_dict()


@pytest.mark.parametrize(("field", "value", "match"), [
    ("params", True, "params must be a finite number"),
    ("params", "10", "params must be a finite number"),
    ("forward_s", 10**400, "forward_s must be a finite number, got an integer of about 401 digits"),
    ("activation_bytes", 1e300, "activation_bytes must be a finite number"),
    ("tp_degrees", [1, True], "tp_degrees must be a non-empty list of positive integers"),
])
def test_profile_fields_must_have_their_json_types(field: str, value: Any, match: str) -> None:
    doc = build_problem(model="tiny_gpt", cluster="local_cpu", global_batch_size=8).model.to_dict()
    doc["layers"][1][field] = value
    with pytest.raises(UniAPError, match=rf"profile: layers\[1\]\.{match}"):
        ModelProfile.from_dict(doc)


# ================================================================================ sane ranges
@pytest.mark.parametrize(("field", "value", "match"), [
    # the hostile case: passed the 1e30 bound, and HiGHS failed with an InterfacingError on the program
    ("tp_allreduces", 10**18, r"tp_allreduces must be at most 1,000,000 \(all-reduces per pass\), got 1e\+18: no real "
                              r"layer comes near it; measure the profile again or fix the field$"),
    ("param_tensors", 10**7, r"param_tensors must be at most 1,000,000 \(tensors\)"),
    ("forward_s", 1e7, r"forward_s must be at most 1,000,000 \(seconds per sample\)"),
    ("activation_bytes", 1e20, r"activation_bytes must be at most 1,125,899,906,842,624 \(bytes per sample\)"),
    ("backward_peak_bytes", 1e25, r"backward_peak_bytes must be at most 1,125,899,906,842,624"),
    ("params", 10**14, r"params must be at most 10,000,000,000,000 \(parameters\)"),
    ("sequence_length", 10**12, r"sequence_length must be at most 1,000,000,000 \(tokens\)"),
    ("experts", 10**7, r"experts must be at most 1,000,000 \(experts\)"),
    ("backward_split_overhead", 1e9, r"backward_split_overhead must be at most 1,000 \(a ratio of times\)"),
    ("timings", [{"micro_batch": 1, "forward_s": 1e9, "backward_s": 0}],
     r"timings\[0\]\.forward_s must be at most 1,000,000 \(seconds per call\)"),
    ("overheads", [{"kind": "tp", "degree": 2, "micro_batch": 1, "seconds": -1e9}],
     r"overheads\[0\]\.seconds must be between -1,000,000 and 1,000,000"),
])
def test_profile_numbers_must_be_in_sane_ranges(tmp_path: Path, field: str, value: Any, match: str) -> None:
    doc = build_problem(model="tiny_gpt", cluster="local_cpu", global_batch_size=8).model.to_dict()
    doc["layers"][1][field] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UniAPError, match=rf"^profile file p\.json: layers\[1\]\.{match}") as err:
        load_profile(path)  # checked when the profile is read, before any program is built
    assert "\n" not in str(err.value)


def test_a_profile_at_its_bounds_is_solved_or_refused_as_infeasible(tmp_path: Path) -> None:
    """The bounds are ones the solver takes: a layer at every time and count bound is planned; at the byte and
    parameter bounds the plan is infeasible (a clear error), never a solver failure."""
    from uniap_lightning.planner import profile as P
    from uniap_lightning.planner.solver import solve

    base = build_problem(model="tiny_gpt", cluster="local_cpu", global_batch_size=8).model.to_dict()
    times = {"forward_s": P.MAX_PROFILE_SECONDS, "backward_s": P.MAX_PROFILE_SECONDS,
             "tp_allreduces": P.MAX_PROFILE_COUNT, "param_tensors": P.MAX_PROFILE_COUNT,
             "matrix_dims": P.MAX_PROFILE_PARAMS, "sequence_length": P.MAX_PROFILE_TOKENS,
             "backward_split_overhead": P.MAX_PROFILE_RATIO,
             "overheads": [{"kind": "tp", "degree": 2, "micro_batch": 1, "seconds": P.MAX_PROFILE_SECONDS}]}
    sizes = {"activation_bytes": P.MAX_PROFILE_BYTES, "backward_peak_bytes": P.MAX_PROFILE_BYTES,
             "params": P.MAX_PROFILE_PARAMS}
    for name, fields in (("times", times), ("sizes", sizes)):
        doc = copy.deepcopy(base)
        doc["layers"][1].update(fields)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(doc))
        problem = build_problem(model="tiny_gpt", cluster="local_cpu", global_batch_size=8, profile=str(path))
        if name == "times":
            assert solve(problem, time_limit_s=30, baselines=False).estimate.tpi_s > P.MAX_PROFILE_SECONDS
        else:
            with pytest.raises(UniAPError, match="no plan fits in memory"):
                solve(problem, time_limit_s=30, baselines=False)


def test_cli_refuses_a_profile_out_of_range(tmp_path: Path) -> None:
    doc = build_problem(model="tiny_gpt", cluster="local_cpu", global_batch_size=8).model.to_dict()
    for layer in doc["layers"]:
        layer["tp_allreduces"] = 10**18
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    _one_error_line(uniap("plan", *SMALL, f"profile={path}"),
                    "profile file p.json: layers[0].tp_allreduces must be at most 1,000,000 (all-reduces per pass)")


@pytest.mark.parametrize(("options", "match"), [
    # the hostile case: accepted, and `uniap evaluate` printed an iteration of 1e298 ms
    ({"powersgd_rank": 1e300}, r"plan compression_options\.powersgd_rank must be an integer >= 1 and at most 65,536 "
                               r"\(the rank of PowerSGD's low-rank gradient factors\), got 1e\+300$"),
    ({"powersgd_rank": 10**20}, r"plan compression_options\.powersgd_rank must be an integer >= 1 and at most 65,536"),
    ({"start_iter": 1e15}, r"plan compression_options\.start_iter must be an integer >= 0 and at most 1,000,000,000"),
])
def test_plan_compression_options_must_be_in_sane_ranges(plan_doc: dict[str, Any], tmp_path: Path,
                                                         options: dict[str, Any], match: str) -> None:
    doc = copy.deepcopy(plan_doc)
    doc["compression_options"] = options
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UniAPError, match=rf"^plan file '.*plan\.json': {match}") as err:
        Plan.from_json(path)
    assert "\n" not in str(err.value)
    doc["compression_options"] = {"powersgd_rank": 65_536, "start_iter": 1_000_000_000}
    Plan.from_dict(doc)  # the bounds themselves are taken


def test_evaluate_names_cp_when_it_does_not_divide_the_sequence(plan_doc: dict[str, Any], tmp_path: Path) -> None:
    """A plan splitting a layer's sequence over cp=2, scored with a profile whose sequence has 63 tokens: the refusal
    names cp and the sequence (it said "strategy dp=2 tp=1 is not allowed here")."""
    from uniap_lightning.planner.cost import evaluate

    doc = copy.deepcopy(plan_doc)
    assert doc["pp"] == 2 and doc["layers"][1]["dp"] == 2  # 2 devices a stage: dp 2 becomes cp 2
    doc["layers"][1].update(dp=1, cp=2, cp_method="ulysses", dp_mode="replicate")
    plan = Plan.from_dict(doc)
    evaluate(build_problem(model="tiny_gpt", cluster="local_cpu", global_batch_size=8), plan)  # 64 tokens: runs
    profile = build_problem(model="tiny_gpt", cluster="local_cpu", global_batch_size=8).model.to_dict()
    profile["layers"][1]["sequence_length"] = 63
    path = tmp_path / "p63.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(UniAPError) as err:
        evaluate(build_problem(model="tiny_gpt", cluster="local_cpu", global_batch_size=8, profile=str(path)), plan)
    assert str(err.value) == ("plan layer 1 (block0): strategy cp2u (dp=1 cp=2 tp=1) is not allowed here: cp=2 does "
                              "not divide the layer's sequence_length=63 in the profile")


@pytest.mark.parametrize("option", ["schedule=gpipe", "virtual_stages=2", "pp=2", "microbatches=[4]",
                                    "compression=powersgd"])
@pytest.mark.parametrize("command", ["evaluate", "explain"])
def test_evaluate_and_explain_refuse_search_options_next_to_a_plan(plan_doc: dict[str, Any], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str], command: str,
                                                                   option: str) -> None:
    """`uniap evaluate plan=p.json schedule=gpipe` scored the plan's own schedule without a word."""
    from uniap_lightning.cli import apps
    from uniap_lightning.cli.overrides import compose_checked

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_doc))
    cfg = compose_checked("plan", [f"plan={path}", *SMALL, option])
    with pytest.raises(SystemExit) as stop:
        {"evaluate": apps.run_evaluate, "explain": apps.run_explain}[command](cfg)
    assert stop.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    key = option.split("=")[0]
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}=") and \
        f"steers the planner's search, but plan={path} is scored as it is, with its own " in lines[0], lines


@pytest.mark.parametrize(("change", "match"), [
    ({"bandwidth_tables": {"intra": {"2": "100"}}}, r"bandwidth_tables.intra\[2\] must be a number"),
    ({"bandwidth_tables": {"intra": {"two": 100}}}, r"group sizes must be integers >= 2"),
    ({"bandwidth_tables": {"intra": {True: 100}}}, r"group sizes must be integers >= 2"),
    ({"rank_device": [1, 2]}, r"rank_device entries must be strings"),
    ({"device": ["gpu"]}, r"device must be a string"),
    ({"nodes": 10**9, "devices_per_node": 10**9}, r"at most 16,777,216 are planned for"),
    ({"nodes": "2"}, r"nodes must be a positive integer"),
])
def test_cluster_fields_must_have_their_types(change: dict[str, Any], match: str) -> None:
    doc = {"name": "c", "nodes": 1, "devices_per_node": 2, "memory_gib": 16, "peak_tflops": 10, **change}
    with pytest.raises(UniAPError, match=match):
        Cluster.from_dict(doc)


def test_json_keys_still_name_group_sizes() -> None:
    cluster = Cluster.from_dict({"name": "c", "nodes": 1, "devices_per_node": 4, "memory_gib": 16,
                                 "peak_tflops": 10, "bandwidth_tables": {"intra": {"2": 100, "4": 80.5}}})
    assert cluster.bandwidth_tables == {"intra": {2: 100.0, 4: 80.5}}


# ================================================================================ cache entries
def _junk(path: Path, good: str) -> None:
    path.write_bytes(random.Random(7).randbytes(256) + b"\xff\xfe")


def _set(text: str, key: str, raw: str) -> str:
    """``text`` (a JSON document) with the first value of ``key`` replaced by the JSON text ``raw``."""
    out, n = re.subn(rf'("{key}": )(-?[0-9.eE+-]+|true|false|null|"[^"]*")', lambda m: m.group(1) + raw, text,
                     count=1)
    assert n == 1, key
    return out


def _victim(entry: Path, good: str) -> Path:
    """A file outside the cache (holding a valid entry's text, the most tempting to trust) for a link to point at."""
    victim = entry.parent.parent / "VICTIM"
    victim.write_text(good)
    victim.chmod(0o644)
    return victim


def _victim_untouched(entry: Path, good: str) -> None:
    victim = entry.parent.parent / "VICTIM"
    if victim.exists():
        assert victim.read_text() == good and stat.S_IMODE(os.stat(victim).st_mode) == 0o644
        assert os.stat(victim).st_nlink == 1  # a hard-linked entry was dropped as a name, never written into
    assert not os.path.islink(entry)


#: every damaged shape a cache entry can take: (name, how to make it from the good entry's text)
CORRUPT: list[tuple[str, Callable[[Path, str], Any]]] = [
    ("fifo", lambda p, g: os.mkfifo(p)),
    ("symlink-to-a-file", lambda p, g: p.symlink_to(_victim(p, g))),
    ("hardlink-to-a-file", lambda p, g: os.link(_victim(p, g), p)),
    ("dangling-symlink", lambda p, g: p.symlink_to(p.parent / "gone" / "x.json")),
    ("alias-bomb", lambda p, g: p.write_text(ALIAS_BOMB)),
    ("deep-json", lambda p, g: p.write_text(DEEP_JSON)),
    ("truncated", lambda p, g: p.write_text(g[: len(g) // 2])),
    ("binary-junk", _junk),
    ("empty", lambda p, g: p.write_text("")),
    ("json-list", lambda p, g: p.write_text("[1, 2]")),
]


def _plan_shapes() -> list[tuple[str, Callable[[Path, str], Any]]]:
    def edit(fn: Callable[[dict[str, Any]], Any]) -> Callable[[Path, str], Any]:
        def make(p: Path, g: str) -> None:
            doc = json.loads(g)
            fn(doc)
            p.write_text(json.dumps(doc))
        return make

    return CORRUPT + [
        ("400-digit-int", lambda p, g: p.write_text(_set(g, "dp", "9" * 400))),
        ("dp-minus-1", edit(lambda d: d["layers"][0].update(dp=-1))),
        ("string-number", edit(lambda d: d["layers"][0].update(dp="1"))),
        ("v1-string-shard", edit(lambda d: d.update(_v1(d)) or d["layers"][0].update(shard="false"))),
        ("nan-estimate", lambda p, g: p.write_text(_set(g, "tpi_s", "NaN"))),
    ]


@pytest.fixture(scope="module")
def small_problem() -> Any:
    return build_problem(model="tiny_gpt", cluster="local_cpu", global_batch_size=8)


def _solve(problem: Any, cache_dir: Path) -> tuple[Plan, str]:
    from uniap_lightning.runtime.planning import solve_plan

    return solve_plan(profile=problem.model, cluster=problem.cluster, training=problem.training, solver="auto",
                      time_limit_s=30, cache_dir=cache_dir)


@quick
@pytest.mark.parametrize(("shape", "make"), _plan_shapes(), ids=[s for s, _ in _plan_shapes()])
def test_a_damaged_cached_plan_is_discarded_and_solved_again(small_problem: Any, tmp_path: Path, shape: str,
                                                              make: Callable) -> None:
    good_dir = tmp_path / "good"
    plan, origin = _solve(small_problem, good_dir)
    assert origin == "solver"
    (good,) = good_dir.iterdir()
    path = tmp_path / "cache" / good.name
    path.parent.mkdir()
    make(path, good.read_text())
    with pytest.warns(UserWarning, match=f"ignoring the cached plan {path}") as caught:
        again, origin = _solve(small_problem, path.parent)
    assert origin == "solver" and again.to_dict()["layers"] == plan.to_dict()["layers"]
    assert sum("ignoring the cached plan" in str(w.message) for w in caught) == 1
    assert stat.S_ISREG(os.stat(path).st_mode) and Plan.from_json(path).layers == plan.layers  # rebuilt
    assert _solve(small_problem, path.parent)[1] == f"cache {path}"
    _victim_untouched(path, good.read_text())


def test_a_folder_under_the_plan_entry_name_means_no_caching(small_problem: Any, tmp_path: Path) -> None:
    good_dir = tmp_path / "good"
    _solve(small_problem, good_dir)
    (good,) = good_dir.iterdir()
    (tmp_path / "cache" / good.name).mkdir(parents=True)
    with pytest.warns(UserWarning) as caught:
        plan, origin = _solve(small_problem, tmp_path / "cache")
    assert origin == "solver" and plan.layers
    messages = " | ".join(str(w.message) for w in caught)
    assert "ignoring the cached plan" in messages and "is a folder, not a file" in messages
    assert "could not cache the plan" in messages


def _profile_shapes() -> list[tuple[str, Callable[[Path, str], Any]]]:
    return CORRUPT + [
        ("400-digit-int", lambda p, g: p.write_text(_set(g, "params", "9" * 400))),
        ("negative", lambda p, g: p.write_text(_set(g, "forward_s", "-1"))),
        ("string-number", lambda p, g: p.write_text(_set(g, "tp_allreduces", '"2"'))),
        ("string-bool-degree", lambda p, g: p.write_text(g.replace('"tp_degrees": [', '"tp_degrees": ["1", ', 1))),
    ]


@quick
@pytest.mark.parametrize(("shape", "make"), _profile_shapes(), ids=[s for s, _ in _profile_shapes()])
def test_a_damaged_cached_profile_is_discarded_and_rebuilt(small_problem: Any, tmp_path: Path, shape: str,
                                                           make: Callable) -> None:
    from uniap_lightning.profiling.cache import load_cached_profile, save_cached_profile

    profile = small_problem.model
    good = save_cached_profile(tmp_path / "good", "k", profile)
    path = tmp_path / "cache" / good.name
    path.parent.mkdir()
    make(path, good.read_text())
    with pytest.warns(UserWarning, match=f"ignoring the cache entry {path}") as caught:
        assert load_cached_profile(path.parent, "k") is None
    assert len([w for w in caught if "ignoring the cache entry" in str(w.message)]) == 1
    save_cached_profile(path.parent, "k", profile)  # what setup does after measuring again
    assert load_cached_profile(path.parent, "k").fingerprint() == profile.fingerprint()
    _victim_untouched(path, good.read_text())


CLUSTER_ENTRY = {"ops": {"all_reduce": {"2": {"bw_gbps": 1.0, "latency_us": 50.0, "inter_node": False}}},
                 "compression_ns_per_param": {"bf16": 1.0, "powersgd": 2.0, "topk": 30.0}}


def _cluster_shapes() -> list[tuple[str, Callable[[Path, str], Any]]]:
    return CORRUPT + [
        ("400-digit-int", lambda p, g: p.write_text(_set(g, "bw_gbps", "9" * 400))),
        ("string-number", lambda p, g: p.write_text(_set(g, "bw_gbps", '"1.0"'))),
        ("string-bool", lambda p, g: p.write_text(_set(g, "inter_node", '"false"'))),
        ("negative", lambda p, g: p.write_text(_set(g, "latency_us", "-1"))),
        ("huge-float", lambda p, g: p.write_text(_set(g, "bf16", "1e999"))),
    ]


@quick
@pytest.mark.parametrize(("shape", "make"), _cluster_shapes(), ids=[s for s, _ in _cluster_shapes()])
def test_a_damaged_cached_cluster_is_discarded(tmp_path: Path, shape: str, make: Callable) -> None:
    torch = pytest.importorskip("torch")
    from uniap_lightning.runtime.planning import local_cluster
    from uniap_lightning.setup import Ranks, SetupOptions
    from uniap_lightning.setup.measure import Measurements

    m = Measurements(ranks=Ranks(rank=0, world_size=2, num_nodes=1, devices_per_node=2, device=torch.device("cpu")),
                     options=SetupOptions(cache_dir=tmp_path), precision="32-true", forward_context=lambda: None)
    base = local_cluster(nodes=1, devices_per_node=2, device_type="cpu")
    path = tmp_path / "cache" / "cluster-x.json"
    path.parent.mkdir()
    path.write_text(json.dumps(CLUSTER_ENTRY))
    assert m._cached_cluster(base, path) is not None
    path.unlink()
    make(path, json.dumps(CLUSTER_ENTRY))
    with pytest.warns(UserWarning, match=f"ignoring the cache entry {path}"):
        assert m._cached_cluster(base, path) is None
    assert not stat.S_ISFIFO(os.lstat(path).st_mode) if os.path.lexists(path) else True
    from uniap_lightning.profiling.cache import save_cached_json

    save_cached_json(path.parent, path.name, CLUSTER_ENTRY)  # what setup does after measuring again
    assert m._cached_cluster(base, path) is not None
    _victim_untouched(path, json.dumps(CLUSTER_ENTRY))


# ================================================================================ the CLI
def uniap(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "uniap_lightning.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300, check=False)


def _one_error_line(res: subprocess.CompletedProcess, message: str) -> None:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr[-2000:]


SMALL = ("model=tiny_gpt", "cluster=local_cpu", "batch_size=8")


@needs_dev_full
@pytest.mark.parametrize("key", ["out", "viz"])
def test_cli_refuses_dev_full_as_output(key: str) -> None:
    _one_error_line(uniap("plan", *SMALL, f"{key}=/dev/full"),
                    f"{key}='/dev/full' is not a regular file (a character device); give a file name")
    assert _is_char_device(DEV_FULL)


@needs_dev_full
def test_cli_train_refuses_a_device_as_its_out_folder(tmp_path: Path) -> None:
    _one_error_line(uniap("train", "model=tiny_gpt", "out=/dev/full", "trainer.max_steps=1", cwd=tmp_path),
                    "out='/dev/full' exists and is not a folder (a character device); give a folder name")
    assert _is_char_device(DEV_FULL)


@quick
def test_cli_refuses_fifos_and_bombs_as_inputs_and_outputs(tmp_path: Path) -> None:
    fifo = _fifo(tmp_path)
    _one_error_line(uniap("plan", *SMALL, f"viz={fifo}"), "is not a regular file (a FIFO); give a file name")
    _one_error_line(uniap("plan", *SMALL, f"profile={fifo}"), "is a FIFO, not a file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(ALIAS_BOMB)
    _one_error_line(uniap("plan", "model=tiny_gpt", f"cluster={bomb}"), "expands to more than 100,000 nodes")


def test_cli_replaces_a_symlink_out_never_its_target(tmp_path: Path) -> None:
    target = tmp_path / "plans" / "plan.json"
    target.parent.mkdir()
    target.write_text("{}")
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    res = uniap("plan", *SMALL, f"out={link}")
    assert res.returncode == 0, res.stderr
    assert not link.is_symlink() and Plan.from_json(link).num_devices == 4
    assert target.read_text() == "{}"


@pytest.mark.parametrize(("rebalances", "message"), [
    ("[" * 100_000 + "]" * 100_000, "nests lists / objects deeper than 64 levels"),
    ('[{"step": "three"}]', "rebalances[0].step must be an integer, got 'three'"),
    ('[{"step": 3, "switch_s": "slow"}]', "rebalances[0].switch_s must be a number, got 'slow'"),
    ('{"step": 3}', "rebalances must be a list, got dict"),
    ("[[1]]", "rebalances[0] must be an object, got list"),
], ids=["deep", "step", "switch_s", "not-a-list", "not-objects"])
def test_cli_explain_refuses_malformed_rebalances(tmp_path: Path, rebalances: str, message: str) -> None:
    measured = tmp_path / "measured.json"
    measured.write_text('{"tpi_s": 0.5, "rebalances": ' + rebalances + "}")
    _one_error_line(uniap("explain", *SMALL, f"measured={measured}"), message)


def test_solving_is_announced_only_when_the_cache_has_no_plan(small_problem: Any, tmp_path: Path) -> None:
    """A cached plan used to print "UniAP: solving for ..." before "UniAP plan (cache ...)"."""
    from uniap_lightning.runtime.planning import solve_plan

    said: list[str] = []
    kw = dict(profile=small_problem.model, cluster=small_problem.cluster, training=small_problem.training,
              solver="auto", time_limit_s=30, cache_dir=tmp_path, on_solve=lambda: said.append("solving"))
    assert solve_plan(**kw)[1] == "solver" and said == ["solving"]
    assert solve_plan(**kw)[1].startswith("cache ") and said == ["solving"]


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_cache_variable_means_the_default_folder_not_the_working_directory(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str) -> None:
    from uniap_lightning.profiling.cache import default_profile_cache_dir
    from uniap_lightning.runtime.planning import default_cache_dir

    monkeypatch.setenv("UNIAP_CACHE_DIR", value)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "uniap-lightning" / "plans"
    assert default_profile_cache_dir() == tmp_path / ".cache" / "uniap-lightning" / "profiles"
    monkeypatch.setenv("UNIAP_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c" and default_profile_cache_dir() == tmp_path / "c" / "profiles"
