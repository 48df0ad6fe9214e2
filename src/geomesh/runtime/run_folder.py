"""One run folder holds one run: the lock a run holds while it writes, its run id, and the check that a fresh
start does not write into a folder another run left.

``DIR/run.lock`` is a small JSON file, ``{"run_id", "pid", "host", "since"}``, and an advisory lock
(``flock``) on it that the process writing the run holds until it exits: the ``geomesh train`` process, or
the ``geomesh launch`` process for all its ranks (which find the run id in :data:`RUN_ID_ENV`). The kernel
drops the lock when that process dies, even by ``kill -9``, so a killed run's folder can be resumed at once,
while a second run started into a live run's folder is refused whether it starts fresh or with ``--resume``.
The file stays when the run ends: its run id is the folder's, recorded in every checkpoint marker, and a
resumed run keeps it.

A fresh start (no ``--resume``) into a folder that holds another run's checkpoints, events, summary or final
parameters is one error, and nothing in the folder is changed (the lock file is only written once every
check passed). Starting again from scratch means another folder, or removing the old one deliberately.

Where the file system has no ``flock`` (some network file systems), the lock degrades to the recorded
pid and host: a live process with that pid on this host holds it; one on another host cannot be checked
and is reported as a warning.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

from .. import checkpoint as ckpt
from ..errors import RunError

LOCK_FILE = "run.lock"
RUN_ID_ENV = "GEOMESH_RUN_ID"  # the launcher's run id, for the ranks it starts (they do not take the lock)
_RUN_FILES = ("events.jsonl", "summary.json", "final_params.pt")

_held: dict[str, "RunFolder"] = {}  # this process's locks, by folder: a later run in the process takes over


def read_lock(out_dir: Path) -> dict[str, Any] | None:
    """The lock file's record, or None when there is none or it is unreadable."""
    try:
        record = json.loads((Path(out_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def run_id_of(out_dir: Path | None) -> str | None:
    """The run id of the run writing ``out_dir``: the launcher's (:data:`RUN_ID_ENV`), else the lock file's."""
    if os.environ.get(RUN_ID_ENV):
        return os.environ[RUN_ID_ENV]
    if out_dir is None:
        return None
    record = read_lock(out_dir)
    return str(record["run_id"]) if record and record.get("run_id") else None


def previous_run(out_dir: Path) -> list[str]:
    """What another run left in ``out_dir`` (names of its files or checkpoints), empty when nothing."""
    out_dir = Path(out_dir)
    found = []
    for name in _RUN_FILES:
        p = out_dir / name
        if p.is_file() and (name != "events.jsonl" or p.stat().st_size > 0):
            found.append(name)
    checkpoints = ckpt.checkpoint_dir(out_dir)
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        found.append(f"{ckpt.CHECKPOINT_DIR}/")
    return found


def _describe(record: dict[str, Any] | None) -> str:
    if not record:
        return "another process"
    return f"run {record.get('run_id')} (pid {record.get('pid')} on {record.get('host')})"


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


class RunFolder:
    """The lock of one run folder, held by this process (see the module's docstring)."""

    def __init__(self, out_dir: Path, fd: int | None, run_id: str):
        self.out_dir, self.fd, self.run_id = Path(out_dir), fd, run_id

    def release(self) -> None:
        """Give the lock up (the file and its run id stay)."""
        _held.pop(str(self.out_dir.resolve()), None)
        if self.fd is not None:
            try:
                os.close(self.fd)  # closing the only descriptor drops the flock
            except OSError:
                pass
            self.fd = None


def _try_lock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: the file system has no flock."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None


def claim(out_dir: Path, resume: bool) -> RunFolder:
    """Take ``out_dir`` for one run before anything is written into it; returns the held lock.

    RunError (one line, nothing changed) when a live run holds the folder, or, without ``resume``, when the
    folder holds another run's files. A resumed run keeps the folder's run id; a fresh one gets a new one."""
    out_dir = Path(out_dir)
    key = str(out_dir.resolve())
    if key in _held:  # an earlier run of this process (runs in one process follow each other)
        _held[key].release()
    lock_path = out_dir / LOCK_FILE
    record = read_lock(out_dir)
    fd = None
    if lock_path.is_file():  # opened without creating or truncating: a refused start changes nothing
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except OSError as exc:
            raise RunError(f"run folder {out_dir}: cannot open {LOCK_FILE}: {exc.strerror or exc}") from None
        state = _try_lock(fd)
        if state is None and record and record.get("host") == socket.gethostname():
            state = not _pid_alive(record.get("pid")) or int(record.get("pid", -1)) == os.getpid()
        elif state is None:
            warnings.warn(f"run folder {out_dir}: its file system has no locks; a live run of another host "
                          f"writing it ({_describe(record)}) cannot be detected")  # fmt: skip
        if state is False:
            os.close(fd)
            raise RunError(f"run folder {out_dir} is in use by a live run: {_describe(record)}; wait for it to "
                           "end, or use another folder")  # fmt: skip
    if not resume:
        left = previous_run(out_dir)
        if left:
            if fd is not None:
                os.close(fd)
            who = f" of run {record['run_id']}" if record and record.get("run_id") else ""
            raise RunError(f"run folder {out_dir} holds another run{who} ({', '.join(left)}): use --resume to "
                           "continue it, or another folder")  # fmt: skip
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if fd is None:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            if _try_lock(fd) is False:  # a run that started in the same instant
                os.close(fd)
                raise RunError(f"run folder {out_dir} is in use by a live run: {_describe(read_lock(out_dir))}; "
                               "wait for it to end, or use another folder")  # fmt: skip
        run_id = str(record["run_id"]) if resume and record and record.get("run_id") else uuid.uuid4().hex[:16]
        body = json.dumps({"run_id": run_id, "pid": os.getpid(), "host": socket.gethostname(),
                           "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n"  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, body.encode(), 0)
        os.fsync(fd)
    except OSError as exc:
        if fd is not None:
            os.close(fd)
        raise RunError(f"run folder {out_dir} is not writable: {exc.strerror or exc}") from None
    held = RunFolder(out_dir, fd, run_id)
    _held[key] = held
    return held
