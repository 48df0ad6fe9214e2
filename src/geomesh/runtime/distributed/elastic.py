"""Elastic regions: the exchange of the one round loop (:mod:`.rounds`) when regions may die, hang, fall behind
and come back.

With ``reliability.min_regions >= 1`` (or ``--min-regions``) every region is its own ``torch.distributed``
world (its ranks only: one ``torchrun`` per region), and regions meet only through
:class:`~geomesh.runtime.distributed.membership.Membership` (torchft: a quorum per round from the Lighthouse,
a Gloo group reconfigured over the quorum's leaders, live recovery of a region that is behind).
:class:`QuorumExchange` is what the round loop sees of it:

1. **Quorum** (:mod:`.quorum`): the region's leader asks for the round's quorum; a region that died, hangs or is
   late is left out, one behind the others first receives a live region's state; members check each other's
   quorum header, and the round's plan header is shipped over the quorum.
2. **Exchange** (:meth:`QuorumExchange.exchange`) over the quorum's leaders: an all-gather of payload + round
   info, an all-reduce of the dense sum, or, when the plan picks it, the sharded exchange
   (:func:`~geomesh.runtime.distributed.sharded_loop.quorum_sharded_exchange`: one shard per quorum member). If a
   member dies or passes the deadline there, the survivors form a new quorum and exchange the payloads they
   already have (sharded: with a layout for the new quorum, so they own the lost member's shard): the lost
   region's tokens of this round are counted as lost. Then torchft commits the round (its step = rounds done).
3. **Records** (:mod:`.round_records`): ``round`` (members, lost tokens), ``leave`` and ``join`` events, spans;
   every leader keeps them, the writer writes ``events.jsonl`` and ``summary.json`` (:mod:`.records`).

The run goes on while at least ``min_regions`` regions form a quorum, counting only regions whose headers
authenticate (a region with another key is a quorum member for torchft, never one of the ``min_regions``);
with fewer, the quorum times out after ``--timeout`` seconds and the run stops with one ``error:`` line.
Faults, planning, screening, evaluation and checkpoints are the round loop's, as in a static run; with
``--checkpoint-every N`` each region writes its own checkpoint into ``DIR/checkpoints/<region>``.

This module is the exchange and its commit vote; :class:`QuorumExchange` holds the other parts and hands them
values: the quorum, the records of membership, the region's state (:mod:`.elastic_state`), its records and the
round's agreement (its pure rules: :mod:`.agreement`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ... import checkpoint as ckpt
from ...errors import RunError
from ...telemetry import Telemetry
from ..checkpoint_state import run_fingerprint
from .agreement import RoundAgreement, RoundHeader, arrivals_digest, commit_decision, vote
from .elastic_state import RegionState
from .records import RunRecords
from .deadline import RoundDeadline, adaptive_deadline_s, deadline_history, setup_s
from .exchange import Exchanged, RoundView
from .layout import RegionLayout, region_layout
from .membership import ExchangeFailed, Membership
from .quorum import RoundQuorum
from .round_records import RoundRecords
from .service import LIGHTHOUSE_ENV, join_timeout_s
from .wan_shaper import WanShaper, ring_allgather_bytes, ring_allreduce_bytes

__all__ = ["QuorumExchange", "RegionLayout", "adaptive_deadline_s", "deadline_history", "region_layout"]


class QuorumExchange:
    """The round loop's exchange and its commit vote for one elastic region (see the module docstring); it holds
    the round's quorum (``quorum``), the records of membership (``history``), the region's state, its records
    and the round's agreement, and hands them values."""

    elastic = True
    report_wait_s = 0.0  # (the round's records came with its exchange: its report waits for nobody)

    def __init__(self, loop):
        self.loop = loop
        run = loop.run
        self.run, self.sc, self.method = run, loop.sc, loop.method
        self.names, self.n, self.me = loop.names, loop.n, loop.me
        self.min_regions = self.sc.reliability.min_regions
        self.deadline = RoundDeadline(self.sc.reliability)  # how long an exchange waits for its slowest member
        self.job_hash = ckpt.fingerprint_hash(run_fingerprint(self.sc, self.method.name, run.seed, run.budget))
        self.faults = loop.faults
        self.records = RunRecords(run.out_dir, self.names[self.me], run.is_leader)
        # what a live region sends one that joins (torchft's recovery), and this region's part of its checkpoint
        self.state = RegionState(run, loop.params, loop.outer, loop.codec, loop.faults, loop.planning, self.records)
        # the round's agreement (agreement.py): its header, why this region refused one, the round's attempt
        self.agreement = RoundAgreement(self.job_hash, self.names, self.me)
        # the round's quorum and its header (quorum.py), and the records of who came and went (round_records.py)
        self.quorum = RoundQuorum(run, self.names, self.min_regions, self.job_hash, self.agreement, self.state,
                                  loop.params, self._emit, self._say)  # fmt: skip
        self.history = RoundRecords(run, self.names, self.state, self.records, self.faults, self._emit)
        self.membership: Membership | None = None
        run.keeps_records = run.is_leader

    def _emit(self, record: dict[str, Any]) -> None:
        if self.run.is_leader:
            self.run.telemetry.emit(record)

    def _say(self, text: str) -> None:
        if self.run.is_leader and self.run.options.progress:
            print(f"[{self.method.name}] region {self.names[self.me]}: {text}", flush=True)

    # ---- start ----------------------------------------------------------------------------------------
    def start(self) -> None:
        run = self.run
        if run.is_leader:
            run.telemetry = Telemetry(None, sinks=[self.records.sink()])
            self.records.claim_folder()
            rel, rtt_s = self.sc.reliability, max(max(row) for row in self.sc.wan_model().rtt_s)
            self.membership = self.quorum.connect(run.options.lighthouse or os.environ.get(LIGHTHOUSE_ENV),
                                                  self.deadline.cap_s, join_timeout_s(rel),
                                                  setup_s(self.deadline.cap_s, rtt_s))  # fmt: skip
            self._emit({"type": "run", "runtime": "distributed", "method": self.method.name, "scenario": self.sc.name,
                        "seed": run.seed, "tokens_budget": run.budget, "model": run.model_name,
                        "model_params": run.global_model.num_params(), "workers": self.names,
                        "backend": run.backend, "wan": run.options.wan, "elastic": True,
                        "min_regions": self.min_regions, "round_deadline_s": self.deadline.cap_s,
                        "round_deadline_mode": self.deadline.mode})  # fmt: skip
        run.transport.barrier(None, what="the start barrier")
        run.clock.start()
        self.state.snapshot()  # θ as a region behind may ask for it at the first quorum

    def share_calibration(self, mine: dict[str, Any] | None) -> None:
        """This region's calibration travels with its quorum header, so every member learns the others'."""
        self.quorum.share_calibration(mine)

    def planned_for_after_resume(self) -> list[int] | None:
        return None  # the first quorum after a resume plans its members

    # ---- 1. the quorum (quorum.py) ---------------------------------------------------------------------------
    def open_round(self, first: bool) -> RoundView:
        """The round's quorum, on every rank (:meth:`.quorum.RoundQuorum.open_round`)."""
        return self.quorum.open_round(first, self.loop.overlap is not None, self.leader_wait_s)

    def agree_round(self, quorum: list[int], members: list[int], proposal, reason: str,
                    number: int | None = None) -> RoundHeader | None:  # fmt: skip
        """(every rank) The header of round ``number`` (default: the next one; :meth:`.quorum.RoundQuorum.agree`).
        None: this region refused it, or it did not arrive (``agreement.refusal`` says why); the region then takes
        no part in the round and votes no, so the round is rolled back everywhere and tried again."""
        number = self.run.rounds + 1 if number is None else number
        return self.quorum.agree(quorum, members, proposal, reason, self.loop.planning.exchange_kind, number)

    def leader_wait_s(self) -> float:
        """How long a region's ranks may wait for their leader's quorum or exchange: the startup wait and the
        quorum's timeout (each ``--timeout``), a heal of the model's state, and the round deadline."""
        from .heal import heal_timeout_s

        nbytes = 12 * sum(p.numel() for p in self.loop.params.values())  # θ, momentum and a margin, in fp32
        return 2 * self.run.options.timeout_s + heal_timeout_s(nbytes) + self.deadline.cap_s

    def launch_quorum(self, propose) -> list[int]:
        """(leader, overlapped rounds) The quorum of the exchange about to leave: its members. The next round
        starts with them, so its header is shipped here (``propose(quorum)``: this region's (members, plan,
        reason) for it), before the exchange's thread takes the group."""
        quorum, rejoined = self.quorum.launch()
        self.history.restarted_in_place(rejoined, self.run.rounds + 1)
        members, plan, reason = propose(list(quorum))
        self.quorum.ship_launch_header(members, plan, reason, self.loop.planning.exchange_kind, self.run.rounds + 2)
        return quorum

    @property
    def launch_members(self) -> list[int] | None:
        """(overlapped rounds) The members the next round starts with, as the last exchange's quorum had them."""
        return self.quorum.launch_members

    @launch_members.setter
    def launch_members(self, members: list[int]) -> None:  # (a region healed at that quorum formed none itself)
        self.quorum.launched_with(members)

    def members_known(self, view: RoundView, members: list[int]) -> None:
        """``leave``/``join`` records for the round's members (every leader alike)."""
        self.history.members_known(view.rejoined, members, self.run.rounds + 1)

    def planned(self, plan, members: list[int], round_index: int, header: RoundHeader | None = None) -> None:
        agreed = {} if header is None else {"attempt": header.attempt, "maker": self.names[header.maker],
                                            "reason": header.reason, "digest": header.digest}  # fmt: skip
        self._emit({"type": "plan", "round": round_index, "time": self.run._now(), "plan": plan.to_json(),
                    "members": [self.names[i] for i in members], **agreed})  # fmt: skip

    def apply_healed(self, state: dict[str, Any]) -> int | None:
        """The live region's state, received at the quorum, applied on every rank; the index of the plan the
        live region's round in progress runs (None: the plan in force)."""
        plan_at = self.state.apply_healed(state)
        if self.run.is_leader:  # an operator wants to see this one even with --quiet
            print(f"region {self.names[self.me]}: joined at round {self.run.rounds + 1} with the state of a live "
                  f"region", flush=True)  # fmt: skip
        return plan_at

    # ---- 2. the exchange ---------------------------------------------------------------------------------
    def straggler_barrier(self, round_number: int) -> None:
        pass  # the quorum at the round's start is the barrier

    def info_fields(self) -> dict[str, Any]:
        run = self.run
        spans = run.clock.take_spans()
        return {"spans": spans, "stream": run.worker.stream.state_dict(), "crc": self.state.theta_crc()}

    def _wan(self, members: list[int]):
        return self.faults.wan(members)

    def shaper_s(self, members: list[int]) -> float:
        """What the WAN shaper holds this exchange to (0 without a shaper or with a single region)."""
        if len(members) < 2:
            return 0.0
        if self.loop.sharded is not None:  # the sharded exchange of these members (runtime/distributed/sharded_loop.py)
            from .sharded_loop import shaper_s

            return shaper_s(self.loop, members)
        shaper = WanShaper(self._wan(members), self.run.options.wan)
        return shaper.allreduce_s(4 * (self.loop.d + 1)) if self.loop.summed else shaper.allgather_s(
            self.loop.slot_nbytes)  # fmt: skip

    def exchange(self, payload: bytes | None, summed: torch.Tensor | None, info: dict[str, Any],
                 members: list[int], round_number: int | None = None) -> Exchanged:  # fmt: skip
        """(leader) The all-gather (or all-reduce, or the sharded exchange the plan picked) over the quorum, then
        the round's commit vote (:mod:`.agreement`). A round that does not commit comes back ``void``: no region
        applies it, every one rolls it back and trains it again under a new header. ``round_number``: the round
        it is of (default: the one in progress; an overlapped exchange on its thread is given it, as the round
        loop counts on meanwhile)."""
        m, run = self.membership, self.run
        number = self.exchange_round = run.rounds + 1 if round_number is None else round_number
        header = self.agreement.header_for(number)
        if self.loop.overlap is not None:  # (overlapped: the vote is on this exchange, over its own quorum)
            refused = number in self.agreement.refused_rounds
            self.agreement.refused_rounds.discard(number)
            header = None if refused else RoundHeader(
                run=self.job_hash, round=number, attempt=0, members=tuple(sorted(members)), plan={}, digest="",
                exchange="", reason="overlapped exchange", maker=min(members))  # fmt: skip
        t0 = time.perf_counter()
        sent, sharded, infos, gathered = 0, None, [], None
        deadline = self.deadline.for_round(self.records.records, lambda: self.shaper_s(members))
        ok, why, arrived = header is not None, self.agreement.refusal or "it holds no header for the round", None
        group_intact = True
        try:
            since = time.perf_counter()
            if self.loop.sharded is not None and summed is None:
                from .sharded_loop import quorum_sharded_exchange

                sharded = quorum_sharded_exchange(self, payload, info, deadline)
                infos = sharded["infos"]
                sent += sharded["wan_bytes"]
                update = sharded["update"]  # (the combined update every leader assembled from the owners' shards)
                extra = update.numpy().tobytes() if update is not None else b"none"
                arrived = arrivals_digest([i["region"] for i in infos], extra=extra)
            elif summed is not None:
                infos = m.all_gather_framed(info, timeout_s=deadline)
                self.quorum.note_rejections()
                m.all_reduce_sum(summed, timeout_s=deadline)
                sent += ring_allreduce_bytes(4 * (self.loop.d + 1), len(infos))  # (on the wire: docs/formats.md)
                arrived = arrivals_digest([i["region"] for i in infos], extra=summed.numpy().tobytes())
            else:
                envelopes = m.all_gather_framed({**info, "payload": payload}, timeout_s=deadline)
                self.quorum.note_rejections()
                infos = [{k: v for k, v in e.items() if k != "payload"} for e in envelopes]
                gathered = {e["region"]: e["payload"] for e in envelopes}
                sent += ring_allgather_bytes(self.loop.slot_nbytes, len(envelopes))
                arrived = arrivals_digest(gathered, gathered)
            if run.hooks.at("arrived", self.names[self.me], number, rank=run.rank):
                raise ExchangeFailed("fault hook: the connection broke after the payloads arrived")
            who = sorted(i["region"] for i in infos)
            WanShaper(self._wan(who), run.options.wan).hold(self.shaper_s(who), since)
        except ExchangeFailed as exc:
            m.report(exc)
            ok, why, group_intact = False, f"its exchange failed ({exc})", False
        committed, why_not = self._vote(header, ok, arrived, why, group_intact)
        if not committed:
            return Exchanged([], None, None, time.perf_counter() - t0, sent, void=True, why=why_not)
        crcs = {i["crc"] for i in infos}
        if len(crcs) > 1:
            detail = ", ".join(f"{self.names[i['region']]}: {i['crc']}" for i in infos)
            raise RunError(f"round {number}: the regions hold different global parameters ({detail})")
        if sharded is not None:
            return Exchanged(infos, None, None, time.perf_counter() - t0, sent, update=sharded["update"],
                             sharded=sharded["sharded"])  # fmt: skip
        return Exchanged(sorted(infos, key=lambda i: i["region"]), gathered, summed, time.perf_counter() - t0, sent)

    def _vote(self, header: RoundHeader | None, ok: bool, arrived: str | None, why: str,
              group_intact: bool) -> tuple[bool, str]:  # fmt: skip
        """(leader) The round's commit vote over the quorum's leaders: (commit, why not). Every member that
        gathers the votes reads the same ones and decides alike; one that cannot gather them rolls back (if the
        others committed, it is behind: the next quorum heals it). A rolled-back round is a commit failure for
        torchft (its step stays), so the next quorum is a new one with a group formed afresh."""
        m = self.membership
        decided, why_not = False, why
        if group_intact:  # (a region that refused the header votes no: the others learn it at once)
            try:
                votes = m.all_gather_framed(vote(region=self.me, header=header, ok=ok, arrived=arrived, why=why),
                                            timeout_s=self.deadline.last_s)  # fmt: skip
                if header is not None:
                    decided, why_not = commit_decision(votes, header, self.names)
            except ExchangeFailed as exc:
                m.report(exc)
                group_intact, why_not = False, f"the commit vote failed ({exc})"
        if decided and m.commit():
            return True, ""
        if group_intact:  # (a failed collective reported itself already)
            m.report(ExchangeFailed(f"the round was rolled back: {why_not}"))
        return False, why_not or "torchft did not commit the round"

    def theta_changed(self) -> None:
        self.state.snapshot()

    # ---- 3. records (round_records.py) ------------------------------------------------------------------------
    def end_round(self, result: Exchanged, members: list[int], outcome: dict[str, Any], lost: dict[int, int],
                  planned: dict[int, int], compute_s: float, comm_s: float, round_number: int | None = None,
                  **_: Any) -> None:  # fmt: skip
        number = self.run.rounds if round_number is None else round_number  # (overlapped: the exchange's own round)
        self.history.end_round(result, members, outcome, lost, planned, number, self.deadline.last_s,
                               self.quorum.take_rejections(), self.loop.slot_nbytes)  # fmt: skip

    # ---- resumed from checkpoints, together --------------------------------------------------------------
    def resumed(self) -> None:
        """Resumed from this region's own newest checkpoint. The rounds its folder holds go with its first quorum
        header, and torchft's step stays 0 until the members agree (:meth:`.quorum.RoundQuorum.agreed_resume_round`):
        a step of its own would make torchft heal the regions whose newest checkpoint is older from the one that
        got further, with a fresh AdamW, so the run would part from the uninterrupted one."""
        from .checkpoints import list_complete

        self.quorum.resume_from(self.run.rounds, [r for r, _, _ in list_complete(self.run.checkpoints.directory)])
        self.state.snapshot()

    def resumed_at_round(self) -> None:
        """The loop loaded the agreed round: torchft's step is the rounds done, and the records are rewritten."""
        if self.membership is not None:
            self.membership.set_step(self.run.rounds)
        self.records.written = -1
        self.state.snapshot()

    # ---- the WAN probed before round 0 (plan_loop.py) -------------------------------------------------------
    def probe(self, nbytes: int, members: list[int]) -> float:
        """(leader) One all-gather of ``nbytes`` per member over the quorum, held by the WAN shaper as an
        exchange is, after a tiny one that lines the members up: its seconds."""
        m = self.membership
        m.all_gather_framed({"region": self.me, "probe": b""})  # (a frame names the region it is signed for)
        since = time.perf_counter()
        m.all_gather_framed({"region": self.me, "probe": bytes(nbytes)})
        shaper = WanShaper(self.faults.wan(members), self.run.options.wan)
        shaper.hold(shaper.allgather_s(nbytes), since)
        return time.perf_counter() - since

    def gather_json(self, obj: Any, what: str) -> list[Any]:
        """(leader) Every member's ``obj`` (JSON), over the quorum."""
        return self.membership.all_gather_framed({**obj, "region": self.me})

    def _note_rejections(self) -> None:
        """The frames the last collective refused, for the round's record (the sharded exchange's collectives)."""
        self.quorum.note_rejections()

    # ---- this region's part of its checkpoint (RegionState) -------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return self.state.checkpoint_state()

    def checkpoint_state_rank0(self) -> dict[str, Any] | None:
        return self.state.checkpoint_state_rank0()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.state.load_checkpoint_state(state)

    def finish(self) -> dict[str, Any]:
        run = self.run
        run._mark("other")
        final = [self.me]
        checksums = {self.names[self.me]: self.state.theta_crc()}
        if run.is_leader and self.membership is not None:
            ends = self.quorum.ends(checksums[self.names[self.me]], run.clock.take_spans())
            final = [e["region"] for e in ends]
            checksums = {self.names[e["region"]]: e["crc"] for e in ends}
            self.history.ended(ends, final)
            self.quorum.close({"round": run.rounds, "regions": [self.names[i] for i in final],
                               "checksum": checksums.get(self.names[self.me])})  # fmt: skip
        writer = self.records.writes(min(final) == self.me) if run.is_leader else False
        if run.region_group is not None:  # its ranks evaluate θ and gather it for the summary together
            writer = run.transport.broadcast_json(writer, run.leader, run.region_group,
                                                  what="whether this region writes the summary")  # fmt: skip
        run.writes_summary = bool(writer)
        run.ledger.end(list(checksums.values()), run._now())
        loop, stats = self.loop, self.state.stats
        return {
            **run.ledger.exchange_fields(run.rounds, loop.planning.wire_nbytes, loop.kit.payload_nbytes,
                                         loop.kit.modeled_payload_nbytes, self.shaper_s(final),
                                         self.method.collective),  # fmt: skip
            "status": "complete",
            "exchange": loop.planning.exchange_kind,
            "shard_bits": loop.sharded.bits if loop.sharded is not None else None,
            "world_size": None,
            "ranks_per_region": None,
            "elastic": {"min_regions": self.min_regions, "round_deadline_s": self.deadline.cap_s,
                        "round_deadline_mode": self.deadline.mode, **self.history.summary_fields(final)},
            "rounds_without": stats["rounds_without"],
            "tokens_lost": sum(stats["tokens_lost"].values()),
            "faults": self.faults.records,
            "param_checksums": checksums,
            "rejected_payloads": int(run.telemetry.counters.get("rejected_payloads", 0)),
            # frames refused from quorum members (forged, replayed, another run's) and recoveries refused to
            # whoever could not prove the key, as this region saw them
            "rejected_frames": self.membership.rejected_frames if self.membership is not None else 0,
            "heals_refused": getattr(getattr(self.membership, "heal", None), "refused", 0),
            "overlap": loop.overlap is not None,
            **loop.planning.summary_fields(),
        }
