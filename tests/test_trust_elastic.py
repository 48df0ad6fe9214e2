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

from test_elastic import SRC, _kill_all, _port, processes, scenario, start, wait_for_round

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
    gather(pickle.dumps(Evil()))  # the header: a pickle that would run code on every leader
    gather(forged)  # the envelope: a frame with a forged tag
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


def test_an_outsider_on_the_quorum_service_gets_nothing_and_runs_nothing(tmp_path, small_corpus, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "the run's secret, 32 bytes long!")
    path = keyed_scenario(tmp_path, small_corpus)
    out, tag = tmp_path / "run", uuid.uuid4().hex
    report, marker = tmp_path / "intruder.json", tmp_path / "code-ran"
    script = tmp_path / "intruder.py"
    script.write_text(INTRUDER)
    # 48 short rounds of the two regions: room for the outsider to start and join
    proc = start(launch_argv(path, out, 7680 * 8), tag, out)
    try:
        wait_for_round(out, proc, 1)
        lighthouse = rank_env(tag, "r0-h100")["TORCHFT_LIGHTHOUSE"]
        intruder = subprocess.run([sys.executable, str(script), lighthouse, str(report), str(marker)],
                                  env={**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "RUST_LOG": "error"},
                                  capture_output=True, text=True, timeout=300)  # fmt: skip
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        proc.kill()
        _kill_all(tag)
    assert proc.returncode == 0, stderr[-3000:]
    seen = json.loads(report.read_text())
    assert seen["heal"], (seen, intruder.stderr[-2000:])  # it was offered recovery
    for attempt in seen["heal"]:
        assert attempt["metadata"].startswith("geomesh-heal://127.0.0.1:")
        assert attempt["http"].startswith("failed")
        # the challenge and the refusal, nothing else: not one byte of θ (the model has 270k parameters)
        assert attempt["received_bytes"] < 200 and "no proof of the run's key" in attempt["reply"]
    assert seen["gathers"] >= 2 and seen["members"] == 3, seen  # it took part in the leaders' exchanges
    assert not marker.exists()  # the pickle never ran
    logs = rank_logs(out)
    assert "refused a recovery request from 127.0.0.1" in logs
    assert "rejected a frame from quorum member" in logs and "not a frame (bad magic)" in logs
    assert "HMAC tag mismatch" in logs or "oversize frame: it claims 1099511627776 bytes" in logs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["elastic"]["regions_at_end"] == ["r0-h100", "r1-a100"]
    assert len(set(summary["param_checksums"].values())) == 1
    assert summary["tokens"] >= 7680 * 8


def test_a_second_copy_of_a_live_region_exits_with_one_line_and_the_run_goes_on(tmp_path, small_corpus,
                                                                                 monkeypatch):  # fmt: skip
    monkeypatch.setenv(KEY_ENV, "the run's secret, 32 bytes long!")
    path = keyed_scenario(tmp_path, small_corpus)
    out, tag = tmp_path / "run", uuid.uuid4().hex
    proc = start(launch_argv(path, out, 7680 * 8), tag, out)
    try:
        wait_for_round(out, proc, 1)
        original = Path("/proc") / str(processes(tag, "r1-a100")[0])
        cmd = [a.decode() for a in (original / "cmdline").read_bytes().split(b"\0") if a]
        env = {**rank_env(tag, "r1-a100"), "MASTER_PORT": str(_port()), "GEOMESH_TEST_TAG": "copy"}
        copy = subprocess.run(cmd, env=env, cwd=os.readlink(original / "cwd"), capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        proc.kill()
        _kill_all(tag)
    assert proc.returncode == 0, stderr[-3000:]
    errors = [ln for ln in copy.stderr.splitlines() if ln.startswith("error:")]
    assert copy.returncode != 0 and len(errors) == 1, copy.stderr[-3000:]
    assert "region r1-a100 is already running" in errors[0] and "Traceback" not in copy.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["elastic"]["regions_at_end"] == ["r0-h100", "r1-a100"]
    assert "a second live instance of region 1" in rank_logs(out)
