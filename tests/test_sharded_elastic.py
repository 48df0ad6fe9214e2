"""The sharded exchange between elastic regions (runtime/distributed/sharded.py over torchft's quorum).

Real ``geomesh launch`` runs of 3 regions over Gloo on this machine, with ``--min-regions`` (torchft's
Lighthouse and Managers): kept exact (32-bit combined shards) the sharded exchange gives the all-gather's θ
and loss; a payload damaged on the wire goes out as damaged slices, which their owners refuse, so its
region's update is dropped that round, never the run; a region killed inside the exchange fails it, the
survivors roll the round back, re-form the quorum and train it again with a layout of their own (the lost region's shard owned by
them), plan the next rounds over two shards, finish, and agree on θ.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_elastic import scenario

from geomesh.cli import launch as cli_launch
from geomesh.telemetry import read_events

ONE_ROUND = 4 * 5 * 32  # b=4, H=5, 32 tokens per sequence, per region
CORRUPT = [{"at_round": 2, "region": "r2-t4", "kind": "corrupt"}]  # r2-t4's payload damaged on the wire


def sharded_scenario(folder, corpus, exchange: str, bits: int = 32, **kwargs):
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    path = scenario(folder, corpus, **kwargs)
    data = yaml.safe_load(path.read_text())
    data["geomesh"].update({"exchange": exchange, "shard_bits": bits})
    path.write_text(yaml.safe_dump(data))
    return path


def launch_argv(path, out, tokens: int) -> list[str]:
    return ["launch", str(path), "--nproc", "3", "--method", "geomesh-sign-only", "--min-regions", "2", "--out",
            str(out), "--tokens", str(tokens), "--save-params", "--quiet", "--wan", "none", "--timeout", "90"]  # fmt: skip


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory, small_corpus):
    """The same elastic run twice, the all-gather and the sharded exchange kept exact; in both, r2-t4's
    payload is damaged on the wire in its third round."""
    folder = tmp_path_factory.mktemp("sharded-elastic")
    runs = {}
    for exchange in ("all_gather", "sharded"):
        path = sharded_scenario(folder / f"{exchange}-scenario", small_corpus, exchange, faults=CORRUPT)
        out = folder / exchange
        result = cli_launch.launch(cli_launch.build_parser().parse_args(launch_argv(path, out, 3 * 3 * ONE_ROUND)),
                                   extra_env={"OMP_NUM_THREADS": "1"})  # fmt: skip
        assert result.code == 0, result.message
        runs[exchange] = (result.summary, out)
    return runs


def test_exact_sharded_elastic_run_equals_the_all_gather(exact_runs):
    """The owners' combine of their shards is SignCodec.combine's arithmetic on the same elements in the same
    order (the quorum's group ranks follow the regions' order), and 32 bits carry it as it is: the same θ."""
    from test_sharded_distributed import assert_same_run

    sh, sh_out = exact_runs["sharded"]
    assert_same_run(exact_runs)
    assert sh["bytes_sent"] > 0
    rounds = [e for e in read_events(sh_out / "events.jsonl") if e["type"] == "round"]
    assert all(r["shard_owners"] == ["r0-h100", "r1-a100", "r2-t4"] for r in rounds)


def test_a_damaged_slice_drops_its_region_for_the_round_not_the_run(exact_runs):
    """r2-t4's damaged payload goes out as damaged slices: their owners refuse them, every region drops its
    update that round (the all-gather's screening does the same with the whole payload), and it stays in."""
    (ag, ag_out), (sh, sh_out) = exact_runs["all_gather"], exact_runs["sharded"]
    assert sh["rejected_payloads"] == ag["rejected_payloads"] == 1
    assert sh["tokens_lost"] == ag["tokens_lost"] == ONE_ROUND
    warned = [e for e in read_events(sh_out / "events.jsonl") if e["type"] == "warning"]
    assert [(w["worker"], w["round"]) for w in warned] == [("r2-t4", 3)]
    assert "payload rejected" in warned[0]["message"] and "slice of shard" in warned[0]["message"]
    assert sh["elastic"]["regions_at_end"] == ["r0-h100", "r1-a100", "r2-t4"] and sh["elastic"]["leaves"] == 0


def test_a_region_lost_in_the_middle_of_the_sharded_exchange(tmp_path, small_corpus):
    """r1-a100's leader dies inside round 2's sharded exchange, its slices delivered and its combined shard
    never sent (the test hook): the survivors' next collective fails, so the round does not commit; they roll
    it back (the owners' residuals too), re-form the quorum and train the round again with two shards; the
    failed attempt's tokens are lost, and the survivors agree on θ."""
    from geomesh.runtime.distributed.sharded_loop import TEST_KILL_ENV

    path = sharded_scenario(tmp_path / "s", small_corpus, "sharded", bits=8)
    out = tmp_path / "run"
    args = cli_launch.build_parser().parse_args(launch_argv(path, out, 4 * 3 * ONE_ROUND))
    result = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1", TEST_KILL_ENV: "r1-a100:2"})
    assert result.code == 0, result.message
    assert [r.describe() for r in result.ranks] == ["exit code 0", "killed by SIGKILL", "exit code 0"]
    events = read_events(out / "events.jsonl")
    leave = [e for e in events if e["type"] == "leave"]
    assert [(e["region"], e["round"]) for e in leave] == [("r1-a100", 2)]
    rollbacks = [e for e in events if e["type"] == "rollback"]
    assert [e["round"] for e in rollbacks] == [2] and rollbacks[0]["tokens_lost"]["r1-a100"] == ONE_ROUND
    rounds = [e for e in events if e["type"] == "round"]
    assert rounds[0]["shard_owners"] == ["r0-h100", "r1-a100", "r2-t4"]
    assert rounds[1]["round"] == 2 and rounds[1]["members"] == ["r0-h100", "r2-t4"]
    assert all(r["shard_owners"] == ["r0-h100", "r2-t4"] for r in rounds[1:])
    summary = result.summary
    assert summary["elastic"]["regions_at_end"] == ["r0-h100", "r2-t4"]
    assert 4 * 3 * ONE_ROUND <= summary["tokens"] and len(set(summary["param_checksums"].values())) == 1


def test_a_region_with_another_key_is_left_out_and_the_others_shard_without_it(tmp_path, small_corpus):
    """Three regions started by hand, r2-t4 with another run key (tests/test_trust_elastic.py runs the same
    with the all-gather): the two live regions refuse its frames, never take its slices or combined shard,
    shard the model between themselves and finish; it stops alone with one error."""
    from test_trust_elastic import KEY_ENV, run_regions_by_hand

    path = sharded_scenario(tmp_path / "s", small_corpus, "sharded", bits=8, round_deadline_s=60,
                            hmac_key_env=KEY_ENV)  # fmt: skip
    codes, errs = run_regions_by_hand(path, tmp_path, 4 * 2 * ONE_ROUND)
    assert codes["r0-h100"] == 0 and codes["r1-a100"] == 0, errs
    assert not any("Traceback" in e for e in errs.values()), errs
    odd = [ln for ln in errs["r2-t4"].splitlines() if ln.startswith("error:")]
    assert codes["r2-t4"] != 0 and len(odd) == 1 and "cannot authenticate" in odd[0], errs["r2-t4"][-3000:]
    summary = json.loads((tmp_path / "r0-h100" / "summary.json").read_text())
    assert summary["exchange"] == "sharded" and summary["elastic"]["regions_at_end"] == ["r0-h100", "r1-a100"]
    rounds = [e for e in read_events(tmp_path / "r0-h100" / "events.jsonl") if e["type"] == "round"]
    assert rounds and all(r["members"] == ["r0-h100", "r1-a100"] for r in rounds)
    assert all("r2-t4" not in r["shard_owners"] for r in rounds)
    assert rounds[-1]["shard_owners"] == ["r0-h100", "r1-a100"]
    assert summary["tokens"] >= 4 * 2 * ONE_ROUND and len(set(summary["param_checksums"].values())) == 1


def test_a_slot_binds_the_quorum_and_a_known_sender():
    """A slot sealed under one quorum (an earlier attempt of the round, before a member was lost) is refused
    under the next; so is any slot from a member whose round info was rejected (its region unknown)."""
    from geomesh.runtime.distributed.frames import Rejected
    from geomesh.runtime.distributed.sharded import SlotTrust

    key = b"the run's key"
    first = SlotTrust(key, "run-1", 5, (0, 1, 2), "quorum 7.3.3")
    slot = first.seal(b"x" * 10, 10, 1, "slice", 0)
    assert first.open(slot, 10, 1, "slice", 0) == b"x" * 10
    retry = SlotTrust(key, "run-1", 5, (0, 1, 2), "quorum 8.3.2")
    assert "HMAC" in retry.open(slot, 10, 1, "slice", 0).reason
    unknown = SlotTrust(None, "run-1", 5, (0, -1, 2), "quorum 7.3.3")
    assert isinstance(unknown.open(SlotTrust(None, "run-1", 5, (0, 1, 2)).seal(b"x" * 10, 10, 1, "slice", 0), 10,
                                   1, "slice", 0), Rejected)  # fmt: skip


def test_a_failed_all_to_all_is_an_exchange_failure():
    """Membership.all_to_all_bytes over torchft's group: the pieces in group order; a member lost on the way
    (the work fails, or the group is already torn down) raises ExchangeFailed, which the quorum's exchange
    retries without it."""
    from types import SimpleNamespace

    from geomesh.runtime.distributed.membership import ExchangeFailed, Membership

    class Done:
        def __init__(self, error=None):
            self.error = error

        def wait(self):
            if self.error:
                raise RuntimeError(self.error)
            return True

    class Pair:  # two members; member 1 sends b"from 1 to 0" (padded to what the layout implies)
        _pg = object()
        error = None

        def size(self):
            return 2

        def alltoall_base(self, out, inp, out_sizes, in_sizes, opts):
            assert opts.timeout.total_seconds() == 3
            out[: in_sizes[0]].copy_(inp[: in_sizes[0]])
            theirs = torch.frombuffer(bytearray(b"from 1 to 0".ljust(out_sizes[1], b"\0")), dtype=torch.uint8)
            out[in_sizes[0] :].copy_(theirs)
            return Done(self.error)

    m = Membership.__new__(Membership)
    m.pg = Pair()
    got = m.all_to_all_bytes([b"mine", b"for member 1"], [4, 12], timeout_s=3)
    assert got == [b"mine", b"from 1 to 0\0"]
    m.pg.error = "Connection closed by peer"
    with pytest.raises(ExchangeFailed, match="Connection closed"):
        m.all_to_all_bytes([b"mine", b"for member 1"], [4, 12], timeout_s=3)
    m.pg = SimpleNamespace(_pg=None)
    with pytest.raises(ExchangeFailed, match="torn down"):
        m.all_to_all_bytes([b"mine", b"x"], [4, 1], timeout_s=3)


@pytest.mark.filterwarnings("ignore:region 2. its combined shard 2 was rejected")
def test_an_unknown_quorum_member_cannot_veto_and_costs_only_its_own_shard():
    """Three members of a quorum's group in threads (a mover that hands the pieces over in memory): members 0
    and 1 authenticated each other's round infos, member 2's was rejected (an outsider torchft let in). It
    sends junk slices, a row refusing member 1's slice, a junk combined shard and a row refusing shard 1:
    its rows are not counted (1 of 2 would not make it a suspect), so both honest members keep each other's
    update and shard; only member 2's shard is left out (zeros), the same on both."""
    import threading

    from geomesh.codec import Manifest, SignCodec
    from geomesh.codec.sharded import ShardedExchange
    from geomesh.runtime.distributed.sharded import SLOT_REFUSED, sharded_round

    shapes = {"w": (64, 33), "b": (7,), "v": (1000,)}
    codec = SignCodec(Manifest.from_shapes(shapes), chunk_size=128, key=b"payload key")
    payloads = [codec.encode({k: torch.randn(s, generator=torch.Generator().manual_seed(r)) for k, s in shapes.items()},
                             tokens=100 + 50 * r) for r in range(2)]  # fmt: skip
    ex = ShardedExchange(codec, 3, bits=32)
    barrier, box = threading.Barrier(3), {}

    class InMemory:
        def __init__(self, rank):
            self.size, self.rank, self.members, self.scope = 3, rank, (0, 1, -1), "quorum 9.2.3"

        def all_to_all(self, send, recv_sizes):
            box[self.rank] = send
            barrier.wait()
            got = [box[j][self.rank][:n].ljust(n, b"\0") for j, n in enumerate(recv_sizes)]
            barrier.wait()
            return got

    def outsider():
        m = InMemory(2)
        m.all_to_all([b"junk" * 400] * 3, [1] * 3)  # its slices
        m.all_to_all([bytes([0, SLOT_REFUSED, 0])] * 3, [3] * 3)  # "member 1's slice was refused"
        m.all_to_all([b"junk" * 4000] * 3, [1] * 3)  # its combined shard
        m.all_to_all([bytes([0, 1, 0])] * 3, [3] * 3)  # "shard 1 arrived damaged"

    results = {}

    def honest(rank):
        results[rank] = sharded_round(payloads[rank], ex, mover=InMemory(rank), round_number=4, key=b"run key",
                                      run_id="run-1", exclude={2: "its round info was rejected"})  # fmt: skip

    threads = [threading.Thread(target=honest, args=(r,)) for r in range(2)] + [threading.Thread(target=outsider)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    whole = torch.cat([v.reshape(-1) for v in codec.combine(payloads).values()])
    a, b = ex.bounds[2]
    for r in results.values():
        assert r.accepted == [0, 1] and list(r.lost_shards) == [2] and not r.suspect
        flat = torch.cat([v.reshape(-1) for v in r.update.values()])
        assert torch.equal(flat[:a], whole[:a]) and not flat[a:b].any()
    assert len(results) == 2 and torch.equal(results[0].flat, results[1].flat)
