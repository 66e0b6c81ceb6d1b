"""Planning for a heterogeneous pool (conf/cluster/a100_v100_4x8: 16 A100-80GB + 16 V100-32GB): the plan, the
same planner told every device is an A100 (its plan scored on the real pool), and the baselines.

    python benchmarks/heterogeneous.py
"""
from dataclasses import replace
from uniap_lightning.planner.config import build_problem
from uniap_lightning.planner.cost import evaluate
from uniap_lightning.planner.solver import solve as search
print("| model | batch | plan (stages: blocks on A100 / V100) | plan ms/iter | told all equal: its plan on the real pool | baselines on the real pool (ms; - = does not fit) |")
print("|---|---|---|---|---|---|")
for model, batch in [("gpt2_xl", 64), ("llama_7b", 64), ("llama_13b", 64), ("bert_huge", 128)]:
    pr = build_problem(model=model, cluster="a100_v100_4x8", global_batch_size=batch)
    plan = search(pr, time_limit_s=60)
    eq = replace(pr, cluster=replace(pr.cluster, rank_speed=None, rank_memory_gib=None, rank_device=None))
    naive = search(eq, time_limit_s=60)
    ne = evaluate(pr, naive)
    base = {k: v for k, v in plan.baselines.items() if v is not None}
    bl = ", ".join(f"{k} {v*1e3:,.0f}" if v is not None else f"{k} -" for k, v in plan.baselines.items())
    split = " / ".join(f"{len(plan.layers_of_stage(i))}" + ("V" if "V100" in plan.estimate.stage_device[i] else "A") for i in range(plan.pp))
    nt = f"{ne.tpi_s*1e3:,.0f} ms" + ("" if ne.feasible else " (does not fit)")
    print(f"| {model} | {batch} | pp={plan.pp}: {split} | {plan.estimate.tpi_s*1e3:,.0f} | {nt} | {bl} |")
