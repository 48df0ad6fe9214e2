"""The records of an elastic region's membership, round by round: ``leave`` and ``join`` events when the quorum
changes (or a region restarts in place), each round's ``round`` record (its members, lost tokens, deadline, the
frames refused), the membership statistics in :class:`~.elastic_state.RegionState`, the spans every region
reports, and the counts the summary gives at the end. :class:`~.elastic.QuorumExchange` holds it and hands it
each round's values.

Every leader keeps the records (:mod:`.records`). In a run folder that regions share, the leader of the
lowest-numbered live region writes ``events.jsonl`` (a leader that takes over rewrites the file) and, at the end,
``summary.json``; a region whose folder is its own (one host per region, no shared folder) writes both into it, so
every host's folder shows the run."""

from __future__ import annotations

from typing import Any, Callable

from .clock import record_spans
from .elastic_state import RegionState
from .exchange import Exchanged, reported_overhead_s, round_idle
from .records import RunRecords


class RoundRecords:
    """What one region's leader records of the regions' comings and goings (every rank keeps the statistics):
    ``state`` holds the statistics, the data streams and the last round's members, ``records`` the records,
    ``faults`` the round's injected faults (lost tokens count there too); ``emit`` sends a record."""

    def __init__(self, run: Any, names: list[str], state: RegionState, records: RunRecords, faults: Any,
                 emit: Callable[[dict[str, Any]], None]):  # fmt: skip
        self.run, self.names, self.me, self.state, self.records = run, names, run.region, state, records
        self.faults, self.emit = faults, emit

    def members_known(self, rejoined: list[int], members: list[int], number: int) -> None:
        """``leave``/``join`` records for round ``number``'s members (every leader alike)."""
        self.restarted_in_place(rejoined, number)
        self._membership_events(members, number)

    def restarted_in_place(self, rejoined: list[int], number: int) -> None:
        """``leave`` and ``join`` records for regions that came back behind the others while still members: their
        processes died and were restarted before any quorum formed without them (every leader, the rejoined
        one included, records them at the same point of the same round, so their records stay the same)."""
        for i in rejoined:
            if self.state.members is None or i not in self.state.members:
                continue  # a region absent from the last round: _membership_events records its join
            self.state.stats["leaves"] += 1
            self.state.stats["joins"] += 1
            why = "restarted (or fell behind) and healed before a quorum formed without it"
            self.emit({"type": "leave", "round": number, "time": self.run._now(), "region": self.names[i],
                       "reason": why})  # fmt: skip
            self.emit({"type": "join", "round": number, "time": self.run._now(), "region": self.names[i]})

    def _membership_events(self, members: list[int], number: int) -> None:
        """``leave``/``join`` records when the quorum differs from the last round's."""
        if self.state.members is not None:
            for i in sorted(set(self.state.members) - set(members)):
                self.state.stats["leaves"] += 1
                self.emit({"type": "leave", "round": number, "time": self.run._now(), "region": self.names[i],
                           "reason": "not in the round's quorum (died, hung or late)"})  # fmt: skip
            for i in sorted(set(members) - set(self.state.members)):
                self.state.stats["joins"] += 1
                self.emit({"type": "join", "round": number, "time": self.run._now(), "region": self.names[i]})
        self.state.members = list(members)

    def end_round(self, result: Exchanged, members: list[int], outcome: dict[str, Any], lost: dict[int, int],
                  planned: dict[int, int], number: int, deadline_s: float, rejections: list[dict[str, Any]],
                  slot_nbytes: int) -> None:  # fmt: skip
        """Round ``number`` exchanged: the members lost in it, the statistics, the streams, and on the leader the
        spans, the ledger's totals and the round's record (held to ``deadline_s``; ``rejections``: the frames
        refused since the last record; ``slot_nbytes``: one member's proxy payload)."""
        run, names = self.run, self.names
        infos = result.infos
        took_part = outcome["took_part"]
        for i in members:
            if i not in took_part and i in planned:  # lost in the round (healed at its quorum: trained nothing)
                lost[i] = planned[i]
                if self.state.members is not None and i not in self.state.members:
                    continue  # (overlapped: the next round's quorum, which formed before this exchange arrived)
                self.state.stats["leaves"] += 1
                self.emit({"type": "leave", "round": number, "time": run._now(), "region": names[i],
                           "reason": "lost during the round's exchange", "tokens_lost": planned[i]})  # fmt: skip
        self.state.members = [i for i in members if i in took_part or i not in planned]  # (healed now: still a member)
        for i in range(len(names)):
            if i not in took_part:
                self.state.stats["rounds_without"][names[i]] += 1
        for i, t in lost.items():
            self.state.stats["tokens_lost"][names[i]] += t
        self.faults.count_lost(number - 1, lost)
        for i in infos:
            self.state.streams[names[i["region"]]] = i["stream"]
        if run.is_leader:
            for i in infos:
                record_spans(run.telemetry, names[i["region"]], i["spans"])
            run._mark("other")
            t = run.ledger.totals
            t["bytes_sent"] += result.wan_bytes * len(infos)
            t["proxy_bytes_sent"] += slot_nbytes * (len(took_part) - len(outcome["dropped"]))
            t["comm_s"] += result.comm_s
            run.ledger.round_idle.append(round_idle(infos))
            self.emit({"type": "round", "round": number, "time": run._now(), "tokens": run.tokens_done,
                       "members": [names[i] for i in took_part], "compute_s": [i["compute_s"] for i in infos],
                       "overhead_s": [reported_overhead_s(i) for i in infos],
                       "straggler_idle_frac": round_idle(infos),
                       "exchange_s": result.comm_s, "bytes_sent": result.wan_bytes * len(infos),
                       "tokens_lost": {names[i]: t for i, t in lost.items()},
                       "deadline_s": deadline_s,
                       "frames_rejected": rejections,
                       **({"shard_owners": result.sharded["owners"]} if result.sharded else {})})  # fmt: skip
            self.records.write_events(min(took_part) == self.me)

    def ended(self, ends: list[dict[str, Any]], final: list[int]) -> None:
        """(leader) The run ended with the regions ``final``: every one's last spans (``ends``), then the records
        written once more, by the writer."""
        for end in ends:
            record_spans(self.run.telemetry, self.names[end["region"]], end.get("spans"))
        self.records.write_events(min(final) == self.me)

    def summary_fields(self, final: list[int]) -> dict[str, Any]:
        """The summary's membership counts (its ``elastic`` part after the configured ones), ``final`` the regions
        at the end."""
        st = self.state.stats
        return {"deadlines_s": [r.get("deadline_s") for r in self.records.records if r.get("type") == "round"],
                "regions_at_end": [self.names[i] for i in final], "leaves": st["leaves"],
                "joins": st["joins"], "rounds_without": st["rounds_without"],
                "rollbacks": int(self.run.telemetry.counters.get("rollbacks", 0)),
                "tokens_lost": st["tokens_lost"]}  # fmt: skip
