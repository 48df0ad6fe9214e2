"""The WAN measured in place (planner/wan.py): the declared WAN is the prior, every exchange a measurement; and
the emulated runtime's closed loop over a cluster whose WAN is not the declared one (``wan.actual``)."""

from __future__ import annotations

import json
import math
import random

import pytest

from geomesh.methods import get_method
from geomesh.network import WanModel
from geomesh.planner import WanEstimator, exchange_parts, time_parts

GEOMESH = get_method("geomesh")


def declared_wan(n: int = 4, rtt_ms: float = 80.0, gbps: float = 1.0) -> WanModel:
    return WanModel(rtt_s=tuple(tuple(0.0 if i == j else rtt_ms / 1000 for j in range(n)) for i in range(n)),
                    bandwidth_Bps=tuple(tuple(gbps * 1e9 / 8 for _ in range(n)) for _ in range(n)))  # fmt: skip


def exchange(wan: WanModel, nbytes: float) -> float:
    return GEOMESH.exchange(wan, nbytes)[0]


def test_scaled_wan_multiplies_latencies_and_divides_bandwidths():
    wan = declared_wan()
    slow = wan.scaled(2.0, 4.0)
    assert slow.rtt_s[0][1] == pytest.approx(2 * wan.rtt_s[0][1])
    assert slow.bandwidth_Bps[0][1] == pytest.approx(wan.bandwidth_Bps[0][1] / 4)
    lat, tr = exchange_parts(GEOMESH, wan, 40e6)
    assert exchange(slow, 40e6) == pytest.approx(2 * lat + 4 * tr)
    assert time_parts(lambda w: exchange(w, 40e6), wan) == pytest.approx((lat, tr))
    assert wan.scaled(1, 1) is wan and wan.rtt_s[0][1] == 0.08  # a copy: the declared WAN is left alone
    for bad in (0, -1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="latency_factor"):
            wan.scaled(bad, 1.0)


def test_a_4x_slower_link_is_found_from_a_few_exchanges():
    wan = declared_wan()
    actual = wan.scaled(4.0, 4.0)
    parts = exchange_parts(GEOMESH, wan, 40e6)
    plain, aware = WanEstimator(noise_k=0.0), WanEstimator()
    asked = {}
    for k in range(1, 7):
        for name, est in (("plain", plain), ("aware", aware)):
            est.observe(*parts, exchange(actual, 40e6))
            if name not in asked and est.should_replan():
                asked[name] = (k, est.should_replan())
    assert plain.latency_factor == pytest.approx(4.0) and plain.transfer_factor == pytest.approx(4.0)
    assert exchange(plain.measured(wan), 40e6) == pytest.approx(exchange(actual, 40e6))
    assert asked["plain"][0] == 1  # modeled times: the first exchange says it
    assert asked["aware"][0] <= 6  # with noise_k: once the measurements' noise is known (none here)
    assert "4.0x slower" in asked["aware"][1]
    aware.assume()
    assert aware.should_replan() is None and aware.drift() == 0.0


def test_two_sizes_separate_latency_from_bandwidth():
    wan = declared_wan()
    actual = wan.scaled(1.5, 3.0)  # latencies 1.5x, bandwidths a third of the declared
    est = WanEstimator()
    for k in range(6):  # probes of two sizes, as a runtime sends them before round 0
        nbytes = 4e3 if k % 2 == 0 else 64e6
        est.observe(*exchange_parts(GEOMESH, wan, nbytes), exchange(actual, nbytes), probe=True)
    assert est.latency_factor == pytest.approx(1.5, rel=1e-9) and est.transfer_factor == pytest.approx(3.0, rel=1e-9)
    assert est.probes == 6
    for _ in range(20):  # then rounds of one size: the split stays what the probes measured
        est.observe(*exchange_parts(GEOMESH, wan, 40e6), exchange(actual, 40e6))
    assert est.latency_factor == pytest.approx(1.5, rel=1e-9) and est.transfer_factor == pytest.approx(3.0, rel=1e-9)
    # so the measured WAN predicts an exchange of another size, and another collective, too
    measured = est.measured(wan)
    assert exchange(measured, 1e9) == pytest.approx(exchange(actual, 1e9))
    assert measured.sharded_s(8e6, 64e6) == pytest.approx(actual.sharded_s(8e6, 64e6))
    # one size alone cannot tell them apart: the total is right at that size, the split is the prior's 1:1
    alone = WanEstimator()
    alone.observe(*exchange_parts(GEOMESH, wan, 40e6), exchange(actual, 40e6))
    assert alone.latency_factor == alone.transfer_factor
    assert exchange(alone.measured(wan), 40e6) == pytest.approx(exchange(actual, 40e6))


def noisy_replans(seed: int, noise_k: float, sigma: float = 0.1, n: int = 40) -> int:
    rng = random.Random(seed)
    est = WanEstimator(noise_k=noise_k)
    replans = 0
    for _ in range(n):
        est.observe(0.3, 0.7, math.exp(rng.gauss(0.0, sigma)))  # an accurately declared link, 10% noise
        if est.should_replan():
            replans += 1
            est.assume()
    return replans


def test_noise_does_not_replan():
    """Exchange times that scatter as much as the threshold around an accurately declared link: the plain
    threshold rule re-plans again and again, the noise-aware deadband holds the plan."""
    plain = [noisy_replans(seed, noise_k=0.0) for seed in range(6)]
    aware = [noisy_replans(seed, noise_k=2.0) for seed in range(6)]
    assert min(plain) >= 3
    assert aware == [0] * 6


def test_a_bandwidth_drop_to_a_quarter_replans_within_3_exchanges():
    wan = declared_wan()
    parts = exchange_parts(GEOMESH, wan, 40e6)
    rng = random.Random(1)
    est = WanEstimator()
    for _ in range(12):  # the link as declared, 3% noise: its noise is measured
        est.observe(*parts, exchange(wan, 40e6) * math.exp(rng.gauss(0.0, 0.03)))
        assert est.should_replan() is None
    # one congested exchange is an outlier: held back, not folded in, no re-plan
    est.observe(*parts, 3 * exchange(wan, 40e6))
    assert est.should_replan() is None and est.held_back == 1 and est.transfer_factor == pytest.approx(1, abs=0.05)
    quarter = wan.scaled(1.0, 4.0)
    reasons = []
    for _ in range(3):
        est.observe(*parts, exchange(quarter, 40e6) * math.exp(rng.gauss(0.0, 0.03)))
        reasons.append(est.should_replan())
    assert any(reasons)
    reason = next(r for r in reasons if r)
    assert reason.startswith("the WAN measured") and "slower than the plan assumed" in reason
    est.assume()
    assert exchange(est.measured(wan), 40e6) == pytest.approx(exchange(quarter, 40e6), rel=0.1)


def test_state_round_trips_and_a_resumed_copy_decides_alike():
    wan = declared_wan()
    rng = random.Random(7)

    def observations(k: int):
        nbytes = (4e3, 64e6)[k % 2] if k < 6 else 40e6
        link = wan.scaled(1.0, 1.0 if k < 20 else 4.0)
        return exchange_parts(GEOMESH, wan, nbytes), exchange(link, nbytes) * math.exp(rng.gauss(0.0, 0.05)), k < 6

    seq = [observations(k) for k in range(40)]
    whole, trail = WanEstimator(), []
    for k, (parts, measured, probe) in enumerate(seq):
        if k == 17:
            saved = json.dumps(whole.state_dict())  # plain JSON
        whole.observe(*parts, measured, probe=probe)
        reason = whole.should_replan()
        trail.append((reason, whole.latency_factor, whole.transfer_factor))
        if reason:
            whole.assume()
    assert any(r for r, _, _ in trail[20:])  # the quarter bandwidth at exchange 20 re-planned
    resumed = WanEstimator()
    resumed.load_state_dict(json.loads(saved))
    for k, (parts, measured, probe) in enumerate(seq[17:], start=17):
        resumed.observe(*parts, measured, probe=probe)
        reason = resumed.should_replan()
        assert (reason, resumed.latency_factor, resumed.transfer_factor) == trail[k]  # bit for bit
        if reason:
            resumed.assume()
    assert resumed.state_dict() == whole.state_dict()
    assert whole.summary()["observations"] == 40 and whole.summary()["probes"] == 6


def test_bad_input_is_refused():
    est = WanEstimator()
    for args in ((float("nan"), 1.0, 1.0), (0.1, -1.0, 1.0), (0.1, 1.0, float("inf")), (0.1, 1.0, -2.0),
                 (True, 1.0, 1.0), ("1", 1.0, 1.0)):  # fmt: skip
        with pytest.raises(ValueError, match="expected finite seconds"):
            est.observe(*args)
    with pytest.raises(ValueError, match="measures nothing"):
        est.observe(0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="positive seconds"):
        est.observe(0.1, 0.2, 0.0)
    assert est.observations == 0 and est.state_dict() == WanEstimator().state_dict()
    for kwargs, field in (({"smoothing": 1.0}, "smoothing"), ({"threshold": 0}, "threshold"),
                          ({"noise_k": -1}, "noise_k"), ({"noise_k": float("nan")}, "noise_k")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            WanEstimator(**kwargs)
    with pytest.raises(ValueError, match="not a WanEstimator state"):
        est.load_state_dict({"version": 1, "latency_factor": -1})
    with pytest.raises(ValueError, match="not a WanEstimator state"):
        est.load_state_dict({**WanEstimator().state_dict(), "level": [[1.0, float("nan"), 1.0]]})
