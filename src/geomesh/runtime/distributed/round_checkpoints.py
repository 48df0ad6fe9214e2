"""The round loop's checkpoints on one rank of the distributed runtime: when one is due, writing it, a resumed
run taking its checkpoint back, elastic regions resumed together stepping back to the newest round they all
hold, and the loop's own state that a checkpoint carries (the scenario's faults, the plan loop, the exchange's).

:class:`RoundCheckpoints` is held by the round loop (:class:`.rounds.RoundLoop`). What a rank writes and restores
is :class:`.run_checkpoint.RunCheckpointer`'s; where checkpoints are, how often and which one a run resumes from
are the run's (:class:`.checkpointing.RunCheckpoints`); the folder's format is :mod:`.checkpoints`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...errors import RunError
from .run_checkpoint import RunCheckpointer


class RoundCheckpoints:
    """The checkpoints of ``run``'s rounds on this rank (``label``: the method's name and this region's, for what
    it says): θ (``params``), the outer optimizer (``outer``), this region's encoder (``codec``), the overlapped
    round (``overlap``, None: plain rounds) and the shard owners' residuals (``owners``), with the loop's own
    state: the scenario's faults (``faults``), the plan loop (``planning``) and the run's ``exchange``."""

    def __init__(self, run: Any, params: dict[str, torch.Tensor], outer: Any, codec: Any, *, overlap: Any,
                 owners: Any, faults: Any, planning: Any, exchange: Any, label: tuple[str, str]):  # fmt: skip
        self.run, self.faults, self.planning, self.exchange, self.label = run, faults, planning, exchange, label
        self.every, self.keep = run.checkpoints.cadence()
        self.saver = None  # (none written and none resumed: no saver)
        if self.every > 0 or run.checkpoints.resume_from is not None:
            self.saver = RunCheckpointer(run, params, outer, codec, run.checkpoints.fingerprint,
                                         directory=run.checkpoints.directory, extra=self.state,
                                         load_extra=self.load_state, overlap=overlap, owners=owners)  # fmt: skip

    @property
    def resumed(self) -> bool:
        """This run resumes from a checkpoint (a region whose folder held none does not: it heals instead)."""
        return self.run.checkpoints.resume_from is not None

    def due(self, round_number: int) -> bool:
        """A checkpoint is written after round ``round_number`` (counted from 1)."""
        return self.saver is not None and self.every > 0 and round_number % self.every == 0

    def save(self) -> None:
        """Every rank writes its part of the checkpoint of the round that just ended."""
        self.run._save_checkpoint(self.saver, self.keep)

    def resume(self) -> None:
        """A resumed run takes its checkpoint back; the clock goes on from the checkpoint's time."""
        run = self.run
        self.saver.restore(Path(run.checkpoints.resume_from))
        run.clock.resume(run._cursor)
        self.exchange.resumed()
        run._say(f"[{self.label[0]}] resumed from the checkpoint of round {run.rounds} "
                 f"({run.checkpoints.resume_from})")  # fmt: skip

    def resume_at(self, round_index: int) -> None:
        """(elastic regions resumed together) Load the checkpoint of ``round_index``, the newest round every
        resumed region holds, where this region loaded a newer one: a region that got further before the hosts
        were lost steps back, so that no region is healed across rounds it never trained (a heal starts a fresh
        AdamW: the run would part from the uninterrupted one)."""
        run = self.run
        if not self.resumed:  # its folder held none: it stays behind and heals at the next quorum
            return
        if round_index != run.rounds:
            from .checkpoints import list_complete, verify

            found = {r: (p, m) for r, p, m in list_complete(run.checkpoints.directory)}
            if round_index not in found:  # none in common: this one is behind and heals at the next quorum
                return
            path, marker = found[round_index]
            try:
                verify(path, marker, self.saver.key)
            except Exception as exc:  # noqa: BLE001 - DistCheckpointError/CheckpointError: one line
                raise RunError(f"--resume: {exc}") from None
            was = run.rounds
            self.saver.restore(path)
            run.clock.resume(run._cursor)
            run._say(f"[{self.label[0]}] region {self.label[1]}: resumed from round {round_index}, the "
                     f"newest every resumed region holds (its own newest: {was})")  # fmt: skip
        self.exchange.resumed_at_round()

    # ---- the loop's own state in a checkpoint (plain JSON; the same on every rank) -------------------------
    def state(self) -> dict[str, Any]:
        common = {"faults": self.faults.state_dict(), "plan_loop": self.planning.plan_state(),
                  **self.exchange.checkpoint_state()}  # fmt: skip
        return {"common": common, "rank0": self.exchange.checkpoint_state_rank0()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.faults.load_state_dict(state["common"]["faults"])
        self.planning.load_plan_state(state["common"]["plan_loop"],
                                      members_after_resume=self.exchange.planned_for_after_resume())  # fmt: skip
        self.exchange.load_checkpoint_state(state)
