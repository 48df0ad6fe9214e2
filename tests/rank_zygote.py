"""Rank processes for the tests, forked from one process that imported torch once.

Every rank that ``geomesh launch`` starts is ``python -m geomesh.run ...``: a new interpreter that imports torch
and ``torch._dynamo`` (the first optimizer step imports it), about 3.8 s of CPU, before it does a few hundred
milliseconds of work at the tests' sizes. The suite starts a few hundred ranks, so most of its CPU went to
those imports.

In a test process, :func:`start_rank` replaces :func:`geomesh.cli.ranks.start_rank` (``tests/conftest.py``):
it asks a *zygote* (this file run as a script: one per test process, started at the first launch) to fork the
rank. The zygote imported torch, dynamo and the rank's modules once and runs nothing else, so each fork is a
clean rank that starts in milliseconds. The child takes the command's environment, output pipe, working
folder and lifeline (the fds travel over a Unix socket), starts its own session, and runs the same entry
point as ``python -m geomesh.run`` with the same arguments. The zygote reaps it and reports its exit status,
which :class:`ForkedRank` (the ``Popen`` the launcher polls, waits for and kills by process group) returns.

Only what a rank reads through the environment at import time differs from an exec'd rank: OpenMP read the
zygote's ``OMP_NUM_THREADS`` (1), so a child sets torch's threads from its own. The processes' ``/proc``
identity (command line, environment) is the zygote's: tests that find ranks there, and the launches started as
``geomesh launch`` subprocesses, start ranks the product's way (marker ``exec_ranks``; every test with
``GEOMESH_TEST_EXEC_RANKS=1``).
"""

from __future__ import annotations

import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from geomesh.cli.ranks import start_rank as product_start_rank  # bound before the tests replace it

RANK_MODULE = "geomesh.run"
EXEC_RANKS_ENV = "GEOMESH_TEST_EXEC_RANKS"  # "1": every rank starts the product's way (tests/conftest.py)
MAX_MESSAGE = 1 << 20  # a request: the command and its environment


def _is_rank_command(cmd: list[str]) -> bool:
    return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1:3] == ["-m", RANK_MODULE]


class ForkedRank:
    """The part of ``subprocess.Popen`` that :func:`geomesh.cli.ranks.run_ranks` uses, for a forked rank."""

    def __init__(self, zygote: Zygote, cmd: list[str], pid: int, stdout: io.TextIOBase):
        self.zygote, self.args, self.pid, self.stdout = zygote, cmd, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


class Zygote:
    """The test process's side: starts the zygote, sends it rank commands, collects exit statuses (the zygote
    ends when this process does: its socket reads end-of-file)."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], env=env,
                                     pass_fds=(theirs.fileno(),))  # fmt: skip
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.exits: dict[int, int] = {}
        self.started: dict[int, int] = {}  # request id -> pid
        self.next_id = 0

    def start(self, cmd: list[str], env: dict[str, str], lifeline_fd: int) -> ForkedRank:
        read_end, write_end = os.pipe()
        with self.lock:
            self.next_id += 1
            request = self.next_id
            message = {"id": request, "argv": cmd[3:], "env": env, "cwd": os.getcwd()}
            socket.send_fds(self.sock, [json.dumps(message).encode()], [write_end, lifeline_fd])
        os.close(write_end)
        deadline = time.monotonic() + 120
        while (pid := self._started(request)) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the rank zygote did not start {cmd} (exit {self.proc.poll()})")
            time.sleep(0.005)
        stdout = open(read_end, encoding="utf-8", errors="replace")  # noqa: SIM115 (the launcher closes it)
        return ForkedRank(self, cmd, pid, stdout)

    def _started(self, request: int) -> int | None:
        with self.lock:
            self._drain()
            return self.started.pop(request, None)

    def exit_code(self, pid: int) -> int | None:
        with self.lock:
            self._drain()
            return self.exits.get(pid)

    def _drain(self) -> None:
        while select.select([self.sock], [], [], 0)[0]:
            data = self.sock.recv(MAX_MESSAGE)
            if not data:
                return
            reply = json.loads(data)
            if "exit" in reply:
                self.exits[reply["exit"]] = reply["code"]
            else:  # a new child: an exit recorded under its pid was an earlier child's (pids are reused)
                self.exits.pop(reply["pid"], None)
                self.started[reply["id"]] = reply["pid"]


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def start_rank(cmd: list[str], env: dict[str, str], lifeline_fd: int, preexec_fn):
    """:func:`geomesh.cli.ranks.start_rank` for tests: a rank command is forked by this process's zygote;
    anything else (a rank under ``ip netns exec``) starts as the product starts it."""
    global _zygote
    if not _is_rank_command(cmd):
        return product_start_rank(cmd, env, lifeline_fd, preexec_fn)
    with _zygote_lock:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = Zygote()
    return _zygote.start(cmd, env, lifeline_fd)


# ---- the zygote ---------------------------------------------------------------------------------------------


def _preload() -> None:
    """What every rank imports, once (no threads are started by these imports: the forks are clean)."""
    import torch
    import torch._dynamo  # noqa: F401  (the first optimizer step imports it)
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import geomesh.cli.rank  # noqa: F401
    import geomesh.methods  # noqa: F401
    import geomesh.runtime.distributed  # noqa: F401
    import geomesh.runtime.distributed.checkpoints  # noqa: F401
    import geomesh.runtime.distributed.elastic  # noqa: F401
    import geomesh.runtime.distributed.membership  # noqa: F401

    torch.set_num_threads(1)


def _run_rank(sock: socket.socket, request: dict, out_fd: int, lifeline_fd: int) -> None:
    """In the forked child: become the rank ``python -m geomesh.run ARGV`` would be, run it, never return."""
    code = 1
    try:
        sock.close()
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", write_through=True)
        os.chdir(request["cwd"])
        from geomesh.runtime.lifeline import LIFELINE_ENV, watch_inherited

        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[LIFELINE_ENV] = str(lifeline_fd)
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        sys.argv = ["-m", *request["argv"]]
        watch_inherited()
        from geomesh.cli.rank import main

        main(request["argv"])  # ends the process (os._exit)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a child must never return into the zygote's loop
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    _preload()
    while True:
        if select.select([sock], [], [], 0.02)[0]:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            if not data:
                return  # the test process is gone
            request = json.loads(data)
            out_fd, lifeline_fd = fds
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_rank(sock, request, out_fd, lifeline_fd)
            os.close(out_fd)
            os.close(lifeline_fd)
            sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


if __name__ == "__main__":
    serve(int(sys.argv[1]))
