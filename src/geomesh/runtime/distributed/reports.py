"""How a rank's reports reach the others in a static distributed run (:class:`RankReports`): gathered inside its
region, then across the regions' leaders (only leaders cross the WAN), with the check that every rank holds the
same θ (its checksum) before a round's reports count. The groups are :class:`~geomesh.runtime.distributed.core.
RankRun`'s set-up; the messages travel over :mod:`.transport`; rank 0 records them (:mod:`.ledger`).
"""

from __future__ import annotations

from typing import Any


class RankFailure(RuntimeError):
    """A peer rank died or hung past the timeout, or the ranks disagree; the message says which."""


class RankReports:
    """This rank's way to its region's ranks (``region_group``, None for a region of one rank: ``region_ranks``)
    and, on a leader, to the other leaders (``leaders_group``, ``leaders`` of them); ``names``: the regions'."""

    def __init__(self, transport: Any, names: list[str], region: int, region_ranks: list[int], is_leader: bool,
                 region_group: Any, leaders_group: Any, leaders: int):  # fmt: skip
        self.transport, self.names, self.region, self.region_ranks = transport, names, region, region_ranks
        self.is_leader, self.region_group = is_leader, region_group
        self.leaders_group, self.leaders = leaders_group, leaders

    def in_region(self, mine: dict[str, Any], what: str) -> list[dict[str, Any]]:
        """Every rank of this region's ``mine`` on its leader (and every other rank of it), in rank order."""
        if self.region_group is None:
            return [mine]
        return self.transport.all_gather_json(mine, self.region_group, len(self.region_ranks), what=what)

    def from_leaders(self, info: dict[str, Any], what: str) -> list[dict[str, Any]] | None:
        """(leaders) Every leader's ``info``, in region order; other ranks get None."""
        if not self.is_leader:
            return None
        return self.transport.all_gather_json(info, self.leaders_group, self.leaders, what=what)

    def checked(self, info: dict[str, Any], unit: str, what: str, number: int) -> list[dict[str, Any]] | None:
        """Every region's ``info`` of round (``unit``: round or step) ``number`` on the leaders (None elsewhere),
        after checking that every rank holds the same ``what`` (its ``crc``): inside each region first, then
        across the leaders."""
        region = self.in_region({"crc": info["crc"], "intra_bytes": info["intra_bytes"]},
                                what=f"the region's checksum of {unit} {number}")  # fmt: skip
        crcs = {i["crc"] for i in region}
        if len(crcs) > 1:
            detail = ", ".join(f"rank {r}: {i['crc']}" for r, i in zip(self.region_ranks, region))
            raise RankFailure(f"{unit} {number}: the ranks of region {self.names[self.region]} hold different "
                              f"{what} ({detail})")  # fmt: skip
        info = {**info, "intra_bytes": sum(i["intra_bytes"] for i in region)}
        infos = self.from_leaders(info, what=f"the checksum of {unit} {number}")
        if infos is not None and len({i["crc"] for i in infos if i["crc"] is not None}) > 1:
            detail = ", ".join(f"{self.names[k]}: {i['crc']}" for k, i in enumerate(infos))
            raise RankFailure(f"{unit} {number}: the regions hold different {what} ({detail})")
        return infos
