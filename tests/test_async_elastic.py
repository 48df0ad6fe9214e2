"""The asynchronous baseline (``async-local-sgd``) with elastic regions: every region its own world, reaching the
parameter server over an authenticated session of its own (its address on the quorum service's board). A launch
trains to the budget and ends every region on the server's θ; a region lost mid-run leaves the others going, and
started again with its own command it rejoins from the live θ; whoever cannot prove the run's key is refused."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import uuid

import pytest
import torch
import yaml
from test_async_distributed import METHOD, async_launch
from test_distributed import write_scenario
from test_elastic import hang_at, kill_all, kill_hung_region, start
from test_hosts import NAMES, REASON, one_checksum, records, run_bed

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


def slowed_launch(tmp_path, small_corpus, slowed: list[int], hook: dict[str, str], min_regions: int = 3,
                  tokens: int = 60000):  # fmt: skip
    """A launch of three elastic regions, its own process (so that one region can be killed), ``slowed`` regions'
    inner steps padded with sleep (it costs no CPU), ``hook`` in its environment: (the launcher, its folder, its
    tag)."""
    path = write_scenario(tmp_path, small_corpus, ("H100", "A100", "T4"))
    data = yaml.safe_load(path.read_text())
    for i in slowed:
        data["regions"][i]["slowdown"] = 100
    path.write_text(yaml.safe_dump(data))
    out, tag = tmp_path / "run", uuid.uuid4().hex
    argv = ["launch", str(path), "--nproc", "3", "--method", METHOD, "--out", str(out), "--tokens", str(tokens),
            "--min-regions", str(min_regions), "--quiet", "--wan", "none", "--timeout", "90"]  # fmt: skip
    return start(argv, tag, out, extra_env=hook), out, tag


def lose_hung_region(proc, out, tag: str, region: str, rank: int, round_number: int) -> str:
    """Kill ``region`` (its one rank), hung at the send of its cycle ``round_number``, and wait for the launch to
    end (no process of the tag outlives it): the launch's stderr."""
    try:
        kill_hung_region(tag, out, proc, region, [rank], "send", round_number)
        return proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
        kill_all(tag)


@pytest.mark.waits
def test_a_region_lost_mid_run_is_waited_for_below_min_regions_and_started_again_it_rejoins(tmp_path, small_corpus):
    """Region r2-t4 is lost at a known point (trained its second cycle, its push not sent: it hangs there and is
    killed), with ``--min-regions 3``: the server holds every push until three regions are connected again (a
    ``leave`` record). Started again with its own command, it connects, pulls the live θ (its welcome: the tokens
    applied so far, not θ0) and trains on to the end, on the server's θ. (Held, not raced: however long its
    restart takes, the budget cannot run out before it is back.)"""
    proc, out, tag = slowed_launch(tmp_path, small_corpus, [0, 1], hang_at("r2-t4", "send", 2))
    restarted = None
    try:
        (lost,) = kill_hung_region(tag, out, proc, "r2-t4", [2], "send", 2)
        env = {k: v for k, v in lost["env"].items() if k != "GEOMESH_FAULT_HOOKS"}  # (it does not hang again)
        restarted = subprocess.Popen(lost["cmd"], env=env, cwd=lost["cwd"], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            _, stderr = proc.communicate(timeout=600)
            log = restarted.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            restarted.kill()
            pytest.fail(f"the run did not end: {proc.communicate()[1][-2000:]}; {restarted.communicate()[0][-2000:]}")
    finally:
        proc.kill()
        if restarted is not None:
            restarted.kill()
        kill_all(tag)
    assert proc.returncode == 0, stderr[-3000:]
    assert restarted.returncode == 0, log[-3000:]
    assert "warning: region r2-t4 was lost" in stderr and "it was restarted and rejoined" in stderr
    summary = json.loads((out / "summary.json").read_text())
    el = summary["elastic"]
    assert el["leaves"] == 1 and el["joins"] == 1 and el["regions_at_end"] == ["r0-h100", "r1-a100", "r2-t4"]
    assert summary["tokens"] >= 60000 and len(set(summary["param_checksums"].values())) == 1
    events = read_events(out / "events.jsonl")
    leave = next(e for e in events if e["type"] == "leave")
    join = next(e for e in events if e["type"] == "join")
    assert leave["region"] == join["region"] == "r2-t4" and 1 <= leave["round"] <= join["round"]
    # the restarted region trained from the live θ and ended on the server's
    rounds = [e for e in events if e["type"] == "round"]
    assert [e["members"] for e in rounds if e["round"] >= join["round"]].count(["r2-t4"]) >= 1
    assert ended_on(log) == {"r2-t4": summary["param_checksums"]["r0-h100"]}, log[-2000:]


@pytest.mark.waits
def test_a_region_lost_mid_run_leaves_the_others_going_at_min_regions(tmp_path, small_corpus):
    """Region r2-t4 is lost at a known point and not started again, with ``--min-regions 2``: the server and
    r1-a100 go on without waiting for it (a ``leave`` record) and spend the budget; the launch ends with exit 0,
    and the two that finished hold the server's θ."""
    proc, out, tag = slowed_launch(tmp_path, small_corpus, [0, 1], hang_at("r2-t4", "send", 2), min_regions=2,
                                   tokens=15000)  # (the two slowed ones spend it alone)
    stderr = lose_hung_region(proc, out, tag, "r2-t4", 2, 2)
    assert proc.returncode == 0, stderr[-3000:]
    assert "warning: region r2-t4 was lost" in stderr
    summary = json.loads((out / "summary.json").read_text())
    el = summary["elastic"]
    assert el["leaves"] == 1 and el["joins"] == 0 and el["regions_at_end"] == ["r0-h100", "r1-a100"]
    assert summary["tokens"] >= 15000 and len(set(summary["param_checksums"].values())) == 1


@pytest.mark.waits
def test_when_the_servers_region_dies_the_others_stop_with_one_line(tmp_path, small_corpus):
    """The parameter server's region is lost (hung after its first cycle, then killed): θ lived only there, so
    each other region stops at its next push with one ``error:`` line that says so, and the launch fails."""
    proc, out, tag = slowed_launch(tmp_path, small_corpus, [1, 2], hang_at("r0-h100", "send", 1))
    lose_hung_region(proc, out, tag, "r0-h100", 0, 1)
    assert proc.returncode == 1 and not (out / "summary.json").exists()
    for k, name in ((1, "r1-a100"), (2, "r2-t4")):
        errors = [line for line in (out / "logs" / f"rank{k}.log").read_text().splitlines() if "error" in line]
        assert len(errors) == 1 and "the parameter server (region r0-h100) is gone" in errors[0], errors
        assert "no second server" in errors[0] and "Traceback" not in (out / "logs" / f"rank{k}.log").read_text()


@pytest.mark.bed
@pytest.mark.waits
@pytest.mark.skipif(REASON is not None, reason=f"the hosts test bed cannot run here: {REASON}")
def test_on_the_hosts_bed_a_lost_host_restarted_with_its_folder_pulls_the_live_theta(tmp_path, small_corpus):
    """Three hosts, each region its own torchrun, address and folder, the quorum service alone: r2's host is
    lost once the server recorded its second arrival and started again with its folder; it connects anew and
    trains on. Every host ends with exit 0 on one θ; each host's own folder holds its records and summary."""
    path = write_scenario(tmp_path, small_corpus, ("H100", "A100", "T4"))
    data = yaml.safe_load(path.read_text())
    for region in data["regions"][:2]:  # (the budget must outlast r2's loss at round 2: sleep, no CPU; its
        # restart is waited for: min_regions 3)
        region["slowdown"] = 100
    data["reliability"] = {"min_regions": 3}
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "bed"
    result = run_bed(path, out, METHOD, "--tokens", "60000", "--min-regions", "3", "--lose", "r2-t4@2")
    assert [f["kind"] for f in result["faults"]] == ["lose"] and result["hosts"]["r2-t4"]["starts"] == 2
    one_checksum(result)
    summary = json.loads((out / "r0-h100" / "run" / "summary.json").read_text())
    assert summary["elastic"]["joins"] == 1 and summary["elastic"]["regions_at_end"] == NAMES
    assert {e["region"] for e in records(out, "r0-h100") if e["type"] == "join"} == {"r2-t4"}
    for host in NAMES:
        assert (out / host / "run" / "summary.json").exists()


def test_the_server_serves_only_regions_that_prove_the_key_and_a_session_opens_only_its_own_frames():
    """The parameter server's listener (in this process): a region with the run's key gets a session, and its
    frames open only with that session's key; a peer without the key, or claiming a region the server does not
    serve, is refused with a reason and never served; a push recorded in one session does not open in another (a
    restarted region's session is new), and inside its session it opens only as the push number it was."""
    from geomesh.runtime.distributed.async_link import LinkRefused, ServerLink, connect
    from geomesh.runtime.distributed.async_wire import PUSH, message_width, pack, unpack
    from geomesh.runtime.distributed.frames import Rejected

    like = {"w": torch.zeros(4, 3)}
    width = message_width(like)
    served, done = [], threading.Event()

    def serve(session):  # the server's side: each session's first push, opened with the session's key
        buf = session.recv(30)
        served.append((session.region, session.key, buf))
        done.set()

    key, names = b"k" * 32, ["r0", "r1", "r2"]
    server = ServerLink("127.0.0.1", key=key, run_id="run-a", width=width, regions=[1, 2], names=names, serve=serve)
    try:
        with pytest.raises(LinkRefused, match="no proof of the run's key"):
            connect(server.address(), key=b"x" * 32, run_id="run-a", region=1, width=width)
        with pytest.raises(LinkRefused, match="not one the parameter server serves"):
            connect(server.address(), key=key, run_id="run-a", region=0, width=width)
        with pytest.raises(LinkRefused, match="another job"):
            connect(server.address(), key=key, run_id="run-b", region=1, width=width)
        assert server.refused >= 2 and not served  # (a refusal is counted before it is sent)
        first = connect(server.address(), key=key, run_id="run-a", region=1, width=width)
        push = pack(PUSH, {"delta": {"w": torch.ones(4, 3)}, "info": {}}, region=1, number=0, sender=1,
                    width=width, key=first.key)  # fmt: skip
        first.send(push)
        assert done.wait(30)
        region, session_key, got = served[0]
        assert region == 1 and session_key == first.key
        opened = unpack(PUSH, got, region=1, number=0, sender=1, like=like, key=session_key)
        assert not isinstance(opened, Rejected) and torch.equal(opened["delta"]["w"], torch.ones(4, 3))
        replayed = unpack(PUSH, got, region=1, number=1, sender=1, like=like, key=session_key)
        assert isinstance(replayed, Rejected) and "replayed" in replayed.reason
        again = connect(server.address(), key=key, run_id="run-a", region=1, width=width)  # (restarted)
        assert again.key != first.key
        other = unpack(PUSH, push, region=1, number=0, sender=1, like=like, key=again.key)
        assert isinstance(other, Rejected) and "HMAC" in other.reason
        first.close()
        again.close()
    finally:
        server.shutdown()
