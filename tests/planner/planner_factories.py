from __future__ import annotations

import random
from dataclasses import replace

from uniap_lightning.planner.cluster import Cluster
from uniap_lightning.planner.problem import Problem, TrainingConfig
from uniap_lightning.planner.profile import LayerProfile, ModelProfile, Overhead


def random_problem(seed: int, *, num_layers: int, nodes: int, per_node: int, batch: int = 8,
                   schedule: str = "1f1b", memory_gib: float | None = None,
                   compression: tuple[str, ...] = ("none",)) -> Problem:
    """A random chain with heterogeneous layers on a random cluster, seeded. ``compression``: the methods the
    solver may choose (with them, some layers get measured PowerSGD dimensions and the cluster measured
    compression figures)."""
    rng = random.Random(seed)
    layers = []
    for u in range(num_layers):
        fwd = rng.uniform(1e-4, 5e-3)
        layers.append(
            LayerProfile(
                name=f"l{u}",
                forward_s=fwd,
                backward_s=fwd * rng.uniform(1.5, 2.5),
                params=rng.randint(1, 120) * 1_000_000,
                activation_bytes=rng.uniform(1e6, 1e8),
                output_bytes=rng.uniform(1e5, 5e7),
                tp_degrees=tuple(sorted(rng.sample([1, 2, 4], rng.randint(1, 3)) + [1]))[-3:] if u % 3 else (1, 2),
                tp_allreduces=rng.choice([0, 1, 2]),
                activation_tp_fraction=rng.uniform(0.5, 1.0),
            )
        )
    layers = [
        LayerProfile(**{**lp.__dict__, "tp_degrees": tuple(sorted(set(lp.tp_degrees) | {1}))}) for lp in layers
    ]
    cluster = Cluster(
        name=f"rand{seed}",
        nodes=nodes,
        devices_per_node=per_node,
        memory_gib=memory_gib if memory_gib is not None else rng.choice([4.0, 8.0, 16.0, 40.0]),
        peak_tflops=10,
        efficiency=0.5,
        intra_bw_gbps=rng.uniform(5, 100),
        inter_bw_gbps=rng.uniform(0.5, 10),
        intra_latency_us=rng.uniform(1, 20),
        inter_latency_us=rng.uniform(5, 50),
    )
    # drawn last, so earlier seeds keep their chains: measured terms on some instances (pipeline slot overhead,
    # per-layer TP / FSDP overheads), which the MILP must price exactly as evaluate() does
    if seed % 3 == 1:
        cluster = replace(cluster, pipeline_overhead_us=rng.uniform(50, 3000))
    if seed % 4 == 2:  # a measured optimizer step: per iteration, on the parameters each rank holds
        cluster = replace(cluster, optimizer_ns_per_param=rng.uniform(0.1, 5.0))
    if seed % 2 == 1:
        layers = [
            replace(lp, overheads=tuple(
                Overhead(kind, k, m, rng.uniform(-1e-4, 5e-3))
                for kind in ("tp", "fsdp") for k in (2, 4) for m in (1, 4)
            )) if u % 2 == 0 else lp
            for u, lp in enumerate(layers)
        ]
    options = {}
    if set(compression) - {"none"}:  # drawn last again: the chains above stay as they were for every seed
        layers = [replace(lp, param_tensors=rng.randint(1, 6), matrix_dims=(rng.uniform(2e3, 2e4) if u % 2 else None),
                          vector_params=(rng.randint(0, 10_000) if u % 2 else None))
                  for u, lp in enumerate(layers)]
        if seed % 2:
            cluster = replace(cluster, compression_ns_per_param={"bf16": rng.uniform(0.01, 1), "topk": rng.uniform(0.1, 5),
                                                                 "powersgd": rng.uniform(0.05, 2)})
        options = {"powersgd_rank": rng.choice([1, 2, 4]), "topk_ratio": rng.choice([0.001, 0.01, 0.1])}
    training = TrainingConfig(global_batch_size=batch, schedule=schedule)
    return Problem(ModelProfile("random", layers), cluster, training, compression=compression,
                   compression_options=options)


def repeated_problem(seed: int, *, pattern: str, nodes: int, per_node: int, batch: int = 8,
                     schedule: str = "1f1b", memory_gib: float = 8.0, compression: tuple[str, ...] = ("none",)) -> Problem:
    """Like :func:`random_problem`, but layers follow ``pattern`` (e.g. "ABBBBC"): equal letters are identical
    layers, so runs of repeated blocks (what the grouped MILP aggregates) appear."""
    base = random_problem(seed, num_layers=len(set(pattern)), nodes=nodes, per_node=per_node, batch=batch,
                          schedule=schedule, memory_gib=memory_gib, compression=compression)
    templates = {ch: base.model.layers[j] for j, ch in enumerate(sorted(set(pattern)))}
    layers = [LayerProfile(**{**templates[ch].__dict__, "name": f"{ch}{u}"}) for u, ch in enumerate(pattern)]
    return Problem(ModelProfile("repeated", layers), base.cluster, base.training, compression=base.compression,
                   compression_options=base.compression_options)


def forced_problem(seed: int, *, memory_gib: float, activation_scale: float, param_scale: float,
                   num_layers: int = 4, nodes: int = 1, per_node: int = 2,
                   compression: tuple[str, ...] = ("none",)) -> Problem:
    """:func:`random_problem` with activations scaled up and parameters down: with little memory the optimum
    must recompute activations, shard, or accumulate (ZeRO-1 / ZeRO-2 then differ)."""
    base = random_problem(seed, num_layers=num_layers, nodes=nodes, per_node=per_node, schedule="gpipe",
                          memory_gib=memory_gib, compression=compression)
    layers = [replace(lp, params=int(lp.params * param_scale), activation_bytes=lp.activation_bytes * activation_scale)
              for lp in base.model.layers]
    return Problem(ModelProfile("forced", layers), base.cluster, base.training, compression=base.compression,
                   compression_options=base.compression_options)


def moe_problem(seed: int, *, num_layers: int, nodes: int, per_node: int, memory_gib: float, batch: int = 8,
                schedule: str = "1f1b") -> Problem:
    """:func:`random_problem` with mixture-of-experts layers: every odd layer holds 2, 4 or 8 experts (top-1 or
    top-2, most of its parameters inside them, a capacity factor on some), and on odd seeds the cluster has a
    measured all-to-all table, so expert parallelism has something to win (memory, gradient sync) and to pay."""
    base = random_problem(seed, num_layers=num_layers, nodes=nodes, per_node=per_node, batch=batch,
                          schedule=schedule, memory_gib=memory_gib)
    rng = random.Random(10_000 + seed)
    layers = []
    for u, lp in enumerate(base.model.layers):
        if u % 2:
            E = rng.choice([2, 4, 8])
            lp = replace(lp, experts=E, top_k=rng.choice([1, 2]), expert_params=int(lp.params * rng.uniform(0.6, 0.95)),
                         capacity_factor=rng.choice([None, 1.25]))
        layers.append(lp)
    cluster = base.cluster
    if seed % 2:
        cluster = replace(cluster, collective_tables={"all_to_all": {
            "intra": {2: {"bw_gbps": rng.uniform(1, 50), "latency_us": rng.uniform(5, 50)},
                      4: {"bw_gbps": rng.uniform(1, 50), "latency_us": rng.uniform(5, 50)}},
            "inter": {4: {"bw_gbps": rng.uniform(0.5, 5), "latency_us": rng.uniform(10, 100)}}}})
    return Problem(ModelProfile("moe", layers), cluster, base.training)


def offload_problem(seed: int, *, num_layers: int, nodes: int, per_node: int, memory_gib: float,
                    activation_scale: float = 1.0, schedule: str = "1f1b") -> Problem:
    """:func:`random_problem` on a cluster that allows activation offload (``offload: auto``) over a host link of
    a random effective bandwidth (slow, PCIe-like, to fast, NVLink-C2C-like), activations scaled by
    ``activation_scale``: offload competes with recomputation, sharding and pipelining where memory binds."""
    base = random_problem(seed, num_layers=num_layers, nodes=nodes, per_node=per_node, schedule=schedule,
                          memory_gib=memory_gib)
    rng = random.Random(20_000 + seed)
    cluster = replace(base.cluster, offload="auto", host_link_gbps=rng.choice([2.0, 25.0, 360.0]))
    layers = [replace(lp, activation_bytes=lp.activation_bytes * activation_scale) for lp in base.model.layers]
    return Problem(ModelProfile("chain", layers), cluster, base.training)


def fp8_problem(seed: int, *, num_layers: int, nodes: int, per_node: int, memory_gib: float,
                fp8: tuple[str, ...] = ("fp8", "fp8_rowwise"), device: str = "h100_sxm") -> Problem:
    """:func:`random_problem` on a cluster of catalogue ``device`` (H100: fp8 at twice the bf16 peak) with the float8
    precisions ``fp8`` allowed. Each layer gets a sequence length (odd: no context parallelism, the space stays
    small) that makes its matmuls, priced at the device's bf16 peak, 30% to 150% of its compute: fp8 wins where
    they dominate and large batches amortize the casts, loses where they do not."""
    base = random_problem(seed, num_layers=num_layers, nodes=nodes, per_node=per_node, memory_gib=memory_gib)
    rng = random.Random(30_000 + seed)
    layers = []
    for lp in base.model.layers:
        tokens = rng.uniform(0.3, 1.5) * (lp.forward_s + lp.backward_s) * 989e12 * 0.75 / (6 * lp.params)
        layers.append(replace(lp, sequence_length=2 * max(int(tokens) // 2, 1) + 1))
    cluster = replace(base.cluster, device=device)
    return Problem(ModelProfile("chain", layers), cluster, base.training, opt_ins={"fp8": fp8})
