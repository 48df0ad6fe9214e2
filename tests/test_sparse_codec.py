"""Tests of the sparse sign codec and the quantised codec: what is selected and sent, the position code's
measured size, error feedback (classic and decayed), the combine rules, the wire format, and hostile payloads
(malformed fields, every single-byte corruption, HMAC, fuzzing) as for the sign codec."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geomesh.codec import HEADER_NBYTES, MAGIC, MAX_TOKENS, DenseCodec, Manifest, PayloadError, QuantCodec, SignCodec
from geomesh.codec.sparse import SparseSignCodec

PROPS = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
HDR = struct.Struct("<4sHBBI16sQQI")


def make_tensors(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(shape, generator=g) for i, shape in enumerate(shapes)}


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors.values()]) if tensors else torch.zeros(0)


def rebuild(payload: bytes, *, fix_crc=True, **fields) -> bytes:
    names = ["magic", "version", "kind", "flags", "chunk", "digest", "tokens", "body_len", "crc"]
    vals = dict(zip(names, HDR.unpack_from(payload, 0)))
    vals.update(fields)
    buf = bytearray(payload)
    HDR.pack_into(buf, 0, *[vals[n] for n in names])
    if fix_crc:
        end = HEADER_NBYTES + vals["body_len"]
        struct.pack_into("<I", buf, 44, zlib.crc32(bytes(buf[HEADER_NBYTES:end]), zlib.crc32(bytes(buf[:44]))))
    return bytes(buf)


def with_body(payload: bytes, offset: int, data: bytes) -> bytes:
    """Overwrite body bytes at ``offset`` and fix the crc32: a well-formed but hostile payload."""
    buf = bytearray(payload)
    buf[HEADER_NBYTES + offset : HEADER_NBYTES + offset + len(data)] = data
    return rebuild(bytes(buf))


def chunks_of(codec, x):
    """(start, width, k) of every chunk, in wire order."""
    out = []
    for s in codec._segments:
        out += [(s.start + r * s.width, s.width, s.k) for r in range(s.rows)]
    return out


# ---------------------------------------------------------------------------------------------
# what is sent
# ---------------------------------------------------------------------------------------------


@PROPS
@given(
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4),
    seed=st.integers(0, 10**6),
    chunk=st.sampled_from([2, 5, 16, 64]),
    k=st.integers(1, 8),
    value_bits=st.sampled_from([1, 2]),
)
def test_sends_the_top_k_of_every_chunk_with_its_signs(shapes, seed, chunk, k, value_bits):
    tensors = make_tensors(shapes, seed)
    m = Manifest.from_tensors(tensors)
    codec = SparseSignCodec(m, chunk_size=chunk, k=min(k, chunk), value_bits=value_bits, error_feedback=False)
    payload = codec.encode(tensors, 9)
    assert len(payload) == codec.payload_nbytes()
    dec = codec.decode(payload)
    assert dec.tokens == 9
    x, y = flat(tensors), flat(dec.tensors)
    for start, width, kc in chunks_of(codec, x):
        xs, ys = x[start : start + width], y[start : start + width]
        sent = ys != 0
        assert int(sent.sum()) == kc  # random normal values: no exact zeros
        # every sent |x| is at least every unsent |x| (ties aside), and the signs match
        if kc < width:
            assert float(xs[sent].abs().min()) >= float(xs[~sent].abs().max())
        assert torch.equal(torch.sign(ys[sent]), torch.sign(xs[sent]))
        if value_bits == 1:  # one magnitude that keeps the norm of what was selected
            assert math.isclose(float(ys.norm()), float(xs[sent].norm()), rel_tol=1e-5)
            assert torch.allclose(ys[sent].abs(), ys[sent].abs()[0].expand(kc))
        else:
            assert len(set(ys[sent].abs().tolist())) <= 2


def test_position_code_size_is_measured_and_beats_raw_indices():
    m = Manifest.from_shapes({"w": (256, 4096)})  # 1,048,576 parameters
    codec = SparseSignCodec(m, chunk_size=4096, k=64)
    # Rice code: r = log2(4096/64) = 6 remainder bits + a 127-bit unary field per 64 entries
    assert codec.index_bits() == pytest.approx(6 + 127 / 64)
    assert codec.index_bits() < math.log2(4096) - 4  # 7.98 bits against 12 raw
    # the payload: 64 × (1 sign + 7.98 position) bits + 32-bit magnitude per 4096 elements, header
    assert codec.bits_per_parameter() == pytest.approx((64 * (1 + 6) + 127 + 32) / 4096 + 8 * HEADER_NBYTES / m.numel)
    ratio = DenseCodec(m).payload_nbytes() / codec.payload_nbytes()
    assert ratio >= 128  # the bar against fp32 DiLoCo; also against 1 bit:
    assert SignCodec(m).payload_nbytes() / codec.payload_nbytes() > 6.5  # 6.8x fewer bytes than 1 bit
    # a payload really has that size, and a dense random chunk's positions decode exactly
    t = {"w": torch.randn(256, 4096, generator=torch.Generator().manual_seed(3))}
    p = SparseSignCodec(m, error_feedback=False).encode(t, 1)
    assert len(p) == codec.payload_nbytes()


def test_positions_in_a_crowded_chunk_and_all_positions():
    # k = width: every position sent (r = 0, gaps all zero); k next to width: the unary bound is tight
    for width, k in [(8, 8), (9, 8), (4096, 4095), (7, 1), (1, 1)]:
        t = {"a": torch.randn(width, generator=torch.Generator().manual_seed(width))}
        codec = SparseSignCodec(Manifest.from_tensors(t), chunk_size=max(2, width), k=min(k, width),
                                error_feedback=False)  # fmt: skip
        y = codec.decode(codec.encode(t, 1)).tensors["a"]
        assert int((y != 0).sum()) == min(k, width)
    # the largest entries at the very end of a chunk (the largest gaps)
    x = torch.zeros(4096)
    x[-64:] = torch.arange(1, 65, dtype=torch.float32)
    x[:-64] = 1e-3
    codec = SparseSignCodec(Manifest.from_tensors({"a": x}), k=64, error_feedback=False)
    y = codec.decode(codec.encode({"a": x}, 1)).tensors["a"]
    assert torch.equal((y != 0).nonzero().reshape(-1), torch.arange(4096 - 64, 4096))


def test_wire_layout_by_hand():
    # one tensor of 10, chunk 10, k 2: r = floor(log2(5)) = 2, unary field 2 + (8 >> 2) = 4 bits
    x = torch.tensor([0.0, 0, -3, 0, 0, 0, 0, 0, 0, 4])
    codec = SparseSignCodec(Manifest.from_tensors({"a": x}), chunk_size=10, k=2, error_feedback=False)
    p = codec.encode({"a": x}, 5)
    mag = struct.unpack_from("<f", p, HEADER_NBYTES)[0]
    assert mag == pytest.approx(math.sqrt((9 + 16) / 2))
    bits = np.unpackbits(np.frombuffer(p[HEADER_NBYTES + 4 :], np.uint8), bitorder="little")
    # signs (-, +); gaps 2 and 6: remainders 2, 2 (low bit first); quotients 0, 1: ones at 0 and 2
    assert bits.tolist() == [0, 1, 0, 1, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    assert len(p) == HEADER_NBYTES + 4 + 2


@PROPS
@given(
    shapes=st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=2).map(tuple), min_size=1, max_size=4),
    seed=st.integers(0, 10**6),
    chunk_block_k=st.sampled_from([(16, 4, 8), (16, 2, 2), (32, 8, 16), (12, 3, 12), (64, 4, 4)]),
)
def test_block_positions_send_the_top_k_blocks_by_norm(shapes, seed, chunk_block_k):
    chunk, block, k = chunk_block_k
    tensors = make_tensors(shapes, seed)
    m = Manifest.from_tensors(tensors)
    codec = SparseSignCodec(m, chunk_size=chunk, k=k, block=block, error_feedback=False)
    payload = codec.encode(tensors, 3)
    assert len(payload) == codec.payload_nbytes()
    y = flat(codec.decode(payload).tensors)
    x = flat(tensors)
    for s in codec._segments:
        for r in range(s.rows):
            xs = x[s.start + r * s.width : s.start + (r + 1) * s.width]
            ys = y[s.start + r * s.width : s.start + (r + 1) * s.width]
            sent = ys != 0
            # a chunk the block divides sends whole blocks; a tail chunk it does not, single entries
            assert s.block == (block if s.width % block == 0 else 1)
            assert int(sent.sum()) == s.k * s.block
            blocks = sent.view(s.slots, s.block)
            assert bool((blocks.all(dim=1) | ~blocks.any(dim=1)).all())
            norms = xs.view(s.slots, s.block).square().sum(dim=1)
            chosen = blocks.any(dim=1)
            if s.k < s.slots:  # every sent block's norm at least every unsent one's
                assert float(norms[chosen].min()) >= float(norms[~chosen].max())
            assert torch.equal(torch.sign(ys[sent]), torch.sign(xs[sent]))
            assert math.isclose(float(ys.norm()), float(xs[sent].norm()), rel_tol=1e-5)  # norm kept
    assert codec.entries == int((y != 0).sum())


def test_block_position_code_size_is_measured():
    m = Manifest.from_shapes({"w": (256, 4096)})
    codec = SparseSignCodec(m, chunk_size=4096, k=432, block=4)  # 108 blocks of 4 among 1024
    # r = floor(log2(1024/108)) = 3, unary field 108 + ((1024 − 108) >> 3) = 222 bits per chunk
    assert codec.position_bits() == pytest.approx(3 + 222 / 108)  # 5.06 bits per block
    assert codec.index_bits() == pytest.approx((3 + 222 / 108) / 4)  # 1.26 bits per entry, 7.98 at block 1
    assert codec.bits_per_parameter() == pytest.approx((432 + 108 * 3 + 222 + 32) / 4096 + 8 * HEADER_NBYTES / m.numel)
    assert codec.bits_per_parameter() <= 0.25  # >= 128x fewer bytes than fp32
    assert DenseCodec(m).payload_nbytes() / codec.payload_nbytes() >= 128
    t = {"w": torch.randn(256, 4096, generator=torch.Generator().manual_seed(5))}
    assert len(SparseSignCodec(m, k=432, block=4, error_feedback=False).encode(t, 1)) == codec.payload_nbytes()
    assert SparseSignCodec(m, k=64).position_bits() == SparseSignCodec(m, k=64).index_bits()


def test_block_wire_layout_by_hand():
    # 12 elements, chunk 12, blocks of 3 (4 slots), k 6 = 2 blocks: r = floor(log2(4/2)) = 1, unary 2 + (2 >> 1) = 3
    x = torch.tensor([0.0, 0, 0, 1, -2, 2, 0, 0, 0, -3, 0.5, 0])
    codec = SparseSignCodec(Manifest.from_tensors({"a": x}), chunk_size=12, k=6, block=3, error_feedback=False)
    p = codec.encode({"a": x}, 5)
    mag = struct.unpack_from("<f", p, HEADER_NBYTES)[0]
    assert mag == pytest.approx(math.sqrt((1 + 4 + 4 + 9 + 0.25 + 0) / 6))
    bits = np.unpackbits(np.frombuffer(p[HEADER_NBYTES + 4 :], np.uint8), bitorder="little")
    # blocks 1 and 3: signs + - + - + + (0 counts as +); gaps 1 and 1: remainders 1, 1; quotients 0, 0
    assert bits.tolist() == [1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    y = codec.decode(p).tensors["a"]
    assert torch.equal(y != 0, torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1], dtype=torch.bool))
    # a block position past the last slot is refused (gaps 1 and (1 << 1) | 1 = 3: block 5 of 4)
    bad = [1, 0, 1, 0, 1, 1, 1, 1, 1, 0, 1]
    with pytest.raises(PayloadError, match="past the end of chunk 0 \\(4 blocks\\)"):
        codec.decode(with_body(p, 4, _bits_body(bad)))


def test_block_error_feedback_telescopes():
    rounds = [make_tensors([(300,), (7, 11)], seed=s) for s in range(6)]
    m = Manifest.from_tensors(rounds[0])
    codec = SparseSignCodec(m, chunk_size=64, k=16, block=4)
    sent = torch.zeros(m.numel)
    for t in rounds:
        sent += flat(codec.decode(codec.encode(t, 1)).tensors)
    assert torch.allclose(sent + flat(codec.residual), sum(flat(t) for t in rounds), atol=1e-4)


# ---------------------------------------------------------------------------------------------
# error feedback and combine
# ---------------------------------------------------------------------------------------------


def test_error_feedback_telescopes_and_decays():
    rounds = [make_tensors([(300,), (7, 11)], seed=s) for s in range(6)]
    m = Manifest.from_tensors(rounds[0])
    codec = SparseSignCodec(m, chunk_size=64, k=4)
    sent = torch.zeros(m.numel)
    for t in rounds:
        sent += flat(codec.decode(codec.encode(t, 1)).tensors)
    total = sum(flat(t) for t in rounds)
    assert torch.allclose(sent + flat(codec.residual), total, atol=1e-4)
    # decayed (SparseLoCo): e <- β·e + x − C(β·e + x)
    decayed = SparseSignCodec(m, chunk_size=64, k=4, ef_decay=0.5)
    e = torch.zeros(m.numel)
    for t in rounds:
        c = flat(decayed.decode(decayed.encode(t, 1)).tensors)
        e = 0.5 * e + flat(t) - c
        assert torch.allclose(flat(decayed.residual), e, atol=1e-5)
    # without feedback nothing is kept
    off = SparseSignCodec(m, chunk_size=64, k=4, error_feedback=False)
    off.encode(rounds[0], 1)
    assert off.residual == {}


def test_residual_state_dict_and_failed_encode():
    t = make_tensors([(100,)], seed=2)
    m = Manifest.from_tensors(t)
    codec = SparseSignCodec(m, chunk_size=32, k=3)
    codec.encode(t, 1)
    state = codec.state_dict()
    other = SparseSignCodec(m, chunk_size=32, k=3)
    other.load_state_dict(state)
    assert codec.encode(t, 2) == other.encode(t, 2)
    before = flat(codec.residual).clone()
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode({"t0": torch.full((100,), float("nan"))}, 1)
    assert torch.equal(flat(codec.residual), before)
    with pytest.raises(ValueError, match="error_feedback=False"):
        SparseSignCodec(m, chunk_size=32, k=3, error_feedback=False).load_state_dict(state)
    codec.reset_residual()
    assert codec.residual == {}


def test_combine_weights_by_tokens_or_equally():
    a, b = {"x": torch.tensor([4.0, 0, 0, 0])}, {"x": torch.tensor([0.0, 0, -2, 0])}
    m = Manifest.from_tensors(a)
    tokens = SparseSignCodec(m, chunk_size=4, k=1, error_feedback=False)
    pa, pb = tokens.encode(a, 1), tokens.encode(b, 3)
    out, n = tokens.combine_with_tokens([pa, pb])
    assert n == 4 and torch.allclose(out["x"], torch.tensor([1.0, 0, -1.5, 0]))
    equal = SparseSignCodec(m, chunk_size=4, k=1, error_feedback=False, weighting="equal")
    assert torch.allclose(equal.combine([equal.encode(a, 1), equal.encode(b, 3)])["x"], torch.tensor([2.0, 0, -1, 0]))
    with pytest.raises(ValueError, match="at least one"):
        tokens.combine([])
    # the update overwrites a reused buffer
    buf = torch.full((4,), 7.0)
    tokens.combine([pa], out=buf)
    assert torch.equal(buf, torch.tensor([4.0, 0, 0, 0]))


def test_constructor_validation():
    m = Manifest.from_shapes({"a": (10,)})
    for kwargs, word in [({"k": 0}, "k must"), ({"chunk_size": 1}, "chunk_size"), ({"k": 4097}, "k must"),
                         ({"value_bits": 3}, "value_bits"), ({"ef_decay": 0}, "ef_decay"),
                         ({"weighting": "x"}, "weighting"), ({"block": 0}, "block must"),
                         ({"block": 3, "k": 64}, "must divide"),
                         ({"block": 8, "k": 12, "chunk_size": 20}, "must divide"),
                         ({"block": 4, "k": 8, "value_bits": 2}, "value_bits=1"),
                         ({"scale": "max"}, "scale")]:  # fmt: skip
        with pytest.raises(ValueError, match=word):
            SparseSignCodec(m, **kwargs)
    with pytest.raises(ValueError, match="fmt"):
        QuantCodec(m, fmt="int4")


# ---------------------------------------------------------------------------------------------
# the quantised codec
# ---------------------------------------------------------------------------------------------


def test_int8_and_fp4_round_to_nearest_with_a_scale_per_chunk():
    t = make_tensors([(1000,), (3, 7), ()], seed=5)
    m = Manifest.from_tensors(t)
    x = flat(t)
    for fmt, qmax in (("int8", 127), ("fp4", 6)):
        codec = QuantCodec(m, fmt=fmt, chunk_size=64)
        p = codec.encode(t, 3)
        assert len(p) == codec.payload_nbytes()
        y = flat(codec.decode(p).tensors)
        for spec, off in zip(m, m.offsets):
            for a in range(0, spec.numel, 64):
                xs, ys = x[off + a : off + min(spec.numel, a + 64)], y[off + a : off + min(spec.numel, a + 64)]
                s = float(xs.abs().max()) / qmax
                i = int(xs.abs().argmax())
                assert float(ys[i]) == pytest.approx(float(xs[i]), rel=1e-6)  # the largest value is exact
                step = s if fmt == "int8" else 2 * s  # fp4's widest grid step (4 -> 6) is 2·s
                assert float((ys - xs).abs().max()) <= step / 2 + 1e-6
        if fmt == "fp4":  # every decoded value is a grid point times its chunk's scale
            grid = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
            xs, ys = x[:64], y[:64]
            s = float(xs.abs().max()) / 6
            assert all(min(abs(abs(v) / s - g) for g in grid) < 1e-4 for v in ys.tolist())
    big = Manifest.from_shapes({"w": (1024, 1024)})
    assert QuantCodec(big).bits_per_parameter() == pytest.approx(8 + 32 / 256 + 8 * HEADER_NBYTES / big.numel)
    assert QuantCodec(big, fmt="fp4").bits_per_parameter() == pytest.approx(4 + 32 / 256 + 8 * HEADER_NBYTES / big.numel)


def test_quant_malformed_bodies():
    t = make_tensors([(9,)], seed=1)
    m = Manifest.from_tensors(t)
    int8 = QuantCodec(m, chunk_size=4)
    p = int8.encode(t, 2)
    with pytest.raises(PayloadError, match="bad scale"):
        int8.decode(with_body(p, 0, struct.pack("<f", -1.0)))
    with pytest.raises(PayloadError, match="-128"):
        int8.decode(with_body(p, 12, b"\x80"))
    fp4 = QuantCodec(m, fmt="fp4", chunk_size=4)
    q = fp4.encode(t, 2)
    last = q[HEADER_NBYTES + fp4._body_len - 1]
    with pytest.raises(PayloadError, match="padding nibble"):
        fp4.decode(with_body(q, fp4._body_len - 1, bytes([last | 0x10])))
    with pytest.raises(PayloadError, match="flags mismatch"):
        int8.decode(q)  # an fp4 payload for an int8 codec


# ---------------------------------------------------------------------------------------------
# hostile payloads
# ---------------------------------------------------------------------------------------------


def _tiny():
    x = torch.tensor([0.0, 0, -3, 0, 0, 0, 0, 0, 0, 4])
    codec = SparseSignCodec(Manifest.from_tensors({"a": x}), chunk_size=10, k=2, error_feedback=False)
    return codec, codec.encode({"a": x}, 5)


def _bits_body(bits):
    return np.packbits(np.array(bits, dtype=np.uint8), bitorder="little").tobytes()


def test_malformed_sparse_payloads_are_refused_with_a_clear_message():
    t = make_tensors([(3, 5), (), (0, 4), (37,)], seed=1)
    m = Manifest.from_tensors(t)
    codec = SparseSignCodec(m, chunk_size=8, k=2)
    p = codec.encode(t, 42)
    tiny, tp = _tiny()
    cases = {
        "truncated": [p[:-1], p[:10], b""],
        "oversized": [p + b"\0"],
        "bad magic": [b"XXXX" + p[4:]],
        "version": [rebuild(p, version=2)],
        "wrong codec kind": [rebuild(p, kind=1), rebuild(p, kind=9)],
        "flags mismatch": [rebuild(p, flags=0), rebuild(p, flags=0x03), rebuild(p, flags=0x81)],
        "chunk size": [rebuild(p, chunk=16)],
        "manifest mismatch": [rebuild(p, digest=b"\0" * 16),
                              SparseSignCodec(m, chunk_size=8, k=3).encode(t, 1)],  # fmt: skip
        "body length": [rebuild(p, body_len=5)],
        "checksum": [p[:50] + bytes([p[50] ^ 1]) + p[51:], rebuild(p, fix_crc=False, tokens=43)],
        "token count": [rebuild(p, tokens=0), rebuild(p, tokens=MAX_TOKENS + 1)],
        "bad magnitude": [with_body(p, 0, struct.pack("<f", float("nan"))), with_body(p, 4, struct.pack("<f", -1.0)),
                          with_body(p, 8, struct.pack("<f", float("inf")))],  # fmt: skip
        "bytes-like": ["not bytes", None],
    }
    for word, payloads in cases.items():
        for bad in payloads:
            with pytest.raises(PayloadError, match=word):
                codec.decode(bad)
            with pytest.raises(PayloadError, match=word):
                codec.combine([p, bad])
    # body fields of the hand-built tiny payload: signs(2) remainders(2×2) unary(4)
    body = {
        "has 0 entries": [0, 1, 0, 1, 0, 1, 0, 0, 0, 0],  # no one-bit in the unary field
        "has 3 entries": [0, 1, 0, 1, 0, 1, 1, 1, 1, 0],
        "past the end": [0, 1, 1, 1, 0, 0, 0, 0, 1, 1],  # gap (2<<2)|3 = 11: position 11 of a 10-element chunk
        "padding bits": [0, 1, 0, 1, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1],
    }
    for word, bits in body.items():
        with pytest.raises(PayloadError, match=word):
            tiny.decode(with_body(tp, 4, _bits_body(bits)))
    assert tiny.decode(with_body(tp, 4, _bits_body([0, 1, 0, 1, 0, 1, 1, 0, 1, 0]))).tokens == 5
    # other codecs' payloads
    with pytest.raises(PayloadError, match="kind"):
        codec.decode(SignCodec(m).encode(t, 1))
    with pytest.raises(PayloadError, match="kind"):
        QuantCodec(m).decode(p)
    assert codec.decode(bytearray(p)).tokens == 42 == codec.decode(memoryview(p)).tokens


def test_every_single_byte_corruption_is_caught():
    t = make_tensors([(11,), (2, 3)], seed=4)
    m = Manifest.from_tensors(t)
    for codec in (SparseSignCodec(m, chunk_size=4, k=2, value_bits=2), SparseSignCodec(m, chunk_size=4, k=2, block=2),
                  QuantCodec(m, fmt="fp4", chunk_size=4)):  # fmt: skip
        p = codec.encode(t, 7)
        for i in range(len(p)):
            for flip in (0x01, 0x80, 0xFF):
                with pytest.raises(PayloadError):
                    codec.decode(p[:i] + bytes([p[i] ^ flip]) + p[i + 1 :])


def test_hmac_tag():
    t = make_tensors([(20,), (4,)])
    m = Manifest.from_tensors(t)
    for make in (lambda key: SparseSignCodec(m, chunk_size=8, k=2, key=key),
                 lambda key: QuantCodec(m, key=key)):  # fmt: skip
        signed = make(b"secret")
        p = signed.encode(t, 3)
        assert len(p) == make(None).payload_nbytes() + 32 and signed.decode(p).tokens == 3
        with pytest.raises(PayloadError, match="HMAC tag mismatch"):
            make(b"other").decode(p)
        with pytest.raises(PayloadError, match="HMAC tag mismatch"):
            signed.decode(rebuild(p, tokens=4))
        with pytest.raises(PayloadError, match="missing HMAC"):
            signed.decode(make(None).encode(t, 3))
        with pytest.raises(PayloadError, match="no key"):
            make(None).decode(p)


_FUZZ_T = make_tensors([(13,), (), (2, 5)], seed=9)
_FUZZ_M = Manifest.from_tensors(_FUZZ_T)
_FUZZ_CODECS = [SparseSignCodec(_FUZZ_M, chunk_size=4, k=2, error_feedback=False),
                SparseSignCodec(_FUZZ_M, chunk_size=8, k=3, value_bits=2, error_feedback=False),
                SparseSignCodec(_FUZZ_M, chunk_size=8, k=4, block=2, error_feedback=False),
                QuantCodec(_FUZZ_M, chunk_size=4), QuantCodec(_FUZZ_M, fmt="fp4", chunk_size=4)]  # fmt: skip
_FUZZ_P = [c.encode(_FUZZ_T, 17) for c in _FUZZ_CODECS]


@FUZZ
@given(data=st.binary(max_size=200), which=st.integers(0, len(_FUZZ_CODECS) - 1))
def test_fuzz_random_bytes(data, which):
    for candidate in (data, MAGIC + data):
        try:
            _FUZZ_CODECS[which].decode(candidate)
        except PayloadError:
            continue
        assert candidate == _FUZZ_P[which]


@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
    extra=st.binary(max_size=8),
    which=st.integers(0, len(_FUZZ_CODECS) - 1),
    fix_crc=st.booleans(),
)
def test_fuzz_mutations_of_a_valid_payload(edits, cut, extra, which, fix_crc):
    codec = _FUZZ_CODECS[which]
    buf = bytearray(_FUZZ_P[which])
    for pos, val in edits:
        buf[pos % len(buf)] = val
    data = bytes(buf)
    if fix_crc and data[:4] == MAGIC:
        try:
            data = rebuild(data)  # a hostile payload with a valid checksum: the body checks must hold
        except struct.error:
            pass
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    data += extra
    try:
        dec = codec.decode(data)
        out = codec.combine([data, data])
    except PayloadError:
        return
    assert dec.tokens >= 1
    for k, v in dec.tensors.items():
        assert v.shape == _FUZZ_T[k].shape and torch.isfinite(v).all() and torch.isfinite(out[k]).all()
