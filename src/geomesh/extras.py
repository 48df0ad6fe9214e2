"""Optional extras (facts layer): which package each optional feature needs, and :func:`require`, which imports
it or raises :class:`MissingDependencyError` naming what to install (docs/ecosystem.md).

:class:`MissingDependencyError` is a :class:`~geomesh.errors.ConfigError`, so every face prints it as one
``error:`` line. Used wherever an optional package is imported: the ``transformers`` adapter
(:mod:`geomesh.models.hf`), HF datasets (:mod:`geomesh.data.hf`), the loggers and lm-eval
(:mod:`geomesh.integrations`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import ConfigError

__all__ = ["MissingDependencyError", "require", "install_hint", "EXTRAS"]

# module -> (pip package, extra of geomesh that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "transformers": ("transformers", "hf"),
    "datasets": ("datasets", "hf"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "torch.utils.tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "lm_eval": ("lm-eval", "eval"),
}


class MissingDependencyError(ConfigError):
    """A feature was asked for whose optional package is not installed; the message says what to install."""


def install_hint(module: str) -> str:
    package, extra = EXTRAS.get(module, (module.split(".")[0], None))
    return f"pip install 'geomesh[{extra}]' (or: pip install {package})" if extra else f"pip install {package}"


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingDependencyError` saying that ``feature`` needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or module
        raise MissingDependencyError(
            f"{feature} needs the optional package {module.split('.')[0]!r} ({missing} could not be imported): "
            f"{install_hint(module)}"
        ) from None
