"""A round's exchange shared inside a region of the distributed runtime: the region's leader alone crosses the
WAN (:mod:`.exchange`, :mod:`.elastic`), and every rank of the region needs what arrived, to screen, combine and
step alike (:mod:`.update`).

:class:`RegionShare` is held by the round loop (:class:`.rounds.RoundLoop`) and serves its plain and overlapped
rounds; the bytes move over the region's group with :class:`.transport.Transport`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .exchange import Exchanged
from .transport import split_gathered


class RegionShare:
    """The leader's exchange result on every rank of a region of ``run`` (JSON for the infos, raw bytes for the
    payloads of ``n`` regions, a float32 tensor of ``d`` numbers for a sharded update or ``d + 1`` for a dense
    sum when ``summed``, the healing state's tensors one by one). ``wait_for_leader`` (elastic regions): the
    ranks wait for their leader outside the collectives first, since its exchange may re-form the quorum."""

    def __init__(self, run: Any, n: int, d: int, *, summed: bool, wait_for_leader: Callable[[], None] | None):
        self.run, self.n, self.d, self.summed, self.wait_for_leader = run, n, d, summed, wait_for_leader

    def share(self, result: Exchanged | None, slot_nbytes: int) -> Exchanged:
        """``result`` (the leader's; None elsewhere) on every rank; ``slot_nbytes``: one gathered payload's size."""
        run = self.run
        if run.region_group is None:
            return result
        if self.wait_for_leader is not None:
            self.wait_for_leader()
        head = run.transport.broadcast_json(result.to_json() if run.is_leader else None, run.leader,
                                            run.region_group, what="the round's exchange")  # fmt: skip
        if head.get("void"):
            return Exchanged(infos=[], payloads=None, summed=None, comm_s=head["comm_s"], wan_bytes=head["wan_bytes"],
                             void=True, why=head.get("why", ""))  # fmt: skip
        if head.get("sharded") is not None:  # the sharded exchange's update (runtime/distributed/sharded_loop.py)
            flat = None
            if head["sharded"]["has_update"]:
                flat = result.update if run.is_leader else torch.empty(self.d, dtype=torch.float32, device=run.device)
                flat = run.transport.broadcast(flat, run.leader, run.region_group)
            return Exchanged(infos=head["infos"], payloads=None, summed=None, comm_s=head["comm_s"],
                             wan_bytes=head["wan_bytes"], update=flat, sharded=head["sharded"])  # fmt: skip
        if self.summed:
            summed = result.summed if run.is_leader else torch.empty(self.d + 1, dtype=torch.float32,
                                                                      device=run.device)  # fmt: skip
            summed = run.transport.broadcast(summed, run.leader, run.region_group)
            return Exchanged(head["infos"], None, summed, head["comm_s"], head["wan_bytes"])
        packed = torch.zeros(self.n * slot_nbytes, dtype=torch.uint8)
        if run.is_leader:
            for i, p in result.payloads.items():
                if p is not None:
                    packed[i * slot_nbytes : (i + 1) * slot_nbytes] = torch.frombuffer(bytearray(p), dtype=torch.uint8)
        packed = run.transport.broadcast(packed, run.leader, run.region_group)
        slots = split_gathered(packed, slot_nbytes)
        active = {i["region"] for i in head["infos"]} if head["infos"] else set(range(self.n))
        payloads = {i: slots[i] for i in range(self.n) if i in active}
        return Exchanged(head["infos"], payloads, None, head["comm_s"], head["wan_bytes"])
