"""Setup refuses what would break training later, and its caches cover everything they depend on (1 process)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from uniap_lightning.planner.decision import Strategy
from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.profile import load_profile
from uniap_lightning.profiling.cache import profile_key
from uniap_lightning.profiling.measure import profile_layers

IN, HID, OUT = 8, 16, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HID, 2 * HID), nn.Linear(2 * HID, HID)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _module(block: type[nn.Module] = Block) -> Any:
    import lightning.pytorch as pl

    class Chain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(IN, HID), block(), nn.LayerNorm(HID), nn.Linear(HID, OUT))
            self.loss_fn = nn.MSELoss()

        def training_step(self, batch: Any, batch_idx: int) -> Any:  # not called by the strategy
            raise AssertionError

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Chain()


def _loader(batch: int = 8) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, IN, generator=g), torch.randn(32, OUT, generator=g)),
                      batch_size=batch, drop_last=True)


def _fit(tmp: Path, module: Any, steps: int = 1, precision: str = "32-true", **strategy: Any) -> Any:
    import lightning.pytorch as pl

    from uniap_lightning import UniAPStrategy

    strategy.setdefault("cache_dir", str(tmp / "cache"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=UniAPStrategy(monitor=False, **strategy),
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, precision=precision)
    trainer.fit(module, _loader())
    return trainer


# ------------------------------------------------------------------------------------------ bug 4: the chain contract
class TupleBlock(Block):
    def forward(self, x: torch.Tensor) -> Any:  # a Hugging Face block's habit: (hidden, extras)
        return super().forward(x), None


def test_a_layer_returning_a_tuple_is_refused_at_setup_naming_it(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "structural profile" detour: an error, at once
        warnings.filterwarnings("ignore", message=".*(does not have many workers|num_workers|`srun` command).*")
        with pytest.raises(UniAPError, match=r"layer 1 'net.1' \(TupleBlock\) returned a tuple holding NoneType, "
                                             r"Tensor; the chain contract is one tensor, a tuple or a flat dict of "
                                             r"tensors per layer, each with the batch on dim 0"):
            _fit(tmp_path, _module(TupleBlock))


def test_a_layer_dropping_the_batch_dimension_is_refused() -> None:
    from uniap_lightning.runtime.chain import check_layer_output

    layer = nn.Linear(HID, HID)
    check_layer_output(0, "net.0", layer, torch.zeros(4, HID), rows=4)
    with pytest.raises(UniAPError, match=r"layer 2 'net.2' \(Linear\) returned a tensor of shape \(16,\) for a "
                                         r"micro-batch of 4 samples"):
        check_layer_output(2, "net.2", layer, torch.zeros(16), rows=4)


# ------------------------------------------------------------------------------- bug 3: what the profile key covers
def _key(layers: list[nn.Module], precision: str = "32-true") -> str:
    from uniap_lightning.runtime.tensor_parallel import tp_allreduces, tp_degrees

    return profile_key(layers=layers, names=[f"net.{i}" for i in range(len(layers))], input_shape=[8, HID],
                       input_dtype="torch.float32", device="cpu", nodes=1, devices_per_node=1, settings={},
                       precision=precision, tp_degrees=[tp_degrees(m) for m in layers],
                       tp_allreduces=[tp_allreduces(m) for m in layers])


def _tp_block() -> type[nn.Module]:
    class Block(globals()["Block"]):  # the same class name and code, with the tensor-parallel methods added
        def uniap_tp_degrees(self) -> list[int]:
            return [1, 2]

        def uniap_tp_plan(self, tp: int) -> dict[str, Any]:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

            return {"up": ColwiseParallel(), "down": RowwiseParallel()}

    return Block


def _edited_block() -> type[nn.Module]:
    class Block(nn.Module):  # same name and parameters as the module-level Block, other code
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(HID, 2 * HID), nn.Linear(2 * HID, HID)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.tanh(self.up(x)))

    return Block


def test_the_profile_key_covers_layer_code_uniap_methods_and_precision() -> None:
    key = _key([Block()])
    assert _key([Block()]) == key  # deterministic
    assert _key([_tp_block()()]) != key  # uniap_tp_* methods added
    assert _key([_edited_block()()]) != key  # the layer's code changed
    assert _key([Block()], precision="bf16-mixed") != key


def test_adding_tensor_parallel_methods_profiles_again(tmp_path: Path) -> None:
    first = _fit(tmp_path, _module(Block))
    second = _fit(tmp_path, _module(_tp_block()))
    assert first.strategy.setup_report["profile_origin"] == "measured"
    assert second.strategy.setup_report["profile_origin"] == "measured"  # not the first run's cache entry
    assert second.strategy.setup_report["profile_path"] != first.strategy.setup_report["profile_path"]
    assert load_profile(second.strategy.setup_report["profile_path"]).layers[1].tp_degrees == (1, 2)
    result = second.strategy.setup_result  # frozen: what setup decided, read by the strategy's properties
    assert result.profile.layers[1].tp_degrees == (1, 2) and result.origin == second.strategy.plan_origin
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.origin = "elsewhere"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(result)).report == result.report


# ---------------------------------------------------------------------------------------- bug 9: precision
def test_profiling_follows_the_precision_context() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(IN, HID), Block(), nn.Linear(HID, OUT)]
    names = ["net.0", "net.1", "net.2"]
    x = torch.randn(8, IN)
    full = profile_layers(layers, names, x, repeats=1)
    bf16 = profile_layers(layers, names, x, repeats=1, context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert full.layers[0].output_bytes == HID * 4 and bf16.layers[0].output_bytes == HID * 2
    # autocast saves bf16 copies of the input and of the weights for backward: other bytes than in fp32
    assert bf16.layers[1].activation_bytes != full.layers[1].activation_bytes


def test_bf16_mixed_profiles_under_autocast_and_keys_its_own_cache_entry(tmp_path: Path) -> None:
    full = _fit(tmp_path, _module())
    mixed = _fit(tmp_path, _module(), precision="bf16-mixed")
    rep_full, rep_mixed = full.strategy.setup_report, mixed.strategy.setup_report
    assert rep_mixed["profile_origin"] == "measured" and rep_mixed["profile_path"] != rep_full["profile_path"]
    assert rep_full["precision"] == "32-true" and rep_mixed["precision"] == "bf16-mixed"
    out_full = [lp.output_bytes for lp in load_profile(rep_full["profile_path"]).layers]
    out_mixed = [lp.output_bytes for lp in load_profile(rep_mixed["profile_path"]).layers]
    assert out_mixed[0] == out_full[0] / 2  # a Linear's output is bf16 under autocast


# ------------------------------------------------------------------------------ bug 6: plans checked against the job
def _plan(batch: int) -> Any:
    from uniap_lightning.planner.plan import Plan

    return Plan.from_assignment(stage_of_layer=[0, 0, 0, 0], strategies=[Strategy(1, 1)] * 4,
                                layer_names=["net.0", "net.1", "net.2", "net.3"], pp=1, microbatches=1,
                                schedule="1f1b", global_batch_size=batch, num_devices=1)


def test_a_pinned_plan_for_another_batch_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UniAPError, match="plan is for a global batch of 16 samples but the dataloader's batches "
                                         "have 8"):
        _fit(tmp_path, _module(), plan=_plan(16))
    assert _fit(tmp_path, _module(), plan=_plan(8)).strategy.plan_origin == "pinned"


def test_an_unreadable_or_foreign_cached_plan_is_discarded_with_a_warning(tmp_path: Path) -> None:
    from uniap_lightning.runtime.planning import _cached_plan

    profile = profile_layers(list(_module().net), ["net.0", "net.1", "net.2", "net.3"], torch.randn(8, IN),
                             repeats=1)
    path = tmp_path / "plan-x.json"
    _plan(8).to_json(path)
    assert _cached_plan(path, profile=profile, world_size=1, global_batch_size=8) is not None
    with pytest.warns(UserWarning, match=f"ignoring the cached plan {path}.*global batch of 8 .* have 16"):
        assert _cached_plan(path, profile=profile, world_size=1, global_batch_size=16) is None
    path.write_bytes(os.urandom(64) + b"\xff\xfe")
    with pytest.warns(UserWarning, match=f"ignoring the cached plan {path}"):
        assert _cached_plan(path, profile=profile, world_size=1, global_batch_size=8) is None


def test_an_invalid_cluster_cache_entry_is_discarded_with_a_warning(tmp_path: Path) -> None:
    import json

    from uniap_lightning.runtime.planning import local_cluster
    from uniap_lightning.setup import Ranks, SetupOptions
    from uniap_lightning.setup.measure import Measurements

    m = Measurements(ranks=Ranks(rank=0, world_size=2, num_nodes=1, devices_per_node=2, device=torch.device("cpu")),
                     options=SetupOptions(cache_dir=tmp_path), precision="32-true", forward_context=lambda: None)
    base = local_cluster(nodes=1, devices_per_node=2, device_type="cpu")
    path = tmp_path / "cluster-x.json"
    comp = {"compression_ns_per_param": {"bf16": 1.0, "powersgd": 2.0, "topk": 30.0}}
    good = {"ops": {"all_reduce": {"2": {"bw_gbps": 1.0, "latency_us": 50.0, "inter_node": False}}}, **comp}
    path.write_text(json.dumps(good))
    assert m._cached_cluster(base, path).collective_tables["all_reduce"]["intra"][2]["bw_gbps"] == 1.0
    # an entry from before compression was timed: measured again, silently (not an error)
    path.write_text(json.dumps({"ops": good["ops"]}))
    assert m._cached_cluster(base, path) is None
    missing = {"ops": {"all_reduce": {"2": {"bw_gbps": 1.0, "latency_us": 50.0}}}, **comp}  # no "inter_node"
    negative = {"ops": {"all_reduce": {"2": {"bw_gbps": -1.0, "latency_us": 50.0, "inter_node": False}}}, **comp}
    for content in (json.dumps(missing), json.dumps(negative), "[1, 2]", b"\xff\xfe" + os.urandom(32)):
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        with pytest.warns(UserWarning, match=f"ignoring the cache entry {path}"):
            assert m._cached_cluster(base, path) is None


def test_a_cache_folder_that_cannot_be_written_means_no_caching(tmp_path: Path) -> None:
    # a regular file where the cache folder should be: every write below it fails (as root, a read-only folder
    # would not stop the writes, so the test uses what fails for anyone)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.warns(UserWarning, match="could not cache the plan"):
        trainer = _fit(tmp_path, _module(), cache_dir=str(blocker / "cache"))
    assert trainer.global_step == 1 and trainer.strategy.plan_origin == "solver"
    assert blocker.is_file()
