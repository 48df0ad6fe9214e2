"""Which ranks train which region, in both shapes of a distributed run.

- One world for the whole run (:class:`RankLayout`): ranks fill regions in scenario order; ``k`` ranks per
  region from ``--ranks-per-region`` (:func:`parse_ranks_per_region`), else one per region or one per GPU
  (:func:`rank_layout`). The first rank of a region is its *leader*.
- Elastic regions (:class:`RegionLayout`): every region is its own world and sees only its ranks
  (:func:`region_layout`; the quorum's floor is the scenario's ``reliability.min_regions``, 0: not elastic).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import ConfigError, ScenarioConfig


@dataclass(frozen=True)
class RankLayout:
    """How many ranks each region runs; ranks fill regions in scenario order."""

    names: tuple[str, ...]
    counts: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return sum(self.counts)

    def ranks_of(self, region: int) -> list[int]:
        start = sum(self.counts[:region])
        return list(range(start, start + self.counts[region]))

    def region_of(self, rank: int) -> int:
        for i in range(len(self.counts)):
            if rank in self.ranks_of(i):
                return i
        raise ValueError(f"rank {rank} is outside a world of {self.world_size}")

    @property
    def leaders(self) -> list[int]:
        return [self.ranks_of(i)[0] for i in range(len(self.counts))]

    def to_json(self) -> dict[str, int]:
        return dict(zip(self.names, self.counts))


def parse_ranks_per_region(text: str | None, n_regions: int) -> list[int] | None:
    """``"2"`` (every region) or ``"2,1,1"`` (one figure per region, scenario order)."""
    if text is None or str(text).strip() == "":
        return None
    try:
        counts = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ConfigError(f"--ranks-per-region {text!r}: expected an integer or one integer per region") from None
    if len(counts) == 1:
        counts *= n_regions
    if len(counts) != n_regions or any(c < 1 for c in counts):
        raise ConfigError(f"--ranks-per-region {text!r}: expected one positive integer per region "
                          f"({n_regions} regions) or one for all")  # fmt: skip
    return counts


def rank_layout(scenario: ScenarioConfig, world_size: int, ranks_per_region: list[int] | None = None) -> RankLayout:
    names = tuple(r.name for r in scenario.regions)
    n = len(names)
    if ranks_per_region is not None:
        counts = tuple(ranks_per_region)
        if len(counts) != n or any(c < 1 for c in counts):
            raise ConfigError(f"ranks per region {list(counts)}: expected one positive integer per region ({n})")
        if sum(counts) != world_size:
            raise ConfigError(f"ranks per region {list(counts)} add up to {sum(counts)} ranks, "
                              f"but the world has {world_size}")  # fmt: skip
        return RankLayout(names, counts)
    if world_size == n:
        return RankLayout(names, (1,) * n)
    gpus = tuple(r.count for r in scenario.regions)
    if world_size == sum(gpus):
        return RankLayout(names, gpus)
    raise ConfigError(
        f"a world of {world_size} ranks does not fit scenario {scenario.name}: run {n} ranks (one per region) or "
        f"{sum(gpus)} (one per GPU, regions' count), or give --ranks-per-region"
    )


@dataclass(frozen=True)
class RegionLayout:
    """The layout of an elastic run as one region's world sees it: its own ranks, none of the others'."""

    names: tuple[str, ...]
    region: int
    count: int

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(self.count if i == self.region else 0 for i in range(len(self.names)))

    @property
    def world_size(self) -> int:
        return self.count

    def ranks_of(self, region: int) -> list[int]:
        return list(range(self.count)) if region == self.region else []

    def region_of(self, rank: int) -> int:
        if 0 <= rank < self.count:
            return self.region
        raise ValueError(f"rank {rank} is outside region {self.names[self.region]}'s world of {self.count}")

    @property
    def leaders(self) -> list[int]:
        return [0]

    def to_json(self) -> dict[str, int]:
        return {self.names[self.region]: self.count}


def region_layout(scenario, region: str | None, world: int) -> RegionLayout:
    names = tuple(r.name for r in scenario.regions)
    if not region:
        raise ConfigError("elastic regions (reliability.min_regions >= 1): every rank must know its region: "
                          "give --region NAME or set $GEOMESH_REGION")  # fmt: skip
    if region not in names:
        raise ConfigError(f"region {region!r} (--region / $GEOMESH_REGION) is not in scenario {scenario.name}: "
                          f"expected one of {', '.join(names)}")  # fmt: skip
    return RegionLayout(names, names.index(region), world)

