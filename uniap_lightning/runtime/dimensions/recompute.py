"""The recompute dimension's runtime (``recompute``): the layer's activations recomputed in backward.

Run: the layer's call under non-reentrant activation checkpointing (:func:`torch.utils.checkpoint.checkpoint`) in
the stage's forward. torchtitan wraps the block (``apply_ac``, after TP and CP, before compile and FSDP, so FSDP2
wraps the checkpointed block); here nothing is wrapped, the checkpoint is around the call of the parallelized layer
(FSDP2's hooks inside it), so parameter names, and checkpoints, stay the user's. No groups. Before offload in the
registry: a layer the plan recomputes saves nothing to offload.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from uniap_lightning.runtime.dimensions.base import RuntimeDimension
from uniap_lightning.runtime.payload import call_layer


def run(stage: Any, layer: nn.Module, x: Any) -> tuple[Any, None]:
    return checkpoint(call_layer, layer, x, use_reentrant=False), None


RECOMPUTE = RuntimeDimension("recompute", runs=lambda st: bool(st.recompute), run=run)
