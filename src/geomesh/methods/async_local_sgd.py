"""Asynchronous Local-SGD (Liu et al. 2024, arXiv 2401.09135): the asynchronous baseline.

Workers never wait for each other: each pulls the current global parameters, runs its local steps, and
pushes its fp32 pseudo-gradient to a parameter server, which applies it at once with Delayed Nesterov
(:class:`~geomesh.outer.DelayedNesterov`). Dynamic Local Updates (DyLU) give each worker
H_w = max(1, floor(H · v_w / max v)) steps, v = inner steps per second, so that slow workers do not
arrive too stale. The staleness is real: a worker's update was computed from the parameters it pulled,
and others have moved them since.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..hardware import WorkerProfile
from ..planner import split_batch
from .base import Method

if TYPE_CHECKING:
    from ..config import ScenarioConfig

# what a run of the asynchronous baseline with a checkpoint cadence is told, in either runtime
NO_CHECKPOINTS = ("no checkpoints are written (its in-flight, stale work is not checkpointable here); the run "
                  "cannot be resumed")  # fmt: skip


def dynamic_local_updates(profiles: list[WorkerProfile], batch: int, inner_steps: int) -> list[int]:
    """DyLU: H_w = max(1, floor(H · v_w / max v)) with v_w = inner steps per second at ``batch``."""
    speeds = [1.0 / p.step_s(*split_batch(batch, p.max_micro_batch)) for p in profiles]
    fastest = max(speeds)
    return [max(1, int(inner_steps * v / fastest)) for v in speeds]


def modeled_cycle(scenario: ScenarioConfig, profiles: list[WorkerProfile], steps: list[int],
                  server: int) -> tuple[list[float], list[float]]:  # fmt: skip
    """Each worker's modeled seconds of its ``steps`` inner steps, and of one transfer of the fp32 buffer (at the
    timing model's size) between it and the parameter server (zero for the server's own region): the cluster's
    WAN, the declared one unless ``wan.actual`` says not."""
    batch = scenario.training.batch
    wan = scenario.actual_wan_model()
    fp32_bytes = 4 * scenario.timing().params
    compute = [h * p.step_s(*split_batch(batch, p.max_micro_batch)) for h, p in zip(steps, profiles)]
    transfer = [0.0 if i == server else wan.rtt_s[i][server] / 2 + fp32_bytes / wan.bandwidth_Bps[i][server]
                for i in range(len(profiles))]  # fmt: skip
    return compute, transfer


def modeled_arrivals(compute: list[float], transfer: list[float]) -> Iterator[tuple[float, int]]:
    """The modeled arrivals at the parameter server, in order, without end: (time, worker). Every worker starts at
    0, its update arrives after its compute and one transfer, and it starts again when θ is back (one more
    transfer); ties go to the lower worker. Both runtimes follow it: the emulated one as its event queue, the
    distributed one's server when told to apply arrivals in this order (``--async-order modeled``)."""
    queue = [(0.0 + compute[i] + transfer[i], i) for i in range(len(compute))]
    heapq.heapify(queue)
    while True:
        arrival, i = heapq.heappop(queue)
        yield arrival, i
        start = arrival + transfer[i]
        heapq.heappush(queue, (start + compute[i] + transfer[i], i))


@dataclass(frozen=True)
class AsyncLocalSGDMethod(Method):
    server: int = 0  # the parameter server lives in this worker's region
    c: float = 0.0  # Delayed Nesterov's c in [0, 1/N]


ASYNC_LOCAL_SGD = AsyncLocalSGDMethod(
    name="async-local-sgd",
    description="asynchronous pseudo-gradients (fp32) with delayed Nesterov and dynamic local updates",
    kind="async",
)
