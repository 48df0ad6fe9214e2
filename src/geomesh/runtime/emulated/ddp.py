"""The ``ddp`` baseline in the emulated runtime: one inner step per round, the gradient all-reduced across the
live workers (one shared replica takes every worker's batch in turn; in worker processes each gradient is
computed apart and summed in worker order, the same bits)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ...planner import plan_uniform
from ...worker import inner_lr
from ..faults import grads_finite, poison_grads
from .parallel import intra_op_threads, worker_threads
from .cluster import Cluster, LoopState
from .core import EmulatedCore


class DdpLoop(EmulatedCore):
    """DDP's steps (one step is one round)."""

    def _run_ddp(self, cluster: Cluster) -> dict[str, Any]:
        """All replicas stay identical under DDP, so one replica takes every worker's batch in turn: the
        step is the mean of the workers' gradients, exactly what an fp32 all-reduce produces.

        Faults: ``slowdown`` and ``bandwidth`` change the modeled times, ``leave``/``join`` the workers whose
        batches make the step (the step is the mean over the live ones); a ``nan`` fault poisons one worker's
        gradients, and since the all-reduce mixes them before anyone could drop one, the whole step is
        skipped; ``corrupt`` has no payload to damage and is ignored."""
        tr = self.scenario.training
        shared = cluster.workers[0]
        grad_bytes = 4 * self.scenario.timing().params
        loop = LoopState(self.scenario)

        def remake() -> None:
            live = loop.cluster.live()
            wan = loop.cluster.wan(live)
            loop.exchange_s = wan.allreduce_s(grad_bytes)
            loop.actual_s = loop.cluster.actual_wan(live).allreduce_s(grad_bytes)  # (what the clock charges)
            loop.sent = wan.allreduce_bytes_per_worker(grad_bytes, len(live))
            loop.plan = plan_uniform([cluster.profiles[i] for i in live], tr.batch, 1, exchange_bytes=grad_bytes,
                                     exchange_s=loop.exchange_s)  # fmt: skip
            self._record_plan(loop.plan)

        def extra() -> dict[str, Any]:
            return {"payload_bytes_per_worker": grad_bytes, "exchange_s_per_round": loop.actual_s,
                    "collective": "all_reduce"}  # fmt: skip

        self._extra_fn = extra
        if self._resume is not None:
            self._restore(cluster, loop)
        else:
            shared.load_global(cluster.global_params)
            remake()
            loop.last_loss = self._evaluate(cluster)
        shared.model.train()
        pool, gradients = self._ddp_gradients(cluster)
        try:
            self._ddp_steps(cluster, loop, remake, gradients, pool)
            if pool is not None:  # the parent's streams end where the run ended
                self._pull_streams(pool, cluster)
        finally:
            if pool is not None:
                pool.close()
        return extra()

    def _ddp_gradients(self, cluster: Cluster) -> tuple[Any, Callable[[list[int], float], list[float]]]:
        """(worker processes or None, ``gradients(live, weight)``): every live worker's batch through the shared
        replica into its ``.grad``, summed in worker order, and each worker's loss.

        In worker processes each worker's gradient is computed from a zero ``.grad`` into a shared buffer and
        the parent adds them up in worker order: the fp32 adds autograd makes when it accumulates them one
        after another in-process, so both give the same bits (for batches of one proxy micro-batch; larger
        ones accumulate inside a worker and train in-process)."""
        tr = self.scenario.training
        shared = cluster.workers[0]
        n = len(cluster.workers)
        threads = self.options.worker_threads or worker_threads(n)
        processes = min(self.workers_parallel, n)

        def in_process(live: list[int], weight: float) -> list[float]:
            with intra_op_threads(threads):
                return [shared.accumulate_grad(tr.batch, stream=cluster.workers[i].stream, weight=weight)[0]
                        for i in live]  # fmt: skip

        # (fp16: the loss scale lives in this process's scaler, which the gradients must be scaled by)
        if processes <= 1 or tr.batch > shared.max_proxy_micro_batch or shared.scaler is not None:
            return None, in_process
        from .parallel import WorkerPool, assign_owners

        params = list(shared.model.parameters())
        sizes = [p.numel() for p in params]
        rows = torch.zeros(n, sum(sizes)).share_memory_()  # worker i's gradient, flat, in row i
        views = [[v.view_as(p) for v, p in zip(rows[i].split(sizes), params)] for i in range(n)]
        shared.model.share_memory()  # θ: the parent's AdamW step updates it in place, every process reads it

        def grad(i: int, weight: float) -> tuple[float, list[bool]]:
            shared.optimizer.zero_grad(set_to_none=True)  # this process's own .grad
            loss, _ = shared.accumulate_grad(tr.batch, stream=cluster.workers[i].stream, weight=weight)
            for v, p in zip(views[i], params):
                v.copy_(p.grad) if p.grad is not None else v.zero_()
            return loss, [p.grad is None for p in params]

        calls = {"grad": grad, "stream": lambda i, _: cluster.workers[i].stream.state_dict()}
        pool = WorkerPool(calls, assign_owners([1.0] * n, processes), threads=threads)

        def in_processes(live: list[int], weight: float) -> list[float]:
            got = pool.map("grad", [(i, weight) for i in live])
            for k, p in enumerate(params):
                if all(none[k] for _, none in got):
                    p.grad = None
                    continue
                total = views[live[0]][k].clone()
                for i in live[1:]:
                    total.add_(views[i][k])
                p.grad = total
            return [loss for loss, _ in got]

        return pool, in_processes

    @staticmethod
    def _pull_streams(pool: Any, cluster: Cluster) -> None:
        """DDP: bring every worker's data-stream position from its process (the replica and AdamW are here)."""
        states = pool.map("stream", [(i, None) for i in range(len(cluster.workers))])
        for worker, state in zip(cluster.workers, states):
            worker.stream.load_state_dict(state)

    def _ddp_steps(self, cluster: Cluster, loop: LoopState, remake: Callable[[], None],
                   gradients: Callable[[list[int], float], list[float]], pool: Any) -> None:  # fmt: skip
        """DDP's steps until the token budget is spent."""
        tr = self.scenario.training
        shared = cluster.workers[0]
        names = self._names()
        seq = self.scenario.model.seq_len

        def checkpoint_state() -> dict[str, Any]:
            if pool is not None:
                self._pull_streams(pool, cluster)
            return self._state(cluster, loop)

        ignored = {"corrupt": "ddp all-reduces fp32 gradients: there is no payload to corrupt"}
        while self.tokens_done < self.budget:
            effects = self._apply_faults(loop.cluster, ignored)
            if effects.remake:
                remake()
            live = loop.cluster.live()
            shared.optimizer.zero_grad(set_to_none=True)
            bad: dict[int, str] = {}
            for i, loss in zip(live, gradients(live, 1.0 / len(live))):
                if "nan" in effects.once.get(i, ()):
                    loss = poison_grads(shared.model)
                if not math.isfinite(loss):
                    bad[i] = "non-finite loss"
            # fp16: an overflowed gradient is the loss scaler's to skip (it halves its scale), not a bad step
            if not bad and shared.scaler is None and not grads_finite(shared.model):
                bad = dict.fromkeys(live, "non-finite gradient")
            step_tokens = len(live) * tr.batch * seq
            if bad:
                self.telemetry.count("dropped_updates")
                who = ", ".join(names[i] for i in bad)
                self._warn(who, f"{next(iter(bad.values()))}; the all-reduced step is skipped")
                shared.optimizer.zero_grad(set_to_none=True)
            else:
                shared.apply_step(inner_lr(self.tokens_done, self.budget, tr))
            compute = {i: cluster.profiles[i].step_s(wp.micro_batch, wp.accum) * loop.cluster.speed[i]
                       for i, wp in ((i, loop.plan.worker(names[i])) for i in live)}  # fmt: skip
            length = self._barrier_spans(compute, loop.actual_s)
            self.clock += length
            self.bytes_sent += loop.sent * len(live)
            self.tokens_done += step_tokens
            self.rounds += 1
            if self.rounds % tr.inner_steps == 0 or self.tokens_done >= self.budget:
                cluster.global_model.load_state_dict(shared.model.state_dict())
                loop.last_loss = self._evaluate(cluster)
                self._progress(loop.last_loss)
            self._end_round(length, 0 if bad else step_tokens, dict.fromkeys(bad, step_tokens), live, bad)
            self._maybe_checkpoint(checkpoint_state)
