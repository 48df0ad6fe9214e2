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


PROBE_SIZES = (512, 4 << 20)  # the distributed runtime's probes before round 0 (plan_loop.py), each twice


def probed(wan: WanModel, actual: WanModel, sigma: float = 0.0, seed: int = 0) -> WanEstimator:
    rng, est = random.Random(seed), WanEstimator()
    for nbytes in PROBE_SIZES * 2:
        noise = math.exp(rng.gauss(0.0, sigma)) if sigma else 1.0
        est.observe(*exchange_parts(GEOMESH, wan, nbytes), exchange(actual, nbytes) * noise, probe=True)
    return est


def test_a_link_declared_far_faster_than_it_is_is_split_by_the_probes():
    """Declared at 10 Gbit/s, the links run at 250 Mbit/s: to the declaration both probe sizes are latency (the
    large one's transfer share is 8%, under SPAN_MIN), so before, the probes gave one total factor and the
    measured WAN mispredicted every other size. The measurements separate them: the large probe takes 4x the
    small one."""
    wan = declared_wan(gbps=10.0)
    actual = wan.scaled(1.2, 40.0)
    est = probed(wan, actual)
    assert est.latency_factor == pytest.approx(1.2, rel=1e-6) and est.transfer_factor == pytest.approx(40.0, rel=1e-6)
    measured = est.measured(wan)
    assert exchange(measured, 40e6) == pytest.approx(exchange(actual, 40e6), rel=1e-6)
    assert measured.sharded_s(8e6, 64e6) == pytest.approx(actual.sharded_s(8e6, 64e6), rel=1e-6)
    # with a few percent of jitter on every probe, still found
    found = [probed(wan, actual, sigma=0.05, seed=seed).transfer_factor for seed in range(50)]
    assert all(20 < f < 64 for f in found), sorted(found)[:3]


def test_a_probe_that_measured_nothing_is_left_out():
    """A probe median of 0 s (leaders' reports are data) says nothing of the link: left out, never an error."""
    wan = declared_wan()
    est = WanEstimator()
    est.observe_probe(wan, 512, 0.0)
    assert est.probes == 0 and est.latency_factor == 1.0
    est.observe_probe(wan, 512, 2 * wan.allgather_s(512))
    assert est.probes == 1 and est.latency_factor == pytest.approx(2.0)


def test_jitter_between_probe_sizes_is_seldom_taken_for_a_bandwidth():
    """A link declared right (100 Gbit/s: the large probe's transfer is 1% of it), probes scattered by 10%: the
    two sizes differ by noise alone. Only a split that stands out from the probes' own scatter is taken (here
    3 seeds of 200 at 10% jitter, none at 2%); otherwise one total factor, as before."""
    wan = declared_wan(gbps=100.0)
    split = {sigma: [s for s in range(200) if probed(wan, wan, sigma, s).transfer_factor
                     != pytest.approx(probed(wan, wan, sigma, s).latency_factor, rel=1e-9)]
             for sigma in (0.02, 0.1)}  # fmt: skip
    assert len(split[0.02]) == 0 and len(split[0.1]) <= 5, split


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


# ---- wan.actual: the WAN the cluster really has ---------------------------------------------------------


def test_wan_actual_is_links_or_factors_of_the_declared():
    from geomesh.config import load_scenario

    sc = load_scenario("default", {"wan.actual.bandwidth_factor": 0.25, "wan.actual.rtt_factor": 2.0})
    declared, actual = sc.wan_model(), sc.actual_wan_model()
    assert actual.rtt_s[0][1] == 2 * declared.rtt_s[0][1]
    assert actual.bandwidth_Bps[0][1] == declared.bandwidth_Bps[0][1] / 4
    given = load_scenario("default", {"wan.actual.bandwidth_gbps": 0.5}).actual_wan_model()
    assert given.bandwidth_Bps[1][2] == 0.5e9 / 8 and given.rtt_s == declared.rtt_s
    assert load_scenario("default").actual_wan_model() == declared and sc.geomesh.measure_wan is True


@pytest.mark.parametrize("pair, message", [
    ("wan.actual.bandwidth_factor=0", "wan.actual.bandwidth_factor: 0.0 is not allowed; expected a factor"),
    ("wan.actual.rtt_factor=abc", "scenario.wan.actual.rtt_factor: 'abc' is not allowed"),
    ("wan.actual.bandwith_gbps=1", "scenario.wan.actual.bandwith_gbps: unknown field"),
    ("wan.actual={}", "wan.actual: {} is not allowed; expected at least one of"),
    ("wan.actual.rtt=[[0,1],[1,0]]", "wan.actual.rtt: [[0, 1], [1, 0]] is not allowed; expected a 4x4 matrix"),
    ("geomesh.measure_wan=maybe", "scenario.geomesh.measure_wan: 'maybe' is not allowed; expected true/false"),
])  # fmt: skip
def test_a_bad_wan_actual_is_one_line_and_exit_2(pair, message, capsys):
    from geomesh.cli import main

    assert main(["plan", "default", "--set", pair]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_the_study_declares_the_actual_wan_for_its_reference_run():
    from conftest import bench_script

    study = bench_script("wan_loop")
    actual = {"bandwidth_factor": 0.25}
    right = study.scenario_for("default", {}, actual, "declared right")
    opened = study.scenario_for("default", {}, actual, "open loop")
    assert right.wan.actual is None and right.geomesh.measure_wan and not opened.geomesh.measure_wan
    for a, b in zip(right.wan_model().bandwidth_Bps, opened.actual_wan_model().bandwidth_Bps):
        assert a == pytest.approx(b)


# ---- the emulated runtime: a cluster whose WAN is not the declared one ----------------------------------


def wan_scenario(folder, paths, method_tokens=None, **geomesh):
    """The tiny scenario at 1 Gbit/s with rounds short against the exchange (0.2 s of compute, an all-gather of
    0.33 s as declared): an overlapped round is stretched to the exchange it hides. ``geomesh``: its section's
    overrides; ``actual=``: the scenario's wan.actual."""
    import yaml
    from conftest import tiny_scenario_dict

    data = tiny_scenario_dict(paths, zero_shot_items=0)
    data["wan"]["bandwidth_gbps"] = 1.0
    actual = geomesh.pop("actual", None)
    if actual is not None:
        data["wan"]["actual"] = actual
    g = data["geomesh"]
    g.pop("round_sequences_factor")  # the planning rule, which overlap floors at the exchange
    g.update({"calibrate": True, "round_time_s": 0.2, **geomesh})
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def emulated(path, method, out=None, **options):
    from geomesh.config import load_scenario
    from geomesh.runtime.emulated import EmulatedRun, RunOptions

    return EmulatedRun(load_scenario(path), get_method(method),
                       RunOptions(out_dir=out, progress=False, **{"workers_parallel": 1, **options})).run()  # fmt: skip


def test_a_wan_4x_thinner_than_declared_is_probed_planned_for_from_round_0_and_overlap_hides_it(tmp_path,
                                                                                                small_corpus):
    """The cluster's links carry a quarter of the declared bandwidth. The emulated closed loop probes them
    before round 0 at the distributed runtime's two sizes: latency x1, transfer x4 (one size alone gives one
    total factor for both, as the first round's exchange did before the probes), and the first plan is made
    over them, so no round runs on the declared WAN and none is re-planned."""
    from geomesh.telemetry import read_events

    slow = {"actual": {"bandwidth_factor": 0.25}}
    closed = emulated(wan_scenario(tmp_path / "c", small_corpus, **slow), "geomesh-overlap", tmp_path / "closed")
    opened = emulated(wan_scenario(tmp_path / "o", small_corpus, measure_wan=False, **slow), "geomesh-overlap")
    # open loop: the plan keeps the declared exchange, which the cluster's exchange outlasts round after round
    assert opened["replans"] == 0 and opened["wan_measured"] is None
    assert opened["plan"]["exchange_s"] < opened["exchange_s_per_round"]
    assert any("on wan.actual" in m for m in opened["modeled"])
    # closed loop: the probes measure the WAN before round 0, and the first plan is made over it
    events = read_events(tmp_path / "closed" / "events.jsonl")
    probes = [e for e in events if e["type"] == "wan_probe"]
    assert len(probes) == 1 and probes[0]["time"] == 0.0 and probes[0]["seconds"] > 0
    measured = probes[0]["wan_measured"]
    assert measured["probes"] == 4 and measured["latency_factor"] == pytest.approx(1.0)
    assert measured["transfer_factor"] == pytest.approx(4.0)
    assert closed["replans"] == 0 and closed["wan_measured"]["probes"] == 4
    assert closed["plan"]["exchange_s"] == pytest.approx(closed["exchange_s_per_round"])  # the plan knows the WAN
    # the round stretched to the exchange it hides (within the planner's 1% fill slack)
    assert closed["plan"]["compute_s"] > 0.98 * closed["exchange_s_per_round"] > opened["plan"]["compute_s"]
    assert closed["wan_idle_frac"] < opened["wan_idle_frac"]
    rounds = [e for e in events if e["type"] == "round"]
    assert not [r for r in rounds if "planned_exchange_s" in r]  # from round 1 on, the plan's exchange is the WAN's
    # --no-calibrate (geomesh.calibrate: false) keeps the declared WAN too
    nocal = emulated(wan_scenario(tmp_path / "n", small_corpus, calibrate=False, **slow), "geomesh-overlap")
    assert nocal["wan_measured"] is None
    assert (nocal["curve"], nocal["modeled_time_s"]) == (opened["curve"], opened["modeled_time_s"])


def test_an_accurate_declaration_is_not_replanned_for(tmp_path, small_corpus):
    from geomesh.telemetry import read_events

    closed = emulated(wan_scenario(tmp_path / "c", small_corpus), "geomesh-overlap", tmp_path / "closed")
    opened = emulated(wan_scenario(tmp_path / "o", small_corpus, measure_wan=False), "geomesh-overlap")
    assert closed["replans"] == 0 and closed["wan_measured"]["observations"] >= 1
    assert closed["wan_measured"]["transfer_factor"] == pytest.approx(1.0)
    assert not [e for e in read_events(tmp_path / "closed" / "events.jsonl") if e["type"] == "plan" and e.get("replan")]
    # measuring the WAN the plan already has changes nothing: the same run as the open loop
    assert (closed["curve"], closed["modeled_time_s"], closed["per_worker"]) == (
        opened["curve"], opened["modeled_time_s"], opened["per_worker"])


def test_a_resumed_closed_loop_is_the_uninterrupted_run(tmp_path, small_corpus, monkeypatch):
    """The WAN measured is in the emulated checkpoints: a run interrupted after one resumes to the very run
    that was never interrupted (summary and events byte for byte)."""
    from test_reliability import Interrupted, assert_same_run, interrupt_at

    path = wan_scenario(tmp_path, small_corpus, actual={"bandwidth_factor": 0.25, "rtt_factor": 2.0},
                        round_time_s=None, round_sequences_factor=1.0)  # fmt: skip
    ref = emulated(path, "geomesh", tmp_path / "ref", tokens=9000)
    measured = ref["wan_measured"]  # (the probes split the WAN before round 0; every round measures it again)
    assert measured["probes"] == 4 and measured["observations"] > 4 and ref["rounds"] >= 4
    assert (measured["latency_factor"], measured["transfer_factor"]) == (pytest.approx(2.0), pytest.approx(4.0))
    interrupt_at(monkeypatch, 3)
    with pytest.raises(Interrupted):
        emulated(path, "geomesh", tmp_path / "run", tokens=9000, checkpoint_every=1)
    monkeypatch.undo()
    emulated(path, "geomesh", tmp_path / "run", tokens=9000, checkpoint_every=1, resume=True)
    assert_same_run(tmp_path / "run", tmp_path / "ref")


# ---- GeoMeshSync: a user's loop reports its exchanges -----------------------------------------------------


def test_geomesh_sync_takes_measured_exchange_times(tmp_path):
    from test_api_replan import _trained, alike_scenario, tiny

    from geomesh.api import GeoMeshSync
    from geomesh.config import load_scenario
    from geomesh.telemetry import Telemetry
    from geomesh.telemetry_sinks import ListSink

    path = alike_scenario(tmp_path / "alike.yaml")
    sink = ListSink()

    def make(telemetry=None, **overrides):
        return GeoMeshSync([tiny(0), tiny(0)], scenario=load_scenario(path, overrides), telemetry=telemetry)

    sync = make(Telemetry(None, sinks=[sink]))
    assert isinstance(sync.wan, WanEstimator) and make(**{"geomesh.measure_wan": False}).wan is None
    assert make(**{"geomesh.calibrate": False}).wan is None
    declared = sum(exchange_parts(sync.method, sync.scenario.wan_model(), sync.payload_bytes))
    first = sync.plan.exchange_s
    with pytest.raises(ValueError, match="exchange time"):
        sync.sync([10, 10], exchange_s=-1.0)
    results = []
    for k in range(8):  # the user's exchange takes 4x what the declared WAN says
        _trained(sync)
        results.append(sync.sync([10, 10], exchange_s=4 * declared))
        if k == 3:
            resumed = make()
            resumed.load_state_dict(sync.state_dict())
            assert json.loads(json.dumps(sync.state_dict()["wan"])) == sync.state_dict()["wan"]  # plain JSON
    assert results[0].exchange_s == pytest.approx(4 * declared)
    replanned = [k for k, r in enumerate(results) if r.replanned]
    assert replanned and replanned[0] <= 6  # once the exchanges' noise is known (none here): six exchanges
    records = [r for r in sink.records if r["type"] == "plan" and "reason" in r]
    assert len(records) == 1 and records[0]["reason"].startswith("the WAN measured 4.0x slower")
    assert sync.plan.exchange_s == pytest.approx(4 * first)  # the plan now expects the measured WAN
    assert sync.wan.transfer_factor == pytest.approx(4.0)
    # the WAN measured is in its state: a copy resumed mid-way decides as the uninterrupted one
    for k in range(4, 8):
        _trained(resumed)
        assert resumed.sync([10, 10], exchange_s=4 * declared).replanned == results[k].replanned
    assert resumed.wan.state_dict() == sync.wan.state_dict() and resumed.plan.to_json() == sync.plan.to_json()
