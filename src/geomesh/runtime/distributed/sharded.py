"""The sharded exchange over ``torch.distributed``: the transport half of :mod:`geomesh.codec.sharded`.

Run by every region's leader in the leaders' group (Gloo or NCCL), group rank k owning shard k:

1. the leader cuts its payload into N slices and an ``all_to_all_single`` sends slice k to shard k's owner
   (an absent update sends slots of zeros);
2. each owner screens the N slices of its shard; the leaders agree on who is out (a direct exchange of N
   flags: sender j is out of the round on every region if any owner refused its slice or it had no update),
   and each owner combines its shard from the senders that are in, token-weighted;
3. each owner quantises its combined shard to the exchange's bits and a second ``all_to_all_single`` sends
   the frame to every leader;
4. every leader decodes the N frames; the leaders agree on the shards that arrived intact everywhere (a bad
   frame on any leader leaves its shard out of this round's update on every leader, so all apply the same
   update), and reassemble the update.

Where ``all_to_all_single`` is not supported by the backend, the same bytes move in pairs of ``isend`` /
``irecv``. Every slot has the size the layout implies, so a receiver never allocates what a peer asks for;
nothing received is unpickled: slices are sign payloads, combined shards are the frames of
:mod:`geomesh.codec.sharded`, flags are raw bytes. Direct exchanges (one latency step each) keep the round
at four latency steps whatever N; the WAN model (``WanModel.sharded_s``) times the two large ones.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...codec.sharded import ShardedExchange
from ...errors import PayloadError

ABSENT = b"\0\0\0\0"  # a slot of zeros: the sender has no update this round


@dataclass
class ShardedResult:
    """One round of the sharded exchange as a leader ends it."""

    update: dict[str, torch.Tensor] | None  # None: no sender's update counted
    accepted: list[int]  # group ranks whose updates are in it
    rejected: dict[int, str] = field(default_factory=dict)  # group rank -> why its update is out (this leader's view)
    lost_shards: list[int] = field(default_factory=list)  # shards left out (a combined frame that did not arrive intact)
    tokens: int = 0  # Σ n_i of the accepted senders
    sent_bytes: int = 0
    received_bytes: int = 0


def sharded_round(payload: bytes | None, ex: ShardedExchange, group: Any = None, *,
                  device: torch.device | str = "cpu", names: list[str] | None = None) -> ShardedResult:  # fmt: skip
    """This leader's side of one round of the sharded exchange (see the module docstring).

    ``payload``: this region's sign payload, or None (no update this round); ``ex``: the exchange for the
    ``group``'s size (``ex.n`` must equal it; shard k belongs to group rank k); ``device``: where the update
    lands; ``names``: the members' names for warnings (default: their group ranks)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if ex.n != n:
        raise ValueError(f"the sharded exchange has {ex.n} shards, the group {n} members")
    names = names or [str(r) for r in range(n)]
    moved = [0, 0]

    # 1. the slices to their owners
    slices = ex.slices(payload) if payload is not None else [bytes(ex.slice_nbytes(k)) for k in range(n)]
    got = _all_to_all(slices, [ex.slice_nbytes(me)] * n, group, moved)

    # 2. screen, agree on who is out, combine my shard
    out = [payload is None if j == me else False for j in range(n)]
    reasons: dict[int, str] = {}
    for j, piece in enumerate(got):
        if j == me and payload is None:
            continue
        if ex.slice_nbytes(me) and piece[:4] == ABSENT:
            out[j], reasons[j] = True, "no update this round"
            continue
        why = ex.screen_slice(me, piece)
        if why is not None:
            out[j], reasons[j] = True, f"shard {me} slice rejected: {why}"
    flags = _agree(bytes(out), n, group, moved)
    dropped = {j for row in flags for j in range(n) if row[j]}
    accepted = [j for j in range(n) if j not in dropped]
    for j in sorted(dropped):
        if j in reasons and j != me and reasons[j] != "no update this round":
            warnings.warn(f"region {names[j]}: {reasons[j]}; its update is dropped this round")
        reasons.setdefault(j, "no update, or its slice was refused by another shard's owner")
    if not accepted:
        return ShardedResult(None, [], reasons, [], 0, *moved)
    values, tokens = ex.combine_shard(me, [got[j] for j in accepted])
    frame = ex.encode_combined(me, values, tokens) if values.numel() else b""

    # 3. my combined shard to everyone; 4. decode, agree on the shards intact everywhere, reassemble
    frames = _all_to_all([frame] * n, [ex.combined_nbytes(k) for k in range(n)], group, moved)
    shards, bad, total = [], [], 0
    for k, f in enumerate(frames):
        try:
            values, t = ex.decode_combined(k, f)
            shards.append(values)
            total = max(total, t)
        except PayloadError as exc:
            warnings.warn(f"region {names[k]}: its combined shard {k} was rejected: {exc}; the shard is left out "
                          f"of this round's update")  # fmt: skip
            shards.append(None)
            bad.append(k)
    lost = sorted({k for row in _agree(bytes(k in bad for k in range(n)), n, group, moved) for k in range(n) if row[k]})
    for k in lost:
        shards[k] = torch.zeros(ex.numel(k), dtype=torch.float32)
    update = ex.assemble(shards, device=device)
    return ShardedResult(update, accepted, {j: reasons[j] for j in dropped}, lost, total, *moved)


def _agree(mine: bytes, n: int, group: Any, moved: list[int]) -> list[bytes]:
    """Every leader's ``len(mine)`` flag bytes (a direct exchange: each sends its row to every other)."""
    return _all_to_all([mine] * n, [len(mine)] * n, group, moved)


def _all_to_all(send: list[bytes], recv_sizes: list[int], group: Any, moved: list[int]) -> list[bytes]:
    """Direct all-to-all of raw bytes: ``send[j]`` goes to group rank j; the piece from rank j has
    ``recv_sizes[j]`` bytes (what the layout implies; a piece of another size is never read)."""
    n, me = len(send), dist.get_rank(group)
    send_sizes = [len(s) for s in send]
    flat_in = torch.frombuffer(bytearray(b"".join(send)), dtype=torch.uint8) if sum(send_sizes) else (
        torch.empty(0, dtype=torch.uint8))  # fmt: skip
    flat_out = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    moved[0] += sum(s for j, s in enumerate(send_sizes) if j != me)
    moved[1] += sum(s for j, s in enumerate(recv_sizes) if j != me)
    try:
        dist.all_to_all_single(flat_out, flat_in, recv_sizes, send_sizes, group=group)
    except (RuntimeError, NotImplementedError, ValueError):  # a backend without all-to-all: pairs of send/recv
        _pairwise(flat_in, send_sizes, flat_out, recv_sizes, group, me)
    raw = flat_out.numpy().tobytes()
    pieces, pos = [], 0
    for size in recv_sizes:
        pieces.append(raw[pos : pos + size])
        pos += size
    return pieces


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
