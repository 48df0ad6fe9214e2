"""Processes a run starts end when the process that started them dies, even by ``kill -9``.

Two mechanisms, because each alone has a gap:

- on Linux, :func:`die_with_parent` asks the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, through ctypes)
  to kill the process when its parent exits; it is set in the child before anything else runs
  (``preexec_fn`` of a rank, the first line of a forked worker), and a parent that died before it was set is
  caught by comparing ``getppid()`` with the parent's pid;
- everywhere, a pipe (:class:`Lifeline`): the parent keeps the write end, the child watches the read end in a
  thread (:func:`watch`) and ends itself when it reads end-of-file, which the kernel delivers when the last
  write end closes, i.e. when the parent is gone. This also covers a child whose direct parent is not the run's
  process (``ip netns exec`` in front of a rank) and platforms without ``prctl``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

LIFELINE_ENV = "GEOMESH_LIFELINE_FD"  # the read end a rank inherits (geomesh.run watches it)


_PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's ``prctl``, or None off Linux (looked up in the parent: a child between fork and exec must not
    import or load anything)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def death_hook(parent_pid: int | None = None):
    """A function for the child to call first (``preexec_fn``, or a forked worker's first line) that asks
    the kernel for SIGKILL when its parent exits, and exits at once if the parent (``parent_pid``, default:
    this process) is already gone."""
    prctl = _prctl()
    parent = os.getpid() if parent_pid is None else parent_pid

    def hook() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request was in place
            os._exit(1)

    return hook


def die_with_parent(parent_pid: int) -> None:
    """In a child already running (a forked worker): :func:`death_hook` at once."""
    death_hook(parent_pid)()


class Lifeline:
    """A pipe whose read end children inherit and watch; the parent holds the write end until it dies."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_inheritable(self.write_fd, False)  # exec'd children get the read end only (pass_fds)

    def close(self) -> None:
        """Close both ends (once: a descriptor number may be reused after it is closed)."""
        for fd in (self.read_fd, self.write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.read_fd = self.write_fd = -1


def watch(fd: int, close_fds: tuple[int, ...] = ()) -> None:
    """In the child: end this process when ``fd`` (a lifeline's read end) reaches end-of-file. ``close_fds``:
    write ends this child inherited by fork, which would otherwise keep its own lifeline open."""
    for other in close_fds:
        try:
            os.close(other)
        except OSError:
            pass

    def wait() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        os._exit(1)  # the parent is gone: nothing of the run is left to serve

    threading.Thread(target=wait, name="geomesh-lifeline", daemon=True).start()


def watch_inherited() -> None:
    """Watch the lifeline named by :data:`LIFELINE_ENV`, when this process was started with one."""
    value = os.environ.pop(LIFELINE_ENV, None)
    if value is None:
        return
    try:
        fd = int(value)
        os.fstat(fd)
    except (ValueError, OSError):
        return
    watch(fd)
