"""A region's round overhead on one rank of the distributed runtime: its work outside the inner steps and the
exchange (evaluation on its cadence, a checkpoint when due, the outer step, the round's start), done where it
holds no other region up, and measured, so that the plan loop plans each region's round less its own overhead
(a slower region's evaluation is not waited out by the faster ones).

:class:`RoundOverhead` is held by the round loop (:class:`.rounds.RoundLoop`), which ends each round with it;
the checkpoints are :class:`.round_checkpoints.RoundCheckpoints`'; the overhead measured goes with the round's
info and report (:mod:`.leader_exchange`, :mod:`.exchange`) to the plan loop (:class:`.plan_loop.PlanLoop`).
"""

from __future__ import annotations

from typing import Any


class RoundOverhead:
    """The overhead of this region's rounds in ``run`` (``name``: its region, for the fault hooks): evaluation
    every ``eval_every_rounds`` rounds (``overlapped``: none here, the overlapped round evaluates θ when the
    update arrives; ``elastic``: after the next round's quorum), a checkpoint when due (``checkpointing``), and
    :attr:`s`, the time outside the inner steps since the last exchange, less the wait of the round's report
    (``exchange.report_wait_s``)."""

    def __init__(self, run: Any, checkpointing: Any, exchange: Any, hooks: Any, name: str, *, eval_every_rounds: int,
                 overlapped: bool, elastic: bool):  # fmt: skip
        self.run, self.checkpointing, self.exchange, self.hooks, self.name = run, checkpointing, exchange, hooks, name
        self.eval_every_rounds, self.overlapped, self.elastic = eval_every_rounds, overlapped, elastic
        # this region's round overhead: its time outside the inner steps since its last exchange (that round's
        # outer step, evaluation and checkpoint, this round's start; overlapped: the outer step and evaluation at
        # the apply step), reported with its compute (None: not measured yet)
        self.s: float | None = None
        self._evaluation_due = False  # (elastic plain rounds) the last round's evaluation, run after this quorum
        self._exchange_end: float | None = None
        self._tail = 0.0

    def healed(self) -> None:
        """This region was healed with the live state: an evaluation due was of the θ it held before, not the
        run's."""
        self._evaluation_due = False

    def after_quorum(self) -> None:
        """The last round's evaluation, after this round's quorum (see :meth:`end_round`)."""
        if self._evaluation_due:
            self._evaluation_due = False
            self.run._evaluate(self.run._now())

    def measure(self, quorum_end: float, round_start: float, apart_s: float) -> float:
        """The round overhead up to this round's inner steps: the last round's after its exchange, this round's
        start since its quorum, and ``apart_s`` (overlapped: the outer step and an evaluation at the apply step,
        less the wait there). Returns it."""
        self.s = self._tail + (round_start - quorum_end) + max(apart_s, 0.0)
        self._tail = 0.0
        return self.s

    def exchange_ended(self) -> None:
        """The round's exchange is done (overlapped: launched): what follows, to the round's end, is overhead."""
        self._exchange_end = self.run._cursor

    def end_round(self, checkpoint_due: bool) -> None:
        """Evaluation on its cadence (overlapped: when the update arrives), a checkpoint when due, test hooks."""
        run = self.run
        if not self.overlapped and run.evaluates and (run.rounds % self.eval_every_rounds == 0
                                                       or run.stopping.spent(run.tokens_done)):  # fmt: skip
            if self.elastic and not (run.stopping.spent(run.tokens_done) or checkpoint_due):
                # elastic: after the next round's quorum, which waits for every member. Run before it, a slower
                # region's evaluation held every other region there; after it, it is this region's round
                # overhead, which the plan gives the faster ones as inner steps. (The last round's, and one a
                # checkpoint follows, at once: a resumed run has the records the uninterrupted one has.)
                self._evaluation_due = True
            else:
                run._evaluate(run._now())
        if checkpoint_due:
            self.hooks.at("checkpoint", self.name, run.rounds, rank=run.rank)
            self.checkpointing.save()
        # the evaluation and the checkpoint are the round's "other" time, as in an overlapped round (unmarked, the
        # next round's quorum or barrier booked them as a wait: an evaluation at a slow region's speed read as WAN
        # or straggler idle)
        run._mark("other")
        if self._exchange_end is not None:  # (plain rounds) the round overhead's part after the exchange
            tail = run._cursor - self._exchange_end - self.exchange.report_wait_s
            self._tail, self._exchange_end = max(tail, 0.0), None
        run._test_exit_point()
