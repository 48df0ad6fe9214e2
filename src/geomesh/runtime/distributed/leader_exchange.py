"""A round's exchange as a region's leader takes it, on one rank of the distributed runtime: the straggler barrier,
what the leader tells the others with its payload (its info), the collective over the members' leaders, then the
result shared inside the region so that every rank screens, combines and steps alike.

:class:`LeaderExchange` is held by the round loop (:class:`.rounds.RoundLoop`) for its plain and overlapped
rounds. The collective itself is the run's exchange (:mod:`.exchange` for static regions, :mod:`.elastic` for
torchft's quorum); the bytes move inside the region with :class:`.share.RegionShare`; an overlapped exchange is
launched here and arrives inside the next round (:mod:`.overlap`); the plan and the WAN's wire times are the plan
loop's (:class:`.plan_loop.PlanLoop`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ...planner import Plan
from ..payloads import screen_payload
from .exchange import Exchanged, wait_for_slowest_s


class LeaderExchange:
    """The leader's exchange of a round of ``run``, region ``me``, over ``exchange`` (the run's), shared inside
    the region by ``sharing`` in slots of ``slot_nbytes()`` bytes (the round in progress's payload). ``planning``
    gives the plan in force and takes the wire times measured; ``faults`` says who is away; ``overlap`` is the
    overlapped round (None: plain rounds); ``summed``: dense contributions summed by an all-reduce, which the
    sender screens itself (``combiner``); ``elastic``: torchft's quorum (no barrier: its quorum opened the round)."""

    def __init__(self, run: Any, exchange: Any, planning: Any, sharing: Any, combiner: Any, faults: Any, me: int, *,
                 summed: bool, elastic: bool, overlap: Any, slot_nbytes: Callable[[], int]):  # fmt: skip
        self.run, self.exchange, self.planning, self.sharing = run, exchange, planning, sharing
        self.combiner, self.faults, self.me, self.summed, self.elastic = combiner, faults, me, summed, elastic
        self.overlap, self.slot_nbytes = overlap, slot_nbytes

    def info(self, payload: bytes | None, compute_s: float, members: list[int], reason: str | None,
             overhead_s: float | None) -> dict:  # fmt: skip
        """What this leader tells the others with its payload (JSON); ``overhead_s``: this region's round
        overhead (None: not measured yet)."""
        run = self.run
        info = {"region": self.me, "active": self.me in members, "compute_s": compute_s, "sent": payload is not None,
                "rejected": reason,
                "plan": self.planning.plan.digest() if self.planning.plan is not None else None}  # fmt: skip
        if overhead_s is not None:
            info["overhead_s"] = overhead_s
        info.update(self.exchange.info_fields())
        info.update(self.planning.wan.wire)
        if self.elastic and run.stopping.timed:  # this region's clock, for the time budget's rule
            info["elapsed_s"] = run._now()
        return info

    def _screened_sum(self, payload: bytes | None, **device: Any) -> tuple[Any, str | None]:
        """(dense contributions) A sum mixes contributions before anyone could check one: the sender checks its
        own. (its reducible form or None, why it was rejected or None)"""
        if not self.summed:
            return None, None
        reason = screen_payload(self.combiner, payload) if payload is not None else None
        return self.combiner.reducible(payload if reason is None else None, **device), reason

    def plain(self, payload: bytes | None, members: list[int], compute_s: float,
              overhead_s: float | None) -> tuple[Exchanged, float]:  # fmt: skip
        """The plain round's exchange on the leader, shared inside the region: (what arrived, comm seconds)."""
        run = self.run
        result = None
        comm_start = run._cursor
        if run.is_leader:
            self.exchange.straggler_barrier(run.rounds + 1)
            run._mark("straggler_wait")
            comm_start = run._cursor
            summed, reason = self._screened_sum(payload, device=run.device)
            info = self.info(payload, compute_s, members, reason, overhead_s)
            result = self.exchange.exchange(payload, summed, info, members)
            if self.elastic:  # no barrier before the exchange (the quorum opened the round): the wait for the
                # slowest member is inside it: the part its compute outlasted this region's, as a barrier books it
                waited = wait_for_slowest_s(result.infos, compute_s + (overhead_s or 0.0))
                run._mark("straggler_wait", until=min(run._now(), comm_start + waited))
                comm_start = run._cursor
            self.planning.note_wire(max(0.0, result.comm_s - (waited if self.elastic else 0.0)))
        result = self.share(result)
        run._mark("comm_wait")
        return result, run._cursor - comm_start

    def overlapped(self, payload, split, members, compute_s: float, overhead_s: float | None,
                   quorum: bool = True) -> tuple[Exchanged, float]:  # fmt: skip
        """The overlapped round: the leader passes the barrier and launches the exchange (or its last
        fragment); it arrives inside the next round. Returns the round's info exchange, done with it.
        Elastic, the info carries this region's measured compute of the round and its wire time of the last
        exchange that arrived; ``quorum`` False: this region was healed at this exchange's quorum."""
        run, ov = self.run, self.overlap
        comm_start = run._cursor
        if run.is_leader:
            self.note_overlap_wire()
            self.exchange.straggler_barrier(run.rounds + 1)
            run._mark("straggler_wait")
            comm_start = run._cursor
            since = time.perf_counter()
            if self.elastic:  # this exchange's quorum now (the barrier), then the exchange on a thread
                now = self.exchange.launch_quorum(self._propose_next) if quorum else list(members)
                # the quorum waits for the slowest member, as the static barrier does: straggler_wait (it was
                # booked as comm_wait, so overlapped elastic rounds showed their stragglers as WAN idle)
                run._mark("straggler_wait")
                comm_start = run._cursor
                if not quorum:  # healed at this exchange's quorum: its next round starts with these members,
                    self.exchange.launch_members = list(now)  # as the others' does (no quorum of its own)
                summed, reason = self._screened_sum(payload)
                trained = now if quorum else [i for i in now if i != self.me]  # (one healed now trained nothing)
                info = self.info(payload, compute_s if quorum else 0.0, trained, reason, overhead_s)
                number = run.rounds + 1  # (the thread's: the loop counts the round on meanwhile)
                ov.launch_on_thread(lambda: self.exchange.exchange(payload, summed, info, now, number), now)
            elif split is not None:  # the last fragment, launched as the others were; drained by the loop
                ov.tail.launch(split.fragments - 1, payload[-1])
            else:
                ov.launch(payload, since)
        run._mark("comm_wait")
        comm_s = run._cursor - comm_start + ov.take_waited()
        return Exchanged(infos=[], payloads=None, summed=None, comm_s=comm_s, wan_bytes=0), comm_s

    def share(self, result: Exchanged | None) -> Exchanged:
        """The leader's exchange result on every rank of the region, in slots of the round in progress."""
        return self.sharing.share(result, self.slot_nbytes())

    def note_overlap_wire(self) -> None:
        """(leader) The wire time of the overlapped exchange that arrived (its launch to its arrival), for the
        next report or info this leader sends."""
        wire = self.overlap.take_wire() if self.run.is_leader else None
        if wire is not None:
            self.planning.note_wire(*wire)

    def _propose_next(self, quorum: list[int]) -> tuple[list[int], Plan, str]:
        """(leader, overlapped elastic rounds) What this region proposes for the round that starts with the
        members of the exchange's quorum now forming: (members, plan, why); shipped only by the maker."""
        members = [i for i in quorum if not self.faults.away(i)]
        self.planning.propose(members)
        return members, self.planning.plan, self.planning.plan_reason
