"""A sharded (FSDP2) layer whose output is a view of one of its parameters, as T5's first block hands its
relative-position table to the later blocks (``weight.unsqueeze(0).expand(batch, ...)``): the runtime copies such
outputs before FSDP2 frees the gathered parameter (issue 20, item 5), so they read, and train, as without sharding.

One process (a gloo group of one rank: FSDP2 still gathers into its own buffer and frees it after the forward);
the multi-process parity of T5 / Swin / ViT / Llama / GPT-2 with ZeRO-3 on their first and last blocks is in
``test_hf_families.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from uniap_lightning.runtime.shards import _copy_views_of_parameters, apply_fsdp


@pytest.fixture
def world_of_one(tmp_path) -> Iterator[dist.ProcessGroup]:
    """A one-process group; an in-process Trainer of an earlier test (devices=1) may have left one behind."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class FirstBlock(nn.Module):
    """Its hidden output is computed; ``rel`` is an expand() view of its table, ``row`` a plain view of it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(8, 4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        w = self.table.weight
        return {"hidden": self.lin(x), "rel": w.unsqueeze(0).expand(x.shape[0], -1, -1), "row": w[0]}


def test_views_of_a_sharded_layers_parameters_outlive_its_reshard(world_of_one: dist.ProcessGroup) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    plain = FirstBlock()
    sharded = copy.deepcopy(plain)
    apply_fsdp(sharded, init_device_mesh("cpu", (1,)))
    x = torch.randn(3, 4)
    losses = []
    for model in (plain, sharded):
        out = model(x)
        # later layers use the table after the layer's forward (FSDP2 has resharded the sharded one by now)
        later = (out["hidden"].unsqueeze(1) * out["rel"][:, :1]).sum() + (out["rel"] ** 2).sum() + out["row"].sum()
        later.backward()
        losses.append(later.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_outputs_that_are_not_parameter_views_are_returned_as_they_are() -> None:
    model = FirstBlock()
    x = torch.randn(2, 4)
    out = model(x)
    assert _copy_views_of_parameters(model, (x,), {"hidden": out["hidden"], "none": None, "n": 3}) is None
    copied = _copy_views_of_parameters(model, (x,), out)
    assert copied["hidden"] is out["hidden"]
    for key in ("rel", "row"):  # own storage, same values, still differentiable
        assert copied[key].untyped_storage().data_ptr() != model.table.weight.untyped_storage().data_ptr()
        assert copied[key].is_contiguous() and copied[key].grad_fn is not None
        torch.testing.assert_close(copied[key], out[key])
