"""The round's agreement (runtime/distributed/agreement.py): one header per round, made by the quorum's maker and
shipped; one commit vote. A region fed a doctored, stale or forged header refuses it; the vote commits only
what every member received alike."""

from __future__ import annotations

import pytest

from geomesh.planner import Plan
from geomesh.runtime.distributed.agreement import (
    HeaderRefused,
    accept_header,
    arrivals_digest,
    commit_decision,
    make_header,
    maker_of,
    vote,
)
from geomesh.runtime.distributed.frames import Context, Rejected, open_frame, seal

NAMES = ["ra", "rb", "rc", "rd"]
KEY = b"k" * 32


def plan_for(names: list[str], steps: int = 5) -> Plan:
    workers = [{"name": n, "gpu": "H100", "micro_batch": 2, "accum": 2, "batch": 4, "inner_steps": steps + i,
                "compute_s": 1.0, "straggler_wait_s": 0.0} for i, n in enumerate(names)]  # fmt: skip
    return Plan.from_json({"workers": workers, "round_s": 1.0, "compute_s": 1.0, "sequences_per_round": 16,
                           "utilization": 1.0, "exchange_bytes": 100, "exchange_s": 0.1,
                           "straggler_idle_frac": 0.0})  # fmt: skip


def header(members=(0, 1, 2), round_number=7, attempt=0, maker=0, plan=None, run="job"):
    plan = plan or plan_for([NAMES[i] for i in members])
    return make_header(run=run, round_number=round_number, attempt=attempt, members=members, plan=plan,
                       exchange="all_gather", reason="members changed", maker=maker).to_json()  # fmt: skip


def accept(data, **kw):
    args = {"run": "job", "round_number": 7, "min_attempt": 0, "quorum": [0, 1, 2], "names": NAMES, "sender": 0}
    return accept_header(data, **{**args, **kw})


def test_the_maker_is_the_lowest_numbered_member_of_the_quorum():
    assert maker_of([3, 1, 2]) == 1


def test_a_genuine_header_is_accepted_with_the_plan_it_ships():
    h = accept(header())
    assert h.members == (0, 1, 2) and h.round == 7 and h.attempt == 0
    assert h.trained_plan().worker("rc").inner_steps == 7


@pytest.mark.parametrize("doctor, why", [
    (lambda h: {**h, "round": 6}, "round 6"),  # stale: last round's header replayed
    (lambda h: {**h, "attempt": 0}, "attempt 0"),  # an older attempt of this round (min_attempt 1 below)
    (lambda h: {**h, "run": "other"}, "another run"),
    (lambda h: {**h, "plan": {**h["plan"], "workers": [{**h["plan"]["workers"][0], "inner_steps": 99},
                                                      *h["plan"]["workers"][1:]]}}, "does not hash"),
    (lambda h: {**h, "members": [0, 1, 2, 3]}, "not all in the quorum"),
    (lambda h: {**h, "maker": 1}, "maker"),
    (lambda h: {k: v for k, v in h.items() if k != "digest"}, "lacks 'digest'"),
    (lambda h: {**h, "exchange": "carrier pigeon"}, "unknown exchange"),
    (lambda h: {**h, "members": "0,1,2"}, "members"),
    (lambda h: None, "no header"),
])  # fmt: skip
def test_a_doctored_or_stale_header_is_refused_with_its_reason(doctor, why):
    kw = {"min_attempt": 1} if why == "attempt 0" else {}
    with pytest.raises(HeaderRefused, match=why):
        accept(doctor(header(attempt=1 if why != "attempt 0" else 0)), **kw)


def test_a_header_whose_plan_lacks_a_member_is_refused():
    """The plan a region would train must have its entry (a rejoined member missing from the plan stopped
    every region with a KeyError before)."""
    doctored = header(plan=plan_for(["ra", "rb"]))
    with pytest.raises(HeaderRefused, match="no entry for member.*rc"):
        accept(doctored)


def test_a_header_sent_by_another_member_than_the_maker_is_refused():
    with pytest.raises(HeaderRefused, match="maker"):
        accept(header(), sender=2)


def test_a_forged_header_without_the_key_never_reaches_the_check():
    """The header travels as the maker's frame of the quorum's collective: a frame sealed with another key
    (an outsider's) is rejected before its JSON is read, so the region has no header and trains nothing."""
    ctx = Context(run_id="job", kind="quorum", round=6, scope=65537)
    forged = seal({"region": 0, "header": header()}, ctx=ctx, sender=0, key=b"x" * 32).to_bytes()
    got = open_frame(forged, ctx=ctx, key=KEY)
    assert isinstance(got, Rejected) and "HMAC" in got.reason
    with pytest.raises(HeaderRefused, match="no header"):
        accept({}.get("header"))


def test_the_vote_commits_only_when_every_member_voted_yes_over_the_same_arrivals():
    h = accept(header())
    arrived = arrivals_digest([0, 1, 2], {0: b"a", 1: b"b", 2: b"c"})
    votes = [vote(region=i, header=h, ok=True, arrived=arrived) for i in (0, 1, 2)]
    assert commit_decision(votes, h, NAMES) == (True, "")
    # one member's exchange failed: it votes no, nobody commits
    no = [*votes[:2], vote(region=2, header=h, ok=False, arrived=None, why="its exchange failed (closed)")]
    assert commit_decision(no, h, NAMES) == (False, "rc voted no (its exchange failed (closed))")
    # a member's vote is missing (its link broke before it sent it)
    assert commit_decision(votes[:2], h, NAMES) == (False, "no vote from rc")
    # a member received other bytes (a slot swapped on its link)
    other = arrivals_digest([0, 1, 2], {0: b"a", 1: b"B", 2: b"c"})
    swapped = [*votes[:2], vote(region=2, header=h, ok=True, arrived=other)]
    assert commit_decision(swapped, h, NAMES) == (False, "the members received different payloads")
    # a vote of another attempt (replayed) does not count
    stale = [*votes[:2], {**votes[2], "attempt": 3}]
    assert commit_decision(stale, h, NAMES)[0] is False
    # a peer's garbage is data: ignored, and it counts as a missing vote
    assert commit_decision([*votes[:2], "garbage", {"region": True}], h, NAMES) == (False, "no vote from rc")


# ---- one region's side of the agreement (RoundAgreement) ------------------------------------------------------


def test_the_makers_proposal_is_what_every_member_trains_and_only_for_its_round():
    from geomesh.runtime.distributed.agreement import RoundAgreement

    maker, member = RoundAgreement("job", NAMES, 0), RoundAgreement("job", NAMES, 2)
    plan = plan_for(NAMES[:3])
    shipped = {0: maker.proposal(7, [0, 1, 2], plan, "all_gather", "members changed"), 2: None}
    taken = member.take(member.check(shipped, [0, 1, 2], 7))
    assert taken is not None and taken.trained_plan().digest() == plan.digest() and taken.maker == 0
    assert member.header_for(7) is taken and member.header_for(8) is None and member.refusal is None
    # a header from a non-maker, or the maker's slot carrying one made by another region, is refused, with the
    # reason kept for the vote
    assert member.take(member.check({1: header(maker=1)}, [0, 1, 2], 7)) is None
    assert member.header_for(7) is None and member.refusal == "no header from the round's maker"
    assert member.take(member.check({0: header(maker=1)}, [0, 1, 2], 7)) is None
    assert "the quorum's maker is region 0" in member.refusal


def test_a_rolled_back_round_is_retried_as_the_next_attempt_and_a_stale_header_is_refused():
    from geomesh.runtime.distributed.agreement import RoundAgreement

    maker, member = RoundAgreement("job", NAMES, 0), RoundAgreement("job", NAMES, 1)
    plan = plan_for(NAMES[:3])
    first = {0: maker.proposal(7, [0, 1, 2], plan, "all_gather", "r")}
    member.take(member.check(first, [0, 1, 2], 7))
    member.settled(False, "an exchange failed", 7)
    maker.settled(False, "an exchange failed", 7)
    assert member.attempt == 1 and maker.attempt == 0  # (the maker held no header: it learns the attempt at the
    maker.seen_attempts([member.attempt, "x", True, -3])  # next quorum, from its members' headers)
    assert maker.attempt == 1
    assert member.take(member.check(first, [0, 1, 2], 7)) is None  # the old attempt's header: stale
    retry = {0: maker.proposal(7, [0, 1, 2], plan, "all_gather", "r")}
    assert member.take(member.check(retry, [0, 1, 2], 7)).attempt == 1
    member.settled(True, "", 7)
    assert member.attempt == 0 and member.failed_attempts == 0


def test_a_round_that_never_commits_stops_the_run_with_one_error():
    from geomesh.errors import RunError
    from geomesh.runtime.distributed.agreement import MAX_ATTEMPTS, RoundAgreement

    region = RoundAgreement("job", NAMES, 1)
    for _ in range(MAX_ATTEMPTS - 1):
        region.settled(False, "no vote from rc", 7)
    with pytest.raises(RunError, match=f"round 7 of region rb was rolled back {MAX_ATTEMPTS} times in a row"):
        region.settled(False, "no vote from rc", 7)
