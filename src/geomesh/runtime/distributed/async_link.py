"""How elastic regions reach the asynchronous baseline's parameter server (``async-local-sgd`` with
``--min-regions``): one authenticated TCP connection per region *session*.

With elastic regions every region is its own ``torch.distributed`` world, so the pushes and pulls cannot travel
over a group of the leaders. The server's leader listens on a TCP port bound to its advertised address
(``GEOMESH_ADVERTISE_HOST``, as torchft's manager server and the recovery server of :mod:`.heal` are) and posts
``HOST:PORT`` on the quorum service's run board (:mod:`.board`, a ``server`` note signed with the run key); each
region's leader reads the note, connects and proves the key. A session is one such connection: a restarted
region opens a new one and is welcome (the newest session of a region is the region).

The handshake (``K``: the run key, or empty bytes without one; ``run``: the run id; MACs HMAC-SHA256, as
:mod:`.heal`'s):

1. server → region: ``b"GMAL"``, version (u8), the run id (u8 length + ASCII), a fresh 32-byte nonce ``Ns``;
2. region → server: ``b"GMAJ"``, its own nonce ``Nc``, its region index (u32), ``MAC(K, "geomesh-async-join" |
   run | Ns | Nc | region)``;
3. server → region, when the proof holds and the region is one the server serves: ``b"GMAS"``, ``MAC(K,
   "geomesh-async-serve" | run | Ns | Nc | region | width)`` (the server proves the key too), ``width`` (u64: the
   fixed width of every message, :func:`~.async_wire.message_width`, which the region checks against its own);
   otherwise ``b"GMAN"``, a one-line reason, and the connection closes.

Then every message is exactly ``width`` bytes each way: pushes and pulls as :mod:`.async_wire` frames, signed
with the session's own key ``MAC(K, "geomesh-async-session" | run | Ns | Nc)`` and numbered from 0 in the session
(the server's welcome is pull 0, the answer to push k is pull k + 1). A frame recorded from another session, or
replayed inside one, does not open; a restarted region's fresh nonce makes its pushes new. Reads are bounded:
the handshake's fields have fixed sizes, a message has the width both ends computed, and nothing read is code.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
import sys
import threading
from typing import Callable

import torch

from .heal import HealError, Listener, _mac, _recv_exact, send_refusal

_HELLO, _JOIN, _SERVE, _NO = b"GMAL", b"GMAJ", b"GMAS", b"GMAN"
_VERSION = 1
HANDSHAKE_S = 15.0
MAX_HANDSHAKES = 16  # connections in their handshake at once (more are closed at once)
WARN_LIMIT = 20  # refusals warned about on stderr; the rest only counted


class LinkError(RuntimeError):
    """The connection to the parameter server failed, closed or was refused (the message says which)."""


class LinkRefused(LinkError):
    """The server refused the region, or did not prove the run's key: asking again would not help."""


class Session:
    """One region's connection, at either end: messages of exactly ``width`` bytes each way, and the key its
    frames are signed with."""

    def __init__(self, sock: socket.socket, key: bytes, region: int, width: int, peer: str):
        self.sock, self.key, self.region, self.width, self.peer = sock, key, region, width, peer
        self.superseded = False  # (server) a newer session of this region connected since
        self.ended: str | None = None  # (server) why the session ended: "stop", "dropped", "superseded"

    def send(self, buf: torch.Tensor) -> None:
        self.sock.sendall(memoryview(buf.numpy()).cast("B"))

    def recv(self, timeout_s: float | None = None) -> torch.Tensor | None:
        """The next message (a uint8 tensor of ``width`` bytes), or None when the peer closed the connection
        (or it broke) before or inside one."""
        self.sock.settimeout(timeout_s)
        try:
            raw = _recv_exact(self.sock, self.width)
        except (OSError, HealError):
            return None
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _session_key(key: bytes, rid: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return _mac(key, b"geomesh-async-session", rid, nonce_s, nonce_c)


class ServerLink:
    """(the parameter server's leader) The listening socket and the handshake; each accepted session is handed to
    ``serve(session)`` on a thread of its own. ``regions``: the region indices it serves (every one but the
    server's own)."""

    def __init__(self, host: str, *, key: bytes | None, run_id: str, width: int, regions: list[int],
                 names: list[str], serve: Callable[[Session], None]):  # fmt: skip
        self.key, self.rid = key or b"", run_id.encode()[:255]
        self.width, self.regions, self.names, self.serve = width, set(regions), names, serve
        self.refused = 0
        self._lock = threading.Lock()
        self._handshakes = 0
        try:
            self._listener = Listener(host, self._handshake, "geomesh-async-link", backlog=64)
        except OSError as exc:
            raise LinkError(f"the parameter server cannot listen at the advertised address {host!r}: "
                            f"{exc.strerror or exc} (set GEOMESH_ADVERTISE_HOST to an address of this host)") from None
        self.host, self.port = host, self._listener.port

    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    def shutdown(self) -> None:
        self._listener.shutdown()

    def _refuse(self, conn: socket.socket, peer: tuple, reason: str) -> None:
        self.refused += 1
        if self.refused <= WARN_LIMIT:
            print(f"warning: the parameter server refused a connection from {peer[0]}:{peer[1]}: {reason}",
                  file=sys.stderr, flush=True)  # fmt: skip
        send_refusal(conn, _NO, reason)
        conn.close()

    def _handshake(self, conn: socket.socket, peer: tuple) -> None:
        with self._lock:
            busy = self._handshakes >= MAX_HANDSHAKES
            self._handshakes += 0 if busy else 1
        if busy:
            return self._refuse(conn, peer, "busy: too many connections in their handshake")
        try:
            session = self._prove(conn, peer)
        finally:
            with self._lock:
                self._handshakes -= 1
        if session is not None:
            try:
                self.serve(session)
            finally:
                session.close()

    def _prove(self, conn: socket.socket, peer: tuple) -> Session | None:
        """The handshake on the server's side: a session, or None (refused, said on stderr)."""
        try:
            conn.settimeout(HANDSHAKE_S)
            nonce_s = os.urandom(32)
            conn.sendall(_HELLO + bytes([_VERSION, len(self.rid)]) + self.rid + nonce_s)
            join = _recv_exact(conn, 4 + 32 + 4 + 32)
        except (OSError, HealError):
            self.refused += 1  # connected and never asked properly (a port scan, a stray request)
            conn.close()
            return None
        if join[:4] != _JOIN:
            self._refuse(conn, peer, "not a region of this run (no join request)")
            return None
        nonce_c, region_b, proof = join[4:36], join[36:40], join[40:]
        (region,) = struct.unpack("<I", region_b)
        want = _mac(self.key, b"geomesh-async-join", self.rid, nonce_s, nonce_c, region_b)
        if not hmac.compare_digest(proof, want):
            self._refuse(conn, peer, "no proof of the run's key (wrong key, or another job)")
            return None
        if region not in self.regions:
            self._refuse(conn, peer, f"region #{region} is not one the parameter server serves")
            return None
        width_b = struct.pack("<Q", self.width)
        try:
            conn.sendall(_SERVE + _mac(self.key, b"geomesh-async-serve", self.rid, nonce_s, nonce_c, region_b,
                                       width_b) + width_b)  # fmt: skip
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # (a host cut off is noticed, in time)
        except OSError:
            conn.close()
            return None
        return Session(conn, _session_key(self.key, self.rid, nonce_s, nonce_c), region, self.width,
                       f"{peer[0]}:{peer[1]}")  # fmt: skip


def connect(address: str, *, key: bytes | None, run_id: str, region: int, width: int) -> Session:
    """(a region's leader) A session with the parameter server at ``address`` (``HOST:PORT``); LinkError when it
    cannot be reached, is not one, refuses, or does not prove the run's key."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not host:
        raise LinkError(f"malformed parameter server address {address[:80]!r}")
    key, rid = key or b"", run_id.encode()[:255]
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=HANDSHAKE_S)
    except OSError as exc:
        raise LinkError(f"the parameter server at {address} cannot be reached: {exc.strerror or exc}") from None
    try:
        head = _recv_exact(sock, 6)
        if head[:4] != _HELLO or head[4] != _VERSION:
            raise LinkError(f"{address} is not a GeoMesh parameter server")
        theirs = _recv_exact(sock, head[5]) if head[5] else b""
        nonce_s = _recv_exact(sock, 32)
        if theirs != rid:
            raise LinkRefused(f"the parameter server at {address} runs another job (run id "
                            f"{theirs[:32].decode(errors='replace')!r}, this one {run_id!r})")  # fmt: skip
        nonce_c, region_b = os.urandom(32), struct.pack("<I", region)
        sock.sendall(_JOIN + nonce_c + region_b + _mac(key, b"geomesh-async-join", rid, nonce_s, nonce_c, region_b))
        what = _recv_exact(sock, 4)
        if what == _NO:
            (n,) = struct.unpack("<H", _recv_exact(sock, 2))
            why = _recv_exact(sock, n).decode(errors="replace")
            raise LinkRefused(f"the parameter server at {address} refused: {why}")
        proof, width_b = (_recv_exact(sock, 32), _recv_exact(sock, 8)) if what == _SERVE else (b"", b"")
        if what != _SERVE or not hmac.compare_digest(proof, _mac(key, b"geomesh-async-serve", rid, nonce_s, nonce_c,
                                                                 region_b, width_b)):  # fmt: skip
            raise LinkRefused(f"the parameter server at {address} did not prove the run's key")
        (theirs_width,) = struct.unpack("<Q", width_b)
        if theirs_width != width:
            raise LinkRefused(f"the parameter server at {address} sends messages of {theirs_width} bytes, this "
                              f"region's are {width} (another model?)")  # fmt: skip
    except (OSError, HealError) as exc:
        sock.close()
        raise LinkError(f"the handshake with the parameter server at {address} failed: {exc}") from None
    except LinkError:
        sock.close()
        raise
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return Session(sock, _session_key(key, rid, nonce_s, nonce_c), region, width, address)
