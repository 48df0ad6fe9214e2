"""Planner speed and quality on random heterogeneous clusters, GeoMesh's balanced plan beside the uniform one.

    python bench/planner.py [--workers 4,16,64] [--clusters 20] [--seed 0]

For each cluster size: seeded random clusters of catalog GPUs (1-8 GPUs per region), the planning rule (the
reference plan, batch 16 and 30 inner steps, on the slowest worker sets the round); prints one JSON line per
size with the median and maximum planning time and the worst predicted straggler idle of both plans.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from geomesh.hardware import GPU_CATALOG, TimingModel, model_profile
from geomesh.planner import PlanConstraints, plan_balanced, plan_uniform


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="4,16,64")
    ap.add_argument("--clusters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    timing = TimingModel(n_layers=24, hidden=1024, seq_len=1024)
    gpus = [g for g in GPU_CATALOG if timing.max_micro_batch(GPU_CATALOG[g]) > 0]
    rng = random.Random(args.seed)
    for n in (int(x) for x in args.workers.split(",")):
        seconds, idle, uniform_idle = [], [], []
        for _ in range(args.clusters):
            profiles = [model_profile(f"w{i}", rng.choice(gpus), rng.randint(1, 8), timing) for i in range(n)]
            t0 = time.perf_counter()
            rule = PlanConstraints(fill=True, ref_batch=16, ref_inner_steps=30, max_inner_steps=400)
            plan = plan_balanced(profiles, rule)
            seconds.append(time.perf_counter() - t0)
            idle.append(plan.straggler_idle_frac)
            uniform_idle.append(plan_uniform(profiles, 16, 30).straggler_idle_frac)
        print(json.dumps({"workers": n, "clusters": args.clusters, "plan_s_median": round(statistics.median(seconds), 4),
                          "plan_s_max": round(max(seconds), 4), "geomesh_idle_max": round(max(idle), 4),
                          "uniform_idle_median": round(statistics.median(uniform_idle), 4)}))  # fmt: skip


if __name__ == "__main__":
    main()
