"""The payload wire format: header layout, format version, layout digest, crc32, HMAC tag, and the
checks that turn untrusted bytes into a token count and a view of the body.

Both codecs write their header with :func:`write_header` and read payloads with
:func:`parse_payload`; only the body's contents (magnitudes and sign bits, or dense values) are the
codecs' own business.

Wire format (all integers little-endian)
----------------------------------------
====== ====== =============== ==========================================================
offset bytes  field           meaning
====== ====== =============== ==========================================================
0      4      magic           ``b"GMSH"``
4      2      version (u16)   wire-format version, currently 1; others are refused
6      1      kind (u8)       1 = sign codec, 2 = dense codec, 3 = sparse sign codec,
                              4 = quantised codec (their flags and bodies: sparse.py, quant.py)
7      1      flags (u8)      bit 0: error feedback was on (sign); bit 1: scale is l1
                              (else l2) (sign); bit 2: an HMAC tag follows the body;
                              bits 3-4: dense wire dtype (0 = float32, 1 = bfloat16,
                              2 = float16); bits 5-7: reserved, zero. A payload's flags
                              must equal the receiving codec's (all workers run one config).
8      4      chunk (u32)     elements per magnitude; 0 = one magnitude per tensor (dense: 0)
12     16     layout digest   first 16 bytes of sha256 over the kind, chunk, dense dtype and
                              the manifest (ordered names, shapes, dtypes)
28     8      tokens (u64)    the worker's token count n_i, 1 <= n_i <= 2**53
36     8      body length     bytes of body; must equal what the manifest implies
44     4      crc32 (u32)     zlib.crc32 over bytes [0, 44) followed by the body
48     B      body            sign: M float32 magnitudes, then ceil(d/8) sign bytes;
                              dense: d values of the wire dtype
48+B   32     HMAC tag        only with flag bit 2: HMAC-SHA256(key, bytes [0, 48+B))
====== ====== =============== ==========================================================

``d`` is the total element count of the manifest, ``M`` the number of chunks. Tensors are
concatenated in manifest order, each flattened in row-major (C) order; element k of this
concatenation (the *global index*) is bit ``k % 8`` of sign byte ``k // 8`` (little-endian bit
order within a byte, ``numpy.packbits(..., bitorder="little")``). Bit 1 means +1, bit 0 means −1.
The unused high bits of the last sign byte must be zero. Chunks never cross tensors: each tensor is
cut into chunks of ``chunk`` elements from its own start, the last one may be shorter; magnitude j
belongs to the j-th chunk in this order. An empty tensor has no chunks and no bits; a 0-d tensor
has one element. ``payload_nbytes() = 48 + 4·M + ceil(d/8) (+ 32 with a key)``.

Decoding untrusted bytes checks, in this order, size >= header, magic, version, kind, flags,
chunk, layout digest, body length, total size (refusing truncated and oversized payloads before
touching the body, so nothing larger than the manifest justifies is ever allocated), the HMAC tag
when the codec has a key, the crc32, the token count, then the body itself (finite, non-negative
magnitudes; zero padding bits; finite dense values).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import PayloadError

MAGIC = b"GMSH"
FORMAT_VERSION = 1
KIND_SIGN = 1
KIND_DENSE = 2
KIND_SPARSE = 3  # top-k signs with Rice-coded positions (codec/sparse.py)
KIND_QUANT = 4  # per-chunk int8 / fp4 values (codec/quant.py)
_KIND_NAMES = {KIND_SIGN: "sign", KIND_DENSE: "dense", KIND_SPARSE: "sparse", KIND_QUANT: "quant"}

# magic, version, kind, flags, chunk, layout digest, tokens, body length, crc32
_HEADER = struct.Struct("<4sHBBI16sQQI")
HEADER_NBYTES = _HEADER.size  # 48
_CRC_OFFSET = HEADER_NBYTES - 4
TAG_NBYTES = 32  # HMAC-SHA256
MAX_TOKENS = 2**53  # token counts stay exact as float64

FLAG_ERROR_FEEDBACK = 0x01
FLAG_SCALE_L1 = 0x02
FLAG_HMAC = 0x04
_DENSE_DTYPE_SHIFT = 3
_DENSE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("geomesh.codec needs a little-endian host (the wire format is little-endian)")


def _check_tokens_arg(tokens: Any) -> int:
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)):
        raise TypeError(f"tokens must be an int, got {type(tokens).__name__}")
    tokens = int(tokens)
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"tokens must be in [1, 2**53], got {tokens}")
    return tokens


def _frombuffer(buf: memoryview, dtype: torch.dtype, count: int) -> torch.Tensor:
    """Zero-copy read-only CPU tensor over ``buf`` (never written to)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": we only read it
        return torch.frombuffer(buf, dtype=dtype, count=count)


def _as_bytes_view(payload: Any) -> memoryview:
    if isinstance(payload, str) or not isinstance(payload, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes-like, got {type(payload).__name__}")
    mv = memoryview(payload)
    if not mv.c_contiguous:
        raise PayloadError("payload buffer is not contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv



def layout_digest(kind: int, chunk_field: int, extra: str, manifest_canonical: bytes) -> bytes:
    """Header bytes 12-28: sha256 over the kind, the chunk field, a codec's ``extra`` text (the
    dense wire dtype) and the manifest's canonical form, cut to 16 bytes, so that a payload made
    for another model or codec configuration is refused before its body is read."""
    h = hashlib.sha256()
    h.update(b"geomesh-codec\0")
    h.update(f"{_KIND_NAMES[kind]};chunk={chunk_field};{extra}\0".encode())
    h.update(manifest_canonical)
    return h.digest()[:16]


def payload_size(body_len: int, key: bytes | None) -> int:
    """Exact size in bytes of a payload: header + body + the HMAC tag when there is a key."""
    return HEADER_NBYTES + body_len + (TAG_NBYTES if key else 0)


def write_header(
    buf: bytearray,
    *,
    kind: int,
    flags: int,
    chunk_field: int,
    digest: bytes,
    tokens: int,
    body_len: int,
    key: bytes | None,
) -> None:
    """Fill in the header of ``buf`` (whose body is already in place after the header), then its
    crc32 and, with a key, the HMAC tag after the body. ``flags`` excludes the HMAC bit, which
    follows from ``key``."""
    flags = flags | (FLAG_HMAC if key else 0)
    _HEADER.pack_into(
        buf,
        0,
        MAGIC,
        FORMAT_VERSION,
        kind,
        flags,
        chunk_field,
        digest,
        tokens,
        body_len,
        0,
    )
    mv = memoryview(buf)
    end = HEADER_NBYTES + body_len
    crc = zlib.crc32(mv[HEADER_NBYTES:end], zlib.crc32(mv[:_CRC_OFFSET]))
    struct.pack_into("<I", buf, _CRC_OFFSET, crc)
    if key:
        buf[end : end + TAG_NBYTES] = hmac.new(key, mv[:end], hashlib.sha256).digest()


def parse_payload(
    payload: Any,
    *,
    kind: int,
    flags: int,
    chunk_field: int,
    digest: bytes,
    body_len: int,
    key: bytes | None,
    flag_text: Callable[[int], str],
) -> tuple[int, memoryview]:
    """Validate everything but the body's contents; return (tokens, body view).

    The keyword arguments are the receiving codec's layout (``flags`` without the HMAC bit, which
    follows from ``key``); every field of the payload must match it. ``flag_text`` renders a flags
    byte for the mismatch message in the codec's own terms.
    """
    mv = _as_bytes_view(payload)
    n = len(mv)
    if n < HEADER_NBYTES:
        raise PayloadError(f"truncated payload: {n} bytes, shorter than the {HEADER_NBYTES}-byte header")
    got_magic, version, got_kind, got_flags, got_chunk, got_digest, tokens, got_body_len, crc = _HEADER.unpack_from(
        mv, 0
    )
    if got_magic != MAGIC:
        raise PayloadError(f"bad magic {bytes(got_magic)!r} (expected {MAGIC!r}): not a GeoMesh payload")
    if version != FORMAT_VERSION:
        raise PayloadError(f"unsupported wire-format version {version} (this codec reads version {FORMAT_VERSION})")
    if got_kind != kind:
        got = _KIND_NAMES.get(got_kind, f"unknown kind {got_kind}")
        raise PayloadError(f"wrong codec kind: payload is {got}, this codec decodes {_KIND_NAMES[kind]}")
    want_flags = flags | (FLAG_HMAC if key else 0)
    if got_flags != want_flags:
        if (got_flags ^ want_flags) & FLAG_HMAC:
            if key:
                raise PayloadError("missing HMAC tag: this codec has a key but the payload is unsigned")
            raise PayloadError("payload carries an HMAC tag but this codec has no key to check it")
        raise PayloadError(
            f"flags mismatch: payload has {flag_text(got_flags)}, this codec expects {flag_text(want_flags)}"
        )
    if got_chunk != chunk_field:
        raise PayloadError(f"chunk size mismatch: payload has {got_chunk}, this codec uses {chunk_field}")
    if got_digest != digest:
        raise PayloadError(
            f"manifest mismatch: layout digest {got_digest.hex()} != expected {digest.hex()} "
            f"(other tensor names/shapes/dtypes, or a corrupted header)"
        )
    if got_body_len != body_len:
        raise PayloadError(
            f"body length mismatch: header says {got_body_len} bytes, the manifest implies {body_len}"
        )
    expected = payload_size(body_len, key)
    if n < expected:
        raise PayloadError(f"truncated payload: {n} bytes, expected {expected}")
    if n > expected:
        raise PayloadError(f"oversized payload: {n} bytes, expected {expected} ({n - expected} extra)")
    end = HEADER_NBYTES + body_len
    if key:
        tag = hmac.new(key, mv[:end], hashlib.sha256).digest()
        if not hmac.compare_digest(tag, bytes(mv[end:])):
            raise PayloadError("HMAC tag mismatch: wrong key or tampered payload")
    body = mv[HEADER_NBYTES:end]
    got_crc = zlib.crc32(body, zlib.crc32(mv[:_CRC_OFFSET]))
    if got_crc != crc:
        raise PayloadError(f"checksum mismatch: crc32 {got_crc:08x} != header {crc:08x} (corrupted payload)")
    if not 1 <= tokens <= MAX_TOKENS:
        raise PayloadError(f"bad token count {tokens}: must be in [1, 2**53]")
    return tokens, body
