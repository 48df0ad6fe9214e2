"""The asynchronous baseline with elastic regions (``async-local-sgd`` with ``--min-regions``): where a region
meets the parameter server, and what each region keeps of the run.

Every region is its own world, started with its own command; what they share is the quorum service's address
(``--lighthouse`` or ``TORCHFT_LIGHTHOUSE``). The server's leader (region 0's) listens for sessions
(:mod:`.async_link`) at its advertised address and posts it on the service's run board (:mod:`.board`, a
``server`` note signed with the run key); a region's leader reads the note (until ``--timeout``), connects, and
its first pull is the server's welcome: θ as it is (θ0 at the start; the live θ for a region restarted mid-run).
No quorum is formed: regions never meet each other, and torchft's Lighthouse is only the address they share.

- A remote region that dies just stops pushing; the others go on without it while ``min_regions`` are connected
  (with fewer, the server holds every push until enough are back). Restarted with its own command, it connects
  again and trains on from the current θ.
- The server's region is the run: θ and the outer momentum live only on its leader. If it dies, every other region
  stops with one ``error:`` line at its next push (there is no second server, and nothing to go on from).
- A region started after the run's end reads the board's ``finished`` note and stops at once (exit 0).

Records: the server's region writes ``events.jsonl`` (one ``round`` record per arrival, ``join``/``leave`` per
session), ``summary.json`` and ``final_params.pt``, as region 0 of a static run; a region whose folder is its own
(a host's disk) also writes its own there: its spans and the evaluation of the θ it ended on.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from ...config import ConfigError
from ...telemetry import Telemetry
from .async_link import LinkError, LinkRefused, ServerLink, Session, connect
from .board import RunBoard
from .frames import run_trust
from .membership import RunFinished
from .records import RunRecords
from .service import ADVERTISE_ENV, LIGHTHOUSE_ENV, MembershipError, bind_address

POLL_S = 0.25  # how often a region reads the board while the server's note is not there yet


class ServerLost(MembershipError):
    """The parameter server's connection closed or broke: its region is gone, and θ with it."""


def server_lost(name: str, server: str, why: str) -> ServerLost:
    return ServerLost(f"the parameter server (region {server}) is gone ({why}); θ lived only there and there is "
                      f"no second server: region {name} stops")  # fmt: skip


def board(run: Any) -> RunBoard:
    """The quorum service's run board of this run (a ConfigError, one line, without a service address)."""
    lighthouse = run.options.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not lighthouse:
        raise ConfigError(f"--method {run.method.name} with elastic regions needs the quorum service's address, where "
                          f"the parameter server leaves its own: --lighthouse http://HOST:PORT or ${LIGHTHOUSE_ENV} "
                          f"(`geomesh launch` starts one and sets it)")  # fmt: skip
    trust = run_trust()
    return RunBoard(lighthouse, run=f"{trust.run_id}/async", key=trust.key)


def listen(run: Any, width: int, serve) -> ServerLink:
    """(the server's leader) Sessions served at the advertised address, which the board then says."""
    advertised = os.environ.get(ADVERTISE_ENV) or socket.gethostname()
    trust = run_trust()
    names = [r.name for r in run.scenario.regions]
    try:
        link = ServerLink(bind_address(advertised), key=trust.key, run_id=trust.run_id, width=width,
                          regions=[i for i in range(len(names)) if i != run.method.server], names=names,
                          serve=serve)  # fmt: skip
    except LinkError as exc:
        raise MembershipError(str(exc)) from None
    host = f"[{advertised}]" if ":" in advertised else advertised
    note = {"round": 0, "address": f"{host}:{link.port}"}
    if not run.board.post("server", note):
        link.shutdown()
        raise MembershipError(f"the parameter server cannot leave its address on the quorum service's board at "
                              f"{run.board.url}: is the quorum service running there?")  # fmt: skip
    return link


def join_server(run: Any, width: int) -> Session:
    """(a remote region's leader) A session with the parameter server whose address the board gives, within
    ``--timeout``; RunFinished when the board says the run is over."""
    server = run.scenario.regions[run.method.server].name
    deadline = time.monotonic() + run.options.timeout_s
    trust, last = run_trust(), "no parameter server has left its address on the quorum service's board yet"
    while time.monotonic() < deadline:
        finished = run.board.finished()
        if finished is not None:
            raise RunFinished(finished)
        note = run.board.read("server")
        if note is not None and isinstance(note.get("address"), str):
            try:
                return connect(note["address"], key=trust.key, run_id=trust.run_id, region=run.region, width=width)
            except LinkRefused as exc:  # the server (or an impostor) refused us, or proved no key: no retry helps
                raise MembershipError(str(exc)) from None
            except LinkError as exc:  # not listening (yet, or a stale note): read the board again
                last = str(exc)
        time.sleep(POLL_S)
    raise MembershipError(f"no parameter server (region {server}) to connect to within {run.options.timeout_s:g}s: "
                          f"{last}")  # fmt: skip


def start_records(run: Any) -> RunRecords | None:
    """Where this region's records go: the server's region writes ``events.jsonl`` as it goes; another region
    keeps them (written at the end if its folder is its own). Every region's leader claims the folder."""
    if run.out_dir is None or not run.is_leader:
        return None
    name = run.scenario.regions[run.region].name
    records = RunRecords(run.out_dir, name, run.is_leader)
    records.claim_folder()
    if run.rank == 0:
        if run.region == run.method.server:
            run.telemetry = Telemetry(run.out_dir / "events.jsonl")
        else:
            run.telemetry = Telemetry(None, sinks=[records.sink()])
    return records


def finish(run: Any, records: RunRecords | None, server: Any, cycle: Any) -> dict[str, Any]:
    """The summary's elastic fields, after the run; the server posts the run's end on the board; a remote region
    whose folder is its own evaluates the θ it ended on and writes its records."""
    names = [r.name for r in run.scenario.regions]
    me = names[run.region]
    crc = (run.ledger.final_checksums or [None])[0]  # (rank 0 of the region's world has it)
    if server is not None:
        at_end = {names[i]: c for i, c in sorted(server.at_end.items())}
        run.ledger.totals["bytes_sent"] = server.sent + server.received
        run.board.post("finished", {"round": run.rounds, "regions": list(at_end), "checksum": crc})
        run.writes_summary = True
        return {"param_checksums": at_end, "cycles": {names[i]: k for i, k in enumerate(server.arrivals)},
                "elastic": {"min_regions": run.scenario.reliability.min_regions, "regions_at_end": list(at_end),
                            "leaves": server.leaves, "joins": server.joins}}  # fmt: skip
    writes = records is not None and records.writes(False)
    if run.is_leader:
        print(f"[{run.method.name}] region {me}: the run ended at round {run.rounds} ({run.tokens_done:,} tokens); "
              f"this region ends on the parameter server's θ (checksum {crc}; {cycle.cycles} cycles)",
              file=sys.stderr, flush=True)  # fmt: skip
    run.writes_summary = writes
    run.ledger.totals["bytes_sent"] = cycle.sent + cycle.received
    if writes and run.evaluates:
        run._evaluate(run._now())
        records.write_events(False)
    return {"param_checksums": {me: crc}, "cycles": {me: cycle.cycles},
            "elastic": {"min_regions": run.scenario.reliability.min_regions, "regions_at_end": [me]}}
