"""The profile file: a public JSON format (documented in the README, ``format_version`` 1).

One record per layer of the chain, in order::

    {
      "format_version": 1,
      "model": "gpt2_small",          # free text, shown in reports
      "source": "analytic",           # "analytic" | "measured"
      "device": "A100-80GB",          # free text
      "layers": [
        {"name": "embed",
         "forward_s": 1.2e-5,          # forward seconds per sample on one device
         "backward_s": 2.4e-5,         # backward seconds per sample
         "params": 38597376,           # parameter count
         "activation_bytes": 1.6e6,    # bytes per sample saved for backward
         "output_bytes": 1.5e6,        # bytes per sample of the layer's output (what crosses a boundary)
         "tp_degrees": [1, 2, 4, 8],   # tensor-parallel degrees this layer supports
         "tp_allreduces": 1,           # activation all-reduces per pass under tensor parallelism
         # optional:
         "activation_tp_fraction": 0.8,  # share of activation_bytes that tensor parallelism splits (default 1)
         "timings": [{"micro_batch": 1, "forward_s": ..., "backward_s": ...}, ...],  # per-call seconds
         "overheads": [{"kind": "tp", "degree": 2, "micro_batch": 8, "seconds": 0.004}, ...],
         "param_tensors": 4,            # trainable parameter tensors (optimizer step cost per tensor)
         "matrix_dims": 4096,           # sum over parameters with ndim >= 2 of shape[0] + numel / shape[0]
         "vector_params": 2048,         # elements in parameters with ndim < 2 (biases, norms)
         "backward_peak_bytes": 3.1e6,  # bytes per sample the backward adds at its peak (default 0)
         "weight_grad_fraction": 0.35,  # weight-gradient share of the backward (default: 0.5 with params, else 0)
         "backward_split_overhead": 1.15,  # split backward's time over one ordinary backward (default 1)
         "sequence_length": 2048,       # tokens per sample along the sequence (absent: not split along it)
         "attention_heads": 32,         # heads of attention across the sequence (0: token-wise layer)
         "kv_heads": 8,                 # key/value heads (grouped-query attention; default attention_heads)
         "sequence_parallel": true,     # has a tensor-parallel plan with sequence parallelism (default false)
         "loss_on_pieces": true,        # last layer: the loss runs on sequence pieces, no gather (default false)
         "experts": 8,                  # experts of a mixture-of-experts layer (absent or 0: a dense layer)
         "top_k": 2,                    # experts each token is routed to (default 1)
         "expert_params": 1409286144,   # parameters inside the experts (part of params; default 0)
         "capacity_factor": 1.25        # tokens an expert takes over its balanced share (absent: dropless)
        }, ...]
    }

``activation_bytes`` counts each storage autograd keeps for backward once (parameters excluded).
``backward_peak_bytes`` (optional, measured) is what the layer's backward holds at its peak beyond those: the
gradient it receives, the one it hands back, and its temporaries; the cost model adds the largest of a stage's
layers to the stage's memory (only one layer runs its backward at a time).

``weight_grad_fraction`` (optional, measured, in [0, 1]) is the share of the layer's backward that computes the
gradients of its parameters (W), the rest computing the gradient of its input (B): zero-bubble pipeline schedules
run B when the gradient arrives and move W into the bubbles, so their cost model needs ``backward time x
fraction`` per layer. The profiler times the two halves as ``torch.distributed.pipelining`` runs them
(:mod:`uniap_lightning.profiling.backward_split`); a layer whose input never needs a gradient (the first) has 1,
a layer without parameters 0. Absent (analytic, structural and older profiles), :meth:`LayerProfile.backward_split` uses
0.5 for a layer with parameters (a linear layer's input and weight gradients cost the same flops) and 0 without.
``backward_split_overhead`` (optional, measured, > 0) is the time of the two halves over the time of one ordinary
backward of the layer: the split walks the graph twice, so a zero-bubble schedule's backward is that much slower
(1.1-1.3 for a GPT-2 block on this project's CPU host). Absent, :meth:`LayerProfile.split_overhead` uses 1 (the
zero-bubble paper's assumption, and what a GPU's large kernels come close to).
Readers of ``format_version`` 1 ignore fields they do not know, so a profile with them still loads in older
versions (which then price zero-bubble schedules without them).

The sequence fields (optional) say what the planner may split along the sequence. ``sequence_length`` is the
tokens per sample of the layer's input: with it the layer may run with its sequence split over ``cp`` ranks
(context parallelism, ``cp`` dividing it); without it, not. ``attention_heads`` 0 (the default) says the layer works
token by token (embeddings, MLPs, norms, a per-token LM head and its loss: a split sequence costs it nothing);
``a > 0`` says it holds attention over the whole sequence with ``a`` query heads and ``kv_heads`` key/value heads,
which under context parallelism moves data: Ulysses (all-to-alls; ``a / tp`` divisible by ``cp``) or ring attention
(where the cluster runs it). ``sequence_parallel`` says the layer's tensor-parallel plan has a
sequence-parallel form (norms and dropout on sequence shards; Korthikanti et al. 2022): its activations that tensor
parallelism alone does not split are then split too. All four are written by the analytic profiles and by adapters
that declare them; readers of ``format_version`` 1 that predate them ignore them. ``loss_on_pieces`` (the last
layer only) says the chain's loss runs on the sequence pieces a split last layer leaves (a per-token loss, or a
next-token loss with labels shifted before the split: ``uniap_sequence_loss``), so a plan that splits the last
layer's sequence pays no all-gather of its output into whole sequences before the loss; absent, it does.

The expert fields (optional) describe a mixture-of-experts layer (a router sends each token to ``top_k`` of
``experts`` experts): with ``experts`` the planner may split the experts over ``ep`` data-parallel ranks (expert
parallelism; ``ep`` divides ``experts``), which divides the ``expert_params`` (the parameters inside the experts,
counted in ``params`` too; the router, attention and shared experts are the rest) and their gradients and optimizer
state by ``ep`` and moves every routed token by all-to-all (dispatch and combine, forward and backward).
``capacity_factor`` is the layer's expert capacity over a balanced share (GShard / Switch): the dispatch buffers
hold that many times the routed tokens (absent: dropless, the routed tokens alone). Readers that predate them ignore
them (and never split the experts).

When ``timings`` lists two or more micro-batch sizes, compute time for ``m`` samples is interpolated (and
extrapolated) linearly between them instead of assuming ``m * forward_s``.

``overheads`` (optional) are measured costs of running the layer under a strategy, per forward + backward of one
micro-batch of ``micro_batch`` samples on each device, *beyond* the layer's divided compute: for ``kind="tp"``
(tensor parallel over ``degree`` devices) the measured time minus the single-device time / ``degree`` (so it holds
the activation all-reduces, the compute tensor parallelism does not split, and the per-call dispatch cost); for
``kind="fsdp"`` (sharded over ``degree`` devices, no TP) the measured time minus the single-device time (weight
all-gathers, gradient reduce-scatter, FSDP's own per-call work); for ``kind="dp"`` (replicated over ``degree``
devices, no TP) the time of a forward + backward whose gradient average is started during the backward and waited
for, minus the single-device time (the all-reduce as it runs beside the backward in training: on CPU ranks that
share cores it also slows the backward; on a GPU it may overlap); for ``kind="zero2"`` / ``"zero1"`` (those
modes over ``degree`` devices, no TP) one whole step's forward + backward with the mode's gathers, gradient
reduction and resharding, minus the single-device time. Where present, the cost model uses them instead
of its formulas for those terms (``dp``, ``zero2``, ``zero1``: once per optimizer step, in place of the gradient and parameter collectives'
formulas; the others
per micro-batch), interpolated linearly in the micro-batch size; elsewhere the formulas apply.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import read_json, write_json_atomic
from uniap_lightning.planner.fields import MAX_COUNT, array, short

PROFILE_FORMAT_VERSION = 1
#: the largest magnitude of any number in a profile (seconds, bytes, counts): far beyond any real figure, and
#: small enough that the cost model's sums and products stay finite floats
MAX_PROFILE_NUMBER = 1e30
#: each field's sane range, checked when a profile is read, so the planner's programs never see a coefficient no
#: solver takes (a profile with ``tp_allreduces`` of 1e18 made HiGHS fail): a second per sample or call at most a
#: million, a layer's bytes per sample at most a pebibyte, its parameters at most ten trillion, a count of
#: collectives, tensors, heads or experts at most a million, a sequence at most a billion tokens
MAX_PROFILE_SECONDS = 1e6
MAX_PROFILE_BYTES = float(2**50)
MAX_PROFILE_PARAMS = 10**13
MAX_PROFILE_COUNT = 10**6
MAX_PROFILE_TOKENS = 10**9
#: micro-batch sizes a timing or overhead is measured at (the planner's largest global batch)
MAX_PROFILE_MICRO_BATCH = 10**9
#: ``capacity_factor`` and ``backward_split_overhead`` are ratios near 1
MAX_PROFILE_RATIO = 1e3
_REQUIRED = ("name", "forward_s", "backward_s", "params", "activation_bytes", "output_bytes", "tp_degrees", "tp_allreduces")


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
    """Costs of one layer of the chain on one device (see the module docstring for units)."""

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
    #: tokens per sample along the sequence; None: the layer is not split along it (see the module docstring)
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


#: the start of the fingerprint of an analytic profile (a plan made by `uniap plan` for a ``model`` config)
ANALYTIC_FINGERPRINT_PREFIX = "analytic-"


def describes_a_config(fingerprint: str) -> bool:
    """Whether a plan's ``model_fingerprint`` is an analytic profile's (see :meth:`ModelProfile.fingerprint`)."""
    return fingerprint.startswith(ANALYTIC_FINGERPRINT_PREFIX)


@dataclass
class ModelProfile:
    """A chain of layer profiles."""

    model: str
    layers: list[LayerProfile]
    source: str = "analytic"
    device: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_params(self) -> int:
        return sum(lp.params for lp in self.layers)

    def fingerprint(self) -> str:
        """A short hash of the chain's structure (names, parameters, output sizes), not of its timings. An analytic
        profile's starts with :data:`ANALYTIC_FINGERPRINT_PREFIX`: it identifies a model *description* (a ``model``
        config), whose sizes a module's measured profile does not reproduce (the analytic head outputs the loss,
        a module's head the logits), so the runtime compares only what both have (:func:`describes_a_config`)."""
        key = json.dumps([(lp.name, lp.params, round(lp.output_bytes)) for lp in self.layers])
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return ANALYTIC_FINGERPRINT_PREFIX + digest if self.source == "analytic" else digest

    def to_dict(self) -> dict[str, Any]:
        layers = []
        for lp in self.layers:
            d = asdict(lp)
            d["tp_degrees"] = list(lp.tp_degrees)
            d["timings"] = [asdict(t) for t in lp.timings]
            if not d["timings"]:
                del d["timings"]
            d["overheads"] = [asdict(o) for o in lp.overheads]
            if not d["overheads"]:
                del d["overheads"]
            for key in ("matrix_dims", "vector_params", "weight_grad_fraction", "backward_split_overhead",
                        "sequence_length", "kv_heads", "capacity_factor"):
                if d[key] is None:
                    del d[key]
            # written only where they say something
            for key in ("attention_heads", "sequence_parallel", "loss_on_pieces", "experts", "expert_params"):
                if not d[key]:
                    del d[key]
            if not lp.experts and d["top_k"] == 1:
                del d["top_k"]
            if not d["backward_peak_bytes"]:
                del d["backward_peak_bytes"]
            layers.append(d)
        return {
            "format_version": PROFILE_FORMAT_VERSION,
            "model": self.model,
            "source": self.source,
            "device": self.device,
            "meta": self.meta,
            "layers": layers,
        }

    @classmethod
    def from_dict(cls, data: Any, *, origin: str = "profile") -> ModelProfile:
        if not isinstance(data, dict):
            raise UniAPError(f"{origin}: expected a JSON object with a 'layers' list")
        version = data.get("format_version", PROFILE_FORMAT_VERSION)
        if isinstance(version, bool) or version != PROFILE_FORMAT_VERSION:  # true == 1 in Python, not in JSON
            raise UniAPError(f"{origin}: format_version={version} is not supported (expected {PROFILE_FORMAT_VERSION})")
        raw = data.get("layers")
        if not isinstance(raw, list) or not raw:
            raise UniAPError(f"{origin}: field 'layers' must be a non-empty list")
        layers = [_layer_from_dict(item, f"{origin}: layers[{i}]") for i, item in enumerate(raw)]
        if not any(lp.forward_s + lp.backward_s > 0 for lp in layers):
            raise UniAPError(f"{origin}: every layer has forward_s = backward_s = 0; a profile needs the time of at "
                             "least one layer")
        if data.get("meta") is not None and not isinstance(data["meta"], dict):  # null: none; false, [], 0: damaged
            raise UniAPError(f"{origin}: field 'meta' must be an object, got {short(data['meta'])}")
        labels = {}
        for key, default in (("model", "model"), ("source", "measured"), ("device", "")):
            value = data.get(key, default)
            if not isinstance(value, str):  # (null, a number: a damaged file, not the label "None")
                raise UniAPError(f"{origin}: field {key!r} must be a string, got {short(value)}")
            labels[key] = value
        return cls(layers=layers, meta=dict(data.get("meta") or {}), **labels)


def _finite(value: Any) -> bool:
    """A real JSON number (not a boolean or string) that is finite as a float (a 400-digit integer is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _number(item: dict[str, Any], key: str, where: str, *, integer: bool = False, positive: bool = False,
            high: float, unit: str) -> Any:
    """``item[key]``: a finite number >= 0 (> 0 when ``positive``), an integer when ``integer``, at most ``high``
    (``unit`` says what it counts, in the message)."""
    value = item[key]
    if not _finite(value) or abs(value) > MAX_PROFILE_NUMBER:
        raise UniAPError(f"{where}.{key} must be a finite number, got {short(value)}")
    if value < 0 or (positive and value == 0):
        raise UniAPError(f"{where}.{key} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    if value > high:
        limit = f"{int(high):,}" if float(high).is_integer() and high < 1e16 else f"{high:g}"
        raise UniAPError(f"{where}.{key} must be at most {limit} ({unit}), got {short(value)}: no real layer comes "
                         "near it; measure the profile again or fix the field")
    if integer:
        if int(value) != value:
            raise UniAPError(f"{where}.{key} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def _fraction(item: dict[str, Any], key: str, where: str) -> float:
    value = item[key]
    if not _finite(value):
        raise UniAPError(f"{where}.{key} must be a finite number, got {short(value)}")
    if not 0 <= value <= 1:
        raise UniAPError(f"{where}.{key} must be in [0, 1], got {value!r}")
    return float(value)


def _optional_list(item: dict[str, Any], key: str, where: str) -> list[Any]:
    """An optional list field: absent or null reads as empty; anything else but a list is refused."""
    value = item.get(key)
    return [] if value is None else array(value, f"{where}.{key}")


def _layer_from_dict(item: Any, where: str) -> LayerProfile:
    if not isinstance(item, dict):
        raise UniAPError(f"{where} must be an object")
    missing = [k for k in _REQUIRED if k not in item]
    if missing:
        raise UniAPError(f"{where} is missing field(s) {', '.join(repr(m) for m in missing)}")
    degrees = item["tp_degrees"]
    if not isinstance(degrees, list) or not degrees or any(
        isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_COUNT for t in degrees
    ):
        raise UniAPError(f"{where}.tp_degrees must be a non-empty list of positive integers, got {short(degrees)}")
    if 1 not in degrees:
        raise UniAPError(f"{where}.tp_degrees must include 1, got {degrees!r}")
    frac = _fraction(item, "activation_tp_fraction", where) if "activation_tp_fraction" in item else 1.0
    wgrad = _fraction(item, "weight_grad_fraction", where) if item.get("weight_grad_fraction") is not None else None
    timings = []
    for j, t in enumerate(_optional_list(item, "timings", where)):
        tw = f"{where}.timings[{j}]"
        if not isinstance(t, dict) or any(k not in t for k in ("micro_batch", "forward_s", "backward_s")):
            raise UniAPError(f"{tw} needs 'micro_batch', 'forward_s' and 'backward_s'")
        timings.append(
            Timing(
                _number(t, "micro_batch", tw, integer=True, positive=True, high=MAX_PROFILE_MICRO_BATCH,
                        unit="samples"),
                _number(t, "forward_s", tw, high=MAX_PROFILE_SECONDS, unit="seconds per call"),
                _number(t, "backward_s", tw, high=MAX_PROFILE_SECONDS, unit="seconds per call"),
            )
        )
    if len({t.micro_batch for t in timings}) != len(timings):
        raise UniAPError(f"{where}.timings lists a micro_batch size twice")
    overheads = []
    for j, o in enumerate(_optional_list(item, "overheads", where)):
        ow = f"{where}.overheads[{j}]"
        if not isinstance(o, dict) or any(k not in o for k in ("kind", "degree", "micro_batch", "seconds")):
            raise UniAPError(f"{ow} needs 'kind', 'degree', 'micro_batch' and 'seconds'")
        if o["kind"] not in OVERHEAD_KINDS:
            raise UniAPError(f"{ow}.kind must be one of {list(OVERHEAD_KINDS)}, got {o['kind']!r}")
        sec = o["seconds"]
        if not _finite(sec) or abs(sec) > MAX_PROFILE_NUMBER:
            raise UniAPError(f"{ow}.seconds must be a finite number, got {short(sec)}")
        if abs(sec) > MAX_PROFILE_SECONDS:
            raise UniAPError(f"{ow}.seconds must be between -{MAX_PROFILE_SECONDS:,.0f} and {MAX_PROFILE_SECONDS:,.0f} "
                             f"(seconds per micro-batch), got {short(sec)}: no real layer comes near it; measure the "
                             "profile again or fix the field")
        degree = _number(o, "degree", ow, integer=True, positive=True, high=MAX_COUNT, unit="devices")
        if degree < 2:
            raise UniAPError(f"{ow}.degree must be >= 2, got {degree}")
        overheads.append(Overhead(o["kind"], degree, _number(o, "micro_batch", ow, integer=True, positive=True,
                                                           high=MAX_PROFILE_MICRO_BATCH, unit="samples"),
                                  float(sec)))
    if len({(o.kind, o.degree, o.micro_batch) for o in overheads}) != len(overheads):
        raise UniAPError(f"{where}.overheads lists a (kind, degree, micro_batch) twice")
    name = item["name"]
    if not isinstance(name, str) or not name:
        raise UniAPError(f"{where}.name must be a non-empty string")
    return LayerProfile(
        name=name,
        forward_s=_number(item, "forward_s", where, high=MAX_PROFILE_SECONDS, unit="seconds per sample"),
        backward_s=_number(item, "backward_s", where, high=MAX_PROFILE_SECONDS, unit="seconds per sample"),
        params=_number(item, "params", where, integer=True, high=MAX_PROFILE_PARAMS, unit="parameters"),
        activation_bytes=_number(item, "activation_bytes", where, high=MAX_PROFILE_BYTES, unit="bytes per sample"),
        output_bytes=_number(item, "output_bytes", where, high=MAX_PROFILE_BYTES, unit="bytes per sample"),
        tp_degrees=tuple(sorted(set(degrees))),
        tp_allreduces=_number(item, "tp_allreduces", where, integer=True, high=MAX_PROFILE_COUNT,
                              unit="all-reduces per pass"),
        activation_tp_fraction=frac,
        timings=tuple(timings),
        overheads=tuple(overheads),
        param_tensors=_number(item, "param_tensors", where, integer=True, high=MAX_PROFILE_COUNT,
                              unit="tensors") if "param_tensors" in item else 0,
        matrix_dims=_number(item, "matrix_dims", where, high=MAX_PROFILE_PARAMS, unit="elements") if item.get("matrix_dims") is not None else None,
        vector_params=(_number(item, "vector_params", where, integer=True, high=MAX_PROFILE_PARAMS, unit="parameters")
                       if item.get("vector_params") is not None else None),
        backward_peak_bytes=(_number(item, "backward_peak_bytes", where, high=MAX_PROFILE_BYTES, unit="bytes per sample")
                             if item.get("backward_peak_bytes") is not None else 0.0),
        weight_grad_fraction=wgrad,
        backward_split_overhead=(_number(item, "backward_split_overhead", where, positive=True, high=MAX_PROFILE_RATIO,
                                          unit="a ratio of times")
                                 if item.get("backward_split_overhead") is not None else None),
        **_sequence_fields(item, where),
        **_expert_fields(item, where),
    )


_SEQUENCE_BOUNDS: dict[str, dict[str, Any]] = {
    "sequence_length": {"high": MAX_PROFILE_TOKENS, "unit": "tokens"},
    "attention_heads": {"high": MAX_PROFILE_COUNT, "unit": "heads"},
    "kv_heads": {"high": MAX_PROFILE_COUNT, "unit": "heads"},
}
_EXPERT_BOUNDS: dict[str, dict[str, Any]] = {
    "experts": {"high": MAX_PROFILE_COUNT, "unit": "experts"},
    "top_k": {"high": MAX_PROFILE_COUNT, "unit": "experts per token"},
    "expert_params": {"high": MAX_PROFILE_PARAMS, "unit": "parameters"},
}


def _sequence_fields(item: dict[str, Any], where: str) -> dict[str, Any]:
    """The optional sequence fields (see the module docstring), checked against each other."""
    out: dict[str, Any] = {}
    for key in ("sequence_length", "attention_heads", "kv_heads"):
        if item.get(key) is not None:
            out[key] = _number(item, key, where, integer=True, positive=key != "attention_heads",
                               **_SEQUENCE_BOUNDS[key])
    for key in ("sequence_parallel", "loss_on_pieces"):
        if item.get(key) is not None:
            if not isinstance(item[key], bool):
                raise UniAPError(f"{where}.{key} must be true or false, got {short(item[key])}")
            out[key] = item[key]
    heads, kv = out.get("attention_heads", 0), out.get("kv_heads")
    if kv is not None and (heads == 0 or heads % kv):
        raise UniAPError(f"{where}.kv_heads={kv} must divide attention_heads={heads} (grouped-query attention)")
    return out


def _expert_fields(item: dict[str, Any], where: str) -> dict[str, Any]:
    """The optional expert fields (see the module docstring), checked against each other and ``params``."""
    out: dict[str, Any] = {}
    for key in ("experts", "top_k", "expert_params"):
        if item.get(key) is not None:
            out[key] = _number(item, key, where, integer=True, positive=key == "top_k", **_EXPERT_BOUNDS[key])
    if item.get("capacity_factor") is not None:
        out["capacity_factor"] = _number(item, "capacity_factor", where, positive=True, high=MAX_PROFILE_RATIO,
                                          unit="a ratio of tokens")
    experts = out.get("experts", 0)
    if experts and out.get("top_k", 1) > experts:
        raise UniAPError(f"{where}.top_k={out['top_k']} must be at most experts={experts}")
    if out.get("expert_params", 0) > item["params"]:
        raise UniAPError(f"{where}.expert_params={out['expert_params']} must be at most params={item['params']} "
                         "(the experts' parameters are part of the layer's)")
    if not experts and (out.get("expert_params") or "capacity_factor" in out or out.get("top_k", 1) != 1):
        raise UniAPError(f"{where}: top_k, expert_params and capacity_factor need 'experts' > 0 (a mixture-of-experts "
                         "layer)")
    return out


def load_profile(path: str | Path) -> ModelProfile:
    """Read and validate a profile file; errors name the file, the layer and the field."""
    p = Path(path)
    data = read_json(p, "profile file")
    return ModelProfile.from_dict(data, origin=f"profile file {p.name}")


def save_profile(profile: ModelProfile, path: str | Path) -> None:
    write_json_atomic(path, profile.to_dict())
