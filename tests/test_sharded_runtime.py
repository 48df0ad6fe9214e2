"""The sharded exchange in the emulated runtime: kept exact it trains exactly as the all-gather does, the
plan's choice is reported, and a scenario that cannot use it says so in one line."""

from __future__ import annotations

import pytest

from geomesh.config import ConfigError, load_scenario
from geomesh.methods import get_method
from geomesh.runtime.emulated import EmulatedRun, RunOptions


def run(scenario, **opts):
    return EmulatedRun(scenario, get_method("geomesh"), RunOptions(progress=False, workers_parallel=1, tokens=4000,
                                                                    **opts)).run()  # fmt: skip


def test_exact_sharded_training_equals_all_gather(tiny_scenario, tmp_path):
    import yaml

    base = tiny_scenario(gpus=("H100", "A100", "T4", "V100"))
    path = tmp_path / "s.yaml"
    data = yaml.safe_load((tmp_path / "tiny.yaml").read_text())
    for ex, bits in (("all_gather", 32), ("sharded", 32), ("sharded", 2)):
        data["geomesh"].update(exchange=ex, shard_bits=bits)
        path.write_text(yaml.safe_dump(data))
        s = run(load_scenario(path))
        if ex == "all_gather":
            ref = s
            assert s["exchange"] == "all_gather"
        elif bits == 32:
            assert s["exchange"] == "sharded"
            assert s["final_val_loss"] == ref["final_val_loss"]  # the same update, bit for bit
            assert s["modeled_time_s"] != ref["modeled_time_s"]  # its own modeled exchange
        else:
            assert s["final_val_loss"] != ref["final_val_loss"]  # 2 bits really quantise the combined shard
    assert base.geomesh.exchange == "auto"


def test_scenario_fields_are_checked():
    with pytest.raises(ConfigError, match="geomesh.exchange"):
        load_scenario("default", {"geomesh.exchange": "ring"})
    with pytest.raises(ConfigError, match="geomesh.shard_bits"):
        load_scenario("default", {"geomesh.shard_bits": 3})
    both = load_scenario("default", {"geomesh.exchange": "sharded", "geomesh.overlap": True})  # overlapped, sharded
    assert both.geomesh.exchange == "sharded" and both.geomesh.overlap is True


def test_geomesh_plan_says_which_exchange_and_why(tmp_path, capsys):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from scale import main as scale_main

    from geomesh.cli import main

    path = tmp_path / "u16.yaml"
    assert scale_main(["scenario", "--regions", "16", "--out", str(path)]) == 0
    capsys.readouterr()
    assert main(["plan", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exchange"]["exchange"] == "sharded" and "16 regions" in out["exchange"]["reason"]
    c = out["exchange"]["candidates"]
    assert c["sharded"]["seconds"] < c["all_gather"]["seconds"] and out["exchange_s"] == c["sharded"]["seconds"]
    assert main(["plan", str(path), "--set", "geomesh.exchange=all_gather"]) == 0
    assert "all-gather (geomesh.exchange forces it" in capsys.readouterr().out
    assert main(["plan", "default"]) == 0
    text = capsys.readouterr().out
    assert "exchange: all-gather (cheapest" in text
    # DiLoCo: all-reduced without a run key; with one (a scenario that names it) the plan shards it and says why
    assert "DiLoCo's exchange: ring all-reduce (dense payloads are all-reduced (no run key" in text
    assert main(["plan", "default", "--set", "reliability.hmac_key_env=GEOMESH_PLAN_KEY", "--json"]) == 0
    dense = json.loads(capsys.readouterr().out)["baseline"]["exchange"]
    assert dense["exchange"] == "sharded" and "run key" in dense["reason"] and "float32" in dense["reason"]
    c = dense["candidates"]
    assert set(c) == {"all_gather", "sharded"} and c["sharded"]["sent_bytes"] < 0.6 * c["all_gather"]["sent_bytes"]
