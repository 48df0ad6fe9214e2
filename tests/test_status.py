"""`geomesh status DIR`: where a run stands, read from its run folder while it runs (records written by hand as
the runtimes write them, a last line cut mid-write, a finished run, folders that are no run's) and from a real
emulated run."""

from __future__ import annotations

import json

import pytest
import yaml

from geomesh.cli import main
from geomesh.runtime.run_status import read_status, summarise
from conftest import tiny_scenario_dict

REGIONS = ["r0-h100", "r1-a100", "r2-t4"]
REASON = "not in the round's quorum (died, hung or late)"


def _elastic_records() -> list[dict]:
    """An elastic run of 3 regions at round 6 of a 24,000-token budget: r2-t4 left at round 3, came back at 5."""
    recs = [{"type": "run", "runtime": "distributed", "method": "geomesh", "scenario": "tiny", "seed": 0,
             "tokens_budget": 24000, "model": "nano", "model_params": 1000, "workers": REGIONS,
             "elastic": True, "min_regions": 2, "round_deadline_s": 60.0},
            {"type": "plan", "round": 0, "time": 0.0, "plan": {}, "members": REGIONS},
            {"type": "eval", "time": 0.0, "tokens": 0, "round": 0, "val_loss": 6.3}]  # fmt: skip
    members = {1: REGIONS, 2: REGIONS, 3: REGIONS[:2], 4: REGIONS[:2], 5: REGIONS, 6: REGIONS}
    tokens = 0
    for r in range(1, 7):
        if r == 3:
            recs.append({"type": "leave", "round": 3, "time": 4.1, "region": "r2-t4", "reason": REASON})
        if r == 5:
            recs.append({"type": "join", "round": 5, "time": 8.0, "region": "r2-t4"})
        tokens += 1000 * len(members[r])
        recs.append({"type": "round", "round": r, "time": 2.0 * r, "tokens": tokens, "members": members[r],
                     "compute_s": [1.0 + 0.1 * i + 0.01 * r for i in range(len(members[r]))],
                     "exchange_s": 0.25 + 0.01 * r, "bytes_sent": 3000, "tokens_lost": {}, "deadline_s": 60.0,
                     "frames_rejected": [], "straggler_idle_frac": 0.1})  # fmt: skip
        recs.append({"type": "span", "worker": "r0-h100", "kind": "compute", "start": 2.0 * r - 1, "end": 2.0 * r,
                     "round": r})  # fmt: skip
        if r % 2 == 0:
            recs.append({"type": "eval", "time": 2.0 * r, "tokens": tokens, "round": r, "val_loss": 6.0 - 0.1 * r})
    return recs


def _write(folder, records, tail: str = ""):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return folder


def test_a_live_elastic_run_with_a_leave_and_a_join(tmp_path, capsys):
    run = _write(tmp_path / "run", _elastic_records())
    (run / "run.lock").write_text(json.dumps({"run_id": "x", "pid": 1, "host": "h", "since": 0}))
    st = read_status(run)
    assert st["method"] == "geomesh" and st["scenario"] == "tiny" and st["elastic"] and st["min_regions"] == 2
    assert st["state"] == "running" and st["round"] == 6 and st["tokens"] == 16000 and st["tokens_budget"] == 24000
    assert st["members"] == REGIONS and st["clock"] == "wall" and not st["torn_line"]
    assert st["regions"]["r2-t4"] == {"compute_s": pytest.approx(1.26), "round": 6, "member": True}
    assert st["exchange_s"] == pytest.approx(0.31) and st["deadline_s"] == 60.0
    assert st["membership"] == [{"event": "leave", "region": "r2-t4", "round": 3, "time": 4.1, "reason": REASON},
                                {"event": "join", "region": "r2-t4", "round": 5, "time": 8.0}]  # fmt: skip
    assert st["val_loss"] == {"val_loss": pytest.approx(5.4), "round": 6, "tokens": 16000, "time": 12.0}
    # the last 5 rounds (2..6): 13,000 tokens in 10 s; 8,000 left
    assert st["pace_tokens_per_s"] == pytest.approx(1300) and st["eta_s"] == pytest.approx(8000 / 1300)

    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "geomesh on tiny (distributed, elastic: at least 2 region(s))" in out
    assert "running, round 6 done" in out and "16,000 / 24,000 (66.7%)" in out and "to go at 1,300 tokens/s" in out
    assert "r0-h100, r1-a100, r2-t4 (3 of 3)" in out and "r2-t4 1.26 s (round 6)" in out
    assert f"left: r2-t4 at round 3: {REASON}" in out and "joined: r2-t4 at round 5" in out
    assert "val loss: 5.4000 (round 6, 16,000 tokens)" in out and "finished: no" in out

    assert main(["status", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["membership"][1]["event"] == "join"


def test_members_follow_a_leave_recorded_after_the_last_round(tmp_path):
    """The quorum of the next round left a region out: it is no member now, and its last compute time stays."""
    recs = _elastic_records() + [
        {"type": "leave", "round": 7, "time": 12.5, "region": "r1-a100", "reason": REASON},
        {"type": "plan", "round": 6, "time": 12.5, "plan": {}, "members": ["r0-h100", "r2-t4"]},
    ]
    st = read_status(_write(tmp_path / "run", recs))
    assert st["members"] == ["r0-h100", "r2-t4"]
    assert st["regions"]["r1-a100"] == {"compute_s": pytest.approx(1.16), "round": 6, "member": False}
    lost = summarise([(1, recs[0]), (2, {"type": "leave", "round": 1, "time": 0.5, "region": "r2-t4",
                                         "reason": "lost during the round's exchange", "tokens_lost": 640}),
                      (3, {**_elastic_records()[4], "members": REGIONS[:2], "compute_s": [1.0, 1.1]})])  # fmt: skip
    assert lost["members"] == REGIONS[:2] and lost["membership"][0]["tokens_lost"] == 640
    assert lost["regions"]["r2-t4"] == {"compute_s": None, "round": None, "member": False}


def test_a_last_line_cut_mid_write_is_skipped(tmp_path, capsys):
    cut = json.dumps({"type": "round", "round": 7, "time": 14.0, "tokens": 19000, "members": REGIONS})[:37]
    run = _write(tmp_path / "run", _elastic_records(), tail=cut)
    st = read_status(run)
    assert st["torn_line"] and st["round"] == 6 and st["tokens"] == 16000
    assert main(["status", str(run)]) == 0
    assert "was being written and is left out" in capsys.readouterr().out
    # a cut in the middle of a multi-byte character is cut too
    whole = (run / "events.jsonl").read_bytes()[: -len(cut)]
    (run / "events.jsonl").write_bytes(whole + '{"reason": "é'.encode()[:-1])
    assert read_status(run)["torn_line"]


def test_a_finished_run(tmp_path, capsys):
    run = _write(tmp_path / "run", _elastic_records())
    (run / "summary.json").write_text(json.dumps({"method": "geomesh", "tokens": 24000, "rounds": 8,
                                                  "final_val_loss": 5.1, "status": "complete"}))  # fmt: skip
    st = read_status(run)
    assert st["state"] == "finished" and st["status"] == "complete" and st["eta_s"] == 0.0
    assert st["tokens"] == 24000 and st["progress"] == 1.0 and st["final_val_loss"] == 5.1
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "finished (complete) after 8 rounds" in out and "final val loss 5.1000" in out and "to go" not in out
    # --watch ends at once on a finished run
    assert main(["status", str(run), "--watch", "0.01", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "finished"


def test_watch_refreshes_until_the_summary_appears(tmp_path, capsys, monkeypatch):
    import geomesh.cli.status as face

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").write_text("{}")
    naps = []

    def nap(seconds):  # the run goes on between refreshes: first records, then the summary
        naps.append(seconds)
        if len(naps) == 1:
            _write(run, _elastic_records())
        else:
            (run / "summary.json").write_text(json.dumps({"tokens": 24000, "rounds": 8, "status": "complete"}))

    monkeypatch.setattr(face.time, "sleep", nap)
    assert main(["status", str(run), "--watch", "5"]) == 0
    captured = capsys.readouterr()
    assert naps == [5.0, 5.0] and "waiting:" in captured.err and "holds no events.jsonl" in captured.err
    assert "running, round 6 done" in captured.out and "finished (complete)" in captured.out


def test_a_static_and_an_emulated_run_name_their_regions(tmp_path):
    static = [{"type": "run", "runtime": "distributed", "method": "diloco", "scenario": "s", "tokens_budget": 100,
               "workers": REGIONS},
              {"type": "round", "round": 1, "time": 1.0, "tokens": 30, "compute_s": [0.5, 0.6, 0.7],
               "exchange_s": 0.1, "members": REGIONS[:2]}]  # fmt: skip
    st = summarise(list(enumerate(static, 1)))
    assert not st["elastic"] and st["members"] == REGIONS and st["regions"]["r2-t4"]["compute_s"] == 0.7
    assert st["pace_tokens_per_s"] == 30.0 and st["eta_s"] == pytest.approx(70 / 30)
    emulated = [{**static[0], "runtime": "emulated"},
                {"type": "round", "round": 1, "time": 9.0, "tokens": 30, "compute_s": {"r0-h100": 2.0, "r2-t4": 3.0},
                 "exchange_s": 0.1}]  # fmt: skip
    st = summarise(list(enumerate(emulated, 1)))
    assert st["clock"] == "modeled" and st["members"] == ["r0-h100", "r2-t4"]
    assert st["regions"]["r1-a100"]["compute_s"] is None and st["regions"]["r2-t4"]["compute_s"] == 3.0
    # the DDP and asynchronous baselines record evaluations, no rounds: their round, tokens and pace come from them
    evals = [static[0], *({"type": "eval", "time": 2.0 * k, "tokens": 10 * k, "round": 4 * k, "val_loss": 6.0}
                          for k in range(3))]  # fmt: skip
    st = summarise(list(enumerate(evals, 1)))
    assert st["state"] == "running" and st["round"] == 8 and st["tokens"] == 20 and st["exchange_s"] is None
    assert st["pace_tokens_per_s"] == 5.0 and st["eta_s"] == 16.0


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "no such folder"),
        (lambda d: (d.mkdir(), (d / "notes.txt").write_text("hi")), "is not a run folder"),
        (lambda d: (d.mkdir(), (d / "run.lock").write_text("{}")),
         "is a run folder (run.lock) but holds no events.jsonl"),
        (lambda d: (d.mkdir(), (d / "checkpoints").mkdir(), (d / "regions").mkdir(),
                    (d / "regions" / "r1-a100.json").write_text(json.dumps({"region": "r1-a100", "host": "b1"}))),
         "another host's run folder"),
        (lambda d: _write(d, [], tail='{"type": "ru'), "holds no complete record yet"),
        (lambda d: _write(d, _elastic_records()[:3], tail='{"type": "round", broken\n{"type": "eval"}\n'),
         "is damaged: line 4 is not a JSON record"),
        (lambda d: _write(d, [{"type": "span", "worker": "a"}]), 'holds no "run" record'),
        (lambda d: _write(d, [*_elastic_records()[:1], ["a", "list"]]), "line 2 is not a record"),
        (lambda d: _write(d, [*_elastic_records()[:1], {"type": "round", "round": "six", "tokens": 1}]),
         "line 2 round: expected a number"),
        (lambda d: (_write(d, _elastic_records()), (d / "summary.json").write_text("{oops")),
         "summary.json is damaged"),
    ],
)
def test_bad_folders_are_one_error_line(tmp_path, capsys, setup, message):
    folder = tmp_path / "run"
    setup(folder)
    assert main(["status", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_folder_above_run_folders_names_them(tmp_path, capsys):
    _write(tmp_path / "bed" / "r0-h100" / "run", _elastic_records())
    assert main(["status", str(tmp_path / "bed")]) == 2
    assert f"run folders under it: {tmp_path / 'bed' / 'r0-h100' / 'run'}" in capsys.readouterr().err


def test_bad_watch_interval(tmp_path, capsys):
    assert main(["status", str(_write(tmp_path / "run", _elastic_records())), "--watch", "0"]) == 2
    assert "--watch 0: expected seconds > 0" in capsys.readouterr().err


def test_status_of_a_real_emulated_run(tmp_path, small_corpus, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_scenario_dict(small_corpus)))
    out = tmp_path / "run"
    assert main(["train", str(path), "--method", "geomesh", "--out", str(out), "--quiet", "--tokens", "6000"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    capsys.readouterr()
    assert main(["status", str(out), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["method"] == "geomesh" and st["scenario"] == "tiny" and st["runtime"] == "emulated"
    assert not st["elastic"] and st["state"] == "finished" and st["round"] == summary["rounds"]
    assert st["tokens"] == summary["tokens"] and st["tokens_budget"] == 6000 and st["members"] == st["workers"]
    assert all(r["compute_s"] > 0 for r in st["regions"].values()) and st["exchange_s"] > 0
    assert st["val_loss"]["val_loss"] == pytest.approx(summary["final_val_loss"])
    # the same run seen mid-way: its records cut after the second round (and half of the next line)
    lines = (out / "events.jsonl").read_text().splitlines(keepends=True)
    second = [i for i, line in enumerate(lines) if json.loads(line)["type"] == "round"][1]
    live = tmp_path / "live"
    live.mkdir()
    (live / "events.jsonl").write_text("".join(lines[: second + 1]) + lines[second + 1][: len(lines[second + 1]) // 2])
    st = read_status(live)
    assert st["state"] == "running" and st["round"] == 2 and st["torn_line"] and 0 < st["tokens"] < 6000
    assert st["eta_s"] is not None and st["eta_s"] > 0
    assert main(["status", str(live)]) == 0
    assert "running, round 2 done" in capsys.readouterr().out
