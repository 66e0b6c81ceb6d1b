"""One layer's profile (:class:`LayerProfile`, with its measured :class:`Timing` and :class:`Overhead` points) and
how the cost model reads it: compute time at a micro-batch size, the measured overheads of a parallel form, the
backward's split into input and weight gradients. The file format and the chain's record are in
:mod:`uniap_lightning.planner.profile` (which re-exports these names), reading a file in
:mod:`uniap_lightning.planner.profile_read`."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    micro_batch: int
    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class Overhead:
    kind: str  # "tp" | "fsdp" | "dp" | "zero2" | "zero1"
    degree: int
    micro_batch: int  # samples per device
    seconds: float  # forward + backward, beyond the divided single-device compute (may be < 0: measured)


OVERHEAD_KINDS = ("tp", "fsdp", "dp", "zero2", "zero1")
#: :meth:`LayerProfile.backward_split` of a layer with parameters whose profile has no ``weight_grad_fraction``
DEFAULT_WEIGHT_GRAD_FRACTION = 0.5


@dataclass(frozen=True)
class LayerProfile:
    """Costs of one layer of the chain on one device (see :mod:`uniap_lightning.planner.profile` for units)."""

    name: str
    forward_s: float
    backward_s: float
    params: int
    activation_bytes: float
    output_bytes: float
    tp_degrees: tuple[int, ...] = (1,)
    tp_allreduces: int = 0
    activation_tp_fraction: float = 1.0
    timings: tuple[Timing, ...] = ()
    overheads: tuple[Overhead, ...] = ()
    #: trainable parameter tensors (an optimizer step has a fixed cost per tensor; 0: not known)
    param_tensors: int = 0
    #: PowerSGD pricing (optional): sum of ``shape[0] + numel / shape[0]`` over parameters with ndim >= 2, and the
    #: elements of parameters with ndim < 2; None: estimated (:meth:`powersgd_dims`)
    matrix_dims: float | None = None
    vector_params: int | None = None
    #: bytes per sample the layer's backward adds at its peak beyond its saved activations (0: not measured)
    backward_peak_bytes: float = 0.0
    #: share of the backward that computes the parameters' gradients (W; the rest is B, the input's gradient), in
    #: [0, 1]; None: not measured (:meth:`backward_split` gives the default)
    weight_grad_fraction: float | None = None
    #: the split backward's ``B + W`` time over one ordinary backward (> 0); None: not measured (1 is priced)
    backward_split_overhead: float | None = None
    #: tokens per sample along the sequence; None: the layer is not split along it (see
    #: :mod:`uniap_lightning.planner.profile`)
    sequence_length: int | None = None
    #: query heads of attention across the sequence (0: the layer works token by token)
    attention_heads: int = 0
    #: key/value heads (grouped-query attention); None: ``attention_heads``
    kv_heads: int | None = None
    #: the layer's tensor-parallel plan has a sequence-parallel form
    sequence_parallel: bool = False
    #: the chain's last layer only: the loss runs on its sequence pieces where it splits the sequence (no gather
    #: into whole sequences before the loss; the runtime's ``piece_loss``)
    loss_on_pieces: bool = False
    #: experts of a mixture-of-experts layer (0: a dense layer); each token goes to ``top_k`` of them
    experts: int = 0
    top_k: int = 1
    #: parameters inside the experts (part of ``params``): what expert parallelism splits
    expert_params: int = 0
    #: expert capacity over a balanced share (dispatch buffers of ``capacity_factor`` x the routed tokens); None:
    #: dropless
    capacity_factor: float | None = None

    def powersgd_dims(self) -> tuple[float, float]:
        """``(matrix_dims, vector_params)``: the profiled values, else every tensor taken as a square matrix."""
        if self.matrix_dims is not None:
            return float(self.matrix_dims), float(self.vector_params or 0)
        tensors = max(self.param_tensors, 1)
        return 2.0 * math.sqrt(self.params / tensors) * tensors, float(self.vector_params or 0)

    def backward_split(self) -> float:
        """The weight-gradient share of the backward to price with: the measured ``weight_grad_fraction``, else
        :data:`DEFAULT_WEIGHT_GRAD_FRACTION` for a layer with parameters (a linear layer's input and weight
        gradients are two matrix products of the same flops) and 0 for one without."""
        if self.weight_grad_fraction is not None:
            return self.weight_grad_fraction
        return DEFAULT_WEIGHT_GRAD_FRACTION if self.params > 0 else 0.0

    def split_overhead(self) -> float:
        """What splitting the backward multiplies it by: the measured ``backward_split_overhead``, else 1."""
        return self.backward_split_overhead if self.backward_split_overhead is not None else 1.0

    @property
    def forward_fraction(self) -> float:
        """Forward's share of forward + backward (what recomputing the layer adds to its backward)."""
        if self.timings:
            t = max(self.timings, key=lambda x: x.micro_batch)
            f, b = t.forward_s, t.backward_s
        else:
            f, b = self.forward_s, self.backward_s
        return f / (f + b) if f + b > 0 else 0.5

    def overhead_s(self, kind: str, degree: int, samples: float) -> float | None:
        """Measured extra seconds of ``kind`` at ``degree`` for ``samples`` per device (None when not measured):
        linear between the measured micro-batch sizes, extended flat beyond them."""
        pts = sorted((o.micro_batch, o.seconds) for o in self.overheads if o.kind == kind and o.degree == degree)
        if not pts:
            return None
        if samples <= pts[0][0]:
            return pts[0][1]
        for (m0, s0), (m1, s1) in zip(pts, pts[1:]):
            if samples <= m1:
                return s0 + (s1 - s0) * (samples - m0) / (m1 - m0)
        return pts[-1][1]

    def compute_s(self, samples: float) -> float:
        """Forward + backward seconds for ``samples`` samples on one device (interpolated when timed)."""
        if len(self.timings) >= 2:
            pts = sorted(self.timings, key=lambda t: t.micro_batch)
            lo, hi = pts[0], pts[-1]
            for a, b in zip(pts, pts[1:]):
                if samples <= b.micro_batch:
                    lo, hi = a, b
                    break
            ta, tb = lo.forward_s + lo.backward_s, hi.forward_s + hi.backward_s
            slope = (tb - ta) / (hi.micro_batch - lo.micro_batch)
            linear = ta + slope * (samples - lo.micro_batch)
            if samples < lo.micro_batch:
                # below the smallest timed size a steep first segment would extrapolate to ~0: never less than
                # the smallest size's time per sample (fixed costs only make small calls dearer per sample)
                return max(linear, ta * samples / lo.micro_batch)
            return max(linear, 0.0)
        return (self.forward_s + self.backward_s) * samples
