"""The run's records on an elastic region's leader: every leader keeps them all (what a joining region receives
and a new writer rewrites); in a folder regions share, the leader of the lowest-numbered live region writes
``events.jsonl``, rewriting it whole when it takes over; a region whose folder is its own (a host's disk) writes
them there too."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from ... import checkpoint as ckpt
from ...telemetry import _jsonable
from .service import ADVERTISE_ENV


class Records:
    """A telemetry sink that keeps every record (what a joining region receives and a new writer rewrites)."""

    def __init__(self, records: list[dict[str, Any]]):
        self.records = records

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(json.loads(json.dumps(record, default=_jsonable)))

    def close(self) -> None:
        pass


class RunRecords:
    """The records one region's leader keeps (``records``) and, when it is the writer, ``events.jsonl`` in
    ``out_dir`` (None: no folder)."""

    def __init__(self, out_dir: str | os.PathLike | None, region: str, is_leader: bool):
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.region, self.is_leader = region, is_leader
        self.records: list[dict[str, Any]] = []
        self.written = -1  # records already in events.jsonl (-1: not written by this leader, or to be rewritten)
        self._shared_folder = False

    def sink(self) -> Records:
        return Records(self.records)

    def replace(self, records: list[dict[str, Any]]) -> None:
        """The records as another region (a heal) or a checkpoint holds them; rewritten whole at the next write."""
        self.records[:] = records
        self.written = -1

    def claim_folder(self) -> None:
        """(leader) Mark the run folder as used by this region (``DIR/regions/<region>.json``: its host and
        address), so that :meth:`own_folder` can tell a host's own folder from one that regions share."""
        if not self.is_leader or self.out_dir is None:
            return
        mine = {"region": self.region, "host": socket.gethostname(), "address": os.environ.get(ADVERTISE_ENV) or None}
        folder = self.out_dir / "regions"
        folder.mkdir(parents=True, exist_ok=True)
        ckpt.write_atomic(folder / f"{self.region}.json", json.dumps(mine).encode())

    def own_folder(self) -> bool:
        """Whether no other region has used this run folder (a host's own disk, not a folder regions share):
        then this region keeps the run's records and summary there too, whichever region writes them in a
        shared folder. Every region claims the folder before the first quorum; once shared, always shared."""
        if self._shared_folder or self.out_dir is None:
            return False
        folder = self.out_dir / "regions"
        others = [p for p in folder.glob("*.json") if p.stem != self.region] if folder.is_dir() else []
        self._shared_folder = bool(others)
        return not others

    def writes(self, lowest_live: bool) -> bool:
        """Whether this region's leader writes ``events.jsonl`` and ``summary.json``: the lowest-numbered live
        region's (``lowest_live``) in a folder regions share, every region's in its own."""
        return self.is_leader and self.out_dir is not None and (lowest_live or self.own_folder())

    def write_events(self, lowest_live: bool) -> None:
        """The writer's ``events.jsonl``: appended to, or (a new writer) replaced whole, atomically, on disk."""
        if not self.writes(lowest_live):
            self.written = -1
            return
        path = self.out_dir / "events.jsonl"
        lines = [json.dumps(r, allow_nan=False) + "\n" for r in self.records]
        if self.written < 0:  # a new writer: the whole file, replaced atomically and flushed to disk
            ckpt.write_atomic(path, "".join(lines).encode())
        else:
            with open(path, "a") as f:
                f.write("".join(lines[self.written :]))
                f.flush()
                os.fsync(f.fileno())
        self.written = len(lines)
