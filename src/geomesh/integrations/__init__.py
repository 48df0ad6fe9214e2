"""Bridges to outside tools (faces layer), each behind an optional extra (docs/ecosystem.md).

- :mod:`.lm_eval_adapter`: an lm-evaluation-harness ``LM`` for the trained model and what ``geomesh eval``
  runs (extra ``eval``; its arguments live in :mod:`geomesh.cli.eval`).
- :mod:`.torchft_diloco`: torchft's own DiLoCo (its ``Manager``, ``local_sgd.DiLoCo`` and Lighthouse) on a
  GeoMesh scenario, one region per process under torchrun: the peer a user would pick, run on the hosts test
  bed beside our methods (``geomesh hosts ... --method torchft-diloco``, ``bench/wallclock.py``).

The TensorBoard and Weights & Biases sinks are telemetry writers that both runtimes attach, so they live
beside telemetry (:mod:`geomesh.telemetry_sinks`). The ``transformers`` model adapter lives with the models (:mod:`geomesh.models.hf`), token shards and HF
datasets with the data (:mod:`geomesh.data.tokens`, :mod:`geomesh.data.hf`). The library API for a user's
own training loop is :mod:`geomesh.api`. Nothing here is imported by the core unless a scenario asks for it;
a missing extra raises :class:`~geomesh.extras.MissingDependencyError` (a
:class:`~geomesh.errors.ConfigError`, so the CLI prints one ``error:`` line) that names what to install.
:func:`require` and the extras table live in :mod:`geomesh.extras` (facts) and are re-exported here.
"""

from __future__ import annotations

from ..extras import EXTRAS, MissingDependencyError, install_hint, require

__all__ = ["MissingDependencyError", "require", "install_hint", "EXTRAS"]
