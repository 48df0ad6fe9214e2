"""Fault injection: one hooks object, named points of a round, for the tests and the chaos harness.

The distributed runtime calls :meth:`FaultHooks.at` at fixed points of every round; the default hooks inject
nothing. A fault is ``{"point", "region", "round", "action"}`` (and ``"factor"`` for ``slow``): at ``point`` of
round ``round`` (1-based), every rank of ``region`` does ``action`` once. The faults reach a rank as JSON in
``GEOMESH_FAULT_HOOKS``, read once where the rank starts (:meth:`FaultHooks.from_env`); no other module of the
runtime reads the environment for them. The older one-fault variables (``GEOMESH_TEST_*``) are read here too,
as faults of this form.

Points, in a round's order:

- ``quorum``: before the round's quorum (a region lost between rounds);
- ``send``: its inner steps done, its payload not yet sent (lost mid-round);
- ``slices``: (the sharded exchange) its slices sent, its combined shard not;
- ``arrived``: every payload arrived, the vote not yet cast (``lose``: its exchange fails there alone);
- ``step``: the round committed, its outer step not yet taken;
- ``checkpoint``: before its checkpoint of the round is written;
- ``done``: the round's records written (``exit``: the rank ends abruptly; ranks named by ``rank``).

Actions: ``kill`` (SIGKILL of the rank's own process), ``hang`` (stops responding; its heartbeat goes on),
``lose`` (the collective fails on this region alone; :meth:`at` returns True for the caller to raise it),
``exit`` (``os._exit(17)``), ``slow`` (from that round on, inner steps padded to ``factor`` x their time).

Two measurement stand-ins make plan-loop tests deterministic: ``wan`` (the WAN measured ``k`` times slower than
declared, ``k2`` after round ``after``) and ``compute_as_planned`` (each region's compute reported as planned).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

HOOKS_ENV = "GEOMESH_FAULT_HOOKS"
POINTS = ("quorum", "send", "slices", "arrived", "step", "checkpoint", "done")
ACTIONS = ("kill", "hang", "lose", "exit", "slow")
# the one-fault variables of earlier tests, each read as a fault of the form above
LEGACY = {"kill": "GEOMESH_TEST_KILL_MID_ROUND", "lose": "GEOMESH_TEST_LOSE_EXCHANGE",
          "slices": "GEOMESH_TEST_KILL_IN_SHARDED", "slow": "GEOMESH_TEST_SLOW_AFTER_ROUND",
          "exit": "GEOMESH_TEST_EXIT_AFTER_ROUND", "wan": "GEOMESH_TEST_WAN",
          "compute": "GEOMESH_TEST_COMPUTE_AS_PLANNED"}  # fmt: skip


class HooksError(ValueError):
    """A fault specification that names no point, action, region or round as allowed."""


@dataclass
class Fault:
    point: str
    region: str | None  # the region's name (None: rank-scoped, ``rank`` says which)
    round: int
    action: str
    factor: float = 1.0
    rank: int | None = None
    fired: bool = False

    @classmethod
    def parse(cls, data: Any) -> "Fault":
        if not isinstance(data, Mapping):
            raise HooksError(f"a fault is a JSON object, got {data!r}")
        point, action, number = data.get("point"), data.get("action"), data.get("round")
        if point not in POINTS:
            raise HooksError(f"fault point {point!r}: expected one of {', '.join(POINTS)}")
        if action not in ACTIONS:
            raise HooksError(f"fault action {action!r}: expected one of {', '.join(ACTIONS)}")
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            raise HooksError(f"fault round {number!r}: expected a round number >= 0")
        region, rank = data.get("region"), data.get("rank")
        if region is None and rank is None:
            raise HooksError("a fault names its region (or, for exit, its rank)")
        return cls(point=point, region=None if region is None else str(region), round=number, action=action,
                   factor=float(data.get("factor", 1.0)), rank=None if rank is None else int(rank))  # fmt: skip


@dataclass
class FaultHooks:
    faults: list[Fault] = field(default_factory=list)
    wan: tuple[float, int | None, float | None] | None = None  # (k, after, k2): see the module docstring
    compute_as_planned: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "FaultHooks":
        """The faults given to this process (:data:`HOOKS_ENV` and the one-fault variables); HooksError when
        one is malformed."""
        env = os.environ if environ is None else environ
        raw = env.get(HOOKS_ENV, "").strip()
        try:
            listed = json.loads(raw) if raw else []
        except json.JSONDecodeError as exc:
            raise HooksError(f"{HOOKS_ENV}: not JSON ({exc})") from None
        if not isinstance(listed, list):
            raise HooksError(f"{HOOKS_ENV}: expected a JSON list of faults")
        hooks = cls([Fault.parse(f) for f in listed])
        hooks._read_legacy(env)
        return hooks

    def _read_legacy(self, env: Mapping[str, str]) -> None:
        def parts(name: str) -> list[str]:
            return [p.strip() for p in env.get(LEGACY[name], "").split(":")] if env.get(LEGACY[name]) else []

        if len(p := parts("kill")) >= 2 and p[1].isdigit():  # REGION:ROUND[:hang]
            self.faults.append(Fault("send", p[0], int(p[1]), "hang" if p[2:] == ["hang"] else "kill"))
        if len(p := parts("lose")) == 2 and p[1].isdigit():  # REGION:ROUND
            self.faults.append(Fault("arrived", p[0], int(p[1]), "lose"))
        if len(p := parts("slices")) == 2 and p[1].isdigit():  # REGION:ROUND
            self.faults.append(Fault("slices", p[0], int(p[1]), "kill"))
        if len(p := parts("slow")) == 3 and p[1].isdigit():  # REGION:ROUND:FACTOR (from the round after ROUND)
            self.faults.append(Fault("send", p[0], int(p[1]) + 1, "slow", factor=float(p[2])))
        if len(p := parts("exit")) >= 2 and p[0].isdigit() and p[1].isdigit():  # RANK:ROUND[:hang]
            self.faults.append(Fault("done", None, int(p[1]), "hang" if p[2:] == ["hang"] else "exit", rank=int(p[0])))
        if p := parts("wan"):  # K or K:AFTER:K2
            self.wan = (float(p[0]), int(p[1]) if len(p) > 2 else None, float(p[2]) if len(p) > 2 else None)
        self.compute_as_planned = env.get(LEGACY["compute"]) == "1"

    def at(self, point: str, region: str, round_number: int, rank: int | None = None) -> bool:
        """Point ``point`` of round ``round_number`` on a rank of ``region``: the faults due there fire (once
        each). Returns True when one is ``lose`` (the caller fails its collective)."""
        lose = False
        for f in self.faults:
            if f.fired or f.point != point or f.action == "slow":
                continue
            due = f.round == round_number if point != "done" else round_number >= f.round
            if not due or (f.region is not None and f.region != region) or (f.rank is not None and f.rank != rank):
                continue
            f.fired = True
            # (the pid: a harness kills the process the line names, whichever way the process was started)
            print(f"fault hook: {f.action} at {point} of round {round_number} ({region}, rank {rank}, pid "
                  f"{os.getpid()})", file=sys.stderr, flush=True)  # fmt: skip
            if f.action == "lose":
                lose = True
                continue
            if f.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while f.action == "hang":  # stop responding (torchft's heartbeat thread goes on)
                time.sleep(3600)
            if f.action == "exit":
                os._exit(17)
        return lose

    def pending(self, point: str, region: str, round_number: int) -> bool:
        """Whether a fault is due at ``point`` of round ``round_number`` on ``region`` (without firing it)."""
        return any(not f.fired and f.point == point and f.region == region and f.round == round_number
                   for f in self.faults)  # fmt: skip

    def slowdown(self, region: str, round_number: int) -> float:
        """The hidden slowdown of ``region``'s inner steps in round ``round_number`` (1-based), 1 without."""
        found = [f.factor for f in self.faults if f.action == "slow" and f.region == region and round_number >= f.round]
        return found[-1] if found else 1.0

    def wan_factor(self, round_number: int) -> float | None:
        """How many times slower than declared the WAN is measured for the exchange of ``round_number`` (0: the
        probes before round 0); None: measured as it is."""
        if self.wan is None:
            return None
        k, after, k2 = self.wan
        return k2 if after is not None and round_number > after else k

    def forget(self, region: str) -> None:
        """A region healed into the run by a restarted process: faults aimed at its old process are spent."""
        for f in self.faults:
            if f.region == region and f.action in ("kill", "hang"):
                f.fired = True


NO_HOOKS = FaultHooks()
