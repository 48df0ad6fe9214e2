"""The plan as a loop (docs/design/architecture.md), the component of the distributed round loop
(:class:`.rounds.RoundLoop`) that plans: the members planned over the WAN that links them now, from their profiles
measured in place before round 0 (:class:`~.calibration.Calibration`, ``planning.calibration``); every round's
measured compute times folded into the online planner (:class:`~geomesh.planner.OnlinePlanner`) on every rank alike,
re-planning at the same round when a speed drifts; the WAN measured as compute is
(:class:`~.wan_measurement.WanMeasurement`, ``planning.wan``), probed before round 0 (where the exchange kind is
chosen again over it) and re-planned for when it drifts past its noise; and this state in checkpoints and a healed
region's state, so a resumed or healed region plans what the uninterrupted run does. The plan settles
(:mod:`geomesh.planner.settle`): regions that measure alike are planned alike, each region's first round is warm-up,
not its speed, the table is corrected at the batches the plan runs, and a re-plan that moves no work is none.

:class:`PlanLoop` is a component the round loop holds (``loop.planning``): it owns the plan in force, the members it
was made for and why, the exchange kind the plan is made for (``sharded``), and what the loop measured; the loop
hands it values (members, what arrived, the steps it ran) and reads the plan back."""

from __future__ import annotations

from typing import Any, Callable

from ...network import WanModel
from ...planner import OnlinePlanner, Plan
from ...planner.settle import settled_profiles
from ...planner.wan import WanEstimator, time_parts
from .calibration import Calibration
from .exchange import Exchanged, reported_overhead_s
from .wan_measurement import WanMeasurement, seconds


class PlanLoop:
    """Planning, calibration and re-planning for the rounds of ``run`` (set up; ``kit``: its codec, combiner and
    payload sizes; ``faults``: the scenario's; ``emit``: the run's records; ``summed``: dense updates summed by an
    all-reduce)."""

    def __init__(self, run: Any, kit: Any, faults: Any, emit: Callable[[dict[str, Any]], None], summed: bool):
        from .sharded_loop import loop_exchange

        self.run, self.kit, self.faults, self.emit, self.summed = run, kit, faults, emit, summed
        self.method, self.sc = run.method, run.scenario
        self.tr = self.sc.training
        self.names = [r.name for r in self.sc.regions]
        self.n, self.me = len(self.names), run.region
        self.combiner = kit.combiner
        self.plan: Plan | None = None
        self.planned_for: list[int] | None = None
        self.plan_reason = "unchanged"  # why the plan in force is what it is (the round header says it)
        g = self.sc.geomesh
        # the plan as a loop: profiles measured in place before round 0, then re-planned from every round's
        # measured compute times; the same numbers on every rank, so every rank holds the same plan
        given = {pair.partition("=")[0] for pair in run.options.profiles}  # (--profile: not measured)
        self.calibration = Calibration(self.method.balanced and g.calibrate, self.names[self.me] in given)
        self.online: OnlinePlanner | None = None
        # the WAN measured as compute is: re-planned as compute is, so only where that is on
        self.wan = WanMeasurement(WanEstimator(threshold=g.replan_threshold, noise_k=max(g.replan_noise_k, 1.0))
                                  if self.calibration.on and g.replan and g.measure_wan else None, run.hooks)
        self.exchange_switched = False  # the probed WAN chose the other exchange kind: the round is planned again
        self.overlap = None  # the overlapped round, when the method overlaps (its exchange in flight)
        self.sharded = loop_exchange(self)  # the exchange kind: the sharded one, or None (chosen again after probes)

    @property
    def wire_nbytes(self) -> int:
        """What one leader hands to the cross-region collective per round."""
        return 4 * (self.kit.manifest.numel + 1) if self.summed else self.kit.payload_nbytes

    @property
    def exchange_kind(self) -> str:
        """The exchange the rounds use now: ``sharded``, ``all_reduce`` (unsigned dense sums) or ``all_gather``."""
        return "sharded" if self.sharded is not None else "all_reduce" if self.summed else "all_gather"

    def use_exchange(self, kind: str) -> None:
        """The exchange kind ``kind`` (an agreed round's header, a checkpoint) in force from now on (a dense sum
        stays a sum)."""
        if kind == self.exchange_kind or kind == "all_reduce" or self.summed:
            return
        from ...codec.sharded_sparse import sharded_exchange

        bits = self.sc.geomesh.shard_bits
        self.sharded = sharded_exchange(self.combiner, self.n, bits) if kind == "sharded" else None

    def propose(self, members: list[int]) -> bool:
        """The plan for ``members``, made again when they are not the members the plan in force was made for,
        with the reason (every rank alike). Whether a plan was made."""
        if self.planned_for == members:
            return False
        was = self.planned_for
        self.plan = self.make_plan(members)
        self.plan_reason = ("the run's first plan" if not self.run.plans
                            else "members changed: " + ", ".join(self.names[i] for i in members)
                            if was is not None and set(was) != set(members)
                            else "the round's faults or members changed")  # fmt: skip
        self.planned_for = list(members)
        return True

    def planning_wan(self, members: list[int]) -> WanModel:
        """The WAN the plan fills the round against: the declared one (the scenario's, with its faults), as
        measured in place when the loop measures it."""
        return self.wan.measured(self.faults.wan(members))

    @property
    def plan_sc(self):
        """The scenario the round is planned on: this run's, its exchange resolved to the one in force (a
        re-sparsified sharded exchange has shorter rounds, ``CompressedMethod.constraints``)."""
        from ...planner.exchange import with_exchange

        return with_exchange(self.sc, "sharded" if self.sharded is not None else "all_gather")

    def make_plan(self, members: list[int]) -> Plan:
        """The members planned over the WAN that links them now, at their speeds now (every rank alike)."""
        wan = self.planning_wan(members)
        self.wan.assume()
        exchange_s = self.plan_exchange_s(wan)
        profiles = [self.run.profiles[i] for i in members]
        for p, i in zip(profiles, members):
            p.slowdown = self.sc.regions[i].slowdown * self.faults.speed(i)
        if not (self.method.balanced and self.sc.geomesh.replan):
            if self.method.balanced:  # regions calibrated alike (within their calibrations' noise) planned alike
                profiles = settled_profiles(profiles, self.method.constraints(self.plan_sc, len(profiles)),
                                            self.sc.geomesh.replan_noise_k)  # fmt: skip
            return self.method.plan(self.plan_sc, profiles, exchange_bytes=self.kit.modeled_payload_nbytes,
                                    exchange_s=exchange_s)  # fmt: skip
        # re-planned from measurements: the speed factors learned so far carry over to the new members' planner
        known = self.online
        self.online = self.calibration.online_planner(self.plan_sc, self.method, profiles)
        if known is not None:
            self.online.adopt(known)
        return self.online.plan(self.kit.modeled_payload_nbytes, exchange_s)

    def arrival_margin(self) -> float:
        """How much later than the plan's exchange time this region's overlapped round applies the exchange in
        flight (:meth:`.WanMeasurement.arrival_margin`, with this region's compute noise)."""
        name = self.names[self.me]
        compute = (self.online.noise(name) if self.online is not None and name in self.online.factors else None) or 0.0
        return self.wan.arrival_margin(compute, self.sc.geomesh.replan_noise_k)

    def plan_exchange_s(self, wan: WanModel) -> float:
        """The plan's exchange time over ``wan``: the exchange kind in force (the sharded one or the method's
        collective) for the timing model's payload, as the emulated runtime times it."""
        payload = self.kit.modeled_payload_nbytes
        if self.sharded is None:
            return self.method.exchange(wan, payload)[0]
        from ...planner.exchange import scenario_exchange_seconds

        return scenario_exchange_seconds(self.sc, wan, self.method.collective, payload, "sharded", self.combiner)

    def choose_exchange_measured(self) -> None:
        """Every rank, after the WAN probe (before round 0's exchange, every rank with the same figures): the
        exchange kind (all-gather or sharded, ``geomesh.exchange: auto``) chosen again over the WAN as measured,
        and the choice recorded with the modeled seconds of each kind. Chosen once: a run does not switch kinds
        mid-run (a sharded layout's owners hold state, and every rank would have to switch at one round)."""
        from .sharded_loop import exchange_choice, loop_exchange

        wan = self.wan.measured(self.sc.wan_model())
        choice = exchange_choice(self, wan)
        if choice is None:
            return
        if (choice.name == "sharded") != (self.sharded is not None):
            self.sharded = loop_exchange(self, wan)
            self.exchange_switched = True  # a plan made for the other kind is made again (_replan_after_probe)
        w = self.wan.estimator
        self.emit({"type": "exchange_choice", "round": self.run.rounds, "time": self.run._now(),
                   "exchange": choice.name, "wan": "measured", "latency_factor": w.latency_factor,
                   "transfer_factor": w.transfer_factor, "reason": choice.reason,
                   "seconds": {k: c.seconds for k, c in choice.candidates.items()}})  # fmt: skip

    def calibrate(self) -> dict[str, Any] | None:
        """Every rank of this region: its step time measured in place (:meth:`.Calibration.measure`), unless
        ``--profile`` names it. Returns what the leader shares with the others (JSON)."""
        if not self.calibration.due:
            return None
        # measure the micro-batches the plan may use: up to the largest the datasheet plan gives any region, and
        # the reference batch (the planning rule's round is made of it, and the slowest region runs it)
        datasheet = self.method.plan(self.plan_sc, self.run.profiles, exchange_bytes=self.kit.modeled_payload_nbytes)
        top = max([self.tr.batch, *(w.micro_batch for w in datasheet.workers)])
        g = self.plan_sc.geomesh
        return self.calibration.measure(self.run.worker, top, self.tr.batch, g.calibration_window_s,
                                        g.calibration_budget_s)  # fmt: skip

    def use_calibration(self, shared: dict[int, dict[str, Any] | None]) -> None:
        """Every rank: plan from the regions' measured profiles (region -> what :meth:`calibrate` returned), each
        taken once, when first seen."""
        measured = self.calibration.take({self.names[i]: c for i, c in shared.items()})
        if not measured:
            return
        cal = self.calibration
        self.run.profile_source.use_measured(cal.profiles)
        self.planned_for = None  # plan (again) from the measured profiles
        self.emit({"type": "calibration", "time": self.run._now(), "seconds": dict(cal.seconds),
                   "profiles": {n: p.to_json() for n, p in measured.items()}})  # fmt: skip
        if self.run.keeps_records and self.run.options.progress:
            costs = ", ".join(f"{n} {s:.2f} s" for n, s in cal.seconds.items())
            print(f"[{self.method.name}] calibrated in place: {costs}", flush=True)

    def summary_fields(self) -> dict[str, Any]:
        """What the summary says about the plan's loop."""
        return {"replans": int(self.run.telemetry.counters.get("replans", 0)),
                "calibration_s": dict(self.calibration.seconds) or None,
                "wan_measured": self.wan.summary(),
                "wan_probe_s": self.wan.probe_s,
                "straggler_idle_per_round": list(self.run.ledger.round_idle)}  # fmt: skip

    # ---- the WAN, measured ----------------------------------------------------------------------------------
    def exchange_cost(self, members: list[int]) -> Callable[[WanModel], float]:
        """The time of this run's exchange among ``members`` on a WAN, for the bytes it really moves."""
        if self.sharded is not None:
            from .sharded_loop import sharded_sizes

            slices, combined = sharded_sizes(self, len(members))
            return lambda wan: wan.sharded_s(slices, combined)
        nbytes = self.wire_nbytes
        return (lambda wan: wan.allreduce_s(nbytes)) if self.summed else (lambda wan: wan.allgather_s(nbytes))

    def time_parts(self, members: list[int]) -> tuple[float, float]:
        """The latency and transfer parts of this run's exchange among ``members`` over the declared WAN."""
        return time_parts(self.exchange_cost(members), self.faults.wan(members))

    def probe_wan(self, members: list[int], exchange: Any) -> None:
        """Every rank, before round 0: the WAN probed (:meth:`~.wan_measurement.WanMeasurement.probe`; the leaders
        over ``exchange``), reported as calibration is; the exchange kind is chosen again over it, and a plan
        already made is made again when the probes moved its exchange."""
        run = self.run
        share = (lambda medians: medians) if run.region_group is None else (  # (the leader's, to its region)
            lambda medians: run.transport.broadcast_json(medians, run.leader, run.region_group, what="the WAN probes"))
        self.wan.probe(self.faults.wan(members), self.wire_nbytes, exchange if run.is_leader else None, members, share)
        self.emit({"type": "wan_probe", "time": run._now(), "seconds": self.wan.probe_s,
                   "wan_measured": self.wan.summary()})  # fmt: skip
        if run.keeps_records and run.options.progress:
            w = self.wan.estimator
            print(f"[{self.method.name}] WAN probed in {self.wan.probe_s:.2f} s: latency x{w.latency_factor:.2f}, "
                  f"transfer x{w.transfer_factor:.2f} the declared", flush=True)  # fmt: skip
        self.choose_exchange_measured()
        self._replan_after_probe(members)

    def _replan_after_probe(self, members: list[int]) -> None:
        """A plan already made over the declared WAN (a static run plans at its start, before the probe) is made
        again over the measured one when the probes moved its exchange (the overlapped round's stretch and apply
        step, and the exchange kind's time, come from the WAN measured before round 0)."""
        if self.planned_for is None or self.online is None:
            return
        if self.exchange_switched:  # the round's length may depend on the exchange's kind
            self.exchange_switched = False
            kind = "sharded exchange" if self.sharded is not None else "all-gather"
            why = f"the exchange chosen over the probed WAN is the {kind}"
            self._replanned(self.make_plan(self.planned_for), {}, why, {"took_part": list(members)})
            return
        why = self.wan.probed_drift(*self.time_parts(self.planned_for))
        if why is None:
            return
        exchange_s = self.plan_exchange_s(self.planning_wan(self.planned_for))
        self._replanned(self.online.plan(self.kit.modeled_payload_nbytes, exchange_s), {}, why,
                        {"took_part": list(members)})  # fmt: skip

    def note_wire(self, wire_s: float, round_number: int | None = None) -> None:
        """(leader) The exchange of round ``round_number`` (default: this round's) took ``wire_s`` on the wire
        (its wait for the slowest member left out; an overlapped exchange: from its launch to its arrival, its
        wait at the apply step left out): reported with the next info this leader sends."""
        self.wan.note_wire(wire_s, self.run.rounds + 1 if round_number is None else round_number)

    def observe_wan(self, result: Exchanged, wire_round: int | tuple[int, ...] | None = None) -> str | None:
        """Fold the previous exchange into the WAN's measurement (every rank alike); why to re-plan, when the
        WAN drifted past the measurements' noise. ``wire_round``: the round(s) of the exchange the reports may
        be of (default: the round before this one)."""
        expected = (self.run.rounds - 1,) if wire_round is None else (
            wire_round if isinstance(wire_round, tuple) else (wire_round,))  # fmt: skip
        return self.wan.observe(result.infos, expected, self.time_parts)

    def observe(self, result: Exchanged, outcome: dict[str, Any], steps: dict[int, int], entries: dict,
                plan: Plan | None = None, wire_round: int | tuple[int, ...] | None = None,
                after_round: int | None = None) -> None:  # fmt: skip
        """Fold a round's measured compute times (every member's leader reports its own) into the online
        planner, and re-plan at this round on every rank when a region's speed drifted past the threshold, or
        the WAN's (:meth:`observe_wan`). ``plan``: the plan that round ran (default: the plan in force; an
        overlapped exchange arrives a round later, maybe under a newer plan); ``wire_round``: see
        :meth:`observe_wan`; ``after_round``: the round after which a re-plan is in force (default: this
        one, counted)."""
        ran = self.plan if plan is None else plan
        wan_drift = self.observe_wan(result, wire_round) if result.infos else None
        if self.online is None or not result.infos:
            return
        measured = {}
        as_planned = self.run.hooks.compute_as_planned
        for info in result.infos:
            i, c = info.get("region"), seconds(info.get("compute_s"))
            full = i in steps and steps[i] == entries[i].inner_steps  # a shortened last round says nothing new
            if i in outcome["took_part"] and full and c is not None:
                measured[self.names[i]] = entries[i].compute_s if as_planned else c
        for name, c in measured.items():
            self.online.observe(name, c, ran)
        for info in result.infos:  # each member's round overhead (after its compute: its warm-up is not folded)
            i, o = info.get("region"), reported_overhead_s(info)
            name = self.names[i] if i in outcome["took_part"] else None
            if o is not None and name in self.online.overheads:  # (tests: as planned, as compute is)
                planned_o = entries[i].overhead_s if i in entries else 0.0
                self.online.observe_overhead(name, planned_o if as_planned else o)
        if wan_drift is not None:  # the same members over the measured WAN (their speeds as measured now)
            exchange_s = self.plan_exchange_s(self.planning_wan(self.planned_for))
            self.wan.assume()
            self._replanned(self.online.plan(self.kit.modeled_payload_nbytes, exchange_s), measured, wan_drift, outcome,
                            after_round)  # fmt: skip
            return
        online = self.online
        moved = {n: (online.overhead_assumed.get(n, 0.0), online.round_overhead(n)) for n in online.overhead_moved()}
        replanned = online.maybe_replan(self.kit.modeled_payload_nbytes, self.plan.exchange_s)
        if replanned is not None:
            self._replanned(replanned, measured, None, outcome, after_round, overheads=moved)

    def _replanned(self, replanned: Plan, measured: dict[str, float], wan_drift: str | None, outcome,
                   after_round: int | None = None, overheads: dict[str, tuple[float, float]] | None = None) -> None:
        """A re-plan at this round (every rank alike): in force from the next round, recorded with its reason
        (``overheads``: the regions whose round overhead moved, name -> (assumed, measured) seconds)."""
        run, plan = self.run, self.plan
        number = run.rounds if after_round is None else after_round
        planned_s = {w.name: w.compute_s for w in plan.workers}
        self.plan = replanned
        run.plans.append(replanned)
        self.plan_reason = f"re-planned after round {number}"  # (the next round's header says so)
        ov = self.overlap
        if wan_drift is not None and ov is not None and ov.in_flight_s > 0:  # the exchange in flight is now
            ov.in_flight_s = replanned.exchange_s  # expected as the measured WAN has it (its apply step)
        run.telemetry.count("replans")
        drift = wan_drift or "compute measured against planned: " + ", ".join(
            f"{n} measured {m:.3g} s vs planned {planned_s[n]:.3g} s" for n, m in measured.items() if n in planned_s)
        if overheads:  # (a region slower outside its inner steps: the others no longer wait for it)
            drift += "; round overhead measured against planned: " + ", ".join(
                f"{n} measured {m:.3g} s vs planned {a:.3g} s" for n, (a, m) in overheads.items())
        self.emit({"type": "plan", "round": number, "time": run._now(), "plan": replanned.to_json(),
                   "replan": True, "measured_s": measured, "planned_s": planned_s, "reason": drift})  # fmt: skip
        if run.keeps_records and run.region == min(outcome["took_part"] or [self.me]):
            print(f"[{self.method.name}] re-planned after round {number}: {drift}", flush=True)

    def plan_state(self) -> dict[str, Any]:
        """The plan's loop state (JSON): the profiles measured in place and the online planner's speed factors,
        so a resumed or healed region plans what the uninterrupted run does."""
        return {**self.calibration.state_dict(),
                "online": self.online.state_dict() if self.online is not None else None,
                "online_for": [f for f in (self.online.factors if self.online is not None else {})],
                # the members the plan in force (the last of the run's plans) was made for: a resumed or healed
                # region keeps that plan while the members stay, as the uninterrupted run does
                "planned_for": None if self.planned_for is None else list(self.planned_for),
                **self.wan.state_dict(),
                # (a leader) an overlapped exchange's wire time that arrived and is not noted yet: a resumed
                # leader reports what the uninterrupted one does
                "overlap_wire": list(self.overlap.wire) if self.overlap is not None and self.overlap.wire else None,
                # the exchange kind chosen over the WAN measured before round 0 (kept for the rest of the run)
                "exchange": "sharded" if self.sharded is not None else "all_gather"}  # fmt: skip

    def load_plan_state(self, state: dict[str, Any], healed: bool = False,
                        members_after_resume: list[int] | None = None) -> None:  # fmt: skip
        """The plan's loop state of :meth:`plan_state` (the run's plans already loaded): the plan in force and the
        members it was made for, the profiles measured in place, the online planner; resumed (not ``healed``:
        another region's state), this leader's last wire report too. (``members_after_resume``: what an older
        checkpoint's plan was made for.)"""
        self.plan = self.run.plans[-1] if self.run.plans else None
        planned_for = state.get("planned_for")  # (older checkpoints: the exchange's guess)
        self.planned_for = list(planned_for) if planned_for is not None else members_after_resume
        self.calibration.load_state_dict(state)
        self.run.profile_source.use_measured(self.calibration.profiles)
        self.wan.load_state_dict(state, healed)
        if not healed:  # (a healed region's pending report is another region's)
            pending = state.get("overlap_wire")
            if self.overlap is not None and isinstance(pending, list) and len(pending) == 2:
                wire, number = seconds(pending[0]), pending[1]
                if wire is not None and isinstance(number, int) and not isinstance(number, bool):
                    self.overlap.wire = (wire, number)
        if state.get("exchange") in ("sharded", "all_gather"):  # (older states: the kind chosen over the declared WAN)
            self.use_exchange(state["exchange"])
        self.online = None
        if state["online"] is not None:
            names = state["online_for"]
            profiles = [self.run.profiles[self.names.index(n)] for n in names]
            for p in profiles:
                i = self.names.index(p.name)
                p.slowdown = self.sc.regions[i].slowdown * self.faults.speed(i)
            self.online = self.calibration.online_planner(self.plan_sc, self.method, profiles)
            self.online.load_state_dict(state["online"])

    # ---- static overlapped rounds: measured where every rank has the same figures ----------------------
    def observe_reports(self, reports: list[dict] | None, members: list[int], steps: dict[int, int],
                         entries: dict, drained: bool) -> None:  # fmt: skip
        """Static overlapped rounds (their exchange carries payloads only): the round measured from the regions'
        reports (every leader gathers them and shares them inside its region, so every rank folds in the same
        figures at the same round): each region's compute of this round, and its leader's wire time of the
        exchange that arrived in it (the last round's, or this round's own when every leader drained it whole). A
        re-plan takes effect from the next round; the exchange in flight applies as launched."""
        if self.online is None and self.wan.estimator is None:
            return
        run = self.run
        keys = ("compute_s", "overhead_s", "wire_s", "wire_round")
        infos = None
        if run.is_leader:  # (each region's report is data: observe() checks every figure)
            infos = [{"region": k, **{f: i.get(f) for f in keys}} for k, i in enumerate(reports or [])
                     if isinstance(i, dict)]  # fmt: skip
            self.wan.wire = {}  # reported once
        if run.region_group is not None:
            infos = run.transport.broadcast_json(infos, run.leader, run.region_group, what="the round's reports")
        self.observe(Exchanged(infos=infos, payloads=None, summed=None, comm_s=0.0, wan_bytes=0),
                     {"took_part": list(members)}, steps, entries,
                     wire_round=(run.rounds - 1, run.rounds) if drained else run.rounds - 1)  # fmt: skip
