"""Reliability: checkpoints and resume (incl. a real SIGKILL), worker faults and what they cost, hostile and
broken input (fuzzed payloads and scenarios, NaN workers, HMAC), and storage faults. docs/reliability.md maps
each fault to the test here that proves what the product does about it."""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_scenario_dict
from geomesh import checkpoint as ckpt
from geomesh.cli import main
from geomesh.codec import DenseCodec, Manifest, PayloadError, SignCodec
from geomesh.config import ConfigError, FaultConfig, ScenarioConfig, load_scenario
from geomesh.methods import get_method
from geomesh.methods.base import OuterLoopMethod, payload_key
from geomesh.runtime.emulated import EmulatedRun, RunError, RunOptions, corrupt_payload, screen_payload
from geomesh.telemetry import read_events
from geomesh.worker import Worker

SRC = str(Path(__file__).resolve().parents[1] / "src")
FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip


def run(scenario, method, out=None, **opts):
    return EmulatedRun(scenario, get_method(method), RunOptions(out_dir=out, progress=False, **opts)).run()


def summary_of(folder: Path) -> dict:
    s = json.loads((folder / "summary.json").read_text())
    s.pop("wall_clock_s"), s.pop("setup_s")  # real seconds of this machine
    return s


def assert_same_run(a: Path, b: Path) -> None:
    """Two run folders hold the same run: summary.json (but the wall clock) and events.jsonl byte for byte."""
    assert summary_of(a) == summary_of(b)
    assert (a / "events.jsonl").read_bytes() == (b / "events.jsonl").read_bytes()


def final_params(folder: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_latest(folder / "checkpoints")[1]["global_model"]


class Interrupted(Exception):
    pass


def interrupt_at(monkeypatch, round_index: int) -> None:
    """Make the next run die in the middle of round ``round_index`` (after the workers trained, before the
    round's spans are written): what a crash leaves behind, minus the process."""
    original = EmulatedRun._barrier_spans

    def barrier(self, compute, exchange_s):
        if self.rounds == round_index:
            raise Interrupted
        return original(self, compute, exchange_s)

    monkeypatch.setattr(EmulatedRun, "_barrier_spans", barrier)


# ---- checkpoints and resume ------------------------------------------------------------------------------


def test_sigkill_mid_round_then_resume_is_bit_identical(tmp_path, small_corpus):
    """A real `geomesh train` process killed with SIGKILL after its first checkpoint, then `--resume`d, ends
    with the parameters, summary.json (but wall_clock_s) and events.jsonl of the same run never interrupted."""
    d = tiny_scenario_dict(small_corpus, tokens=14000, zero_shot_items=8)
    d["faults"] = [{"at_round": 1, "region": "r0-h100", "kind": "slowdown", "factor": 2.0}]
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(d))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "geomesh.cli", "train", str(path), "--method", "geomesh", "--quiet"]
    proc = subprocess.Popen([*cmd, "--out", str(out), "--checkpoint-every", "1", "--keep", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 240
    try:
        while not list((out / "checkpoints").glob("round-*.json")):
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.005)
    finally:
        proc.kill()  # SIGKILL: no handler, no flush, no cleanup
        proc.communicate()
    assert proc.returncode == -9
    assert not (out / "summary.json").exists()  # it really was interrupted
    # (the resumed run checkpoints every round and keeps 2, as the interrupted one did)
    resumed = subprocess.run([*cmd, "--resume", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stderr and "from its checkpoint at round" in resumed.stderr

    reference = EmulatedRun(load_scenario(path), get_method("geomesh"),
                            RunOptions(out_dir=tmp_path / "ref", progress=False))  # fmt: skip
    reference.run()  # uninterrupted, and without checkpoints: writing them changes nothing either
    assert_same_run(out, tmp_path / "ref")
    got = final_params(out)
    for name, want in reference.cluster.global_model.state_dict().items():
        assert torch.equal(got[name], want), name
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(left) == 4 and not [n for n in left if n.startswith(".")]  # the newest 2, no temporary files


@pytest.mark.parametrize("method", ["geomesh", "ddp"])
@pytest.mark.filterwarnings("ignore:worker r1-a100")  # the injected NaN round
def test_interrupted_run_resumes_bit_identical(tiny_scenario, tmp_path, monkeypatch, method):
    """Resume restores everything a round depends on: AdamW moments, error-feedback residuals, data positions,
    RNG, the plan and the online planner's speed factors, who is alive, the fault records and the counters."""
    s = tiny_scenario(tokens=9000 if method == "geomesh" else 4000, zero_shot_items=0)
    at = (lambda r: r) if method == "geomesh" else (lambda r: 2 * r)  # ddp's rounds are single steps
    s.faults = [FaultConfig(at(1), "r0-h100", "slowdown", 3.0), FaultConfig(at(1), "r1-a100", "nan"),
                FaultConfig(at(2), "r2-t4", "leave"), FaultConfig(at(4), "r2-t4", "join")]  # fmt: skip
    run(s, method, tmp_path / "ref")
    interrupt_at(monkeypatch, at(3) + 1)  # geomesh: round 4 (checkpoint 4 is the last); ddp: step 7 (6 is)
    with pytest.raises(Interrupted):
        run(s, method, tmp_path / "run", checkpoint_every=at(1))
    monkeypatch.undo()
    assert not (tmp_path / "run" / "summary.json").exists()
    em = EmulatedRun(s, get_method(method), RunOptions(out_dir=tmp_path / "run", progress=False, resume=True,
                                                        checkpoint_every=at(1)))  # fmt: skip
    assert em.resumed_from == (at(3) + 1) // at(1) * at(1)
    em.run()
    assert_same_run(tmp_path / "run", tmp_path / "ref")
    assert summary_of(tmp_path / "ref")["dropped_updates"] == 1


def test_resume_refuses_another_run_and_leaves_the_folder_alone(tiny_scenario, tmp_path):
    s = tiny_scenario(tokens=3000, zero_shot_items=0)
    with pytest.raises(RunError, match="no checkpoint in"):
        EmulatedRun(s, get_method("diloco"), RunOptions(out_dir=tmp_path / "empty", resume=True))
    out = tmp_path / "run"
    run(s, "diloco", out, checkpoint_every=1)
    events = (out / "events.jsonl").read_bytes()
    other = tiny_scenario(tokens=3000, zero_shot_items=0, outer_lr=0.5)
    with pytest.raises(RunError, match=r"belongs to another run.*scenario\.training\.outer_lr \(0\.7 then, 0\.5 now\)"):
        EmulatedRun(other, get_method("diloco"), RunOptions(out_dir=out, resume=True))
    with pytest.raises(RunError, match=r"method \(\"diloco\" then, \"geomesh\" now\)"):
        EmulatedRun(s, get_method("geomesh"), RunOptions(out_dir=out, resume=True))
    with pytest.raises(RunError, match=r"seed \(0 then, 5 now\)"):
        EmulatedRun(s, get_method("diloco"), RunOptions(out_dir=out, resume=True, seed=5))
    with pytest.raises(RunError, match="async-local-sgd cannot be resumed"):
        EmulatedRun(s, get_method("async-local-sgd"), RunOptions(out_dir=out, resume=True))
    assert (out / "events.jsonl").read_bytes() == events
    # the reliability section does not change what a run computes: resuming with other values is fine
    s.reliability.max_consecutive_failures = 7
    assert EmulatedRun(s, get_method("diloco"), RunOptions(out_dir=out, resume=True)).resumed_from == 2


def test_checkpoint_files_are_atomic_verified_and_pruned(tmp_path):
    d = tmp_path / "ck"
    for r in (1, 2, 3):
        ckpt.write_checkpoint(d, r, {"x": torch.full((4,), float(r)), "round": r}, keep=2)
    assert [m["round"] for m in ckpt.list_checkpoints(d)] == [2, 3]
    assert sorted(p.name for p in d.iterdir()) == ["round-000002.json", "round-000002.pt", "round-000003.json",
                                                   "round-000003.pt"]  # fmt: skip
    # a damaged newest checkpoint is skipped with a warning; the previous one is used
    blob = bytearray((d / "round-000003.pt").read_bytes())
    blob[len(blob) // 2] ^= 1
    (d / "round-000003.pt").write_bytes(bytes(blob))
    with pytest.warns(UserWarning, match="do not match its marker"):
        marker, state = ckpt.load_latest(d)
    assert marker["round"] == 2 and state["x"].tolist() == [2.0] * 4
    # a .pt without its marker (a crash between the two renames) does not exist as a checkpoint
    (d / "round-000009.pt").write_bytes(b"half")
    assert [m["round"] for m in ckpt.list_checkpoints(d)] == [2, 3]
    # checkpoints load with weights_only: a pickled object that would run code is refused
    ckpt.write_checkpoint(d, 10, {"obj": Interrupted()}, keep=5)
    with pytest.raises(ckpt.CheckpointError, match="cannot load"):
        ckpt.read_checkpoint(d, ckpt.list_checkpoints(d)[-1])


# ---- worker faults ---------------------------------------------------------------------------------------


def test_fault_costs_are_reported_and_a_rejoining_worker_gets_the_global_state(tmp_path, small_corpus, capsys,
                                                                               monkeypatch):  # fmt: skip
    d = tiny_scenario_dict(small_corpus, tokens=12000, zero_shot_items=0)  # 6 rounds of 1,920 tokens (+480 folded)
    d["faults"] = [{"at_round": 1, "region": "r0-h100", "kind": "slowdown", "factor": 3.0},
                   {"at_round": 2, "region": "r2-t4", "kind": "leave"},
                   {"at_round": 4, "region": "r2-t4", "kind": "join"}]  # fmt: skip
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(d))
    seen: list[tuple[str, bool, int]] = []  # (worker, starts from θ, AdamW state entries) at each local phase
    original_phase, original_train = OuterLoopMethod.local_phase, Worker.train
    theta: dict[str, torch.Tensor] = {}

    def local_phase(self, worker, steps, batch, global_params, codec, lr_at_step):
        theta.clear()
        theta.update({k: v.clone() for k, v in global_params.items()})
        return original_phase(self, worker, steps, batch, global_params, codec, lr_at_step)

    def train(self, steps, batch, lr_at_step):
        same = all(torch.equal(p, theta[n]) for n, p in self.model.named_parameters())
        seen.append((self.name, same, len(self.optimizer.state)))
        return original_train(self, steps, batch, lr_at_step)

    monkeypatch.setattr(OuterLoopMethod, "local_phase", local_phase)
    monkeypatch.setattr(Worker, "train", train)
    assert main(["train", str(path), "--method", "geomesh", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    t4 = [(same, state) for name, same, state in seen if name == "r2-t4"]
    assert len(t4) >= 4
    assert all(same for _, same, _ in seen)  # every local phase starts from the current θ ...
    assert t4[2] == (True, 0)  # ... and the rejoining worker (its third phase) with a fresh AdamW
    assert t4[1][1] > 0 and t4[3][1] > 0

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    slow, leave, join = summary["faults"]
    assert (slow["kind"], leave["kind"], join["kind"]) == ("slowdown", "leave", "join")
    assert slow["round_s_after"] > 2 * slow["round_s_before"]  # the round that discovered the slowdown ...
    assert slow["round_s_replanned"] < slow["round_s_after"] / 1.5  # ... and the re-planned one after it
    for f in (slow, leave, join):
        assert f["tokens_lost"] == 0 and f["tokens_per_s_before"] > 0 and f["tokens_per_s_after"] > 0
    printed = capsys.readouterr().out
    assert "round 1 r0-h100 slowdown x3: round " in printed and "round 2 r2-t4 leave: round " in printed
    assert "round 4 r2-t4 join" in printed and "tokens lost" in printed


def test_nan_worker_is_dropped_and_repeated_failures_stop_the_run(tiny_scenario, tmp_path):
    s = tiny_scenario(tokens=16000, zero_shot_items=0)
    s.faults = [FaultConfig(r, "r1-a100", "nan") for r in (1, 3, 4, 5)]
    s.reliability.max_consecutive_failures = 3
    em = EmulatedRun(s, get_method("diloco"), RunOptions(out_dir=tmp_path, progress=False))
    with pytest.warns(UserWarning, match="r1-a100: non-finite"):
        with pytest.raises(RunError, match=r"worker r1-a100: no usable update for 3 consecutive rounds \(rounds 3-5; "
                                           r"last: non-finite .*summary of the 6 rounds done"):  # fmt: skip
            em.run()
    assert all(torch.isfinite(p).all() for p in em.cluster.global_model.parameters())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "stopped" and "consecutive" in summary["stop_reason"]
    assert summary["rounds"] == 6 and summary["dropped_updates"] == 4  # round 2 counted: AdamW was healed
    assert all(math.isfinite(c[2]) for c in summary["curve"]) and summary["curve"][-1][2] < summary["curve"][0][2]
    assert [f["tokens_lost"] for f in summary["faults"]] == [4 * 5 * 32] * 4
    warnings = [e for e in read_events(tmp_path / "events.jsonl") if e["type"] == "warning"]
    assert [(w["round"], w["worker"]) for w in warnings] == [(r, "r1-a100") for r in (1, 3, 4, 5)]


def test_nan_in_ddp_skips_the_step(tiny_scenario):
    s = tiny_scenario(tokens=3000, zero_shot_items=0)
    s.faults = [FaultConfig(2, "r2-t4", "nan"), FaultConfig(3, "r0-h100", "corrupt")]
    with pytest.warns(UserWarning, match="the all-reduced step is skipped"):
        summary = run(s, "ddp")
    assert summary["dropped_updates"] == 1 and math.isfinite(summary["final_val_loss"])
    assert summary["faults"][0]["tokens_lost"] == 3 * 4 * 32 and "no payload" in summary["faults"][1]["ignored"]


# ---- hostile and broken input ----------------------------------------------------------------------------


def test_hmac_signed_payloads_reject_tampering(tiny_scenario, tmp_path, monkeypatch):
    monkeypatch.setenv("GEOMESH_TEST_KEY", "0123456789abcdef0123456789abcdef")
    s = tiny_scenario(tokens=5000, zero_shot_items=0)
    s.reliability.hmac_key_env = "GEOMESH_TEST_KEY"
    s.faults = [FaultConfig(1, "r0-h100", "corrupt")]
    with pytest.warns(UserWarning, match="r0-h100, round 1: payload rejected: HMAC tag mismatch"):
        summary = run(s, "geomesh", tmp_path)
    assert summary["rejected_payloads"] == 1 and summary["dropped_updates"] == 0 and summary["status"] == "complete"
    assert summary["faults"][0]["tokens_lost"] > 0
    unsigned = get_method("geomesh").make_codec(Manifest.from_shapes({"w": (1000,)}), s)
    signed = get_method("geomesh").make_codec(Manifest.from_shapes({"w": (1000,)}), s, key=payload_key(s))
    assert signed.payload_nbytes() == unsigned.payload_nbytes() + 32
    assert any(e["type"] == "warning" and "HMAC" in e["message"] for e in read_events(tmp_path / "events.jsonl"))


@pytest.mark.parametrize("kind", ["sign", "dense"])
def test_payload_screening(kind):
    m = Manifest.from_shapes({"a": (40, 3), "b": (7,)})
    make = (lambda key=None: SignCodec(m, chunk_size=16, key=key)) if kind == "sign" else (
        lambda key=None: DenseCodec(m, key=key))  # fmt: skip
    x = {"a": torch.randn(40, 3), "b": torch.randn(7)}
    a, b = b"a" * 32, b"b" * 32
    assert screen_payload(make(a), make(a).encode(x, 10)) is None
    assert "HMAC tag mismatch" in screen_payload(make(a), make(b).encode(x, 10))  # wrong key
    assert "missing HMAC tag" in screen_payload(make(a), make().encode(x, 10))  # unsigned
    assert "HMAC tag mismatch" in screen_payload(make(a), corrupt_payload(make(a).encode(x, 10)))
    assert "checksum mismatch" in screen_payload(make(), corrupt_payload(make().encode(x, 10)))  # no key: crc32



@pytest.mark.parametrize("kind", ["sign", "dense"])
def test_every_slot_is_screened_before_any_is_combined(kind):
    """A bad slot (another key, corrupted) costs its sender's update; an empty slot is a dropped update; what
    passed combines as the codec combines it (a dense codec: the signed contributions summed in region order)."""
    from geomesh.runtime.payloads import combine_payloads, screen_slots

    m = Manifest.from_shapes({"a": (40, 3), "b": (7,)})
    make = (lambda key=None: SignCodec(m, chunk_size=16, key=key)) if kind == "sign" else (
        lambda key=None: DenseCodec(m, key=key))  # fmt: skip
    mine, other = make(b"a" * 32), make(b"b" * 32)
    xs = [{"a": torch.randn(40, 3), "b": torch.randn(7)} for _ in range(3)]
    slots = {3: mine.encode(xs[2], 30), 0: mine.encode(xs[0], 10), 1: other.encode(xs[1], 20), 2: None,
             4: corrupt_payload(mine.encode(xs[1], 20))}  # fmt: skip
    passed, rejected, dropped = screen_slots(mine, slots)
    assert list(passed) == [0, 3] and dropped == [2]
    assert [(i, "HMAC tag mismatch" in why) for i, why in rejected] == [(1, True), (4, True)]
    got = combine_payloads(mine, list(passed.values()), torch.device("cpu"))
    if kind == "sign":
        want = mine.combine([slots[0], slots[3]])
    else:  # the sum an all-reduce of the two contributions would have made
        want = mine.reduced_update(mine.reducible(slots[0]) + mine.reducible(slots[3]))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert combine_payloads(mine, [], torch.device("cpu")) is None

def test_hmac_key_sources(tiny_scenario, tmp_path, monkeypatch):
    s = tiny_scenario()
    assert payload_key(s) is None
    s.reliability.hmac_key_env = "GEOMESH_NO_SUCH_KEY"
    monkeypatch.delenv("GEOMESH_NO_SUCH_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"hmac_key_env \(GEOMESH_NO_SUCH_KEY\).*not set"):
        EmulatedRun(s, get_method("geomesh"), RunOptions(out_dir=tmp_path / "run", progress=False))
    assert not (tmp_path / "run").exists()  # refused before anything was written
    monkeypatch.setenv("GEOMESH_NO_SUCH_KEY", "short")
    with pytest.raises(ConfigError, match="at least 16"):
        payload_key(s)
    s.reliability.hmac_key_env, s.reliability.hmac_key_file = None, str(tmp_path / "key")
    with pytest.raises(ConfigError, match="cannot read the key"):
        payload_key(s)
    (tmp_path / "key").write_text("s3cr3t-s3cr3t-s3cr3t\n")
    assert payload_key(s) == b"s3cr3t-s3cr3t-s3cr3t"


MANIFEST = Manifest.from_shapes({"w": (33, 5), "b": (9,), "s": ()})


def _mutate(payload: bytes, how: int, where: int, value: int) -> bytes:
    if how == 0:  # flip bits of one byte
        b = bytearray(payload)
        b[where % len(b)] ^= value or 1
        return bytes(b)
    if how == 1:
        return payload[: where % len(payload)]  # truncated
    if how == 2:
        return payload + bytes([value]) * (1 + where % 64)  # oversized
    if how == 3:  # a header field swapped for another payload's
        return payload[:28] + (value + 1).to_bytes(8, "little") + payload[36:]
    return bytes([value]) * (where % 300)  # garbage


@FUZZ
@given(
    kind=st.sampled_from(["sign-weighted", "sign-majority", "dense-equal", "dense-tokens"]),
    keyed=st.booleans(),
    tokens=st.lists(st.integers(1, 10**6), min_size=1, max_size=5),
    mutations=st.lists(st.none() | st.tuples(st.integers(0, 4), st.integers(0, 10**6), st.integers(0, 255)),
                       min_size=1, max_size=5),  # fmt: skip
)
def test_combine_fuzz_mixes_valid_and_mutated_payloads(kind, keyed, tokens, mutations):
    """combine() over a mix refuses the whole mix with PayloadError (never another exception); screening
    first keeps exactly the intact payloads, whose combination is finite and what they alone give."""
    family, rule = kind.split("-")
    key = b"k" * 32 if keyed else None
    codec = (SignCodec(MANIFEST, chunk_size=16, combine_rule=rule, key=key) if family == "sign"
             else DenseCodec(MANIFEST, weighting=rule, key=key))  # fmt: skip
    gen = torch.Generator().manual_seed(len(tokens) * 7 + sum(tokens) % 1000)
    n = len(mutations)
    originals = [codec.encode({s.name: torch.randn(s.shape, generator=gen) for s in MANIFEST},
                              tokens[i % len(tokens)]) for i in range(n)]  # fmt: skip
    mixed = [p if m is None else _mutate(p, *m) for p, m in zip(originals, mutations)]
    intact = [p for p, q in zip(originals, mixed) if p == q]
    kept = [p for p in mixed if screen_payload(codec, p) is None]
    assert kept == intact
    if len(intact) < n:
        with pytest.raises(PayloadError):
            codec.combine(mixed)
    if kept:
        out = codec.combine(kept)
        assert all(torch.isfinite(t).all() for t in out.values())
        ref = codec.combine(intact)
        assert all(torch.equal(out[k], ref[k]) for k in out)


def _json_values():
    leaves = (st.none() | st.booleans() | st.integers() | st.just(10**400) | st.floats() | st.text(max_size=6)
              | st.sampled_from(["azure", "H100", "T4", "nano", "l2", "leave", "nan", "tokens", "hf", "text", "1e6"]))  # fmt: skip
    return st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                        max_leaves=10)  # fmt: skip


EXTREMES = [10**400, -(10**400), -1, 0, 2**63, float("nan"), float("inf"), "", "  ", None, True, [], {}, [[]],
            "r0-h100", "unknown"]


def _values():
    """Any YAML value, half the time one of the edge cases a loader trips over."""
    return st.sampled_from(EXTREMES) | _json_values()


def _load_or_config_error(path: Path, data) -> None:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    try:
        cfg = load_scenario(path)
    except ConfigError:
        return
    assert isinstance(cfg, ScenarioConfig)  # anything else raised fails the test


SECTIONS = ["name", "regions", "wan", "timing_model", "model", "data", "training", "geomesh", "faults", "logging",
            "reliability", "description"]  # fmt: skip


@FUZZ
@given(st.dictionaries(st.sampled_from(SECTIONS) | st.text(max_size=6), _values(), max_size=6))
def test_scenario_loader_fuzz_random_documents(tmp_path, data):
    _load_or_config_error(tmp_path / "fuzz.yaml", data)


def _get(node, path):
    for k in path:
        node = node[k]
    return node


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _valid_doc(paths: list[str]) -> dict:
    doc = copy.deepcopy(tiny_scenario_dict(paths))  # (it shares the session's list of paths)
    doc["faults"] = [{"at_round": 1, "region": "r1-a100", "kind": "leave"}]
    doc["reliability"] = {"checkpoint_every_rounds": 2, "hmac_key_env": "KEY"}
    return doc


def test_scenario_loader_every_field_with_every_edge_value(tmp_path, small_corpus):
    """The exhaustive single mutation: each field of a valid scenario set to each edge value."""
    base = _valid_doc(small_corpus)
    for path in [p for p in _paths(base) if p]:
        for value in EXTREMES:
            doc = copy.deepcopy(base)
            _get(doc, path[:-1])[path[-1]] = value
            _load_or_config_error(tmp_path / "edge.yaml", doc)


@FUZZ
@given(data=st.data())
def test_scenario_loader_fuzz_mutated_valid_scenario(tmp_path, small_corpus, data):
    doc = _valid_doc(small_corpus)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        leaves = [p for p in paths if not isinstance(_get(doc, p), (dict, list))]
        target = data.draw(st.sampled_from(leaves) | st.sampled_from(paths))
        parent = doc
        for k in target[:-1]:
            parent = parent[k]
        action = data.draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[target[-1]] = data.draw(_values())
        elif action == "delete":
            del parent[target[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=6))] = data.draw(_values())
    if data.draw(st.integers(0, 3)) == 0:  # and damage the YAML text itself
        text = bytearray(yaml.safe_dump(doc).encode())
        for _ in range(data.draw(st.integers(1, 4))):
            text[data.draw(st.integers(0, len(text) - 1))] = data.draw(st.integers(0, 255))
        (tmp_path / "fuzz.yaml").write_bytes(bytes(text))
        try:
            load_scenario(tmp_path / "fuzz.yaml")
        except ConfigError:
            pass
        return
    _load_or_config_error(tmp_path / "fuzz.yaml", doc)


# ---- storage faults --------------------------------------------------------------------------------------


def test_unwritable_run_folder_is_one_clear_error(tiny_scenario, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(RunError, match="is not writable"):
        EmulatedRun(tiny_scenario(), get_method("diloco"), RunOptions(out_dir=blocker / "run"))
    path = tmp_path / "tiny.yaml"  # written by the fixture
    assert main(["train", str(path), "--method", "diloco", "--out", str(blocker / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run folder") and "Traceback" not in err and err.count("\n") == 1


def test_full_run_folder_is_one_clear_error_before_training(tiny_scenario, tmp_path, monkeypatch):
    s = tiny_scenario()
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10 * ckpt.MiB))
    EmulatedRun(s, get_method("geomesh"), RunOptions(out_dir=tmp_path / "ok"))  # enough without checkpoints
    with pytest.raises(RunError, match=r"is full: .*10\.0 MiB free, 2 checkpoint\(s\) of ~[\d.]+ MiB"):
        EmulatedRun(s, get_method("geomesh"), RunOptions(out_dir=tmp_path / "ck", checkpoint_every=1))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(RunError, match="is full"):
        EmulatedRun(s, get_method("diloco"), RunOptions(out_dir=tmp_path / "full"))
    assert not (tmp_path / "full" / "events.jsonl").exists()


def test_failed_checkpoint_write_keeps_the_previous_one_and_stops_cleanly(tiny_scenario, tmp_path, monkeypatch):
    s = tiny_scenario(tokens=8000, zero_shot_items=0)
    out = tmp_path / "run"
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):  # the disk fills up while round 3's checkpoint is written
        if str(dst).endswith("round-000003.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(RunError, match=r"could not write the checkpoint of round 3 .*No space left on device; the "
                                       r"summary of the 3 rounds done is in .*; the last checkpoint \(round 2\) is "
                                       r"intact: continue with --resume"):  # fmt: skip
        run(s, "diloco", out, checkpoint_every=1)
    monkeypatch.undo()
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["status"] == "stopped" and stopped["rounds"] == 3 and "No space left" in stopped["stop_reason"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "round-000001.json", "round-000001.pt", "round-000002.json", "round-000002.pt"]  # fmt: skip
    # once there is room again, the run continues from round 2 and ends as if nothing had happened
    run(s, "diloco", out, checkpoint_every=1, resume=True)
    run(s, "diloco", tmp_path / "ref")
    assert_same_run(out, tmp_path / "ref")


def test_disk_full_during_the_run_stops_cleanly(tiny_scenario, tmp_path):
    em = EmulatedRun(tiny_scenario(tokens=8000, zero_shot_items=0), get_method("diloco"),
                     RunOptions(out_dir=tmp_path, progress=False))  # fmt: skip

    class FullAfter:
        def __init__(self, f, lines):
            self.f, self.lines = f, lines

        def write(self, text):
            self.lines -= 1
            if self.lines < 0:
                raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "events.jsonl"))
            return self.f.write(text)

        def close(self):
            self.f.close()

    em.telemetry._file = FullAfter(em.telemetry._file, 40)
    with pytest.raises(RunError, match=r"round \d+: I/O error \(.*events\.jsonl\): No space left on device; the "
                                       r"summary of the \d+ rounds done is in"):  # fmt: skip
        em.run()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["rounds"] >= 1 and summary["curve"]
