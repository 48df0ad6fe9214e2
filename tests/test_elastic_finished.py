"""A region that arrives after its run finished (runtime/distributed/board.py): it learns it from the quorum
service's run board and stops at once with exit 0 and one line, instead of waiting out ``--timeout`` for a
quorum that never forms; a note on the board that another key signed is ignored."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_elastic import SRC, TAG_ENV, kill_all, scenario
from test_trust_elastic import KEY_ENV, _port

from geomesh.runtime.distributed.board import RunBoard
from geomesh.runtime.distributed.service import start_lighthouse

KEY = "the run's secret, 32 bytes long!"


def region_cmd(path: Path, folder: Path, region: str, port: str, tag: str) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": SRC, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_port()), "GEOMESH_REGION": region, "OMP_NUM_THREADS": "1", KEY_ENV: KEY,
           "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}", "GEOMESH_ADVERTISE_HOST": "127.0.0.1", TAG_ENV: tag}
    cmd = [sys.executable, "-m", "geomesh.run", str(path), "--method", "geomesh-sign-only", "--out",
           str(folder / region), "--tokens", str(3 * 640), "--timeout", "30", "--quiet"]  # fmt: skip
    return cmd, env


@pytest.mark.waits
def test_a_region_started_after_the_run_finished_exits_at_once_with_one_line(tmp_path, small_corpus):
    path = scenario(tmp_path, small_corpus, gpus=("H100", "A100", "T4"), hmac_key_env=KEY_ENV)
    service = start_lighthouse(2, 20.0)
    port = service.address().rsplit(":", 1)[-1].strip("/")
    tag = uuid.uuid4().hex
    try:
        procs = {}
        for region in ("r0-h100", "r1-a100"):  # (they wait --timeout, 30 s, for r2-t4 at the start, then go on)
            cmd, env = region_cmd(path, tmp_path, region, port, tag)
            procs[region] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True)  # fmt: skip
        for region, p in procs.items():
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, (region, err[-3000:])
        cmd, env = region_cmd(path, tmp_path, "r2-t4", port, tag)
        late = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    finally:
        kill_all(tag)
        service.shutdown()
    assert late.returncode == 0, late.stderr[-3000:]
    lines = [ln for ln in late.stdout.splitlines() if "finished" in ln]
    assert len(lines) == 1 and "the run finished at round" in lines[0] and "without this region" in lines[0], late
    assert "r0-h100" in lines[0] and "r1-a100" in lines[0]
    # (without the board it waits its --timeout for a quorum and exits 1 with "no quorum ... within 30s")
    assert "no quorum" not in late.stderr


def test_a_note_signed_with_another_key_or_for_another_run_is_ignored(capsys):
    service = start_lighthouse(2, 10.0)
    try:
        genuine = RunBoard(service.address(), run="job/1", key=b"k" * 32)
        assert genuine.finished() is None
        RunBoard(service.address(), run="job/1", key=b"x" * 32).post_finished({"round": 9, "regions": ["r0"]})
        assert genuine.finished() is None and "tag does not hold" in capsys.readouterr().err  # a forged note
        genuine.post_finished({"round": 7, "regions": ["r0", "r1"]})
        assert genuine.finished()["round"] == 7
        assert RunBoard(service.address(), run="job/2", key=b"k" * 32).finished() is None  # another run's board
    finally:
        service.shutdown()
