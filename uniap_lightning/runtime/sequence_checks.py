"""What context and sequence parallelism can run (:mod:`.sequence`), checked in one line from the plan and the layer
before any process-group work: the Ulysses degree against the heads, a layer's declared sequence behaviour
(``uniap_sequence()``) and context-parallel hooks, ring attention without attention dropout, and the sequence length
every batch must be a multiple of.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from uniap_lightning.errors import UniAPError
from uniap_lightning.runtime.payload import flatten, is_payload

#: Context-parallel methods this runtime executes (ring: :mod:`uniap_lightning.runtime.ring`, any device).
CP_METHODS = ("ulysses", "ring")


def check_ulysses(*, heads: int, cp: int, tp: int = 1, seq_len: int | None = None, name: str = "layer") -> None:
    """Refuse a Ulysses degree the layer cannot run, in one line naming the numbers."""
    if cp < 1 or tp < 1:
        raise UniAPError(f"{name}: context-parallel degree cp={cp} and tensor-parallel degree tp={tp} must be >= 1")
    if heads % tp:
        raise UniAPError(f"{name}: {heads} attention heads are not divisible by tp={tp}")
    if (heads // tp) % cp:
        raise UniAPError(
            f"{name}: Ulysses needs the attention heads per tensor-parallel rank ({heads} heads / tp={tp} = "
            f"{heads // tp}) divisible by cp={cp}; choose cp in {_divisors(heads // tp)}"
        )
    if seq_len is not None and seq_len % cp:
        raise UniAPError(f"{name}: sequence length {seq_len} is not divisible by cp={cp}; pad it to a multiple of {cp}")


def _divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


def sequence_info(layer: nn.Module) -> dict[str, Any] | None:
    """What ``layer`` declares about the sequence (``uniap_sequence()``): ``attention_heads`` (0: token-wise),
    ``kv_heads``, ``sequence_parallel``; ``None`` when it declares nothing, no hook or a hook returning ``None``
    (it is then never split along it)."""
    hook = getattr(layer, "uniap_sequence", None)
    declared = None if hook is None else hook()
    if declared is None:
        return None
    info = dict(declared)
    heads = int(info.get("attention_heads", 0))
    return {"attention_heads": heads, "kv_heads": int(info.get("kv_heads") or heads) if heads else None,
            "sequence_parallel": bool(info.get("sequence_parallel", hasattr(layer, "uniap_sp_plan")))}


def check_sequence_strategy(layer: nn.Module, name: str, *, cp: int, cp_method: str, tp: int, sp: bool) -> None:
    """Refuse, in one line, a layer strategy with context or sequence parallelism this runtime cannot execute
    (needs only the plan and the layer: every rank fails alike, before any collective)."""
    where = f"plan layer {name!r} ({type(layer).__name__})"
    if sp and tp > 1 and not hasattr(layer, "uniap_sp_plan"):
        raise UniAPError(f"{where}: sp=true needs a sequence-parallel tensor-parallel plan (uniap_sp_plan), which "
                         "the layer does not have; use sp=false")
    if cp == 1:
        return
    if cp_method not in CP_METHODS:
        raise UniAPError(f"{where}: cp_method={cp_method!r} is not executable; supported: {list(CP_METHODS)}")
    info = sequence_info(layer)
    cp_modules = [m for m in layer.modules() if hasattr(m, "uniap_enable_cp")]
    if info is None and not cp_modules:
        raise UniAPError(f"{where}: cp={cp} splits the sequence, but the layer declares no sequence behaviour "
                         "(uniap_sequence() / uniap_enable_cp); use cp=1 for it")
    heads = info["attention_heads"] if info is not None else 0
    if heads == 0 and cp_modules and info is None:
        raise UniAPError(f"{where}: cp={cp} needs the layer's attention heads (uniap_sequence()); use cp=1 for it")
    if heads and not cp_modules:
        raise UniAPError(f"{where}: cp={cp} needs its attention to run over the split sequence, which the layer "
                         "does not support (no uniap_enable_cp); use cp=1 for it")
    for m in cp_modules:
        if cp_method not in m.uniap_cp_methods():
            raise UniAPError(f"{where}: {type(m).__name__} supports context parallelism {m.uniap_cp_methods()}, "
                             f"not {cp_method!r}")
    if cp_method == "ring":
        dropout = attention_dropout(layer)
        if dropout > 0:
            raise UniAPError(f"{where}: ring attention does not run attention dropout (p={dropout}); set the "
                             "model's attention dropout to 0 or use cp_method='ulysses'")
    elif heads:
        check_ulysses(heads=heads, cp=cp, tp=tp, name=where)


#: config fields that hold a Hugging Face attention's dropout probability (Llama, GPT-2, BERT)
ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def attention_dropout(layer: nn.Module) -> float:
    """The largest attention-dropout probability a layer's modules declare: ``uniap_attention_dropout()``, or a
    Hugging Face attention's config (:data:`ATTENTION_DROPOUT_KEYS`) on modules switched with ``uniap_enable_cp``."""
    found = [0.0]
    for m in layer.modules():
        hook = getattr(m, "uniap_attention_dropout", None)
        if callable(hook):
            found.append(float(hook()))
        config = getattr(m, "config", None)
        if config is not None and type(m).__name__.endswith("Attention"):
            found += [float(v) for key in ATTENTION_DROPOUT_KEYS
                      if isinstance(v := getattr(config, key, None), (int, float))]
    return max(found)


def sequence_multiple(plan: Any) -> int:
    """What every sequence's length must be a multiple of under ``plan``: the lcm over its layers of ``cp``
    (``cp x tp`` where sequence parallelism splits each cp piece again; ``2 cp`` for ring attention's halves)."""
    out = 1
    for lp in plan.layers:
        st = lp.strategy
        ring = 2 if st.cp > 1 and getattr(st, "cp_method", "ulysses") == "ring" else 1
        out = math.lcm(out, st.cp * ring * (st.tp if st.sp else 1))
    return out


def check_sequence_length(plan: Any, x: Any) -> None:
    """Refuse, in one line and on every rank alike (all load the same batch), a batch whose sequences the plan's
    context / sequence parallelism cannot split evenly."""
    multiple = sequence_multiple(plan)
    if multiple == 1 or not is_payload(x):
        return
    seq = next((t for t in flatten(x) if t.dim() >= 2), None)
    if seq is not None and seq.shape[1] % multiple:
        raise UniAPError(
            f"the batch's sequence length {seq.shape[1]} is not divisible by {multiple}, the pieces the plan's "
            f"context / sequence parallelism splits each sequence into; pad sequences to a multiple of {multiple}")
