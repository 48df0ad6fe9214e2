"""The overlapped round (docs/overlap.md): the exchange of round r runs under the compute of round r+1.

Pure pieces (the look-ahead step, the apply step, the rebase), the emulated runtime (zero exchange time is
the plain round bit for bit; otherwise every exchange but the last is hidden and the clock says so; worker
processes give the same bits), the planner's floor, the refusals, and the distributed runtime against the
emulated one (3 ranks, one per region, over the WAN shaper).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import yaml
from conftest import FIXED_PLAN, tiny_scenario_dict

from geomesh.config import ConfigError, TrainingConfig, load_scenario
from geomesh.methods import OuterLoopMethod, get_method
from geomesh.codec import Manifest
from geomesh.methods.overlap import (TailSplit, apply_step, eager_estimate, eager_start, eager_weights,
                                     fold_remainder, fragment_manifest, merge_results, rebase, split_manifest,
                                     tail_fragments, tail_schedule, tail_split)  # fmt: skip
from geomesh.outer import OuterNesterov
from geomesh.runtime.emulated import EmulatedRun, RunOptions
from geomesh.telemetry import read_events
from geomesh.worker import InnerResult, Worker

TOKENS = 3 * 19360  # 3 full rounds of the tiny scenario's plan (19,360 tokens each)


def write(folder: Path, paths: list[str], gbps: float = 1.0, **geomesh) -> Path:
    data = tiny_scenario_dict(paths)
    data["geomesh"].update(FIXED_PLAN)
    data["wan"]["bandwidth_gbps"] = gbps
    data["geomesh"].pop("round_sequences_factor", None)  # the planning rule, which overlap floors at the exchange
    data["geomesh"].update(geomesh)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(path: Path, method: str, out: Path | None = None, tokens: int = TOKENS, **options):
    r = EmulatedRun(load_scenario(path), get_method(method),
                    RunOptions(out_dir=out, tokens=tokens, progress=False, **{"workers_parallel": 1, **options}))  # fmt: skip
    summary = r.run()
    return summary, {k: v.clone() for k, v in r.cluster.global_model.state_dict().items()}


# ---- pure pieces ------------------------------------------------------------------------------------


def test_lookahead_is_the_step_it_would_take_and_changes_nothing():
    torch.manual_seed(0)
    params = {"a": torch.randn(50), "b": torch.randn(3, 4)}
    outer = OuterNesterov({k: v.clone() for k, v in params.items()}, lr=0.7, momentum=0.9)
    for _ in range(2):
        g = {k: torch.randn_like(v) for k, v in params.items()}
        before = {k: v.clone() for k, v in outer.params.items()}
        buf = {k: v.clone() for k, v in outer.buf.items()}
        ahead = outer.lookahead(g)
        assert all(torch.equal(outer.params[k], before[k]) for k in params)  # θ untouched
        assert all(torch.equal(outer.buf[k], buf[k]) for k in buf)  # momentum untouched
        outer.step(g)
        assert all(torch.equal(ahead[k], outer.params[k]) for k in params)  # bit-identical to the step
    zero = outer.lookahead(None)  # no estimate at all: momentum only
    expect = {k: outer.params[k] - 0.7 * 0.9 * 0.9 * outer.buf[k] for k in params}
    for k in params:
        torch.testing.assert_close(zero[k], expect[k])


def test_apply_step_is_the_first_step_boundary_after_arrival():
    assert apply_step(0.0, 0.5, 10) == 0  # nothing in flight: the plain round
    assert apply_step(1.0, 0.5, 10) == 2
    assert apply_step(1.01, 0.5, 10) == 3
    assert apply_step(0.001, 0.5, 10) == 1
    assert apply_step(100.0, 0.5, 10) == 10  # an exchange longer than the round: applied at its end
    assert apply_step(1.0, 0.5, 0) == 0


def test_eager_estimates():
    own, last = {"x": torch.tensor([1.0, 2.0])}, {"x": torch.tensor([10.0, 20.0])}
    # own (the default): the worker's fresh update stands in for the combined one; the last one without it
    assert eager_estimate(own, last, 0.25) is own and eager_estimate(None, last, 0.25) is last
    # mixture (Kale et al.): own share at its weight, the rest from the last combined update
    assert torch.equal(eager_estimate(own, last, 0.25, "mixture")["x"], torch.tensor([0.25 + 7.5, 0.5 + 15.0]))
    assert torch.equal(eager_estimate(own, None, 0.25, "mixture")["x"], torch.tensor([0.25, 0.5]))
    assert torch.equal(eager_estimate(None, last, 0.25, "mixture")["x"], torch.tensor([7.5, 15.0]))
    assert eager_estimate(None, None, 0.5, "mixture") is None and eager_estimate(own, last, 0.5, "stale") is None
    outer = OuterNesterov({"x": torch.tensor([3.0, 4.0])}, lr=0.5, momentum=0.9)
    assert torch.equal(eager_start(outer, own, last, 0.5, "stale")["x"], torch.tensor([3.0, 4.0]))
    assert torch.equal(eager_start(outer, own, last, 0.5)["x"], outer.lookahead(own)["x"])
    assert eager_weights({"a": 30, "b": 10}, "tokens") == {"a": 0.75, "b": 0.25}
    assert eager_weights({"a": 30, "b": 10}, "equal") == {"a": 0.5, "b": 0.5}


def _replica(values: list[float]) -> Worker:
    """A worker whose replica is one weight row (what :func:`rebase` moves)."""
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([values]))
    return Worker("w", model, None, TrainingConfig())


def test_rebase_keeps_the_progress_and_moves_it_onto_theta():
    start = {"weight": torch.tensor([[1.0, 1.0, 1.0]])}
    replica = _replica([1.5, 0.75, 1.0])  # trained from start
    theta = {"weight": torch.tensor([[2.0, -1.0, 0.0]])}
    rebase(replica, start, theta)
    assert torch.equal(replica.model.weight.detach(), torch.tensor([[2.5, -1.25, 0.0]]))
    untouched = _replica([1.0, 1.0, 1.0])  # nothing trained yet: lands exactly on θ
    rebase(untouched, start, theta)
    assert torch.equal(untouched.model.weight.detach(), theta["weight"])


def test_a_remainder_too_short_to_hide_the_exchange_joins_the_round():
    # a round: 2 workers, batches 4 and 2, 10 steps each, seq 8 -> 480 tokens, 10 s of compute
    full = dict(batches=[4, 2], seq_len=8, plan_tokens=480, compute_s=10.0)
    assert fold_remainder([10, 10], remaining_tokens=520, exchange_s=2.0, **full) == [11, 11]  # 40 left: 0.8 s
    assert fold_remainder([10, 10], remaining_tokens=960, exchange_s=2.0, **full) == [10, 10]  # a whole round left
    assert fold_remainder([10, 10], remaining_tokens=480, exchange_s=2.0, **full) == [10, 10]  # nothing left
    assert fold_remainder([10, 10], remaining_tokens=600, exchange_s=2.0, **full) == [10, 10]  # 2.5 s left: hides it
    # an exchange that outlasts several rounds' compute: the round at most doubles (no 3x round at once)
    assert fold_remainder([10, 10], remaining_tokens=960, exchange_s=30.0, **full) == [20, 20]  # one round left
    assert fold_remainder([10, 10], remaining_tokens=1440, exchange_s=30.0, **full) == [10, 10]  # two rounds left


def test_merge_results_weights_the_two_parts():
    merged = merge_results(InnerResult(2, 64, 3.0, True), InnerResult(6, 192, 1.0, True))
    assert (merged.steps, merged.tokens, merged.mean_loss, merged.finite) == (8, 256, 1.5, True)
    assert not merge_results(InnerResult(2, 64, 3.0, False), InnerResult(1, 32, 1.0, True)).finite


def test_the_last_exchange_is_split_by_how_much_of_it_is_bytes():
    """The rule: the count whose cost (the wait for the last fragment plus the training the early fragments
    drop) is least; for equal fragments that is F = sqrt(bytes time / latency)."""
    from geomesh.network import WanModel

    method = get_method("geomesh")
    manifest = Manifest.from_shapes({f"t{k}": [1000] for k in range(48)})  # equal tensors, 48 = 2·3·8·16

    def link(latency_s: float, bytes_s: float) -> tuple[WanModel, int]:  # 2 workers: one ring step
        return WanModel(((0.0, 2 * latency_s), (2 * latency_s, 0.0)), ((1.0, 1e6), (1e6, 1.0))), round(bytes_s * 1e6)

    for latency, bytes_s, expected in [(1.0, 9.0, 3), (1.0, 0.5, 1), (0.36, 1.0, 2), (0.1, 6.4, 8), (0.0, 1.0, 16)]:
        wan, payload = link(latency, bytes_s)
        split = tail_split(method, wan, manifest, payload)
        assert (split.fragments if split else 1) == expected, (latency, bytes_s)
        if split:  # the cost of F equal fragments: (L + B/F)·(F + 1)/2, less than the whole exchange
            f = split.fragments
            assert sum(tail_schedule(split)) == pytest.approx((latency + bytes_s / f) * (f + 1) / 2, rel=1e-3)
            assert split.lead_s[-1] == 0 and split.lead_s[0] == pytest.approx(sum(split.exchange_s[:-1]))
    wan, payload = link(1.0, 9.0)
    # a last round that is mostly waiting for the exchange in flight has no room to send fragments early
    assert tail_split(method, wan, manifest, payload, round_s=30.0, busy_s=2.0).fragments == 3
    assert tail_split(method, wan, manifest, payload, round_s=30.0, busy_s=30.0) is None
    assert tail_split(method, wan, manifest, payload, requested=5).fragments == 5  # geomesh.overlap_tail_fragments
    assert tail_split(method, wan, manifest, payload, requested=1) is None
    assert tail_split(method, link(0.0, 0.0)[0], manifest, 0) is None  # nothing to wait for


def test_split_manifest_makes_consecutive_groups_of_about_equal_size():
    m = Manifest.from_shapes({"a": [100], "b": [10], "c": [10], "d": [50], "e": [30], "f": [1]})
    assert split_manifest(m, 1) == [("a", "b", "c", "d", "e", "f")]
    assert split_manifest(m, 2) == [("a",), ("b", "c", "d", "e", "f")]
    assert split_manifest(m, 3) == [("a",), ("b", "c"), ("d", "e", "f")]
    six = split_manifest(m, 6)
    assert six == [(n,) for n in "abcdef"] and split_manifest(m, 9) == six  # never an empty group
    assert [s.name for s in fragment_manifest(m, ("e", "b"))] == ["b", "e"]  # the manifest's order


def test_where_the_rule_keeps_the_last_exchange_whole(tmp_path, small_corpus):
    """Error feedback (a fragment's codec would leave the residual behind) and a start estimate other than
    `own` (a fragment may carry only steps trained from it) keep one exchange; an explicit count is kept
    except with error feedback."""
    path = write(tmp_path, small_corpus)
    assert tail_fragments(load_scenario(path)) is None  # the rule
    assert tail_fragments(load_scenario(path, {"geomesh.overlap_start": "mixture"})) == 1
    assert tail_fragments(load_scenario(path, {"geomesh.overlap_start": "stale",
                                               "geomesh.overlap_tail_fragments": 3})) == 3  # fmt: skip
    assert tail_fragments(load_scenario(path, {"geomesh.error_feedback": True,
                                               "geomesh.overlap_tail_fragments": 3})) == 1  # fmt: skip


def test_the_plan_of_the_last_exchange_counts_the_wait_and_the_dropped_training():
    split = TailSplit((("a",), ("b",), ("c",)), exchange_s=(1.0, 0.5, 0.7), lead_s=(1.5, 0.5, 0.0),
                      shares=(0.4, 0.3, 0.3))
    # a 10 s round, the WAN free: a leaves at 8.5 s and b at 9.5 s, both in by 10 s; c takes 0.7 s after it
    assert tail_schedule(split, 10.0) == pytest.approx((0.7, 0.4 * 1.5 + 0.3 * 0.5))
    assert tail_schedule(split) == pytest.approx((0.7, 0.75))  # (a round long enough for every lead)
    # the exchange in flight holds the WAN and θ until 9 s: a leaves at 9 s, b queues behind it until 10 s
    assert tail_schedule(split, 10.0, busy_s=9.0) == pytest.approx((10.5 + 0.7 - 10.0, 0.4 * 1.0 + 0.3 * 0.5))


def test_fragments_leave_as_late_as_their_exchanges_allow():
    split = TailSplit((("a",), ("b",), ("c",)), exchange_s=(1.0, 0.5, 0.7), lead_s=(1.5, 0.5, 0.0),
                      shares=(0.4, 0.3, 0.3))
    assert split.send_steps(0.25, 20, 0) == [14, 18, 20]  # 1.5 s and 0.5 s before the end, in steps
    assert split.send_steps(0.3, 20, 0) == [15, 18, 20]  # a partial step: taken at the boundary before
    assert split.send_steps(0.25, 20, 16) == [16, 18, 20]  # never before the update in flight is applied
    assert split.send_steps(1.0, 1, 0) == [1, 1, 1]  # at least one step: a payload with tokens
    assert split.send_steps(0.0, 20, 0) == [20, 20, 20]


def test_a_fragment_payload_holds_the_whole_payloads_values():
    """Chunks never cross tensors, so a fragment's payload decodes to what the whole payload holds for its
    tensors: splitting the exchange changes *when* a fragment is taken, not how it is coded."""
    from geomesh.codec import SignCodec

    torch.manual_seed(0)
    delta = {"a": torch.randn(5000), "b": torch.randn(3, 700), "c": torch.randn(9000)}
    m = Manifest.from_tensors(delta)
    whole = SignCodec(m, chunk_size=4096).decode(SignCodec(m, chunk_size=4096).encode(delta, 100)).tensors
    part_m = fragment_manifest(m, ("b", "c"))
    part = SignCodec(part_m, chunk_size=4096)
    decoded = part.decode(part.encode({k: delta[k] for k in ("b", "c")}, 100)).tensors
    assert decoded.keys() == {"b", "c"} and all(torch.equal(decoded[k], whole[k]) for k in decoded)


# ---- the emulated runtime -----------------------------------------------------------------------------


def test_zero_exchange_time_is_the_plain_round_bit_for_bit(tmp_path, small_corpus, monkeypatch):
    """With an exchange that takes no time nothing is in flight when a round starts: every apply step is 0
    and the overlapped run is the plain one (same parameters, losses and clock)."""
    original = OuterLoopMethod.exchange
    monkeypatch.setattr(OuterLoopMethod, "exchange", lambda self, wan, nbytes: (0.0, original(self, wan, nbytes)[1]))
    path = write(tmp_path, small_corpus)
    plain, p_params = run(path, "geomesh")
    over, o_params = run(path, "geomesh-overlap")
    assert plain["rounds"] == over["rounds"] >= 3
    assert all(torch.equal(p_params[k], o_params[k]) for k in p_params)
    assert over["curve"] == plain["curve"] and over["modeled_time_s"] == plain["modeled_time_s"]
    assert over["overlap"] is True and plain["overlap"] is False


def test_overlap_hides_every_exchange_but_the_last(tmp_path, small_corpus):
    path = write(tmp_path, small_corpus, gbps=1.0, overlap_tail_fragments=1)  # the last exchange in one piece
    plain, p_params = run(path, "geomesh", tmp_path / "plain")
    over, o_params = run(path, "geomesh-overlap", tmp_path / "over")
    x = plain["exchange_s_per_round"]
    rounds = plain["rounds"]
    assert over["rounds"] == rounds >= 3 and over["tokens"] == plain["tokens"]
    assert 0 < x < over["plan"]["compute_s"]  # an exchange shorter than a round: it can hide
    assert over["plan"]["workers"] == plain["plan"]["workers"]  # fast link: the same plan
    # each round is the exchange shorter, except the last, whose exchange is waited for at the end
    assert over["modeled_time_s"] == pytest.approx(plain["modeled_time_s"] - (rounds - 1) * x, rel=1e-9)
    per = over["per_worker"]
    assert sum(w["comm_wait"] for w in per.values()) == pytest.approx(len(per) * x)  # the drain only
    assert over["wan_idle_frac"] < plain["wan_idle_frac"] / 2
    assert not all(torch.equal(p_params[k], o_params[k]) for k in p_params)  # an overlapped trajectory
    assert over["final_val_loss"] == pytest.approx(plain["final_val_loss"], rel=0.05)
    events = read_events(tmp_path / "over" / "events.jsonl")
    flights = [e for e in events if e["type"] == "exchange"]
    assert len(flights) == rounds and all(e["end"] - e["start"] == pytest.approx(x) for e in flights)
    spans = [e for e in events if e["type"] == "span"]
    for worker in per:
        mine = sorted((e for e in spans if e["worker"] == worker), key=lambda e: e["start"])
        assert mine[0]["start"] == 0.0 and mine[-1]["end"] == pytest.approx(over["modeled_time_s"])
        for a, b in itertools.pairwise(mine):  # the spans tile the worker's timeline
            assert b["start"] == pytest.approx(a["end"], abs=1e-9)
        # every exchange but the last runs while this worker computes the next round
        for f in flights[:-1]:
            assert any(e["kind"] == "compute" and e["start"] <= f["start"] + 1e-9 and e["end"] >= f["end"] - 1e-9
                       for e in mine), (worker, f)  # fmt: skip
    # an evaluation is stamped when its update has arrived
    evals = [e for e in events if e["type"] == "eval"]
    assert evals[-1]["time"] == pytest.approx(over["modeled_time_s"])
    from geomesh.report import plot_timeline

    plot_timeline(tmp_path / "over" / "events.jsonl", tmp_path / "timeline.png", "overlap")
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_the_last_exchange_leaves_in_fragments_and_only_the_last_is_waited_for(tmp_path, small_corpus):
    """The last round's fragments go on the wire one after another while the round still computes; the run
    waits only for what is left after the compute, and that is less than the whole exchange."""
    whole = write(tmp_path / "whole", small_corpus, gbps=0.2, overlap_tail_fragments=1)
    split = write(tmp_path / "split", small_corpus, gbps=0.2, overlap_tail_fragments=3)
    one, _ = run(whole, "geomesh-overlap", tmp_path / "one")
    three, params = run(split, "geomesh-overlap", tmp_path / "three")
    x = one["exchange_s_per_round"]
    assert one["per_worker"]["r0-h100"]["comm_wait"] == pytest.approx(x)
    events = read_events(tmp_path / "three" / "events.jsonl")
    last = three["rounds"] - 1
    tail = [e for e in events if e["type"] == "exchange" and e["round"] == last]
    assert [e["fragment"] for e in tail] == [0, 1, 2]
    for a, b in itertools.pairwise(tail):  # the WAN carries them one after another
        assert b["start"] >= a["end"] - 1e-9
    computed = max(e["end"] for e in events if e["type"] == "span" and e["kind"] == "compute")
    assert tail[0]["start"] < computed  # the first fragment left while the round still computed
    wait = three["modeled_time_s"] - computed
    assert tail[-1]["end"] == pytest.approx(three["modeled_time_s"])
    assert 0 < wait < x and all(w["comm_wait"] == pytest.approx(wait) for w in three["per_worker"].values())
    assert three["wan_idle_frac"] < one["wan_idle_frac"]
    assert three["tokens"] == one["tokens"] and all(torch.isfinite(v).all() for v in params.values())
    assert three["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=0.02)
    evals = [e for e in events if e["type"] == "eval"]
    assert evals[-1]["time"] == pytest.approx(three["modeled_time_s"])  # θ exists once the last fragment is in


def test_fragments_taken_at_the_round_end_are_the_whole_exchange_bit_for_bit(tmp_path, small_corpus, monkeypatch):
    """The split only changes *when* a fragment is taken: taken after the last step, the fragments' combined
    updates are the whole exchange's, and the run ends with the very parameters of the unsplit run."""
    whole = write(tmp_path / "whole", small_corpus, gbps=0.2, overlap_tail_fragments=1)
    split = write(tmp_path / "split", small_corpus, gbps=0.2, overlap_tail_fragments=3)
    _, a = run(whole, "geomesh-overlap")
    monkeypatch.setattr(TailSplit, "send_steps", lambda self, step_s, steps, apply_at: [steps] * self.fragments)
    _, b = run(split, "geomesh-overlap")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_scenario_switch_overlaps_any_outer_method(tmp_path, small_corpus):
    path = write(tmp_path, small_corpus, overlap=True)
    summary, _ = run(path, "diloco", tokens=12000)
    assert summary["overlap"] is True and summary["plan"]["overlap"] is True


@pytest.mark.parametrize("fragments", [1, 3])
def test_faults_in_overlapped_rounds(tmp_path, small_corpus, fragments):
    """A NaN round and a corrupted payload are left out of the combination, a worker leaves and rejoins (it
    starts from the others' eager estimate): the run completes like the plain one. The second corruption hits
    the last round, whose exchange may leave in fragments: each damaged fragment is rejected."""
    data = tiny_scenario_dict(small_corpus)
    data["geomesh"].pop("round_sequences_factor", None)
    data["geomesh"]["overlap_tail_fragments"] = fragments
    data["faults"] = [{"at_round": 1, "region": "r1-a100", "kind": "nan"},
                      {"at_round": 1, "region": "r2-t4", "kind": "leave"},
                      {"at_round": 2, "region": "r2-t4", "kind": "join"},
                      {"at_round": 2, "region": "r0-h100", "kind": "corrupt"},
                      {"at_round": 3, "region": "r1-a100", "kind": "corrupt"}]  # fmt: skip
    path = tmp_path / "faults.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.warns(UserWarning):
        plain, _ = run(path, "geomesh", tokens=TOKENS)
    with pytest.warns(UserWarning):
        over, params = run(path, "geomesh-overlap", tokens=TOKENS)
    assert over["status"] == plain["status"] == "complete" and over["rounds"] == plain["rounds"]
    assert over["rounds"] == 4  # (the round without r2-t4 trained fewer tokens)
    assert (over["dropped_updates"], over["rejected_payloads"]) == (1, 1 + fragments)
    assert [f["tokens_lost"] for f in over["faults"]] == [f["tokens_lost"] for f in plain["faults"]]
    assert all(torch.isfinite(v).all() for v in params.values())
    assert over["final_val_loss"] == pytest.approx(plain["final_val_loss"], rel=0.05)


def test_worker_processes_give_the_same_bits(tmp_path, small_corpus):
    from geomesh.runtime.emulated.parallel import fork_available

    if not fork_available():
        pytest.skip("worker processes need fork")
    path = write(tmp_path, small_corpus, overlap_tail_fragments=3)  # the last exchange in fragments, too
    one, a = run(path, "geomesh-overlap")
    two, b = run(path, "geomesh-overlap", workers_parallel=2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert one["curve"] == two["curve"]


# ---- the planner ---------------------------------------------------------------------------------------


def test_planner_stretches_a_round_to_the_exchange_it_hides(tmp_path, small_corpus):
    """On a link slower than the round, the overlapped plan fills the exchange with compute instead of
    waiting; on a fast link it is the plain plan."""
    sc = load_scenario(write(tmp_path, small_corpus, gbps=0.02))
    profiles = sc.worker_profiles()
    plans = {}
    for name in ("geomesh", "geomesh-overlap"):
        m = get_method(name)
        nbytes = m.modeled_payload_bytes(sc)
        x, _ = m.exchange(sc.wan_model(), nbytes)
        plans[name] = m.plan(sc, profiles, exchange_bytes=nbytes, exchange_s=x)
    plain, over = plans["geomesh"], plans["geomesh-overlap"]
    assert over.exchange_s > plain.compute_s  # the slow link: the exchange is longer than the rule's round
    assert over.compute_s == pytest.approx(over.exchange_s, rel=0.05) and over.compute_s <= over.exchange_s * 1.01
    assert over.round_s == pytest.approx(max(over.compute_s, over.exchange_s))
    assert plain.round_s == pytest.approx(plain.compute_s + plain.exchange_s)
    assert over.sequences_per_round > plain.sequences_per_round
    assert "stretched to the exchange" in over.rule and over.to_json()["overlap"] is True


def test_geomesh_plan_says_how_the_last_exchange_leaves(tmp_path, small_corpus, capsys):
    import json

    from geomesh.cli import main

    path = write(tmp_path, small_corpus, gbps=0.2)
    for fragments in (None, 1, 3):
        extra = [] if fragments is None else ["--set", f"geomesh.overlap_tail_fragments={fragments}"]
        assert main(["plan", str(path), "--json", "--set", "geomesh.overlap=true", *extra]) == 0
        tail = json.loads(capsys.readouterr().out)["last_exchange"]
        assert tail["fragments"] == (fragments or tail["fragments"])
        if fragments is None:  # the rule splits only when the wait it saves is more than the training dropped
            assert tail["wait_s"] + tail["dropped_s"] <= tail["whole_s"]
        if tail["fragments"] == 1:
            assert tail["wait_s"] == tail["whole_s"] and tail["dropped_s"] == 0
    assert main(["plan", str(path), "--set", "geomesh.overlap=true"]) == 0
    assert "last round's exchange" in capsys.readouterr().out
    assert main(["plan", str(path), "--json"]) == 0  # not overlapped: every exchange is waited for whole
    assert "last_exchange" not in json.loads(capsys.readouterr().out)


# ---- refusals ------------------------------------------------------------------------------------------


def test_overlap_refusals(tmp_path, small_corpus, capsys):
    data = tiny_scenario_dict(small_corpus)
    data["geomesh"]["overlap"] = True
    data["reliability"] = {"min_regions": 2}
    path = tmp_path / "elastic.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_scenario(path).reliability.min_regions == 2  # overlap composes with elastic regions
    with pytest.raises(ConfigError, match="overlap_start"):
        load_scenario(write(tmp_path / "start", small_corpus), {"geomesh.overlap_start": "eager"})
    for bad in (0, 17, 2.5, "many"):
        with pytest.raises(ConfigError, match="overlap_tail_fragments"):
            load_scenario(write(tmp_path / "tail", small_corpus), {"geomesh.overlap_tail_fragments": bad})
    from geomesh.api import GeoMeshSync

    with pytest.raises(ConfigError, match="plain rounds"):  # the library API for your own loop runs plain rounds
        GeoMeshSync(torch.nn.Linear(2, 2), method="geomesh-overlap", batch_size=2, inner_steps=2)


def test_a_checkpoint_waits_for_the_exchange_and_resumes_bit_identical(tmp_path, small_corpus, monkeypatch):
    """A checkpoint holds no exchange in flight: the round before it waits for its exchange (sent in fragments,
    as the last round's) and the next round starts from θ. A run interrupted after its checkpoint resumes to
    the very run (summary and events byte for byte) that was never interrupted."""
    from geomesh.runtime.emulated.overlap import EmulatedOverlap
    from test_reliability import assert_same_run

    path = write(tmp_path, small_corpus)
    tokens = 5 * 19360  # 5 rounds: checkpoints after rounds 2 and 4
    plain, _ = run(path, "geomesh-overlap", tmp_path / "plain", tokens=tokens)
    ref, _ = run(path, "geomesh-overlap", tmp_path / "ref", tokens=tokens, checkpoint_every=2)
    assert ref["rounds"] == plain["rounds"] == 5
    exchange = ref["exchange_s_per_round"]
    for name, totals in ref["per_worker"].items():  # drained after rounds 2 and 4, and the last round's
        tail = plain["per_worker"][name]["comm_wait"]  # what is left of the last exchange, in fragments
        assert 0 < tail < exchange
        # each of the three rounds whose exchange is waited for (the same plan) sends it in fragments
        assert totals["comm_wait"] == pytest.approx(3 * tail, rel=1e-6)

    original = EmulatedOverlap.spans

    def crash_in_round_4(self, run_, compute, exchange_s):
        if run_.rounds == 3:
            raise KeyboardInterrupt
        return original(self, run_, compute, exchange_s)

    monkeypatch.setattr(EmulatedOverlap, "spans", crash_in_round_4)
    with pytest.raises(KeyboardInterrupt):
        run(path, "geomesh-overlap", tmp_path / "cut", tokens=tokens, checkpoint_every=2)
    monkeypatch.undo()
    assert not (tmp_path / "cut" / "summary.json").exists()
    resumed = EmulatedRun(load_scenario(path), get_method("geomesh-overlap"),
                          RunOptions(out_dir=tmp_path / "cut", tokens=tokens, progress=False, resume=True,
                                     checkpoint_every=2, workers_parallel=1))  # fmt: skip
    assert resumed.resumed_from == 2
    resumed.run()
    assert_same_run(tmp_path / "cut", tmp_path / "ref")
