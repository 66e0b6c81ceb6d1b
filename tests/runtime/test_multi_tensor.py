"""Layers that take and return several tensors (dicts and tuples, an integer padding mask among them) and dict
batches train under pinned plans - pipeline boundaries carrying a dict and a tuple, data-parallel re-layouts of every
tensor between layers of different dp, tensor parallelism inside a dict layer - matching one process within 1e-5."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import uniap_rt_helpers as h
from uniap_lightning.errors import UniAPError
from uniap_models import LAYER_NAMES, dict_batches, multi_tensor_module

MODULE = {"factory": "uniap_models:multi_tensor_module"}
DATA = {"factory": "uniap_models:dict_batches"}
REPL, FSDP, TP, ONE = (2, 1, False), (2, 1, True), (1, 2, False), (1, 1, False)


def _plan(strategies: list[tuple[int, int, bool]], stages: list[int], **kw: Any) -> Any:
    return h.make_plan(strategies, stages, names=LAYER_NAMES, **kw)


CASES = {
    # the boundary carries {mask (int64), h}
    "pp2_dict_boundary": {"plan": _plan([ONE] * 6, [0, 0, 1, 1, 1, 1], pp=2, microbatches=2, schedule="gpipe")},
    # the boundary carries the tuple (h, gate); 1F1B with 4 micro-batches
    "pp2_tuple_boundary": {"plan": _plan([ONE] * 6, [0, 0, 0, 0, 1, 1], pp=2, microbatches=4),
                           "limit_val_batches": 2, "predict": True},
    # one stage, dp 2 -> 1 -> 2: the dict (with its integer mask) is gathered, then split again
    "dp2_tp2_relayouts": {"plan": _plan([REPL, TP, FSDP, REPL, FSDP, REPL], [0] * 6, pp=1, microbatches=2),
                          "accumulate": 2},
}
for case in CASES.values():
    case.update(module=MODULE, data=DATA)


@pytest.mark.parametrize("name", list(CASES))
def test_multi_tensor_layers_match_one_process(name: str, spawn_cases: Any) -> None:
    results = spawn_cases(2, CASES, "multi_tensor")
    ref = h.reference_for(CASES[name])
    h.assert_close_to_reference(results, name, ref)
    for res in results:  # validation and prediction on dict batches through the pipeline, on every rank
        if "val_loss" in ref:
            assert res[name]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)
        if "predictions" in ref:
            torch.testing.assert_close(res[name]["predictions"], ref["predictions"], rtol=1e-5, atol=1e-6)


def test_contract_records_the_structure_and_checks_every_tensor() -> None:
    from uniap_lightning.runtime import extract_chain
    from uniap_lightning.runtime.chain import check_chain_contract

    torch.manual_seed(0)
    chain = extract_chain(multi_tensor_module())
    batch = next(iter(dict_batches(4)))
    x, y = chain.split_batch(batch)
    assert set(x) == {"x", "mask"} and y.shape == (4, 4)
    check_chain_contract(chain, x)
    assert chain.input_spec == ("x", "mask")
    assert chain.specs == [("mask", "h"), ("mask", "h"), ("mask", "h"), 2, 2, None]

    class Constant(nn.Module):  # a layer that returns a constant without the batch dimension
        def forward(self, d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"h": d["h"], "table": torch.zeros(7, 3)}

    chain.layers[1] = Constant()
    with pytest.raises(UniAPError, match=r"layer 1 'blocks.0' \(Constant\) returned a tensor of shape \(7, 3\) for a "
                                         r"micro-batch of 4 samples.*rebuilt inside each layer"):
        check_chain_contract(chain, x)

    class Mixed(nn.Module):
        def forward(self, d: dict[str, torch.Tensor]) -> tuple[Any, ...]:
            return d["h"], [1, 2]

    chain.layers[1] = Mixed()
    with pytest.raises(UniAPError, match=r"returned a tuple holding Tensor, list"):
        check_chain_contract(chain, x)


def test_profile_sums_the_tensors_crossing_each_boundary() -> None:
    from uniap_lightning.profiling.measure import profile_layers
    from uniap_lightning.runtime import extract_chain

    torch.manual_seed(0)
    chain = extract_chain(multi_tensor_module())
    x, _ = chain.split_batch(next(iter(dict_batches(8))))
    profile = profile_layers(chain.layers, chain.names, x, repeats=1, micro_batches=[8])
    per_sample = [lp.output_bytes for lp in profile.layers]
    mask, hidden, gate = 8 * 8, 16 * 4, 1 * 4  # int64 mask of IN=8, float hidden of 16, float gate
    assert per_sample == [mask + hidden] * 3 + [hidden + gate] * 2 + [4 * 4]
