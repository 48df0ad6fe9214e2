"""The quorum service of elastic regions: torchft's Lighthouse (quorums, heartbeats) and, on the next port, the
run board (:mod:`.board`). ``python -m geomesh.runtime.distributed.membership`` runs it alone for a cluster;
``geomesh launch`` runs one in its own process for the regions it starts."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any


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


