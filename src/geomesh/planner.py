"""The GeoMesh planner: each worker's batch size and inner steps, so every worker computes equally long.

Units: batches and targets are in **sequences** (the caller converts tokens: tokens = sequences · seq_len),
times in **seconds**. A worker's *plan* is ``micro_batch``, ``accum`` (micro-batches per inner step),
``batch`` = micro_batch·accum and ``inner_steps`` H; its predicted compute time per round is
``c_i = H_i · profile.step_s(micro_batch_i, accum_i)`` and it contributes ``S_i = batch_i · H_i`` sequences.
The round lasts ``round_s = max_i c_i + exchange_s``; a worker that finishes early waits
``max_j c_j − c_i`` at the barrier (straggler wait). With overlap (``PlanConstraints.overlap``,
docs/overlap.md) the exchange of a round runs under the next round's compute, so a round lasts
``round_s = max(max_i c_i, exchange_s)`` and the planning rule's compute time is floored at the exchange:
``T = max(T_rule, exchange_s)``. Everything here is pure: no I/O, no clock.

Two planners:

* :func:`plan_uniform` (DiLoCo): one ``batch`` and one H for everyone; each worker reaches the batch with
  the fewest micro-batches that fit (:func:`split_batch`). On a heterogeneous cluster fast workers idle.
* :func:`plan_balanced` (GeoMesh): per-worker (batch_i, H_i), by one of two targets.

The planning rule (the default: ``PlanConstraints(fill=True, ref_batch=b, ref_inner_steps=H)``)
------------------------------------------------------------------------------------------------
The round's compute time T is what the reference plan (H steps of b sequences: DiLoCo's plan) takes on the
slowest worker (:func:`reference_round_s`), or ``round_compute_s`` when given. Every worker then fills T on
its own: among its candidate batches ``B_i`` (below, with T as the round) and every H with
``H · step(b) ≤ T``, the options whose compute is within ``FILL_SLACK`` (1%) of the longest that fits
(straggler idle first), and among those the most sequences (the most efficient batch), then the smaller
batch. So GeoMesh synchronises exactly as often as DiLoCo and fast workers do more useful work instead of
waiting, with no tuned knob; re-planning (faults, measured speed drift) applies the same rule to the live
workers' scaled profiles. A worker that cannot fit ``min_inner_steps`` of its smallest batch into T gets its
quickest option and a warning.

The sequence target (``target_sequences``, or ``(ref_batch, ref_inner_steps)`` without ``fill``) is the
alternative: the round carries a given number of sequences and the deadline is searched, as follows.

Problem solved by :func:`plan_balanced` with a sequence target
--------------------------------------------------------------
Candidate batches. Worker i's *knee* k_i is the smallest micro-batch m ≤ min(max_micro_batch, max_batch)
with ``throughput(m) ≥ knee · max_m' throughput(m')`` (the point where larger micro-batches stop paying).
``r_i = max b / step_s(b)`` over b in [min_batch, max(k_i, min_batch)] is its *knee rate* (sequences/s),
and ``T0 = target / Σ_i r_i`` the continuous balanced round (:func:`balanced_round_s`). Its candidate
batches are ``B_i = {b : min_batch ≤ b ≤ u_i}`` with ``u_i = max(k_i, min_batch,
⌈STEP_HEADROOM·T0·r_i / max_inner_steps⌉)`` capped at max_batch: batches sit at or below the knee unless
max_inner_steps steps of the knee batch cannot fill the round, and a slow GPU can step down to smaller
batches when the round is short; the integer range also gives the fine granularity that equal compute
times need. Only when the target cannot be reached at all is ``B_i`` widened to [min_batch, max_batch].
Batches above max_micro_batch are reached with accumulation (:func:`split_batch`).

Constraints: b_i ∈ B_i, ``min_inner_steps ≤ H_i ≤ max_inner_steps`` (integers) and the sequences per round
``S = Σ_i b_i·H_i`` within ``[⌈target·(1−tolerance)⌉, ⌊target·(1+tolerance)⌋]``.

Objective: maximise the *balance score*

    V = Σ_i ((1−β)·c_i + β·S_i/r_i) / (n · max_i c_i)  =  1 − idle − β·slow,

with idle = Σ_i (max c − c_i) / (n · max c) (the straggler idle of the compute phase) and
slow = Σ_i (c_i − S_i/r_i) / (n · max c) (time lost to batches below the knee rate), β =
``efficiency_weight`` (default 0.5). So straggler idle is the primary term, and the efficiency term keeps
batches at the knee instead of the smallest ones (with β = 1, V is the useful utilisation: for a given
number of sequences it is highest when the round's compute time is lowest). Among plans whose V is within
``V_SLACK`` (0.003) of the best, the one whose S is closest to the target wins (then higher V).
:func:`plan_objective` computes V for any plan; the tests compare it with an exhaustive search.

Algorithm (64 workers plan in well under a second):

1. For a deadline T, worker i's best response is the (b, H) with the highest value
   v_i = (1−β)·c_i + β·S_i/r_i among those with c_i ≤ T (for each b that is the largest H that fits);
   if none fits, its quickest option. For a fixed round compute time the objective is a sum of these
   values, so only the deadline has to be searched.
2. Bisection on the (monotone) most-sequences responses, started from the continuous balanced time
   target / Σ r_i, finds the deadline window [T_a, T_b] in which the sequences per round can lie in the
   band (the most-sequences plans at T_a and T_b are candidates); the window is stretched by
   ``WINDOW_STRETCH`` (1.5 for small problems) above, since best-value responses may do fewer sequences.
3. Sweep: every (b, H) of every worker with compute time in the window is an *event*; in time order, an
   event that raises its worker's best value changes the plan, and at that event the round's compute time
   is exactly the event's time (or the quickest option of a worker that fits nowhere yet). Scoring V after
   each event enumerates every distinct best-response plan in the window; those in the band are
   candidates. Cost: O(events · log events), events ≈ Σ_i Σ_{b∈B_i} (window / step time(b) + 1), capped.
4. The band couples the workers, so for small problems (≤ 8 workers) the sweep is repeated with a ladder
   of prices λ on sequences (criterion v + λ·S, a Lagrangian relaxation of the band), and the best plans
   just outside the band are *repaired*: one worker's (b, H) is changed so that S lands in the band. The
   same repair is used when no best-response plan falls in the band (it jumps over a narrow band).
5. The best candidate by the rule above wins; none at all raises :class:`PlanError`. A plan whose predicted
   straggler idle still exceeds ``IDLE_WARN`` (the constraints forbid better, e.g. a slow worker's
   min_batch·min_inner_steps takes longer than the balanced round) comes with a warning that says why.

Online re-planning (beyond the paper): :class:`OnlinePlanner` keeps a smoothed per-worker speed factor
(measured compute time / the profile's prediction), plans on copies of the profiles with that factor as
``slowdown``, and re-plans when a factor drifts more than ``threshold`` from what the current plan assumed.
:func:`replan` does one such re-plan from one set of measurements.

Impossible input raises :class:`PlanError` (a ``ValueError``) naming the worker or field and the reason:
a worker whose ``max_micro_batch`` is 0 (the model fits no micro-batch; with ``allow_drop=True`` it is left
out with a warning and listed in ``Plan.dropped``), duplicate names, min > max, or an unreachable target.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import PlanError
from .hardware import WorkerProfile

__all__ = [
    "PlanError",
    "PlanConstraints",
    "WorkerPlan",
    "Plan",
    "plan_balanced",
    "plan_uniform",
    "replan",
    "OnlinePlanner",
    "split_batch",
    "knee_micro_batch",
    "candidate_batches",
    "knee_rate",
    "balanced_round_s",
    "reference_round_s",
    "plan_objective",
    "scaled_profiles",
]

IDLE_WARN = 0.05  # plan_balanced warns when the predicted straggler idle of the compute phase exceeds this
V_SLACK = 0.003  # plans within this much of the best balance score count as equally good
STEP_HEADROOM = 1.25  # B_i reaches at least the batch that fills 1.25 x the balanced round in max H steps
WINDOW_STRETCH = 1.15  # how far above T_b the sweep looks (best-value responses do fewer sequences)
_EPS = 1e-12  # relative slack when comparing a compute time with a deadline (float rounding)
_MAX_EVENTS = 150_000  # cap on (b, H) pairs swept; the window is narrowed when it would hold more
_SMALL_SWEEP = 20_000  # small problems (pairs, workers): the sweep is repeated with prices on sequences
_SMALL_CLUSTER = 8  # and the best plans near the band are repaired into it
_SMALL_STRETCH = 1.5  # and the window is stretched further
_PRICE_LADDER = (0.0, -0.5, -0.25, -0.1, -0.04, 0.04, 0.1, 0.25, 0.5, 1.0)
_REPAIRED = 8  # in small sweeps, how many of the best plans just outside the band are repaired into it
_REPAIR_MARGIN = 0.25  # "just outside": within this fraction of the target
FILL_SLACK = 0.01  # the planning rule: options within 1% of a worker's longest compute count as filling the round


# ----------------------------------------------------------------------------------------------------
# constraints and results


@dataclass(frozen=True)
class PlanConstraints:
    """What :func:`plan_balanced` must respect.

    The round's target is ``target_sequences`` (sequences summed over all workers and inner steps), or
    ``n_workers · ref_batch · ref_inner_steps`` when the reference pair is given instead (n = the workers
    actually planned, after drops). ``tolerance`` is relative (0.1 = ±10 %). ``knee`` sets the efficiency
    knee (see the module docstring). ``allow_drop`` leaves out, with a warning, a worker that cannot run.
    """

    target_sequences: int | None = None
    ref_batch: int | None = None
    ref_inner_steps: int | None = None
    min_batch: int = 1
    max_batch: int = 512
    min_inner_steps: int = 1
    max_inner_steps: int = 1000
    tolerance: float = 0.1
    allow_drop: bool = False
    knee: float = 0.9
    efficiency_weight: float = 0.5  # β in the balance score; 0: balance only, 1: useful utilisation
    fill: bool = False  # the planning rule: the round lasts the reference plan on the slowest worker
    round_compute_s: float | None = None  # an explicit compute time per round (fill it), instead of a target
    # the exchange of a round runs under the next round's compute (docs/overlap.md): a round lasts
    # max(compute, exchange), and a round that fills a time (the rule, round_compute_s) fills at least the exchange
    overlap: bool = False

    def validate(self) -> None:
        """Raise :class:`PlanError` naming the field, the value and what is allowed."""

        def positive_int(name: str, value: object) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"constraint {name}={value!r}: must be an integer >= 1")

        has_target = self.target_sequences is not None
        has_ref = self.ref_batch is not None or self.ref_inner_steps is not None
        if self.round_compute_s is not None:
            t = self.round_compute_s
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
                raise PlanError(f"constraint round_compute_s={t!r}: must be a positive number of seconds")
            if has_target or self.fill:
                raise PlanError("constraints: give round_compute_s, or a target (target_sequences, fill), not both")
        elif self.fill:
            if has_target or self.ref_batch is None or self.ref_inner_steps is None:
                raise PlanError("constraints: fill needs the reference plan (ref_batch, ref_inner_steps) and no "
                                "target_sequences")  # fmt: skip
            positive_int("ref_batch", self.ref_batch)
            positive_int("ref_inner_steps", self.ref_inner_steps)
        elif has_target and has_ref:
            raise PlanError("constraints: give target_sequences or (ref_batch, ref_inner_steps), not both")
        if has_target:
            positive_int("target_sequences", self.target_sequences)
        elif has_ref:
            positive_int("ref_batch", self.ref_batch)
            positive_int("ref_inner_steps", self.ref_inner_steps)
        elif self.round_compute_s is None:
            raise PlanError("constraints: a target is needed: target_sequences, (ref_batch, ref_inner_steps), fill "
                            "or round_compute_s")  # fmt: skip
        for name in ("min_batch", "max_batch", "min_inner_steps", "max_inner_steps"):
            positive_int(name, getattr(self, name))
        if self.min_batch > self.max_batch:
            raise PlanError(f"constraints: min_batch={self.min_batch} > max_batch={self.max_batch}")
        if self.min_inner_steps > self.max_inner_steps:
            raise PlanError(
                f"constraints: min_inner_steps={self.min_inner_steps} > max_inner_steps={self.max_inner_steps}"
            )
        if not (isinstance(self.tolerance, (int, float)) and 0.0 <= self.tolerance < 1.0):
            raise PlanError(f"constraint tolerance={self.tolerance!r}: must be in [0, 1)")
        if not (isinstance(self.knee, (int, float)) and 0.0 < self.knee <= 1.0):
            raise PlanError(f"constraint knee={self.knee!r}: must be in (0, 1]")
        if not (isinstance(self.efficiency_weight, (int, float)) and 0.0 <= self.efficiency_weight <= 1.0):
            raise PlanError(f"constraint efficiency_weight={self.efficiency_weight!r}: must be in [0, 1]")

    @property
    def fills(self) -> bool:
        """Whether the plan fills a round time (the rule, or an explicit one) instead of a sequence target."""
        return self.fill or self.round_compute_s is not None

    def target(self, n_workers: int) -> int:
        """The round's target in sequences for ``n_workers`` planned workers (sequence-target mode)."""
        if self.target_sequences is not None:
            return int(self.target_sequences)
        return int(n_workers * self.ref_batch * self.ref_inner_steps)  # type: ignore[operator]

    def band(self, n_workers: int) -> tuple[int, int]:
        """Allowed sequences per round: (lowest, highest), inclusive."""
        t = self.target(n_workers)
        lo = max(1, math.ceil(t * (1.0 - self.tolerance) - 1e-9))
        hi = math.floor(t * (1.0 + self.tolerance) + 1e-9)
        return lo, max(lo, hi)


@dataclass
class WorkerPlan:
    """One worker's part of a round: ``inner_steps`` steps of ``batch`` = micro_batch·accum sequences."""

    name: str
    gpu: str
    micro_batch: int
    accum: int
    batch: int
    inner_steps: int
    compute_s: float  # predicted compute time this round (seconds)
    straggler_wait_s: float  # predicted wait at the barrier: max compute − own compute (seconds)

    @property
    def sequences(self) -> int:
        """Sequences this worker processes per round."""
        return self.batch * self.inner_steps


_WORKER_FIELDS = [f.name for f in dataclasses.fields(WorkerPlan)]


@dataclass
class Plan:
    """One round's plan for the whole cluster (``workers`` in the order of the profiles given)."""

    workers: list[WorkerPlan]
    round_s: float  # max compute + exchange (seconds)
    compute_s: float  # max compute (seconds)
    sequences_per_round: int
    utilization: float  # Σ compute / (n · round_s)
    exchange_bytes: int
    exchange_s: float
    straggler_idle_frac: float  # Σ straggler wait / (n · round_s)
    dropped: dict[str, str] = field(default_factory=dict)  # worker name -> why it was left out
    method: str = "geomesh"  # "geomesh" (balanced) or "uniform"
    target_sequences: int | None = None
    rule: str = ""  # how the round's length was chosen, in words
    overlap: bool = False  # the exchange runs under the next round's compute: round_s = max(compute, exchange)

    def worker(self, name: str) -> WorkerPlan:
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(f"no worker {name!r} in the plan; workers: {', '.join(w.name for w in self.workers)}")

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "workers": [dataclasses.asdict(w) for w in self.workers],
            "round_s": self.round_s,
            "compute_s": self.compute_s,
            "sequences_per_round": self.sequences_per_round,
            "target_sequences": self.target_sequences,
            "utilization": self.utilization,
            "exchange_bytes": self.exchange_bytes,
            "exchange_s": self.exchange_s,
            "straggler_idle_frac": self.straggler_idle_frac,
            "dropped": dict(self.dropped),
            "rule": self.rule,
            "overlap": self.overlap,
        }

    @classmethod
    def from_json(cls, data: Mapping) -> "Plan":
        """Inverse of :meth:`to_json`; ``ValueError`` with the reason when malformed."""
        try:
            workers = []
            for w in data["workers"]:
                missing = [k for k in _WORKER_FIELDS if k not in w]
                if missing:
                    raise ValueError(f"worker entry lacks {', '.join(missing)}")
                workers.append(
                    WorkerPlan(
                        name=str(w["name"]),
                        gpu=str(w["gpu"]),
                        micro_batch=int(w["micro_batch"]),
                        accum=int(w["accum"]),
                        batch=int(w["batch"]),
                        inner_steps=int(w["inner_steps"]),
                        compute_s=float(w["compute_s"]),
                        straggler_wait_s=float(w["straggler_wait_s"]),
                    )
                )
            target = data.get("target_sequences")
            return cls(
                workers=workers,
                round_s=float(data["round_s"]),
                compute_s=float(data["compute_s"]),
                sequences_per_round=int(data["sequences_per_round"]),
                utilization=float(data["utilization"]),
                exchange_bytes=int(data["exchange_bytes"]),
                exchange_s=float(data["exchange_s"]),
                straggler_idle_frac=float(data["straggler_idle_frac"]),
                dropped={str(k): str(v) for k, v in dict(data.get("dropped", {})).items()},
                method=str(data.get("method", "geomesh")),
                target_sequences=None if target is None else int(target),
                rule=str(data.get("rule", "")),
                overlap=bool(data.get("overlap", False)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"bad plan: {exc}") from None


# ----------------------------------------------------------------------------------------------------
# per-worker facts


def split_batch(batch: int, max_micro_batch: int) -> tuple[int, int]:
    """(micro_batch, accum) with micro_batch·accum == batch exactly and micro_batch ≤ max_micro_batch.

    accum starts at ⌈batch / max_micro_batch⌉ and grows to the first value that divides ``batch``
    (at worst accum = batch, micro_batch = 1).
    """
    if batch < 1:
        raise PlanError(f"batch={batch}: must be >= 1")
    if max_micro_batch < 1:
        raise PlanError(f"max_micro_batch={max_micro_batch}: the model fits no micro-batch")
    accum = -(-batch // max_micro_batch)
    while batch % accum:
        accum += 1
    return batch // accum, accum


def knee_micro_batch(profile: WorkerProfile, knee: float = 0.9, max_batch: int | None = None) -> int:
    """Smallest micro-batch m ≤ min(max_micro_batch, max_batch) with throughput(m) ≥ knee · the best there."""
    cap = profile.max_micro_batch if max_batch is None else min(profile.max_micro_batch, max_batch)
    if cap < 1:
        raise PlanError(f"worker {profile.name!r} ({profile.gpu}): the model fits no micro-batch (max_micro_batch=0)")
    thr = [profile.throughput(m) for m in range(1, cap + 1)]
    best = max(thr)
    for m, t in enumerate(thr, start=1):
        if t >= knee * best * (1 - 1e-12):
            return m
    return cap  # unreachable: the best itself qualifies


def _upper(knee_upper: int, rate: float, round_s: float | None, c: PlanConstraints) -> int:
    if round_s is None:
        return knee_upper
    need = math.ceil(STEP_HEADROOM * round_s * rate / c.max_inner_steps)  # to fill the round in max H steps
    return min(c.max_batch, max(knee_upper, need))


def candidate_batches(
    profile: WorkerProfile,
    constraints: PlanConstraints,
    *,
    round_s: float | None = None,
    widened: bool = False,
) -> list[int]:
    """``B_i``: batches from min_batch up to the knee, or up to what fills ``round_s`` (the continuous
    balanced round, :func:`balanced_round_s`) in max_inner_steps steps when that is more, or up to
    max_batch when ``widened``."""
    c = constraints
    if widened:
        upper = c.max_batch
    else:
        knee_upper = min(c.max_batch, max(knee_micro_batch(profile, c.knee, c.max_batch), c.min_batch))
        upper = _upper(knee_upper, knee_rate(profile, c), round_s, c)
    return list(range(c.min_batch, upper + 1))


def knee_rate(profile: WorkerProfile, constraints: PlanConstraints) -> float:
    """``r_i``: the best sequences per second over batches min_batch..knee (one inner step per batch)."""
    c = constraints
    cap = profile.max_micro_batch
    upper = min(c.max_batch, max(knee_micro_batch(profile, c.knee, c.max_batch), c.min_batch))
    return max(b / profile.step_s(*split_batch(b, cap)) for b in range(c.min_batch, upper + 1))


def balanced_round_s(profiles: Sequence[WorkerProfile], constraints: PlanConstraints) -> float:
    """The continuous balanced round compute time target / Σ_i r_i (seconds) for these workers."""
    return constraints.target(len(profiles)) / sum(knee_rate(p, constraints) for p in profiles)


def plan_objective(plan: Plan, profiles: Sequence[WorkerProfile], constraints: PlanConstraints) -> float:
    """Balance score V = Σ_i ((1−β)·c_i + β·S_i/r_i) / (n · max_i c_i) of ``plan`` (higher is better)."""
    by_name = {p.name: p for p in profiles}
    beta = constraints.efficiency_weight
    value = sum(
        (1 - beta) * w.compute_s + beta * w.sequences / knee_rate(by_name[w.name], constraints) for w in plan.workers
    )
    return value / (len(plan.workers) * plan.compute_s)


def scaled_profiles(profiles: Sequence[WorkerProfile], factors: Mapping[str, float]) -> list[WorkerProfile]:
    """Copies of ``profiles`` whose ``slowdown`` is multiplied by ``factors[name]`` (missing: 1)."""
    out = []
    for p in profiles:
        f = float(factors.get(p.name, 1.0))
        if not (math.isfinite(f) and f > 0):
            raise PlanError(f"worker {p.name!r}: speed factor {f!r} must be positive and finite")
        out.append(dataclasses.replace(p, table=dict(p.table), extra=dict(p.extra), slowdown=p.slowdown * f))
    return out


def _usable(profiles: Sequence[WorkerProfile], allow_drop: bool) -> tuple[list[WorkerProfile], dict[str, str]]:
    """The workers that can run, and the ones left out (name -> reason); PlanError when not allowed."""
    if not profiles:
        raise PlanError("no workers to plan")
    names = [p.name for p in profiles]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PlanError(f"duplicate worker names: {', '.join(dup)}")
    kept, dropped = [], {}
    for p in profiles:
        reason = None
        if p.max_micro_batch < 1:
            reason = f"the model fits no micro-batch on {p.gpu} x{p.gpu_count} (max_micro_batch={p.max_micro_batch})"
        else:
            try:
                t = p.step_s(1, 1)
                if not (math.isfinite(t) and t > 0):
                    reason = f"non-positive or non-finite step time {t!r}"
            except (ValueError, ZeroDivisionError) as exc:
                reason = f"bad profile: {exc}"
        if reason is None:
            kept.append(p)
        elif allow_drop:
            warnings.warn(f"planner: worker {p.name!r} left out: {reason}", stacklevel=3)
            dropped[p.name] = reason
        else:
            raise PlanError(f"worker {p.name!r}: {reason}")
    if not kept:
        raise PlanError("no worker can run: " + "; ".join(f"{k}: {v}" for k, v in dropped.items()))
    return kept, dropped


def _assemble(profiles, choices, exchange_bytes, exchange_s, method, target, dropped, rule: str = "",
              overlap: bool = False) -> Plan:  # fmt: skip
    """A Plan from per-worker (micro_batch, accum, inner_steps) choices; with ``overlap`` the exchange runs
    under the next round's compute, so the round lasts max(compute, exchange) instead of their sum."""
    if exchange_s < 0 or not math.isfinite(exchange_s):
        raise PlanError(f"exchange_s={exchange_s!r}: must be finite and >= 0")
    if exchange_bytes < 0:
        raise PlanError(f"exchange_bytes={exchange_bytes!r}: must be >= 0")
    computes = [h * p.step_s(m, a) for p, (m, a, h) in zip(profiles, choices)]
    top = max(computes)
    round_s = max(top, exchange_s) if overlap else top + exchange_s
    n = len(profiles)
    workers = [
        WorkerPlan(p.name, p.gpu, m, a, m * a, h, c, top - c) for p, (m, a, h), c in zip(profiles, choices, computes)
    ]
    return Plan(
        workers=workers,
        round_s=round_s,
        compute_s=top,
        sequences_per_round=sum(w.sequences for w in workers),
        utilization=sum(computes) / (n * round_s),
        exchange_bytes=int(exchange_bytes),
        exchange_s=float(exchange_s),
        straggler_idle_frac=sum(top - c for c in computes) / (n * round_s),
        dropped=dict(dropped),
        method=method,
        target_sequences=target,
        rule=rule,
        overlap=overlap,
    )


# ----------------------------------------------------------------------------------------------------
# DiLoCo: one batch and H for all


def plan_uniform(
    profiles: Sequence[WorkerProfile],
    batch: int,
    inner_steps: int,
    exchange_bytes: int = 0,
    exchange_s: float = 0.0,
    *,
    allow_drop: bool = False,
    overlap: bool = False,
) -> Plan:
    """Everyone ``batch`` sequences per step and ``inner_steps`` steps (DiLoCo); see :func:`split_batch`.
    ``overlap`` only changes the round's length (max(compute, exchange)): the uniform plan is the plan."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlanError(f"batch={batch!r}: must be an integer >= 1")
    if isinstance(inner_steps, bool) or not isinstance(inner_steps, int) or inner_steps < 1:
        raise PlanError(f"inner_steps={inner_steps!r}: must be an integer >= 1")
    kept, dropped = _usable(profiles, allow_drop)
    choices = [(*split_batch(batch, p.max_micro_batch), inner_steps) for p in kept]
    rule = f"uniform: every worker {inner_steps} steps of {batch} sequences"
    if overlap:
        rule += "; the exchange runs under the next round's compute"
    return _assemble(kept, choices, exchange_bytes, exchange_s, "uniform", batch * inner_steps * len(kept), dropped,
                     rule, overlap)  # fmt: skip


def reference_round_s(profiles: Sequence[WorkerProfile], batch: int, inner_steps: int) -> tuple[float, str]:
    """(seconds, worker): the compute time of the reference plan (``inner_steps`` steps of ``batch``
    sequences, split as :func:`split_batch` does) on the slowest of ``profiles``: the planning rule's round."""
    times = [(inner_steps * p.step_s(*split_batch(batch, p.max_micro_batch)), p.name) for p in profiles]
    return max(times)


# ----------------------------------------------------------------------------------------------------
# GeoMesh: balanced plan


class _Worker:
    """Precomputed options of one worker: batches, their splits and step times, value weights."""

    __slots__ = ("profile", "c", "min_h", "step1", "knee_upper", "bs", "ts", "splits", "rate", "wc", "ws", "min_opt")

    def __init__(self, profile: WorkerProfile, constraints: PlanConstraints, min_h: int):
        # the same numbers as knee_micro_batch / candidate_batches / knee_rate, each step time computed once
        c = constraints
        top = min(profile.max_micro_batch, c.max_batch)
        step1 = [profile.step_s(m, 1) for m in range(1, top + 1)]  # accum 1
        for m, t in enumerate(step1, start=1):
            if not (math.isfinite(t) and t > 0):
                raise PlanError(f"worker {profile.name!r}: step time {t!r} at batch {m} is not positive and finite")
        thr = [m / t for m, t in enumerate(step1, start=1)]
        best = max(thr)
        knee = next(m for m, x in enumerate(thr, start=1) if x >= c.knee * best * (1 - 1e-12))
        self.profile, self.c, self.min_h, self.step1 = profile, c, min_h, step1
        self.knee_upper = min(c.max_batch, max(knee, c.min_batch))
        self.rate = max(b / self._step(b) for b in range(c.min_batch, self.knee_upper + 1))
        beta = c.efficiency_weight
        self.wc, self.ws = 1.0 - beta, beta / self.rate  # v = wc·c + ws·S

    def _step(self, b: int) -> float:
        m, a = split_batch(b, self.profile.max_micro_batch)
        t = self.step1[b - 1] if a == 1 else self.profile.step_s(m, a)
        if not (math.isfinite(t) and t > 0):
            raise PlanError(f"worker {self.profile.name!r}: step time {t!r} at batch {b} is not positive and finite")
        return t

    def set_batches(self, upper: int) -> None:
        """Candidate batches min_batch..upper."""
        self.bs = list(range(self.c.min_batch, upper + 1))
        self.splits = [split_batch(b, self.profile.max_micro_batch) for b in self.bs]
        self.ts = [self._step(b) for b in self.bs]
        # quickest option (ties: more sequences): the response when nothing fits the deadline
        j = min(range(len(self.bs)), key=lambda k: (self.ts[k], -self.bs[k]))
        self.min_opt = self.option(self.bs[j], self.min_h, self.ts[j])

    def option(self, b: int, h: int, t: float) -> tuple[float, int, int, int, float]:
        """(c, S, b, H, v) of running ``h`` steps of batch ``b`` (step time ``t``)."""
        c = h * t
        return (c, b * h, b, h, self.wc * c + self.ws * b * h)


def _respond(w: _Worker, deadline: float, min_h: int, max_h: int, lam: float = 0.0):
    """Best response (c, S, b, H, v) to a deadline: the highest v + lam·S with c ≤ deadline.

    Ties go to more sequences; when nothing fits, the quickest option.
    """
    lim = deadline * (1 + _EPS)
    best = None
    best_key = None
    wc, wsq = w.wc, w.ws + lam
    for b, t in zip(w.bs, w.ts):
        h = int(lim / t)
        if h > max_h:
            h = max_h
        if h < min_h:
            continue
        if wc * t + wsq * b <= 0:  # the criterion falls with H: the fewest steps
            h = min_h
        key = (wc * h * t + wsq * b * h, b * h)
        if best is None or key > best_key:
            best, best_key = w.option(b, h, t), key
    return best if best is not None else w.min_opt


def _max_total(ws: list[_Worker], deadline: float, min_h: int, max_h: int) -> int:
    """Σ_i max S_i with c_i ≤ deadline (quickest option when none fits): non-decreasing in the deadline."""
    lim = deadline * (1 + _EPS)
    total = 0
    for w in ws:
        best = -1
        for b, t in zip(w.bs, w.ts):
            h = int(lim / t)
            if h > max_h:
                h = max_h
            if h >= min_h and b * h > best:
                best = b * h
        total += best if best >= 0 else w.min_opt[1]
    return total


def _most_sequences(w: _Worker, deadline: float, min_h: int, max_h: int):
    """The option with the most sequences and c ≤ deadline (ties: shorter); the quickest when none fits."""
    lim = deadline * (1 + _EPS)
    best = None
    for b, t in zip(w.bs, w.ts):
        h = min(max_h, int(lim / t))
        if h >= min_h and (best is None or b * h > best[1] or (b * h == best[1] and h * t < best[0])):
            best = w.option(b, h, t)
    return best if best is not None else w.min_opt


def _bisect(ws, pred, guess: float, t_max: float, min_h: int, max_h: int) -> tuple[float, float]:
    """(a, b), b − a ≤ 1e-9·b, with pred(Σ max S(a)) false and pred(Σ max S(b)) true; pred is monotone in
    the deadline and true at ``t_max``. The bracket is found by doubling or halving from ``guess``."""
    total = lambda t: _max_total(ws, t, min_h, max_h)  # noqa: E731
    if pred(total(0.0)):
        return 0.0, 0.0
    lo_t, hi_t = 0.0, t_max
    probe = min(max(guess, 1e-9 * t_max), t_max)
    if pred(total(probe)):
        hi_t = probe
        while probe > 1e-9 * t_max:
            probe /= 2
            if not pred(total(probe)):
                lo_t = probe
                break
            hi_t = probe
    else:
        lo_t = probe
        while probe < t_max:
            probe = min(2 * probe, t_max)
            if pred(total(probe)):
                hi_t = probe
                break
            lo_t = probe
    for _ in range(100):
        if hi_t - lo_t <= 1e-9 * hi_t:
            break
        mid = 0.5 * (lo_t + hi_t)
        if pred(total(mid)):
            hi_t = mid
        else:
            lo_t = mid
    return lo_t, hi_t


def _pick(cands: list[tuple[float, int, object]]):
    """The best candidate (V, |S − target|, payload): V within V_SLACK of the best, then closest to target."""
    best_v = max(c[0] for c in cands)
    eligible = [c for c in cands if c[0] >= best_v - V_SLACK]
    return min(eligible, key=lambda c: (c[1], -c[0]))


def _as_candidate(state, n: int, target: int):
    top = max(s[0] for s in state)
    return (sum(s[4] for s in state) / (n * top), abs(sum(s[1] for s in state) - target), state)


class _Repair:
    """``state`` with worker ``i`` switched to ``opt`` (materialised only for the chosen candidate)."""

    __slots__ = ("state", "i", "opt")

    def __init__(self, state, i, opt):
        self.state, self.i, self.opt = state, i, opt

    def materialise(self):
        new = list(self.state)
        new[self.i] = self.opt
        return new


def _repairs(ws, state, lo, hi, target, min_h, max_h):
    """Plans that change one worker of ``state`` so that Σ S lands in [lo, hi], as candidates for _pick."""
    n = len(ws)
    total = sum(s[1] for s in state)
    value = sum(s[4] for s in state)
    tops = sorted(((s[0], j) for j, s in enumerate(state)), reverse=True)[:2]
    out = []
    for i, w in enumerate(ws):
        rest = total - state[i][1]
        rest_value = value - state[i][4]
        others_top = next((c for c, j in tops if j != i), 0.0)
        for b, t in zip(w.bs, w.ts):
            h_lo = max(min_h, -(-(lo - rest) // b))
            h_hi = min(max_h, (hi - rest) // b)
            for h in {h_lo, h_hi} if h_lo <= h_hi else ():
                opt = w.option(b, h, t)
                top = max(others_top, opt[0])
                out.append(((rest_value + opt[4]) / (n * top), abs(rest + opt[1] - target), _Repair(state, i, opt)))
    return out


def _sweep(ws, t_a, t_b, lam, min_h, max_h):
    """Every distinct best-response plan (criterion v + lam·S) for deadlines in [T_a, T_b].

    Returns (scored [(V, Σ S, event index)], initial state, events); event index −1 is the initial state.
    """
    n = len(ws)
    init = [_respond(w, t_a, min_h, max_h, lam) for w in ws]
    lim_a, lim_b = t_a * (1 + _EPS), t_b * (1 + _EPS)
    events = []
    for i, w in enumerate(ws):
        wc, wsq = w.wc, w.ws
        pairs = []
        for b, t in zip(w.bs, w.ts):
            h0 = max(min_h, int(lim_a / t))
            h1 = min(max_h, int(lim_b / t))
            for h in range(h0, h1 + 1):
                c = h * t
                if lim_a < c <= lim_b:
                    v = wc * c + wsq * b * h
                    pairs.append((c, -(v + lam * b * h), -b * h, b, h, v))
        pairs.sort()
        cur = init[i][4] + lam * init[i][1]
        for c, neg_key, neg_s, b, h, v in pairs:
            if -neg_key > cur:
                cur = -neg_key
                events.append((c, i, -neg_s, b, h, v))
    events.sort()

    floor_top = max((s[0] for s in init if s[0] > lim_a), default=0.0)  # workers that fit no deadline yet
    state_s = [s[1] for s in init]
    state_v = [s[4] for s in init]
    total = sum(state_s)
    value = sum(state_v)
    scored = [(value / (n * max(s[0] for s in init)), total, -1)]
    k, n_ev = 0, len(events)
    while k < n_ev:
        c = events[k][0]
        while k < n_ev and events[k][0] == c:
            _, i, s, _, _, v = events[k]
            total += s - state_s[i]
            value += v - state_v[i]
            state_s[i], state_v[i] = s, v
            k += 1
        scored.append((value / (n * max(c, floor_top)), total, k - 1))
    return scored, init, events


def _replay(init, events, indices):
    """{index: state} for the given event indices (−1: the initial state), in one pass over the events."""
    out = {}
    state = list(init)
    todo = sorted(set(indices))
    j = 0
    while j < len(todo) and todo[j] < 0:
        out[todo[j]] = list(state)
        j += 1
    for k, (c, i, s, b, h, v) in enumerate(events):
        if j >= len(todo):
            break
        state[i] = (c, s, b, h, v)
        while j < len(todo) and todo[j] == k:
            out[k] = list(state)
            j += 1
    return out


def _solve(ws: list[_Worker], lo: int, hi: int, target: int, min_h: int, max_h: int):
    """Per-worker options (c, S, b, H, v) of the best plan, or None when the band is unreachable."""
    n = len(ws)
    t_max = max(max_h * max(w.ts) for w in ws)
    if _max_total(ws, t_max, min_h, max_h) < lo:
        return None
    # deadline window from the most-sequences responses: T_a = smallest deadline with Σ S ≥ lo,
    # T_b = largest with Σ S ≤ hi (their plans are in the band and always candidates)
    guess = target / sum(w.rate for w in ws)  # the continuous balanced round time
    if _max_total(ws, 0.0, min_h, max_h) >= lo:
        t_a = 0.0
    else:
        t_a = _bisect(ws, lambda s: s >= lo, guess, t_max, min_h, max_h)[1]
    if _max_total(ws, t_max, min_h, max_h) <= hi:
        t_b = t_max
    else:
        t_b = _bisect(ws, lambda s: s > hi, guess, t_max, min_h, max_h)[0]
    above = [_most_sequences(w, t_a, min_h, max_h) for w in ws]
    below = [_most_sequences(w, t_b, min_h, max_h) for w in ws]
    if t_a <= t_b:
        cands = [_as_candidate(x, n, target) for x in (above, below) if lo <= sum(s[1] for s in x) <= hi]
    else:  # Σ S jumps over the band between T_b and T_a: repair the plans on both sides of the jump
        cands = _repairs(ws, above, lo, hi, target, min_h, max_h) + _repairs(ws, below, lo, hi, target, min_h, max_h)
        t_a, t_b = t_b, t_a

    # best-value responses may do fewer sequences than the most-sequences ones: look a bit further up
    def pairs_up_to(t_end: float) -> float:
        return sum(max(0.0, (t_end - t_a) / t) + 1 for w in ws for t in w.ts)

    small = n <= _SMALL_CLUSTER and pairs_up_to(min(t_max, t_b * _SMALL_STRETCH)) <= _SMALL_SWEEP
    t_b = min(t_max, t_b * (_SMALL_STRETCH if small else WINDOW_STRETCH))
    n_pairs = pairs_up_to(t_b)
    if n_pairs > _MAX_EVENTS:  # keep the sweep fast: narrow the window
        t_b = t_a + (t_b - t_a) * _MAX_EVENTS / n_pairs
    prices = tuple(k * sum(1.0 / w.rate for w in ws) / n for k in _PRICE_LADDER) if small else (0.0,)
    for lam in prices:
        scored, init, events = _sweep(ws, t_a, t_b, lam, min_h, max_h)
        in_band = [(v, abs(s - target), k) for v, s, k in scored if lo <= s <= hi]
        wanted = [_pick(in_band)[2]] if in_band else []
        repair = small or not in_band
        if repair:  # the band may cut off the best plans: repair the best few near it, one worker each
            margin = _REPAIR_MARGIN * target
            near = [x for x in scored if lo - margin <= x[1] <= hi + margin and not lo <= x[1] <= hi]
            wanted += [k for _, _, k in sorted(near, reverse=True)[:_REPAIRED]]
        states = _replay(init, events, wanted)
        if in_band:
            cands.append(_as_candidate(states[wanted[0]], n, target))
        if repair:
            for k in wanted[1 if in_band else 0 :]:
                cands += _repairs(ws, states[k], lo, hi, target, min_h, max_h)
    if not cands:
        raise PlanError(
            f"no plan within tolerance: sequences per round jump from {sum(s[1] for s in below)} "
            f"to {sum(s[1] for s in above)} around the band [{lo}, {hi}]; widen the tolerance "
            "or the batch/step bounds"
        )
    best = _pick(cands)[2]
    return best.materialise() if isinstance(best, _Repair) else best


def plan_balanced(
    profiles: Sequence[WorkerProfile],
    constraints: PlanConstraints,
    exchange_bytes: int = 0,
    exchange_s: float = 0.0,
) -> Plan:
    """GeoMesh's balanced plan (per-worker batch and inner steps); algorithm in the module docstring."""
    constraints.validate()
    kept, dropped = _usable(profiles, constraints.allow_drop)
    if constraints.fills:
        return _plan_fill(kept, dropped, constraints, exchange_bytes, exchange_s)
    n = len(kept)
    lo, hi = constraints.band(n)
    target = constraints.target(n)
    min_h, max_h = constraints.min_inner_steps, constraints.max_inner_steps
    least = n * constraints.min_batch * min_h
    if least > hi:
        raise PlanError(
            f"target {target} sequences (at most {hi} with tolerance {constraints.tolerance}) is below the "
            f"{least} that {n} workers do at least with min_batch={constraints.min_batch} and "
            f"min_inner_steps={min_h}"
        )
    ws = [_Worker(p, constraints, min_h) for p in kept]
    round_s = target / sum(w.rate for w in ws)
    for w in ws:
        w.set_batches(_upper(w.knee_upper, w.rate, round_s, constraints))
    state = _solve(ws, lo, hi, target, min_h, max_h)
    if state is None:  # the target is out of reach with batches near the knee: allow up to max_batch
        for w in ws:
            w.set_batches(constraints.max_batch)
        state = _solve(ws, lo, hi, target, min_h, max_h)
    if state is None:
        most = n * constraints.max_batch * max_h
        raise PlanError(
            f"target {target} sequences (at least {lo} with tolerance {constraints.tolerance}) is unreachable: "
            f"{n} workers do at most {most} with max_batch={constraints.max_batch} and max_inner_steps={max_h}"
        )
    choices = []
    for w, (_, _, b, h, _) in zip(ws, state):
        m, a = w.splits[w.bs.index(b)]
        choices.append((m, a, h))
    rule = f"sequences per round: {target} (tolerance {constraints.tolerance:.0%})"
    if constraints.overlap:
        rule += "; the exchange runs under the next round's compute"
    plan = _assemble(kept, choices, exchange_bytes, exchange_s, "geomesh", target, dropped, rule, constraints.overlap)
    _warn_if_unbalanced(plan, ws, state)
    return plan


def _fill_response(w: _Worker, deadline: float, min_h: int, max_h: int):
    """Worker ``w``'s best way to fill ``deadline``: the options (c, S, b, H, v) with c ≤ deadline whose
    compute is within FILL_SLACK of the longest such option (straggler idle first), and among those the most
    sequences (the most efficient batch), then the smaller batch (more inner steps). The quickest option
    when nothing fits."""
    lim = deadline * (1 + _EPS)
    options = []
    for b, t in zip(w.bs, w.ts):
        h = min(max_h, int(lim / t))
        if h >= min_h:
            options.append(w.option(b, h, t))
    if not options:
        return w.min_opt
    longest = max(o[0] for o in options)
    full = [o for o in options if o[0] >= longest * (1 - FILL_SLACK)]
    return max(full, key=lambda o: (o[1], -o[2]))


def _plan_fill(kept, dropped, constraints: PlanConstraints, exchange_bytes: int, exchange_s: float) -> Plan:
    """The planning rule: every worker fills the round's compute time (the reference plan on the slowest
    worker, or ``round_compute_s``) with its best batch and inner steps (:func:`_fill_response`)."""
    c = constraints
    min_h, max_h = c.min_inner_steps, c.max_inner_steps
    if c.round_compute_s is not None:
        deadline = float(c.round_compute_s)
        rule = f"explicit round: {deadline:.3g} s of compute (geomesh.round_time_s)"
    else:
        deadline, slowest = reference_round_s(kept, c.ref_batch, c.ref_inner_steps)
        rule = (f"fill the slowest worker's reference round: {c.ref_inner_steps} steps of {c.ref_batch} sequences "
                f"on {slowest} = {deadline:.3g} s of compute; every worker fills it")  # fmt: skip
    if c.overlap:
        # the exchange runs under the next round's compute: a round shorter than the exchange would leave the
        # workers waiting for it, so the compute fills at least the exchange (docs/overlap.md)
        if exchange_s > deadline:
            rule += f"; stretched to the exchange it hides ({exchange_s:.3g} s, overlap)"
            deadline = float(exchange_s)
        else:
            rule += f"; the exchange ({exchange_s:.3g} s) runs under the next round's compute (overlap)"
    ws = [_Worker(p, c, min_h) for p in kept]
    for w in ws:
        w.set_batches(_upper(w.knee_upper, w.rate, deadline, c))
    state = [_fill_response(w, deadline, min_h, max_h) for w in ws]
    choices = []
    for w, (_, _, b, h, _) in zip(ws, state):
        m, a = w.splits[w.bs.index(b)]
        choices.append((m, a, h))
    plan = _assemble(kept, choices, exchange_bytes, exchange_s, "geomesh", None, dropped, rule, c.overlap)
    _warn_if_unbalanced(plan, ws, state)
    return plan


def _warn_if_unbalanced(plan: Plan, ws: list[_Worker], state) -> None:
    """Warn when the constraints leave much straggler idle (e.g. a slow worker's minimum is too long)."""
    n = len(plan.workers)
    idle = sum(w.straggler_wait_s for w in plan.workers) / (n * plan.compute_s)
    if idle <= IDLE_WARN:
        return
    pinned = [w.profile.name for w, s in zip(ws, state) if s == w.min_opt and s[0] >= plan.compute_s * (1 - 1e-9)]
    if pinned:
        reason = (
            f"worker(s) {', '.join(pinned)} cannot do less than min_inner_steps steps of their smallest batch; "
            "lower min_batch/min_inner_steps or raise the target"
        )
    else:
        reason = "integer batches and steps within the bounds allow no better balance; widen the bounds"
    warnings.warn(
        f"planner: predicted straggler idle {idle:.1%} of the compute phase (round compute "
        f"{plan.compute_s:.3g} s): {reason}",
        stacklevel=3,
    )


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
    """

    def __init__(
        self,
        profiles: Sequence[WorkerProfile],
        constraints: PlanConstraints,
        *,
        smoothing: float = 0.5,
        threshold: float = 0.1,
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
        f = self.smoothing * self.factors[name] + (1.0 - self.smoothing) * observed
        self.factors[name] = f
        return f

    def drift(self) -> dict[str, float]:
        """Per worker |f − f_assumed| / f_assumed."""
        return {k: abs(f - self.assumed[k]) / self.assumed[k] for k, f in self.factors.items()}

    def maybe_replan(self, exchange_bytes: int = 0, exchange_s: float = 0.0) -> Plan | None:
        """A new plan when a speed factor drifted past ``threshold`` (or when there is none yet), else None."""
        if self.current is None or max(self.drift().values()) > self.threshold:
            return self.plan(exchange_bytes, exchange_s)
        return None
