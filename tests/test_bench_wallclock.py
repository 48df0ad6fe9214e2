"""bench/wallclock.py: what it reads from a run's records (the clock and loss curve of region r0, every region's
spans, the interfaces' bytes), the figures across methods of a repeat, the spread over repeats and the table; bad
input is one line. And its smallest case end to end on the hosts test bed (marked ``waits``): torchft's DiLoCo
(:mod:`geomesh.integrations.torchft_diloco`) trains what our ``diloco`` trains, round for round (its losses are the
emulated ``diloco``'s at every round), and the bench writes its table, results and plot."""

from __future__ import annotations

import json

import pytest
from conftest import bench_script

from geomesh.testbed.netns import netns_unavailable_reason

bench = bench_script("wallclock")
NAMES = ["r0-h100", "r1-a100", "r2-t4"]


def events_of(times: list[float], losses: list[float], per_round_tokens: int, spans=()) -> list[dict]:
    out = [{"type": "run"}]
    for k, (t, loss) in enumerate(zip(times, losses), start=1):
        out.append({"type": "round", "round": k, "time": t, "tokens": k * per_round_tokens})
        out.append({"type": "eval", "round": k, "time": t + 0.01, "tokens": k * per_round_tokens, "val_loss": loss})
    return out + [{"type": "span", "worker": w, "kind": kind, "start": a, "end": b, "round": r}
                  for w, kind, a, b, r in spans]  # fmt: skip


def round_spans(worker: str, rounds: list[tuple[float, float, float]]) -> list[tuple]:
    """One worker's spans: (compute, straggler_wait, comm_wait) seconds per round, back to back (0-based rounds)."""
    out, t = [], 0.0
    for r, parts in enumerate(rounds):
        for kind, seconds in zip(("compute", "straggler_wait", "comm_wait"), parts):
            out.append((worker, kind, t, t + seconds, r))
            t += seconds
    return out


def test_a_run_is_read_on_the_clock_of_the_region_ready_last_with_every_regions_spans_and_the_interfaces():
    # every host records every region's spans (ours); the first round holds r0's and r1's wait for r2 to start
    spans = (round_spans("r0-h100", [(1, 9, 0), (1, 1, 0), (1, 1, 0)]) + round_spans("r1-a100", [(2, 8, 0),
             (2, 0, 0), (2, 0, 0)]) + round_spans("r2-t4", [(2, 0, 0), (1, 0, 1), (1, 0, 1)]))  # fmt: skip
    ours = {"r0-h100": events_of([10.0, 12.0, 14.0, 15.5], [9.0, 9.0, 9.0, 9.0], 100, spans),
            "r1-a100": events_of([10.0, 12.0, 14.0, 15.5], [9.0, 9.0, 9.0, 9.0], 100, spans),
            "r2-t4": events_of([2.0, 4.0, 6.5, 8.0], [5.0, 4.5, 4.2, 4.1], 100, spans)}  # fmt: skip
    summaries = {n: {"runtime": "distributed", "bytes_per_round": 3000, "stopped_by": "time_budget",
                     "exchange_s_per_round": 0.5} for n in NAMES}  # fmt: skip
    m = bench.run_metrics(ours, summaries, {n: 4000 for n in NAMES})
    assert m["clock_host"] == "r2-t4"  # (the others' clocks hold its start-up)
    assert (m["rounds"], m["tokens"], m["wall_s"], m["final_val_loss"]) == (4, 400, 8.0, 4.1)
    assert m["round_s"] == pytest.approx(2.25)  # gaps 2.0, 2.5 (the last, 1.5, left out)
    assert m["tokens_per_s"] == pytest.approx(50.0)
    assert m["straggler_idle"] == pytest.approx(2 / 12) and m["wan_idle"] == pytest.approx(2 / 12)  # rounds 2, 3
    assert m["straggler_idle_whole"] == pytest.approx(19 / 34) and m["wan_idle_whole"] == pytest.approx(2 / 34)
    assert m["wire_bytes_per_round"] == pytest.approx(3000.0) and m["runtime_bytes_per_round"] == 3000
    # torchft's hosts: each records its own region's spans and bytes
    own = {n: events_of([2.0, 4.0, 6.0], [5.0, 4.5, 4.2], 100, round_spans(n, [(2, 2 * k, 0)] * 3))
           for k, n in enumerate(NAMES)}  # fmt: skip
    peer = {n: {"runtime": "distributed (torchft)", "bytes_per_round": 1000} for n in NAMES}
    m = bench.run_metrics(own, peer, {"r0-h100": 1, "r1-a100": None, "r2-t4": 1})
    assert m["straggler_idle"] == pytest.approx(12 / 24) and m["wan_idle"] == 0.0
    assert m["runtime_bytes_per_round"] == 3000 and m["wire_bytes_per_round"] is None  # (a host's count missing)
    with pytest.raises(ValueError, match="no host recorded a round"):
        bench.run_metrics({"r0-h100": [{"type": "run"}]}, {}, {})


def run(curve: list[tuple[float, int, float]]) -> dict:
    return {"curve": curve, "tokens": curve[-1][1], "final_val_loss": curve[-1][2], "wall_s": curve[-1][0]}


def test_a_repeat_compares_at_diloco_s_final_loss_equal_time_and_equal_tokens():
    runs = {"diloco": run([(10, 100, 5.0), (20, 200, 4.0), (30, 300, 3.5)]),
            "geomesh": run([(8, 300, 4.2), (16, 600, 3.4), (24, 900, 3.0)])}  # fmt: skip
    got = bench.compare_repeat(runs)
    assert got["diloco"]["time_to_diloco_final_s"] == 30 and got["geomesh"]["time_to_diloco_final_s"] == 16
    assert got["geomesh"]["time_to_diloco_final_frac"] == pytest.approx(16 / 30)
    assert got["geomesh"]["time_to_torchft_final_s"] is None  # (no torchft-diloco in this repeat)
    peer = bench.compare_repeat({**runs, "torchft-diloco": run([(12, 100, 5.1), (25, 200, 4.2)])})
    assert peer["geomesh"]["time_to_torchft_final_s"] == 8 and peer["diloco"]["time_to_torchft_final_s"] == 20
    assert peer["geomesh"]["time_to_torchft_final_frac"] == pytest.approx(8 / 25)
    assert got["geomesh"]["equal_time_s"] == 24 and got["diloco"]["loss_at_equal_time"] == 4.0
    assert got["geomesh"]["loss_at_equal_time"] == 3.0
    assert got["geomesh"]["equal_tokens"] == 300 and got["geomesh"]["loss_at_equal_tokens"] == 4.2
    assert got["diloco"]["loss_at_equal_tokens"] == 3.5
    assert bench.loss_at_tokens([(0, 100, 5.0), (0, 300, 4.0)], 200) == pytest.approx(4.5)
    assert bench.loss_at_tokens([(0, 100, 5.0)], 50) is None
    assert "time_to_diloco_final_s" not in runs["diloco"]  # (a copy: the runs' own figures are kept)
    assert bench.compare_repeat({"geomesh": runs["geomesh"]})["geomesh"]["time_to_diloco_final_s"] is None


def test_the_table_shows_the_median_and_range_over_repeats_and_missing_runs():
    reps = [{"diloco": {"rounds": 10, "tokens_per_s": 100.0, "round_s": 2.0, "straggler_idle": 0.2},
             "torchft-diloco": {"rounds": 11, "tokens_per_s": 110.0, "round_s": 1.8}},
            {"diloco": {"rounds": 12, "tokens_per_s": 120.0, "round_s": 2.2, "straggler_idle": 0.1}},
            {"diloco": {"rounds": 11, "tokens_per_s": 90.0, "round_s": 2.1, "straggler_idle": None},
             "torchft-diloco": {"rounds": 11, "tokens_per_s": 100.0, "round_s": 2.0}}]  # fmt: skip
    agg = bench.aggregate(reps)
    assert agg["diloco"]["tokens_per_s"] == {"median": 100.0, "min": 90.0, "max": 120.0, "n": 3, "of": 3}
    assert agg["torchft-diloco"]["rounds"]["n"] == 2 and agg["torchft-diloco"]["rounds"]["of"] == 3
    table = bench.markdown_table(agg).splitlines()
    assert table[0].startswith("| method | rounds | tokens/s | wall s / round |") and len(table) == 4
    assert table[2].startswith("| diloco | 11 (10-12) | 100 (90-120) | 2.10 (2.00-2.20) |")
    assert "| 15.0% (10.0%-20.0%) [2/3] |" in table[2]
    assert table[3].startswith("| torchft-diloco | 11 [2/3] | 105 (100-110) [2/3] |")
    note = bench.overhead(agg)
    assert note.startswith("diloco vs torchft-diloco: wall s / round 2.1 vs 1.9 (1.105x); tokens/s 100 vs 105")


@pytest.mark.parametrize("args, line", [
    (["--methods", "diloco,ddp"], "error: --methods 'diloco,ddp': expected some of diloco, geomesh, geomesh-overlap, "
                                  "geomesh-sparse, torchft-diloco, geomesh-sparse-overlap, streaming-diloco, "
                                  "async-local-sgd"),
    (["--methods", "diloco,async-local-sgd"], "error: --methods async-local-sgd: runs under a token budget only; "
                                              "give --tokens N"),
    (["--cpu", "1,0.5"], "error: --cpu '1,0.5': expected 3 core counts, r0,r1,r2 (or none)"),
    (["--repeats", "0"], "error: --repeats >= 1, --time-budget > 0 seconds and --mbps > 0 expected"),
])  # fmt: skip
def test_bad_input_is_one_line(tmp_path, capsys, args, line):
    assert bench.main(["--out", str(tmp_path / "o"), *args]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]


REASON = netns_unavailable_reason()


@pytest.mark.waits
@pytest.mark.bed
@pytest.mark.skipif(REASON is not None, reason=f"the hosts test bed cannot run here: {REASON}")
def test_the_smallest_case_end_to_end_torchft_trains_what_our_diloco_trains(tmp_path, small_corpus):
    """torchft's DiLoCo on the bed, 2 rounds of the tiny model, through the bench: its losses at every round are
    our emulated ``diloco``'s on the bench's scenario (the same model, shards, optimizers and rounds)."""
    from geomesh.config import load_scenario
    from geomesh.methods import get_method
    from geomesh.runtime.emulated import EmulatedRun, RunOptions

    out = tmp_path / "bench"
    corpus = [a for f in small_corpus for a in ("--corpus", f)]
    code = bench.main(["--out", str(out), "--methods", "torchft-diloco", "--repeats", "1", "--tokens", "3840",
                       "--cpu", "none", "--preset", "nano", "--seq-len", "32", "--batch", "4", "--inner-steps", "5",
                       "--vocab", "512", "--mbps", "100", *corpus])  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert code == 0, results["runs"]
    got = results["repeats"][0]["torchft-diloco"]
    assert (got["rounds"], got["tokens"], got["stopped_by"]) == (2, 3840, "token_budget")
    assert (out / "loss_vs_wall.png").stat().st_size > 0
    assert (out / "table.md").read_text().startswith("| method |")
    summary = json.loads((out / "1" / "torchft-diloco" / "r2-t4" / "run" / "summary.json").read_text())
    assert summary["method"] == "torchft-diloco" and summary["torchft"]["sync_every"] == 5
    hosts = json.loads((out / "1" / "torchft-diloco" / "hosts.json").read_text())
    assert len(set(hosts["param_checksums"].values())) == 1 and sorted(hosts["param_checksums"]) == NAMES
    ours = EmulatedRun(load_scenario(str(out / "scenario.yaml")), get_method("diloco"),
                       RunOptions(out_dir=tmp_path / "emulated", progress=False, workers_parallel=1)).run()  # fmt: skip
    by_tokens = {n: loss for _, n, loss in ours["curve"]}
    assert [n for _, n, _ in got["curve"]] == [1920, 3840]
    for _, n, loss in got["curve"]:
        assert loss == pytest.approx(by_tokens[n], abs=1e-4)


def test_the_timing_models_round_time_is_the_plan_from_the_profiles_measured_on_the_bed(tmp_path):
    import yaml

    from geomesh.config import load_scenario
    from geomesh.methods import get_method

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(bench.scenario("micro", 64, 8, 10, 10.0, 0.003, None, 4096, 240.0, 10**12)))
    sc = load_scenario(str(path))
    assert sc.timing().params == pytest.approx(1.33e6, rel=0.05)  # (the model that trains)
    profiles = {p.name: p.to_json() for p in sc.worker_profiles()}
    diloco = get_method("diloco")
    payload = diloco.modeled_payload_bytes(sc)
    want = diloco.plan(sc, sc.worker_profiles(), exchange_bytes=payload,
                       exchange_s=diloco.exchange(sc.wan_model(), payload)[0]).round_s  # fmt: skip
    assert bench.predicted_round_s(sc, "diloco", profiles) == pytest.approx(want)
    assert bench.predicted_round_s(sc, "torchft-diloco", profiles) == pytest.approx(want)
    assert bench.predicted_round_s(sc, "async-local-sgd", profiles) is None  # (its arrivals are no plan's rounds)
    runs = {"diloco": {**run([(10, 100, 5.0)]), "round_s": 2 * want},
            "geomesh": {**run([(8, 300, 4.2)]), "calibrated_profiles": profiles, "round_s": 1.0}}  # fmt: skip
    got = bench.compare_repeat(runs, lambda m, prof: bench.predicted_round_s(sc, m, prof))
    assert got["diloco"]["predicted_round_s"] == pytest.approx(want)
    assert got["diloco"]["round_s_over_predicted"] == pytest.approx(2.0)


def test_the_table_is_made_again_from_the_run_folders(tmp_path, capsys):
    """``--report``: no runs; every run's figures read again from its bed folder, a failed run said in one line."""
    import yaml

    out = tmp_path / "o"
    data = bench.scenario("nano", 32, 4, 5, 100.0, 0.003, None, 512, None, 3840)
    out.mkdir()
    (out / "scenario.yaml").write_text(yaml.safe_dump(data))
    runs = []
    for method, ok in (("diloco", True), ("torchft-diloco", False)):
        folder = out / "1" / method
        hosts = {}
        for k, name in enumerate(NAMES):
            run_dir = folder / name / "run"
            run_dir.mkdir(parents=True)
            spans = round_spans(name, [(1, 0, 1), (1, 0, 1)])
            lines = events_of([2.0 + k, 4.0 + k], [5.0, 4.0], 100, spans)
            (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
            (run_dir / "summary.json").write_text(json.dumps({"runtime": "distributed", "bytes_per_round": 10}))
            hosts[name] = {"folder": str(folder / name), "exit": 0, "tx_bytes": 30}
        (folder / "hosts.json").write_text(json.dumps({"hosts": hosts, "finished": True}))
        runs.append({"repeat": 1, "method": method, "ok": ok, "error": None if ok else "the bed run failed",
                     "folder": str(folder)})  # fmt: skip
    (out / "results.json").write_text(json.dumps({"args": {"out": str(out)}, "scenario": data, "runs": runs}))
    assert bench.main(["--out", str(out), "--report"]) == 1  # (a run failed)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: repeat 1 torchft-diloco: the bed run failed (its folder: {out / '1' / 'torchft-diloco'})"]
    table = (out / "table.md").read_text().splitlines()
    assert len(table) == 3 and table[2].startswith("| diloco | 2 | 50 | ")  # 200 tokens in 4 s on r0's clock
    assert (out / "loss_vs_wall.png").exists()
    saved = json.loads((out / "results.json").read_text())
    assert saved["repeats"][0]["diloco"]["clock_host"] == "r0-h100" and saved["runs"][1]["ok"] is False
