"""Online re-planning (beyond the paper): :func:`replan` re-plans from one set of measured compute times, and
:class:`OnlinePlanner` keeps smoothed per-worker speed factors and re-plans when one drifts; with noisy
wall-clock measurements (``noise_k``) its plan settles (alike workers planned alike, the table corrected where
the plan runs, warm-up ignored, no re-plan that moves no work). Pure: the caller passes the measurements in.

This file is long because the planner's rules share one state (speed factors, their noise and levels, the
tables' corrections, round overheads) that a checkpoint and a healed region carry whole, so that a resumed
or healed region plans what the uninterrupted run does; what needs no state is beside it (:mod:`.settle`,
:mod:`.noise`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from ..hardware import WorkerProfile
from .noise import dispersion, geomean, median, robust_sigma
from .plan import Plan, PlanConstraints, WorkerPlan, scaled_profiles
from .search import plan_balanced
from .settle import ALIKE_FLOOR, alike_groups, comparison_batches, corrected, correction_at, pooled, table_noise

# ----------------------------------------------------------------------------------------------------
# online re-planning


def _implied_factor(profile: WorkerProfile, wp: WorkerPlan, measured_compute_s: float) -> float:
    """measured / what ``profile`` (unscaled) predicts for the worker's plan."""
    if not (isinstance(measured_compute_s, (int, float)) and math.isfinite(measured_compute_s)
            and measured_compute_s > 0):  # fmt: skip
        raise ValueError(f"worker {wp.name!r}: measured compute {measured_compute_s!r} must be positive and finite")
    predicted = wp.inner_steps * profile.step_s(wp.micro_batch, wp.accum)
    return measured_compute_s / predicted


def _entry(plan: Plan, name: str) -> WorkerPlan:
    try:
        return plan.worker(name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None


def replan(
    profiles: Sequence[WorkerProfile],
    plan: Plan,
    measured_compute_s: Mapping[str, float],
    constraints: PlanConstraints,
    exchange_bytes: int | None = None,
    exchange_s: float | None = None,
) -> Plan:
    """A new balanced plan after one round's measurements.

    Each measured worker's speed factor = measured compute / the profile's prediction for its part of
    ``plan``; the profiles are copied with ``slowdown`` scaled by that factor (the caller's objects are not
    touched). The exchange defaults to the old plan's.
    """
    by_name = {p.name: p for p in profiles}
    factors = {}
    for name, measured in measured_compute_s.items():
        if name not in by_name:
            raise ValueError(f"measured compute for unknown worker {name!r}")
        factors[name] = _implied_factor(by_name[name], _entry(plan, name), measured)
    return plan_balanced(
        scaled_profiles(profiles, factors),
        constraints,
        plan.exchange_bytes if exchange_bytes is None else exchange_bytes,
        plan.exchange_s if exchange_s is None else exchange_s,
    )


NOISE_WINDOW = 12  # recent observed factors per worker that measure its round-to-round dispersion
NOISE_TRUSTED = 6  # (noise-aware) own round-to-round changes after which the measured noise alone sets the bands
SPREAD_MIN_ROUNDS = 3  # rounds since the plan a worker needs before its drift is compared with the others'
DEADBAND_FLOOR = 0.01  # (noise-aware) a re-plan that gains less than this (straggler idle, round length) is none
SHAPE_BATCHES = 8  # (noise-aware) the batches a worker's table is corrected at (the most recently measured)
OVERHEAD_WINDOW = 5  # recent rounds whose median is a worker's round overhead (an evaluation's outlier is one)
# (noise-aware) a round whose measured compute is further than this factor from its plan (either way; more once
# the rounds' noise is known: OnlinePlanner._far) is a miss far beyond the noise: re-planned for at the next round
# (at a batch the worker's rounds measured, taken as its speed at once, no round of confirmation), a warm-up round
# included when it was that much faster
MISS_FACTOR = 1.5
# (noise-aware) ... while the worker's speed level rests on fewer rounds than this: the plan is then the
# calibration's or a few rounds', and a far miss is its error. Against a level of this many rounds one far round
# is likelier a moment (a descheduled process) than a new speed: it waits for one round's confirmation
SETTLED_ROUNDS = 4
# (noise-aware) one re-plan changes the round's length by at most this factor, and gives a worker at most this
# factor more work than the plan in force gave it for its time then: a wrong single measurement (a descheduled
# process, a burst that ended) cannot make the next round many times longer; the plan steps on at the next round
ROUND_STEP = 2.0


class OnlinePlanner:
    """Re-plans between rounds when workers turn out slower or faster than their profiles say.

    ``observe`` folds one measurement into the worker's speed factor f (measured / predicted compute time,
    relative to the profile given here): ``f ← smoothing·f + (1 − smoothing)·measured/predicted``.
    ``maybe_replan`` returns a new plan (made on copies of the profiles with ``slowdown`` scaled by f) when
    some worker's |f − f_assumed| / f_assumed exceeds ``threshold``, f_assumed being the factor the current
    plan was made with; otherwise ``None``. The caller's profiles are copied, never changed.

    ``warmup_rounds``: each worker's first measurements (start-up: allocators, kernels, caches, a first
    exchange) are not its speed; that many are skipped (counted in :attr:`warmed`, for every worker alike
    from the same inputs). A worker new to the planner warms up again; :meth:`adopt` and the state carry it.

    ``noise_k`` > 0 makes both decisions aware of the measurements' noise, for wall-clock measurements (the
    distributed runtime: shared hosts, short rounds), where one round's time can be tens of percent off the
    next one's. Each worker's relative round-to-round dispersion σ is measured from its last
    :data:`NOISE_WINDOW` observations, and from all workers' pooled (:meth:`noise`: the larger counts). Then
    a worker's factor is the geometric mean of its observations since its speed last changed (at most
    :data:`NOISE_WINDOW`, each over its table's shape at its batch), not a smoothed value, and:

    - an observation further than ``max(threshold, noise_k·σ)`` from the factor at its batch (in log, as σ) is
      held back instead of folded in: a single such round is an outlier (a descheduled process) and is dropped
      when the next observation is back within the noise. Two in a row on the same side at a batch the level
      measured are a change of speed: the older observations are forgotten and f jumps to the two's mean at
      once (one re-plan to the new speed, not a chain of re-plans half-way there). Two in a row at a batch the
      level never measured (a re-plan moved the worker there) are the table's error there, not a change of
      speed: the table is corrected at that batch (its *shape*, :attr:`shape`: a ratio per batch, log-linear
      between them and the nearest beyond, :func:`~geomesh.planner.settle.correction_at`), kept across
      changes of speed, so a plan that moves a worker between batches predicts each from what was measured
      there, not from one factor applied to a table that is wrong at one of them;
    - a re-plan needs evidence: the mean of the n observations since the current plan (the last
      :data:`NOISE_WINDOW` of them) must differ from the factor that plan assumed (itself the mean of n_a
      observations) by more than ``max(threshold, noise_k·σ·√(1/n + 1/max(n_a, n)))`` (in
      log): noise alone does not re-plan the run round after round (the plan is held: a deadband), while a
      bias that one round cannot show is shown by several. The worker that passes it starts a new level from
      those n observations;
    - a plan is also remade when a worker's level holds twice the observations its assumption was made from
      and says otherwise by more than ``threshold`` (the better estimate: after 2, 4, 8 rounds of a level,
      then no more), so an early plan made from one noisy round is not kept for long;
    - and when the workers drift apart (:meth:`spread`): each may stay inside its own band (one 7% faster,
      another 7% slower than assumed) while the fast one waits for the difference, round after round. The
      drifts since the plan of the fastest and the slowest worker (at least :data:`SPREAD_MIN_ROUNDS` rounds
      each) differ by more than ``max(threshold, noise_k·σ·√(1/n₁ + 1/n₂))``: noise that every worker shares
      (the host's) cancels in the difference, a bias between them does not. Every worker measured since the
      plan then starts a new level from those rounds, so the next plan is made from each worker's time at
      the (b, H) it runs now;
    - workers that measure alike are planned as one (:func:`~geomesh.planner.settle.alike_groups`): step
      times within ``noise_k·√(u_i² + u_j²)`` of each other, u being a worker's relative uncertainty
      (:meth:`uncertainty`: σ/√n from its n observations, its calibration's before any), get the same plan,
      whatever GPU each declared;
    - workers that a plan made apart and that now measure alike are planned as one again when their work per
      round differs by more than ``threshold`` (in log);
    - a round that misses its plan far beyond the noise (:data:`MISS_FACTOR` while the noise is unknown;
      :meth:`_far`), while the worker's level rests on fewer than :data:`SETTLED_ROUNDS` rounds (the plan is the
      calibration's or a few rounds'), re-plans at the next :meth:`maybe_replan`, and at a batch the level
      measured is taken at once (a new level from it, no round of confirmation); a warm-up round counts when it
      was that far *faster* than planned (a start-up only slows a round). Against a settled level a far round
      waits for confirmation, as one at a batch the level never measured does (the table's error there);
    - a re-plan changes the round's length (the longest work) by at most :data:`ROUND_STEP` either way, every
      worker filling the round so held at its measured speed, and gives a worker at most ROUND_STEP times the
      work its time was worth by the plan in force (:meth:`_guarded`, :meth:`_bounded_round`): a wrong single
      measurement makes the next round at most that much longer. A plan so held (:attr:`limited`) is stepped on
      at the next call. A datasheet profile's first measurement (``first_measurement_sets_factor``) is not held;
    - and a new plan that those rules ask for is adopted only when it moves the work (:meth:`settles`): under
      the current estimates its straggler idle is lower than the plan in force's, or its round's compute
      differs, by more than :data:`DEADBAND_FLOOR`. Otherwise (the same plan, a speed every worker shares,
      another lattice point as balanced) the plan in force is kept and its assumptions brought up to date.

    A worker's **round overhead** (:meth:`observe_overhead`: its time per round outside the inner steps, the outer
    step and an evaluation, which a slower worker takes longer over) is the median of its last
    :data:`OVERHEAD_WINDOW` rounds once its compute is measured (its warm-up is not); every plan is made with the
    workers' overheads (:attr:`~geomesh.hardware.WorkerProfile.round_overhead_s`: a worker fills its round less
    its own, so the faster ones do not wait out a slower one's evaluation), and a worker's overhead that moved
    from what the plan in force assumed by more than ``threshold`` of its round re-plans the run (the new plan
    taken as the other rules' are).

    Until :data:`NOISE_MIN_CHANGES` round-to-round changes are known σ is unknown and ``threshold`` alone
    counts. ``noise_k = 0`` (the default) keeps the plain rules (the emulated runtime's modeled times carry
    no noise).

    ``first_measurement_sets_factor``: a worker's first measurement becomes its factor outright instead of
    being smoothed with the profile's 1.0. For profiles of another model than the one that trains (a user's
    loop planned with the scenario's timing model), where 1.0 is no evidence and smoothing towards it would
    take many rounds to forget it. :meth:`state_dict` / :meth:`load_state_dict` carry the factors, the
    observations the noise and the levels are measured from (with their batches), the held-back ones, those
    since the plan, the tables' shapes, the warm-up rounds skipped, the workers planned as one, and the
    current plan (JSON values), so a resumed or healed run re-plans as the uninterrupted one.
    """

    def __init__(
        self,
        profiles: Sequence[WorkerProfile],
        constraints: PlanConstraints,
        *,
        smoothing: float = 0.5,
        threshold: float = 0.1,
        first_measurement_sets_factor: bool = False,
        noise_k: float = 0.0,
        warmup_rounds: int = 0,
        miss_factor: float = MISS_FACTOR,
        round_step: float = ROUND_STEP,
    ):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing={smoothing!r}: must be in [0, 1)")
        if not threshold > 0.0:
            raise ValueError(f"threshold={threshold!r}: must be > 0")
        if not (isinstance(noise_k, (int, float)) and math.isfinite(noise_k) and noise_k >= 0.0):
            raise ValueError(f"noise_k={noise_k!r}: must be >= 0")
        if isinstance(warmup_rounds, bool) or not isinstance(warmup_rounds, int) or warmup_rounds < 0:
            raise ValueError(f"warmup_rounds={warmup_rounds!r}: must be an integer >= 0")
        for label, value in (("miss_factor", miss_factor), ("round_step", round_step)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1.0:
                raise ValueError(f"{label}={value!r}: must be a factor > 1 (inf: none)")
        constraints.validate()
        self.profiles = scaled_profiles(profiles, {})
        self.constraints = constraints
        self.smoothing = smoothing
        self.threshold = threshold
        self.noise_k = float(noise_k)
        self.warmup_rounds = warmup_rounds
        self.factors: dict[str, float] = {p.name: 1.0 for p in self.profiles}
        self.assumed: dict[str, float] = dict(self.factors)
        self.current: Plan | None = None
        self.first_measurement_sets_factor = first_measurement_sets_factor
        self.measured: set[str] = set()  # workers with at least one measurement folded in
        self.history: dict[str, list[float]] = {p.name: [] for p in self.profiles}  # recent observed factors
        self.held: dict[str, list[float]] = {p.name: [] for p in self.profiles}  # outside the noise, unconfirmed
        self.held_at: dict[str, list[int]] = {p.name: [] for p in self.profiles}  # (their batches)
        self.level: dict[str, list[float]] = {p.name: [] for p in self.profiles}  # since the speed last changed
        self.level_at: dict[str, list[int]] = {p.name: [] for p in self.profiles}  # (the batch of each)
        self.shape: dict[str, dict[int, float]] = {p.name: {} for p in self.profiles}  # batch -> table's error
        self.since: dict[str, list[float]] = {p.name: [] for p in self.profiles}  # folded since the current plan
        self.assumed_n: dict[str, int] = {p.name: 0 for p in self.profiles}  # observations behind `assumed`
        self.warmed: dict[str, int] = {p.name: 0 for p in self.profiles}  # warm-up measurements skipped
        self.groups: list[list[str]] = []  # (noise-aware) the workers the plan in force planned as one
        self.fresh: set[str] = set()  # (noise-aware) run by the plan in force at a batch their level never measured
        self._candidate_groups: list[list[str]] = []
        self._candidate_limited = False
        self.overheads: dict[str, list[float]] = {p.name: [] for p in self.profiles}  # recent round overheads
        self.overhead_assumed: dict[str, float] = {p.name: 0.0 for p in self.profiles}  # the plan in force's
        self.miss_factor, self.round_step = float(miss_factor), float(round_step)
        self.missed: set[str] = set()  # (noise-aware) their last round missed the plan in force far: re-plan now
        self.limited = False  # (noise-aware) the plan in force was held to ROUND_STEP: the next round steps on
        # (noise-aware) whose assumption in the plan in force rests on evidence (a measurement, or a calibrated
        # profile): the bounds of ROUND_STEP hold for them; a datasheet profile's first measurement is taken whole
        self.grounded: set[str] = set() if first_measurement_sets_factor else {p.name for p in self.profiles}

    # ---- planning ---------------------------------------------------------------------------------------
    def plan(self, exchange_bytes: int = 0, exchange_s: float = 0.0) -> Plan:
        """Plan now with the current speed factors (and remember them as assumed)."""
        if self.noise_k <= 0:
            self.current = plan_balanced(
                self.with_overheads(scaled_profiles(self.profiles, self.factors)), self.constraints, exchange_bytes,
                exchange_s,
            )
            self.overhead_assumed = {k: self.round_overhead(k) for k in self.factors}
            self.assumed = dict(self.factors)
            self.assumed_n = {k: len(v) for k, v in self.level.items()}
            self.since = {k: [] for k in self.factors}
            return self.current
        return self._put_in_force(self._candidate(exchange_bytes, exchange_s))

    def _candidate(self, exchange_bytes: int, exchange_s: float, bounded: bool = False) -> Plan:
        """(noise-aware) The plan the current estimates give: workers that measure alike planned as one;
        ``bounded``: held to :data:`ROUND_STEP` from the plan in force (:meth:`_guarded`, :meth:`_bounded_round`;
        :attr:`_candidate_limited` says whether that changed it)."""
        estimates = self.estimates()
        groups = self._groups(estimates)
        guarded = self._guarded(estimates) if bounded else estimates
        profiles = pooled(guarded, groups)
        plan = plan_balanced(profiles, self.constraints, exchange_bytes, exchange_s)
        limited = guarded is not estimates
        if bounded:
            plan, held = self._bounded_round(plan, profiles, exchange_bytes, exchange_s)
            limited = limited or held
        self._candidate_limited = limited
        plan_names = {w.name for w in plan.workers}
        self._candidate_groups = sorted(sorted(estimates[i].name for i in g if estimates[i].name in plan_names)
                                        for g in groups if any(estimates[i].name in plan_names for i in g))  # fmt: skip
        return plan

    def _bounds_hold(self) -> bool:
        """(noise-aware) Whether a re-plan is held to :data:`ROUND_STEP` from the plan in force: there is one, of
        these workers, and the bound is finite."""
        current = self.current
        return (current is not None and math.isfinite(self.round_step)
                and {w.name for w in current.workers} == set(self.factors))  # fmt: skip

    def _guarded(self, estimates: list[WorkerProfile]) -> list[WorkerProfile]:
        """(noise-aware) ``estimates`` (:meth:`estimates`), each grounded worker (:attr:`grounded`) at most
        :data:`ROUND_STEP` times faster, at the (micro-batch, accumulation) the plan in force gives it, than that
        plan assumed: a worker measured 7 times faster than planned gets twice the work this re-plan (and its
        round shows whether the rest is true), so a measurement that was wrong makes its next round at most twice
        the round in force. ``estimates`` itself when nothing is held."""
        if not self._bounds_hold():
            return estimates
        out, held = [], False
        for p in estimates:
            w = self.current.worker(p.name)
            planned = w.compute_s / w.inner_steps  # the step the plan in force assumed (its group's)
            now = p.step_s(w.micro_batch, w.accum)
            if p.name in self.grounded and now * self.round_step < planned:
                p = dataclasses.replace(p, slowdown=p.slowdown * planned / (self.round_step * now))
                held = True
            out.append(p)
        return out if held else estimates

    def _bounded_round(self, plan: Plan, profiles: list[WorkerProfile], exchange_bytes: int,
                       exchange_s: float) -> tuple[Plan, bool]:  # fmt: skip
        """(noise-aware) ``plan``, or, when its round (the longest work: compute and round overhead) is more than
        :data:`ROUND_STEP` times longer or shorter than the plan in force's, the plan that fills the round held
        to that factor (``profiles``, as planned: every worker fills it at its measured speed, so a slower one
        does less than the reference work this round, and none waits for it); whether it was held. Only where
        every worker's assumption is grounded (a datasheet profile's first measurement is taken whole)."""
        if not self._bounds_hold() or self.grounded != set(self.factors):
            return plan, False
        before = max(w.compute_s + w.overhead_s for w in self.current.workers)
        after = max(w.compute_s + w.overhead_s for w in plan.workers)
        target = min(max(after, before / self.round_step), before * self.round_step)
        overhead = max(p.round_overhead_s for p in profiles)
        if math.isclose(target, after, rel_tol=1e-9) or target <= overhead:
            return plan, False
        # the work the held round does: at most round_step x the work in force, and a round held shorter does no
        # more work than the rule's round or the round in force (an overhead in force measured long, and short
        # since, must not turn into compute: a round of 3.5x the work came of a held 2x shorter round)
        now_c = max(w.compute_s for w in self.current.workers)
        fill = min(target - overhead, self.round_step * now_c)
        if after < before:
            fill = min(fill, max(now_c, max(w.compute_s for w in plan.workers)))
        held = dataclasses.replace(self.constraints, fill=False, target_sequences=None,
                                   round_compute_s=fill)  # fmt: skip
        out = plan_balanced(profiles, held, exchange_bytes, exchange_s)
        if max(w.compute_s + w.overhead_s for w in out.workers) > max(before, after) * (1 + 1e-9):
            # (overlapped, a round that fills a time is stretched to the exchange it hides: a held round longer than
            # both the rule's and the round in force holds nothing back)
            return plan, False
        how = "longer" if after > before else "shorter"
        out.rule = (f"the round held to {target:.3g} s, {self.round_step:g}x {how} than the round in force "
                    f"({before:.3g} s; one re-plan changes it at most {self.round_step:g}x); the rule's round: "
                    f"{after:.3g} s ({plan.rule})")  # fmt: skip
        return out, True

    def _groups(self, estimates: list[WorkerProfile]) -> list[list[int]]:
        """(noise-aware) The workers that measure alike (indices of ``estimates``, :meth:`estimates`), under
        :func:`~geomesh.planner.settle.alike_groups` with each pair's tolerance ``noise_k·√(u_a² + u_b²)``: at
        a batch both measured, u is the noise of their estimates (:meth:`uncertainty`; ``threshold/noise_k``
        while unknown); elsewhere their calibrations' (:func:`~geomesh.planner.settle.table_noise`) when
        larger; at least :data:`~geomesh.planner.settle.ALIKE_FLOOR` (and never more than
        :data:`~geomesh.planner.settle.ALIKE_CEILING`: workers further apart are planned apart)."""
        measured = {k: set(self.level_at[k]) | set(self.shape[k]) for k in self.factors}
        unknown = self.threshold / self.noise_k
        uncertainty = {k: unknown if u is None else u for k, u in ((k, self.uncertainty(k)) for k in self.factors)}
        prior = {p.name: table_noise(p) for p in self.profiles}

        def tolerance(a: str, b: str, batch: int) -> float:
            ua, ub = uncertainty[a], uncertainty[b]
            if batch not in measured[a] or batch not in measured[b]:
                ua, ub = max(ua, prior[a]), max(ub, prior[b])
            return max(ALIKE_FLOOR, self.noise_k * math.hypot(ua, ub))

        batches = sorted(set(self._batches().values()) | {b for bs in measured.values() for b in bs})
        return alike_groups(estimates, comparison_batches(estimates, self.constraints, batches), tolerance)

    def _merged(self) -> bool:
        """(noise-aware) Whether workers that the plan in force made apart now measure alike, and their work per
        round differs by more than ``threshold`` (in log): a re-plan, like the others, needs that much."""
        if self.current is None:
            return False
        estimates = self.estimates()
        work = {w.name: w.sequences for w in self.current.workers}
        group_of = {name: j for j, g in enumerate(self.groups) for name in g}
        for g in self._groups(estimates):
            names = [estimates[i].name for i in g if estimates[i].name in work]
            if len({group_of.get(n, n) for n in names}) > 1:
                ws = [work[n] for n in names]
                if math.log(max(ws) / min(ws)) > self.threshold:
                    return True
        return False

    def _put_in_force(self, plan: Plan, limited: bool = False) -> Plan:
        self.current = plan
        self.groups = self._candidate_groups
        self.limited = limited
        self._rebase()
        return plan

    def _rebase(self) -> None:
        """(noise-aware) The plan in force assumes each worker's factor at the batch it runs there."""
        batches = self._batches()
        self.factors = {k: self.factor_at(k, batches[k]) if k in batches else f for k, f in self.factors.items()}
        self.assumed = dict(self.factors)
        self.overhead_assumed = {k: self.round_overhead(k) for k in self.factors}
        self.assumed_n = {k: len(v) for k, v in self.level.items()}
        self.since = {k: [] for k in self.factors}
        self.missed = set()
        if self.first_measurement_sets_factor:
            self.grounded = set(self.measured)
        # the workers the plan runs at a batch their level never measured (their factor there is the table's
        # shape read elsewhere): their measurements there are held to the noise alone (:meth:`_floor`)
        self.fresh = {k for k, b in batches.items() if self.level[k] and b not in self.level_at[k]
                      and b not in self.shape[k]}  # fmt: skip

    def _batches(self) -> dict[str, int]:
        return {w.name: w.batch for w in self.current.workers} if self.current is not None else {}

    def estimates(self) -> list[WorkerProfile]:
        """(noise-aware) Each worker's profile as measured so far: its factor, its table corrected where its
        shape was measured, each worker on its own."""
        out = []
        for p in self.profiles:
            level = self.level_factor(p.name)
            shape = sorted(self.shape[p.name].items())
            out.append(corrected(p, tuple((b, level * r) for b, r in shape) or ((0, level),)))
        return self.with_overheads(out)

    # ---- round overheads ------------------------------------------------------------------------------------
    def observe_overhead(self, name: str, seconds: float) -> None:
        """Fold one round's overhead of ``name`` (seconds outside its inner steps, >= 0) in; a worker's rounds
        before its compute is measured (warm-up) are not folded."""
        if name not in self.overheads:
            raise ValueError(f"unknown worker {name!r}; workers: {', '.join(self.factors)}")
        if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and 0 <= seconds < math.inf):
            raise ValueError(f"worker {name!r}: round overhead {seconds!r} must be finite seconds >= 0")
        if name in self.measured:
            self.overheads[name] = [*self.overheads[name], float(seconds)][-OVERHEAD_WINDOW:]

    def round_overhead(self, name: str) -> float:
        """``name``'s round overhead: the median of its recent rounds' (0 before any)."""
        return median(self.overheads[name]) if self.overheads.get(name) else 0.0

    def with_overheads(self, profiles: Sequence[WorkerProfile]) -> list[WorkerProfile]:
        """``profiles`` with each worker's round overhead as measured (the profile itself when it is 0 and so
        was the profile's)."""
        return [dataclasses.replace(p, round_overhead_s=o) if o != p.round_overhead_s else p
                for p, o in ((p, self.round_overhead(p.name)) for p in profiles)]  # fmt: skip

    def overhead_moved(self) -> list[str]:
        """The workers whose round overhead moved from what the plan in force assumed by more than
        ``threshold`` of its longest round's work (compute and overhead); with ``noise_k``, and by more than
        ``noise_k`` times the noise of their recent overheads (σ from their median absolute deviation), so that
        an overhead that varies round to round (an evaluation on a shared host) does not re-plan every round."""
        if self.current is None:
            return []
        top = max(w.compute_s + w.overhead_s for w in self.current.workers)

        def band(k: str) -> float:
            return max(self.threshold * top, max(self.noise_k, 0.0) * robust_sigma(self.overheads[k]))

        return [k for k in self.overheads if abs(self.round_overhead(k) - self.overhead_assumed.get(k, 0.0)) > band(k)]

    def level_factor(self, name: str) -> float:
        """(noise-aware) ``name``'s speed level: the geometric mean of its level's observations, each over its
        table's shape at the batch it was measured at; its factor while the level is empty."""
        if not self.level[name]:
            return self.factors[name]
        shape = tuple(sorted(self.shape[name].items()))
        if not shape:
            return geomean(self.level[name])
        return geomean([x / correction_at(shape, b) for x, b in zip(self.level[name], self.level_at[name])])

    def factor_at(self, name: str, batch: int) -> float:
        """(noise-aware) ``name``'s factor at ``batch``: its level times its table's shape there."""
        if not self.level[name]:
            return self.factors[name]
        return self.level_factor(name) * correction_at(tuple(sorted(self.shape[name].items())), batch)

    # ---- the noise ----------------------------------------------------------------------------------------
    def noise(self, name: str) -> float | None:
        """``name``'s relative round-to-round dispersion σ: the larger of its own and all workers' pooled (a
        few rounds' own changes are a noisy estimate, and the workers of one run mostly share their hosts'
        noise); None while neither has :data:`NOISE_MIN_CHANGES` changes."""
        known = [x for x in (dispersion(self.history[name]), dispersion(*self.history.values())) if x is not None]
        return max(known) if known else None

    def _floor(self, name: str) -> float:
        """(noise-aware) The least drift the rules act on for ``name``: ``threshold``, but none where the plan in
        force moved it to a batch its level never measured (:attr:`fresh`) once its noise rests on
        :data:`NOISE_TRUSTED` of its own round-to-round changes (a dispersion from three or four changes is
        often far too low): there the factor is the table's shape read elsewhere, and the measured noise alone
        says whether the table is wrong at that batch, so a bias of a few percent is corrected too."""
        if name in self.fresh and len(self.history[name]) - 1 >= NOISE_TRUSTED:
            return 0.0
        return self.threshold

    def uncertainty(self, name: str) -> float | None:
        """(noise-aware) The relative uncertainty of ``name``'s estimated step time: σ/√n from the n
        observations of its level, its calibration's before any (:func:`~geomesh.planner.settle.table_noise`;
        0 for a datasheet profile); None while σ is unknown."""
        n = len(self.level[name])
        if n == 0:
            return table_noise(next(p for p in self.profiles if p.name == name))
        sigma = self.noise(name)
        return None if sigma is None else sigma / math.sqrt(n)

    def band(self, name: str) -> float:
        """How far (relative; in log with ``noise_k``) ``name``'s measurements since the current plan may be
        from what the plan assumed before a re-plan."""
        sigma = self.noise(name) if self.noise_k > 0 else None
        n, n_a = len(self.since[name]), self.assumed_n[name]
        if sigma is None or n == 0:
            return self.threshold
        # the noise of the difference of the two means; an assumption made from fewer observations than the
        # rounds since have given counts as many (the newer mean is the better estimate: re-planning on it helps)
        return max(self._floor(name), self.noise_k * sigma * math.sqrt(1.0 / n + 1.0 / max(n_a, n)))

    # ---- measurements -----------------------------------------------------------------------------------
    def observe(self, name: str, measured_compute_s: float, plan: Plan) -> float:
        """Fold one round's measured compute time of ``name`` (following ``plan``) in; returns its factor."""
        profile = next((p for p in self.profiles if p.name == name), None)
        if profile is None:
            raise ValueError(f"unknown worker {name!r}; workers: {', '.join(self.factors)}")
        entry = _entry(plan, name)
        observed = _implied_factor(profile, entry, measured_compute_s)
        # how far the round missed its plan (log); a miss far beyond the noise is re-planned for at once
        miss = math.log(measured_compute_s / entry.compute_s) if entry.compute_s > 0 else 0.0
        far_s = self._far(name, self.assumed_n[name])
        far = far_s is not None and abs(miss) > far_s
        if self.warmed[name] < self.warmup_rounds:  # start-up, not the worker's speed
            self.warmed[name] += 1
            if not (far and miss < 0):  # (a start-up only ever slows a round: one far faster is a speed)
                return self.factors[name]
        if self.noise_k > 0:
            f = self._fold_noise_aware(name, observed, first=self.first_measurement_sets_factor
                                       and name not in self.measured, batch=entry.batch)  # fmt: skip
        elif self.first_measurement_sets_factor and name not in self.measured:
            f = observed
        else:
            f = self.smoothing * self.factors[name] + (1.0 - self.smoothing) * observed
        self.factors[name] = f
        self.measured.add(name)
        self.history[name] = [*self.history[name], observed][-NOISE_WINDOW:]
        if far and self.noise_k > 0 and (self.current is None or plan.digest() == self.current.digest()):
            self.missed.add(name)
        return f

    def _far(self, name: str, n: int) -> float | None:
        """(noise-aware) How far (log) a round may be from what ``n`` observations predicted (its plan, the
        worker's factor) before it is a miss far beyond the noise, or None: no miss is, the worker's level rests
        on :data:`SETTLED_ROUNDS` rounds or more (a far round waits for confirmation as any other). While the
        rounds' noise is unknown (the first measured rounds: the plan rests on the calibration, whose error a
        measured round shows), log(``miss_factor``); once it is known (from a few changes, often far too low),
        ``miss_factor`` squared, or twice the noise band of the difference, 2·``noise_k``·σ·√(1 + 1/n), where
        that is wider (a host whose rounds scatter by 25% misses 1.5x by noise alone; a prediction from one noisy
        round is that round's noise off)."""
        if self.noise_k <= 0 or len(self.level[name]) >= SETTLED_ROUNDS:
            return None
        sigma = self.noise(name)
        if sigma is None:
            return math.log(self.miss_factor)
        return max(2.0 * math.log(self.miss_factor), 2.0 * self.noise_k * sigma * math.sqrt(1.0 + 1.0 / max(n, 1)))

    def _fold_noise_aware(self, name: str, observed: float, first: bool, batch: int) -> float:
        expected, held = self.factor_at(name, batch), self.held[name]
        sigma = self.noise(name)  # from the observations before this one
        far = self._far(name, len(self.level[name]))
        if (not first and far is not None and batch in self.level_at[name]
                and abs(math.log(observed / expected)) > far):  # fmt: skip
            # far beyond the noise at a batch the level measured: the speed changed, a new level from this round
            # at once (no round of confirmation). At a batch it never measured, the rules below hold as before
            # (two rounds there are the table's error at that batch, which stays with the table: one wild round
            # is not made that)
            self.held[name], self.held_at[name] = [], []
            self.level[name], self.level_at[name] = [observed], [batch]
            self.since[name] = [observed]
            self.assumed_n[name] = 0  # what the plan assumed was another speed: no evidence for it
            return self.factor_at(name, batch)
        if first or sigma is None or abs(math.log(observed / expected)) <= max(
                self._floor(name), self.noise_k * sigma):
            self.held[name], self.held_at[name] = [], []  # an earlier held-back observation was an outlier
            self._extend_level(name, [observed], batch)
            self.since[name] = [*self.since[name], observed][-NOISE_WINDOW:]
        elif held and self.held_at[name][-1] == batch and (held[-1] > expected) == (observed > expected):
            self.held[name], self.held_at[name] = [], []
            if batch in self.level_at[name] or not self.level[name]:  # two in a row: the speed changed
                self.level[name], self.level_at[name] = [*held, observed], [batch] * (len(held) + 1)
                self.since[name] = [*held, observed]
                self.assumed_n[name] = 0  # what the plan assumed was another speed: no evidence for it
            else:  # a batch the level never measured: the table is wrong there, the speed is the same
                self.since[name] = [*self.since[name], *held, observed][-NOISE_WINDOW:]
                self._reshape(name, [*held, observed], batch)
        else:
            self.held[name], self.held_at[name] = [observed], [batch]
            return self.factors[name]
        return self.factor_at(name, batch)

    def _reshape(self, name: str, observed: list[float], batch: int) -> None:
        """(noise-aware) ``observed`` (at ``batch``) say the table is wrong there, not the speed: its shape at
        ``batch`` becomes what they measured (the batches the level measured keep theirs), and they join the
        level. The batch is measured from then on."""
        # the level without what it took in at that batch (``observed`` are those, or more)
        pairs = [(x, b) for x, b in zip(self.level[name], self.level_at[name]) if b != batch]
        self.level[name], self.level_at[name] = [x for x, _ in pairs], [b for _, b in pairs]
        shape = self.shape[name]
        before = tuple(sorted(shape.items()))
        expected = self.level_factor(name) * correction_at(before, batch)
        for b in self.level_at[name]:  # the batches measured keep what the table is there
            shape.setdefault(b, correction_at(before, b))
        shape.pop(batch, None)
        shape[batch] = correction_at(before, batch) * geomean(observed) / expected
        while len(shape) > SHAPE_BATCHES:
            shape.pop(next(iter(shape)))
        self._extend_level(name, list(observed), batch)
        self.factors[name] = self.factor_at(name, batch)
        self.fresh.discard(name)

    def _extend_level(self, name: str, values: list[float], batch: int) -> None:
        self.level[name] = [*self.level[name], *values][-NOISE_WINDOW:]
        self.level_at[name] = [*self.level_at[name], *[batch] * len(values)][-NOISE_WINDOW:]

    def _remeasure(self, name: str) -> None:
        """(noise-aware) A new level for ``name``: the observations since the plan (at the batch it runs)."""
        batch = self._batches().get(name, 0)
        if name in self.fresh:  # the table there, not a change of speed: the shape at that batch, from them
            self._reshape(name, self.since[name], batch)
            return
        self.level[name] = self.since[name][-NOISE_WINDOW:]
        self.level_at[name] = [batch] * len(self.level[name])
        self.factors[name] = self.factor_at(name, batch)

    def drift(self) -> dict[str, float]:
        """Per worker |f − f_assumed| / f_assumed."""
        return {k: abs(f - self.assumed[k]) / self.assumed[k] for k, f in self.factors.items()}

    # ---- re-planning --------------------------------------------------------------------------------------
    def maybe_replan(self, exchange_bytes: int = 0, exchange_s: float = 0.0) -> Plan | None:
        """A new plan when a speed factor drifted past ``threshold`` (with ``noise_k``: when a worker's
        measurements since the plan differ from what it assumed by more than :meth:`band`, and the plan they
        give :meth:`settles` no better than the one in force) or when there is none yet, else None."""
        if self.current is None:
            return self.plan(exchange_bytes, exchange_s)
        overhead = self.overhead_moved()
        if self.noise_k <= 0:
            drifted = max(self.drift().values()) > self.threshold or overhead
            return self.plan(exchange_bytes, exchange_s) if drifted else None
        # a round far off its plan (:meth:`observe`), or a plan in force held to ROUND_STEP: re-planned now
        missed, limited = sorted(self.missed), self.limited
        self.missed = set()
        moved = [k for k, xs in self.since.items()
                 if xs and abs(math.log(geomean(xs) / self.assumed[k])) > self.band(k)]  # fmt: skip
        # twice the evidence the plan was made from, and it says otherwise by more than the threshold: the
        # better estimate re-plans (a few times early in a level: after 2, 4, 8 rounds; not round after round)
        refreshed = [k for k, xs in self.level.items() if xs and len(xs) >= 2 * max(self.assumed_n[k], 1)
                     and abs(math.log(self.factors[k] / self.assumed[k])) > self.threshold]  # fmt: skip
        drifts = self._drifts()
        apart = self.spread(drifts) > self._spread_band(drifts)
        merged = not (moved or refreshed or apart or overhead or missed or limited) and self._merged()
        if not (moved or refreshed or apart or merged or overhead or missed or limited):
            return None
        if apart:  # every worker's time at the plan it runs now: the next plan corrects their differences
            moved = [k for k, xs in self.since.items() if len(xs) >= SPREAD_MIN_ROUNDS]
        for k in moved:  # a new level, from what the rounds since the plan measured
            if k not in missed:  # (a far miss started its level from that round already)
                self._remeasure(k)
        candidate = self._candidate(exchange_bytes, exchange_s, bounded=True)
        if self.settles(candidate, merged):  # no change worth a re-plan: the plan in force stays
            if not merged:
                self._rebase()
            self.limited = False
            return None
        return self._put_in_force(candidate, limited=self._candidate_limited)

    def settles(self, candidate: Plan, merged: bool = False) -> bool:
        """(noise-aware) Whether ``candidate`` changes nothing worth a re-plan from the plan in force: it is the
        same plan, or, under the current estimates (each worker on its own, :meth:`estimates`), its straggler
        idle is not lower and its round's compute not longer or shorter by more than :data:`DEADBAND_FLOOR`.
        (Whether the measurements moved beyond their noise is the rules' question that asked for the
        candidate; this one is whether the plan they give moves the work: a speed that every worker shares,
        or another lattice point of (batch, steps) as balanced as the one in force, does not.) ``merged``:
        the candidate plans as one workers that now measure alike: it is taken unless it is worse by more than
        :data:`DEADBAND_FLOOR`."""
        current = self.current
        if current is None:
            return False
        if candidate.digest() == current.digest():
            return True
        if {w.name for w in candidate.workers} != {w.name for w in current.workers}:
            return False
        estimates = {p.name: p for p in self.estimates()}
        idle_now, top_now = predicted_balance(current, estimates)
        idle_new, top_new = predicted_balance(candidate, estimates)
        if merged:
            return idle_new - idle_now > DEADBAND_FLOOR
        return idle_now - idle_new <= DEADBAND_FLOOR and abs(math.log(top_now / top_new)) <= DEADBAND_FLOOR

    def _drifts(self) -> dict[str, float]:
        """(noise-aware) Per worker with :data:`SPREAD_MIN_ROUNDS` rounds since the plan: the log of the mean of
        those rounds' factors over the factor the plan assumed."""
        return {k: math.log(geomean(xs) / self.assumed[k]) for k, xs in self.since.items()
                if len(xs) >= SPREAD_MIN_ROUNDS}  # fmt: skip

    def spread(self, drifts: dict[str, float] | None = None) -> float:
        """(noise-aware) How far apart the workers drifted since the plan: the slowest one's drift minus the
        fastest one's (in log; 0 with fewer than two workers measured long enough, or without ``noise_k``).
        ``drifts``: :meth:`_drifts`, when the caller has them."""
        d = (self._drifts() if drifts is None else drifts) if self.noise_k > 0 else {}
        return max(d.values()) - min(d.values()) if len(d) >= 2 else 0.0

    def _spread_band(self, d: dict[str, float]) -> float:
        """What :meth:`spread` of the drifts ``d`` may reach before a re-plan: the threshold, or the noise of
        the difference of the two workers' means when larger (inf while their noise is unknown)."""
        if len(d) < 2:
            return math.inf
        hi, lo = max(d, key=d.get), min(d, key=d.get)
        sigmas = [x for x in (self.noise(hi), self.noise(lo)) if x is not None]
        if not sigmas:
            return math.inf
        n_hi, n_lo = len(self.since[hi]), len(self.since[lo])
        return max(self.threshold, self.noise_k * max(sigmas) * math.sqrt(1.0 / n_hi + 1.0 / n_lo))

    # ---- state ----------------------------------------------------------------------------------------------
    def adopt(self, other: "OnlinePlanner") -> None:
        """Carry ``other``'s knowledge of the workers both plan (factors, who was measured and warmed up, the
        observations and held-back ones) into this planner: a re-plan for new members keeps what was learned."""
        common = [k for k in other.factors if k in self.factors]
        self.factors.update({k: other.factors[k] for k in common})
        self.measured |= other.measured & set(common)
        self.warmed.update({k: other.warmed[k] for k in common})
        for mine, theirs in ((self.history, other.history), (self.held, other.held), (self.level, other.level),
                             (self.held_at, other.held_at), (self.level_at, other.level_at)):  # fmt: skip
            mine.update({k: list(theirs.get(k, ())) for k in common})
        self.shape.update({k: dict(other.shape[k]) for k in common})
        self.overheads.update({k: list(other.overheads[k]) for k in common})

    def state_dict(self) -> dict:
        """The speed factors, the factors the current plan assumed, who was measured, the recent and held-back
        observations (and their batches), the warm-up rounds skipped, and the current plan."""
        return {"factors": dict(self.factors), "assumed": dict(self.assumed), "measured": sorted(self.measured),
                "history": {k: list(v) for k, v in self.history.items()},
                "held": {k: list(v) for k, v in self.held.items()},
                "held_at": {k: list(v) for k, v in self.held_at.items()},
                "level": {k: list(v) for k, v in self.level.items()},
                "level_at": {k: list(v) for k, v in self.level_at.items()},
                "shape": {k: [[b, r] for b, r in v.items()] for k, v in self.shape.items()},
                "since": {k: list(v) for k, v in self.since.items()}, "assumed_n": dict(self.assumed_n),
                "warmed": dict(self.warmed), "groups": [list(g) for g in self.groups],
                "fresh": sorted(self.fresh),
                "overheads": {k: list(v) for k, v in self.overheads.items()},
                "overhead_assumed": dict(self.overhead_assumed),
                "missed": sorted(self.missed), "limited": self.limited, "grounded": sorted(self.grounded),
                "current": self.current.to_json() if self.current is not None else None}  # fmt: skip

    def load_state_dict(self, state: Mapping) -> None:
        """Go on from :meth:`state_dict` output of a planner over the same workers (ValueError otherwise)."""
        names = set(self.factors)
        for key in ("factors", "assumed"):
            if set(state[key]) != names:
                raise ValueError(f"planner state for workers {sorted(state[key])}, this planner has {sorted(names)}")
        self.factors = {k: float(v) for k, v in state["factors"].items()}
        self.assumed = {k: float(v) for k, v in state["assumed"].items()}
        self.measured = set(state.get("measured", ())) & names
        # (states written before the noise-aware rules carry no observations: the noise is measured afresh)
        self.history = {k: [float(x) for x in state.get("history", {}).get(k, ())][-NOISE_WINDOW:]
                        for k in self.factors}  # fmt: skip
        for key in ("held", "level", "since"):
            setattr(self, key, {k: [float(x) for x in state.get(key, {}).get(k, ())] for k in self.factors})
        self.assumed_n = {k: int(state.get("assumed_n", {}).get(k, 0)) for k in self.factors}
        self.current = Plan.from_json(state["current"]) if state.get("current") is not None else None
        # (states written before the levels kept their batches: every observation at the batch planned now)
        batches = self._batches()
        for key, values in (("held_at", self.held), ("level_at", self.level)):
            given = state.get(key, {})
            setattr(self, key, {k: [int(b) for b in given[k]] if k in given and len(given[k]) == len(values[k])
                                else [batches.get(k, 0)] * len(values[k]) for k in self.factors})  # fmt: skip
        self.shape = {k: {int(b): float(r) for b, r in state.get("shape", {}).get(k, ())} for k in self.factors}
        self.groups = [[str(n) for n in g] for g in state.get("groups", ())]
        self.fresh = set(state.get("fresh", ())) & names
        warmed = state.get("warmed")  # (older states: a measured worker had warmed up)
        self.warmed = {k: int(warmed.get(k, 0)) if isinstance(warmed, Mapping)
                       else (self.warmup_rounds if k in self.measured else 0) for k in self.factors}  # fmt: skip
        # (a peer's state is data: an overhead is finite seconds >= 0, else left out; older states: none measured)
        given, assumed = state.get("overheads"), state.get("overhead_assumed")
        given = given if isinstance(given, Mapping) else {}
        assumed = assumed if isinstance(assumed, Mapping) else {}
        self.overheads = {k: [float(x) for x in given[k] if _overhead(x)][-OVERHEAD_WINDOW:]
                          if isinstance(given.get(k), list) else [] for k in self.factors}  # fmt: skip
        self.overhead_assumed = {k: float(assumed[k]) if _overhead(assumed.get(k)) else 0.0 for k in self.factors}
        # (older states: no far miss pending, no plan held, the measured workers' assumptions grounded)
        self.missed = set(state.get("missed", ())) & names
        self.limited = bool(state.get("limited", False))
        grounded = state.get("grounded")
        self.grounded = (set(grounded) & names if isinstance(grounded, (list, tuple))
                         else set(self.measured) if self.first_measurement_sets_factor else set(names))  # fmt: skip


def _overhead(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf


def predicted_balance(plan: Plan, profiles: Mapping[str, WorkerProfile]) -> tuple[float, float]:
    """(straggler idle of the compute phase, longest compute) that ``plan`` would have if the workers ran as
    ``profiles`` (by name) say."""
    busy = [w.inner_steps * profiles[w.name].step_s(w.micro_batch, w.accum) + profiles[w.name].round_overhead_s
            for w in plan.workers]  # fmt: skip
    top = max(busy)
    return math.fsum(top - c for c in busy) / (len(busy) * top), top
