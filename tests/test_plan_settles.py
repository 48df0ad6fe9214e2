"""A plan that settles (geomesh.planner.settle and the online planner's noise-aware rules): regions that measure
alike get the same plan whatever GPU they declared, noise below the deadband re-plans nothing, the first
(warm-up) round is not a region's speed, the table is corrected where the plan runs, and a real slowdown is
re-planned within a few rounds, once. Pure: simulated measurements, no clock."""

from __future__ import annotations

import json
import math
import random
import warnings

import pytest
from test_planner import cluster

from geomesh.hardware import WorkerProfile
from geomesh.planner import OnlinePlanner, PlanConstraints, plan_balanced
from geomesh.planner.settle import (ALIKE_CEILING, ALIKE_FLOOR, AdjustedProfile, alike_groups, correction_at,
                                    corrected, monotone_points, pooled, settled_profiles, table_noise)

# the tiny scenario's two ways to plan (tests/conftest.py): the planning rule (the round: DiLoCo's 5 steps of 4
# sequences on the slowest region) and the sequence target N·b·H that its distributed tests run
RULE = PlanConstraints(fill=True, ref_batch=4, ref_inner_steps=5, max_inner_steps=400)
TARGET = PlanConstraints(target_sequences=60, max_inner_steps=400)
REGIONS = (("r0-h100", "H100"), ("r1-a100", "A100"), ("r2-t4", "T4"))


def cpu_line(m: int) -> float:
    """A CPU region's forward + backward time at micro-batch m, as calibrations of the tiny model measure it."""
    return 0.0076 + 0.00193 * m


def measured(name: str, gpu: str, scale: dict[int, float] | None = None, noise: float = 0.05) -> WorkerProfile:
    """A profile calibrated in place (the line at 1, 4 and 47), each point off by ``scale`` (its noise)."""
    table = {m: cpu_line(m) * (scale or {}).get(m, 1.0) for m in (1, 4, 47)}
    return WorkerProfile(name=name, gpu=gpu, gpu_count=1, max_micro_batch=64, table=table, step_overhead_s=0.0034,
                         source="measured", extra={"table_noise": noise})  # fmt: skip


def alike_regions() -> list[WorkerProfile]:
    """Three regions declared as H100, A100 and T4 whose calibrations measured them alike: their tables differ by
    2-3% at the ends of the line, far inside the calibrations' 5% noise."""
    scales = ({}, {1: 1.02, 47: 0.98}, {1: 0.97, 47: 1.03})
    return [measured(n, g, s) for (n, g), s in zip(REGIONS, scales)]


def shape(plan) -> list[tuple[int, int, int]]:
    return [(w.micro_batch, w.accum, w.inner_steps) for w in plan.workers]


def true_step(m: int, speed: float = 1.0) -> float:
    return speed * (cpu_line(m) + 0.0034)


def rounds(op: OnlinePlanner, plan, n: int, sigma: float, seed: int, speed=lambda r, name: 1.0, warmup: float = 1.0,
           start: int = 0):  # fmt: skip
    """``n`` rounds of measured compute (every region alike in fact unless ``speed`` says otherwise: the line,
    lognormal noise of dispersion ``sigma``; round ``start`` == 0 takes ``warmup`` times longer); returns the
    final plan, the rounds re-planned after and every plan in force."""
    rng = random.Random(seed)
    replanned, plans = [], [plan]
    for r in range(start, start + n):
        for w in plan.workers:
            t = w.inner_steps * true_step(w.batch, speed(r, w.name)) * rng.lognormvariate(0, sigma)
            op.observe(w.name, t * (warmup if r == 0 else 1.0), plan)
        new = op.maybe_replan()
        if new is not None:
            plan = new
            replanned.append(r)
            plans.append(plan)
    return plan, replanned, plans


# ---- alike regions, one plan ----------------------------------------------------------------------------


@pytest.mark.parametrize("constraints", [RULE, TARGET], ids=["rule", "target"])
def test_regions_that_measure_alike_get_one_plan_whatever_gpu_they_declared(constraints):
    """The cause: a few percent between measured tables, far inside their noise, picks another lattice point of
    (batch, steps) for one region (the options that fill the round within 1% are many). Planned as one (the
    geometric mean of their tables), they get the same micro-batch, batch and steps; the records keep each
    region's own name and declared GPU."""
    profiles = alike_regions()
    raw = plan_balanced(profiles, constraints)
    assert len(set(shape(raw))) > 1, shape(raw)  # (what the planner did with these tables before)
    settled = plan_balanced(settled_profiles(profiles, constraints, 2.5), constraints)
    assert len(set(shape(settled))) == 1, shape(settled)
    assert [(w.name, w.gpu) for w in settled.workers] == list(REGIONS)
    online = OnlinePlanner(profiles, constraints, noise_k=2.5).plan()
    assert shape(online) == shape(settled)
    # the same tables under other names and declared GPUs, in another order: the same plan
    renamed = [measured(f"x{i}", gpu, None) for i, gpu in enumerate(("T4", "V100", "H200"))]
    for p, q in zip(renamed, reversed(profiles)):
        p.table = dict(q.table)
    again = plan_balanced(settled_profiles(renamed, constraints, 2.5), constraints)
    assert set(shape(again)) == set(shape(settled))


def test_datasheet_profiles_are_planned_as_before():
    """No noise, no pooling: the cost model's profiles (exact by construction) plan exactly as they did, through
    settled_profiles and through the noise-aware online planner's first plan."""
    c = PlanConstraints(fill=True, ref_batch=16, ref_inner_steps=30)
    for gpus in (("H100", "A100", "V100", "T4"), ("A100", "A100", "T4")):
        profiles = cluster(*gpus)
        assert all(table_noise(p) == 0.0 for p in profiles)
        want = plan_balanced(profiles, c)
        assert settled_profiles(profiles, c, 2.5) == profiles
        assert plan_balanced(settled_profiles(profiles, c, 2.5), c).to_json() == want.to_json()
        assert OnlinePlanner(profiles, c, noise_k=2.5).plan().to_json() == want.to_json()


def test_regions_measured_apart_are_not_pooled():
    """A region 30% slower than the others by its calibration (beyond the noise) is planned on its own; the two
    alike ones together."""
    profiles = alike_regions()
    profiles[2] = measured("r2-t4", "T4", {1: 1.3, 4: 1.3, 47: 1.3})
    plan = plan_balanced(settled_profiles(profiles, RULE, 2.5), RULE)
    a, b, c = shape(plan)
    assert a == b and c != a and plan.workers[2].sequences < plan.workers[0].sequences


@pytest.mark.parametrize("noise", [0.05, 0.15, 0.3, 0.47])
def test_regions_whose_speeds_differ_are_never_pooled_however_noisy_their_calibrations(noise):
    """The hosts bed's regions at 0.5, 0.25 and 0.15 of a core (speeds 1 : 0.5 : 0.3), their calibrations as noisy
    as a busy host made them (up to 47%): planned apart, whatever the noise (k·√(u_i² + u_j²) would be 0.25-1.7,
    1.5-5x in speed; no two regions more than ALIKE_CEILING apart are one). Regions 1.1x apart are apart too, and
    regions a few percent apart with a few percent of noise are pooled."""
    for speeds in ((1.0, 2.0, 3.3), (1.0, 1.5, 2.25), (1.0, 1.12, 1.25)):
        profiles = [measured(n, g, dict.fromkeys((1, 4, 47), s), noise) for (n, g), s in zip(REGIONS, speeds)]
        for constraints in (RULE, TARGET):
            settled = settled_profiles(profiles, constraints, 2.5)
            assert [p.step_s(4, 1) for p in settled] == [p.step_s(4, 1) for p in profiles]  # none pooled
            online = OnlinePlanner(profiles, constraints, noise_k=2.5)
            assert shape(online.plan()) == shape(plan_balanced(profiles, constraints))
            assert all(len(g) == 1 for g in online.groups), online.groups
    close = [measured(n, g, dict.fromkeys((1, 4, 47), s), 0.02) for (n, g), s in zip(REGIONS, (1.0, 1.04, 0.97))]
    assert len(set(shape(plan_balanced(settled_profiles(close, RULE, 2.5), RULE)))) == 1
    assert ALIKE_FLOOR < ALIKE_CEILING < math.log(1.15)


def test_the_online_planner_never_pools_regions_apart_in_speed_however_noisy_their_rounds():
    """Calibrated alike (one plan for the three), the regions in fact 1 : 0.5 : 0.3 in speed, their rounds with
    25% noise (a busy host): from the first re-plan on, in no plan of 30 rounds are two of them planned as one."""
    speed = {"r0-h100": 1.0, "r1-a100": 2.0, "r2-t4": 3.3}
    for seed in range(1, 4):
        op = OnlinePlanner(alike_regions(), RULE, noise_k=2.5, warmup_rounds=1)
        plan, groups = op.plan(), []
        assert op.groups == [[n for n, _ in REGIONS]]
        rng = random.Random(seed)
        for r in range(30):
            for w in plan.workers:
                op.observe(w.name, w.inner_steps * true_step(w.batch, speed[w.name]) * rng.lognormvariate(0, 0.25)
                           * (3.0 if r == 0 else 1.0), plan)  # fmt: skip
            if (new := op.maybe_replan()) is not None:
                plan = new
                groups.append(op.groups)
        assert groups and all(len(g) == 1 for gs in groups for g in gs), (seed, groups)


def test_alike_groups_are_deterministic_and_anchored_at_the_fastest():
    profiles = [measured(f"w{i}", "cpu", {1: s, 4: s, 47: s}) for i, s in enumerate((1.0, 1.04, 1.08, 1.5, 0.99))]
    groups = alike_groups(profiles, [4, 47], lambda a, b, batch: 0.05)
    assert groups == [[4, 0, 1], [2], [3]]  # fastest first; w2 is within 5% of w1 but not of w4, the anchor
    assert alike_groups(profiles, [4, 47], lambda a, b, batch: 0.0) == [[4], [0], [1], [2], [3]]
    one = pooled(profiles, groups)
    assert [p.name for p in one] == [p.name for p in profiles]
    assert one[0].step_s(4, 1) == one[1].step_s(4, 1) == one[4].step_s(4, 1) and one[2] is profiles[2]
    assert isinstance(one[0], AdjustedProfile)
    want = math.exp(sum(math.log(profiles[i].step_s(4, 1)) for i in (0, 1, 4)) / 3)
    assert one[0].step_s(4, 1) == pytest.approx(want, rel=1e-12)
    assert ALIKE_FLOOR > 0


def test_correction_between_and_beyond_the_measured_batches():
    points = ((4, 1.0), (16, 1.2))
    assert correction_at((), 7) == 1.0
    assert correction_at(points, 4) == 1.0 and correction_at(points, 1) == 1.0 and correction_at(points, 40) == 1.2
    assert correction_at(points, 10) == pytest.approx(math.sqrt(1.2))  # halfway, in log


def test_a_corrected_table_never_steps_faster_at_a_larger_batch():
    """Points that say a larger batch steps faster than a smaller one (a region slowed just as its plan moved it
    to a batch it had not measured: read there as the table's error, its older, faster points kept) are
    raised: from the smaller batch up, the corrected step time never falls; where they agree they are kept."""
    profile = measured("r1-a100", "A100")
    fixed = corrected(profile, ((21, 2.37), (22, 1.0), (33, 1.0)))
    at_points = [fixed.step_s(m, 1) for m in (21, 22, 33)]
    assert at_points == sorted(at_points)
    times = [fixed.step_s(m, 1) for m in range(1, 65)]  # (between points, the interpolation bends a little)
    assert all(a <= b * 1.01 for a, b in zip(times, times[1:]))
    assert corrected(profile, ((21, 2.37), (22, 1.0))).step_s(22, 1) >= fixed.step_s(21, 1)
    assert fixed.step_s(21, 1) == pytest.approx(2.37 * profile.step_s(21, 1))  # the slow measurement holds
    kept = ((4, 1.0), (16, 1.2))  # already non-decreasing: as given
    assert monotone_points(profile, kept) == kept


def test_a_slowdown_read_at_a_new_batch_does_not_hand_the_fast_region_less_work(tmp_path, small_corpus):
    """The measured compute times of a real run (tests/test_plan_loop.py, on a busy machine): three regions
    alike, then r1 and r2 held to a third of r0's CPU just as the plan moved r1 to batch 21. Replayed through the
    planner, the re-plans from then on give r0 more sequences than either slowed region (before the correction
    was held monotone, r1's batch 22 looked 2.4 times faster than its 21 and r0 was planned 15 sequences, in
    micro-batches of 1, against their 22)."""
    import yaml
    from conftest import tiny_scenario_dict

    from geomesh.config import load_scenario
    from geomesh.methods import get_method
    from geomesh.runtime.distributed.calibration import online_planner

    data = tiny_scenario_dict(small_corpus, ("A100", "A100", "A100"))
    data["geomesh"].update({"calibrate": False, "replan": True})
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    sc, method = load_scenario(str(tmp_path / "s.yaml")), get_method("geomesh")
    op = online_planner(sc, method, sc.worker_profiles(), calibrated=False)  # as the distributed runtime makes it
    payload = method.modeled_payload_bytes(sc)
    plan = op.plan(payload, method.exchange(sc.wan_model(), payload)[0])
    seen = [[0.1097, 0.1339, 0.1310], [0.0755, 0.0473, 0.1074], [0.0554, 0.1155, 0.0469], [0.0796, 0.1177, 0.0533],
            [0.0681, 0.2222, 0.1707], [0.0684, 0.2571, 0.2020], [0.1178, 0.2293, 0.1016], [0.1148, 0.2662, 0.1022],
            [0.0957, 0.2318, 0.0795]]  # (seconds of compute per round, r0 r1 r2, under the plan in force)
    after = []
    for r, row in enumerate(seen, start=1):
        for w, c in zip(plan.workers, row):
            op.observe(w.name, c, plan)
        new = op.maybe_replan(payload, plan.exchange_s)
        if new is not None:
            plan = new
            after.append(r)
            if r >= 6:  # the slowdown measured
                fast = plan.worker("r0-a100").sequences
                assert fast > plan.worker("r1-a100").sequences and fast > plan.worker("r2-a100").sequences, r
    assert after and after[-1] >= 6
    for p in op.estimates():  # no batch looks faster than a smaller one (but for the interpolation's bend)
        times = [p.step_s(m, 1) for m in range(1, 48)]
        assert all(a <= b * 1.01 for a, b in zip(times, times[1:])), p.name


# ---- the loop settles -------------------------------------------------------------------------------------


@pytest.mark.parametrize("constraints", [RULE, TARGET], ids=["rule", "target"])
def test_noise_below_the_deadband_does_not_replan(constraints):
    """Regions alike in fact, 3% round-to-round noise, 40 rounds: the plan made from their calibrations is kept
    (one plan for the three), noise does not move it, and no re-plan ever gives them different plans."""
    for seed in range(1, 5):
        op = OnlinePlanner(alike_regions(), constraints, noise_k=2.5, warmup_rounds=1)
        first = op.plan()
        _, replanned, plans = rounds(op, first, 40, 0.03, seed, warmup=3.0)
        assert len(replanned) <= 1, (seed, replanned)
        assert all(len(set(shape(p))) == 1 for p in plans), [shape(p) for p in plans]


def test_a_warm_up_round_is_not_a_speed():
    """Round 0 takes three times as long (start-up): with warmup_rounds=1 it is not folded in (no factor, no
    noise, no re-plan); without, the first measurement sets the factor (an uncalibrated run) and re-plans."""
    profiles = alike_regions()
    for warmup, replans in ((1, False), (0, True)):
        op = OnlinePlanner(profiles, RULE, noise_k=2.5, warmup_rounds=warmup, first_measurement_sets_factor=True)
        plan = op.plan()
        slow = {"r1-a100": 3.0}
        for w in plan.workers:  # round 0: r1's start-up is slow
            op.observe(w.name, w.inner_steps * true_step(w.batch, slow.get(w.name, 1.0)), plan)
        assert (op.maybe_replan() is not None) == replans
        if warmup:
            assert op.warmed == {n: 1 for n, _ in REGIONS} and not any(op.history.values())
            assert op.factors == {n: 1.0 for n, _ in REGIONS} and not op.measured
    # the next rounds are the regions' speed
    op = OnlinePlanner(profiles, RULE, noise_k=2.5, warmup_rounds=1)
    _, replanned, _ = rounds(op, op.plan(), 6, 0.02, seed=3, warmup=3.0)
    assert not replanned and all(len(h) == 5 for h in op.history.values())
    with pytest.raises(ValueError, match="warmup_rounds"):
        OnlinePlanner(profiles, RULE, warmup_rounds=-1)


def test_a_real_slowdown_is_replanned_within_a_few_rounds_and_then_holds():
    """From round 10 one region runs at half speed (3% noise): re-planned within 3 rounds, giving it less work
    than the two others (who keep one plan between them); the plan then settles: at most two more re-plans in
    the next 17 rounds."""
    for seed in range(1, 5):
        op = OnlinePlanner(alike_regions(), RULE, noise_k=2.5, warmup_rounds=1)
        first = op.plan()
        plan, replanned, plans = rounds(op, first, 30, 0.03, seed, warmup=3.0,
                                        speed=lambda r, n: 2.0 if n == "r1-a100" and r >= 10 else 1.0)  # fmt: skip
        after = [r for r in replanned if r >= 10]
        assert after and after[0] <= 12, (seed, replanned)
        assert len(after) <= 3 and len(replanned) - len(after) <= 1, (seed, replanned)
        w = {x.name: x for x in plan.workers}
        assert w["r1-a100"].sequences < w["r0-h100"].sequences
        assert shape(plan)[0] == shape(plan)[2]  # r0 and r2 still alike
        assert op.factors["r1-a100"] == pytest.approx(2.0, rel=0.1)


def test_a_table_wrong_where_the_plan_runs_is_corrected_there():
    """The calibration's line is 20% too slow at batches above 8 for one region (the truth bends): measured
    twice in a row at such a batch, beyond the noise, that is the table's error there, not a change of speed:
    the table is corrected at that batch (its shape) and the batch measured before keeps its factor."""
    profiles = alike_regions()
    op = OnlinePlanner(profiles, RULE, noise_k=2.5)
    plan = op.plan()
    rng = random.Random(2)

    def truth(b: int) -> float:  # r0 runs the line below 8 sequences, 20% faster than it above
        return (0.8 if b > 8 else 1.0) * true_step(b) * rng.lognormvariate(0, 0.01)

    for _ in range(8):  # the plan's batch (4) measured: the noise and the level known there
        for w in plan.workers:
            op.observe(w.name, w.inner_steps * truth(w.batch) if w.name == "r0-h100"
                       else w.inner_steps * true_step(w.batch), plan)  # fmt: skip
        assert op.maybe_replan() is None
    level = op.factor_at("r0-h100", 4)
    moved = plan_balanced(profiles, PlanConstraints(fill=True, ref_batch=16, ref_inner_steps=2, max_inner_steps=400))
    w = moved.worker("r0-h100")
    assert w.batch > 8
    for _ in range(2):  # the same run at a batch the level never measured: twice 20% faster than predicted
        op.observe("r0-h100", w.inner_steps * truth(w.batch), moved)
    assert w.batch in op.shape["r0-h100"] and 4 in op.shape["r0-h100"]
    assert op.factor_at("r0-h100", w.batch) == pytest.approx(0.8 * level, rel=0.05)
    assert op.factor_at("r0-h100", 4) == pytest.approx(level, rel=0.02)  # the speed did not change
    by_name = {p.name: p for p in op.estimates()}
    predicted = by_name["r0-h100"].step_s(w.micro_batch, w.accum)
    assert predicted == pytest.approx(0.8 * level * true_step(w.batch), rel=0.05)


def test_a_replan_that_moves_no_work_is_none():
    """Every region 30% slower at once (the host, not one region): the rules see the drift, but the plan they
    give is the one in force (every region's share unchanged); it is kept, no re-plan, the assumptions updated."""
    op = OnlinePlanner(alike_regions(), RULE, noise_k=2.5)
    plan = op.plan()
    for _ in range(4):
        for w in plan.workers:
            op.observe(w.name, 1.3 * w.inner_steps * true_step(w.batch), plan)
        assert op.maybe_replan() is None
    assert op.current is plan and all(f == pytest.approx(1.3) for f in op.assumed.values()), op.assumed


def test_settled_state_round_trips_and_is_adopted():
    """What the settling rules keep (each observation's batch, the held-back ones', the tables' shapes, the warm-up
    rounds skipped, the groups planned as one) is in the state: a planner loaded from it (through JSON, as in a
    checkpoint or a healed region's state) decides as the other does from then on; adopt() carries it."""
    profiles = alike_regions()
    a = OnlinePlanner(profiles, RULE, noise_k=2.5, warmup_rounds=1)
    plan, _, _ = rounds(a, a.plan(), 6, 0.03, seed=5, warmup=3.0)
    a.shape["r2-t4"] = {4: 1.0, 18: 0.9}
    state = json.loads(json.dumps(a.state_dict()))
    assert state["warmed"] == {n: 1 for n, _ in REGIONS} and state["groups"] == [[n for n, _ in REGIONS]]
    assert all(len(state["level_at"][n]) == len(state["level"][n]) for n, _ in REGIONS)
    b = OnlinePlanner(profiles, RULE, noise_k=2.5, warmup_rounds=1)
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    for op in (a, b):
        rounds(op, plan, 8, 0.03, seed=6, start=6, speed=lambda r, n: 2.0 if n == "r1-a100" and r >= 8 else 1.0)
    assert b.state_dict() == a.state_dict() and a.factors["r1-a100"] > 1.5
    fresh = OnlinePlanner(profiles[:2], RULE, noise_k=2.5, warmup_rounds=1)
    fresh.adopt(a)
    assert fresh.warmed == {"r0-h100": 1, "r1-a100": 1} and fresh.level_at["r1-a100"] == a.level_at["r1-a100"]
    # a state written before these rules: every observation at the batch planned now, measured regions warm
    old = {k: v for k, v in state.items() if k not in ("level_at", "held_at", "shape", "warmed", "groups")}
    c = OnlinePlanner(profiles, RULE, noise_k=2.5, warmup_rounds=1)
    c.load_state_dict(old)
    assert c.warmed == {n: 1 for n, _ in REGIONS} and c.shape == {n: {} for n, _ in REGIONS}
    assert all(set(c.level_at[n]) <= {w.batch for w in c.current.workers} for n, _ in REGIONS)


def test_the_first_plan_of_calibrated_regions_is_quiet():
    """(no warning about balance from a pooled plan of alike regions)"""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OnlinePlanner(alike_regions(), RULE, noise_k=2.5).plan()
