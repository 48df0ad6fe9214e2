"""The sharded exchange over torch.distributed (runtime/distributed/sharded.py), 4 Gloo processes on CPU:
kept exact it gives the all-gather path's update; a malformed slice drops its sender for the round on every
leader, like a malformed payload; an absent update is left out; a slot of another round is refused; a leader
with another run key stands aside without vetoing the others; quantised, every leader applies the same."""

from __future__ import annotations

import warnings

import pytest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from geomesh.codec import Manifest, SignCodec

SHAPES = {"w": (64, 33), "b": (7,), "v": (1000,)}
KEY = b"sharded-test-key-0123"


def _payloads(codec):
    out = []
    for r in range(4):
        g = torch.Generator().manual_seed(r)
        out.append(codec.encode({k: torch.randn(s, generator=g) for k, s in SHAPES.items()}, tokens=100 + 50 * r))
    return out


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def _worker(rank: int, store: str) -> None:
    from geomesh.runtime.distributed import sharded as sd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    try:
        _checks(rank, sd)
        native = sd.dist.all_to_all_single

        def no_alltoall(*a, **k):  # a backend without all-to-all: the same bytes in send/recv pairs
            raise RuntimeError("all_to_all_single is not supported")

        sd.dist.all_to_all_single = no_alltoall
        _checks(rank, sd)
        sd.dist.all_to_all_single = native
    finally:
        dist.destroy_process_group()


def _checks(rank: int, sd) -> None:
    from geomesh.codec.sharded import ShardedExchange

    codec = SignCodec(Manifest.from_shapes(SHAPES), chunk_size=128, key=KEY)
    p = _payloads(codec)
    exact = ShardedExchange(codec, 4, bits=32)

    r = sd.sharded_round(p[rank], exact)  # 1. exact == the all-gather path
    assert r.accepted == [0, 1, 2, 3] and _same(r.update, codec.combine(p)), rank
    assert r.tokens == sum(codec.tokens_of(x) for x in p)
    w = 9  # a slot's flag and round (unsigned here)
    assert r.sent_bytes == (sum(w + exact.slice_nbytes(k) for k in range(4) if k != rank)
                            + 3 * (w + exact.combined_nbytes(rank)) + 2 * 3 * 4)

    mine = p[rank]  # 2. rank 2's slice for shard 1 is damaged on the wire
    if rank == 2:
        real = exact.slices

        def damaged(payload):
            s = real(payload)
            s[1] = s[1][:60] + bytes([s[1][60] ^ 0xFF]) + s[1][61:]
            return s

        exact.slices = damaged
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = sd.sharded_round(mine, exact)
    if rank == 2:
        exact.slices = real
    assert r.accepted == [0, 1, 3] and 2 in r.rejected, (rank, r.rejected)
    assert _same(r.update, codec.combine([p[0], p[1], p[3]]))
    if rank == 1:
        assert "HMAC" in r.rejected[2] and any("dropped this round" in str(w.message) for w in caught)

    r = sd.sharded_round(None if rank == 3 else p[rank], exact)  # 3. rank 3 has no update
    assert r.accepted == [0, 1, 2] and r.absent == [3] and 3 not in r.rejected
    assert _same(r.update, codec.combine(p[:3]))

    if rank == 0:  # 4. owner 0's combined frame is damaged: shard 0 is left out on every leader
        real_enc = exact.encode_combined
        exact.encode_combined = lambda k, v, t: (lambda f: f[:-1] + bytes([f[-1] ^ 1]))(real_enc(k, v, t))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = sd.sharded_round(p[rank], exact)
    if rank == 0:
        exact.encode_combined = real_enc
    a, b = exact.bounds[0]
    whole, flat = codec.combine(p), torch.cat([v.reshape(-1) for v in r.update.values()])
    assert list(r.lost_shards) == [0] and not flat[a:b].any()
    assert torch.equal(flat[b:], torch.cat([v.reshape(-1) for v in whole.values()])[b:])

    # 6. signed slots: a slot of another round is refused; a leader with another run key stands aside (its
    # refusals of everyone are not counted), the others drop its update and lose its shard this round
    signed = dict(key=b"run-key", run_id="run-1", round_number=7)
    r = sd.sharded_round(p[rank], exact, **{**signed, "round_number": 8 if rank == 1 else 7})
    if rank != 1:
        assert r.accepted == [0, 2, 3] and ("round 8 in round 7" in r.rejected[1] or rank != 0)
        assert 1 in r.rejected and list(r.lost_shards) == [1] and r.suspect == [1] and r.update is not None
    else:
        assert r.update is None and r.suspect == [1]
    r = sd.sharded_round(p[rank], exact, **{**signed, "key": b"another key" if rank == 3 else b"run-key"})
    assert r.suspect == [3] and (r.update is None) == (rank == 3)
    if rank != 3:
        assert r.accepted == [0, 1, 2] and list(r.lost_shards) == [3]
        a, b = exact.bounds[3]
        flat = torch.cat([v.reshape(-1) for v in r.update.values()])
        ref = torch.cat([v.reshape(-1) for v in codec.combine(p[:3]).values()])
        assert torch.equal(flat[:a], ref[:a]) and not flat[a:b].any()

    _dense_checks(rank, sd)

    q = sd.sharded_round(p[rank], ShardedExchange(codec, 4, bits=8))  # 5. quantised: the same everywhere
    flat = torch.cat([v.reshape(-1) for v in q.update.values()])
    every = [torch.empty_like(flat) for _ in range(4)]
    dist.all_gather(every, flat)
    assert all(torch.equal(every[0], e) for e in every)
    ref = torch.cat([v.reshape(-1) for v in codec.combine(p).values()])
    assert 0 < float((flat - ref).abs().max()) < 0.05 * float(ref.abs().max())


def _dense_checks(rank: int, sd) -> None:
    """7. signed dense payloads (DiLoCo with a run key): the owners' float32 shards are the all-gather path's
    sum bit for bit, a ring all-reduce's bytes go out, and a hostile slice drops only its sender."""
    from geomesh.codec import DenseCodec
    from geomesh.codec.sharded import ShardedDenseExchange

    codec = DenseCodec(Manifest.from_shapes(SHAPES), key=KEY)
    p = _payloads(codec)

    def gathered(ps):
        summed = torch.zeros(codec.manifest.numel + 1)
        for x in ps:
            summed.add_(codec.reducible(x))
        return codec.reduced_update(summed)

    ex = ShardedDenseExchange(codec, 4)
    signed = dict(key=b"run-key", run_id="run-1", round_number=3)
    r = sd.sharded_round(p[rank], ex, **signed)
    assert r.accepted == [0, 1, 2, 3] and _same(r.update, gathered(p)), rank
    d, tag, w = codec.manifest.numel, 32, 9 + 32  # a slot's flag, round and tag
    ring = 2 * 3 / 4 * 4 * d
    assert ring < r.sent_bytes - 2 * 3 * (4 + tag + 9) < ring + 2 * 3 * (w + 52 + 2 * tag)
    if rank == 0:  # rank 0's slice for shard 2 holds an infinity under a good signature (it has the key)
        real = ex.slices

        def hostile(payload):
            s = real(payload)
            values = torch.zeros(ex.numel(2))
            values[3] = float("inf")
            s[2] = ex.codecs[2]._assemble(codec.tokens_of(payload), [values.numpy()])
            return s

        ex.slices = hostile
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = sd.sharded_round(p[rank], ex, **signed)
    if rank == 0:
        ex.slices = real
    assert r.accepted == [1, 2, 3] and list(r.rejected) == [0] and "non-finite" in r.rejected[0] or rank != 2
    assert r.accepted == [1, 2, 3] and not r.lost_shards and _same(r.update, gathered(p[1:])), (rank, r.rejected)


def test_sharded_exchange_over_gloo(tmp_path):
    """all_to_all_single, then the send/recv fallback, in the same 4 processes."""
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=4, join=True)


# ---- the sharded exchange in the one round loop: real `geomesh launch` runs ---------------------------------

TOKENS = 6000
GPUS = ("H100", "A100", "T4", "V100")


def _scenario(folder, corpus, geomesh, faults=None):
    import yaml
    from conftest import FIXED_PLAN, tiny_scenario_dict

    data = tiny_scenario_dict(corpus, GPUS)
    data["geomesh"].update({**FIXED_PLAN, "max_batch": 16, **geomesh})
    if faults:
        data["faults"] = faults
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _launch(path, out, *extra):
    from geomesh.cli import launch as cli_launch

    args = cli_launch.build_parser().parse_args(["launch", str(path), "--nproc", "4", "--method", "geomesh", "--out",
                                                 str(out), "--tokens", str(TOKENS), "--save-params", "--quiet",
                                                 "--timeout", "90", *extra])  # fmt: skip
    result = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1"})
    assert result.code == 0, result.message
    return result.summary


CORRUPT = [{"at_round": 2, "region": "r2-t4", "kind": "corrupt"}]  # r2-t4's payload damaged on the wire


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory, small_corpus):
    """4 leaders, the same scenario twice: the all-gather, and the sharded exchange kept exact (32 bits); in
    both, region r2-t4's payload is damaged on the wire in its third round."""
    folder = tmp_path_factory.mktemp("sharded-exact")
    runs = {}
    for name, geomesh in (("all_gather", {"exchange": "all_gather"}), ("sharded", {"exchange": "sharded",
                                                                                    "shard_bits": 32})):  # fmt: skip
        out = folder / name
        runs[name] = (_launch(_scenario(folder / f"{name}-scenario", small_corpus, geomesh, CORRUPT), out), out)
    return runs


def assert_same_run(exact_runs) -> None:
    """The all-gather run and the sharded run kept exact (32 bits) of ``exact_runs`` ended alike, bit for bit:
    the exchange each used, rounds, tokens, θ, loss and every region's checksum (all equal)."""
    (ag, ag_out), (sh, sh_out) = exact_runs["all_gather"], exact_runs["sharded"]
    assert ag["exchange"] == "all_gather" and sh["exchange"] == "sharded" and sh["shard_bits"] == 32
    assert sh["rounds"] == ag["rounds"] >= 3 and sh["tokens"] == ag["tokens"]
    a, b = torch.load(ag_out / "final_params.pt"), torch.load(sh_out / "final_params.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sh["final_val_loss"] == ag["final_val_loss"]
    checksums = sh["param_checksums"]  # per rank (static runs) or per region (elastic ones)
    assert checksums == ag["param_checksums"]
    assert len(set(checksums.values() if isinstance(checksums, dict) else checksums)) == 1


def test_exact_sharded_launch_equals_the_all_gather_bit_for_bit(exact_runs):
    """The owners' token-weighted combine of their shards is SignCodec.combine's arithmetic on the same
    elements in the same order, and 32 bits carry the float32 values as they are: the same update every
    round, so the same θ to the last bit (not a tolerance)."""
    (ag, _), (sh, _) = exact_runs["all_gather"], exact_runs["sharded"]
    assert_same_run(exact_runs)
    # the same records: bytes sent per round (what leaves each leader), the payload's size, what was lost
    assert sh["payload_bytes_per_worker"] == ag["payload_bytes_per_worker"]
    assert sh["bytes_sent"] > 0 and sh["bytes_per_round"] == sh["bytes_sent"] / sh["rounds"]
    assert sh["tokens_lost"] == ag["tokens_lost"] > 0


def test_a_malformed_shard_slice_is_rejected_like_a_payload(exact_runs):
    """r2-t4's damaged payload goes out as damaged slices: their owners refuse them, every region drops its
    update that round, one warning names it, rejected_payloads counts it, and the run goes on."""
    from geomesh.telemetry import read_events

    (ag, ag_out), (sh, sh_out) = exact_runs["all_gather"], exact_runs["sharded"]
    assert sh["rejected_payloads"] == ag["rejected_payloads"] == 1
    for out in (ag_out, sh_out):
        warned = [e for e in read_events(out / "events.jsonl") if e["type"] == "warning"]
        assert [(w["worker"], w["round"]) for w in warned] == [("r2-t4", 3)]
        assert "payload rejected" in warned[0]["message"]
    assert "slice of shard" in warned[0]["message"]


def test_sharded_launch_equals_emulated(tmp_path, small_corpus):
    """8-bit combined shards (the default): the emulated runtime models the same exchange (the same slices,
    owners' combine and quantised frames, in one process), so the run's θ is the emulated runtime's, to the
    float tolerance of tests/test_distributed.py (the ranks' inner steps run in their own processes)."""
    from geomesh.config import load_scenario
    from geomesh.methods import get_method
    from geomesh.runtime.emulated import EmulatedRun, RunOptions

    path = _scenario(tmp_path / "s", small_corpus, {"exchange": "sharded", "shard_bits": 8})
    s = _launch(path, tmp_path / "run")
    assert s["exchange"] == "sharded" and s["shard_bits"] == 8
    emulated = EmulatedRun(load_scenario(path), get_method("geomesh"), RunOptions(tokens=TOKENS, progress=False))
    e = emulated.run()
    assert e["exchange"] == "sharded" and e["rounds"] == s["rounds"] and e["tokens"] == s["tokens"]
    assert s["final_val_loss"] == pytest.approx(e["final_val_loss"], rel=1e-5)
    expected, got = emulated.cluster.global_model.state_dict(), torch.load(tmp_path / "run" / "final_params.pt")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_elastic_regions_take_the_plan_s_sharded_exchange():
    """Elastic regions shard too (tests/test_sharded_elastic.py runs them): the scenario's layout, and one per
    quorum size, cut when a quorum of that size first exchanges and kept."""
    from types import SimpleNamespace

    from geomesh.config import load_scenario
    from geomesh.methods import get_method
    from geomesh.methods.base import RoundKit, proxy_manifest
    from geomesh.runtime.distributed.sharded_loop import layout_for, loop_exchange

    sc = load_scenario("default", {"geomesh.exchange": "sharded"})
    m = get_method("geomesh")
    params = {s.name: torch.zeros(s.shape) for s in proxy_manifest(sc)}
    kit = RoundKit.build(m, sc, params)
    loop = SimpleNamespace(sc=sc, method=m, kit=kit, combiner=kit.combiner, n=len(sc.regions), elastic=True)
    loop.sharded = loop_exchange(loop)
    assert loop.sharded.n == len(sc.regions)
    assert layout_for(loop, len(sc.regions)) is loop.sharded
    fewer = layout_for(loop, len(sc.regions) - 1)
    assert fewer.n == len(sc.regions) - 1 and layout_for(loop, len(sc.regions) - 1) is fewer
    assert sum(fewer.numel(k) for k in range(fewer.n)) == sum(loop.sharded.numel(k) for k in range(loop.sharded.n))
