"""The sharded exchange over torch.distributed (runtime/distributed/sharded.py), 4 Gloo processes on CPU:
kept exact it gives the all-gather path's update; a malformed slice drops its sender for the round on every
leader, like a malformed payload; an absent update is left out; quantised, every leader applies the same."""

from __future__ import annotations

import warnings

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
    assert r.sent_bytes == sum(exact.slice_nbytes(k) for k in range(4) if k != rank) + 3 * exact.combined_nbytes(rank) + 2 * 3 * 4

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
    assert r.accepted == [0, 1, 2] and _same(r.update, codec.combine(p[:3]))

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
    assert r.lost_shards == [0] and not flat[a:b].any()
    assert torch.equal(flat[b:], torch.cat([v.reshape(-1) for v in whole.values()])[b:])

    q = sd.sharded_round(p[rank], ShardedExchange(codec, 4, bits=8))  # 5. quantised: the same everywhere
    flat = torch.cat([v.reshape(-1) for v in q.update.values()])
    every = [torch.empty_like(flat) for _ in range(4)]
    dist.all_gather(every, flat)
    assert all(torch.equal(every[0], e) for e in every)
    ref = torch.cat([v.reshape(-1) for v in codec.combine(p).values()])
    assert 0 < float((flat - ref).abs().max()) < 0.05 * float(ref.abs().max())


def test_sharded_exchange_over_gloo(tmp_path):
    """all_to_all_single, then the send/recv fallback, in the same 4 processes."""
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=4, join=True)
