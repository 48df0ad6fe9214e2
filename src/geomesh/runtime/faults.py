"""The fault schedule and fault injection, shared by both runtimes (docs/reliability.md).

- The schedule: which of the scenario's ``faults`` apply at which round (:func:`faults_at`; ``at_round`` is
  0-based), which kinds last one round only (:data:`ONE_ROUND_FAULTS`), and what the lasting kinds do to
  a modeled cluster (:class:`ClusterState`, :class:`FaultEffects`: the emulated runtime's clock and WAN).
- Injection: the ``nan`` fault (:func:`poisoned`, :func:`poison_grads`) and the ``corrupt`` fault
  (:func:`corrupt_payload`).
- Health checks before an update counts or an optimizer goes on: :func:`grads_finite`,
  :func:`optimizer_finite` (a payload is screened by :func:`geomesh.runtime.payloads.screen_payload`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..config import FAULT_KINDS, FaultConfig
from ..network import WanModel

if TYPE_CHECKING:
    from ..config import ScenarioConfig
    from ..worker import Worker

__all__ = ["FAULT_KINDS", "ONE_ROUND_FAULTS", "ClusterState", "FaultEffects", "RoundFaults", "corrupt_payload", "faults_at",
           "grads_finite", "optimizer_finite", "poison_grads", "poisoned"]  # fmt: skip

ONE_ROUND_FAULTS = ("nan", "corrupt")  # fault kinds that last one round (the others change the cluster)


def faults_at(scenario: ScenarioConfig, round_index: int) -> list[FaultConfig]:
    """The scenario's faults scheduled at the start of round ``round_index`` (0-based), in scenario order."""
    return [f for f in scenario.faults if f.at_round == round_index]


class ClusterState:
    """Which workers are alive, how much slower than their profiles they really are, and the WAN now: the
    declared one (:meth:`wan`, the plan's prior) and the one the cluster really has (:meth:`actual_wan`, the
    scenario's ``wan.actual``; the declared one without it). A ``bandwidth`` fault changes both."""

    def __init__(self, scenario: ScenarioConfig):
        n = len(scenario.regions)
        self.alive = [True] * n
        self.speed = [1.0] * n  # true compute time / the profile's prediction
        self._wan = scenario.wan_model()
        self._actual = scenario.actual_wan_model() if scenario.wan.actual is not None else None

    def live(self) -> list[int]:
        return [i for i, a in enumerate(self.alive) if a]

    def wan(self, live: list[int]):
        """The declared WAN between ``live`` (the scenario's faults applied)."""
        return self._wan.subset(live)

    def actual_wan(self, live: list[int]):
        """The WAN the cluster really has between ``live``: what its exchanges take (the faults applied)."""
        return (self._actual or self._wan).subset(live)

    def apply(self, i: int, kind: str, factor: float) -> None:
        if kind == "slowdown":
            self.speed[i] *= factor
        elif kind == "leave":
            self.alive[i] = False
        elif kind == "join":
            self.alive[i] = True
        elif kind == "bandwidth":
            self._wan = self._wan.scaled_bandwidth(i, factor)
            if self._actual is not None:
                self._actual = self._actual.scaled_bandwidth(i, factor)

    def state_dict(self) -> dict[str, Any]:
        return {"alive": list(self.alive), "speed": list(self.speed), **_wan_state(self._wan),
                "actual": None if self._actual is None else _wan_state(self._actual)}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alive = [bool(a) for a in state["alive"]]
        self.speed = [float(s) for s in state["speed"]]
        self._wan = _wan_of(state)
        self._actual = _wan_of(state["actual"]) if state.get("actual") is not None else None


def _wan_state(wan: WanModel) -> dict[str, Any]:
    return {"rtt_s": [list(r) for r in wan.rtt_s], "bandwidth_Bps": [list(r) for r in wan.bandwidth_Bps]}


def _wan_of(state: dict[str, Any]) -> WanModel:
    return WanModel(rtt_s=tuple(tuple(float(x) for x in r) for r in state["rtt_s"]),
                    bandwidth_Bps=tuple(tuple(float(x) for x in r) for r in state["bandwidth_Bps"]))  # fmt: skip


@dataclass
class FaultEffects:
    """What the faults scheduled for one round do to it."""

    remake: bool = False  # membership or links changed: the plan must be remade
    joined: list[int] = field(default_factory=list)  # workers that came back this round
    once: dict[int, set[str]] = field(default_factory=dict)  # worker -> one-round faults ("nan", "corrupt")


class RoundFaults:
    """The scenario's faults as the distributed round loop applies them: at the start of their round, on every
    rank of every region alike (so every rank plans the same), over a :class:`ClusterState` (a region away
    from a scheduled ``leave`` until its ``join``, its compute slowdown, the links), with one record per fault
    for the summary. ``nan`` and ``corrupt`` hit one round of a region that takes part in it."""

    def __init__(self, scenario: ScenarioConfig):
        self.scenario = scenario
        self.names = [r.name for r in scenario.regions]
        self.cluster = ClusterState(scenario)
        self.records: list[dict[str, Any]] = []
        self.applied = -1  # the last round whose faults were applied

    def at_round(self, round_index: int, members: list[int], now: float) -> tuple[FaultEffects, list[dict]]:
        """Apply the faults of round ``round_index`` (0-based) once: (what they do to it, their new records)."""
        effects = FaultEffects()
        if round_index <= self.applied:
            return effects, []
        self.applied = round_index
        new = []
        for f in faults_at(self.scenario, round_index):
            if f.kind not in FAULT_KINDS:
                continue
            i = self.names.index(f.region)
            record = {"round": round_index, "time": now, "region": f.region, "kind": f.kind, "factor": f.factor,
                      "tokens_lost": 0}  # fmt: skip
            if f.kind in ONE_ROUND_FAULTS:
                if i in members:
                    effects.once.setdefault(i, set()).add(f.kind)
                else:
                    record["ignored"] = "the region is not in this round"
            elif f.kind == "join":
                if not self.cluster.alive[i]:
                    self.cluster.apply(i, "join", f.factor)
                    effects.joined.append(i)
            else:
                self.cluster.apply(i, f.kind, f.factor)
                effects.remake |= f.kind in ("slowdown", "bandwidth")  # the plan learns speeds and links at once
            self.records.append(record)
            new.append(record)
        return effects, new

    def away(self, i: int) -> bool:
        """Out of the run by a scheduled ``leave`` (until its ``join``): connected, but it trains nothing."""
        return not self.cluster.alive[i]

    def speed(self, i: int) -> float:
        return self.cluster.speed[i]

    def wan(self, members: list[int]):
        return self.cluster.wan(members)

    def count_lost(self, round_index: int, lost: dict[int, int]) -> None:
        """Fill in the tokens a one-round fault of ``round_index`` cost its region."""
        for f in self.records:
            if f["round"] == round_index and f["kind"] in ONE_ROUND_FAULTS and "ignored" not in f:
                f["tokens_lost"] = lost.get(self.names.index(f["region"]), 0)

    def state_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster.state_dict(), "records": [dict(r) for r in self.records],
                "applied": self.applied}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cluster.load_state_dict(state["cluster"])
        self.records[:] = [dict(r) for r in state["records"]]
        self.applied = int(state["applied"])


# ---- injection ---------------------------------------------------------------------------------------


def corrupt_payload(payload: bytes) -> bytes:
    """The payload with one byte in the middle flipped (the ``corrupt`` fault: damage on the wire)."""
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0x5A
    return bytes(damaged)


def poison_grads(model: torch.nn.Module) -> float:
    """Turn every gradient into NaN (the ``nan`` fault); returns the NaN loss the step reports."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.fill_(float("nan"))
    return float("nan")


@contextmanager
def poisoned(worker: Worker, active: bool):
    """While active, every forward/backward of ``worker`` ends with NaN gradients and a NaN loss."""
    if not active:
        yield
        return
    original = worker.accumulate_grad

    def accumulate_grad(*args: Any, **kwargs: Any) -> tuple[float, int]:
        _, tokens = original(*args, **kwargs)
        return poison_grads(worker.model), tokens

    worker.accumulate_grad = accumulate_grad  # type: ignore[method-assign]
    try:
        yield
    finally:
        del worker.accumulate_grad


# ---- health ---------------------------------------------------------------------------------------


def grads_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def optimizer_finite(optimizer: torch.optim.Optimizer) -> bool:
    return all(bool(torch.isfinite(v).all()) for st in optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.is_floating_point())  # fmt: skip
