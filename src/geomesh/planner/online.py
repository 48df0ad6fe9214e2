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


class OnlinePlanner:
    """Re-plans between rounds when workers turn out slower or faster than their profiles say.

    ``observe`` folds one measurement into the worker's speed factor f (measured / predicted compute time,
    relative to the profile given here): ``f ← smoothing·f + (1 − smoothing)·measured/predicted``.
    ``maybe_replan`` returns a new plan (made on copies of the profiles with ``slowdown`` scaled by f) when
    some worker's |f − f_assumed| / f_assumed exceeds ``threshold``, f_assumed being the factor the current
    plan was made with; otherwise ``None``. The caller's profiles are copied, never changed.

    ``first_measurement_sets_factor``: a worker's first measurement becomes its factor outright instead of
    being smoothed with the profile's 1.0. For profiles of another model than the one that trains (a user's
    loop planned with the scenario's timing model), where 1.0 is no evidence and smoothing towards it would
    take many rounds to forget it. :meth:`state_dict` / :meth:`load_state_dict` carry the factors and the
    current plan (JSON values), so a resumed run re-plans as the uninterrupted one.
    """

    def __init__(
        self,
        profiles: Sequence[WorkerProfile],
        constraints: PlanConstraints,
        *,
        smoothing: float = 0.5,
        threshold: float = 0.1,
        first_measurement_sets_factor: bool = False,
    ):
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing={smoothing!r}: must be in [0, 1)")
        if not threshold > 0.0:
            raise ValueError(f"threshold={threshold!r}: must be > 0")
        constraints.validate()
        self.profiles = scaled_profiles(profiles, {})
        self.constraints = constraints
        self.smoothing = smoothing
        self.threshold = threshold
        self.factors: dict[str, float] = {p.name: 1.0 for p in self.profiles}
        self.assumed: dict[str, float] = dict(self.factors)
        self.current: Plan | None = None
        self.first_measurement_sets_factor = first_measurement_sets_factor
        self.measured: set[str] = set()  # workers with at least one measurement folded in

    def plan(self, exchange_bytes: int = 0, exchange_s: float = 0.0) -> Plan:
        """Plan now with the current speed factors (and remember them as assumed)."""
        self.current = plan_balanced(
            scaled_profiles(self.profiles, self.factors), self.constraints, exchange_bytes, exchange_s
        )
        self.assumed = dict(self.factors)
        return self.current

    def observe(self, name: str, measured_compute_s: float, plan: Plan) -> float:
        """Fold one round's measured compute time of ``name`` (following ``plan``) in; returns its factor."""
        profile = next((p for p in self.profiles if p.name == name), None)
        if profile is None:
            raise ValueError(f"unknown worker {name!r}; workers: {', '.join(self.factors)}")
        observed = _implied_factor(profile, _entry(plan, name), measured_compute_s)
        if self.first_measurement_sets_factor and name not in self.measured:
            f = observed
        else:
            f = self.smoothing * self.factors[name] + (1.0 - self.smoothing) * observed
        self.factors[name] = f
        self.measured.add(name)
        return f

    def drift(self) -> dict[str, float]:
        """Per worker |f − f_assumed| / f_assumed."""
        return {k: abs(f - self.assumed[k]) / self.assumed[k] for k, f in self.factors.items()}

    def maybe_replan(self, exchange_bytes: int = 0, exchange_s: float = 0.0) -> Plan | None:
        """A new plan when a speed factor drifted past ``threshold`` (or when there is none yet), else None."""
        if self.current is None or max(self.drift().values()) > self.threshold:
            return self.plan(exchange_bytes, exchange_s)
        return None

    def state_dict(self) -> dict:
        """The speed factors, the factors the current plan assumed, who was measured, and the current plan."""
        return {"factors": dict(self.factors), "assumed": dict(self.assumed), "measured": sorted(self.measured),
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
        self.current = Plan.from_json(state["current"]) if state.get("current") is not None else None
