"""GeoMeshSync re-plans from measured compute times: the same plan on every rank, the work moved from a
worker that turns out slower than its profile says to one that turns out faster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import yaml

from geomesh.api import GeoMeshSync
from geomesh.config import ConfigError
from geomesh.planner import OnlinePlanner
from geomesh.telemetry import Telemetry
from geomesh.telemetry_sinks import ListSink

VOCAB, SEQ_LEN = 16, 5
EXTRA_SLEEP_PER_STEP_S = 0.03  # the slow worker's hidden slowness: about 30x a step of the tiny model
SYNCS = 6


def alike_scenario(path: Path) -> Path:
    """Two regions declared alike (so the first plan splits the round evenly), a fixed round of N·b·H
    sequences that the plan shares out by speed."""
    path.write_text(yaml.safe_dump({
        "name": "alike",
        "regions": [{"name": "first", "gpu": "A100", "count": 1}, {"name": "second", "gpu": "A100", "count": 1}],
        "wan": {"rtt": [[0, 20], [20, 0]], "bandwidth_gbps": 1.0},
        "timing_model": {"n_layers": 12, "hidden": 768, "seq_len": 1024, "vocab": 32000},
        "training": {"batch": 4, "inner_steps": 4},
        "geomesh": {"min_batch": 1, "max_batch": 16, "min_inner_steps": 1, "max_inner_steps": 16, "chunk_size": 64,
                    "round_sequences_factor": 1.0},
    }))  # fmt: skip
    return path


def tiny(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))


def steps_of(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, steps: int, batch: int,
             extra_sleep_s: float) -> None:  # fmt: skip
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (batch, SEQ_LEN), generator=gen)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), x.roll(1, 1).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(extra_sleep_s)  # a slowness nothing declares: a busy neighbour, a throttled GPU


def _rank(rank: int, store: str, scenario: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model = tiny(rank)
        sink = ListSink()
        sync = GeoMeshSync(model, scenario=scenario, group=dist.group.WORLD, telemetry=Telemetry(None, sinks=[sink]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(rank)
        history = [[sync.plan_for_rank(r).__dict__ for r in range(2)]]
        for _ in range(SYNCS):
            p = sync.plan_for_rank()
            steps_of(model, opt, gen, p.inner_steps, p.batch_size, EXTRA_SLEEP_PER_STEP_S if rank == 1 else 0.0)
            sync.sync(tokens=p.tokens(SEQ_LEN))
            history.append([sync.plan_for_rank(r).__dict__ for r in range(2)])
        digest = [float(t.double().sum()) for t in sync.global_params.values()]
        plan_records = [r for r in sink.records if r["type"] == "plan"]
        Path(out, f"rank{rank}.json").write_text(json.dumps({
            "history": history, "replans": sync.replans, "counter": sync.telemetry.counters.get("replans", 0),
            "plan_records": plan_records, "digest": digest}))  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_two_ranks_of_different_speed_rebalance_to_one_plan(tmp_path):
    scenario = alike_scenario(tmp_path / "alike.yaml")
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(scenario), str(tmp_path)), nprocs=2, join=True)
    fast, slow = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert fast["history"] == slow["history"]  # every rank held the same plan after every sync
    assert fast["digest"] == slow["digest"]
    first, last = fast["history"][0], fast["history"][-1]
    sequences = lambda p: p["batch_size"] * p["inner_steps"]  # noqa: E731
    assert sequences(first[0]) == sequences(first[1])  # declared alike: an even split to begin with
    assert sequences(last[1]) < sequences(first[1])  # the slow worker's share dropped ...
    assert sequences(last[0]) > sequences(first[0])  # ... and the fast one's rose
    assert last[1]["inner_steps"] < last[0]["inner_steps"] or last[1]["batch_size"] < last[0]["batch_size"]
    assert fast["replans"] == slow["replans"] == fast["counter"] >= 1
    records = fast["plan_records"]
    assert records[0]["round"] == 0 and "measured_s" not in records[0]  # the first plan, from the profiles
    assert len(records) == 1 + fast["replans"]
    replan = records[1]
    assert set(replan["measured_s"]) == {"first", "second"} and replan["round"] >= 2  # round 1 is warm-up
    assert replan["measured_s"]["second"] > replan["measured_s"]["first"]
    theirs = slow["plan_records"]  # the same plans from the same measurements (only the wall times differ)
    assert [(r["round"], r["plan"], r.get("measured_s")) for r in records] == [
        (r["round"], r["plan"], r.get("measured_s")) for r in theirs]  # fmt: skip


def _trained(sync: GeoMeshSync) -> None:
    for j, m in enumerate(sync.replicas):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        steps_of(m, opt, torch.Generator().manual_seed(j), 1, 2, 0.0)


def test_given_compute_times_replan_in_process_and_resume_the_same(tmp_path):
    """Replicas in one process measure nothing by themselves; given compute times they re-plan, and a
    resumed GeoMeshSync re-plans as the uninterrupted one."""
    scenario = alike_scenario(tmp_path / "alike.yaml")
    sink = ListSink()

    def make(telemetry=None):
        return GeoMeshSync([tiny(0), tiny(0)], scenario=scenario, telemetry=telemetry)

    sync = make(Telemetry(None, sinks=[sink]))
    assert isinstance(sync.online, OnlinePlanner)
    even = sync.plan_for_rank(replica=0)
    assert even.sequences == sync.plan_for_rank(replica=1).sequences
    _trained(sync)
    assert sync.sync([10, 10]).replanned is False  # no compute times: nothing measured, the plan stays
    assert sync.plan_for_rank(replica=0) == even

    def predicted(name):  # what the current plan expects of the worker on its declared GPU
        return sync.plan.worker(name).compute_s

    _trained(sync)
    result = sync.sync([10, 10], compute_s=[predicted("first"), 3 * predicted("second")])
    assert result.replanned and sync.replans == 1 == sink_count(sync)
    after = [sync.plan_for_rank(replica=j) for j in range(2)]
    assert after[0].sequences > even.sequences > after[1].sequences
    state = json.loads(json.dumps(sync.state_dict()["online"]))  # the planner's state is plain JSON
    resumed = make()
    resumed.load_state_dict(sync.state_dict())
    assert resumed.online.state_dict() == state and resumed.plan.to_json() == sync.plan.to_json()
    for s in (sync, resumed):
        _trained(s)
        s.sync([10, 10], compute_s=[1.1 * s.plan.worker("first").compute_s, 3.5 * s.plan.worker("second").compute_s])
    assert resumed.plan.to_json() == sync.plan.to_json() and resumed.replans == sync.replans
    plan_records = [r for r in sink.records if r["type"] == "plan"]
    first_planned = plan_records[0]["plan"]["workers"][1]["compute_s"]
    assert plan_records[1]["measured_s"]["second"] == pytest.approx(3 * first_planned)
    assert plan_records[1]["planned_s"]["second"] == first_planned


def sink_count(sync: GeoMeshSync) -> int:
    return int(sync.telemetry.counters.get("replans", 0))


def test_replanning_needs_a_scenario_plan_and_bad_compute_times_are_refused(tmp_path):
    scenario = alike_scenario(tmp_path / "alike.yaml")
    with pytest.raises(ConfigError, match="replan=True needs a plan made from scenario="):
        GeoMeshSync([tiny(0), tiny(0)], batch_size=2, inner_steps=2, replan=True)
    with pytest.raises(ConfigError, match="replan=True needs"):
        GeoMeshSync([tiny(0), tiny(0)], scenario=scenario, method="diloco", replan=True)
    assert GeoMeshSync([tiny(0), tiny(0)], scenario=scenario, replan=False).online is None
    assert GeoMeshSync([tiny(0), tiny(0)], scenario=scenario, method="diloco").online is None
    sync = GeoMeshSync([tiny(0), tiny(0)], scenario=scenario)
    with pytest.raises(ValueError, match="1 compute times for 2 replicas"):
        sync.sync([5, 5], compute_s=1.0)
    with pytest.raises(ValueError, match="positive, finite seconds"):
        sync.sync([5, 5], compute_s=[1.0, float("nan")])
    with pytest.raises(ConfigError, match="profiles="):
        GeoMeshSync([tiny(0), tiny(0)], batch_size=2, inner_steps=2, profiles={"first": "x.json"})
