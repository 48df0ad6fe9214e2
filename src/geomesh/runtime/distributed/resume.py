"""Which checkpoint a resumed run of the distributed runtime starts from: the newest one that verifies and belongs
to this run (its fingerprint: the scenario, method, seed, token budget and ranks per region; its run id), the ranks
of a run checking the same candidates and falling back together past a damaged one. The checkpoint folder itself,
and how it is verified, is :mod:`.checkpoints`; what the ranks restore from it is :mod:`.run_checkpoint`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ... import checkpoint as ckpt
from .. import checkpoint_state
from .checkpoints import MARKER, DistCheckpointError, list_complete, newest, verify


def fingerprint(scenario, method: str, seed: int, tokens: int, counts) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed (the emulated runtime's fingerprint + the layout)."""
    fp = checkpoint_state.run_fingerprint(scenario, method, seed, tokens)
    fp["ranks_per_region"] = list(counts)
    return fp


def choose_intact(directory: Path, rounds: list[int], key: bytes | None, agree: Callable[[bool], bool] | None = None
                  ) -> tuple[tuple[int, Path, dict[str, Any]] | None, list[str]]:  # fmt: skip
    """The newest of ``rounds`` whose checkpoint verifies, and why each newer one was skipped.

    ``agree(intact_here)`` returns whether every rank found the same checkpoint intact (a collective: all
    ranks check the same candidates in the same order, so they fall back together); without it, this
    process's verdict is the answer."""
    problems = []
    for round_index in sorted(rounds, reverse=True):
        path = Path(directory) / f"round-{round_index:06d}"
        marker, problem = None, None
        try:
            marker = json.loads((path / MARKER).read_text())
            if not isinstance(marker, dict) or int(marker["round"]) != round_index:
                raise ValueError("its marker names another round")
            verify(path, marker, key)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problem = f"checkpoint {path}: its marker is unreadable ({exc})"
        except DistCheckpointError as exc:
            problem = str(exc)
        everywhere = problem is None if agree is None else agree(problem is None)
        if everywhere:
            return (round_index, path, marker), problems  # type: ignore[return-value]
        problems.append(problem or f"checkpoint {path}: another rank found it damaged")
    return None, problems


def check_resume(out_dir: Path, fp: dict[str, Any], directory: Path | None = None, *, key: bytes | None = None,
                 run_id: str | None = None, rounds: list[int] | None = None,
                 agree: Callable[[bool], bool] | None = None, warn: bool = True,
                 ) -> tuple[int, Path, dict[str, Any]]:  # fmt: skip
    """The newest intact checkpoint of ``out_dir`` (or of ``directory``: one region's, with elastic regions),
    after checking that it belongs to this run (its fingerprint, and its run id when both are known).

    A damaged or changed newer checkpoint is skipped (``warn``: with a warning) for the previous intact one;
    none intact is a DistCheckpointError. ``rounds`` (default: the complete checkpoints found here) and
    ``agree`` let the ranks of a run check the same candidates and decide together (:func:`choose_intact`)."""
    directory = Path(directory or ckpt.checkpoint_dir(out_dir))
    if rounds is None:
        rounds = [r for r, _, _ in list_complete(directory)]
    if not rounds:
        newest(directory)  # the one wording of "no checkpoint"
    chosen, problems = choose_intact(directory, rounds, key, agree)
    if chosen is None:
        raise DistCheckpointError(f"--resume {out_dir}: no intact checkpoint in {directory}: {'; '.join(problems)}; "
                                  "start a new run folder")  # fmt: skip
    round_index, path, marker = chosen
    if problems and warn:
        for problem in problems:
            warnings.warn(f"{problem}; resuming from the previous intact checkpoint (round {round_index})",
                          stacklevel=2)  # fmt: skip
    theirs = marker.get("fingerprint")
    if theirs != json.loads(json.dumps(fp, default=str)):
        diffs = ckpt.differences(theirs, json.loads(json.dumps(fp, default=str)))
        raise DistCheckpointError(
            f"--resume {out_dir}: the checkpoint of round {round_index} belongs to another run (scenario hash "
            f"{ckpt.fingerprint_hash(theirs or {})}, this one {ckpt.fingerprint_hash(fp)}): {'; '.join(diffs)}. "
            "Resume with the same scenario, method, seed, token budget and ranks, or start a new run folder"
        )
    if run_id is not None and marker.get("run_id") not in (None, run_id):
        raise DistCheckpointError(f"--resume {out_dir}: the checkpoint of round {round_index} was written by run "
                                  f"{marker.get('run_id')}, not by this folder's run {run_id}; start a new run "
                                  "folder")  # fmt: skip
    return round_index, path, marker
