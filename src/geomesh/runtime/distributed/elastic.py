"""Elastic regions: the distributed runtime's round loop when regions may die, hang, fall behind and come back.

With ``reliability.min_regions >= 1`` (or ``--min-regions``) every region is its own ``torch.distributed``
world (its ranks only: one ``torchrun`` per region), and regions meet only through
:class:`~geomesh.runtime.distributed.membership.Membership` (torchft: a quorum per round from the Lighthouse, a Gloo
group reconfigured over the quorum's leaders, live recovery of a region that is behind). One round:

1. **Quorum.** The region's leader asks for the round's quorum. A region that died is not in it (it stopped
   heartbeating); one that hangs or is late is left out once ``reliability.round_deadline_s`` has passed; a
   region behind the others (restarted, or back after missing rounds) first receives θ, the outer momentum
   and the loop's state from a live region (torchft's checkpoint transport), then takes part with a fresh
   AdamW and an empty error-feedback residual (a restarted process, as in the emulated runtime); its data
   stream continues where it last reported it. Members all-gather a header (region, a hash of scenario,
   method, seed and budget) over the quorum: a region whose hash differs from the others' stops with one
   ``error:`` line. At the first round, regions wait (up to ``--timeout``) until every region is in.
2. **Plan.** The live regions are planned with ``method.plan`` over the WAN that links them (re-planned only
   when the set changes), as the emulated runtime does after a leave or join.
3. **Inner steps** on every rank of every live region, the payload on its leader.
4. **Exchange** over the quorum's leaders: an all-gather of payload + round info (sign codecs) or an
   all-reduce of the weighted fp32 pseudo-gradient (dense codecs). If a member dies or passes the deadline
   there, the survivors form a new quorum and exchange the payloads they already have: the lost region's
   tokens of this round are counted as lost. Every leader screens every payload before combining any, and
   applies the same outer step (payloads in scenario order, as the emulated runtime combines them).
5. **Commit** (torchft's step = rounds done) and records: ``round`` (members, lost tokens), ``leave`` and
   ``join`` events, spans, evaluations. The leader of the lowest-numbered live region writes
   ``events.jsonl`` (every leader keeps the records; a leader that takes over rewrites the file) and, at
   the end, ``summary.json``.

The run goes on while at least ``min_regions`` regions form a quorum; with fewer, the quorum times out
after ``--timeout`` seconds and the run stops with one ``error:`` line.

The scenario's ``faults`` apply at the start of their round on every region alike (``slowdown``,
``bandwidth``, ``nan``, ``corrupt``; ``leave``/``join``: the region stays connected but trains and sends
nothing in between). With ``--checkpoint-every N`` each region writes its own DCP checkpoint
(:class:`~geomesh.runtime.distributed.checkpoints.RunCheckpointer` over its ranks, plus this loop's state) into
``DIR/checkpoints/<region>``; ``--resume`` restarts every region from its newest one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from ... import checkpoint as ckpt
from ...codec import Manifest
from ...config import ConfigError
from ...errors import RunError
from ...methods.base import budget_steps, payload_key
from ...outer import OuterNesterov
from ...planner import Plan
from ...telemetry import Telemetry
from ...worker import inner_lr
from ..checkpoint_state import run_fingerprint
from .elastic_state import ElasticState, Records
from ..faults import FAULT_KINDS, ONE_ROUND_FAULTS, corrupt_payload, faults_at, optimizer_finite, poisoned
from .layout import RegionLayout, min_regions_of, region_layout
from .membership import LIGHTHOUSE_ENV, ExchangeFailed, Membership, MembershipError
from ..payloads import screen_payload
from .region import lay_out_like
from .transport import WanShaper

TEST_KILL_ENV = "GEOMESH_TEST_KILL_MID_ROUND"  # "REGION:ROUND[:hang]": its ranks die (or hang) before that exchange


# ---- the loop -------------------------------------------------------------------------------------------


class ElasticLoop(ElasticState):
    """The elastic round loop of one region (see the module docstring)."""

    def __init__(self, run):
        self.run = run
        sc, tr, method = run.scenario, run.scenario.training, run.method
        if method.kind != "outer":
            raise RunError(f"elastic regions (reliability.min_regions) run round-based methods (diloco, geomesh, "
                           f"geomesh-balance-only, geomesh-sign-only), not {method.name}")  # fmt: skip
        self.sc, self.tr, self.method = sc, tr, method
        self.names = [r.name for r in sc.regions]
        self.n = len(self.names)
        self.me = run.region
        self.min_regions = min_regions_of(sc, run.options.min_regions)
        self.deadline_s = sc.reliability.round_deadline_s
        self.params = {k: p.detach() for k, p in run.global_model.named_parameters()}
        self.manifest = Manifest.from_tensors(self.params)
        key = payload_key(sc)
        self.codec = method.make_codec(self.manifest, sc, key=key)
        self.combiner = method.make_codec(self.manifest, sc, key=key)
        self.outer = OuterNesterov(self.params, lr=tr.outer_lr, momentum=tr.outer_momentum)
        self.wan = sc.wan_model()
        self.dense = method.collective == "all_reduce"
        self.d = self.manifest.numel
        self.seq = sc.proxy.seq_len
        self.proxy_payload = self.combiner.payload_nbytes()
        self.modeled_payload = method.modeled_payload_bytes(sc, self.manifest)
        self.profiles = run._profiles()
        self.job_hash = ckpt.fingerprint_hash(run_fingerprint(sc, method.name, run.seed, run.budget))
        self.records: list[dict[str, Any]] = []
        self.stats = {"rounds_without": dict.fromkeys(self.names, 0), "tokens_lost": dict.fromkeys(self.names, 0),
                      "leaves": 0, "joins": 0}  # fmt: skip
        self.faults: list[dict[str, Any]] = []
        self.streams: dict[str, dict] = {}
        self.members: list[int] | None = None  # last round's
        self.slowdown = {i: 1.0 for i in range(self.n)}
        self.bandwidth = {i: 1.0 for i in range(self.n)}
        self.away: set[int] = set()  # regions out of the run by a scheduled `leave` until their `join`
        self.written = -1  # records already in events.jsonl (-1: this leader has not written it)
        self.healed_state: dict | None = None
        self.whole: tuple[dict, dict] | None = None  # a sharded θ and momentum, gathered (the leader: _snapshot)
        self.membership: Membership | None = None
        region, _, at = os.environ.get(TEST_KILL_ENV, "").partition(":")
        at, _, how = at.partition(":")
        self._kill_at = (region, int(at), how) if at.isdigit() else None

    # ---- helpers -------------------------------------------------------------------------------------
    def _share(self, obj: Any, what: str) -> Any:
        """The leader's ``obj`` on every rank of the region."""
        if self.run.world == 1:
            return obj
        return self.run.transport.broadcast_object(obj, src=0, what=what)

    def _emit(self, record: dict[str, Any]) -> None:
        if self.run.is_leader:
            self.run.telemetry.emit(record)

    def _wan(self, members: list[int]):
        wan = self.wan
        for i, f in self.bandwidth.items():
            if f != 1.0:
                wan = wan.scaled_bandwidth(i, f)
        return wan.subset(members)

    def _plan(self, members: list[int]) -> Plan:
        wan = self._wan(members)
        exchange_s, _ = self.method.exchange(wan, self.modeled_payload)
        profiles = [self.profiles[i] for i in members]
        for p, i in zip(profiles, members):
            p.slowdown = self.sc.regions[i].slowdown * self.slowdown[i]
        return self.method.plan(self.sc, profiles, exchange_bytes=self.modeled_payload, exchange_s=exchange_s)

    # ---- membership -----------------------------------------------------------------------------------
    def _connect(self) -> None:
        run = self.run
        lighthouse = run.options.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ConfigError(f"elastic regions need the quorum service's address: --lighthouse http://HOST:PORT or "
                              f"${LIGHTHOUSE_ENV} (`geomesh launch` starts one and sets it)")  # fmt: skip
        try:
            self.membership = Membership(
                region=self.me, name=self.names[self.me], lighthouse=lighthouse, min_regions=self.min_regions,
                deadline_s=self.deadline_s, quorum_timeout_s=run.options.timeout_s, state_dict=self.state_dict,
                load_state_dict=self.load_state_dict, store_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                store_port=int(os.environ.get("MASTER_PORT", "29500")),
            )  # fmt: skip
        except MembershipError as exc:
            raise RunError(str(exc)) from None

    def _quorum(self, first: bool) -> dict[str, Any]:
        """(leader) Join the round's quorum and learn its members; retried until a header exchange works."""
        m = self.membership
        startup_until = time.monotonic() + self.run.options.timeout_s
        while True:
            healed, _ = m.quorum()
            try:
                wait = first and not healed and time.monotonic() < startup_until
                headers = m.all_gather_object({"region": self.me, "hash": self.job_hash, "wait": wait,
                                               "healed": healed})  # fmt: skip
            except ExchangeFailed as exc:
                m.report(exc)
                continue
            self._check_hashes(headers)
            members = sorted(h["region"] for h in headers)
            if healed:
                first = False
            if len(members) < self.n and all(h["wait"] for h in headers):
                time.sleep(0.3)  # the first round: wait for every region to come up
                continue
            # regions that were behind and received a live region's state at this quorum
            return {"members": members, "healed": healed, "rejoined": sorted(h["region"] for h in headers
                                                                             if h["healed"])}  # fmt: skip

    def _check_hashes(self, headers: list[dict[str, Any]]) -> None:
        counts: dict[str, int] = {}
        for h in headers:
            counts[h["hash"]] = counts.get(h["hash"], 0) + 1
        if len(counts) == 1:
            return
        first = {h["hash"]: h["region"] for h in sorted(headers, key=lambda h: -h["region"])}
        common = max(counts, key=lambda k: (counts[k], -first[k]))
        if self.job_hash != common:
            others = [self.names[h["region"]] for h in headers if h["hash"] == common]
            raise RunError(f"region {self.names[self.me]} runs a different scenario, method, seed or token budget "
                           f"(hash {self.job_hash}) than regions {', '.join(others)} (hash {common}); start every "
                           f"region with the same command and scenario file")  # fmt: skip

    # ---- faults from the scenario -----------------------------------------------------------------------
    def _faults(self, round_index: int, members: list[int]) -> dict[int, set[str]]:
        """The scenario's faults at this round (0-based ``at_round``, as in the emulated runtime)."""
        once: dict[int, set[str]] = {}
        for f in faults_at(self.sc, round_index):
            if f.kind not in FAULT_KINDS:
                continue
            i = self.names.index(f.region)
            record = {"round": round_index, "time": self.run._now(), "region": f.region, "kind": f.kind,
                      "factor": f.factor, "tokens_lost": 0}  # fmt: skip
            if f.kind == "slowdown":
                self.slowdown[i] *= f.factor
                if i == self.me:
                    self.run.worker.slowdown = self.sc.regions[i].slowdown * self.slowdown[i]
            elif f.kind == "bandwidth":
                self.bandwidth[i] *= f.factor
            elif f.kind in ONE_ROUND_FAULTS:
                if i in members:
                    once.setdefault(i, set()).add(f.kind)
                else:
                    record["ignored"] = "the region is not in this round"
            elif f.kind == "leave":
                self.away.add(i)
            elif f.kind == "join" and i in self.away:
                self.away.discard(i)
                if i == self.me:  # back as a restarted process would be: fresh AdamW, empty residual
                    self.run.worker.optimizer.state.clear()
                    if hasattr(self.codec, "reset_residual"):
                        self.codec.reset_residual()
            self.faults.append(record)
            self._emit({"type": "fault", **{k: v for k, v in record.items() if k != "tokens_lost"}})
        return once

    # ---- the run ----------------------------------------------------------------------------------------
    def run_loop(self) -> dict[str, Any]:
        run, method, tr = self.run, self.method, self.tr
        if run.is_leader:
            run.telemetry = Telemetry(None, sinks=[Records(self.records)])
            self._connect()
            self._emit({"type": "run", "runtime": "distributed", "method": method.name, "scenario": self.sc.name,
                        "seed": run.seed, "tokens_budget": run.budget, "model": run.model_name,
                        "model_params": run.global_model.num_params(), "workers": self.names,
                        "backend": run.backend, "wan": run.options.wan, "elastic": True,
                        "min_regions": self.min_regions, "round_deadline_s": self.deadline_s})  # fmt: skip
        run.transport.barrier(None, what="the start barrier")
        run._t0, run._cursor = time.perf_counter(), 0.0
        plan, planned_for, first = None, None, True
        applied_faults = -1
        every, keep = run._checkpoint_cadence()
        saver = self._checkpointer() if every > 0 or run._resume_from is not None else None
        if run._resume_from is not None:  # this region's newest checkpoint; regions behind heal at the quorum
            saver.restore(Path(run._resume_from))
            applied_faults = run.rounds - 1
            run._t0 = time.perf_counter() - run._cursor
            if self.membership is not None:
                self.membership.set_step(run.rounds)
            self._say(f"resumed from the checkpoint of round {run.rounds} ({run._resume_from})")
        self._snapshot()  # θ as a region behind may ask for it at the first quorum
        while True:
            # 1. quorum
            ctrl = None
            if run.is_leader:
                ctrl = self._quorum(first)
                ctrl["state"] = self.healed_state if ctrl["healed"] else None
                self.healed_state = None
            ctrl = self._share(ctrl, "the round's quorum")
            run._mark("straggler_wait")  # waiting for the round's quorum: for the slowest live region
            first = False
            if ctrl["healed"]:
                self._apply_healed(ctrl["state"])
                planned_for = None
                if run.is_leader:  # an operator wants to see this one even with --quiet
                    print(f"region {self.names[self.me]}: joined at round {run.rounds + 1} with the state of a live "
                          f"region", flush=True)  # fmt: skip
            if run.tokens_done >= run.budget:
                break
            r = run.rounds  # 0-based index of this round (fault schedule), round records count from 1
            once = self._faults(r, ctrl["members"]) if applied_faults < r else {}
            if applied_faults < r and any(f.kind in ("slowdown", "bandwidth") for f in faults_at(self.sc, r)):
                planned_for = None  # the planner learns the new speed or links at once
            applied_faults = r
            # a region away by a scheduled `leave` stays connected (θ in step) but trains and sends nothing
            members = [i for i in ctrl["members"] if i not in self.away]
            if not members:
                raise RunError(f"round {r + 1}: every live region is away (the scenario's leave faults)")
            self._restarted_in_place(ctrl["rejoined"])
            self._membership_events(members)
            if planned_for != members:
                plan = self._plan(members)
                run.plans.append(plan)
                self._emit({"type": "plan", "round": r, "time": run._now(), "plan": plan.to_json(),
                            "members": [self.names[i] for i in members]})  # fmt: skip
                planned_for = list(members)
            entries = {i: plan.worker(self.names[i]) for i in members}
            remaining = run.budget - run.tokens_done
            # the budget in whole rounds, as in the other loops: the last round shortened (rounded up), a remainder
            # under half a round joined to this one
            steps = dict(zip(members, budget_steps([entries[i].inner_steps for i in members],
                                                   [entries[i].batch for i in members], self.seq, remaining)))  # fmt: skip
            round_tokens = sum(entries[i].batch * steps[i] for i in members) * self.seq
            planned = {i: entries[i].batch * steps[i] * self.seq for i in members}
            # 2. inner steps
            run._mark("other")
            round_start = run._cursor
            payload = None
            if self.me in members:
                wp, h, start = entries[self.me], steps[self.me], run.tokens_done

                def lr_at(k: int, h: int = h, start: int = start, total: int = round_tokens) -> float:
                    return inner_lr(start + k / h * total, run.budget, tr)

                with poisoned(run.worker, "nan" in once.get(self.me, ())):
                    payload, _ = method.local_phase(run.worker, h, wp.batch, self.params, self.codec, lr_at)
                if payload is None and not optimizer_finite(run.worker.optimizer):
                    run.worker.optimizer.state.clear()  # one bad round must not poison the next ones
                if payload is not None and "corrupt" in once.get(self.me, ()):
                    payload = corrupt_payload(payload)
            run._mark("compute")
            compute_s = run._cursor - round_start
            if self._kill_at is not None and self._kill_at[:2] == (self.names[self.me], run.rounds + 1):
                if self._kill_at[2] == "hang":  # tests: stop responding (torchft's heartbeat thread goes on)
                    while True:
                        time.sleep(3600)
                os.kill(os.getpid(), signal.SIGKILL)  # tests: die with the payload unsent
            # 3. exchange over the quorum's leaders
            result = None
            if run.is_leader:
                info = {"region": self.me, "active": self.me in members, "compute_s": compute_s,
                        "spans": run._spans, "stream": run.worker.stream.state_dict(),
                        "crc": self._theta_crc()}  # fmt: skip
                run._spans = []
                result = self._exchange(payload, info, members)
            result = self._share(result, "the round's exchange")
            if result.get("healed"):  # this region fell behind during the exchange: the round is not ours
                self._apply_healed(result["state"])
                planned_for = None
                continue
            run._mark("comm_wait")
            self._apply(result)
            self._end_round(result, members, planned, compute_s)
            if saver is not None and every > 0 and run.rounds % every == 0:
                run._mark("other")
                try:
                    saver.save(keep)
                except OSError as exc:
                    raise RunError(f"could not write the checkpoint of round {run.rounds} in "
                                   f"{run._checkpoint_dir()}: {exc.strerror or exc}") from None  # fmt: skip
        return self._finish()

    def _say(self, text: str) -> None:
        if self.run.is_leader and self.run.options.progress:
            print(f"[{self.method.name}] region {self.names[self.me]}: {text}", flush=True)

    def _exchange(self, payload: bytes | None, info: dict[str, Any], members: list[int]) -> dict[str, Any]:
        """(leader) The all-gather (or all-reduce) over the quorum; on a failure the survivors form a new
        quorum and exchange what they have. Returns what every rank needs to apply the round."""
        m, run = self.membership, self.run
        t0 = time.perf_counter()
        sent_before = 0
        while True:
            try:
                since = time.perf_counter()
                if self.dense:
                    flat = torch.zeros(self.d + 1, dtype=torch.float32)
                    # an all-reduce mixes payloads before anyone could check one: the sender checks its own
                    reason = screen_payload(self.combiner, payload) if payload is not None else None
                    if payload is not None and reason is None:
                        decoded = self.combiner.decode(payload)
                        w = decoded.tokens / 2**20 if self.combiner.weighting == "tokens" else 1.0
                        torch.cat([t.reshape(-1).float() for t in decoded.tensors.values()], out=flat[: self.d])
                        flat[: self.d].mul_(w)
                        flat[self.d] = w
                    infos = m.all_gather_object({**info, "sent": payload is not None, "rejected": reason})
                    m.all_reduce_sum(flat)
                    sent_before += 4 * (self.d + 1)
                    gathered = None
                else:
                    envelopes = m.all_gather_object({**info, "payload": payload})
                    infos = [{k: v for k, v in e.items() if k != "payload"} for e in envelopes]
                    gathered = {e["region"]: e["payload"] for e in envelopes}
                    sent_before += self.proxy_payload
                    flat = None
                who = sorted(i["region"] for i in infos)
                WanShaper(self._wan(who), run.options.wan).hold(self._shaper_s(who), since)
                break
            except ExchangeFailed as exc:
                m.report(exc)
                self._say(f"exchange failed ({exc}); re-forming the quorum without the lost region(s)")
                try:
                    ctrl = self._quorum(first=False)
                except MembershipError as err:
                    raise RunError(str(err)) from None
                if ctrl["healed"]:  # the others finished this round without us
                    state, self.healed_state = self.healed_state, None
                    return {"healed": True, "state": state}
                self._restarted_in_place(ctrl["rejoined"])  # as the region that rejoined records it
        if not m.commit():
            raise RunError(f"round {run.rounds + 1}: torchft did not commit the round (fewer than "
                           f"{self.min_regions} region(s) took part)")  # fmt: skip
        crcs = {i["crc"] for i in infos}
        if len(crcs) > 1:
            detail = ", ".join(f"{self.names[i['region']]}: {i['crc']}" for i in infos)
            raise RunError(f"round {run.rounds + 1}: the regions hold different global parameters ({detail})")
        return {"infos": sorted(infos, key=lambda i: i["region"]), "payloads": gathered, "flat": flat,
                "comm_s": time.perf_counter() - t0, "wan_bytes": sent_before}  # fmt: skip

    def _shaper_s(self, members: list[int]) -> float:
        """What the WAN shaper holds this exchange to (0 without a shaper or with a single region)."""
        if len(members) < 2:
            return 0.0
        shaper = WanShaper(self._wan(members), self.run.options.wan)
        if self.dense:
            return shaper.allreduce_s(4 * (self.d + 1))
        return shaper.allgather_s(self.proxy_payload)

    def _apply(self, result: dict[str, Any]) -> None:
        """The outer step from the exchanged bytes (every rank of every live region does the same)."""
        result["rejected"], result["dropped"] = [], []
        if self.dense:
            flat = result["flat"]
            if float(flat[self.d]) > 0:
                update = flat[: self.d].div(flat[self.d]).to(next(iter(self.params.values())).device)
                self.outer.step(lay_out_like({s.name: update[o : o + s.numel].view(s.shape)
                                              for s, o in zip(self.manifest, self.manifest.offsets)}, self.params))  # fmt: skip
                self._snapshot()
            result["dropped"] = [i["region"] for i in result["infos"] if i["active"] and not i["sent"]]
            result["rejected"] = [(i["region"], i["rejected"]) for i in result["infos"] if i["rejected"]]
            return
        arrived = []
        active = {i["region"] for i in result["infos"] if i["active"]}
        for i in sorted(result["payloads"]):  # scenario order: the emulated runtime's combine order
            payload = result["payloads"][i]
            if payload is None:
                if i in active:
                    result["dropped"].append(i)
                continue
            reason = screen_payload(self.combiner, payload)
            if reason is None:
                arrived.append(payload)
            else:
                result["rejected"].append((i, reason))
        if arrived:
            device = next(iter(self.params.values())).device
            self.outer.step(lay_out_like(self.combiner.combine(arrived, device=device), self.params))
            self._snapshot()

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

    def _end_round(self, result: dict[str, Any], members: list[int], planned: dict[int, int],
                   compute_s: float) -> None:  # fmt: skip
        run, names = self.run, self.names
        infos = result["infos"]
        took_part = [i["region"] for i in infos if i["active"]]
        lost: dict[int, int] = {}
        for i in members:
            if i not in took_part:  # lost during the round: its tokens never reached θ
                lost[i] = planned[i]
                self.stats["leaves"] += 1
                self._emit({"type": "leave", "round": run.rounds + 1, "time": run._now(), "region": names[i],
                            "reason": "lost during the round's exchange", "tokens_lost": planned[i]})  # fmt: skip
        for i, reason in result["rejected"]:
            lost[i] = planned[i]
            run.telemetry.count("rejected_payloads")
            self._emit({"type": "warning", "round": run.rounds + 1, "worker": names[i],
                        "message": f"payload rejected: {reason}; its update is dropped this round"})  # fmt: skip
        for i in result["dropped"]:
            lost[i] = planned[i]
            run.telemetry.count("dropped_updates")
            self._emit({"type": "warning", "round": run.rounds + 1, "worker": names[i],
                        "message": "non-finite loss, parameters or pseudo-gradient; its update is dropped"})  # fmt: skip
        self.members = [i for i in members if i in took_part]
        for i in range(self.n):
            if i not in took_part:
                self.stats["rounds_without"][names[i]] += 1
        for i, t in lost.items():
            self.stats["tokens_lost"][names[i]] += t
        for f in self.faults:
            if f["round"] == run.rounds and f["kind"] in ONE_ROUND_FAULTS and "ignored" not in f:
                f["tokens_lost"] = lost.get(names.index(f["region"]), 0)
        useful = sum(planned[i] for i in took_part if i not in lost)
        run.tokens_done += useful
        run.rounds += 1
        for i in infos:
            self.streams[names[i["region"]]] = i["stream"]
        if run.is_leader:
            for i in infos:
                for kind, a, b, r in i["spans"]:
                    run.telemetry.span(names[i["region"]], kind, a, b, r)
            run._mark("other")
            t = run.totals
            t["bytes_sent"] += result["wan_bytes"] * len(infos)
            t["proxy_bytes_sent"] += self.proxy_payload * (len(took_part) - len(result["dropped"]))
            t["comm_s"] += result["comm_s"]
            self._emit({"type": "round", "round": run.rounds, "time": run._now(), "tokens": run.tokens_done,
                        "members": [names[i] for i in took_part], "compute_s": [i["compute_s"] for i in infos],
                        "exchange_s": result["comm_s"], "bytes_sent": result["wan_bytes"] * len(infos),
                        "tokens_lost": {names[i]: t for i, t in lost.items()}})  # fmt: skip
        if run.evaluates and (run.rounds % self.tr.eval_every_rounds == 0 or run.tokens_done >= run.budget):
            run._evaluate(run._now())  # (every leader: any may become the writer; a sharded θ: its region's ranks)
        if run.is_leader:
            self._write_events(took_part)

    def _finish(self) -> dict[str, Any]:
        run = self.run
        run._mark("other")
        final = [self.me]
        checksums = {self.names[self.me]: self._theta_crc()}
        if run.is_leader and self.membership is not None:
            for kind, a, b, r in run._spans:
                run.telemetry.span(self.names[self.me], kind, a, b, r)
            run._spans = []
            try:  # every live region's checksum of θ at the end (equal: they applied the same updates)
                ends = self.membership.all_gather_object({"region": self.me, "crc": checksums[self.names[self.me]]})
                final = sorted(e["region"] for e in ends)
                checksums = {self.names[e["region"]]: e["crc"] for e in sorted(ends, key=lambda e: e["region"])}
            except ExchangeFailed:
                pass
            self._write_events(final)
            self.membership.shutdown()
        writer = self._writer(final) if run.is_leader else False
        if self.run.sharded_global:  # its ranks evaluate θ and gather it for the summary together
            writer = self._share(writer, "whether this region writes the summary")
        run.writes_summary = bool(writer)
        run._end_s = run._now()
        run.final_checksums = list(checksums.values())
        st = self.stats
        return {
            **run._exchange_fields(4 * (self.d + 1) if self.dense else self.proxy_payload, self.proxy_payload,
                                   self.modeled_payload, self._shaper_s(final), self.method.collective),
            "status": "complete",
            "world_size": None,
            "ranks_per_region": None,
            "elastic": {"min_regions": self.min_regions, "round_deadline_s": self.deadline_s,
                        "regions_at_end": [self.names[i] for i in final], "leaves": st["leaves"],
                        "joins": st["joins"], "rounds_without": st["rounds_without"],
                        "tokens_lost": st["tokens_lost"]},  # fmt: skip
            "rounds_without": st["rounds_without"],
            "tokens_lost": sum(st["tokens_lost"].values()),
            "faults": self.faults,
            "param_checksums": checksums,
            "rejected_payloads": int(run.telemetry.counters.get("rejected_payloads", 0)),
        }


__all__ = ["RegionLayout", "min_regions_of", "region_layout", "run_elastic"]


def run_elastic(run) -> dict[str, Any]:
    """The elastic round loop on this rank (see the module docstring); returns the summary's extra fields."""
    return ElasticLoop(run).run_loop()
