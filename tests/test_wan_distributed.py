"""The distributed plan loop's WAN measurement (runtime/distributed/plan_loop.py): what the members' leaders
report about their last exchange is data. A hostile or broken report (not a number, NaN, infinite, negative,
of another round) is left out of the measurement; it never stops the run and never moves the WAN."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from geomesh.runtime.hooks import NO_HOOKS
from geomesh.network import WanModel
from geomesh.planner.wan import WanEstimator
from geomesh.runtime.distributed.exchange import Exchanged
from geomesh.runtime.distributed.plan_loop import PlanLoop


class Loop(PlanLoop):
    """The plan loop's fields that the WAN measurement reads, over a 3-region WAN of 100 ms and 10 MB/s."""

    def __init__(self):
        wan = WanModel(rtt_s=((0, 0.1, 0.1), (0.1, 0, 0.1), (0.1, 0.1, 0)),
                       bandwidth_Bps=((1e7,) * 3,) * 3)  # fmt: skip
        self.faults = SimpleNamespace(wan=lambda members: wan.subset(members))
        self.run = SimpleNamespace(rounds=5, hooks=NO_HOOKS)
        self.wan_measure = WanEstimator()
        self.wan_members = [0, 1, 2]
        self.sharded, self.summed, self.kit = None, False, SimpleNamespace(payload_nbytes=1_000_000)


def infos(*wires):
    return Exchanged([{"region": i, "wire_s": w, "wire_round": 4} for i, w in enumerate(wires)], None, None, 0.0, 0)


def test_the_members_median_wire_time_is_one_measurement():
    loop = Loop()
    declared = loop.faults.wan([0, 1, 2]).allgather_s(1_000_000)
    loop.observe_wan(infos(2 * declared, 2.2 * declared, 1.9 * declared))
    assert loop.wan_measure.observations == 1
    assert loop.wan_measure.predict(*_parts(loop)) == pytest.approx(2 * declared)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0, "1.0", None, True, [1.0], {"s": 1}])
def test_a_bad_report_is_left_out_and_never_stops_the_run(bad):
    loop = Loop()
    declared = loop.faults.wan([0, 1, 2]).allgather_s(1_000_000)
    loop.observe_wan(infos(bad, 3 * declared, 3 * declared))  # one bad member: the two others measure
    assert loop.wan_measure.observations == 1
    assert loop.wan_measure.predict(*_parts(loop)) == pytest.approx(3 * declared)
    loop.wan_members = [0, 1, 2]
    loop.observe_wan(infos(bad, bad, bad))  # nobody sane: no measurement, the WAN as it was
    assert loop.wan_measure.observations == 1


def test_a_report_of_another_round_or_from_outside_the_exchange_is_not_this_exchange():
    loop = Loop()
    stale = Exchanged([{"region": 0, "wire_s": 9.0, "wire_round": 3}, {"region": 1, "wire_s": 9.0, "wire_round": 3}],
                      None, None, 0.0, 0)  # fmt: skip
    loop.observe_wan(stale)
    assert loop.wan_measure.observations == 0
    loop.wan_members = [0, 1]  # region 2 was not in the last exchange: its report is of another one
    loop.observe_wan(Exchanged([{"region": 2, "wire_s": 9.0, "wire_round": 4}], None, None, 0.0, 0))
    assert loop.wan_measure.observations == 0


def _parts(loop):
    from geomesh.planner.wan import time_parts

    return time_parts(loop.exchange_cost([0, 1, 2]), loop.faults.wan([0, 1, 2]))
