"""The last overlapped round's exchange in fragments on one rank (docs/overlap.md), the part of the overlapped
round (:class:`.overlap.RankOverlap`) that sends the exchange nothing is left to hide under. The round is split
as the emulated runtime splits it (:func:`~geomesh.methods.overlap.tail_split`); the leader launches each
fragment's collective at its send step, inside the round, and when the round ends waits for them in order, the
WAN shaper holding fragment f from when it left or when fragment f−1 was released, whichever is later, as the WAN
would carry them one after another. The region's ranks share each fragment and combine it.

:class:`TailExchange` owns the split, each fragment's codec and (a leader) each fragment's collective in flight;
the overlapped round hands it the split's inputs, how to launch one payload's collective, and how to combine the
bytes that arrive, and takes back one update of θ."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ...methods.overlap import TailSend, TailSplit, fragment_codecs, tail_fragments, tail_split

Tensors = dict[str, torch.Tensor]
# launch one payload's collective, made by the codec given, and return (work, the buffer it fills)
Launch = Callable[[bytes | None, Any], tuple[Any, torch.Tensor]]


class TailExchange:
    """The last round's fragments on one rank of ``run``: ``method`` makes each fragment's codec over its part of
    ``manifest`` (with the run's ``key``); ``start`` launches one payload's collective; ``shaper`` holds the
    fragments to the WAN model's time; ``dense``: payloads summed by an all-reduce."""

    def __init__(self, run: Any, method: Any, manifest: Any, key: Any, shaper: Any, dense: bool, start: Launch):
        self.run, self.method, self.manifest, self.key = run, method, manifest, key
        self.shaper, self.dense, self.start = shaper, dense, start
        self.split: TailSplit | None = None  # the fragments of the exchange now in flight (None: none)
        self.codecs: list[Any] = []
        self._in_flight: dict[int, tuple[Any, torch.Tensor, float, float]] = {}  # f -> work, buffer, since, at

    def split_for(self, wan: Any, modeled_payload: int, round_s: float, in_flight_s: float) -> TailSplit | None:
        """The fragments of the last round's exchange (None: one exchange), as the emulated runtime splits it:
        a round of ``round_s`` planned compute, with an exchange of ``in_flight_s`` in flight."""
        return tail_split(self.method, wan, self.manifest, modeled_payload, tail_fragments(self.run.scenario),
                          round_s, in_flight_s)  # fmt: skip

    def send(self, split: TailSplit, step_s: float, steps: int, apply_at: int) -> TailSend:
        """This rank's part of ``split``: the plan's send steps (steps of ``step_s``, the exchange in flight
        applied at step ``apply_at``), the fragments' codecs, and (a leader) the launch of each fragment's
        collective as it leaves."""
        self.split, self._in_flight = split, {}
        self.codecs = fragment_codecs(lambda m: self.method.make_codec(m, self.run.scenario, key=self.key),
                                      self.manifest, split)  # fmt: skip
        at = split.send_steps(step_s, steps, apply_at)
        return TailSend(split, at, self.codecs, self.launch if self.run.is_leader else None)

    def launch(self, f: int, payload: bytes | None) -> None:
        """The leader launches fragment ``f``'s collective and goes on training."""
        self.run.transport.op = f"fragment {f} of the exchange of round {self.run.rounds + 1} (overlapped)"
        work, buffer = self.start(payload, self.codecs[f])
        self._in_flight[f] = (work, buffer, time.perf_counter(), self.run._now())

    def arrive(self, combine: Callable[[torch.Tensor, Any], Tensors | None]) -> Tensors | None:
        """Every fragment, in order (the leader waits for each collective and the shaper), shared inside the
        region and combined (``combine``: the update in the bytes of one fragment's codec); their combined
        updates, as one update of θ (None: none arrived)."""
        run = self.run
        combined: Tensors = {}
        released = 0.0
        for f, codec in enumerate(self.codecs):
            exchanged = None
            if run.is_leader:
                work, exchanged, since, launched_at = self._in_flight[f]
                run.transport.op = f"fragment {f} of the exchange of round {run.rounds} (overlapped)"
                work.wait()
                since = max(since, released)
                self.shaper.hold(self._hold_s(codec), since)
                released = since + self._hold_s(codec)
                if run.rank == 0:
                    run.telemetry.emit({"type": "exchange", "round": run.rounds - 1, "start": launched_at,
                                        "end": run._now(), "workers": [r.name for r in run.scenario.regions],
                                        "fragment": f})  # fmt: skip
            if run.region_group is not None:
                exchanged = run.transport.broadcast(exchanged if exchanged is not None else self._empty(codec),
                                                    run.leader, run.region_group)  # fmt: skip
            combined.update(combine(exchanged, codec) or {})
        self.split, self._in_flight = None, {}
        return combined or None

    def _empty(self, codec: Any) -> torch.Tensor:
        """The buffer a non-leader receives one fragment's exchanged payloads into, from its leader."""
        if self.dense:
            return torch.empty(codec.manifest.numel + 1, dtype=torch.float32, device=self.run.device)
        return torch.empty(len(self.run.layout.leaders) * codec.payload_nbytes(), dtype=torch.uint8)

    def _hold_s(self, codec: Any) -> float:
        """What the WAN shaper holds the exchange of one fragment's payloads for."""
        if self.dense:
            return self.shaper.allreduce_s(4 * (codec.manifest.numel + 1))
        return self.shaper.allgather_s(codec.payload_nbytes())
