"""Online re-planning (beyond the paper): :func:`replan` re-plans from one set of measured compute times, and
:class:`OnlinePlanner` keeps smoothed per-worker speed factors and re-plans when one drifts. Pure: the caller
passes the measurements in."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..hardware import WorkerProfile
from .plan import Plan, PlanConstraints, WorkerPlan, scaled_profiles
from .search import plan_balanced

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
NOISE_MIN_CHANGES = 3  # round-to-round changes before a dispersion is trusted (a worker's own, or all workers')
SPREAD_MIN_ROUNDS = 3  # rounds since the plan a worker needs before its drift is compared with the others'
_MAD_TO_SIGMA = 1.4826  # a normal distribution's σ per median absolute deviation


def _changes(history: Sequence[float]) -> list[float]:
    return [abs(math.log(b / a)) for a, b in zip(history, history[1:])]


def dispersion(*histories: Sequence[float]) -> float | None:
    """The relative round-to-round dispersion σ of recent observed factors (one worker's, or several workers'
    pooled): the robust scale (1.4826 × median absolute value) of the successive log-ratios, over √2 (a
    change carries two rounds' noise). A step change of speed is one large change among several, which the
    median ignores; ``None`` with fewer than :data:`NOISE_MIN_CHANGES` changes."""
    steps = [d for h in histories for d in _changes(h)]
    if len(steps) < NOISE_MIN_CHANGES:
        return None
    return _MAD_TO_SIGMA * _median(steps) / math.sqrt(2.0)


def _geomean(values: Sequence[float]) -> float:
    return math.exp(math.fsum(math.log(x) for x in values) / len(values))


def _median(values: Sequence[float]) -> float:
    xs = sorted(values)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


class OnlinePlanner:
    """Re-plans between rounds when workers turn out slower or faster than their profiles say.

    ``observe`` folds one measurement into the worker's speed factor f (measured / predicted compute time,
    relative to the profile given here): ``f ← smoothing·f + (1 − smoothing)·measured/predicted``.
    ``maybe_replan`` returns a new plan (made on copies of the profiles with ``slowdown`` scaled by f) when
    some worker's |f − f_assumed| / f_assumed exceeds ``threshold``, f_assumed being the factor the current
    plan was made with; otherwise ``None``. The caller's profiles are copied, never changed.

    ``noise_k`` > 0 makes both decisions aware of the measurements' noise, for wall-clock measurements (the
    distributed runtime: shared hosts, short rounds), where one round's time can be tens of percent off the
    next one's. Each worker's relative round-to-round dispersion σ is measured from its last
    :data:`NOISE_WINDOW` observations, and from all workers' pooled (:meth:`noise`: the larger counts). Then
    a worker's factor is the geometric mean of its observations since its speed last changed (at most
    :data:`NOISE_WINDOW`), not a smoothed value, and:

    - an observation further than ``max(threshold, noise_k·σ)`` from f (in log, as σ) is held back instead of
      folded in: a single such round is an outlier (a descheduled process) and is dropped when the next
      observation is back within the noise; two in a row on the same side are a change of speed: the older
      observations are forgotten and f jumps to the two's mean at once (one re-plan to the new speed, not a
      chain of re-plans half-way there);
    - a re-plan needs evidence: the mean of the n observations since the current plan (the last
      :data:`NOISE_WINDOW` of them) must differ from the factor that plan assumed (itself the mean of n_a
      observations) by more than ``max(threshold, noise_k·σ·√(1/n + 1/max(n_a, n)))`` (in log): noise alone
      does not re-plan the run round after round (the plan is held: a deadband), while a bias that one round
      cannot show is shown by several. The worker that passes it starts a new level from those n
      observations;
    - a plan is also remade when a worker's level holds twice the observations its assumption was made from
      and says otherwise by more than ``threshold`` (the better estimate: after 2, 4, 8 rounds of a level,
      then no more), so an early plan made from one noisy round is not kept for long;
    - and when the workers drift apart (:meth:`spread`): each may stay inside its own band (one 7% faster,
      another 7% slower than assumed) while the fast one waits for the difference, round after round. The
      drifts since the plan of the fastest and the slowest worker (at least :data:`SPREAD_MIN_ROUNDS` rounds
      each) differ by more than ``max(threshold, noise_k·σ·√(1/n₁ + 1/n₂))``: noise that every worker shares
      (the host's) cancels in the difference, a bias between them does not. Every worker measured since the
      plan then starts a new level from those rounds, so the next plan is made from each worker's time at
      the (b, H) it runs now.

    Until :data:`NOISE_MIN_CHANGES` round-to-round changes are known σ is unknown and ``threshold`` alone
    counts. ``noise_k = 0`` (the default) keeps the plain rules (the emulated runtime's modeled times carry
    no noise).

    ``first_measurement_sets_factor``: a worker's first measurement becomes its factor outright instead of
    being smoothed with the profile's 1.0. For profiles of another model than the one that trains (a user's
    loop planned with the scenario's timing model), where 1.0 is no evidence and smoothing towards it would
    take many rounds to forget it. :meth:`state_dict` / :meth:`load_state_dict` carry the factors, the
    observations the noise and the levels are measured from, the held-back ones, those since the plan and
    the current plan (JSON values), so a resumed run re-plans as the uninterrupted one.
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
    ):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing={smoothing!r}: must be in [0, 1)")
        if not threshold > 0.0:
            raise ValueError(f"threshold={threshold!r}: must be > 0")
        if not (isinstance(noise_k, (int, float)) and math.isfinite(noise_k) and noise_k >= 0.0):
            raise ValueError(f"noise_k={noise_k!r}: must be >= 0")
        constraints.validate()
        self.profiles = scaled_profiles(profiles, {})
        self.constraints = constraints
        self.smoothing = smoothing
        self.threshold = threshold
        self.noise_k = float(noise_k)
        self.factors: dict[str, float] = {p.name: 1.0 for p in self.profiles}
        self.assumed: dict[str, float] = dict(self.factors)
        self.current: Plan | None = None
        self.first_measurement_sets_factor = first_measurement_sets_factor
        self.measured: set[str] = set()  # workers with at least one measurement folded in
        self.history: dict[str, list[float]] = {p.name: [] for p in self.profiles}  # recent observed factors
        self.held: dict[str, list[float]] = {p.name: [] for p in self.profiles}  # outside the noise, unconfirmed
        self.level: dict[str, list[float]] = {p.name: [] for p in self.profiles}  # since the speed last changed
        self.since: dict[str, list[float]] = {p.name: [] for p in self.profiles}  # folded since the current plan
        self.assumed_n: dict[str, int] = {p.name: 0 for p in self.profiles}  # observations behind `assumed`

    def plan(self, exchange_bytes: int = 0, exchange_s: float = 0.0) -> Plan:
        """Plan now with the current speed factors (and remember them as assumed)."""
        self.current = plan_balanced(
            scaled_profiles(self.profiles, self.factors), self.constraints, exchange_bytes, exchange_s
        )
        self.assumed = dict(self.factors)
        self.assumed_n = {k: len(v) for k, v in self.level.items()}
        self.since = {k: [] for k in self.factors}
        return self.current

    def noise(self, name: str) -> float | None:
        """``name``'s relative round-to-round dispersion σ: the larger of its own and all workers' pooled (a
        few rounds' own changes are a noisy estimate, and the workers of one run mostly share their hosts'
        noise); None while neither has :data:`NOISE_MIN_CHANGES` changes."""
        known = [x for x in (dispersion(self.history[name]), dispersion(*self.history.values())) if x is not None]
        return max(known) if known else None

    def band(self, name: str) -> float:
        """How far (relative; in log with ``noise_k``) ``name``'s measurements since the current plan may be
        from what the plan assumed before a re-plan."""
        sigma = self.noise(name) if self.noise_k > 0 else None
        n, n_a = len(self.since[name]), self.assumed_n[name]
        if sigma is None or n == 0:
            return self.threshold
        # the noise of the difference of the two means; an assumption made from fewer observations than the
        # rounds since have given counts as many (the newer mean is the better estimate: re-planning on it helps)
        return max(self.threshold, self.noise_k * sigma * math.sqrt(1.0 / n + 1.0 / max(n_a, n)))

    def observe(self, name: str, measured_compute_s: float, plan: Plan) -> float:
        """Fold one round's measured compute time of ``name`` (following ``plan``) in; returns its factor."""
        profile = next((p for p in self.profiles if p.name == name), None)
        if profile is None:
            raise ValueError(f"unknown worker {name!r}; workers: {', '.join(self.factors)}")
        observed = _implied_factor(profile, _entry(plan, name), measured_compute_s)
        if self.noise_k > 0:
            f = self._fold_noise_aware(name, observed, first=self.first_measurement_sets_factor
                                       and name not in self.measured)  # fmt: skip
        elif self.first_measurement_sets_factor and name not in self.measured:
            f = observed
        else:
            f = self.smoothing * self.factors[name] + (1.0 - self.smoothing) * observed
        self.factors[name] = f
        self.measured.add(name)
        self.history[name] = [*self.history[name], observed][-NOISE_WINDOW:]
        return f

    def _fold_noise_aware(self, name: str, observed: float, first: bool) -> float:
        f, held = self.factors[name], self.held[name]
        sigma = self.noise(name)  # from the observations before this one
        if first or sigma is None or abs(math.log(observed / f)) <= max(self.threshold, self.noise_k * sigma):
            self.held[name] = []  # an earlier held-back observation was an outlier
            self.level[name] = [*self.level[name], observed][-NOISE_WINDOW:]
            self.since[name] = [*self.since[name], observed][-NOISE_WINDOW:]
        elif held and (held[-1] > f) == (observed > f):  # two in a row on one side: the speed changed
            self.held[name] = []
            self.level[name] = [*held, observed]
            self.since[name] = [*held, observed]
            self.assumed_n[name] = 0  # what the plan assumed was another speed: no evidence for it
        else:
            self.held[name] = [observed]
            return f
        return _geomean(self.level[name])

    def drift(self) -> dict[str, float]:
        """Per worker |f − f_assumed| / f_assumed."""
        return {k: abs(f - self.assumed[k]) / self.assumed[k] for k, f in self.factors.items()}

    def maybe_replan(self, exchange_bytes: int = 0, exchange_s: float = 0.0) -> Plan | None:
        """A new plan when a speed factor drifted past ``threshold`` (with ``noise_k``: when a worker's
        measurements since the plan differ from what it assumed by more than :meth:`band`) or when there is
        none yet, else None."""
        if self.current is None:
            return self.plan(exchange_bytes, exchange_s)
        if self.noise_k <= 0:
            return self.plan(exchange_bytes, exchange_s) if max(self.drift().values()) > self.threshold else None
        moved = [k for k, xs in self.since.items()
                 if xs and abs(math.log(_geomean(xs) / self.assumed[k])) > self.band(k)]  # fmt: skip
        # twice the evidence the plan was made from, and it says otherwise by more than the threshold: the
        # better estimate re-plans (a few times early in a level: after 2, 4, 8 rounds; not round after round)
        refreshed = [k for k, xs in self.level.items() if xs and len(xs) >= 2 * max(self.assumed_n[k], 1)
                     and abs(math.log(self.factors[k] / self.assumed[k])) > self.threshold]  # fmt: skip
        drifts = self._drifts()
        apart = self.spread(drifts) > self._spread_band(drifts)
        if not (moved or refreshed or apart):
            return None
        if apart:  # every worker's time at the plan it runs now: the next plan corrects their differences
            moved = [k for k, xs in self.since.items() if len(xs) >= SPREAD_MIN_ROUNDS]
        for k in moved:  # a new level, from what the rounds since the plan measured
            self.level[k] = self.since[k][-NOISE_WINDOW:]
            self.factors[k] = _geomean(self.level[k])
        return self.plan(exchange_bytes, exchange_s)

    def _drifts(self) -> dict[str, float]:
        """(noise-aware) Per worker with :data:`SPREAD_MIN_ROUNDS` rounds since the plan: the log of the mean of
        those rounds' factors over the factor the plan assumed."""
        return {k: math.log(_geomean(xs) / self.assumed[k]) for k, xs in self.since.items()
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

    def adopt(self, other: "OnlinePlanner") -> None:
        """Carry ``other``'s knowledge of the workers both plan (factors, who was measured, the observations
        and held-back ones) into this planner: a re-plan for new members keeps what was learned."""
        common = [k for k in other.factors if k in self.factors]
        self.factors.update({k: other.factors[k] for k in common})
        self.measured |= other.measured & set(common)
        for mine, theirs in ((self.history, other.history), (self.held, other.held), (self.level, other.level)):
            mine.update({k: list(theirs.get(k, ())) for k in common})

    def state_dict(self) -> dict:
        """The speed factors, the factors the current plan assumed, who was measured, the recent and held-back
        observations, and the current plan."""
        return {"factors": dict(self.factors), "assumed": dict(self.assumed), "measured": sorted(self.measured),
                "history": {k: list(v) for k, v in self.history.items()},
                "held": {k: list(v) for k, v in self.held.items()},
                "level": {k: list(v) for k, v in self.level.items()},
                "since": {k: list(v) for k, v in self.since.items()}, "assumed_n": dict(self.assumed_n),
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
