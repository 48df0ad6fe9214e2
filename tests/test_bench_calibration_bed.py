"""Quotas set on running hosts (``geomesh hosts --cpu REGION:CORES@[run+]SECONDS``: a container's limit, a
neighbour's load, a burst that ends) and bench/calibration_bed.py's reading of a run's records.

The bed: a host with later quotas runs in its group without a limit (or at its quota from the start) and each
change is set on its running processes when due, after the host's start or after its run folder appeared; the
changes are logged with their times, and a bad ``--cpu`` is one line. Needs root, iproute2 and the cgroup cpu
controller: skipped with the reason elsewhere. The bench's reading (the plan in force per round, the misses,
the idle) is pure: tested on records written here."""

from __future__ import annotations

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
