"""The emulated runtime: every worker really trains its proxy-model replica in this one process, while
time is *modeled*.

What is real: the proxy model's training (losses, parameters, payload bytes on the proxy). What is
modeled: each worker's compute time (the scenario's timing model on that worker's GPU, through
:class:`~geomesh.hardware.WorkerProfile`), the WAN time of each exchange (:class:`~geomesh.network.WanModel`)
and the bytes on the wire (the codec's bytes per parameter × the timing model's parameter count). The same
scenario and seed give identical results: the clock is a number, not a measurement.

Reliability (docs/reliability.md): the scenario's ``faults`` are injected at round boundaries (a worker slows
down, leaves, rejoins with the current global state, loses bandwidth; for one round its training turns NaN or
its payload is damaged) and each fault's cost is reported; a worker's non-finite or rejected update is dropped
for the round, and the run stops cleanly after ``reliability.max_consecutive_failures`` failed rounds in a row;
payloads are optionally signed with an HMAC key; checkpoints are written atomically at round boundaries and
``RunOptions(resume=True)`` continues an interrupted run bit for bit. A run that must stop (a failed
checkpoint write, a full disk, too many failures) writes the summary of what was done, then raises RunError.

The runtime is a package because its loops differ: :mod:`.rounds` (round-based methods), :mod:`.ddp` (the
DDP baseline's steps) and :mod:`.events` (the asynchronous baseline's event queue) each hold one loop, over
:mod:`.core` (what every loop shares), :mod:`.checkpoints` and :mod:`.cluster`. :class:`EmulatedRun` picks
the loop for its method. Run options, the fault schedule, payload screening and the summary's layout are
shared with the distributed runtime (:mod:`geomesh.runtime.options`, :mod:`~geomesh.runtime.faults`,
:mod:`~geomesh.runtime.payloads`, :mod:`~geomesh.runtime.summary`).
"""

from __future__ import annotations

from typing import Any

from ...errors import RunError
from ...methods.base import OuterLoopMethod
from ..faults import ClusterState, FaultEffects, corrupt_payload
from ..options import RunOptions, prepare_run_dir
from ..payloads import screen_payload
from .cluster import Cluster, build_cluster
from .ddp import DdpLoop
from .events import EventsLoop
from .rounds import RoundsLoop

__all__ = ["Cluster", "ClusterState", "EmulatedRun", "FaultEffects", "RunError", "RunOptions", "build_cluster",
           "corrupt_payload", "prepare_run_dir", "screen_payload"]  # fmt: skip


class EmulatedRun(RoundsLoop, DdpLoop, EventsLoop):
    """One method on one scenario, with a modeled clock."""

    def _run_loop(self, cluster: Cluster) -> dict[str, Any]:
        if isinstance(self.method, OuterLoopMethod):
            return self._run_outer(cluster)
        if self.method.kind == "ddp":
            return self._run_ddp(cluster)
        if self.method.kind == "async":
            return self._run_async(cluster)
        raise RunError(f"method {self.method.name} is not supported by the emulated runtime")
