"""CPU quotas per host on the hosts test bed (``geomesh hosts ... --cpu REGION:CORES``): every process of a host,
its children and a restarted host's too, runs in the host's control group with the quota asked for, and the
groups are gone when the bed closes; a bad ``--cpu`` is one line. Needs root, iproute2 and the cgroup cpu
controller: skipped with the reason elsewhere."""

from __future__ import annotations

import sys
import time

import pytest
import yaml
from conftest import tiny_scenario_dict

from geomesh.network import WanModel
from geomesh.testbed.hosts import HostsBed
from geomesh.testbed.netns import namespace_pids
from geomesh.testbed.quotas import quota_unavailable_reason
from geomesh.testbed.netns import netns_unavailable_reason

REASON = netns_unavailable_reason() or quota_unavailable_reason()
NAMES = ["r0-h100", "r1-a100", "r2-t4"]
# a host whose command starts a child: both must be in the group
PARENT_AND_CHILD = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                    "'import time; time.sleep(60)']); time.sleep(60)"]  # fmt: skip


def host_pids(bed: HostsBed, region: int, count: int) -> set[int]:
    for _ in range(200):  # (the child is started by the parent)
        pids = namespace_pids(bed.ns(region + 1))
        if len(pids) >= count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"host {region}: {namespace_pids(bed.ns(region + 1))}")


@pytest.mark.skipif(REASON is not None, reason=f"CPU quotas on the hosts test bed cannot be set here: {REASON}")
def test_every_process_of_a_host_runs_in_its_cpu_quota_restarted_too(tmp_path):
    n = len(NAMES)
    wan = WanModel(tuple((0.001,) * n for _ in range(n)), tuple((1.25e8,) * n for _ in range(n)))
    bed = HostsBed(wan, NAMES, tmp_path, cpu={0: 1.0, 2: 0.3})
    with bed:
        groups = dict(bed.quotas.groups)
        assert sorted(groups) == ["r0-h100", "r2-t4"]  # r1: no quota asked
        assert bed.quotas.quota("r0-h100") == pytest.approx(1.0) and bed.quotas.quota("r2-t4") == pytest.approx(0.3)
        assert bed.quotas.weight == HostsBed.CPU_WEIGHT > 1  # (it gets its quota on a busy machine)
        hosts = [bed.add_host(i, 1, [], {}) for i in range(len(NAMES))]
        for h in hosts:
            h.argv = PARENT_AND_CHILD
            h.start()
        for i, name in ((0, "r0-h100"), (2, "r2-t4")):
            pids = host_pids(bed, i, 2)
            members = set(map(int, (groups[name] / "cgroup.procs").read_text().split()))
            assert pids <= members, (name, pids, members)
        assert hosts[1].cgroup is None and host_pids(bed, 1, 2)
        before = host_pids(bed, 2, 2)
        bed.lose(2)  # every process killed, the host started again: in its group again
        after = host_pids(bed, 2, 2)
        assert not before & after
        assert after <= set(map(int, (groups["r2-t4"] / "cgroup.procs").read_text().split()))
    assert not any(g.exists() for g in groups.values())


@pytest.mark.parametrize("cpu, line", [
    ("nowhere:0.5", "error: --cpu 'nowhere:0.5': no region 'nowhere' (the scenario's: r0-h100, r1-a100, r2-t4)"),
    ("r1-a100", "error: --cpu 'r1-a100': expected REGION:CORES with CORES from 0.1 to {cores} (this machine's cores)"),
    ("r1-a100:0.01", "error: --cpu 'r1-a100:0.01': expected REGION:CORES with CORES from 0.1 to {cores} (this "
                     "machine's cores)"),
    ("r1-a100:lots", "error: --cpu 'r1-a100:lots': expected REGION:CORES with CORES from 0.1 to {cores} (this "
                     "machine's cores)"),
])  # fmt: skip
def test_a_bad_cpu_quota_is_one_line(tmp_path, small_corpus, capsys, cpu, line):
    import os

    from geomesh.cli import main

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tiny_scenario_dict(small_corpus)))
    code = main(["hosts", str(path), "--method", "geomesh", "--out", str(tmp_path / "o"), "--cpu", cpu])
    assert code == 2 and capsys.readouterr().err.strip().splitlines() == [line.format(cores=os.cpu_count())]
    assert not (tmp_path / "o").exists()  # refused before anything started
