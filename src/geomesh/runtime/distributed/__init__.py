"""The distributed runtime: one process per rank under ``torchrun`` (or ``geomesh launch``), a
``torch.distributed`` process group for the exchange, real wall-clock time and real bytes.

The algorithm is the emulated runtime's, written once in :mod:`geomesh.methods` and
:mod:`geomesh.outer`: the same plan, the same inner steps (:meth:`OuterLoopMethod.local_phase`), the same
payloads, the same combine (:meth:`OuterLoopMethod.apply`) and outer Nesterov step. With one rank per
region, the same scenario, seed and plan end with the same parameters as :class:`EmulatedRun`.

Ranks and regions
-----------------
Ranks fill regions in scenario order: region 0 gets ranks ``0..k0-1``, region 1 the next ``k1``, ...
``k`` comes from ``ranks_per_region``; by default one rank per region when the world has as many ranks
as regions, else one rank per GPU (``count``) when the world has ``Σ count`` ranks. The first rank of a
region is its *leader*.

- Inside a region, ranks train one replica together with DDP over a per-region group: every rank draws
  the region's whole batch from the region's stream (the emulated worker's stream) and trains on its
  own contiguous slice, so the region computes the same gradient as the emulated worker.
- Across regions, only leaders talk: a straggler barrier (``monitored_barrier`` on Gloo, which names
  ranks that do not arrive), then the exchange over the leaders' group: an all-gather of the packed
  payloads (sign codec; all payloads of one codec have ``payload_nbytes()`` bytes, a dropped update
  sends zeros) or an all-reduce of the weighted fp32 pseudo-gradient (dense codec). The leader then
  broadcasts the exchanged bytes inside its region, and every rank applies the same outer step itself.
- After every round all ranks all-gather a checksum of θ (crc32 of strided samples) and stop with a
  clear error if any differs.

Time and telemetry
------------------
Wall-clock seconds from a barrier after set-up. Each region leader records its worker's spans:
``compute`` (inner steps + encoding, slowdown padding included), ``straggler_wait`` (the barrier; between
elastic regions, which have none before the exchange, the exchange's first part, as long as the slowest
member's measured compute outlasted this one's; static regions also the round's report, which waits for
the slowest region's outer step),
``comm_wait`` (the collective, the WAN shaper's hold and the broadcast inside the region; elastic: also
the round's quorum), ``other``
(combine, outer step, checksum, telemetry, evaluation on rank 0). The spans travel with the round's
checksum to rank 0, which alone writes ``events.jsonl``, ``summary.json`` and ``final_params.pt``.

Modules
-------
This package's ``__init__`` only picks the loop for the run (:class:`DistributedRun`): :mod:`.rounds`
(round-based methods), :mod:`.ddp` (the DDP baseline), :mod:`.async_loop` (the asynchronous baseline, with its
parameter server :mod:`.async_server`) or :mod:`.elastic` (elastic regions), all over
:mod:`.core` (set-up and clock; it holds :mod:`.checkpointing`, :mod:`.ledger` (records, summary),
:mod:`.reports`, :mod:`.validation` and :mod:`.profiles`), :mod:`.layout` (ranks and regions),
:mod:`.region` (a region's worker), :mod:`.transport` and :mod:`.checkpoints`.
"""

from __future__ import annotations

from typing import Any

from .async_loop import run_async
from .ddp import run_ddp
from .rounds import run_rounds
from .core import (
    TEST_EXIT_ENV,
    WIRE_IFACE_ENV,
    RankFailure,
    RankRun,
    params_checksum,
)
from .support import check_distributed_support
from .layout import RankLayout, parse_ranks_per_region, rank_layout
from ..options import DistOptions
from .trust import establish as establish_trust

__all__ = ["TEST_EXIT_ENV", "WIRE_IFACE_ENV", "DistOptions", "DistributedRun", "RankFailure",
           "RankLayout", "check_distributed_support", "params_checksum", "parse_ranks_per_region", "rank_layout"]  # fmt: skip


class DistributedRun(RankRun):
    """One method on one scenario, on this rank of an initialised process group, with a wall clock."""

    def __init__(self, scenario, method, options=None):
        super().__init__(scenario, method, options)
        # the key and run id every frame of this process is signed with (runtime/distributed/trust.py)
        self.trust = establish_trust(scenario, method.name, self.seed, self.budget,
                                     elastic=self.options.elastic_region is not None,
                                     lighthouse=self.options.lighthouse)  # fmt: skip

    def _run_loop(self) -> dict[str, Any]:
        if self.method.kind == "ddp":
            return run_ddp(self)
        if self.method.kind == "async":
            return run_async(self)
        return run_rounds(self)
