"""Matmul precision: a layer's ``nn.Linear`` products in float8 (torchao's float8 training: dynamic scaling,
master weights, gradients and optimizer state in the run's own precision) or in the run's precision ("default").

Values: ``"default"``, ``"fp8"`` (tensorwise scaling, torchao's default recipe: one scale per tensor; under ZeRO-3
the weights are all-gathered in float8) and ``"fp8_rowwise"`` (one scale per row; no float8 all-gather). The
runtime converts the layer's ``nn.Linear`` modules (:mod:`uniap_lightning.runtime.stage`).

Opt-in, like compression: fp8 changes numerics, so the planner offers it only where the user allowed it
(``UniAPStrategy(fp8="auto")``, ``uniap plan fp8=auto``: this dimension's :class:`~.base.OptIn`, whose allowed
precisions the problem's ``opt_ins["fp8"]`` and the :class:`~.base.Slot` carry) and the cluster's catalogue device has an fp8 peak (``peak_tflops.fp8``: H100, H200, GH200;
not A100, V100, consumer cards or a free-text device), and only for a layer with parameters.

Priced by :func:`fp8_terms` (through this dimension's cost hooks, which the cost model calls): the layer's matmuls at the fp8
peak instead of the bf16 one, the casts and amax passes each matmul adds (memory bound), a floor per added
kernel, and under ZeRO-3 (tensorwise) all-gathers of one byte per parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, NamedTuple

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner.devices import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY
from uniap_lightning.planner.dimensions.base import Column, Dimension, Field, LayerTerms, OptIn, Slot, one_of

#: the per-layer values: the run's precision, float8 with tensorwise scales, float8 with rowwise scales
PRECISIONS = ("default", "fp8", "fp8_rowwise")
FP8_PRECISIONS = PRECISIONS[1:]
#: what ``UniAPStrategy(fp8=...)`` / ``uniap plan fp8=`` accept, and the per-layer values the planner may then
#: choose besides "default": "off" (none), "auto" / "tensorwise" (torchao's default recipe), "rowwise"
FP8_CHOICES: dict[str, tuple[str, ...]] = {"off": (), "auto": ("fp8",), "tensorwise": ("fp8",),
                                           "rowwise": ("fp8_rowwise",)}
#: the torchao recipe of each fp8 value
RECIPES = {"fp8": "tensorwise", "fp8_rowwise": "rowwise"}
#: kernels eager torchao adds per matmul (amax and cast of the input, the weight and the output's gradient)
KERNELS_PER_GEMM = 6


def fp8_precisions(value: Any, where: str = "fp8") -> tuple[str, ...]:
    """The per-layer fp8 values an ``fp8`` option allows: a key of :data:`FP8_CHOICES` (None: "off"), or a tuple
    of :data:`FP8_PRECISIONS` (as a problem holds them). Refuses anything else in one line, naming ``where``."""
    if value is None:
        return ()
    if isinstance(value, str) and value in FP8_CHOICES:
        return FP8_CHOICES[value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) and v in FP8_PRECISIONS for v in value):
        return tuple(dict.fromkeys(value))
    raise UniAPError(f"{where}={value!r} must be one of {list(FP8_CHOICES)} ('off': the run's precision only; "
                     "'auto' / 'tensorwise': the planner may run a layer's matmuls in float8 with tensorwise scales "
                     "where the device has fp8, 'rowwise': with rowwise scales; it changes numerics, so it is "
                     "opt-in)")


def device_has_fp8(cluster: Any) -> bool:
    """The cluster's catalogue device has float8 matmul units (a peak for ``fp8``) and a bf16 one to compare."""
    spec = cluster.device_spec
    return spec is not None and spec.has("fp8") and spec.has("bf16")


def check_plan_device(plan: Any, cluster: Any) -> None:
    """A pinned plan with float8 layers on a cluster whose device has no fp8 matmuls: refused in one line."""
    fp8 = [lp.name for lp in plan.layers if lp.strategy.precision != "default"]
    if fp8 and not device_has_fp8(cluster):
        raise UniAPError(f"plan runs {len(fp8)} layer(s) in float8 ({', '.join(fp8[:3])}{', ...' if len(fp8) > 3 else ''}) "
                         f"but cluster '{cluster.name}' (device {cluster.device or 'unnamed'!r}) has no fp8 "
                         "matmuls (a catalogue device with peak_tflops.fp8: h100_sxm, h200, gh200): plan again "
                         "for this cluster")


def why_not(layer: Any, s: Any, cluster: Any) -> str | None:
    """Why a float8 ``precision`` is not offered for ``layer`` on ``cluster`` (the device, then the layer), or None."""
    if s.precision == "default":
        return None
    if not device_has_fp8(cluster):
        return (f"precision={s.precision!r} needs a device with float8 matmuls (a catalogue device with "
                f"peak_tflops.fp8: h100_sxm, h200, gh200); cluster '{cluster.name}' has device "
                f"{cluster.device or 'unnamed'!r}, which has none")
    if layer.params == 0:
        return f"precision={s.precision!r} needs a layer with parameters (matmuls to run in float8)"
    return None


def default_precision_problem(problem: Any) -> Any | None:
    """``problem`` with every layer in the run's own precision, where its allowed float8 precisions widen the
    space (allowed, and the device has fp8); ``None`` where they do not (nothing to narrow).

    The search solves this narrower space first and takes its plan as the incumbent of the wide one
    (:func:`~uniap_lightning.planner.solver.search.search`): float8 doubles the candidates per layer, and a wide
    search cut short by its time limit returned plans slower than the fp8-free optimum it contains."""
    if not problem.opt_ins.get("fp8") or not device_has_fp8(problem.cluster):
        return None
    return replace(problem, opt_ins={**problem.opt_ins, "fp8": ()})


def _options(slot: Slot, chosen: Mapping[str, Any]) -> tuple[str, ...]:
    allowed = slot.allowed("fp8")
    if allowed and slot.layer.params > 0 and device_has_fp8(slot.cluster):
        return ("default", *allowed)
    return ("default",)


class Fp8Terms(NamedTuple):
    """What fp8 changes in a layer's terms, per micro-batch on one rank: ``compute_s`` (negative: faster),
    ``transient_bytes`` (its float8 weight copies), and ``float8_gathered`` (parameters per rank, after tensor
    parallelism, that ZeRO-3 all-gathers in float8, one byte each: its matmul weights under tensorwise scales)."""

    compute_s: float
    transient_bytes: float
    float8_gathered: float = 0.0


def gemm_shape(layer: Any, hp_bytes: float) -> tuple[float, float, int]:
    """``(matrix_params, matrix_dims, gemms)`` of a layer's matmuls as its profile describes them: ``M``, the
    parameters outside vectors (the experts' counted by the ``top_k`` of ``experts`` each token reaches); the sum
    over matrices of rows + columns, and the number of matrices.

    A measured profile gives the sum (``matrix_dims``); then ``gemms = round(dims^2 / 4 M)`` (exact for ``n``
    square matrices, ``n (a + b)^2 / 4ab`` for ``n`` of ``a x b``). An analytic one does not: its hidden size
    ``h = output_bytes / (sequence_length x hp_bytes)`` stands on one side of every matrix (a transformer block's
    projections), so ``gemms = max(1, round(M / 4 h^2))`` and ``dims = M / h + gemms x h`` (LLaMA-70B's block:
    129k for its true 161k; GPT's: 15 h for 16 h). Neither known: one square matrix."""
    dims, vectors = layer.powersgd_dims()
    matrix = max(layer.params - vectors, 0.0)
    if layer.experts and layer.expert_params:
        matrix -= layer.expert_params * (1 - layer.top_k / layer.experts)
    if matrix <= 0:
        return 0.0, 0.0, 0
    if layer.matrix_dims is not None:
        return matrix, dims, max(1, round(dims * dims / (4 * matrix)))
    h = layer.output_bytes / ((layer.sequence_length or 1) * hp_bytes)
    if 1 <= h and h * h <= matrix:
        gemms = max(1, round(matrix / (4 * h * h)))
        return matrix, matrix / h + gemms * h, gemms
    return matrix, 2 * matrix ** 0.5, 1


def fp8_terms(layer: Any, precision: str, *, tokens: float, tp: int, compute_s: float, state_shards: int,
              zero3: bool, hp_bytes: float, spec: Any, floor_s: float) -> Fp8Terms:
    """fp8's change to a layer under ``precision`` for ``tokens`` samples' worth of tokens on a rank (``compute_s``
    the layer's priced compute there, ``tp`` its tensor-parallel degree, ``state_shards`` the ranks its state is
    sharded over, ``hp_bytes`` the run's bytes per weight and activation element, ``spec`` the catalogue device).

    * Matmuls (:func:`gemm_shape`): ``F = 6 M L`` FLOPs per sample (forward and both backward products; ``L`` the
      layer's ``sequence_length``, 1 without one), ``G = F tokens / tp / (peak_bf16 x MATMUL_EFFICIENCY)`` seconds
      at bf16, of which fp8 saves ``min(G, compute_s) (1 - peak_bf16 / peak_fp8)``. A layer priced at less than
      ``G`` (an embedding: its table is a lookup, not a matmul) holds matmul weights in that share only,
      ``s = min(1, compute_s / G)``: ``M`` below stands for ``s M``.
    * Casts (memory bound, at ``hbm x MEMORY_EFFICIENCY``): each matmul's input and weight read twice (amax, cast)
      in forward and again in backward (torchao keeps them in high precision for backward), the output's gradient
      twice, each cast writing one byte per element: ``X (4 h + 2) + W (4 h + 2) + Y (2 h + 2)`` with ``X + Y =
      tokens L dims (1 + 1/tp) / 2`` elements (tensor parallelism splits one side of each matrix), ``W = M / tp``
      (``/ state_shards`` under ZeRO-3: the shard is cast before its all-gather); rowwise scaling reads the same.
    * ``KERNELS_PER_GEMM`` kernels per matmul at the kernel floor (eager torchao: amax and cast of three operands):
      what makes a small matmul lose.
    * Memory: the float8 weight and its transpose (``2 M / tp`` bytes) while the layer runs; activations unchanged.
      ZeRO-3 with tensorwise scaling gathers float8 weights: one byte per parameter on the wire and in the gathered
      copy."""
    matrix, dims, gemms = gemm_shape(layer, hp_bytes)
    if precision == "default" or matrix <= 0:
        return Fp8Terms(0.0, 0.0)
    bf16, fp8 = spec.peak("bf16"), spec.peak("fp8")
    L = layer.sequence_length or 1
    gemm_s = 6 * matrix * L * tokens / tp / (bf16 * MATMUL_EFFICIENCY)
    share = min(1.0, compute_s / gemm_s) if gemm_s > 0 else 0.0
    saved = gemm_s * share * (1 - bf16 / fp8)
    matrix *= share
    h = hp_bytes
    xy = tokens * L * dims * share * (1 + 1 / tp) / 2
    w = matrix / tp / (state_shards if zero3 else 1)
    cast_bytes = xy / 2 * (4 * h + 2) + xy / 2 * (2 * h + 2) + w * (4 * h + 2)
    cast_s = cast_bytes / (spec.hbm_gbps * 1e9 * MEMORY_EFFICIENCY) + KERNELS_PER_GEMM * gemms * floor_s
    gathered = matrix / tp if zero3 and precision == "fp8" else 0.0
    return Fp8Terms(cast_s - saved, 2 * matrix / tp, gathered)


def _price_compute(x: LayerTerms) -> None:
    """Matmuls at the fp8 peak, plus their casts, before anything reads the compute (recomputation reruns the
    cheaper forward); the terms kept for :func:`_price_state`."""
    if x.s.precision == "default":
        return
    fp8 = fp8_terms(x.layer, x.s.precision, tokens=x.tokens, tp=x.s.tp, compute_s=x.compute, state_shards=x.d,
                    zero3=x.mode == "zero3", hp_bytes=x.training.weight_bytes, spec=x.cluster.device_spec,
                    floor_s=x.cluster.kernel_floor_us * 1e-6)
    x.compute += fp8.compute_s
    x.notes["precision"] = fp8


def _price_state(x: LayerTerms) -> None:
    """The float8 weight and its transpose while the layer runs; under ZeRO-3 with tensorwise scales its matmul
    weights gathered in float8: fewer bytes on the wire and a float8 gathered copy."""
    fp8 = x.notes.get("precision")
    if fp8 is None:
        return
    x.transient += fp8.transient_bytes
    if fp8.float8_gathered:
        w, F = x.training.weight_bytes, min(fp8.float8_gathered, x.shared)
        x.state_comm = max(x.state_comm - 2 * (x.gather_s(x.shared * w) - x.gather_s((x.shared - F) * w + F)), 0.0)
        x.transient -= F * (w - 1)


def _cell(s: Any) -> str:
    return s.precision if s.precision != "default" else "-"


def _suffix(s: Any) -> str:
    return {"fp8": "+fp8", "fp8_rowwise": "+fp8r"}.get(s.precision, "")


PRECISION = Dimension(
    name="precision",
    fields=(Field("precision", str, "default", _options, check=one_of("precision", PRECISIONS), since=6),),
    # the job's permission: UniAPStrategy(fp8=...), uniap plan fp8=...; Problem.opt_ins["fp8"] holds what it allows
    opt_in=OptIn("fp8", fp8_precisions, off=(None, "off"), pinned="precision per layer",
                 check_plan=check_plan_device, values=FP8_PRECISIONS, why_not=why_not,
                 help="float8 matmuls the planner may choose per layer where the device has fp8: null / off | auto "
                      "(= tensorwise) | rowwise; it changes numerics, so it is opt-in"),
    suffix=_suffix,
    # shown where some layer runs in fp8: reports of plans without it are unchanged
    columns=(Column("precision", _cell, shown=lambda s: s.precision != "default"),),
    price_compute=_price_compute,
    price_state=_price_state,
)

__all__ = ["FP8_CHOICES", "FP8_PRECISIONS", "PRECISION", "PRECISIONS", "RECIPES", "Fp8Terms", "check_plan_device",
           "default_precision_problem", "device_has_fp8", "fp8_precisions", "fp8_terms", "gemm_shape", "why_not"]
