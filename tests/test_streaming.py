"""streaming-diloco: fragments synced on their staggered schedule (one every H/F steps, each every H), FP4 outer
gradients, one outer step per fragment, training that lowers the loss; its fragment payloads' wire safety; the
distributed runtime's one-line refusal of a bad H."""

from __future__ import annotations

import random

import pytest
import torch

from geomesh.cli import launch as cli_launch
from geomesh.codec import Manifest, QuantCodec
from geomesh.codec.fragments import FragmentCodec
from geomesh.config import ConfigError
from geomesh.errors import PayloadError
from geomesh.methods import get_method
from geomesh.methods.base import proxy_manifest
from geomesh.methods.streaming import StreamingMethod, strided_fragments
from geomesh.runtime.emulated import EmulatedRun, RunOptions

H = 4  # inner steps per fragment cycle; 2 fragments: one syncs every 2 steps


def test_fragments_are_strided_blocks_and_cover_the_model(tiny_scenario):
    m = proxy_manifest(tiny_scenario(inner_steps=H))
    groups = strided_fragments(m, 2)
    assert sorted(n for g in groups for n in g) == sorted(s.name for s in m)
    for f, g in enumerate(groups):
        blocks = {int(n.split(".")[1]) for n in g if n.startswith("blocks.")}
        assert blocks and all(b % 2 == f for b in blocks)


def test_fragments_sync_on_their_staggered_schedule_and_it_trains(tiny_scenario, monkeypatch):
    s = tiny_scenario(inner_steps=H)
    method = get_method("streaming-diloco")
    groups = method.make_codec(proxy_manifest(s), s).groups
    seen = []  # per outer step: (inner steps trained so far by worker 0, tensors it updated, tensors θ changed)
    steps_done = [0]
    local_phase, apply = StreamingMethod.local_phase, StreamingMethod.apply

    def spy_phase(self, worker, steps, *args):
        if worker.name == worker_names[0]:
            steps_done[0] += steps
        return local_phase(self, worker, steps, *args)

    def spy_apply(payloads, codec, outer):
        before = {k: v.clone() for k, v in outer.params.items()}
        update = codec.combine(payloads)
        ok = apply(payloads, codec, outer)
        changed = {k for k in before if not torch.equal(before[k], outer.params[k])}
        seen.append((steps_done[0], set(update), changed))
        return ok

    worker_names = [r.name for r in s.regions]
    monkeypatch.setattr(StreamingMethod, "local_phase", spy_phase)
    monkeypatch.setattr(StreamingMethod, "apply", staticmethod(spy_apply))
    n, b, seq = len(s.regions), s.training.batch, s.model.seq_len
    rounds = 8
    summary = EmulatedRun(s, method, RunOptions(tokens=rounds * n * b * (H // 2) * seq, progress=False,
                                                workers_parallel=1)).run()  # fmt: skip
    assert summary["rounds"] == rounds and len(seen) == rounds
    for r, (step, sent, changed) in enumerate(seen):
        f = r % 2
        # fragment f syncs after inner steps (f+1)·H/F + k·H: 2, 6, 10, ... for f=0 and 4, 8, 12, ... for f=1
        assert step == (f + 1) * H // 2 + (r // 2) * H
        assert sent == set(groups[f]) and changed and changed <= set(groups[f])
    curve = [c[2] for c in summary["curve"]]
    assert curve[-1] < curve[0]
    codec = method.make_codec(proxy_manifest(s), s)
    fp4 = QuantCodec(proxy_manifest(s), fmt="fp4")
    # one exchange carries about half the model's FP4 payload (whole-tensor fragments are not exactly equal)
    assert summary["proxy_payload_bytes"] == codec.payload_nbytes() < 0.75 * fp4.payload_nbytes()


def test_streaming_refuses_what_it_cannot_run(tiny_scenario, tmp_path, small_corpus, capsys):
    s = tiny_scenario(inner_steps=5)
    with pytest.raises(ConfigError, match="training.inner_steps: 5 is not a multiple"):
        get_method("streaming-diloco").make_codec(proxy_manifest(s), s)
    # the distributed runtime (tests/test_streaming_distributed.py): the same one line, exit 2, before any process
    # starts
    path = tmp_path / "tiny.yaml"
    tiny_scenario(inner_steps=5)
    code = cli_launch.main(["launch", str(path), "--out", str(tmp_path / "run"), "--method", "streaming-diloco",
                            "--nproc", "3"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "training.inner_steps: 5 is not a multiple" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run" / "logs").exists()


def _codec(key=None):
    specs = {"a.w": torch.zeros(300), "blocks.0.w": torch.zeros(17, 5), "blocks.1.w": torch.zeros(40)}
    m = Manifest.from_tensors(specs)
    return FragmentCodec(m, strided_fragments(m, 2), lambda fm: QuantCodec(fm, fmt="fp4", key=key)), specs


def test_fragment_payloads_are_checked_like_any_payload():
    codec, specs = _codec(key=b"k" * 32)
    x = {k: torch.randn_like(v) for k, v in specs.items()}
    p0 = codec.encode(x, 10)
    codec.advance()
    p1 = codec.encode(x, 10)
    assert codec.fragment_of(p0) == 0 and codec.fragment_of(p1) == 1
    out = codec.combine([p0, p0])
    assert set(out) == set(codec.groups[0])
    with pytest.raises(PayloadError, match="fragments"):
        codec.combine([p0, p1])
    other, _ = _codec(key=b"j" * 32)
    with pytest.raises(PayloadError, match="HMAC"):
        other.decode(p0)
    flipped = bytearray(p1)
    flipped[-40] ^= 1
    with pytest.raises(PayloadError):
        codec.decode(bytes(flipped))
    rng = random.Random(0)
    for _ in range(200):  # hostile bytes: truncations, random headers, random bodies
        choice = rng.randrange(3)
        if choice == 0:
            blob = p0[: rng.randrange(len(p0))]
        elif choice == 1:
            blob = bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
        else:
            b = bytearray(p0)
            for _ in range(rng.randrange(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            blob = bytes(b)
            if blob == p0:
                continue
        with pytest.raises(PayloadError):
            codec.decode(blob)
    codec.load_state_dict(codec.state_dict())
    with pytest.raises(ValueError):
        codec.load_state_dict({"syncs": -1})
