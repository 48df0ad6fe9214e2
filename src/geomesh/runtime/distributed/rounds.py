"""The round loop of the distributed runtime, written once, on one rank: static or elastic regions, plain or
overlapped rounds, scenario faults, payload screening, evaluation and checkpoints are parts of this loop. Every
kind of round takes the same six steps here, so that no variant of the runtime has a loop of its own. The parts
of a round are components it holds, each given the values it needs:

- the plan (:class:`.plan_loop.PlanLoop`, ``loop.planning``) and the exchanges (:mod:`.exchange`,
  :mod:`.elastic`, :mod:`.sharded`; overlapped, :mod:`.overlap`);
- this region's inner steps (:class:`.inner_steps.InnerSteps`, ``loop.inner``);
- the leader's exchange of a round (:class:`.leader_exchange.LeaderExchange`, ``loop.leader``), shared inside
  the region (:class:`.share.RegionShare`, ``loop.sharing``);
- the round's update (:class:`.update.RoundUpdate`, ``loop.update``) and a round rolled back
  (:class:`.rollback.RoundRollback`, ``loop.rollback``);
- the elastic overlapped exchanges in flight (:class:`.in_flight.ExchangesInFlight`, ``loop.in_flight``);
- the rounds' checkpoints, written and resumed (:class:`.round_checkpoints.RoundCheckpoints`,
  ``loop.checkpointing``), and the evaluations and checkpoints at the end of a round, measured as this region's
  round overhead (:class:`.round_overhead.RoundOverhead`, ``loop.overhead``).

One round (every rank of every region; the leader alone crosses the WAN):

1. **Who trains.** The exchange (:mod:`.exchange`: the static leaders' group, or torchft's quorum with
   elastic regions, :mod:`.elastic`) names the round's members; a region that was behind is healed first.
2. **Faults and plan.** The scenario's faults of the round apply on every rank alike
   (:class:`~geomesh.runtime.faults.RoundFaults`); the members are (re-)planned when they or their speeds
   and links changed. The round's steps, tokens and learning rates come from
   :func:`~geomesh.methods.base.round_steps`, as in the emulated runtime.
3. **Inner steps** on every rank of a member region (:meth:`OuterLoopMethod.local_phase`, or the overlapped
   round, :mod:`.overlap`), then the region's payload.
4. **Exchange** over the members' leaders: the straggler barrier, the collective (an all-gather of payloads,
   or an all-reduce of dense contributions), the WAN shaper's hold; the leader shares the bytes inside its
   region (:mod:`.share`).
5. **Screen, combine, step** (:mod:`.update`). Every rank screens every payload before combining any
   (:func:`~geomesh.runtime.payloads.screen_payload`): a bad payload costs its sender's update this round (a
   warning naming the region, ``rejected_payloads``), never the run; the combined update is checked finite;
   every rank takes the same outer step.
6. **Records, evaluation, checkpoint.** The round's record and spans (static: rank 0 writes ``events.jsonl``;
   elastic: :class:`~geomesh.runtime.distributed.elastic.QuorumExchange` keeps and writes them), evaluation on
   its cadence, a checkpoint when due (an overlapped round before it drains its exchange first).
"""

from __future__ import annotations

from typing import Any

from ...errors import RunError
from ...methods.base import OuterLoopMethod, RoundKit, payload_key, round_steps
from ..faults import RoundFaults
from .core import RankRun
from .exchange import StaticExchange
from .in_flight import ExchangesInFlight
from .inner_steps import InnerSteps
from .leader_exchange import LeaderExchange
from .owners import OwnerResiduals
from .plan_loop import PlanLoop
from .region import lay_out_like
from .rollback import RoundRollback
from .round_checkpoints import RoundCheckpoints
from .round_overhead import RoundOverhead
from .share import RegionShare
from .update import RoundUpdate
from .wan_shaper import WanShaper, tx_bytes

STATIC_MEMBERSHIP_FAULTS = ("the scenario's leave/join faults need elastic regions: set reliability.min_regions "
                            "(or --min-regions N) to at least 1; a static run keeps every region in every round")


class RoundLoop:
    """The rounds of a round-based method on this rank of ``run`` (set up), over the run's exchange."""

    def __init__(self, run: RankRun):
        self.run = run
        method: OuterLoopMethod = run.method  # type: ignore[assignment]
        sc = run.scenario
        self.method, self.sc, self.tr = method, sc, sc.training
        self.names = [r.name for r in sc.regions]
        self.n = len(self.names)
        self.me = run.region
        self.seq = sc.model.seq_len
        self.params = {k: p.detach() for k, p in run.global_model.named_parameters()}
        self.kit = RoundKit.build(method, sc, self.params, key=payload_key(sc))
        self.codec, self.combiner, self.outer = self.kit.codec, self.kit.combiner, self.kit.outer
        self.d = self.kit.manifest.numel
        # dense contributions are summed by an all-reduce, unless a run key signs them: then the plan shards
        # them (runtime/distributed/sharded.py: signed slices, each owner screens and sums its shard; a ring
        # all-reduce's bytes) or, where that is not cheaper (two regions, overlapped rounds), each is gathered as
        # a signed payload and every rank sums the ones that pass screening (N·P bytes instead of ~2·P)
        self.summed = self.kit.dense and self.kit.key is None
        self.faults = RoundFaults(sc)
        self.elastic = run.options.elastic_region is not None
        # the plan as a loop (plan_loop.py): the plan in force, its members and the exchange kind it is made for,
        # measured in place and re-planned from every round; the same numbers on every rank
        self.planning = PlanLoop(run, self.kit, self.faults, self.emit, self.summed)
        self.overlap = None  # the overlapped round (runtime/distributed/overlap.py, docs/overlap.md)
        self.hooks = run.hooks  # the faults a test or the chaos harness injects (runtime/hooks.py)
        if self.elastic:
            from .elastic import QuorumExchange

            self.exchange = QuorumExchange(self)
        else:
            if any(f.kind in ("leave", "join") for f in sc.faults):
                raise RunError(STATIC_MEMBERSHIP_FAULTS)
            self.exchange = StaticExchange(self)
        # the round's update: screen, combine, check, step, warnings; its codec is the round in progress's (the
        # combiner, or Streaming DiLoCo's fragment of the round: methods/base.py, round_codec)
        self.update = RoundUpdate(
            self.combiner, self.outer, lambda whole: lay_out_like(whole, self.params), self.names, self.me,
            self.hooks, rank=run.rank, device=run.device, summed=self.summed, elastic=self.elastic,
            overlapped=method.overlapped(sc), theta_changed=self.exchange.theta_changed, emit=self.emit,
            count=lambda name: run.telemetry.count(name), speaks=run.is_leader,
            stood_aside=lambda why: setattr(run, "outvoted", why))  # fmt: skip
        # the leader's exchange on every rank of the region (elastic: its exchange may re-form the quorum and
        # retry, so the ranks wait for it outside Gloo)
        self.sharing = RegionShare(run, self.n, self.d, summed=self.summed, wait_for_leader=(
            (lambda: run.wait_for_leader("the round's exchange", self.exchange.leader_wait_s())) if self.elastic
            else None))  # fmt: skip
        # a round whose vote did not commit it, rolled back (elastic regions)
        self.owners = OwnerResiduals(self)
        self.rollback = RoundRollback(
            run, self.codec, self.owners, self.params, self.names, self.me, self.faults,
            keeps_local_state=method.keeps_local_state, emit=self.emit,
            stats=(lambda: self.exchange.state.stats) if self.elastic else None)  # fmt: skip
        if method.overlapped(sc):
            from .overlap import RankOverlap

            shaper = WanShaper(sc.wan_model(), run.options.wan)
            self.overlap = RankOverlap(run, method, self.combiner, self.outer, self.params, self.kit.manifest,
                                       shaper, self.exchange.shaper_s(list(range(self.n))), self.summed,
                                       self.kit.payload_nbytes)  # fmt: skip
            self.overlap.update = self.update
            # (static: the plan's sharded exchange, when it picks it, and its shaper's time)
            self.overlap.planning, self.overlap.exchange = self.planning, self.exchange
            self.planning.overlap = self.overlap
            if self.elastic:  # the quorum's exchange runs on the leader's thread; this loop applies it
                self.overlap.quorum = self.exchange
        # this region's inner steps and payload of a round
        self.inner = InnerSteps(run, method, self.codec, self.params, self.tr, self.me, overlap=self.overlap,
                                planning=self.planning, modeled_payload_nbytes=self.kit.modeled_payload_nbytes,
                                elastic=self.elastic)  # fmt: skip
        # the leader's exchange of a plain or an overlapped round, shared inside the region
        self.leader = LeaderExchange(run, self.exchange, self.planning, self.sharing, self.combiner, self.faults,
                                     self.me, summed=self.summed, elastic=self.elastic, overlap=self.overlap,
                                     slot_nbytes=lambda: self.update.codec.payload_nbytes())  # fmt: skip
        # elastic overlapped rounds: the exchanges in flight, recorded when they arrive
        self.in_flight = None
        if self.overlap is not None and self.elastic:
            self.in_flight = ExchangesInFlight(run, self.overlap, self.planning, self.exchange, self.update,
                                               self.rollback)  # fmt: skip
            self.overlap.share, self.overlap.observe_arrived = self.leader.share, self.in_flight.observe_arrived
        # the index in ``run.plans`` of the plan the round in progress runs, as a healing state gave it
        self.healed_round_plan: int | None = None
        # the rounds' checkpoints: when due, written, resumed, with this loop's components' state
        self.checkpointing = RoundCheckpoints(
            run, self.params, self.outer, self.codec, overlap=self.overlap, owners=self.owners, faults=self.faults,
            planning=self.planning, exchange=self.exchange, label=(method.name, self.names[self.me]))  # fmt: skip
        # evaluation and checkpoints where they hold no other region up, measured as this region's overhead
        self.overhead = RoundOverhead(run, self.checkpointing, self.exchange, self.hooks, self.names[self.me],
                                      eval_every_rounds=self.tr.eval_every_rounds, overlapped=self.overlap is not None,
                                      elastic=self.elastic)  # fmt: skip

    @property
    def slot_nbytes(self) -> int:
        """One gathered payload of the round in progress (its slot's size on the wire)."""
        return self.update.codec.payload_nbytes()

    @property
    def sharded(self):
        """The sharded exchange in force (None: the all-gather or the dense sum): the plan's choice."""
        return self.planning.sharded

    def emit(self, record: dict[str, Any]) -> None:
        """A record of the run, on the rank that keeps the records (static: rank 0; elastic: every leader)."""
        if self.run.keeps_records:
            self.run.telemetry.emit(record)

    # ---- the run ----------------------------------------------------------------------------------------
    def run_loop(self) -> dict[str, Any]:
        run, method, checkpointing = self.run, self.method, self.checkpointing
        if not checkpointing.resumed:  # (a resumed run plans from the profiles its checkpoint holds)
            self.exchange.share_calibration(self.planning.calibrate())
        self.exchange.start()
        if checkpointing.resumed:
            checkpointing.resume()
        first = True
        while True:
            # 1. who trains this round
            self.hooks.at("quorum", self.names[self.me], run.rounds + 1, rank=run.rank)
            view = self.exchange.open_round(first)
            if view.resume_round is not None:
                checkpointing.resume_at(view.resume_round)
                continue
            # elastic: the round's quorum, a round trip through the Lighthouse that every live region asks for as
            # its last exchange ends (so nobody waits there for a slower one's compute: that wait is in the exchange)
            run._mark("comm_wait" if self.elastic else "straggler_wait")
            quorum_end = run._cursor
            first = False
            # overlapped, a region healed at the quorum of the exchange about to leave joins that exchange at once
            # (with no update: it trained nothing this round), and trains from the next round on
            joined_now = view.healed and self.overlap is not None
            if view.healed:  # the live state first (its plan loop too), then this round's news, as the others
                self.overhead.healed()
                self.healed_round_plan = self.exchange.apply_healed(view.state)
                if method.keeps_local_state:  # (its local state is of rounds the run went on without)
                    run.worker.load_global(self.params)
                self.hooks.forget(self.names[self.me])  # (a restarted process healed into the run: not killed again)
            planning = self.planning
            if view.calibration:
                planning.use_calibration(view.calibration)
            if planning.wan.probe_due(run.rounds) \
                    and not view.healed and len(view.members) > 1:  # (every member at round 0 alike: the first quorum)
                planning.probe_wan(view.members, self.exchange)
            if run.stopping.spent(run.tokens_done):
                break
            r = run.rounds  # 0-based index of this round (fault schedule); round records count from 1
            self.update.codec = method.round_codec(self.combiner, r)
            method.round_codec(self.codec, r)  # (what this region sends: the round's, whatever rounds it missed)
            # 2. faults and plan
            effects, new_faults = self.faults.at_round(r, view.members, run._now())
            for record in new_faults:
                self.emit({"type": "fault", **{k: v for k, v in record.items() if k != "tokens_lost"}})
            if self.me in effects.joined:  # back as a restarted process would be
                self.inner.restart()
            run.worker.slowdown = (self.sc.regions[self.me].slowdown * self.faults.speed(self.me)
                                   * self.hooks.slowdown(self.names[self.me], r + 1))  # fmt: skip
            if effects.remake:
                planning.planned_for = None
            in_exchange = [i for i in view.members if not self.faults.away(i)]
            members = [i for i in in_exchange if not (joined_now and i == self.me)]  # the round's trainers
            if not members:
                raise RunError(f"round {r + 1}: every live region is away (the scenario's leave faults)")
            self.exchange.members_known(view, members)
            header = None
            if planning.propose(members) and not self.elastic:  # (elastic: the round's header records it)
                run.plans.append(planning.plan)
                self.exchange.planned(planning.plan, members, r)
            if self.elastic:  # the round's header: the maker's plan, trained by all
                if view.quorum:  # (overlapped rounds after the first: shipped at the last exchange's quorum)
                    # (one healed at an overlapped exchange's quorum trains from the next round: that one's header)
                    self.exchange.agree_round(view.members, members, planning.plan, planning.plan_reason,
                                              r + 2 if joined_now else r + 1)  # fmt: skip
                header = self.exchange.agreement.header_for(r + 1)
                if header is not None:
                    members = self._adopt(header, r)
                elif self.overlap is None:  # no round without its header: take part in the exchange (so the
                    # others are not held to the deadline) with nothing, vote no, and roll back with them
                    result, _ = self.leader.plain(None, members, 0.0, self.overhead.s)
                    self.exchange.agreement.settled(not result.void, result.why, r + 1)
                    self.rollback.roll_back(r, {}, None, result.why or self.exchange.agreement.refusal or "no header")
                    continue
                elif not joined_now:  # overlapped: its exchange leaves under way already; it votes no on it
                    self.exchange.agreement.refused_rounds.add(r + 1)
                    if not run.plans:
                        run.plans.append(planning.plan)
            # the plan this round runs (a re-plan made during it is in force from the next round); one healed at
            # the quorum of an exchange about to leave takes the plan the others' round ran, which the plan loop
            # measures that exchange against when it arrives
            healed_at = self.healed_round_plan if joined_now else None
            plan_at = len(run.plans) - 1 if healed_at is None else healed_at
            if self.elastic:  # (what a region healed during this round is told it runs)
                self.exchange.state.round_plan_at = plan_at
            plan = run.plans[plan_at]
            if self.elastic and (header is None or healed_at is not None):
                # (overlapped: a region without the round's header, which votes no on its exchange, or one healed
                # at this quorum, trains under the plan the others' round ran: only the members it was made for;
                # a region that joins at the same quorum trains from the next round, as this one does)
                workers = {w.name for w in plan.workers}
                members = [i for i in members if self.names[i] in workers]
            entries = {i: plan.worker(self.names[i]) for i in members}
            rs = round_steps([entries[i] for i in members], self.seq, run.tokens_done, run.stopping.token_cap, plan,
                             overlapped=self.overlap is not None)  # fmt: skip
            steps = dict(zip(members, rs.steps))
            planned = {i: entries[i].batch * steps[i] * self.seq for i in members}
            checkpoint_due = checkpointing.due(run.rounds + 1)  # after this round
            # the run's last round by its tokens (by a time budget: known once the round is reported)
            last = run.tokens_done + rs.tokens >= run.stopping.token_cap
            self.overhead.after_quorum()  # (the last round's evaluation)
            # 3. inner steps
            if self.in_flight is not None:  # (until the round is counted: an exchange arriving now re-plans the next)
                self.in_flight.in_round = True
            run._mark("other")
            round_start = run._cursor
            once = effects.once.get(self.me, set())
            payload, split = None, None
            snapshot = self.rollback.snapshot() if self.elastic and self.overlap is None else None
            if self.me in members and (header is not None or not self.elastic or self.overlap is not None):
                payload, split = self.inner.train(entries, steps, rs, members, plan, once, last or checkpoint_due)
            run._mark("compute")
            # (overlapped: less the wait for the exchange that arrived at the apply step, its outer step and an
            # evaluation there: the region's own compute, which the plan loop re-plans from)
            compute_s = run._cursor - round_start - (self.overlap.apart_s if self.overlap is not None else 0.0)
            # (overlapped: with the outer step and an evaluation at the apply step, less the wait there)
            apart = self.overlap.apart_s - self.overlap.waited_s if self.overlap is not None else 0.0
            overhead_s = self.overhead.measure(quorum_end, round_start, apart)
            self.hooks.at("send", self.names[self.me], r + 1, rank=run.rank)
            # 4. exchange over the members' leaders
            sent_before, wire_before = run.transport.wan_bytes, tx_bytes(run._iface)
            if self.overlap is not None and self.elastic:
                # the exchanges that arrived during this round: their rounds' records before the next exchange's
                # quorum, where a region whose own exchange failed heals with the live state, records included
                # (recorded after it, the writer healed there never had the round it healed over)
                self.in_flight.record_arrived(compute_s, 0.0)
            if self.overlap is not None:
                result, comm_s = self.leader.overlapped(payload, split, in_exchange, compute_s, overhead_s,
                                                        quorum=not joined_now)  # fmt: skip
                self.overhead.exchange_ended()
            else:
                result, comm_s = self.leader.plain(payload, members, compute_s, overhead_s)
                self.overhead.exchange_ended()
                if self.elastic:
                    self.exchange.agreement.settled(not result.void, result.why, r + 1)
                if result.void:  # the round's vote did not commit it: rolled back on every region, tried again
                    self.rollback.roll_back(r, planned, snapshot, result.why)
                    continue
            wire_after = tx_bytes(run._iface)
            # 5. screen, combine, step (overlapped: the previous round's update, applied inside this round)
            outcome = self.update.apply(result, members, run.rounds + 1) if self.overlap is None else None
            run.rounds += 1
            if self.in_flight is not None:
                self.in_flight.in_round = False
            if self.overlap is not None:
                run.tokens_done += rs.tokens  # (the update of these tokens is formed when the exchange arrives)
                if self.elastic:  # (with what the plan loop measures it against when it arrives)
                    self.in_flight.launched(planned, plan, steps, entries, run.rounds)
                drained = run.stopping.spent(run.tokens_done) or checkpoint_due
                if drained:
                    # the last round's exchange (nothing is left to hide it under), or one a checkpoint must not
                    # hold: waited for now
                    self.overlap.drain()
                    comm_s += self.overlap.take_waited()
                if self.elastic:  # an exchange waited for since (drained): its record now
                    self.in_flight.record_arrived(compute_s, comm_s)
                    self.in_flight.agree_clocks()  # (with this round counted: the run ends with it)
                    if run.stopping.time_up:  # the time budget is spent: the exchange in flight is the run's last
                        self.overlap.drain()
                        self.in_flight.record_arrived(compute_s, comm_s + self.overlap.take_waited())
                        self.in_flight.agree_clocks()
                    self.overhead.end_round(checkpoint_due)
                    continue
                outcome = self._applied_meanwhile(members)
            lost = {i: planned[i] for i in outcome["lost"] if i in planned}
            if self.overlap is None:  # the budget counts tokens whose updates reached θ
                run.tokens_done += sum(planned[i] for i in outcome["took_part"] if i not in outcome["lost"])
                self.planning.observe(result, outcome, steps, entries)
            run.tokens_lost += sum(lost.values())
            self.faults.count_lost(r, lost)
            # 6. records, evaluation, checkpoint
            self.update.warn(outcome, run.rounds)
            if self.overlap is not None:  # (the leader) the exchange that arrived this round goes with the report
                self.leader.note_overlap_wire()
            reports = self.exchange.end_round(result, members, outcome, lost, planned, compute_s, comm_s,
                                              payload=payload, split=split, sent_before=sent_before,
                                              wire_before=wire_before, wire_after=wire_after,
                                              overhead_s=overhead_s)  # fmt: skip
            if self.overlap is not None:  # (static) measured and re-planned from the round's reports
                self.planning.observe_reports(reports, members, steps, entries, drained)
            if self.elastic:  # the members' clocks came with the round's exchange (static: with its report)
                run.stopping.agree_elapsed([i.get("elapsed_s") for i in result.infos])
            if self.overlap is not None and run.stopping.time_up:  # the time budget is spent: the exchange in flight is
                self.overlap.drain()  # the run's last (nothing is left to hide it under)
                self.update.warn(self._applied_meanwhile(members), run.rounds)
            self.overhead.end_round(checkpoint_due)
            # the round's buffers (the payloads, a dense sum, the update: several bytes per parameter on a
            # leader) are not held through the next round's compute peak
            del result, outcome, payload
        return self.exchange.finish()

    # ---- the parts of a round ----------------------------------------------------------------------------
    def _adopt(self, header, round_index: int) -> list[int]:
        """Train the round as its header says (elastic): the maker's plan and exchange, whatever this region's
        own plan loop proposed (a proposal of its own made since, for a reason the header does not carry yet,
        stays its proposal for the next header). Returns the round's members."""
        trained, planning = header.trained_plan(), self.planning
        if planning.plan is not None and trained.digest() == planning.plan.digest():
            planning.plan_reason = "unchanged"
        if planning.plan is None or planning.plan_reason == "unchanged":
            planning.plan = trained
        if not self.run.plans or self.run.plans[-1].digest() != header.digest or header.reason != "unchanged":
            self.run.plans.append(trained)
            self.exchange.planned(trained, list(header.members), round_index, header)
        planning.use_exchange(header.exchange)
        return list(header.members)

    # ---- overlapped rounds: the updates applied inside the round ------------------------------------------
    def _applied_meanwhile(self, members: list[int]) -> dict[str, Any]:
        """The outcome of the updates the overlapped round applied (rejected or missed payloads; no lost tokens)."""
        return self.update.meanwhile(members, self.overlap.take_rejected(), self.overlap.take_dropped())


def run_rounds(run: RankRun) -> dict[str, Any]:
    """The round loop of a round-based method on this rank of ``run`` (set up); returns the summary's method
    fields."""
    return RoundLoop(run).run_loop()
