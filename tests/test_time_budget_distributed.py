"""The wall-clock time budget in the distributed runtime (``--time-budget``, ``training.time_budget_s``).

Real ``geomesh launch`` runs over Gloo on this machine, a few seconds of training each. Every region reports its
clock with each round; the run's elapsed time is the mean of those clocks, the same number on every rank, and
the round in which it reaches the budget is the last one on every region. Nothing here asserts how long
anything took: only that the regions stopped at the same round, that the summary says the budget ended the
run, and that the elapsed times the run recorded agree with the budget (every round before the last under it,
the last at or past it). A resumed run keeps the time spent before it stopped: its clock goes on from the
checkpoint's, and a run resumed after its budget was spent trains no further round.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import FIXED_PLAN, tiny_scenario_dict

from geomesh.cli import launch as cli_launch
from geomesh.methods.budget import elapsed_of_round, plan_tokens_in_time
from geomesh.telemetry import read_events

BUDGET = 2.0  # wall-clock seconds of training per run
ENDED = re.compile(r"region (\S+): the time budget of [0-9.]+s is spent .*; the run ends with round (\d+)")


def scenario(folder: Path, paths: list[str], counts=(1, 1, 1), **reliability) -> Path:
    data = tiny_scenario_dict(paths, ("H100", "A100", "T4"), zero_shot_items=0)
    data["geomesh"].update(FIXED_PLAN)
    for region, count in zip(data["regions"], counts):
        region["count"] = count
    if reliability:
        data["reliability"] = {"round_deadline_s": 120, **reliability}
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def launch(path: Path, out: Path, method: str, *extra: str, budget: float = BUDGET, env=None):
    nproc = 4 if "--ranks-per-region" in extra else 3
    args = cli_launch.build_parser().parse_args(
        ["launch", str(path), "--nproc", str(nproc), "--method", method, "--out", str(out), "--time-budget",
         str(budget), "--quiet", "--wan", "none", "--timeout", "90", *extra])  # fmt: skip
    return cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1", **(env or {})})


def ends(out: Path) -> dict[str, int]:
    """Per region (its leader's log), the round its run ended with once the time budget was spent."""
    found: dict[str, int] = {}
    for log in sorted((out / "logs").glob("rank*.log")):
        for region, number in ENDED.findall(log.read_text()):
            assert region not in found, f"region {region} said twice where its run ended"
            found[region] = int(number)
    return found


def assert_ended_by_the_budget(summary: dict, budget: float = BUDGET) -> None:
    assert summary["stopped_by"] == "time_budget"
    assert summary["time_budget_s"] == budget
    assert summary["time_budget_elapsed_s"] >= budget  # the regions' clocks at the last round
    assert any("learning-rate schedule" in m for m in summary["modeled"])


def assert_round_clocks(out: Path, summary: dict, budget: float = BUDGET) -> None:
    """Static runs: every round record carries the elapsed time the regions agreed on; they grow, every one
    before the last is under the budget, the last is at or past it (and is the summary's)."""
    rounds = [e for e in read_events(out / "events.jsonl") if e["type"] == "round"]
    assert [e["round"] for e in rounds] == list(range(1, summary["rounds"] + 1))
    clocks = [e["elapsed_s"] for e in rounds]
    assert clocks == sorted(clocks) and len(set(clocks)) == len(clocks)
    assert all(c < budget for c in clocks[:-1]) and clocks[-1] >= budget
    assert clocks[-1] == summary["time_budget_elapsed_s"]


def assert_evaluations_are_other_time(out: Path) -> None:
    """Every evaluation after a round falls inside an ``other`` span of the region that recorded it, never inside
    a wait: the next round's quorum or barrier must not book it as WAN or straggler idle."""
    events = read_events(out / "events.jsonl")
    evals = [e["time"] for e in events if e["type"] == "eval" and e["round"] >= 1]
    writer = next(e for e in events if e["type"] == "run")["workers"][0]
    others = [(e["start"], e["end"]) for e in events if e["type"] == "span" and e["worker"] == writer
              and e["kind"] == "other"]  # fmt: skip
    assert evals and all(any(a <= t <= b for a, b in others) for t in evals), evals


def assert_evaluations_follow_the_quorum(out: Path) -> None:
    """Elastic plain rounds: every evaluation but the run's last runs after the next round's quorum, just before
    that round's compute (the span after the one it lies in is compute, not the quorum's wait): a slower
    region's evaluation is its round overhead, which the plan counts, not a wait at the quorum for the others."""
    events = read_events(out / "events.jsonl")
    writer = next(e for e in events if e["type"] == "run")["workers"][0]
    spans = sorted((e["start"], e["end"], e["kind"]) for e in events if e["type"] == "span" and e["worker"] == writer
                   and e["end"] > e["start"])  # fmt: skip
    evals = sorted(e["time"] for e in events if e["type"] == "eval" and e["round"] >= 1)[:-1]
    assert evals
    for t in evals:
        k = next(k for k, (a, b, kind) in enumerate(spans) if a <= t <= b and kind == "other")
        assert spans[k + 1][2] == "compute", (t, spans[max(k - 2, 0): k + 3])


# ---- pieces that need no processes ------------------------------------------------------------------


def test_the_run_s_elapsed_time_is_the_mean_of_the_regions_clocks():
    assert elapsed_of_round([1.0, 2.0, 4.5]) == 2.5
    # a malformed report (not seconds) is left out; none left: no number (the budget is not decided on it)
    assert elapsed_of_round([3.0, None, "x", float("nan"), -1.0, True]) == 3.0
    assert elapsed_of_round([None, float("inf")]) is None and elapsed_of_round([]) is None
    # the same reports in the same order give the same float on every rank
    clocks = [0.1 * k + 1e-9 for k in range(7)]
    assert elapsed_of_round(list(clocks)) == elapsed_of_round(list(clocks))


def test_the_schedule_spans_what_the_first_plan_predicts():
    class P:
        sequences_per_round, round_s = 60, 2.0

    assert plan_tokens_in_time(P, 32, 10.0, 128) == 60 * 32 * 5
    assert plan_tokens_in_time(P, 32, 0.001, 128) == 128  # at least the floor


def test_tokens_and_a_time_budget_together_are_one_error(tmp_path, small_corpus, capsys):
    path = scenario(tmp_path, small_corpus)
    assert cli_launch.main(["launch", str(path), "--nproc", "3", "--method", "diloco", "--out",
                            str(tmp_path / "run"), "--time-budget", "5", "--tokens", "4000"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith("error: --tokens 4000 and a time budget of 5s") and err.count("\n") == 1
    assert cli_launch.main(["launch", str(path), "--nproc", "3", "--method", "diloco", "--out",
                            str(tmp_path / "run"), "--time-budget", "0"]) == 2  # fmt: skip
    assert "--time-budget 0.0: expected a positive number of seconds" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---- real processes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method,ranks", [
    ("geomesh-sign-only", None),  # the all-gather of payloads
    ("geomesh-overlap", "2,1,1"),  # overlapped: the exchange in flight when the budget ends is waited for
    ("ddp", None),  # one decision per step: the clocks ride with the gradient's all-reduce
])  # fmt: skip
def test_a_static_run_stops_at_the_same_round_on_every_region(tmp_path, small_corpus, method, ranks):
    counts = (2, 1, 1) if ranks else (1, 1, 1)
    path = scenario(tmp_path, small_corpus, counts=counts)
    out = tmp_path / "run"
    result = launch(path, out, method, *(["--ranks-per-region", ranks] if ranks else []))
    assert result.code == 0, result.message
    s = result.summary
    assert_ended_by_the_budget(s)
    assert_round_clocks(out, s)
    assert ends(out) == {r: s["rounds"] for r in ("r0-h100", "r1-a100", "r2-t4")}  # every region, the same round
    assert len(s["param_checksums"]) == sum(counts) and len(set(s["param_checksums"])) == 1
    assert_evaluations_are_other_time(out)


@pytest.mark.parametrize("method,ranks", [("geomesh-sign-only", None),
                                          ("geomesh-overlap", "2,1,1")])  # (overlap: a region of 2 ranks learns
# each overlapped round's members from its leader, which took the quorum)
def test_elastic_regions_stop_at_the_same_round(tmp_path, small_corpus, method, ranks):
    """Each region is its own world and its own clock; the clocks travel with the round's exchange over the
    quorum, and every region stops after the same round (overlapped: the exchange the decision arrived with
    is followed by the one in flight, waited for). They end with the same θ, and the summary says why."""
    path = scenario(tmp_path, small_corpus, min_regions=2)
    out = tmp_path / "run"
    result = launch(path, out, method, *(["--ranks-per-region", ranks] if ranks else []))
    assert result.code == 0, result.message
    s = result.summary
    assert "elastic" in s and sorted(s["elastic"]["regions_at_end"]) == ["r0-h100", "r1-a100", "r2-t4"]
    assert_ended_by_the_budget(s)
    assert ends(out) == {r: s["rounds"] for r in ("r0-h100", "r1-a100", "r2-t4")}
    assert len(set(s["param_checksums"].values())) == 1
    rounds = [e["round"] for e in read_events(out / "events.jsonl") if e["type"] == "round"]
    assert rounds == list(range(1, s["rounds"] + 1))
    assert_evaluations_are_other_time(out)
    if method == "geomesh-sign-only":
        assert_evaluations_follow_the_quorum(out)


def test_a_resumed_run_keeps_the_budget_it_had(tmp_path, small_corpus):
    """Checkpoints carry the clock and the budget's state: a run whose rank exits after round 1 (whether or not
    its budget was spent then) resumes from that checkpoint with the time it had spent (the resumed rounds'
    clocks go on from there), and stops when the budget it had is spent; resumed once more, with the budget
    spent, it trains no further round."""
    path = scenario(tmp_path, small_corpus)
    out = tmp_path / "run"
    budget = 3.0
    cut = launch(path, out, "geomesh-sign-only", "--checkpoint-every", "1", "--keep", "2", budget=budget,
                 env={"GEOMESH_TEST_EXIT_AFTER_ROUND": "1:1"})  # fmt: skip
    assert cut.code != 0 and not (out / "summary.json").exists()
    before = [e for e in read_events(out / "events.jsonl") if e["type"] == "round"]
    assert [e["round"] for e in before] == [1]  # (round 2 needed the rank that exited)
    resumed = launch(path, out, "geomesh-sign-only", "--checkpoint-every", "1", "--keep", "2", "--resume",
                     budget=budget)  # fmt: skip
    assert resumed.code == 0, resumed.message
    s = resumed.summary
    assert_ended_by_the_budget(s, budget)
    assert_round_clocks(out, s, budget)  # the clocks before the stop count: they go on growing across the resume
    events = list(read_events(out / "events.jsonl"))
    assert [e["type"] for e in events].count("run") == 1
    assert [e for e in events if e["type"] == "round"][0]["elapsed_s"] == before[0]["elapsed_s"]
    assert ends(out) == {r: s["rounds"] for r in ("r0-h100", "r1-a100", "r2-t4")}
    assert len(set(s["param_checksums"])) == 1
    again = launch(path, out, "geomesh-sign-only", "--checkpoint-every", "1", "--keep", "2", "--resume",
                   budget=budget)  # fmt: skip
    assert again.code == 0, again.message
    assert again.summary["rounds"] == s["rounds"] and again.summary["stopped_by"] == "time_budget"
    assert again.summary["final_val_loss"] == s["final_val_loss"]
    assert again.summary["time_budget_elapsed_s"] == s["time_budget_elapsed_s"]
    assert [e["round"] for e in read_events(out / "events.jsonl") if e["type"] == "round"] == list(
        range(1, s["rounds"] + 1))
    assert json.loads((out / "summary.json").read_text())["rounds"] == s["rounds"]
