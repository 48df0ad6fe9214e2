"""``geomesh launch`` with elastic regions (``reliability.min_regions >= 1`` or ``--min-regions N``).

The launcher hosts the quorum service (a torchft Lighthouse, in this process) and starts every region as its
own ``torch.distributed`` world, exactly as a cluster runs one ``torchrun`` per region: per region a free
rendezvous port (``MASTER_PORT``), ``RANK``/``WORLD_SIZE`` inside the region, ``GEOMESH_REGION``, and
``TORCHFT_LIGHTHOUSE`` pointing at the Lighthouse. Everything listens on loopback: the Lighthouse, and (through
``GEOMESH_ADVERTISE_HOST=127.0.0.1``) each leader's torchft manager server and recovery server. Ranks are numbered globally only in their log files
(``DIR/logs/rank<k>.log``) and output prefixes.

A region whose processes die does not stop the others: the launcher reports it (one ``warning:`` line per lost
region) and waits for the rest. Exit status: 0 when the run finished (``summary.json`` written by a live
region); 2 a user error seen by the ranks; 1 otherwise (the first failure named, as without elastic regions).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .ranks import REGION_ENV, LaunchResult, RankExit, report, run_ranks
from .run_args import rank_argv


def launch_elastic(args: argparse.Namespace, env: dict[str, str], scenario, layout) -> LaunchResult:
    from ..runtime.distributed.service import ADVERTISE_ENV, LIGHTHOUSE_ENV, join_timeout_s, start_lighthouse

    min_regions = scenario.reliability.min_regions
    # every region of a launch is on this machine: the quorum service listens on loopback only
    lighthouse = start_lighthouse(min_regions, join_timeout_s(scenario.reliability), bind="127.0.0.1:0")
    port = lighthouse.address().rsplit(":", 1)[-1].strip("/")
    env = dict(env, **{LIGHTHOUSE_ENV: f"http://127.0.0.1:{port}", ADVERTISE_ENV: "127.0.0.1",
                       "MASTER_ADDR": "127.0.0.1"})  # fmt: skip
    env.setdefault("RUST_LOG", "error")  # torchft's own (Rust) logging: errors only
    try:
        return _spawn(args, env, rank_argv(args, "shaper" if args.wan == "shaper" else "none"), layout)
    finally:
        lighthouse.shutdown()


def _spawn(args: argparse.Namespace, env: dict[str, str], argv: list[str], layout) -> LaunchResult:
    out = Path(args.out)
    n = args.nproc
    regions = [layout.names[layout.region_of(k)] for k in range(n)]
    ports = {i: str(_free_port()) for i in range(len(layout.names))}
    envs = []
    for k in range(n):
        i = layout.region_of(k)
        local = layout.ranks_of(i).index(k)
        size = len(layout.ranks_of(i))
        envs.append(dict(env, RANK=str(local), LOCAL_RANK=str(local), WORLD_SIZE=str(size),
                         LOCAL_WORLD_SIZE=str(size), MASTER_PORT=ports[i], **{REGION_ENV: regions[k]}))  # fmt: skip
    done_at = None

    def stop_at(ranks: list[RankExit]) -> float | None:
        # the run is over (a live region wrote the summary, after the last quorum): ranks still running are
        # regions that hung or fell behind, and no quorum will come for them; a short grace, then they go
        nonlocal done_at
        if done_at is None and (out / "summary.json").exists():
            done_at = time.perf_counter()
        return None if done_at is None else done_at + 10

    ranks, interrupted = run_ranks(args, [argv] * n, envs, regions, stop_at)
    if interrupted:
        return LaunchResult(130, None, ranks, "interrupted")
    finished = {regions[k] for k in range(n)} - {regions[k] for k in range(n) if ranks[k].code != 0}
    # the summary's writer may be a region restarted outside this launcher: give it the time to finish
    deadline = time.perf_counter() + (args.timeout + 15 if finished else 0)
    while not (out / "summary.json").exists() and time.perf_counter() < deadline:
        time.sleep(0.1)
    summary = None
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        pass
    if summary is None or not finished:
        return report(args, ranks, regions)
    at_end = set((summary.get("elastic") or {}).get("regions_at_end") or [])
    for name in sorted({regions[k] for k in range(n)} - finished, key=layout.names.index):
        lost = [r for k, r in enumerate(ranks) if regions[k] == name]
        how = ", ".join(f"rank {r.rank}: {r.describe()}" + (f" at {r.at:.1f}s" if r.at is not None else "")
                        for r in lost)  # fmt: skip
        then = ("it was restarted and rejoined" if name in at_end else "the run went on without it")
        print(f"warning: region {name} was lost ({how}); {then}", file=sys.stderr, flush=True)
    return LaunchResult(0, summary, ranks)


def _free_port() -> int:
    from ..runtime.distributed.transport import free_port

    return free_port()

