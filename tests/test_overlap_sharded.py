"""The sharded exchange under overlapped rounds (docs/overlap.md, planner/exchange.py): the plan times each
exchange by what the next round's compute does not hide, so where both are hidden it takes the one with fewer
bytes (geomesh-sparse on `default`: the re-sparsified sharded exchange, 129x below DiLoCo per round); both
runtimes run it (static ranks: on the leader's thread over a group of their own; elastic: the quorum's).

Real 4-leader `geomesh launch` runs of geomesh-sparse with overlap: kept exact (float32 combined shards) the
sharded exchange is the all-gather bit for bit; a damaged sparse slice drops only its sender; re-sparsified, θ
is the emulated runtime's; and the method as users run it (calibration, re-planning, the WAN measured) ends
with one θ on every region, static and elastic."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import QUICK_CALIBRATION
from test_sharded_sparse_distributed import TOKENS, _launch

from geomesh.network import WanModel
from geomesh.planner.exchange import ShardedSizes, choose_exchange

CORRUPT = [{"at_round": 2, "region": "r2-t4", "kind": "corrupt"}]  # r2-t4's payload damaged on the wire
SPARSE = ShardedSizes(slices_body=10e6, slice_header=48, combined_body=10e6, combined_header=48, kind="sparse")


def uniform(n: int, rtt_s: float = 0.1, bytes_per_s: float = 1.25e8) -> WanModel:
    return WanModel(tuple(tuple(0.0 if i == j else rtt_s for j in range(n)) for i in range(n)),
                    tuple(tuple(bytes_per_s for _ in range(n)) for _ in range(n)))  # fmt: skip


def test_overlapped_exchanges_are_timed_by_what_the_round_does_not_hide():
    wan = uniform(4)
    plain = choose_exchange(wan, "all_gather", 10e6, SPARSE)
    assert plain.name == "all_gather"  # plain rounds: two re-sparsified exchanges cost more than one all-gather
    hidden = choose_exchange(wan, "all_gather", 10e6, SPARSE, overlap=True, hidden_s=30.0)
    assert hidden.name == "sharded" and "fewer bytes" in hidden.reason and "does not hide" in hidden.reason
    assert hidden.cost.received_bytes < hidden.candidates["all_gather"].received_bytes
    # a round too short to hide either: what is left of each is compared, as plain rounds compare them whole
    exposed = choose_exchange(wan, "all_gather", 10e6, SPARSE, overlap=True, hidden_s=0.0)
    assert exposed.name == plain.name
    # a round that hides the all-gather but not the sharded exchange's half rounds keeps the all-gather
    ag, sh = plain.candidates["all_gather"].seconds, plain.candidates["sharded"].seconds
    between = choose_exchange(wan, "all_gather", 10e6, SPARSE, overlap=True, hidden_s=max(ag, sh) * 1.5)
    assert between.name == "all_gather"


def test_the_plan_puts_overlapped_geomesh_sparse_on_the_sharded_exchange(capsys):
    from geomesh.cli import main
    from geomesh.cli.plan import cluster_exchanges
    from geomesh.config import load_scenario
    from geomesh.methods import get_method

    plain, over = (cluster_exchanges(load_scenario("default", {"geomesh.overlap": o})) for o in (False, True))
    assert plain["geomesh-sparse"].name == "all_gather" and over["geomesh-sparse"].name == "sharded"
    assert over["geomesh"].name == "all_gather"  # 1-bit payloads at 4 regions: the all-gather moves fewer bytes
    sc = load_scenario("default", {"geomesh.overlap": True})
    assert get_method("geomesh-sparse").resparsified(sc)  # so its rounds carry a quarter of the sequences
    diloco = get_method("diloco").exchange(sc.wan_model(), get_method("diloco").modeled_payload_bytes(sc))[1]
    assert diloco / over["geomesh-sparse"].cost.sent_bytes >= 128
    assert main(["plan", "default"]) == 0  # geomesh plan says so, and why
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("geomesh-sparse-overlap's exchange"))
    assert "sharded exchange (as fast as the all-gather" in line and "does not hide" in line


# ---- real `geomesh launch` runs, 4 leaders ---------------------------------------------------------------------


# every exchange shorter than the round that hides it: the all-gather's plan and schedule, whichever exchange
FAST_WAN = {"rtt": [[0 if i == j else 10 for j in range(4)] for i in range(4)], "bandwidth_gbps": 400.0}


def _scenario(folder, corpus, geomesh, faults=None, wan=None):
    from test_sharded_sparse_distributed import _scenario as sparse_scenario

    return sparse_scenario(folder, corpus, {"overlap": True, **geomesh}, faults, wan)


@pytest.fixture(scope="module")
def overlapped_runs(tmp_path_factory, small_corpus):
    """geomesh-sparse overlapped, the same scenario twice: the all-gather, and the sharded exchange kept exact
    (32 bits); in both, region r2-t4's payload is damaged on the wire in its third round."""
    folder = tmp_path_factory.mktemp("overlap-sharded")
    runs = {}
    for name, geomesh in (("all_gather", {"exchange": "all_gather"}),
                          ("sharded", {"exchange": "sharded", "shard_bits": 32})):  # fmt: skip
        out = folder / name
        path = _scenario(folder / f"{name}-scenario", small_corpus, geomesh, CORRUPT, FAST_WAN)
        runs[name] = (_launch(path, out), out)
    return runs


@pytest.mark.long
def test_exact_overlapped_sharded_launch_equals_the_all_gather_bit_for_bit(overlapped_runs):
    from test_sharded_distributed import assert_same_run

    (ag, _), (sh, _) = overlapped_runs["all_gather"], overlapped_runs["sharded"]
    assert ag["overlap"] is sh["overlap"] is True
    assert ag["exchange"] == "all_gather" and sh["exchange"] == "sharded"
    assert_same_run(overlapped_runs)
    assert sh["tokens_lost"] == ag["tokens_lost"]


def test_a_damaged_sparse_slice_drops_only_its_sender_while_overlapped(overlapped_runs):
    """r2-t4's damaged payload goes out as damaged slices while the next round trains: their owners refuse
    them, every region drops its update of that round (one warning naming it) and applies the others'."""
    from geomesh.telemetry import read_events

    (ag, _), (sh, sh_out) = overlapped_runs["all_gather"], overlapped_runs["sharded"]
    assert sh["rejected_payloads"] == ag["rejected_payloads"] == 1
    warned = [e for e in read_events(sh_out / "events.jsonl") if e["type"] == "warning"]
    assert [w["worker"] for w in warned] == ["r2-t4"]
    assert "payload rejected" in warned[0]["message"] and "slice of shard" in warned[0]["message"]


def test_re_sparsified_overlapped_launch_equals_emulated_and_resumes_bit_identical(tmp_path, small_corpus):
    """Re-sparsified combined shards (the owners' error feedback) under overlap, a checkpoint every 2 rounds
    (the exchange before it drained: the leader's thread joined): the emulated runtime replays the same schedule
    and exchange in one process, so θ is the emulated runtime's, to float tolerance; and a run whose rank exits
    after round 3 resumes from round 2's checkpoint (the owners' residuals in it) to the same θ bit for bit."""
    from geomesh.config import load_scenario
    from geomesh.methods import get_method
    from geomesh.runtime.emulated import EmulatedRun, RunOptions

    path = _scenario(tmp_path / "s", small_corpus, {"exchange": "sharded"})
    common = ("--wan", "none", "--checkpoint-every", "2")
    s = _launch(path, tmp_path / "ref", *common)
    assert s["exchange"] == "sharded" and s["shard_bits"] == 8 and s["overlap"] is True and s["rounds"] >= 4
    emulated = EmulatedRun(load_scenario(path), get_method("geomesh-sparse"),
                           RunOptions(out_dir=tmp_path / "emulated", tokens=TOKENS, progress=False,
                                      checkpoint_every=2))  # fmt: skip
    e = emulated.run()
    assert e["exchange"] == "sharded" and e["rounds"] == s["rounds"] and e["tokens"] == s["tokens"]
    assert s["final_val_loss"] == pytest.approx(e["final_val_loss"], rel=1e-5)
    expected, got = emulated.cluster.global_model.state_dict(), torch.load(tmp_path / "ref" / "final_params.pt")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
    cut = _launch(path, tmp_path / "run", *common, env={"GEOMESH_TEST_EXIT_AFTER_ROUND": "1:3"}, ok=False)
    assert cut.code != 0 and not (tmp_path / "run" / "summary.json").exists()
    resumed = _launch(path, tmp_path / "run", *common, "--resume")
    assert resumed["rounds"] == s["rounds"] and resumed["final_val_loss"] == s["final_val_loss"]
    resumed_params = torch.load(tmp_path / "run" / "final_params.pt")
    assert all(torch.equal(got[name], resumed_params[name]) for name in got)


@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_overlapped_sharded_launch_as_users_run_it(tmp_path, small_corpus, elastic):
    """geomesh-sparse overlapped through the sharded exchange with calibration, re-planning and the WAN measured
    (the plan loop users run), static (its first region of two ranks, whose leader shares the update and the
    exchange's decisions with the other) and with elastic regions; r2-t4's payload is damaged in round 3:
    every round recorded, one warning, naming r2-t4, and one θ on every rank."""
    import yaml

    path = _scenario(tmp_path / "s", small_corpus, {"exchange": "sharded", "replan": True, "calibrate": True,
                                                    "measure_wan": True}, CORRUPT)  # fmt: skip
    extra = ("--min-regions", "3") if elastic else ("--nproc", "5")
    if not elastic:
        data = yaml.safe_load(path.read_text())
        data["regions"][0]["count"] = 2
        path.write_text(yaml.safe_dump(data))
    s = _launch(path, tmp_path / "run", *extra, tokens=2 * TOKENS)
    assert s["exchange"] == "sharded" and s["overlap"] is True and s["rounds"] >= 3
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e.get("type") == "round"]
    assert [e["round"] for e in rounds] == list(range(1, s["rounds"] + 1))
    warned = [e for e in events if e.get("type") == "warning"]
    assert [w["worker"] for w in warned] == ["r2-t4"] and "slice of shard" in warned[0]["message"]
    (calibration,) = [e for e in events if e.get("type") == "calibration"]  # in the scenario's short windows
    assert {(p["extra"]["window_s"], p["extra"]["budget_s"]) for p in calibration["profiles"].values()} == {
        (QUICK_CALIBRATION["calibration_window_s"], QUICK_CALIBRATION["calibration_budget_s"])}  # fmt: skip
    checksums = s["param_checksums"]  # per rank (static runs) or per region (elastic ones)
    assert len(checksums) == (4 if elastic else 5)
    assert len(set(checksums.values() if isinstance(checksums, dict) else checksums)) == 1


@pytest.mark.parametrize("exchange", ["sharded", "all_gather"])
def test_an_overlapped_region_with_another_key_stands_aside(tmp_path, small_corpus, exchange):
    """A signed static run, r3-v100 started with another run key (a mis-deployed region), overlapped: the others
    refuse its payloads (sharded: its slices and its combined shard) every round, each warning naming it, and
    finish with one θ; it refuses most of theirs, so its refusals do not count (no veto), it applies nothing from
    then on and ends with one error naming the key (overlapped all-gathers had no such rule: the run stopped with
    "the regions hold different global parameters")."""
    import yaml
    from conftest import ranks_with_keys

    from geomesh.telemetry import read_events

    path = _scenario(tmp_path / "s", small_corpus, {"exchange": exchange})
    data = yaml.safe_load(path.read_text())
    data["reliability"] = {"hmac_key_env": "GEOMESH_TEST_RUN_KEY"}
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    good, wrong = "the-run-key-of-32-bytes-for-tests", "a-wrong-key-of-32-bytes-for-tests"
    codes, errs = ranks_with_keys(path, out, "geomesh-sparse", TOKENS, [good, good, good, wrong])
    assert codes == [0, 0, 0, 2], errs
    odd = [ln for ln in errs[3].splitlines() if ln.startswith("error:")]
    assert len(odd) == 1 and "r3-v100" in odd[0] and "another run key" in odd[0], errs[3]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exchange"] == exchange and summary["overlap"] is True and summary["rounds"] >= 3
    warned = [e for e in read_events(out / "events.jsonl") if e["type"] == "warning"]
    assert warned and all(w["worker"] == "r3-v100" for w in warned)
    checksums = summary["param_checksums"]
    assert checksums[0] == checksums[1] == checksums[2] != checksums[3]
