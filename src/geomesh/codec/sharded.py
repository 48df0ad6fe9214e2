"""The sharded exchange of sign payloads: each region combines one shard, so bytes and combine work per
region stay flat as regions grow.

An all-gather of 1-bit payloads costs every region (N−1)·P/8 bytes received and O(N·P) combine work. The
sharded exchange cuts the manifest's flat index space into N shards (at chunk boundaries, about P/N
elements each); shard k is owned by region k. A round is then

1. every region cuts its payload into N *slices* (:meth:`ShardedExchange.slices`) and sends slice k to
   shard k's owner (an all-to-all: about P/8 bytes out per region, whatever N);
2. each owner screens and combines the N slices of its shard, token-weighted exactly as
   :meth:`SignCodec.combine` does (:meth:`ShardedExchange.combine_shard`: O(P/N) · N = O(P) work);
3. the owner quantises its combined shard per chunk to ``bits`` bits (:meth:`ShardedExchange.encode_combined`)
   and sends the frame to every region (an all-to-all of P·bits/(8N) bytes per pair);
4. every region decodes the N combined frames (:meth:`ShardedExchange.decode_combined`, the owner its own
   frame too, so every region applies the very same update) and reassembles the update
   (:meth:`ShardedExchange.assemble`).

A slice is itself a sign payload (:mod:`geomesh.codec.wire`) of the shard's own manifest, whose tensors are
the pieces of the model's tensors that fall in the shard (named ``"name[lo:hi]"``, local element ranges):
because shards start and end at chunk boundaries, a piece's chunks are exactly the original chunks, so the
slice carries the original magnitudes and sign bits, the sender's token count, the crc32 and (with the run's
key) the HMAC tag, and a slice meant for another shard fails the layout digest. An owner reads its slices
with an ordinary :class:`SignCodec` of the shard manifest, i.e. with every check a payload gets.

Combined frame (all integers little-endian)
-------------------------------------------
====== ====== ============== ===============================================================
offset bytes  field          meaning
====== ====== ============== ===============================================================
0      4      magic          ``b"GMSC"``
4      2      version (u16)  1
6      1      bits (u8)      1, 2, 4 or 8 (per-chunk linear codes) or 32 (float32, exact)
7      1      flags (u8)     bit 2: an HMAC tag follows the body; others zero
8      4      shard (u32)    the shard's index k
12     4      shards (u32)   the number of shards N
16     16     layout digest  sha256 over "combined", bits, k, N, the shard manifest, cut to 16
32     8      tokens (u64)   Σ n_i of the slices combined, 1 <= tokens <= 2**53
40     8      body length    bytes of body; must equal what the layout implies
48     4      crc32 (u32)    zlib.crc32 over bytes [0, 48) followed by the body
52     B      body           bits 32: the shard's float32 values; else per chunk (lo, step)
                             as float32 pairs, then the codes, ``bits`` per element, packed
                             little-endian (element e in bits [e·bits, (e+1)·bits)); the
                             unused high bits of the last byte are zero
52+B   32     HMAC tag       only with flag bit 2: HMAC-SHA256(key, bytes [0, 52+B))
====== ====== ============== ===============================================================

A value is ``lo + code·step`` with ``lo`` the chunk's minimum and ``step = (max − lo)/(2**bits − 1)``;
codes are rounded to nearest (deterministic: the owner sends one frame and every region decodes the same
values). An empty shard (a model with fewer chunks than regions) sends an empty slice and an empty frame.
Everything here is pure: tensors and bytes in, tensors and bytes out, no I/O.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..errors import PayloadError
from .dense import DenseCodec
from .manifest import Manifest, TensorSpec
from .sign import SignCodec
from .wire import MAX_TOKENS, _as_bytes_view, _frombuffer

_F32 = torch.float32
COMBINED_MAGIC = b"GMSC"
COMBINED_VERSION = 1
COMBINED_BITS = (1, 2, 4, 8, 32)
MAX_SHARDS = 1 << 16
_FLAG_HMAC = 0x04
# magic, version, bits, flags, shard, shards, layout digest, tokens, body length, crc32
_CHEADER = struct.Struct("<4sHBBII16sQQI")
COMBINED_HEADER_NBYTES = _CHEADER.size  # 52
_CRC_AT = COMBINED_HEADER_NBYTES - 4
_TAG = 32


def chunk_widths(manifest: Manifest, chunk_size: int | None) -> list[int]:
    """The sign codec's chunks in global order (their widths): per tensor, full chunks then the tail."""
    widths: list[int] = []
    for spec in manifest:
        n = spec.numel
        if n:
            c = chunk_size if chunk_size is not None else n
            full, tail = divmod(n, c)
            widths += [c] * full + ([tail] if tail else [])
    return widths


def shard_bounds(edges: Sequence[int], n_shards: int) -> list[tuple[int, int]]:
    """Cut ``[0, edges[-1])`` into ``n_shards`` ranges whose ends are chosen among ``edges`` (the chunk
    boundaries, ascending, from 0), each end the boundary nearest to k·d/N: equal shards up to a chunk."""
    d = edges[-1]
    ends, prev = [], 0
    for k in range(1, n_shards):
        t = k * d / n_shards
        i = bisect.bisect_left(edges, t)
        cand = [e for e in edges[max(0, i - 1) : i + 1] if e >= prev] or [prev]
        prev = min(cand, key=lambda e: (abs(e - t), e))
        ends.append(prev)
    ends.append(d)
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


class ShardedExchange:
    """The sharded exchange's layout and steps for one sign codec's payloads and ``n_shards`` owners.

    Args:
        codec: the run's :class:`SignCodec` (its manifest, chunk size, scale, flags and key).
        n_shards: the number of owners N (the live regions of the round).
        bits: the combined shard's bits per element: 1, 2, 4, 8, or 32 (float32: the exact combine).
    """

    # what the combined frame's layout digest names besides its shard (sparse payloads add their own)
    _digest_kind = ""

    def __init__(self, codec: SignCodec, n_shards: int, bits: int = 8):
        self._check_codec(codec)
        if isinstance(n_shards, bool) or not isinstance(n_shards, int) or not 1 <= n_shards <= MAX_SHARDS:
            raise ValueError(f"n_shards must be an int in [1, {MAX_SHARDS}], got {n_shards!r}")
        if bits not in COMBINED_BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, COMBINED_BITS))}, got {bits!r}")
        self.codec, self.n, self.bits, self.key = codec, n_shards, bits, codec.key
        manifest = codec.manifest
        widths = chunk_widths(manifest, codec.chunk_size)
        edges = [0]
        for w in widths:
            edges.append(edges[-1] + w)
        self.bounds = shard_bounds(edges, n_shards)
        self.chunk_bounds = [(bisect.bisect_left(edges, a), bisect.bisect_left(edges, b)) for a, b in self.bounds]
        self._widths = widths
        self._cut(manifest)

    def _cut(self, manifest: Manifest) -> None:
        """Each shard's manifest (the pieces of the model's tensors in it), its slices' codec and digest."""
        self.manifests: list[Manifest | None] = []
        self.codecs: list[Any] = []
        for a, b in self.bounds:
            specs = []
            for spec, off in zip(manifest, manifest.offsets):
                lo, hi = max(a, off), min(b, off + spec.numel)
                if lo < hi:
                    specs.append(TensorSpec(f"{spec.name}[{lo - off}:{hi - off}]", (hi - lo,), spec.dtype))
            m = Manifest(specs) if specs else None
            self.manifests.append(m)
            self.codecs.append(None if m is None else self._shard_codec(m))
        self._digests = [self._combined_digest(k) for k in range(self.n)]

    def _check_codec(self, codec) -> None:
        if not isinstance(codec, SignCodec):
            raise TypeError(f"the sharded exchange needs a SignCodec, got {type(codec).__name__}")
        if codec.combine_rule != "weighted":
            raise ValueError("the sharded exchange combines token-weighted sign payloads (combine_rule 'weighted')")

    def _shard_codec(self, manifest: Manifest):
        """The codec that reads (and checks) the slices of the shard whose tensors are ``manifest``."""
        c = self.codec
        return SignCodec(manifest, chunk_size=c.chunk_size, scale=c.scale, error_feedback=c.error_feedback, key=c.key)

    # ---- sizes ----------------------------------------------------------------------------
    def numel(self, k: int) -> int:
        a, b = self.bounds[k]
        return b - a

    def slice_nbytes(self, k: int) -> int:
        """Bytes of the slice a region sends to shard ``k``'s owner."""
        c = self.codecs[k]
        return 0 if c is None else c.payload_nbytes()

    def _body_len(self, k: int) -> int:
        n = self.numel(k)
        if self.bits == 32:
            return 4 * n
        m0, m1 = self.chunk_bounds[k]
        return 8 * (m1 - m0) + (n * self.bits + 7) // 8

    def combined_nbytes(self, k: int) -> int:
        """Bytes of shard ``k``'s combined frame."""
        if self.numel(k) == 0:
            return 0
        return COMBINED_HEADER_NBYTES + self._body_len(k) + (_TAG if self.key else 0)

    def bytes_per_region(self, k: int) -> tuple[int, int]:
        """(sent, received) by region ``k`` (owner of shard k) in one round, over the WAN (its own slice and
        frame stay home)."""
        slices = sum(self.slice_nbytes(j) for j in range(self.n) if j != k)
        frames = sum(self.combined_nbytes(j) for j in range(self.n) if j != k)
        mine_in = (self.n - 1) * self.slice_nbytes(k)
        mine_out = (self.n - 1) * self.combined_nbytes(k)
        return slices + mine_out, mine_in + frames

    # ---- step 1: slices -------------------------------------------------------------------
    def slices(self, payload: bytes) -> list[bytes]:
        """The N slices of one region's payload (checked first, as any payload is), slice k for shard k."""
        tokens, body = self.codec._parse(payload)
        mags, packed = self.codec._body(body)
        mags_np, packed_np = mags.numpy(), packed.numpy()
        out = []
        for k, ((a, b), (m0, m1)) in enumerate(zip(self.bounds, self.chunk_bounds)):
            c = self.codecs[k]
            out.append(b"" if c is None else c._assemble(tokens, [mags_np[m0:m1], _bit_slice(packed_np, a, b)]))
        return out

    # ---- step 2: the owner's combine ------------------------------------------------------
    def screen_slice(self, k: int, frame: bytes) -> str | None:
        """None when ``frame`` is a valid slice of shard ``k``, else why not (a bad slice drops its sender)."""
        try:
            self._check_slice(k, frame)
        except (PayloadError, ValueError) as exc:
            return str(exc)
        return None

    def _check_slice(self, k: int, frame: bytes) -> None:
        c = self.codecs[k]
        if c is None:
            if len(_as_bytes_view(frame)) != 0:
                raise PayloadError(f"shard {k} is empty, but its slice has {len(frame)} bytes")
            return
        c._body(c._parse(frame)[1])

    def combine_shard(self, k: int, slices: Sequence[bytes], *, device: torch.device | str = "cpu",
                      ) -> tuple[torch.Tensor, int]:  # fmt: skip
        """Shard ``k``'s token-weighted combine of the (already screened) ``slices``: (float32 values, Σ n_i).
        The same arithmetic as :meth:`SignCodec.combine` on the shard's elements."""
        c = self.codecs[k]
        if not slices:
            raise ValueError("combine_shard needs at least one slice")
        if c is None:  # an empty shard: its slices are empty, it weighs nothing
            for s in slices:
                self._check_slice(k, s)
            return torch.empty(0, dtype=_F32, device=device), 0
        out = torch.empty(self.numel(k), dtype=_F32, device=device)
        _, tokens = c.combine_with_tokens(slices, device=device, out=out)
        return out, tokens

    # ---- step 3: the combined frame -------------------------------------------------------
    def _combined_digest(self, k: int) -> bytes:
        h = hashlib.sha256()
        h.update(f"geomesh-sharded\0combined{self._digest_kind};bits={self.bits};shard={k}/{self.n};"
                 f"chunk={getattr(self.codec, 'chunk_size', None)}\0".encode())
        m = self.manifests[k]
        h.update(m.canonical() if m is not None else b"")
        return h.digest()[:16]

    def encode_combined(self, k: int, values: torch.Tensor, tokens: int) -> bytes:
        """Shard ``k``'s combined values as a frame of ``bits`` bits per element (per-chunk linear codes)."""
        n = self.numel(k)
        values = values.detach().reshape(-1).to("cpu", _F32)
        if values.numel() != n:
            raise ValueError(f"shard {k} has {n} elements, got {values.numel()}")
        if n == 0:
            return b""
        if not bool(torch.isfinite(values).all()):
            raise ValueError(f"shard {k}: the combined values are not finite")
        if self.bits == 32:
            body = [values.numpy()]
        else:
            lo, step, codes = _quantise(values, self._shard_widths(k), self.bits)
            body = [torch.stack([lo, step], 1).numpy(), _pack_codes(codes, self.bits)]
        body_len = self._body_len(k)
        buf = bytearray(COMBINED_HEADER_NBYTES + body_len + (_TAG if self.key else 0))
        pos = COMBINED_HEADER_NBYTES
        for part in body:
            raw = np.ascontiguousarray(part).tobytes()
            buf[pos : pos + len(raw)] = raw
            pos += len(raw)
        flags = _FLAG_HMAC if self.key else 0
        _CHEADER.pack_into(buf, 0, COMBINED_MAGIC, COMBINED_VERSION, self.bits, flags, k, self.n, self._digests[k],
                           int(tokens), body_len, 0)  # fmt: skip
        mv = memoryview(buf)
        end = COMBINED_HEADER_NBYTES + body_len
        struct.pack_into("<I", buf, _CRC_AT, zlib.crc32(mv[COMBINED_HEADER_NBYTES:end], zlib.crc32(mv[:_CRC_AT])))
        if self.key:
            buf[end:] = hmac.new(self.key, mv[:end], hashlib.sha256).digest()
        return bytes(buf)

    def _shard_widths(self, k: int) -> list[int]:
        m0, m1 = self.chunk_bounds[k]
        return self._widths[m0:m1]

    # ---- step 4: decode and reassemble ----------------------------------------------------
    def decode_combined(self, k: int, frame: bytes) -> tuple[torch.Tensor, int]:
        """Check shard ``k``'s combined frame (untrusted bytes) and return (float32 values, Σ n_i); any
        malformed frame raises :class:`PayloadError` naming the problem, before its body is read."""
        mv = _as_bytes_view(frame)
        n, size = self.numel(k), len(mv)
        expected = self.combined_nbytes(k)
        if n == 0:
            if size:
                raise PayloadError(f"shard {k} is empty, but its combined frame has {size} bytes")
            return torch.empty(0, dtype=_F32), 0
        if size < COMBINED_HEADER_NBYTES:
            raise PayloadError(f"truncated combined frame: {size} bytes, shorter than the header")
        magic, version, bits, flags, shard, shards, digest, tokens, body_len, crc = _CHEADER.unpack_from(mv, 0)
        if magic != COMBINED_MAGIC:
            raise PayloadError(f"bad magic {bytes(magic)!r} (expected {COMBINED_MAGIC!r}): not a combined shard")
        if version != COMBINED_VERSION:
            raise PayloadError(f"unsupported combined-frame version {version} (this reads {COMBINED_VERSION})")
        if bits != self.bits:
            raise PayloadError(f"bits mismatch: frame has {bits}, this exchange uses {self.bits}")
        if flags != (_FLAG_HMAC if self.key else 0):
            raise PayloadError(f"flags mismatch: frame has 0x{flags:02x}, expected "
                               f"0x{_FLAG_HMAC if self.key else 0:02x} (HMAC tag {'required' if self.key else 'not expected'})")  # fmt: skip
        if (shard, shards) != (k, self.n):
            raise PayloadError(f"wrong shard: frame is shard {shard} of {shards}, expected {k} of {self.n}")
        if digest != self._digests[k]:
            raise PayloadError("layout digest mismatch: the frame was made for another model or shard layout")
        if body_len != self._body_len(k):
            raise PayloadError(f"body length mismatch: header says {body_len}, the layout implies {self._body_len(k)}")
        if size != expected:
            raise PayloadError(f"{'truncated' if size < expected else 'oversized'} combined frame: {size} bytes, "
                               f"expected {expected}")  # fmt: skip
        end = COMBINED_HEADER_NBYTES + body_len
        if self.key and not hmac.compare_digest(hmac.new(self.key, mv[:end], hashlib.sha256).digest(), bytes(mv[end:])):
            raise PayloadError("HMAC tag mismatch: wrong key or tampered combined frame")
        body = mv[COMBINED_HEADER_NBYTES:end]
        if zlib.crc32(body, zlib.crc32(mv[:_CRC_AT])) != crc:
            raise PayloadError("checksum mismatch: corrupted combined frame")
        if not 1 <= tokens <= MAX_TOKENS:
            raise PayloadError(f"bad token count {tokens}: must be in [1, 2**53]")
        if self.bits == 32:
            values = _frombuffer(body, _F32, n).clone()
            if not bool(torch.isfinite(values).all()):
                raise PayloadError(f"shard {k}: non-finite values in the combined frame")
            return values, tokens
        widths = self._shard_widths(k)
        m = len(widths)
        pairs = _frombuffer(body[: 8 * m], _F32, 2 * m).view(m, 2)
        if not bool(torch.isfinite(pairs).all()) or not bool((pairs[:, 1] >= 0).all()):
            raise PayloadError(f"shard {k}: bad chunk range (non-finite, or a negative step)")
        codes = _unpack_codes(body[8 * m :], n, self.bits)
        w = torch.tensor(widths)
        values = pairs[:, 0].repeat_interleave(w) + codes.to(_F32) * pairs[:, 1].repeat_interleave(w)
        if not bool(torch.isfinite(values).all()):
            raise PayloadError(f"shard {k}: the decoded values overflow float32")
        return values, tokens

    def assemble(self, shards: Sequence[torch.Tensor], *, device: torch.device | str = "cpu",
                 out: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
        """The whole update from the N decoded shards: views (name -> tensor) of one float32 buffer."""
        acc = self.codec._accumulator(out, torch.device(device))
        for k, ((a, b), values) in enumerate(zip(self.bounds, shards)):
            if values.numel() != b - a:
                raise ValueError(f"shard {k} has {b - a} elements, got {values.numel()}")
            acc[a:b].copy_(values)
        return self.codec._split(acc)

    # ---- the whole exchange in one process (the emulated runtime) -------------------------
    def combine_with_tokens(self, payloads: Sequence[bytes], *, device: torch.device | str = "cpu",
                            out: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], int]:  # fmt: skip
        """What every region ends with after the four steps, for ``payloads`` (one per region, screened):
        the update and Σ n_i. With ``bits`` 32 this is :meth:`SignCodec.combine` of the same payloads."""
        payloads = list(payloads)
        if not payloads:
            raise ValueError("combine needs at least one payload")
        cut = [self.slices(p) for p in payloads]
        shards = []
        for k in range(self.n):
            values, tokens = self.combine_shard(k, [c[k] for c in cut])
            shards.append(self.decode_combined(k, self.encode_combined(k, values, tokens))[0])
        return self.assemble(shards, device=device, out=out), self.codec.total_tokens(payloads)

    def combine(self, payloads: Sequence[bytes], *, device: torch.device | str = "cpu",
                out: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
        return self.combine_with_tokens(payloads, device=device, out=out)[0]

    def decode(self, payload: bytes, *, device: torch.device | str = "cpu"):
        """A whole payload, checked and decoded as the run's codec does (receivers screen payloads with it)."""
        return self.codec.decode(payload, device=device)


class ShardedDenseExchange(ShardedExchange):
    """The sharded exchange of dense payloads (:class:`DenseCodec`, DiLoCo's float32 pseudo-gradients): the
    bytes of a ring all-reduce, with every sender's contribution checked before it is combined.

    A signed sum cannot be checked per sender once it is summed, so with a run key dense payloads would have
    to be gathered whole ((N−1)·4P bytes out of each region). Here each region sends shard k's owner only
    its *slice* of shard k: a dense payload of the shard's own manifest (the pieces ``"name[lo:hi]"`` of the
    model's tensors in it; its header, the sender's token count, crc32 and, with the key, its HMAC tag), the
    owner screens the N slices of its shard as any payload is screened, combines those that pass and sends
    its combined shard in float32 (the combined frame of this module, ``bits`` 32, exact) to every region.
    Per region that is (N−1)/N·4P bytes out in slices and as much in combined shards: 2(N−1)/N·4P, a ring
    all-reduce's, plus a header (and tag) per slice and frame.

    Shards are equal ranges of the flat element space (no chunks: any cut is a valid slice). The owner's
    combine is the dense all-gather path's arithmetic on its elements, in the order the slices are given:
    the sum of the senders' :meth:`DenseCodec.reducible` forms ``[w·Δ, w]`` from zero, divided by Σ w
    (:meth:`DenseCodec.reduced_update`); element-wise and in the same order, so the update equals the
    gathered payloads' sum bit for bit (tested). ``bits`` is ignored: a dense combined shard is float32.
    """

    _digest_kind = ";dense"

    def __init__(self, codec: DenseCodec, n_shards: int, bits: int = 32):
        self._check_codec(codec)
        if isinstance(n_shards, bool) or not isinstance(n_shards, int) or not 1 <= n_shards <= MAX_SHARDS:
            raise ValueError(f"n_shards must be an int in [1, {MAX_SHARDS}], got {n_shards!r}")
        if bits not in COMBINED_BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, COMBINED_BITS))}, got {bits!r}")
        self.codec, self.n, self.bits, self.key = codec, n_shards, 32, codec.key
        d = codec.manifest.numel
        self.bounds = [(k * d // n_shards, (k + 1) * d // n_shards) for k in range(n_shards)]
        self.chunk_bounds = [(k, k + 1) for k in range(n_shards)]  # one "chunk" per shard
        self._widths = [b - a for a, b in self.bounds]
        self._elem = codec._elem
        self._cut(codec.manifest)

    def _check_codec(self, codec) -> None:
        if not isinstance(codec, DenseCodec):
            raise TypeError(f"the sharded dense exchange needs a DenseCodec, got {type(codec).__name__}")

    def _shard_codec(self, manifest: Manifest):
        c = self.codec
        return DenseCodec(manifest, weighting=c.weighting, dtype=c.dtype, key=c.key)

    def slices(self, payload: bytes) -> list[bytes]:
        """The N slices of one region's payload (its header, size, tag and checksum checked first): slice k
        holds the payload's own values of shard k, as they are (no decoding), under the sender's tokens."""
        tokens, body = self.codec._parse(payload)
        e = self._elem
        return [b"" if c is None else c._assemble(tokens, [body[e * a : e * b]])
                for c, (a, b) in zip(self.codecs, self.bounds)]  # fmt: skip

    def _check_slice(self, k: int, frame: bytes) -> None:
        c = self.codecs[k]
        if c is None:
            return super()._check_slice(k, frame)
        c._values(c._parse(frame)[1])  # header, size, tag, checksum, then every value finite

    def combine_shard(self, k: int, slices: Sequence[bytes], *, device: torch.device | str = "cpu",
                      ) -> tuple[torch.Tensor, int]:  # fmt: skip
        """Shard ``k``'s combine of the (already screened) ``slices``, in their order: Σ [w_i·Δ_i, w_i] from
        zero, then the values divided by Σ w_i, as the dense all-gather path combines whole payloads."""
        c = self.codecs[k]
        if not slices:
            raise ValueError("combine_shard needs at least one slice")
        if c is None:
            return super().combine_shard(k, slices, device=device)
        n = self.numel(k)
        summed = torch.zeros(n + 1, dtype=_F32, device=torch.device(device))
        tokens = 0
        flat = torch.empty(n + 1, dtype=_F32, device=torch.device(device))
        for s in slices:  # each as DenseCodec.reducible forms it (one parse of the slice, not three)
            t, body = c._parse(s)
            w = c.reduce_weight(t)
            flat[:n].copy_(c._values(body))
            flat[:n].mul_(w)
            flat[n] = w
            summed.add_(flat)
            tokens += t
        if float(summed[n]) <= 0:
            raise ValueError(f"shard {k}: the slices weigh nothing")
        return summed[:n].div(summed[n]), tokens


# ---- bit and code kernels (numpy / torch, O(elements)) -------------------------------------


def _bit_slice(packed: np.ndarray, a: int, b: int) -> np.ndarray:
    """Bits [a, b) of a little-endian packed bit array, repacked from bit 0 (high padding bits zero)."""
    n = b - a
    nbytes = (n + 7) // 8
    q, r = divmod(a, 8)
    if r == 0:
        out = packed[q : q + nbytes].copy()
    else:
        region = np.zeros(nbytes + 1, dtype=np.uint16)
        src = packed[q : q + nbytes + 1]
        region[: len(src)] = src
        out = ((region[:-1] >> r) | (region[1:] << (8 - r))).astype(np.uint8)
    if n % 8:
        out[-1] &= (1 << (n % 8)) - 1
    return out


def _quantise(values: torch.Tensor, widths: list[int], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-chunk (lo, step) and the codes round((x − lo)/step) in [0, 2**bits − 1]."""
    w = torch.tensor(widths)
    ids = torch.repeat_interleave(torch.arange(len(widths)), w)
    lo = torch.full((len(widths),), float("inf")).scatter_reduce(0, ids, values, "amin")
    hi = torch.full((len(widths),), float("-inf")).scatter_reduce(0, ids, values, "amax")
    levels = (1 << bits) - 1
    step = (hi - lo) / levels
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    codes = ((values - lo[ids]) * inv[ids]).round_().clamp_(0, levels).to(torch.uint8)
    return lo, step, codes


def _pack_codes(codes: torch.Tensor, bits: int) -> np.ndarray:
    c = codes.numpy()
    if bits == 8:
        return c
    per = 8 // bits
    padded = np.zeros(-(-len(c) // per) * per, dtype=np.uint8)
    padded[: len(c)] = c
    groups = padded.reshape(-1, per)
    out = np.zeros(len(groups), dtype=np.uint8)
    for j in range(per):
        out |= groups[:, j] << (j * bits)
    return out


def _unpack_codes(body: memoryview, n: int, bits: int) -> torch.Tensor:
    raw = np.frombuffer(body, dtype=np.uint8)
    if bits == 8:
        return torch.from_numpy(raw.copy())
    per, mask = 8 // bits, (1 << bits) - 1
    groups = np.stack([(raw >> (j * bits)) & mask for j in range(per)], 1).reshape(-1)
    if groups[n:].any():
        raise PayloadError("nonzero padding bits after the last code")
    return torch.from_numpy(groups[:n].copy())
