"""A region's round overhead in the plan: its time per round outside the inner steps (the outer step, an
evaluation, a checkpoint), measured in place like its compute, so that a region slower there computes less
and the others do not wait out its evaluation. The planning rule and the sequence target, the online planner
(warm-up, re-plan, state, a peer's state as data), the runtime's accounting of a round's work, and a real
static run where region 0 alone evaluates θ after every round."""

from __future__ import annotations

import math

import pytest
import yaml
from conftest import sustained_calibration, tiny_scenario_dict

from geomesh.cli import launch as cli_launch
from geomesh.hardware import WorkerProfile
from geomesh.planner import OnlinePlanner, PlanConstraints, plan_balanced
from geomesh.planner.online import OVERHEAD_WINDOW, predicted_balance
from geomesh.runtime.distributed.deadline import deadline_history
from geomesh.runtime.distributed.exchange import reported_overhead_s, round_idle, round_work_s, wait_for_slowest_s
from geomesh.telemetry import read_events

TABLE = {1: 0.02, 4: 0.05, 8: 0.1, 16: 0.19, 32: 0.37}  # seconds per micro-batch: one worker's step times
RULE = PlanConstraints(fill=True, ref_batch=8, ref_inner_steps=20, min_inner_steps=1, max_batch=32)


def profile(name: str, overhead: float = 0.0) -> WorkerProfile:
    return WorkerProfile(name=name, gpu="A100", gpu_count=1, max_micro_batch=32, table=dict(TABLE),
                         round_overhead_s=overhead)  # fmt: skip


def work_s(plan) -> dict[str, float]:
    return {w.name: w.compute_s + w.overhead_s for w in plan.workers}


def sequences(plan) -> dict[str, int]:
    return {w.name: w.sequences for w in plan.workers}


def test_the_planning_rule_fills_each_round_less_its_overhead():
    """Three workers alike, one with 0.5 s per round outside its inner steps (the reference round is 2 s of
    compute): that one computes less, the others fill the round its overhead makes, and the round's work is
    balanced; a plan blind to the overhead leaves the others waiting for it."""
    blind = plan_balanced([profile("a"), profile("b"), profile("c")], RULE)
    aware = plan_balanced([profile("a", 0.5), profile("b"), profile("c")], RULE)
    assert len(set(sequences(blind).values())) == 1  # alike: the same work
    s = sequences(aware)
    assert s["a"] < s["b"] and s["a"] < s["c"]
    work = work_s(aware)
    assert max(work.values()) - min(work.values()) <= 0.05 * max(work.values())
    assert aware.straggler_idle_frac < 0.02 and aware.worker("a").overhead_s == 0.5
    assert "round overheads measured: a 0.5 s" in aware.rule
    truth = {p.name: p for p in (profile("a", 0.5), profile("b"), profile("c"))}
    assert predicted_balance(blind, truth)[0] > 0.1 > predicted_balance(aware, truth)[0]
    # the round lasts the slowest worker's reference round and its overhead: the others do more in it
    assert aware.round_s == pytest.approx(max(work.values()))
    assert sum(s.values()) > sum(sequences(blind).values())
    # no overhead anywhere: the plan of before, field for field
    assert plan_balanced([profile("a", 0.0), profile("b"), profile("c")], RULE).to_json() == blind.to_json()


def test_the_sequence_target_counts_the_overhead():
    target = PlanConstraints(target_sequences=480, min_inner_steps=1, max_batch=32)
    plan = plan_balanced([profile("a", 0.6), profile("b"), profile("c")], target)
    s = sequences(plan)
    assert s["a"] < min(s["b"], s["c"])
    work = work_s(plan)
    assert (max(work.values()) - min(work.values())) / max(work.values()) < 0.1


def test_an_explicit_round_is_the_compute_of_the_worker_with_most_overhead():
    rule = PlanConstraints(round_compute_s=2.0, min_inner_steps=1, max_batch=32)
    plan = plan_balanced([profile("a", 0.4), profile("b", 0.1), profile("c")], rule)
    compute = {w.name: w.compute_s for w in plan.workers}
    assert compute["a"] <= 2.0 * 1.01 and compute["a"] < compute["b"] < compute["c"]


def online(noise_k: float = 0.0) -> OnlinePlanner:
    return OnlinePlanner([profile("a"), profile("b"), profile("c")], RULE, noise_k=noise_k, warmup_rounds=1)


def a_round(planner: OnlinePlanner, overheads: dict[str, float]) -> None:
    """One round measured: each worker's compute as its plan says (its speed is as profiled), then its overhead."""
    plan = planner.current
    for w in plan.workers:
        planner.observe(w.name, w.compute_s, plan)
        planner.observe_overhead(w.name, overheads[w.name])


@pytest.mark.parametrize("noise_k", [0.0, 2.0], ids=["plain", "noise-aware"])
def test_the_online_planner_replans_for_a_measured_overhead_once(noise_k):
    planner = online(noise_k)
    first = planner.plan()
    slow = {"a": 0.6, "b": 0.02, "c": 0.02}
    a_round(planner, slow)  # the warm-up round: neither its compute nor its overhead is folded
    assert planner.round_overhead("a") == 0.0 and planner.maybe_replan() is None
    a_round(planner, slow)
    assert planner.overhead_moved() == ["a"]
    replanned = planner.maybe_replan()
    assert replanned is not None and replanned.worker("a").overhead_s == pytest.approx(0.6)
    # the rule's round is the slowest worker's reference round and its overhead: the others fill what it adds
    assert sequences(replanned)["a"] == sequences(first)["a"] < min(sequences(replanned)["b"], sequences(replanned)["c"])
    for _ in range(OVERHEAD_WINDOW):  # the same figures again: the plan in force stays
        a_round(planner, slow)
        assert planner.maybe_replan() is None
    # one round's outlier (a checkpoint) is not the overhead: the median of the recent rounds is
    a_round(planner, {**slow, "b": 3.0})
    assert planner.round_overhead("b") == pytest.approx(0.02) and planner.maybe_replan() is None


def test_overheads_travel_in_the_state_and_a_peers_values_are_data():
    planner = online(2.0)
    planner.plan()
    for _ in range(3):
        a_round(planner, {"a": 0.6, "b": 0.02, "c": 0.03})
    planner.maybe_replan()
    state = planner.state_dict()
    again = online(2.0)
    again.load_state_dict(state)
    assert again.overheads == planner.overheads and again.overhead_assumed == planner.overhead_assumed
    assert again.round_overhead("a") == pytest.approx(0.6) and again.overhead_moved() == []
    hostile = {**state, "overheads": {"a": [True, -1.0, math.inf, "1", [2.0], {"x": 1}, None, 0.4], "b": "nope",
                                      "c": {"0": 1.0}},
               "overhead_assumed": {"a": "x", "b": -2.0, "c": math.nan}}  # fmt: skip
    victim = online(2.0)
    victim.load_state_dict(hostile)
    assert victim.overheads == {"a": [0.4], "b": [], "c": []}
    assert victim.overhead_assumed == {"a": 0.0, "b": 0.0, "c": 0.0}
    with pytest.raises(ValueError, match="round overhead"):
        victim.observe_overhead("a", -1.0)
    with pytest.raises(ValueError, match="unknown worker"):
        victim.observe_overhead("z", 1.0)


def test_a_rounds_work_counts_its_overhead_and_a_peers_figures_are_data():
    infos = [{"compute_s": 2.0, "overhead_s": 0.5}, {"compute_s": 2.5}, {"compute_s": 2.5, "overhead_s": True}]
    assert [round_work_s(i) for i in infos] == [2.5, 2.5, 2.5]
    assert round_idle(infos) == 0.0  # balanced work: nobody waits, whatever the compute alone says
    assert wait_for_slowest_s(infos, 2.0 + 0.5) == 0.0
    for bad in (-1.0, math.inf, math.nan, "0.5", [0.5], None, True):
        assert reported_overhead_s({"overhead_s": bad}) is None
        assert round_work_s({"compute_s": 1.0, "overhead_s": bad}) == 1.0
    assert round_work_s({"compute_s": "1"}) is None and round_work_s({}) is None
    assert round_idle([{"compute_s": 1.0, "overhead_s": 1.0}, {"compute_s": 1.0}]) == pytest.approx(0.25)


def test_the_adaptive_deadline_waits_for_the_slowest_work():
    """The exchange waits for a member's compute and overhead alike: so does the deadline's history (a healed
    region's records are data: an overhead list that does not match, or a figure that is no number, counts as
    none)."""
    records = [{"type": "round", "compute_s": [2.0, 3.0], "overhead_s": [1.5, 0.0]},
               {"type": "round", "compute_s": [2.0, 3.0], "overhead_s": [1.5]},
               {"type": "round", "compute_s": [2.0, 3.0], "overhead_s": ["9", None]},
               {"type": "round", "compute_s": [2.0, "x"], "overhead_s": "junk"}]  # fmt: skip
    assert deadline_history(records) == [3.5, 3.0, 3.0, 2.0]


def test_a_static_run_plans_the_evaluating_region_less_work(tmp_path, small_corpus):
    """Three regions alike, a static run with calibration and re-planning (the configuration users run): only
    region 0 evaluates θ after every round (128 sequences), and keeps the run's records. Its rounds' overhead,
    measured, re-plans the run: region 0 computes less than the others, and the records carry every region's
    overhead."""
    # (the product's calibration windows: the re-plans read the overhead against the calibrated compute)
    data = sustained_calibration(tiny_scenario_dict(small_corpus, ("A100", "A100", "A100"), eval_sequences=128))
    data["geomesh"].update({"calibrate": True, "replan": True})
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    args = cli_launch.build_parser().parse_args(
        ["launch", str(path), "--nproc", "3", "--method", "geomesh", "--out", str(out), "--tokens", "24000",
         "--quiet", "--wan", "none", "--timeout", "90"])  # fmt: skip
    result = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1"})
    assert result.code == 0, result.message
    events = read_events(out / "events.jsonl")
    rounds = [e for e in events if e["type"] == "round"]
    assert all(len(e["overhead_s"]) == 3 for e in rounds)
    later = [e["overhead_s"] for e in rounds[1:]]
    assert sum(o[0] > max(o[1], o[2]) for o in later) > len(later) / 2  # region 0 evaluates: its overhead
    replans = [e for e in events if e["type"] == "plan" and e.get("replan")]
    assert any("round overhead measured against planned: r0-a100" in e["reason"] for e in replans), replans
    final = replans[-1]["plan"]["workers"]
    work = {w["name"]: w["batch"] * w["inner_steps"] for w in final}
    overhead = {w["name"]: w.get("overhead_s", 0.0) for w in final}
    assert overhead["r0-a100"] > max(overhead["r1-a100"], overhead["r2-a100"])
    assert work["r0-a100"] < min(work["r1-a100"], work["r2-a100"]), work
    assert len(set(result.summary["param_checksums"])) == 1
