"""A distributed run's checkpoint bookkeeping on one rank (:class:`RunCheckpoints`): where its checkpoints are,
how often it writes one and how many it keeps, what a checkpoint must agree with to be resumed, which one a
resumed run starts from, and writing the rank's part of one. What a rank writes into a checkpoint and restores
from it is :mod:`.run_checkpoint`; the folder's format is :mod:`.checkpoints`; how the newest intact one is
chosen is :mod:`.resume`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable  # noqa: UP035

import torch
import torch.distributed as dist

from ... import checkpoint as ckpt
from ...config import ScenarioConfig
from ...errors import RunError
from ..checkpoint_state import truncate_events
from ..options import DistOptions, checkpoint_cadence
from .checkpoints import DistCheckpointError
from .resume import check_resume
from .transport import Transport


class RunCheckpoints:
    """This rank's view of its run's checkpoints: :attr:`fingerprint` (what a checkpoint must agree with),
    :attr:`directory`, :meth:`cadence`, and :attr:`resume_from` (the checkpoint a resumed run starts from,
    None for a fresh run or a region that found none) once :meth:`prepare_resume` chose it."""

    def __init__(self, scenario: ScenarioConfig, options: DistOptions, fingerprint: dict[str, Any],
                 transport: Transport):  # fmt: skip
        self.scenario, self.options, self.fingerprint, self.transport = scenario, options, fingerprint, transport
        self.out_dir = options.out_dir
        self.resume_from: str | None = None

    @property
    def directory(self) -> Path:
        """``DIR/checkpoints``, or with elastic regions ``DIR/checkpoints/<region>`` (each region its own)."""
        base = ckpt.checkpoint_dir(self.out_dir)
        return base / self.options.elastic_region if self.options.elastic_region is not None else base

    def cadence(self) -> tuple[int, int]:
        """(a checkpoint every N rounds, checkpoints kept); refused without a run folder to write them in."""
        every, keep = checkpoint_cadence(self.options, self.scenario.reliability)
        if every > 0 and self.out_dir is None:
            raise RunError("--checkpoint-every needs a run folder (--out)")
        return every, keep

    def save(self, saver: Any, keep: int, round_index: int) -> None:
        """This rank's part of the checkpoint of the round (step) that just ended, through ``saver``
        (:class:`~geomesh.runtime.distributed.run_checkpoint.RunCheckpointer`)."""
        self.transport.op = f"writing the checkpoint of round {round_index}"
        try:
            saver.save(keep)
        except OSError as exc:
            raise RunError(f"could not write the checkpoint of round {round_index} in "
                           f"{self.out_dir / 'checkpoints'}: {exc.strerror or exc}") from None  # fmt: skip

    def prepare_resume(self, on_rank0: Callable[[str, Callable[[], Any]], Any], is_rank0: bool, region: str) -> None:
        """Every rank checks the newest complete checkpoint's files against its marker (sizes, SHA-256, the
        run key's tag) before anything in it is read, and the ranks agree on the verdict: a damaged one is
        skipped by all of them for the previous intact one (rank 0 warns). Rank 0 then checks that it belongs
        to this run and cuts ``events.jsonl`` back to it; every rank sets :attr:`resume_from` to its folder (or
        raises the same one-line error). ``on_rank0(what, fn)`` runs ``fn`` on rank 0 and returns its result
        on every rank; ``region`` names rank 0's region (an elastic region that found none says so)."""
        if self.out_dir is None:
            raise RunError("--resume needs the run folder of the interrupted run (--out)")
        from ...methods.base import payload_key
        from ..run_folder import run_id_of
        from .checkpoints import list_complete

        directory = self.directory
        key = payload_key(self.scenario)
        rounds = on_rank0("listing the checkpoints to resume from", lambda: [r for r, _, _ in list_complete(directory)])
        if not rounds and self.options.elastic_region is not None:  # a host whose folder is gone: it heals
            if is_rank0:
                print(f"warning: region {region}: no checkpoint in {directory} to resume from; it starts afresh and "
                      f"receives the live state from the others", file=sys.stderr, flush=True)  # fmt: skip
            self.resume_from = None
            return

        def everywhere(intact_here: bool) -> bool:
            self.transport.op = "agreeing on the checkpoint to resume from"
            damaged = torch.tensor([0 if intact_here else 1], dtype=torch.int32, device=self.transport.device)
            dist.all_reduce(damaged, op=dist.ReduceOp.SUM)
            return int(damaged.item()) == 0

        try:
            _, path, marker = check_resume(self.out_dir, self.fingerprint, directory, key=key,
                                           run_id=run_id_of(self.out_dir), rounds=rounds, agree=everywhere,
                                           warn=is_rank0)  # fmt: skip
        except DistCheckpointError as exc:
            raise RunError(str(exc)) from None

        def cut_events() -> str:
            offset = marker.get("events_offset")
            if offset is not None and self.options.elastic_region is None:  # elastic: the writer rewrites it
                truncate_events(self.out_dir, offset)
            return str(path)

        self.resume_from = on_rank0("cutting the events back to the checkpoint", cut_events)
