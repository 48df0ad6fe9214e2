"""The exchanges in flight of elastic overlapped rounds, on one rank of the distributed runtime: each round's
exchange leaves at its end and arrives inside a later round (:mod:`.overlap`), so what the round planned and the
records of its exchange are kept here until it arrives, and the round each belongs to is worked out then.

:class:`ExchangesInFlight` is held by the round loop (:class:`.rounds.RoundLoop`), which tells it of each exchange
launched and asks it to record those that arrived; the overlapped round (:class:`.overlap.RankOverlap`) calls
:meth:`ExchangesInFlight.observe_arrived` as one arrives. The records are the quorum's (:mod:`.elastic`), the
measurements the plan loop's (:class:`.plan_loop.PlanLoop`), a rolled-back exchange :class:`.rollback.RoundRollback`'s.
"""

from __future__ import annotations

from typing import Any

from .exchange import Exchanged


class ExchangesInFlight:
    """The elastic overlapped exchanges of ``run`` launched and not yet recorded: the planned tokens, plan, steps,
    plan entries and round number of each (oldest first), and the clocks of those recorded and not yet agreed.
    ``overlap`` (:class:`.overlap.RankOverlap`) holds the exchanges that arrived; ``planning`` measures them,
    ``exchange`` records them, ``update`` warns of their outcome and ``rollback`` takes a void one back."""

    def __init__(self, run: Any, overlap: Any, planning: Any, exchange: Any, update: Any, rollback: Any):
        self.run, self.overlap, self.planning, self.exchange = run, overlap, planning, exchange
        self.update, self.rollback = update, rollback
        self.planned: list[tuple] = []  # (planned tokens, plan, steps, plan entries, round number)
        self.clocks: list[list] = []  # (the clocks of exchanges recorded, not agreed)
        self.in_round = False  # a round is in progress, not yet counted: an exchange arriving now re-plans the next

    def launched(self, planned: dict[int, int], plan: Any, steps: dict[int, int], entries: dict[int, Any],
                 round_number: int) -> None:  # fmt: skip
        """A round's exchange left, with what the plan loop measures it against when it arrives."""
        self.planned.append((planned, plan, steps, entries, round_number))

    def observe_arrived(self, result: Exchanged, outcome: dict[str, Any]) -> None:
        """Every rank of every member, when an exchange arrives (at the apply step, or drained): the plan loop
        measures it as a plain round's exchange (its infos carry each member's compute of that round, under that
        round's plan, and its leader's wire time of the exchange before). Here, before the next exchange's
        quorum, so that a region healed at that quorum receives the plan loop as the others hold it when they
        launch. A re-plan is in force from the next round."""
        k = len(self.overlap.arrived)
        if k >= len(self.planned):  # (an exchange this region launched nothing for: not measured)
            return
        _, plan, steps, entries, number = self.planned[k]
        self.planning.observe(result, outcome, steps, entries, plan=plan, wire_round=number - 1,
                              after_round=self.run.rounds + (1 if self.in_round else 0))  # fmt: skip

    def record_arrived(self, compute_s: float, comm_s: float) -> None:
        """Warnings and records of the exchanges that arrived (each labelled with its own round). A region lost
        while its exchange was in flight is left out by the survivors, who redo the exchange with the payloads
        they have; its tokens of that round are counted as lost. (The plan loop measured each when it arrived:
        :meth:`observe_arrived`.)"""
        run = self.run
        for result, outcome, members in self.overlap.arrived:
            planned = self.planned.pop(0)[0]
            number = run.rounds - len(self.planned)
            if outcome.get("void"):  # rolled back on every region: none of its tokens reached θ
                run.tokens_done -= sum(planned.values())
                self.rollback.roll_back(number - 1, planned, None, outcome["void"])
                continue
            lost = {i: planned[i] for i in outcome["lost"] if i in planned}
            run.tokens_lost += sum(lost.values())
            self.update.warn(outcome, number)
            # the exchange's quorum and the round's trainers: one that trained the round and is not in the
            # exchange (lost before its quorum) left in this round, the run's last included
            members = sorted(set(members or outcome["took_part"]) | set(planned))
            self.exchange.end_round(result, members, outcome, lost, planned, compute_s, comm_s,
                                    round_number=number)  # fmt: skip
            self.clocks.append([i.get("elapsed_s") for i in result.infos])  # (the clocks it carried)
        self.overlap.arrived.clear()

    def agree_clocks(self) -> None:
        """The time budget's decision from the clocks of the exchanges recorded this round, taken once the round
        is counted (as a static round takes it), whenever their records were made."""
        for clocks in self.clocks:
            self.run.stopping.agree_elapsed(clocks)
        self.clocks.clear()
