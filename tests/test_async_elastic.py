"""The asynchronous baseline (``async-local-sgd``) with elastic regions: every region its own world, reaching the
parameter server over an authenticated session of its own (its address on the quorum service's board). A launch
trains to the budget and ends every region on the server's θ; a region lost mid-run leaves the others going, and
started again with its own command it rejoins from the live θ; whoever cannot prove the run's key is refused."""

from __future__ import annotations

import json
import re
import subprocess
import uuid

import pytest
import torch
import yaml
from test_async_distributed import METHOD, async_launch
from test_distributed import write_scenario
from test_elastic import hang_at, kill_all, kill_hung_region, start

from geomesh.telemetry import read_events

KEY_ENV = "GEOMESH_TEST_ASYNC_KEY"


def ended_on(logs: str) -> dict[str, str]:
    """Region -> the checksum of the θ each region's leader says it ended on (its own line at the end)."""
    return dict(re.findall(r"region (\S+): the run ended at round \d+ .*?checksum (\w+);", logs))


def test_an_elastic_launch_trains_to_the_budget_and_every_region_ends_on_the_servers_theta(tmp_path, small_corpus):
    """Three regions, each its own world (``--min-regions 3``), region 1 of two ranks: the run starts once all
    three are connected, spends the budget, its loss falls; every arrival is one round record; every region ends
    on the server's θ (the server's checksums, and each region's own word for the θ it holds)."""
    path = write_scenario(tmp_path, small_corpus, ("H100", "A100", "T4"), counts=[1, 2, 1])
    out = tmp_path / "run"
    result = async_launch(path, out, 4, "--min-regions", "3")
    assert result.code == 0, result.message
    assert all(r.code == 0 for r in result.ranks), [(r.rank, r.code) for r in result.ranks]
    summary = result.summary
    assert summary["tokens"] >= 6000 and summary["rounds"] >= 3 and summary["curve"][-1][2] < summary["curve"][0][2]
    names = ["r0-h100", "r1-a100", "r2-t4"]
    el = summary["elastic"]
    assert el["regions_at_end"] == names and el["leaves"] == 0 and el["joins"] == 0
    checksums = summary["param_checksums"]
    assert sorted(checksums) == names and len(set(checksums.values())) == 1
    assert sum(summary["cycles"].values()) == summary["rounds"] and min(summary["cycles"].values()) >= 1
    rounds = [e for e in read_events(out / "events.jsonl") if e["type"] == "round"]
    assert [e["round"] for e in rounds] == list(range(1, summary["rounds"] + 1))
    said = ended_on("".join(f.read_text() for f in (out / "logs").glob("rank*.log")))
    assert said == {"r1-a100": checksums["r0-h100"], "r2-t4": checksums["r0-h100"]}, said
    saved = torch.load(out / "final_params.pt")
    assert saved.keys() and not (out / "checkpoints").exists()
