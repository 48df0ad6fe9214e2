"""The library API: GeoMesh inside a user's own training loop (geomesh.api.GeoMeshSync) and its example."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from geomesh.api import GeoMeshSync, RankPlan, load_plan, plan_from_scenario
from geomesh.codec import Manifest, SignCodec
from geomesh.config import ConfigError
from geomesh.outer import OuterNesterov
from geomesh.telemetry import Telemetry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_loop.py"
SCENARIO = ROOT / "examples" / "two_regions.yaml"


def tiny(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))


def local_steps(model: nn.Module, seed: int, steps: int = 3) -> None:
    """A user's inner loop: a few AdamW steps on random data."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x = torch.randint(0, 16, (4, 5), generator=gen)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 16), x.roll(1, 1).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_one_worker_diloco_with_outer_lr_one_keeps_the_local_model():
    model = tiny(0)
    sync = GeoMeshSync(model, method="diloco", outer_lr=1.0, outer_momentum=0.0, batch_size=4, inner_steps=3)
    assert sync.plan_for_rank() == RankPlan("worker0", 4, 3, 4, 1, "")
    assert (sync.batch_size, sync.inner_steps, sync.world_size, sync.rank) == (4, 3, 1, 0)
    local_steps(model, 1)
    trained = params(model)
    result = sync.sync(tokens=60)
    assert result.round == 1 and result.tokens == 60 and result.contributions == 1 and result.dropped == 0
    for n, p in model.named_parameters():
        assert torch.allclose(p, trained[n], atol=1e-6)
        assert torch.equal(p, sync.global_params[n])


def test_replicas_in_process_match_the_codec_and_outer_step_by_hand():
    models = [tiny(0), tiny(1)]
    sync = GeoMeshSync(models, chunk_size=32, error_feedback=False, outer_lr=0.7, outer_momentum=0.9)
    start = params(models[0])
    assert all(torch.equal(p, start[n]) for n, p in models[1].named_parameters())  # replica 0's θ everywhere
    theta = {n: t.clone() for n, t in start.items()}
    codec = SignCodec(Manifest.from_tensors(theta), chunk_size=32)
    outer = OuterNesterov(theta, lr=0.7, momentum=0.9)
    for r in range(3):
        for j, m in enumerate(models):
            local_steps(m, 10 * r + j)
        payloads = [codec.encode({n: theta[n] - p.detach() for n, p in m.named_parameters()}, t)
                    for m, t in zip(models, (100, 300))]  # fmt: skip
        outer.step(codec.combine(payloads))
        result = sync.sync([100, 300])
        assert result.tokens == 400 and result.payload_bytes == codec.payload_nbytes() == len(payloads[0])
        for m in models:
            for n, p in m.named_parameters():
                assert torch.equal(p, theta[n])
    assert sync.rounds == 3 and sync.tokens_total == 1200


def test_plan_from_a_scenario_and_from_a_plan_file(tmp_path):
    models = [tiny(0), tiny(0)]
    sync = GeoMeshSync(models, scenario=SCENARIO)
    fast, slow = sync.plan_for_rank(replica=0), sync.plan_for_rank(replica=1)
    assert (fast.name, slow.name) == ("fast", "slow") and (fast.gpu, slow.gpu) == ("H100", "T4")
    assert fast.sequences > slow.sequences  # the faster GPU does more of the round
    assert fast.batch_size == fast.micro_batch * fast.accum and fast.tokens(32) == fast.sequences * 32
    direct = plan_from_scenario(SCENARIO, manifest=sync.manifest)
    assert direct.to_json() == sync.plan.to_json()
    (tmp_path / "plan.json").write_text(json.dumps(direct.to_json()))
    from_file = GeoMeshSync([tiny(0), tiny(0)], plan=tmp_path / "plan.json")
    assert from_file.plan_for_rank(replica=1) == slow
    assert load_plan(direct.to_json()).to_json() == direct.to_json()
    with pytest.raises(ConfigError, match="2 workers"):
        GeoMeshSync(tiny(0), scenario=SCENARIO)
    with pytest.raises(ConfigError, match="no plan"):
        GeoMeshSync(tiny(0)).plan_for_rank()
    with pytest.raises(ConfigError, match="not round-based"):
        GeoMeshSync(tiny(0), method="ddp")
    with pytest.raises(ConfigError, match="plan"):
        load_plan(tmp_path / "missing.json")


def test_token_counts_are_checked_and_default_from_the_plan():
    sync = GeoMeshSync([tiny(0), tiny(0)], batch_size=2, inner_steps=3, tokens_per_step=10)
    for m in sync.replicas:
        local_steps(m, 0, 1)
    assert sync.sync().tokens == 2 * 3 * 10
    with pytest.raises(ValueError, match="2 replicas"):
        sync.sync(5)
    with pytest.raises(ValueError, match="positive integer"):
        sync.sync([0, 5])
    with pytest.raises(ValueError, match="token count"):
        GeoMeshSync(tiny(0)).sync()


def test_a_non_finite_replica_is_dropped_and_reset():
    models = [tiny(0), tiny(0), tiny(0)]
    sync = GeoMeshSync(models, outer_momentum=0.0)
    for j, m in enumerate(models):
        local_steps(m, j)
    with torch.no_grad():
        next(models[2].parameters()).fill_(float("nan"))
    with pytest.warns(UserWarning, match="replica 2"):
        result = sync.sync([10, 10, 10])
    assert (result.contributions, result.dropped, result.tokens) == (2, 1, 20)
    for m in models:
        assert all(torch.isfinite(p).all() for p in m.parameters())
        assert all(torch.equal(p, sync.global_params[n]) for n, p in m.named_parameters())


def test_checkpoint_resumes_exactly():
    def fresh():
        return GeoMeshSync([tiny(0), tiny(1)], chunk_size=16, error_feedback=True)

    a = fresh()
    for r in range(2):
        for j, m in enumerate(a.replicas):
            local_steps(m, r * 2 + j)
        a.sync([7, 9])
    state = a.state_dict()
    b = fresh()
    b.load_state_dict(state)
    for r in range(2, 4):
        for sync in (a, b):
            for j, m in enumerate(sync.replicas):
                local_steps(m, r * 2 + j)
            sync.sync([7, 9])
    assert b.rounds == a.rounds == 4
    for n in a.global_params:
        assert torch.equal(a.global_params[n], b.global_params[n])


def test_sync_records_reach_telemetry_sinks():
    from geomesh.telemetry_sinks import ListSink

    sink = ListSink()
    sync = GeoMeshSync([tiny(0), tiny(1)], telemetry=Telemetry(None, sinks=[sink]))
    for _ in range(2):
        for j, m in enumerate(sync.replicas):
            local_steps(m, j, 1)
        sync.sync([5, 5])
    assert [r["type"] for r in sink.records] == ["sync", "sync"]
    assert [step for step, _ in sink.scalars["sync/tokens"]] == [1, 2]
    assert sink.scalars["sync/tokens"][-1][1] == 20.0
    assert math.isfinite(sink.scalars["sync/update_norm"][0][1])


def _run_example(*args: str, out: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args, "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def example_in_one_process(tmp_path_factory) -> dict:
    """The example's two workers in one process, 3 rounds (the two tests below read the same run)."""
    (inproc,) = _run_example("--rounds", "3", out=tmp_path_factory.mktemp("example") / "inproc.jsonl")
    return inproc


def test_example_single_process(tmp_path, example_in_one_process):
    (alone,) = _run_example("--single", "--rounds", "4", out=tmp_path / "alone.jsonl")
    assert alone["world"] == 1 and alone["rounds"] == 4 and alone["final_loss"] < math.log(64)
    inproc = example_in_one_process
    assert inproc["replicas"] == 2 and len(set(inproc["replica_digests"])) == 1
    assert [p["name"] for p in inproc["plan"]] == ["fast", "slow"]


def test_example_under_a_two_rank_gloo_group(tmp_path, example_in_one_process):
    ranks = sorted(_run_example("--nproc", "2", "--rounds", "3", out=tmp_path / "ranks.jsonl"), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    assert ranks[0]["digest"] == ranks[1]["digest"]  # every rank ends with the same parameters
    assert ranks[0]["plan"] == ranks[1]["plan"] and ranks[0]["plan"][0]["batch_size"] != ranks[0]["plan"][1]["batch_size"]
    assert ranks[0]["bytes_sent"] == 3 * ranks[0]["payload_bytes"]
    # the same workers in one process give bit-identical parameters: the exchange is the only difference
    assert example_in_one_process["digest"] == ranks[0]["digest"]
