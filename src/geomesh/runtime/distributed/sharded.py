"""One round of the sharded exchange over ``torch.distributed``: the transport half of :mod:`geomesh.codec.sharded`
(sign payloads, and signed dense payloads: float32 slices and shards, a ring all-reduce's bytes) and
:mod:`geomesh.codec.sharded_sparse` (sparse payloads: the same steps, its own slices and combined shards; an
owner re-sparsifies its shard with the residual it holds): the slots, the agreements and what each leader
concludes from them, read together so that what a leader sends and what the others conclude stay in step. An
owner combines its shard's slices in the senders' identity order (static: their global ranks; elastic: their
regions), the all-gather path's order, so an exact shard is its update bit for bit. Its place in the one round
loop (the plan's choice of it, static and elastic rounds, the screening step) is :mod:`.sharded_loop`.

Run by every region's leader in a group of the leaders, group rank k owning shard k: the static run's
leaders' group (Gloo or NCCL; :class:`StaticMover`), or torchft's group over the round's quorum
(:class:`QuorumMover`: M members, M shards; a member lost on the way fails the round's exchange, and the
survivors redo it over a new quorum, with a new layout in which they own the lost member's shard):

1. the leader cuts its payload into N slices and an ``all_to_all_single`` sends slice k to shard k's owner,
   each in a signed slot (below; an absent update is a signed "no update" slot);
2. each owner opens and screens the N slots of its shard; the leaders agree on who is out (a direct
   exchange of N code bytes: sender j is out of the round on every region if any owner refused its slice,
   it had no update, or it was excluded before the exchange), and each owner combines its shard from the
   senders that are in, token-weighted;
3. each owner quantises its combined shard to the exchange's bits and a second ``all_to_all_single`` sends
   the frame, in a signed slot, to every leader;
4. every leader opens and decodes the N frames; the leaders agree on the shards that arrived intact
   everywhere (a bad frame on any leader leaves its shard out of this round's update on every leader, so
   all apply the same update), and reassemble the update.

A leader whose refusals cover most of the others (it holds another run key, say) cannot veto them: with
three or more leaders, the refusals of a leader that refused more than half of the others' slices (or
frames) are not counted, and that leader applies nothing (:attr:`ShardedResult.suspect`).

Slots (the payload slots of :meth:`Transport.all_gather_payloads`, in their own domain): a flag (u8: 1 the
piece, 0 "no update"), the round (u64), the piece (zeros for no update) and, with the run's key, an
HMAC-SHA256 tag (:func:`~geomesh.runtime.distributed.transport._slot_tag`) over the run id, the sender's
identity (static: its global rank; elastic: its region), the domain (``slice`` + the shard, or ``combined``;
elastic: + the quorum) and all of the above: a slot replayed from another round, another sender, another
shard or (elastic) another quorum, or a forged "no update", is refused.

Where ``all_to_all_single`` is not supported by the backend, the same bytes move in pairs of ``isend`` /
``irecv``. Every slot has the size the layout implies, so a receiver never allocates what a peer asks for;
nothing received is unpickled: slices are sign (or sparse) payloads, combined shards are the frames of
:mod:`geomesh.codec.sharded` (or sparse payloads of the shard), codes are raw bytes. Direct exchanges (one latency
step each) keep the round at four latency steps whatever N; the WAN model (``WanModel.sharded_s``) times the two
large ones.
"""

from __future__ import annotations

import hmac
import struct
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...codec.sharded import ShardedExchange
from ...errors import PayloadError
from .frames import Rejected, pack_pieces, split_pieces
from .transport import SLOT_HEAD, SLOT_HEADER_NBYTES, _slot_tag

_TAG = 32
# why a sender is out of the round, as one owner tells the others (a code byte per sender in the agreement)
IN, NO_UPDATE, SLOT_REFUSED, SLICE_REFUSED, EXCLUDED = range(5)
_CODE_WHY = {SLOT_REFUSED: "its slot failed its signature or round", SLICE_REFUSED: "its slice is malformed",
             EXCLUDED: "it was excluded before the exchange"}  # fmt: skip
_REFUSALS = (SLOT_REFUSED, SLICE_REFUSED)


@dataclass(frozen=True)
class SlotTrust:
    """What signs and binds the slots: the run's key (None: unsigned), its id, the round, the members'
    identities in group order (static: the leaders' global ranks; elastic: their regions, -1 for a member
    whose round info was rejected: it is not known who it is) and ``scope`` (elastic: the quorum)."""

    key: bytes | None
    run_id: str
    round: int
    ranks: tuple[int, ...]
    scope: str = ""

    def width(self, nbytes: int) -> int:
        return SLOT_HEADER_NBYTES + nbytes + (_TAG if self.key else 0)

    def _domain(self, kind: str, shard: int) -> bytes:
        return f"GMSX-{kind}\0{shard}\0".encode() + (f"{self.scope}\0".encode() if self.scope else b"")

    def seal(self, piece: bytes | None, nbytes: int, sender: int, kind: str, shard: int) -> bytes:
        """One slot of ``piece`` (None: "no update") from group rank ``sender``."""
        if piece is not None and len(piece) != nbytes:
            raise ValueError(f"a {kind} piece of {len(piece)} bytes, the layout implies {nbytes}")
        body = struct.pack(SLOT_HEAD, 0 if piece is None else 1, self.round) + (piece if piece is not None
                                                                               else bytes(nbytes))  # fmt: skip
        tag = _slot_tag(self.key, self.run_id, self.ranks[sender], self._domain(kind, shard) + body) if self.key else b""
        return body + tag

    def open(self, slot: bytes, nbytes: int, sender: int, kind: str, shard: int) -> bytes | None | Rejected:
        """The piece of a slot from group rank ``sender`` (None: a signed "no update"), or why not."""
        if self.ranks[sender] < 0:
            return Rejected("a member whose round info was rejected (it is not known which region it is)")
        if len(slot) != self.width(nbytes):
            return Rejected(f"a slot of {len(slot)} bytes, expected {self.width(nbytes)}")
        body, tag = slot[: SLOT_HEADER_NBYTES + nbytes], slot[SLOT_HEADER_NBYTES + nbytes :]
        if self.key and not hmac.compare_digest(
                tag, _slot_tag(self.key, self.run_id, self.ranks[sender], self._domain(kind, shard) + body)):
            return Rejected("HMAC tag mismatch (forged, replayed from another sender or shard, or signed with "
                            "another key)")  # fmt: skip
        flag, claimed = struct.unpack_from(SLOT_HEAD, body, 0)
        if flag not in (0, 1) or (flag == 0 and any(body[SLOT_HEADER_NBYTES:])):
            return Rejected(f"malformed {kind} slot")
        if claimed != self.round:
            return Rejected(f"a {kind} slot of round {claimed} in round {self.round}: replayed or stale")
        return body[SLOT_HEADER_NBYTES:] if flag == 1 else None


@dataclass
class ShardedResult:
    """One round of the sharded exchange as a leader ends it."""

    update: dict[str, torch.Tensor] | None  # None: no sender's update counted (or this leader is suspect)
    accepted: list[int]  # group ranks whose updates are in it
    rejected: dict[int, str] = field(default_factory=dict)  # group rank -> why its update is out (refused, not absent)
    absent: list[int] = field(default_factory=list)  # group ranks that sent no update
    lost_shards: dict[int, str] = field(default_factory=dict)  # shard -> why it is left out (zeros this round)
    tokens: int = 0  # Σ n_i of the accepted senders
    sent_bytes: int = 0
    received_bytes: int = 0
    suspect: list[int] = field(default_factory=list)  # leaders whose refusals were not counted (they refused most)
    flat: torch.Tensor | None = None  # the update as one flat float32 buffer (``update`` holds views of it)


class StaticMover:
    """What moves a sharded round's bytes in a static run: the leaders' ``torch.distributed`` group (None:
    the default group), ``all_to_all_single`` or, where the backend lacks it, pairs of ``isend``/``irecv``.
    ``members``: the leaders' global ranks in group order (what the slots bind)."""

    scope = ""

    def __init__(self, group: Any = None):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.members = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(self.size))

    def all_to_all(self, send: list[bytes], recv_sizes: list[int]) -> list[bytes]:
        return _dist_all_to_all(send, recv_sizes, self.group, self.rank)


class QuorumMover:
    """What moves a sharded round's bytes between elastic regions: torchft's group over the quorum's leaders
    (:meth:`~.membership.Membership.all_to_all_bytes`, held to the round's deadline; a member lost on the
    way fails it with ``ExchangeFailed``, which the quorum's exchange retries without it). ``regions``: the
    region of each group rank, as the round infos' frames authenticate them (-1: a member whose info was
    rejected); ``scope``: the quorum (:meth:`~.membership.Membership.quorum_scope`)."""

    def __init__(self, membership: Any, regions: tuple[int, ...], timeout_s: float | None = None):
        self.membership, self.timeout_s = membership, timeout_s
        self.size, self.rank = membership.pg.size(), membership.group_rank()
        self.members = tuple(regions)
        self.scope = f"quorum {membership.quorum_scope()}"
        if len(self.members) != self.size:
            raise ValueError(f"{len(self.members)} regions for a quorum of {self.size} members")

    def all_to_all(self, send: list[bytes], recv_sizes: list[int]) -> list[bytes]:
        return self.membership.all_to_all_bytes(send, recv_sizes, self.timeout_s)


def sharded_round(payload: bytes | None, ex: ShardedExchange, group: Any = None, *, mover: Any = None,
                  device: torch.device | str = "cpu", names: list[str] | None = None, round_number: int = 0,
                  key: bytes | None = None, run_id: str = "", exclude: dict[int, str] | None = None,
                  warn: Any = warnings.warn) -> ShardedResult:  # fmt: skip
    """This leader's side of one round of the sharded exchange (see the module docstring).

    ``payload``: this region's sign payload, or None (no update this round); ``ex``: the exchange for the
    members' count (``ex.n`` must equal it; shard k belongs to group rank k); ``mover``: what moves the
    bytes (:class:`StaticMover` of ``group`` by default, :class:`QuorumMover` for elastic regions);
    ``device``: where the update lands; ``names``: the members' names for warnings (default: their group
    ranks); ``round_number``, ``key``, ``run_id``: what the slots bind with the mover's ``members`` and
    ``scope`` (``key`` None: unsigned slots; a member whose identity is -1, elastic: not known, has its
    slots refused and its agreement rows not counted); ``exclude``: group ranks kept out of this round's
    combine whatever they send (why), the same on every leader; ``warn``: how a refusal is told (the loop's
    ``quiet``: it warns per sender, and a thread must not touch the process-wide warnings filters)."""
    mover = mover if mover is not None else StaticMover(group)
    n, me = mover.size, mover.rank
    if ex.n != n:
        raise ValueError(f"the sharded exchange has {ex.n} shards, the group {n} members")
    names = names or [str(r) for r in range(n)]
    trust = SlotTrust(key, run_id, int(round_number), tuple(mover.members), mover.scope)
    exclude = exclude or {}
    unknown = {k for k in range(n) if trust.ranks[k] < 0}  # (elastic) its agreement rows are not counted
    moved = [0, 0]

    # 1. the slices to their owners, each in its signed slot
    slices = _slices(ex, payload) if payload is not None else [None] * n
    slots = [trust.seal(slices[k], ex.slice_nbytes(k), me, "slice", k) for k in range(n)]
    got = _all_to_all(slots, [trust.width(ex.slice_nbytes(me))] * n, mover, moved)

    # 2. open and screen, agree on who is out, combine my shard
    codes, reasons, pieces = bytearray(n), {}, [None] * n
    for j, slot in enumerate(got):
        opened = trust.open(slot, ex.slice_nbytes(me), j, "slice", me)
        if isinstance(opened, Rejected):
            codes[j], reasons[j] = SLOT_REFUSED, opened.reason
        elif opened is None:
            codes[j] = NO_UPDATE
        elif (why := ex.screen_slice(me, opened)) is not None:
            codes[j], reasons[j] = SLICE_REFUSED, why
        else:
            pieces[j] = opened
        if j in exclude and codes[j] != NO_UPDATE:
            codes[j], reasons[j] = EXCLUDED, exclude[j]
    rows = _agree(bytes(codes), n, mover, moved)
    suspect = _suspects([[row[j] in _REFUSALS for j in range(n)] for row in rows], n)
    out: dict[int, tuple[int, int]] = {}  # sender -> (code, the owner that gave it)
    for k, row in enumerate(rows):
        if k in suspect or k in unknown:
            continue
        for j in range(n):
            if row[j] != IN and j not in out:
                out[j] = (row[j], k)
    for j in range(n):  # a sender's own "no update" is known everywhere; a suspect's slice counts for its own use
        if j not in out and rows[j][j] == NO_UPDATE:
            out[j] = (NO_UPDATE, j)
    accepted = [j for j in range(n) if j not in out]
    rejected: dict[int, str] = {}
    for j, (code, k) in sorted(out.items()):
        if code == NO_UPDATE:
            continue
        if code == EXCLUDED:
            rejected[j] = exclude.get(j, _CODE_WHY[EXCLUDED])
            continue
        detail = reasons.get(j) if k == me else _CODE_WHY[code]
        rejected[j] = f"its slice of shard {k} was refused by region {names[k]}: {detail}"
        if k == me:
            warn(f"region {names[j]}: {rejected[j]}; its update is dropped this round")
    absent = [j for j, (code, _) in sorted(out.items()) if code == NO_UPDATE]
    if not accepted:
        return ShardedResult(None, [], rejected, absent, {}, 0, *moved, suspect=sorted(suspect))
    frame: bytes | None = None  # a suspect owner lacks slices it refused: it sends no shard (lost this round)
    if me not in suspect:
        try:
            # in the senders' identity order (static: global rank; elastic: region), the all-gather's order
            order = sorted(accepted, key=lambda j: trust.ranks[j])
            values, tokens = ex.combine_shard(me, [pieces[j] for j in order])
            frame = ex.encode_combined(me, values, tokens) if values.numel() else b""
        except (PayloadError, ValueError) as exc:  # (a non-finite combine)
            warn(f"region {names[me]}: its shard {me} cannot be combined this round: {exc}")

    # 3. my combined shard to everyone; 4. open and decode, agree on the shards intact everywhere, reassemble
    sent = trust.seal(frame, ex.combined_nbytes(me), me, "combined", me)
    frames = _all_to_all([sent] * n, [trust.width(ex.combined_nbytes(k)) for k in range(n)], mover, moved)
    shards: list[torch.Tensor | None] = []
    bad, why_bad, total = bytearray(n), {}, 0
    for k, slot in enumerate(frames):
        opened = trust.open(slot, ex.combined_nbytes(k), k, "combined", k)
        try:
            if isinstance(opened, Rejected):
                raise PayloadError(opened.reason)
            if opened is None:
                raise PayloadError("its owner sent no combined shard")
            values, t = ex.decode_combined(k, opened)
            shards.append(values)
            total = max(total, t)
        except PayloadError as exc:
            shards.append(None)
            bad[k], why_bad[k] = 1, str(exc)
    rows = _agree(bytes(bad), n, mover, moved)
    suspect |= _suspects([[bool(row[k]) for k in range(n)] for row in rows], n)
    lost: dict[int, str] = {}
    for k in range(n):
        refused_by = [r for r, row in enumerate(rows) if row[k] and r not in suspect and r not in unknown]
        if refused_by:
            lost[k] = (why_bad[k] if k in why_bad else f"region {names[refused_by[0]]} refused it")
            if k in why_bad:
                warn(f"region {names[k]}: its combined shard {k} was rejected: {why_bad[k]}; the shard "
                     f"is left out of this round's update")  # fmt: skip
    if me in suspect:  # this leader refused most of the others: it cannot follow their update
        return ShardedResult(None, accepted, rejected, absent, lost, total, *moved, suspect=sorted(suspect))
    for k in lost:
        shards[k] = torch.zeros(ex.numel(k), dtype=torch.float32)
    flat = torch.empty(ex.codec.manifest.numel, dtype=torch.float32, device=device)
    update = ex.assemble(shards, device=device, out=flat)
    return ShardedResult(update, accepted, rejected, absent, lost, total, *moved, suspect=sorted(suspect), flat=flat)


def quiet(message: str) -> None:
    """A :func:`sharded_round` ``warn`` that tells nothing (the round loop warns, naming the region)."""


def _slices(ex: ShardedExchange, payload: bytes) -> list[bytes]:
    """The slices of this region's payload; a payload damaged before it left (the ``corrupt`` fault: damage on
    the wire) goes out as its own bytes cut to the slices' sizes, which their owners refuse as malformed."""
    try:
        return ex.slices(payload)
    except PayloadError:
        raw = bytes(payload) or b"\0"
        out = []
        for k in range(ex.n):
            size = ex.slice_nbytes(k)
            out.append((raw * (size // len(raw) + 1))[:size])
        return out


def _suspects(refused: list[list[bool]], n: int) -> set[int]:
    """Leaders whose refusals (``refused[k][j]``: leader k refused j's piece) cover more than half of the
    others, with three or more leaders (two cannot tell which of them is wrong)."""
    if n < 3:
        return set()
    return {k for k in range(n) if 2 * sum(refused[k][j] for j in range(n) if j != k) > n - 1}


def _agree(mine: bytes, n: int, mover: Any, moved: list[int]) -> list[bytes]:
    """Every leader's ``len(mine)`` flag bytes (a direct exchange: each sends its row to every other)."""
    return _all_to_all([mine] * n, [len(mine)] * n, mover, moved)


def _all_to_all(send: list[bytes], recv_sizes: list[int], mover: Any, moved: list[int]) -> list[bytes]:
    """Direct all-to-all of raw bytes over ``mover``: ``send[j]`` goes to group rank j; the piece from rank j
    has ``recv_sizes[j]`` bytes (what the layout implies; a piece of another size is never read). Counts
    the bytes that leave and arrive (``moved``), one's own piece not included."""
    me = mover.rank
    moved[0] += sum(len(s) for j, s in enumerate(send) if j != me)
    moved[1] += sum(s for j, s in enumerate(recv_sizes) if j != me)
    return mover.all_to_all(send, recv_sizes)


def _dist_all_to_all(send: list[bytes], recv_sizes: list[int], group: Any, me: int) -> list[bytes]:
    """:meth:`StaticMover.all_to_all` over a ``torch.distributed`` group."""
    send_sizes = [len(s) for s in send]
    flat_in = pack_pieces(send)
    flat_out = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    try:
        dist.all_to_all_single(flat_out, flat_in, recv_sizes, send_sizes, group=group)
    except (RuntimeError, NotImplementedError, ValueError):  # a backend without all-to-all: pairs of send/recv
        _pairwise(flat_in, send_sizes, flat_out, recv_sizes, group, me)
    return split_pieces(flat_out, recv_sizes)


def _pairwise(flat_in: torch.Tensor, send_sizes: list[int], flat_out: torch.Tensor, recv_sizes: list[int],
              group: Any, me: int) -> None:  # fmt: skip
    ins, outs = _offsets(send_sizes), _offsets(recv_sizes)
    flat_out[outs[me] : outs[me] + recv_sizes[me]].copy_(flat_in[ins[me] : ins[me] + send_sizes[me]])
    work = []
    for j in range(len(send_sizes)):
        if j == me:
            continue
        peer = dist.get_global_rank(group, j) if group is not None else j
        if send_sizes[j]:
            work.append(dist.isend(flat_in[ins[j] : ins[j] + send_sizes[j]].clone(), peer, group=group))
        if recv_sizes[j]:
            work.append(dist.irecv(flat_out[outs[j] : outs[j] + recv_sizes[j]], peer, group=group))
    for w in work:
        w.wait()


def _offsets(sizes: list[int]) -> list[int]:
    out, pos = [], 0
    for s in sizes:
        out.append(pos)
        pos += s
    return out
