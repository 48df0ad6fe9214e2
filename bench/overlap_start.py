"""Where an overlapped round starts while the previous update is on the wire (docs/overlap.md), side by side.

Usage:  PYTHONPATH=src python bench/overlap_start.py [SCENARIO] [--set FIELD=VALUE ...] [--tokens N]
        [--checkpoints N,M,...] [--out runs/bench-overlap-start]

Runs plain ``geomesh`` and ``geomesh-overlap`` with each ``geomesh.overlap_start`` (``own``: the worker's
own fresh update stands in for the combined one; ``mixture``: Kale et al.'s eager mixture, own share at its
token weight plus the last combined update for the others; ``stale``: the last global parameters) on one
scenario, token budget and seed, in the emulated runtime. The longer the exchange relative to the round,
the more inner steps run from the start point before the update arrives, so a slow link is the stress
test (e.g. ``--set wan.bandwidth_gbps=0.05`` on ``default``). Prints one JSON line per run and a Markdown
table (validation loss after each round, final loss, WAN idle, modeled time); writes ``OUT/results.json``.

``--checkpoints 1,2`` runs, instead of the three starts, plain ``geomesh`` and ``geomesh-overlap`` without
checkpoints and with a checkpoint every N rounds for each N: the round before a checkpoint waits for its
exchange, so the next round starts from θ (docs/overlap.md); the table shows what that costs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from geomesh.config import load_scenario
from geomesh.methods import get_method
from geomesh.runtime.emulated import EmulatedRun, RunOptions

# (label, method, overlap start, checkpoint every N rounds)
VARIANTS = [("geomesh", "geomesh", None, 0), ("geomesh-overlap (own)", "geomesh-overlap", "own", 0),
            ("geomesh-overlap (mixture)", "geomesh-overlap", "mixture", 0),
            ("geomesh-overlap (stale)", "geomesh-overlap", "stale", 0)]  # fmt: skip


def checkpoint_variants(spec: str) -> list[tuple[str, str, str | None, int]]:
    every = [int(n) for n in spec.split(",")]
    return [("geomesh", "geomesh", None, 0), ("geomesh-overlap", "geomesh-overlap", None, 0)] + [
        (f"geomesh-overlap, checkpoint every {n}", "geomesh-overlap", None, n) for n in every]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", nargs="?", default="default")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--checkpoints", default=None, metavar="N,M", help="checkpoint cadences to compare instead")
    p.add_argument("--out", default="runs/bench-overlap-start")
    args = p.parse_args(argv)
    overrides = {}
    for pair in args.set:
        key, _, value = pair.partition("=")
        overrides[key] = yaml.safe_load(value)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    variants = checkpoint_variants(args.checkpoints) if args.checkpoints else VARIANTS
    for k, (name, method, start, every) in enumerate(variants):
        scenario = load_scenario(args.scenario, {**overrides, **({"geomesh.overlap_start": start} if start else {})})
        run = EmulatedRun(scenario, get_method(method), RunOptions(out_dir=out / f"run-{k}", tokens=args.tokens,
                                                                   progress=False, checkpoint_every=every))  # fmt: skip
        s = run.run()
        plan = s["plan"]
        row = {"run": name, "rounds": s["rounds"], "tokens": s["tokens"], "final_val_loss": s["final_val_loss"],
               "curve": [[round(t, 1), n, round(v, 4)] for t, n, v in s["curve"]], "wan_idle_frac": s["wan_idle_frac"],
               "modeled_time_s": s["modeled_time_s"], "exchange_s": plan["exchange_s"], "compute_s": plan["compute_s"]}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print()
    print(f"exchange {rows[0]['exchange_s']:.1f} s per round against {rows[0]['compute_s']:.1f} s of compute")
    print("| run | rounds | val loss after each round | final val loss | WAN idle | modeled time |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        losses = ", ".join(f"{v:.3f}" for _, _, v in r["curve"][1:])
        print(f"| {r['run']} | {r['rounds']} | {losses} | {r['final_val_loss']:.4f} | {100 * r['wan_idle_frac']:.1f}% "
              f"| {r['modeled_time_s']:,.0f} s |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
