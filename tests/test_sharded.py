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
    assert choose_exchange(uniform(128), "all_gather", 42e6, SIZES, overlap=True).name == "all_gather"
    assert choose_exchange(uniform(128), "all_reduce", 4 * 335e6).name == "all_reduce"
    flat = [choose_exchange(uniform(n), "all_gather", 42e6, SIZES).cost.received_bytes for n in (16, 256)]
    assert flat[1] < 2 * flat[0]
