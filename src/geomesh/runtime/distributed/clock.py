"""A rank's wall clock and the spans of its worker's time (``compute``, ``straggler_wait``, ``comm_wait``,
``other``: DESIGN.md's time accounting), as every loop of the distributed runtime keeps them."""

from __future__ import annotations

import time


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
