"""A rank's wall clock and the spans of its worker's time (``compute``, ``straggler_wait``, ``comm_wait``,
``other``: docs/design/architecture.md, "Time accounting"), as every loop of the distributed runtime keeps them."""

from __future__ import annotations

import time
from typing import Any


class WallClock:
    """A rank's wall clock and the spans of its worker's time: seconds since the start barrier (or the time
    a resumed or healed run had reached), and a cursor up to which the worker's time is accounted."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.cursor = 0.0
        self.spans: list[tuple[str, float, float, int]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def start(self) -> None:
        """Time 0 is now (every rank calls this right after the start barrier)."""
        self.t0, self.cursor = time.perf_counter(), 0.0

    def resume(self, at: float) -> None:
        """The clock goes on from ``at`` seconds (a checkpoint's time, or a live region's when healed)."""
        self.t0, self.cursor = time.perf_counter() - at, at

    def take_spans(self) -> list[tuple[str, float, float, int]]:
        """The spans recorded since the last call (what a rank reports with its round)."""
        spans, self.spans = self.spans, []
        return spans


def record_spans(telemetry: Any, worker: str, spans: Any) -> None:
    """A worker's spans (as :meth:`WallClock.take_spans` gave them) into ``telemetry``'s records. They arrive from
    other ranks and regions, so they are data: a malformed one is skipped, never raised on (the records lose it;
    the run goes on)."""
    for span in spans if isinstance(spans, list) else []:
        try:
            kind, start, end, round_index = span
            telemetry.span(worker, kind, float(start), float(end), int(round_index))
        except (TypeError, ValueError):
            continue
