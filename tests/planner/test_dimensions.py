"""The dimension registry (uniap_lightning.planner.dimensions) against frozen copies of the hand-threaded code it
replaced: the candidate enumeration (``_strategies``, a seven-deep nested loop), ``Strategy.of``, ``label`` and
``check``. The frozen copies are the oracle: the registry must yield the same candidates in the same order, the
same canonical records, labels and errors. Keep them as they are."""

from __future__ import annotations

import itertools
import json
import random
import typing

import pytest

from uniap_lightning.errors import UniAPError
from uniap_lightning.planner import dimensions
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.cost.layer import _strategies, strategies_for
from uniap_lightning.planner.decision import Strategy
from uniap_lightning.planner.profile import LayerProfile

# ---------------------------------------------------------------------------------------------------------------
# the oracle: frozen from uniap_lightning/planner/decision.py and cost/layer.py before the registry (commit ad90784)
_DP_MODES = ("replicate", "zero1", "zero2", "zero3")
_COMPRESSIONS = ("none", "bf16", "powersgd", "topk")
_COMPRESSIBLE_DP_MODES = ("replicate", "zero1")
_DP_LABELS = {"replicate": "dp", "zero1": "z1dp", "zero2": "z2dp", "zero3": "fsdp"}
_CP_METHODS = ("none", "ulysses", "ring")
_CP_LABELS = {"ulysses": "u", "ring": "r"}
_ZERO_LABELS = {"zero1": "z1", "zero2": "z2", "zero3": "fsdp"}


def _old_cp_methods(layer, cp, t, cluster):
    L = layer.sequence_length
    if cp == 1:
        return ("none",)
    if L is None or L % cp:
        return ()
    a = layer.attention_heads
    if a == 0:
        return ("ulysses",)
    out = []
    if a % t == 0 and (a // t) % cp == 0:
        out.append("ulysses")
    if cluster.ring_attention and L % (2 * cp) == 0:
        out.append("ring")
    return tuple(out)


def _old_expert_degrees(layer, replicas):
    E = layer.experts
    return (1,) + tuple(e for e in range(2, replicas + 1) if replicas % e == 0 and E % e == 0) if E else (1,)


def old_strategies(layer, n, cluster, micro_batch, compression, sequence=True):
    dpn = cluster.devices_per_node
    out = []
    for t in layer.tp_degrees:
        if n % t or t > dpn or dpn % t:
            continue
        for c in [c for c in range(1, n // t + 1) if (n // t) % c == 0] if sequence else [1]:
            d = n // (t * c)
            if micro_batch % d:
                continue
            L = layer.sequence_length
            sps = (False, True) if sequence and t > 1 and layer.sequence_parallel and L and L % (c * t) == 0 \
                else (False,)
            for method in _old_cp_methods(layer, c, t, cluster):
                for mode in _DP_MODES if d * c > 1 else ("replicate",):
                    comps = ([m for m in compression if m != "none"]
                             if d * c > 1 and mode in _COMPRESSIBLE_DP_MODES else [])
                    for comp in ("none", *comps):
                        # experts split over the replicas only with uncompressed gradients
                        for ep in _old_expert_degrees(layer, d * c) if comp == "none" else (1,):
                            for sp in sps:
                                for rec in (False, True):
                                    out.append(Strategy(d, t, mode, rec, comp, c, method, sp, ep))
    return tuple(out)


def old_of(dp, tp, dp_mode="replicate", recompute=False, compression="none", cp=1, cp_method="none", sp=False,
           ep=1):
    if dp * cp == 1:
        dp_mode, compression, ep = "replicate", "none", 1
    if cp == 1:
        cp_method = "none"
    if tp == 1:
        sp = False
    return Strategy(int(dp), int(tp), str(dp_mode), bool(recompute), str(compression), int(cp), str(cp_method),
                    bool(sp), int(ep))


def old_label(self):
    parts = []
    if self.dp > 1:
        parts.append(f"{_DP_LABELS.get(self.dp_mode, self.dp_mode)}{self.dp}")
    elif self.cp > 1 and self.dp_mode != "replicate":
        parts.append(_ZERO_LABELS[self.dp_mode])
    if self.cp > 1:
        parts.append(f"cp{self.cp}{_CP_LABELS.get(self.cp_method, self.cp_method)}")
    if self.tp > 1:
        parts.append(f"tp{self.tp}")
    out = "x".join(parts) or "single"
    if self.sp:
        out += "+sp"
    if self.ep > 1:
        out += f"+ep{self.ep}"
    if self.compression != "none":
        out += f"+{self.compression}"
    return out + ("+rc" if self.recompute else "")


def old_faults(self, where, experts=None):
    """The old ``check``'s rules in its order, each message of a rule the record breaks (``check`` raised the
    first); the ep rules after the first broken one are skipped, as the old early returns did."""
    out = []
    if self.dp_mode not in _DP_MODES:
        out.append(f"{where}: dp_mode={self.dp_mode!r} must be one of {_DP_MODES}")
    if self.compression not in _COMPRESSIONS:
        out.append(f"{where}: compression={self.compression!r} must be one of {_COMPRESSIONS}")
    if not isinstance(self.recompute, bool):
        out.append(f"{where}: recompute must be true or false, got {self.recompute!r}")
    if self.cp_method not in _CP_METHODS:
        out.append(f"{where}: cp_method={self.cp_method!r} must be one of {_CP_METHODS}")
    if not isinstance(self.sp, bool):
        out.append(f"{where}: sp must be true or false, got {self.sp!r}")
    if (self.cp > 1) != (self.cp_method != "none"):
        out.append(f"{where}: cp={self.cp} needs cp_method " + (
            f"'ulysses' or 'ring', got {self.cp_method!r}" if self.cp > 1 else f"'none', got {self.cp_method!r}"))
    if self.sp and self.tp == 1:
        out.append(f"{where}: sp (sequence parallelism) needs tp > 1, got tp=1")
    if self.replicas == 1 and (self.dp_mode != "replicate" or self.compression != "none"):
        out.append(
            f"{where}: dp=1 has no data-parallel copies, so dp_mode must be 'replicate' and compression 'none' "
            f"(got {self.dp_mode!r}, {self.compression!r})"
        )
    if self.compression != "none" and self.dp_mode not in _COMPRESSIBLE_DP_MODES:
        out.append(
            f"{where}: compression={self.compression!r} needs dp_mode in {_COMPRESSIBLE_DP_MODES} "
            f"(gradients all-reduced whole), got {self.dp_mode!r}"
        )
    ep = self.ep
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        return out + [f"{where}: ep must be a positive integer, got {ep!r}"]
    if ep == 1:
        return out
    if self.replicas % ep:
        return out + [f"{where}: ep={ep} must divide the dp*cp = {self.replicas} replicas (expert parallelism "
                      "splits the experts over data ranks)"]
    if self.compression != "none":
        return out + [f"{where}: ep={ep} needs compression 'none' (expert and other gradients are reduced "
                      f"over different groups), got {self.compression!r}"]
    if experts is not None and experts == 0:
        return out + [f"{where}: ep={ep} on a layer without experts (only mixture-of-experts layers split "
                      "over ep)"]
    if experts is not None and experts % ep:
        return out + [f"{where}: ep={ep} must divide the layer's {experts} experts"]
    return out


# end of the oracle
# ---------------------------------------------------------------------------------------------------------------


def test_record_fields_are_the_registrys_in_order():
    assert Strategy._fields == dimensions.RECORD == tuple(f.name for f in dimensions.FIELDS)
    assert Strategy._field_defaults == dimensions.defaults()
    assert {f.name: f.type for f in dimensions.FIELDS} == typing.get_type_hints(Strategy)
    # every field belongs to exactly one dimension, and every order names each field once
    owned = [f.name for d in dimensions.DIMENSIONS for f in d.fields]
    assert sorted(owned) == sorted(set(owned)) == sorted(dimensions.RECORD) == sorted(dimensions.CHOICES)


def _layer(rng: random.Random, u: int) -> LayerProfile:
    L = rng.choice([None, 8, 12, 16, 32, 48, 64])
    heads = rng.choice([0, 2, 4, 6, 8, 12]) if L else 0
    experts = rng.choice([0, 0, 2, 4, 6, 8]) if u % 2 else 0
    return LayerProfile(
        name=f"l{u}", forward_s=1e-3, backward_s=2e-3, params=1_000_000 * (1 + u % 5),
        activation_bytes=1e6, output_bytes=1e5,
        tp_degrees=tuple(sorted({1, *rng.sample([2, 3, 4, 8], rng.randint(0, 3))})),
        sequence_length=L, attention_heads=heads, sequence_parallel=bool(L) and rng.random() < 0.6,
        experts=experts, top_k=min(2, experts) or 1, expert_params=500_000 * (1 + u % 5) if experts else 0,
    )


def _cluster(rng: random.Random, k: int) -> Cluster:
    return Cluster(name=f"c{k}", nodes=rng.choice([1, 2, 4]), devices_per_node=rng.choice([1, 2, 4, 8]),
                   memory_gib=16.0, peak_tflops=10, ring_attention=rng.random() < 0.7)


COMPRESSION_SETS = [("none",), ("none", "bf16"), ("none", "powersgd", "topk"), _COMPRESSIONS, ("bf16",),
                    ("none", "topk", "topk")]


def test_enumeration_equals_the_frozen_loop():
    rng = random.Random(40)
    layers = [_layer(rng, u) for u in range(40)]
    clusters = [_cluster(rng, k) for k in range(6)]
    compared = nonempty = moe = seq = 0
    for layer, cluster in itertools.product(layers, clusters):
        for n in sorted({1, 2, 3, 4, 6, 8, cluster.devices_per_node, cluster.nodes * cluster.devices_per_node}):
            for micro_batch in (1, 2, 4, 6, 8):
                for compression in rng.sample(COMPRESSION_SETS, 2):
                    for sequence in (True, False):
                        want = old_strategies(layer, n, cluster, micro_batch, compression, sequence)
                        got = _strategies(layer, n, cluster, micro_batch, compression, sequence)
                        assert got == want, (layer, n, cluster.name, micro_batch, compression, sequence)
                        assert all(type(s) is Strategy for s in got)
                        compared += 1
                        nonempty += bool(want)
                        moe += any(s.ep > 1 for s in want)
                        seq += any(s.cp > 1 or s.sp for s in want)
    # the sample reaches every dimension
    assert compared > 5000 and nonempty > 2000 and moe > 100 and seq > 500, (compared, nonempty, moe, seq)


def test_strategies_for_equals_the_frozen_loop_on_a_moe_sequence_layer():
    layer = LayerProfile(name="moe", forward_s=1e-3, backward_s=2e-3, params=10**7, activation_bytes=1e6,
                         output_bytes=1e5, tp_degrees=(1, 2, 4), sequence_length=64, attention_heads=8,
                         sequence_parallel=True, experts=8, top_k=2, expert_params=5 * 10**6)
    cluster = Cluster(name="x", nodes=2, devices_per_node=4, memory_gib=16.0, peak_tflops=10)
    for n in (1, 2, 4, 8):
        got = strategies_for(layer, n, cluster, 8, compression=_COMPRESSIONS)
        assert got == list(old_strategies(layer, n, cluster, 8, _COMPRESSIONS))
    assert {s.ep for s in got} == {1, 2, 4, 8} and any(s.sp for s in got) and {s.cp_method for s in got} == set(
        _CP_METHODS)


def _records(rng: random.Random, count: int):
    for _ in range(count):
        yield (rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 4]), rng.choice(_DP_MODES), rng.random() < 0.5,
               rng.choice(_COMPRESSIONS), rng.choice([1, 2, 4]), rng.choice(_CP_METHODS), rng.random() < 0.5,
               rng.choice([1, 2, 3, 4]))


def test_of_and_label_equal_the_frozen_code():
    rng = random.Random(7)
    for values in _records(rng, 4000):
        s = Strategy.of(*values)
        assert s == old_of(*values) and type(s) is Strategy
        assert [type(v) for v in s] == [type(v) for v in old_of(*values)]
        assert Strategy.of(**dict(zip(Strategy._fields, values))) == s
        assert s.label() == old_label(s)
        raw = Strategy(*values)
        assert raw.label() == old_label(raw)
    assert Strategy.of(1, 1) == Strategy(1, 1)
    assert Strategy.of(2, 1, dp_mode="zero3", recompute=1) == Strategy(2, 1, "zero3", True)
    with pytest.raises(TypeError):
        Strategy.of(2)
    with pytest.raises(TypeError):
        Strategy.of(2, 1, shard=True)


def _error(fn, *args):
    try:
        fn(*args)
    except UniAPError as e:
        return str(e)
    return None


def _agrees(s, experts):
    """The registry's check against the frozen rules: no error where none was broken; the same message where one
    was; where several were, one of theirs (the registry checks every field's own vocabulary first, then each
    dimension's rules in its order: the first message of a record with several faults may differ)."""
    new, old = _error(s.check, "w", experts), old_faults(s, "w", experts)
    if len(old) <= 1:
        assert new == (old[0] if old else None), (s, experts, new, old)
    else:
        assert new in old, (s, experts, new, old)
    return len(old)


def test_check_equals_the_frozen_code():
    rng = random.Random(11)
    bad_values = {"dp_mode": "zero4", "compression": "gzip", "recompute": "yes", "cp_method": "tree", "sp": 1,
                  "ep": 0}
    counts = [0, 0, 0]
    for values in _records(rng, 3000):
        canonical = old_of(*values)
        for experts in (None, 0, 4, 6):
            counts[min(_agrees(canonical, experts), 2)] += 1
        field = rng.choice(sorted(bad_values))  # one field out of its vocabulary
        counts[min(_agrees(canonical._replace(**{field: bad_values[field]}), None), 2)] += 1
        for experts in (None, 0, 4):  # the raw record: relational faults
            counts[min(_agrees(Strategy(*values), experts), 2)] += 1
    assert min(counts) > 1000, counts


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_plan_json_layer_reading_by_version(version):
    """Each field reads from the format version that added it; older versions read the defaults (version 1's
    ``shard`` becomes ``dp_mode``)."""
    from uniap_lightning.planner.plan_read import _layer_from_dict

    x = {"name": "a", "stage": 0, "dp": 2, "tp": 2, "dp_mode": "zero1", "shard": True, "recompute": True,
         "compression": "bf16", "cp": 2, "cp_method": "ring", "sp": True, "ep": 2}
    s = _layer_from_dict(json.loads(json.dumps(x)), 0, version).strategy
    want = {1: Strategy(2, 2, "zero3"), 2: Strategy(2, 2, "zero1", True, "bf16"),
            3: Strategy(2, 2, "zero1", True, "bf16"), 4: Strategy(2, 2, "zero1", True, "bf16", 2, "ring", True, 2)}
    assert s == want[version] and [type(v) for v in s] == [type(v) for v in want[version]]
    missing = {k: v for k, v in x.items() if k not in ("dp_mode", "shard")}
    with pytest.raises(UniAPError, match="shard" if version == 1 else "dp_mode"):
        _layer_from_dict(missing, 0, version)
    with pytest.raises(UniAPError, match=r"plan layer 0 \(a\): tp"):
        _layer_from_dict({**x, "tp": 0}, 0, version)
    if version >= 4:
        with pytest.raises(UniAPError, match=r"plan layer 0 \(a\): cp"):
            _layer_from_dict({**x, "cp": 0}, 0, version)
        with pytest.raises(UniAPError, match=r"plan layer 0 \(a\): sp"):
            _layer_from_dict({**x, "sp": "true"}, 0, version)
    else:  # fields of later versions are not read
        assert _layer_from_dict({**x, "cp": "junk", "sp": "junk"}, 0, version).strategy == want[version]


def test_an_opt_in_is_declared_once_and_read_through_the_registry(monkeypatch):
    """An opt-in dimension's option is declared on its ``OptIn`` only: `uniap plan`'s option (type, help), the
    problem's ``opt_ins`` (every option, resolved; off: ``()``), and ``evaluate``'s check of a pinned plan (the
    values a layer may use, the reason a value is refused) come from :data:`dimensions.OPT_INS`."""
    import dataclasses
    import importlib

    from planner_factories import fp8_problem

    from uniap_lightning.planner.config_schema import plan_schema
    from uniap_lightning.planner.problem import Problem

    ev = importlib.import_module("uniap_lightning.planner.cost.evaluate")  # the module (the package re-exports
    # its function under the same name)

    schema = {f.name: f for f in dataclasses.fields(plan_schema())}
    assert dimensions.OPT_INS
    for name, o in dimensions.OPT_INS.items():
        assert schema[name].type == typing.Optional[o.type] and schema[name].default is None  # noqa: UP007
        assert o.help and schema[name].metadata["help"] == o.help
        assert o.values and ev._EVERY_OPT_IN[name] == o.values
    problem = fp8_problem(3, num_layers=3, nodes=1, per_node=2, memory_gib=16.0, fp8=(), device="a100_80gb")
    assert problem.opt_ins == {name: () for name in dimensions.OPT_INS}
    with pytest.raises(UniAPError, match="unknown opt-in option"):
        Problem(problem.model, problem.cluster, problem.training, opt_ins={"fp16": "auto"})
    layer, cluster = problem.model.layers[1], problem.cluster
    s = Strategy(2, 1, "zero1")._replace(precision="fp8")  # a100: no float8 matmuls
    assert "needs a device with float8 matmuls" in ev.why_not_allowed(layer, s, cluster, 2)
    monkeypatch.setitem(dimensions.OPT_INS, "fp8", dataclasses.replace(
        dimensions.OPT_INS["fp8"], why_not=lambda _layer, _s, _cluster: "the opt-in's own reason"))
    assert ev.why_not_allowed(layer, s, cluster, 2) == "the opt-in's own reason"
