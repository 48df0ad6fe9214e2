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
  when workers train in their own processes (runtime/emulated/parallel.py), like θ.

Modeled time (the same accounting as the plain round, :meth:`EmulatedRun._barrier_spans`): the exchange of
round r leaves when the slowest worker has finished round r (the all-gather needs every payload) and takes
the WAN model's time X_r; round r+1 starts at that moment. Worker i computes until it reaches its apply
step (``reach_i``), waits ``max(0, X_r − reach_i)`` for the update (``comm_wait``), computes the rest, and
waits at the end of the round for the slowest worker (``straggler_wait``). So a round lasts
max(compute, exchange) instead of compute + exchange. The apply step is the plan's (from what the plan
expects the exchange in flight to take, :attr:`EmulatedOverlap.planned_in_flight_s`, as a distributed rank
takes it), X_r what the exchange takes on the cluster's WAN (``wan.actual``): on a WAN slower than the plan
assumes, workers reach their apply step before the update and wait. The last round's exchange has no next round to hide
under: it is waited for at the end of the run (:meth:`EmulatedOverlap.drain`), in fragments
(:func:`~geomesh.methods.overlap.tail_split`): fragment f leaves when the slowest worker has reached its send
step (or when the WAN is free of the fragment before it), so only what is left of the fragments' exchanges
after the round's compute is waited for. Each exchange in flight (each fragment) is an ``exchange`` event in
``events.jsonl`` (docs/formats.md), which the timeline plot draws under the compute.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...codec import Manifest
from ...methods.overlap import (TailSend, TailSplit, apply_step, eager_start, eager_weights, fragment_codecs,
                               fragment_exchange_s, planned_tokens, tail_split)  # fmt: skip

Tensors = dict[str, torch.Tensor]


class EmulatedOverlap:
    """The overlapped schedule's state in one emulated run: every worker's eager start (``share``: in shared
    memory, for worker processes), the last combined update, and the exchange still in flight."""

    def __init__(self, params: Tensors, n_workers: int, share: bool = False, start_kind: str = "own",
                 make_codec: Callable[[Manifest], Any] | None = None, tail_fragments: int | None = None):  # fmt: skip
        self.start_kind = start_kind  # geomesh.overlap_start
        self.manifest = Manifest.from_tensors(params)
        self.make_codec = make_codec  # the method's codec on a manifest (a fragment's)
        self.tail_fragments = tail_fragments  # geomesh.overlap_tail_fragments (None: the rule; 1: no split)
        self._fragment_codecs: dict[tuple, list[Any]] = {}
        self._split: TailSplit | None = None
        self._send_at: dict[int, list[int] | None] = {}
        self.starts: list[Tensors] = []
        for _ in range(n_workers):
            start = {k: v.detach().clone() for k, v in params.items()}
            if share:
                for t in start.values():
                    t.share_memory_()
            self.starts.append(start)
        self.last: Tensors | None = None  # the last combined update (the others' most recent direction)
        self.in_flight_s = 0.0  # modeled seconds of the exchange on the wire when the next round starts
        # what the plan expects of it (its WAN: the declared or the measured one): the apply steps and the last
        # round's split are taken from this, as a distributed rank takes them; the clock from the other
        self.planned_in_flight_s = 0.0
        self._actual_x: tuple[float, ...] | None = None  # the last round's fragments on the cluster's WAN
        self._apply_at: dict[int, int] = {}
        self._steps: dict[int, int] = {}

    # ---- a round's jobs ---------------------------------------------------------------------------
    def tail_split(self, method: Any, wan: Any, modeled_payload: int, round_s: float,
                   actual: Any = None) -> TailSplit | None:  # fmt: skip
        """The fragments of the last round's exchange over the live workers' ``wan`` (the plan's; None: one
        exchange), for a round of ``round_s`` planned compute with the exchange in flight; ``actual``: the WAN
        the cluster really has, which times the fragments (default: ``wan``)."""
        split = tail_split(method, wan, self.manifest, modeled_payload, self.tail_fragments, round_s,
                           self.planned_in_flight_s)  # fmt: skip
        self._actual_x = None
        if split is not None and actual is not None:
            self._actual_x = fragment_exchange_s(method, actual, self.manifest, modeled_payload, split.names)
        return split

    def with_apply_steps(self, jobs: list[tuple[int, tuple]], entries: list[Any], steps: list[int],
                         split: TailSplit | None = None) -> list:  # fmt: skip
        """The round's phase jobs, each with its apply step appended (from the plan's predicted step time,
        as the distributed runtime computes it), and for the last round (``split``) the steps after which
        its fragments leave."""
        out = []
        self._apply_at, self._steps, self._send_at, self._split = {}, {}, {}, split
        for (i, job), wp, h in zip(jobs, entries, steps):
            step_s = wp.compute_s / max(wp.inner_steps, 1)
            k = apply_step(self.planned_in_flight_s, step_s, h)
            at = split.send_steps(step_s, h, k) if split is not None else None
            self._apply_at[i], self._steps[i], self._send_at[i] = k, h, at
            out.append((i, (*job, k, split, at)))
        return out

    def codecs_of(self, split: TailSplit, codec: Any) -> list[Any]:
        """One codec per fragment of ``split``, like ``codec`` (kept: the same split is asked for by every
        worker of the round)."""
        if split.names not in self._fragment_codecs:
            self._fragment_codecs = {split.names: fragment_codecs(self.make_codec, codec.manifest, split)}
        return self._fragment_codecs[split.names]

    def local_phase(self, method: Any, i: int, worker: Any, job: tuple, params: Tensors, codec: Any,
                    lr_at: Any) -> tuple[Any, Any]:  # fmt: skip
        """Worker ``i``'s overlapped round; θ (``params``) already holds the update that was in flight. The
        last round returns one payload per fragment."""
        h, batch = job[0], job[1]
        apply_at, split, at = job[-3:]
        tail = TailSend(split, at, self.codecs_of(split, codec)) if split is not None else None
        return method.local_phase_overlapped(worker, h, batch, self.starts[i], apply_at, lambda: params, codec,
                                             lr_at, tail)  # fmt: skip

    # ---- the end of a round -----------------------------------------------------------------------
    @torch.no_grad()
    def finish(self, method: Any, outer: Any, combiner: Any, arrived: list[bytes], own: dict[int, bytes | None],
               names: list[str], entries: list[Any], steps: list[int],
               combine_arrived: Any = None) -> None:  # fmt: skip
        """Every worker's eager start for the next round (from θ_r and the payload it sent, ``own``, decoded by
        ``combiner``), then the outer step with the payloads that ``arrived``, combined by ``combine_arrived``
        (the round's exchange: ``combiner`` all-gathered, or the sharded exchange; as
        :meth:`OuterLoopMethod.apply`)."""
        device = next(iter(outer.params.values())).device
        weights = eager_weights(planned_tokens(entries, steps), method.weighting)
        for i, start in enumerate(self.starts):
            payload = own.get(i)
            mine = combiner.combine([payload], device=device) if payload is not None else None
            new = eager_start(outer, mine, self.last, weights.get(names[i], 0.0), self.start_kind)
            for name, t in start.items():
                t.copy_(new[name])
        if arrived:
            combined = (combine_arrived or combiner).combine(arrived, device=device)
            outer.step(combined)
            self.last = combined

    @torch.no_grad()
    def finish_tail(self, outer: Any, combiners: list[Any], arrived: list[list[bytes]]) -> None:
        """The last round's outer step: each fragment's payloads combined by its codec, one step on the union
        (a fragment no payload arrived for keeps θ and its momentum)."""
        device = next(iter(outer.params.values())).device
        combined: Tensors = {}
        for combiner, payloads in zip(combiners, arrived):
            if payloads:
                combined.update(combiner.combine(payloads, device=device))
        if combined:
            outer.step(combined)
        if len(combined) == len(outer.params):
            self.last = combined

    def spans(self, run: Any, compute: dict[int, float], exchange_s: float) -> float:
        """Spans of one overlapped round starting at ``run.clock``; returns its length. ``compute`` maps
        worker -> its compute seconds; ``exchange_s`` is this round's exchange, which goes on the wire at the
        round's end and is in flight during the next round (what the plan expects of it is
        :attr:`planned_in_flight_s`, the same unless the runtime says otherwise: a WAN not the plan's)."""
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
        if self._split is not None and exchange_s > 0:
            self.in_flight_s = self.planned_in_flight_s = self._tail_spans(run, compute, waits, length)
            return length
        if exchange_s > 0:
            tel.emit({"type": "exchange", "round": r, "start": t0 + length, "end": t0 + length + exchange_s,
                      "workers": [names[i] for i in compute]})  # fmt: skip
        self.in_flight_s = self.planned_in_flight_s = exchange_s
        return length

    def _tail_spans(self, run: Any, compute: dict[int, float], waits: dict[int, float], length: float) -> float:
        """The last round's fragments on the wire: fragment f leaves when the slowest worker has taken it (its
        send step, after any wait for the update that was in flight) and the WAN has carried the fragment
        before it; returns how long after the round's compute the last one arrives."""
        split, names, t0 = self._split, run._names(), run.clock
        wire = self.in_flight_s  # the previous round's exchange holds the WAN until then
        last = split.fragments - 1
        for f, x in enumerate(self._actual_x or split.exchange_s):
            ready = length if f == last else max(
                c * self._send_at[i][f] / self._steps[i] + waits[i] if self._steps.get(i) else c + waits[i]
                for i, c in compute.items())  # fmt: skip
            start = max(ready, wire)
            wire = start + x
            run.telemetry.emit({"type": "exchange", "round": run.rounds, "start": t0 + start, "end": t0 + wire,
                                "workers": [names[i] for i in compute], "fragment": f})  # fmt: skip
        return max(0.0, wire - length)

    def drain(self, run: Any, live: list[int]) -> float:
        """The exchange in flight, waited for by every live worker (``comm_wait``): the last round's, which no
        round hides, or one before a checkpoint (the next round then starts from θ, as a plain round);
        returns its length."""
        tail, t0 = self.in_flight_s, run.clock
        for i, name in enumerate(run._names()):
            run.telemetry.span(name, "comm_wait" if i in live else "other", t0, t0 + tail, run.rounds)
        self.in_flight_s = self.planned_in_flight_s = 0.0
        return tail

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (taken after :meth:`drain`, or after the last round): the last combined
        update (``mixture`` starts, a dropped worker's estimate) and the exchange still in flight."""
        return {"last": self.last, "in_flight_s": self.in_flight_s, "planned_in_flight_s": self.planned_in_flight_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last, self.in_flight_s = state["last"], float(state["in_flight_s"])
        self.planned_in_flight_s = float(state.get("planned_in_flight_s", self.in_flight_s))
