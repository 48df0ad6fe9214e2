"""A plan that settles (docs/design/architecture.md, "The plan is a loop"): measured profiles as the planner sees them.

The planner's choice of (batch, inner steps) for a worker is discrete: the planning rule takes, among the
options that fill the round within 1%, the one with the most sequences, and options as far apart as 14 steps
of 4 sequences and 4 steps of 23 are often within that 1% of each other. Datasheet profiles are exact, so the
choice is too; measured step times carry a few percent of noise, and a difference far inside that noise
picks another lattice point: three regions whose calibrated tables were 3% apart got micro-batches 4, 17 and
10, and each re-plan from the next noisy round moved them again, to batches where the calibrated line was
wrong by more than the noise, so the round measured apart from the plan and re-planned again. Two things make
a plan from measurements settle:

* **Alike workers are planned as one** (:func:`alike_groups`, :func:`pooled`): measured workers whose step
  times differ by less than their measurements can tell (``k·√(u_i² + u_j²)``, u a worker's relative
  uncertainty; at least :data:`ALIKE_FLOOR`, at most :data:`ALIKE_CEILING`) are planned with one profile, the
  geometric mean of theirs, so they get the same plan whatever GPU each declared. A worker whose uncertainty
  is 0 (a datasheet profile) is never pooled: those plans are unchanged. Workers further apart than the
  ceiling are never pooled, however noisy their measurements: planned as one, each would run
  half their difference off its own speed, every round, which costs more idle than the lattice's choice
  pooling avoids (on a busy host calibrations measured with 15-47% noise pooled regions 1.5-3× apart).
* **The table is corrected where the plan runs** (:class:`AdjustedProfile`, :func:`corrected`): a round's
  compute time measures the step time at the batch the plan gives the worker; where it finds the table wrong
  (beyond the noise, at a batch not measured before), the online planner keeps a correction at that batch
  (piecewise log-linear in the batch between corrected batches, constant beyond them), so a re-plan that
  moves a worker to another batch and back predicts each from what was measured there, not from one factor
  applied to a table that is wrong at one of them.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..hardware import WorkerProfile
from .plan import PlanConstraints, scaled_profiles, split_batch

Points = tuple[tuple[int, float], ...]  # (batch, factor) measured, ascending batches
# measured workers whose step times differ by less than this are planned as one even when their noise is lower:
# a few percent apart is not worth another lattice point of (batch, steps), which is often no better balanced
ALIKE_FLOOR = 0.03
# ... and never when they differ by more than this (in log, about 10%), however noisy: pooled, each would be planned
# half that far from its own speed (the faster waiting that long every round), and a plan apart costs at most
# the lattice point it picks
ALIKE_CEILING = 0.10


def correction_at(points: Points, batch: int) -> float:
    """The factor at ``batch`` from ``points``: piecewise linear in the batch on the log of the factors
    between measured batches, the nearest one's beyond them; 1 without points."""
    if not points:
        return 1.0
    xs = [b for b, _ in points]
    i = bisect.bisect_left(xs, batch)
    if i < len(xs) and xs[i] == batch:
        return points[i][1]
    if i == 0:
        return points[0][1]
    if i == len(xs):
        return points[-1][1]
    (b0, f0), (b1, f1) = points[i - 1], points[i]
    w = (batch - b0) / (b1 - b0)
    return math.exp((1 - w) * math.log(f0) + w * math.log(f1))


@dataclass
class AdjustedProfile(WorkerProfile):
    """A profile whose step time is that of ``parts``: the geometric mean over (profile, points) of
    ``profile.step_s(m, a)`` × :func:`correction_at` (points, m·a), times this profile's ``slowdown``. One
    part with points: a worker's profile corrected at the batches measured in place; several parts: workers
    planned as one (:func:`pooled`). ``table`` and the other fields are the worker's own (for its records)."""

    parts: tuple = ()

    def step_s(self, micro_batch: int, accum: int) -> float:
        b = micro_batch * accum
        if len(self.parts) == 1:
            p, points = self.parts[0]
            return self.slowdown * p.step_s(micro_batch, accum) * correction_at(points, b)
        logs = [math.log(p.step_s(micro_batch, accum) * correction_at(points, b)) for p, points in self.parts]
        return self.slowdown * math.exp(math.fsum(logs) / len(logs))


def _parts(profile: WorkerProfile) -> tuple:
    return profile.parts if isinstance(profile, AdjustedProfile) else ((profile, ()),)


def corrected(profile: WorkerProfile, points: Points) -> WorkerProfile:
    """``profile`` corrected by the factors measured at ``points`` (one point or none: a plain copy whose
    ``slowdown`` carries the factor, as :func:`~geomesh.planner.plan.scaled_profiles` makes)."""
    if len(points) <= 1:
        return scaled_profiles([profile], {profile.name: points[0][1] if points else 1.0})[0]
    points = monotone_points(profile, points)
    return AdjustedProfile(name=profile.name, gpu=profile.gpu, gpu_count=profile.gpu_count,
                           max_micro_batch=profile.max_micro_batch, table=dict(profile.table),
                           step_overhead_s=profile.step_overhead_s, source=profile.source, slowdown=1.0,
                           extra=dict(profile.extra), round_overhead_s=profile.round_overhead_s,
                           parts=((profile, tuple(points)),))  # fmt: skip


def monotone_points(profile: WorkerProfile, points: Points) -> Points:
    """``points`` (batch, factor), sorted by batch, each raised where needed so that the corrected step time at a
    measured batch is never below a smaller measured batch's: a step of more sequences takes no less time on the
    same worker. Measurements that say otherwise (a region slowed just as its plan moved it to a batch it had not
    measured: read as the table wrong there, its older, faster points kept) would make the larger batch look
    faster and draw the plan's work to it; held to the smaller batch's time, the worker is not underestimated.
    (Between two points the factors' interpolation in log may still bend the time by a fraction of a percent.)"""
    cap = max(profile.max_micro_batch, 1)
    out, floor = [], 0.0
    for b, f in sorted(points):
        table = profile.step_s(*split_batch(max(b, 1), cap))
        floor = max(floor, f * table)
        out.append((b, floor / table))
    return tuple(out)


def table_noise(profile: WorkerProfile) -> float:
    """The relative uncertainty of a profile's step times: a calibration's (``extra["table_noise"]``, see
    :mod:`geomesh.profiler`), 0 for the datasheet model (exact by construction) or a profile without it."""
    value = profile.extra.get("table_noise") if profile.source == "measured" else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return 0.0
    return float(value)


def comparison_batches(profiles: Sequence[WorkerProfile], constraints: PlanConstraints,
                       also: Sequence[int] = ()) -> list[int]:  # fmt: skip
    """Where two workers' step times are compared: the reference batch (the planning rule's round is made of
    it), the batches given (where the plan runs them, where they were measured), and the profiles' own
    measured points from there up (below it a measured line is its noisiest: the intercept)."""
    c = constraints
    lo = max(c.min_batch, c.ref_batch if c.ref_batch is not None else c.min_batch)
    points = {b for p in profiles for b in p.table if lo <= b <= c.max_batch}
    return sorted(points | {b for b in (lo, *also) if c.min_batch <= b <= c.max_batch})


def alike_groups(profiles: Sequence[WorkerProfile], batches: Sequence[int],
                 tolerance: Callable[[str, str, int], float]) -> list[list[int]]:  # fmt: skip
    """Indices of ``profiles`` in groups of workers that measure alike, fastest group first.

    Two workers are alike when at every batch b of ``batches`` their step times (accumulated as the planner
    would) differ by at most ``tolerance(name_i, name_j, b)`` in log (0: never alike; never more than
    :data:`ALIKE_CEILING`, whatever it says), and their largest micro-batches by at most the smallest of those.
    Deterministic: the workers in order of their step time at the first batch (then name); each group starts at
    the fastest worker not yet grouped and takes every later one alike with it."""
    n = len(profiles)
    if n < 2 or not batches:
        return [[i] for i in range(n)]
    times = []
    for p in profiles:
        cap = max(p.max_micro_batch, 1)
        times.append([math.log(p.step_s(*split_batch(b, cap))) for b in batches])
    order = sorted(range(n), key=lambda i: (times[i][0], profiles[i].name))

    def alike(i: int, j: int) -> bool:
        tols = [min(ALIKE_CEILING, tolerance(profiles[i].name, profiles[j].name, b)) for b in batches]
        if min(tols) <= 0:
            return False
        ci, cj = profiles[i].max_micro_batch, profiles[j].max_micro_batch
        if ci != cj and abs(math.log(ci / cj)) > min(tols):
            return False
        return all(abs(a - b) <= tol for a, b, tol in zip(times[i], times[j], tols))

    groups, grouped = [], set()
    for pos, i in enumerate(order):
        if i in grouped:
            continue
        group = [i] + [j for j in order[pos + 1 :] if j not in grouped and alike(i, j)]
        grouped.update(group)
        groups.append(group)
    return groups


def pooled(profiles: Sequence[WorkerProfile], groups: Sequence[Sequence[int]]) -> list[WorkerProfile]:
    """``profiles`` (in their order) with every worker of a group of several planned with the group's one
    profile: the geometric mean of the members' step times, the smallest largest micro-batch; each keeps its
    own name, GPU and records. A group of one is the worker's profile as given."""
    out = list(profiles)
    for group in groups:
        if len(group) < 2:
            continue
        parts = tuple(part for i in sorted(group) for part in _parts(profiles[i]))
        cap = min(profiles[i].max_micro_batch for i in group)
        for i in group:
            p = profiles[i]
            out[i] = AdjustedProfile(name=p.name, gpu=p.gpu, gpu_count=p.gpu_count, max_micro_batch=cap,
                                     table=dict(p.table), step_overhead_s=p.step_overhead_s, source=p.source,
                                     slowdown=1.0, extra=dict(p.extra), round_overhead_s=p.round_overhead_s,
                                     parts=parts)  # fmt: skip
    return out


def settled_profiles(profiles: Sequence[WorkerProfile], constraints: PlanConstraints, k: float) -> list[WorkerProfile]:
    """Profiles for a plan made from calibrations alone (no round measured yet): workers whose measured
    tables are alike within their calibrations' noise (:func:`table_noise`, ``k`` of it) are planned as one.
    Datasheet profiles (no noise) come back as given, and so does everything when ``k`` is 0."""
    if k <= 0:
        return list(profiles)
    noise = {p.name: table_noise(p) for p in profiles}
    if not any(noise.values()):
        return list(profiles)

    def tolerance(a: str, b: str, batch: int) -> float:
        return max(ALIKE_FLOOR, k * math.hypot(noise[a], noise[b])) if noise[a] and noise[b] else 0.0

    return pooled(profiles, alike_groups(profiles, comparison_batches(profiles, constraints), tolerance))
