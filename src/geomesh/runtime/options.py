"""Run options, shared by both runtimes: what a caller may override for one run (budget, seed, target,
checkpointing, the run folder), and how those overrides resolve against the scenario.

:class:`CommonOptions` holds the fields every runtime reads; :class:`RunOptions` (emulated runtime) and
:class:`DistOptions` (distributed runtime) add what only one of them has (worker processes and the device;
ranks, backend, WAN shaper, elastic regions). :func:`resolve_run` and :func:`checkpoint_cadence` turn
options plus scenario into the numbers a run uses, with one wording of every refusal. :func:`prepare_run_dir`
proves a run folder is writable before anything trains.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import RunError

if TYPE_CHECKING:
    from ..config import ReliabilityConfig, ScenarioConfig
    from .distributed.wan_shaper import WanMode


@dataclass
class CommonOptions:
    """What both runtimes let a caller override (``None``: the scenario's value)."""

    out_dir: Path | None = None
    tokens: int | None = None  # overrides training.tokens
    seed: int | None = None  # overrides training.seed
    target_val_loss: float | None = None  # overrides training.target_val_loss
    progress: bool = True
    cache_dir: Path | None = None
    checkpoint_every: int | None = None  # overrides reliability.checkpoint_every_rounds (0: no checkpoints)
    keep_checkpoints: int | None = None  # overrides reliability.keep_checkpoints
    resume: bool = False  # continue the interrupted run in out_dir from its newest checkpoint


@dataclass
class RunOptions(CommonOptions):
    """Options of one emulated run."""

    # workers of a round trained at once in this many processes (runtime/emulated/parallel.py; same results as 1);
    # None: one per core, up to one per worker, where that is possible (CPU, fork), else 1
    workers_parallel: int | None = None
    worker_threads: int | None = None  # intra-op threads of one worker's local phase; None: its share of the cores
    device: str = "cpu"  # where the proxy trains: cpu, cuda or cuda:N (the modeled clock does not change)


@dataclass
class DistOptions(CommonOptions):
    """Options of one distributed run (this rank's view of it)."""

    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 300.0  # every collective (and the straggler barrier) gives up after this
    wan: WanMode = "none"  # none | shaper | latency (see transport.WanShaper)
    ranks_per_region: list[int] | None = None
    profiles: list[str] = field(default_factory=list)  # REGION=FILE: measured profiles (rank 0 reads them)
    save_params: bool = False  # rank 0 writes out_dir/final_params.pt (the global model's state_dict)
    elastic_region: str | None = None  # elastic: this world is this region's ranks only
    lighthouse: str | None = None  # elastic: the quorum service (default $TORCHFT_LIGHTHOUSE)
    async_order: str = "arrival"  # async-local-sgd: the server applies pushes as they arrive, or "modeled"


def resolve_run(options: CommonOptions, scenario: ScenarioConfig) -> tuple[int, int, float | None]:
    """(seed, token budget, target validation loss) of a run: the options' overrides, else the scenario's."""
    tr = scenario.training
    seed = options.seed if options.seed is not None else tr.seed
    budget = options.tokens if options.tokens is not None else tr.tokens
    target = options.target_val_loss if options.target_val_loss is not None else tr.target_val_loss
    return seed, budget, target


def checkpoint_cadence(options: CommonOptions, rel: ReliabilityConfig) -> tuple[int, int]:
    """(checkpoint every N rounds, checkpoints kept): the options' overrides, else the scenario's
    ``reliability`` section; refused in one line when out of range."""
    every = options.checkpoint_every if options.checkpoint_every is not None else rel.checkpoint_every_rounds
    keep = options.keep_checkpoints if options.keep_checkpoints is not None else rel.keep_checkpoints
    if every < 0:
        raise RunError(f"--checkpoint-every {every}: expected >= 0 rounds (0: no checkpoints)")
    if keep < 1:
        raise RunError(f"--keep {keep}: expected >= 1 checkpoint")
    return every, keep


def prepare_run_dir(path: Path) -> None:
    """Create the run folder and prove it is writable before any training starts."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"  # per process: several ranks may check one folder at once
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise RunError(f"run folder {path} is not writable: {exc.strerror or exc}") from None
