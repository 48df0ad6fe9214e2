"""What an elastic region holds besides its exchange (:mod:`geomesh.runtime.distributed.elastic`), as one state:
θ and the outer optimizer with the run's counters, plans, records, the plan loop's state and the time budget's,
which a live region sends a region that joins or falls behind (torchft's recovery, :meth:`RegionState.state_dict`),
and this region's part of its checkpoint (:class:`~geomesh.runtime.distributed.run_checkpoint.RunCheckpointer`
into ``DIR/checkpoints/<region>``): the membership statistics, the data streams and the last round's members."""

from __future__ import annotations

import json
from typing import Any

import torch

from ...planner import Plan
from .core import params_checksum
from .records import RunRecords
from .region import lay_out_like


class RegionState:
    """One elastic region's state on one rank: ``params``, ``outer``, ``codec`` and ``faults`` are the round
    loop's, ``planning`` its plan loop, ``records`` the leader's records; ``stats``, ``streams`` and ``members``
    are the region's membership bookkeeping (its exchange updates them each round)."""

    def __init__(self, run: Any, params: dict[str, torch.Tensor], outer: Any, codec: Any, faults: Any, planning: Any,
                 records: RunRecords):  # fmt: skip
        self.run, self.params, self.outer, self.codec, self.faults = run, params, outer, codec, faults
        self.planning, self.records = planning, records
        self.names = [r.name for r in run.scenario.regions]
        self.me = run.region
        self.stats = {"rounds_without": dict.fromkeys(self.names, 0), "tokens_lost": dict.fromkeys(self.names, 0),
                      "leaves": 0, "joins": 0}  # fmt: skip
        self.streams: dict[str, dict] = {}
        self.members: list[int] | None = None  # last round's
        self.whole: tuple[dict, dict] | None = None  # a sharded θ and momentum, gathered (the leader: snapshot)
        self.healed_state: dict | None = None  # what torchft's recovery received, for the main thread to apply
        self.round_plan_at: int | None = None  # the index in run.plans of the plan the round in progress runs

    # ---- torchft's recovery: what a live region sends, and how a joiner loads it ---------------------
    def snapshot(self) -> None:
        """A region that shards θ (``strategy: fsdp``) gathers θ and the outer momentum after every change, one
        tensor at a time (every rank takes part), and its leader keeps them whole in host memory: torchft's
        recovery asks the leader for them from its own thread, where the region's ranks cannot gather."""
        if not self.run.sharded_global:
            return
        keep = self.run.is_leader  # every rank takes part in the gathers; only the leader copies to host memory
        with torch.no_grad():
            params = {k: _gathered(v, keep) for k, v in self.params.items()}
            buf = {k: _gathered(v, keep) for k, v in self.outer.buf.items()}
        if keep:
            self.whole = (params, buf)

    def theta_crc(self) -> str | None:
        """θ's checksum on this region's leader (the region's own ranks do not need it): from the whole host
        copy when θ is sharded (gathered at its last change, so no second gather), else from θ itself."""
        if not self.run.sharded_global:
            return params_checksum(self.params)
        return params_checksum(self.whole[0]) if self.run.is_leader else None

    def state_dict(self) -> dict[str, Any]:
        run, tel = self.run, self.run.telemetry
        if run.sharded_global:
            params, buf = self.whole
            outer = self.outer.state_dict(buf=buf)
        else:
            params, outer = {k: v.detach().cpu().clone() for k, v in self.params.items()}, self.outer.state_dict()
        return {
            "params": params,
            "outer": outer,
            "run": {"rounds": run.rounds, "tokens_done": run.tokens_done, "plans": [p.to_json() for p in run.plans],
                    "records": list(self.records.records), **tel.state_dict(), "run_totals": dict(run.ledger.totals),
                    "stats": json.loads(json.dumps(self.stats)), "faults": self.faults.state_dict(),
                    "streams": dict(self.streams), "members": list(self.members or []), "now": run._now(),
                    "plan_loop": self.planning.plan_state(), "time_budget": run.stopping.state_dict(),
                    "round_plan": self.round_plan_at},
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.healed_state = state  # applied by the main thread (and shared with the region's ranks)

    def take_healed(self) -> dict | None:
        """What torchft's recovery received at the last quorum (None: nothing), taken: the next quorum starts
        without it."""
        taken, self.healed_state = self.healed_state, None
        return taken

    def apply_healed(self, state: dict[str, Any]) -> int | None:
        run = self.run
        with torch.no_grad():  # whole tensors; a sharded θ takes each rank's shard of them
            whole = {k: state["params"][k].to(v.device) for k, v in self.params.items()}
            for k, v in lay_out_like(whole, self.params).items():
                self.params[k].copy_(v)
        buf = {k: t.to(self.params[k].device) for k, t in state["outer"]["buf"].items()}
        self.outer.load_state_dict({**state["outer"], "buf": lay_out_like(buf, self.params)})
        self.snapshot()
        s = state["run"]
        run.rounds, run.tokens_done = int(s["rounds"]), int(s["tokens_done"])
        run.plans = [Plan.from_json(p) for p in s["plans"]]
        self.stats = s["stats"]
        self.faults.load_state_dict(s["faults"])
        self.planning.load_plan_state(s["plan_loop"], healed=True)
        self.streams = dict(s["streams"])
        self.members = list(s["members"])
        run.worker.slowdown = run.scenario.regions[self.me].slowdown * self.faults.speed(self.me)
        run.clock.resume(float(s["now"]))  # this region's clock joins the others'
        run.stopping.load_state_dict(s.get("time_budget"))  # (the time budget spent: it stops with them)
        run._cursor = float(s["now"])
        run._spans = []
        if run.is_leader:  # the records are the live region's now: rewritten whole if this one writes them
            self.records.replace(s["records"])
            run.telemetry.load_state_dict(s)
            run.ledger.totals.update(s["run_totals"])
        # a restarted process: fresh AdamW, empty residual; the data stream goes on where it last reported
        run.worker.reset_inner_state()  # (fresh AdamW and loss scaler)
        if hasattr(self.codec, "reset_residual"):
            self.codec.reset_residual()
        mine = self.streams.get(self.names[self.me])
        if mine is not None:
            run.worker.stream.load_state_dict(mine)
        # the plan the live region's round in progress runs (an overlapped round healed into at its exchange)
        return round_plan_index(s.get("round_plan"), len(run.plans))

    # ---- this region's part of its checkpoint (one folder per region) -------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """What every rank of the region stores (plain JSON)."""
        return json.loads(json.dumps({"stats": self.stats, "streams": self.streams, "members": self.members}))

    def checkpoint_state_rank0(self) -> dict[str, Any] | None:
        return {"records": self.records.records} if self.run.is_leader else None

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        c = state["common"]
        self.stats, self.streams = c["stats"], dict(c["streams"])
        self.members = c["members"]
        self.run.worker.slowdown = self.run.scenario.regions[self.me].slowdown * self.faults.speed(self.me)
        if state["rank0"] is not None and self.run.is_leader:
            self.records.records[:] = state["rank0"]["records"]


def round_plan_index(value: Any, plans: int) -> int | None:
    """Which of a healing state's ``plans`` the round in progress runs, as the live region sent it (data: an index
    of those plans, else None: the healed region takes the plan in force)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < plans else None


def _gathered(shard: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """A sharded tensor gathered whole (a collective of the region); in host memory where ``keep``, else
    dropped at once."""
    whole = shard.full_tensor()
    return whole.cpu() if keep else None
