"""The errors a user can cause; the CLI turns each into one ``error: ...`` line and exit status 2."""

from __future__ import annotations

from .checkpoint import CheckpointError
from .codec import PayloadError
from .config import ConfigError
from .data import DataError
from .planner import PlanError
from .runtime.emulated import RunError


class UnknownMethodError(ValueError):
    """A method name that is not registered."""


USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, DataError, PlanError, PayloadError, RunError, UnknownMethodError, CheckpointError,
)  # fmt: skip
