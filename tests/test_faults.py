"""Injected faults in the emulated runtime, and online re-planning when a worker's speed drifts."""

from __future__ import annotations

import pytest

from geomesh.config import ConfigError, FaultConfig, validate
from geomesh.methods import get_method
from geomesh.runtime.emulated import EmulatedRun, RunOptions
from geomesh.telemetry import read_events


def run(scenario, method="geomesh", out=None):
    return EmulatedRun(scenario, get_method(method), RunOptions(out_dir=out, progress=False)).run()


def sequences(plan, name):
    w = next(w for w in plan["workers"] if w["name"] == name)
    return w["batch"] * w["inner_steps"]


def round_idle(events, round_index):
    spans = [e for e in events if e["type"] == "span" and e["round"] == round_index]
    wall = sum(e["end"] - e["start"] for e in spans)
    return sum(e["end"] - e["start"] for e in spans if e["kind"] == "straggler_wait") / wall


def test_worker_that_slows_down_is_replanned(tiny_scenario, tmp_path):
    s = tiny_scenario(tokens=60000)
    s.faults = [FaultConfig(at_round=3, region="r0-h100", kind="slowdown", factor=3.0)]
    summary = run(s, out=tmp_path)
    assert summary["replans"] >= 1
    events = read_events(tmp_path / "events.jsonl")
    plans = [e["plan"] for e in events if e["type"] == "plan"]
    assert sequences(plans[-1], "r0-h100") < sequences(plans[0], "r0-h100")  # the slowed worker gets less
    last = summary["rounds"] - 2  # a full round (the final one may be shortened)
    assert round_idle(events, 3) > 0.2  # the round that discovered the slowdown
    assert round_idle(events, last) < round_idle(events, 3) / 3

    s.geomesh.replan = False
    frozen = run(s)
    assert frozen["replans"] == 0
    assert frozen["straggler_idle_frac"] > summary["straggler_idle_frac"]


def test_worker_leaves_and_rejoins(tiny_scenario, tmp_path):
    s = tiny_scenario()
    s.faults = [FaultConfig(at_round=1, region="r2-t4", kind="leave"),
                FaultConfig(at_round=3, region="r2-t4", kind="join")]
    validate(s)
    for method in ("geomesh", "diloco"):
        summary = run(s, method, tmp_path / method)
        assert [f["kind"] for f in summary["faults"]] == ["leave", "join"]
        t4 = summary["per_worker"]["r2-t4"]
        assert t4["other"] > 0  # down time
        for t in summary["per_worker"].values():
            assert t["wall"] == pytest.approx(summary["modeled_time_s"])
        events = read_events(tmp_path / method / "events.jsonl")
        rounds = {e["round"]: e for e in events if e["type"] == "round"}
        assert "r2-t4" not in rounds[2]["compute_s"] and "r2-t4" in rounds[4]["compute_s"]
        assert summary["final_val_loss"] < summary["curve"][0][2]


def test_bandwidth_drop_slows_the_exchange(tiny_scenario, tmp_path):
    s = tiny_scenario()
    s.faults = [FaultConfig(at_round=2, region="r1-a100", kind="bandwidth", factor=0.1)]
    run(s, "diloco", tmp_path)
    rounds = {e["round"]: e for e in read_events(tmp_path / "events.jsonl") if e["type"] == "round"}
    assert rounds[3]["exchange_s"] > 3 * rounds[1]["exchange_s"]


@pytest.mark.parametrize(
    "faults, message",
    [
        ([FaultConfig(1, "nowhere", "leave")], "faults[0].region"),
        ([FaultConfig(1, "r0-h100", "explode")], "faults[0].kind"),
        ([FaultConfig(1, "r0-h100", "join")], "has not left"),
        ([FaultConfig(1, "r0-h100", "slowdown", factor=0)], "faults[0].factor"),
    ],
)
def test_fault_validation(tiny_scenario, faults, message):
    s = tiny_scenario()
    s.faults = faults
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(s)
