"""The language-model head with its vocabulary split (``tp > 1``) is traced as Megatron's vocabulary-parallel loss
(``reference_layers._VocabParallelLoss``): eight passes over the logits forward and two backward, advanced indexing
priced by the elements it picks, and its all-reduces (the input's gradient, three per-token numbers) in the head's
tensor-parallel overhead; with the whole vocabulary (``tp = 1``) the head keeps torch's ``cross_entropy``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from uniap_lightning.planner.config import cluster_from, load_group, model_spec_from  # noqa: E402
from uniap_lightning.profiling.pricing import analytic_profile  # noqa: E402
from uniap_lightning.planner.cost.comm import all_reduce_s  # noqa: E402
from uniap_lightning.profiling import roofline as R  # noqa: E402

S, H, V = 128, 64, 1024
KEY = (S, H, V, True, torch.float32)


def _names(ops) -> list[str]:
    return [op.name.removeprefix("aten.") for op in ops]


def test_whole_vocabulary_head_keeps_torch_cross_entropy():
    tr = R.cached_trace("lm_head", KEY, 2, 1)
    assert "_log_softmax" in _names(tr.forward) and "max" not in _names(tr.forward)


def test_split_vocabulary_head_runs_megatrons_passes():
    tr = R.cached_trace("lm_head", KEY, 2, 4)
    logits = 2 * S * (V // 4) * 4.0  # bytes of the fp32 logits one rank holds
    fwd, bwd = _names(tr.forward), _names(tr.backward)
    for name in ("max", "exp", "log", "index"):
        assert name in fwd
    # passes over the logits: max 1, shift 2, exp 2, row sum 1, softmax 2 (forward); update 2 (backward)
    full = lambda ops: sum(op.bytes for op in ops if op.shape is None and op.bytes >= logits) / logits  # noqa: E731
    assert full(tr.forward) == pytest.approx(8.0, rel=0.01)
    assert full(tr.backward) == pytest.approx(2.0, rel=0.01)
    picked = [op for op in tr.forward + tr.backward if op.name.startswith("aten.index")]
    # per token: two int64 indices (the row, the target) and the picked fp32 logit read and written, not the row
    assert picked and all(op.bytes == pytest.approx(2 * S * (8 + 8 + 2 * 4)) for op in picked)
    assert "index_put_" in bwd


def test_split_vocabulary_head_overhead_carries_its_all_reduces():
    cluster = cluster_from(dict(load_group("cluster", "gh200_clariden"), nodes=1))
    spec = model_spec_from("opt_350m_megatron")
    profile = analytic_profile(spec, cluster)
    head = profile.layers[-1]
    rows = {(o.degree, o.micro_batch): o.seconds for o in head.overheads if o.kind == "tp"}
    costs = R.layer_costs("lm_head", (2048, 1024, spec.vocab, True, torch.float32), cluster.device_spec, "tf32",
                          [4], floor_s=cluster.kernel_floor_us * 1e-6)
    (mb, sliced), (_, f1, b1) = costs.tp_timings[4][0], costs.timings[0]
    comm = all_reduce_s(cluster, mb * 2048 * 1024 * 4, 4, False) + 3 * all_reduce_s(cluster, mb * 2048 * 4.0, 4,
                                                                                    False)
    assert rows[(4, mb)] == pytest.approx(sliced - (f1 + b1) / 4 + comm, rel=1e-9)
