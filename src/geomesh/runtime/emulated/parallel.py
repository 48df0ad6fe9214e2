"""Worker processes for the emulated runtime: the workers of a round train at the same time, same results.

Within a round the workers are independent: each starts from the same global parameters θ, trains its own
replica with its own AdamW state, data stream and codec, and hands back a payload. :class:`WorkerPool`
runs them in ``processes`` forked processes, each owning a fixed subset of the workers for the whole run
(the replica, optimizer moments, stream position and error-feedback residual live in the owner, so nothing
but the payload crosses a process boundary in a round). θ is read from shared memory: the global model's
parameters are moved into shared memory before the fork, and the parent's outer step updates them in place
while the children wait. What the parent sends per round is a few numbers per worker; what comes back is
the payload bytes (and any warnings the worker raised, re-emitted in the parent in worker order).

Same results: a worker's local phase is the *same function* in both modes (the runtime passes it in; fork
hands the child the parent's objects, so nothing is pickled but the per-round job), and it runs with the same
number of intra-op threads (:func:`worker_threads`) in both, because a reduction split over more threads
adds in another order. So ``workers_parallel = 1`` (in-process) and ``= N`` give bit-identical summaries and
events, and neither depends on how many cores the machine has beyond ``worker_threads``.

The parent needs a worker's state only to write a checkpoint or at the end of the run: :meth:`WorkerPool.pull`
fetches it from the owner (``state_dict`` round trips are exact). A worker's rejoin (fresh AdamW, empty
residual) runs in its owner through :meth:`WorkerPool.map` like any other call.

The worker processes end with the parent, even when it is killed with ``kill -9`` in the middle of a round
(:mod:`geomesh.runtime.lifeline`): nothing of a killed run is left running.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..lifeline import Lifeline, death_hook, watch

Call = Callable[[int, Any], Any]  # (worker index, argument) -> result, run in the worker's owner


class PoolError(RuntimeError):
    """A worker process failed (its traceback is in the message) or died."""


def available_cores() -> int:
    """The cores this process may use: torch's intra-op thread budget (it follows ``OMP_NUM_THREADS``
    and ``torch.set_num_threads``), capped by the CPU affinity mask."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), affinity))


def worker_threads(n_workers: int, cores: int | None = None) -> int:
    """Intra-op threads for one worker's local phase: its share of the cores, the same in serial and parallel
    mode (so the two give the same bits). ``cores`` defaults to :func:`available_cores`."""
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, n_workers))


def fork_available() -> bool:
    return "fork" in mp.get_all_start_methods()


def default_processes(n_workers: int, device: str = "cpu", cores: int | None = None) -> int:
    """How many worker processes a run uses unless told: one per core up to one per worker on a CPU where
    fork is available, else 1 (in-process). With one core, or one worker, processes only add overhead."""
    if device != "cpu" or not fork_available():
        return 1
    cores = available_cores() if cores is None else cores
    return max(1, min(n_workers, cores))


def assign_owners(work: Sequence[float], processes: int) -> list[int]:
    """Worker -> process: longest work first, each to the least-loaded process (ties: lowest index), so a
    skewed plan (one fast GPU doing most of the sequences) still spreads over the processes."""
    load = [0.0] * processes
    owners = [0] * len(work)
    for i in sorted(range(len(work)), key=lambda k: (-work[k], k)):
        p = min(range(processes), key=lambda q: (load[q], q))
        owners[i] = p
        load[p] += work[i]
    return owners


@contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the previous count."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _serve(conn: Any, calls: dict[str, Call], threads: int, die_with_parent: Callable[[], None], lifeline: Any,
           inherited: Sequence[Any]) -> None:  # fmt: skip
    """A worker process: run the calls the parent sends until it sends None or goes away.

    It ends when the parent dies, even by ``kill -9`` and in the middle of a round: the kernel's parent-death
    signal (Linux), and the pool's lifeline pipe watched in a thread. The parent's ends of the pool's pipes,
    which fork copied into this process, are closed first: holding them would keep ``conn`` from ever
    reporting the parent gone."""
    die_with_parent()
    for other in inherited:
        other.close()
    watch(lifeline.read_fd, close_fds=(lifeline.write_fd,))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it closes the pool
    torch.set_num_threads(threads)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        name, jobs = message
        results = []
        for i, arg in jobs:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    value, error = calls[name](i, arg), None
                except BaseException as exc:  # reported to the parent, which raises it
                    value, error = None, (type(exc).__name__, str(exc), traceback.format_exc())
            notes = [(str(w.message), w.category) for w in caught]
            results.append((i, value, error, notes))
            if error is not None:
                break
        try:
            conn.send(results)
        except Exception as exc:  # e.g. a result that does not pickle
            conn.send([(jobs[0][0], None, (type(exc).__name__, str(exc), traceback.format_exc()), [])])


class WorkerPool:
    """``processes`` forked processes; worker ``i`` lives in process ``owners[i]`` for the pool's lifetime.

    ``calls`` are functions of (worker index, argument) that the children inherit through fork (closures
    over the runtime's objects are fine: they are never pickled). :meth:`map` runs one of them for many
    workers, each in its owner, all owners at once, and returns the results in the order of the jobs.
    """

    def __init__(self, calls: dict[str, Call], owners: Sequence[int], threads: int = 1):
        if not fork_available():
            raise PoolError("worker processes need the 'fork' start method, which this platform does not have")
        self.owners = list(owners)
        self.processes = max(self.owners) + 1 if self.owners else 0
        self.threads = threads
        ctx = mp.get_context("fork")
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._lifeline = Lifeline()
        hook = death_hook()  # prepared here: the child only calls it
        try:
            for p in range(self.processes):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, name=f"geomesh-worker-{p}", daemon=True,
                                   args=(child, calls, threads, hook, self._lifeline,
                                         [*self._conns, parent]))  # fmt: skip
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
        except BaseException:
            self.close()
            raise

    def map(self, name: str, jobs: Sequence[tuple[int, Any]]) -> list[Any]:
        """Run ``calls[name](i, arg)`` for every ``(i, arg)`` in its owner; results in the order of ``jobs``.

        Warnings a call raised are re-emitted here, in job order; an exception in a call is raised here
        (as :class:`PoolError` with the child's traceback) after every owner has answered."""
        per_proc: dict[int, list[tuple[int, Any]]] = {}
        for i, arg in jobs:
            per_proc.setdefault(self.owners[i], []).append((i, arg))
        for p, batch in per_proc.items():
            self._conns[p].send((name, batch))
        answers: dict[int, tuple[Any, Any, list]] = {}
        failure = None
        for p in per_proc:
            try:
                got = self._conns[p].recv()
            except (EOFError, OSError):
                code = self._procs[p].exitcode
                failure = failure or PoolError(f"worker process {p} died (exit code {code}) while running {name}")
                continue
            for i, value, error, notes in got:
                answers[i] = (value, error, notes)
        out = []
        for i, _ in jobs:
            if i not in answers:
                continue
            value, error, notes = answers[i]
            for message, category in notes:
                warnings.warn(message, category, stacklevel=2)
            if error is not None and failure is None:
                kind, text, tb = error
                failure = PoolError(f"{name} of worker {i} failed in its process: {kind}: {text}\n{tb}")
            out.append(value)
        if failure is not None:
            raise failure
        return out

    def close(self) -> None:
        """Stop the processes (asked first, then terminated if they do not leave within a few seconds)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        self._lifeline.close()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
