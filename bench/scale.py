"""The scale study of the exchange: modeled bytes and time per region for N = 4 ... 256 regions (1-bit GeoMesh and
geomesh-sparse), and the loss that quantising (or re-sparsifying) the sharded exchange's combined shard costs,
measured with the emulated runtime.

Usage:  PYTHONPATH=src python bench/scale.py modeled [--regions 4,8,16,32,64,128,256] [--out FILE]
        PYTHONPATH=src python bench/scale.py real [--regions 8] [--bits 8,2,1] [--wan netns|shaper] [--out FILE]
        PYTHONPATH=src python bench/scale.py scenario --regions 128 --out FILE   (that cluster as a YAML)
        PYTHONPATH=src python bench/scale.py loss [--scenario default|regions16] [--bits 32,8,4,2]
                                                  [--method geomesh|geomesh-sparse] [--tokens N] [--out FILE]

``modeled``: a uniform cluster (``--rtt-ms`` 100 between every pair, ``--gbps`` 1 per link, the ``default``
timing model, regions cycling H100/A100/V100/T4), as ``geomesh plan`` models it: per N, GeoMesh's 1-bit ring
all-gather, the sharded exchange (geomesh.shard_bits, ``--bits``), DiLoCo's fp32 ring all-reduce, their
seconds and the bytes a region receives per round, the plan's choice and the sharded exchange's time as a
fraction of DiLoCo's; and the same for geomesh-sparse's sparse payloads (``sparse_*``: its all-gather, its
sharded exchange with re-sparsified combined shards, the plan's choice, the bytes into a region against the
first N's). One JSON object per N (stdout, and ``--out``).

``real``: ``--regions`` (8) regions of one rank each on this machine, tiny training (``--tokens``), launched
twice or more with ``geomesh launch``: the all-gather, then the sharded exchange at each ``--bits``. Per run
the bytes per rank per round from the runtime's own counter (``bytes_sent``: what each leader puts on the wire
in the cross-region collectives, docs/formats.md: the ring all-gather's N−1 slots, the sharded exchange's
pieces to their destinations) and, with ``--wan netns``
(root, the default where namespaces can be made), the bytes each rank's interface sent (``wire_bytes_sent``:
everything the exchange put on the wire, TCP/IP headers, round infos and agreements included), and the
ratio sharded / all-gather of both. One JSON object per run.

``loss``: ``--method`` (GeoMesh, or geomesh-sparse: any bits but 32 re-sparsify the combined shard) trained
with the exchange forced to ``sharded`` at each ``--bits`` (32: the exact combine, equal to the all-gather's;
``all_gather`` in the list: the all-gather itself), on ``default`` or ``regions16`` (16 regions cycling H100/A100/V100/T4 over 100 ms
and 1 Gbit/s links, generated here, the default's model and data); final validation loss at equal tokens and
its difference to the exact combine's. One JSON object per run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

GPUS = ("H100", "A100", "V100", "T4")


def uniform_overrides(n: int, rtt_ms: float, gbps: float) -> dict:
    """``load_scenario`` overrides that turn ``default`` into ``n`` regions over a uniform WAN."""
    regions = [{"name": f"r{i:03d}", "gpu": GPUS[i % len(GPUS)]} for i in range(n)]
    rtt = [[0.0 if i == j else rtt_ms for j in range(n)] for i in range(n)]
    return {"regions": regions, "wan.rtt": rtt, "wan.bandwidth_gbps": gbps}


def modeled(args: argparse.Namespace) -> list[dict]:
    from geomesh.config import load_scenario
    from geomesh.methods import get_method
    from geomesh.methods.base import proxy_manifest
    from geomesh.planner.exchange import scenario_exchange

    rows, first = [], None
    for n in (int(x) for x in args.regions.split(",")):
        s = load_scenario("default", {**uniform_overrides(n, args.rtt_ms, args.gbps), "geomesh.shard_bits": args.bits})
        wan, manifest = s.wan_model(), proxy_manifest(s)
        g, d, sp = get_method("geomesh"), get_method("diloco"), get_method("geomesh-sparse")
        choice = scenario_exchange(s, wan, g.collective, g.modeled_payload_bytes(s, manifest), g.make_codec(manifest, s))
        base = scenario_exchange(s, wan, d.collective, d.modeled_payload_bytes(s, manifest), d.make_codec(manifest, s))
        sparse = scenario_exchange(s, wan, sp.collective, sp.modeled_payload_bytes(s, manifest), sp.make_codec(manifest, s))
        ag, sh, ar = choice.candidates["all_gather"], choice.candidates["sharded"], base.cost
        sag, ssh = sparse.candidates["all_gather"], sparse.candidates["sharded"]
        first = first or ssh.received_bytes
        rows.append({"regions": n, "bits": args.bits, "plan": choice.name,
                     "all_gather_s": ag.seconds, "sharded_s": sh.seconds, "diloco_all_reduce_s": ar.seconds,
                     "all_gather_received_bytes": ag.received_bytes, "sharded_received_bytes": sh.received_bytes,
                     "diloco_received_bytes": ar.received_bytes, "sharded_vs_diloco": sh.seconds / ar.seconds,
                     "combined_payloads_per_region": {"all_gather": ag.combined_payloads, "sharded": 1},
                     "sparse_plan": sparse.name, "sparse_all_gather_s": sag.seconds, "sparse_sharded_s": ssh.seconds,
                     "sparse_all_gather_received_bytes": sag.received_bytes,
                     "sparse_sharded_received_bytes": ssh.received_bytes,
                     "sparse_sharded_vs_first": ssh.received_bytes / first,
                     "sparse_sent_vs_diloco": ar.sent_bytes / sparse.cost.sent_bytes})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def loss(args: argparse.Namespace) -> list[dict]:
    from geomesh.config import load_scenario
    from geomesh.methods import get_method
    from geomesh.runtime.emulated import EmulatedRun, RunOptions

    extra = uniform_overrides(16, 100.0, 1.0) if args.scenario == "regions16" else {}
    rows, exact = [], None
    for bits in args.bits_list.split(","):
        ex = {"geomesh.exchange": "all_gather"} if bits == "all_gather" else {"geomesh.exchange": "sharded",
                                                                              "geomesh.shard_bits": int(bits)}  # fmt: skip
        s = load_scenario("default", {**extra, **ex})
        t0 = time.time()
        summary = EmulatedRun(s, get_method(args.method), RunOptions(tokens=args.tokens, progress=False)).run()
        val = summary["final_val_loss"]
        exact = val if bits in ("32", "all_gather") and exact is None else exact
        rows.append({"scenario": args.scenario, "method": args.method, "bits": bits, "tokens": summary["tokens"],
                     "rounds": summary["rounds"], "bytes_per_round": summary["bytes_per_round"],
                     "final_val_loss": val, "vs_exact": None if exact is None else val / exact - 1,
                     "exchange": summary.get("exchange"), "modeled_time_s": summary["modeled_time_s"],
                     "bytes_sent": summary["bytes_sent"], "wall_s": round(time.time() - t0, 1)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def real(args: argparse.Namespace) -> list[dict]:
    import tempfile

    import yaml

    from geomesh.cli import launch as cli_launch
    from geomesh.testbed.netns import netns_unavailable_reason

    wan = args.wan
    if wan == "netns" and netns_unavailable_reason():
        print(f"--wan netns: {netns_unavailable_reason()}; measuring with the runtime's counters only (shaper)",
              file=sys.stderr)  # fmt: skip
        wan = "shaper"
    n = args.regions
    work = Path(args.work or tempfile.mkdtemp(prefix="scale-real-"))
    work.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "src/geomesh/scenarios/default.yaml").read_text())
    o = uniform_overrides(n, args.rtt_ms, args.gbps)
    data.update(regions=o["regions"], wan={"rtt": o["wan.rtt"], "bandwidth_gbps": args.gbps},
                description=f"{n} regions of one rank, uniform WAN; the default's model and data, tiny rounds")  # fmt: skip
    data["training"].update(inner_steps=2, eval_sequences=16, eval_every_rounds=1000, zero_shot_items=0)
    data.setdefault("geomesh", {}).update(calibrate=False, replan=False)
    runs = [("all_gather", None)] + [("sharded", int(b)) for b in args.bits.split(",")]
    rows, base = [], None
    for exchange, bits in runs:
        name = exchange if bits is None else f"sharded{bits}"
        data["geomesh"].update(exchange=exchange, shard_bits=bits if bits is not None else 8)
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False, width=200))
        argv = ["launch", str(path), "--nproc", str(n), "--method", "geomesh", "--out", str(work / name),
                "--tokens", str(args.tokens), "--wan", wan, "--quiet", "--timeout", "300"]  # fmt: skip
        t0 = time.time()
        result = cli_launch.launch(cli_launch.build_parser().parse_args(argv), extra_env={"OMP_NUM_THREADS": "1"})
        if result.code != 0:
            raise SystemExit(f"{name}: geomesh launch failed: {result.message}")
        s = result.summary
        per = s["rounds"] * n
        counter = s["bytes_sent"] / per
        to_peers = counter  # (the counter is what leaves the rank on the wire, every exchange alike)
        wire = s["wire_bytes_sent"] / per if s.get("wire_bytes_sent") else None
        row = {"regions": n, "exchange": s["exchange"], "bits": s.get("shard_bits"), "rounds": s["rounds"],
               "payload_bytes": s["proxy_payload_bytes"], "model_params": s["model_params"], "wan": wan,
               "counter_bytes_per_rank_round": counter, "to_peers_bytes_per_rank_round": to_peers,
               "wire_bytes_per_rank_round": wire, "final_val_loss": s["final_val_loss"],
               "wall_s": round(time.time() - t0, 1)}  # fmt: skip
        if base is None:
            base = row
        else:
            row["to_peers_vs_all_gather"] = to_peers / base["to_peers_bytes_per_rank_round"]
            if wire is not None and base["wire_bytes_per_rank_round"]:
                row["wire_vs_all_gather"] = wire / base["wire_bytes_per_rank_round"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def write_scenario(args: argparse.Namespace) -> list[dict]:
    """The uniform cluster of ``modeled`` as a scenario file, for ``geomesh plan`` and ``geomesh train``."""
    import yaml

    from geomesh.config import load_scenario

    data = yaml.safe_load((Path(__file__).resolve().parents[1] / "src/geomesh/scenarios/default.yaml").read_text())
    o = uniform_overrides(args.regions, args.rtt_ms, args.gbps)
    data.update(regions=o["regions"], wan={"rtt": o["wan.rtt"], "bandwidth_gbps": args.gbps},
                description=f"{args.regions} regions cycling {'/'.join(GPUS)}, {args.rtt_ms:g} ms RTT between every "
                            f"pair, {args.gbps:g} Gbit/s links; the default's timing model, model and data")  # fmt: skip
    Path(args.out).write_text(yaml.safe_dump(data, sort_keys=False, width=200))
    load_scenario(args.out)  # it loads
    print(f"wrote {args.out}", file=sys.stderr)
    return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("modeled")
    m.add_argument("--regions", default="4,8,16,32,64,128,256")
    m.add_argument("--rtt-ms", type=float, default=100.0)
    m.add_argument("--gbps", type=float, default=1.0)
    m.add_argument("--bits", type=int, default=8)
    m.add_argument("--out", default=None)
    l_ = sub.add_parser("loss")
    l_.add_argument("--scenario", default="default", choices=["default", "regions16"])
    l_.add_argument("--bits", dest="bits_list", default="32,8,4,2",
                    help="32 (or all_gather) first: the exact combine")
    l_.add_argument("--method", default="geomesh", choices=["geomesh", "geomesh-sparse"])
    l_.add_argument("--tokens", type=int, default=None, help="token budget (default: the scenario's)")
    l_.add_argument("--out", default=None)
    r = sub.add_parser("real")
    r.add_argument("--regions", type=int, default=8)
    r.add_argument("--bits", default="8,2,1", help="the sharded runs' geomesh.shard_bits, after the all-gather")
    r.add_argument("--tokens", type=int, default=16384)
    r.add_argument("--rtt-ms", type=float, default=10.0)
    r.add_argument("--gbps", type=float, default=1.0)
    r.add_argument("--wan", default="netns", choices=["netns", "shaper", "none"])
    r.add_argument("--work", default=None, help="folder of the runs (default: a new temporary one)")
    r.add_argument("--out", default=None)
    w = sub.add_parser("scenario")
    w.add_argument("--regions", type=int, default=128)
    w.add_argument("--rtt-ms", type=float, default=100.0)
    w.add_argument("--gbps", type=float, default=1.0)
    w.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.what == "scenario":
        write_scenario(args)
        return 0
    rows = {"modeled": modeled, "loss": loss, "real": real}[args.what](args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
