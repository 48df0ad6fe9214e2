"""The planning rule (fill the slowest worker's reference round) and regions planned as sharded units."""

from __future__ import annotations

import json
import random

import pytest
import yaml

from geomesh.cli import main
from geomesh.config import ConfigError, load_scenario
from geomesh.hardware import GIB, GPU_CATALOG, TimingModel, gpu_spec, model_profile
from geomesh.methods import get_method
from geomesh.planner import (
    FILL_SLACK,
    PlanConstraints,
    PlanError,
    candidate_batches,
    plan_balanced,
    plan_uniform,
    reference_round_s,
    replan,
    split_batch,
)

TM = TimingModel(n_layers=24, hidden=1024, seq_len=1024)


def cluster(*gpus, timing=TM):
    return [model_profile(f"{g}-{i}", g, 1, timing) for i, g in enumerate(gpus)]


def brute_force_fill(profile, c: PlanConstraints, deadline: float):
    """Every (batch, H) of the worker's candidate batches that fits the deadline; the rule's choice: compute
    within FILL_SLACK of the longest, then most sequences, then smaller batch."""
    options = []
    for b in candidate_batches(profile, c, round_s=deadline):
        t = profile.step_s(*split_batch(b, profile.max_micro_batch))
        for h in range(c.min_inner_steps, c.max_inner_steps + 1):
            if h * t <= deadline * (1 + 1e-12):
                options.append((h * t, b * h, b, h))
    longest = max(o[0] for o in options)
    return max((o for o in options if o[0] >= longest * (1 - FILL_SLACK)), key=lambda o: (o[1], -o[2]))


@pytest.mark.parametrize("gpus, ref", [
    (("H100", "A100", "V100", "T4"), (4, 50)),
    (("H100", "L4"), (8, 10)),
    (("A100", "A10G", "RTX3090"), (2, 30)),
    (("A100", "A100"), (4, 20)),
])  # fmt: skip
def test_rule_matches_brute_force_and_synchronises_as_often_as_diloco(gpus, ref):
    profiles = cluster(*gpus)
    c = PlanConstraints(fill=True, ref_batch=ref[0], ref_inner_steps=ref[1], min_batch=1, max_batch=64,
                        min_inner_steps=1, max_inner_steps=400)  # fmt: skip
    plan = plan_balanced(profiles, c)
    deadline, slowest = reference_round_s(profiles, *ref)
    diloco = plan_uniform(profiles, *ref)
    assert deadline == pytest.approx(diloco.compute_s)  # the round is DiLoCo's, by construction
    assert slowest in plan.rule and "fill" in plan.rule
    assert plan.compute_s <= deadline * (1 + 1e-9)
    for w, p in zip(plan.workers, profiles):
        want = brute_force_fill(p, c, deadline)
        assert (w.compute_s, w.sequences, w.batch, w.inner_steps) == pytest.approx(want)
    assert plan.straggler_idle_frac <= 0.02
    assert plan.sequences_per_round >= diloco.sequences_per_round


def test_rule_on_random_clusters_fills_the_round():
    rng = random.Random(5)
    gpus = [g for g in GPU_CATALOG if TM.max_micro_batch(GPU_CATALOG[g]) > 0]
    for _ in range(20):
        profiles = [model_profile(f"w{i}", rng.choice(gpus), rng.randint(1, 4), TM) for i in range(rng.randint(2, 6))]
        c = PlanConstraints(fill=True, ref_batch=rng.randint(2, 16), ref_inner_steps=rng.randint(10, 60),
                            min_batch=2, max_batch=512, min_inner_steps=2, max_inner_steps=400)  # fmt: skip
        plan = plan_balanced(profiles, c)
        deadline, _ = reference_round_s(profiles, c.ref_batch, c.ref_inner_steps)
        assert plan.compute_s <= deadline * (1 + 1e-9)
        for w, p in zip(plan.workers, profiles):
            assert w.compute_s == pytest.approx(brute_force_fill(p, c, deadline)[0])
        assert plan.compute_s >= deadline * (1 - FILL_SLACK) - 1e-12


def test_explicit_round_time_and_invalid_combinations():
    profiles = cluster("H100", "T4")
    plan = plan_balanced(profiles, PlanConstraints(round_compute_s=60.0, min_batch=1, max_batch=64,
                                                   max_inner_steps=1000))  # fmt: skip
    assert 60 * (1 - FILL_SLACK) <= plan.compute_s <= 60.0 and "explicit" in plan.rule
    with pytest.raises(PlanError, match="round_compute_s"):
        plan_balanced(profiles, PlanConstraints(round_compute_s=-1.0))
    with pytest.raises(PlanError, match="not both"):
        plan_balanced(profiles, PlanConstraints(round_compute_s=5.0, target_sequences=100))
    with pytest.raises(PlanError, match="reference plan"):
        plan_balanced(profiles, PlanConstraints(fill=True, ref_batch=4))


def test_replan_after_a_slowdown_uses_the_same_rule():
    profiles = cluster("H100", "A100", "T4")
    c = PlanConstraints(fill=True, ref_batch=4, ref_inner_steps=50, min_batch=2, max_inner_steps=400)
    plan = plan_balanced(profiles, c)
    t4 = plan.workers[2]
    # the T4 runs 2x slower than its profile: the reference round on the slowest worker doubles
    again = replan(profiles, plan, {"T4-2": 2 * t4.compute_s}, c)
    assert again.compute_s == pytest.approx(2 * plan.compute_s, rel=0.02)
    assert again.workers[0].sequences > plan.workers[0].sequences  # the H100 fills the longer round


def test_scenario_rule_is_the_default_and_round_time_overrides(tmp_path):
    s = load_scenario("default")
    assert s.geomesh.round_time_s is None and s.geomesh.round_sequences_factor is None
    c = get_method("geomesh").constraints(s, 4)
    assert c.fill and (c.ref_batch, c.ref_inner_steps) == (s.training.batch, s.training.inner_steps)
    s2 = load_scenario("default", {"geomesh.round_time_s": 12.5})
    assert get_method("geomesh").constraints(s2, 4).round_compute_s == 12.5
    with pytest.raises(ConfigError, match="not both"):
        load_scenario("default", {"geomesh.round_time_s": 12.5, "geomesh.round_sequences_factor": 2.0})


@pytest.mark.parametrize("preset", ["default", "fast-wan", "multi-gpu-slow-wan", "homogeneous"])
def test_presets_plan_by_the_rule_without_a_factor(preset, capsys):
    assert main(["plan", preset, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    base = out["baseline"]
    assert out["rule"].startswith("fill") and out["target_sequences"] is None
    assert out["compute_s"] == pytest.approx(base["compute_s"], rel=FILL_SLACK)  # equally long rounds
    assert out["straggler_idle_frac"] <= 0.02
    geo_share, diloco_share = out["exchange_s"] / out["round_s"], base["exchange_s"] / base["round_s"]
    if preset != "homogeneous":
        assert geo_share <= diloco_share / 3


# ---- regions as sharded units -----------------------------------------------------------------------
BIG = TimingModel(n_layers=24, hidden=2048, seq_len=2048, vocab=32000)  # 1.27B parameters


def test_memory_model_with_sharding_matches_a_hand_computation():
    P = 12 * 24 * 2048**2 + 32000 * 2048
    assert BIG.params == P
    a10g = gpu_spec("A10G")
    # DDP: every GPU holds weights, gradients and AdamW state of the whole model (16 bytes per parameter),
    # and the outer loop's fp32 global parameters and momentum (8 more)
    assert BIG.state_bytes(4, "ddp") == 24 * P
    # FSDP over 4 GPUs: a quarter of that, plus two gathered bf16 units (the embedding is the largest here)
    assert BIG.state_bytes(4, "fsdp") == 24 * P / 4 + 2 * 2 * (32000 * 2048)
    act = 24 * 34 * 2048 * 2048 + 4 * 2048 * 32000  # per sequence: activations + fp32 logits
    free = 0.9 * 24e9 - 1.5 * GIB - (24 * P / 4 + 4 * 32000 * 2048)
    assert BIG.max_micro_batch(a10g, 4, "fsdp") == int(free // act)
    assert BIG.max_micro_batch(a10g, 4, "ddp") == 0  # 30 GB of state leaves nothing on a 24 GB card
    ckpt_act = 24 * 2 * 2048 * 2048 + 34 * 2048 * 2048 + 4 * 2048 * 32000
    assert BIG.max_micro_batch(a10g, 4, "fsdp", True) == int(free // ckpt_act)
    # the recompute costs one more forward: 8P + 16·L·h·s FLOPs per token
    assert BIG.train_flops_per_token(True) == pytest.approx(8 * P + 16 * 24 * 2048 * 2048)
    # FSDP's step pays all-gather (forward, backward) + reduce-scatter of bf16 weights at the link's bandwidth
    assert BIG.region_collective_s(a10g, 4, "fsdp") == pytest.approx(3 * 3 / 4 * 2 * P / (a10g.link_gbs * 1e9))
    assert BIG.region_collective_s(a10g, 4, "ddp") == pytest.approx(2 * 3 / 4 * 2 * P / (a10g.link_gbs * 1e9))
    fsdp = model_profile("r", "A10G", 4, BIG, strategy="fsdp")
    assert fsdp.max_micro_batch == 4 * BIG.max_micro_batch(a10g, 4, "fsdp")


def big_regions(tmp_path, strategy="fsdp", **extra):
    data = {
        "name": "big",
        "regions": [{"name": "a10g-east", "gpu": "A10G", "count": 4, "strategy": strategy},
                    {"name": "t4-india", "gpu": "T4", "count": 8, "strategy": strategy, **extra}],
        "wan": {"rtt": [[0, 200], [200, 0]], "bandwidth_gbps": 0.1},
        "timing_model": {"n_layers": 24, "hidden": 2048, "seq_len": 2048, "vocab": 32000},
        "training": {"batch": 8, "inner_steps": 20},
    }  # fmt: skip
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_13b_over_a10g_and_t4_regions_with_fsdp(tmp_path, capsys):
    assert main(["plan", str(big_regions(tmp_path)), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [w["gpu"] for w in out["workers"]] == ["A10G", "T4"] and out["straggler_idle_frac"] <= 0.02


def test_a_region_that_cannot_fit_says_what_would(tmp_path, capsys):
    assert main(["plan", str(big_regions(tmp_path, strategy="ddp"))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "region a10g-east" in err[0] and "strategy: fsdp over at least" in err[0]


def test_scenario_defines_its_own_gpu(tmp_path, capsys):
    data = {
        "name": "b300",
        "gpus": {"B300": {"tflops": 2500, "memory_gb": 288, "mem_bw_gbs": 8000, "mfu": 0.4, "link_gbs": 900}},
        "regions": [{"name": "new", "gpu": "B300", "count": 1}, {"name": "old", "gpu": "V100", "count": 1}],
        "wan": {"rtt": [[0, 100], [100, 0]], "bandwidth_gbps": 1.0},
    }  # fmt: skip
    path = tmp_path / "b300.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workers"][0]["gpu"] == "B300" and out["workers"][0]["inner_steps"] > out["workers"][1]["inner_steps"]
    data["gpus"]["B300"]["mfu"] = 2.0
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(path)]) == 2
    assert "gpus.B300.mfu" in capsys.readouterr().err


def test_catalog_has_current_data_centre_gpus():
    for name in ("B200", "H800", "A800", "H20", "MI300X", "L40S"):
        spec = gpu_spec(name)
        assert spec.tflops > 0 and spec.memory_gb > 0 and spec.link_gbs > 0 and spec.link
    assert gpu_spec("H20").tflops < gpu_spec("H800").tflops  # the export parts trade compute or links
    assert gpu_spec("H800").link_gbs < gpu_spec("H100").link_gbs


def test_profile_measures_the_model_the_run_trains(tmp_path, capsys):
    pytest.importorskip("transformers")
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "hf_llama.yaml"
    out = tmp_path / "llama.json"
    assert main(["profile", "--scenario", str(example), "--device", "cpu", "--out", str(out), "--batches", "1,2",
                 "--repeats", "2", "--set", "data.paths=null"]) == 0  # fmt: skip
    profile = json.loads(out.read_text())
    extra = profile["extra"]
    assert extra["model"] == "llama (transformers)" and extra["seq_len"] == 64
    assert 10_000 < extra["params"] < 2_000_000 and extra["repeats"] == 2 and extra["warmup"] >= 1
    assert profile["step_overhead_s"] > 0 and set(profile["table"]) == {"1", "2"}
    capsys.readouterr()
    assert main(["plan", str(example), "--json", "--profile", f"us-east={out}"]) == 0
    assert json.loads(capsys.readouterr().out)["workers"][0]["name"] == "us-east"


def test_emulated_run_by_the_rule_synchronises_as_often_as_diloco(tiny_scenario):
    from geomesh.runtime.emulated import EmulatedRun, RunOptions

    s = tiny_scenario(tokens=24000, zero_shot_items=0)
    s.geomesh.round_sequences_factor = None  # the fixture's sequence target off: the planning rule
    runs = {m: EmulatedRun(s, get_method(m), RunOptions(progress=False)).run() for m in ("geomesh", "diloco")}
    geo, diloco = runs["geomesh"], runs["diloco"]
    assert geo["plan"]["rule"].startswith("fill") and geo["plan"]["target_sequences"] is None
    assert geo["plan"]["compute_s"] == pytest.approx(diloco["plan"]["compute_s"], rel=FILL_SLACK)
    assert geo["plan"]["sequences_per_round"] > 2 * diloco["plan"]["sequences_per_round"]
    assert geo["straggler_idle_frac"] < diloco["straggler_idle_frac"] / 5


def test_budget_is_spent_in_whole_rounds():
    from geomesh.methods.base import budget_steps

    # a full round of (4·10 + 2·10)·8 = 480 tokens
    assert budget_steps([10, 10], [4, 2], 8, 10_000) == [10, 10]  # plenty left: the plan's round
    assert budget_steps([10, 10], [4, 2], 8, 240) == [5, 5]  # the last round is shortened to what is left
    assert budget_steps([10, 10], [4, 2], 8, 250) == [6, 6]  # rounded up: no sliver left for another round
    assert budget_steps([10, 10], [4, 2], 8, 480 + 200) == [15, 15]  # a remainder under half a round joins this one
    assert budget_steps([10, 10], [4, 2], 8, 480 + 250) == [10, 10]  # half a round or more is a round of its own
