"""The plan as a loop in real processes: regions measure their step time in place before round 0, and every
round's measured compute times re-plan the run when speeds drift, on every rank alike.

The speed changes here are real, never declared: CPU quotas slow two regions partway through a run, or the
scenario declares H100, A100 and T4 for processes that all run at one
speed. Assertions are on the plan's direction (the slowed regions get less work, on every rank the same), never
on seconds.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
import torch
import yaml
from conftest import sustained_calibration, tiny_scenario_dict
from test_elastic import MEASURED_ENV, fixed_profiles, processes, start, wait_for_round

from geomesh.cli import launch as cli_launch
from geomesh.testbed.quotas import CpuQuotas, quota_unavailable_reason
from geomesh.telemetry import read_events

QUOTA_REASON = quota_unavailable_reason()


def write(tmp_path, small_corpus, gpus=("A100", "A100", "A100"), elastic=False, training=None, sustained=False,
          **geomesh):  # fmt: skip
    data = tiny_scenario_dict(small_corpus, gpus, **(training or {}))
    if sustained:
        sustained_calibration(data)
    data["geomesh"].update({"calibrate": False, "replan": True, **geomesh})
    if elastic:
        data["reliability"] = {"min_regions": 2, "round_deadline_s": 120}
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def work(plan: dict, region: str) -> int:
    w = next(w for w in plan["workers"] if w["name"] == region)
    return w["batch"] * w["inner_steps"]


@pytest.mark.skipif(QUOTA_REASON is not None, reason=f"CPU quotas cannot be set here: {QUOTA_REASON}")
@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_regions_slowed_mid_run_are_replanned(tmp_path, small_corpus, elastic):
    """Regions declared alike; after round 3 each region's processes are held to a CPU quota, r0 at 0.8 of a
    core, r1 and r2 at 0.15 (a control group each, weighing 100 default groups: each gets its share however
    busy the machine is, and each region's speed is its own): the measured compute times re-plan the run,
    giving r1 and r2 less work than r0. (Evaluated at the end only: an evaluation after every round, which
    only r0 runs in a static run, would weigh more than these tiny rounds' compute, and the plan counts it:
    tests/test_round_overhead.py.)"""
    path = write(tmp_path, small_corpus, elastic=elastic, training={"eval_every_rounds": 1000})
    out, tag = tmp_path / "run", uuid.uuid4().hex
    cmd = ["launch", str(path), "--nproc", "3", "--method", "geomesh", "--out", str(out), "--tokens", "40000",
           "--quiet", "--wan", "none", "--timeout", "90"]  # fmt: skip
    proc = start(cmd, tag, out)
    quotas = CpuQuotas(tag, weight=100)
    try:
        wait_for_round(out, proc, 3)
        for region, share in (("r0-a100", 0.8), ("r1-a100", 0.15), ("r2-a100", 0.15)):
            quotas.set(region, share, pids=processes(tag, region))
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
        quotas.close()
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    events = read_events(out / "events.jsonl")
    replans = [e for e in events if e["type"] == "plan" and e.get("replan")]
    assert summary["replans"] == len(replans) >= 1
    last = replans[-1]
    assert last["round"] > 3 and set(last["measured_s"]) <= {"r0-a100", "r1-a100", "r2-a100"}
    final = last["plan"]
    seen = [(e["round"], {r: work(e["plan"], r) for r in ("r0-a100", "r1-a100", "r2-a100")}, e["measured_s"])
            for e in replans]  # (the evidence when it fails: every re-plan's work and what it measured)
    assert work(final, "r1-a100") < work(final, "r0-a100") and work(final, "r2-a100") < work(final, "r0-a100"), seen
    rounds = [e for e in events if e["type"] == "round"]
    assert all("straggler_idle_frac" in e for e in rounds)
    checksums = summary["param_checksums"]
    assert len(set(checksums.values() if isinstance(checksums, dict) else checksums)) == 1


def test_wrong_datasheet_gpus_are_balanced_by_calibration(tmp_path, small_corpus):
    """H100, A100 and T4 declared, processes that all run at one speed: the datasheet plan gives the 'H100' several
    times the T4's work; calibrated in place, round 0's plan is close to even."""
    path = write(tmp_path, small_corpus, gpus=("H100", "A100", "T4"), calibrate=True, replan=False, sustained=True)
    plans = {}
    for name, extra in (("datasheet", ["--no-calibrate"]), ("calibrated", [])):
        out = tmp_path / name
        args = cli_launch.build_parser().parse_args(
            ["launch", str(path), "--nproc", "3", "--method", "geomesh", "--out", str(out), "--tokens", "4000",
             "--quiet", "--wan", "none", "--timeout", "90", *extra])  # fmt: skip
        result = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1"})
        assert result.code == 0, result.message
        plans[name] = [e["plan"] for e in read_events(out / "events.jsonl") if e["type"] == "plan"][-1]
        if name == "calibrated":
            assert set(result.summary["calibration_s"]) == {"r0-h100", "r1-a100", "r2-t4"}
            (calibration,) = [e for e in read_events(out / "events.jsonl") if e["type"] == "calibration"]
            # the scenario's windows (the product's: geomesh.calibration_window_s, geomesh.calibration_budget_s)
            assert {(p["extra"]["window_s"], p["extra"]["budget_s"]) for p in calibration["profiles"].values()} == {
                (0.5, 10.0)}  # fmt: skip
    spread = {k: work(p, "r0-h100") / work(p, "r2-t4") for k, p in plans.items()}
    assert spread["datasheet"] > 2.5 and spread["calibrated"] < spread["datasheet"] / 2, spread


# the WAN as the test hooks measure it: 4x the declared for the probes and the exchanges of rounds 1 and 2, 32x from
# round 3's on: a change of the link once its noise is known (the probes and two exchanges), confirmed over three
# exchanges, in the resumed run (an exchange that far off before the noise is known corrects the measured WAN at
# once: planner/wan.py, FAR_FACTOR; MEASURED_ENV's 32x from round 2's exchange is corrected at round 3)
RESUMED_WAN_ENV = {**MEASURED_ENV, "GEOMESH_TEST_WAN": "4:2:32"}


def plan_records(out) -> list[tuple]:
    return [(e["round"], e.get("reason"), e["plan"]) for e in read_events(out / "events.jsonl") if e["type"] == "plan"]


def test_a_resumed_run_plans_as_the_uninterrupted_one(tmp_path, small_corpus):
    """Re-planning on, the WAN measured: the plan history, the online planner's speed factors, the WAN's
    measurement and each leader's last wire report (sent with the next round's info) are in every checkpoint,
    so SIGKILL after a re-plan for the measured WAN + --resume re-plans at the same rounds, for the same reasons,
    and ends bit-identical. (Measured times differ between runs: the test hooks make them a function of the
    bytes and the plan, so the two runs' measurements, and so their plans, can be compared.)"""
    path = write(tmp_path, small_corpus, gpus=("H100", "A100", "T4"), calibrate=True)
    base = ["launch", str(path), "--nproc", "3", "--method", "geomesh", "--tokens", "14784", "--save-params",
            "--quiet", "--wan", "none", "--timeout", "90", *fixed_profiles(tmp_path, path)]  # fmt: skip
    ref = tmp_path / "ref"
    done = cli_launch.launch(cli_launch.build_parser().parse_args([*base, "--out", str(ref)]),
                             extra_env={"OMP_NUM_THREADS": "1", **RESUMED_WAN_ENV})  # fmt: skip
    assert done.code == 0, done.message
    want_plans = plan_records(ref)
    reasons = [(r, why.split(" than ")[0]) for r, why, _ in want_plans if why]
    assert reasons[0] == (0, "the WAN probed 4.0x slower"), reasons  # the first re-plan, before the kill
    # and one the resumed run makes, from the WAN measured before the kill and after it (the 32x exchanges)
    assert any(r > 3 and why.startswith("the WAN measured") for r, why in reasons[1:]), reasons
    out, tag = tmp_path / "run", uuid.uuid4().hex
    cmd = [*base, "--out", str(out), "--checkpoint-every", "1", "--keep", "2"]
    proc = start(cmd, tag, out, RESUMED_WAN_ENV, forked=True)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / "round-000003").is_dir():
            assert proc.poll() is None, "the run ended before its third checkpoint"
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        for pid in processes(tag) + [proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
    # what the checkpoint carries of the plan's loop: the planner's speed factors, the WAN's measurement, and
    # each leader's wire report of the round's exchange (still to be sent with the next round's info)
    rank0 = json.loads((out / "checkpoints" / "round-000003" / "rank-0.json").read_text())
    loop = json.loads(rank0["state"]["run.extra"])["plan_loop"]
    online = loop["online"]
    assert set(online["factors"]) == {"r0-h100", "r1-a100", "r2-t4"} and online["measured"]
    assert all(online["history"][n] for n in online["factors"]) and set(online["level"]) == set(online["factors"])
    assert loop["wan"]["observations"] == 4 + 2  # the probes, the exchanges of rounds 1 and 2
    assert loop["wire"]["wire_round"] == 3 and loop["wire"]["wire_s"] > 0
    resumed = cli_launch.launch(cli_launch.build_parser().parse_args([*cmd, "--resume"]),
                                extra_env={"OMP_NUM_THREADS": "1", **RESUMED_WAN_ENV})  # fmt: skip
    assert resumed.code == 0, resumed.message
    summary = json.loads((out / "summary.json").read_text())
    assert summary["replans"] == done.summary["replans"] == len(reasons)
    assert summary["wan_measured"] == done.summary["wan_measured"]
    assert summary["plan"] == done.summary["plan"]
    assert plan_records(out) == want_plans
    want, got = torch.load(ref / "final_params.pt"), torch.load(out / "final_params.pt")
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_the_loop_plans_with_noise_aware_rules(tmp_path, small_corpus):
    """The distributed runtime's measurements are wall-clock: its online planner holds outliers back and keeps
    a plan until the rounds show a drift beyond their noise (geomesh.replan_noise_k); 0 turns that off, and a
    negative value is refused naming the field. (No launch: the loop's planner is built as the loop builds it.)"""
    from geomesh.config import ConfigError, load_scenario
    from geomesh.methods import get_method
    from geomesh.planner.online import MISS_FACTOR, ROUND_STEP
    from geomesh.runtime.distributed.calibration import Calibration

    path = write(tmp_path, small_corpus)
    for k in (2.5, 0.0):
        sc = load_scenario(path, {"geomesh.replan_noise_k": k} if k == 0.0 else None)
        calibration, method = Calibration(True, False), get_method("geomesh")
        online = calibration.online_planner(sc, method, sc.worker_profiles({}))
        assert online.noise_k == k and online.first_measurement_sets_factor
        assert online.warmup_rounds == 1  # an uncalibrated region's first round (start-up) is not its speed
        # (calibrated: the calibration's steps were the start-up)
        calibration.profiles = {"r0": sc.worker_profiles({})[0]}
        assert calibration.online_planner(sc, method, sc.worker_profiles({})).warmup_rounds == 0
        # a miss far beyond the noise re-plans at once; one measurement moves a round at most ROUND_STEP
        # (tests/test_replan_miss.py)
        assert (online.miss_factor, online.round_step) == (MISS_FACTOR, ROUND_STEP)
    with pytest.raises(ConfigError, match="geomesh.replan_noise_k"):
        load_scenario(path, {"geomesh.replan_noise_k": -1})
