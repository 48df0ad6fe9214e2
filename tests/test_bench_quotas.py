"""bench/distributed.py's CPU quotas (``--throttle``): a region's processes go into a cgroup of their own with
the quota asked for, a change of share rewrites it, and nothing is left behind. Skipped where this process may
not make cgroups."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import bench_script


def quota_of(quotas, group: Path) -> int:
    text = (group / ("cpu.max" if quotas.v2 else "cpu.cfs_quota_us")).read_text().split()
    return int(text[0])


def test_a_region_runs_under_its_own_quota_and_the_groups_are_removed():
    bench = bench_script("distributed")
    try:
        quotas = bench.CpuQuotas("test-" + uuid.uuid4().hex)
        quotas.set("probe", 0.5)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"no cgroup cpu controller to write here: {e}")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        quotas.set("r1-a100", 0.4, [spinner.pid])
        group = quotas.groups["r1-a100"]
        assert str(spinner.pid) in (group / "cgroup.procs").read_text().split()
        assert quota_of(quotas, group) == int(0.4 * quotas.PERIOD_US)
        quotas.set("r1-a100", 0.2)  # the drift: the same group, half the share
        assert quota_of(quotas, group) == int(0.2 * quotas.PERIOD_US)
        assert str(spinner.pid) in (group / "cgroup.procs").read_text().split()
    finally:
        quotas.close()
        spinner.kill()
        spinner.wait()
    assert not any(g.exists() for g in quotas.groups.values())
