"""Which regions take part in a round, and how their leaders talk: a region leader's view of the quorums that
torchft's Lighthouse forms, through torchft's Manager and the group over each quorum (:class:`Membership`).

Elastic regions (``reliability.min_regions >= 1``) use torchft (PyTorch's fault-tolerance library) for
membership rather than consensus written here:

- one **Lighthouse** per job (``geomesh launch`` hosts it; on a cluster ``torchft_lighthouse`` or
  ``python -m geomesh.runtime.distributed.membership``) forms a *quorum* every round from the regions that ask for one:
  all live regions, or, once ``round_deadline_s`` has passed, those that arrived, if at least
  ``min_regions`` did. A region whose process died stops heartbeating and is left out at once;
- one **Manager** per region, on the region's leader (one replica group = one region, group world size 1:
  only leaders cross the WAN), asks for the quorum at the start of each round, reconfigures a torchft Gloo
  process group over the quorum's leaders (a new rendezvous per quorum, so a dead peer never poisons the
  next round), and counts committed rounds (``current_step`` = rounds done);
- **live recovery**: a region whose step is behind the quorum's (a restarted process, or one that missed
  rounds) receives the state of a live region over :class:`~geomesh.runtime.distributed.heal.HealTransport`
  (authenticated; in place of torchft's HTTP one) before its first round (:meth:`Membership.quorum` returns
  ``healed=True``); a recovery that is refused or fails is retried at the next quorum, nothing of it applied.

Trust (docs/distributed.md, "Security"): nothing a peer sends is unpickled. Every message between leaders is a
frame (:mod:`.frames`) tagged, with the run's key, over the run id, the round (torchft's step), the quorum
and the collective's place in it, and the sender's region; the recovery state travels over
:class:`~geomesh.runtime.distributed.heal.HealTransport`, only to a joiner that proves the key. torchft's
manager server, this leader's recovery server and a Lighthouse started here bind to the advertised address
(``GEOMESH_ADVERTISE_HOST``), not to every interface.

The contract of :meth:`Membership.all_gather_framed` (and :meth:`Membership.all_gather_bytes`): it returns
the messages of the quorum members whose frames passed every check, in quorum order, so a list may be
shorter than the quorum. A member whose frame is malformed, oversize (its claimed size above
:attr:`Membership.frame_limit`), unsigned, forged, replayed from another round or collective, from another
run, or whose message's ``"region"`` differs from the region its frame is signed for, is left out: it is
named in :attr:`Membership.rejected` (for the last collective: ``[{"slot", "region", "reason"}]``, ``region``
the claimed one or ``None``), counted in :attr:`Membership.rejected_frames`, and warned about on stderr. A
genuine frame of this very collective from a live member of *another* job (another run id: a region started
with another scenario, seed or budget) is handed on, so that the loop's job check (the header's ``hash``)
names the odd region and stops it; recovery between two jobs is refused (:mod:`.heal`). Two
members signed for one region (a region started again while its original is alive): the instance that took
part in a quorum first is kept; the other is rejected, and on the newcomer itself the call raises
:class:`DuplicateRegion` (one line; it should exit).

Why not torchft's ``Manager.allreduce``: GeoMesh exchanges 1-bit payloads of one size, which an all-reduce
cannot combine (the combine weights signs by tokens and decodes magnitudes). So the Manager gives
membership, recovery and the reconfigured process group, and the exchange is an all-gather over that group
(:meth:`Membership.all_gather_bytes`); dense (fp32) methods all-reduce a weighted buffer over it.

The quorum service itself (the Lighthouse and the run board, the addresses regions reach each other at, the
join timeout) is :mod:`.service`.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable

import torch

from .service import ADVERTISE_ENV, MembershipError, bind_address, check_reachable, hostport, quorum_attempt_s
from .torchft_logs import quiet_torchft_logs
from .frames import (HEAD_NBYTES, Context, Rejected, frame_nbytes, open_frame, pack_pieces, run_trust, seal,
                     split_pieces)


class ExchangeFailed(RuntimeError):
    """A collective over the quorum failed: a member died, hung past the deadline or left."""


class RunFinished(MembershipError):
    """The run this region belongs to finished without it (the run board says so: :mod:`.board`)."""

    def __init__(self, note: dict[str, Any]):
        super().__init__(f"the run finished at round {note.get('round')} without this region (regions at the end: "
                         f"{', '.join(map(str, note.get('regions') or [])) or 'unknown'})")  # fmt: skip
        self.note = note


class DuplicateRegion(MembershipError):
    """Another live instance of this region took part in the run first: this one must stop."""


DEFAULT_FRAME_LIMIT = 256 << 20  # the largest frame a leader accepts (a round's envelope carries a payload)
WARN_LIMIT = 50  # rejected frames warned about on stderr; the rest only counted


class Membership:
    """A region leader's view of the job: the torchft Manager (quorum, recovery, step count) and the
    reconfigurable Gloo group over the quorum's leaders."""

    def __init__(self, *, region: int, name: str, lighthouse: str, min_regions: int, deadline_s: float,
                 quorum_timeout_s: float, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
                 store_addr: str, store_port: int, key: bytes | None = None, run_id: str | None = None,
                 frame_limit: int = DEFAULT_FRAME_LIMIT, names: list[str] | None = None,
                 join_timeout_s: float = 0.0, setup_s: float | None = None):  # fmt: skip
        """``key``/``run_id``: what frames and healing are signed with (default: this process's
        :func:`~geomesh.runtime.distributed.frames.run_trust`); ``frame_limit``: the largest frame accepted
        from a member (a round's envelope with its payload must fit); ``names``: the scenario's region names,
        so that a rejected member is named by the region it is (or claims to be); ``join_timeout_s``: the quorum
        service's join timeout (:func:`.service.join_timeout_s` of the scenario), which one quorum request outlasts;
        ``setup_s``: how long a quorum's group set-up waits for its members (:func:`.deadline.setup_s`)."""
        quiet_torchft_logs()
        from torchft.manager import Manager

        from .heal import HealError, HealTransport
        from .quorum_group import QuorumGroup

        check_reachable(lighthouse, min(quorum_timeout_s, 30.0))
        trust = run_trust()
        self.key = key if key is not None else trust.key
        self.run_id = run_id if run_id is not None else trust.run_id
        self.frame_limit = int(frame_limit)
        self.rejected: list[dict[str, Any]] = []  # the last collective's rejected members
        self.rejected_frames = 0  # ... and all of them so far
        self.instance = uuid.uuid4().hex  # this process, to tell two instances of one region apart
        self.first_step: int | None = None  # the round this instance first took part in
        self._quorum_id, self._seq = -1, 0
        advertised = os.environ.get(ADVERTISE_ENV) or socket.gethostname()
        bind_ip = bind_address(advertised)

        def expected() -> dict[str, Any]:  # what a received state must look like: this region's own
            return {"user": {"default": state_dict()}, "torchft": {"step": 0, "batches_committed": 0}}

        try:
            self.heal = HealTransport(host=bind_ip, key=self.key, run_id=self.run_id, region=region, name=name,
                                      expected=expected)  # fmt: skip
        except HealError as exc:
            raise MembershipError(str(exc)) from None
        self.region, self.name = region, name
        self.names = list(names) if names is not None else None
        self.deadline = timedelta(seconds=deadline_s)
        self.quorum_timeout = timedelta(seconds=quorum_timeout_s)
        self.attempt_s = quorum_attempt_s(join_timeout_s)
        self.lighthouse = lighthouse
        self.min_regions = min_regions
        self.pg = QuorumGroup(self.deadline, None if setup_s is None else timedelta(seconds=setup_s))
        # replica ids sort in scenario order (the quorum ranks follow them); torchft appends a fresh uuid, so a
        # restarted region is a new replica of the same name
        with _manager_server_bound_to(bind_ip):
            self.manager = Manager(
                pg=self.pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=min_regions,
                use_async_quorum=False, timeout=self.deadline, quorum_timeout=self.quorum_timeout,
                connect_timeout=timedelta(seconds=min(quorum_timeout_s, 60.0)), rank=0, world_size=1,
                store_addr=store_addr, store_port=store_port, lighthouse_addr=lighthouse,
                replica_id=f"region{region:03d}_{name}", hostname=advertised,
                heartbeat_interval=timedelta(milliseconds=100), init_sync=False, checkpoint_transport=self.heal,
            )  # fmt: skip
        self.control_bytes = 0
        # the run board's word that the run finished (None: no board); read while no quorum comes
        self.finished: Callable[[], dict[str, Any] | None] | None = None

    @property
    def step(self) -> int:
        return self.manager.current_step()

    def set_step(self, step: int) -> None:
        """After a resume from a checkpoint: the rounds already done."""
        self.manager.load_state_dict({"step": int(step), "batches_committed": int(step)})

    def quorum(self) -> tuple[bool, int]:
        """Join this round's quorum (blocks until the Lighthouse forms it). Returns (healed, participants):
        ``healed`` when this region was behind and has just received a live region's state."""
        before = self.step
        give_up = time.monotonic() + self.quorum_timeout.total_seconds()
        while True:
            self.heal.last_error = None
            try:
                self._request_quorum(give_up)
            except RunFinished:
                raise
            except Exception as exc:  # noqa: BLE001 - torchft raises RuntimeError/TimeoutError from its RPCs
                why = "timed out" if _timed_out(exc) else _short(exc)
                raise MembershipError(f"no quorum of at least {self.min_regions} region(s) within "
                                      f"{self.quorum_timeout.total_seconds():g}s (quorum service {self.lighthouse}): "
                                      f"{why}; fewer regions are alive than reliability.min_regions") from None  # fmt: skip
            err = self.manager.errored()
            if err is None:
                break
            if self.heal.last_error is None:
                raise ExchangeFailed(f"reconfiguring for the quorum failed: {_short(err.original_exception)}")
            # this region is behind and the state it was offered was refused or never came: nothing of it is
            # applied; closing our group's connections frees the members waiting for us, and we ask again
            print(f"warning: region {self.name}: recovery failed: {self.heal.last_error}; asking again",
                  file=sys.stderr, flush=True)  # fmt: skip
            self.pg.abort()
            if time.monotonic() > give_up:
                raise MembershipError(f"region {self.name} is behind and could not receive the live state within "
                                      f"{self.quorum_timeout.total_seconds():g}s: {self.heal.last_error}")  # fmt: skip
            time.sleep(1.0)
        self._quorum_id, self._seq = int(getattr(self.manager, "_quorum_id", 0)), 0
        if self.first_step is None:
            self.first_step = self.step
        return self.step != before, self.manager.num_participants()

    def _request_quorum(self, give_up: float) -> None:
        """Ask the quorum service for this round's quorum until ``give_up`` (monotonic), one bounded request at a
        time. The Lighthouse drops a participant whose heartbeats lapse (a host cut off from it for more than
        its heartbeat timeout) but keeps that participant's pending request waiting for a quorum it can no
        longer be in: one long request would wait out the whole timeout after the link came back. A new request
        registers the region again, so a region cut off for a while rejoins within one attempt of its return."""
        while True:
            note = self.finished() if self.finished is not None else None
            if note is not None:
                raise RunFinished(note)
            left = give_up - time.monotonic()
            try:
                self.manager.start_quorum(timeout=timedelta(seconds=max(min(self.attempt_s, left), 0.1)))
                return
            except Exception as exc:  # noqa: BLE001 - torchft raises RuntimeError/TimeoutError from its RPCs
                if not _timed_out(exc) or give_up - time.monotonic() <= 0:
                    raise
                # torchft's start_quorum first waits on the last request's future, which re-raises its timeout:
                # the request is over (its RPC gave up), so the next one starts afresh
                self.manager._quorum_future = None

    def report(self, exc: Exception) -> None:
        """A collective failed: the round is void for torchft, and this leader's group is torn down at once.
        Its peers may still be blocked in the same collective on a link that never touched the lost region
        (a ring's other half); closing our connections fails them now instead of at the round deadline, so
        every survivor asks for the next quorum together.

        The round's commit vote is cast now (no: torchft counts a commit failure), so that the next quorum is a
        new one even when its members are the same (a connection that broke while every member lived): the
        Lighthouse gives a new quorum id only for other members or a member's commit failures, and only a new
        quorum id re-forms the group torn down here."""
        self.manager.report_error(exc)
        self.pg.abort()
        try:
            self.manager.should_commit(timeout=self.deadline)
        except Exception:  # noqa: BLE001 - its own manager server; other members still re-form the quorum
            pass

    def commit(self) -> bool:
        """End the round for torchft (the step count advances); False when the round must not count."""
        return bool(self.manager.should_commit(timeout=self.deadline))

    # ---- collectives over the quorum's leaders ------------------------------------------------------
    def _wait(self, work) -> None:
        try:
            work.wait()
            return
        except Exception as exc:  # noqa: BLE001 - Gloo: connection closed, timed out
            why = _short(exc)
        # the failed work holds the Gloo context: dropped here, not kept alive by the traceback we raise
        del work
        raise ExchangeFailed(why)

    def _configured(self) -> None:
        """The quorum's group is there (a torn-down one is re-formed only at the next quorum)."""
        if getattr(self.pg, "_pg", True) is None:
            raise ExchangeFailed("this leader's group over the quorum was torn down (it is re-formed at the next "
                                 "quorum)")  # fmt: skip

    @staticmethod
    def _options(kind: str, timeout_s: float | None):
        """Collective options; ``timeout_s``: this collective's own deadline (Gloo honours it per operation),
        else the group's (``round_deadline_s``)."""
        from torch.distributed import distributed_c10d as c10d

        opts = getattr(c10d, kind)()
        if timeout_s is not None:
            opts.timeout = timedelta(seconds=float(timeout_s))
        return opts

    def _gather_raw(self, data: bytes, timeout_s: float | None = None) -> list[bytes | Rejected]:
        """Every member's bytes in quorum order; a member that claims more than :attr:`frame_limit` (or a
        negative size) gets a :class:`Rejected` and costs the others no memory."""
        self._configured()
        n = self.pg.size()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        self._wait(self.pg.allgather([sizes], [size], self._options("AllgatherOptions", timeout_s)))
        claims = [int(s) for s in sizes]
        ok = [0 <= c <= self.frame_limit for c in claims]
        width = max([1] + [c for c, good in zip(claims, ok) if good])  # every member computes the same width
        mine = torch.zeros(width, dtype=torch.uint8)
        if data and len(data) <= width:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(width, dtype=torch.uint8) for _ in range(n)]
        self._wait(self.pg.allgather([outs], [mine], self._options("AllgatherOptions", timeout_s)))
        return [bytearray(o[:c].numpy().tobytes()) if good
                else Rejected(f"oversize frame: it claims {c} bytes, the limit is {self.frame_limit}")
                for o, c, good in zip(outs, claims, ok)]  # fmt: skip

    def _context(self) -> Context:
        """This collective's place in the run: the round (torchft's step), the quorum and the collective's
        number in it (every member of a quorum calls the same collectives in the same order)."""
        self._seq += 1
        return Context(run_id=self.run_id, kind="quorum", round=self.step,
                       scope=max(self._quorum_id, 0) * 65536 + self._seq)  # fmt: skip

    def region_name(self, region: int | None) -> str:
        """A region index as the scenario names it (an index outside the scenario as ``#index``)."""
        if region is None:
            return "an unknown sender"
        if self.names is not None and 0 <= region < len(self.names):
            return self.names[region]
        return f"#{region}"

    def _reject(self, slot: int, claimed: int | None, reason: str, authenticated: bool = True) -> None:
        """A member left out of this collective: recorded (``region`` the index its frame is signed for, or the
        one it claims when its frame does not authenticate: ``claimed`` then), counted and warned about."""
        self.rejected.append({"slot": slot, "region": claimed, "claimed": not authenticated, "reason": reason,
                              "name": self.region_name(claimed) if claimed is not None else None})  # fmt: skip
        self.rejected_frames += 1
        if self.rejected_frames <= WARN_LIMIT:
            if claimed is None:
                who = f"quorum member {slot} (its frame names no region)"
            else:
                who = (f"region {self.region_name(claimed)} (" + ("claimed, unauthenticated; " if not authenticated
                                                                  else "") + f"quorum member {slot})")  # fmt: skip
            print(f"warning: region {self.name}: rejected a frame from {who}: {reason}; it is left out of this "
                  f"exchange", file=sys.stderr, flush=True)  # fmt: skip

    def all_gather_framed(self, obj: Any, timeout_s: float | None = None) -> list[Any]:
        """Every accepted quorum member's ``obj`` (JSON values, bytes, tensors), in quorum order; rejected
        members are left out and named in :attr:`rejected` (the module docstring has the whole contract).
        ``timeout_s``: how long this collective waits for the slowest member (default: the round deadline)."""
        return [got for _, _, got in self.all_gather_framed_slots(obj, timeout_s)]

    def all_gather_framed_slots(self, obj: Any, timeout_s: float | None = None) -> list[tuple[int, int, Any]]:
        """:meth:`all_gather_framed` with each accepted message's place: ``(slot, region, obj)``, ``slot`` the
        sender's rank in the quorum's group (:meth:`group_rank` on the sender), ``region`` the region its frame
        is signed for. A rejected member's slot is absent."""
        ctx = self._context()
        meta = {"instance": self.instance, "first_step": self.first_step if self.first_step is not None else -1}
        frame = seal(obj, ctx=ctx, sender=self.region, key=self.key, meta=meta).to_bytes()
        self.control_bytes += len(frame)
        self.rejected = []
        opened: list[tuple[int, Any]] = []
        for slot, raw in enumerate(self._gather_raw(frame, timeout_s)):
            got = raw if isinstance(raw, Rejected) else open_frame(raw, ctx=ctx, key=self.key,
                                                                    max_bytes=self.frame_limit)  # fmt: skip
            if isinstance(got, Rejected) and got.run is not None:
                # a live member of another job (its frame is genuine and of this very collective): its message
                # is handed on, so the loop's job check names the odd region and stops it
                got = open_frame(raw, ctx=replace(ctx, run_id=got.run), key=self.key, max_bytes=self.frame_limit)
            if isinstance(got, Rejected):
                if got.sender is not None:
                    self._reject(slot, got.sender, got.reason)
                else:  # its tag did not hold (or it has none): only what its header claims names it
                    self._reject(slot, claimed_sender(raw), got.reason, authenticated=False)
                continue
            claims = got.obj.get("region") if isinstance(got.obj, dict) else got.sender
            if got.sender < 0 or claims != got.sender:
                self._reject(slot, got.sender, f"a message for region {claims!r} in a frame signed for region "
                                               f"{got.sender}")  # fmt: skip
                continue
            opened.append((slot, got))
        keep = self._one_per_region(opened)
        return [(slot, got.sender, got.obj) for slot, got in opened if slot in keep]

    def _one_per_region(self, opened: list[tuple[int, Any]]) -> set[int]:
        """The slots kept: one per region, the instance that took part in a quorum first."""
        by_region: dict[int, list[tuple[int, Any]]] = {}
        for slot, got in opened:
            by_region.setdefault(got.sender, []).append((slot, got))
        keep = set()
        for region, entries in by_region.items():
            def seniority(entry: tuple[int, Any]) -> tuple[int, str]:
                first = entry[1].meta.get("first_step", -1)
                first = first if isinstance(first, int) and first >= 0 else 1 << 62
                return first, str(entry[1].meta.get("instance", ""))

            entries.sort(key=seniority)
            keep.add(entries[0][0])
            for slot, got in entries[1:]:
                if region == self.region and got.meta.get("instance") == self.instance:
                    first = entries[0][1].meta.get("first_step")
                    raise DuplicateRegion(f"region {self.name} is already running (an instance that joined at "
                                          f"round {first} is live); this one stops. Stop that one first to "
                                          f"replace it")  # fmt: skip
                self._reject(slot, region, f"a second live instance of region {region}")
        return keep

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every accepted member's ``data`` in quorum order (sizes may differ), framed as
        :meth:`all_gather_framed` frames its messages (rejected members left out)."""
        return [m["data"] for m in self.all_gather_framed({"region": self.region, "data": bytes(data)})]

    def all_reduce_sum(self, flat: torch.Tensor, timeout_s: float | None = None) -> torch.Tensor:
        from torch.distributed.distributed_c10d import ReduceOp

        self._configured()
        opts = self._options("AllreduceOptions", timeout_s)
        opts.reduceOp = ReduceOp.SUM
        self._wait(self.pg.allreduce([flat], opts))
        return flat

    def group_rank(self) -> int:
        """This leader's rank in the quorum's group (the quorum order of every collective here)."""
        self._configured()
        return int(self.pg.parent.rank())

    def quorum_scope(self) -> str:
        """The quorum and the last collective's place in it, as every member of the quorum has them: what
        a sharded exchange's slots bind, so that a slot of another quorum (an earlier attempt of the round,
        before a member was lost) or of another collective is refused."""
        return f"{max(self._quorum_id, 0)}.{self._seq}.{self.pg.size()}"

    def all_to_all_bytes(self, send: list[bytes], recv_sizes: list[int],
                         timeout_s: float | None = None) -> list[bytes]:  # fmt: skip
        """A direct all-to-all of raw bytes over the quorum's group (torchft's ``alltoall_base``): ``send[j]``
        goes to group rank j, the piece from rank j has ``recv_sizes[j]`` bytes (what the receiver's layout
        implies: a member never makes another allocate what it claims). Raw bytes, never unpickled; the
        caller authenticates them. A member that dies or misses ``timeout_s`` (default: the round deadline)
        fails it with :class:`ExchangeFailed`, as :meth:`all_gather_framed` fails."""
        self._configured()
        n = self.pg.size()
        if len(send) != n or len(recv_sizes) != n:
            raise ValueError(f"an all-to-all of {len(send)} pieces (receiving {len(recv_sizes)}) over {n} members")
        flat_out = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        try:
            work = self.pg.alltoall_base(flat_out, pack_pieces(send), list(recv_sizes), [len(s) for s in send],
                                         self._options("AllToAllOptions", timeout_s))  # fmt: skip
        except (RuntimeError, AssertionError) as exc:  # Gloo: a connection already closed
            raise ExchangeFailed(_short(exc)) from None
        self._wait(work)
        return split_pieces(flat_out, recv_sizes)

    def shutdown(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
        self.heal.shutdown()


@contextmanager
def _manager_server_bound_to(ip: str):
    """torchft's Manager starts its server on every interface (``[::]:PORT``, fixed in its constructor); while
    it is built here, the server it starts listens on ``ip`` instead."""
    import torchft.manager as tfm

    real = tfm.ManagerServer

    def bound(*args: Any, bind: str, **kwargs: Any):
        return real(*args, bind=hostport(ip, bind.rsplit(":", 1)[-1]), **kwargs)

    tfm.ManagerServer = bound
    try:
        yield
    finally:
        tfm.ManagerServer = real


def claimed_sender(raw: Any) -> int | None:
    """The sender a frame's JSON header claims, read without trusting the frame (its tag failed, or it has
    none): only to name who it says it is. JSON only, bounded by the frame the receiver already accepted in
    size; ``None`` when it is not a frame or names no sender."""
    if isinstance(raw, Rejected) or frame_nbytes(bytes(raw[:HEAD_NBYTES])) is None:
        return None
    jlen = struct.unpack_from("<I", raw, 8)[0]
    try:
        doc = json.loads(bytes(raw[HEAD_NBYTES : HEAD_NBYTES + jlen]))
    except (ValueError, RecursionError):
        return None
    sender = doc.get("sender") if isinstance(doc, dict) else None
    return sender if isinstance(sender, int) and not isinstance(sender, bool) else None


def _timed_out(exc: BaseException) -> bool:
    return "Timeout" in str(exc) or "timed out" in str(exc) or isinstance(exc, TimeoutError)


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


if __name__ == "__main__":  # the quorum service alone, for a cluster (the command the deployment guide names)
    from .service import main

    sys.exit(main())
