"""Spans, idle accounting, and the run folder's two files: ``events.jsonl`` and ``summary.json``.

Every worker's time is a sequence of spans of four kinds (the same in both runtimes):

- ``compute``: the worker trains (inner steps);
- ``straggler_wait``: it waits at the round barrier for slower workers;
- ``comm_wait``: its accelerator is idle while bytes cross the WAN;
- ``other``: anything else (evaluation is not charged to workers).

Per run: straggler idle = Σ straggler_wait / Σ wall, WAN idle = Σ comm_wait / Σ wall, utilisation =
Σ compute / Σ wall, summed over workers. ``events.jsonl`` holds one JSON object per line with a ``type``
(``run``, ``plan``, ``span``, ``round``, ``eval``, ``fault``, ``warning``); see docs/formats.md.

Sinks: ``Telemetry(path, sinks=[...])`` (or ``add_sink``) hands every emitted record to each sink's
``write(record)`` as well, e.g. the TensorBoard and W&B sinks of :mod:`geomesh.telemetry_sinks`
(docs/ecosystem.md); ``close`` closes them. The JSONL file needs no sink and no extra package.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, Protocol

SPAN_KINDS = ("compute", "straggler_wait", "comm_wait", "other")


class Sink(Protocol):
    """Receives every record that :meth:`Telemetry.emit` writes (TensorBoard, W&B, a test's list, ...)."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class Telemetry:
    """Collects spans and evaluations for one run and streams them to ``events.jsonl`` and to any sinks.

    ``sinks`` (or :meth:`add_sink` later) receive every emitted record, after the JSONL line is written;
    a sink that raises is dropped with a warning, so a logger never stops a run. ``close`` closes them."""

    def __init__(self, path: Path | None = None, *, append: bool = False, sinks: Iterable[Sink] = ()):
        self.path = path
        self._file: IO[str] | None = None
        if path is not None:
            self._file = open(path, "a" if append else "w", buffering=1)
        self.sinks: list[Sink] = list(sinks)
        self.totals: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(SPAN_KINDS, 0.0))
        self.evals: list[dict[str, Any]] = []
        self.counters: dict[str, float] = defaultdict(float)

    def add_sink(self, sink: Sink) -> None:
        self.sinks.append(sink)

    def emit(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False, default=_jsonable) + "\n")
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as exc:  # a logger must never stop a run
                self.sinks.remove(sink)
                warnings.warn(f"telemetry sink {type(sink).__name__} failed and is switched off: {exc}")

    def span(self, worker: str, kind: str, start: float, end: float, round_index: int) -> None:
        if kind not in SPAN_KINDS:
            raise ValueError(f"unknown span kind {kind!r}")
        if end < start - 1e-12:
            raise ValueError(f"span ends before it starts: {start} > {end}")
        if end - start <= 0:
            return
        self.totals[worker][kind] += end - start
        self.emit({"type": "span", "worker": worker, "kind": kind, "start": start, "end": end, "round": round_index})

    def evaluation(self, time_s: float, tokens: int, round_index: int, val_loss: float) -> None:
        record = {"type": "eval", "time": time_s, "tokens": tokens, "round": round_index, "val_loss": val_loss}
        self.evals.append(record)
        self.emit(record)

    def count(self, name: str, amount: float = 1.0) -> None:
        self.counters[name] += amount

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as exc:
                warnings.warn(f"telemetry sink {type(sink).__name__} failed to close: {exc}")

    # ---- checkpoints: what a resumed (or joining) run needs to go on with the same totals -----------
    def state_dict(self) -> dict[str, Any]:
        """Span totals per worker, evaluations and counters (copies)."""
        return {"totals": {w: dict(t) for w, t in self.totals.items()}, "evals": list(self.evals),
                "counters": dict(self.counters)}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals.clear()
        for w, t in state["totals"].items():
            self.totals[w] = dict(t)
        self.evals[:] = [dict(e) for e in state["evals"]]
        self.counters.clear()
        self.counters.update(state["counters"])

    # ---- summaries -----------------------------------------------------------------------------
    def idle_fractions(self) -> dict[str, float]:
        wall = sum(sum(t.values()) for t in self.totals.values())
        if wall <= 0:
            return {"straggler_idle_frac": 0.0, "wan_idle_frac": 0.0, "utilization": 0.0}
        total = {k: sum(t[k] for t in self.totals.values()) for k in SPAN_KINDS}
        return {
            "straggler_idle_frac": total["straggler_wait"] / wall,
            "wan_idle_frac": total["comm_wait"] / wall,
            "utilization": total["compute"] / wall,
        }

    def per_worker(self) -> dict[str, dict[str, float]]:
        return {w: {**t, "wall": sum(t.values())} for w, t in self.totals.items()}

    def time_to_target(self, target: float | None) -> float | None:
        return time_to_target(self.evals, target)


def time_to_target(evals: list[dict[str, Any]], target: float | None) -> float | None:
    """The first evaluation time at which the validation loss is at or below ``target``."""
    if target is None:
        return None
    for e in evals:
        if e["val_loss"] <= target:
            return float(e["time"])
    return None


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if hasattr(x, "to_json"):
        return x.to_json()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def clean_floats(obj: Any) -> Any:
    """Replace NaN/inf by None so that summaries are strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_floats(v) for v in obj]
    return obj


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(clean_floats(data), f, indent=2, default=_jsonable, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_events(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
