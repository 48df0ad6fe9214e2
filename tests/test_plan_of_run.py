"""``geomesh plan RUN_FOLDER``: a finished (or running) run's plans from its records, each with why it was made,
and the WAN as measured against the declared one; a folder without records is one error line."""

from __future__ import annotations

import json

from geomesh.cli import main


def plan_record(round_index, batches, **extra):
    workers = [{"name": n, "batch": b, "inner_steps": 1} for n, b in batches.items()]
    return {"type": "plan", "round": round_index, "time": 0.0, "plan": {"workers": workers, "exchange_s": 0.3,
                                                                         "round_s": 0.5}, **extra}  # fmt: skip


def test_a_run_folder_shows_every_plan_with_its_reason_and_the_wan_measured(tmp_path, capsys):
    records = [
        {"type": "run", "method": "geomesh"},
        plan_record(0, {"r0": 22, "r1": 22}, members=["r0", "r1"]),
        {"type": "round", "round": 1, "exchange_s": 0.31},
        plan_record(2, {"r0": 20, "r1": 24}, replan=True, measured_s={"r0": 0.2}, planned_s={"r0": 0.1}),
        plan_record(7, {"r0": 20, "r1": 24}, replan=True, reason="the WAN measured 3.7x slower than the plan assumed"),
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    measured = {"latency_factor": 1.2, "transfer_factor": 3.5, "observations": 9, "probes": 4, "held_back": 1}
    (tmp_path / "summary.json").write_text(json.dumps({"wan_measured": measured}))
    assert main(["plan", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(p["round"], p["why"]) for p in out["plans"]] == [
        (0, "the start"), (2, "compute measured against planned"),
        (7, "the WAN measured 3.7x slower than the plan assumed")]
    assert out["plans"][1]["workers"] == {"r0": [20, 1], "r1": [24, 1]} and out["wan_measured"] == measured
    assert main(["plan", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "after round   7:" in text and "3.7x slower" in text and "latency x1.20, transfer x3.50" in text


def test_a_folder_without_run_records_is_one_error_line(tmp_path, capsys):
    assert main(["plan", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "events.jsonl" in err[0]
