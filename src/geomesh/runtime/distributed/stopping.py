"""What ends a distributed run: its token budget, or a time budget in wall-clock seconds decided by every region
together (:class:`StoppingRule`, held by the rank's run as ``run.stopping``).

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
    """The stopping rule's state and decisions on one rank: the token budget ``budget``, or the scenario's time
    budget, which the regions' reported clocks spend (:meth:`agree_elapsed`)."""

    def __init__(self, scenario: Any, budget: int, tokens_given: bool, on_time_up: Any = None) -> None:
        self.scenario = scenario
        self.on_time_up = on_time_up  # told once, with a line for the log, when the regions agree the time is up
        self.budget = budget
        self.time_budget_s: float | None = scenario.training.time_budget_s
        if self.time_budget_s is not None and tokens_given:
            raise RunError("give a token budget (--tokens) or a time budget (--time-budget, training.time_budget_s), "
                           "not both")  # fmt: skip
        self.time_up = False  # the regions agreed that the time budget is spent: this round is the last
        self.time_elapsed_s: float | None = None  # the run's elapsed seconds, as the regions last agreed on them

    @property
    def timed(self) -> bool:
        """Whether a time budget ends the run (every region then reports its clock with each round)."""
        return self.time_budget_s is not None

    def spent(self, tokens_done: int) -> bool:
        """Whether the run is over: the regions agreed that the time budget is spent, or (without one) the
        tokens whose updates reached θ (``tokens_done``) met the token budget."""
        if self.time_budget_s is not None:
            return self.time_up
        return tokens_done >= self.budget

    @property
    def token_cap(self) -> int:
        """The tokens the rounds are cut to (the last one shortened to what is left): the token budget; none
        under a time budget (every round is whole, the clock ends the run)."""
        return self.budget if self.time_budget_s is None else sys.maxsize

    def lr_tokens(self, plans: list[Any]) -> int:
        """The tokens the inner learning-rate schedule spans: the token budget, or under a time budget what the
        run's first plan (of ``plans``, the run's so far) predicts it trains in that time (measured step times where calibrated, the modeled
        exchange): the clock, not this figure, ends the run (rounds past it train at the schedule's floor)."""
        if self.time_budget_s is None or not plans:
            return self.budget
        from ...methods.budget import plan_tokens_in_time

        seq = self.scenario.model.seq_len
        return plan_tokens_in_time(plans[0], seq, self.time_budget_s, self.scenario.training.batch * seq)

    def agree_elapsed(self, clocks: list[Any] | None) -> None:
        """The regions' clocks as they reported them with a round (every rank the same list; ``None``: none
        this round): their mean is the run's elapsed time; at or past the time budget the run stops after this
        round, on every rank of every region alike."""
        if self.time_budget_s is None or clocks is None:
            return
        from ...methods.budget import elapsed_of_round

        elapsed = elapsed_of_round(clocks)
        if elapsed is None:
            return
        self.time_elapsed_s = float(elapsed)
        if self.time_elapsed_s >= self.time_budget_s and not self.time_up:
            self.time_up = True
            if self.on_time_up is not None:
                self.on_time_up(f"the time budget of {self.time_budget_s:g}s is spent (the regions' clocks: "
                                f"{self.time_elapsed_s:.2f}s)")  # fmt: skip

    def stopped_by(self, tokens_done: int) -> str | None:
        """What ended the run: ``time_budget`` or ``token_budget`` (None: neither was reached)."""
        if self.time_up:
            return "time_budget"
        return "token_budget" if self.time_budget_s is None and tokens_done >= self.budget else None

    def state_dict(self) -> dict[str, Any]:
        """The stopping rule's state, for checkpoints and for a region healed from this one (JSON)."""
        return {"time_up": self.time_up, "elapsed_s": self.time_elapsed_s}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state if isinstance(state, dict) else {}
        self.time_up = bool(state.get("time_up", False))
        elapsed = state.get("elapsed_s")
        self.time_elapsed_s = float(elapsed) if isinstance(elapsed, (int, float)) else None

    # ---- what the summary says -----------------------------------------------------------------------------
    def summary_fields(self, tokens_done: int) -> dict[str, Any]:
        """The summary's fields: what ended the run, the time budget and the elapsed time the regions agreed on
        at the last round."""
        return {"stopped_by": self.stopped_by(tokens_done), "time_budget_s": self.time_budget_s,
                "time_budget_elapsed_s": self.time_elapsed_s}  # fmt: skip

    def modeled(self) -> list[str]:
        """What the stopping rule takes from a model rather than a measurement (the summary's ``modeled``)."""
        if self.time_budget_s is None:
            return []
        return ["the inner learning-rate schedule's length under the time budget (the tokens the first plan "
                "predicts for it); the wall clock ends the run"]
