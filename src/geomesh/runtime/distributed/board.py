"""The run board: where a finished run leaves word for a region that arrives after it.

A region started (or restarted) after the others finished would ask the quorum service for a quorum that never
forms, and fail after ``--timeout`` although the run succeeded. So the quorum service also keeps a small board
(a ``torch.distributed`` TCPStore beside the Lighthouse, on the next port: ``http://HOST:P`` -> ``HOST:P+1``).
At the end of a run the live leaders post ``finished`` (the round, the regions at the end, the checksum of θ);
a region that cannot get a quorum reads the board, and if its run finished, it stops at once with exit 0 and
one line. A board that cannot be reached is no board: the region waits for its quorum as before.

The board is outside the trust boundary: anyone who reaches the port can write to it. A note is JSON bytes,
bounded, signed with the run key (an HMAC over the run and the note) when the run has one; a note that does not
parse or whose tag does not hold is ignored with a warning. Nothing read from it is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

NOTE_LIMIT = 4096  # bytes: a note is a few fields


def board_address(lighthouse: str) -> tuple[str, int] | None:
    """The board's (host, port) beside the quorum service at ``lighthouse`` (``http://HOST:PORT``)."""
    try:
        parts = urlsplit(lighthouse if "//" in lighthouse else f"http://{lighthouse}")
        return (parts.hostname, parts.port + 1) if parts.hostname and parts.port else None
    except ValueError:
        return None


def start_board(host: str, port: int):
    """(the quorum service) The board's store, listening on ``host:port``."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _key(run: str) -> str:
    return f"geomesh/finished/{hashlib.sha256(run.encode()).hexdigest()[:32]}"


def _tag(key: bytes | None, run: str, body: bytes) -> str:
    return hmac.new(key, b"geomesh-board\0" + run.encode() + b"\0" + body, hashlib.sha256).hexdigest() if key else ""


class RunBoard:
    """A region's view of the board (a client of the store; a few seconds at most per call)."""

    def __init__(self, lighthouse: str, run: str, key: bytes | None, timeout_s: float = 3.0):
        self.run, self.key = run, key
        self.address = board_address(lighthouse)
        self.timeout_s = timeout_s
        self._store = None

    def _open(self):
        if self._store is None and self.address is not None:
            from torch.distributed import TCPStore

            try:
                self._store = TCPStore(self.address[0], self.address[1], is_master=False,
                                       timeout=timedelta(seconds=self.timeout_s))  # fmt: skip
            except Exception:  # noqa: BLE001 - no board (an older quorum service, a closed port): none is used
                self.address = None
        return self._store

    def post_finished(self, note: dict[str, Any]) -> None:
        """Leave word that this run finished (``note``: JSON: the round, the regions at the end, the checksum)."""
        store = self._open()
        if store is None:
            return
        body = json.dumps({"run": self.run, **note}, sort_keys=True).encode()
        try:
            store.set(_key(self.run), json.dumps({"body": body.decode(), "tag": _tag(self.key, self.run, body)}))
        except Exception:  # noqa: BLE001 - the board is a courtesy to late regions, never the run's failure
            pass

    def finished(self) -> dict[str, Any] | None:
        """The note of this run's end, if the board holds a genuine one."""
        store = self._open()
        if store is None:
            return None
        try:
            if not store.check([_key(self.run)]):
                return None
            raw = store.get(_key(self.run))
        except Exception:  # noqa: BLE001 - unreachable now: no word
            return None
        return read_note(raw, self.run, self.key)


def read_note(raw: bytes, run: str, key: bytes | None) -> dict[str, Any] | None:
    """A note from the board (a peer's bytes: data), or None when it is malformed, another run's or forged."""
    why = None
    try:
        if len(raw) > NOTE_LIMIT:
            raise ValueError(f"{len(raw)} bytes, over {NOTE_LIMIT}")
        outer = json.loads(raw)
        body = outer["body"].encode()
        if key is not None and not hmac.compare_digest(str(outer.get("tag", "")), _tag(key, run, body)):
            raise ValueError("its tag does not hold (another key, or forged)")
        note = json.loads(body)
        if not isinstance(note, dict) or note.get("run") != run or not isinstance(note.get("round"), int):
            raise ValueError("not a note of this run")
        return note
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        why = str(exc)[:200]
    print(f"warning: the run board holds a note this region ignores: {why}", file=sys.stderr, flush=True)
    return None
