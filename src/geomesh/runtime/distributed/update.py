"""The round's update on every rank of the distributed runtime: what arrived is screened, what passed is
combined, the combined update is checked and the outer step taken, and each sender's part is told (who took
part, whose payload was rejected and why, who sent none, whose update was lost), with one warning per bad
sender. A static region that cannot authenticate most others' payloads stands aside here.

:class:`RoundUpdate` is held by the round loop (:class:`.rounds.RoundLoop`) and by the overlapped round
(:class:`.overlap.RankOverlap`), which apply the same screen → outvote → combine (:meth:`RoundUpdate.screened`).
What arrives comes from the exchanges (:mod:`.exchange`, :mod:`.elastic`, :mod:`.sharded_loop`); screening one
payload is :mod:`geomesh.runtime.payloads`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple  # noqa: UP035

import torch

from ...errors import RunError
from ..payloads import combine_payloads, screen_slots

Tensors = dict[str, torch.Tensor]


class Screened(NamedTuple):
    """Payloads screened and combined: the update (None: none passed), (region, why) of those rejected, the
    regions that sent none, and whether this region stood aside (then nothing of it is applied)."""

    update: Tensors | None
    rejected: list[tuple[int, str]]
    dropped: list[int]
    outvoted: bool


def lost_shard(why: str) -> str:
    """Why an owner's update is left out when its combined shard was rejected."""
    return f"its combined shard was rejected ({why}); the shard is left out of this round's update"


class RoundUpdate:
    """Screen, combine, check and step a round's exchange on this rank (region ``me`` of ``names``), the same on
    every rank; ``codec`` is the round in progress's (the loop sets it each round: Streaming DiLoCo's fragment).

    ``lay_out`` places a whole update as θ is held, ``outer`` takes the step, ``theta_changed`` is told after it;
    ``summed``: dense contributions summed by an all-reduce; ``overlapped``: an update applied inside the round
    after the one it came from. ``emit``/``count``/``speaks`` carry the warnings (the run's records, its
    counters, and whether this rank prints them); ``stood_aside`` is told why this region stands aside."""

    def __init__(self, combiner: Any, outer: Any, lay_out: Callable[[Tensors], Tensors], names: list[str], me: int,
                 hooks: Any, *, rank: int, device: torch.device, summed: bool, elastic: bool, overlapped: bool,
                 theta_changed: Callable[[], None], emit: Callable[[dict], None], count: Callable[[str], None],
                 speaks: bool, stood_aside: Callable[[str], None]):  # fmt: skip
        self.combiner, self.codec, self.outer, self.lay_out = combiner, combiner, outer, lay_out
        self.names, self.me, self.hooks, self.rank, self.device = names, me, hooks, rank, device
        self.summed, self.elastic, self.overlapped = summed, elastic, overlapped
        self.theta_changed, self.emit, self.count, self.speaks = theta_changed, emit, count, speaks
        self.stood_aside = stood_aside
        self.outvoted = False  # this static region holds another run key than the others (see outvoted_by)

    @torch.no_grad()
    def apply(self, result: Any, members: list[int], number: int) -> dict[str, Any]:
        """Screen every payload of ``result`` (an :class:`~.exchange.Exchanged`), combine those that pass, check
        the update and take the outer step, in round ``number`` (the one in progress). Returns who took part,
        whose update was rejected (why) or dropped, whose was lost, and the update applied."""
        infos = result.infos
        took_part = [i["region"] for i in infos if i.get("active", True)] if infos else list(members)
        rejected: list[tuple[int, str]] = []
        dropped: list[int] = []
        combined = None
        if self.summed:
            for i in infos:
                if i["active"] and not i["sent"]:
                    dropped.append(i["region"])
                if i.get("rejected"):
                    rejected.append((i["region"], f"payload rejected: {i['rejected']}"))
            combined = self.combiner.reduced_update(result.summed)
        elif result.sharded is not None:  # combined by the shards' owners (runtime/distributed/sharded_loop.py)
            combined = self._sharded(result, took_part, rejected, dropped, number)
            if self.outvoted:
                return self._aside(took_part)
        else:  # a slot that failed its signature (another key, forged, replayed): its sender is out
            refused = [(i["region"], f"payload rejected: {i['slot_rejected']}") for i in infos
                       if i.get("slot_rejected") and i["region"] in took_part]  # fmt: skip
            screened = self.screened(self.codec, result.payloads, took_part, number, refused_slots=refused)
            if screened.outvoted:  # counted as the others count it: only its own update is lost
                return self._aside(took_part)
            combined, rejected, dropped = screened.update, screened.rejected, screened.dropped
        if combined is not None and not all(bool(torch.isfinite(t).all()) for t in combined.values()):
            rejected.extend((i, "the combined update is not finite") for i in took_part)
            combined = None
        update = None
        if combined is not None:  # (overlapped: the update of the round before the one in progress)
            self.hooks.at("step", self.names[self.me], number - 1 if self.overlapped else number, rank=self.rank)
            update = self.lay_out(combined)
            self.outer.step(update)
            self.theta_changed()
        lost = set(dropped) | {i for i, _ in rejected}
        return {"took_part": took_part, "rejected": rejected, "dropped": dropped, "lost": lost, "update": update}

    def _aside(self, took_part: list[int]) -> dict[str, Any]:
        """The outcome of a round this region stood aside in: only its own update is lost."""
        return {"took_part": took_part, "rejected": [], "dropped": [], "lost": {self.me}, "update": None}

    def screened(self, codec: Any, slots: Mapping[int, bytes | None], took_part: list[int], number: int,
                 refused_slots: list[tuple[int, str]] | None = None) -> Screened:  # fmt: skip
        """Every slot of ``took_part`` screened by ``codec`` before any is combined, then combined. The evidence
        that this region holds another key: ``refused_slots``, the slots whose signature failed, where slots are
        signed (plain rounds; checked first, and those senders are not screened again), else the payloads' own
        tags (overlapped rounds: unsigned slots; the regions that sent none are told even if it stands aside)."""
        if refused_slots is not None and self.outvoted_by(refused_slots, took_part, number):
            return Screened(None, [], [], True)
        out = {i for i, _ in refused_slots or []}
        passed, rejected, dropped = screen_slots(codec, {i: p for i, p in slots.items()
                                                         if i in took_part and i not in out})  # fmt: skip
        if refused_slots is None and self.outvoted_by(rejected, took_part, number):
            return Screened(None, [], dropped, True)
        rejected = (refused_slots or []) + rejected
        return Screened(combine_payloads(codec, list(passed.values()), self.device), rejected, dropped, False)

    def outvoted_by(self, rejected: list[tuple[int, str]], took_part: list[int], number: int) -> bool:
        """A static region that cannot authenticate most of the others' payloads holds another run key than
        they do: it cannot follow θ (it would have to trust unverified bytes), so it stands aside: it goes on
        taking part in the collectives (so the others finish; they reject its payloads), applies nothing,
        leaves the agreement on θ, and ends with one error. (Elastic regions sort this at the quorum.)"""
        if self.elastic:
            return False
        others = [i for i in took_part if i != self.me]
        bad = {i for i, why in rejected if i != self.me and "HMAC" in why}
        if not self.outvoted and others and len(bad) * 2 > len(others):
            self.outvoted = True
            self.stood_aside(f"region {self.names[self.me]} cannot authenticate the payloads of regions "
                             f"{', '.join(self.names[i] for i in sorted(bad))}: it holds another run key "
                             "(reliability.hmac_key_env / hmac_key_file) than they do; it stood aside "
                             f"from round {number}")  # fmt: skip
        return self.outvoted

    def _sharded(self, result: Any, took_part: list[int], rejected: list, dropped: list[int],
                 number: int) -> Tensors | None:  # fmt: skip
        """The screening step of a sharded round: the senders whose slices were refused, the regions with no
        update, the owners whose combined shard was lost, and the update the leaders combined (None: nothing)."""
        for i in result.infos:
            k = i["region"]
            if k not in took_part:
                continue
            if i.get("slot_rejected"):
                rejected.append((k, f"payload rejected: {i['slot_rejected']}"))
            elif not i.get("sent"):
                dropped.append(k)
            if i.get("shard_lost") and not i.get("slot_rejected"):
                rejected.append((k, lost_shard(i["shard_lost"])))
        if self.stands_aside(result.sharded["suspect"], number) or result.update is None:
            return None
        return self.combiner._split(result.update)

    def stands_aside(self, suspect: list[int], number: int) -> bool:
        """Whether this region refused the slices or combined shards of most others in round ``number`` (a
        suspect of the sharded exchange): elastic, it stops; static, it stands aside from the run."""
        if self.me not in suspect:
            return False
        why = (f"region {self.names[self.me]} refused the slices or combined shards of most other regions in "
               f"round {number}: it holds another run key (reliability.hmac_key_env / hmac_key_file) than they do, "
               "or its link corrupts them")  # fmt: skip
        if self.elastic:  # it cannot follow the others' θ: it leaves their quorum
            raise RunError(f"{why}; it stops (restart it to rejoin with the live state)")
        if not self.outvoted:
            self.outvoted = True
            self.stood_aside(f"{why}; it stood aside from then on")
        return True

    @staticmethod
    def meanwhile(members: list[int], rejected: list[tuple[int, str]], dropped: list[int]) -> dict[str, Any]:
        """Overlapped rounds: the payloads that the updates applied during the round rejected or missed. Their
        tokens were counted when trained (the round they came from), so none are counted as lost here."""
        return {"took_part": list(members), "rejected": rejected, "dropped": dropped, "lost": set()}

    def warn(self, outcome: dict[str, Any], number: int) -> None:
        """One warning per bad sender of round ``number``, naming its region, and the counters."""
        for i, reason in outcome["rejected"]:
            self.count("rejected_payloads")
            self.emit({"type": "warning", "round": number, "worker": self.names[i],
                       "message": f"{reason}; its update is dropped this round"})  # fmt: skip
            if self.speaks and self.me == min(outcome["took_part"] or [self.me]):
                print(f"warning: round {number}: region {self.names[i]}: {reason}; its update is dropped this "
                      f"round", flush=True)  # fmt: skip
        for i in outcome["dropped"]:
            self.count("dropped_updates")
            self.emit({"type": "warning", "round": number, "worker": self.names[i],
                       "message": "non-finite loss, parameters or pseudo-gradient; its update is dropped"})  # fmt: skip
