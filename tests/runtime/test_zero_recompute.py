"""ZeRO modes (``dp_mode`` zero1 / zero2 / zero3) and recomputation on real processes.

Every plan must reproduce one process (loss and parameters within 1e-5 after 5 optimizer steps), alone and mixed
with pipeline and tensor parallelism and with each other; a checkpoint saved under zero2 + recomputation resumes
under a zero1 pipeline plan on twice the processes; and each rank's parameter, gradient and optimizer-state bytes,
measured from the live tensors, are what the mode's formula says (issue 12 interfaces, term by term, computed here)
and what the planner's per-layer ``static_bytes`` says (equal).
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import uniap_rt_helpers as h

REP, Z1, Z2, Z3 = "replicate", "zero1", "zero2", "zero3"
ONE_STAGE, TWO_STAGES = [0, 0, 0, 0], [0, 0, 1, 1]
ADAM = {"module": {"optimizer": "adam", "lr": 0.01}}


def S(dp: int, tp: int, mode: str = REP, recompute: bool = False) -> tuple[Any, ...]:
    return (dp, tp, mode if dp > 1 else REP, recompute, "none")


def OFF(dp: int, tp: int, mode: str = REP) -> dict[str, Any]:
    """A layer whose activations wait in host memory between its forward and its backward (``offload``)."""
    return {"dp": dp, "tp": tp, "dp_mode": mode if dp > 1 else REP, "offload": True}


def SOFF(dp: int, tp: int, mode: str = REP, **kw: Any) -> dict[str, Any]:
    """A layer whose parameters, gradients and optimizer state wait in host memory (``state_offload``: FSDP2's
    CPUOffloadPolicy, unpinned on CPU; zero3 over its replicas, or a one-rank unit without)."""
    return {"dp": dp, "tp": tp, "dp_mode": mode if dp > 1 else REP, "state_offload": True, **kw}


def FP8(dp: int, tp: int, mode: str = REP, recompute: bool = False, precision: str = "fp8") -> dict[str, Any]:
    """A layer whose ``nn.Linear`` products run in float8 (torchao, tensorwise scales unless ``precision`` says)."""
    return {"dp": dp, "tp": tp, "dp_mode": mode if dp > 1 else REP, "recompute": recompute, "precision": precision}


def fp8_lm(layers: list[int], lm: str = "gpt", precision: str = "fp8") -> Any:
    """The tiny GPT (``make_module(lm="gpt")``) with the chain layers ``layers`` converted to float8 in one process,
    as the runtime converts them (:func:`uniap_lightning.runtime.dimensions.precision.apply_fp8`): the one-process
    reference of the fp8 plans."""
    from uniap_lightning.runtime.dimensions.precision import apply_fp8

    module = h.make_module(lm=lm)
    for u in layers:
        module.chain[u] = apply_fp8(module.chain[u], precision)
    return module


def P2(strategies: list[tuple[Any, ...]], stages: list[int], **kw: Any) -> Any:
    return h.make_plan(strategies, stages, **kw)


def P4(strategies: list[tuple[Any, ...]], stages: list[int], **kw: Any) -> Any:
    return h.make_plan(strategies, stages, world=4, **kw)


DEFAULTS = {"defaults": True}  # every Trainer argument at Lightning's default, as users leave them

TWO_RANKS = {
    # with a validation loader (default Trainer: sanity check before training, validation after each epoch): an
    # evaluation forward leaves zero1 / zero2 layers sharded, so the next step starts from the shards
    "zero1": {"plan": P2([S(2, 1, Z1)] * 4, ONE_STAGE, pp=1, microbatches=1), "limit_val_batches": 2, **DEFAULTS},
    # two micro-batches: one reduce-scatter and one all-gather per step, the unsharded gradient accumulates
    "zero2_microbatches": {"plan": P2([S(2, 1, Z2)] * 4, ONE_STAGE, pp=1, microbatches=2), "limit_val_batches": 2,
                           **DEFAULTS},
    "zero2_accumulate_adam": {"plan": P2([S(2, 1, Z2)] * 4, ONE_STAGE, pp=1, microbatches=2), "accumulate": 2,
                              **ADAM},
    "zero1_accumulate_clip": {"plan": P2([S(2, 1, Z1)] * 4, ONE_STAGE, pp=1, microbatches=2), "accumulate": 2,
                              "clip": 0.5},
    "pp2_recompute_1f1b": {"plan": P2([S(1, 1, REP, True)] * 4, [0, 1, 1, 1], pp=2, microbatches=4), **DEFAULTS},
    # every mode in one stage, recomputation on some, activations re-laid out between dp and tp layers (SGD: with
    # Adam this layout is 4e-5 off one process even all-replicated, Adam magnifying rounding in tiny gradients)
    "mixed_modes_recompute": {"plan": P2([S(2, 1, Z1, True), S(2, 1, Z2), S(1, 2, REP, True), S(2, 1, Z3, True)],
                                         ONE_STAGE, pp=1, microbatches=2), "accumulate": 2, "clip": 0.5},
    # activation offload (saved tensors copied to host memory and back: on CPU the same copy path a GPU runs)
    # on some layers, beside plain and recomputed ones, across two pipeline stages
    "pp2_offload_1f1b": {"plan": P2([OFF(1, 1), S(1, 1), OFF(1, 1), S(1, 1, REP, True)], TWO_STAGES, pp=2,
                                    microbatches=4), **DEFAULTS},
    # offload under ZeRO-1 / ZeRO-3 and tensor parallelism (DTensor activations travel as their local shards)
    "mixed_modes_offload": {"plan": P2([OFF(2, 1, Z1), OFF(1, 2), S(2, 1, Z2, True), OFF(2, 1, Z3)], ONE_STAGE,
                                       pp=1, microbatches=2), "accumulate": 2, "clip": 0.5},
    # state offload (FSDP2's CPU offload: the optimizer steps host shards): one-rank units on two pipeline stages,
    # beside a plain layer, with activation offload and with recomputation; Adam's state lives with the shards
    "pp2_state_offload": {"plan": P2([SOFF(1, 1), S(1, 1), SOFF(1, 1, offload=True), SOFF(1, 1, recompute=True)],
                                     TWO_STAGES, pp=2, microbatches=2), **ADAM},
    # under ZeRO-3 beside ZeRO-2 and tensor parallelism in one stage, accumulating, clipped
    "mixed_modes_state_offload": {"plan": P2([SOFF(2, 1, Z3), S(2, 1, Z2), SOFF(2, 1, Z3, offload=True), S(1, 2)],
                                             ONE_STAGE, pp=1, microbatches=2), "accumulate": 2, "clip": 0.5},
}

# Float8 matmuls (torchao) on the tiny GPT (embedding, block, block, norm + LM head), 50 steps: against one process
# in fp32 (the gap fp8 costs) and against one process running the same layers in fp8 (what distribution costs).
# The embedding has no nn.Linear, so its precision stays default.
GPT_NAMES = ["chain.0", "chain.1", "chain.2", "chain.3"]
FP8_STEPS = 50
FP8_TWO = {
    # two pipeline stages, one micro-batch: every float8 matmul sees the inputs one process sees (same scales)
    "fp8_pp2": {"module": {"lm": "gpt"}, "steps": FP8_STEPS, "plan": P2(
        [S(1, 1), FP8(1, 1), FP8(1, 1), FP8(1, 1)], TWO_STAGES, pp=2, microbatches=1, names=GPT_NAMES)},
    # tensor parallelism (DTensor weights: amax over the whole tensor), ZeRO-3 with float8 all-gather,
    # recomputation, rowwise scales and replication in one stage
    "fp8_tp2_zero3_mixed": {"module": {"lm": "gpt"}, "steps": FP8_STEPS, "plan": P2(
        [S(2, 1, Z3), FP8(1, 2), FP8(2, 1, Z3, True), FP8(2, 1, REP, precision="fp8_rowwise")], ONE_STAGE, pp=1,
        microbatches=1, names=GPT_NAMES)},
}
FP8_REFERENCE = {"fp8_pp2": [1, 2, 3]}  # the cases that run every layer in the same fp8 precision
FP8_FOUR = {
    # two stages of two ranks: ZeRO-3 (float8 all-gather) and tensor parallelism beside each other
    "fp8_pp2_dp2_zero3_tp2": {"module": {"lm": "gpt"}, "steps": FP8_STEPS, "plan": P4(
        [S(2, 1, Z3), FP8(2, 1, Z3), FP8(1, 2), FP8(2, 1, Z3)], TWO_STAGES, pp=2, microbatches=1,
        names=GPT_NAMES)},
}
#: what torchao's own float8 tests accept (test/float8/test_base.py: a Float8Linear's output against the
#: high-precision one, SQNR >= 18 dB, its weight gradient >= 17 dB), here for the whole run: the 50 losses and the
#: final parameters against one fp32 process. Measured (2 and 4 gloo processes, tiny GPT): losses 64-66 dB (largest gap
#: 0.006 on a loss of ~3.86, 0.16%), parameters 60-63 dB.
FP8_LOSS_SQNR_DB, FP8_PARAM_SQNR_DB = 18.0, 17.0

# zero1 gradients travel as a replicated layer's do: with the same compressor (here PowerSGD, error feedback and
# warm-started factors) zero1 must train exactly as replicate (no single-process reference: compression is lossy)
COMPRESSED = {
    f"{mode}_powersgd": {"plan": P2([(2, 1, mode, False, "powersgd")] * 4, ONE_STAGE, pp=1, microbatches=2),
                         "accumulate": 2}
    for mode in (REP, Z1)
}

FOUR_RANKS = {
    "pp2_dp2_modes_recompute": {
        "plan": P4([S(2, 1, Z1), S(2, 1, Z2, True), S(2, 1, Z3, True), S(2, 1, REP, True)], TWO_STAGES, pp=2,
                   microbatches=2), "accumulate": 2, "clip": 0.3},
    # 2-D (dp x tp) shards in zero1 / zero2: the gradient chunk a zero1 rank keeps is of its TP shard
    "dp2_x_tp2_zero_recompute": {
        "plan": P4([S(2, 2, Z1, True), S(2, 2, Z2), S(2, 2, Z3, True), S(2, 2, Z1)], ONE_STAGE, pp=1,
                   microbatches=2), "clip": 0.3},
    "pp2_dp2_x_tp_zero_offload": {
        "plan": P4([OFF(2, 1, Z2), OFF(1, 2), S(2, 1, Z3, True), OFF(2, 1, Z3)], TWO_STAGES, pp=2,
                   microbatches=2), "clip": 0.3},
}

# more of the same, in the slow run (the default run keeps under a minute on 2 cores)
TWO_RANKS_SLOW = {
    "zero3_recompute": {"plan": P2([S(2, 1, Z3, True)] * 4, ONE_STAGE, pp=1, microbatches=2), **DEFAULTS},
    "tp2_recompute": {"plan": P2([S(1, 2, REP, True)] * 4, ONE_STAGE, pp=1, microbatches=1), **DEFAULTS},
    "pp2_recompute_gpipe_accumulate": {"plan": P2([S(1, 1, REP, True)] * 4, TWO_STAGES, pp=2, microbatches=2,
                                                  schedule="gpipe"), "accumulate": 2},
}
LM_NAMES = ["chain.0", "chain.1", "chain.2", "chain.3"]  # embedding, block, block, norm + head
TWO_RANKS_SLOW.update({
    # transformer blocks through the adapters (Llama: several tensors between layers), every mode, recomputed
    "llama_modes_recompute": {"module": {"lm": "llama"}, "plan": P2(
        [S(2, 1, Z1, True), S(1, 2, REP, True), S(2, 1, Z2, True), S(2, 1, Z3, True)], ONE_STAGE, pp=1,
        microbatches=2, names=LM_NAMES)},
    "gpt2_pp2_recompute": {"module": {"lm": "gpt2"}, "plan": P2([S(1, 1, REP, True)] * 4, TWO_STAGES, pp=2,
                                                                 microbatches=2, names=LM_NAMES)},
})
FOUR_RANKS_SLOW = {
    "dp4_zero1_zero2": {
        "plan": P4([S(4, 1, Z1), S(4, 1, Z2, True), S(1, 4, REP, True), S(4, 1, Z1)], ONE_STAGE, pp=1,
                   microbatches=1), **DEFAULTS},
    "pp2_dp2_zero2_accumulate_adam": {
        "plan": P4([S(2, 1, Z2, True)] * 4, TWO_STAGES, pp=2, microbatches=2), "accumulate": 2, **ADAM},
    # state offload under ZeRO-3 and on a tensor-parallel layer (a one-rank FSDP2 unit of 2-D DTensors), beside
    # zero2 with recomputation and with activation offload, over two stages of two ranks
    "pp2_dp2_x_tp_state_offload": {
        "plan": P4([SOFF(2, 1, Z3), SOFF(1, 2), S(2, 1, Z2, True), SOFF(2, 1, Z3, offload=True)], TWO_STAGES, pp=2,
                   microbatches=2), "clip": 0.3},
}

# ---------------------------------------------------------------------- memory
# Adam: 8 optimizer bytes per parameter (exp_avg, exp_avg_sq; the scalar `step` does not scale), fp32 weights and
# gradients
B, G, O = 4, 4, 8
MEMORY_2 = P2([S(2, 1, REP), S(2, 1, Z1), S(2, 1, Z2), S(2, 1, Z3)], ONE_STAGE, pp=1, microbatches=2)
MEMORY_4 = P4([S(4, 1, REP), S(4, 1, Z1), S(4, 1, Z2), S(4, 1, Z3)], ONE_STAGE, pp=1, microbatches=2)
MEMORY_CASE = {"probe": True, "steps": 2, **ADAM}
MEMORY_PP2 = P4([S(2, 1, Z2), S(2, 1, Z1), S(2, 1, Z1), S(2, 1, Z2)], TWO_STAGES, pp=2, microbatches=2)


def _probe_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train ``steps`` steps recording, for each local layer, :func:`held_bytes` at the forward of the last layer
    of the stage in the second step's last micro-batch (``in_step``: gathered parameters and accumulating
    gradients are alive) and after that step's optimizer step (``after``)."""
    import lightning.pytorch as pl

    from uniap_lightning.runtime.zero import held_bytes
    from uniap_lightning.strategy import UniAPStrategy

    module = h.make_module(**case.get("module", {}))
    strategy = UniAPStrategy(plan=case["plan"])

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.current: dict[str, Any] = {}
            self.result: dict[str, Any] = {}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            rt = strategy.runtime
            self.names = [rt.chain.names[u] for u in rt.plan.layers_of_rank(rt.meshes.rank)]
            self.layers = [layer for m in rt.stage_modules for layer in m.layers]
            self.layers[-1].register_forward_hook(self._forward)

        def _measure(self, trainer: Any) -> dict[str, Any]:
            opts = [getattr(o, "_optimizer", o) for o in trainer.optimizers]
            return {n: held_bytes(layer, opts) for n, layer in zip(self.names, self.layers)}

        def _forward(self, *_: Any) -> None:
            if torch.is_grad_enabled():
                self.current = self._measure(self.trainer)

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            self.trainer = trainer

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            if idx == 0:  # with accumulate_grad_batches=2: inside the window, before its optimizer step
                self.result["window"] = self._measure(trainer)
                self.result["first_in_step"] = self.current  # as in_step, in the first step
            if idx == 1:
                self.result.update(in_step=self.current, after=self._measure(trainer),
                                   bucket=strategy.runtime.replicated.buffer_bytes())

    probe = Probe()
    trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=[probe], **h.trainer_kwargs(case))
    trainer.fit(module, h.make_data(16))
    # whole sizes (a DTensor's numel is its global one); layers of other stages are Identity here
    numel = {n: sum(p.numel() for p in layer.parameters()) for n, layer in zip(h.NAMES, module.net)}
    return {**probe.result, "numel": numel, "plan": strategy.plan.to_dict()}


def _count_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train two steps counting, in the second, each local layer's forward calls with gradients on (a recomputed
    layer runs its forward again in backward)."""
    import lightning.pytorch as pl

    from uniap_lightning.strategy import UniAPStrategy

    module = h.make_module()
    strategy = UniAPStrategy(plan=case["plan"])
    calls: dict[str, int] = {}

    class Count(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            rt = strategy.runtime
            for u in rt.plan.layers_of_rank(rt.meshes.rank):
                name = rt.chain.names[u]
                calls[name] = 0
                # a pre-hook: checkpoint's recomputation stops once it has what backward needs, before post-hooks
                rt.chain.layers[u].register_forward_pre_hook(
                    lambda *_, name=name: calls.__setitem__(name, calls[name] + torch.is_grad_enabled()))

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            if idx == 1:  # count the second step only: the first also runs the pipeline stages' shape inference
                calls.update(dict.fromkeys(calls, 0))

    trainer = pl.Trainer(devices=world, strategy=strategy, callbacks=[Count()], **h.trainer_kwargs(case))
    trainer.fit(module, h.make_data(16))
    return {"calls": calls}


def _skip_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """net.1 is skipped (its input passed through, detached) by every second micro-batch."""
    import lightning.pytorch as pl

    from uniap_lightning.strategy import UniAPStrategy

    class EverySecond(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += torch.is_grad_enabled()
            return self.inner(x) if self.calls % 2 else x.detach().clone()

    module = h.make_module()
    module.net[1] = EverySecond(module.net[1])
    trainer = pl.Trainer(devices=world, strategy=UniAPStrategy(plan=case["plan"]), **h.trainer_kwargs(case))
    trainer.fit(module, h.make_data(16))
    return {}


def _gather_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train two steps counting, per dtype, the elements FSDP2 all-gathers (its ``all_gather_inputs``)."""
    import lightning.pytorch as pl
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    from uniap_lightning.strategy import UniAPStrategy

    module = h.make_module(**case.get("module", {}))
    gathered: dict[str, int] = {}
    plain = FSDPParam.all_gather_inputs

    def counted(self: Any) -> Any:
        out = plain.fget(self)
        for t in out:
            gathered[str(t.dtype)] = gathered.get(str(t.dtype), 0) + t.numel()
        return out

    FSDPParam.all_gather_inputs = property(counted)
    try:
        trainer = pl.Trainer(devices=world, strategy=UniAPStrategy(plan=case["plan"]), **h.trainer_kwargs(case))
        trainer.fit(module, h.make_data(16, lm=True))
    finally:
        FSDPParam.all_gather_inputs = plain
    return {"gathered": gathered}


def worker(rank: int, world: int, port: int, cases: dict[str, dict[str, Any]], out_dir: str) -> None:
    """:func:`uniap_rt_helpers.worker`, plus memory-probe cases."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      NODE_RANK="0", GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    os.chdir(out_dir)
    results: dict[str, Any] = {}
    for name, case in cases.items():
        start = time.monotonic()
        try:
            run = (_probe_case if case.get("probe") else _count_case if case.get("count") else
                   _gather_case if case.get("gather") else
                   _skip_case if case.get("skip") else (lambda r, w, c: h._run_case(r, w, c, Path(out_dir))))
            results[name] = run(rank, world, case)
        except Exception as err:  # recorded, so one broken case does not hide the others
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(),
                             "failed_after_s": time.monotonic() - start}
            break
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def expected_bytes(mode: str, P: int, d: int, microbatches: int) -> dict[str, int]:
    """What a layer of ``P`` local parameters holds per rank under ``mode``: the interfaces formula term by term
    (parameters: ``P b`` / ``P b / d``; gradients: ``P g`` / ``P g / d`` (+ ``P g`` accumulating, zero2 with
    ``m > 1``); optimizer: ``P o`` / ``P o / d``), plus what FSDP2 holds beyond it, named: the shard kept beside
    the gathered parameters (zero1, zero2: ``P b / d``) and zero1's sharded gradient beside the unsharded one
    (``P g / d``). Replicate and zero1 layers' all-reduce buckets (``P g``) are checked per rank."""
    if mode == REP:
        return {"params": P * B, "grads": P * G, "optimizer": P * O}
    formula = {
        Z1: {"params": P * B, "grads": P * G, "optimizer": P * O // d},
        Z2: {"params": P * B, "grads": P * G // d + (P * G if microbatches > 1 else 0), "optimizer": P * O // d},
        Z3: {"params": P * B // d, "grads": P * G // d, "optimizer": P * O // d},
    }[mode]
    if mode in (Z1, Z2):
        formula["params"] += P * B // d  # the shard FSDP2 keeps (and the optimizer updates) beside the gathered one
    if mode == Z1:
        formula["grads"] += P * G // d  # the sharded gradient the optimizer reads, beside the averaged full one
    return formula


def planner_static_bytes(mode: str, P: int, d: int, microbatches: int) -> float:
    """The planner's per-layer memory (``planner.cost.layer.layer_cost(...).static_bytes``) for this layer."""
    from uniap_lightning.planner.config import cluster_from
    from uniap_lightning.planner.cost.layer import Pricing, Strategy, layer_cost
    from uniap_lightning.planner.problem import TrainingConfig
    from uniap_lightning.planner.profile import LayerProfile

    profile = LayerProfile(name="x", forward_s=1e-3, backward_s=2e-3, params=P, activation_bytes=0.0,
                           output_bytes=0.0, param_tensors=2)
    cost = layer_cost(profile, Strategy(d, 1, mode), Pricing(16 // microbatches, d, accumulate=microbatches > 1),
                      cluster=cluster_from("local_cpu"), training=TrainingConfig(global_batch_size=16))
    return cost.static_bytes


def measured_bytes(res: dict[str, Any], name: str) -> dict[str, int]:
    """Per component, the most this rank held at once: parameters with the gathered copy (during the step),
    the unsharded gradient at its largest (during the step) with the sharded one (at its end), optimizer state."""
    during, after = res["in_step"][name], res["after"][name]
    return {"params": during["params"] + during["gathered"],
            "grads": during["unsharded_grads"] + after["grads"],
            "optimizer": after["optimizer"]}


def check_memory(results: list[dict[str, Any]], case: str, world: int) -> list[tuple[Any, ...]]:
    rows = []
    for rank, res in enumerate(results):
        r = res[case]
        assert "error" not in r, r.get("traceback")
        plan = r["plan"]
        bucket = 0
        for lp in plan["layers"]:
            if lp["stage"] != rank // (world // plan["pp"]):
                continue
            P, d = r["numel"][lp["name"]] // lp["tp"], lp["dp"]
            want = expected_bytes(lp["dp_mode"], P, d, plan["microbatches"])
            got = measured_bytes(r, lp["name"])
            rows.append((case, rank, lp["name"], lp["dp_mode"], d, P, got, want))
            assert got == want, (case, rank, lp["name"], lp["dp_mode"], got, want)
            share = P * G if lp["dp_mode"] in (REP, Z1) else 0  # this layer's part of the rank's buckets
            bucket += share
            # the planner's figure: exactly what the rank holds (a plan that claims to fit does fit)
            total, planned = sum(got.values()) + share, planner_static_bytes(lp["dp_mode"], P, d, plan["microbatches"])
            assert total == planned, (case, lp, total, planned)
            # after the step a zero layer holds shards only: nothing gathered, no unsharded gradient left
            if lp["dp_mode"] != REP:
                assert r["after"][lp["name"]]["gathered"] == 0, (case, rank, lp["name"], r["after"])
                assert r["after"][lp["name"]]["unsharded_grads"] == 0, (case, rank, lp["name"], r["after"])
        assert r["bucket"] == bucket, (case, rank, r["bucket"], bucket)
    return rows


# ---------------------------------------------------------------------- resume across plans
SAVE_PLAN = P2([S(2, 1, Z2, True)] * 4, ONE_STAGE, pp=1, microbatches=2)
RESUME_PLAN = P4([S(2, 1, Z1)] * 4, TWO_STAGES, pp=2, microbatches=2)
# the same plan with every layer's activations offloaded: checkpoints are per parameter, offload holds no state
RESUME_PLAN_OFFLOAD = P4([OFF(2, 1, Z1)] * 4, TWO_STAGES, pp=2, microbatches=2)
# and with every layer's state on the host (ZeRO-3 units with CPUOffloadPolicy: the shards and Adam's state reshard
# by name into host tensors)
RESUME_PLAN_STATE_OFFLOAD = P4([SOFF(2, 1, Z3)] * 4, TWO_STAGES, pp=2, microbatches=2)
# and with the middle layers' matmuls in float8 (net.0 and net.3, 8 -> 16 and 16 -> 4, are too narrow for it)
RESUME_PLAN_FP8 = P4([S(2, 1, Z1), FP8(2, 1, Z1), FP8(2, 1, Z1), S(2, 1, Z1)], TWO_STAGES, pp=2, microbatches=2)
# saved with float8 ZeRO-3 layers (torchao wraps their weights for float8 all-gather; the checkpoint holds the
# full-precision tensors inside)
SAVE_PLAN_FP8 = P2([S(2, 1, Z3), FP8(2, 1, Z3), FP8(2, 1, Z3, True), S(2, 1, Z3)], ONE_STAGE, pp=1, microbatches=2)
RESUME_TWO = {
    "save_zero2_recompute": {"plan": SAVE_PLAN, "epochs": 1, "save": "z2rc.ckpt", **ADAM},
    "uninterrupted_zero2_recompute": {"plan": SAVE_PLAN, "epochs": 2, **ADAM},
    "save_fp8_zero3": {"plan": SAVE_PLAN_FP8, "epochs": 1, "save": "fp8z3.ckpt", **ADAM},
}


# recompute on net.1 (stage 0) and net.3 (stage 1), two micro-batches per step
COUNT_PLAN = P2([S(1, 1), S(1, 1, REP, True), S(1, 1), S(1, 1, REP, True)], TWO_STAGES, pp=2, microbatches=2)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("zero_two")
    cases = {**TWO_RANKS, **COMPRESSED, **RESUME_TWO, **FP8_TWO, "memory": {"plan": MEMORY_2, **MEMORY_CASE},
             "memory_window": {"plan": MEMORY_2, **MEMORY_CASE, "accumulate": 2},
             "count": {"plan": COUNT_PLAN, "count": True, "steps": 2},
             # ZeRO-3 layers: the embedding in fp32, a block with float8 all-gather, a block with rowwise scales
             "fp8_gather": {"module": {"lm": "gpt"}, "gather": True, "steps": 1, "plan": P2(
                 [S(2, 1, Z3), FP8(2, 1, Z3), FP8(2, 1, Z3, precision="fp8_rowwise"), S(2, 1)], ONE_STAGE, pp=1,
                 microbatches=1, names=GPT_NAMES)},
             # last: it fails on purpose (a worker stops at a failed case)
             "zero2_skipped_layer": {"plan": P2([S(2, 1, Z2)] * 4, ONE_STAGE, pp=1, microbatches=2), "skip": True,
                                     "steps": 1}}
    return h.spawn(2, cases, out, fn=worker), out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory, two_ranks: Any) -> list[dict[str, Any]]:
    _, two_out = two_ranks
    out = tmp_path_factory.mktemp("zero_four")
    cases = {
        **FOUR_RANKS,
        "resume_zero1_pp2": {"plan": RESUME_PLAN, "epochs": 2, "resume": str(two_out / "z2rc.ckpt"), **ADAM},
        "resume_zero1_pp2_offload": {"plan": RESUME_PLAN_OFFLOAD, "epochs": 2, "resume": str(two_out / "z2rc.ckpt"),
                                     **ADAM},
        "resume_pp2_state_offload": {"plan": RESUME_PLAN_STATE_OFFLOAD, "epochs": 2,
                                     "resume": str(two_out / "z2rc.ckpt"), **ADAM},
        "resume_zero1_pp2_fp8": {"plan": RESUME_PLAN_FP8, "epochs": 2, "resume": str(two_out / "z2rc.ckpt"), **ADAM},
        "load_fp8_zero3_under_zero1_pp2": {"plan": RESUME_PLAN, "validate_only": True, "limit_val_batches": 1,
                                           "resume": str(two_out / "fp8z3.ckpt"), **ADAM},
        "resume_fp8_zero3_under_zero1_pp2": {"plan": RESUME_PLAN, "epochs": 2, "resume": str(two_out / "fp8z3.ckpt"),
                                             **ADAM},
        **FP8_FOUR,
        "memory": {"plan": MEMORY_4, **MEMORY_CASE},
        "memory_pp2": {"plan": MEMORY_PP2, **MEMORY_CASE},
    }
    return h.spawn(4, cases, out, fn=worker)


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_two_ranks_match_single_process(name: str, two_ranks: Any) -> None:
    results, _ = two_ranks
    h.assert_close_to_reference(results, name, h.reference_for(TWO_RANKS[name]))


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_four_ranks_match_single_process(name: str, four_ranks: Any) -> None:
    h.assert_close_to_reference(four_ranks, name, h.reference_for(FOUR_RANKS[name]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO_RANKS_SLOW))
def test_two_ranks_match_single_process_more(name: str, spawn_cases: Any) -> None:
    results = spawn_cases(2, TWO_RANKS_SLOW, "zero_two_slow")
    h.assert_close_to_reference(results, name, h.reference_for(TWO_RANKS_SLOW[name]))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR_RANKS_SLOW))
def test_four_ranks_match_single_process_more(name: str, spawn_cases: Any) -> None:
    results = spawn_cases(4, FOUR_RANKS_SLOW, "zero_four_slow")
    h.assert_close_to_reference(results, name, h.reference_for(FOUR_RANKS_SLOW[name]))


def test_zero1_compressed_like_replicated(two_ranks: Any) -> None:
    results, _ = two_ranks
    for r in results:
        for name in COMPRESSED:
            assert "error" not in r[name], r[name].get("traceback")
    rep, z1 = h.merge_states(results, "replicate_powersgd"), h.merge_states(results, "zero1_powersgd")
    for k in rep:
        torch.testing.assert_close(z1[k], rep[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    assert results[0]["zero1_powersgd"]["losses"] == pytest.approx(results[0]["replicate_powersgd"]["losses"],
                                                                     rel=1e-6)
    # and the compression did something: not the uncompressed run's weights
    plain = h.reference_for({"accumulate": 2})["state"]
    assert max(float((z1[k] - plain[k]).abs().max()) for k in plain) > 1e-4


def test_resume_zero2_recompute_under_zero1_pipeline(two_ranks: Any, four_ranks: Any) -> None:
    """Saved on 2 ranks (zero2 + recomputation, one stage), resumed on 4 (zero1, two stages): the second epoch
    continues as if uninterrupted (weights and Adam state resharded by name)."""
    two, _ = two_ranks
    for r in two:
        assert "error" not in r["save_zero2_recompute"], r["save_zero2_recompute"].get("traceback")
    for r in four_ranks:
        assert "error" not in r["resume_zero1_pp2"], r["resume_zero1_pp2"].get("traceback")
    full, resumed = h.merge_states(two, "uninterrupted_zero2_recompute"), h.merge_states(four_ranks, "resume_zero1_pp2")
    assert sorted(full) == sorted(resumed)
    for k in full:
        torch.testing.assert_close(resumed[k], full[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(torch.tensor(four_ranks[0]["resume_zero1_pp2"]["losses"]),
                               torch.tensor(two[0]["uninterrupted_zero2_recompute"]["losses"][4:]), rtol=1e-5,
                               atol=1e-7)


def test_resume_under_plans_that_differ_in_offload(two_ranks: Any, four_ranks: Any) -> None:
    """The same checkpoint resumed under the resume plan above with every layer's activations offloaded: the same
    state and losses (offload keeps no state; checkpoints are per parameter)."""
    two, _ = two_ranks
    for r in four_ranks:
        assert "error" not in r["resume_zero1_pp2_offload"], r["resume_zero1_pp2_offload"].get("traceback")
    full, resumed = h.merge_states(two, "uninterrupted_zero2_recompute"), h.merge_states(four_ranks,
                                                                                         "resume_zero1_pp2_offload")
    assert sorted(full) == sorted(resumed)
    for k in full:
        torch.testing.assert_close(resumed[k], full[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert four_ranks[0]["resume_zero1_pp2_offload"]["losses"] == pytest.approx(
        four_ranks[0]["resume_zero1_pp2"]["losses"], rel=1e-6)


def test_resume_under_plans_that_differ_in_state_offload(two_ranks: Any, four_ranks: Any) -> None:
    """The zero2 checkpoint (state on the devices) resumed with every layer's state on the host: the second epoch
    continues as if uninterrupted (the shards and Adam's state land in FSDP2's host tensors, by name)."""
    two, _ = two_ranks
    for r in four_ranks:
        assert "error" not in r["resume_pp2_state_offload"], r["resume_pp2_state_offload"].get("traceback")
    full, resumed = h.merge_states(two, "uninterrupted_zero2_recompute"), h.merge_states(four_ranks,
                                                                                         "resume_pp2_state_offload")
    assert sorted(full) == sorted(resumed)
    for k in full:
        torch.testing.assert_close(resumed[k], full[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(torch.tensor(four_ranks[0]["resume_pp2_state_offload"]["losses"]),
                               torch.tensor(two[0]["uninterrupted_zero2_recompute"]["losses"][4:]), rtol=1e-5,
                               atol=1e-7)


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal to quantization noise, as torchao's ``compute_error``: ``20 log10(|ref| / |ref - got|)``."""
    return float(20 * torch.log10(ref.norm() / (ref - got).norm()))


def _fp8_gap(results: list[dict[str, Any]], name: str) -> tuple[float, float, float]:
    """(loss SQNR dB, largest loss gap, parameters' SQNR dB) of an fp8 case against one fp32 process."""
    for r in results:
        assert "error" not in r[name], r[name].get("traceback")
    case = {k: v for k, v in {**FP8_TWO, **FP8_FOUR}[name].items() if k != "plan"}
    ref = h.reference_for(case)
    losses, want = torch.tensor(results[-1][name]["losses"]), torch.tensor(ref["losses"])
    assert len(losses) == len(want) == FP8_STEPS
    state = h.merge_states(results, name)
    assert all(state[k].dtype == torch.float32 for k in state)  # master weights stay in full precision
    params = torch.cat([state[k].flatten() for k in sorted(ref["state"])])
    ref_params = torch.cat([ref["state"][k].flatten() for k in sorted(ref["state"])])
    return _sqnr_db(want, losses), float((losses - want).abs().max()), _sqnr_db(ref_params, params)


@pytest.mark.parametrize("name", list(FP8_TWO))
def test_fp8_two_ranks_within_float8_tolerance_of_fp32(name: str, two_ranks: Any) -> None:
    """50 steps of the tiny GPT with float8 matmuls on 2 processes: the losses and the final parameters within
    what torchao's float8 tests accept of the fp32 run (the measured gap is far inside it), and not equal to it
    (the float8 path really ran)."""
    results, _ = two_ranks
    loss_db, gap, param_db = _fp8_gap(results, name)
    assert loss_db >= FP8_LOSS_SQNR_DB and param_db >= FP8_PARAM_SQNR_DB, (loss_db, gap, param_db)
    assert gap > 0


def test_fp8_four_ranks_within_float8_tolerance_of_fp32(four_ranks: Any) -> None:
    for name in FP8_FOUR:
        loss_db, gap, param_db = _fp8_gap(four_ranks, name)
        assert loss_db >= FP8_LOSS_SQNR_DB and param_db >= FP8_PARAM_SQNR_DB, (name, loss_db, gap, param_db)
        assert gap > 0


def test_fp8_on_two_processes_equals_fp8_on_one(two_ranks: Any) -> None:
    """Two pipeline stages, one micro-batch: each float8 matmul sees what it sees in one process running the same
    layers in float8 (same amax, same scales), so the 50 losses and the parameters agree to fp32 rounding."""
    results, _ = two_ranks
    for name, layers in FP8_REFERENCE.items():
        for r in results:
            assert "error" not in r[name], r[name].get("traceback")
        case = {k: v for k, v in FP8_TWO[name].items() if k != "plan"}
        ref = h.reference_for({**case, "module": {"factory": "test_zero_recompute:fp8_lm", "lm": "gpt",
                                                  "layers": layers}})
        torch.testing.assert_close(torch.tensor(results[-1][name]["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=1e-6)
        state = h.merge_states(results, name)
        for k in ref["state"]:
            torch.testing.assert_close(state[k], ref["state"][k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_zero3_gathers_float8_weights_under_tensorwise_scales(two_ranks: Any) -> None:
    """FSDP2's all-gather inputs of one step: the tensorwise fp8 block's six matmul weights (24,576 elements, half
    of them per rank, in each of its gathers) travel as float8_e4m3fn; the embedding, the rowwise block's weights
    (torchao gathers only tensorwise weights in float8) and every bias and norm in fp32."""
    results, _ = two_ranks
    for r in results:
        assert "error" not in r["fp8_gather"], r["fp8_gather"].get("traceback")
        gathered = r["fp8_gather"]["gathered"]
        block = 4 * 32 * 32 + 2 * 32 * 128  # q, k, v, proj; fc, fc_proj
        assert gathered["torch.float8_e4m3fn"] > 0 and gathered["torch.float8_e4m3fn"] % (block // 2) == 0, gathered
        assert gathered["torch.float32"] > block // 2  # the rowwise block's weights among them


def test_resume_under_plans_that_differ_in_precision(two_ranks: Any, four_ranks: Any) -> None:
    """The fp32 checkpoint (zero2 + recomputation, 2 ranks) resumed on 4 ranks with the middle layers in float8:
    it loads (master weights are full precision, parameter names unchanged), trains on, and ends within float8's
    tolerance of the uninterrupted fp32 run."""
    two, _ = two_ranks
    for r in four_ranks:
        assert "error" not in r["resume_zero1_pp2_fp8"], r["resume_zero1_pp2_fp8"].get("traceback")
    full, resumed = h.merge_states(two, "uninterrupted_zero2_recompute"), h.merge_states(four_ranks,
                                                                                         "resume_zero1_pp2_fp8")
    assert sorted(full) == sorted(resumed) and all(resumed[k].dtype == torch.float32 for k in resumed)
    flat = [torch.cat([s[k].flatten() for k in sorted(full)]) for s in (full, resumed)]
    assert _sqnr_db(flat[0], flat[1]) >= FP8_PARAM_SQNR_DB
    losses, want = (torch.tensor(four_ranks[-1]["resume_zero1_pp2_fp8"]["losses"]),
                    torch.tensor(four_ranks[-1]["resume_zero1_pp2"]["losses"]))
    assert _sqnr_db(want, losses) >= FP8_LOSS_SQNR_DB and not torch.equal(losses, want)


def test_a_checkpoint_saved_with_float8_zero3_loads_exactly_under_a_default_plan(two_ranks: Any,
                                                                                   four_ranks: Any) -> None:
    """Saved on 2 ranks with float8 ZeRO-3 layers (float8 all-gather wraps their weights), loaded on 4 under the zero1
    pipeline plan in the default precision: the very weights saved (plain fp32 tensors in the checkpoint), and
    training resumes from them."""
    two, _ = two_ranks
    for r in two:
        assert "error" not in r["save_fp8_zero3"], r["save_fp8_zero3"].get("traceback")
    for name in ("load_fp8_zero3_under_zero1_pp2", "resume_fp8_zero3_under_zero1_pp2"):
        for r in four_ranks:
            assert "error" not in r[name], r[name].get("traceback")
    saved, loaded = h.merge_states(two, "save_fp8_zero3"), h.merge_states(four_ranks, "load_fp8_zero3_under_zero1_pp2")
    assert sorted(saved) == sorted(loaded)
    for k in saved:
        assert loaded[k].dtype == torch.float32
        torch.testing.assert_close(loaded[k], saved[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    assert len(four_ranks[-1]["resume_fp8_zero3_under_zero1_pp2"]["losses"]) == 4  # the second epoch


def test_memory_per_mode_two_ranks(two_ranks: Any) -> None:
    results, _ = two_ranks
    rows = check_memory(results, "memory", 2)
    assert {row[3] for row in rows} == {REP, Z1, Z2, Z3}


def test_memory_per_mode_four_ranks(four_ranks: Any) -> None:
    rows = check_memory(four_ranks, "memory", 4)
    # the optimizer state of a zero layer is a quarter of the replicated one's per parameter
    by_mode = {row[3]: row[6]["optimizer"] / row[5] for row in rows}
    assert by_mode[REP] == O and by_mode[Z1] == by_mode[Z2] == by_mode[Z3] == O / 4


def test_recomputed_layers_run_forward_again(two_ranks: Any) -> None:
    """Per micro-batch a recomputed layer's forward runs twice with gradients on (forward, then in backward),
    the others once: the recomputation really happens (the equivalence tests show it changes no number)."""
    results, _ = two_ranks
    calls = {}
    for r in results:
        assert "error" not in r["count"], r["count"].get("traceback")
        calls.update(r["count"]["calls"])
    assert calls == {"net.0": 2, "net.1": 4, "net.2": 2, "net.3": 4}, calls


def test_accumulation_window_keeps_one_gather_and_no_reduction(two_ranks: Any) -> None:
    """Between the batches of an accumulation window (accumulate_grad_batches=2) zero1 / zero2 layers stay gathered
    and keep the unsharded gradient (nothing reduced, nothing gathered again); zero3 has reduce-scattered."""
    results, _ = two_ranks
    for rank, res in enumerate(results):
        r = res["memory_window"]
        assert "error" not in r, r.get("traceback")
        for lp in r["plan"]["layers"]:
            P, d, got = r["numel"][lp["name"]], lp["dp"], r["window"][lp["name"]]
            want = {REP: (0, 0, P * G), Z1: (P * B, P * G, 0), Z2: (P * B, P * G, 0), Z3: (0, 0, P * G // d)}
            assert (got["gathered"], got["unsharded_grads"], got["grads"]) == want[lp["dp_mode"]], (rank, lp, got)


def test_memory_pipeline_first_step_like_the_others(four_ranks: Any) -> None:
    """Under pp the first step also runs the stages' shape inference (a forward and, on the last stage, an
    ``autograd.grad``): it must not count as a micro-batch, or zero1/zero2 would reduce and reshard a micro-batch
    early. At the last forward of the first step every layer holds what it holds in later steps; on the last stage
    (1F1B: forward 0, backward 0, forward 1) that is the gathered parameters and the first micro-batch's unsharded
    gradient, nothing reduced yet."""
    for rank, res in enumerate(four_ranks):
        r = res["memory_pp2"]
        assert "error" not in r, r.get("traceback")
        for name, now in r["first_in_step"].items():
            later = r["in_step"][name]
            # (the optimizer state exists only from the first optimizer step on)
            assert {k: v for k, v in now.items() if k != "optimizer"} == {
                k: v for k, v in later.items() if k != "optimizer"}, (rank, name, now, later)
            if rank >= 2:
                P = r["numel"][name]
                assert (now["gathered"], now["unsharded_grads"], now["grads"]) == (P * B, P * G, 0), (rank, name, now)


def test_zero2_layer_skipped_by_the_last_micro_batch_is_an_error(two_ranks: Any) -> None:
    """FSDP2 reduce-scatters in the post-backward of the backward that syncs; a layer that backward skips would
    keep its gradient unreduced (and the optimizer would step without it): refused, naming the way out."""
    results, _ = two_ranks
    for r in results:
        err = r["zero2_skipped_layer"].get("error", "")
        assert "UniAPError" in err and "got no gradient in the last micro-batch" in err, r["zero2_skipped_layer"]
