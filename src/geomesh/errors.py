"""The errors a user can cause, in one place at the bottom of the package (every layer raises them; the
faces turn each into one ``error: ...`` line and exit status 2). This module imports nothing from geomesh."""

from __future__ import annotations


class ConfigError(ValueError):
    """A scenario or option a user wrote is invalid; the message says which field and why."""


class DataError(ValueError):
    """A data problem the user can fix (missing file, empty corpus, bad JSONL); the message names the file."""


class PlanError(ValueError):
    """No valid plan: the message names the worker or constraint and the reason."""


class PayloadError(ValueError):
    """A payload is malformed, corrupted, forged, or belongs to another codec configuration."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read back (the message names the file and the reason)."""


class RunError(RuntimeError):
    """A run cannot start or continue for a reason the user can fix (message says which)."""


class UnknownMethodError(ValueError):
    """A method name that is not registered."""


USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, DataError, PlanError, PayloadError, RunError, UnknownMethodError, CheckpointError,
)  # fmt: skip
