"""Starting local ranks and waiting for them: what ``geomesh launch`` does once its checks passed, with or
without elastic regions (:mod:`geomesh.cli.launch`, :mod:`geomesh.cli.launch_elastic`).

:func:`run_ranks` starts one process per rank (``python -m geomesh.run``, each in its own session), pumps
every rank's output into ``DIR/logs/rank<k>.log`` and, unless ``--quiet``, onto stderr prefixed
``[rank k region NAME]``, polls them, and kills those still running once the caller's stop rule says the run
is over (a rank failed, or the summary was written); a rank also ends when the launcher dies, even by
``kill -9`` (:mod:`geomesh.runtime.lifeline`). :func:`report` turns the ranks' exits into a
:class:`LaunchResult`: the summary, or the rank that died first and why.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REGION_ENV = "GEOMESH_REGION"  # every rank's region, in its environment (geomesh.cli.rank sets it under torchrun)


@dataclass
class RankExit:
    rank: int
    code: int | None = None  # None: still running
    at: float | None = None  # seconds after the start
    killed: bool = False  # by the launcher, after the others had stopped
    tail: deque = field(default_factory=lambda: deque(maxlen=30))

    def describe(self) -> str:
        if self.killed:
            return "did not stop; killed by the launcher"
        if self.code is None:
            return "still running"
        if self.code < 0:
            try:
                name = signal.Signals(-self.code).name
            except ValueError:
                name = f"signal {-self.code}"
            return f"killed by {name}"
        return f"exit code {self.code}"

    def error_line(self) -> str | None:
        for line in reversed(self.tail):
            if "error:" in line:
                return line[line.index("error:") :]
        return None


@dataclass
class LaunchResult:
    code: int
    summary: dict[str, Any] | None
    ranks: list[RankExit]
    message: str = ""
    netns: dict[str, Any] | None = None


def run_ranks(args: argparse.Namespace, cmds: list[list[str]], envs: list[dict[str, str]], regions: list[str],
              stop_at: Callable[[list[RankExit]], float | None]) -> tuple[list[RankExit], bool]:
    """Start rank ``k`` as ``cmds[k]`` with environment ``envs[k]``, forward its output, and wait for every rank.

    After each poll, ``stop_at(ranks)`` gives the time (``time.perf_counter()``) after which ranks still
    running are killed (None: no limit yet). Returns the ranks' exits and whether the launcher was interrupted
    (KeyboardInterrupt: every rank is killed). No rank outlives this call."""
    out = Path(args.out)
    ranks = [RankExit(r) for r in range(len(cmds))]
    procs: list[subprocess.Popen] = []
    threads = []
    lock = threading.Lock()

    def pump(k: int, proc: subprocess.Popen) -> None:
        with open(out / "logs" / f"rank{k}.log", "w") as log, proc.stdout:  # type: ignore[union-attr]
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                log.flush()
                ranks[k].tail.append(line.rstrip("\n"))
                if not args.quiet:
                    with lock:
                        print(f"[rank {k} region {regions[k]}] {line}", end="", file=sys.stderr, flush=True)

    from ..runtime.lifeline import LIFELINE_ENV, Lifeline, death_hook

    # a rank ends when this launcher dies, even by kill -9: the kernel's parent-death signal, and a pipe the
    # rank watches (geomesh.run) for a rank that runs under another process (ip netns exec)
    lifeline = Lifeline()
    hook = death_hook()
    started = time.perf_counter()
    try:
        for k, (cmd, rank_env) in enumerate(zip(cmds, envs)):
            proc = start_rank(cmd, {**rank_env, LIFELINE_ENV: str(lifeline.read_fd)}, lifeline.read_fd, hook)
            procs.append(proc)
            t = threading.Thread(target=pump, args=(k, proc), daemon=True)
            t.start()
            threads.append(t)
        while any(r.code is None for r in ranks):
            for k, proc in enumerate(procs):
                if ranks[k].code is None and proc.poll() is not None:
                    ranks[k].code, ranks[k].at = proc.returncode, time.perf_counter() - started
            deadline = stop_at(ranks)
            if deadline is not None and time.perf_counter() > deadline:
                for k, proc in enumerate(procs):
                    if ranks[k].code is None:
                        kill(proc)
                        ranks[k].code, ranks[k].killed = proc.returncode, True
            time.sleep(0.05)
    except KeyboardInterrupt:
        for proc in procs:
            kill(proc)
        return ranks, True
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill(proc)
        for t in threads:
            t.join(timeout=5)
        lifeline.close()
    return ranks, False


def start_rank(cmd: list[str], env: dict[str, str], lifeline_fd: int, preexec_fn) -> subprocess.Popen:
    """Start one rank: ``cmd`` in its own session with ``env``, its output (stdout and stderr) on a text pipe,
    ``lifeline_fd`` inherited. The one place a rank process starts: a test harness may start the same command
    another way (tests/rank_zygote.py forks it from a process that imported torch once)."""
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=preexec_fn, pass_fds=(lifeline_fd,))  # fmt: skip


def kill(proc: subprocess.Popen) -> None:
    """End one rank we started (its own process group: ``ip netns exec`` and the Python under it)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def report(args: argparse.Namespace, ranks: list[RankExit], regions: list[str]) -> LaunchResult:
    out = Path(args.out)
    if all(r.code == 0 for r in ranks):
        try:
            summary = json.loads((out / "summary.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            return LaunchResult(1, None, ranks, f"all ranks finished but {out / 'summary.json'} is unreadable: {exc}")
        return LaunchResult(0, summary, ranks)
    failed = [r for r in ranks if r.code != 0]
    if all(r.code == 2 for r in failed):  # a user error, seen by the ranks themselves
        line = next((r.error_line() for r in failed if r.error_line()), "error: a rank refused the job")
        return LaunchResult(2, None, ranks, line.removeprefix("error: "))
    # the root cause: the first rank that died on its own (a signal or an unexpected code), else a rank that
    # hung (the launcher killed it after the others had stopped), else the first failure
    own = [r for r in failed if not r.killed and r.code not in (1, 2)]
    hung = [r for r in failed if r.killed]
    first = min(own or hung or failed, key=lambda r: (r.at or 1e18, r.rank))
    others = [r for r in ranks if r is not first]
    why = first.error_line()
    verb = "died" if own else "hung" if hung else "failed"
    msg = f"rank {first.rank} (region {regions[first.rank]}) {verb} ({first.describe()}" + (
        f" at {first.at:.1f}s)" if first.at is not None and not first.killed else ")"
    )
    if why:
        msg += f": {why.removeprefix('error: ')}"
    stopped = ", ".join(f"rank {r.rank}: {r.describe()}" for r in others)
    if stopped:
        msg += f"; the others stopped: {stopped}"
    msg += f" (logs in {out / 'logs'})"
    return LaunchResult(1, None, ranks, msg)
