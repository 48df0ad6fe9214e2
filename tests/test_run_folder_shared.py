"""A static run keeps one folder for all its ranks (runtime/distributed/folder.py): ranks started as torchrun
starts them, on "hosts" that do not share the folder (each given its own ``--out``), stop before training
with one line that names the ranks and the fix; nothing is trained or written as a run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import tiny_scenario_dict

from geomesh.runtime.distributed.transport import free_port

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_ranks_that_do_not_share_the_run_folder_stop_before_training_with_one_line(tmp_path, small_corpus):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(tiny_scenario_dict(small_corpus, ("H100", "A100"))))
    port = str(free_port())
    procs = []
    for rank in range(2):  # each "host" its own folder: what a static run across hosts without a shared disk has
        env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": "0",
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        env.pop("GEOMESH_REGION", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "geomesh.run", str(scenario), "--method", "geomesh",
                                       "--out", str(tmp_path / f"host{rank}"), "--quiet", "--backend", "gloo",
                                       "--timeout", "60"], env=env, stderr=subprocess.PIPE, text=True))  # fmt: skip
    errs = [p.communicate(timeout=120)[1] for p in procs]
    for p, err in zip(procs, errs):
        assert p.returncode not in (0, None), err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert "is not shared: rank 1 (host" in lines[0] and "--min-regions" in lines[0], lines[0]
    for rank in range(2):
        assert not (tmp_path / f"host{rank}" / "events.jsonl").exists()
        assert not list((tmp_path / f"host{rank}").glob(".geomesh-start-*"))  # the token does not stay behind
