"""The asynchronous baseline's messages between a region's leader and the parameter server (``async-local-sgd``).

A *push* carries a region's fp32 pseudo-gradient (or a signed "no update" when its steps went non-finite), a
*pull* carries θ back, with the tokens applied so far and whether the run is over. Each is a frame
(:mod:`.frames`: JSON and raw tensor bytes, never a pickle), signed with the run key when there is one, bound to
the region (``scope``), the region's push number (``round``) and its sender, and padded to one fixed width that
both ends compute from θ's layout: a point-to-point receive needs its size in advance, and a fixed size tells an
eavesdropper nothing about the content.

Opening never raises on what a peer sent: a push that is truncated, oversize, unsigned, forged, replayed (another
push number), from another sender, or whose tensors are not θ's names, dtypes and shapes or not finite comes back
as :class:`~geomesh.runtime.distributed.frames.Rejected` with a one-line reason.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..faults import corrupt_payload
from .frames import HEAD_NBYTES, Context, Opened, Rejected, frame_nbytes, open_frame, run_trust, seal
from .heal import tensor_layout

PUSH, PULL = "async-push", "async-pull"
JSON_SLACK = 1024  # what the numbers of a message (tokens, seconds, counts) may add to its template's JSON


def message_width(params: dict[str, torch.Tensor]) -> int:
    """The fixed width of every push and pull of a run whose θ is ``params`` (the same on every rank)."""
    like = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in params.items()}
    ctx = Context(run_id=run_trust().run_id, kind=PULL)
    biggest = max(seal({"delta": like, "info": {}}, ctx=ctx, sender=0, key=b"k").nbytes,
                  seal({"theta": like, "info": {}}, ctx=ctx, sender=0, key=b"k").nbytes)  # fmt: skip
    return biggest + JSON_SLACK


def pack(kind: str, body: dict[str, Any], *, region: int, number: int, sender: int, width: int,
         damaged: bool = False, key: bytes | None = None) -> torch.Tensor:  # fmt: skip
    """``body`` as a ``kind`` frame of ``region``'s push ``number`` from global rank ``sender``, zero-padded to
    ``width`` bytes (a uint8 tensor, ready for a point-to-point send); ``damaged``: one byte of it flipped after
    signing (the scenario's ``corrupt`` fault: damage on the wire); ``key``: what it is signed with (default: the
    run key; a connection's own key, :mod:`.async_link`)."""
    trust = run_trust()
    frame = seal(body, ctx=Context(run_id=trust.run_id, kind=kind, round=number, scope=region), sender=sender,
                 key=trust.key if key is None else key).to_bytes()  # fmt: skip
    if damaged:
        frame = corrupt_payload(frame)
    if len(frame) > width:
        raise ValueError(f"an {kind} frame of {len(frame)} bytes, wider than the run's {width}")
    out = torch.zeros(width, dtype=torch.uint8)
    out[: len(frame)] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    return out


def unpack(kind: str, buf: torch.Tensor, *, region: int, number: int, sender: int,
           like: dict[str, torch.Tensor], key: bytes | None = None) -> dict[str, Any] | Rejected:  # fmt: skip
    """The body of the ``kind`` frame in ``buf`` (``region``'s push ``number`` from ``sender``), its tensors
    checked against θ's layout (``like``), or why it is refused (``key``: as :func:`pack`'s)."""
    raw = bytearray(buf.numpy().tobytes())
    total = frame_nbytes(raw[:HEAD_NBYTES])
    if total is None or total > len(raw):
        return Rejected("malformed frame (bad header or longer than the run's message width)")
    trust = run_trust()
    opened = open_frame(raw[:total], ctx=Context(run_id=trust.run_id, kind=kind, round=number, scope=region),
                        key=trust.key if key is None else key, max_bytes=len(raw), sender=sender)  # fmt: skip
    if not isinstance(opened, Opened):
        return opened
    return _checked(kind, opened.obj, like)


def _checked(kind: str, body: Any, like: dict[str, torch.Tensor]) -> dict[str, Any] | Rejected:
    name = "delta" if kind == PUSH else "theta"
    if not isinstance(body, dict) or set(body) != {name, "info"} or not isinstance(body["info"], dict):
        return Rejected(f"malformed {kind} message")
    tensors = body[name]
    if tensors is None and kind == PUSH:  # a signed "no update": the region's steps went non-finite
        return body
    want = {k: ("torch.float32", tuple(v.shape)) for k, v in like.items()}
    if not isinstance(tensors, dict) or tensor_layout(tensors) != {f"/{k}": v for k, v in want.items()}:
        return Rejected(f"{kind} tensors that are not θ's names, dtypes and shapes")
    if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
        return Rejected(f"non-finite {kind} tensors")
    for value in body["info"].values():
        if not isinstance(value, (int, float, bool)) or (isinstance(value, float) and not math.isfinite(value)):
            return Rejected(f"malformed {kind} message (info)")
    return body
