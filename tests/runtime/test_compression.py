"""Gradient compression (runtime/compression.py): each compressor against a single-process reference written
here from the algorithm's definition, on 2 real gloo ranks (one spawn for all cases); bytes counted == formula.

Every case runs two optimizer steps on the same bucket so the error-feedback state (and PowerSGD's warm-started
``Q``) carries over from the first to the second.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import uniap_launch

from uniap_lightning.planner.decision import Strategy

SHAPES = [(6, 5), (4, 3, 2), (5,)]  # a matrix, a 3-D piece (viewed 4 x 6), a vector
WORLD = 2
CASES = {
    "bf16": ("bf16", {}),
    "powersgd_r1": ("powersgd", {"powersgd_rank": 1}),
    "powersgd_r2": ("powersgd", {"powersgd_rank": 2}),
    "powersgd_full": ("powersgd", {"powersgd_rank": 6}),  # capped at min(n, k) per matrix: exact
    "topk_q": ("topk", {"topk_ratio": 0.2}),
    "topk_all": ("topk", {"topk_ratio": 1.0}),
}
#: name -> (method, options, first compressed step, state reloaded into a new compressor after step 0)
MORE = {
    "powersgd_warm": ("powersgd", {"powersgd_rank": 1}, 1, False),
    "topk_warm": ("topk", {"topk_ratio": 0.2}, 1, False),
    "topk_dgc": ("topk", {"topk_ratio": 0.2, "dgc_momentum": 0.9}, 0, False),
    "topk_dgc_warm": ("topk", {"topk_ratio": 0.2, "dgc_momentum": 0.9}, 1, False),
    "bf16_no_warm": ("bf16", {"start_iter": 1}, None, False),
    "powersgd_r2_reloaded": ("powersgd", {"powersgd_rank": 2}, 0, True),
    "topk_q_reloaded": ("topk", {"topk_ratio": 0.2}, 0, True),
    "topk_dgc_reloaded": ("topk", {"topk_ratio": 0.2, "dgc_momentum": 0.9}, 0, True),
}


def grads(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from uniap_lightning.planner.plan import COMPRESSION_DEFAULTS
    from uniap_lightning.runtime.compression import ByteCounter, make_compressor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    specs = {**{n: (m, o, None, False) for n, (m, o) in CASES.items()}, **MORE}
    for name, (method, options, first, reload) in specs.items():
        comp = make_compressor(method, {**COMPRESSION_DEFAULTS, **options})
        if first is not None:
            comp.start_step = first
        numel = sum(math.prod(s) for s in SHAPES)
        buffer = torch.empty(numel)
        slots = [p.view(s) for p, s in zip(buffer.split([math.prod(s) for s in SHAPES]), SHAPES)]
        steps = []
        for step in range(2):
            counter = ByteCounter()
            counter.begin_step()
            for slot, g in zip(slots, grads(rank, step)):
                slot.copy_(g)
            if reload and step == 1:  # a resumed run: a new compressor continues from the saved state
                state = comp.state_dict()
                comp = make_compressor(method, {**COMPRESSION_DEFAULTS, **options})
                comp.load_state_dict(state)
            comp.start(buffer, slots, dist.group.WORLD, world, counter, None if first is None else step).wait()
            error = getattr(comp, "error", None)
            steps.append({"out": buffer.clone(), "error": None if error is None else error.clone(),
                          "bytes": counter.step_bytes, "by_op": dict(counter.step_by_op),
                          "state_bytes": comp.state_bytes()})
        results[name] = steps
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from uniap_rt_helpers import free_port

    out = tmp_path_factory.mktemp("compression")
    uniap_launch.start_processes(_worker, args=(WORLD, free_port(), str(out)), nprocs=WORLD)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _split(flat: torch.Tensor) -> list[torch.Tensor]:
    return [p.view(s) for p, s in zip(flat.split([math.prod(s) for s in SHAPES]), SHAPES)]


# ---------------------------------------------------------------------------------------------- references
def ref_powersgd(rank_r: int, grad_steps: tuple[int, ...] = (0, 1)) -> list[dict[str, Any]]:
    """PowerSGD (Vogels et al., Algorithm 1 with torch's hook's choices), d ranks simulated in one process:
    P = sum_i M_i Q, orthogonalize P, Q = mean_i M_i^T P, approx = P Q^T, error_i = M_i - approx; vectors
    averaged exactly. Orthogonalization by QR (sign conventions cancel in P Q^T)."""
    errors = [torch.zeros(sum(math.prod(s) for s in SHAPES)) for _ in range(WORLD)]
    qs: list[torch.Tensor | None] = [None, None]
    gen = torch.Generator().manual_seed(0)
    out = []
    for step in grad_steps:
        ms = [_flat(grads(r, step)) + errors[r] for r in range(WORLD)]
        pieces = [_split(m) for m in ms]
        approx = []
        mi = 0
        for j, shape in enumerate(SHAPES):
            if len(shape) < 2:
                approx.append(sum(p[j] for p in pieces) / WORLD)
                continue
            n = shape[0]
            mats = [p[j].reshape(n, -1) for p in pieces]
            k = mats[0].shape[1]
            r = min(n, k, rank_r)
            if qs[mi] is None:
                qs[mi] = torch.randn(1, k, r, generator=gen)[0]
            q = torch.linalg.qr(qs[mi]).Q
            p = torch.linalg.qr(sum(m @ q for m in mats)).Q
            q = sum(m.T @ p for m in mats) / WORLD
            qs[mi] = q
            approx.append((p @ q.T).reshape(shape))
            mi += 1
        avg = _flat(approx)
        for r in range(WORLD):
            e = ms[r] - avg
            for j, piece in enumerate(_split(e)):
                if len(SHAPES[j]) < 2:
                    piece.zero_()
            errors[r] = e
        out.append({"out": avg, "errors": [e.clone() for e in errors]})
    return out


def ref_topk(ratio: float, momentum: float = 0.0, dense_first: bool = False) -> list[dict[str, Any]]:
    """Top-k with error feedback (Lin et al. 2018): each rank sends the k largest |g + e| per piece and keeps the
    rest as its error; the result is the sum of what was sent / d. With ``momentum`` m, DGC's momentum correction
    and momentum factor masking: u = m u + g, v = v + u, send top-k of v, zero v and u where sent. With
    ``dense_first`` the first step is a warm-up: everyone's (momentum-corrected) gradient averaged, u kept."""
    errors = [torch.zeros(sum(math.prod(s) for s in SHAPES)) for _ in range(WORLD)]
    velocities = [torch.zeros_like(errors[0]) for _ in range(WORLD)]
    out = []
    for step in range(2):
        total = torch.zeros_like(errors[0])
        if dense_first and step == 0:
            for r in range(WORLD):
                velocities[r] = momentum * velocities[r] + _flat(grads(r, step))
                total += velocities[r] if momentum else _flat(grads(r, step))
            out.append({"out": total / WORLD, "errors": [e.clone() for e in errors]})
            continue
        for r in range(WORLD):
            g = _flat(grads(r, step))
            if momentum:
                velocities[r] = momentum * velocities[r] + g
                g = velocities[r]
            acc = g + errors[r]
            sent = torch.zeros_like(acc)
            offset = 0
            for s in SHAPES:
                n = math.prod(s)
                k = max(1, math.ceil(ratio * n))
                piece = acc[offset:offset + n]
                keep = piece.abs().argsort(descending=True)[:k] + offset
                sent[keep] = acc[keep]
                if momentum:
                    velocities[r][keep] = 0.0
                offset += n
            total += sent
            errors[r] = acc - sent
        out.append({"out": total / WORLD, "errors": [e.clone() for e in errors]})
    return out


# -------------------------------------------------------------------------------------------------- tests
def _wire_formula(method: str, options: dict[str, float]) -> int:
    """The agreed bytes per rank per step (notes/issue12-interfaces.md), written out independently."""
    if method == "bf16":
        return 2 * sum(math.prod(s) for s in SHAPES)
    if method == "powersgd":
        r = options["powersgd_rank"]
        total = 0
        for s in SHAPES:
            n, numel = s[0], math.prod(s)
            total += 4 * min(r, n, numel // n) * (n + numel // n) if len(s) >= 2 else 4 * numel
        return total
    return sum(8 * max(1, math.ceil(options["topk_ratio"] * math.prod(s))) for s in SHAPES)


@pytest.mark.parametrize("name", list(CASES))
def test_counted_bytes_equal_the_formula(ranks: list[dict[str, Any]], name: str) -> None:
    method, options = CASES[name]
    for res in ranks:
        for step in res[name]:
            assert step["bytes"] == _wire_formula(method, options)
            assert set(step["by_op"]) == ({"all_gather"} if method == "topk" else {"all_reduce"})


@pytest.mark.parametrize("name", list(CASES))
def test_kept_state_is_the_error_buffer_and_the_warm_start_factors(ranks: list[dict[str, Any]], name: str) -> None:
    """What the cost model charges as the compressor's memory: 4 bytes per element of error feedback (top-k and
    PowerSGD), plus PowerSGD's Q factors (k x r per matrix); bf16 keeps nothing."""
    method, options = CASES[name]
    numel = sum(math.prod(s) for s in SHAPES)
    r = options.get("powersgd_rank", 0)
    q = sum(math.prod(s) // s[0] * min(r, s[0], math.prod(s) // s[0]) for s in SHAPES if len(s) >= 2)
    expected = {"bf16": 0, "topk": 4 * numel, "powersgd": 4 * numel + 4 * q}[method]
    assert all(step["state_bytes"] == expected for res in ranks for step in res[name])


def test_bf16_is_the_mean_up_to_bf16_rounding(ranks: list[dict[str, Any]]) -> None:
    for step in range(2):
        exact = (_flat(grads(0, step)) + _flat(grads(1, step))) / 2
        rounded = (_flat(grads(0, step)).bfloat16() + _flat(grads(1, step)).bfloat16()).float() / 2
        for res in ranks:
            got = res["bf16"][step]["out"]
            torch.testing.assert_close(got, rounded, rtol=0, atol=0)
            torch.testing.assert_close(got, exact, rtol=2**-7, atol=1e-2)
            assert not torch.equal(got, exact)  # it did round


@pytest.mark.parametrize("name,rank_r", [("powersgd_r1", 1), ("powersgd_r2", 2), ("powersgd_full", 6)])
def test_powersgd_matches_the_reference_with_error_feedback_and_warm_start(
    ranks: list[dict[str, Any]], name: str, rank_r: int
) -> None:
    ref = ref_powersgd(rank_r)
    for r, res in enumerate(ranks):
        for step in range(2):
            torch.testing.assert_close(res[name][step]["out"], ref[step]["out"], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(res[name][step]["error"], ref[step]["errors"][r], rtol=1e-4, atol=1e-5)
    if rank_r == 1:  # low rank: a real approximation, and the error carries it to the next step
        assert ref[0]["errors"][0].abs().max() > 0.1


def test_powersgd_at_full_rank_is_the_exact_mean(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        for step in range(2):
            # step 1 adds step 0's errors, which sum to zero over the ranks at full rank
            exact = (_flat(grads(0, step)) + _flat(grads(1, step))) / 2
            torch.testing.assert_close(res["powersgd_full"][step]["out"], exact, rtol=1e-4, atol=1e-5)


def test_topk_matches_the_reference_and_keeps_what_it_did_not_send(ranks: list[dict[str, Any]]) -> None:
    ref = ref_topk(0.2)
    for r, res in enumerate(ranks):
        for step in range(2):
            torch.testing.assert_close(res["topk_q"][step]["out"], ref[step]["out"], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(res["topk_q"][step]["error"], ref[step]["errors"][r], rtol=1e-6, atol=1e-7)
    assert (ref[0]["errors"][0] != 0).sum() > 0


def test_topk_with_ratio_one_is_the_plain_all_reduce(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        for step in range(2):
            exact = (_flat(grads(0, step)) + _flat(grads(1, step))) / 2
            assert torch.equal(res["topk_all"][step]["out"], exact)
            assert torch.equal(res["topk_all"][step]["error"], torch.zeros_like(exact))


def test_warm_up_steps_are_the_plain_all_reduce_then_compression_starts_from_zero_error(
    ranks: list[dict[str, Any]],
) -> None:
    """As torch's ``start_powerSGD_iter``: the warm-up step is the exact fp32 mean, counted as ``4 * numel`` bytes
    (the dense formula), and keeps no error; the first compressed step is the compressor's first step on its
    gradients (zero error, PowerSGD's first ``Q``)."""
    from uniap_lightning.runtime.compression import wire_bytes

    numel = sum(math.prod(s) for s in SHAPES)
    exact0 = (_flat(grads(0, 0)) + _flat(grads(1, 0))) / 2
    refs = {"powersgd_warm": ref_powersgd(1, grad_steps=(1,))[0], "topk_warm": ref_topk(0.2, dense_first=True)[1]}
    for name, ref in refs.items():
        method, options, _, _ = MORE[name]
        for r, res in enumerate(ranks):
            warm, first = res[name]
            assert torch.equal(warm["out"], exact0) and warm["error"] is None and warm["state_bytes"] == 0
            assert warm["bytes"] == 4 * numel == wire_bytes(method, SHAPES, grad_bytes=4, options=options, dense=True)
            assert warm["by_op"] == {"all_reduce": 4 * numel}
            assert first["bytes"] == _wire_formula(method, {**options, "powersgd_rank": 1})
            torch.testing.assert_close(first["out"], ref["out"], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(first["error"], ref["errors"][r], rtol=1e-4, atol=1e-5)
    for res in ranks:  # bf16 has nothing to protect: no warm-up, whatever start_iter says
        assert res["bf16_no_warm"][0]["bytes"] == 2 * numel


def test_dgc_momentum_correction_and_masking_match_the_reference(ranks: list[dict[str, Any]]) -> None:
    for name, dense_first in (("topk_dgc", False), ("topk_dgc_warm", True)):
        ref = ref_topk(0.2, momentum=0.9, dense_first=dense_first)
        for r, res in enumerate(ranks):
            for step in range(2):
                torch.testing.assert_close(res[name][step]["out"], ref[step]["out"], rtol=1e-6, atol=1e-6)
        # the kept state: v (error) and u (momentum), fp32, the bucket's size each
        assert ranks[0][name][1]["state_bytes"] == 8 * sum(math.prod(s) for s in SHAPES)
    # momentum correction changes the result: not plain error feedback
    assert not torch.allclose(ranks[0]["topk_dgc"][1]["out"], ranks[0]["topk_q"][1]["out"])
    # a dense DGC step is SGD with momentum: the warm-up's step 0 is the plain mean of the gradients
    assert torch.equal(ranks[0]["topk_dgc_warm"][0]["out"], (_flat(grads(0, 0)) + _flat(grads(1, 0))) / 2)


@pytest.mark.parametrize("name", ["powersgd_r2", "topk_q", "topk_dgc"])
def test_a_compressor_continues_exactly_from_its_saved_state(ranks: list[dict[str, Any]], name: str) -> None:
    for res in ranks:
        for step in range(2):
            assert torch.equal(res[f"{name}_reloaded"][step]["out"], res[name][step]["out"])


def test_dgc_needs_sgd_without_momentum_for_the_top_k_layers() -> None:
    """DGC moves the momentum before top-k: an optimizer that applies momentum (or Adam's moments) to the top-k
    layers would apply it twice; refused, naming the option. Other layers may use any optimizer."""
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.runtime.compression_topk import check_dgc_optimizers

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    check_dgc_optimizers([torch.optim.SGD([a], lr=0.1), torch.optim.AdamW([b])], [a], 0.9)
    for bad in (torch.optim.AdamW([a]), torch.optim.SGD([a], lr=0.1, momentum=0.9)):
        with pytest.raises(UniAPError, match=r"dgc_momentum=0.9 .* torch.optim.SGD with momentum=0"):
            check_dgc_optimizers([bad], [a], 0.9)


def test_the_cost_model_charges_what_dgc_keeps() -> None:
    """The planner's memory for a top-k layer: the fp32 error feedback (``4 P``), with DGC also the fp32 momentum
    (``4 P`` more), as ``state_bytes`` counts above; the bytes on the wire do not change."""
    from uniap_lightning.planner.cluster import Cluster
    from uniap_lightning.planner.cost.layer import Pricing, Strategy, layer_cost
    from uniap_lightning.planner.problem import TrainingConfig
    from uniap_lightning.planner.profile import LayerProfile

    cl = Cluster(name="c", nodes=1, devices_per_node=2, memory_gib=16, peak_tflops=1, intra_bw_gbps=10)
    tr = TrainingConfig(global_batch_size=8, weight_bytes=4, grad_bytes=4, optimizer_bytes=8)
    layer = LayerProfile(name="l", forward_s=1e-3, backward_s=2e-3, params=10_000, activation_bytes=1e3,
                         output_bytes=1e2)
    topk = Strategy(2, 1, "replicate", False, "topk")
    plain = layer_cost(layer, topk, Pricing(4, 2, topk_ratio=0.1), cluster=cl, training=tr)
    dgc = layer_cost(layer, topk, Pricing(4, 2, topk_ratio=0.1, dgc=True), cluster=cl, training=tr)
    assert dgc.static_bytes - plain.static_bytes == 4 * 10_000 and dgc.sync_s == plain.sync_s


def test_wire_bytes_formula_and_unknown_method() -> None:
    from uniap_lightning.runtime.compression import make_compressor, topk_count, wire_bytes

    opts = {"powersgd_rank": 2, "topk_ratio": 0.01}
    assert wire_bytes("none", [(10, 20), (20,)], grad_bytes=4, options=opts) == 4 * 220
    assert wire_bytes("powersgd", [(10, 20), (20,)], grad_bytes=4, options=opts) == 4 * 2 * 30 + 4 * 20
    assert wire_bytes("topk", [(10, 20), (20,)], grad_bytes=4, options=opts) == 8 * (2 + 1)
    assert topk_count(5, 0.01) == 1 and topk_count(300, 0.01) == 3 and topk_count(4, 1.0) == 4
    with pytest.raises(ValueError, match="unknown compression 'fp8'"):
        make_compressor("fp8", opts)


# ------------------------------------------------------------------------------------- training, 2 processes
STEPS = 16


def _plan(methods: list[str], *, modes: list[str] | None = None, dp: int = 2, world: int = 2, rank_r: int = 2,
          ratio: float = 0.1) -> Any:
    from uniap_lightning.planner.plan import Plan
    from uniap_rt_helpers import NAMES

    modes = modes or ["replicate"] * len(methods)
    return Plan.from_assignment(
        stage_of_layer=[0] * 4, strategies=[Strategy(dp, world // dp, mode, False, m) for m, mode in zip(methods, modes)],
        layer_names=NAMES, pp=1, microbatches=2, schedule="1f1b", global_batch_size=16, num_devices=world,
        compression_options={"powersgd_rank": rank_r, "topk_ratio": ratio},
    )


#: point-to-point so slow that the planner keeps one stage, gradient all-reduce slow enough that compressing pays
SLOW_LINKS = {"name": "slow-links", "nodes": 1, "devices_per_node": 2, "memory_gib": 4, "peak_tflops": 0.001,
              "collective_tables": {"p2p": {"intra": {2: {"bw_gbps": 1e-6, "latency_us": 1e6}}},
                                    "all_reduce": {"intra": {2: {"bw_gbps": 1e-4, "latency_us": 1.0}}}}}

TRAIN_CASES = {
    "none": {"methods": ["none"] * 4},
    "bf16": {"methods": ["bf16"] * 4, "monitor": True},
    "powersgd": {"methods": ["powersgd"] * 4},
    "topk": {"methods": ["topk"] * 4},
    "mixed_accumulate": {"methods": ["powersgd", "topk", "bf16", "none"], "accumulate": 2},
    # ZeRO-1 layers' gradients are all-reduced whole through the same compressed buckets (runtime/zero.py)
    "zero1": {"methods": ["powersgd", "topk", "bf16", "none"], "modes": ["zero1", "zero1", "replicate", "zero1"]},
    # solved at setup: UniAPStrategy(compression=...) reaches the planner, which may use that method per layer
    # (measure_cluster=False: no replication timed at setup, whose fast local figure would replace SLOW_LINKS')
    "solved": {"strategy": {"cluster": SLOW_LINKS, "compression": "powersgd", "compression_options": {"powersgd_rank": 3},
                            "time_limit": 20, "profile_repeats": 1, "measure_cluster": False}},
}


def _train_worker(rank: int, world: int, port: int, cases: dict[str, Any], out_dir: str) -> None:
    """Train each case with a pinned compressed plan; record the loss and, per optimizer step, the counted bytes
    next to the formula's."""
    import lightning.pytorch as pl

    import uniap_rt_helpers as h
    from uniap_lightning.monitor import UniAPMonitor
    from uniap_lightning.strategy import UniAPStrategy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    os.chdir(out_dir)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, case in cases.items():
        monitor = UniAPMonitor(warmup_steps=1, window=4, metrics_file=Path(out_dir) / f"{name}.json")
        if "strategy" in case:  # solved at setup
            strategy = UniAPStrategy(monitor=False, cache_dir=out_dir, **case["strategy"])
        else:
            strategy = UniAPStrategy(plan=_plan(case["methods"], modes=case.get("modes"), dp=case.get("dp", world),
                                                world=world), monitor=monitor if case.get("monitor") else False)
        seen: list[tuple[int, int, int]] = []

        class Count(pl.Callback):
            def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
                rg = strategy.runtime.replicated
                seen.append((rg.counter.steps, rg.counter.step_bytes, rg.wire_bytes_per_step()))

        rec = h.LossRecorder.make()
        trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=[rec, Count()],
                             **h.trainer_kwargs({"steps": STEPS, "accumulate": case.get("accumulate", 1)}))
        trainer.fit(h.make_module(), h.make_data(16))
        results[name] = {"losses": rec.losses, "bytes": seen, "plan": strategy.plan.to_dict(), "monitor": monitor.last}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    import uniap_rt_helpers as h

    return h.spawn(WORLD, TRAIN_CASES, tmp_path_factory.mktemp("compressed_training"), fn=_train_worker)


def test_the_planner_chooses_the_allowed_compression_and_the_runtime_executes_it(
    trained: list[dict[str, Any]],
) -> None:
    plan = trained[0]["solved"]["plan"]
    chosen = {lp["compression"] for lp in plan["layers"]}
    assert "powersgd" in chosen <= {"none", "powersgd"}, chosen
    assert plan["compression_options"] == {"powersgd_rank": 3, "topk_ratio": 0.01}  # priced and run with rank 3


def test_training_counts_the_formula_bytes_once_per_optimizer_step(trained: list[dict[str, Any]]) -> None:
    for name, case in TRAIN_CASES.items():
        for res in trained:
            seen = res[name]["bytes"]
            assert len(seen) == STEPS  # one averaging per optimizer step, also with accumulation
            assert [s[0] for s in seen] == list(range(1, STEPS + 1))
            assert all(counted == formula > 0 for _, counted, formula in seen), (name, seen[:2])
    # the ratios are what the methods promise on this model (tiny matrices: PowerSGD's rank-2 factors are large),
    # after the default warm-up: 2% of the 16 steps, rounded up (1), uncompressed; bf16 has none
    plain = trained[0]["none"]["bytes"][0][1]
    assert trained[0]["topk"]["bytes"][0][1] == trained[0]["powersgd"]["bytes"][0][1] == plain
    assert trained[0]["bf16"]["bytes"][0][1] * 2 == plain
    assert trained[0]["topk"]["bytes"][1][1] < plain / 4
    assert trained[0]["powersgd"]["bytes"][1][1] < plain / 2


def test_the_monitor_reports_counted_bytes_next_to_the_formula(trained: list[dict[str, Any]]) -> None:
    report = trained[0]["bf16"]["monitor"]
    per_rank = trained[0]["bf16"]["bytes"][-1][2]
    assert report["rank_grad_sync_bytes"] == report["rank_predicted_grad_sync_bytes"] == [per_rank] * WORLD
    assert trained[1]["bf16"]["monitor"]["rank_grad_sync_bytes"] == report["rank_grad_sync_bytes"]


def test_compressed_training_converges_near_uncompressed(trained: list[dict[str, Any]]) -> None:
    """A loose bound (the 2% target on the shipped GPT is benchmarks/compression.py's): by epoch means (4 batches
    of different data each), every method lowers the loss at least 60% as much as uncompressed training and ends
    within 5% of it; the ranks agree on every loss."""
    def epochs(losses: list[float]) -> list[float]:
        return [sum(losses[i:i + 4]) / 4 for i in range(0, len(losses), 4)]

    base = epochs(trained[0]["none"]["losses"])
    assert base[-1] < 0.95 * base[0]
    for name in TRAIN_CASES:
        losses = trained[0][name]["losses"]
        assert len(losses) == STEPS * TRAIN_CASES[name].get("accumulate", 1)
        assert trained[1][name]["losses"] == losses
        mine = epochs(losses)
        if "accumulate" in TRAIN_CASES[name]:  # other batches per step: its own trend only
            assert mine[-1] < 0.95 * mine[0], (name, mine)
            continue
        assert mine[0] - mine[-1] > 0.6 * (base[0] - base[-1]), (name, mine, base)
        assert mine[-1] < 1.05 * base[-1], (name, mine, base)


# ------------------------------------------------------------------------------------------------ the option
@pytest.mark.parametrize("value, allowed", [
    (None, ("none",)), ("bf16", ("none", "bf16")), ("powersgd", ("none", "powersgd")), ("topk", ("none", "topk")),
    ("auto", ("none", "bf16", "powersgd", "topk")),
])
def test_strategy_option_is_the_planners_allowed_set(value: str | None, allowed: tuple[str, ...]) -> None:
    from uniap_lightning.strategy import UniAPStrategy

    assert UniAPStrategy(compression=value).setup_options.compression == allowed


@pytest.mark.parametrize("options, message", [
    ({"rank": 4}, r"unknown key\(s\) \['rank'\]"), ({"powersgd_rank": 0}, "powersgd_rank must be an integer >= 1"),
    ({"powersgd_rank": 2.5}, "powersgd_rank must be an integer"), ({"topk_ratio": 0}, r"topk_ratio must be .* \(0, 1\]"),
    ([4], "compression_options must be a dict"), ({"start_iter": -1}, "start_iter must be an integer >= 0"),
    ({"start_iter": 2.5}, "start_iter must be an integer"), ({"start_fraction": 1.0}, r"start_fraction .* \[0, 1\)"),
    ({"dgc_momentum": -0.1}, r"dgc_momentum .* \[0, 1\)"),
])
def test_bad_compression_options_are_refused_when_the_strategy_is_built(options: Any, message: str) -> None:
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.strategy import UniAPStrategy

    with pytest.raises(UniAPError, match=message):
        UniAPStrategy(compression="auto", compression_options=options)


@pytest.mark.parametrize("value", ["fp8", "PowerSGD", ["bf16", "zip"], ("auto",), 1])
def test_bad_compression_is_refused_when_the_strategy_is_built(value: Any) -> None:
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.strategy import UniAPStrategy

    with pytest.raises(UniAPError, match=r"compression=.* must be one of None, 'bf16', 'powersgd', 'topk', 'auto'"):
        UniAPStrategy(compression=value)


def test_uniap_train_override_reaches_the_strategy() -> None:
    from hydra import compose, initialize_config_dir

    from uniap_lightning.cli.train import build_strategy
    from uniap_lightning.errors import UniAPError
    from uniap_lightning.planner.config import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        assert compose(config_name="fit").strategy.compression is None  # off by default
        cfg = compose(config_name="fit", overrides=["strategy.compression=bf16",
                                                    "strategy.compression_options={powersgd_rank: 4}"])
        bad = compose(config_name="fit", overrides=["strategy.compression=zip"])
    options = build_strategy(cfg).setup_options
    assert options.compression == ("none", "bf16")
    assert options.compression_options_dict == {"powersgd_rank": 4, "topk_ratio": 0.01}
    runtime = UniAPStrategy_options({"start_iter": 50, "dgc_momentum": 0.9})
    assert runtime == {"powersgd_rank": 1, "topk_ratio": 0.01, "start_iter": 50, "dgc_momentum": 0.9}
    with pytest.raises(UniAPError, match="compression='zip'"):
        build_strategy(bad)


def UniAPStrategy_options(options: dict[str, float]) -> dict[str, float]:
    from uniap_lightning.strategy import UniAPStrategy

    return UniAPStrategy(compression="auto", compression_options=options).setup_options.compression_options_dict


@pytest.mark.slow
def test_tensor_parallel_layers_compress_their_local_shards(tmp_path: Path) -> None:
    """4 ranks, every layer dp=2 x tp=2 (DTensor shards): each rank compresses its shard; the counted bytes
    follow the formula on the local shapes (less than the whole gradient), training converges."""
    import uniap_rt_helpers as h

    cases = {"tp_none": {"methods": ["none"] * 4, "dp": 2},
             "tp_mixed": {"methods": ["powersgd", "topk", "bf16", "powersgd"], "dp": 2}}
    results = h.spawn(4, cases, tmp_path, fn=_train_worker)
    full = 4 * sum(m.numel() for m in h.make_module().parameters())
    for name in cases:
        for res in results:
            seen = res[name]["bytes"]
            assert len(seen) == STEPS and all(c == f > 0 for _, c, f in seen), (name, seen[:2])
        assert all(r[name]["losses"] == results[0][name]["losses"] for r in results)
    assert results[0]["tp_none"]["bytes"][0][1] < full  # shards: less than the whole model's gradient
    base, mine = results[0]["tp_none"]["losses"], results[0]["tp_mixed"]["losses"]
    assert sum(mine[-4:]) < 1.05 * sum(base[-4:]) and sum(mine[-4:]) < 0.95 * sum(mine[:4])
