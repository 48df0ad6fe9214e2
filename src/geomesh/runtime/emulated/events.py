"""The asynchronous baseline (``async-local-sgd``) in the emulated runtime: an event queue ordered by modeled
time, where a worker's update lands at the parameter server when its upload arrives."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ...planner import plan_uniform
from ...worker import inner_lr
from .cluster import Cluster
from .core import EmulatedCore


class EventsLoop(EmulatedCore):
    """Asynchronous Local-SGD's events (one event, one worker's update, counts as a round)."""

    def _run_async(self, cluster: Cluster) -> dict[str, Any]:
        """An event queue ordered by modeled time: a worker's update lands when its upload arrives at the
        parameter server, computed from the (by then stale) parameters it pulled when it started."""
        from ...methods.async_local_sgd import (NO_CHECKPOINTS, AsyncLocalSGDMethod, dynamic_local_updates,
                                                modeled_arrivals, modeled_cycle)
        from ...outer import DelayedNesterov

        method: AsyncLocalSGDMethod = self.method  # type: ignore[assignment]
        if self.scenario.faults:
            warnings.warn(f"{method.name}: the emulated runtime does not inject faults into the asynchronous "
                          f"baseline; the scenario's {len(self.scenario.faults)} fault(s) are ignored")  # fmt: skip
        if self.checkpoint_every > 0:
            warnings.warn(f"{method.name}: {NO_CHECKPOINTS}")
        tr = self.scenario.training
        n = len(cluster.workers)
        params = cluster.global_params
        outer = DelayedNesterov(params, lr=tr.outer_lr, momentum=tr.outer_momentum, n_workers=n, c=method.c)
        fp32_bytes = 4 * self.scenario.timing().params
        steps = dynamic_local_updates(cluster.profiles, tr.batch, tr.inner_steps)
        plan = plan_uniform(cluster.profiles, tr.batch, tr.inner_steps)
        for wp, h in zip(plan.workers, steps):
            wp.inner_steps = h
        self._record_plan(plan)
        compute, transfer = modeled_cycle(self.scenario, cluster.profiles, steps, method.server)
        order = modeled_arrivals(compute, transfer)  # the event queue: arrivals by modeled time
        seq = self.scenario.model.seq_len
        names = self._names()
        spans: list[tuple[str, str, float, float, int]] = []
        deltas: list[dict[str, torch.Tensor] | None] = [None] * n

        def start(i: int, t: float) -> None:
            """Worker i pulls θ at time t, trains, and its upload will arrive at the server later (``order``)."""
            worker, h = cluster.workers[i], steps[i]
            begin = self.tokens_done
            tokens = h * tr.batch * seq

            def lr_at(k: int) -> float:
                return inner_lr(begin + k / h * tokens, self.budget, tr)

            worker.load_global(params)
            result = worker.train(h, tr.batch, lr_at)
            deltas[i] = worker.pseudo_gradient(params) if result.finite else None
            spans.append((names[i], "compute", t, t + compute[i], self.rounds))
            spans.append((names[i], "comm_wait", t + compute[i], t + compute[i] + transfer[i], self.rounds))

        for i in range(n):
            start(i, 0.0)
        last_loss = self._evaluate(cluster)
        while self.tokens_done < self.budget:
            arrival, i = next(order)
            self.clock = arrival
            if deltas[i] is not None:
                outer.step(deltas[i])
            else:
                self.telemetry.count("dropped_updates")
            self.tokens_done += steps[i] * tr.batch * seq
            self.bytes_sent += 2 * fp32_bytes if i != method.server else 0  # push Δ, pull θ
            self.proxy_bytes_sent += 8 * sum(t.numel() for t in params.values()) if i != method.server else 0
            self.rounds += 1
            if self.rounds % (tr.eval_every_rounds * n) == 0 or self.tokens_done >= self.budget:
                last_loss = self._evaluate(cluster)
            self._progress(last_loss)
            if self.tokens_done < self.budget:
                spans.append((names[i], "comm_wait", arrival, arrival + transfer[i], self.rounds))
                start(i, arrival + transfer[i])
        # work still in flight when the budget ran out is cut at the end of the run
        for name, kind, a, b, r in sorted(spans, key=lambda x: (x[2], x[0])):
            if a < self.clock:
                self.telemetry.span(name, kind, a, min(b, self.clock), r)
        return {"payload_bytes_per_worker": fp32_bytes, "collective": "push_pull", "server": names[method.server],
                "dyLU_inner_steps": dict(zip(names, steps))}  # fmt: skip
