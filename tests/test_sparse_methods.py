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
    # geomesh-sparse's positions: the top 108 blocks of 4 entries per chunk; sparseloco's: the top 64 entries
    assert (gs.block, gs.k, gs.scale, gs.warm_start) == (4, 432, "rms", False) and (sl.block, sl.k) == (1, 64)
    single = sparse.make_codec(m, load_scenario("default", {"compression.sparse_block": 1}))
    assert (single.block, single.k) == (1, 64) and single.bits_per_parameter() < 0.15
    assert gs.bits_per_parameter() <= 0.25 and loco.make_codec(m, load_scenario(
        "default", {"compression.sparse_block": 8, "compression.sparse_block_k": 384})).block == 1  # fmt: skip
    for field, value in [("sparse_block", 3), ("sparse_block", 0), ("sparse_block_k", 430), ("sparse_block_k", 2),
                         ("sparse_scale", "max")]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"compression.{field}"):
            load_scenario("default", {f"compression.{field}": value})
    # the bytes: >= 128x fewer than fp32 DiLoCo on default; int8 about 4x, fp4 about 8x
    fp32 = DenseCodec(m).payload_nbytes()
    assert fp32 / gs.payload_nbytes() >= 128
    assert 3.8 < fp32 / get_method("diloco-int8").make_codec(m, sc).payload_nbytes() < 4
    assert 7.5 < fp32 / get_method("diloco-fp4").make_codec(m, sc).payload_nbytes() < 8
    # geomesh-sparse's rounds carry half the reference's sequences (N·b·H/2) unless the scenario sets the round
    ref = len(sc.regions) * sc.training.batch * sc.training.inner_steps
    assert abs(sparse.plan(sc, sc.worker_profiles()).sequences_per_round - ref / 2) < 0.1 * ref / 2
    assert get_method("geomesh").plan(sc, sc.worker_profiles()).sequences_per_round > 5 * ref
    timed = load_scenario("default", {"geomesh.round_time_s": 25.9})
    assert sparse.plan(timed, timed.worker_profiles()).sequences_per_round > 5 * ref
    # through a sharded exchange that re-sparsifies, rounds of half that (it applies one payload's share of the
    # update a round); float32 combined shards or the all-gather keep the method's rounds
    def target(**over):
        s = load_scenario("default", over)
        return sparse.constraints(s, len(s.regions)).target_sequences

    assert target() == target(**{"geomesh.exchange": "all_gather"}) == round(ref / 2)  # default: the all-gather
    assert target(**{"geomesh.exchange": "sharded"}) == round(ref / 4)
    assert target(**{"geomesh.exchange": "sharded", "geomesh.shard_bits": 32}) == round(ref / 2)
    assert target(**{"geomesh.exchange": "sharded", "geomesh.round_sequences_factor": 1.0}) == ref  # the scenario's
    assert get_method("sparseloco").constraints(sc, 4).target_sequences is None  # uniform rounds: no target
    with pytest.raises(ConfigError, match="compression.sparse_feedback"):
        load_scenario("default", {"compression.sparse_feedback": "momentum"})


class _StubWorker:
    """What local_phase needs of a worker: where its round started, and steps that move it by ``step``."""

    name = "stub"

    def __init__(self, step):
        self.step, self.started = step, None

    def load_global(self, params):
        self.started = {k: v.clone() for k, v in params.items()}
        self.local = {k: v.clone() for k, v in params.items()}

    def train(self, steps, batch, lr_at_step):
        from geomesh.worker import InnerResult

        for k in self.local:
            self.local[k] -= self.step[k]
        return InnerResult(steps=steps, tokens=10, mean_loss=1.0, finite=True)

    def pseudo_gradient(self, global_params, names=None):
        return {k: global_params[k] - self.local[k] for k in global_params}


@pytest.mark.parametrize("feedback", ["residual", "decay"])
def test_warm_started_rounds_start_from_theta_minus_the_residual(feedback):
    small = {"compression.sparse_feedback": feedback, "compression.sparse_chunk_size": 16,
             "compression.sparse_block_k": 4, "compression.sparse_k": 4}  # fmt: skip
    cold = load_scenario("default", small)
    warm = load_scenario("default", {**small, "compression.sparse_warm_start": True})
    method = get_method("geomesh-sparse")
    g = torch.Generator().manual_seed(1)
    theta = {"w": torch.randn(4, 16, generator=g)}
    m = Manifest.from_tensors(theta)
    steps = [{"w": torch.randn(4, 16, generator=g)} for _ in range(3)]
    wc, cc = method.make_codec(m, warm), method.make_codec(m, cold)
    assert wc.warm_start and not cc.warm_start and wc.ef_decay == cc.ef_decay
    for step in steps:
        before = None if not wc.residual else {k: v.clone() for k, v in wc.residual.items()}
        worker = _StubWorker(step)
        payload, _ = method.local_phase(worker, 1, 1, theta, wc, None)
        start = theta["w"] if before is None else theta["w"] - wc.ef_decay * before["w"]
        assert torch.allclose(worker.started["w"], start)  # the round began at θ − β·e
        # the same payload as the cold rule, whose codec adds β·e to the round's own Δ
        ours, theirs = wc.decode(payload).tensors["w"], cc.decode(cc.encode({"w": step["w"]}, 10)).tensors["w"]
        assert torch.equal(ours != 0, theirs != 0) and torch.allclose(ours, theirs, atol=1e-6)  # up to rounding
        assert torch.allclose(wc.residual["w"], cc.residual["w"], atol=1e-6)
    with pytest.raises(ConfigError, match="compression.sparse_warm_start"):
        load_scenario("default", {"compression.sparse_warm_start": "yes"})


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
