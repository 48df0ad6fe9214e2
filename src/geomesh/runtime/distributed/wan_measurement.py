"""The WAN measured in place, the part of the plan loop (:class:`.plan_loop.PlanLoop`) that measures the links
between regions as it measures compute (:class:`~geomesh.planner.wan.WanEstimator`). Before round 0 the leaders
probe their links (two sizes separate latency from bandwidth); after it, each leader reports the wire time of its
last exchange (its exchange less its wait for the slowest member) with the next round's info, and every rank
folds the members' median in, against the declared WAN's latency and transfer parts of that exchange. The plan
loop plans over the measured WAN and re-plans when it drifts past its noise (``geomesh.measure_wan``;
``--no-calibrate`` keeps the declared WAN).

:class:`WanMeasurement` owns the estimator, the members of the last exchange measured, what the probes cost and
this leader's wire report; the plan loop hands it values (the infos that arrived, the rounds their reports may be
of, the time parts of an exchange among given members) and reads back the measured WAN and why to re-plan."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

from ...network import WanModel
from ...planner.wan import WanEstimator, probe_sizes

# the latency and transfer parts of the declared WAN's exchange among the members given
TimeParts = Callable[[list[int]], tuple[float, float]]
# (tests: the fault hooks' ``wan`` stand-in replaces each leader's measured wire time, as received, by what the
# declared WAN K times slower gives it, so that every run measures the same WAN; runtime/hooks.py)


def seconds(value: Any) -> float | None:
    """A duration a peer reported (data): finite positive seconds, else None (left out, never a stopped run)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        return None
    return float(value)


def _wire_report(value: Any) -> dict[str, Any]:
    """A checkpoint's wire report (:meth:`WanMeasurement.note_wire`): {} unless it is one."""
    if not isinstance(value, dict) or not value:
        return {}
    wire, number = seconds(value.get("wire_s")), value.get("wire_round")
    if wire is None or not isinstance(number, int) or isinstance(number, bool):
        return {}
    return {"wire_s": wire, "wire_round": number}


class WanMeasurement:
    """The WAN as this rank measures it (``estimator``: None where the loop does not measure it, the declared WAN
    planned over; ``hooks``: the faults a test injects)."""

    def __init__(self, estimator: WanEstimator | None, hooks: Any):
        self.estimator, self.hooks = estimator, hooks
        self.members: list[int] | None = None  # who took part in the last exchange measured
        self.probe_s: float | None = None  # what the probes before round 0 cost (None: not probed yet)
        self.wire: dict[str, Any] = {}  # (leader) the wire time of its last exchange, for the next round's info

    def measured(self, wan: WanModel) -> WanModel:
        """``wan`` (the declared one) as measured in place, when it is measured."""
        return self.estimator.measured(wan) if self.estimator is not None else wan

    def assume(self) -> None:
        """The WAN as measured now is what the plan in force assumes (drift is counted from it)."""
        if self.estimator is not None:
            self.estimator.assume()

    def probe_due(self, rounds: int) -> bool:
        """Whether the leaders probe their links now: before round 0, once, where the WAN is measured."""
        return self.estimator is not None and rounds == 0 and self.probe_s is None

    def arrival_margin(self, compute_noise: float, noise_k: float) -> float:
        """How much later than the plan's exchange time an overlapped round applies the exchange in flight, when
        the WAN is measured: exp(k·σ), σ the measurements' noise (the WAN's exchanges, as the estimator knows
        them, and the region's ``compute_noise``; k ``noise_k``), so that an exchange a little slower, or a round
        a little faster, than planned does not leave the region waiting at its apply step. 1 when the WAN is not
        measured (both runtimes then apply at the same step)."""
        if self.estimator is None:
            return 1.0
        return math.exp(max(noise_k, 0.0) * math.hypot(self.estimator.noise() or 0.0, compute_noise))

    def summary(self) -> dict[str, Any] | None:
        """What the summary says about the WAN measured (None: not measured)."""
        return self.estimator.summary() if self.estimator is not None else None

    def note_wire(self, wire_s: float, round_number: int) -> None:
        """(leader) The exchange of round ``round_number`` took ``wire_s`` on the wire: reported with the next info
        this leader sends."""
        self.wire = {"wire_s": float(wire_s), "wire_round": int(round_number)}

    def probe(self, declared: WanModel, nbytes: int, exchange: Any | None, members: list[int],
              share: Callable[[list[float] | None], list[float]]) -> None:  # fmt: skip
        """Every rank, before round 0: the leaders (``exchange``: a leader's, None on other ranks) probe their links
        to ``members`` (all-gathers of the two sizes of :func:`~geomesh.planner.wan.probe_sizes` for a payload of
        ``nbytes``, held by the WAN shaper as exchanges are) and agree on each probe's median over the leaders;
        ``share`` hands a leader's medians to every rank of its region, and every rank folds the same figures into
        the estimator, against ``declared``. A short, bounded cost (``probe_s``)."""
        sizes = probe_sizes(nbytes)
        start = time.perf_counter()
        medians = None
        if exchange is not None:
            mine = [exchange.probe(size, members) for size in sizes]
            gathered = exchange.gather_json({"probe_s": mine}, what="the WAN probes")
            timings = [g["probe_s"] for g in gathered if isinstance(g, dict) and isinstance(g.get("probe_s"), list)
                       and len(g["probe_s"]) == len(sizes)
                       and all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0
                               for x in g["probe_s"])]  # fmt: skip
            medians = [statistics.median(float(t[k]) for t in timings) for k in range(len(sizes))] if timings else []
        medians = share(medians)
        k = self.hooks.wan_factor(0)
        for size, probed_s in zip(sizes, medians):
            self.estimator.observe_probe(declared, size, probed_s if k is None else k * declared.allgather_s(size))
        self.probe_s = time.perf_counter() - start

    def probed_drift(self, latency_s: float, transfer_s: float) -> str | None:
        """Why a plan made over the declared WAN before the probes is made again: the probes put its exchange (of
        these latency and transfer parts, declared) past ``replan_threshold`` from what it assumed (probes are
        deliberate measurements: no noise band holds them back); the measured WAN is assumed from then on. None:
        the plan stands."""
        w = self.estimator
        a0, b0 = w.assumed
        assumed_s, probed_s = a0 * latency_s + b0 * transfer_s, w.predict(latency_s, transfer_s)
        ratio = probed_s / assumed_s
        if abs(math.log(ratio)) <= w.threshold:
            return None
        how = f"{ratio:.1f}x slower" if ratio > 1 else f"{1 / ratio:.1f}x faster"
        why = (f"the WAN probed {how} than the plan assumed (an exchange of {probed_s:.3g} s against "
               f"{assumed_s:.3g} s; latency x{w.latency_factor:.2f}, transfer x{w.transfer_factor:.2f} the "
               f"declared)")  # fmt: skip
        w.assume()
        return why

    def observe(self, infos: list[dict[str, Any]], expected: tuple[int, ...], parts: TimeParts) -> str | None:
        """Fold the previous exchange into the measurement (every rank alike: the median of the wire times its
        members' leaders report with these ``infos`` of the round(s) ``expected``, against the declared WAN's
        latency and transfer ``parts`` of it); why to re-plan, when the WAN drifted past the measurements'
        noise."""
        prev, self.members = self.members, sorted(i["region"] for i in infos)
        if self.estimator is None or prev is None or len(prev) < 2:
            return None
        # (a peer's report is data: a duration and a round of this exchange, else left out)
        reports = [(s, i["wire_round"]) for s, i in ((seconds(i.get("wire_s")), i) for i in infos
                   if i.get("region") in prev and i.get("wire_round") in expected
                   and not isinstance(i.get("wire_round"), bool)) if s is not None]  # fmt: skip
        if not reports:
            return None
        lat, transfer = parts(prev)
        wires = [s if (k := self.hooks.wan_factor(number)) is None else k * (lat + transfer)
                 for s, number in reports]  # fmt: skip
        self.estimator.observe(lat, transfer, statistics.median(wires))
        return self.estimator.should_replan()

    def state_dict(self) -> dict[str, Any]:
        """The measurement's part of the plan loop's state (JSON)."""
        return {"wan": self.estimator.state_dict() if self.estimator is not None else None,
                "wan_members": self.members,
                "wan_probe_s": self.probe_s,
                # (a leader; this rank's own, never a healed region's) the wire time of its last exchange, which
                # it reports with the next round's info: a resumed leader reports what the uninterrupted one does
                "wire": dict(self.wire)}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], healed: bool = False) -> None:
        """The measurement of :meth:`state_dict`; this leader's wire report too unless ``healed`` (another
        region's state)."""
        if self.estimator is not None and state.get("wan") is not None:
            self.estimator.load_state_dict(state["wan"])
        self.members = state.get("wan_members")
        if isinstance(state.get("wan_probe_s"), float):  # (what the probes before round 0 cost, for the summary)
            self.probe_s = state["wan_probe_s"]
        # a healed region's own last report is of an exchange the live state has gone past, the live leader's of
        # one it took no part in: it reports nothing until its next exchange
        self.wire = {} if healed else _wire_report(state.get("wire"))
