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

__all__ = ["FAULT_KINDS", "ONE_ROUND_FAULTS", "ClusterState", "FaultEffects", "corrupt_payload", "faults_at",
           "grads_finite", "optimizer_finite", "poison_grads", "poisoned"]  # fmt: skip

ONE_ROUND_FAULTS = ("nan", "corrupt")  # fault kinds that last one round (the others change the cluster)


def faults_at(scenario: ScenarioConfig, round_index: int) -> list[FaultConfig]:
    """The scenario's faults scheduled at the start of round ``round_index`` (0-based), in scenario order."""
    return [f for f in scenario.faults if f.at_round == round_index]


class ClusterState:
    """Which workers are alive, how much slower than their profiles they really are, and the WAN now."""

    def __init__(self, scenario: ScenarioConfig):
        n = len(scenario.regions)
        self.alive = [True] * n
        self.speed = [1.0] * n  # true compute time / the profile's prediction
        self._wan = scenario.wan_model()

    def live(self) -> list[int]:
        return [i for i, a in enumerate(self.alive) if a]

    def wan(self, live: list[int]):
        return self._wan.subset(live)

    def apply(self, i: int, kind: str, factor: float) -> None:
        if kind == "slowdown":
            self.speed[i] *= factor
        elif kind == "leave":
            self.alive[i] = False
        elif kind == "join":
            self.alive[i] = True
        elif kind == "bandwidth":
            self._wan = self._wan.scaled_bandwidth(i, factor)

    def state_dict(self) -> dict[str, Any]:
        wan = self._wan
        return {"alive": list(self.alive), "speed": list(self.speed), "rtt_s": [list(r) for r in wan.rtt_s],
                "bandwidth_Bps": [list(r) for r in wan.bandwidth_Bps]}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alive = [bool(a) for a in state["alive"]]
        self.speed = [float(s) for s in state["speed"]]
        self._wan = WanModel(rtt_s=tuple(tuple(float(x) for x in r) for r in state["rtt_s"]),
                             bandwidth_Bps=tuple(tuple(float(x) for x in r) for r in state["bandwidth_Bps"]))  # fmt: skip


@dataclass
class FaultEffects:
    """What the faults scheduled for one round do to it."""

    remake: bool = False  # membership or links changed: the plan must be remade
    joined: list[int] = field(default_factory=list)  # workers that came back this round
    once: dict[int, set[str]] = field(default_factory=dict)  # worker -> one-round faults ("nan", "corrupt")


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
