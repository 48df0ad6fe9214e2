"""Elastic regions in the distributed runtime (torchft Lighthouse + Manager, one replica group per region).

Real ``geomesh launch`` runs of 3 regions over Gloo on this machine: one region's processes are SIGKILLed in
the middle of the run (found by ``GEOMESH_REGION`` in their environment, as an operator would), the two
survivors finish; the same with the killed region restarted with its original command, which rejoins with
the live regions' state; faults from the scenario on real processes; bad input.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import FIXED_PLAN, healed_in_place, tiny_scenario_dict

from geomesh.cli import launch as cli_launch
from geomesh.telemetry import read_events

SRC = str(Path(__file__).resolve().parents[1] / "src")
TAG_ENV = "GEOMESH_TEST_TAG"


def scenario(folder: Path, paths: list[str], slowdown: float = 1.0, faults=None, strategy: str = "ddp",
             gpus=("H100", "A100", "T4"), rtt_ms: float | None = None, plan_loop: bool = False,
             **reliability) -> Path:  # fmt: skip
    data = tiny_scenario_dict(paths, gpus)
    if rtt_ms is not None:  # with --wan shaper every exchange is held to it: rounds of a known length
        n = len(gpus)
        data["wan"]["rtt"] = [[0 if i == j else rtt_ms for j in range(n)] for i in range(n)]
    if not plan_loop:  # GeoMesh's plan loop (calibration, re-planning) on: what users run
        data["geomesh"].update(FIXED_PLAN)
    else:
        data["geomesh"].update({"calibrate": True, "replan": True})
    for region in data["regions"]:
        region["slowdown"] = slowdown  # inner steps padded with sleep: longer rounds that cost no CPU
        region["strategy"] = strategy  # fsdp: θ and the outer momentum sharded over the region's ranks
    # a generous deadline: a dead region is noticed at once (closed connections, no heartbeat), and a slow one
    # must not be left out because this shared machine is busy
    data["reliability"] = {"min_regions": 2, "round_deadline_s": 120, **reliability}
    if faults:
        data["faults"] = faults
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def fixed_profiles(folder: Path, path: Path) -> list[str]:
    """``--profile REGION=FILE`` for every region, its datasheet profile: compute is not calibrated in place
    (whose figures differ between runs), the WAN is still measured."""
    from geomesh.config import load_scenario

    args = []
    for p in load_scenario(path).worker_profiles({}):
        f = folder / f"{p.name}.json"
        f.write_text(json.dumps(p.to_json()))
        args += ["--profile", f"{p.name}={f}"]
    return args


# every run measures the same WAN and the same compute (the fault hooks' stand-ins, runtime/hooks.py): the probes find it 4x
# slower than declared (a re-plan before round 0), and from round 2's exchange on 32x (re-planned for as the
# exchanges at 32x are folded in, within the noise the probes' prediction errors set: after rounds 3 and 6)
MEASURED_ENV = {"GEOMESH_TEST_WAN": "4:1:32", "GEOMESH_TEST_COMPUTE_AS_PLANNED": "1"}


def argv(path: Path, out: Path, tokens: int, method: str = "geomesh-sign-only", ranks: str = "1") -> list[str]:
    # the sign codec on DiLoCo's plan (b=4, H=5 per region): the same rounds whatever the planner's tuning
    nproc = str(sum(int(k) for k in ranks.split(","))) if "," in ranks else "3"  # 3 regions of `ranks` each
    return ["launch", str(path), "--nproc", nproc, "--ranks-per-region", ranks, "--method", method, "--out",
            str(out), "--tokens", str(tokens), "--save-params", "--quiet", "--wan", "none", "--timeout", "90"]  # fmt: skip


def processes(tag: str, region: str | None = None) -> list[int]:
    """Processes whose environment carries ``tag`` (and ``GEOMESH_REGION=region``, when given)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{TAG_ENV}={tag}".encode() in env and (region is None or f"GEOMESH_REGION={region}".encode() in env):
            found.append(int(entry.name))
    return found


def start(cmd: list[str], tag: str, out: Path, extra_env: dict[str, str] | None = None,
          forked: bool = False) -> subprocess.Popen:  # fmt: skip
    """``geomesh CMD`` as a process of its own, its environment tagged. ``forked``: its ranks are forked from a
    zygote (tests/zygote_launch.py): for a test that kills all of the tag's processes, not one region's."""
    env = {**{k: v for k, v in os.environ.items() if k != "GEOMESH_REGION"}, "PYTHONPATH": SRC,
           "OMP_NUM_THREADS": "1", TAG_ENV: tag, **(extra_env or {})}  # the launcher must not look like a region's
    entry = [str(Path(__file__).with_name("zygote_launch.py"))] if forked else ["-m", "geomesh.cli"]
    return subprocess.Popen([sys.executable, *entry, *cmd], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def wait_for_round(out: Path, proc: subprocess.Popen, k: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"round {k} never ended"
        try:
            if any(e["type"] == "round" and e["round"] >= k for e in read_events(out / "events.jsonl")):
                return
        except (OSError, json.JSONDecodeError):
            pass
        time.sleep(0.05)


def hang_at(region: str, point: str, round_number: int) -> dict[str, str]:
    """The launch environment that makes every rank of ``region`` hang at ``point`` of round ``round_number``
    (:mod:`geomesh.runtime.hooks`), for :func:`kill_hung_region`."""
    from geomesh.runtime.hooks import HOOKS_ENV

    return {HOOKS_ENV: json.dumps([{"point": point, "region": region, "round": round_number, "action": "hang"}])}


def kill_hung_region(tag: str, out: Path, proc: subprocess.Popen, region: str, ranks: list[int], point: str,
                     round_number: int, timeout: float = 180, forked: bool = False) -> list[dict]:  # fmt: skip
    """Once every rank of ``region`` (launch ranks ``ranks``) says in its log that it hung at ``point`` of round
    ``round_number`` (:func:`hang_at`), SIGKILL them (:func:`kill_region`): a region lost at a known point of a
    round, not wherever the test's poll happens to land (a kill during the commit vote lets some survivors commit
    the round and the others heal from them: an outcome the test would be asserting on a race). ``forked``: a
    launch whose ranks a zygote forked (``start(..., forked=True)``): the processes the hook lines name are
    killed, and nothing is returned (their /proc identity is the zygote's: they cannot be started again from it)."""
    line = f"fault hook: hang at {point} of round {round_number} ({region}"
    deadline = time.monotonic() + timeout
    logs = [out / "logs" / f"rank{k}.log" for k in ranks]
    while not all(f.exists() and line in f.read_text(errors="replace") for f in logs):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{region} never reached {point} of round {round_number}"
        time.sleep(0.05)
    if not forked:
        return kill_region(tag, region)
    pattern = re.escape(line) + r", rank \d+, pid (\d+)\)"
    pids = {int(pid) for f in logs for pid in re.findall(pattern, f.read_text(errors="replace"))}
    assert len(pids) == len(ranks), (region, pids)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)  # (hung: alive until killed)
    return []


def gone_within(tag: str, seconds: float) -> list[int]:
    """The processes tagged ``tag`` still there ``seconds`` after the test's launch ended (a zygote that forked
    its ranks ends when its launcher does, moments later)."""
    deadline = time.monotonic() + seconds
    while (left := processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def kill_region(tag: str, region: str) -> list[dict]:
    """SIGKILL every process of ``region``; returns how each was started (command line, environment, folder)."""
    pids = processes(tag, region)
    deadline = time.monotonic() + 10
    while not pids and time.monotonic() < deadline:  # (a /proc entry that could not be read just then)
        time.sleep(0.1)
        pids = processes(tag, region)
    assert pids, f"no process of region {region}"
    # how every process was started, read before any is killed: once one rank dies, its region's other ranks may
    # stop on their own before their /proc entries are read (and would not be started again)
    started = {}
    for pid in pids:
        proc = Path("/proc") / str(pid)
        try:  # (a process of the region that exited meanwhile, e.g. a launcher's child: nothing to kill)
            cmdline = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
            env = dict(kv.decode().split("=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
            started[pid] = {"cmd": cmdline, "env": env, "cwd": os.readlink(proc / "cwd")}
        except (ProcessLookupError, FileNotFoundError):
            continue
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert started, f"every process of region {region} exited before it could be killed"
    return list(started.values())


@pytest.mark.parametrize("method", ["geomesh-sign-only", "diloco"])  # the all-gather, the fp32 all-reduce
def test_survivors_that_did_not_touch_the_lost_region_are_not_held_to_the_deadline(tmp_path, small_corpus, method):
    """4 regions, the first of 2 ranks: a region is killed mid-round (every process of it, its inner steps of
    round 3 done and its payload not sent, while the others wait in the exchange). It is left out and
    the survivors finish: every round from the one it was lost in goes on without it, what it trained then is
    lost tokens, and no rank outlives the launcher. Gloo's ring all-gather fails at once only on the dead
    region's neighbours; the others wait on a neighbour that has left the collective. The leaders that see the
    failure tear their group down, so the rest fail at once too: the new quorum of 3 (the minimum here) forms
    well inside the round deadline and every survivor, both ranks of the first region included, ends with the
    same θ."""
    path = scenario(tmp_path, small_corpus, slowdown=2.0, gpus=("H100", "A100", "V100", "T4"), min_regions=3,
                    round_deadline_s=600)  # fmt: skip
    out, tag = tmp_path / "run", uuid.uuid4().hex
    proc = start([*argv(path, out, 7680 * 2, method=method, ranks="2,1,1,1"), "--timeout", "120"], tag, out,
                 extra_env=hang_at("r2-v100", "send", 3), forked=True)  # fmt: skip
    try:  # (lost mid-round: its inner steps done, its payload not sent, the others in the exchange)
        kill_hung_region(tag, out, proc, "r2-v100", [3], "send", 3, forked=True)
        killed_at = time.monotonic()
        stdout, stderr = launch_output_or_stacks(proc, tag, out, 240)
        took = time.monotonic() - killed_at
    finally:
        proc.kill()
        left = gone_within(tag, 10)  # the launcher has exited: every rank should have too
        kill_all(tag)  # on a failure, no rank outlives the test
    assert proc.returncode == 0, stderr[-3000:]
    assert took < 120, f"the survivors waited {took:.0f}s: someone sat out the round deadline"
    assert "warning: region r2-v100 was lost (rank 3: killed by SIGKILL" in stderr
    summary = json.loads((out / "summary.json").read_text())
    events = read_events(out / "events.jsonl")
    leaves = [e for e in events if e["type"] == "leave"]
    assert [e["region"] for e in leaves] == ["r2-v100"] and leaves[0]["round"] >= 3
    el = summary["elastic"]
    assert el["regions_at_end"] == ["r0-h100", "r1-a100", "r3-t4"] and el["leaves"] == 1 and el["joins"] == 0
    without = [e for e in events if e["type"] == "round" and "r2-v100" not in e["members"]]
    assert el["rounds_without"]["r2-v100"] == len(without) >= 1 and without[0]["round"] == leaves[0]["round"]
    # what it trained in the round it was lost in, if it was lost inside one (then that round was rolled back, a
    # record says so, and trained again; a kill between two rounds costs nothing)
    assert el["tokens_lost"]["r2-v100"] == sum(e["tokens_lost"].get("r2-v100", 0) for e in events
                                               if e["type"] in ("round", "rollback"))  # fmt: skip
    assert summary["tokens"] >= 7680 * 2 and summary["final_val_loss"] is not None
    checksums = summary["param_checksums"]
    assert list(checksums) == ["r0-h100", "r1-a100", "r3-t4"] and len(set(checksums.values())) == 1
    assert not left


def test_a_region_dying_mid_round_rolls_the_round_back_and_the_survivors_train_it_again(tmp_path, small_corpus):
    """A region's processes die with their payload unsent (SIGKILL from the test hook): the survivors' exchange
    fails, so the round does not commit; they roll it back, form a new quorum and train the round again without
    the dead region, under a new header. Every member's work of the failed attempt is lost tokens."""
    path = scenario(tmp_path, small_corpus)
    out = tmp_path / "run"
    args = cli_launch.build_parser().parse_args(argv(path, out, 7680))
    result = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1", "GEOMESH_TEST_KILL_MID_ROUND": "r2-t4:2"})
    assert result.code == 0, result.message
    assert [r.describe() for r in result.ranks] == ["exit code 0", "exit code 0", "killed by SIGKILL"]
    events = read_events(out / "events.jsonl")
    leave = [e for e in events if e["type"] == "leave"]
    one_round = 4 * 5 * 32  # b=4, H=5, 32 tokens per sequence
    assert [(e["region"], e["round"]) for e in leave] == [("r2-t4", 2)]
    rollbacks = [e for e in events if e["type"] == "rollback"]
    assert [e["round"] for e in rollbacks] == [2]
    assert rollbacks[0]["tokens_lost"] == {"r0-h100": one_round, "r1-a100": one_round, "r2-t4": one_round}
    rounds = [e for e in events if e["type"] == "round"]
    assert [e["round"] for e in rounds] == list(range(1, len(rounds) + 1))
    assert rounds[1]["members"] == ["r0-h100", "r1-a100"]
    el = result.summary["elastic"]
    assert el["rollbacks"] == 1 and el["rounds_without"]["r2-t4"] == len(rounds) - 1
    assert el["tokens_lost"] == {"r0-h100": one_round, "r1-a100": one_round, "r2-t4": one_round}
    # the budget counts tokens that reached θ: the survivors trained more rounds (the last one is shortened)
    assert 7680 <= result.summary["tokens"] < 7680 + one_round


def test_an_exchange_that_failed_on_one_region_is_rolled_back_on_every_region(tmp_path, small_corpus):
    """r2-t4's leader loses round 3's exchange after every payload arrived (the test hook; a member dying just
    after it sent is the real case). Whether a round counts is one vote (runtime/distributed/agreement.py):
    r2-t4 votes no, so no region commits the round; every region rolls it back and trains it again as a new
    attempt under a new header, all three together. No region falls behind, none leaves, θ stays one.
    GeoMesh's plan loop on, the WAN measured (compute from fixed profiles; the measured times made a function
    of the bytes and the plan by the test hooks): every region trains the plan the maker ships, re-plans for the
    measured WAN included, so every region's plan loop ends alike."""
    path = scenario(tmp_path, small_corpus, plan_loop=True)
    out = tmp_path / "run"
    args = cli_launch.build_parser().parse_args([*argv(path, out, 14784, method="geomesh"), "--timeout", "40",
                                                 "--checkpoint-every", "1", "--keep", "1",
                                                 *fixed_profiles(tmp_path, path)])  # fmt: skip
    result = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1", "GEOMESH_TEST_LOSE_EXCHANGE": "r2-t4:3",
                                                **MEASURED_ENV})  # fmt: skip
    assert result.code == 0, result.message
    assert [r.describe() for r in result.ranks] == ["exit code 0"] * 3
    events = read_events(out / "events.jsonl")
    rounds = [e for e in events if e["type"] == "round"]
    assert [e["round"] for e in rounds] == list(range(1, len(rounds) + 1))
    # every round, the rolled-back one's second attempt included, was trained by all three
    assert all(e["members"] == ["r0-h100", "r1-a100", "r2-t4"] for e in rounds)
    assert not [e for e in events if e["type"] in ("leave", "join")]
    rollbacks = [e for e in events if e["type"] == "rollback"]
    assert [(e["round"], e["region"]) for e in rollbacks] == [(3, "r0-h100")], rollbacks
    plans = [e for e in events if e["type"] == "plan" and not e.get("replan")]
    assert plans and all(e["maker"] == "r0-h100" for e in plans)
    el = result.summary["elastic"]
    assert el["regions_at_end"] == ["r0-h100", "r1-a100", "r2-t4"] and el["rollbacks"] == 1
    assert len(set(result.summary["param_checksums"].values())) == 1
    replans = [(e["round"], e["reason"]) for e in events if e["type"] == "plan" and e.get("replan")]
    assert any(r >= 3 and why.startswith("the WAN measured") for r, why in replans), replans
    assert not [e for e in events if e["type"] == "warning"]  # no plan differed, no payload was refused
    # every region's last checkpoint (each in its own folder) holds the same plan loop: the healed one's too
    loops = {}
    for region in ("r0-h100", "r1-a100", "r2-t4"):
        (last,) = sorted((out / "checkpoints" / region).glob("round-*"))
        (state,) = [json.loads(f.read_text())["state"] for f in last.glob("rank-*.json")]
        loop = json.loads(state["run.extra"])["plan_loop"]
        loops[region] = (last.name, loop["wan"], loop["online"], loop["planned_for"], json.loads(state["run.loop"]))
    assert loops["r2-t4"] == loops["r0-h100"] == loops["r1-a100"]


@pytest.mark.waits
def test_a_hung_region_misses_the_deadline_and_is_left_out(tmp_path, small_corpus):
    """A region that stops responding before its exchange (its heartbeat goes on, as in a stuck process) holds
    the others only until reliability.round_deadline_s; they re-form the quorum without it and finish. The
    deadline (the quorum service's join timeout too) is longer than QUORUM_ATTEMPT_S: when each quorum request
    was shorter than the join timeout, every request restarted the service's wait for the hung region (alive,
    never asking), and no quorum formed until --timeout."""
    from geomesh.runtime.distributed.service import QUORUM_ATTEMPT_S

    path = scenario(tmp_path, small_corpus, round_deadline_s=QUORUM_ATTEMPT_S + 1)
    out = tmp_path / "run"
    args = cli_launch.build_parser().parse_args([*argv(path, out, 7680), "--timeout", "30"])
    result = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1", "GEOMESH_TEST_KILL_MID_ROUND": "r2-t4:2:hang"})
    assert result.code == 0, result.message
    assert [r.describe() for r in result.ranks] == ["exit code 0", "exit code 0", "did not stop; killed by the launcher"]
    events = read_events(out / "events.jsonl")
    leave = [e for e in events if e["type"] == "leave"]
    assert [(e["region"], e["round"]) for e in leave] == [("r2-t4", 2)]
    assert [e["round"] for e in events if e["type"] == "rollback"] == [2]  # (trained again without it)
    assert result.summary["elastic"]["regions_at_end"] == ["r0-h100", "r1-a100"]


def test_scenario_faults_on_real_processes(tmp_path, small_corpus):
    """slowdown, bandwidth, nan, corrupt and a scheduled leave/join, recorded as the emulated runtime does."""
    faults = [{"at_round": 1, "region": "r0-h100", "kind": "slowdown", "factor": 2.0},
              {"at_round": 1, "region": "r2-t4", "kind": "bandwidth", "factor": 0.5},
              {"at_round": 2, "region": "r1-a100", "kind": "nan"},
              {"at_round": 3, "region": "r2-t4", "kind": "corrupt"},
              {"at_round": 4, "region": "r1-a100", "kind": "leave"},
              {"at_round": 6, "region": "r1-a100", "kind": "join"}]  # fmt: skip
    path = scenario(tmp_path, small_corpus, faults=faults)
    out = tmp_path / "run"
    args = cli_launch.build_parser().parse_args(argv(path, out, 7680 * 2))
    result = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1"})
    assert result.code == 0, result.message
    summary = result.summary
    kinds = [(f["kind"], f["region"], f["round"]) for f in summary["faults"]]
    assert kinds == [("slowdown", "r0-h100", 1), ("bandwidth", "r2-t4", 1), ("nan", "r1-a100", 2),
                     ("corrupt", "r2-t4", 3), ("leave", "r1-a100", 4), ("join", "r1-a100", 6)]  # fmt: skip
    by_kind = {f["kind"]: f for f in summary["faults"]}
    one_round = 4 * 5 * 32  # b=4, H=5, 32 tokens per sequence
    assert by_kind["nan"]["tokens_lost"] == one_round and by_kind["corrupt"]["tokens_lost"] == one_round
    assert summary["dropped_updates"] == 1 and summary["rejected_payloads"] == 1
    events = read_events(out / "events.jsonl")
    assert [(e["region"], e["round"]) for e in events if e["type"] == "leave"] == [("r1-a100", 5)]
    assert [(e["region"], e["round"]) for e in events if e["type"] == "join"] == [("r1-a100", 7)]
    assert summary["elastic"]["rounds_without"]["r1-a100"] == 2
    # re-planned at once after the slowdown and bandwidth faults, and when r1 leaves and comes back
    assert [e["round"] for e in events if e["type"] == "plan"] == [0, 1, 4, 6]
    assert [e["kind"] for e in events if e["type"] == "fault"] == [k for k, _, _ in kinds]
    assert len(set(summary["param_checksums"].values())) == 1


def test_bad_input_is_one_error_line_without_a_hang(tmp_path, small_corpus, capsys):
    path = scenario(tmp_path, small_corpus)
    # a region never reaches the quorum service
    env = {**os.environ, "PYTHONPATH": SRC, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_port()), "GEOMESH_REGION": "r0-h100", "OMP_NUM_THREADS": "1"}  # fmt: skip
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "geomesh.run", str(path), "--method", "geomesh", "--out",
                           str(tmp_path / "x"), "--timeout", "5", "--lighthouse", f"http://127.0.0.1:{_port()}"],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode != 0 and len(lines) == 1, done.stderr[-2000:]
    assert "quorum service" in lines[0] and "cannot be reached" in lines[0]
    assert "Traceback" not in done.stderr and time.monotonic() - started < 100
    # elastic regions refuse checkpoints and network namespaces, in one line, before anything starts
    (tmp_path / "f").mkdir()
    faulty = scenario(tmp_path / "f", small_corpus, faults=[{"at_round": 1, "region": "r1-a100", "kind": "leave"}])
    for scen, extra, says in ((path, ["--wan", "netns"], "not with elastic regions"),
                              (path, ["--min-regions", "4"], "reliability.min_regions: 4 is not allowed"),
                              (faulty, ["--min-regions", "0"], "leave/join faults need elastic regions")):  # fmt: skip
        code = cli_launch.main([*argv(scen, tmp_path / "y", 3840), *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and says in err[0], err


@pytest.mark.waits
def test_regions_running_different_jobs_stop_with_one_error_each(tmp_path, small_corpus):
    """Two regions started by hand (as two torchruns would) with different seeds: the header exchange over the
    quorum compares a hash of scenario, method, seed and budget; the odd region stops with one line, and the
    other, now short of min_regions, stops when its quorum times out. Nothing hangs."""
    from geomesh.runtime.distributed.service import start_lighthouse

    path = scenario(tmp_path, small_corpus)
    lighthouse = start_lighthouse(2, 20.0)
    port = lighthouse.address().rsplit(":", 1)[-1]
    procs = []
    try:
        for region, seed in (("r0-h100", "0"), ("r1-a100", "7")):
            env = {**os.environ, "PYTHONPATH": SRC, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(_port()), "GEOMESH_REGION": region, "OMP_NUM_THREADS": "1",
                   "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "GEOMESH_ADVERTISE_HOST": "127.0.0.1"}  # fmt: skip
            procs.append(subprocess.Popen([sys.executable, "-m", "geomesh.run", str(path), "--method", "geomesh",
                                           "--out", str(tmp_path / region), "--seed", seed, "--timeout", "20",
                                           "--quiet"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))  # fmt: skip
        outs = [p.communicate(timeout=150)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
        lighthouse.shutdown()
    errors = [[ln for ln in err.splitlines() if ln.startswith("error:")] for err in outs]
    assert [p.returncode != 0 for p in procs] == [True, True], outs
    assert all(len(e) == 1 for e in errors), errors
    assert "region r1-a100 runs a different scenario, method, seed or token budget" in errors[1][0]
    assert "no quorum of at least 2 region(s)" in errors[0][0]
    assert not any("Traceback" in err for err in outs), outs


def test_a_region_that_cannot_fit_the_model_is_one_error(tmp_path, small_corpus):
    path = scenario(tmp_path, small_corpus)
    result = cli_launch.launch(cli_launch.build_parser().parse_args(
        [*argv(path, tmp_path / "run", 3840), "--set", "timing_model.n_layers=24", "--set", "timing_model.hidden=2048"]),
        extra_env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert result.code == 2 and result.message.startswith("region r2-t4: the timing model does not fit"), result.message


def kill_all(tag: str) -> None:
    for pid in processes(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def print_stacks(pids) -> None:
    """Each rank in ``pids`` prints every thread's stack to its output (``SIGUSR1``, geomesh.cli.rank)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(2.0)


def stderr_or_stacks(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, str]:
    """Each process's stderr once they have all ended within ``timeout`` seconds (together). Otherwise the
    test fails with the stacks of those still running (``SIGUSR1``: each rank prints every thread's stack), so
    that a hang names the call it is waiting in."""
    deadline, errs = time.monotonic() + timeout, {}
    for name, p in procs.items():
        try:
            errs[name] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[1]
        except subprocess.TimeoutExpired:
            break
    else:
        return errs
    hung = [name for name, p in procs.items() if p.poll() is None]
    print_stacks([procs[name].pid for name in hung])
    stacks = {}
    for name in hung:
        procs[name].kill()
        stacks[name] = procs[name].communicate()[1][-6000:]
    pytest.fail(f"still running after {timeout:g}s: {', '.join(hung)}; their stderr, stacks last:\n"
                + "\n".join(f"===== {name}\n{err}" for name, err in stacks.items()))


def launch_output_or_stacks(proc: subprocess.Popen, tag: str, out: Path, timeout: float) -> tuple[str, str]:
    """The launcher's (stdout, stderr) once it has ended within ``timeout`` seconds. Otherwise the test fails
    with the stack of every rank still running (``SIGUSR1``, printed into ``out/logs/rank<k>.log``), so that a
    hung run names the call each rank waits in."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    print_stacks(set(processes(tag)) - {proc.pid})  # the ranks (the launcher's default for SIGUSR1 is to end)
    proc.kill()
    logs = {f.name: f.read_text(errors="replace")[-5000:] for f in sorted((out / "logs").glob("rank*.log"))}
    events = (out / "events.jsonl").read_text()[-3000:] if (out / "events.jsonl").exists() else ""
    pytest.fail(f"the launcher still ran after {timeout:g}s; launcher: {proc.communicate()[1][-2000:]}\n"
                f"events: {events}\n"
                + "\n".join(f"===== {name}\n{log}" for name, log in logs.items()))


def _port() -> int:
    from geomesh.runtime.distributed.transport import free_port

    return free_port()


@pytest.mark.parametrize("flag", ["--region"])
def test_a_rank_must_know_its_region(tmp_path, small_corpus, flag):
    path = scenario(tmp_path, small_corpus)
    env = {k: v for k, v in os.environ.items() if k != "GEOMESH_REGION"}
    env.update({"PYTHONPATH": SRC, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    done = subprocess.run([sys.executable, "-m", "geomesh.run", str(path), "--method", "geomesh", "--out",
                           str(tmp_path / "x"), flag, "mars"], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: region 'mars'")


def test_an_overlapped_elastic_run_rolls_back_a_lone_failure_and_survives_a_killed_region(tmp_path, small_corpus):
    """`geomesh-overlap` with elastic regions and the plan loop on (calibration and re-planning: what users run):
    each exchange leaves at its own quorum and runs under the next round's compute; each exchange is voted on.
    1. r0-h100's leader, the one that writes events.jsonl, loses round 2's exchange after every payload
       arrived (the test hook): it votes no, so no region applies round 2 (a `rollback` record) and nobody
       falls behind.
    2. r1-a100 SIGKILLed later fails the exchange in flight: rolled back on the survivors, who go on without it.
    Each round's header is shipped at the quorum of the exchange before it (the round starts with its members).
    The survivors finish with equal θ, and no region refused a payload."""
    path = scenario(tmp_path, small_corpus, slowdown=2.0, plan_loop=True)
    out, tag = tmp_path / "run", uuid.uuid4().hex
    proc = start(argv(path, out, 7680 * 2, method="geomesh-overlap"), tag, out,
                 extra_env={"GEOMESH_TEST_LOSE_EXCHANGE": "r0-h100:2", **hang_at("r1-a100", "send", 6)},
                 forked=True)  # fmt: skip
    try:  # (lost with its round 6 trained and its exchange not launched, round 5's in flight)
        kill_hung_region(tag, out, proc, "r1-a100", [1], "send", 6, forked=True)
        stdout, stderr = launch_output_or_stacks(proc, tag, out, 240)
    finally:
        proc.kill()
        kill_all(tag)
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["overlap"] is True
    events = read_events(out / "events.jsonl")
    rolled_back = [e["round"] for e in events if e["type"] == "rollback"]
    assert rolled_back[0] == 2 and all(r >= 5 for r in rolled_back[1:]), rolled_back  # (the kill: after round 5)
    recorded = sorted([e["round"] for e in events if e["type"] == "round"] + rolled_back)
    assert recorded == list(range(1, summary["rounds"] + 1))
    assert not healed_in_place(events)
    assert [e["region"] for e in events if e["type"] == "leave"] == ["r1-a100"]
    # each round's plan came with its header, made by the quorum's maker (the lowest-numbered live region)
    shipped = [e for e in events if e["type"] == "plan" and not e.get("replan")]
    assert shipped and all(e["maker"] == "r0-h100" for e in shipped), shipped
    assert not [e for e in events if e["type"] == "warning"]  # no plan differed, no payload was refused
    el = summary["elastic"]
    assert el["regions_at_end"] == ["r0-h100", "r2-t4"]
    assert summary["tokens"] >= 7680 * 2 and summary["final_val_loss"] is not None
    checksums = summary["param_checksums"]
    assert list(checksums) == ["r0-h100", "r2-t4"] and len(set(checksums.values())) == 1


def test_torchft_reports_a_handled_failure_in_one_line_without_its_traceback(capsys):
    """torchft's Manager logs a failed group set-up with ``logger.exception``; the region handles it (it asks for
    another quorum) and says so itself: torchft's report stays one line, its traceback is not printed, and what it
    logs below ERROR is not printed at all."""
    import logging

    from geomesh.runtime.distributed.torchft_logs import quiet_torchft_logs

    quiet_torchft_logs()
    quiet_torchft_logs()  # (idempotent: one handler)
    log = logging.getLogger("torchft.manager")
    try:
        raise TimeoutError("wait timeout after 60000ms, keys: /torchft/5/0/0/2")
    except TimeoutError as exc:
        log.exception(f"[r1/0 - step 0] got exception in pg configure: {exc}")
    log.info("quorum formed")
    err = capsys.readouterr().err
    assert err == "torchft: [r1/0 - step 0] got exception in pg configure: wait timeout after 60000ms, keys: " \
                  "/torchft/5/0/0/2\n", err  # fmt: skip
