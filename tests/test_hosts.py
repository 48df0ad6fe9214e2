"""The hosts test bed (``geomesh hosts``): a 3-region ``geomesh`` run with calibration and re-planning, each region
a host (its own network namespace, address, folder and torchrun), the quorum service alone. Needs root and
iproute2: skipped with the reason elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import tiny_scenario_dict

from geomesh.runtime.distributed.transport import netns_unavailable_reason

SRC = str(Path(__file__).resolve().parents[1] / "src")
REASON = netns_unavailable_reason()


@pytest.mark.waits
@pytest.mark.skipif(REASON is not None, reason=f"the hosts test bed cannot run here: {REASON}")
def test_a_geomesh_run_on_three_hosts_ends_with_one_checksum(tmp_path, small_corpus):
    data = tiny_scenario_dict(small_corpus)
    data["geomesh"].update({"calibrate": True, "replan": True})  # GeoMesh's plan loop, as users run it
    data["wan"]["rtt"] = [[0 if i == j else 200 for j in range(3)] for i in range(3)]
    data["reliability"] = {"min_regions": 2, "round_deadline_s": 60}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "bed"
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "geomesh.cli", "hosts", str(path), "--method", "geomesh", "--out",
                           str(out), "--tokens", "12000", "--json", "--run-timeout", "400"], env=env,
                          capture_output=True, text=True, timeout=500)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    hosts = result["hosts"]
    assert sorted(hosts) == ["r0-h100", "r1-a100", "r2-t4"]
    assert len({h["address"] for h in hosts.values()}) == 3 and all(h["exit"] == 0 for h in hosts.values())
    assert len(result["param_checksums"]) == 3 and len(set(result["param_checksums"].values())) == 1
    summary = json.loads(Path(result["summary_from"]).read_text())
    assert summary["tokens"] >= 12000 and summary["calibration_s"]  # calibrated in place on each host
    for name in hosts:  # each host wrote into its own folder only
        assert (out / name / "run").is_dir()


def test_the_bed_refuses_bad_faults_in_one_line(tmp_path, small_corpus):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tiny_scenario_dict(small_corpus)))
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-m", "geomesh.cli", "hosts", str(path), "--method", "geomesh", "--out",
                           str(tmp_path / "o"), "--lose", "nowhere@2"], env=env, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --lose nowhere@...: no region 'nowhere' (the scenario's: r0-h100, r1-a100, r2-t4)"]
