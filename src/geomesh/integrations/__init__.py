"""Bridges to the wider ecosystem, each behind an optional extra (docs/ecosystem.md).

- :mod:`.hf`: ``transformers`` causal LMs as the trained model (extra ``hf``);
- :mod:`.token_data`: pre-tokenised binary shards (numpy memmap, no extra) and HF ``datasets`` sources
  streamed into a token cache (extra ``hf``);
- :mod:`.loggers`: TensorBoard (extra ``tensorboard``) and Weights & Biases (extra ``wandb``) sinks that
  receive every telemetry record;
- :mod:`.lm_eval_adapter`: an lm-evaluation-harness ``LM`` for the trained model (extra ``eval``).

The library API for a user's own training loop is :mod:`geomesh.api`. Nothing here is imported by the core
unless a scenario asks for it; a missing extra raises :class:`MissingDependencyError` (a
:class:`~geomesh.config.ConfigError`, so the CLI prints one ``error:`` line) that names what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..config import ConfigError

__all__ = ["MissingDependencyError", "require", "EXTRAS"]

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
