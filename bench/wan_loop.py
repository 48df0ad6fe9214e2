"""The declared WAN is wrong: open loop against closed loop, side by side (emulated runtime).

Usage:  PYTHONPATH=src python bench/wan_loop.py [SCENARIO] [--actual FIELD=VALUE ...] [--set FIELD=VALUE ...]
        [--methods geomesh,geomesh-overlap] [--tokens N] [--out runs/bench-wan-loop]

The cluster's WAN is the scenario's ``wan.actual`` (``--actual``, default ``bandwidth_factor=0.25``: every link
4x slower than declared). Each method runs three times on the same scenario, token budget and seed:

- ``declared right``: the declaration is the cluster's WAN (what measuring could at best reach);
- ``open loop``: ``geomesh.measure_wan: false``, the plan keeps the declared WAN;
- ``closed loop``: the default, the WAN measured from every round's exchange and the round re-planned when it
  drifts (docs/distributed.md, "The WAN measured").

Prints one JSON line per run and a Markdown table (re-plans, the exchange the plan chose, what the plan expected
it to take against what it took, the round's planned compute, idle, time, the final loss, and the validation
loss after each round with its modeled time); writes ``OUT/results.json``.
``--tabulate`` prints the table again from the run folders in ``OUT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import yaml

from geomesh.config import WanConfig, load_scenario
from geomesh.methods import get_method
from geomesh.runtime.emulated import EmulatedRun, RunOptions

LOOPS = ("declared right", "open loop", "closed loop")


def parse_pairs(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def scenario_for(name: str, overrides: dict, actual: dict, loop: str):
    """The scenario of one run: the declared WAN and wan.actual, or (``declared right``) the actual WAN declared."""
    sc = load_scenario(name, {**overrides, **{f"wan.actual.{k}": v for k, v in actual.items()},
                              **({"geomesh.measure_wan": False} if loop == "open loop" else {})})  # fmt: skip
    if loop != "declared right":
        return sc
    wan = sc.actual_wan_model()
    right = WanConfig(rtt=[[x * 1000 for x in row] for row in wan.rtt_s],
                      bandwidth_gbps=[[x * 8 / 1e9 for x in row] for row in wan.bandwidth_Bps])  # fmt: skip
    return dataclasses.replace(sc, wan=right)


def row_of(method: str, loop: str, s: dict) -> dict:
    plan = s["plan"]
    return {"method": method, "loop": loop, "replans": s["replans"], "exchange": s["exchange"],
            "planned_exchange_s": plan["exchange_s"], "exchange_s": s["exchange_s_per_round"],
            "planned_compute_s": plan["compute_s"], "rounds": s["rounds"],
            "straggler_idle_frac": s["straggler_idle_frac"], "wan_idle_frac": s["wan_idle_frac"],
            "utilization": s["utilization"], "modeled_time_s": s["modeled_time_s"],
            "final_val_loss": s["final_val_loss"], "wan_measured": s["wan_measured"], "curve": s["curve"]}  # fmt: skip


def table(rows: list[dict]) -> None:
    print("| method | WAN plan | re-plans | exchange | planned / taken (s) | round compute (s) | rounds "
          "| straggler idle | WAN idle | util | modeled time | final val loss "
          "| val loss after each round |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        curve = ", ".join(f"{v:.3f} ({t:,.0f} s)" for t, _, v in r["curve"][1:])
        print(f"| {r['method']} | {r['loop']} | {r['replans']} | {r['exchange']} | {r['planned_exchange_s']:.2f} / "
              f"{r['exchange_s']:.2f} | {r['planned_compute_s']:.1f} | {r['rounds']} | "
              f"{100 * r['straggler_idle_frac']:.1f}% | {100 * r['wan_idle_frac']:.1f}% | "
              f"{100 * r['utilization']:.1f}% | {r['modeled_time_s']:,.0f} s | "
              f"{r['final_val_loss']:.4f} | {curve} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", nargs="?", default="default")
    p.add_argument("--actual", action="append", default=[], metavar="FIELD=VALUE",
                   help="a field of wan.actual (default: bandwidth_factor=0.25)")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--methods", default="geomesh,geomesh-overlap")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--out", default="runs/bench-wan-loop")
    p.add_argument("--tabulate", action="store_true", help="print the table of the runs already in --out")
    args = p.parse_args(argv)
    overrides, actual = parse_pairs(args.set), parse_pairs(args.actual) or {"bandwidth_factor": 0.25}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for method in args.methods.split(","):
        for loop in LOOPS:
            folder = out / f"{method}-{loop.replace(' ', '-')}"
            if args.tabulate:
                rows.append(row_of(method, loop, json.loads((folder / "summary.json").read_text())))
                continue
            sc = scenario_for(args.scenario, overrides, actual, loop)
            s = EmulatedRun(sc, get_method(method), RunOptions(out_dir=folder, tokens=args.tokens,
                                                               progress=False)).run()  # fmt: skip
            rows.append(row_of(method, loop, s))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
    if args.tabulate:
        table(rows)
        return 0
    results = {"args": vars(args), "actual": actual, "rows": rows}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print()
    table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
