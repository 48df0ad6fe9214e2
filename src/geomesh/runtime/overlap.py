"""The overlapped round in the emulated runtime: who starts where, when the update is applied, and what the
modeled clock charges (docs/overlap.md; the algorithm itself is :mod:`geomesh.methods.overlap`).

The emulated runtime trains the workers of a round one after another (or in worker processes), so the
combined update of round r is known before round r+1 is trained. The overlapped schedule is replayed
exactly as the distributed runtime runs it in real time:

- after round r, every worker's eager start for round r+1 is computed from θ_r and its own payload
  (:func:`~geomesh.methods.overlap.eager_start`, ``geomesh.overlap_start``), *then* the outer step θ_{r+1} is taken: the same operations
  in the same order as a rank of the distributed runtime, which computes its start when its round ends and
  takes the outer step when the exchange arrives;
- in round r+1 a worker trains ``apply_at`` steps from its start, rebases onto θ_{r+1} and trains the rest
  (:meth:`~geomesh.methods.base.OuterLoopMethod.local_phase_overlapped`); the starts live in shared memory
  when workers train in their own processes (runtime/parallel.py), like θ.

Modeled time (the same accounting as the plain round, :meth:`EmulatedRun._barrier_spans`): the exchange of
round r leaves when the slowest worker has finished round r (the all-gather needs every payload) and takes
the WAN model's time X_r; round r+1 starts at that moment. Worker i computes until it reaches its apply
step (``reach_i``), waits ``max(0, X_r − reach_i)`` for the update (``comm_wait``), computes the rest, and
waits at the end of the round for the slowest worker (``straggler_wait``). So a round lasts
max(compute, exchange) instead of compute + exchange. The last round's exchange has no next round to hide
under: it is waited for at the end of the run (:meth:`EmulatedOverlap.drain`). Each exchange in flight is an
``exchange`` event in ``events.jsonl`` (docs/formats.md), which the timeline plot draws under the compute.
"""

from __future__ import annotations

from typing import Any

import torch

from ..methods.overlap import apply_step, eager_start, eager_weights, planned_tokens

Tensors = dict[str, torch.Tensor]


class EmulatedOverlap:
    """The overlapped schedule's state in one emulated run: every worker's eager start (``share``: in shared
    memory, for worker processes), the last combined update, and the exchange still in flight."""

    def __init__(self, params: Tensors, n_workers: int, share: bool = False, start_kind: str = "own"):
        self.start_kind = start_kind  # geomesh.overlap_start
        self.starts: list[Tensors] = []
        for _ in range(n_workers):
            start = {k: v.detach().clone() for k, v in params.items()}
            if share:
                for t in start.values():
                    t.share_memory_()
            self.starts.append(start)
        self.last: Tensors | None = None  # the last combined update (the others' most recent direction)
        self.in_flight_s = 0.0  # modeled seconds of the exchange on the wire when the next round starts
        self._apply_at: dict[int, int] = {}
        self._steps: dict[int, int] = {}

    # ---- a round's jobs ---------------------------------------------------------------------------
    def with_apply_steps(self, jobs: list[tuple[int, tuple]], entries: list[Any], steps: list[int]) -> list:
        """The round's phase jobs, each with its apply step appended (from the plan's predicted step time,
        as the distributed runtime computes it)."""
        out = []
        self._apply_at, self._steps = {}, {}
        for (i, job), wp, h in zip(jobs, entries, steps):
            k = apply_step(self.in_flight_s, wp.compute_s / max(wp.inner_steps, 1), h)
            self._apply_at[i], self._steps[i] = k, h
            out.append((i, (*job, k)))
        return out

    def local_phase(self, method: Any, i: int, worker: Any, job: tuple, params: Tensors, codec: Any,
                    lr_at: Any) -> tuple[bytes | None, Any]:  # fmt: skip
        """Worker ``i``'s overlapped round; θ (``params``) already holds the update that was in flight."""
        h, batch, apply_at = job[0], job[1], job[-1]
        return method.local_phase_overlapped(worker, h, batch, self.starts[i], apply_at, lambda: params, codec, lr_at)

    # ---- the end of a round -----------------------------------------------------------------------
    @torch.no_grad()
    def finish(self, method: Any, outer: Any, combiner: Any, arrived: list[bytes], own: dict[int, bytes | None],
               names: list[str], entries: list[Any], steps: list[int]) -> None:  # fmt: skip
        """Every worker's eager start for the next round (from θ_r and the payload it sent, ``own``), then the
        outer step with the payloads that ``arrived`` (as :meth:`OuterLoopMethod.apply`)."""
        device = next(iter(outer.params.values())).device
        weights = eager_weights(planned_tokens(entries, steps), method.weighting)
        for i, start in enumerate(self.starts):
            payload = own.get(i)
            mine = combiner.combine([payload], device=device) if payload is not None else None
            new = eager_start(outer, mine, self.last, weights.get(names[i], 0.0), self.start_kind)
            for name, t in start.items():
                t.copy_(new[name])
        if arrived:
            combined = combiner.combine(arrived, device=device)
            outer.step(combined)
            self.last = combined

    def spans(self, run: Any, compute: dict[int, float], exchange_s: float) -> float:
        """Spans of one overlapped round starting at ``run.clock``; returns its length. ``compute`` maps
        worker -> its compute seconds; ``exchange_s`` is this round's exchange, which goes on the wire at the
        round's end and is in flight during the next round."""
        tel, names, t0, r = run.telemetry, run._names(), run.clock, run.rounds
        waits, reach = {}, {}
        for i, c in compute.items():
            h = self._steps.get(i, 0)
            reach[i] = c * self._apply_at.get(i, 0) / h if h else c
            waits[i] = max(0.0, self.in_flight_s - reach[i]) if self._apply_at.get(i, 0) > 0 else 0.0
        length = max(c + waits[i] for i, c in compute.items())
        for i, name in enumerate(names):
            if i not in compute:
                tel.span(name, "other", t0, t0 + length, r)
                continue
            end = t0 + compute[i] + waits[i]
            if waits[i] > 0:
                a, b = t0 + reach[i], t0 + reach[i] + waits[i]
                tel.span(name, "compute", t0, a, r)
                tel.span(name, "comm_wait", a, b, r)
                tel.span(name, "compute", b, end, r)
            else:  # the update arrived before the worker needed it: one unbroken compute span
                tel.span(name, "compute", t0, end, r)
            tel.span(name, "straggler_wait", end, t0 + length, r)
        if exchange_s > 0:
            tel.emit({"type": "exchange", "round": r, "start": t0 + length, "end": t0 + length + exchange_s,
                      "workers": [names[i] for i in compute]})  # fmt: skip
        self.in_flight_s = exchange_s
        return length

    def drain(self, run: Any, live: list[int]) -> float:
        """The exchange in flight, waited for by every live worker (``comm_wait``): the last round's, which no
        round hides, or one before a checkpoint (the next round then starts from θ, as a plain round);
        returns its length."""
        tail, t0 = self.in_flight_s, run.clock
        for i, name in enumerate(run._names()):
            run.telemetry.span(name, "comm_wait" if i in live else "other", t0, t0 + tail, run.rounds)
        self.in_flight_s = 0.0
        return tail

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (taken after :meth:`drain`, or after the last round): the last combined
        update (``mixture`` starts, a dropped worker's estimate) and the exchange still in flight."""
        return {"last": self.last, "in_flight_s": self.in_flight_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last, self.in_flight_s = state["last"], float(state["in_flight_s"])
