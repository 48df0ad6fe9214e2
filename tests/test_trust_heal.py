"""Healing over the authenticated transport (runtime/distributed/heal.py), and control messages between ranks
(runtime/distributed/transport.py) as frames.

The heal server hands θ, the momentum and the loop's state only to a joiner that proves the run's key; the
joiner takes state only from a server that proves it too, of its own job, and shaped like its own. A rank
with another key is named and refused by the others' object collectives.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import urllib.request
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from geomesh.runtime.distributed.heal import HealError, HealTransport

KEY = b"s" * 32
T = timedelta(seconds=10)


def state(step: int = 3) -> dict:
    torch.manual_seed(0)
    return {"user": {"default": {"params": {"w": torch.randn(5, 4), "b": torch.randn(4)},
                                 "outer": {"lr": 0.7, "momentum": 0.9, "buf": {"w": torch.randn(5, 4),
                                                                              "b": torch.randn(4)}},
                                 "run": {"rounds": step, "records": [{"type": "round", "round": step}],
                                         "slowdown": {0: 1.0, 1: 2.0}}}},
            "torchft": {"step": step, "batches_committed": step}}  # fmt: skip


def own_state() -> dict:  # a joiner's own state: the same model, other values
    s = state(0)
    for part in (s["user"]["default"]["params"], s["user"]["default"]["outer"]["buf"]):
        for k in part:
            part[k] = torch.zeros_like(part[k])
    return s


@pytest.fixture
def servers():
    made = []

    def make(key=KEY, run_id="job-1", expected=own_state, region=0):
        t = HealTransport(host="127.0.0.1", key=key, run_id=run_id, region=region, name=f"r{region}",
                          expected=expected)  # fmt: skip
        made.append(t)
        return t

    yield make
    for t in made:
        t.shutdown()


def settle(done, within_s: float = 10.0) -> None:
    """Wait (bounded) for the server's thread to count what the client has already seen the end of."""
    deadline = time.monotonic() + within_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_joiner_with_the_key_receives_the_state_and_it_is_bit_identical(servers):
    live, joiner = servers(region=0), servers(region=1)
    # the joiner may ask before the live region has staged the round: it waits for it
    threading.Timer(0.5, live.send_checkpoint, args=([1], 3, state(), T)).start()
    got = joiner.recv_checkpoint(0, live.metadata(), 3, T)
    want = state()
    for part in ("params", "outer"):
        a, b = got["user"]["default"][part], want["user"]["default"][part]
        tensors = a if part == "params" else a["buf"]
        for k, v in tensors.items():
            assert torch.equal(v, (b if part == "params" else b["buf"])[k])
    assert got["user"]["default"]["run"] == want["user"]["default"]["run"]
    assert got["torchft"] == {"step": 3, "batches_committed": 3}
    settle(lambda: live.served >= 1)  # the joiner may hold the last byte before the server's thread counts it
    assert live.served == 1 and live.refused == 0
    assert live.metadata().startswith("geomesh-heal://127.0.0.1:")
    assert live._listener._sock.getsockname()[0] == "127.0.0.1"  # bound to the advertised address, not the wildcard


def test_a_joiner_without_the_key_receives_nothing(servers, capsys):
    live, stranger = servers(), servers(key=b"w" * 32, region=1)
    live.send_checkpoint([1], 3, state(), T)
    with pytest.raises(HealError, match="refused: no proof of the run's key"):
        stranger.recv_checkpoint(0, live.metadata(), 3, T)
    assert live.refused == 1 and live.served == 0
    assert "refused a recovery request from 127.0.0.1" in capsys.readouterr().err


def test_what_an_outsider_sees_before_proving_the_key_is_a_nonce(servers):
    """A raw client that answers the challenge with garbage, and torchft's own HTTP client: neither gets a
    byte of state (the server speaks first, 32 random bytes and the run id, then refuses)."""
    live = servers()
    live.send_checkpoint([1], 3, state(), T)
    host, port = live.metadata()[len("geomesh-heal://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        received = b""
        s.sendall(b"GMHJ" + bytes(32) + struct.pack("<Q", 3) + bytes(32))
        while chunk := s.recv(65536):
            received += chunk
    assert len(received) < 120 and b"no proof of the run's key" in received
    with pytest.raises(Exception):
        urllib.request.urlopen(f"http://{host}:{port}/checkpoint/3/full", timeout=10).read()
    # the HTTP client gives up on reading the server's greeting, maybe before the server's thread has read the
    # request and counted the refusal
    settle(lambda: live.refused >= 2)
    assert live.served == 0 and live.refused == 2


def test_a_server_without_the_key_cannot_feed_a_joiner(servers):
    """A stranger posing as a live region (it registered with the quorum service and claims a higher step)."""
    fake, joiner = servers(key=b"w" * 32), servers(region=1)
    fake.send_checkpoint([1], 3, state(), T)
    with pytest.raises(HealError, match="refused|did not prove the run's key"):
        joiner.recv_checkpoint(0, fake.metadata(), 3, T)
    with pytest.raises(HealError, match="not over the authenticated transport"):
        joiner.recv_checkpoint(0, "http://127.0.0.1:1/checkpoint/", 3, T)


def test_another_job_is_named_and_its_state_not_taken(servers):
    live, joiner = servers(run_id="job-2"), servers(region=1)
    live.send_checkpoint([1], 3, state(), T)
    with pytest.raises(HealError, match="runs another job"):
        joiner.recv_checkpoint(0, live.metadata(), 3, T)


def test_only_the_staged_round_is_served_and_only_while_it_is(servers):
    live, joiner = servers(), servers(region=1)
    live.stage_wait_s = 0.5  # how long a request waits for its round to be staged
    with pytest.raises(HealError, match="round 3 is not being served"):
        joiner.recv_checkpoint(0, live.metadata(), 3, T)
    live.send_checkpoint([1], 3, state(), T)
    with pytest.raises(HealError, match="round 4 is not being served"):
        joiner.recv_checkpoint(0, live.metadata(), 4, T)
    live.disallow_checkpoint()
    with pytest.raises(HealError, match="not being served"):
        joiner.recv_checkpoint(0, live.metadata(), 3, T)


def test_a_state_that_does_not_fit_the_joiner_s_model_is_refused(servers):
    live = servers()
    small = own_state()
    small["user"]["default"]["params"]["w"] = torch.zeros(2, 2)
    del small["user"]["default"]["outer"]["buf"]["b"]  # a fresh optimizer holds no momentum yet: not a misfit
    joiner = servers(expected=lambda: small, region=1)
    live.send_checkpoint([1], 3, state(), T)
    with pytest.raises(HealError, match="does not fit this region's model"):
        joiner.recv_checkpoint(0, live.metadata(), 3, T)


# ---- control messages between ranks ----------------------------------------------------------------------


def _ranks_with_keys(rank: int, world: int, init: str, keys: list[bytes], out, rounds=(3, 3)) -> None:
    from geomesh.runtime.distributed.transport import FrameRejected, Transport

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    t = Transport(torch.device("cpu"), "gloo", 30.0, key=keys[rank], run_id="job-1")
    got = t.all_gather_json({"rank": rank, "crc": "ab"}, None, world, what="the round's info")
    out.put((rank, "json", got, [r["reason"] for r in t.rejected]))
    # rank 0 sends a payload, rank 1 "no update" (which a stranger must not be able to forge)
    slots = t.all_gather_payloads(b"GMSH" + bytes([rank]) * 12 if rank == 0 else None, 16, None, world, rounds[rank])
    out.put((rank, "payloads", [s if not hasattr(s, "reason") else "rejected: " + s.reason for s in slots], None))
    try:
        t.all_gather_framed({"rank": rank})
        out.put((rank, "object", "accepted", None))
    except FrameRejected as exc:
        out.put((rank, "object", "raised", str(exc)))
    try:
        box = t.broadcast_json({"members": [0, 1]} if rank == 0 else None, 0, None, what="the quorum")
        out.put((rank, "broadcast", box, None))
    except FrameRejected as exc:
        out.put((rank, "broadcast", "raised", str(exc)))
    dist.destroy_process_group()


def _run_ranks(tmp_path, keys: list[bytes], rounds=(3, 3)) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_ranks_with_keys, args=(r, 2, init, keys, out, rounds)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(8):
        rank, what, got, detail = out.get(timeout=120)
        results[(rank, what)] = (got, detail)
    for p in procs:
        p.join(timeout=60)
    return results


def test_ranks_with_the_same_key_exchange_control_messages(tmp_path):
    got = _run_ranks(tmp_path, [KEY, KEY])
    assert got[(0, "json")][0] == [{"rank": 0, "crc": "ab"}, {"rank": 1, "crc": "ab"}]
    assert got[(1, "object")][0] == "accepted"
    assert got[(1, "broadcast")][0] == {"members": [0, 1]}
    assert got[(1, "payloads")][0] == [b"GMSH" + bytes(12), None]  # a payload, and a signed "no update"


def test_a_payload_replayed_from_another_round_is_rejected(tmp_path):
    got = _run_ranks(tmp_path, [KEY, KEY], rounds=(3, 2))  # rank 1 sends what it signed for round 2
    slots = got[(0, "payloads")][0]
    assert slots[0] == b"GMSH" + bytes(12)
    assert slots[1] == "rejected: a payload of round 2 in round 3: replayed or stale"


def test_a_rank_with_another_key_is_named_and_rejected(tmp_path):
    got = _run_ranks(tmp_path, [KEY, b"w" * 32])
    slots, reasons = got[(0, "json")]
    assert slots == [{"rank": 0, "crc": "ab"}, None] and "HMAC tag mismatch" in reasons[0]
    raised, line = got[(0, "object")]
    assert raised == "raised" and line.startswith("rank 1 sent a bad control frame") and "HMAC tag" in line
    # the broadcast's receiver refuses rank 0's frame with one line: it never holds what rank 0 sent
    assert got[(0, "broadcast")][0] == {"members": [0, 1]}
    raised, line = got[(1, "broadcast")]
    assert raised == "raised" and line.startswith("rank 0 sent a bad control frame during the quorum")
    # the "no update" of the rank with another key is not taken for one: it is rejected
    assert got[(0, "payloads")][0][1].startswith("rejected: HMAC tag mismatch")


# ---- which runs need a key -------------------------------------------------------------------------------


def test_a_multi_host_run_needs_a_key_or_an_explicit_opt_out(tiny_scenario, monkeypatch, capsys):
    from geomesh.config import ConfigError
    from geomesh.runtime.distributed import trust
    from geomesh.runtime.distributed import frames
    from geomesh.runtime.distributed.frames import run_trust

    monkeypatch.setattr(frames, "_trust", frames.RunTrust())  # this process's trust comes back after the test
    sc = tiny_scenario()
    for name in ("GEOMESH_LAUNCHER", "GEOMESH_ALLOW_UNSIGNED", "LOCAL_WORLD_SIZE", "GEOMESH_ADVERTISE_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert trust.establish(sc, "geomesh", 0, 1000, elastic=False).key is None  # one host: no key needed
    monkeypatch.setenv("MASTER_ADDR", "node0.example.org")
    with pytest.raises(ConfigError, match=r"this run spans hosts \(MASTER_ADDR=node0.example.org\) but has no key"):
        trust.establish(sc, "geomesh", 0, 1000, elastic=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # every rank of the world on this node
    trust.establish(sc, "geomesh", 0, 1000, elastic=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    # elastic regions that reach the quorum service over loopback are on this machine, however they advertise
    trust.establish(sc, "geomesh", 0, 1000, elastic=True, lighthouse="http://127.0.0.1:29510")
    with pytest.raises(ConfigError, match="the quorum service http://10.77.0.1:29510"):
        trust.establish(sc, "geomesh", 0, 1000, elastic=True, lighthouse="http://10.77.0.1:29510")
    monkeypatch.setenv("GEOMESH_ALLOW_UNSIGNED", "1")
    trust.establish(sc, "geomesh", 0, 1000, elastic=True, lighthouse="http://10.77.0.1:29510")
    assert "warning: running without a key across hosts" in capsys.readouterr().err
    monkeypatch.setenv("GEOMESH_ALLOW_UNSIGNED", "0")
    monkeypatch.setenv("GEOMESH_LAUNCHER", "1")  # `geomesh launch`: every process on this machine
    trust.establish(sc, "geomesh", 0, 1000, elastic=True, lighthouse="http://10.213.0.1:29510")
    # with a key: any hosts, and the run id is the job's hash (the same for every region of the job)
    monkeypatch.delenv("GEOMESH_LAUNCHER")
    monkeypatch.setenv("GEOMESH_TEST_RUN_KEY", "a key of more than sixteen bytes")
    sc.reliability.hmac_key_env = "GEOMESH_TEST_RUN_KEY"
    got = trust.establish(sc, "geomesh", 0, 1000, elastic=True, lighthouse="http://10.77.0.1:29510")
    assert got.key == b"a key of more than sixteen bytes" and got == run_trust()
    assert got.run_id == trust.establish(sc, "geomesh", 0, 1000, elastic=False).run_id
    assert got.run_id != trust.establish(sc, "geomesh", 1, 1000, elastic=False).run_id


# ---- what a region's leader listens on ---------------------------------------------------------------------


def _listening() -> dict[int, str]:
    """This process's listening TCP sockets: port -> address (hex as the kernel writes it, decoded)."""
    import ipaddress
    import os

    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    found = {}
    for table, width in (("/proc/self/net/tcp", 4), ("/proc/self/net/tcp6", 16)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state != "0A" or inode not in mine:
                    continue
                addr, port = local.split(":")
                raw = bytes.fromhex(addr)
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # kernel words, little-endian
                found[int(port, 16)] = str(ipaddress.ip_address(raw if width == 16 else raw[:4]))
    return found


def test_a_leader_s_servers_listen_on_the_advertised_address_only(monkeypatch):
    from torch.distributed import TCPStore

    from geomesh.runtime.distributed.membership import Membership
    from geomesh.runtime.distributed.service import start_lighthouse

    monkeypatch.setenv("GEOMESH_ADVERTISE_HOST", "127.0.0.1")
    lighthouse = start_lighthouse(1, 10.0)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # PyTorch's: every interface
    m = Membership(region=0, name="r0", lighthouse=f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[-1]}",
                   min_regions=1, deadline_s=10, quorum_timeout_s=10, state_dict=dict, load_state_dict=lambda s: None,
                   store_addr="127.0.0.1", store_port=store.port)  # fmt: skip
    try:
        ours = {p: a for p, a in _listening().items() if p != store.port}
        assert len(ours) >= 3, ours  # the Lighthouse, torchft's manager server, the recovery server
        assert set(ours.values()) == {"127.0.0.1"}, ours
        assert m.heal.port in ours
    finally:
        m.shutdown()
        lighthouse.shutdown()


def test_a_cluster_lighthouse_needs_the_address_to_listen_on(monkeypatch, capsys):
    from geomesh.runtime.distributed import service

    monkeypatch.delenv("GEOMESH_ADVERTISE_HOST", raising=False)
    assert service.main(["--min-regions", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --host: the address to listen on is needed")
    assert service.main(["--min-regions", "2", "--host", "no-such-host.invalid"]) == 2
    assert "does not resolve on this host" in capsys.readouterr().err


@pytest.mark.parametrize("value, expected", [(2, 2), (0, 0), (3, None), (-1, None), (True, None), (1.0, None),
                                             ("1", None), (None, None), ([1], None)])  # fmt: skip
def test_a_healing_state_s_round_plan_is_an_index_of_its_plans_or_ignored(value, expected):
    """The plan a live region's round in progress runs comes in its healing state as an index of the plans that
    state carries (the healed region measures that round's exchange against it): anything else a peer sends is
    left out, and the healed region takes the plan in force."""
    from geomesh.runtime.distributed.elastic_state import round_plan_index

    assert round_plan_index(value, 3) == expected
