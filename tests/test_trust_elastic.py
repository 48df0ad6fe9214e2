"""The trust boundary against a live elastic run (``geomesh launch`` with ``--min-regions``, the run's key set).

An outsider with nothing but network access to the quorum service registers as a region (torchft lets it),
is behind, and so is offered recovery: it asks for the state with torchft's HTTP client and with a guessed
key, sends a pickle that would run code as its header, a forged frame as its envelope, claims a 1 TiB frame,
and leaves. It receives no model state, nothing it sent runs, the run finishes with exit 0, and every leader
names it as rejected. A second copy of a region started while the region is alive exits with one line; the
run goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_elastic import SRC, kill_all, _port, processes, scenario, start, wait_for_round

KEY_ENV = "GEOMESH_TEST_RUN_KEY"

INTRUDER = r'''
import json, os, pickle, socket, struct, sys, urllib.request
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import AllgatherOptions
from torchft.checkpointing.transport import CheckpointTransport
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from geomesh.runtime.distributed.frames import Context, seal

lighthouse, report_path, marker = sys.argv[1:4]
report = {"heal": [], "gathers": 0}


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))


class Thief(CheckpointTransport):
    """What an outsider does when torchft tells it to recover from a live region."""

    def metadata(self):
        return "http://127.0.0.1:1/checkpoint/"

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
        pass

    def disallow_checkpoint(self):
        pass

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        attempt = {"metadata": metadata}
        host, port = metadata.split("://", 1)[1].rstrip("/").rsplit(":", 1)
        try:  # torchft's own client
            attempt["http"] = len(urllib.request.urlopen(f"http://{host}:{port}/checkpoint/{step}/full",
                                                         timeout=10).read())
        except Exception as exc:
            attempt["http"] = f"failed: {type(exc).__name__}"
        received = b""
        with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as s:  # a guessed key
            s.sendall(b"GMHJ" + os.urandom(32) + struct.pack("<Q", step) + os.urandom(32))
            try:
                while chunk := s.recv(65536):
                    received += chunk
            except OSError:
                pass
        attempt["received_bytes"] = len(received)
        attempt["reply"] = received[-120:].decode(errors="replace")
        report["heal"].append(attempt)
        raise RuntimeError("no state for the outsider")


store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
manager = Manager(pg=pg, load_state_dict=lambda s: None, state_dict=lambda: {}, min_replica_size=1,
                  use_async_quorum=False, timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=120),
                  connect_timeout=timedelta(seconds=30), rank=0, world_size=1, store_addr="127.0.0.1",
                  store_port=store.port, lighthouse_addr=lighthouse, replica_id="region001_r1-a100",
                  hostname="127.0.0.1", heartbeat_interval=timedelta(milliseconds=100), init_sync=False,
                  checkpoint_transport=Thief())
LIMIT = 256 << 20  # what leaders accept by default


def gather(data: bytes, claim: int | None = None):
    n = pg.size()
    size = torch.tensor([len(data) if claim is None else claim], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    pg.allgather([sizes], [size], AllgatherOptions()).wait()
    claims = [int(s) for s in sizes]
    width = max([1] + [c for c in claims if 0 <= c <= LIMIT])
    mine = torch.zeros(width, dtype=torch.uint8)
    if data and len(data) <= width:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(n)]
    pg.allgather([outs], [mine], AllgatherOptions()).wait()
    report["gathers"] += 1
    report["members"] = n


forged = seal({"region": 1, "hash": "x", "wait": False, "healed": False, "payload": pickle.dumps(Evil())},
              ctx=Context("guessed", "quorum", 0, 0), sender=1, key=b"guessed key, not the run's").to_bytes()
try:
    manager.start_quorum(timeout=timedelta(seconds=120))  # recovery is offered, and fails
    gather(pickle.dumps(Evil()))  # the quorum's header: a pickle that would run code on every leader
    gather(forged)  # the round's header: a frame with a forged tag
    gather(forged)  # the envelope
    gather(forged)  # the commit vote
    manager.start_quorum(timeout=timedelta(seconds=120))
    gather(b"", claim=1 << 40)  # the next header: a 1 TiB frame
    gather(b"", claim=1 << 40)
except Exception as exc:
    report["error"] = f"{type(exc).__name__}: {exc}"[:300]
finally:
    with open(report_path, "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    os._exit(0)
'''


def keyed_scenario(tmp_path: Path, corpus: list[str], **extra) -> Path:
    # inner steps padded with sleep (no CPU): a run of about a minute, long enough for a process to join it
    return scenario(tmp_path, corpus, slowdown=10.0, gpus=("H100", "A100"), round_deadline_s=60,
                    hmac_key_env=KEY_ENV, **extra)  # fmt: skip


def launch_argv(path: Path, out: Path, tokens: int) -> list[str]:
    return ["launch", str(path), "--nproc", "2", "--method", "geomesh-sign-only", "--out", str(out), "--tokens",
            str(tokens), "--save-params", "--quiet", "--wan", "none", "--timeout", "90"]  # fmt: skip


def rank_env(tag: str, region: str) -> dict[str, str]:
    pid = processes(tag, region)[0]
    raw = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def rank_logs(out: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((out / "logs").glob("rank*.log")))


OTHER_KEY = {"r0-h100": "the run's secret, 32 bytes long!", "r1-a100": "the run's secret, 32 bytes long!",
             "r2-t4": "another secret, also 32 bytes lo"}  # r2-t4 holds another run key than the live two


def run_regions_by_hand(path: Path, folder: Path, tokens: int, keys: dict[str, str] = OTHER_KEY,
                        timeout_s: int = 60):  # fmt: skip
    """The regions of ``path`` named in ``keys`` started by hand (one rank each, a Lighthouse of this process),
    each with its key from ``keys`` and ``--timeout timeout_s``, each writing into ``folder/<region>``; returns
    each region's exit code and stderr."""
    from test_elastic import TAG_ENV, stderr_or_stacks

    from geomesh.runtime.distributed.service import start_lighthouse

    lighthouse = start_lighthouse(2, 20.0)
    port = lighthouse.address().rsplit(":", 1)[-1].strip("/")
    tag = uuid.uuid4().hex
    procs = {}
    try:
        for region, key in keys.items():
            env = {**os.environ, "PYTHONPATH": SRC, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(_port()), "GEOMESH_REGION": region, "OMP_NUM_THREADS": "1", KEY_ENV: key,
                   "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "GEOMESH_ADVERTISE_HOST": "127.0.0.1",
                   TAG_ENV: tag}  # fmt: skip
            procs[region] = subprocess.Popen([sys.executable, "-m", "geomesh.run", str(path), "--method",
                                              "geomesh-sign-only", "--out", str(folder / region), "--tokens",
                                              str(tokens), "--timeout", str(timeout_s), "--quiet"], env=env,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        errs = stderr_or_stacks(procs, 300)
    finally:
        for p in procs.values():
            p.kill()
        kill_all(tag)
        lighthouse.shutdown()
    return {region: p.returncode for region, p in procs.items()}, errs


@pytest.mark.waits
def test_an_outsider_gets_nothing_and_a_second_copy_exits_while_the_run_goes_on(tmp_path, small_corpus,
                                                                                 monkeypatch):  # fmt: skip
    """Two attacks on one live run, one after the other: the outsider on the quorum service (the module
    docstring), then a second copy of region r1-a100 started with the original's command line."""
    monkeypatch.setenv(KEY_ENV, "the run's secret, 32 bytes long!")
    path = keyed_scenario(tmp_path, small_corpus)
    out, tag = tmp_path / "run", uuid.uuid4().hex
    report, marker = tmp_path / "intruder.json", tmp_path / "code-ran"
    script = tmp_path / "intruder.py"
    script.write_text(INTRUDER)
    # 48 short rounds of the two regions: room for the outsider and then the copy to start and join
    proc = start(launch_argv(path, out, 7680 * 8), tag, out)
    try:
        wait_for_round(out, proc, 1)
        lighthouse = rank_env(tag, "r0-h100")["TORCHFT_LIGHTHOUSE"]
        intruder = subprocess.run([sys.executable, str(script), lighthouse, str(report), str(marker)],
                                  env={**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "RUST_LOG": "error"},
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.poll() is None, "the run ended before the second copy could start"
        original = Path("/proc") / str(processes(tag, "r1-a100")[0])
        cmd = [a.decode() for a in (original / "cmdline").read_bytes().split(b"\0") if a]
        env = {**rank_env(tag, "r1-a100"), "MASTER_PORT": str(_port()), "GEOMESH_TEST_TAG": "copy"}
        copy = subprocess.run(cmd, env=env, cwd=os.readlink(original / "cwd"), capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        proc.kill()
        kill_all(tag)
    assert proc.returncode == 0, stderr[-3000:]
    # the outsider: offered recovery, it received the challenge and the refusal, not one byte of θ
    seen = json.loads(report.read_text())
    assert seen["heal"], (seen, intruder.stderr[-2000:])
    for attempt in seen["heal"]:
        assert attempt["metadata"].startswith("geomesh-heal://127.0.0.1:")
        assert attempt["http"].startswith("failed")
        assert attempt["received_bytes"] < 200 and "no proof of the run's key" in attempt["reply"]  # (270k params)
    assert seen["gathers"] >= 4 and seen["members"] == 3, seen  # it took part in the leaders' exchanges
    assert not marker.exists()  # the pickle never ran
    logs = rank_logs(out)
    assert "refused a recovery request from 127.0.0.1" in logs
    assert "rejected a frame from quorum member" in logs and "not a frame (bad magic)" in logs
    assert "HMAC tag mismatch" in logs or "oversize frame: it claims 1099511627776 bytes" in logs
    # the second copy: one line, no traceback; the original goes on
    errors = [ln for ln in copy.stderr.splitlines() if ln.startswith("error:")]
    assert copy.returncode != 0 and len(errors) == 1, copy.stderr[-3000:]
    assert "region r1-a100 is already running" in errors[0] and "Traceback" not in copy.stderr
    assert "a second live instance of region 1" in logs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["elastic"]["regions_at_end"] == ["r0-h100", "r1-a100"]
    assert len(set(summary["param_checksums"].values())) == 1
    assert summary["tokens"] >= 7680 * 8


def test_an_elastic_region_with_another_key_is_rejected_named_and_stops_alone(tmp_path, small_corpus):
    """Three regions started by hand, r2-t4 with another key. The live two reject its frames, naming it by the
    region its frame claims, do not wait for it, and finish with exit 0; it authenticates neither of them and
    stops with one error. No live leader meets a torn-down group when it leaves."""
    from geomesh.telemetry import read_events

    # one CPU-bound round a region (no sleep padding): the live regions' 3 rounds are short
    path = scenario(tmp_path, small_corpus, round_deadline_s=60, hmac_key_env=KEY_ENV)
    codes, errs = run_regions_by_hand(path, tmp_path, 3840)
    assert codes["r0-h100"] == 0 and codes["r1-a100"] == 0, errs
    assert not any("Traceback" in e or "process group not initialized" in e for e in errs.values()), errs
    odd = [ln for ln in errs["r2-t4"].splitlines() if ln.startswith("error:")]
    assert codes["r2-t4"] != 0 and len(odd) == 1, errs["r2-t4"][-3000:]
    assert "region r2-t4 cannot authenticate the frames of regions r0-h100, r1-a100" in odd[0]
    for live in ("r0-h100", "r1-a100"):
        assert f"warning: region {live}: rejected a frame from region r2-t4 (claimed, unauthenticated" in errs[live]
    events = read_events(tmp_path / "r0-h100" / "events.jsonl")
    rounds = [e for e in events if e["type"] == "round"]
    assert rounds and all("r2-t4" not in r["members"] for r in rounds)
    named = [f for f in rounds[0]["frames_rejected"] if f["region"] == "r2-t4"]
    assert named and named[0]["claimed"] and "HMAC tag mismatch" in named[0]["reason"]
    summary = json.loads((tmp_path / "r0-h100" / "summary.json").read_text())
    assert summary["elastic"]["regions_at_end"] == ["r0-h100", "r1-a100"]
    assert len(set(summary["param_checksums"].values())) == 1


@pytest.mark.waits
def test_a_region_with_another_key_does_not_count_towards_the_quorum(tmp_path, small_corpus):
    """r0-h100 and r2-t4, with another key, alone (min_regions 2): torchft forms quorums of the two, but neither
    region may train on in them (it would commit rounds alone, and r1-a100 would then have to heal across
    them). Both wait for a quorum of two regions that hold its key, and stop with one error each: the first
    to give up says why; the other may then find no quorum at all."""
    from geomesh.telemetry import read_events

    path = scenario(tmp_path, small_corpus, round_deadline_s=60, hmac_key_env=KEY_ENV)
    keys = {r: OTHER_KEY[r] for r in ("r0-h100", "r2-t4")}
    codes, errs = run_regions_by_hand(path, tmp_path, 3840, keys, timeout_s=8)
    for region in keys:
        lines = [ln for ln in errs[region].splitlines() if ln.startswith("error:")]
        assert codes[region] != 0 and len(lines) == 1, errs[region][-3000:]
        assert "Traceback" not in errs[region]
    why = [r for r in keys if "no quorum of at least 2 region(s) that hold the run's key" in errs[r]]
    assert why, errs
    other = {"r0-h100": "r2-t4", "r2-t4": "r0-h100"}
    assert all(f"whose frames do not authenticate: {other[r]}" in errs[r] for r in why), errs
    assert not (tmp_path / "r0-h100" / "summary.json").exists()
    events = tmp_path / "r0-h100" / "events.jsonl"
    assert not events.exists() or not any(e["type"] == "round" for e in read_events(events))


class _ScriptedGroup:
    """The quorum's group as leader 0 sees it, without a network: member k > 0 sends ``frames[k - 1]``."""

    def __init__(self, frames: list[bytes]):
        self.frames = frames

    def size(self) -> int:
        return 1 + len(self.frames)

    def allgather(self, outs, ins, opts):
        import torch

        outs, mine = outs[0], ins[0]
        if mine.dtype == torch.int64:  # the sizes
            for o, n in zip(outs, [int(mine[0])] + [len(f) for f in self.frames]):
                o.fill_(n)
        else:
            outs[0].copy_(mine)
            for o, f in zip(outs[1:], self.frames):
                o.zero_()
                o[: len(f)] = torch.frombuffer(bytearray(f), dtype=torch.uint8)

        class Done:
            def wait(self):
                return True

        return Done()


def test_an_envelope_replayed_in_a_later_round_or_another_slot_is_rejected_and_named(capsys):
    from types import SimpleNamespace

    from geomesh.runtime.distributed.frames import Context, seal
    from geomesh.runtime.distributed.membership import Membership

    key, run_id = b"the run's secret, 32 bytes long!", "run-1"
    m = Membership.__new__(Membership)  # a leader's membership, its torchft parts replaced by the script
    step = {"now": 2}
    m.manager = SimpleNamespace(current_step=lambda: step["now"])
    m.key, m.run_id, m.frame_limit, m.region, m.name = key, run_id, 1 << 20, 0, "r0-h100"
    m.names = ["r0-h100", "r1-a100", "r2-t4"]
    m.rejected, m.rejected_frames, m.instance, m.first_step, m.control_bytes = [], 0, "me", 0, 0
    m._quorum_id, m._seq = 7, 0

    def envelope(round_: int, seq: int, region: int = 1) -> bytes:
        ctx = Context(run_id, "quorum", round_, 7 * 65536 + seq)
        return seal({"region": region, "payload": b"GMSH" + bytes(12)}, ctx=ctx, sender=region, key=key,
                    meta={"instance": f"i{region}", "first_step": 0}).to_bytes()  # fmt: skip

    round2 = envelope(2, 1)
    m.pg = _ScriptedGroup([round2])
    got = m.all_gather_framed({"region": 0, "payload": b"mine"})
    assert [g["region"] for g in got] == [0, 1] and not m.rejected  # genuine: accepted
    # the next round: member 1's envelope of round 2 sent again
    step["now"], m._seq = 3, 0
    m.pg = _ScriptedGroup([round2])
    got = m.all_gather_framed({"region": 0, "payload": b"mine"})
    assert [g["region"] for g in got] == [0]
    assert m.rejected[0]["name"] == "r1-a100" and not m.rejected[0]["claimed"]
    assert "replayed or stale" in m.rejected[0]["reason"]
    # this round's genuine envelope of region 1, also put in member 2's place
    m._seq = 0
    now = envelope(3, 1)
    m.pg = _ScriptedGroup([now, now])
    got = m.all_gather_framed({"region": 0, "payload": b"mine"})
    assert [g["region"] for g in got] == [0, 1] and [r["slot"] for r in m.rejected] == [2]
    # a frame signed for region 1 whose message says it is region 2
    m._seq = 0
    lying = seal({"region": 2, "payload": b""}, ctx=Context(run_id, "quorum", 3, 7 * 65536 + 1), sender=1, key=key)
    m.pg = _ScriptedGroup([lying.to_bytes()])
    got = m.all_gather_framed({"region": 0, "payload": b"mine"})
    assert [g["region"] for g in got] == [0] and "signed for region 1" in m.rejected[0]["reason"]
    err = capsys.readouterr().err
    assert "rejected a frame from region r1-a100 (quorum member 1): frame of round 2" in err


def test_a_members_malformed_spans_are_skipped_and_its_good_ones_recorded():
    """A member's spans are data in its signed round info: a span of an unknown kind, a wrong shape or a string
    for a time is left out of the records, never raised on; its well-formed spans are recorded."""
    from geomesh.runtime.distributed.clock import record_spans
    from geomesh.runtime.distributed.records import Records
    from geomesh.telemetry import Telemetry

    records: list[dict] = []
    telemetry = Telemetry(None, sinks=[Records(records)])  # a leader's records
    spans = [["compute", 0.0, 1.5, 0], ["rm -rf", 0.0, 1.0, 0], ["comm_wait", "soon", 2.0, 0], ["compute", 1.0],
             "compute", ["comm_wait", 1.5, 2.0, 0], ["compute", 3.0, 2.0, 1]]  # fmt: skip
    record_spans(telemetry, "r1-a100", spans)
    record_spans(telemetry, "r1-a100", {"not": "a list"})
    got = [(r["worker"], r["kind"], r["start"], r["end"]) for r in records if r["type"] == "span"]
    assert got == [("r1-a100", "compute", 0.0, 1.5), ("r1-a100", "comm_wait", 1.5, 2.0)]
