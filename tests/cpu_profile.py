"""A pytest plugin that says where the suite's CPU goes: each test's wall seconds and CPU-seconds (its rank
processes, zygote and hosts included), summed per file at the end.

    PYTHONPATH=tests .venv/bin/python -m pytest -p cpu_profile -m "not waits" [CPU_PROFILE_OUT=FILE.jsonl]

Where cgroup v1's ``cpuacct`` controller is writable (root), each pytest process (each xdist worker too) moves
itself into a cpuacct group of its own, which every process it starts inherits however it is reparented; a test's
figure is then its own process tree's, and the lanes may run side by side with other work. Elsewhere the figure is
the whole machine's busy CPU (/proc/stat): run the tests one at a time (no ``-n``) on an otherwise idle machine.
With ``CPU_PROFILE_OUT`` every test's line is also written there (JSON lines: id, wall, cpu)."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

TICKS = os.sysconf("SC_CLK_TCK")
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_rows: list[dict] = []
_group: Path | None = None  # this process's own cpuacct group, once it has joined one


def busy_cpu_s() -> float:
    """The machine's busy CPU-seconds since boot (every core: user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return (sum(ticks) - idle) / TICKS


def _join_own_group() -> Path | None:
    """Move this process into a new cpuacct group below its current one; None where that cannot be done."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        current = next(line.split(":", 2)[2] for line in lines if "cpuacct" in line.split(":", 2)[1].split(","))
        group = CPUACCT / current.lstrip("/") / f"cpu-profile-{os.getpid()}"
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        return group
    except (OSError, StopIteration, IndexError):
        return None


def tree_cpu_s() -> float:
    """This process tree's CPU-seconds where it has a group of its own, else the machine's busy CPU-seconds."""
    if _group is not None:
        return int((_group / "cpuacct.usage").read_text()) / 1e9
    return busy_cpu_s()


def pytest_configure(config):
    global _group
    _group = _join_own_group()


def pytest_unconfigure(config):
    """Back to the parent group, and the own one removed (left where a process of the run still lives in it)."""
    if _group is None:
        return
    try:
        (_group.parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
    except OSError:
        return
    for group in [*sorted(_group.glob("**/cpu-profile-*"), reverse=True), _group]:  # (an xdist worker's inside)
        try:
            group.rmdir()
        except OSError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, c0 = time.monotonic(), tree_cpu_s()
    yield
    row = {"id": item.nodeid, "wall": round(time.monotonic() - t0, 2), "cpu": round(tree_cpu_s() - c0, 2)}
    _rows.append(row)
    out = os.environ.get("CPU_PROFILE_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter):
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for row in _rows:
        totals = per_file[row["id"].split("::")[0]]
        totals[0] += row["cpu"]
        totals[1] += row["wall"]
        totals[2] += 1
    if not per_file:
        return
    whose = "its process tree's" if _group is not None else "the machine's, while its tests ran"
    terminalreporter.section(f"CPU-seconds per file ({whose})")
    for name, (cpu, wall, n) in sorted(per_file.items(), key=lambda kv: -kv[1][0]):
        terminalreporter.write_line(f"{cpu:8.1f} CPU-s {wall:8.1f} wall-s {n:4d} tests  {name}")
    terminalreporter.write_line(f"{sum(t[0] for t in per_file.values()):8.1f} CPU-s in all")
