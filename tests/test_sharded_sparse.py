"""The sharded exchange of sparse sign payloads (codec/sharded_sparse.py) and the plan's choice for sparse
methods (planner/exchange.py): exact it is the all-gather's combine bit for bit, slices are the payload's
own entries, a bad slice is refused, the re-sparsified combine keeps what it drops in the owners' residuals,
and the plan picks it (and says why) where two of its re-sparsified exchanges cost less than one all-gather."""

from __future__ import annotations

import pytest
import torch

from geomesh.codec import Manifest, PayloadError, SignCodec, SparseSignCodec
from geomesh.codec.sharded import ShardedExchange
from geomesh.codec.sharded_sparse import ShardedSparseExchange, shardable, sharded_exchange

SHAPES = {"a": (37, 129), "b": (10,), "c": (3 * 256 + 5,), "empty": (0,), "e": (513, 17)}
KEY = b"k" * 16
CODECS = {  # geomesh-sparse's blocks, single entries, sparseloco's 2-bit values with equal weights
    "blocks": dict(chunk_size=256, k=24, block=4),
    "single": dict(chunk_size=256, k=7),
    "two-bit": dict(chunk_size=256, k=9, value_bits=2, weighting="equal", ef_decay=0.9),
}


def payloads(codec, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [codec.encode({k: torch.randn(s, generator=g) for k, s in SHAPES.items()}, tokens=100 * (i + 1))
            for i in range(n)]  # fmt: skip


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors.values()])


@pytest.fixture(params=list(CODECS))
def codec(request):
    return SparseSignCodec(Manifest.from_shapes(SHAPES), key=KEY, **CODECS[request.param])


@pytest.mark.parametrize("n_shards", [1, 3, 7, 64])
def test_exact_sharded_sparse_combine_is_the_all_gather_combine(codec, n_shards):
    p = payloads(codec)
    ex = sharded_exchange(codec, n_shards, bits=32)
    assert isinstance(ex, ShardedSparseExchange) and not ex.resparsify
    got, tokens = ex.combine_with_tokens(p)
    want, total = codec.combine_with_tokens(p)
    assert tokens == total == 1500
    assert torch.equal(flat(got), flat(want))  # bit for bit, not a tolerance


def test_a_slice_is_the_payload_s_own_entries_in_its_shard(codec):
    ex = ShardedSparseExchange(codec, 4)
    p = payloads(codec)[2]
    whole = flat(codec.decode(p).tensors)
    for k, (a, b) in enumerate(ex.bounds):
        part = ex.codecs[k].decode(ex.slices(p)[k])
        assert part.tokens == 300 and torch.equal(flat(part.tensors), whole[a:b])
    # every payload byte goes to one owner: the slices add only their headers and tags
    assert sum(ex.slice_nbytes(k) for k in range(4)) <= codec.payload_nbytes() + 3 * (48 + 32) + 4


def test_a_bad_or_swapped_slice_is_refused(codec):
    ex = ShardedSparseExchange(codec, 4)
    sl = ex.slices(payloads(codec)[0])
    assert ex.screen_slice(1, sl[1]) is None
    assert ex.screen_slice(1, sl[2]) is not None  # a slot swap: another shard's manifest (or size)
    bad = bytearray(sl[1])
    bad[60] ^= 1
    assert "HMAC" in ex.screen_slice(1, bytes(bad))
    assert "truncated" in ex.screen_slice(1, sl[1][:-1])
    assert ex.screen_slice(1, sl[1] + b"x") is not None
    unsigned = SparseSignCodec(codec.manifest, **{**CODECS["blocks"], "chunk_size": codec.chunk_size})
    forged = ShardedSparseExchange(unsigned, 4).slices(unsigned.encode(codec.decode(payloads(codec)[0]).tensors, 5))
    assert ex.screen_slice(1, forged[1]) is not None  # no tag, another layout
    # a slice whose unary field lies (well signed): its owner reads it as any payload and refuses it
    s = ex.codecs[1]
    tokens, body = s._parse(sl[1])
    raw = bytearray(body)
    raw[-1] ^= 0x01  # (the last bits of the stream: a unary field, or its padding)
    lying = s._assemble(tokens, [bytes(raw)])
    assert ex.screen_slice(1, lying) is not None
    with pytest.raises(PayloadError):
        ex.slices(payloads(codec)[0][:-1])  # a damaged payload is refused whole


def test_re_sparsified_combine_keeps_what_it_drops_with_the_owner(codec):
    """Each owner sends its shard's top-k of (its residual + the combined shard) and keeps the rest: over
    rounds, Σ applied + Σ residuals = Σ exact combines (error feedback at β = 1 loses nothing)."""
    ex = ShardedSparseExchange(codec, 3, bits=8)
    exact = ShardedSparseExchange(codec, 3, bits=32)
    assert ex.resparsify and all(o.error_feedback and o.ef_decay == 1.0 for o in ex.owners if o is not None)
    applied = want = 0
    for r in range(3):
        p = payloads(codec, seed=r)
        upd, tokens = ex.combine_with_tokens(p)
        assert tokens == 1500
        applied = applied + flat(upd)
        want = want + flat(exact.combine(p))
        # what a region receives from an owner is a payload of the shard: as sparse as a slice
        assert all(ex.combined_nbytes(k) == ex.slice_nbytes(k) for k in range(3))
    left = torch.cat([flat(o.residual) if o.residual else torch.zeros(ex.numel(k)) for k, o in enumerate(ex.owners)])
    torch.testing.assert_close(applied + left, want, rtol=1e-5, atol=1e-5)
    assert left.abs().sum() > 0  # it really dropped entries
    # owner state: saved and loaded (a fresh layout then continues identically)
    again = ShardedSparseExchange(codec, 3, bits=8)
    again.load_owner_state(ex.owner_state())
    # and as the flat tensors of a distributed checkpoint, one owner at a time (a leader runs one)
    flats = ex.owner_residuals()
    assert sorted(flats) == [k for k, o in enumerate(ex.owners) if o is not None and o.residual]
    assert all(flats[k].shape == (ex.numel(k),) for k in flats)
    each = ShardedSparseExchange(codec, 3, bits=8)
    for k, t in flats.items():
        each.load_owner_residuals({k: t})
    p = payloads(codec, seed=9)
    nxt = flat(ex.combine(p))
    assert torch.equal(flat(again.combine(p)), nxt) and torch.equal(flat(each.combine(p)), nxt)
    for bad, says in (({7: torch.zeros(1)}, "no owner"), ({0: torch.zeros(ex.numel(0) + 1)}, "elements"),
                      ({"0": flats[0]}, "no owner")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            each.load_owner_residuals(bad)


def test_combined_shards_and_slices_never_pass_for_each_other(codec):
    ex = ShardedSparseExchange(codec, 3, bits=8)
    values, tokens = ex.combine_shard(0, [s[0] for s in map(ex.slices, payloads(codec))])
    frame = ex.encode_combined(0, values, tokens)
    got, t = ex.decode_combined(0, frame)
    assert t == tokens == 1500 and got.numel() == values.numel()
    with pytest.raises(PayloadError, match="digest|manifest|size|truncated|oversized"):
        ex.decode_combined(0, ex.slices(payloads(codec)[0])[0])
    assert ex.screen_slice(0, frame) is not None
    with pytest.raises(PayloadError):
        ex.decode_combined(1, frame)
    for cut in (frame[:-1], frame + b"\0", frame[:10]):
        with pytest.raises(PayloadError):
            ex.decode_combined(0, cut)
    bad = bytearray(frame)
    bad[60] ^= 0xFF
    with pytest.raises(PayloadError, match="HMAC"):
        ex.decode_combined(0, bytes(bad))
    with pytest.raises(ValueError, match="not finite|NaN"):
        ex.encode_combined(0, torch.full_like(values, float("nan")), tokens)


def test_what_can_be_sharded_and_bad_arguments():
    m = Manifest.from_shapes(SHAPES)
    assert shardable(SparseSignCodec(m)) and shardable(SignCodec(m)) and not shardable(SignCodec(m, combine_rule="majority"))
    assert isinstance(sharded_exchange(SignCodec(m), 2), ShardedExchange)
    with pytest.raises(TypeError, match="SparseSignCodec"):
        ShardedSparseExchange(SignCodec(m), 2)
    with pytest.raises(ValueError, match="bits"):
        ShardedSparseExchange(SparseSignCodec(m), 2, bits=3)
    with pytest.raises(ValueError, match="combined"):
        ShardedSparseExchange(SparseSignCodec(m, layout_tag="combined"), 2)
    with pytest.raises(ValueError, match="shard"):
        ShardedSparseExchange(SparseSignCodec(m), 2).load_owner_state({"7": {}})


def test_the_plan_times_a_re_sparsified_exchange_at_two_rounds_and_says_why():
    """A re-sparsified sharded exchange applies one payload's share of the update a round (the all-gather the
    union of N payloads), so the plan times it at two of its exchanges: on `default`, where latency sets both
    exchanges' time and the sharded exchange would only save bytes, the all-gather (measured better there at
    equal tokens and at equal time, docs/benchmarks.md); at 16 regions, where the all-gather's bytes set its time,
    the sharded exchange. Exchanges that apply the same update are timed as they are."""
    from geomesh.config import load_scenario
    from geomesh.methods import get_method
    from geomesh.methods.base import proxy_manifest
    from geomesh.planner.exchange import RESPARSIFIED_ROUNDS, ShardedSizes, choose_exchange, scenario_exchange
    from test_sharded import uniform

    def choice(method, wan=None, **over):
        s = load_scenario("default", over)
        m, man = get_method(method), proxy_manifest(s)
        return scenario_exchange(s, wan or s.wan_model(), m.collective, m.modeled_payload_bytes(s, man),
                                 m.make_codec(man, s))  # fmt: skip

    c = choice("geomesh-sparse")
    ag, sh = c.candidates["all_gather"], c.candidates["sharded"]
    assert c.name == "all_gather" and "re-sparsify" in c.reason and "4 regions" in c.reason
    assert sh.seconds <= ag.seconds * 1.01 and sh.received_bytes < 0.55 * ag.received_bytes  # bytes, not time
    many = choice("geomesh-sparse", uniform(16))
    ag, sh = many.candidates["all_gather"], many.candidates["sharded"]
    assert many.name == "sharded" and "re-sparsify" in many.reason and "16 regions" in many.reason
    assert RESPARSIFIED_ROUNDS * sh.seconds < ag.seconds and "1/2 of the sequences" in many.reason
    # and the method plans its rounds for the exchange the plan picks: at 16 regions over the same links
    # (unresolved, as `geomesh plan` and a time budget see it), rounds of half its sequences
    gpus = ("H100", "A100", "V100", "T4")
    wide = load_scenario("default", {"regions": [{"name": f"r{i}", "gpu": gpus[i % 4]} for i in range(16)],
                                     "wan.rtt": [[0.0 if i == j else 100.0 for j in range(16)] for i in range(16)]})
    sparse, tr = get_method("geomesh-sparse"), wide.training
    assert sparse.resparsified(wide)
    assert sparse.constraints(wide, 16).target_sequences == round(16 * tr.batch * tr.inner_steps / 4)
    assert not sparse.resparsified(load_scenario("default"))
    exact = choice("geomesh-sparse", **{"geomesh.shard_bits": 32})  # float32 shards back: 4 bytes a parameter
    assert exact.name == "all_gather" and "float32" in exact.reason and "re-sparsify" not in exact.reason
    assert choice("geomesh").name == "all_gather"  # 1-bit GeoMesh keeps the all-gather at 4 regions
    q = choice("diloco-int8")
    assert q.name == "all_gather" and "no sharding" in q.reason
    # the same sizes, sign slices (combined shards quantised, every entry kept) or re-sparsified sparse ones:
    # where one sharded exchange is cheaper than the all-gather and two are not, only the sign one is taken
    sizes = dict(slices_body=40e6, slice_header=48, combined_body=40e6, combined_header=48)
    wan = uniform(4)
    sign = choose_exchange(wan, "all_gather", 40e6, ShardedSizes(**sizes))
    sparse = choose_exchange(wan, "all_gather", 40e6, ShardedSizes(**sizes, kind="sparse"))
    assert sign.candidates["sharded"].seconds < sign.candidates["all_gather"].seconds
    assert 2 * sparse.candidates["sharded"].seconds > sparse.candidates["all_gather"].seconds
    assert sign.name == "sharded" and sparse.name == "all_gather"
    assert sparse.candidates["sharded"].seconds == sign.candidates["sharded"].seconds  # its cost is its own
    assert choose_exchange(wan, "all_gather", 40e6, ShardedSizes(**sizes, kind="sparse"), forced="sharded").name == "sharded"


def test_a_resumed_run_keeps_the_owners_residuals(tiny_scenario, tmp_path, monkeypatch):
    """The owners' residuals are in the emulated runtime's checkpoint: geomesh-sparse through the re-sparsified
    sharded exchange, interrupted mid-round and resumed, ends as the uninterrupted run does, byte for byte."""
    import dataclasses

    from test_reliability import Interrupted, assert_same_run, final_params, interrupt_at, run

    s = tiny_scenario(tokens=8000, zero_shot_items=0)
    s = dataclasses.replace(s, geomesh=dataclasses.replace(s.geomesh, exchange="sharded"))
    ref = run(s, "geomesh-sparse", tmp_path / "ref")
    assert ref["exchange"] == "sharded" and ref["rounds"] >= 4
    interrupt_at(monkeypatch, 3)
    with pytest.raises(Interrupted):
        run(s, "geomesh-sparse", tmp_path / "run", checkpoint_every=1)
    monkeypatch.undo()
    from geomesh import checkpoint as ckpt

    owners = ckpt.load_latest(tmp_path / "run" / "checkpoints")[1]["owners"]
    assert list(owners) == ["0,1,2"] and any(v["residual"] for v in owners["0,1,2"].values())
    run(s, "geomesh-sparse", tmp_path / "run", checkpoint_every=1, resume=True)
    assert_same_run(tmp_path / "run", tmp_path / "ref")
    want = final_params(tmp_path / "ref") if (tmp_path / "ref" / "checkpoints").exists() else None
    assert want is None or all(torch.equal(final_params(tmp_path / "run")[k], v) for k, v in want.items())


def test_a_leaders_owner_residuals_round_trip_through_checkpoint_state(codec):
    """runtime/distributed/owners.py: what a leader saves is what it loads (into a fresh loop's layout, and
    into one of another size it cuts on load); names no layout has are one ValueError; non-leaders hold none."""
    from types import SimpleNamespace

    from geomesh.runtime.distributed.owners import OwnerResiduals

    def loop(leader=True):
        ex = ShardedSparseExchange(codec, 3, bits=8)
        return SimpleNamespace(sharded=ex, sharded_layouts={}, n=3, combiner=codec,
                               run=SimpleNamespace(is_leader=leader),
                               sc=SimpleNamespace(geomesh=SimpleNamespace(shard_bits=8)))  # fmt: skip

    live = loop()
    pair = ShardedSparseExchange(codec, 2, bits=8)
    live.sharded_layouts[2] = pair
    for r in range(2):
        live.sharded.combine(payloads(codec, seed=r))
        pair.combine(payloads(codec, seed=r)[:2])
    state = {}
    OwnerResiduals(live).save_into(state, "region.r0.owners.")
    assert sorted(state) == sorted([f"region.r0.owners.3.{k}" for k in live.sharded.owner_residuals()] +
                                   [f"region.r0.owners.2.{k}" for k in pair.owner_residuals()])  # fmt: skip
    fresh, asked = loop(), {}
    OwnerResiduals(fresh).request(asked, set(state) | {"region.r1.owners.3.0"}, "region.r0.owners.")
    assert asked.keys() == state.keys() and all(asked[k].shape == state[k].shape for k in state)
    OwnerResiduals(fresh).load_from(state, "region.r0.owners.")
    p = payloads(codec, seed=5)
    assert torch.equal(flat(fresh.sharded.combine(p)), flat(live.sharded.combine(p)))
    assert torch.equal(flat(fresh.sharded_layouts[2].combine(p[:2])), flat(pair.combine(p[:2])))
    for bad in ("4.0", "3.3", "1.0", "x.0", "3"):
        with pytest.raises(ValueError, match="names no shard"):
            OwnerResiduals(fresh).request({}, {f"region.r0.owners.{bad}"}, "region.r0.owners.")
    follower, none = loop(leader=False), {}
    follower.sharded.combine(payloads(codec))
    OwnerResiduals(follower).save_into(none, "p.")
    OwnerResiduals(follower).request(none, set(state), "region.r0.owners.")
    assert none == {}


def test_re_sparsified_rounds_are_half_as_long_in_the_emulated_runtime(tiny_scenario, tmp_path):
    """geomesh-sparse on the tiny cluster, the exchange forced: at equal tokens the re-sparsified sharded
    exchange runs about twice the all-gather's rounds (each of half the sequences); exact float32 shards run
    the all-gather's rounds."""
    import dataclasses

    from test_reliability import run

    s = tiny_scenario(tokens=8000, zero_shot_items=0)

    def rounds(exchange, bits=8):  # the method's own rounds (the tiny scenario sets N·b·H per round)
        g = dataclasses.replace(s.geomesh, exchange=exchange, shard_bits=bits, round_sequences_factor=None)
        summary = run(dataclasses.replace(s, geomesh=g), "geomesh-sparse", tmp_path / f"{exchange}-{bits}")
        assert summary["exchange"] == exchange
        return summary["rounds"]

    gathered = rounds("all_gather")
    assert 1.6 * gathered <= rounds("sharded") <= 2.5 * gathered
    assert rounds("sharded", 32) == gathered
