"""Plans and what they are made of: the constraints, a worker's plan and the whole plan (with its JSON form),
a worker's candidate batches and knee rate, the balance score, DiLoCo's uniform plan and the planning rule's
reference round. Pure: no I/O, no clock (the package docstring explains the algorithm)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import PlanError
from ..hardware import WorkerProfile

STEP_HEADROOM = 1.25  # B_i reaches at least the batch that fills 1.25 x the balanced round in max H steps


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
    # predicted wait at the barrier: the longest round's work − own (seconds); the work is the compute plus
    # ``overhead_s``, the worker's measured time per round outside its inner steps (outer step, evaluation)
    straggler_wait_s: float
    overhead_s: float = 0.0

    @property
    def sequences(self) -> int:
        """Sequences this worker processes per round."""
        return self.batch * self.inner_steps


_WORKER_FIELDS = [f.name for f in dataclasses.fields(WorkerPlan) if f.default is dataclasses.MISSING]


@dataclass
class Plan:
    """One round's plan for the whole cluster (``workers`` in the order of the profiles given)."""

    workers: list[WorkerPlan]
    round_s: float  # max (compute + overhead) + exchange (seconds)
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

    def digest(self) -> str:
        """What the ranks compare to agree that they hold the same plan: each worker's batch, micro-batch,
        accumulation and inner steps (the numbers that decide what trains; timings may differ by rounding)."""
        import hashlib

        key = ";".join(f"{w.name}:{w.micro_batch}x{w.accum}={w.batch},{w.inner_steps}" for w in self.workers)
        return hashlib.sha256(key.encode()).hexdigest()[:16]

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
                        overhead_s=float(w.get("overhead_s", 0.0)),
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
    under the next round's compute, so the round lasts max(compute, exchange) instead of their sum. A worker's
    round overhead (:attr:`~geomesh.hardware.WorkerProfile.round_overhead_s`) is work too: the round lasts the
    longest compute plus overhead, and a worker waits for it less its own."""
    if exchange_s < 0 or not math.isfinite(exchange_s):
        raise PlanError(f"exchange_s={exchange_s!r}: must be finite and >= 0")
    if exchange_bytes < 0:
        raise PlanError(f"exchange_bytes={exchange_bytes!r}: must be >= 0")
    computes = [h * p.step_s(m, a) for p, (m, a, h) in zip(profiles, choices)]
    busy = [c + p.round_overhead_s for p, c in zip(profiles, computes)]
    top = max(busy)
    round_s = max(top, exchange_s) if overlap else top + exchange_s
    n = len(profiles)
    workers = [WorkerPlan(p.name, p.gpu, m, a, m * a, h, c, top - b, p.round_overhead_s)
               for p, (m, a, h), c, b in zip(profiles, choices, computes, busy)]  # fmt: skip
    return Plan(
        workers=workers,
        round_s=round_s,
        compute_s=max(computes),
        sequences_per_round=sum(w.sequences for w in workers),
        utilization=sum(computes) / (n * round_s),
        exchange_bytes=int(exchange_bytes),
        exchange_s=float(exchange_s),
        straggler_idle_frac=sum(top - b for b in busy) / (n * round_s),
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
    """(seconds, worker): the round of the reference plan (``inner_steps`` steps of ``batch`` sequences, split
    as :func:`split_batch` does, plus the worker's round overhead) on the slowest of ``profiles``: the planning
    rule's round."""
    times = [(inner_steps * p.step_s(*split_batch(batch, p.max_micro_batch)) + p.round_overhead_s, p.name)
             for p in profiles]  # fmt: skip
    return max(times)
