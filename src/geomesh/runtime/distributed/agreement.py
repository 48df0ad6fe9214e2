"""Plan agreement: a round is decided once, by one region, and shipped; whether it counts is one vote.

**The header.** What every region must agree on before it trains a round (the run, the round and its attempt,
the members, the plan and its digest, the exchange, why the plan is what it is) is a :class:`RoundHeader`.
One region makes it: the *maker*, the lowest-numbered member of the round's quorum (a fixed rule every member
applies to the same quorum). It travels to every member as the maker's frame of a collective over the quorum's
leaders, so it is signed with the run key and bound to the run, the round and the quorum like every frame
(:mod:`.frames`). Every region trains the shipped plan; none trains a plan of its own. A region that receives
no header from the maker, or one for another run, round or an older attempt, or whose plan does not hash to its
digest or lacks one of its members, refuses it (:func:`accept_header`) and takes no part in that round.

**The vote.** After the exchange every member votes (:func:`vote`) with whether its exchange completed and a
digest of what arrived at it (:func:`arrivals_digest`). The votes are gathered over the quorum's leaders and
:func:`commit_decision` reads them; every member that gathered the votes reads the same ones, so every one
decides alike. The round commits only when every member of the header voted yes over the same arrivals.
Otherwise no region applies it: it is rolled back on every live region to its starting state (θ and the outer
momentum are untouched until the outer step; error-feedback residuals are restored), and it is trained again as
a new attempt under a new header. A region that could not gather the votes (its link broke after it sent its
own) rolls back too; if the others committed, it is behind, and the next quorum heals it from a live region.

Everything here is pure: values in, values out. The exchange (:mod:`.elastic`) moves the frames.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ...planner import Plan

EXCHANGES = ("all_gather", "all_reduce", "sharded")


class HeaderRefused(ValueError):
    """A round header this region must not train under; the message says why."""


@dataclass(frozen=True)
class RoundHeader:
    run: str  # the run's job hash (scenario, method, seed, budget)
    round: int  # the round it decides (1-based, as the round records count)
    attempt: int  # 0 for the round's first attempt; +1 for each roll-back of it
    members: tuple[int, ...]  # the regions that train the round (scenario indices, ascending)
    plan: Mapping[str, Any]  # the plan every member trains (:meth:`Plan.to_json`)
    digest: str  # :meth:`Plan.digest` of ``plan``
    exchange: str  # the round's exchange: one of :data:`EXCHANGES`
    reason: str  # why the plan is what it is (first round, members changed, a re-plan and its cause, unchanged)
    maker: int  # the region that made it

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "round": self.round, "attempt": self.attempt, "members": list(self.members),
                "plan": dict(self.plan), "digest": self.digest, "exchange": self.exchange, "reason": self.reason,
                "maker": self.maker}  # fmt: skip

    def trained_plan(self) -> Plan:
        return Plan.from_json(self.plan)


def maker_of(quorum: Iterable[int]) -> int:
    """The region that makes a round's header: the lowest-numbered member of the quorum."""
    return min(quorum)


def make_header(*, run: str, round_number: int, attempt: int, members: Iterable[int], plan: Plan, exchange: str,
                reason: str, maker: int) -> RoundHeader:  # fmt: skip
    return RoundHeader(run=run, round=int(round_number), attempt=int(attempt), members=tuple(sorted(members)),
                       plan=plan.to_json(), digest=plan.digest(), exchange=exchange, reason=reason,
                       maker=int(maker))  # fmt: skip


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def accept_header(data: Any, *, run: str, round_number: int, min_attempt: int, quorum: Iterable[int],
                  names: list[str], sender: int | None = None) -> RoundHeader:  # fmt: skip
    """The header ``data`` (a peer's JSON: data, never trusted) if this region may train under it, else
    :class:`HeaderRefused` naming why. ``sender``: the region whose authenticated frame carried it."""
    quorum = sorted(quorum)
    if not isinstance(data, Mapping):
        raise HeaderRefused("no header from the round's maker")
    try:
        members = data["members"]
        fields = (data["run"], data["round"], data["attempt"], data["plan"], data["digest"], data["exchange"],
                  data["reason"], data["maker"])  # fmt: skip
    except KeyError as exc:
        raise HeaderRefused(f"the header lacks {exc.args[0]!r}") from None
    if not (isinstance(members, list) and members and all(_int(i) for i in members)):
        raise HeaderRefused("the header's members are not a non-empty list of regions")
    head_run, head_round, attempt, plan, digest, exchange, reason, maker = fields
    if not (_int(head_round) and _int(attempt) and _int(maker) and isinstance(plan, Mapping)
            and isinstance(digest, str) and isinstance(reason, str)):  # fmt: skip
        raise HeaderRefused("the header's fields have the wrong types")
    expected_maker = maker_of(quorum)
    if maker != expected_maker or (sender is not None and sender != maker):
        raise HeaderRefused(f"the header was made by region {maker} (sent by {sender}); the quorum's maker is "
                            f"region {expected_maker}")  # fmt: skip
    if head_run != run:
        raise HeaderRefused(f"the header is for another run ({head_run!r}, this run is {run!r})")
    if head_round != round_number:
        raise HeaderRefused(f"the header is for round {head_round}; this region's next round is {round_number}")
    if attempt < min_attempt:
        raise HeaderRefused(f"the header is for attempt {attempt} of round {round_number}; this region has seen "
                            f"attempt {min_attempt}")  # fmt: skip
    if exchange not in EXCHANGES:
        raise HeaderRefused(f"the header names an unknown exchange {exchange!r}")
    if not set(members) <= set(quorum):
        raise HeaderRefused(f"the header's members {sorted(members)} are not all in the quorum {quorum}")
    try:
        trained = Plan.from_json(plan)
    except (ValueError, TypeError, KeyError) as exc:
        raise HeaderRefused(f"the header's plan is malformed: {exc}") from None
    if trained.digest() != digest:
        raise HeaderRefused(f"the header's plan does not hash to its digest ({trained.digest()} != {digest})")
    planned = {w.name for w in trained.workers}
    missing = [names[i] if 0 <= i < len(names) else f"#{i}" for i in members
               if not (0 <= i < len(names)) or names[i] not in planned]  # fmt: skip
    if missing:
        raise HeaderRefused(f"the header's plan has no entry for member(s) {', '.join(missing)}")
    return RoundHeader(run=head_run, round=head_round, attempt=attempt, members=tuple(sorted(members)),
                       plan=dict(plan), digest=digest, exchange=exchange, reason=reason, maker=maker)  # fmt: skip


def arrivals_digest(regions: Iterable[int], payloads: Mapping[int, Any] | None = None,
                    extra: bytes | None = None) -> str:  # fmt: skip
    """A digest of what arrived at a member in a round's exchange: who took part, each payload's bytes, and
    ``extra`` (a dense sum, a sharded update's owners' decisions): members that gathered the same bytes agree."""
    h = hashlib.sha256()
    for i in sorted(regions):
        h.update(f"region {i};".encode())
        p = (payloads or {}).get(i)
        h.update(hashlib.sha256(bytes(p)).digest() if p is not None else b"none")
    if extra is not None:
        h.update(hashlib.sha256(extra).digest())
    return h.hexdigest()[:32]


def vote(*, region: int, header: RoundHeader | None, ok: bool, arrived: str | None, why: str = "") -> dict[str, Any]:
    """This region's vote on its round (JSON)."""
    return {"region": region, "round": header.round if header else None,
            "attempt": header.attempt if header else None, "ok": bool(ok), "arrived": arrived, "why": why}  # fmt: skip


def commit_decision(votes: list[Any], header: RoundHeader, names: list[str]) -> tuple[bool, str]:
    """Whether the round of ``header`` commits, from every member's gathered vote: (commit, why not)."""
    got: dict[int, Mapping[str, Any]] = {}
    for v in votes:
        if isinstance(v, Mapping) and _int(v.get("region")):
            got[v["region"]] = v

    def name(i: int) -> str:
        return names[i] if 0 <= i < len(names) else f"#{i}"

    missing = [name(i) for i in header.members if i not in got]
    if missing:
        return False, f"no vote from {', '.join(missing)}"
    for i in header.members:
        v = got[i]
        if v.get("round") != header.round or v.get("attempt") != header.attempt:
            return False, f"{name(i)} voted on round {v.get('round')} attempt {v.get('attempt')}"
        if v.get("ok") is not True:
            why = v.get("why") if isinstance(v.get("why"), str) else ""
            return False, f"{name(i)} voted no ({why[:200] or 'its exchange failed'})"
    arrived = {str(got[i].get("arrived")) for i in header.members}
    if len(arrived) > 1:
        return False, "the members received different payloads"
    return True, ""


MAX_ATTEMPTS = 8  # a round rolled back this many times in a row stops the run with one error


class RoundAgreement:
    """One region's side of the agreement on its rounds: the header it accepted for the round in progress (or
    why it refused one), the round's attempt, and the rounds it trained without a header (overlapped: it votes
    no on them). The exchange moves the frames; this holds what they decided."""

    def __init__(self, run_id: str, names: list[str], me: int) -> None:
        self.run_id, self.names, self.me = run_id, names, me
        self.header: RoundHeader | None = None
        self.refusal: str | None = None  # why this region holds no header for the round in progress
        self.attempt = 0  # of the round in progress (each roll-back of it is a new attempt)
        self.failed_attempts = 0  # roll-backs in a row
        self.refused_rounds: set[int] = set()  # (overlapped) rounds trained without their header: voted no

    def proposal(self, number: int, members: list[int], plan: Plan, exchange: str, reason: str) -> dict[str, Any]:
        """(the maker) The header of round ``number`` this region ships (JSON)."""
        return make_header(run=self.run_id, round_number=number, attempt=self.attempt, members=members, plan=plan,
                           exchange=exchange, reason=reason, maker=self.me).to_json()  # fmt: skip

    def check(self, got: Mapping[int, Any], quorum: list[int], number: int) -> dict[str, Any]:
        """(leader) What arrived from the quorum's members (region -> its header slot): the maker's header,
        accepted, or why not, as the region's leader shares it with its ranks (JSON)."""
        maker = maker_of(quorum)
        try:
            header = accept_header(got.get(maker), run=self.run_id, round_number=number, min_attempt=self.attempt,
                                   quorum=quorum, names=self.names, sender=maker if maker in got else None)  # fmt: skip
        except HeaderRefused as exc:
            return {"header": None, "refusal": str(exc)}
        return {"header": header.to_json(), "refusal": None}

    def take(self, head: Mapping[str, Any]) -> RoundHeader | None:
        """(every rank) The header its leader accepted (or why none) as this region's."""
        self.refusal = head["refusal"]
        h = head["header"]
        if h is None:
            self.header = None
            return None
        self.header = RoundHeader(run=h["run"], round=h["round"], attempt=h["attempt"], members=tuple(h["members"]),
                                  plan=h["plan"], digest=h["digest"], exchange=h["exchange"], reason=h["reason"],
                                  maker=h["maker"])  # fmt: skip
        self.attempt = self.header.attempt
        return self.header

    def header_for(self, number: int) -> RoundHeader | None:
        """The accepted header of round ``number``, if this region holds one."""
        return self.header if self.header is not None and self.header.round == number else None

    def seen_attempts(self, attempts: Iterable[Any]) -> None:
        """The attempts the quorum's members are at (data): a region that rejoins takes the newest."""
        self.attempt = max([self.attempt] + [a for a in attempts if _int(a) and 0 <= a < 1 << 20])

    def settled(self, committed: bool, why: str, round_number: int) -> None:
        """After the round's vote: a committed round's attempts start again at 0; a rolled-back one is retried as
        the next attempt, up to :data:`MAX_ATTEMPTS` (then the run stops with one error, not a silent loop)."""
        if committed:
            self.attempt, self.failed_attempts = 0, 0
            return
        if self.header is not None:
            self.attempt = max(self.attempt, self.header.attempt + 1)
        self.failed_attempts += 1
        if self.failed_attempts >= MAX_ATTEMPTS:
            from ...errors import RunError

            raise RunError(f"round {round_number} of region {self.names[self.me]} was rolled back "
                           f"{self.failed_attempts} times in a row (the last: {why}); it stops")  # fmt: skip
