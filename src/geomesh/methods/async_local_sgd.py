"""Asynchronous Local-SGD (Liu et al. 2024, arXiv 2401.09135): the asynchronous baseline.

Workers never wait for each other: each pulls the current global parameters, runs its local steps, and
pushes its fp32 pseudo-gradient to a parameter server, which applies it at once with Delayed Nesterov
(:class:`~geomesh.outer.DelayedNesterov`). Dynamic Local Updates (DyLU) give each worker
H_w = max(1, floor(H · v_w / max v)) steps, v = inner steps per second, so that slow workers do not
arrive too stale. The staleness is real: a worker's update was computed from the parameters it pulled,
and others have moved them since.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware import WorkerProfile
from ..planner import split_batch
from .base import Method


def dynamic_local_updates(profiles: list[WorkerProfile], batch: int, inner_steps: int) -> list[int]:
    """DyLU: H_w = max(1, floor(H · v_w / max v)) with v_w = inner steps per second at ``batch``."""
    speeds = [1.0 / p.step_s(*split_batch(batch, p.max_micro_batch)) for p in profiles]
    fastest = max(speeds)
    return [max(1, int(inner_steps * v / fastest)) for v in speeds]


@dataclass(frozen=True)
class AsyncLocalSGDMethod(Method):
    server: int = 0  # the parameter server lives in this worker's region
    c: float = 0.0  # Delayed Nesterov's c in [0, 1/N]


ASYNC_LOCAL_SGD = AsyncLocalSGDMethod(
    name="async-local-sgd",
    description="asynchronous pseudo-gradients (fp32) with delayed Nesterov and dynamic local updates",
    kind="async",
)
