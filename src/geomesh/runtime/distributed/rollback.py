"""A round rolled back on one rank of the distributed runtime: the round's vote (elastic regions,
:mod:`.agreement`) did not commit it, so every live region restores the state the round started from and trains
it again as a new attempt; what it trained in it is lost work, recorded.

:class:`RoundRollback` is held by the round loop (:class:`.rounds.RoundLoop`), which takes a snapshot before a
plain elastic round's inner steps and rolls back when the round's exchange comes back void. θ and the outer
momentum need no snapshot (they change only at the outer step, :mod:`.update`); the shard owners' residuals are
:mod:`.owners`'.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class RoundRollback:
    """Snapshot and roll back a round of this rank's region (``me`` of ``names``) in ``run``: its codec's
    error-feedback residual, its shard owners' residuals (``owners``, an :class:`~.owners.OwnerResiduals`),
    and, where the method keeps a local state (``keeps_local_state``), the worker moved back onto θ (``params``).
    The tokens lost go to the run's counters, the scenario's faults (``faults``), and ``stats`` (elastic regions:
    the region state's counters, read when needed since a heal replaces them); ``emit`` keeps the record."""

    def __init__(self, run: Any, codec: Any, owners: Any, params: dict[str, torch.Tensor], names: list[str],
                 me: int, faults: Any, *, keeps_local_state: bool, emit: Callable[[dict], None],
                 stats: Callable[[], dict[str, Any]] | None = None):  # fmt: skip
        self.run, self.codec, self.owners, self.params, self.names, self.me = run, codec, owners, params, names, me
        self.faults, self.keeps_local_state, self.emit, self.stats = faults, keeps_local_state, emit, stats

    def snapshot(self) -> dict[str, Any]:
        """What a rolled-back round must restore besides θ and the outer momentum (which change only at the
        outer step): this region's error-feedback residual and its shard owners' residuals."""
        codec = self.codec.state_dict() if getattr(self.codec, "residual", None) else None
        owners = {k: v.clone() for k, v in self.owners.state().items()}
        return {"codec": codec, "owners": owners}

    def roll_back(self, round_index: int, planned: dict[int, int], snapshot: dict[str, Any] | None,
                  why: str) -> None:  # fmt: skip
        """The round's vote did not commit it: every live region restores the round's starting state and
        trains it again as a new attempt; what it trained in it is lost work, recorded."""
        run = self.run
        if self.keeps_local_state:  # what the round trained locally is rolled back with it
            run.worker.load_global(self.params)
        if snapshot is not None:
            if snapshot["codec"] is not None:
                self.codec.load_state_dict(snapshot["codec"])
            if snapshot["owners"]:
                self.owners.load(snapshot["owners"])
        run.tokens_lost += sum(planned.values())  # (every member's work of the round: none reached θ)
        self.faults.count_lost(round_index, planned)
        if self.stats is not None:
            for i, t in planned.items():
                self.stats()["tokens_lost"][self.names[i]] += t
        run.telemetry.count("rollbacks")
        self.emit({"type": "rollback", "round": round_index + 1, "time": run._now(), "region": self.names[self.me],
                   "reason": why, "tokens_lost": {self.names[i]: t for i, t in planned.items()}})  # fmt: skip
        if run.is_leader:
            print(f"region {self.names[self.me]}: round {round_index + 1} rolled back ({why}); it is trained "
                  f"again", flush=True)  # fmt: skip
