"""What the asynchronous baseline (``async-local-sgd``) cannot do in the distributed runtime, said in one line
before any process starts (``geomesh launch`` checks it, and every rank again at set-up):

- elastic regions (``--min-regions``): each region its own world, reaching the server over a session of its own
  (:mod:`.async_elastic`); in arrival order only (``--async-order modeled`` refused: a region lost would hold every
  later turn). The server's region is the run: if it dies the others stop (docs/reliability.md);
- scenario faults: refused, but ``corrupt`` (a remote region's push damaged on the wire; ``at_round`` is the
  region's push number, 0-based: the server rejects it and drops that update only);
- a time budget: refused (the token budget ends the run: the server counts the tokens that reached θ);
- ``fsdp`` regions: refused (θ is whole on every rank: pulls and pushes carry all of it);
- checkpoints: none are written (in-flight, stale work is not checkpointable here, as in the twin): a cadence is
  warned about, ``--resume`` refused.
"""

from __future__ import annotations

from ...config import ConfigError, ScenarioConfig
from ...methods.async_local_sgd import NO_CHECKPOINTS
from ...methods.base import Method


def check_async_support(scenario: ScenarioConfig, method: Method, elastic: bool) -> None:
    """Refuse, in one line, what the distributed asynchronous baseline cannot run."""
    name = f"--method {method.name}"
    others = sorted({f.kind for f in scenario.faults if f.kind != "corrupt"})
    if others:
        raise ConfigError(f"{name}: the scenario has faults ({', '.join(others)}); the distributed asynchronous loop "
                          "injects only corrupt (a region's push damaged on the wire; remove the others)")  # fmt: skip
    server = [f.region for f in scenario.faults if f.region == scenario.regions[0].name]
    if server:
        raise ConfigError(f"{name}: a corrupt fault of region {server[0]}, the parameter server's, whose pushes do "
                          "not cross the WAN (name another region)")  # fmt: skip
    if scenario.training.time_budget_s is not None:
        raise ConfigError(f"{name}: not with a time budget (--time-budget, training.time_budget_s); give it a token "
                          "budget (--tokens)")  # fmt: skip
    sharded = [r.name for r in scenario.regions if r.strategy == "fsdp"]
    if sharded:
        raise ConfigError(f"{name}: regions {', '.join(sharded)} have strategy fsdp; its pushes and pulls carry the "
                          "whole θ, held on every rank (set their strategy to ddp)")  # fmt: skip
    if getattr(method, "server", 0) != 0:
        raise ConfigError(f"{name}: the parameter server must be in region 0 (whose leader keeps the records)")


def check_async_launch(scenario: ScenarioConfig, method: Method, resume: bool, order: str = "arrival",
                       elastic: bool = False) -> str | None:  # fmt: skip
    """(``geomesh launch``, before any process starts) ``--resume`` refused, and the modeled order with elastic
    regions; a warning line when checkpoints were asked for (None: nothing to say)."""
    if elastic and order == "modeled":
        raise ConfigError(f"--async-order modeled: not with elastic regions (--min-regions): a region lost would hold "
                          f"every later turn; use --async-order arrival")  # fmt: skip
    if resume:
        raise ConfigError(f"--resume: --method {method.name} writes no checkpoints in the distributed runtime; "
                          "start the run afresh")  # fmt: skip
    if scenario.reliability.checkpoint_every_rounds > 0:
        return f"warning: {method.name}: {NO_CHECKPOINTS}"
    return None
