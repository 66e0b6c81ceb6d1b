"""The model contract: what the strategy finds in a LightningModule without glue code."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from uniap_lightning.runtime import UniAPModule, extract_chain


class _Sequential(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        self.loss_fn = nn.CrossEntropyLoss()


class _Explicit(pl.LightningModule):
    """Layers spread over several attributes, exposed in order through uniap_layers()."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 10)

    def uniap_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def uniap_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())

    def uniap_split_batch(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch["ids"], batch["ids"]


def test_sequential_attribute_and_loss_fn() -> None:
    module = _Sequential()
    chain = extract_chain(module)
    assert chain.names == ["net.0", "net.1", "net.2"]
    assert chain.loss_fn is module.loss_fn
    x, y = chain.split_batch((torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)))
    assert x.shape == (2, 4) and y.shape == (2,)


def test_uniap_layers_loss_and_batch_split() -> None:
    module = _Explicit()
    assert isinstance(module, UniAPModule)
    chain = extract_chain(module)
    assert chain.names == ["embed", "blocks.0", "blocks.1", "head"]
    ids = torch.randint(0, 10, (2, 3))
    x, y = chain.split_batch({"ids": ids})
    out = x
    for layer in chain.layers:
        out = layer(out)
    assert chain.loss_fn(out, y).ndim == 0


def test_replacing_a_layer_keeps_other_names() -> None:
    module = _Explicit()
    chain = extract_chain(module)
    chain.replace(1, nn.Identity())
    names = [n for n, _ in module.named_parameters()]
    assert "blocks.0.weight" not in names and {"embed.weight", "blocks.1.weight", "head.weight"} <= set(names)


def test_payload_calling_rules() -> None:
    """A tuple is passed as positional arguments; a dict as one argument, the entries a layer does not return
    travel on and an entry returned as None is dropped; structures survive the flat tuples stages exchange."""
    from uniap_lightning.runtime.payload import call_layer, chunk, concat, flatten, spec_of, unflatten

    class Pair(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return a + b, b

    class Update(nn.Module):
        def forward(self, d: dict[str, torch.Tensor]) -> dict[str, Any]:
            return {"h": d["h"] * 2, "ids": None, "new": d["mask"].float()}

    a, b = torch.ones(4, 2), torch.full((4, 2), 3.0)
    assert torch.equal(call_layer(Pair(), (a, b))[0], a + b)
    d = {"ids": torch.zeros(4, 3, dtype=torch.long), "h": a, "mask": torch.ones(4, 3, dtype=torch.long)}
    out = call_layer(Update(), d)
    assert list(out) == ["h", "mask", "new"] and torch.equal(out["h"], 2 * a) and out["mask"] is d["mask"]
    for payload in (a, (a, b), out):
        assert spec_of(unflatten(flatten(payload), spec_of(payload))) == spec_of(payload)
        parts = chunk(payload, 2)
        assert all(t.shape[0] == 2 for part in parts for t in flatten(part))
        assert all(torch.equal(x, y) for x, y in zip(flatten(concat(parts)), flatten(payload)))


def test_dict_batch_with_labels_splits_by_default() -> None:
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.runtime.chain import default_split_batch

    x, y = default_split_batch({"input_ids": torch.zeros(2, 3), "attention_mask": torch.ones(2, 3),
                                "labels": torch.zeros(2)})
    assert set(x) == {"input_ids", "attention_mask"} and y.shape == (2,)
    import pytest

    with pytest.raises(UniAPError, match="expects \\(input, target\\) or a dict with 'labels'"):
        default_split_batch({"input_ids": torch.zeros(2, 3)})


def test_a_plan_with_expert_parallelism_on_a_dense_layer_is_refused_before_any_process_group() -> None:
    """The strategy runs ep (expert parallelism) on layers with experts it can split; a pinned plan with ep > 1 on
    a layer without any is refused in one line (instead of running the layer unsplit, past the plan's memory)."""
    import pytest

    from uniap_lightning.errors import UniAPError
    from uniap_lightning.planner.decision import Strategy
    from uniap_lightning.planner.plan import Plan
    from uniap_lightning.runtime import check_plan_executable

    chain = extract_chain(_Sequential())
    plan = Plan.from_assignment(stage_of_layer=[0, 0, 0], layer_names=chain.names, pp=1, microbatches=1,
                                schedule="1f1b", global_batch_size=4, num_devices=2,
                                strategies=[Strategy(2, 1), Strategy(2, 1, ep=2), Strategy(2, 1)])
    with pytest.raises(UniAPError, match=r"plan layer 'net.1': ep=2 \(expert parallelism\) but the layer has no "
                                         r"experts the runtime can split") as err:
        check_plan_executable(plan, chain)
    assert "\n" not in str(err.value)
