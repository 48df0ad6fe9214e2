"""What ends a distributed run: its token budget, or a time budget in wall-clock seconds decided by every region
together (:class:`StoppingRule`, a part of :class:`~geomesh.runtime.distributed.core.RankRun`).

With ``training.time_budget_s`` (``--time-budget``) every region reports its own clock with each round (a
static run with the round's report to rank 0, elastic regions in the round info of the exchange, ``ddp`` as one
more float of each step's all-reduce); every rank computes the run's elapsed time from the same gathered clocks
(their mean, :func:`~geomesh.methods.budget.elapsed_of_round`), and the round at which it reaches the budget is
the last on every region. The clock counts training time: it starts at the start barrier before the first round,
goes on from a checkpoint's time on resume and from a live region's when a region is healed, and the budget's
state (spent or not, the elapsed time agreed on) travels in checkpoints and heals, so a resumed run trains only
what was left of its budget. See docs/distributed.md (A time budget in wall-clock seconds).
"""

from __future__ import annotations

import sys
from typing import Any

from ...errors import RunError


class StoppingRule:
    """The stopping rule's state and decisions on one rank (mixed into the rank's run, whose scenario, plans,
    clock, transport and region it reads)."""

    def _init_stopping(self, scenario: Any) -> None:
        self.time_budget_s: float | None = scenario.training.time_budget_s
        if self.time_budget_s is not None and self.options.tokens is not None:
            raise RunError("give a token budget (--tokens) or a time budget (--time-budget, training.time_budget_s), "
                           "not both")  # fmt: skip
        self.time_up = False  # the regions agreed that the time budget is spent: this round is the last
        self.time_elapsed_s: float | None = None  # the run's elapsed seconds, as the regions last agreed on them

    def budget_spent(self) -> bool:
        """Whether the run is over: the regions agreed that the time budget is spent, or (without one) the
        tokens whose updates reached θ met the token budget."""
        if self.time_budget_s is not None:
            return self.time_up
        return self.tokens_done >= self.budget

    @property
    def token_cap(self) -> int:
        """The tokens the rounds are cut to (the last one shortened to what is left): the token budget; none
        under a time budget (every round is whole, the clock ends the run)."""
        return self.budget if self.time_budget_s is None else sys.maxsize

    @property
    def lr_tokens(self) -> int:
        """The tokens the inner learning-rate schedule spans: the token budget, or under a time budget what the
        run's first plan predicts it trains in that time (measured step times where calibrated, the modeled
        exchange): the clock, not this figure, ends the run (rounds past it train at the schedule's floor)."""
        if self.time_budget_s is None or not self.plans:
            return self.budget
        from ...methods.budget import plan_tokens_in_time

        seq = self.scenario.model.seq_len
        return plan_tokens_in_time(self.plans[0], seq, self.time_budget_s, self.scenario.training.batch * seq)

    def agree_elapsed(self, clocks: list[Any] | None, in_region: bool = False) -> None:
        """The regions' clocks as they reported them with a round (every rank of a region the same list, or
        with ``in_region`` its leader's only, shared here inside the region): their mean is the run's elapsed
        time; at or past the time budget the run stops after this round, on every rank of every region alike."""
        if self.time_budget_s is None:
            return
        from ...methods.budget import elapsed_of_round

        elapsed = elapsed_of_round(clocks) if clocks is not None else None
        if in_region and self.region_group is not None:
            elapsed = self.transport.broadcast_json(elapsed if self.is_leader else None, self.leader, self.region_group,
                                                    what=f"the run's elapsed time at round {self.rounds}")  # fmt: skip
        if elapsed is None:
            return
        self.time_elapsed_s = float(elapsed)
        if self.time_elapsed_s >= self.time_budget_s and not self.time_up:
            self.time_up = True
            if self.is_leader:  # every region's log says where its run ended (with --quiet too)
                print(f"[{self.method.name}] region {self.scenario.regions[self.region].name}: the time budget of "
                      f"{self.time_budget_s:g}s is spent (the regions' clocks: {self.time_elapsed_s:.2f}s); the run "
                      f"ends with round {self.rounds}", file=sys.stderr, flush=True)  # fmt: skip

    def stopped_by(self) -> str | None:
        """What ended the run: ``time_budget`` or ``token_budget`` (None: neither was reached)."""
        if self.time_up:
            return "time_budget"
        return "token_budget" if self.time_budget_s is None and self.tokens_done >= self.budget else None

    def time_state(self) -> dict[str, Any]:
        """The stopping rule's state, for checkpoints and for a region healed from this one (JSON)."""
        return {"time_up": self.time_up, "elapsed_s": self.time_elapsed_s}

    def load_time_state(self, state: dict[str, Any] | None) -> None:
        state = state if isinstance(state, dict) else {}
        self.time_up = bool(state.get("time_up", False))
        elapsed = state.get("elapsed_s")
        self.time_elapsed_s = float(elapsed) if isinstance(elapsed, (int, float)) else None

    # ---- what the summary says -----------------------------------------------------------------------------
    def _stopping_fields(self) -> dict[str, Any]:
        """The summary's fields: what ended the run, the time budget and the elapsed time the regions agreed on
        at the last round."""
        return {"stopped_by": self.stopped_by(), "time_budget_s": self.time_budget_s,
                "time_budget_elapsed_s": self.time_elapsed_s}  # fmt: skip

    def _stopping_modeled(self) -> list[str]:
        """What the stopping rule takes from a model rather than a measurement (the summary's ``modeled``)."""
        if self.time_budget_s is None:
            return []
        return ["the inner learning-rate schedule's length under the time budget (the tokens the first plan "
                "predicts for it); the wall clock ends the run"]
