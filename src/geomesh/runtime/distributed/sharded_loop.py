"""The sharded exchange in the one round loop: the plan's choice of it (:func:`exchange_choice`,
:func:`loop_exchange`) and its layout for a number of members (:func:`layout_for`), what the WAN shaper holds it
to (:func:`shaper_s`), a round's exchange of it, static over the leaders' group (:func:`static_sharded_exchange`)
or elastic over the round's quorum (:func:`quorum_sharded_exchange`, one shard per member), as the fields of the
round's :class:`~.exchange.Exchanged`; the update is shared inside a region by :class:`~.share.RegionShare`, and
the screening step every rank takes alike is the round's update's (:class:`~.update.RoundUpdate`). One round of the
exchange itself, its slots and agreements, is :mod:`.sharded`; the loop's exchanges are :mod:`.exchange`
(static) and :mod:`.elastic` (elastic regions).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ...codec.sharded import ShardedExchange
from ...codec.sharded_sparse import sharded_exchange
from ...errors import RunError
from ..hooks import LEGACY
from .sharded import QuorumMover, SlotTrust, quiet, sharded_round

# tests: "REGION:ROUND": that elastic region's leader dies in the middle of that round's sharded exchange (its
# slices delivered, its combined shard never sent)
TEST_KILL_ENV = LEGACY["slices"]  # "REGION:ROUND": the fault hooks' point ``slices`` (runtime/hooks.py)


class _DiesAfterSlices:
    """The fault hooks' point ``slices`` (runtime/hooks.py): a mover that fires it once its slices have left."""

    def __init__(self, mover: Any, fire: Any):
        self.mover, self.size, self.rank, self.members, self.scope = (mover, mover.size, mover.rank, mover.members,
                                                                      mover.scope)  # fmt: skip
        self.fire = fire

    def all_to_all(self, send: list[bytes], recv_sizes: list[int]) -> list[bytes]:
        got = self.mover.all_to_all(send, recv_sizes)
        self.fire()
        return got


def loop_exchange(loop: Any, wan: Any = None) -> ShardedExchange | None:
    """The sharded exchange a run's rounds use when the plan picks it (:func:`exchange_choice`), or None: the
    all-gather (or the dense sum). Its layout is for every region of the scenario; elastic rounds cut one per
    quorum size (:func:`layout_for`)."""
    choice = exchange_choice(loop, wan)
    if choice is None or choice.name != "sharded":
        return None
    return sharded_exchange(loop.combiner, loop.n, loop.sc.geomesh.shard_bits)


def exchange_choice(loop: Any, wan: Any = None) -> Any:
    """The plan's choice of exchange for a run's payloads (planner/exchange.py: the scenario's
    ``geomesh.exchange``, else the cheaper by the WAN model over ``wan``: the declared WAN unless given, the
    measured one after the WAN probe; overlapped, each timed by what the round does not hide); None where there
    is no choice (unsigned dense payloads, summed by an all-reduce; one region)."""
    from ...planner.exchange import scenario_exchange

    sc, method, kit = loop.sc, loop.method, loop.kit
    if (kit.dense and kit.key is None) or loop.n < 2:
        return None
    wan = wan if wan is not None else sc.wan_model()
    profiles = list(loop.run.profiles) if method.overlapped(sc) else []  # (what the round hides, overlapped)
    hidden = method.overlap_hidden_s(sc, profiles, wan, kit.modeled_payload_nbytes)
    return scenario_exchange(sc, wan, method.collective, kit.modeled_payload_nbytes, loop.combiner,
                             overlap=method.overlapped(sc), hidden_s=hidden)  # fmt: skip


def layout_for(loop: Any, m: int) -> ShardedExchange:
    """The sharded exchange of ``m`` members (shard k to the member of group rank k): the loop's own for every
    region, else one cut for ``m`` (an elastic quorum), kept for the quorums of that size to come."""
    if loop.sharded is not None and loop.sharded.n == m:
        return loop.sharded
    cache = getattr(loop, "sharded_layouts", None)
    if cache is None:
        cache = loop.sharded_layouts = {}
    if m not in cache:
        cache[m] = sharded_exchange(loop.combiner, m, loop.sc.geomesh.shard_bits)
    return cache[m]


def shaper_s(loop: Any, members: list[int]) -> float:
    """What the WAN shaper holds a sharded exchange of ``members`` to: the WAN model's time for the slices and
    combined shards this run really moves (``latency``: its four latency steps only)."""
    from .wan_shaper import WanShaper

    shaper = WanShaper(loop.faults.wan(members), loop.run.options.wan)
    if shaper.mode == "none" or len(members) < 2:
        return 0.0
    if shaper.mode == "latency":
        return shaper._latency_only(4)
    return shaper.wan.sharded_s(*sharded_sizes(loop, len(members)))


def sharded_sizes(loop: Any, m: int) -> tuple[int, int]:
    """The bytes a sharded exchange of ``m`` members really moves: (the slices of one payload, the combined
    shards), as signed on the wire."""
    ex = layout_for(loop, m)
    trust = SlotTrust(loop.kit.key, "", 0, ())
    slices = sum(trust.width(ex.slice_nbytes(k)) for k in range(ex.n))
    combined = sum(trust.width(ex.combined_nbytes(k)) for k in range(ex.n))
    return slices, combined


def _exclude_odd_plans(infos: dict[int, dict[str, Any]], exclude: dict[int, str]) -> None:
    """Members whose plan differs from the one most members hold (the same rule on every leader: the same
    infos) are kept out of the combine (``infos``: group rank -> round info)."""
    plans = Counter(str(i.get("plan")) for i in infos.values() if i.get("plan") is not None)
    if plans:
        common = min(plans, key=lambda d: (-plans[d], d))
        for k, i in infos.items():
            if i.get("plan") is not None and str(i["plan"]) != common and k not in exclude:
                exclude[k] = "its plan differs from the other regions' (the regions disagree)"


def static_sharded_exchange(xc: Any, payload: bytes | None, info: dict[str, Any],
                            members: list[int]) -> dict[str, Any]:  # fmt: skip
    """:meth:`StaticExchange.exchange` when the plan picks the sharded exchange: the round infos first (so a
    region whose info is malformed or whose plan differs from the others' is kept out of the combine on every
    leader), then :func:`sharded_round` over the leaders' group; every refused slice, absent update and lost
    shard is in the infos for the loop's screening step (:meth:`~.update.RoundUpdate.apply`). Returns the fields of the
    round's :class:`~.exchange.Exchanged` (this module sits below the exchange seam)."""
    from .wan_shaper import WanShaper

    run, loop = xc.run, xc.loop
    n, number = xc.n, run.rounds + 1
    t0 = since = time.perf_counter()
    before = run.transport.wan_bytes
    infos = run.transport.all_gather_json(info, run.leaders_group, n, what=f"the round infos of round {number}")
    exclude: dict[int, str] = {}
    for k, i in enumerate(infos):
        if not isinstance(i, dict):
            infos[k] = {"region": k, "active": True, "sent": False, "rejected": "its round info is not a JSON object"}
            exclude[k] = "its round info is not a JSON object"
        infos[k]["region"] = k
    _exclude_odd_plans(dict(enumerate(infos)), exclude)
    key, run_id = run.transport._trust()
    r = sharded_round(payload, loop.sharded, run.leaders_group, device=run.device, names=loop.names,
                      round_number=number, key=key, run_id=run_id, exclude=exclude, warn=quiet)  # fmt: skip
    run.transport.wan_bytes += r.sent_bytes
    for j, why in r.rejected.items():
        infos[j]["slot_rejected"] = why
    for k, why in r.lost_shards.items():
        infos[k]["shard_lost"] = why
    WanShaper(loop.faults.wan(members), run.options.wan).hold(shaper_s(loop, members), since)
    sharded = {"accepted": r.accepted, "lost_shards": {str(k): v for k, v in r.lost_shards.items()},
               "suspect": r.suspect, "tokens": r.tokens, "has_update": r.flat is not None,
               "received_bytes": r.received_bytes}  # fmt: skip
    return {"infos": infos, "payloads": None, "summed": None, "comm_s": time.perf_counter() - t0,
            "wan_bytes": run.transport.wan_bytes - before, "update": r.flat, "sharded": sharded}  # fmt: skip


def quorum_sharded_exchange(xc: Any, payload: bytes | None, info: dict[str, Any],
                            timeout_s: float | None) -> dict[str, Any]:  # fmt: skip
    """One attempt of :meth:`~.elastic.QuorumExchange.exchange` when the plan picks the sharded exchange, over
    the quorum's leaders (torchft's group; ``M`` members, its layout :func:`layout_for` ``M``).

    The round infos first, framed and authenticated (:meth:`~.membership.Membership.all_gather_framed_slots`):
    they say which group rank is which region (each member names its group rank in its info, checked against
    the slot its frame arrived in). A member whose frame was rejected (its region unknown: it is left out of
    the round, and its slots and combined shard are refused), whose info is malformed or names another
    slot, or whose plan differs from the common one is kept out of the combine on every leader. Then
    :func:`sharded_round` over :class:`QuorumMover` (slots bound to the round, the sender's region, the shard
    and the quorum). A member lost on the way fails a collective: ``ExchangeFailed`` goes to the caller,
    which re-forms the quorum without it and calls this again: M−1 members, a new layout, the lost
    member's shard owned by the survivors. Returns the fields of the round's :class:`~.exchange.Exchanged`
    (``comm_s`` is the caller's), in regions: infos by region, and the exchange's decisions by region."""
    m, loop, run = xc.membership, xc.loop, xc.run
    mine = m.group_rank()
    got = m.all_gather_framed_slots({**info, "slot": mine}, timeout_s=timeout_s)
    xc._note_rejections()
    size = m.pg.size()
    regions = [-1] * size
    by_slot: dict[int, dict[str, Any]] = {}
    exclude: dict[int, str] = {}
    for slot, region, i in got:
        if not isinstance(i, dict):
            i = {"region": region, "active": True, "sent": False, "rejected": "its round info is not a JSON object"}
            exclude[slot] = "its round info is not a JSON object"
        elif i.get("slot") != slot:
            exclude[slot] = f"its round info names quorum slot {i.get('slot')!r}; it came in slot {slot}"
        regions[slot], by_slot[slot] = region, i
    if regions[mine] != xc.me:
        raise RunError(f"region {loop.names[xc.me]}: its own round info is not in its slot of the quorum's group "
                       f"(slot {mine} holds {regions[mine]})")  # fmt: skip
    for slot in range(size):
        if regions[slot] < 0:
            exclude[slot] = "its round info was rejected"
    names = [loop.names[r] if 0 <= r < len(loop.names) else f"#{r}" if r >= 0 else f"(quorum member {k})"
             for k, r in enumerate(regions)]  # fmt: skip
    mover = QuorumMover(m, tuple(regions), timeout_s)
    if xc.run.hooks.pending("slices", loop.names[xc.me], xc.exchange_round):
        mover = _DiesAfterSlices(mover, lambda: xc.run.hooks.at("slices", loop.names[xc.me], xc.exchange_round,
                                                                 rank=xc.run.rank))  # fmt: skip
    r = sharded_round(payload, layout_for(loop, size), mover=mover, device=run.device, names=names,
                      round_number=xc.exchange_round, key=m.key, run_id=m.run_id, exclude=exclude,
                      warn=quiet)  # fmt: skip
    for j, why in r.rejected.items():
        if j in by_slot:
            by_slot[j]["slot_rejected"] = why
    for k, why in r.lost_shards.items():
        if k in by_slot:
            by_slot[k]["shard_lost"] = why
    infos = sorted(by_slot.values(), key=lambda i: i["region"])
    known = lambda ks: sorted(regions[k] for k in ks if regions[k] >= 0)  # noqa: E731
    sharded = {"accepted": known(r.accepted), "suspect": known(r.suspect),
               "lost_shards": {names[k]: v for k, v in r.lost_shards.items()}, "tokens": r.tokens,
               "has_update": r.flat is not None, "received_bytes": r.received_bytes,
               "owners": names}  # fmt: skip
    return {"infos": infos, "payloads": None, "summed": None, "wan_bytes": r.sent_bytes, "update": r.flat,
            "sharded": sharded}  # fmt: skip
