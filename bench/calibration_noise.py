"""How well calibration in place measures regions held to CPU quotas: each region's measured step time per
micro-batch, its dispersion, what a calibration costs, and whether the first plan pools regions whose speeds differ.

Usage:  python bench/calibration_noise.py [--quotas 0.5,0.25,0.15] [--repeats 3] [--out runs/calibration-noise]
        [--preset micro] [--seq-len 64] [--batch 8] [--inner-steps 10] [--vocab 4096] [--sequential]

One process per quota, each in a control group of its own at that share of a core (the hosts test bed's quotas:
:class:`~geomesh.testbed.quotas.CpuQuotas`, weighted as the bed weighs them, ``OMP_NUM_THREADS=1``),
all at once as the bed's regions calibrate (``--sequential``: one after another). Each builds region i's worker of
the bed's scenario (``bench/wallclock.py``'s: the ``micro`` model on the bundled corpus, DiLoCo's b = 8, H = 10;
region names r0-h100, r1-a100, r2-t4 so the datasheet plan is the bed's) as the distributed runtime builds it and
calibrates it ``--repeats`` times as :meth:`~geomesh.runtime.distributed.plan_loop.PlanLoop.calibrate` does
(the candidates from the datasheet plan, :func:`~geomesh.profiler.calibrate_worker`), keeping every timed sample;
then the *truth*: one long window of what a round of the reference plan runs (``--inner-steps`` steps of
``--batch`` sequences, timed as a whole, three times).

Per quota: the candidates, the calibrated line's step time at each (median over the calibrations and the spread),
the calibrations' own noise estimate (``table_noise``), the dispersion of the calibrated step time at the reference
batch from calibration to calibration, its ratio to the truth, and the calibration's wall time and steps. Per
repeat: the groups :func:`~geomesh.planner.settle.settled_profiles` makes of the regions' calibrations (the first
plan's pooling) and the plan. Writes ``OUT/results.json`` and prints a table. Needs root (cgroups).

The calibration code measured is whatever ``geomesh`` this interpreter imports (``PYTHONPATH``): a copy of an
older ``src/`` measures the code before a change.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NAMES = ("r0-h100", "r1-a100", "r2-t4")


def log_dispersion(values: list[float]) -> float | None:
    """The robust relative dispersion (1.4826 × the median absolute log-deviation from the median) of ``values``."""
    if len(values) < 2:
        return None
    mid = statistics.median(values)
    return 1.4826 * statistics.median(abs(math.log(v / mid)) for v in values)


# ---- one region: a child process in its control group ---------------------------------------------------------
def child(args: argparse.Namespace) -> int:
    Path(args.procs).write_text(f"{os.getpid()}\n")  # into the group first: every thread torch starts is in it
    import torch

    import geomesh.profiler as profiler
    from geomesh.config import load_scenario
    from geomesh.methods import get_method
    from geomesh.runtime.distributed.region import RegionWorker, build_training

    torch.manual_seed(0)
    sc = load_scenario(args.scenario)
    training = build_training(sc, args.region, seed=0, device=torch.device("cpu"))
    worker = RegionWorker(sc.regions[args.region].name, training.replica, training.stream, sc.training,
                          device=torch.device("cpu"))  # fmt: skip
    method = get_method("geomesh")
    datasheet = method.plan(sc, sc.worker_profiles())
    top = max([sc.training.batch, *(w.micro_batch for w in datasheet.workers)])
    cap = worker.max_proxy_micro_batch * worker.size
    samples: list[tuple[int, float]] = []  # every timed forward + backward (one step, or a window's mean)
    real = profiler._timed_training_step

    def spy(*a, **k):
        out = real(*a, **k)
        samples.append((a[1], out[0]))
        return out

    profiler._timed_training_step = spy
    calibrations = []
    for _ in range(args.repeats):
        samples.clear()
        cal = profiler.calibrate_worker(worker, profiler.default_micro_batches(top, cap, sc.training.batch))
        calibrations.append({"profile": cal.profile.to_json(), "seconds": cal.seconds, "steps": cal.steps,
                             "samples": list(samples)})  # fmt: skip
    profiler._timed_training_step = real
    truth = []
    b, h = sc.training.batch, sc.training.inner_steps
    worker.inner_step(b, sc.training.inner_lr)  # warm
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(h):
            worker.inner_step(b, sc.training.inner_lr)
        truth.append((time.perf_counter() - started) / h)
    Path(args.result).write_text(json.dumps({"region": sc.regions[args.region].name, "cores": args.cores,
                                             "top": top, "calibrations": calibrations, "truth_step_s": truth}))  # fmt: skip
    return 0


# ---- the parent: groups, children, the table -------------------------------------------------------------------
def summarise(regions: list[dict], scenario_path: str) -> dict:
    """Per quota and per repeat, from the children's results (pure but for loading the scenario)."""
    from geomesh.config import load_scenario
    from geomesh.hardware import WorkerProfile
    from geomesh.methods import get_method
    from geomesh.planner.settle import settled_profiles

    sc = load_scenario(scenario_path)
    ref = sc.training.batch
    per_quota = []
    for r in regions:
        cals = r["calibrations"]
        profiles = [WorkerProfile.from_json(c["profile"]) for c in cals]
        truth = statistics.median(r["truth_step_s"])
        at_ref = [p.step_s(ref, 1) for p in profiles]
        tables = {}
        for m in sorted({int(m) for p in profiles for m in p.table}):
            ts = [p.table[m] for p in profiles if m in p.table]
            tables[m] = {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}
        raw = {}
        for c in cals:
            for m, t in c["samples"]:
                raw.setdefault(int(m), []).append(t)
        per_quota.append({
            "region": r["region"], "cores": r["cores"], "top": r["top"],
            "candidates": sorted({int(m) for c in cals for m in c["profile"]["extra"].get("measured_table", {})}),
            "line_s": tables, "step_s_at_ref": at_ref, "truth_step_s": truth,
            "ref_over_truth": statistics.median(at_ref) / truth,
            "ref_dispersion_between_calibrations": log_dispersion(at_ref),
            "table_noise": [p.extra.get("table_noise") for p in profiles],
            "sample_dispersion": {m: log_dispersion(ts) for m, ts in sorted(raw.items())},
            "seconds": [c["seconds"] for c in cals], "steps": [c["steps"] for c in cals],
        })  # fmt: skip
    method = get_method("geomesh")
    constraints = method.constraints(sc, len(regions))
    pooling = []
    for k in range(min(len(r["calibrations"]) for r in regions)):
        profiles = [WorkerProfile.from_json(r["calibrations"][k]["profile"]) for r in regions]
        settled = settled_profiles(profiles, constraints, sc.geomesh.replan_noise_k)
        plan = method.plan(sc, settled)
        groups: dict[float, list[str]] = {}
        for p in settled:
            groups.setdefault(round(p.step_s(ref, 1), 12), []).append(p.name)
        pooling.append({"repeat": k + 1, "groups": sorted(groups.values()),
                        "plan": [(w.name, w.micro_batch, w.batch, w.inner_steps) for w in plan.workers]})  # fmt: skip
    return {"quotas": per_quota, "first_plans": pooling}


def print_table(summary: dict) -> None:
    print("| region | cores | candidates | step s at b (median, min-max) | at ref / truth | ref between calibrations |"
          " table_noise | calibration s | steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for q in summary["quotas"]:
        line = ", ".join(f"{m}: {v['median_s']:.3f} ({v['min_s']:.3f}-{v['max_s']:.3f})" for m, v in q["line_s"].items())
        noise = ", ".join(f"{u:.3f}" for u in q["table_noise"] if u is not None)
        disp = q["ref_dispersion_between_calibrations"]
        secs = ", ".join(f"{s:.1f}" for s in q["seconds"])
        print(f"| {q['region']} | {q['cores']:g} | {q['candidates']} | {line} | {q['ref_over_truth']:.2f} "
              f"(truth {q['truth_step_s']:.3f} s) | {'-' if disp is None else f'{disp:.3f}'} | {noise} | {secs} | "
              f"{', '.join(str(s) for s in q['steps'])} |")  # fmt: skip
    for p in summary["first_plans"]:
        print(f"repeat {p['repeat']}: pooled {p['groups']}; plan {p['plan']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quotas", default="0.5,0.25,0.15", help="cores of r0,r1,r2 (CPU quotas)")
    p.add_argument("--repeats", type=int, default=3, help="calibrations per region")
    p.add_argument("--out", default="runs/calibration-noise")
    p.add_argument("--preset", default="micro")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--sequential", action="store_true", help="one region after another instead of all at once")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--region", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cores", type=float, help=argparse.SUPPRESS)
    p.add_argument("--procs", help=argparse.SUPPRESS)
    p.add_argument("--scenario", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)

    import yaml

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from wallclock import scenario

    from geomesh.testbed.quotas import CpuQuotas, quota_unavailable_reason

    quotas = [float(x) for x in args.quotas.split(",")]
    if len(quotas) != len(NAMES) or args.repeats < 1:
        print(f"error: --quotas: {len(NAMES)} core counts expected and --repeats >= 1", file=sys.stderr)
        return 2
    if reason := quota_unavailable_reason():
        print(f"error: CPU quotas cannot be set here: {reason}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "scenario.yaml"
    data = scenario(args.preset, args.seq_len, args.batch, args.inner_steps, 10.0, 3e-3, None, args.vocab, None, 10**12)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    from geomesh.config import load_scenario
    from geomesh.data import load_corpus

    load_corpus(load_scenario(str(path)).data)  # the data cache filled once, before the regions start
    groups = CpuQuotas(f"cal{os.getpid()}", weight=100)
    started = time.perf_counter()
    try:
        procs = []
        for i, cores in enumerate(quotas):
            groups.set(NAMES[i], cores)
            cmd = [sys.executable, __file__, "--child", "--region", str(i), "--cores", str(cores),
                   "--procs", str(groups.procs_file(NAMES[i])), "--scenario", str(path),
                   "--repeats", str(args.repeats), "--result", str(out / f"{NAMES[i]}.json")]  # fmt: skip
            proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if args.sequential:
                proc.wait()
            procs.append(proc)
        codes = [proc.wait() for proc in procs]
    finally:
        groups.close()
    if any(codes):
        print(f"error: a region's process failed (exit codes {codes})", file=sys.stderr)
        return 1
    regions = [json.loads((out / f"{n}.json").read_text()) for n in NAMES]
    summary = summarise(regions, str(path))
    summary.update({"quotas_cores": quotas, "repeats": args.repeats, "sequential": args.sequential,
                    "wall_s": time.perf_counter() - started, "load_average": os.getloadavg()})  # fmt: skip
    (out / "results.json").write_text(json.dumps({"summary": summary, "regions": regions}, indent=1))
    print_table(summary)
    print(f"wall {summary['wall_s']:.0f} s, load average {summary['load_average'][0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
