"""The distributed plan loop's WAN measurement (runtime/distributed/wan_measurement.py): what the members'
leaders report about their last exchange is data. A hostile or broken report (not a number, NaN, infinite,
negative, of another round) is left out of the measurement; it never stops the run and never moves the WAN."""

from __future__ import annotations

import pytest

from geomesh.network import WanModel
from geomesh.planner.wan import WanEstimator, time_parts
from geomesh.runtime.distributed.wan_measurement import WanMeasurement
from geomesh.runtime.hooks import NO_HOOKS

# a 3-region WAN of 100 ms and 10 MB/s, over which an all-gather of 1 MB is the exchange measured
WAN = WanModel(rtt_s=((0, 0.1, 0.1), (0.1, 0, 0.1), (0.1, 0.1, 0)), bandwidth_Bps=((1e7,) * 3,) * 3)
PAYLOAD = 1_000_000
LAST_ROUND = (4,)  # the round the reports are of


def parts(members: list[int]) -> tuple[float, float]:
    return time_parts(lambda wan: wan.allgather_s(PAYLOAD), WAN.subset(members))


def measurement() -> WanMeasurement:
    m = WanMeasurement(WanEstimator(), NO_HOOKS)
    m.members = [0, 1, 2]
    return m


def infos(*wires):
    return [{"region": i, "wire_s": w, "wire_round": 4} for i, w in enumerate(wires)]


def test_the_members_median_wire_time_is_one_measurement():
    m = measurement()
    declared = WAN.allgather_s(PAYLOAD)
    m.observe(infos(2 * declared, 2.2 * declared, 1.9 * declared), LAST_ROUND, parts)
    assert m.estimator.observations == 1
    assert m.estimator.predict(*parts([0, 1, 2])) == pytest.approx(2 * declared)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0, "1.0", None, True, [1.0], {"s": 1}])
def test_a_bad_report_is_left_out_and_never_stops_the_run(bad):
    m = measurement()
    declared = WAN.allgather_s(PAYLOAD)
    m.observe(infos(bad, 3 * declared, 3 * declared), LAST_ROUND, parts)  # one bad member: the two others measure
    assert m.estimator.observations == 1
    assert m.estimator.predict(*parts([0, 1, 2])) == pytest.approx(3 * declared)
    m.members = [0, 1, 2]
    m.observe(infos(bad, bad, bad), LAST_ROUND, parts)  # nobody sane: no measurement, the WAN as it was
    assert m.estimator.observations == 1


def test_a_report_of_another_round_or_from_outside_the_exchange_is_not_this_exchange():
    m = measurement()
    m.observe([{"region": 0, "wire_s": 9.0, "wire_round": 3}, {"region": 1, "wire_s": 9.0, "wire_round": 3}],
              LAST_ROUND, parts)  # fmt: skip
    assert m.estimator.observations == 0
    m.members = [0, 1]  # region 2 was not in the last exchange: its report is of another one
    m.observe([{"region": 2, "wire_s": 9.0, "wire_round": 4}], LAST_ROUND, parts)
    assert m.estimator.observations == 0

