"""The command line: the public contract of `train`, `plan`, `bench`, and one-line errors."""

from __future__ import annotations

import json

import pytest
import yaml

from geomesh.cli import main
from conftest import tiny_scenario_dict


@pytest.fixture
def scenario_file(tmp_path, small_corpus):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_scenario_dict(small_corpus)))
    return path


def test_train_writes_summary_and_events(scenario_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", str(scenario_file), "--method", "geomesh", "--out", str(out), "--quiet",
                 "--seed", "3", "--tokens", "12000"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "geomesh" and summary["seed"] == 3 and 12000 <= summary["tokens"] < 13000
    assert (out / "events.jsonl").stat().st_size > 0
    assert "final_val_loss" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "no-such-preset", "--method", "diloco", "--out", "x"], "no such preset"),
        (["train", "default", "--method", "sgd9000", "--out", "x"], "unknown method 'sgd9000'"),
        (["train", "default", "--method", "diloco", "--out", "x", "--set", "training.tokens=-1"], "training.tokens"),
        (["train", "default", "--method", "diloco", "--out", "x", "--set", "nonsense"], "FIELD=VALUE"),
        (["plan", "default", "--profile", "mars=p.json"], "REGION=FILE"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_unwritable_run_folder_fails_before_training(scenario_file, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["train", str(scenario_file), "--method", "diloco", "--out", str(blocker / "run"), "--quiet"]) == 2
    assert "not writable" in capsys.readouterr().err


def test_plan_json_is_one_object(capsys):
    assert main(["plan", "default", "--json"]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out)
    for key in ("round_s", "sequences_per_round", "utilization", "exchange_bytes", "exchange_s",
                "straggler_idle_frac", "workers"):
        assert key in plan
    assert {w["gpu"] for w in plan["workers"]} == {"H100", "A100", "V100", "T4"}
    for w in plan["workers"]:
        assert w["batch"] == w["micro_batch"] * w["accum"]
    assert plan["straggler_idle_frac"] <= 0.02
    assert plan["baseline"]["straggler_idle_frac"] > 0.3


def test_plan_impossible_scenario_exits_nonzero(tmp_path, capsys):
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump({
        "regions": [{"name": "a", "gpu": "H100", "azure_region": "East US"},
                    {"name": "b", "gpu": "T4", "azure_region": "Japan East"}],
        "timing_model": {"n_layers": 32, "hidden": 2560, "seq_len": 1024},  # 2.6B: fits H100, not T4
    }))
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "T4" in err and "Traceback" not in err
    assert main(["plan", str(path), "--allow-drop", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dropped"]


def test_bench_compares_methods_side_by_side(scenario_file, tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", str(scenario_file), "--out", str(out), "--methods", "diloco,geomesh", "--json",
                 "--quiet", "--tokens", "12000"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [s["method"] for s in results["summaries"]] == ["diloco", "geomesh"]
    diloco = results["summaries"][0]
    assert results["target_val_loss"] == diloco["final_val_loss"]
    assert diloco["time_to_target_s"] is not None and diloco["time_to_target_s"] <= diloco["modeled_time_s"]
    for name in ("loss_vs_time.png", "idle.png", "timeline_geomesh.png", "results.json", "table.md"):
        assert (out / name).stat().st_size > 0


def test_profile_measures_this_device_and_plan_accepts_it(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert main(["profile", "--device", "cpu", "--out", str(out), "--batches", "1,2", "--repeats", "1"]) == 0
    profile = json.loads(out.read_text())
    assert profile["source"] == "measured" and set(profile["table"]) == {"1", "2"}
    assert all(t > 0 for t in profile["table"].values())
    capsys.readouterr()
    assert main(["plan", "default", "--json", "--profile", f"us-east={out}"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {w["name"] for w in plan["workers"]} == {"us-east", "eu-west", "japan-east", "india-central"}
    assert main(["profile", "--device", "cpu", "--out", str(out), "--batches", "0,x"]) == 2
