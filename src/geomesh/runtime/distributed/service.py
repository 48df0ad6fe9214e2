"""The quorum service of elastic regions, and how the regions reach it: torchft's Lighthouse (quorums, heartbeats)
and, on the next port, the run board (:mod:`.board`). ``geomesh launch`` runs one in its own process for the
regions it starts (:func:`start_lighthouse`); ``python -m geomesh.runtime.distributed.membership`` runs it alone
for a cluster (:func:`main`). Regions find it at ``$TORCHFT_LIGHTHOUSE`` (:func:`check_reachable`); each leader
advertises the address the others reach it at (``$GEOMESH_ADVERTISE_HOST``: :func:`bind_address`,
:func:`group_store_host`); the service waits its join timeout (:func:`join_timeout_s`) for the live regions that
have not asked for a round's quorum yet, and one quorum request outlasts it (:func:`quorum_attempt_s`). A region
leader's view of the quorums it takes part in is :mod:`.membership`."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import time
from typing import Any

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # the Lighthouse's address, http://HOST:PORT (torchft's own variable)
ADVERTISE_ENV = "GEOMESH_ADVERTISE_HOST"  # how other regions reach this leader (default: its host name)


class MembershipError(RuntimeError):
    """No quorum within the time allowed, or the quorum service cannot be reached (the message says which)."""


def hostport(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ServiceError(RuntimeError):
    """The quorum service could not start (no free ports)."""


class QuorumService:
    """The quorum service: torchft's Lighthouse and, on the next port, the run board (:mod:`.board`)."""

    def __init__(self, lighthouse: Any, board: Any):
        self.lighthouse, self.board = lighthouse, board

    def address(self) -> str:
        return self.lighthouse.address()

    def shutdown(self) -> None:
        self.lighthouse.shutdown()
        if self.board is not None:
            self.board.shutdown()
            self.board.server_close()


def _free_port_pair(host: str) -> int:
    """A port P such that P and P+1 are free on ``host`` now (the Lighthouse's and the board's)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.bind((host, port + 1))
            return port
        except OSError:
            continue
    raise ServiceError(f"no two free ports in a row on {host}")


def start_lighthouse(min_regions: int, deadline_s: float, bind: str = "127.0.0.1:0",
                     heartbeat_timeout_s: float = 5.0) -> QuorumService:  # fmt: skip
    """A torchft Lighthouse (in this process, on a background thread) and the run board on the next port;
    ``.address()`` is what regions use. ``bind``: HOST:PORT it listens on (default: loopback only, for regions
    on this machine; port 0: two free ports in a row)."""
    os.environ.setdefault("RUST_LOG", "error")  # torchft's own (Rust) logging: errors only
    from torchft.coordination import LighthouseServer

    from .board import start_board

    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    for _ in range(10):
        p = int(port) or _free_port_pair(host)
        lighthouse = LighthouseServer(bind=hostport(host, p), min_replicas=int(min_regions),
                                      join_timeout_ms=int(deadline_s * 1000), quorum_tick_ms=100,
                                      heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))  # fmt: skip
        try:
            return QuorumService(lighthouse, start_board(host, p + 1))
        except Exception as exc:  # noqa: BLE001 - its port taken meanwhile
            if int(port):  # (a port asked for: the service runs without a board, late regions wait it out)
                print(f"warning: the run board could not listen on {hostport(host, p + 1)}: {' '.join(str(exc).split())[:300]}",
                      file=sys.stderr, flush=True)  # fmt: skip
                return QuorumService(lighthouse, None)
            lighthouse.shutdown()
    raise ServiceError(f"the quorum service could not start on {host}")


# one quorum request's bound (requests repeat until --timeout): a few Lighthouse heartbeat timeouts, so that a
# region the Lighthouse dropped while it was cut off registers again soon after its link returns. Never shorter than
# the Lighthouse's join timeout and a margin (quorum_attempt_s): torchft takes a request's arrival as the member's
# join time, and waits for live regions that have not asked yet until the earliest join time is a join timeout
# old, so requests repeated faster than that restart the wait each time, and a hung region that still heartbeats
# (alive, never asking) would hold every quorum until --timeout
QUORUM_ATTEMPT_S = 15.0
JOIN_MARGIN_S = 5.0


def quorum_attempt_s(join_timeout_s: float) -> float:
    """How long one quorum request waits before it is made again (:data:`QUORUM_ATTEMPT_S`), given the quorum
    service's join timeout (:func:`join_timeout_s`)."""
    return max(QUORUM_ATTEMPT_S, float(join_timeout_s) + JOIN_MARGIN_S)


def bind_address(host: str) -> str:
    """The IP address ``host`` (an advertised name or address) resolves to, to bind a server to."""
    host = host.strip().strip("[]")
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError) as exc:
        raise MembershipError(f"the advertised address {host!r} does not resolve on this host ({exc}); set "
                              f"${ADVERTISE_ENV} to an address of this host that the other regions reach"
                              ) from None  # fmt: skip


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(bind_address(host)).is_loopback
    except (MembershipError, ValueError):
        return False


def group_store_host(lighthouse: str, region: str) -> str:
    """The address the other regions' leaders reach this region's group store at (torchft hands it to the
    quorum: the cross-region Gloo group meets at the store of one member). ``GEOMESH_ADVERTISE_HOST`` when
    set (torchrun's store listens on every interface), else ``MASTER_ADDR``. With the quorum service on
    another host, a loopback address here is a wrong deployment that would cost every region a store timeout
    and a traceback a round later: it is refused now, in one line."""
    host = os.environ.get(ADVERTISE_ENV) or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    service = lighthouse.split("://", 1)[-1].rstrip("/").rpartition(":")[0].strip("[]")
    if _is_loopback(host) and service and not _is_loopback(service):
        raise MembershipError(f"region {region} on host {socket.gethostname()}: the other regions would reach its "
                              f"group at {host} ({ADVERTISE_ENV} or MASTER_ADDR), a loopback address, while the "
                              f"quorum service is at {service}; set {ADVERTISE_ENV} to this host's address on the "
                              f"network the regions share (or start torchrun with --local-addr / "
                              f"--rdzv-endpoint on that address)")  # fmt: skip
    return host


def check_reachable(address: str, timeout_s: float) -> None:
    """Raise MembershipError unless something accepts TCP connections at ``address`` (http://HOST:PORT)."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit():
        raise MembershipError(f"quorum service address {address!r}: expected http://HOST:PORT")
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=min(2.0, timeout_s)):
                return
        except OSError as exc:
            last = exc
            time.sleep(0.25)
    raise MembershipError(f"the quorum service (torchft Lighthouse) at {address} cannot be reached within "
                          f"{timeout_s:g}s: {last}; start it (`geomesh launch` hosts one; on a cluster run "
                          f"torchft_lighthouse) and set ${LIGHTHOUSE_ENV}")  # fmt: skip


def join_timeout_s(reliability: Any) -> float:
    """How long the Lighthouse waits, once a region asks for a round's quorum, for the live regions that have
    not asked yet (its ``join_timeout``). Fixed deadlines: ``round_deadline_s``. Adaptive ones: the floor,
    ``round_deadline_floor_s``: the exchange is where rounds wait for a slow region (held to the adaptive
    deadline); regions reach the next quorum together after it, so a long join wait would only make every
    round after a hung region (alive, heartbeating, never asking) pay the fixed cap."""
    if getattr(reliability, "round_deadline_mode", "fixed") == "adaptive":
        return float(reliability.round_deadline_floor_s)
    return float(reliability.round_deadline_s)


def main(argv: list[str] | None = None) -> int:
    """``python -m geomesh.runtime.distributed.membership --min-regions N [--host H] [--port P] [--deadline S]``: a
    Lighthouse for a cluster run (torchft's ``torchft_lighthouse``, bound to one address), until interrupted."""
    p = argparse.ArgumentParser(prog="python -m geomesh.runtime.distributed.membership", description=main.__doc__)
    p.add_argument("--min-regions", type=int, required=True)
    p.add_argument("--host", default=os.environ.get(ADVERTISE_ENV),
                   help=f"the address to listen on, one the regions reach (default: ${ADVERTISE_ENV})")
    p.add_argument("--port", type=int, default=29510)
    p.add_argument("--deadline", type=float, default=60.0, help="round deadline (s): the quorum's join timeout")
    args = p.parse_args(argv)
    if args.min_regions < 1:
        print(f"error: --min-regions {args.min_regions}: expected >= 1", file=sys.stderr)
        return 2
    if not args.host:
        print(f"error: --host: the address to listen on is needed (or ${ADVERTISE_ENV}): an address of this host "
              "that the regions reach, e.g. its private or WireGuard address", file=sys.stderr)  # fmt: skip
        return 2
    try:
        bind = hostport(bind_address(args.host), args.port)
    except MembershipError as exc:
        print(f"error: --host: {exc}", file=sys.stderr)
        return 2
    server = start_lighthouse(args.min_regions, args.deadline, bind=bind)
    print(f"quorum service (torchft Lighthouse) listening on {bind}; regions need "
          f"{LIGHTHOUSE_ENV}=http://{hostport(args.host, args.port)}", flush=True)  # fmt: skip
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
    return 0
