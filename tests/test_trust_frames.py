"""Frames (runtime/distributed/frames.py): what one process hands another is data, never code.

Each bad frame a peer could send (forged tag, an old round replayed, another sender's slot, another run,
oversize, truncated, garbage, a pickle) comes back as ``Rejected`` with its reason; nothing raises, nothing
runs, nothing larger than the receiver's limit is allocated.
"""

from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch

from geomesh.runtime.distributed.frames import (
    HEAD_NBYTES,
    MAGIC,
    Context,
    FrameError,
    Opened,
    Rejected,
    frame_nbytes,
    open_frame,
    seal,
)

KEY = b"k" * 32
CTX = Context(run_id="job-1", kind="quorum", round=5, scope=3)


def message() -> dict:
    return {"region": 1, "hash": "abc", "wait": False, "payload": b"GMSH\x00\x01raw", "crc": "0a1b2c3d",
            "spans": [("compute", 0.0, 1.5, 4)], "by_region": {0: 10, 2: 30}, "nothing": None,
            "theta": torch.arange(6, dtype=torch.float32).reshape(2, 3), "half": torch.ones(3, dtype=torch.bfloat16),
            "flags": torch.tensor([True, False]), "empty": torch.zeros(0, 4), "nan": float("nan")}  # fmt: skip


def frame(obj=None, ctx=CTX, sender=1, key=KEY) -> bytes:
    return seal(message() if obj is None else obj, ctx=ctx, sender=sender, key=key).to_bytes()


def test_a_signed_frame_round_trips_every_kind_of_value():
    got = open_frame(frame(), ctx=CTX, key=KEY, sender=1)
    assert isinstance(got, Opened) and got.sender == 1
    want = message()
    for k in ("region", "hash", "wait", "payload", "crc", "nothing"):
        assert got.obj[k] == want[k]
    assert got.obj["spans"] == [("compute", 0.0, 1.5, 4)]  # tuples stay tuples
    assert got.obj["by_region"] == {0: 10, 2: 30}  # int keys stay ints
    for k in ("theta", "half", "flags", "empty"):
        assert got.obj[k].dtype == want[k].dtype and torch.equal(got.obj[k], want[k])
    assert got.obj["nan"] != got.obj["nan"]


def test_a_forged_tag_is_rejected():
    blob = bytearray(frame())
    blob[HEAD_NBYTES + 5] ^= 0x01  # one bit of the JSON
    assert "HMAC tag mismatch" in open_frame(bytes(blob), ctx=CTX, key=KEY).reason
    other = frame(key=b"x" * 32)  # the same message signed with another key
    assert "HMAC tag mismatch" in open_frame(other, ctx=CTX, key=KEY).reason
    tail = bytearray(frame())
    tail[-1] ^= 0x80  # the tag itself
    assert "HMAC tag mismatch" in open_frame(bytes(tail), ctx=CTX, key=KEY).reason


def test_a_frame_of_an_old_round_or_collective_is_rejected_although_its_tag_is_genuine():
    old = frame(ctx=Context("job-1", "quorum", round=4, scope=3))
    got = open_frame(old, ctx=CTX, key=KEY)
    assert isinstance(got, Rejected) and "replayed or stale" in got.reason and got.sender == 1
    earlier = frame(ctx=Context("job-1", "quorum", round=5, scope=2))  # an earlier collective of the round
    assert "replayed or stale" in open_frame(earlier, ctx=CTX, key=KEY).reason


def test_a_frame_in_another_sender_s_slot_is_rejected():
    got = open_frame(frame(sender=0), ctx=CTX, key=KEY, sender=1)
    assert isinstance(got, Rejected) and got.reason == "frame of sender 0 in the slot of sender 1"


def test_a_frame_of_another_run_or_kind_is_rejected():
    got = open_frame(frame(ctx=Context("job-2", "quorum", 5, 3)), ctx=CTX, key=KEY)
    assert "another run" in got.reason and got.run == "job-2"  # genuine: the caller may name the other job
    assert "frame where a 'quorum' frame belongs" in open_frame(frame(ctx=Context("job-1", "heal", 5, 3)),
                                                                 ctx=CTX, key=KEY).reason  # fmt: skip


def test_signed_and_unsigned_frames_do_not_mix():
    assert "unsigned frame" in open_frame(frame(key=None), ctx=CTX, key=KEY).reason
    assert "no key" in open_frame(frame(), ctx=CTX, key=None).reason


def test_oversize_frames_are_rejected_before_anything_is_allocated():
    blob = frame()
    assert "oversize frame" in open_frame(blob, ctx=CTX, key=KEY, max_bytes=len(blob) - 1).reason
    # a header that claims a huge body, followed by nothing: refused on the claim, not on a read
    huge = struct.pack("<4sBBHIQ", MAGIC, 1, 1, 0, 100, 1 << 40)
    got = open_frame(huge, ctx=CTX, key=KEY, max_bytes=1 << 20)
    assert "oversize frame: it claims" in got.reason
    assert frame_nbytes(huge) == HEAD_NBYTES + 100 + (1 << 40) + 32


@pytest.mark.parametrize("cut", [0, 3, HEAD_NBYTES - 1, HEAD_NBYTES + 10, -1])
def test_truncated_frames_are_rejected(cut):
    blob = frame()
    got = open_frame(blob[:cut], ctx=CTX, key=KEY)
    assert isinstance(got, Rejected) and "truncated" in got.reason


def test_garbage_and_trailing_bytes_are_rejected():
    assert open_frame(os.urandom(300), ctx=CTX, key=KEY).reason == "not a frame (bad magic)"
    assert "trailing bytes" in open_frame(frame() + b"\0", ctx=CTX, key=KEY).reason
    head = struct.pack("<4sBBHIQ", MAGIC, 2, 0, 0, 0, 0)
    assert "version 2" in open_frame(head, ctx=CTX, key=None).reason
    bad_json = struct.pack("<4sBBHIQ", MAGIC, 1, 0, 0, 8, 0) + b"{not js}"
    assert "malformed frame" in open_frame(bad_json, ctx=CTX, key=None).reason


def test_a_pickle_that_runs_code_is_only_bytes(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    blob = pickle.dumps(Evil())
    assert open_frame(blob, ctx=CTX, key=KEY).reason == "not a frame (bad magic)"
    # carried inside a genuine frame, a pickle is a bytes value: handed over, never loaded
    got = open_frame(frame({"region": 1, "payload": blob}), ctx=CTX, key=KEY)
    assert got.obj["payload"] == blob
    assert not marker.exists()


def _unsigned(doc: str, raw: bytes = b"") -> bytes:
    text = doc.encode()
    return struct.pack("<4sBBHIQ", MAGIC, 1, 0, 0, len(text), len(raw)) + text + raw


def test_markers_that_point_outside_the_frame_or_lie_about_a_tensor_are_rejected():
    base = '{"run":"job-1","kind":"quorum","round":5,"scope":3,"sender":1,"meta":{},"body":%s}'
    outside = _unsigned(base % '{"$b":[0,1099511627776]}', b"\0" * 16)
    assert "outside the frame" in open_frame(outside, ctx=CTX, key=None).reason
    lying = _unsigned(base % '{"$t":[0,16],"dtype":"float32","shape":[1000,1000]}', b"\0" * 16)
    assert "in a segment of 16 bytes" in open_frame(lying, ctx=CTX, key=None).reason
    odd_dtype = _unsigned(base % '{"$t":[0,16],"dtype":"object","shape":[2]}', b"\0" * 16)
    assert "not one a frame carries" in open_frame(odd_dtype, ctx=CTX, key=None).reason
    stray = _unsigned(base % '{"$class":"os.system"}')
    assert "malformed marker" in open_frame(stray, ctx=CTX, key=None).reason
    deep = _unsigned(base % ("[" * 5000 + "]" * 5000))
    assert isinstance(open_frame(deep, ctx=CTX, key=None), Rejected)


def test_a_message_json_cannot_carry_is_refused_by_the_sender():
    with pytest.raises(FrameError, match="cannot be framed"):
        seal({"x": object()}, ctx=CTX, sender=0, key=KEY)


def test_a_plain_dict_with_dollar_keys_round_trips():
    obj = {"$b": "not bytes", "$t": 1}
    got = open_frame(frame(obj), ctx=CTX, key=KEY)
    assert got.obj == obj
