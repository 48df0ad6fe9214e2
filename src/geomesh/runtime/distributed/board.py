"""The run board: where a finished run leaves word for a region that arrives after it, and where the asynchronous
baseline's parameter server leaves its address for the regions.

A region started (or restarted) after the others finished would ask the quorum service for a quorum that never
forms, and fail after ``--timeout`` although the run succeeded. So the quorum service also keeps a small board:
an HTTP server beside the Lighthouse, on the next port (``http://HOST:P`` -> ``http://HOST:P+1``), bound to the
service's address only. At the end of a run the live leaders post ``finished`` (the round, the regions at the
end, the checksum of θ); a region that asks for a quorum reads the board first, and if its run finished, it stops
at once with exit 0 and one line. A board that cannot be reached is no board: the region waits for its quorum.

The board is outside the trust boundary: anyone who reaches the port can write to it. A note is JSON bytes,
bounded (:data:`NOTE_LIMIT`), kept per run, signed with the run key (an HMAC over the run and the note) when the
run has one; a note that does not parse or whose tag does not hold is ignored with a warning. Nothing read from
it is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

NOTE_LIMIT = 4096  # bytes: a note is a few fields
KINDS = ("finished", "server")  # a run's end; the asynchronous baseline's parameter server's address
RUNS_LIMIT = 1024  # notes a board keeps (the oldest go first)


def board_url(lighthouse: str) -> str | None:
    """The board's URL beside the quorum service at ``lighthouse`` (``http://HOST:PORT``)."""
    try:
        parts = urlsplit(lighthouse if "//" in lighthouse else f"http://{lighthouse}")
        if not parts.hostname or not parts.port:
            return None
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return f"http://{host}:{parts.port + 1}"
    except ValueError:
        return None


class _Notes(BaseHTTPRequestHandler):
    notes: dict[str, bytes]

    def log_message(self, *args: Any) -> None:  # (quiet: the service's output is the operator's)
        pass

    def _key(self) -> str | None:
        kind, _, key = self.path.strip("/").partition("/")
        return f"{kind}/{key}" if kind in KINDS and key.isalnum() and len(key) <= 64 else None

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        note = self.notes.get(self._key() or "")
        self.send_response(200 if note is not None else 404)
        self.end_headers()
        if note is not None:
            self.wfile.write(note)

    def do_PUT(self) -> None:  # noqa: N802 - http.server's name
        key, size = self._key(), int(self.headers.get("Content-Length") or -1)
        if key is None or not 0 < size <= NOTE_LIMIT:
            self.send_response(400)
            self.end_headers()
            return
        body = self.rfile.read(size)
        if len(self.notes) >= RUNS_LIMIT and key not in self.notes:
            self.notes.pop(next(iter(self.notes)))
        self.notes[key] = body
        self.send_response(204)
        self.end_headers()


def start_board(host: str, port: int) -> ThreadingHTTPServer:
    """(the quorum service) The board, listening on ``host:port`` only, on a daemon thread."""
    handler = type("Notes", (_Notes,), {"notes": {}})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="geomesh-board", daemon=True).start()
    return server


def _key(run: str) -> str:
    return hashlib.sha256(run.encode()).hexdigest()[:32]


def _tag(key: bytes | None, run: str, body: bytes) -> str:
    return hmac.new(key, b"geomesh-board\0" + run.encode() + b"\0" + body, hashlib.sha256).hexdigest() if key else ""


class RunBoard:
    """A region's view of the board (an HTTP client; a few seconds at most per call)."""

    def __init__(self, lighthouse: str, run: str, key: bytes | None, timeout_s: float = 3.0):
        self.run, self.key = run, key
        self.url = board_url(lighthouse)
        self.timeout_s = timeout_s

    def post_finished(self, note: dict[str, Any]) -> None:
        """Leave word that this run finished (``note``: JSON: the round, the regions at the end, the checksum)."""
        self.post("finished", note)

    def finished(self) -> dict[str, Any] | None:
        """The note of this run's end, if the board holds a genuine one."""
        return self.read("finished")

    def post(self, kind: str, note: dict[str, Any]) -> bool:
        """Leave a ``kind`` note (:data:`KINDS`) of this run, signed; whether the board took it."""
        if self.url is None:
            return False
        body = json.dumps({"run": self.run, **note}, sort_keys=True).encode()
        data = json.dumps({"body": body.decode(), "tag": _tag(self.key, self.run, body)}).encode()
        try:
            request = urllib.request.Request(f"{self.url}/{kind}/{_key(self.run)}", data=data, method="PUT")
            urllib.request.urlopen(request, timeout=self.timeout_s).close()
            return True
        except (OSError, ValueError):  # a finished note is a courtesy to late regions, never the run's failure
            return False

    def read(self, kind: str) -> dict[str, Any] | None:
        """This run's ``kind`` note, if the board holds a genuine one."""
        if self.url is None:
            return None
        try:
            with urllib.request.urlopen(f"{self.url}/{kind}/{_key(self.run)}", timeout=self.timeout_s) as reply:
                raw = reply.read(NOTE_LIMIT + 1)
        except (OSError, ValueError):  # 404 (no note), or no board there: no word
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
