"""Checkpoint state that both runtimes share: what identifies a run (its fingerprint), the random number
generators' states, and cutting ``events.jsonl`` back to a checkpoint when a run resumes.

Where each runtime's checkpoint lives and what else goes into it: the emulated runtime writes one file per
checkpoint with :mod:`geomesh.checkpoint` (:mod:`geomesh.runtime.emulated.checkpoints`: models, optimizers,
codecs, the loop's state); the distributed runtime writes a DCP folder per checkpoint
(:mod:`geomesh.runtime.distributed.checkpoints`). The telemetry's part is :meth:`geomesh.telemetry.Telemetry.state_dict`.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import checkpoint as ckpt
from ..errors import RunError


def run_fingerprint(scenario: Any, method: str, seed: int, tokens: int) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed: the scenario (without its neutral sections), the
    method, the seed and the token budget."""
    return ckpt.fingerprint(scenario.to_dict(), method, seed, tokens)


def rng_state(python_as_text: bool = False) -> dict[str, Any]:
    """The torch, Python and numpy generators' states (``python_as_text``: Python's as its ``repr``, for a
    checkpoint format that holds strings only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    python = random.getstate()
    return {"torch": torch.get_rng_state(), "python": repr(python) if python_as_text else python,
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}  # fmt: skip


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (either form of Python's state)."""
    torch.set_rng_state(state["torch"])
    python = state["python"]
    if isinstance(python, str):
        random.setstate(ast.literal_eval(python))
    else:
        version, internal, gauss = python
        random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


def truncate_events(out_dir: Path, offset: int) -> None:
    """Cut ``out_dir/events.jsonl`` back to ``offset`` bytes (what it held when the checkpoint was written)."""
    try:
        ckpt.truncate_to(Path(out_dir) / "events.jsonl", int(offset))
    except ckpt.CheckpointError as exc:
        raise RunError(f"--resume {out_dir}: {exc}") from None
