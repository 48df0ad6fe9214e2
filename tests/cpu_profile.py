"""A pytest plugin that says where the suite's CPU goes: each test's wall seconds and the machine's busy CPU-seconds
while it ran (from /proc/stat: its rank processes, zygote and hosts included), summed per file at the end.

    PYTHONPATH=tests .venv/bin/python -m pytest -p cpu_profile -m "not waits" [CPU_PROFILE_OUT=FILE.jsonl]

Run the tests one at a time (no ``-n``) on an otherwise idle machine: the figure is the whole machine's. With
``CPU_PROFILE_OUT`` every test's line is also written there (JSON lines: id, wall, cpu)."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import pytest

TICKS = os.sysconf("SC_CLK_TCK")
_rows: list[dict] = []


def busy_cpu_s() -> float:
    """The machine's busy CPU-seconds since boot (every core: user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return (sum(ticks) - idle) / TICKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, c0 = time.monotonic(), busy_cpu_s()
    yield
    row = {"id": item.nodeid, "wall": round(time.monotonic() - t0, 2), "cpu": round(busy_cpu_s() - c0, 2)}
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
    terminalreporter.section("CPU-seconds per file (the machine's, while its tests ran)")
    for name, (cpu, wall, n) in sorted(per_file.items(), key=lambda kv: -kv[1][0]):
        terminalreporter.write_line(f"{cpu:8.1f} CPU-s {wall:8.1f} wall-s {n:4d} tests  {name}")
    terminalreporter.write_line(f"{sum(t[0] for t in per_file.values()):8.1f} CPU-s in all")
