"""The compressed methods (geomesh-sparse, sparseloco, diloco-int8, diloco-fp4) in the emulated runtime, their
published rules (outer step, weights, feedback), the time budget and the few-outer-steps warning."""

from __future__ import annotations

import json

import pytest
import torch

from geomesh.cli import main
from geomesh.codec import DenseCodec, Manifest, QuantCodec, SparseSignCodec
from geomesh.config import ConfigError, load_scenario
from geomesh.methods import get_method
from geomesh.methods.base import proxy_manifest
from geomesh.outer import OuterNesterov
from geomesh.methods.budget import budget_rule, few_outer_steps, tokens_in_time
from geomesh.runtime.emulated import EmulatedRun, RunError, RunOptions

NEW = ["geomesh-sparse", "sparseloco", "diloco-int8", "diloco-fp4"]


def run(scenario, method, out=None, **opts):
    return EmulatedRun(scenario, get_method(method), RunOptions(out_dir=out, progress=False, **opts)).run()


def test_each_method_trains_and_sends_what_its_codec_says(tiny_scenario):
    s = tiny_scenario()
    dense = get_method("diloco").modeled_payload_bytes(s)
    for name in NEW:
        summary = run(s, name, tokens=12000)
        curve = [c[2] for c in summary["curve"]]
        assert torch.isfinite(torch.tensor(curve)).all() and curve[-1] < curve[0], name
        assert summary["collective"] == "all_gather"
        codec = get_method(name).make_codec(proxy_manifest(s), s)
        assert summary["proxy_payload_bytes"] == codec.payload_nbytes()
        assert summary["payload_bytes_per_worker"] < dense / 3.5, name
    assert isinstance(get_method("geomesh-sparse").make_codec(proxy_manifest(s), s), SparseSignCodec)
    assert isinstance(get_method("diloco-int8").make_codec(proxy_manifest(s), s), QuantCodec)


def test_published_rules_of_each_method():
    sc = load_scenario("default")
    m = proxy_manifest(sc)
    sparse, loco = get_method("geomesh-sparse"), get_method("sparseloco")
    gs, sl = sparse.make_codec(m, sc), loco.make_codec(m, sc)
    # geomesh-sparse: balanced plan, token weights, classic residual in place of outer momentum (plain SGD)
    assert sparse.balanced and gs.weighting == "tokens" and gs.value_bits == 1
    assert gs.error_feedback and gs.ef_decay == 1.0
    assert sparse.outer_settings(sc) == (sc.compression.decay_outer_lr, 0.0)
    # without feedback, the scenario's outer Nesterov (as DiLoCo)
    bare = load_scenario("default", {"compression.sparse_feedback": "none"})
    assert sparse.outer_settings(bare) == (sc.training.outer_lr, sc.training.outer_momentum)
    # sparseloco: uniform plan, equal weights, 2-bit values, decayed feedback in place of outer momentum
    assert not loco.balanced and sl.weighting == "equal" and sl.value_bits == 2
    assert sl.error_feedback and sl.ef_decay == sc.compression.ef_decay == 0.95
    assert loco.outer_settings(sc) == (sc.compression.decay_outer_lr, 0.0)
    # the variants of geomesh-sparse come from the scenario
    decay = load_scenario("default", {"compression.sparse_feedback": "decay"})
    assert sparse.outer_settings(decay) == (1.0, 0.0) and sparse.make_codec(m, decay).ef_decay == 0.95
    assert not sparse.make_codec(m, load_scenario("default", {"compression.sparse_feedback": "none"})).error_feedback
    # the bytes: >= 128x fewer than fp32 DiLoCo on default; int8 about 4x, fp4 about 8x
    fp32 = DenseCodec(m).payload_nbytes()
    assert fp32 / gs.payload_nbytes() >= 128
    assert 3.8 < fp32 / get_method("diloco-int8").make_codec(m, sc).payload_nbytes() < 4
    assert 7.5 < fp32 / get_method("diloco-fp4").make_codec(m, sc).payload_nbytes() < 8
    # geomesh-sparse's rounds carry the reference's sequences (N·b·H) unless the scenario sets the round
    ref = len(sc.regions) * sc.training.batch * sc.training.inner_steps
    assert abs(sparse.plan(sc, sc.worker_profiles()).sequences_per_round - ref) < 0.1 * ref
    assert get_method("geomesh").plan(sc, sc.worker_profiles()).sequences_per_round > 5 * ref
    timed = load_scenario("default", {"geomesh.round_time_s": 25.9})
    assert sparse.plan(timed, timed.worker_profiles()).sequences_per_round > 5 * ref
    with pytest.raises(ConfigError, match="compression.sparse_feedback"):
        load_scenario("default", {"compression.sparse_feedback": "momentum"})


def test_sparseloco_outer_step_is_plain_sgd_on_the_mean():
    """Two rounds of sparseloco move θ by exactly −α · mean of the decoded payloads: no outer momentum."""
    sc = load_scenario("default")
    method = get_method("sparseloco")
    g = torch.Generator().manual_seed(0)
    theta = {"w": torch.randn(64, 128, generator=g), "b": torch.randn(10, generator=g)}
    m = Manifest.from_tensors(theta)
    workers = [method.make_codec(m, sc) for _ in range(2)]
    combiner = method.make_codec(m, sc)
    outer = OuterNesterov(theta, *method.outer_settings(sc))
    for _ in range(2):
        before = {k: v.clone() for k, v in theta.items()}
        deltas = [{k: torch.randn(v.shape, generator=g) for k, v in theta.items()} for _ in workers]
        payloads = [c.encode(d, 100 * (i + 1)) for i, (c, d) in enumerate(zip(workers, deltas))]
        decoded = [combiner.decode(p).tensors for p in payloads]
        assert method.apply(payloads, combiner, outer)
        for k in theta:
            expected = before[k] - sc.compression.decay_outer_lr * (decoded[0][k] + decoded[1][k]) / 2
            assert torch.allclose(theta[k], expected, atol=1e-6)


def test_time_budget_gives_every_method_the_same_modeled_seconds(tiny_scenario):
    s = tiny_scenario()
    seconds = 3 * get_method("diloco").plan(s, s.worker_profiles()).round_s
    s.training.time_budget_s = seconds
    times = {}
    for name in ("diloco", "geomesh", "geomesh-sparse", "ddp", "async-local-sgd"):
        tokens = tokens_in_time(get_method(name), s, seconds)
        summary = run(s, name)
        assert summary["tokens"] >= tokens  # the budget became the tokens the plan fits in the time
        times[name] = summary["modeled_time_s"]
    for name, t in times.items():  # within a round (or an async cycle) of the budget
        assert seconds * 0.6 < t < seconds * 1.5, (name, t)
    assert "time budget" in budget_rule(s)
    with pytest.raises(RunError, match="not both"):
        run(s, "diloco", tokens=1000)


def test_cli_time_budget_and_stopping_rule_in_the_table(tiny_scenario, tmp_path, capsys):
    s = tiny_scenario()
    path = tmp_path / "tiny.yaml"
    assert main(["bench", str(path), "--methods", "diloco,geomesh-sparse", "--time-budget", "6", "--out",
                 str(tmp_path / "b"), "--quiet", "--workers-parallel", "1"]) == 0
    table = (tmp_path / "b" / "table.md").read_text()
    assert table.startswith("Stopping rule: time budget: 6 modeled seconds")
    assert json.loads((tmp_path / "b" / "results.json").read_text())["stopping_rule"].startswith("time budget")
    assert main(["train", str(path), "--method", "diloco", "--time-budget", "-1", "--out", str(tmp_path / "x")]) == 2
    assert "--time-budget -1" in capsys.readouterr().err


def test_few_outer_steps_warning_names_the_rule():
    sc = load_scenario("multi-gpu-slow-wan")
    note = few_outer_steps(sc, get_method("geomesh"), sc.training.tokens)
    assert note is not None and "geomesh.round_sequences_factor=1" in note and "--time-budget" in note
    assert few_outer_steps(sc, get_method("diloco"), sc.training.tokens) is None  # the reference itself
    kept = load_scenario("multi-gpu-slow-wan", {"geomesh.round_sequences_factor": 1.0})
    assert few_outer_steps(kept, get_method("geomesh"), kept.training.tokens) is None
    assert few_outer_steps(sc, get_method("geomesh"), 100 * sc.training.tokens) is None  # enough rounds


def test_geomesh_plan_says_when_the_token_budget_leaves_few_outer_steps(capsys):
    assert main(["plan", "multi-gpu-slow-wan"]) == 0
    out = capsys.readouterr().out
    assert "note: geomesh: this token budget gives" in out and "round_sequences_factor=1" in out
    assert main(["plan", "multi-gpu-slow-wan", "--set", "geomesh.round_sequences_factor=1"]) == 0
    assert "note:" not in capsys.readouterr().out
