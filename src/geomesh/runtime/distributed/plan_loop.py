"""The plan as a loop (DESIGN.md), the part of the distributed round loop (:class:`.rounds.RoundLoop`) that
plans: the members planned over the WAN that links them now; their profiles measured in place before round 0
(:func:`~geomesh.profiler.calibrate_worker`, shared by the exchange); every round's measured compute times
folded into the online planner (:class:`~geomesh.planner.OnlinePlanner`) on every rank alike, re-planning at
the same round when a speed drifts; and this state in checkpoints and a healed region's state, so a resumed
or healed region plans what the uninterrupted run does. The plan settles (:mod:`geomesh.planner.settle`):
regions that measure alike are planned alike, each region's first round is warm-up, not its speed, the table
is corrected at the batches the plan runs, and a re-plan that moves no work is none. A part of the loop's
class: it reads the loop's fields (run, scenario, method, kit, faults, plan)."""

from __future__ import annotations

from typing import Any

from ...hardware import WorkerProfile
from ...planner import OnlinePlanner, Plan
from ...planner.settle import settled_profiles
from .exchange import Exchanged

WARMUP_ROUNDS = 1  # each region's first measured round (start-up, warm-up) is not its speed


class PlanLoop:
    """Planning, calibration and re-planning of :class:`~geomesh.runtime.distributed.rounds.RoundLoop`."""

    def make_plan(self, members: list[int]) -> Plan:
        """The members planned over the WAN that links them now, at their speeds now (every rank alike)."""
        wan = self.faults.wan(members)
        exchange_s, _ = self.method.exchange(wan, self.kit.modeled_payload_nbytes)
        profiles = [self.run.profiles[i] for i in members]
        for p, i in zip(profiles, members):
            p.slowdown = self.sc.regions[i].slowdown * self.faults.speed(i)
        if not (self.method.balanced and self.sc.geomesh.replan):
            if self.method.balanced:  # regions calibrated alike (within their calibrations' noise) planned alike
                profiles = settled_profiles(profiles, self.method.constraints(self.sc, len(profiles)),
                                            self.sc.geomesh.replan_noise_k)  # fmt: skip
            return self.method.plan(self.sc, profiles, exchange_bytes=self.kit.modeled_payload_nbytes,
                                    exchange_s=exchange_s)  # fmt: skip
        # re-planned from measurements: the speed factors learned so far carry over to the new members' planner
        known = self.online
        self.online = self._new_online(profiles)
        if known is not None:
            self.online.adopt(known)
        return self.online.plan(self.kit.modeled_payload_nbytes, exchange_s)

    def _new_online(self, profiles: list[WorkerProfile]) -> OnlinePlanner:
        g = self.sc.geomesh
        # uncalibrated profiles describe the timing model, not what trains: a first measurement is the factor;
        # wall-clock compute times are noisy: outliers held back, the deadband widened to the regions' noise,
        # regions that measure alike planned alike; a region's first round (start-up) is not its speed
        return OnlinePlanner(profiles, self.method.constraints(self.sc, len(profiles)), smoothing=g.replan_smoothing,
                             threshold=g.replan_threshold, first_measurement_sets_factor=not self.calibrated,
                             noise_k=g.replan_noise_k, warmup_rounds=WARMUP_ROUNDS)  # fmt: skip

    def calibrate(self) -> dict[str, Any] | None:
        """Every rank of this region: measure the region's step time in place (the model it really trains, a
        few steps at candidate micro-batches, its state restored bit for bit), unless ``--profile`` names it.
        Returns what the leader shares with the others (JSON)."""
        from ...profiler import calibrate_worker, default_micro_batches

        given = {pair.partition("=")[0] for pair in self.run.options.profiles}
        if not self.calibrating or self.names[self.me] in given:
            return None
        # measure the micro-batches the plan may use: up to the largest the datasheet plan gives any region, and
        # the reference batch (the planning rule's round is made of it, and the slowest region runs it)
        datasheet = self.method.plan(self.sc, self.run.profiles, exchange_bytes=self.kit.modeled_payload_nbytes)
        top = max([self.tr.batch, *(w.micro_batch for w in datasheet.workers)])
        worker = self.run.worker
        cap = getattr(worker, "max_proxy_micro_batch", None)
        cal = calibrate_worker(worker, default_micro_batches(top, cap * worker.size if cap else None, self.tr.batch))
        return {"profile": cal.profile.to_json(), "seconds": cal.seconds}

    def use_calibration(self, shared: dict[int, dict[str, Any] | None]) -> None:
        """Every rank: plan from the regions' measured profiles (region -> what :meth:`calibrate` returned)."""
        # A region's calibration enters the run's state once, when it is first seen: the same headers against
        # the same state give every rank the same decision, a healed region's too (it applies the live state
        # first). A restarted region measures itself again, but its speed since is the online planner's to
        # follow from measured rounds: taking the new table on some ranks only would part their plans.
        new = {i: c for i, c in shared.items() if c and self.names[i] not in self.calibrated}
        if not new:
            return
        measured = {self.names[i]: WorkerProfile.from_json(c["profile"]) for i, c in new.items()}
        self.calibrated = {**self.calibrated, **measured}
        self.calibration_s.update({self.names[i]: float(c["seconds"]) for i, c in new.items()})
        self.run.use_measured_profiles(self.calibrated)
        self.planned_for = None  # plan (again) from the measured profiles
        self.emit({"type": "calibration", "time": self.run._now(), "seconds": dict(self.calibration_s),
                   "profiles": {n: p.to_json() for n, p in measured.items()}})  # fmt: skip
        if self.run.keeps_records and self.run.options.progress:
            costs = ", ".join(f"{n} {s:.2f} s" for n, s in self.calibration_s.items())
            print(f"[{self.method.name}] calibrated in place: {costs}", flush=True)

    def summary_fields(self) -> dict[str, Any]:
        """What the summary says about the plan's loop."""
        return {"replans": int(self.run.telemetry.counters.get("replans", 0)),
                "calibration_s": dict(self.calibration_s) or None,
                "straggler_idle_per_round": list(self.run.round_idle)}  # fmt: skip

    def observe(self, result: Exchanged, outcome: dict[str, Any], steps: dict[int, int], entries: dict) -> None:
        """Fold the round's measured compute times (every member's leader reports its own) into the online
        planner, and re-plan at this round on every rank when a region's speed drifted past the threshold."""
        run, plan = self.run, self.plan
        if self.online is None or not result.infos:
            return
        measured = {}
        for info in result.infos:
            i, c = info.get("region"), info.get("compute_s")
            full = i in steps and steps[i] == entries[i].inner_steps  # a shortened last round says nothing new
            if i in outcome["took_part"] and full and isinstance(c, (int, float)) and c > 0:
                measured[self.names[i]] = float(c)
        for name, c in measured.items():
            self.online.observe(name, c, plan)
        replanned = self.online.maybe_replan(self.kit.modeled_payload_nbytes, plan.exchange_s)
        if replanned is None:
            return
        planned_s = {w.name: w.compute_s for w in plan.workers}
        self.plan = replanned
        run.plans.append(replanned)
        run.telemetry.count("replans")
        self.emit({"type": "plan", "round": run.rounds, "time": run._now(), "plan": replanned.to_json(),
                   "replan": True, "measured_s": measured, "planned_s": planned_s})  # fmt: skip
        if run.keeps_records and run.region == min(outcome["took_part"] or [self.me]):
            drift = ", ".join(f"{n} measured {m:.3g} s vs planned {planned_s[n]:.3g} s" for n, m in measured.items())
            print(f"[{self.method.name}] re-planned after round {run.rounds}: {drift}", flush=True)

    def plan_state(self) -> dict[str, Any]:
        """The plan's loop state (JSON): the profiles measured in place and the online planner's speed factors,
        so a resumed or healed region plans what the uninterrupted run does."""
        return {"calibrated": {n: p.to_json() for n, p in self.calibrated.items()},
                "calibration_s": dict(self.calibration_s),
                "online": self.online.state_dict() if self.online is not None else None,
                "online_for": [f for f in (self.online.factors if self.online is not None else {})],
                # the members the plan in force (the last of the run's plans) was made for: a resumed or healed
                # region keeps that plan while the members stay, as the uninterrupted run does
                "planned_for": None if self.planned_for is None else list(self.planned_for)}  # fmt: skip

    def load_plan_state(self, state: dict[str, Any]) -> None:
        """The plan's loop state of :meth:`plan_state` (the run's plans already loaded): the plan in force and the
        members it was made for, the profiles measured in place, the online planner."""
        self.plan = self.run.plans[-1] if self.run.plans else None
        planned_for = state.get("planned_for")  # (older checkpoints: the exchange's guess)
        self.planned_for = list(planned_for) if planned_for is not None else self.exchange.planned_for_after_resume()
        self.calibrated = {n: WorkerProfile.from_json(p) for n, p in state["calibrated"].items()}
        self.calibration_s = {n: float(s) for n, s in state["calibration_s"].items()}
        self.run.use_measured_profiles(self.calibrated)
        self.online = None
        if state["online"] is not None:
            names = state["online_for"]
            profiles = [self.run.profiles[self.names.index(n)] for n in names]
            for p in profiles:
                i = self.names.index(p.name)
                p.slowdown = self.sc.regions[i].slowdown * self.faults.speed(i)
            self.online = self._new_online(profiles)
            self.online.load_state_dict(state["online"])

