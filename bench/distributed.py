"""DiLoCo (fp32, all-reduce) beside GeoMesh (1-bit sign, all-gather) on the distributed runtime, one machine.

Usage:  PYTHONPATH=src python bench/distributed.py [--out runs/bench-distributed] [--rounds 4]
        [--wan shaper|netns|none] [--preset micro] [--mbps 100] [--rtt-ms 100]

Three ranks (one per region) over Gloo on loopback, the WAN emulated at ``--mbps`` Mbit/s and ``--rtt-ms``
round-trip on every link (``shaper``: each exchange is held to latency + bytes / bandwidth of the ring
collective for the bytes really sent; ``netns``: kernel rate limits between network namespaces). The
regions share one measured CPU profile (``geomesh profile``, one thread) with ``slowdown`` 1, 1.5 and 2
(inner steps padded with sleep), so the CPU cluster is heterogeneous and the planner balances real compute
(``--cost-model``: plan from the A100 cost model instead). Both methods train the same proxy model for
the same token budget (``--rounds`` of DiLoCo). ``--methods diloco,geomesh,geomesh-overlap`` adds GeoMesh
with the exchange overlapped with the next round's inner steps (docs/overlap.md) and a
``geomesh / geomesh-overlap`` comparison line (wall seconds per round, WAN wait, final loss).

One JSON object per line per method: rounds, tokens, payload_bytes (one worker's payload),
bytes_per_round (bytes all ranks handed to the cross-region collective), ring_wire_bytes_per_round (what a
ring collective puts on the wire for them), wall_s_per_round, full_round_wall_s (median time between
rounds, the last round left out), compute / straggler / comm seconds per round
(mean over workers), idle fractions, final validation loss; then one ``comparison`` line with the ratios.
Everything also goes to ``OUT/results.json``; each method's run folder is ``OUT/<method>``.

The plan as a loop (``--cases drift,datasheet``; docs/design/architecture.md "The plan is a loop"), each case run
open loop
(``--set geomesh.replan=false --no-calibrate``) and closed loop (the defaults: calibrated in place, re-planned
from every round's measured compute times) side by side, GeoMesh on a tiny model (``--loop-preset``) over the
default corpus, no WAN shaping:

- ``drift``: 3 regions declared alike (A100 x3); after round ``--drift-round`` two regions' processes are
  pinned onto one core together and the third onto the other (CPU affinity, found by a tag in their
  environment: a busy neighbour nothing declares). Needs two cores.
- ``datasheet``: H100, A100 and T4 declared for processes that all run at one speed (``--one-core``: the three
  share one core from the start, each a fair third of it; else three processes on the host's cores).
- ``alike``: A100 x3 declared for processes that all run at one speed, nothing changed: the even plan is right,
  so what its open loop waits is the host's floor (three single-threaded processes on two cores: which two
  share a core changes from round to round), the idle no plan removes; the closed loop must not add to it.

``--throttle SHARE`` sets each region's speed by a CPU quota instead (cgroups: every region at SHARE of one
core from its start; drift: r1 and r2 at SHARE/2 after the change), so that each region's speed is its own:
two processes that share a core by affinity are coupled (one that ends its round early leaves the core to
the other), which no per-region speed describes. ``--elastic`` runs each case between elastic regions
(torchft quorums, ``reliability.min_regions: 2``) instead of static ones; ``--loop-inner-steps`` sets the
rounds' length (H of the even plan).

One JSON object per line per case and loop: per round the straggler idle from the round record
(``straggler_idle_frac``: the members' measured compute, the time the faster wait for the slowest) and from
the spans (Σ straggler_wait / Σ wall), the rounds re-planned at, the straggler idle over windows of rounds
(drift: before the change and from ``--settle`` rounds after it; datasheet, alike: from round 1 on; the last
round, shortened to the budget, left out), ``calibration_s``; then one ``comparison`` line per case (open /
closed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import yaml

from geomesh.cli import launch as cli_launch
from geomesh.network import WanModel
from geomesh.testbed.quotas import CpuQuotas


def scenario(preset: str, mbps: float, rtt_ms: float, batch: int, inner_steps: int, tokens: int) -> dict:
    n = 3
    return {
        "name": "bench-distributed",
        "description": f"3 regions, one GPU type with slowdown 1/1.5/2, {mbps:g} Mbit/s and {rtt_ms:g} ms RTT links",
        "regions": [{"name": f"r{i}", "gpu": "A100", "count": 1, "slowdown": s} for i, s in enumerate((1.0, 1.5, 2.0))],
        "wan": {"rtt": [[0 if i == j else rtt_ms for j in range(n)] for i in range(n)], "bandwidth_gbps": mbps / 1000},
        "timing_model": {"n_layers": 12, "hidden": 768, "seq_len": 1024, "vocab": 32000},
        "model": {"preset": preset, "seq_len": 64},
        "data": {"vocab_size": 4096, "val_fraction": 0.05},
        "training": {"tokens": tokens, "batch": batch, "inner_steps": inner_steps, "eval_sequences": 32,
                     "eval_every_rounds": 1000},
        "geomesh": {"min_batch": 2, "min_inner_steps": 2},
    }  # fmt: skip


def full_round_s(events_path: Path) -> float | None:
    """Median wall seconds between consecutive rounds, leaving out the last round (shortened to the budget,
    or, overlapped, lengthened to take a short remainder): what one full round of the plan takes."""
    from statistics import median

    from geomesh.telemetry import read_events

    times = [0.0] + [e["time"] for e in read_events(events_path) if e["type"] == "round"]
    gaps = [b - a for a, b in zip(times, times[1:])][:-1]
    return median(gaps) if gaps else None


def row(method: str, s: dict, n: int, events_path: Path | None = None) -> dict:
    rounds = max(s["rounds"], 1)
    pw = s["per_worker"].values()
    payload = s["proxy_payload_bytes"]
    if s["collective"] == "all_gather":
        ring = WanModel.allgather_bytes_per_worker(payload, n) * n
    else:
        ring = WanModel.allreduce_bytes_per_worker(s["payload_bytes_per_worker"], n) * n
    out = {
        "method": method,
        "collective": s["collective"],
        "rounds": s["rounds"],
        "tokens": s["tokens"],
        "payload_bytes": payload,
        "bytes_per_round": s["bytes_per_round"],
        "ring_wire_bytes_per_round": ring,
        "wall_s_per_round": s["modeled_time_s"] / rounds,
        "full_round_wall_s": full_round_s(events_path) if events_path is not None else None,
        "compute_s_per_round": sum(w["compute"] for w in pw) / len(pw) / rounds,
        "straggler_s_per_round": sum(w["straggler_wait"] for w in pw) / len(pw) / rounds,
        "comm_s_per_round": s["exchange_s_per_round"],
        "shaper_s_per_round": s["shaper_s_per_round"],
        "straggler_idle_frac": s["straggler_idle_frac"],
        "wan_idle_frac": s["wan_idle_frac"],
        "utilization": s["utilization"],
        "final_val_loss": s["final_val_loss"],
        "wan": s["wan"],
        "plan": [(w["batch"], w["inner_steps"]) for w in s["plan"]["workers"]],
    }
    if s.get("wire_bytes_sent") is not None:
        out["measured_wire_bytes_per_round"] = s["wire_bytes_sent"] / rounds
    return out


# ---- the plan as a loop ----------------------------------------------------------------------------------
LOOP_CASES = ("drift", "datasheet", "alike")
OPEN_LOOP = ["--set", "geomesh.replan=false", "--no-calibrate"]  # the plan made once, from the datasheet
TAG_ENV = "GEOMESH_BENCH_TAG"  # finds a run's rank processes (with GEOMESH_REGION) to move them between cores


def loop_scenario(gpus: tuple[str, ...], preset: str, batch: int, inner_steps: int, max_batch: int,
                  elastic: bool = False) -> dict:  # fmt: skip
    """A tiny GeoMesh run on two plays of the default corpus; the regions declare ``gpus`` and nothing else
    (no slowdown: what the plan learns, it learns from measurement). ``elastic``: elastic regions (torchft
    quorums, ``reliability.min_regions: 2``), the same loop over the other exchange."""
    from geomesh.data import default_corpus_files

    paths = [str(f) for f in default_corpus_files() if f.name.startswith(("hamlet", "macbeth"))]
    regions = [{"name": f"r{i}-{g.lower()}", "gpu": g, "count": 1} for i, g in enumerate(gpus)]
    n = len(regions)
    return {
        "name": "bench-plan-loop",
        "description": f"3 regions declared {'/'.join(gpus)}, processes of one speed on this machine",
        "regions": regions,
        "wan": {"rtt": [[0 if i == j else 80 for j in range(n)] for i in range(n)], "bandwidth_gbps": 10.0},
        "timing_model": {"n_layers": 12, "hidden": 768, "seq_len": 1024, "vocab": 32000},
        "model": {"preset": preset, "seq_len": 32},
        "data": {"paths": paths, "vocab_size": 512, "val_fraction": 0.05},
        "training": {"tokens": 0, "batch": batch, "inner_steps": inner_steps, "inner_lr": 0.003,
                     "eval_sequences": 16, "eval_every_rounds": 1000},
        "geomesh": {"min_batch": 1, "max_batch": max_batch, "min_inner_steps": 1, "round_sequences_factor": 1.0},
        **({"reliability": {"min_regions": 2}} if elastic else {}),
    }  # fmt: skip


def rank_pids(tag: str, region: str) -> list[int]:
    """The processes whose environment carries ``tag`` and ``GEOMESH_REGION=region``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{TAG_ENV}={tag}".encode() in env and f"GEOMESH_REGION={region}".encode() in env:
            found.append(int(entry.name))
    return found


def rounds_done(events_path: Path) -> int:
    from geomesh.telemetry import read_events

    try:
        return max([e["round"] for e in read_events(events_path) if e["type"] == "round"], default=0)
    except (OSError, json.JSONDecodeError):  # (a line being written)
        return 0


def run_loop_case(path: Path, out: Path, tokens: int, extra: list[str], pins: dict[str, set[int]] | None,
                  at_round: int, timeout: float, start_cpus: set[int] | None = None,
                  shares: tuple[dict[str, float], dict[str, float]] | None = None,
                  ) -> tuple[dict, float, int | None, dict[str, int]]:  # fmt: skip
    """``geomesh launch`` in a child process (with ``start_cpus``, it and every process it starts on those
    cores); with ``pins``, once round ``at_round`` has ended each region's processes (every thread) are moved
    onto its cores; with ``shares`` (before, after), each region runs at its share of one core from its start
    (:class:`CpuQuotas`), and at its share after once round ``at_round`` has ended. Returns the summary, the
    launch's wall seconds, the round the change took effect from (the first round that began after it) and
    the processes moved per region."""
    tag = uuid.uuid4().hex
    env = {**{k: v for k, v in os.environ.items() if k != "GEOMESH_REGION"}, "OMP_NUM_THREADS": "1", TAG_ENV: tag}
    cmd = [sys.executable, "-m", "geomesh.cli", "launch", str(path), "--nproc", "3", "--method", "geomesh",
           "--out", str(out), "--tokens", str(tokens), "--wan", "none", "--quiet", "--timeout", str(timeout),
           *extra]  # fmt: skip
    t0 = time.monotonic()
    pin_start = (lambda: os.sched_setaffinity(0, start_cpus)) if start_cpus else None
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=pin_start)  # fmt: skip
    changed_from, pinned = None, {}
    quotas = CpuQuotas(tag) if shares else None
    try:
        if quotas is not None:
            before = shares[0]
            waiting = set(before)
            while waiting and proc.poll() is None and time.monotonic() - t0 < 60:
                for region in sorted(waiting):  # as each rank appears (it imports torch for a second or more)
                    if found := rank_pids(tag, region):
                        quotas.set(region, before[region], found)
                        pinned[region] = len(found)
                        waiting.discard(region)
                time.sleep(0.01)
        if pins or quotas is not None:
            while (done := rounds_done(out / "events.jsonl")) < at_round and proc.poll() is None:
                time.sleep(0.01)
            if proc.poll() is None:
                if quotas is not None:
                    for region, share in shares[1].items():
                        quotas.set(region, share)
                else:
                    for region, cpus in pins.items():
                        for pid in rank_pids(tag, region):
                            for task in Path(f"/proc/{pid}/task").iterdir():  # every thread (as taskset -a)
                                try:
                                    os.sched_setaffinity(int(task.name), cpus)
                                except OSError:  # (a thread that has just ended)
                                    pass
                            pinned[region] = pinned.get(region, 0) + 1
                changed_from = rounds_done(out / "events.jsonl") + 1 if done >= at_round else None
        stdout, stderr = proc.communicate(timeout=timeout + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
        if quotas is not None:
            quotas.close()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{out.name}: geomesh launch exited {proc.returncode}: {stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text()), wall, changed_from, pinned


def per_round_idle(events_path: Path) -> list[dict]:
    """Each round's straggler idle: the round record's (its members' measured compute) and the spans'
    (Σ straggler_wait / Σ wall over every worker's spans of that round), and whether it was re-planned after."""
    from collections import defaultdict

    from geomesh.telemetry import read_events

    events = read_events(events_path)
    wait, wall = defaultdict(float), defaultdict(float)
    for e in events:
        if e["type"] == "span":  # a span's round counts from 0; round records count from 1
            wall[e["round"] + 1] += e["end"] - e["start"]
            if e["kind"] == "straggler_wait":
                wait[e["round"] + 1] += e["end"] - e["start"]
    replanned = {e["round"] for e in events if e["type"] == "plan" and e.get("replan")}
    return [{"round": e["round"], "idle_record": e.get("straggler_idle_frac"),
             "idle_spans": wait[e["round"]] / wall[e["round"]] if wall[e["round"]] else None,
             "compute_s": e["compute_s"], "replanned": e["round"] in replanned}
            for e in events if e["type"] == "round"]  # fmt: skip


def window(rounds: list[dict], first: int, last: int) -> dict:
    """Straggler idle over rounds ``first..last``: the mean of the round records', the spans' Σ wait / Σ wall."""
    got = [r for r in rounds if first <= r["round"] <= last]
    rec = [r["idle_record"] for r in got if r["idle_record"] is not None]
    spans = [r["idle_spans"] for r in got if r["idle_spans"] is not None]
    return {"rounds": [first, last] if got else None,
            "idle_record": sum(rec) / len(rec) if rec else None,
            "idle_record_max": max(rec) if rec else None,
            "idle_spans": sum(spans) / len(spans) if spans else None}  # fmt: skip


def loop_row(case: str, loop: str, s: dict, wall: float, rounds: list[dict], changed_from: int | None,
             settle: int) -> dict:  # fmt: skip
    last = max((r["round"] for r in rounds), default=0) - 1  # the last round is shortened to the budget
    out = {"case": case, "loop": loop, "rounds": s["rounds"], "tokens": s["tokens"], "launch_wall_s": wall,
           "calibration_s": s.get("calibration_s"), "replans": s.get("replans", 0),
           "replan_rounds": [r["round"] for r in rounds if r["replanned"]],
           "straggler_idle_frac": s["straggler_idle_frac"], "final_val_loss": s["final_val_loss"]}  # fmt: skip
    if case == "drift":
        out["changed_from_round"] = changed_from
        if changed_from is not None:
            out["before"] = window(rounds, 1, changed_from - 1)
            out["after"] = window(rounds, changed_from, last)
            out["settled"] = window(rounds, changed_from + settle, last)
    else:
        out["from_round_1"] = window(rounds, 1, last)
    out["per_round"] = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "compute_s"}
                        | {"compute_s": [round(c, 4) for c in r["compute_s"]]} for r in rounds]  # fmt: skip
    return out


def loop_cases(args: argparse.Namespace, out: Path, cases: list[str]) -> list[dict]:
    rows: list[dict] = []
    for case in cases:
        if case == "drift" and (not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2):
            print("error: the drift case needs CPU affinity and two cores", file=sys.stderr)
            continue
        gpus = ("H100", "A100", "T4") if case == "datasheet" else ("A100", "A100", "A100")
        path = out / case / "scenario.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(loop_scenario(gpus, args.loop_preset, args.loop_batch, args.loop_inner_steps,
                                                    args.loop_max_batch or 512, args.elastic)))
        tokens = args.loop_rounds * 3 * args.loop_batch * args.loop_inner_steps * 32
        cpus = sorted(os.sched_getaffinity(0)) if case == "drift" else []
        # r0 alone on one core; r1 and r2 together on the other (each at about half its speed)
        pins = {"r0-a100": {cpus[1]}, "r1-a100": {cpus[0]}, "r2-a100": {cpus[0]}} if case == "drift" else None
        shares = None
        if args.throttle:  # every region at its own quota of a core; drift: r1 and r2 at half of it after the change
            names = [f"r{i}-{g.lower()}" for i, g in enumerate(gpus)]  # (loop_scenario's regions)
            before = dict.fromkeys(names, args.throttle)
            after = {names[1]: args.throttle / 2, names[2]: args.throttle / 2} if case == "drift" else {}
            shares, pins = (before, after), None
        # processes that "all run at one speed": with --one-core, the three share one core from the start (each a
        # fair third of it), not three on two cores, where which two share a core changes from round to round
        start_cpus = {min(os.sched_getaffinity(0))} if args.one_core and case != "drift" else None
        by = {}
        for loop, extra in (("open", OPEN_LOOP), ("closed", [])):
            summary, wall, changed_from, pinned = run_loop_case(path, out / case / loop, tokens, extra, pins,
                                                        args.drift_round, args.timeout, start_cpus, shares)  # fmt: skip
            rounds = per_round_idle(out / case / loop / "events.jsonl")
            r = by[loop] = loop_row(case, loop, summary, wall, rounds, changed_from, args.settle)
            if pins or shares:
                r["processes_moved"] = pinned
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "per_round"}), flush=True)
        key = "settled" if case == "drift" else "from_round_1"
        o, c = by["open"].get(key) or {}, by["closed"].get(key) or {}
        comparison = {
            "comparison": f"{case}: open / closed loop",
            "window": key,
            "idle_record": {"open": o.get("idle_record"), "closed": c.get("idle_record")},
            "idle_spans": {"open": o.get("idle_spans"), "closed": c.get("idle_spans")},
            "idle_record_ratio": o["idle_record"] / c["idle_record"] if o.get("idle_record") and c.get(
                "idle_record") else None,
            "target_met": c.get("idle_record") is not None and c["idle_record"] <= 0.05,
            "replans": {"open": by["open"]["replans"], "closed": by["closed"]["replans"]},
            "calibration_s": by["closed"]["calibration_s"],
            "launch_wall_s": {"open": by["open"]["launch_wall_s"], "closed": by["closed"]["launch_wall_s"]},
        }
        rows.append(comparison)
        print(json.dumps(comparison), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench-distributed")
    p.add_argument("--rounds", type=int, default=4, help="DiLoCo rounds; GeoMesh gets the same token budget")
    p.add_argument("--wan", default="shaper", choices=["shaper", "netns", "none"])
    p.add_argument("--preset", default="micro", help="proxy model preset")
    p.add_argument("--mbps", type=float, default=100.0)
    p.add_argument("--rtt-ms", type=float, default=100.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--methods", default="diloco,geomesh")
    p.add_argument(
        "--cost-model",
        action="store_true",
        help="plan from the GPU cost model instead of this CPU's measured step times",
    )
    p.add_argument("--cases", default="methods",
                   help="methods (the comparison above) and/or the plan-loop cases drift, datasheet, alike")  # fmt: skip
    p.add_argument("--loop-preset", default="nano", help="plan-loop cases: the proxy model preset")
    p.add_argument("--loop-rounds", type=int, default=20, help="plan-loop cases: rounds of the (even) plan")
    p.add_argument("--loop-batch", type=int, default=8)
    p.add_argument("--loop-inner-steps", type=int, default=10)
    p.add_argument("--loop-max-batch", type=int, default=0, help="plan-loop cases: geomesh.max_batch (0: 512)")
    p.add_argument("--drift-round", type=int, default=3, help="drift: the cores change after this round")
    p.add_argument("--one-core", action="store_true",
                   help="datasheet, alike: the three regions' processes share one core from the start (each a fair "
                        "third of it) instead of three on every core")  # fmt: skip
    p.add_argument("--throttle", type=float, default=0.0, metavar="SHARE",
                   help="plan-loop cases: every region at SHARE of one core by a CPU quota (cgroups, root) from its "
                        "start, instead of CPU affinity; drift: r1 and r2 at SHARE/2 after the change")  # fmt: skip
    p.add_argument("--elastic", action="store_true",
                   help="plan-loop cases: elastic regions (torchft quorums, reliability.min_regions 2) instead of "
                        "static ones")  # fmt: skip
    p.add_argument("--settle", type=int, default=3, help="drift: the settled window starts this many rounds "
                   "after the change")  # fmt: skip
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown := [c for c in cases if c not in ("methods", *LOOP_CASES)]:
        p.error(f"unknown case(s) {', '.join(unknown)}: expected methods, {', '.join(LOOP_CASES)}")
    if "methods" not in cases:
        rows = loop_cases(args, out, [c for c in cases if c in LOOP_CASES])
        (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
        return 0
    tokens = args.rounds * 3 * args.batch * args.inner_steps * 64
    path = out / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario(args.preset, args.mbps, args.rtt_ms, args.batch, args.inner_steps, tokens)))
    profile_flags: list[str] = []
    if not args.cost_model:
        # measured CPU step times (one thread, as each rank runs), so the planner balances real compute
        import torch

        from geomesh.config import load_scenario
        from geomesh.profiler import profile_device

        torch.set_num_threads(1)
        prof = profile_device(load_scenario(path), "cpu", [1, 2, 4, 8, 16, 32], repeats=2, name="cpu")
        (out / "cpu-profile.json").write_text(json.dumps(prof.to_json(), indent=2) + "\n")
        for i in range(3):
            profile_flags += ["--profile", f"r{i}={out / 'cpu-profile.json'}"]
    rows = []
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:  # the methods case
        launch_args = cli_launch.build_parser().parse_args(
            ["launch", str(path), "--nproc", "3", "--method", method, "--out", str(out / method), "--wan", args.wan,
             "--timeout", str(args.timeout), "--quiet", "--backend", "gloo", *profile_flags])  # fmt: skip
        result = cli_launch.launch(launch_args)
        if result.code != 0:
            print(f"error: {method}: {result.message}", file=sys.stderr)
            return result.code
        r = row(method, result.summary, 3, out / method / "events.jsonl")
        rows.append(r)
        print(json.dumps(r), flush=True)
    by = {r["method"]: r for r in rows}
    if "diloco" in by and "geomesh" in by:
        d, g = by["diloco"], by["geomesh"]
        comparison = {
            "comparison": "diloco / geomesh",
            "payload_ratio": d["payload_bytes"] / g["payload_bytes"],
            "bytes_per_round_ratio": d["bytes_per_round"] / g["bytes_per_round"],
            "ring_wire_bytes_ratio": d["ring_wire_bytes_per_round"] / g["ring_wire_bytes_per_round"],
            "comm_s_ratio": d["comm_s_per_round"] / g["comm_s_per_round"],
            "wall_s_per_round_ratio": d["wall_s_per_round"] / g["wall_s_per_round"],
            "tokens_per_s": {m: by[m]["tokens"] / (by[m]["wall_s_per_round"] * by[m]["rounds"]) for m in by},
        }
        rows.append(comparison)
        print(json.dumps(comparison), flush=True)
    if "geomesh" in by and "geomesh-overlap" in by:  # the exchange hidden under the next round (docs/overlap.md)
        g, o = by["geomesh"], by["geomesh-overlap"]
        comparison = {
            "comparison": "geomesh / geomesh-overlap",
            "same_plan": g["plan"] == o["plan"],
            "full_round_wall_s": {"geomesh": g["full_round_wall_s"], "geomesh-overlap": o["full_round_wall_s"]},
            "full_round_wall_ratio": g["full_round_wall_s"] / o["full_round_wall_s"],
            "wall_s": {m: by[m]["wall_s_per_round"] * by[m]["rounds"] for m in ("geomesh", "geomesh-overlap")},
            "tokens": {m: by[m]["tokens"] for m in ("geomesh", "geomesh-overlap")},
            "comm_s_per_round": {"geomesh": g["comm_s_per_round"], "geomesh-overlap": o["comm_s_per_round"]},
            "wan_idle_frac": {"geomesh": g["wan_idle_frac"], "geomesh-overlap": o["wan_idle_frac"]},
            "final_val_loss": {"geomesh": g["final_val_loss"], "geomesh-overlap": o["final_val_loss"]},
            "tokens_per_s": {m: by[m]["tokens"] / (by[m]["wall_s_per_round"] * by[m]["rounds"]) for m in (
                "geomesh", "geomesh-overlap")},
        }
        rows.append(comparison)
        print(json.dumps(comparison), flush=True)
    rows += loop_cases(args, out, [c for c in cases if c in LOOP_CASES])
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
