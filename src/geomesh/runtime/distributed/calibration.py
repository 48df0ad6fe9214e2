"""Calibration in place, the part of the plan loop (:class:`.plan_loop.PlanLoop`) that measures the regions'
profiles before round 0: each region's ranks time the model it really trains at a few candidate micro-batches
(:func:`~geomesh.profiler.calibrate_worker`, its state restored bit for bit), its leader shares the profile through
the exchange, and every rank takes each region's profile into the run's state once, when it is first seen.

:class:`Calibration` owns the profiles measured in place and what measuring them cost; the plan loop hands it
values (the worker and the micro-batches to measure, what the regions shared) and plans from the profiles it
holds (``planning.calibration``)."""

from __future__ import annotations

from typing import Any

from ...hardware import WorkerProfile
from ...planner import OnlinePlanner

# an uncalibrated region's first round (start-up: allocators, kernels, optimizer state) is not its speed; a
# calibrated region's start-up was the calibration's own warm-up steps, so its round 1 is a measurement (a round 1
# far off the calibration is its error, or a speed that changed since: re-planned at once, not carried a round)
WARMUP_ROUNDS = 1


def online_planner(sc, method, profiles: list[WorkerProfile], calibrated: bool) -> OnlinePlanner:
    """The online planner of a run of ``method`` on ``sc`` over ``profiles`` (``calibrated``: measured in place)."""
    g = sc.geomesh
    # uncalibrated profiles describe the timing model, not what trains: a first measurement is the factor;
    # wall-clock compute times are noisy: outliers held back, the deadband widened to the regions' noise,
    # regions that measure alike planned alike; an uncalibrated region's first round (start-up) is not its speed
    return OnlinePlanner(profiles, method.constraints(sc, len(profiles)), smoothing=g.replan_smoothing,
                         threshold=g.replan_threshold, first_measurement_sets_factor=not calibrated,
                         noise_k=g.replan_noise_k, warmup_rounds=0 if calibrated else WARMUP_ROUNDS)  # fmt: skip


class Calibration:
    """The regions' profiles measured in place (``on``: the run calibrates; ``given``: this region's profile was
    given on the command line, ``--profile``, so it is not measured)."""

    def __init__(self, on: bool, given: bool):
        self.on, self.given = on, given
        self.profiles: dict[str, WorkerProfile] = {}  # region -> its profile measured in place
        self.seconds: dict[str, float] = {}  # region -> what measuring it cost

    def online_planner(self, sc, method, profiles: list[WorkerProfile]) -> OnlinePlanner:
        """The online planner of a run of ``method`` on ``sc`` over ``profiles``, calibrated or not so far."""
        return online_planner(sc, method, profiles, calibrated=bool(self.profiles))

    @property
    def due(self) -> bool:
        """Whether this region measures itself before round 0."""
        return self.on and not self.given

    def measure(self, worker: Any, top: int, batch: int, window_s: float, budget_s: float) -> dict[str, Any]:
        """Every rank of this region: its step time measured in place at the micro-batches up to ``top`` and the
        reference ``batch``, within ``window_s`` a measurement and ``budget_s`` in all (where it is :attr:`due`).
        What the leader shares with the others (JSON)."""
        from ...profiler import calibrate_worker, default_micro_batches

        cap = getattr(worker, "max_proxy_micro_batch", None)
        cal = calibrate_worker(worker, default_micro_batches(top, cap * worker.size if cap else None, batch),
                               window_s=window_s, budget_s=budget_s)  # fmt: skip
        return {"profile": cal.profile.to_json(), "seconds": cal.seconds}

    def take(self, shared: dict[str, dict[str, Any] | None]) -> dict[str, WorkerProfile]:
        """The profiles the regions shared (region name -> what :meth:`measure` returned) that are new: each enters
        the run's state once, when it is first seen."""
        # the same headers against the same state give every rank the same decision, a healed region's too (it
        # applies the live state first). A restarted region measures itself again, but its speed since is the
        # online planner's to follow from measured rounds: taking the new table on some ranks only would part
        # their plans.
        new = {name: c for name, c in shared.items() if c and name not in self.profiles}
        measured = {name: WorkerProfile.from_json(c["profile"]) for name, c in new.items()}
        self.profiles = {**self.profiles, **measured}
        self.seconds.update({name: float(c["seconds"]) for name, c in new.items()})
        return measured

    def state_dict(self) -> dict[str, Any]:
        """The profiles measured in place and their cost (JSON), so a resumed or healed region plans from them."""
        return {"calibrated": {n: p.to_json() for n, p in self.profiles.items()}, "calibration_s": dict(self.seconds)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The profiles of :meth:`state_dict`."""
        self.profiles = {n: WorkerProfile.from_json(p) for n, p in state["calibrated"].items()}
        self.seconds = {n: float(s) for n, s in state["calibration_s"].items()}
