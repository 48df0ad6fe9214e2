"""torchft's own log lines in a region's output: errors only, one line each.

torchft's ``Manager`` reports a failed quorum, group set-up or recovery with ``logger.exception``: the message and
the full traceback of an exception the runtime has already handled (a member died between the quorum and the
group's set-up, and the region asks for another quorum; the round is rolled back). What the runtime did about it
is said in its own lines; torchft's keeps its message (which names the exception) and drops the traceback.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings


class OneLine(logging.Formatter):
    """A record as one line: ``torchft: MESSAGE``, whatever exception or stack it carries."""

    def format(self, record: logging.LogRecord) -> str:
        return "torchft: " + " ".join(record.getMessage().split())


class ToStderr(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stderr`` is when a record comes (as logging's last resort does)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def quiet_torchft_logs() -> None:
    """Errors of the ``torchft`` loggers only, each on one line of stderr (idempotent; before torchft starts)."""
    os.environ.setdefault("RUST_LOG", "error")  # (the Lighthouse and the Manager's Rust client)
    warnings.filterwarnings("ignore", message="The 'warn' method is deprecated")  # torchft's own logger calls it
    log = logging.getLogger("torchft")
    log.setLevel(logging.ERROR)
    if not any(isinstance(h, ToStderr) for h in log.handlers):
        handler = ToStderr()
        handler.setFormatter(OneLine())
        log.addHandler(handler)
    log.propagate = False  # (not again, with its traceback, through a handler of the root logger)
