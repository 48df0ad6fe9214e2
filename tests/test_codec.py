"""Tests of the payload codecs: round trips, scales, combine rules, error feedback, wire format,
malformed and forged payloads (incl. fuzzing), and the device-generic (GPU) code path on CPU."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geomesh.codec.kernels as codec_kernels
import geomesh.codec.sign as codec_sign
import geomesh.codec.wire as codec_wire
from geomesh.codec import (
    HEADER_NBYTES,
    MAGIC,
    MAX_TOKENS,
    DecodedPayload,
    DenseCodec,
    Manifest,
    PayloadError,
    SignCodec,
    TensorSpec,
)

PROPS = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

HDR = struct.Struct("<4sHBBI16sQQI")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def make_tensors(shapes, seed=0, dtype=torch.float32, zero_frac=0.0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, shape in enumerate(shapes):
        x = torch.randn(shape, generator=g, dtype=torch.float32) * scale
        if zero_frac:
            x = torch.where(torch.rand(shape, generator=g) < zero_frac, torch.zeros_like(x), x)
        out[f"t{i}"] = x.to(dtype)
    return out


def reference_signs(tensors):
    """±1 per element as sent on the wire: sign, with zeros by the parity of the global index."""
    out, k0 = {}, 0
    for name, t in tensors.items():
        x = t.detach().to(torch.float32).reshape(-1).double()
        k = torch.arange(k0, k0 + x.numel())
        thr = torch.where(k % 2 == 1, -(2.0**-126), 0.0).double()
        out[name] = torch.where(x > thr, 1.0, -1.0).double().view(t.shape)
        k0 += x.numel()
    return out


def reference_decode(tensors, chunk, scale):
    """float64 reference of s ⊙ sign with the documented chunking and zero (parity) rule."""
    out, k0 = {}, 0
    for name, t in tensors.items():
        x = t.detach().to(torch.float32).reshape(-1).double()
        n = x.numel()
        k = torch.arange(k0, k0 + n)
        thr = torch.where(k % 2 == 1, -(2.0**-126), 0.0).double()
        sign = torch.where(x > thr, 1.0, -1.0).double()
        dec = torch.empty(n, dtype=torch.float64)
        c = chunk or max(n, 1)
        for a in range(0, n, c):
            seg = x[a : a + c]
            s = seg.abs().mean() if scale == "l1" else seg.norm() / math.sqrt(seg.numel())
            dec[a : a + c] = s * sign[a : a + c]
        out[name] = dec.view(t.shape)
        k0 += n
    return out


def assert_same_sign_payload(codec, p1: bytes, p2: bytes) -> None:
    """Same header (but crc), identical sign bits, magnitudes equal up to summation order."""
    h1, h2 = list(HDR.unpack_from(p1, 0)), list(HDR.unpack_from(p2, 0))
    assert h1[:-1] == h2[:-1] and len(p1) == len(p2)
    m = codec.num_chunks
    mags1 = np.frombuffer(p1, np.float32, m, HEADER_NBYTES)
    mags2 = np.frombuffer(p2, np.float32, m, HEADER_NBYTES)
    np.testing.assert_allclose(mags1, mags2, rtol=2e-6, atol=0)
    assert p1[HEADER_NBYTES + 4 * m :] == p2[HEADER_NBYTES + 4 * m :]


def rebuild(payload: bytes, *, fix_crc=True, **fields) -> bytes:
    """Rewrite header fields of a payload (and its crc32, unless fix_crc=False)."""
    names = ["magic", "version", "kind", "flags", "chunk", "digest", "tokens", "body_len", "crc"]
    vals = dict(zip(names, HDR.unpack_from(payload, 0)))
    vals.update(fields)
    buf = bytearray(payload)
    HDR.pack_into(buf, 0, *[vals[n] for n in names])
    if fix_crc:
        end = HEADER_NBYTES + vals["body_len"]
        crc = zlib.crc32(bytes(buf[HEADER_NBYTES:end]), zlib.crc32(bytes(buf[:44])))
        struct.pack_into("<I", buf, 44, crc)
    return bytes(buf)


def with_body(payload: bytes, offset: int, data: bytes) -> bytes:
    """Overwrite body bytes at ``offset`` and fix the crc32 (a well-formed but hostile payload)."""
    buf = bytearray(payload)
    buf[HEADER_NBYTES + offset : HEADER_NBYTES + offset + len(data)] = data
    return rebuild(bytes(buf))


@pytest.fixture
def small():
    tensors = make_tensors([(3, 5), (), (0, 4), (37,), (2, 2, 3)], seed=1)
    return tensors, Manifest.from_tensors(tensors)


# ---------------------------------------------------------------------------------------------
# manifest
# ---------------------------------------------------------------------------------------------


def test_manifest_order_digest_and_validation():
    t = {"b": torch.zeros(2, 3), "a": torch.zeros(4, dtype=torch.bfloat16)}
    m = Manifest.from_tensors(t)
    assert m.names == ("b", "a") and m.numel == 10 and m.offsets == (0, 6)
    assert m == Manifest.from_tensors(list(t.items())) and m.digest() == Manifest.from_tensors(t).digest()
    assert m != Manifest.from_tensors({"a": t["a"], "b": t["b"]})  # order matters
    assert m != Manifest.from_shapes({"b": (3, 2), "a": (4,)})
    with pytest.raises(ValueError, match="duplicate"):
        Manifest([TensorSpec("x", (1,), torch.float32)] * 2)
    with pytest.raises(ValueError, match="not supported"):
        Manifest.from_tensors({"i": torch.zeros(3, dtype=torch.int64)})


def test_constructor_validation(small):
    _, m = small
    for kwargs, word in [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 2.5}, "chunk_size"),
        ({"scale": "linf"}, "scale"),
        ({"combine_rule": "mean"}, "combine_rule"),
        ({"key": b""}, "key"),
    ]:
        with pytest.raises(ValueError, match=word):
            SignCodec(m, **kwargs)
    with pytest.raises(ValueError, match="weighting"):
        DenseCodec(m, weighting="median")
    with pytest.raises(ValueError, match="dtype"):
        DenseCodec(m, dtype=torch.float64)
    with pytest.raises(TypeError):
        SignCodec({"x": torch.zeros(1)})


# ---------------------------------------------------------------------------------------------
# round trips, scales, wire format
# ---------------------------------------------------------------------------------------------

shape_st = st.lists(st.integers(0, 5), max_size=3).map(tuple)
shapes_st = st.one_of(
    st.lists(shape_st, min_size=1, max_size=4),
    st.lists(st.integers(1, 3000).map(lambda n: (n,)), min_size=1, max_size=3),
)


@PROPS
@given(
    shapes=shapes_st,
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    chunk=st.sampled_from([1, 3, 8, 13, 64, 4096, None]),
    scale=st.sampled_from(["l1", "l2"]),
    zero_frac=st.sampled_from([0.0, 0.3]),
)
def test_roundtrip_property(shapes, seed, dtype, chunk, scale, zero_frac):
    tensors = make_tensors(shapes, seed, dtype, zero_frac)
    codec = SignCodec(Manifest.from_tensors(tensors), chunk_size=chunk, scale=scale)
    payload = codec.encode(tensors, tokens=seed + 1)
    assert len(payload) == codec.payload_nbytes()
    assert codec.fp32_nbytes() == 4 * sum(t.numel() for t in tensors.values())
    dec = codec.decode(payload)
    assert isinstance(dec, DecodedPayload) and dec.tokens == seed + 1
    ref = reference_decode(tensors, chunk, scale)
    for name, x in tensors.items():
        y = dec.tensors[name]
        assert y.dtype == torch.float32 and y.shape == x.shape
        nz = x != 0
        # signs survive exactly wherever the element is nonzero
        assert bool((y[nz] != 0).all())
        assert torch.equal(torch.sign(y[nz]), torch.sign(x[nz].float()))
        torch.testing.assert_close(y.double(), ref[name], rtol=2e-5, atol=0)
    assert codec.encode(tensors, tokens=seed + 1) == payload  # deterministic


def test_l2_preserves_chunk_norm_and_l1_is_least_squares():
    x = make_tensors([(1000,)], seed=3)["t0"]
    big = make_tensors([(70_001,)], seed=4)["t0"]  # one chunk wider than the numpy-norm limit
    codec = SignCodec(Manifest.from_tensors({"x": big}), chunk_size=None)
    y = codec.decode(codec.encode({"x": big}, 1)).tensors["x"]
    assert math.isclose(float(y.double().norm()), float(big.double().norm()), rel_tol=1e-6)
    for chunk in (7, 128, None):
        dec = SignCodec(Manifest.from_tensors({"x": x}), chunk_size=chunk, scale="l2")
        y = dec.decode(dec.encode({"x": x}, 1)).tensors["x"]
        c = chunk or 1000
        for a in range(0, 1000, c):
            assert math.isclose(float(y[a : a + c].norm()), float(x[a : a + c].norm()), rel_tol=1e-5)
    # l1: s minimises ||x - s sign(x)||^2; closed form <x, sign>/d = mean|x|, and a scan agrees
    codec = SignCodec(Manifest.from_tensors({"x": x}), chunk_size=100, scale="l1")
    y = codec.decode(codec.encode({"x": x}, 1)).tensors["x"]
    for a in range(0, 1000, 100):
        seg, s = x[a : a + 100].double(), float(y[a : a + 100].abs()[0])
        assert math.isclose(s, float(seg.abs().mean()), rel_tol=1e-5)
        sgn = torch.sign(seg)

        def err(v, seg=seg, sgn=sgn):
            return float(((seg - v * sgn) ** 2).sum())

        assert all(err(s) <= err(s * f) + 1e-9 for f in np.linspace(0.5, 1.5, 41))
        # l2 magnitude is larger than the least-squares one (Cauchy-Schwarz)
        assert float(seg.norm()) / 10 >= s


def test_wire_format_bit_order_and_header():
    # element k of the concatenation is bit k % 8 of sign byte k // 8; bit 1 = +1
    a = torch.tensor([1.0, -2.0, -3.0, 4.0, 5.0, 6.0, -7.0, -8.0, 9.0])
    b = torch.tensor([[-1.0, 1.0]])
    codec = SignCodec(Manifest.from_tensors({"a": a, "b": b}), chunk_size=None, scale="l1")
    p = codec.encode({"a": a, "b": b}, tokens=123)
    magic, version, kind, flags, chunk, _digest, tokens, body_len, crc = HDR.unpack_from(p, 0)
    assert (magic, version, kind, flags, chunk, tokens) == (MAGIC, 1, 1, codec_wire.FLAG_SCALE_L1, 0, 123)
    assert body_len == 2 * 4 + 2 and len(p) == HEADER_NBYTES + body_len == codec.payload_nbytes()
    assert crc == zlib.crc32(p[HEADER_NBYTES:], zlib.crc32(p[:44]))
    mags = struct.unpack_from("<2f", p, HEADER_NBYTES)
    assert mags == pytest.approx((45 / 9, 1.0))
    signs = p[HEADER_NBYTES + 8 :]
    # a: + - - + + + - - | + ; b: - +  -> byte0 = 0b00111001, byte1 = bits(+,-,+) = 0b101
    assert signs == bytes([0b00111001, 0b00000101])
    assert signs == np.packbits(np.array([1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 1], bool), bitorder="little").tobytes()


def test_zero_elements_follow_index_parity():
    # zeros are sent as -1 at even global index, +1 at odd (also across a tensor starting at an odd
    # offset, and for -0.0); a run of zeros therefore decodes to alternating ±s.
    a = torch.tensor([0.0, 0.0, 0.0, 5.0, 0.0])  # global 0..4
    b = torch.tensor([0.0, -0.0, 0.0, -3.0, 0.0, 0.0])  # global 5..10
    codec = SignCodec(Manifest.from_tensors({"a": a, "b": b}), chunk_size=None)
    dec = codec.decode(codec.encode({"a": a, "b": b}, 1)).tensors
    got = torch.sign(torch.cat([dec["a"], dec["b"]])).tolist()
    assert got == [-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1]
    # an all-zero tensor has magnitude 0 and decodes to (signed) zeros
    z = {"z": torch.zeros(9)}
    codec = SignCodec(Manifest.from_tensors(z))
    assert torch.equal(codec.decode(codec.encode(z, 1)).tensors["z"].abs(), torch.zeros(9))


def test_wire_ratio_and_sizes_without_encoding():
    m = Manifest.from_shapes({"w": (10_000_000,)})
    codec = SignCodec(m)
    assert codec.fp32_nbytes() / codec.payload_nbytes() >= 31.7
    # a transformer-like layout with partial chunks still clears 31
    shapes = {
        f"l{i}.{k}": s
        for i in range(12)
        for k, s in {"qkv": (768, 2304), "proj": (768, 768), "ln": (768,), "bias": (2304,), "mlp": (768, 3072)}.items()
    }
    codec = SignCodec(Manifest.from_shapes(shapes))
    assert codec.fp32_nbytes() / codec.payload_nbytes() >= 31
    assert SignCodec(m, key=b"k").payload_nbytes() == codec_size(m) + 32
    assert DenseCodec(m).payload_nbytes() == HEADER_NBYTES + 4 * 10_000_000
    assert DenseCodec(m, dtype=torch.bfloat16).payload_nbytes() == HEADER_NBYTES + 2 * 10_000_000


def codec_size(m):
    return HEADER_NBYTES + 4 * math.ceil(m.numel / 4096) + math.ceil(m.numel / 8)


def test_encode_accepts_noncontiguous_and_any_dict_order():
    base = torch.randn(6, 8)
    t = {"a": base[:, ::2], "b": base.t()}
    codec = SignCodec(Manifest.from_tensors(t), chunk_size=5)
    p1 = codec.encode(t, 3)
    p2 = codec.encode({"b": base.t().contiguous(), "a": base[:, ::2].contiguous()}, 3)
    assert p1 == p2


def test_overflowing_norm_is_recomputed_scaled():
    x = torch.full((64,), 3e38)
    x[::3] = -3e38
    for scale in ("l1", "l2"):
        codec = SignCodec(Manifest.from_tensors({"x": x}), chunk_size=16, scale=scale)
        p = codec.encode({"x": x}, 1)
        y = codec.decode(p).tensors["x"]
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, x, rtol=1e-5, atol=0)
        with pytest.raises(PayloadError, match="overflow"):
            codec.combine([p, p])
        half = codec.encode({"x": x / 4}, 1)
        torch.testing.assert_close(codec.combine([half, half])["x"], x / 4, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------------------
# combine rules
# ---------------------------------------------------------------------------------------------


def test_token_weighting_hand_case():
    m = Manifest.from_shapes({"x": (4,)})
    codec = SignCodec(m, chunk_size=None, scale="l2")
    pa = codec.encode({"x": torch.tensor([1.0, -1.0, 1.0, -1.0])}, tokens=1)  # s = 1
    pb = codec.encode({"x": torch.tensor([2.0, 2.0, -2.0, -2.0])}, tokens=3)  # s = 2
    # 1/4 * 1 * [+ - + -] + 3/4 * 2 * [+ + - -]
    out, total = codec.combine_with_tokens([pa, pb])
    assert total == 4 and codec.total_tokens([pa, pb]) == 4 and codec.tokens_of(pb) == 3
    torch.testing.assert_close(out["x"], torch.tensor([1.75, 1.25, -1.25, -1.75]), rtol=1e-6, atol=1e-7)
    # order does not matter, a single payload gives its own decode
    torch.testing.assert_close(codec.combine([pb, pa])["x"], out["x"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(codec.combine([pa])["x"], codec.decode(pa).tensors["x"])


def test_majority_vote_hand_case():
    m = Manifest.from_shapes({"x": (3,)})
    codec = SignCodec(m, chunk_size=None, combine_rule="majority")
    pa = codec.encode({"x": torch.tensor([1.0, 1.0, -1.0])}, tokens=1)  # s = 1
    pb = codec.encode({"x": torch.tensor([2.0, -2.0, -2.0])}, tokens=1)  # s = 2
    pc = codec.encode({"x": torch.tensor([-1.0, 1.0, 1.0])}, tokens=3)  # s = 1
    # votes: 1+1-3 < 0, 1-1+3 > 0, -1-1+3 > 0 ; magnitude (1*1 + 1*2 + 3*1)/5 = 1.2
    out = codec.combine(iter([pa, pb, pc]))
    torch.testing.assert_close(out["x"], torch.tensor([-1.2, 1.2, 1.2]), rtol=1e-6, atol=1e-7)
    # a tied vote gives 0
    pd = codec.encode({"x": torch.tensor([-1.0, -1.0, 1.0])}, tokens=1)
    torch.testing.assert_close(codec.combine([pa, pd])["x"], torch.tensor([0.0, 0.0, 0.0]))


@PROPS
@given(
    shapes=shapes_st,
    seed=st.integers(0, 2**16),
    chunk=st.sampled_from([1, 5, 64, None]),
    tokens=st.lists(st.integers(1, 10_000), min_size=1, max_size=4),
    rule=st.sampled_from(["weighted", "majority"]),
)
def test_combine_matches_decoded_reference(shapes, seed, chunk, tokens, rule):
    manifest = Manifest.from_tensors(make_tensors(shapes))
    codec = SignCodec(manifest, chunk_size=chunk, combine_rule=rule)
    inputs = [make_tensors(shapes, seed + i, zero_frac=0.2) for i in range(len(tokens))]
    payloads = [codec.encode(x, n) for x, n in zip(inputs, tokens)]
    decoded = [codec.decode(p).tensors for p in payloads]
    signs = [reference_signs(x) for x in inputs]
    total = sum(tokens)
    out, got_total = codec.combine_with_tokens(p for p in payloads)
    assert got_total == total
    for name in manifest.names:
        if rule == "weighted":
            ref = sum(n / total * d[name].double() for n, d in zip(tokens, decoded))
        else:
            vote = sum(n * s[name] for n, s in zip(tokens, signs))
            mag = sum(n / total * d[name].double().abs() for n, d in zip(tokens, decoded))
            ref = torch.sign(vote) * mag
        torch.testing.assert_close(out[name].double(), ref, rtol=1e-5, atol=1e-6)
    # the out= buffer gives the same result and is reused
    buf = torch.full((manifest.numel,), 7.0)
    out2 = codec.combine(payloads, out=buf)
    for name in manifest.names:
        torch.testing.assert_close(out2[name], out[name], rtol=0, atol=0)
        if out2[name].numel():
            assert out2[name].data_ptr() >= buf.data_ptr()


def test_combine_streams_one_payload_at_a_time():
    t = make_tensors([(100,)])
    codec = SignCodec(Manifest.from_tensors(t))
    good = codec.encode(t, 1)
    bad = good[:-1]

    def gen():
        yield good
        yield bad
        raise AssertionError("combine pulled a payload after a bad one: it is not streaming")

    with pytest.raises(PayloadError, match="truncated"):
        codec.combine(gen())
    with pytest.raises(ValueError, match="at least one"):
        codec.combine([])
    with pytest.raises(ValueError, match="out must be"):
        codec.combine([good], out=torch.zeros(99))


@pytest.mark.parametrize("numpy_on_cpu", [True, False])
def test_combine_unaligned_blocks_match_reference(monkeypatch, numpy_on_cpu):
    # tiny blocks force many block boundaries that are not byte- or chunk-aligned; the torch
    # (accelerator) path and the numpy CPU path must agree
    monkeypatch.setattr(codec_sign, "_BLOCK_CPU", 24)
    monkeypatch.setattr(codec_sign, "_BLOCK_ACCEL", 40)
    monkeypatch.setattr(SignCodec, "_numpy_on_cpu", numpy_on_cpu)
    shapes = [(7,), (50,), (3, 11), (), (129,)]
    t = [make_tensors(shapes, s, zero_frac=0.1) for s in range(3)]
    for chunk in (5, 16, 40, None):
        for rule in ("weighted", "majority"):
            codec = SignCodec(Manifest.from_tensors(t[0]), chunk_size=chunk, combine_rule=rule)
            ps = [codec.encode(x, n) for x, n in zip(t, (1, 2, 5))]
            out = codec.combine(ps)
            dec = [codec.decode(p).tensors for p in ps]
            signs = [reference_signs(x) for x in t]
            for name in t[0]:
                if rule == "weighted":
                    ref = (1 * dec[0][name] + 2 * dec[1][name] + 5 * dec[2][name]) / 8
                else:
                    vote = 1 * signs[0][name] + 2 * signs[1][name] + 5 * signs[2][name]
                    mag = sum(n / 8 * d[name].abs() for n, d in zip((1, 2, 5), dec))
                    ref = (torch.sign(vote) * mag).float()
                torch.testing.assert_close(out[name], ref, rtol=1e-5, atol=1e-6)


def test_dense_codec_is_exactly_an_average():
    shapes = [(3, 4), (), (0,), (17,)]
    xs = [make_tensors(shapes, s) for s in range(3)]
    m = Manifest.from_tensors(xs[0])
    eq = DenseCodec(m)
    ps = [eq.encode(x, n) for x, n in zip(xs, (1, 2, 5))]
    for p, x in zip(ps, xs):
        d = eq.decode(p)
        assert d.tokens in (1, 2, 5) and all(torch.equal(d.tensors[k], x[k]) for k in x)
        assert len(p) == eq.payload_nbytes()
    out, total = eq.combine_with_tokens(iter(ps))
    assert total == 8
    for k in xs[0]:
        torch.testing.assert_close(out[k], (xs[0][k] + xs[1][k] + xs[2][k]) / 3)
    tok = DenseCodec(m, weighting="tokens")
    out = tok.combine([tok.encode(x, n) for x, n in zip(xs, (1, 2, 5))])
    for k in xs[0]:
        torch.testing.assert_close(out[k], (1 * xs[0][k] + 2 * xs[1][k] + 5 * xs[2][k]) / 8)
    # hand case: tokens 1 and 3
    hm = Manifest.from_shapes({"x": (2,)})
    tc = DenseCodec(hm, weighting="tokens")
    r = tc.combine([tc.encode({"x": torch.tensor([4.0, 0.0])}, 1), tc.encode({"x": torch.tensor([0.0, 8.0])}, 3)])
    assert r["x"].tolist() == [1.0, 6.0]
    # reduced-precision wire dtypes round-trip to within their precision
    for dt in (torch.bfloat16, torch.float16):
        c = DenseCodec(m, dtype=dt)
        d = c.decode(c.encode(xs[0], 1)).tensors
        for k in xs[0]:
            torch.testing.assert_close(d[k], xs[0][k].to(dt).float())
    with pytest.raises(ValueError, match="out of range"):
        DenseCodec(Manifest.from_shapes({"x": (2,)}), dtype=torch.float16).encode({"x": torch.tensor([1e6, 0.0])}, 1)


# ---------------------------------------------------------------------------------------------
# error feedback
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", ["l1", "l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_feedback_telescopes(scale, dtype):
    shapes = [(5, 7), (), (0,), (300,)]
    codec = SignCodec(Manifest.from_tensors(make_tensors(shapes)), chunk_size=16, scale=scale, error_feedback=True)
    sent = {k: torch.zeros(s, dtype=torch.float64) for k, s in zip(make_tensors(shapes), shapes)}
    given_ = {k: torch.zeros_like(v) for k, v in sent.items()}
    for r in range(6):
        x = make_tensors(shapes, seed=r, dtype=dtype, zero_frac=0.1)
        dec = codec.decode(codec.encode(x, 10)).tensors
        for k in x:
            sent[k] += dec[k].double()
            given_[k] += x[k].double()
    res = codec.residual
    assert set(res) == set(sent) and all(v.dtype == torch.float32 for v in res.values())
    for k, total_sent in sent.items():
        torch.testing.assert_close(total_sent + res[k].double(), given_[k], rtol=0, atol=1e-5)


def test_error_feedback_state_dict_and_failed_encode():
    t = make_tensors([(40,), (3, 3)])
    m = Manifest.from_tensors(t)
    a = SignCodec(m, chunk_size=8, error_feedback=True)
    assert a.residual == {} and a.state_dict()["residual"] == {}
    a.encode(t, 1)
    state = a.state_dict()
    b = SignCodec(m, chunk_size=8, error_feedback=True)
    b.load_state_dict(state)
    t2 = make_tensors([(40,), (3, 3)], seed=5)
    assert a.encode(t2, 2) == b.encode(t2, 2)
    before = {k: v.clone() for k, v in a.residual.items()}
    bad = dict(t2, t1=torch.full((3, 3), float("nan")))
    with pytest.raises(ValueError, match="'t1'.*NaN"):
        a.encode(bad, 1)
    assert all(torch.equal(before[k], a.residual[k]) for k in before)
    a.reset_residual()
    assert a.residual == {}
    with pytest.raises(ValueError, match="error_feedback=False"):
        SignCodec(m).load_state_dict(state)
    with pytest.raises(TypeError, match="mapping"):
        b.load_state_dict({"residual": [1, 2]})
    with pytest.raises(ValueError, match="shape"):
        b.load_state_dict({"residual": {"t0": torch.zeros(41), "t1": torch.zeros(3, 3)}})


def test_error_feedback_flag_must_match():
    t = make_tensors([(10,)])
    m = Manifest.from_tensors(t)
    with pytest.raises(PayloadError, match="flags mismatch"):
        SignCodec(m).decode(SignCodec(m, error_feedback=True).encode(t, 1))


# ---------------------------------------------------------------------------------------------
# encode-side errors
# ---------------------------------------------------------------------------------------------


def test_encode_refuses_bad_inputs(small):
    tensors, m = small
    codec = SignCodec(m)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = dict(tensors)
        x["t3"] = tensors["t3"].clone()
        x["t3"][5] = bad
        with pytest.raises(ValueError, match="'t3'.*NaN or Inf"):
            codec.encode(x, 1)
        with pytest.raises(ValueError, match="'t3'.*NaN or Inf"):
            DenseCodec(m).encode(x, 1)
    with pytest.raises(ValueError, match="missing \\['t4'\\]"):
        codec.encode({k: v for k, v in tensors.items() if k != "t4"}, 1)
    with pytest.raises(ValueError, match="unexpected \\['zz'\\]"):
        codec.encode(dict(tensors, zz=torch.zeros(1)), 1)
    with pytest.raises(ValueError, match="'t0' has shape"):
        codec.encode(dict(tensors, t0=torch.zeros(5, 3)), 1)
    with pytest.raises(ValueError, match="dtype"):
        codec.encode(dict(tensors, t0=torch.zeros(3, 5, dtype=torch.float64)), 1)
    for tok in (0, -1, MAX_TOKENS + 1):
        with pytest.raises(ValueError, match="tokens"):
            codec.encode(tensors, tok)
    for tok in (1.0, True, "3"):
        with pytest.raises(TypeError, match="tokens"):
            codec.encode(tensors, tok)


# ---------------------------------------------------------------------------------------------
# malformed payloads
# ---------------------------------------------------------------------------------------------


def test_malformed_payloads_are_refused_with_a_clear_message(small):
    tensors, m = small
    codec = SignCodec(m, chunk_size=4)
    p = codec.encode(tensors, 42)
    cases = {
        "truncated": [p[:-1], p[:10], b""],
        "oversized": [p + b"\0", p + p],
        "bad magic": [b"XXXX" + p[4:]],
        "version": [rebuild(p, version=2)],
        "wrong codec kind": [rebuild(p, kind=2), rebuild(p, kind=9)],
        "flags mismatch": [rebuild(p, flags=codec_wire.FLAG_SCALE_L1), rebuild(p, flags=0x80)],
        "chunk size": [rebuild(p, chunk=8)],
        "manifest mismatch": [
            SignCodec(Manifest.from_shapes({"t0": (5, 3)}), chunk_size=4).encode({"t0": torch.ones(5, 3)}, 1),
            rebuild(p, digest=b"\0" * 16),
        ],
        "body length": [rebuild(p, body_len=5)],
        "checksum": [p[:60] + bytes([p[60] ^ 1]) + p[61:], rebuild(p, fix_crc=False, tokens=43)],
        "token count": [rebuild(p, tokens=0), rebuild(p, tokens=MAX_TOKENS + 1), rebuild(p, tokens=2**64 - 1)],
        "magnitude": [
            with_body(p, 0, struct.pack("<f", float("nan"))),
            with_body(p, 4, struct.pack("<f", float("inf"))),
            with_body(p, 8, struct.pack("<f", -1.0)),
        ],
        "padding bits": [with_body(p, codec._body_len - 1, bytes([p[-1] | 0x80]))],
        "bytes-like": ["not bytes", None, [1, 2, 3]],
    }
    assert m.numel % 8 != 0  # so the padding case is meaningful
    for word, payloads in cases.items():
        for bad in payloads:
            with pytest.raises(PayloadError, match=word):
                codec.decode(bad)
            with pytest.raises(PayloadError, match=word):
                codec.combine([p, bad])
    # a dense payload for a sign codec and vice versa
    with pytest.raises(PayloadError, match="kind"):
        codec.decode(DenseCodec(m).encode(tensors, 1))
    with pytest.raises(PayloadError, match="kind"):
        DenseCodec(m).decode(p)
    # the magnitude error names the tensor
    with pytest.raises(PayloadError, match="'t0'"):
        codec.decode(with_body(p, 0, struct.pack("<f", float("nan"))))
    # memoryview / bytearray payloads are accepted
    assert codec.decode(bytearray(p)).tokens == 42 == codec.decode(memoryview(p)).tokens


def test_dense_malformed_payloads(small):
    tensors, m = small
    dc = DenseCodec(m)
    p = dc.encode(tensors, 5)
    with pytest.raises(PayloadError, match="non-finite value"):
        dc.decode(with_body(p, 4 * 15, struct.pack("<f", float("nan"))))  # element 15 = tensor t1
    with pytest.raises(PayloadError, match="'t1'"):
        dc.decode(with_body(p, 4 * 15, struct.pack("<f", float("inf"))))
    with pytest.raises(PayloadError, match="flags mismatch"):
        DenseCodec(m, dtype=torch.bfloat16).decode(p)
    with pytest.raises(PayloadError, match="checksum"):
        dc.decode(p[:-1] + bytes([p[-1] ^ 0x10]))


def test_every_single_byte_corruption_is_caught():
    t = make_tensors([(11,), (2, 3)], seed=4)
    codec = SignCodec(Manifest.from_tensors(t), chunk_size=4)
    p = codec.encode(t, 7)
    for i in range(len(p)):
        for flip in (0x01, 0x80, 0xFF):
            bad = p[:i] + bytes([p[i] ^ flip]) + p[i + 1 :]
            with pytest.raises(PayloadError):
                codec.decode(bad)


def test_hmac_tag():
    t = make_tensors([(20,), (4,)])
    m = Manifest.from_tensors(t)
    signed = SignCodec(m, key=b"secret")
    p = signed.encode(t, 3)
    assert len(p) == signed.payload_nbytes() == SignCodec(m).payload_nbytes() + 32
    assert signed.decode(p).tokens == 3
    with pytest.raises(PayloadError, match="HMAC tag mismatch"):
        SignCodec(m, key=b"other").decode(p)
    # tampering with a re-computed crc is still caught by the tag
    with pytest.raises(PayloadError, match="HMAC tag mismatch"):
        signed.decode(rebuild(p, tokens=4))
    with pytest.raises(PayloadError, match="missing HMAC"):
        signed.decode(SignCodec(m).encode(t, 3))
    with pytest.raises(PayloadError, match="no key"):
        SignCodec(m).decode(p)
    dense = DenseCodec(m, key=b"secret")
    with pytest.raises(PayloadError, match="HMAC"):
        DenseCodec(m, key=b"x").decode(dense.encode(t, 1))


# ---------------------------------------------------------------------------------------------
# fuzzing: decode either succeeds correctly or raises PayloadError, nothing else
# ---------------------------------------------------------------------------------------------

_FUZZ_T = make_tensors([(13,), (), (2, 5)], seed=9)
_FUZZ_SIGN = SignCodec(Manifest.from_tensors(_FUZZ_T), chunk_size=4)
_FUZZ_DENSE = DenseCodec(Manifest.from_tensors(_FUZZ_T))
_FUZZ_P = {id(_FUZZ_SIGN): _FUZZ_SIGN.encode(_FUZZ_T, 17), id(_FUZZ_DENSE): _FUZZ_DENSE.encode(_FUZZ_T, 17)}


def _decode_or_payload_error(codec, data, original):
    try:
        dec = codec.decode(data)
    except PayloadError:
        return
    # success is only acceptable for the untouched payload (or an identical one)
    assert data == original
    ref = codec.decode(original)
    assert dec.tokens == ref.tokens and all(torch.equal(dec.tensors[k], ref.tensors[k]) for k in ref.tensors)


@FUZZ
@given(data=st.binary(max_size=200), codec=st.sampled_from([_FUZZ_SIGN, _FUZZ_DENSE]))
def test_fuzz_random_bytes(data, codec):
    _decode_or_payload_error(codec, data, _FUZZ_P[id(codec)])
    _decode_or_payload_error(codec, MAGIC + data, _FUZZ_P[id(codec)])


@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
    extra=st.binary(max_size=8),
    codec=st.sampled_from([_FUZZ_SIGN, _FUZZ_DENSE]),
    fix_crc=st.booleans(),
)
def test_fuzz_mutations_of_a_valid_payload(edits, cut, extra, codec, fix_crc):
    original = _FUZZ_P[id(codec)]
    buf = bytearray(original)
    for pos, val in edits:
        buf[pos % len(buf)] = val
    data = bytes(buf)
    if fix_crc and data[:4] == MAGIC:
        try:
            data = rebuild(data)  # hostile payload with a valid checksum: body checks must hold
        except struct.error:
            pass
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    data += extra
    try:
        dec = codec.decode(data)
    except PayloadError:
        return
    # a valid-checksum payload may decode: then it must be well-formed output
    assert dec.tokens >= 1
    for k, v in dec.tensors.items():
        assert v.shape == _FUZZ_T[k].shape and torch.isfinite(v).all()


# ---------------------------------------------------------------------------------------------
# the device-generic (accelerator) path, exercised on CPU; and CUDA when present
# ---------------------------------------------------------------------------------------------


@PROPS
@given(n=st.integers(0, 300).map(lambda k: 8 * k), seed=st.integers(0, 1000))
def test_torch_bit_packing_matches_numpy(n, seed):
    g = torch.Generator().manual_seed(seed)
    bits = torch.rand(n, generator=g) > 0.5
    ref = np.packbits(bits.numpy(), bitorder="little")
    assert np.array_equal(codec_kernels._pack_bits_torch(bits).numpy(), ref)
    for numpy_on_cpu in (True, False):
        b01 = codec_kernels._unpack01(torch.from_numpy(ref), torch.empty(n), numpy_on_cpu)
        assert torch.equal(b01, bits.float())


def test_all_byte_values_pack_and_unpack():
    v = torch.arange(256, dtype=torch.uint8)
    bits = ((v.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).bool().reshape(-1)
    assert torch.equal(codec_kernels._pack_bits_torch(bits), v)
    for numpy_on_cpu in (True, False):
        assert torch.equal(codec_kernels._unpack01(v, torch.empty(2048), numpy_on_cpu), bits.float())


@pytest.mark.parametrize("ef", [False, True])
def test_torch_path_encodes_identical_bytes(monkeypatch, ef):
    shapes = [(3, 5), (), (0, 4), (4100,), (9,)]
    t = make_tensors(shapes, seed=2, zero_frac=0.2)
    m = Manifest.from_tensors(t)
    ref_codec = SignCodec(m, chunk_size=16, error_feedback=ef)
    gen_codec = SignCodec(m, chunk_size=16, error_feedback=ef)
    monkeypatch.setattr(gen_codec, "_numpy_on_cpu", False)
    for r in range(2):
        x = make_tensors(shapes, seed=10 + r, zero_frac=0.2)
        assert_same_sign_payload(ref_codec, ref_codec.encode(x, 5), gen_codec.encode(x, 5))
    if ef:
        for k in ref_codec.residual:
            torch.testing.assert_close(ref_codec.residual[k], gen_codec.residual[k], rtol=0, atol=1e-5)


@pytest.mark.parametrize("block", [8, 40, 4096, 1 << 20])
def test_blocked_threaded_cpu_signs_match_torch_path(monkeypatch, block):
    # small blocks: many blocks cut through tensors at unaligned places, spread over threads
    monkeypatch.setattr(codec_kernels, "_SIGN_BLOCK", block)
    monkeypatch.setattr(codec_sign, "_NORM_PIECE", 150)  # several norm tasks per run
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    shapes = [(13,), (), (0,), (5, 9), (4099,), (7,)]
    m = Manifest.from_tensors(make_tensors(shapes))
    for ef in (False, True):
        a, b = SignCodec(m, chunk_size=64, error_feedback=ef), SignCodec(m, chunk_size=64, error_feedback=ef)
        b._numpy_on_cpu = False
        for r in range(2):
            x = make_tensors(shapes, seed=r, zero_frac=0.25)
            assert_same_sign_payload(a, a.encode(x, 2), b.encode(x, 2))
        if ef:
            for k in a.residual:
                torch.testing.assert_close(a.residual[k], b.residual[k], rtol=0, atol=1e-5)


def test_empty_manifest():
    for codec in (
        SignCodec(Manifest.from_tensors({})),
        SignCodec(Manifest.from_tensors({"e": torch.zeros(0)})),
        DenseCodec(Manifest.from_tensors({})),
    ):
        names = codec.manifest.names
        p = codec.encode({n: torch.zeros(0) for n in names}, 5)
        assert len(p) == codec.payload_nbytes() == HEADER_NBYTES
        assert codec.decode(p).tokens == 5
        out, total = codec.combine_with_tokens([p, p])
        assert total == 10 and all(v.numel() == 0 for v in out.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    shapes = [(3, 5), (), (0, 4), (5000,), (9,)]
    t = make_tensors(shapes, seed=2, zero_frac=0.1)
    m = Manifest.from_tensors(t)
    for ef in (False, True):
        cpu, gpu = SignCodec(m, error_feedback=ef), SignCodec(m, error_feedback=ef)
        pc = cpu.encode(t, 3)
        pg = gpu.encode({k: v.cuda() for k, v in t.items()}, 3)
        assert_same_sign_payload(cpu, pc, pg)
        if ef:
            assert all(v.is_cuda for v in gpu.residual.values())
        out = gpu.combine([pg, pc], device="cuda")
        ref = cpu.combine([pg, pc])
        for k in out:
            assert out[k].is_cuda
            torch.testing.assert_close(out[k].cpu(), ref[k])
        dec = gpu.decode(pg, device="cuda")
        assert all(v.is_cuda for v in dec.tensors.values())
