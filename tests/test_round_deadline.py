"""The adaptive round deadline of elastic regions (``reliability.round_deadline_mode: adaptive``).

The rule is pure (:func:`~geomesh.runtime.distributed.deadline.adaptive_deadline_s`): the median of the recent
rounds' slowest compute plus a multiple of their median absolute deviation, within a floor and the fixed
deadline as the cap. One small elastic run (3 regions of one rank) shows that every round record carries the
deadline its exchange was held to, that it is the rule applied to the records' own measured times, and that a
region that stalls beyond it is dropped for the round while the others go on.
"""

from __future__ import annotations

import pytest

from geomesh.config import ConfigError, ReliabilityConfig, _validate_reliability
from geomesh.runtime.distributed.deadline import MEASURED_ROUNDS, adaptive_deadline_s, deadline_history
from geomesh.runtime.distributed.service import join_timeout_s

RULE = {"multiple": 4.0, "floor_s": 1.0, "cap_s": 60.0, "window": 8}


def test_the_fixed_deadline_until_rounds_are_measured():
    for n in range(MEASURED_ROUNDS):
        assert adaptive_deadline_s([2.0] * n, **RULE) == 60.0


def test_median_plus_a_multiple_of_the_median_absolute_deviation():
    # median 10, deviations 0 1 1 2 2 -> MAD 1: 10 + 4 * 1
    assert adaptive_deadline_s([10, 9, 11, 8, 12], **RULE) == pytest.approx(14.0)


def test_one_stalled_round_does_not_move_it_and_old_rounds_leave_the_window():
    steady = [10, 9, 11, 8, 12]
    # a stall of 55 s counts as no more than the slowest healthy round would
    assert adaptive_deadline_s(steady + [55], **RULE) == pytest.approx(adaptive_deadline_s(steady + [12], **RULE))
    # speeds drift: only the last `window` rounds count
    assert adaptive_deadline_s([2.0] * 20 + [20, 23, 17], **{**RULE, "window": 3}) == pytest.approx(20 + 4 * 3)


def test_identical_rounds_still_leave_room_and_the_floor_and_cap_hold():
    # no spread at all: a tenth of the median is assumed, so jitter does not drop a region
    assert adaptive_deadline_s([10.0] * 5, **RULE) == pytest.approx(10 + 4 * 1.0)
    assert adaptive_deadline_s([0.1] * 5, **RULE) == 1.0  # the floor
    assert adaptive_deadline_s([50.0] * 5, **RULE) == 60.0  # the cap
    assert adaptive_deadline_s([10, 10, "x", -1, None], **RULE) == 60.0  # what is no measurement is skipped


def test_the_history_is_the_round_records_slowest_member():
    records = [{"type": "run"}, {"type": "round", "compute_s": [1.0, 3.0]}, {"type": "plan"},
               {"type": "round", "compute_s": [2.5]}, {"type": "round", "compute_s": []}]  # fmt: skip
    assert deadline_history(records) == [3.0, 2.5]


def test_the_options_are_validated_with_the_field_named():
    _validate_reliability(ReliabilityConfig(round_deadline_mode="adaptive"))
    for field, value in (("round_deadline_mode", "auto"), ("round_deadline_multiple", -1),
                         ("round_deadline_floor_s", 0), ("round_deadline_floor_s", 120.0),
                         ("round_deadline_window", 2), ("round_deadline_window", 4.5)):  # fmt: skip
        with pytest.raises(ConfigError, match=f"reliability.{field}"):
            _validate_reliability(ReliabilityConfig(**{field: value}))


def test_the_quorum_waits_the_floor_for_late_regions_with_adaptive_deadlines():
    assert join_timeout_s(ReliabilityConfig(round_deadline_s=30)) == 30
    assert join_timeout_s(ReliabilityConfig(round_deadline_s=30, round_deadline_mode="adaptive",
                                            round_deadline_floor_s=4)) == 4  # fmt: skip


@pytest.mark.waits
def test_an_elastic_run_holds_each_exchange_to_the_measured_deadline_and_drops_a_stalled_region(tmp_path,
                                                                                                small_corpus):  # fmt: skip
    """3 regions of one rank; r2-t4 stops responding before its exchange of round 5 (its heartbeat goes on).
    Rounds 1-3 use the fixed deadline; from round 4 each round's deadline is the rule applied to the measured
    compute in the records before it, far below the cap; round 5's exchange gives up on r2-t4 at that
    deadline, and the others finish without it."""
    from test_elastic import argv, scenario

    from geomesh.cli import launch as cli_launch
    from geomesh.telemetry import read_events

    cap = 60.0
    path = scenario(tmp_path, small_corpus, round_deadline_s=cap, round_deadline_mode="adaptive",
                    round_deadline_floor_s=4.0, round_deadline_multiple=4.0)  # fmt: skip
    out = tmp_path / "run"
    # 1920 tokens a round of the three (b=4, H=5, 32 tokens a sequence each): 4 rounds, then 2 without r2-t4
    args = cli_launch.build_parser().parse_args([*argv(path, out, 1920 * 6), "--timeout", "30"])
    result = cli_launch.launch(args, extra_env={"OMP_NUM_THREADS": "1", "GEOMESH_TEST_KILL_MID_ROUND": "r2-t4:5:hang"})
    assert result.code == 0, result.message
    assert [r.describe() for r in result.ranks] == ["exit code 0", "exit code 0", "did not stop; killed by the launcher"]
    events = read_events(out / "events.jsonl")
    rounds = [e for e in events if e["type"] == "round"]
    assert [r["round"] for r in rounds] == list(range(1, len(rounds) + 1)) and len(rounds) >= 6
    rel = {"multiple": 4.0, "floor_s": 4.0, "cap_s": cap, "window": ReliabilityConfig().round_deadline_window}
    for k, r in enumerate(rounds):  # the deadline each exchange used: the rule, on the records before it
        history = deadline_history(rounds[:k])
        assert r["deadline_s"] == (cap if k < MEASURED_ROUNDS else pytest.approx(adaptive_deadline_s(history, **rel)))
    assert all(r["deadline_s"] < cap for r in rounds[MEASURED_ROUNDS:])  # measured rounds are far shorter
    leave = [e for e in events if e["type"] == "leave"]
    # (its round-5 exchange timed out: rolled back, and trained again without it)
    assert [(e["region"], e["round"]) for e in leave] == [("r2-t4", 5)]
    assert [e["round"] for e in events if e["type"] == "rollback"] == [5]
    assert [r["members"] for r in rounds[4:]] == [["r0-h100", "r1-a100"]] * (len(rounds) - 4)
    el = result.summary["elastic"]
    assert el["round_deadline_mode"] == "adaptive" and el["deadlines_s"] == [r["deadline_s"] for r in rounds]
    assert el["regions_at_end"] == ["r0-h100", "r1-a100"]


def test_a_quorum_member_missing_at_the_group_set_up_is_given_up_on_before_the_deadline():
    """A member that died right after its quorum formed never joins the group's set-up: the others give up on it
    after the set-up's bound (here 1 s), not the round deadline, and ask for the next quorum; a group that did form
    keeps the deadline for its collectives (here 4 s)."""
    import socket
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from geomesh.runtime.distributed.deadline import setup_s
    from geomesh.runtime.distributed.quorum_group import QuorumGroup

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # (the quorum's store)

    def group():
        return QuorumGroup(timeout=timedelta(seconds=4), setup=timedelta(seconds=1))

    alone = group()
    # 20 s on short links, ten round trips of the slowest on long ones, never past the round deadline
    assert (setup_s(60, 0.08), setup_s(60, 3.0), setup_s(5, 1.5)) == (20.0, 30.0, 5.0)
    with pytest.raises(dist.DistStoreError, match="after 1000ms"):  # (the member of rank 1 never comes)
        alone.configure(f"127.0.0.1:{port}/quorum1", "r0", 0, 2)
    pair = [group(), group()]
    both = [threading.Thread(target=pair[k].configure, args=(f"127.0.0.1:{port}/quorum2", f"r{k}", k, 2))
            for k in range(2)]  # fmt: skip
    for t in both:
        t.start()
    for t in both:
        t.join()
    # the group formed and works; its collectives wait the deadline
    assert all(pg.parent._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=4) for pg in pair)
    xs = [torch.ones(3), torch.ones(3)]
    works = [pg.allreduce([x], dist.AllreduceOptions()) for pg, x in zip(pair, xs)]
    for w in works:
        w.wait()
    assert all(torch.equal(x, torch.full((3,), 2.0)) for x in xs)
    del server
