"""The declared WAN is wrong, on the hosts test bed: open loop against closed loop with real processes and links
shaped in the kernel.

Usage:  python bench/wan_loop_bed.py [--out runs/bench-wan-loop-bed] [--methods geomesh-overlap]
        [--mbps 1] [--factor 0.25] [--tokens 150000] [--cpu 0.4,0.4,0.4] [--repeats 1]

Three regions, each a host of the hosts test bed (``geomesh hosts``: its own network namespace, address, folder
and torchrun; the quorum service alone; ``--cpu`` cores each, a CPU quota). The scenario declares every link at
``--mbps`` ÷ ``--factor`` (4x the real rate by default); the kernel limits every host's links to ``--factor`` of
the declared from the start (``geomesh hosts --bandwidth REGION@0:FACTOR``, before any probe), so the links are
``--mbps`` in fact. The job is bench/wallclock.py's (the ``micro`` model, sequence 64, DiLoCo's b = 8, H = 10; the
timing model is the model that trains), under a token budget, every region in every round. Each method runs:

- ``open loop``: ``geomesh.measure_wan: false``, the plan keeps the declared WAN (an overlapped round's stretch
  and apply step expect the exchange 4x sooner than it arrives);
- ``closed loop``: the default: the leaders probe their links before round 0 and every exchange is measured
  (docs/distributed.md, "The WAN measured").

Read from the runs' records (bench/wallclock.py's reading: every region's spans, the clock of the host ready
last): WAN idle over the rounds an exchange can hide under (round 2 to the last: the last exchange has nothing
to hide it), from round 2 on and over the whole run, straggler idle from round 2 on, wall seconds per round, rounds, the
re-plans and their reasons, the exchange kind and the WAN it was chosen over, the WAN measured. Prints one JSON line
per run and a Markdown table; writes ``OUT/results.json``. ``--report`` prints the table again from ``OUT``'s runs.
Needs root, iproute2 and cgroups (the bed's); one ``error:`` line and exit 2 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wallclock  # noqa: E402  (bench/: files, not a package)

LOOPS = {"open loop": ["--set", "geomesh.measure_wan=false"], "closed loop": []}


def bed_command(path: Path, method: str, out: Path, cpu: list[float], factor: float, extra: list[str],
                timeout_s: float) -> list[str]:  # fmt: skip
    cmd = [sys.executable, "-m", "geomesh.cli", "hosts", str(path), "--method", method, "--out", str(out), "--json",
           "--min-regions", str(len(wallclock.NAMES)), "--run-timeout", f"{timeout_s:g}", "--timeout", "300", *extra]
    for name, cores in zip(wallclock.NAMES, cpu):
        cmd += ["--cpu", f"{name}:{cores:g}", "--bandwidth", f"{name}@0:{factor:g}"]
    return cmd


def hidden_idle(events: dict[str, list]) -> float | None:
    """Σ comm_wait / Σ wall over every region's spans of the rounds an overlapped exchange can hide under
    (round 2 to the last: the last exchange, after the last round, has nothing left to hide it)."""
    last = max((e["round"] for ev in events.values() for e in ev if e["type"] == "span"), default=0)
    steady = wallclock.idle_fractions({h: [e for e in ev if e["type"] != "span" or e["round"] < last]
                                       for h, ev in events.items()}, from_round=1)  # fmt: skip
    return steady["wan"]


def loop_metrics(folder: Path) -> dict:
    """One run's figures: bench/wallclock.py's, and what the plan loop did (re-plans with their reasons, the
    exchange kind and the WAN it was chosen over, the WAN measured), from the host whose clock is read."""
    result = json.loads((folder / "hosts.json").read_text())
    events, summaries, sent = wallclock.read_bed(result)
    m = wallclock.run_metrics(events, summaries, sent)
    ref = m["clock_host"]
    summary = summaries.get(ref) or {}
    replans = [(e["round"], e.get("reason", "")) for e in events[ref] if e["type"] == "plan" and e.get("replan")]
    choice = next((e for e in events[ref] if e["type"] == "exchange_choice"), None)
    plans = [e["plan"] for e in events[ref] if e["type"] == "plan"]
    return {**{k: v for k, v in m.items() if k not in ("curve", "calibrated_profiles")},
            "ok": bool(result.get("finished")) and all(h["exit"] == 0 for h in result["hosts"].values()),
            "wan_idle_hidden": hidden_idle(events), "replans": replans, "exchange": summary.get("exchange"),
            "exchange_wan": choice.get("wan") if choice else "declared",
            "planned_exchange_s": [p.get("exchange_s") for p in plans],
            "wan_measured": summary.get("wan_measured"), "wan_probe_s": summary.get("wan_probe_s")}  # fmt: skip


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(rows: list[dict]) -> str:
    lines = ["| repeat | method | WAN plan | rounds | wall s / round | WAN idle (rounds 2 to last, hidden) | WAN idle "
             "(round 2 on) | WAN idle (whole run) | straggler idle (round 2 on) | re-plans (WAN) | plan's exchange s "
             "(first, last) | exchange, over the WAN | WAN measured (latency, transfer x declared) | final val loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        m = r["metrics"]
        wan = m.get("wan_measured")
        measured = f"x{wan['latency_factor']:.2f}, x{wan['transfer_factor']:.2f}" if wan else "not measured"
        planned = [p for p in m["planned_exchange_s"] if isinstance(p, (int, float))]
        wan_replans = sum("WAN" in why for _, why in m["replans"])
        lines.append(f"| {r['repeat']} | {r['method']} | {r['loop']} | {m['rounds']} | {m['round_s']:.2f} | "
                     f"{pct(m['wan_idle_hidden'])} | {pct(m['wan_idle'])} | "
                     f"{pct(m['wan_idle_whole'])} | {pct(m['straggler_idle'])} | {len(m['replans'])} ({wan_replans}) | "
                     f"{planned[0]:.2f}, {planned[-1]:.2f} | {m['exchange']}, {m['exchange_wan']} | {measured} | "
                     f"{m['final_val_loss']:.4f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench-wan-loop-bed")
    p.add_argument("--methods", default="geomesh-overlap")
    p.add_argument("--mbps", type=float, default=1.0, help="every link's real rate in the kernel (Mbit/s)")
    p.add_argument("--factor", type=float, default=0.25, help="real rate / declared rate")
    p.add_argument("--tokens", type=int, default=150000)
    p.add_argument("--cpu", default="0.4,0.4,0.4", help="cores of r0,r1,r2 (CPU quotas)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--report", action="store_true", help="no runs: the table again from OUT's runs")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    try:
        if args.report:
            rows = json.loads((out / "results.json").read_text())["runs"]
            rows = [{**r, "metrics": loop_metrics(Path(r["folder"]))} for r in rows]
            print(table(rows))
            return 0
        return run(args, out)
    except (wallclock.BenchError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, out: Path) -> int:
    from geomesh.testbed.quotas import quota_unavailable_reason
    from geomesh.testbed.netns import netns_unavailable_reason

    cpu = wallclock.parse_cpu(args.cpu)
    if not cpu or not 0 < args.factor <= 1 or args.mbps <= 0 or args.tokens <= 0 or args.repeats < 1:
        raise wallclock.BenchError("--cpu r0,r1,r2 cores, 0 < --factor <= 1, --mbps > 0, --tokens > 0, --repeats >= 1")
    if reason := netns_unavailable_reason() or quota_unavailable_reason():
        raise wallclock.BenchError(f"the hosts test bed cannot run here: {reason}")
    data = wallclock.scenario("micro", 64, 8, 10, args.mbps / args.factor, 0.003, None, 4096, None, args.tokens)
    data["name"] = "bench-wan-loop-bed"
    data["description"] = f"3 hosts, links declared {args.mbps / args.factor:g} Mbit/s, {args.mbps:g} in fact"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "scenario.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GEOMESH_REGION", None)
    for k in range(args.repeats):
        for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
            for loop, extra in LOOPS.items():
                folder = out / f"{k + 1}" / method / loop.replace(" ", "-")
                started = time.monotonic()
                proc = subprocess.run(bed_command(path, method, folder, cpu, args.factor, extra, 900), env=env,
                                      capture_output=True, text=True, timeout=1100)  # fmt: skip
                row = {"repeat": k + 1, "method": method, "loop": loop, "folder": str(folder),
                       "bed_wall_s": time.monotonic() - started, "exit": proc.returncode}  # fmt: skip
                if proc.returncode != 0:
                    row["error"] = (proc.stderr.strip().splitlines() or ["?"])[-1]
                print(json.dumps(row), flush=True)
                rows.append(row)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
    done = [{**r, "metrics": loop_metrics(Path(r["folder"]))} for r in rows if r["exit"] == 0]
    print(table(done))
    return 0 if len(done) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
