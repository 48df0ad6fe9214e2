"""The one distributed round loop: what one mode of it supports, every mode does (faults in static runs,
payload screening everywhere, the ddp baseline's refusal of faults), on real rank processes."""

from __future__ import annotations

import pytest
import yaml
from conftest import FIXED_PLAN, tiny_scenario_dict

from geomesh.cli import launch as cli_launch
from geomesh.telemetry import read_events

RANK_ENV = {"OMP_NUM_THREADS": "1"}
ONE_ROUND = 4 * 5 * 32  # b=4, H=5, 32 tokens per sequence (the tiny scenario, uniform plan)


def write(tmp_path, small_corpus, faults=None, **reliability):
    data = tiny_scenario_dict(small_corpus, ("H100", "A100", "T4"))
    data["geomesh"].update(FIXED_PLAN)
    data["faults"] = faults or []
    if reliability:
        data["reliability"] = reliability
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def launch(argv, env=None):
    args = cli_launch.build_parser().parse_args(["launch", *argv])
    return cli_launch.launch(args, extra_env={**RANK_ENV, **(env or {})})


@pytest.mark.parametrize("method", ["geomesh", "diloco"])
def test_a_static_run_honours_slowdown_and_corrupt_faults(tmp_path, small_corpus, capsys, method):
    """Without elastic regions: a slowdown (re-planned at once) and a corrupted payload (screened out by every
    receiver, or by its sender for a summed dense exchange) on real processes; the run goes to its end."""
    faults = [{"at_round": 1, "region": "r0-h100", "kind": "slowdown", "factor": 2.0},
              {"at_round": 2, "region": "r2-t4", "kind": "corrupt"}]  # fmt: skip
    path = write(tmp_path, small_corpus, faults)
    out = tmp_path / "run"
    result = launch([str(path), "--nproc", "3", "--method", method, "--out", str(out), "--tokens", "8000",
                     "--timeout", "60"])  # fmt: skip
    assert result.code == 0, result.message
    s = result.summary
    assert [(f["kind"], f["region"], f["round"]) for f in s["faults"]] == [("slowdown", "r0-h100", 1),
                                                                          ("corrupt", "r2-t4", 2)]  # fmt: skip
    assert s["rejected_payloads"] == 1
    corrupt = s["faults"][1]
    assert corrupt["tokens_lost"] > 0 and s["tokens_lost"] == corrupt["tokens_lost"]
    events = read_events(out / "events.jsonl")
    warnings = [e for e in events if e["type"] == "warning"]
    assert [(w["worker"], w["round"]) for w in warnings] == [("r2-t4", 3)]
    assert "payload rejected" in warnings[0]["message"]
    assert [e["round"] for e in events if e["type"] == "plan"] == [0, 1]  # the slowdown is planned at once
    assert len(set(s["param_checksums"])) == 1
    err = capsys.readouterr()
    assert "region r2-t4: payload rejected" in err.out + err.err


def test_ddp_refuses_scenario_faults_in_one_line(tmp_path, small_corpus, capsys):
    path = write(tmp_path, small_corpus, [{"at_round": 1, "region": "r0-h100", "kind": "slowdown", "factor": 2.0}])
    code = cli_launch.main(["launch", str(path), "--nproc", "3", "--method", "ddp", "--out", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--method ddp: the scenario has faults (slowdown)" in err and err.count("\n") == 1
    assert not (tmp_path / "r" / "logs").exists()


def test_a_static_run_refuses_membership_faults_in_one_line(tmp_path, small_corpus, capsys):
    path = write(tmp_path, small_corpus, [{"at_round": 1, "region": "r1-a100", "kind": "leave"}])
    code = cli_launch.main(["launch", str(path), "--nproc", "3", "--method", "geomesh", "--out", str(tmp_path / "r")])
    assert code == 2
    err = capsys.readouterr().err
    assert "leave/join faults need elastic regions" in err and err.count("\n") == 1


def test_a_region_with_another_key_is_rejected_each_round_and_the_others_finish(tmp_path, small_corpus):
    """A static run signed with a run key, one region started with another key (as a mis-deployed region
    would be): every round the others reject its payload (the slot's tag fails), name it and finish; it cannot
    authenticate them, so it stands aside (it applies nothing) and ends with one error naming the key."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    path = write(tmp_path, small_corpus, hmac_key_env="GEOMESH_TEST_RUN_KEY")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = tmp_path / "run"
    procs = []
    for rank in range(3):
        key = "a-wrong-key-of-32-bytes-for-tests" if rank == 2 else "the-run-key-of-32-bytes-for-tests"
        env = {**os.environ, "PYTHONPATH": src, "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "GEOMESH_TEST_RUN_KEY": key}  # fmt: skip
        env.pop("GEOMESH_REGION", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "geomesh.run", str(path), "--method", "geomesh",
                                       "--out", str(out), "--tokens", "8000", "--quiet", "--timeout", "60"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 2], errs
    odd = [ln for ln in errs[2].splitlines() if ln.startswith("error:")]
    assert len(odd) == 1 and "r2-t4" in odd[0] and "another run key" in odd[0], errs[2]
    summary = yaml.safe_load((out / "summary.json").read_text())
    rounds = summary["rounds"]
    assert rounds >= 3 and summary["rejected_payloads"] == rounds
    warnings = [e for e in read_events(out / "events.jsonl") if e["type"] == "warning"]
    assert [w["round"] for w in warnings] == list(range(1, rounds + 1))
    assert all(w["worker"] == "r2-t4" and "HMAC" in w["message"] for w in warnings)
    assert summary["param_checksums"][0] == summary["param_checksums"][1] != summary["param_checksums"][2]
