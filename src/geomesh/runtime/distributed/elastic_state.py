"""What an elastic region keeps besides θ and the outer optimizer (:mod:`geomesh.runtime.distributed.elastic`): the run's
records (every leader keeps them; in a folder regions share, the leader of the lowest-numbered live region
writes ``events.jsonl``, rewriting it whole when it takes over; a region whose folder is its own, a host's
disk, writes them there too), the state a live region sends a region that joins or falls behind
(torchft's recovery), and this loop's part of a region's checkpoint
(:class:`~geomesh.runtime.distributed.checkpoints.RunCheckpointer` into ``DIR/checkpoints/<region>``)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from ... import checkpoint as ckpt
from ...planner import Plan
from ...telemetry import _jsonable
from .core import params_checksum
from .membership import ADVERTISE_ENV
from .region import lay_out_like
from .transport import WanShaper


class Records:
    """A telemetry sink that keeps every record (what a joining region receives and a new writer rewrites)."""

    def __init__(self, records: list[dict[str, Any]]):
        self.records = records

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(json.loads(json.dumps(record, default=_jsonable)))

    def close(self) -> None:
        pass


class ElasticState:
    """Records, recovery state and checkpoint state of :class:`~geomesh.runtime.distributed.elastic.QuorumExchange` (a part
    of its class: it reads the loop's and the run's fields)."""

    # ---- torchft's recovery: what a live region sends, and how a joiner loads it ---------------------
    def _snapshot(self) -> None:
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

    def _theta_crc(self) -> str | None:
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
                    "records": list(self.records), **tel.state_dict(), "run_totals": dict(run.totals),
                    "stats": json.loads(json.dumps(self.stats)), "faults": self.faults.state_dict(),
                    "streams": dict(self.streams), "members": list(self.members or []), "now": run._now(),
                    "plan_loop": self.loop.plan_state(), "time_budget": run.stopping.state_dict(),
                    "round_plan": self.loop.round_plan_at},
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.healed_state = state  # applied by the main thread (and shared with the region's ranks)

    def _apply_healed(self, state: dict[str, Any]) -> None:
        run = self.run
        with torch.no_grad():  # whole tensors; a sharded θ takes each rank's shard of them
            whole = {k: state["params"][k].to(v.device) for k, v in self.params.items()}
            for k, v in lay_out_like(whole, self.params).items():
                self.params[k].copy_(v)
        buf = {k: t.to(self.params[k].device) for k, t in state["outer"]["buf"].items()}
        self.outer.load_state_dict({**state["outer"], "buf": lay_out_like(buf, self.params)})
        self._snapshot()
        s = state["run"]
        run.rounds, run.tokens_done = int(s["rounds"]), int(s["tokens_done"])
        run.plans = [Plan.from_json(p) for p in s["plans"]]
        self.stats = s["stats"]
        self.faults.load_state_dict(s["faults"])
        self.loop.load_plan_state(s["plan_loop"], healed=True)
        self.loop.healed_round_plan = round_plan_index(s.get("round_plan"), len(run.plans))
        self.streams = dict(s["streams"])
        self.members = list(s["members"])
        run.worker.slowdown = self.sc.regions[self.me].slowdown * self.faults.speed(self.me)
        run.clock.resume(float(s["now"]))  # this region's clock joins the others'
        run.stopping.load_state_dict(s.get("time_budget"))  # (the time budget spent: it stops with them)
        self.written = -1  # the records are the live region's now: rewrite events.jsonl if this one writes it
        run._cursor = float(s["now"])
        run._spans = []
        if run.is_leader:
            self.records[:] = s["records"]
            run.telemetry.load_state_dict(s)
            run.totals.update(s["run_totals"])
        # a restarted process: fresh AdamW, empty residual; the data stream goes on where it last reported
        run.worker.reset_inner_state()  # (fresh AdamW and loss scaler)
        if hasattr(self.codec, "reset_residual"):
            self.codec.reset_residual()
        mine = self.streams.get(self.names[self.me])
        if mine is not None:
            run.worker.stream.load_state_dict(mine)

    # ---- this component's part of the region's checkpoint (one folder per region) --------------------------
    def resumed(self) -> None:
        """Resumed from this region's own newest checkpoint. The rounds its folder holds go with its first quorum
        header, and torchft's step stays 0 until the members agree (:meth:`_agreed_resume_round`): a step of its
        own would make torchft heal the regions whose newest checkpoint is older from the one that got further,
        with a fresh AdamW, so the run would part from the uninterrupted one."""
        from .checkpoints import list_complete

        held = [r for r, _, _ in list_complete(self.run._checkpoint_dir())]
        self.pending_resume = {"loaded": self.run.rounds, "rounds": held}
        self._snapshot()

    def resumed_at_round(self) -> None:
        """The loop loaded the agreed round: torchft's step is the rounds done, and the records are rewritten."""
        if self.membership is not None:
            self.membership.set_step(self.run.rounds)
        self.written = -1
        self._snapshot()

    @staticmethod
    def _agreed_resume_round(resuming: list[dict[str, Any]]) -> int:
        """The newest round whose checkpoint every resumed member holds, from their quorum headers (every leader
        computes it from the same headers). With none in common, the newest any of them loaded: the others are
        healed from it (the run goes on; it is no longer bit for bit the uninterrupted one)."""
        held, loaded = [], [0]
        for h in resuming:
            rounds, got = h["resume"].get("rounds"), h["resume"].get("loaded")
            if isinstance(rounds, list) and all(type(r) is int and r >= 0 for r in rounds):
                held.append(set(rounds))
            if type(got) is int and got >= 0:
                loaded.append(got)
        common = set.intersection(*held) if held else set()
        return max(common) if common else max(loaded)

    def checkpoint_state(self) -> dict[str, Any]:
        """What every rank of the region stores (plain JSON)."""
        return json.loads(json.dumps({"stats": self.stats, "streams": self.streams, "members": self.members}))

    def checkpoint_state_rank0(self) -> dict[str, Any] | None:
        return {"records": self.records} if self.run.is_leader else None

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        c = state["common"]
        self.stats, self.streams = c["stats"], dict(c["streams"])
        self.members = c["members"]
        self.run.worker.slowdown = self.sc.regions[self.me].slowdown * self.faults.speed(self.me)
        if state["rank0"] is not None and self.run.is_leader:
            self.records[:] = state["rank0"]["records"]

    # ---- events.jsonl ----------------------------------------------------------------------------------
    # ---- the WAN probed before round 0 (plan_loop.py) -------------------------------------------------------
    def probe(self, nbytes: int, members: list[int]) -> float:
        """(leader) One all-gather of ``nbytes`` per member over the quorum, held by the WAN shaper as an
        exchange is, after a tiny one that lines the members up: its seconds."""
        m = self.membership
        m.all_gather_framed({"region": self.me, "probe": b""})  # (a frame names the region it is signed for)
        since = time.perf_counter()
        m.all_gather_framed({"region": self.me, "probe": bytes(nbytes)})
        shaper = WanShaper(self.faults.wan(members), self.run.options.wan)
        shaper.hold(shaper.allgather_s(nbytes), since)
        return time.perf_counter() - since

    def gather_json(self, obj: Any, what: str) -> list[Any]:
        """(leader) Every member's ``obj`` (JSON), over the quorum."""
        return self.membership.all_gather_framed({**obj, "region": self.me})

    def _note_rejections(self) -> None:
        """The members the last collective refused, for the round's record, by region name (``claimed``: what
        an unauthenticated frame says it is)."""
        for r in self.membership.rejected:
            if r["claimed"] and r["region"] is not None and ("HMAC" in r["reason"] or "unsigned" in r["reason"]):
                self.refused.add(r["region"])
            entry = {"region": r["name"], "claimed": r["claimed"], "reason": r["reason"]}
            if entry not in self.round_rejections:  # (the first round's startup wait repeats its header)
                self.round_rejections.append(entry)

    def _restarted_in_place(self, rejoined: list[int]) -> None:
        """``leave`` and ``join`` records for regions that came back behind the others while still members: their
        processes died and were restarted before any quorum formed without them (every leader, the rejoined
        one included, records them at the same point of the same round, so their records stay the same)."""
        run = self.run
        for i in rejoined:
            if self.members is None or i not in self.members:
                continue  # a region absent from the last round: _membership_events records its join
            self.stats["leaves"] += 1
            self.stats["joins"] += 1
            self._emit({"type": "leave", "round": run.rounds + 1, "time": run._now(), "region": self.names[i],
                        "reason": "restarted (or fell behind) and healed before a quorum formed without it"})  # fmt: skip
            self._emit({"type": "join", "round": run.rounds + 1, "time": run._now(), "region": self.names[i]})

    def _membership_events(self, members: list[int]) -> None:
        """``leave``/``join`` records when the quorum differs from the last round's."""
        run = self.run
        if self.members is not None:
            for i in sorted(set(self.members) - set(members)):
                self.stats["leaves"] += 1
                self._emit({"type": "leave", "round": run.rounds + 1, "time": run._now(), "region": self.names[i],
                            "reason": "not in the round's quorum (died, hung or late)"})  # fmt: skip
            for i in sorted(set(members) - set(self.members)):
                self.stats["joins"] += 1
                self._emit({"type": "join", "round": run.rounds + 1, "time": run._now(), "region": self.names[i]})
        self.members = list(members)

    def _claim_folder(self) -> None:
        """(leader) Mark the run folder as used by this region (``DIR/regions/<region>.json``: its host and
        address), so that :meth:`_own_folder` can tell a host's own folder from one that regions share."""
        run = self.run
        if not run.is_leader or run.out_dir is None:
            return
        mine = {"region": self.names[self.me], "host": socket.gethostname(),
                "address": os.environ.get(ADVERTISE_ENV) or None}  # fmt: skip
        folder = Path(run.out_dir) / "regions"
        folder.mkdir(parents=True, exist_ok=True)
        ckpt.write_atomic(folder / f"{self.names[self.me]}.json", json.dumps(mine).encode())

    def _own_folder(self) -> bool:
        """Whether no other region has used this run folder (a host's own disk, not a folder regions share):
        then this region keeps the run's records and summary there too, whichever region writes them in a
        shared folder. Every region claims the folder before the first quorum; once shared, always shared."""
        if getattr(self, "_shared_folder", False) or self.run.out_dir is None:
            return False
        folder = Path(self.run.out_dir) / "regions"
        others = [p for p in folder.glob("*.json") if p.stem != self.names[self.me]] if folder.is_dir() else []
        self._shared_folder = bool(others)
        return not others

    def _writer(self, took_part: list[int]) -> bool:
        """Whether this region's leader writes ``events.jsonl`` and ``summary.json``: the lowest-numbered live
        region's in a folder regions share, every region's in its own."""
        run = self.run
        return run.is_leader and run.out_dir is not None and (min(took_part) == self.me or self._own_folder())

    def _write_events(self, took_part: list[int]) -> None:
        """The lowest-numbered live region's leader keeps ``events.jsonl`` (a new writer rewrites it whole)."""
        if not self._writer(took_part):
            self.written = -1
            return
        path = Path(self.run.out_dir) / "events.jsonl"
        lines = [json.dumps(r, allow_nan=False) + "\n" for r in self.records]
        if self.written < 0:  # a new writer: the whole file, replaced atomically and flushed to disk
            ckpt.write_atomic(path, "".join(lines).encode())
        else:
            with open(path, "a") as f:
                f.write("".join(lines[self.written :]))
                f.flush()
                os.fsync(f.fileno())
        self.written = len(lines)


def round_plan_index(value: Any, plans: int) -> int | None:
    """Which of a healing state's ``plans`` the round in progress runs, as the live region sent it (data: an index
    of those plans, else None: the healed region takes the plan in force)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < plans else None


def _gathered(shard: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """A sharded tensor gathered whole (a collective of the region); in host memory where ``keep``, else
    dropped at once."""
    whole = shard.full_tensor()
    return whole.cpu() if keep else None
