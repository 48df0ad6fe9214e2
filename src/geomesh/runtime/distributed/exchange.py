"""The exchange seam of the distributed round loop: who takes part in a round, and how the leaders' bytes
cross the WAN (:mod:`geomesh.runtime.distributed.rounds` is written once over it).

An exchange answers three questions for the loop, always on a region's leader (the loop shares the answers
inside the region):

- :meth:`open_round`: which regions train this round (:class:`RoundView`), and whether this region was
  behind and has just received the live state (elastic regions only);
- :meth:`straggler_barrier`: wait for the slowest member (the span ``straggler_wait``);
- :meth:`exchange`: every member's payload (or the sum of the dense contributions) and every member's round
  info, in scenario order (:class:`Exchanged`), after the WAN shaper's hold.

Two implementations: :class:`StaticExchange`, the leaders' ``torch.distributed`` group of a static run
(every region in every round; a lost region stops the run with one error), and
:class:`~geomesh.runtime.distributed.elastic.QuorumExchange`, torchft's quorum per round (regions leave, hang,
come back and are healed).

Payloads travel as the raw bytes their codec wrote (one size per round, the round codec's: the same every round,
or Streaming DiLoCo's fragment of the round; an absent update is a slot of zeros); round infos are JSON. Nothing
a peer sends is unpickled, and nothing is trusted before the loop screens it: a bad payload costs its sender's
update this round, never the run.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ...methods.budget import elapsed_of_round
from .core import params_checksum
from .frames import Rejected
from .wan_shaper import WanShaper


@dataclass
class RoundView:
    """A round's members (region indices, scenario order) as this region's leader learned them."""

    members: list[int]
    healed: bool = False  # this region was behind and has just received a live region's state
    state: dict[str, Any] | None = None  # that state (the loop applies it on every rank of the region)
    rejoined: list[int] = field(default_factory=list)  # regions healed at this quorum
    calibration: dict[int, Any] = field(default_factory=dict)  # region -> its step times measured in place
    # elastic regions resumed together: the newest round whose checkpoint every resumed member holds (each
    # region loads it, then asks for the quorum again, where a region with none heals from them)
    resume_round: int | None = None
    quorum: bool = True  # False: an overlapped round that starts with the members of the last exchange's quorum


@dataclass
class Exchanged:
    """What the leaders exchanged in one round, in scenario order of the regions that took part."""

    infos: list[dict[str, Any]]  # every member's round info (its ``region`` index included)
    payloads: dict[int, bytes | None] | None  # region -> its payload (None: it sent no update); gathered codecs
    summed: torch.Tensor | None  # the sum of the dense contributions; summed codecs
    comm_s: float  # seconds the collective took on this leader (the shaper's hold included)
    wan_bytes: int  # bytes this leader handed to the collective
    # elastic: the round's commit vote did not commit it (runtime/distributed/agreement.py): no region applies
    # it, every live one rolls it back and trains it again; ``why`` says why
    void: bool = False
    why: str = ""
    # the sharded exchange (runtime/distributed/sharded.py): the leaders' combined update (flat float32) and
    # what the exchange decided (accepted senders, lost shards, suspects); None: payloads were gathered
    update: torch.Tensor | None = None
    sharded: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The non-tensor part, as the leader shares it inside its region."""
        return {"infos": self.infos, "comm_s": self.comm_s, "wan_bytes": self.wan_bytes,
                "sharded": self.sharded, "void": self.void, "why": self.why}  # fmt: skip


def compute_idle(compute_s: list[float]) -> float | None:
    """The round's straggler idle from its members' measured compute: the time the faster ones wait for the
    slowest, over the members' time (None without a measurement)."""
    times = [c for c in compute_s if isinstance(c, (int, float)) and c >= 0]
    if not times or max(times) <= 0:
        return None
    return sum(max(times) - c for c in times) / (len(times) * max(times))


def reported_overhead_s(info: dict[str, Any]) -> float | None:
    """A member's round overhead as its info reports it (its time outside the inner steps since its last
    exchange: the outer step, an evaluation): finite seconds >= 0, else None (a peer's figure is data)."""
    value = info.get("overhead_s")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf
    return float(value) if ok else None


def round_work_s(info: dict[str, Any]) -> float | None:
    """A member's work in its round, as its info reports it: its measured compute plus its round overhead
    (:func:`reported_overhead_s`, none counts as 0); None without a compute."""
    compute = info.get("compute_s")
    if isinstance(compute, bool) or not isinstance(compute, (int, float)) or not math.isfinite(compute):
        return None
    return float(compute) + (reported_overhead_s(info) or 0.0)


def round_idle(infos: list[dict[str, Any]]) -> float | None:
    """The round's straggler idle from its members' infos: :func:`compute_idle` of their work
    (:func:`round_work_s`): a member slower outside its inner steps, planned to compute less, is not idle."""
    return compute_idle([w for w in map(round_work_s, infos) if w is not None])


def wait_for_slowest_s(infos: list[dict[str, Any]], work_s: float) -> float:
    """How long an exchange that no barrier precedes waits for the slowest member: its measured work (compute
    and round overhead, :func:`round_work_s`; the members' round infos carry theirs) beyond this member's. By
    measured times, not clock times: the regions' clocks agree only roughly, and the round records measure
    straggler idle the same way. The caller clips it to the exchange's length (members that started their
    round later wait less)."""
    times = [w for w in map(round_work_s, infos) if w is not None]
    return max(0.0, max(times, default=work_s) - work_s)


class Exchange(Protocol):
    """The seam (see the module docstring); ``run`` is the rank's :class:`~.core.RankRun`."""

    elastic: bool
    report_wait_s: float  # seconds the last round's report waited for other regions (none: 0)

    def open_round(self, first: bool) -> RoundView: ...

    def straggler_barrier(self, round_number: int) -> None: ...

    def exchange(self, payload: bytes | None, summed: torch.Tensor | None, info: dict[str, Any],
                 members: list[int]) -> Exchanged: ...  # fmt: skip

    def shaper_s(self, members: list[int]) -> float: ...


class StaticExchange:
    """Every region in every round, over the leaders' process group of a static run: a monitored barrier
    (Gloo names the rank that does not arrive within ``--timeout``), then an all-gather of the payloads (or an
    all-reduce of the dense sum) and of the round infos, held by the WAN shaper. Rank 0 keeps the records:
    after each round every region reports to it (inside the region first, then across the leaders only)."""

    elastic = False

    def __init__(self, loop: Any):
        self.loop, self.run = loop, loop.run
        self.n = len(self.run.scenario.regions)
        self.report_wait_s = 0.0  # the last round report's wait for the other regions (see end_round)

    # ---- start and resume -----------------------------------------------------------------------------
    def start(self) -> None:
        """The first plan (every region), the ``run`` and ``plan`` records and the evaluation at 0, the clock."""
        loop, run = self.loop, self.run
        every = list(range(self.n))
        loop.planning.propose(every)
        run.plans.append(loop.planning.plan)
        run._start_records(loop.planning.plan)
        run._start_clock()

    def resumed(self) -> None:
        pass

    def resumed_at_round(self) -> None:  # (elastic regions only: a static world resumes one checkpoint)
        pass

    def share_calibration(self, mine: dict[str, Any] | None) -> None:
        """Every region's calibration (leaders' all-gather, then inside each region) to the loop."""
        run = self.run
        shared = None
        if run.is_leader:
            shared = run.transport.all_gather_json(mine, run.leaders_group, self.n, what="the calibrations")
        if run.region_group is not None:
            shared = run.transport.broadcast_json(shared, run.leader, run.region_group, what="the calibrations")
        self.loop.planning.use_calibration({k: c for k, c in enumerate(shared) if isinstance(c, dict)})

    def planned_for_after_resume(self) -> list[int]:
        return list(range(self.n))

    def checkpoint_state(self) -> dict[str, Any]:
        return {}

    def checkpoint_state_rank0(self) -> None:
        return None

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        pass

    # ---- a round ------------------------------------------------------------------------------------------
    def open_round(self, first: bool) -> RoundView:
        return RoundView(members=list(range(self.n)))

    def members_known(self, view: RoundView, members: list[int]) -> None:
        pass

    def planned(self, plan: Any, members: list[int], round_index: int) -> None:
        self.loop.emit({"type": "plan", "round": round_index, "time": self.run._now(), "plan": plan.to_json()})

    def apply_healed(self, state: dict[str, Any]) -> None:
        raise AssertionError("a static run is never healed")

    def straggler_barrier(self, round_number: int) -> None:
        run = self.run
        run.transport.barrier(run.leaders_group, what=f"the straggler barrier of round {round_number}")

    def info_fields(self) -> dict[str, Any]:
        return {}

    def probe(self, nbytes: int, members: list[int]) -> float:
        """(leader) One all-gather of ``nbytes`` per leader, held by the WAN shaper as an exchange is, after a
        barrier that lines the leaders up: its seconds (the WAN probed before round 0, plan_loop.py)."""
        run = self.run
        run.transport.barrier(run.leaders_group, what="the WAN probe")
        since = time.perf_counter()
        run.transport.all_gather_json({"probe": "0" * nbytes}, run.leaders_group, self.n, what="the WAN probe",
                                      max_bytes=nbytes + 4096)  # fmt: skip
        shaper = WanShaper(self.loop.faults.wan(members), run.options.wan)
        shaper.hold(shaper.allgather_s(nbytes), since)
        return time.perf_counter() - since

    def gather_json(self, obj: Any, what: str) -> list[Any]:
        """(leader) Every leader's ``obj`` (JSON)."""
        return self.run.transport.all_gather_json(obj, self.run.leaders_group, self.n, what=what)

    def shaper_s(self, members: list[int]) -> float:
        """What the WAN shaper holds this exchange to (0 without a shaper or with a single region)."""
        if len(members) < 2:
            return 0.0
        loop = self.loop
        if loop.sharded is not None:  # the sharded exchange (runtime/distributed/sharded.py)
            from .sharded_loop import shaper_s

            return shaper_s(loop, members)
        shaper = WanShaper(loop.faults.wan(members), self.run.options.wan)
        nbytes = loop.planning.wire_nbytes
        return shaper.allreduce_s(nbytes) if loop.summed else shaper.allgather_s(nbytes)

    def exchange(self, payload: bytes | None, summed: torch.Tensor | None, info: dict[str, Any],
                 members: list[int]) -> Exchanged:  # fmt: skip
        run, loop = self.run, self.loop
        if loop.sharded is not None and summed is None:  # the plan picked the sharded exchange
            from .sharded_loop import static_sharded_exchange

            return Exchanged(**static_sharded_exchange(self, payload, info, members))
        t0 = since = time.perf_counter()
        before = run.transport.wan_bytes
        payloads = None
        if summed is not None:
            summed = run.transport.all_reduce_sum(summed, run.leaders_group)
        else:  # each slot signed for its sender and round: "no update" cannot be forged, nor a slot replayed
            slots = run.transport.all_gather_payloads(payload, loop.slot_nbytes, run.leaders_group, self.n,
                                                      run.rounds + 1)  # fmt: skip
            payloads = {k: (s if not isinstance(s, Rejected) else None) for k, s in enumerate(slots)}
        infos = run.transport.all_gather_json(info, run.leaders_group, self.n,
                                              what=f"the round infos of round {run.rounds + 1}")  # fmt: skip
        for k, i in enumerate(infos):  # a malformed info: its region takes no part in this round's update
            if not isinstance(i, dict):
                infos[k] = {"region": k, "active": True, "sent": False,
                            "rejected": "its round info is not a JSON object"}  # fmt: skip
            infos[k]["region"] = k
            if payloads is not None and isinstance(slots[k], Rejected):
                infos[k]["slot_rejected"] = slots[k].reason
        WanShaper(loop.faults.wan(members), run.options.wan).hold(self.shaper_s(members), since)
        return Exchanged(infos=infos, payloads=payloads, summed=summed, comm_s=time.perf_counter() - t0,
                         wan_bytes=run.transport.wan_bytes - before)  # fmt: skip

    def theta_changed(self) -> None:
        pass

    def end_round(self, result: Exchanged, members: list[int], outcome: dict[str, Any], lost: dict[int, int],
                  planned: dict[int, int], compute_s: float, comm_s: float, *, payload: Any = None,
                  split: Any = None, sent_before: int = 0, wire_before: int | None = None,
                  wire_after: int | None = None, overhead_s: float | None = None,
                  ) -> list[dict[str, Any]] | None:  # fmt: skip
        """Every region reports the round to rank 0 (θ's checksum, spans, bytes, ``overhead_s``: its round
        overhead, None where not measured yet), which records it. Returns the reports on the leaders (every
        leader gathers them; None elsewhere): overlapped rounds exchange payloads only, and the plan loop
        measures them from these (each leader's report carries its wire time of the exchange that arrived in
        the round)."""
        run, loop = self.run, self.loop
        checksum = params_checksum(loop.params) if not loop.update.outvoted else None  # (a region standing aside)
        run._mark("other")
        parts = payload if split is not None else (payload,)
        clock = {"elapsed_s": run._now()} if run.stopping.timed else {}  # (the time budget's rule)
        wire = loop.planning.wan.wire if loop.overlap is not None and run.is_leader else {}
        info = run._round_info(checksum, compute_s, comm_s, sent_before, wire_before, wire_after,
                               proxy_bytes=sum(len(p) for p in parts if p is not None) if run.is_leader else 0,
                               dropped=False, **clock, **wire,
                               **({} if overhead_s is None else {"overhead_s": overhead_s}))
        run._mark("other")
        before = run._cursor
        infos = run.reports.checked(info, "round", "global parameters", run.rounds)
        # the report waits for the slowest region's outer step: a wait, not this region's round overhead
        run._mark("straggler_wait")
        self.report_wait_s = run._cursor - before
        # every region's clock came with its report: the leaders agree on the run's elapsed time, then their ranks
        elapsed = elapsed_of_round([i.get("elapsed_s") for i in infos]) if infos is not None else None
        if clock and run.region_group is not None:
            elapsed = run.transport.broadcast_json(elapsed if run.is_leader else None, run.leader, run.region_group,
                                                   what=f"the run's elapsed time at round {run.rounds}")  # fmt: skip
        run.stopping.agree_elapsed(None if elapsed is None else [elapsed])
        if run.rank == 0:
            run._record_round(infos, loop.names, members=[loop.names[i] for i in outcome["took_part"]],
                              tokens_lost={loop.names[i]: t for i, t in lost.items()},
                              straggler_idle_frac=round_idle(infos),
                              **({"overhead_s": [reported_overhead_s(i) for i in infos]}
                                 if overhead_s is not None else {}),
                              **({"elapsed_s": run.stopping.time_elapsed_s} if clock else {}))  # fmt: skip
        return infos

    def finish(self) -> dict[str, Any]:
        run, loop = self.run, self.loop
        run._final_telemetry(loop.params, loop.outer.buf)
        every = list(range(self.n))
        return {**run.ledger.exchange_fields(run.rounds, loop.planning.wire_nbytes, loop.kit.payload_nbytes,
                                             loop.kit.modeled_payload_nbytes, self.shaper_s(every),
                                             loop.method.collective),
                "exchange": loop.planning.exchange_kind,
                "shard_bits": loop.sharded.bits if loop.sharded is not None else None,
                "overlap": loop.overlap is not None, "faults": loop.faults.records, **loop.planning.summary_fields(),
                "rejected_payloads": int(run.telemetry.counters.get("rejected_payloads", 0)),
                "tokens_lost": int(run.tokens_lost)}  # fmt: skip
