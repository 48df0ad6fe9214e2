"""Frames: how one process hands another a message without handing it code.

Every control message, envelope and heal stream that crosses processes in the distributed runtime is a
*frame*: a fixed header, a JSON document, raw byte segments, and (with the run's key) an HMAC-SHA256 tag.
Nothing in a frame is unpickled; tensors are raw bytes described by a dtype and a shape in the JSON, bytes
are raw bytes, everything else is JSON. The receiver decides how large a frame may be.

Frame layout (integers little-endian)
-------------------------------------
====== ====== ============= ============================================================================
offset bytes  field         meaning
====== ====== ============= ============================================================================
0      4      magic         ``b"GMFR"``
4      1      version       1; others are refused
5      1      flags         bit 0: a 32-byte HMAC-SHA256 tag follows; other bits zero
6      2      reserved      zero
8      4      JSON length J bytes of the JSON document (UTF-8, padded with spaces so the raw part starts at
                            a multiple of 16)
12     8      raw length R  bytes of the raw segments
20     J      JSON          ``{"run", "kind", "round", "scope", "sender", "meta", "body"}``
20+J   R      raw           the segments ``body`` points at (each at a multiple of 16)
20+J+R 32     tag           with flag bit 0: HMAC-SHA256(key, ``b"GMFR-tag\\0"`` + bytes [0, 20+J+R))
====== ====== ============= ============================================================================

``body`` is the message: JSON values as they are, and markers for what JSON cannot carry:
``{"$b": [offset, length]}`` (bytes), ``{"$t": [offset, length], "dtype": "float32", "shape": [..]}`` (a
tensor), ``{"$tuple": [...]}``, ``{"$items": [[key, value], ...]}`` (a dict whose keys are not all strings,
or that has a key starting with ``$``). A plain JSON object never has a ``$`` key, so markers cannot be
confused with data.

What the tag binds
------------------
The tag covers the whole frame, so it binds the JSON's ``run`` (the run id: a hash of scenario, method,
seed and budget), ``kind`` (what the frame is: ``control``, ``header``, ``heal``, ...), ``round`` and
``scope`` (where in the run: the torchft step and quorum, or a collective's sequence number) and ``sender``
(who sent it). The receiver checks the tag *before* it parses anything else, then that every one of these
equals what it expects: an old frame replayed into a later round, a frame of one sender put in another's
slot, or a frame of another run is rejected even though its tag is genuine.

Receiving: :func:`open_frame` never raises on bad input. It returns :class:`Opened` (the sender and the
message) or :class:`Rejected` (a one-line reason: ``truncated``, ``oversize``, ``bad magic``, ``HMAC tag
mismatch``, ``unsigned frame``, ``frame of round 3, expected round 5``, ``sender 2 in the slot of 1``,
``malformed JSON``, ...). Without a key frames carry no tag and prove nothing (see docs/distributed.md,
"Security"); the structural checks still apply.

:class:`RunTrust` is this process's key and run id: set once when a distributed run is built
(:class:`~geomesh.runtime.distributed.DistributedRun`), read by the transport and membership unless they are
given their own.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

MAGIC = b"GMFR"
VERSION = 1
FLAG_TAGGED = 0x01
_HEAD = struct.Struct("<4sBBHIQ")  # magic, version, flags, reserved, JSON length, raw length
HEAD_NBYTES = _HEAD.size  # 20
TAG_NBYTES = 32
_TAG_DOMAIN = b"GMFR-tag\0"
_ALIGN = 16
MAX_DEPTH = 48  # nesting of a message: deeper is refused (a parser's recursion is not an attacker's to use)
DEFAULT_MAX_BYTES = 64 << 20

# dtypes a frame may carry (a receiver builds tensors only of these)
_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool")}  # fmt: skip
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class RunTrust:
    """The run's key (``reliability.hmac_key_env`` / ``hmac_key_file``; ``None``: frames are not signed) and
    its id (bound into every tag, so a frame of another run with the same key is refused)."""

    key: bytes | None = None
    run_id: str = ""


_trust = RunTrust()


def set_run_trust(key: bytes | None, run_id: str) -> RunTrust:
    """This process's key and run id (one process runs one rank of one run)."""
    global _trust
    _trust = RunTrust(key=key, run_id=str(run_id))
    return _trust


def run_trust() -> RunTrust:
    return _trust


@dataclass(frozen=True)
class Context:
    """Where a frame belongs: the receiver's expectation, and what a sender seals into the frame."""

    run_id: str
    kind: str
    round: int = 0
    scope: int = 0


@dataclass
class Opened:
    sender: int
    obj: Any
    meta: dict = field(default_factory=dict)


@dataclass
class Rejected:
    reason: str
    sender: int | None = None  # the sender the frame claims, when its tag (if any) held
    run: str | None = None  # the run id it claims, when its tag held but the run is another one

    def __bool__(self) -> bool:  # `if opened:` reads as "it opened"
        return False


class FrameError(ValueError):
    """A message cannot be framed (a value JSON cannot carry and that is neither bytes nor a tensor)."""


# ---- encoding --------------------------------------------------------------------------------------------


class _Packer:
    def __init__(self) -> None:
        self.segments: list[memoryview] = []
        self.offset = 0

    def _segment(self, view: memoryview) -> list[int]:
        at = self.offset
        self.segments.append(view)
        pad = -(at + len(view)) % _ALIGN
        if pad:
            self.segments.append(memoryview(bytes(pad)))
        self.offset = at + len(view) + pad
        return [at, len(view)]

    def value(self, v: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise FrameError(f"a message nested deeper than {MAX_DEPTH}")
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (bytes, bytearray, memoryview)):
            return {"$b": self._segment(memoryview(v).cast("B"))}
        if isinstance(v, torch.Tensor):
            t = v.detach()
            if t.dtype not in _DTYPE_NAMES:
                raise FrameError(f"a tensor of dtype {t.dtype}: frames carry {', '.join(_DTYPES)}")
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            t = t.to("cpu").contiguous()
            raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            return {"$t": self._segment(memoryview(raw.numpy()).cast("B")), "dtype": _DTYPE_NAMES[t.dtype],
                    "shape": list(t.shape)}  # fmt: skip
        if isinstance(v, (list, tuple)):
            items = [self.value(x, depth + 1) for x in v]
            return {"$tuple": items} if isinstance(v, tuple) else items
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: self.value(x, depth + 1) for k, x in v.items()}
            return {"$items": [[self.value(k, depth + 1), self.value(x, depth + 1)] for k, x in v.items()]}
        if hasattr(v, "item") and callable(v.item) and getattr(v, "ndim", None) == 0:  # a numpy scalar
            return self.value(v.item(), depth)
        raise FrameError(f"a value of type {type(v).__name__} cannot be framed (JSON, bytes or tensors only)")


@dataclass
class Sealed:
    """A frame as parts (to stream it without a second copy of large segments) and as one ``bytes``."""

    head: bytes  # fixed header + JSON
    segments: list[memoryview]
    tag: bytes  # b"" without a key

    @property
    def nbytes(self) -> int:
        return len(self.head) + sum(len(s) for s in self.segments) + len(self.tag)

    def parts(self) -> Iterator[memoryview]:
        yield memoryview(self.head)
        yield from self.segments
        if self.tag:
            yield memoryview(self.tag)

    def to_bytes(self) -> bytes:
        return b"".join(self.parts())


def seal(obj: Any, *, ctx: Context, sender: int, key: bytes | None, meta: dict | None = None) -> Sealed:
    """Frame ``obj`` for ``ctx`` from ``sender``; with ``key`` the frame carries its tag."""
    packer = _Packer()
    body = packer.value(obj)
    doc = {"run": ctx.run_id, "kind": ctx.kind, "round": int(ctx.round), "scope": int(ctx.scope),
           "sender": int(sender), "meta": meta or {}, "body": body}  # fmt: skip
    text = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
    text += b" " * (-(HEAD_NBYTES + len(text)) % _ALIGN)
    flags = FLAG_TAGGED if key else 0
    head = _HEAD.pack(MAGIC, VERSION, flags, 0, len(text), packer.offset) + text
    tag = b""
    if key:
        mac = hmac.new(key, _TAG_DOMAIN, hashlib.sha256)
        mac.update(head)
        for s in packer.segments:
            mac.update(s)
        tag = mac.digest()
    return Sealed(head, packer.segments, tag)


# ---- decoding untrusted bytes -----------------------------------------------------------------------------


def pack_pieces(pieces: list[bytes]) -> torch.Tensor:
    """Raw byte pieces, one after the other, as one flat uint8 tensor (what a direct all-to-all sends)."""
    if not any(pieces):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.uint8)


def split_pieces(flat: torch.Tensor, sizes: list[int]) -> list[bytes]:
    """A flat uint8 tensor cut back into pieces of ``sizes`` bytes (what a direct all-to-all received)."""
    raw = flat.numpy().tobytes()
    pieces, pos = [], 0
    for size in sizes:
        pieces.append(raw[pos : pos + size])
        pos += size
    return pieces


class _Bad(Exception):
    pass


def frame_nbytes(prefix: bytes | bytearray | memoryview) -> int | None:
    """The total size the fixed header at the start of ``prefix`` claims (``None``: not a frame header)."""
    if len(prefix) < HEAD_NBYTES:
        return None
    magic, version, flags, _, jlen, rlen = _HEAD.unpack_from(prefix, 0)
    if magic != MAGIC or version != VERSION:
        return None
    return HEAD_NBYTES + jlen + rlen + (TAG_NBYTES if flags & FLAG_TAGGED else 0)


def open_frame(blob: bytes | bytearray | memoryview, *, ctx: Context, key: bytes | None,
               max_bytes: int = DEFAULT_MAX_BYTES, sender: int | None = None,
               copy: bool = True) -> Opened | Rejected:  # fmt: skip
    """Check and decode one frame from an untrusted peer; never raises on bad input.

    ``sender``: the sender this slot belongs to, when the receiver knows it (a rank in a world); ``None``:
    any sender (the caller then checks the claimed one). ``copy=False`` leaves tensors as views of ``blob``
    (a large heal stream held once)."""
    try:
        base = blob if isinstance(blob, bytearray) and not copy else None
        return _open(memoryview(blob).cast("B"), ctx, key, max_bytes, sender, base)
    except _Bad as exc:
        return exc.args[0]
    except (RecursionError, MemoryError, ValueError, TypeError, KeyError, OverflowError, RuntimeError) as exc:
        return Rejected(f"malformed frame ({type(exc).__name__})")


def _open(mv: memoryview, ctx: Context, key: bytes | None, max_bytes: int, sender: int | None,
          base: bytearray | None) -> Opened | Rejected:  # fmt: skip
    n = len(mv)
    if n > max_bytes:
        return Rejected(f"oversize frame: {n} bytes, the limit is {max_bytes}")
    if n < HEAD_NBYTES:
        return Rejected(f"truncated frame: {n} bytes, shorter than the {HEAD_NBYTES}-byte header")
    magic, version, flags, reserved, jlen, rlen = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        return Rejected("not a frame (bad magic)")
    if version != VERSION:
        return Rejected(f"frame version {version}, expected {VERSION}")
    if flags & ~FLAG_TAGGED or reserved:
        return Rejected("frame with unknown flags")
    tagged = bool(flags & FLAG_TAGGED)
    total = HEAD_NBYTES + jlen + rlen + (TAG_NBYTES if tagged else 0)
    if total > max_bytes:
        return Rejected(f"oversize frame: it claims {total} bytes, the limit is {max_bytes}")
    if n < total:
        return Rejected(f"truncated frame: {n} of the {total} bytes it claims")
    if n > total:
        return Rejected(f"frame with {n - total} trailing bytes")
    end = HEAD_NBYTES + jlen + rlen
    if key:
        if not tagged:
            return Rejected("unsigned frame (this run signs its frames: is the key set on every region?)")
        want = hmac.new(key, _TAG_DOMAIN, hashlib.sha256)
        want.update(mv[:end])
        if not hmac.compare_digest(want.digest(), bytes(mv[end:total])):
            return Rejected("HMAC tag mismatch (forged, damaged, or signed with another key)")
    elif tagged:
        return Rejected("signed frame, but this process has no key (the key must be set on every region)")
    doc = json.loads(bytes(mv[HEAD_NBYTES : HEAD_NBYTES + jlen]))
    if not isinstance(doc, dict) or not {"run", "kind", "round", "scope", "sender", "body"} <= doc.keys():
        return Rejected("malformed frame header")
    claimed = doc["sender"]
    if not isinstance(claimed, int) or isinstance(claimed, bool):
        return Rejected("malformed frame header (sender)")
    if doc["run"] != ctx.run_id:
        return Rejected(f"frame of another run (run id {str(doc['run'])[:32]!r}, this run {ctx.run_id!r})", claimed,
                        str(doc["run"]))  # fmt: skip
    if doc["kind"] != ctx.kind:
        return Rejected(f"{str(doc['kind'])[:32]!r} frame where a {ctx.kind!r} frame belongs", claimed)
    if doc["round"] != ctx.round or doc["scope"] != ctx.scope:
        return Rejected(f"frame of round {doc['round']} (scope {doc['scope']}), expected round {ctx.round} "
                        f"(scope {ctx.scope}): replayed or stale", claimed)  # fmt: skip
    if sender is not None and claimed != sender:
        return Rejected(f"frame of sender {claimed} in the slot of sender {sender}", claimed)
    raw = mv[HEAD_NBYTES + jlen : end]
    meta = doc.get("meta") or {}
    if not isinstance(meta, dict):
        return Rejected("malformed frame header (meta)", claimed)
    views = (base, HEAD_NBYTES + jlen) if base is not None else None
    return Opened(claimed, _unpack(doc["body"], raw, views, 0), meta)


def _span(marker: Any, raw: memoryview) -> tuple[int, int]:
    if (not isinstance(marker, list) or len(marker) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in marker)):  # fmt: skip
        raise _Bad(Rejected("malformed segment reference"))
    at, length = marker
    if at + length > len(raw):
        raise _Bad(Rejected(f"segment [{at}, {at + length}) outside the frame's {len(raw)} raw bytes"))
    return at, length


def _unpack(v: Any, raw: memoryview, views: tuple[bytearray, int] | None, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise _Bad(Rejected(f"message nested deeper than {MAX_DEPTH}"))
    if isinstance(v, list):
        return [_unpack(x, raw, views, depth + 1) for x in v]
    if not isinstance(v, dict):
        return v
    if "$b" in v and len(v) == 1:
        at, length = _span(v["$b"], raw)
        return bytes(raw[at : at + length])
    if "$t" in v and v.keys() == {"$t", "dtype", "shape"}:
        at, length = _span(v["$t"], raw)
        dtype = _DTYPES.get(v["dtype"]) if isinstance(v["dtype"], str) else None
        shape = v["shape"]
        if dtype is None:
            raise _Bad(Rejected(f"tensor of dtype {str(v['dtype'])[:32]!r}: not one a frame carries"))
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):  # fmt: skip
            raise _Bad(Rejected("malformed tensor shape"))
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if numel * itemsize != length:
            raise _Bad(Rejected(f"tensor of shape {shape} and dtype {v['dtype']} in a segment of {length} bytes"))
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        if at % _ALIGN:
            raise _Bad(Rejected("misaligned tensor segment"))
        if views is None:
            return torch.frombuffer(bytearray(raw[at : at + length]), dtype=dtype).reshape(shape)
        base, start = views  # a view into the received buffer (a large heal stream is held once)
        return torch.frombuffer(base, dtype=dtype, count=numel, offset=start + at).reshape(shape)
    if "$tuple" in v and len(v) == 1:
        if not isinstance(v["$tuple"], list):
            raise _Bad(Rejected("malformed tuple"))
        return tuple(_unpack(x, raw, views, depth + 1) for x in v["$tuple"])
    if "$items" in v and len(v) == 1:
        items = v["$items"]
        if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 for p in items):
            raise _Bad(Rejected("malformed mapping"))
        out = {}
        for k, x in items:
            k = _unpack(k, raw, views, depth + 1)
            if not isinstance(k, (str, int, float, bool, type(None), tuple, bytes)):
                raise _Bad(Rejected("mapping with an unhashable key"))
            out[k] = _unpack(x, raw, views, depth + 1)
        return out
    if any(isinstance(k, str) and k.startswith("$") for k in v):
        raise _Bad(Rejected("malformed marker in the message"))
    return {k: _unpack(x, raw, views, depth + 1) for k, x in v.items()}
