"""The sharded exchange (codec/sharded.py), its WAN model (network.py) and the plan's choice
(planner/exchange.py): exact when kept exact, quantised within its bound, malformed frames refused."""

from __future__ import annotations

import pytest
import torch

from geomesh.codec import Manifest, PayloadError, SignCodec
from geomesh.codec.sharded import ShardedExchange, shard_bounds
from geomesh.network import WanModel
from geomesh.planner.exchange import ShardedSizes, choose_exchange

SHAPES = {"a": (37, 129), "b": (10,), "c": (3 * 256 + 5,), "empty": (0,), "e": (513, 17)}


def payloads(codec, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [codec.encode({k: torch.randn(s, generator=g) for k, s in SHAPES.items()}, tokens=100 * (i + 1))
            for i in range(n)]  # fmt: skip


@pytest.fixture
def codec():
    return SignCodec(Manifest.from_shapes(SHAPES), chunk_size=256, key=b"k" * 16)


@pytest.mark.parametrize("n_shards", [1, 3, 7, 64, 300])
def test_exact_sharded_combine_is_the_all_gather_combine(codec, n_shards):
    p = payloads(codec)
    ref = codec.combine(p)
    got = ShardedExchange(codec, n_shards, bits=32).combine(p)
    assert all(torch.equal(got[k], ref[k]) for k in ref)  # the same arithmetic, element by element


@pytest.mark.parametrize("bits", [8, 4, 2, 1])
def test_quantised_combine_within_half_a_step(codec, bits):
    p = payloads(codec)
    ref = codec.combine(p)
    ex = ShardedExchange(codec, 4, bits=bits)
    got = ex.combine(p)
    flat_ref = torch.cat([ref[k].reshape(-1) for k in ref])
    flat = torch.cat([got[k].reshape(-1) for k in got])
    bound = (flat_ref.max() - flat_ref.min()) / (2 * (2**bits - 1))  # per chunk the range is at most this
    assert float((flat - flat_ref).abs().max()) <= float(bound) * (1 + 1e-5)
    if bits == 8:
        assert float((flat - flat_ref).abs().max()) > 0  # it really quantises
    assert sum(ex.combined_nbytes(k) for k in range(4)) < ShardedExchange(codec, 4, 32).combined_nbytes(0) * 4


def test_shards_cover_the_model_at_chunk_boundaries(codec):
    ex = ShardedExchange(codec, 6)
    assert ex.bounds[0][0] == 0 and ex.bounds[-1][1] == codec.manifest.numel
    assert all(a[1] == b[0] for a, b in zip(ex.bounds, ex.bounds[1:]))
    assert shard_bounds([0, 4, 8, 12], 2) == [(0, 4), (4, 12)]  # a tie goes to the lower boundary
    sizes = [b - a for a, b in ex.bounds]
    assert max(sizes) - min(sizes) <= 2 * 256 + 513  # equal up to a chunk (and a tensor tail)


def test_a_slice_for_another_shard_or_damaged_is_refused(codec):
    ex = ShardedExchange(codec, 4)
    sl = ex.slices(payloads(codec)[0])
    assert ex.screen_slice(1, sl[1]) is None
    assert "manifest mismatch" in ex.screen_slice(1, sl[2])  # a slot swap
    bad = bytearray(sl[1])
    bad[60] ^= 1
    assert "HMAC" in ex.screen_slice(1, bytes(bad))
    assert "truncated" in ex.screen_slice(1, sl[1][:-1])
    assert ex.screen_slice(1, sl[1] + b"x") is not None


def test_malformed_combined_frames_are_refused(codec):
    ex = ShardedExchange(codec, 3, bits=4)
    values, tokens = ex.combine_shard(0, [s[0] for s in map(ex.slices, payloads(codec))])
    frame = ex.encode_combined(0, values, tokens)
    got, t = ex.decode_combined(0, frame)
    assert t == tokens == 1500 and got.numel() == values.numel()
    with pytest.raises(PayloadError, match="wrong shard"):
        ex.decode_combined(1, frame)  # (sizes differ or digest differs first: either way refused)
    for cut in (frame[:-1], frame + b"\0", frame[:10]):
        with pytest.raises(PayloadError):
            ex.decode_combined(0, cut)
    bad = bytearray(frame)
    bad[COMBINED_AT] ^= 0xFF
    with pytest.raises(PayloadError, match="HMAC"):
        ex.decode_combined(0, bytes(bad))
    unsigned = ShardedExchange(SignCodec(codec.manifest, chunk_size=256), 3, bits=4)
    with pytest.raises(PayloadError, match="flags"):
        unsigned.decode_combined(0, frame)
    with pytest.raises(PayloadError, match="bits"):
        ShardedExchange(codec, 3, bits=8).decode_combined(0, frame)


COMBINED_AT = 60  # a byte inside the body


def test_bad_arguments_are_one_clear_error(codec):
    with pytest.raises(ValueError, match="bits"):
        ShardedExchange(codec, 2, bits=3)
    with pytest.raises(ValueError, match="n_shards"):
        ShardedExchange(codec, 0)
    with pytest.raises(ValueError, match="majority|weighted"):
        ShardedExchange(SignCodec(codec.manifest, combine_rule="majority"), 2)


def uniform(n, rtt_s=0.1, bw=1.25e8):
    return WanModel(tuple(tuple(0.0 if i == j else rtt_s for j in range(n)) for i in range(n)),
                    tuple(tuple(bw for _ in range(n)) for _ in range(n)))  # fmt: skip


def test_direct_collectives_serialise_on_each_region():
    wan = uniform(4)
    assert wan.alltoall_s(1e6) == pytest.approx(0.05 + 3 * 1e6 / 1.25e8)
    assert wan.sharded_s(4e6, 8e6) == pytest.approx(4 * 0.05 + 3 * (1e6 + 2e6 + 2 * 4) / 1.25e8)
    assert WanModel.sharded_bytes_per_worker(4e6, 8e6, 4) == pytest.approx(9e6)
    slow = wan.scaled_bandwidth(2, 0.5)  # the slowest region's interface sets the pace
    assert slow.alltoall_s(1e6) == pytest.approx(0.05 + 3 * 1e6 / 0.625e8)
    assert uniform(1).sharded_s(1e6, 1e6) == 0.0


SIZES = ShardedSizes(slices_body=42e6, slice_header=48, combined_body=336e6, combined_header=52)


def test_the_plan_takes_the_cheapest_exchange():
    small, large = choose_exchange(uniform(4), "all_gather", 42e6, SIZES), choose_exchange(uniform(128), "all_gather", 42e6, SIZES)
    assert small.name == "all_gather" and large.name == "sharded"
    assert large.seconds < large.candidates["all_gather"].seconds / 10
    assert "128 regions" in large.reason and "all-gather" in large.reason
    forced = choose_exchange(uniform(4), "all_gather", 42e6, SIZES, forced="sharded")
    assert forced.name == "sharded" and "forces" in forced.reason
    # overlapped rounds that hide both exchanges: the one with fewer bytes (1-bit slices and 8-bit shards move
    # more than 3 payloads at 4 regions, far less than 127 at 128)
    hidden = [choose_exchange(uniform(n), "all_gather", 42e6, SIZES, overlap=True, hidden_s=1e3) for n in (4, 128)]
    assert [c.name for c in hidden] == ["all_gather", "sharded"] and "fewer bytes" in hidden[1].reason
    assert choose_exchange(uniform(128), "all_reduce", 4 * 335e6).name == "all_reduce"
    flat = [choose_exchange(uniform(n), "all_gather", 42e6, SIZES).cost.received_bytes for n in (16, 256)]
    assert flat[1] < 2 * flat[0]


# ---- dense payloads (DiLoCo with a run key): float32 slices, float32 shards back -------------------------------


def dense_gather(codec, ps):
    """The dense all-gather path's combine (runtime/distributed/rounds.py): Σ reducible forms, in order."""
    summed = torch.zeros(codec.manifest.numel + 1)
    for p in ps:
        summed.add_(codec.reducible(p))
    return codec.reduced_update(summed)


@pytest.mark.parametrize("weighting,dtype", [("equal", torch.float32), ("tokens", torch.float32),
                                             ("equal", torch.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("n_shards", [1, 3, 7, 300])
def test_dense_sharded_combine_is_the_all_gather_sum_bit_for_bit(weighting, dtype, n_shards):
    from geomesh.codec import DenseCodec
    from geomesh.codec.sharded_sparse import sharded_exchange

    codec = DenseCodec(Manifest.from_shapes(SHAPES), weighting=weighting, dtype=dtype, key=b"k" * 16)
    p = payloads(codec, n=4)
    ex = sharded_exchange(codec, n_shards, bits=8)  # (bits ignored: a dense shard comes back in float32)
    got, tokens = ex.combine_with_tokens(p)
    ref = dense_gather(codec, p)
    assert all(torch.equal(got[k], ref[k]) for k in ref) and tokens == 1000 and ex.bits == 32
    d, n = codec.manifest.numel, n_shards
    assert [b - a for a, b in ex.bounds] == [(k + 1) * d // n - k * d // n for k in range(n)]
    if n_shards == 3 and dtype == torch.float32:  # per region: the bytes of a ring all-reduce, plus headers
        sent, received = ex.bytes_per_region(0)
        ring = 2 * (n - 1) / n * 4 * d
        assert sent == received and ring < sent < ring + 2 * (n - 1) * (52 + 32)


def test_a_hostile_dense_slice_drops_only_its_sender():
    from geomesh.codec import DenseCodec
    from geomesh.codec.sharded import ShardedDenseExchange

    codec = DenseCodec(Manifest.from_shapes(SHAPES), key=b"k" * 16)
    p = payloads(codec, n=4)
    ex = ShardedDenseExchange(codec, 3)
    cut = [ex.slices(x) for x in p]
    assert all(ex.screen_slice(1, c[1]) is None for c in cut)
    assert "manifest mismatch" in ex.screen_slice(1, cut[0][0])  # a slot swap (another shard's slice)
    bad = bytearray(cut[2][1])
    bad[60] ^= 1
    assert "HMAC" in ex.screen_slice(1, bytes(bad))
    assert "truncated" in ex.screen_slice(1, cut[2][1][:-1])
    assert ex.screen_slice(1, cut[2][1] + b"x") is not None
    shard = ex.codecs[1]  # a well-signed slice of a non-finite value (a sender that holds the key): refused
    values = torch.zeros(ex.numel(1))
    values[5] = float("inf")
    assert "non-finite" in ex.screen_slice(1, shard._assemble(7, [values.numpy()]))
    unsigned = ShardedDenseExchange(DenseCodec(codec.manifest), 3).slices(payloads(DenseCodec(codec.manifest))[0])
    assert ex.screen_slice(1, unsigned[1]) is not None  # an unsigned slice under the key
    # the owner combines the slices that passed: the same as the all-gather of the other senders' payloads
    kept = [c[1] for i, c in enumerate(cut) if i != 2]
    values, tokens = ex.combine_shard(1, kept)
    a, b = ex.bounds[1]
    ref = torch.cat([v.reshape(-1) for v in dense_gather(codec, [x for i, x in enumerate(p) if i != 2]).values()])
    assert torch.equal(values, ref[a:b]) and tokens == 100 + 200 + 400
    frame = ex.encode_combined(1, values, tokens)
    assert len(frame) == ex.combined_nbytes(1) == 52 + 4 * (b - a) + 32
    assert torch.equal(ex.decode_combined(1, frame)[0], values)


def test_the_plan_shards_dense_payloads_when_a_run_key_rules_out_the_all_reduce():
    big = 4 * 335e6
    dense = ShardedSizes(slices_body=big, slice_header=80, combined_body=big, combined_header=84, kind="dense",
                         exact=True)  # fmt: skip
    plain = choose_exchange(uniform(3), "all_reduce", big, dense)
    assert plain.name == "all_reduce" and list(plain.candidates) == ["all_reduce"] and "no run key" in plain.reason
    keyed = choose_exchange(uniform(3), "all_reduce", big, dense, keyed=True)
    assert keyed.name == "sharded" and "run key" in keyed.reason and "float32" in keyed.reason
    ag, sh = keyed.candidates["all_gather"], keyed.candidates["sharded"]
    assert sh.sent_bytes == pytest.approx(WanModel.allreduce_bytes_per_worker(big, 3), rel=1e-6)
    assert ag.sent_bytes == 2 * big and sh.seconds < ag.seconds
    two = choose_exchange(uniform(2), "all_reduce", big, dense, keyed=True)  # two regions: one gather is less
    assert two.name == "all_gather" and "run key" in two.reason
    hidden = choose_exchange(uniform(3), "all_reduce", big, dense, keyed=True, overlap=True, hidden_s=1e4)
    assert hidden.name == "sharded" and "fewer bytes" in hidden.reason  # overlapped, both hidden: fewer bytes
