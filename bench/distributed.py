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
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from geomesh.cli import launch as cli_launch
from geomesh.network import WanModel


def scenario(preset: str, mbps: float, rtt_ms: float, batch: int, inner_steps: int, tokens: int) -> dict:
    n = 3
    return {
        "name": "bench-distributed",
        "description": f"3 regions, one GPU type with slowdown 1/1.5/2, {mbps:g} Mbit/s and {rtt_ms:g} ms RTT links",
        "regions": [{"name": f"r{i}", "gpu": "A100", "count": 1, "slowdown": s} for i, s in enumerate((1.0, 1.5, 2.0))],
        "wan": {"rtt": [[0 if i == j else rtt_ms for j in range(n)] for i in range(n)], "bandwidth_gbps": mbps / 1000},
        "timing_model": {"n_layers": 12, "hidden": 768, "seq_len": 1024, "vocab": 32000},
        "proxy": {"preset": preset, "seq_len": 64},
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
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
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
    for method in [m.strip() for m in args.methods.split(",") if m.strip()]:
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
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
