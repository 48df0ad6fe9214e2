"""The round deadline: how long an elastic exchange waits for a member (:class:`RoundDeadline`), fixed or adaptive
(``reliability.round_deadline_mode: adaptive``: from the recent rounds' measured work). Pure: every leader
computes it from the same round records (which a healed region receives too), so the leaders agree. And how long a
quorum's group set-up waits for a member (:func:`setup_s`), which is not the deadline: the members of a quorum
meet within round trips."""

from __future__ import annotations

import itertools
import statistics
from typing import Any, Callable

from .exchange import round_work_s

MEASURED_ROUNDS = 3  # rounds measured before an adaptive deadline replaces the fixed one (the first may warm up)
MIN_SPREAD = 0.1  # the least spread assumed, as a fraction of the median (see adaptive_deadline_s)
SETUP_S = 20.0  # how long a quorum's group set-up waits for a member that was in the quorum (on short links)


def setup_s(deadline_s: float, rtt_s: float) -> float:
    """How long a quorum's group set-up waits for its members (:mod:`.quorum_group`): :data:`SETUP_S`, or ten round
    trips of ``rtt_s`` (the slowest declared link's) where that is longer; at most the round deadline."""
    return min(float(deadline_s), max(SETUP_S, 10.0 * float(rtt_s)))


def adaptive_deadline_s(history: list[float], *, multiple: float, floor_s: float, cap_s: float,
                        window: int) -> float:  # fmt: skip
    """The exchange's deadline from the recent rounds' measured times (``history``: per round, the slowest
    member's work seconds, oldest first): over the last ``window`` rounds, the median plus ``multiple``
    median absolute deviations, never below ``floor_s``, never above ``cap_s`` (``reliability.round_deadline_s``).
    ``cap_s`` until :data:`MEASURED_ROUNDS` rounds are measured.

    Median and MAD rather than mean and deviation: one stalled or healing round must not move the deadline.
    A history of identical rounds has no spread at all; the deviation is taken as at least
    :data:`MIN_SPREAD` of the median, so such a deadline is not the median itself (which would drop a region
    for a 1% jitter). Pure: every leader computes it from the same round records, so they agree."""
    xs = [float(x) for x in history if isinstance(x, (int, float)) and x >= 0][-window:]
    if len(xs) < MEASURED_ROUNDS:
        return float(cap_s)
    med = statistics.median(xs)
    mad = statistics.median([abs(x - med) for x in xs])
    return float(min(cap_s, max(floor_s, med + multiple * max(mad, MIN_SPREAD * med))))


def deadline_history(records: list[dict[str, Any]]) -> list[float]:
    """Per round record (oldest first), the slowest member's measured work seconds (its compute and round
    overhead, which the exchange waits for alike): numbers every leader gathered alike with the round's
    exchange, and that a healed region receives with the records (data: what is not a number is left out)."""
    out = []
    for r in records:
        if r.get("type") == "round":
            computes, overheads = r.get("compute_s"), r.get("overhead_s")
            computes = computes if isinstance(computes, list) else []
            overheads = overheads if isinstance(overheads, list) and len(overheads) == len(computes) else []
            infos = [{"compute_s": c, "overhead_s": o} for c, o in itertools.zip_longest(computes, overheads)]
            times = [w for w in map(round_work_s, infos) if w is not None]
            if times:
                out.append(max(times))
    return out


class RoundDeadline:
    """The round deadline of one elastic region's exchanges, from ``reliability``: ``cap_s`` the fixed deadline
    (with adaptive deadlines their cap), ``mode`` which, ``last_s`` what the last exchange was held to (its round
    record and its commit vote say it)."""

    def __init__(self, reliability: Any):
        self.rel = reliability
        self.cap_s, self.mode = reliability.round_deadline_s, reliability.round_deadline_mode
        self.last_s = self.cap_s

    def for_round(self, records: list[dict[str, Any]], shaper_s: Callable[[], float]) -> float:
        """(leader) How long this round's exchange waits for its slowest member: ``round_deadline_s``, or with
        ``round_deadline_mode: adaptive`` :func:`adaptive_deadline_s` of the recent round ``records``' measured
        compute (every leader keeps the same records, so every leader holds the exchange to the same deadline)
        plus the WAN shaper's modeled hold (``shaper_s()``), within the cap. It is :attr:`last_s` from now on."""
        self.last_s = self._deadline_s(records, shaper_s)
        return self.last_s

    def _deadline_s(self, records: list[dict[str, Any]], shaper_s: Callable[[], float]) -> float:
        if self.mode != "adaptive":
            return float(self.cap_s)
        rel = self.rel
        history = deadline_history(records)
        base = adaptive_deadline_s(history, multiple=rel.round_deadline_multiple, floor_s=rel.round_deadline_floor_s,
                                   cap_s=self.cap_s, window=rel.round_deadline_window)  # fmt: skip
        if len(history) < MEASURED_ROUNDS:
            return float(self.cap_s)
        return float(min(self.cap_s, base + shaper_s()))
