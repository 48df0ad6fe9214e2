"""How bytes move in the distributed runtime: the collectives with byte accounting.

- :class:`Transport` wraps ``torch.distributed`` for the few collectives a round needs (the leaders'
  straggler barrier, the all-gather of equal-size payloads, the all-reduce of a flat fp32 buffer, the
  broadcast inside a region, control objects) and counts the bytes handed to each.

Control objects are frames (:mod:`.frames`), never pickles: :meth:`Transport.all_gather_framed` and
:meth:`Transport.broadcast_framed` carry JSON values, ``bytes`` and tensors (dict keys may be ints or
strings, tuples stay tuples). With the run's key each frame is tagged over the run id, a sequence number of
the object collective (every rank calls them in the same order, so it is the same on every rank), and the
sender's rank, so a frame replayed from an earlier collective or put in another rank's slot is refused.
Receivers bound a frame's size: a sender that claims more than ``max_control_bytes`` (gathers) or
``max_broadcast_bytes`` (broadcasts), or whose frame is malformed, unsigned or forged, stops the run on every
rank with one line naming that rank (:class:`FrameRejected`): a static world cannot go on without a rank,
but it never runs what a peer sent. :meth:`Transport.all_gather_json` instead leaves such a rank's slot
``None`` (the reason in :attr:`Transport.rejected`). Payloads: :meth:`Transport.all_gather_payloads` signs each
slot for its sender and round, "no update" included (:func:`split_gathered`'s four zero bytes prove nothing).

The WAN shaper, the ring collectives' byte counts and the wire counters are :mod:`.wan_shaper`; real links
between local ranks (Linux network namespaces) are :mod:`geomesh.testbed.netns`.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import random
import socket
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from .wan_shaper import ring_allgather_bytes, ring_allreduce_bytes
from .frames import DEFAULT_MAX_BYTES, Context, Rejected, open_frame, run_trust, seal

ABSENT = b"\0\0\0\0"  # a payload slot of a worker whose update was dropped (real payloads start with b"GMSH")


SLOT_HEAD = "<BQ"  # a payload slot's head: a payload (1) or "no update" (0), and the round
SLOT_HEADER_NBYTES = struct.calcsize(SLOT_HEAD)  # what a signed slot adds to its payload (the tag aside)
MAX_CONTROL_BYTES = 16 * 2**20  # a control message (round info, plan, state header) is far smaller

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PICKED_PORT = 10000
# a picked port is this machine's launches' for this long (a file per port in PORT_RESERVATIONS): enough for the
# ranks it is meant for to import torch and bind it on a busy machine, so two launches at once (of one user) never
# hand out the same port while their ranks start
PORT_RESERVED_S = 120.0
PORT_RESERVATIONS = Path(tempfile.gettempdir()) / f"geomesh-ports-{os.getuid() if hasattr(os, 'getuid') else 0}"


def reserve_port(port: int, now: float | None = None) -> bool:
    """Claim ``port`` for this launch unless another launch on this machine claimed it within
    :data:`PORT_RESERVED_S` (an exclusive create: two claims at once cannot both succeed; an older claim is
    taken over)."""
    now = time.time() if now is None else now
    try:
        PORT_RESERVATIONS.mkdir(mode=0o700, exist_ok=True)
        mark = PORT_RESERVATIONS / str(port)
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            if now - mark.stat().st_mtime < PORT_RESERVED_S:
                return False
            os.utime(mark, (now, now))  # a stale claim: this launch's now
            return True
    except OSError:  # (no writable temporary folder: the bind check alone)
        return True


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ephemeral ports (the source ports of outgoing connections); Linux's default where it
    cannot be read."""
    try:
        low, high = (int(x) for x in Path(EPHEMERAL_RANGE_FILE).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the rendezvous port of a local launch), picked below the kernel's
    ephemeral range: a port the kernel hands out is also any outgoing connection's source port, so on a busy
    machine one of its own connections (Gloo opens many) took it between this check and the rank's bind
    (``EADDRINUSE``, and the launch failed). Random, so that two launches at once rarely pick the same one;
    an ephemeral port where none below the range is free. Two launches on one machine do not pick the same port
    within :data:`PORT_RESERVED_S` (:func:`reserve_port`): a port is free until its rank binds it, seconds later
    on a busy machine, and another launch's random pick could land on it meanwhile."""
    low, _ = ephemeral_ports()
    pick = random.SystemRandom()
    for _ in range(32 if low > LOWEST_PICKED_PORT else 0):
        port = pick.randrange(LOWEST_PICKED_PORT, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if reserve_port(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class FrameRejected(getattr(dist, "DistError", RuntimeError), ValueError):  # a communication failure (the rank's exit)
    """A rank sent a control frame that failed its checks (the message names the rank and the reason)."""


@dataclass
class Transport:
    """The collectives of one rank, with the bytes handed to each counted by purpose.

    ``wan_bytes``: bytes this rank puts on the wire in the cross-region collectives, as the ring moves them
    (docs/formats.md, ``bytes_sent``): an all-gather of one ``w``-byte slot per rank sends (N−1)·w (its own
    slot and the N−2 it forwards), an all-reduce of ``b`` bytes 2(N−1)/N·b (reduce-scatter + all-gather);
    ``intra_bytes``: bytes broadcast inside a region; ``control_bytes``: plans, checksums, telemetry.
    """

    device: torch.device
    backend: str
    timeout_s: float
    wan_bytes: int = 0
    intra_bytes: int = 0
    control_bytes: int = 0
    op: str = "startup"  # the collective in progress, for error messages
    key: bytes | None = None  # None: this process's run key (frames.run_trust()), when one is set
    run_id: str | None = None  # None: this process's run id (frames.run_trust())
    max_control_bytes: int = DEFAULT_MAX_BYTES  # the largest frame a rank may all-gather
    max_broadcast_bytes: int = 8 << 30  # ... or broadcast (it may carry θ and the outer momentum)
    frames: dict = field(default_factory=dict)  # object collectives so far, per group: what their tags bind
    rejected: list = field(default_factory=list)  # frames all_gather_json left out: {"rank", "reason", "during"}
    # control frames carry the run key's tag (elastic regions); a static world signs only its payload slots (see
    # RankRun: its store and Gloo traffic are unauthenticated anyway, and a region with another key must be
    # rejected round by round, not stop the world at its first control message)
    sign_control: bool = True

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def barrier(self, group: Any = None, what: str = "barrier") -> None:
        """Wait for every rank of ``group``; Gloo names the ranks that did not arrive within the timeout."""
        self.op = what
        if self.backend == "gloo":
            dist.monitored_barrier(group=group, timeout=self.timeout, wait_all_ranks=True)
        else:
            dist.barrier(group=group, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def all_gather_bytes(self, payload: bytes | None, nbytes: int, group: Any, size: int) -> torch.Tensor:
        """All-gather one ``nbytes`` payload per rank of ``group`` (``None``: an absent slot of zeros).

        Returns the gathered uint8 tensor [size * nbytes] in group-rank order (on CPU)."""
        self.op = "all_gather of the payloads"
        mine = torch.zeros(nbytes, dtype=torch.uint8)
        if payload is not None:
            if len(payload) != nbytes:
                raise ValueError(f"payload of {len(payload)} bytes, expected {nbytes} (all payloads are one size)")
            mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        mine = mine.to(self.device)
        out = torch.empty(size * nbytes, dtype=torch.uint8, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, mine, group=group)
        self.wan_bytes += ring_allgather_bytes(nbytes, size)
        return out.cpu()

    def all_gather_payloads(self, payload: bytes | None, nbytes: int, group: Any, size: int, round_number: int,
                            what: str = "all_gather of the payloads") -> list[bytes | None | Rejected]:  # fmt: skip
        """All-gather one ``nbytes`` payload per rank of ``group``, each slot signed for its sender and round.

        A slot is ``flag`` (u8: 1 a payload, 0 "no update"), the round (u64), the payload (zeros for no
        update), and with the run's key an HMAC-SHA256 tag over the run id, the sender's global rank and
        all of the above: so "no update" cannot be forged to drop a region, and a slot replayed from another
        round or sender is refused. Returns per group rank the payload, ``None`` (a signed "no update") or
        :class:`~geomesh.runtime.distributed.frames.Rejected` with the reason (also in :attr:`rejected`)."""
        self.op = what
        key, run_id = self._trust()
        ranks = self._ranks(group)
        if len(ranks) != size:
            raise ValueError(f"{what}: a group of {len(ranks)} ranks, expected {size}")
        if payload is not None and len(payload) != nbytes:
            raise ValueError(f"payload of {len(payload)} bytes, expected {nbytes} (all payloads are one size)")
        head = struct.pack(SLOT_HEAD, 0 if payload is None else 1, int(round_number))
        body = head + (payload if payload is not None else bytes(nbytes))
        tag = _slot_tag(key, run_id, dist.get_rank(), body) if key else b""
        width = len(body) + len(tag)
        mine = torch.frombuffer(bytearray(body + tag), dtype=torch.uint8).to(self.device)
        out = torch.empty(size * width, dtype=torch.uint8, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, mine, group=group)
        self.wan_bytes += ring_allgather_bytes(width, size)
        raw = out.cpu().numpy().tobytes()
        result: list[bytes | None | Rejected] = []
        for k, rank in enumerate(ranks):
            slot = raw[k * width : (k + 1) * width]
            body_k, tag_k = slot[: width - len(tag)], slot[width - len(tag) :]
            flag, claimed_round = struct.unpack_from(SLOT_HEAD, body_k, 0)
            if key and not hmac.compare_digest(tag_k, _slot_tag(key, run_id, rank, body_k)):
                got: bytes | None | Rejected = Rejected("HMAC tag mismatch (forged, replayed from another sender, "
                                                        "or signed with another key)")  # fmt: skip
            elif flag not in (0, 1) or (flag == 0 and any(body_k[9:])):
                got = Rejected("malformed payload slot")
            elif claimed_round != round_number:
                got = Rejected(f"a payload of round {claimed_round} in round {round_number}: replayed or stale")
            else:
                got = body_k[9:] if flag == 1 else None
            if isinstance(got, Rejected):
                self._reject(rank, what, got.reason)
            result.append(got)
        return result

    def all_reduce_sum(self, flat: torch.Tensor, group: Any) -> torch.Tensor:
        """Sum a flat float32 buffer over ``group`` (in place); returns it."""
        self.op = "all_reduce of the pseudo-gradients"
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        self.wan_bytes += ring_allreduce_bytes(flat.numel() * flat.element_size(), dist.get_world_size(group))
        return flat

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> torch.Tensor:
        """Broadcast ``tensor`` (in place) from global rank ``src`` to the ranks of ``group`` (a region)."""
        self.op = "broadcast inside the region"
        moved = tensor.to(self.device)
        dist.broadcast(moved, src=src, group=group)
        self.intra_bytes += moved.numel() * moved.element_size()
        return moved.cpu() if moved is not tensor else tensor

    # ---- control messages: frames (runtime/distributed/frames.py), never pickles -------------------------
    def _trust(self) -> tuple[bytes | None, str]:
        trust = run_trust()
        return (self.key if self.key is not None else trust.key,
                self.run_id if self.run_id is not None else trust.run_id)  # fmt: skip

    def _context(self, ranks: tuple[int, ...]) -> tuple[Context, bytes | None]:
        """The next collective of the group of ``ranks``: its members call them in one order, so each
        group's own count is the same on all of them (and differs from every earlier collective's)."""
        key, run_id = self._trust()
        self.frames[ranks] = self.frames.get(ranks, 0) + 1
        return (Context(run_id=run_id, kind="control", round=self.frames[ranks], scope=hash(ranks) & 0xFFFF),
                key if self.sign_control else None)  # fmt: skip

    @staticmethod
    def _ranks(group: Any) -> tuple[int, ...]:
        if group is None:
            return tuple(range(dist.get_world_size()))
        return tuple(dist.get_process_group_ranks(group))

    def _gather_frames(self, obj: Any, group: Any, what: str, limit: int) -> list[Any | Rejected]:
        """Every group member's ``obj`` in group order, or a :class:`Rejected` in the slot of a member whose
        frame failed its checks (the width every member pads to is bounded, whatever a peer claims)."""
        self.op = what
        ranks = self._ranks(group)
        ctx, key = self._context(ranks)
        me = dist.get_rank()
        frame = seal(obj, ctx=ctx, sender=me, key=key).to_bytes()
        mine_size = torch.tensor([len(frame)], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in ranks]
        dist.all_gather(sizes, mine_size, group=group)
        claimed = [int(s) for s in sizes]
        ok = [0 <= n <= limit for n in claimed]
        width = max([1] + [n for n, good in zip(claimed, ok) if good])
        mine = torch.zeros(width, dtype=torch.uint8)
        if len(frame) <= width:
            mine[: len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        outs = [torch.empty(width, dtype=torch.uint8, device=self.device) for _ in ranks]
        dist.all_gather(outs, mine.to(self.device), group=group)
        self.control_bytes += len(frame)
        result: list[Any | Rejected] = []
        for rank, o, n, good in zip(ranks, outs, claimed, ok):
            if not good:
                result.append(Rejected(f"it claims a {n}-byte frame, the limit is {limit}"))
                continue
            opened = open_frame(bytearray(o[:n].cpu().numpy().tobytes()), ctx=ctx, key=key, max_bytes=limit,
                                sender=rank)  # fmt: skip
            result.append(opened if isinstance(opened, Rejected) else opened.obj)
        return result

    def _broadcast_frame(self, obj: Any, src: int, group: Any, what: str, limit: int, intra: bool = False) -> Any:
        self.op = what
        ctx, key = self._context(self._ranks(group))
        me = dist.get_rank()
        frame = seal(obj, ctx=ctx, sender=src, key=key).to_bytes() if me == src else b""
        size = torch.tensor([len(frame)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=src, group=group)
        n = int(size.cpu()[0])
        if not 0 <= n <= limit:
            raise FrameRejected(f"rank {src} sent a bad control frame during {what}: it claims a {n}-byte "
                                f"frame, the limit is {limit}")  # fmt: skip
        buf = torch.zeros(max(n, 1), dtype=torch.uint8)
        if me == src:
            buf[:n] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        buf = buf.to(self.device)
        dist.broadcast(buf, src=src, group=group)
        if intra:
            self.intra_bytes += n
        else:
            self.control_bytes += n
        if me == src:
            return obj
        opened = open_frame(bytearray(buf[:n].cpu().numpy().tobytes()), ctx=ctx, key=key, max_bytes=limit,
                            sender=src)  # fmt: skip
        if isinstance(opened, Rejected):
            raise FrameRejected(f"rank {src} sent a bad control frame during {what}: {opened.reason}")
        return opened.obj

    def _reject(self, rank: int, what: str, reason: str) -> None:
        self.rejected.append({"rank": rank, "reason": reason, "during": what})
        if len(self.rejected) <= 50:
            print(f"warning: rank {dist.get_rank()}: rejected the frame of rank {rank} during {what}: {reason}",
                  file=sys.stderr, flush=True)  # fmt: skip

    def all_gather_json(self, obj: Any, group: Any, size: int, what: str = "control message",
                        max_bytes: int = MAX_CONTROL_BYTES) -> list[Any]:  # fmt: skip
        """Every member's ``obj`` over ``group`` (of ``size`` ranks), in group order. A member whose frame is
        malformed, longer than ``max_bytes``, unsigned, forged, replayed or in another's slot has ``None`` in
        its slot; the reason is appended to :attr:`rejected` (``{"rank", "reason", "during"}``) and warned."""
        got = self._gather_frames(obj, group, what, max_bytes)
        if len(got) != size:
            raise ValueError(f"{what}: a group of {len(got)} ranks, expected {size}")
        out = []
        for rank, item in zip(self._ranks(group), got):
            if isinstance(item, Rejected):
                self._reject(rank, what, item.reason)
                item = None
            out.append(item)
        return out

    def broadcast_json(self, obj: Any, src: int, group: Any, what: str = "control message",
                       max_bytes: int = MAX_CONTROL_BYTES) -> Any:  # fmt: skip
        """``obj`` from global rank ``src`` to the ranks of ``group`` (a region); a bad frame from ``src``
        raises :class:`FrameRejected` (one line naming it) on every receiver."""
        return self._broadcast_frame(obj, src, group, what, max_bytes, intra=True)

    def all_gather_framed(self, obj: Any, what: str = "control message") -> list[Any]:
        """Every rank's ``obj`` over the whole world, in rank order. A rank whose frame fails its checks
        raises :class:`FrameRejected` on every rank (naming it): a static world cannot go on without it."""
        got = self._gather_frames(obj, None, what, self.max_control_bytes)
        for rank, item in enumerate(got):
            if isinstance(item, Rejected):
                raise FrameRejected(f"rank {rank} sent a bad control frame during {what}: {item.reason}")
        return got

    def broadcast_framed(self, obj: Any, src: int = 0, what: str = "control message",
                         max_bytes: int | None = None) -> Any:  # fmt: skip
        """Global rank ``src``'s ``obj`` on every rank of the world (``max_bytes``: default
        ``max_broadcast_bytes``, as it may carry θ); a bad frame raises :class:`FrameRejected`."""
        return self._broadcast_frame(obj, src, None, what, self.max_broadcast_bytes if max_bytes is None else max_bytes)


def _slot_tag(key: bytes, run_id: str, sender: int, body: bytes) -> bytes:
    mac = hmac.new(key, b"GMPL-slot\0", hashlib.sha256)
    mac.update(struct.pack("<I", len(run_id.encode())) + run_id.encode() + struct.pack("<q", sender))
    mac.update(body)
    return mac.digest()


def split_gathered(gathered: torch.Tensor, nbytes: int) -> list[bytes | None]:
    """The payloads of an all-gather in rank order; an all-zero slot (a dropped update) is ``None``."""
    raw = gathered.numpy().tobytes()
    out: list[bytes | None] = []
    for k in range(len(raw) // nbytes):
        piece = raw[k * nbytes : (k + 1) * nbytes]
        out.append(None if piece[:4] == ABSENT else piece)
    return out
