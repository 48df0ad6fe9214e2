"""What the distributed runtime refuses to run (:func:`check_distributed_support`), said in one line before any
process starts (``geomesh launch`` checks it, and every rank again at set-up): a method's own limits
(:meth:`~geomesh.methods.base.Method.check`), the asynchronous baseline's (:mod:`.async_checks`), the ddp
baseline's, and the membership faults a static world cannot honour.
"""

from __future__ import annotations

from ...config import ConfigError, ScenarioConfig
from ...methods.base import Method
from .async_checks import check_async_support

MEMBERSHIP_FAULTS = ("leave", "join")  # faults that change who is in a round: elastic regions only


def check_distributed_support(scenario: ScenarioConfig, method: Method, elastic: bool = False) -> None:
    """Refuse, in one line, what the distributed runtime cannot run (before any process starts, and on every
    rank): what the asynchronous baseline cannot do, a sharded ddp baseline, scenario faults the run cannot
    honour."""
    method.check(scenario)
    if method.kind == "async":
        return check_async_support(scenario, method, elastic)  # (runtime/distributed/async_checks.py)
    if method.kind == "ddp":
        sharded = [r.name for r in scenario.regions if r.strategy == "fsdp"]
        if sharded:
            raise ConfigError(f"--method ddp: regions {', '.join(sharded)} have strategy fsdp; the ddp baseline keeps "
                              "a full replica on every rank (set their strategy to ddp)")  # fmt: skip
        if scenario.faults:
            kinds = sorted({f.kind for f in scenario.faults})
            raise ConfigError(f"--method ddp: the scenario has faults ({', '.join(kinds)}); the ddp baseline's step "
                              "loop does not inject them (remove the scenario's faults, or run a round-based "
                              "method)")  # fmt: skip
        if elastic:
            raise ConfigError("--method ddp: not with elastic regions (reliability.min_regions / --min-regions): "
                              "ddp all-reduces every step across every region")  # fmt: skip
        fp16 = [r.name for r in scenario.regions if scenario.region_precision(r) == "fp16"]
        if fp16:
            raise ConfigError(f"--method ddp: regions {', '.join(fp16)} train in fp16, whose loss scaling is each "
                              "region's own; the ddp baseline all-reduces every step's gradients across regions "
                              "(give them precision bf16, fp32 or auto)")  # fmt: skip
    if not elastic and any(f.kind in MEMBERSHIP_FAULTS for f in scenario.faults):
        raise ConfigError("the scenario's leave/join faults need elastic regions: set reliability.min_regions (or "
                          "--min-regions N) to at least 1; a static run keeps every region in every round")  # fmt: skip
