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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from uniap_lightning.errors import UniAPError
from uniap_lightning.files import read_json, write_json_atomic
from uniap_lightning.planner.fields import short
# the layer record and the file's checks, in modules of their own; imported from here as before
from uniap_lightning.planner.profile_layer import (DEFAULT_WEIGHT_GRAD_FRACTION, OVERHEAD_KINDS, LayerProfile,
                                                   Overhead, Timing)
from uniap_lightning.planner.profile_read import (MAX_PROFILE_BYTES, MAX_PROFILE_COUNT, MAX_PROFILE_MICRO_BATCH,
                                                  MAX_PROFILE_NUMBER, MAX_PROFILE_PARAMS, MAX_PROFILE_RATIO,
                                                  MAX_PROFILE_SECONDS, MAX_PROFILE_TOKENS, layer_from_dict)

__all__ = ["DEFAULT_WEIGHT_GRAD_FRACTION", "MAX_PROFILE_BYTES", "MAX_PROFILE_COUNT", "MAX_PROFILE_MICRO_BATCH",
           "MAX_PROFILE_NUMBER", "MAX_PROFILE_PARAMS", "MAX_PROFILE_RATIO", "MAX_PROFILE_SECONDS",
           "MAX_PROFILE_TOKENS", "OVERHEAD_KINDS", "PROFILE_FORMAT_VERSION", "ANALYTIC_FINGERPRINT_PREFIX",
           "LayerProfile", "ModelProfile", "Overhead", "Timing", "describes_a_config", "load_profile", "save_profile"]

PROFILE_FORMAT_VERSION = 1


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
        layers = [layer_from_dict(item, f"{origin}: layers[{i}]") for i, item in enumerate(raw)]
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


def load_profile(path: str | Path) -> ModelProfile:
    """Read and validate a profile file; errors name the file, the layer and the field."""
    p = Path(path)
    data = read_json(p, "profile file")
    return ModelProfile.from_dict(data, origin=f"profile file {p.name}")


def save_profile(profile: ModelProfile, path: str | Path) -> None:
    write_json_atomic(path, profile.to_dict())
