"""One run folder, one run, and a killed run leaves nothing running.

- a fresh start into a folder another run left (checkpoints, events, summary) is one error, nothing changed;
- a start into a live run's folder (fresh or ``--resume``) is one error naming the live run's pid and host;
- the lock goes with the process that held it, even by ``kill -9``: the folder can be resumed at once;
- ``kill -9`` of ``geomesh train`` with worker processes, and of ``geomesh launch``: every process of the run
  ends (the worker pool and the ranks watch their parent).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import FIXED_PLAN, tiny_scenario_dict
from test_dist_resume import TAG_ENV, tagged_pids

from geomesh.cli import launch as cli_launch
from geomesh.errors import RunError
from geomesh.runtime import run_folder

SRC = str(Path(__file__).resolve().parents[1] / "src")


def snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def wait_for(condition, what: str, proc: subprocess.Popen | None = None, limit: float = 240) -> None:
    """Poll until ``condition()`` holds (a generous bound: the machine may be busy)."""
    deadline = time.monotonic() + limit
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}")
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.05)


def kill_and_wait_for_none(pid: int, tag: str) -> list[int]:
    """SIGKILL ``pid`` only; return the processes of the run still alive once they had time to notice."""
    os.kill(pid, signal.SIGKILL)
    for _ in range(300):  # the orphans end on their own: the kernel's parent-death signal, or the lifeline
        if not tagged_pids(tag):
            break
        time.sleep(0.1)
    return tagged_pids(tag)


def test_a_fresh_start_into_another_runs_folder_is_refused_untouched(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoints" / "round-000002").mkdir(parents=True)
    (folder / "events.jsonl").write_text('{"type": "run"}\n')
    before = snapshot(folder)
    with pytest.raises(RunError, match=r"holds another run \(events.jsonl, checkpoints/\): use --resume"):
        run_folder.claim(folder, resume=False)
    assert snapshot(folder) == before and not (folder / run_folder.LOCK_FILE).exists()
    held = run_folder.claim(folder, resume=True)  # continuing it is what --resume is for
    assert run_folder.read_lock(folder)["pid"] == os.getpid()
    held.release()
    empty = tmp_path / "new"
    assert run_folder.claim(empty, resume=False).run_id != held.run_id  # a new folder, a new run id


def test_a_live_runs_lock_refuses_every_start_and_dies_with_it(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from geomesh.runtime import run_folder; "
         f"run_folder.claim(Path({str(folder)!r}), resume=False); print('held', flush=True); time.sleep(600)"],
        env={**os.environ, "PYTHONPATH": SRC}, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        record = run_folder.read_lock(folder)
        before = snapshot(folder)
        for resume in (False, True):
            with pytest.raises(RunError, match=rf"in use by a live run: run {record['run_id']} \(pid {holder.pid} on"):
                run_folder.claim(folder, resume=resume)
        assert snapshot(folder) == before
    finally:
        holder.kill()
        holder.wait()
    held = run_folder.claim(folder, resume=True)  # the kernel dropped the lock with its holder
    assert held.run_id == record["run_id"]  # a resumed run keeps the folder's run id
    held.release()


def scenario_file(tmp_path: Path, small_corpus: list[str]) -> Path:
    path = tmp_path / "scenario.yaml"
    data = tiny_scenario_dict(small_corpus)
    data["geomesh"].update(FIXED_PLAN)
    path.write_text(yaml.safe_dump(data))
    return path


def test_kill_9_of_train_ends_its_workers_and_its_folder_takes_no_second_fresh_run(tmp_path, small_corpus):
    path = scenario_file(tmp_path, small_corpus)
    out = tmp_path / "run"
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", TAG_ENV: tag}
    cmd = [sys.executable, "-c", "import sys; from geomesh.cli import main; sys.exit(main())", "train", str(path),
           "--method", "diloco", "--tokens", "100000000", "--workers-parallel", "2", "--quiet"]  # fmt: skip
    proc = subprocess.Popen([*cmd, "--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        events = out / "events.jsonl"
        wait_for(lambda: events.exists() and b'"type": "round"' in events.read_bytes(), "round record", proc)
        assert len(tagged_pids(tag)) == 3  # the run and its two worker processes
        lock = (out / run_folder.LOCK_FILE).read_bytes()
        second = subprocess.run([*cmd, "--out", str(out)], env={**env, TAG_ENV: "second"}, capture_output=True,
                                text=True, timeout=120)  # fmt: skip
        err = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: run folder {out} is in use by a live run") and f"pid {proc.pid}" in err[0]
        assert (out / run_folder.LOCK_FILE).read_bytes() == lock
    finally:
        left = kill_and_wait_for_none(proc.pid, tag)
        proc.wait()
    assert left == []
    before = snapshot(out)
    again = subprocess.run([*cmd, "--out", str(out)], env={**env, TAG_ENV: "again"}, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    err = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(err) == 1, err
    assert "holds another run" in err[0] and "use --resume to continue it, or another folder" in err[0]
    assert snapshot(out) == before


def test_kill_9_of_launch_ends_its_ranks_and_a_finished_folder_takes_no_second_fresh_run(tmp_path, small_corpus,
                                                                                          capsys):  # fmt: skip
    path = scenario_file(tmp_path, small_corpus)
    out = tmp_path / "run"
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", TAG_ENV: tag}
    args = ["launch", str(path), "--nproc", "3", "--method", "diloco", "--out", str(out), "--tokens", "100000000",
            "--quiet", "--wan", "none", "--timeout", "90"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from geomesh.cli import main; sys.exit(main())",
                             *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        events = out / "events.jsonl"
        wait_for(lambda: events.exists() and b'"type": "round"' in events.read_bytes(), "round record", proc)
        assert len(tagged_pids(tag)) == 4  # the launcher and its 3 ranks
        assert cli_launch.main(args) == 2  # a second launch into the live run's folder
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is in use by a live run" in err[0] and f"pid {proc.pid}" in err[0], err
    finally:
        left = kill_and_wait_for_none(proc.pid, tag)  # the launcher only: its ranks must follow by themselves
        proc.wait()
    assert left == []
    finished = tmp_path / "finished"
    assert cli_launch.main([*args[:7], str(finished), "--tokens", "3840", *args[10:]]) == 0
    capsys.readouterr()
    before = snapshot(finished)
    assert cli_launch.main([*args[:7], str(finished), "--tokens", "3840", *args[10:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds another run" in err[0] and "summary.json" in err[0], err
    assert snapshot(finished) == before
    assert json.loads((finished / run_folder.LOCK_FILE).read_text())["run_id"]
