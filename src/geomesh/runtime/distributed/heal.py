"""Healing over an authenticated transport: how a live region hands θ, the outer momentum and the loop's state
to a region that is behind, and only to one that proves the run's key.

:class:`HealTransport` is torchft's ``CheckpointTransport`` for :class:`~geomesh.runtime.distributed.membership.
Membership` (in place of torchft's HTTP one, which listens on every interface, serves anyone who asks and
loads what it receives with ``weights_only=False``). Every region's leader runs one server, bound to its
advertised address (``GEOMESH_ADVERTISE_HOST``) on a free port; torchft passes the address on to a joiner as
the checkpoint metadata (``geomesh-heal://HOST:PORT``). A live region serves only while torchft has staged a
state (from ``send_checkpoint`` until ``disallow_checkpoint``), and only that round's.

The exchange on one TCP connection (``K``: the run's key, or empty bytes without one; ``run``: the run id;
``step``: the round the joiner is to receive; all MACs HMAC-SHA256):

1. server → joiner: ``b"GMHL"``, version (u8), the run id (u8 length + ASCII), a fresh 32-byte nonce ``Ns``;
2. joiner → server: ``b"GMHJ"``, its own nonce ``Nc``, ``step`` (u64), ``MAC(K, "geomesh-heal-join" | run | Ns
   | Nc | step)``: the proof of the key, bound to this connection (a recorded proof is useless later);
3. server → joiner, when the proof holds and ``step`` is the staged round: ``b"GMHS"``, ``MAC(K,
   "geomesh-heal-serve" | run | Ns | Nc | step | size)`` (the server proves the key too: a stranger cannot
   pose as a live region and feed a joiner its own θ), ``size`` (u64), then the state as one frame
   (:mod:`.frames`: tensors as raw bytes, the rest JSON) tagged with a key derived from ``K``, ``Ns`` and
   ``Nc``; otherwise ``b"GMHN"`` and a one-line reason, and the connection closes. No state byte leaves the
   server before step 3.

The joiner bounds ``size`` by what its own state weighs (its tensors' bytes plus 256 MiB), receives it under
a timeout of its own sized for the state (``60 s + size / 1.25 MB/s``, i.e. a 10 Mbit/s floor, or
``GEOMESH_HEAL_TIMEOUT_S``; a stall of 60 s ends it at once), checks the frame's tag before it parses a
byte, and checks that every tensor it holds itself comes with the same name, dtype and shape, before torchft
hands the state to the loop. A joiner that asks before the live region has staged the round waits for it (up
to 60 s). A refused or failed heal raises :class:`HealError` inside torchft's quorum; the server
counts refusals in :attr:`HealTransport.refused` and warns once per request on stderr, naming the peer.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
from torchft.checkpointing.transport import CheckpointTransport

from .frames import Context, Rejected, open_frame, seal

SCHEME = "geomesh-heal://"
HEAL_TIMEOUT_ENV = "GEOMESH_HEAL_TIMEOUT_S"
HEAL_BASE_S = 60.0
HEAL_FLOOR_BPS = 1.25e6  # bytes/s the heal timeout allows for (10 Mbit/s)
IDLE_S = 60.0  # a transfer that moves nothing for this long has stalled
HANDSHAKE_S = 15.0
STAGE_WAIT_S = 60.0  # a joiner may ask before the live region has staged the round (both learn of it at once)
MAX_ACTIVE = 4  # transfers served at once (more requests are refused as busy)
WARN_LIMIT = 20  # refusals warned about on stderr; the rest only counted
_HELLO, _JOIN, _SERVE, _NO = b"GMHL", b"GMHJ", b"GMHS", b"GMHN"
_VERSION = 1
_CHUNK = 4 << 20


class HealError(RuntimeError):
    """A heal was refused or failed (the message says why)."""


def heal_timeout_s(nbytes: int) -> float:
    """How long receiving ``nbytes`` of state may take."""
    given = os.environ.get(HEAL_TIMEOUT_ENV)
    if given:
        try:
            return max(1.0, float(given))
        except ValueError:
            raise HealError(f"${HEAL_TIMEOUT_ENV}={given!r}: expected seconds") from None
    return HEAL_BASE_S + nbytes / HEAL_FLOOR_BPS


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    m = hmac.new(key, label + b"\0", hashlib.sha256)
    for p in parts:
        m.update(struct.pack("<I", len(p)))
        m.update(p)
    return m.digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise HealError(f"the connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def tensor_layout(obj: Any, path: str = "") -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor in a nested state, by its path: (dtype, shape). What a received state (a heal's, an
    asynchronous push's) must match before any of it is used."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    if isinstance(obj, torch.Tensor):
        t = obj.full_tensor() if hasattr(obj, "full_tensor") else obj
        out[path] = (str(t.dtype), tuple(t.shape))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensor_layout(v, f"{path}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensor_layout(v, f"{path}/{i}"))
    return out


def send_refusal(conn: socket.socket, magic: bytes, reason: str) -> None:
    """A refusal on ``conn``, best effort: ``magic``, the reason's length (u16) and the reason (200 bytes at most)."""
    try:
        text = reason.encode()[:200]
        conn.sendall(magic + struct.pack("<H", len(text)) + text)
    except OSError:
        pass


class Listener:
    """A TCP socket listening at ``host`` on a free port (OSError when it cannot bind there), each connection
    handed to ``handle(conn, peer)`` on a thread of its own until :meth:`shutdown`."""

    def __init__(self, host: str, handle: Callable[[socket.socket, Any], None], name: str, backlog: int = 16):
        host = host.strip("[]")
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, 0))
        except OSError:
            self._sock.close()
            raise
        self._sock.listen(backlog)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, args=(handle,), name=name, daemon=True).start()

    def _accept(self, handle: Callable[[socket.socket, Any], None]) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn, peer), daemon=True).start()

    def shutdown(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


class HealTransport(CheckpointTransport):
    """torchft's checkpoint transport, authenticated (see the module docstring)."""

    def __init__(self, *, host: str, key: bytes | None, run_id: str, region: int, name: str,
                 expected: Callable[[], Any] | None = None):  # fmt: skip
        self.key = key or b""
        self.run_id = run_id
        self.region, self.name = region, name
        self.expected = expected  # this region's own state, the shape a received one must have
        self.refused = 0
        self.served = 0
        self.stage_wait_s = STAGE_WAIT_S
        self.last_error: str | None = None  # why the last recv_checkpoint failed
        self._lock = threading.Condition()
        self._staged: tuple[int, Any] | None = None
        self._active = 0
        try:
            self._listener = Listener(host, self._serve, "geomesh-heal")
        except OSError as exc:
            raise HealError(f"cannot serve recovery state at the advertised address {host!r}: "
                            f"{exc.strerror or exc} (set GEOMESH_ADVERTISE_HOST to an address of this host)") from None  # fmt: skip
        self.host = host
        self.port = self._listener.port

    # ---- torchft's interface -------------------------------------------------------------------------
    def metadata(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{SCHEME}{host}:{self.port}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Stage this round's state for joiners that prove the key (served from the server's threads).

        The state is the loop's snapshot (copies of θ and the momentum), so a transfer already running when
        :meth:`disallow_checkpoint` comes finishes on the state it started with."""
        with self._lock:
            self._staged = (int(step), state_dict)
            self._lock.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._lock:
            self._staged = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        try:
            return self._recv(metadata, int(step))
        except (OSError, HealError) as exc:
            self.last_error = str(exc) if isinstance(exc, HealError) else f"{metadata}: {exc.strerror or exc}"
            raise HealError(self.last_error) from None

    def shutdown(self, wait: bool = True) -> None:
        self._listener.shutdown()

    # ---- the server ----------------------------------------------------------------------------------

    def _refuse(self, conn: socket.socket, peer: Any, reason: str, warn: bool = True) -> None:
        if warn:
            self.refused += 1
            if self.refused <= WARN_LIMIT:
                print(f"warning: region {self.name}: refused a recovery request from {peer[0]}:{peer[1]}: {reason}",
                      file=sys.stderr, flush=True)  # fmt: skip
        send_refusal(conn, _NO, reason)

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        with self._lock:
            busy = self._active >= MAX_ACTIVE
            if not busy:
                self._active += 1
        try:
            with conn:
                if busy:
                    return self._refuse(conn, peer, "busy: too many recovery transfers at once")
                conn.settimeout(HANDSHAKE_S)
                nonce_s = os.urandom(32)
                rid = self.run_id.encode()[:255]
                conn.sendall(_HELLO + bytes([_VERSION, len(rid)]) + rid + nonce_s)
                try:
                    join = _recv_exact(conn, 4 + 32 + 8 + 32)
                except (OSError, HealError):
                    self.refused += 1  # connected and never asked properly (a port scan, a stray HTTP GET)
                    return
                if join[:4] != _JOIN:
                    return self._refuse(conn, peer, "not a recovery request")
                nonce_c, (step,), proof = join[4:36], struct.unpack("<Q", join[36:44]), join[44:]
                step_b = join[36:44]
                want = _mac(self.key, b"geomesh-heal-join", rid, nonce_s, nonce_c, step_b)
                if not hmac.compare_digest(want, proof):
                    return self._refuse(conn, peer, "no proof of the run's key (wrong key, or another job)")
                with self._lock:  # torchft tells joiner and server at once: the state may be staged a moment later
                    self._lock.wait_for(lambda: self._staged is not None and self._staged[0] >= step,
                                        timeout=self.stage_wait_s)  # fmt: skip
                    staged = self._staged
                if staged is None or staged[0] != step:
                    return self._refuse(conn, peer, f"round {step} is not being served "
                                        f"({'none' if staged is None else f'round {staged[0]}'} is)", warn=False)  # fmt: skip
                session = _mac(self.key, b"geomesh-heal-session", rid, nonce_s, nonce_c)
                sealed = seal(staged[1], ctx=Context(self.run_id, "heal", step), sender=self.region, key=session)
                total = struct.pack("<Q", sealed.nbytes)
                conn.sendall(_SERVE + _mac(self.key, b"geomesh-heal-serve", rid, nonce_s, nonce_c, step_b, total)
                             + total)  # fmt: skip
                conn.settimeout(IDLE_S)
                for part in sealed.parts():
                    for at in range(0, len(part), _CHUNK):
                        conn.sendall(part[at : at + _CHUNK])
                self.served += 1
        except OSError:
            pass  # the joiner went away; it asks again at its next quorum
        finally:
            if not busy:
                with self._lock:
                    self._active -= 1

    # ---- the joiner ----------------------------------------------------------------------------------
    def _limit(self) -> tuple[int, dict | None]:
        """The most bytes of state to accept, and this region's own tensor layout (None: unknown)."""
        try:
            mine = self.expected() if self.expected is not None else None
        except Exception:  # noqa: BLE001 - a region that cannot describe its state yet: the fixed bound
            mine = None
        if mine is None:
            return 64 << 30, None
        layout = tensor_layout(mine)
        nbytes = 0
        for dtype, shape in layout.values():
            numel = 1
            for s in shape:
                numel *= s
            nbytes += numel * torch.empty(0, dtype=getattr(torch, dtype.split(".")[-1])).element_size()
        return nbytes + (256 << 20), layout

    def _recv(self, metadata: str, step: int) -> Any:
        if not metadata.startswith(SCHEME):
            raise HealError(f"the live region offers its state at {metadata[:80]!r}, not over the "
                            "authenticated transport (another program on the quorum service?)")  # fmt: skip
        hostport = metadata[len(SCHEME):].rstrip("/")
        host, _, port = hostport.rpartition(":")
        if not port.isdigit():
            raise HealError(f"malformed recovery address {metadata[:80]!r}")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=HANDSHAKE_S) as sock:
            head = _recv_exact(sock, 6)
            if head[:4] != _HELLO or head[4] != _VERSION:
                raise HealError(f"{metadata}: not a GeoMesh recovery server")
            rid = _recv_exact(sock, head[5]) if head[5] else b""
            nonce_s = _recv_exact(sock, 32)
            if rid != self.run_id.encode()[:255]:
                theirs = rid[:32].decode(errors="replace")
                raise HealError(f"the region at {metadata} runs another job (run id {theirs!r}, this one "
                                f"{self.run_id!r}): start every region with the same command")  # fmt: skip
            nonce_c = os.urandom(32)
            step_b = struct.pack("<Q", step)
            sock.sendall(_JOIN + nonce_c + step_b + _mac(self.key, b"geomesh-heal-join", rid, nonce_s, nonce_c, step_b))
            sock.settimeout(STAGE_WAIT_S + HANDSHAKE_S)  # the server may wait for the round to be staged
            what = _recv_exact(sock, 4)
            if what == _NO:
                (n,) = struct.unpack("<H", _recv_exact(sock, 2))
                raise HealError(f"the region at {metadata} refused: {_recv_exact(sock, n).decode(errors='replace')}")
            if what != _SERVE:
                raise HealError(f"{metadata}: unexpected reply")
            proof, total_b = _recv_exact(sock, 32), _recv_exact(sock, 8)
            if not hmac.compare_digest(proof, _mac(self.key, b"geomesh-heal-serve", rid, nonce_s, nonce_c, step_b,
                                                   total_b)):  # fmt: skip
                raise HealError(f"the region at {metadata} did not prove the run's key: its state is not taken")
            (total,) = struct.unpack("<Q", total_b)
            limit, layout = self._limit()
            if total > limit:
                raise HealError(f"the region at {metadata} offers {total} bytes of state; this region's state "
                                f"is at most {limit}")  # fmt: skip
            deadline = time.monotonic() + heal_timeout_s(total)
            sock.settimeout(IDLE_S)
            buf = bytearray(total)
            view, got = memoryview(buf), 0
            while got < total:
                if time.monotonic() > deadline:
                    raise HealError(f"receiving {total} bytes of state from {metadata} took longer than "
                                    f"{heal_timeout_s(total):.0f}s (${HEAL_TIMEOUT_ENV} sets it)")  # fmt: skip
                k = sock.recv_into(view[got:], min(_CHUNK, total - got))
                if k == 0:
                    raise HealError(f"{metadata} closed the connection after {got} of {total} bytes of state")
                got += k
        session = _mac(self.key, b"geomesh-heal-session", rid, nonce_s, nonce_c)
        opened = open_frame(buf, ctx=Context(self.run_id, "heal", step), key=session, max_bytes=total, copy=False)
        if isinstance(opened, Rejected):
            raise HealError(f"the state from {metadata} was refused: {opened.reason}")
        if layout is not None:  # every tensor this region holds must come, as this region holds it
            theirs = tensor_layout(opened.obj)
            odd = sorted((path, want, theirs.get(path)) for path, want in layout.items()
                         if theirs.get(path) != want)[:3]  # fmt: skip
            if odd:
                raise HealError(f"the state from {metadata} does not fit this region's model "
                                f"(first differences, path: ours, theirs: {odd})")  # fmt: skip
        return opened.obj
