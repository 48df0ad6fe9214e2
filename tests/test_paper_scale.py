"""bench/paper_scale.py and the presets of the larger studies: the paper-scale script runs end to end at smoke
size on a CPU (the same script, scenario and methods as on a GPU), and the presets are what they say."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import bench_script

from geomesh.compare import tabulate
from geomesh.config import load_scenario
from geomesh.models import GPT, model_config
from geomesh.runtime.emulated import RunError

def load_script():
    return bench_script("paper_scale")


def proxy_params(scenario) -> int:
    cfg = model_config(scenario.model.preset, vocab_size=scenario.data.vocab_size, seq_len=scenario.model.seq_len)
    with torch.device("meta"):
        return GPT(cfg).num_params()


@pytest.mark.parametrize("preset", ["paper_scale", "default_large"])
def test_presets_run_on_the_default_cluster(preset):
    default, s = load_scenario("default"), load_scenario(preset)
    assert [r.__dict__ for r in s.regions] == [r.__dict__ for r in default.regions]
    assert s.wan == default.wan and s.timing_model == default.timing_model
    micro = proxy_params(default)
    if preset == "paper_scale":
        assert 115e6 <= proxy_params(s) <= 135e6 and s.model.seq_len >= 512
    else:
        assert 6 <= proxy_params(s) / micro <= 10 and s.model.seq_len >= 128


def test_smoke_run_writes_results_table_and_plots(tmp_path, small_corpus, capsys):
    script = load_script()
    out = tmp_path / "paper"
    code = script.main(["--smoke", "--device", "cpu", "--out", str(out), "--quiet",
                        "--set", f"data.paths=[{','.join(small_corpus)}]"])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in results["rows"]] == script.METHODS
    assert all(r["final_val_loss"] is not None for r in results["rows"])
    assert results["target_val_loss"] == next(r for r in results["rows"] if r["method"] == "diloco")["final_val_loss"]
    for name in ("table.md", "loss_vs_time.png", "idle.png", *(f"timeline_{m}.png" for m in script.METHODS)):
        assert (out / name).stat().st_size > 0, name
    meta = json.loads((out / "paper_scale.json").read_text())
    assert meta["smoke"] and meta["environment"]["device"] == "cpu" and set(meta["per_method"]) == set(script.METHODS)
    assert meta["scenario"]["model"]["preset"] == "nano" and meta["scenario"]["regions"][0]["gpu"] == "H100"
    for s in results["summaries"]:
        assert s["device"] == "cpu" and s["tokens"] >= 16_000
    assert "| geomesh" in printed and "wall time" in printed
    # runs trained by separate commands tabulate the same way (compare.tabulate, as for the CPU study)
    again = tabulate(out, script.METHODS)
    assert again["rows"] == results["rows"] and again["table"] == (out / "table.md").read_text().rstrip("\n")
    with pytest.raises(RunError, match="no finished run"):
        tabulate(out, ["diloco", "async-local-sgd"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_full_size_on_cpu_is_one_clear_error(tmp_path, capsys):
    code = load_script().main(["--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --device cpu") and "--smoke" in err[0]
    assert not (tmp_path / "x").exists()
