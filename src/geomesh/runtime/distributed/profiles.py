"""The worker profiles a distributed run plans from (:class:`RunProfiles`): each region's cost-model profile, or
a measured one (``--profile REGION=FILE``, or the plan loop's calibration, :mod:`.plan_loop`), read once.
"""

from __future__ import annotations

import copy

from ...config import ConfigError, ScenarioConfig
from ...hardware import WorkerProfile, load_profile


class RunProfiles:
    """Every region's profile, in scenario order: the files named in ``pairs`` (``REGION=FILE``) where given,
    else calibrated ones once :meth:`use_measured` gave them, else the scenario's cost model."""

    def __init__(self, scenario: ScenarioConfig, pairs: list[str]):
        self.scenario, self.pairs = scenario, pairs
        self._cache: list[WorkerProfile] | None = None

    def current(self) -> list[WorkerProfile]:
        """The profiles (copies: a caller may change them), read once: the plans of every round are made from
        these."""
        if self._cache is None:
            self._cache = self.read()
        return [copy.copy(p) for p in self._cache]

    def use_measured(self, measured: dict[str, WorkerProfile]) -> None:
        """From now on, ``measured`` (calibrated in place) for the regions no file names."""
        self._cache = self.read(measured)

    def read(self, calibrated: dict[str, WorkerProfile] | None = None) -> list[WorkerProfile]:
        """The cost model's profiles, or measured ones (``--profile REGION=FILE``, else ``calibrated``)."""
        sc = self.scenario
        names = [r.name for r in sc.regions]
        measured: dict[str, WorkerProfile] = {}
        for pair in self.pairs:
            region, _, path = pair.partition("=")
            if region not in names or not path:
                raise ConfigError(f"--profile {pair!r}: expected REGION=FILE with REGION one of {', '.join(names)}")
            try:
                measured[region] = load_profile(path)
            except ValueError as exc:
                raise ConfigError(f"--profile {region}: {exc}") from None
        for region, profile in (calibrated or {}).items():
            measured.setdefault(region, copy.copy(profile))
        return sc.worker_profiles(measured)
