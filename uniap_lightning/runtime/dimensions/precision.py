"""The precision dimension's runtime (``precision``): a layer's ``nn.Linear`` matmuls in float8 (torchao).

Convert (before every parallelism, as torchtitan's model converters, float8 among them, run before
``parallelize``): the layer's linears become torchao's ``Float8Linear`` (:func:`apply_fp8`), so TP and FSDP2 then
wrap the float8 modules (FSDP2 gathers the weights in float8 under ZeRO-3 with the tensorwise recipe). Same
parameter names, master weights in the run's precision. No groups.
"""

from __future__ import annotations

import torch
from torch import nn

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.dimensions.precision import RECIPES
from uniap_lightning.runtime.dimensions.base import LayerJob, RuntimeDimension

#: float8 matmuls need both dimensions of every operand divisible by 16 (torch._scaled_mm)
FP8_ALIGNMENT = 16


def convert(job: LayerJob) -> nn.Module:
    st = job.st
    if st.precision == "default":
        return job.layer
    return apply_fp8(job.layer, st.precision, float8_all_gather=st.shard and st.precision == "fp8", tp=st.tp,
                     where=job.where)


def apply_fp8(layer: nn.Module, precision: str, *, float8_all_gather: bool = False, tp: int = 1,
              where: str = "layer") -> nn.Module:
    """``layer`` with its ``nn.Linear`` modules (the layer itself, when it is one) converted to torchao's float8
    training (``convert_to_float8_training``: dynamic scales, :data:`~uniap_lightning.planner.dimensions.precision.
    RECIPES`'s recipe; ``float8_all_gather``: FSDP2 gathers the weights in float8, tensorwise only). Parameters keep
    their names and dtype (master weights); a linear whose dimensions (after ``tp``) are not multiples of
    :data:`FP8_ALIGNMENT` stays as it is (torchtitan filters the same way). Returns the module to use. Refused in
    one line without torchao, or on a CUDA device without float8 matmuls (compute capability below 8.9); a CPU runs
    torch's float8 matmul (numerics, not speed)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise UniAPError(f"{where} runs in {precision}: it needs torchao's float8 training (pip install "
                         f"'uniap-lightning[fp8]'): {err}") from err
    params = [p for p in layer.parameters()]
    if params and params[0].is_cuda and torch.cuda.get_device_capability(params[0].device) < (8, 9):
        raise UniAPError(f"{where} runs in {precision}, but {torch.cuda.get_device_name(params[0].device)} has no "
                         "float8 matmuls (compute capability 8.9 or newer: H100, H200, L40S); plan without fp8")
    if float8_all_gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = Float8LinearConfig.from_recipe_name(RECIPES[precision])
    step = FP8_ALIGNMENT * tp

    def fits(module: nn.Module, _fqn: str) -> bool:
        return (isinstance(module, nn.Linear) and module.in_features % step == 0
                and module.out_features % step == 0)

    return convert_to_float8_training(layer, config=config, module_filter_fn=fits)


PRECISION = RuntimeDimension("precision", convert=convert)
