"""Setup says how long it will measure, in one line, before it measures anything (issue 42, item 5): every phase
(layer timing, TP/FSDP timing, cluster links) and the first steps, from the model's size and a quick measurement;
the hint names the override the command at hand takes."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from uniap_lightning.cli.estimate import CORPUS_VOCAB, config_work
from uniap_lightning.planner.analytic import ModelSpec
from uniap_lightning.profiling.pricing import analytic_profile
from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.profiling import estimate as est
from uniap_lightning.profiling.estimate import Prediction, Rates, Work, estimate_line, predict, profile_sizes
from uniap_lightning.profiling.rates import measure_rates
from uniap_lightning.profiling.timing import CPU_FLUSH_BYTES
from uniap_lightning.setup.estimate import forward_flops

RATES = Rates(flops_per_s=1e9, flush_s=0.0, memory_bytes_per_s=1e10, link_bytes_per_s=1e9)


def _work(**kw: Any) -> Work:
    base: dict[str, Any] = dict(flops=[1e6, 4e6, 4e6], params=[10, 100, 100], distinct=[(0, [1]), (1, [1, 2])],
                                rows=16)
    return Work(**{**base, **kw})


@pytest.fixture
def compute_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No fixed per-run costs: every second is compute."""
    monkeypatch.setattr(est, "RUN_S", 0.0)
    monkeypatch.setattr(est, "STRATEGY_RUN_S", 0.0)


def test_layer_timing_counts_every_run_of_every_size(compute_only: None) -> None:
    w = _work(repeats=3)
    rate = RATES.flops_per_s * est.LAYER_EFFICIENCY
    sizes = profile_sizes(16, None)
    assert sizes == [2, 4, 16]
    per_sample = 3 * sum(w.flops) / rate  # forward + backward
    # the loss check at the smallest size (forward), (warm-up + 3) runs per size, 2 more runs for the split
    expected = 2 * sum(w.flops) / rate + 4 * sum(sizes) * per_sample + 2 * 16 * per_sample
    p = predict(w, RATES)
    assert p.layers_s == pytest.approx(expected)
    assert p.strategies_s == 0 and p.cluster_s == 0  # one process: neither


def test_fewer_repeats_and_sizes_shorten_it(compute_only: None) -> None:
    three, one = predict(_work(repeats=3), RATES), predict(_work(repeats=1), RATES)
    assert one.layers_s < three.layers_s
    assert predict(_work(micro_batches=[16]), RATES).layers_s < three.layers_s


def test_tp_fsdp_timing_covers_the_distinct_layers_only(compute_only: None) -> None:
    two = dict(world=2, devices_per_node=2, everywhere=True, measure_cluster=True)
    p = predict(_work(**two), RATES)
    assert p.strategies_s > 0 and p.cluster_s == est.CLUSTER_S
    assert p.setup_s == pytest.approx(p.layers_s + p.strategies_s + p.cluster_s)
    # a third distinct layer adds its runs; the same layers listed as one kind do not change the layer timing
    more = predict(_work(distinct=[(0, [1]), (1, [1, 2]), (2, [1, 2])], **two), RATES)
    assert more.strategies_s > p.strategies_s and more.layers_s == p.layers_s
    # TP is timed only where the layer supports the degree
    no_tp = predict(_work(distinct=[(0, [1]), (1, [1])], **two), RATES)
    assert no_tp.strategies_s < p.strategies_s


def test_the_steps_scale_with_the_batch_and_their_count() -> None:
    one = predict(_work(steps=1, samples_per_rank=8), RATES)
    assert predict(_work(steps=3, samples_per_rank=8), RATES).steps_s == pytest.approx(3 * one.steps_s)
    assert predict(_work(steps=1, samples_per_rank=16), RATES).steps_s > one.steps_s


def test_the_line_is_one_line_with_every_phase_and_the_override_given() -> None:
    p = Prediction(layers_s=95.0, strategies_s=130.0, cluster_s=3.0, steps_s=4.0, steps=2)
    line = estimate_line(p, repeats=3, override="strategy.profile_repeats=1", more="or profile=FILE")
    assert "\n" not in line and line.startswith("UniAP: setup will measure for about 3.8 min")
    assert "layer timing 95 s, TP/FSDP timing 2.2 min, cluster links 3.0 s" in line
    assert "the first 2 steps take about 4.0 s" in line
    assert "strategy.profile_repeats=1 (now 3)" in line and "or profile=FILE" in line
    assert "profile_repeats" not in estimate_line(p, repeats=1, override="strategy.profile_repeats=1")


def test_the_quick_measurement_is_positive_and_keeps_the_thread_count() -> None:
    threads = torch.get_num_threads()
    r = measure_rates("cpu", threads=1)
    assert r.flops_per_s > 1e6 and r.flush_s > 0 and r.memory_bytes_per_s == pytest.approx(CPU_FLUSH_BYTES / r.flush_s)
    assert torch.get_num_threads() == threads


def test_the_cli_constants_match_what_they_mirror() -> None:
    from uniap_lightning.data import VOCAB_SIZE

    assert CORPUS_VOCAB == VOCAB_SIZE


def test_counted_flops_match_the_analytic_model_of_the_same_gpt() -> None:
    from uniap_lightning.adapters.gpt import GPT, GPTConfig

    gpt = GPT(GPTConfig(vocab_size=CORPUS_VOCAB, block_size=64, n_layer=2, n_head=4, n_embd=64))
    counted = forward_flops(list(gpt.named_layers().values()), torch.zeros(1, 64, dtype=torch.long))
    spec = ModelSpec.from_dict({"name": "t", "family": "gpt2", "layers": 2, "hidden": 64, "heads": 4, "ffn": 256,
                                "seq_len": 64, "vocab": CORPUS_VOCAB, "dtype": "fp32"})
    nominal = Cluster(name="n", nodes=1, devices_per_node=1, memory_gib=1.0, peak_tflops=1.0)
    analytic = [lp.forward_s * nominal.flops_per_s for lp in analytic_profile(spec, nominal).layers]
    assert counted[1] == pytest.approx(analytic[1], rel=0.05)  # a block: matmuls and attention
    assert counted[-1] == pytest.approx(analytic[-1], rel=0.1)  # the head


def test_a_linear_layer_counts_two_flops_per_weight_and_row() -> None:
    assert forward_flops([nn.Linear(8, 4)], torch.randn(1, 8)) == [2 * 8 * 4]


def _train_cfg(**over: Any) -> Any:
    cfg = OmegaConf.create({
        "model": {"name": "tiny_gpt", "family": "gpt2", "layers": 4, "hidden": 64, "heads": 4, "ffn": 256,
                  "seq_len": 64, "vocab": 512, "dtype": "fp32"},
        "data": {"seq_len": None, "batch_size": 16},
        "trainer": {"devices": 2, "num_nodes": 1, "max_steps": 30, "precision": "32-true", "accelerator": "cpu"},
        "strategy": {"profile_repeats": 3, "measure_cluster": True, "cluster": None, "plan": None, "profile": None},
    })
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in over.items()]))


def test_uniap_train_work_follows_the_config() -> None:
    w = config_work(_train_cfg())
    assert w is not None
    assert len(w.flops) == 6 and w.rows == 16 and w.world == 2 and w.everywhere and w.measure_cluster
    assert [i for i, _ in w.distinct] == [0, 1, 5]  # embed, one block (the others are alike), the head
    assert w.steps == 10 and w.samples_per_rank == 8
    assert config_work(_train_cfg(**{"trainer.max_steps": 2})).steps == 2
    single = config_work(_train_cfg(**{"trainer.devices": 1}))
    assert not single.everywhere and not single.measure_cluster
    assert config_work(_train_cfg(**{"strategy.profile": "p.json"})) is None  # nothing measured


def test_uniap_train_says_the_line_first_naming_its_override(tmp_path: Path) -> None:
    """A fresh interpreter, as a user runs it: the estimate is the command's first line of output (before Lightning
    loads: the launch is cut short right after it)."""
    code = ("import sys, uniap_lightning.cli.train as t\n"
            "def stop(cfg):\n    print('LAUNCH', flush=True); raise SystemExit(0)\n"
            "t.check_before_launch = stop\n"
            "from uniap_lightning.cli.main import main\n"
            "sys.exit(main(['train', 'model=tiny_gpt', 'trainer.max_steps=2']))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("UniAP: setup will measure for about") and lines[1] == "LAUNCH"
    assert "TP/FSDP timing" in lines[0] and "the first 2 steps" in lines[0]
    assert "strategy.profile_repeats=1 (now 3)" in lines[0] and "lightning" not in out.stderr.lower()


def test_the_strategy_says_it_before_profiling_naming_its_argument(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from uniap_lightning import UniAPStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            self.loss_fn = nn.MSELoss()

        def training_step(self, batch: Any, batch_idx: int) -> Any:  # not called by the strategy
            raise AssertionError

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)), batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         strategy=UniAPStrategy(monitor=False, cache_dir=str(tmp_path), profile_repeats=2))
    with caplog.at_level(logging.INFO):
        trainer.fit(Module(), data)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("UniAP")]
    first = next(i for i, m in enumerate(said) if m.startswith("UniAP: profiling"))
    estimates = [i for i, m in enumerate(said) if "setup will measure" in m]
    assert len(estimates) == 1 and estimates[0] < first
    assert "UniAPStrategy(profile_repeats=1) (now 2)" in said[estimates[0]]
    assert "TP/FSDP" not in said[estimates[0]]  # one process: no such phase
