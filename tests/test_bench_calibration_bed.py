"""Quotas set on running hosts (``geomesh hosts --cpu REGION:CORES@[run+]SECONDS``: a container's limit, a
neighbour's load, a burst that ends) and bench/calibration_bed.py's reading of a run's records.

The bed: a host with later quotas runs in its group without a limit (or at its quota from the start) and each
change is set on its running processes when due, after the host's start or after its run folder appeared; the
changes are logged with their times, and a bad ``--cpu`` is one line. Needs root, iproute2 and the cgroup cpu
controller: skipped with the reason elsewhere. The bench's reading (the plan in force per round, the misses,
the idle) is pure: tested on records written here."""

from __future__ import annotations

import json
import math
import sys
import time

import pytest
import yaml
from conftest import bench_script, tiny_scenario_dict

from geomesh.network import WanModel
from geomesh.testbed.hosts import CpuChange, HostsBed
from geomesh.testbed.netns import namespace_pids, netns_unavailable_reason
from geomesh.testbed.quotas import quota_unavailable_reason

REASON = netns_unavailable_reason() or quota_unavailable_reason()
NAMES = ["r0-h100", "r1-a100", "r2-t4"]
# a host that starts its "run" (its run folder) 1.5 s after it starts, then sleeps
RUN_LATER = [sys.executable, "-c", "import os, time; time.sleep(1.5); os.mkdir('run'); time.sleep(60)"]


def members(group) -> set[int]:
    return set(map(int, (group / "cgroup.procs").read_text().split()))


@pytest.mark.skipif(REASON is not None, reason=f"CPU quotas on the hosts test bed cannot be set here: {REASON}")
def test_quotas_set_on_running_hosts_after_their_start_and_after_their_run_began(tmp_path):
    n = len(NAMES)
    wan = WanModel(tuple((0.001,) * n for _ in range(n)), tuple((1.25e8,) * n for _ in range(n)))
    later = [CpuChange(0, 0.5, 0.5), CpuChange(2, 0.3, 0.5, "run"), CpuChange(2, 0.2, 1.0, "run")]
    bed = HostsBed(wan, NAMES, tmp_path, cpu={2: 1.0}, cpu_later=later)
    with bed:
        quotas, groups = bed.quotas, dict(bed.quotas.groups)
        assert sorted(groups) == ["r0-h100", "r2-t4"]  # r1: no quota, now or later
        assert quotas.quota("r0-h100") == math.inf and quotas.quota("r2-t4") == pytest.approx(1.0)
        hosts = [bed.add_host(i, 1, [], {}) for i in range(n)]
        for h in hosts:
            h.argv = RUN_LATER
            h.start()
        assert hosts[1].cgroup is None and hosts[0].cgroup is not None
        bed.start_cpu_schedule(poll_s=0.02)
        time.sleep(0.2)  # the processes run in their groups before any quota is set
        assert quotas.quota("r0-h100") == math.inf
        assert namespace_pids(bed.ns(1)) and namespace_pids(bed.ns(3)) <= members(groups["r2-t4"])
        deadline = time.monotonic() + 10
        while len(bed.cpu_log) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        log = {(c["region"], c["cores"]): c for c in bed.cpu_log}
        assert sorted(log) == [("r0-h100", 0.5), ("r2-t4", 0.2), ("r2-t4", 0.3)], bed.cpu_log
        assert 0.5 <= log["r0-h100", 0.5]["time_s"] < 1.4  # after the host's start
        assert 0.5 <= log["r2-t4", 0.3]["after_anchor_s"] < 0.9 and 1.0 <= log["r2-t4", 0.2]["after_anchor_s"] < 1.4
        assert log["r2-t4", 0.3]["time_s"] >= 1.5 + 0.5  # (its run began 1.5 s after its start)
        assert quotas.quota("r0-h100") == pytest.approx(0.5) and quotas.quota("r2-t4") == pytest.approx(0.2)
        assert namespace_pids(bed.ns(1)) <= members(groups["r0-h100"])
    assert not any(g.exists() for g in groups.values())


@pytest.mark.parametrize("cpu, line", [
    (["r1-a100:0.5@soon"], "error: --cpu 'r1-a100:0.5@soon': expected REGION:CORES@SECONDS or "
                           "REGION:CORES@run+SECONDS (seconds after the host started, or after its run began)"),
    (["r1-a100:0.5@run+-1"], "error: --cpu 'r1-a100:0.5@run+-1': expected REGION:CORES@SECONDS or "
                             "REGION:CORES@run+SECONDS (seconds after the host started, or after its run began)"),
    (["r1-a100:0.5", "r1-a100:0.3"], "error: --cpu 'r1-a100:0.3': r1-a100 has a quota from the start already "
                                     "(later ones: REGION:CORES@SECONDS)"),
    (["nowhere:0.5@3"], "error: --cpu 'nowhere:0.5@3': no region 'nowhere' (the scenario's: r0-h100, r1-a100, "
                        "r2-t4)"),
])  # fmt: skip
def test_a_bad_later_quota_is_one_line(tmp_path, small_corpus, capsys, cpu, line):
    from geomesh.cli import main

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tiny_scenario_dict(small_corpus)))
    code = main(["hosts", str(path), "--method", "geomesh", "--out", str(tmp_path / "o"),
                 *[x for c in cpu for x in ("--cpu", c)]])  # fmt: skip
    assert code == 2 and capsys.readouterr().err.strip().splitlines() == [line]
    assert not (tmp_path / "o").exists()  # refused before anything started


@pytest.mark.skipif(netns_unavailable_reason() is not None, reason=f"no network namespaces here: "
                    f"{netns_unavailable_reason()}")  # fmt: skip
def test_links_as_token_buckets_of_a_given_burst_keep_it_when_their_rate_changes(tmp_path):
    from geomesh.testbed.netns import tc

    n = len(NAMES)
    wan = WanModel(tuple((0.001,) * n for _ in range(n)), tuple((1.25e5,) * n for _ in range(n)))  # 1 Mbit/s
    with HostsBed(wan, NAMES, tmp_path, link_burst=65536) as bed:
        shown = tc(bed.ns(1), "class", "show", "dev", "eth0").stdout
        assert shown.count("rate 1Mbit ceil 1Mbit burst 64Kb cburst 64Kb") == 2, shown
        bed.set_bandwidth(0, 0.01)
        shown = tc(bed.ns(1), "class", "show", "dev", "eth0").stdout
        assert shown.count("rate 10Kbit ceil 10Kbit burst 64Kb cburst 64Kb") == 2, shown
    with HostsBed(wan, NAMES, tmp_path) as bed:  # the default: htb's 15k burst, its ceil's bucket a packet
        shown = tc(bed.ns(1), "class", "show", "dev", "eth0").stdout
        assert shown.count("burst 15Kb cburst 1600b") == 2, shown


# ---- bench/calibration_bed.py's reading of a run (pure) ----------------------------------------------------------
def plan(compute: dict[str, float], exchange_s: float = 0.5) -> dict:
    return {"workers": [{"name": n, "batch": 8, "inner_steps": 10, "compute_s": c} for n, c in compute.items()],
            "exchange_s": exchange_s}  # fmt: skip


def round_record(number: int, compute: list[float], overhead: list[float], time_s: float) -> dict:
    return {"type": "round", "round": number, "time": time_s, "tokens": 1000 * number, "members": NAMES,
            "compute_s": compute, "overhead_s": overhead, "straggler_idle_frac": 0.0, "exchange_s": 0.6}  # fmt: skip


def spans(number: int, work: dict[str, float], wait: dict[str, float]) -> list[dict]:
    out = []
    for n in NAMES:
        out.append({"type": "span", "worker": n, "kind": "compute", "start": 0.0, "end": work[n], "round": number})
        out.append({"type": "span", "worker": n, "kind": "straggler_wait", "start": work[n], "end": work[n] + wait[n],
                    "round": number})  # fmt: skip
        out.append({"type": "span", "worker": n, "kind": "comm_wait", "start": 0.0, "end": 0.5, "round": number})
    return out


RECORDS = [
    {"type": "calibration", "time": 0.1, "seconds": {"r0-h100": 3.0, "r1-a100": 4.0, "r2-t4": 5.0}},
    {"type": "wan_probe", "time": 1.0, "wan_measured": {"latency_factor": 1.2, "transfer_factor": 80.0}},
    {"type": "plan", "round": 0, "time": 1.1, "plan": plan({"r0-h100": 4.0, "r1-a100": 4.0, "r2-t4": 4.0})},
    round_record(1, [4.0, 4.4, 8.0], [1.0, 1.0, 1.0], 10.0),  # r2: a burst that ended (2x its plan)
    {"type": "plan", "round": 1, "time": 10.1, "replan": True, "reason": "compute measured against planned",
     "plan": plan({"r0-h100": 5.0, "r1-a100": 5.0, "r2-t4": 5.0})},  # a proposal: not what round 2 trains
    {"type": "plan", "round": 1, "time": 10.2, "plan": plan({"r0-h100": 5.0, "r1-a100": 5.0, "r2-t4": 5.5})},
    round_record(2, [5.0, 5.0, 5.5], [0.5, 0.5, 0.0], 16.0),
    round_record(3, [5.0, 4.0, 8.8], [0.5, 0.5, 0.0], 25.0),  # no header of its own: round 2's plan, r2 1.6x
    {"type": "eval", "time": 25.1, "tokens": 3000, "round": 3, "val_loss": 5.5},
]  # fmt: skip


def test_the_bench_reads_each_round_against_the_plan_it_trained():
    bench = bench_script("calibration_bed")
    assert {r: p["workers"][2]["compute_s"] for r, p in bench.trained_plans(RECORDS).items()} == {1: 4.0, 2: 5.5,
                                                                                                   3: 5.5}
    rows = bench.round_rows(RECORDS)
    assert [r["ratio"][2] for r in rows] == pytest.approx([2.0, 1.0, 1.6])
    assert rows[0]["idle_compute_parts"] == pytest.approx((4.0 + 3.6, 3 * 8.0))  # compute alone
    assert rows[1]["idle_parts"] == pytest.approx((0.0, 3 * 5.5))  # work: compute and round overhead


def test_the_bench_figures_and_checks_of_a_run(tmp_path):
    bench = bench_script("calibration_bed")
    hosts = {}
    for n in NAMES:  # every host recorded the same rounds; r2 ready last (its first round ends first on its clock)
        run = tmp_path / n / "run"
        run.mkdir(parents=True)
        shift = 0.0 if n == "r2-t4" else 2.0
        events = [dict(e, time=e["time"] + shift) for e in RECORDS]
        events += spans(1, dict(zip(NAMES, (5.0, 5.4, 9.0))), dict(zip(NAMES, (4.0, 3.6, 0.0))))
        events += spans(2, dict(zip(NAMES, (5.5, 5.5, 5.5))), dict(zip(NAMES, (0.0, 0.0, 0.0))))
        events += spans(3, dict(zip(NAMES, (5.5, 4.5, 8.8))), dict(zip(NAMES, (3.3, 4.3, 0.0))))
        (run / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
        (run / "summary.json").write_text(json.dumps({"wan_measured": {"transfer_factor": 95.0}}))
        hosts[n] = {"folder": str(tmp_path / n), "exit": 0, "tx_bytes": 1}
    (tmp_path / "hosts.json").write_text(json.dumps({"hosts": hosts, "finished": True, "cpu_changes": []}))
    f = bench.run_figures(tmp_path, truth_factor=100.0)
    assert f["clock_host"] == "r2-t4" and f["rounds"] == 3 and f["final_val_loss"] == 5.5
    assert f["round1_miss"]["r2-t4"] == pytest.approx(2.0) and f["round1_idle_compute"] == pytest.approx(7.6 / 24)
    assert f["max_miss_2on"]["round"] == 3 and f["max_miss_2on"]["region"] == "r2-t4"
    assert f["max_miss_2on"]["miss"] == pytest.approx(1.6)
    # rounds 2 and 3, time-weighted: work (compute and overhead) 5.5 each, then 5.5, 4.5 and 8.8
    assert f["idle_2on"] == pytest.approx((0 + (8.8 - 5.5) + (8.8 - 4.5)) / (3 * 5.5 + 3 * 8.8))
    assert f["probe_over_truth"] == pytest.approx(0.8) and f["replans"] == [(1, "compute measured against planned")]
    assert f["calibration_s"] == {"r0-h100": 3.0, "r1-a100": 4.0, "r2-t4": 5.0}
    checks = bench.checks(f, token_bucket=True)
    assert checks["no round after the first misses by > 1.5x"] is False
    assert checks["probe transfer factor within 2x of the truth"] is True
    assert checks["rounds 2 on straggler idle <= 3% (records)"] is False
    rows = [{"repeat": 1, "spread": "0.9,0.45,0.3", "figures": f}, {"repeat": 2, "spread": "0.9,0.45,0.3",
                                                                       "figures": None, "error": "exit 1"}]
    table = bench.run_table(rows, True)
    assert "1.60x (round 3, r2-t4: 8.80 / 5.50)" in table and "failed: exit 1" in table
    assert "| 0.9,0.45,0.3 | 1/2 |" in bench.spread_table(rows, True)


def test_a_spread_is_each_regions_quotas_set_on_its_running_host():
    bench = bench_script("calibration_bed")
    spread = bench.parse_spread("0.45,0.3,0.9>0.3@run+10")
    assert bench.cpu_args(spread, "run+0") == ["--cpu", "r0-h100:0.45@run+0", "--cpu", "r1-a100:0.3@run+0",
                                               "--cpu", "r2-t4:0.9@run+0", "--cpu", "r2-t4:0.3@run+10"]  # fmt: skip
    assert bench.cpu_args(bench.parse_spread("0.5,0.5,0.9@0>0.3@10"), "run+0")[-4:] == [
        "--cpu", "r2-t4:0.9@0", "--cpu", "r2-t4:0.3@10"]  # fmt: skip
    for bad in ("0.5,0.5", "0.5,0.5,0.01", "0.5,0.5,0.9>0.3", "0.5,0.5,0.9@run+x", "0.5,0.5,0.9>0.3@soon"):
        with pytest.raises(bench.BenchError):
            bench.parse_spread(bad)


def test_what_the_rounds_scatter_alone_costs_is_measured_against_each_regions_median_under_one_plan():
    bench = bench_script("calibration_bed")
    same = [("r0-h100", 8, 10), ("r1-a100", 8, 10)]

    def row(number, work, plan=same):
        return {"round": number, "members": NAMES[:2], "compute_s": work, "overhead_s": [0.0, 0.0], "plan": plan}

    # round 1 left out; rounds 2-4 under one plan, r1 always 2x r0 (a biased plan: no scatter), round 5 another
    rows = [row(1, [1.0, 9.0]), row(2, [1.0, 2.0]), row(3, [1.1, 2.2]), row(4, [0.9, 1.8]),
            row(5, [3.0, 1.0], [("r0-h100", 4, 10), ("r1-a100", 8, 10)])]  # fmt: skip
    floor, sigma = bench.scatter_floor(rows)
    assert floor == pytest.approx(0.0) and sigma == pytest.approx(1.4826 * math.log(1.1))
    rows[2:4] = [row(3, [1.1, 2.0]), row(4, [0.9, 2.0])]  # r0 scatters 10% either way around its median, r1 not
    assert bench.scatter_floor(rows)[0] == pytest.approx((0 + (1 - 1 / 1.1) / 2 + (1 - 0.9) / 2) / 3)
    assert bench.scatter_floor(rows[:3]) == (None, None)


def test_what_the_plans_own_error_costs_is_each_regions_median_work_under_the_plan():
    bench = bench_script("calibration_bed")
    same, other = [("r0-h100", 8, 10), ("r1-a100", 8, 10)], [("r0-h100", 4, 10), ("r1-a100", 8, 10)]

    def row(number, work, plan=same):
        return {"round": number, "members": NAMES[:2], "compute_s": work, "overhead_s": [0.0, 0.0], "plan": plan}

    # rounds 2-4: r0's median 1.0 against r1's 2.0 (half of r1's time idle for r0: 25% of the two); 5-7 balanced
    rows = [row(1, [1.0, 9.0]), row(2, [1.0, 2.0]), row(3, [1.1, 2.2]), row(4, [0.9, 1.8]),
            row(5, [2.0, 2.1], other), row(6, [2.0, 1.9], other), row(7, [2.0, 2.0], other),
            row(8, [5.0, 1.0], other[:1])]  # (a plan of one round: its rounds' scatter and bias are not apart)
    assert bench.plan_bias(rows) == pytest.approx((3 * 0.25 + 3 * 0.0) / 6)
    assert bench.plan_bias(rows[:3]) is None
