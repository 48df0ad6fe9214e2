"""Elastic regions: the exchange of the one round loop (:mod:`.rounds`) when regions may die, hang, fall behind
and come back.

With ``reliability.min_regions >= 1`` (or ``--min-regions``) every region is its own ``torch.distributed``
world (its ranks only: one ``torchrun`` per region), and regions meet only through
:class:`~geomesh.runtime.distributed.membership.Membership` (torchft: a quorum per round from the Lighthouse,
a Gloo group reconfigured over the quorum's leaders, live recovery of a region that is behind).
:class:`QuorumExchange` is what the round loop sees of it:

1. **Quorum** (:meth:`QuorumExchange.open_round`). The region's leader asks for the round's quorum. A region
   that died is not in it (it stopped heartbeating); one that hangs or is late is left out once
   ``reliability.round_deadline_s`` has passed; a region behind the others (restarted, or back after missing
   rounds) first receives θ, the outer momentum and the loop's state from a live region (torchft's checkpoint
   transport), then takes part with a fresh AdamW and an empty error-feedback residual (a restarted process,
   as in the emulated runtime); its data stream continues where it last reported it. Members all-gather a
   header (region, a hash of scenario, method, seed and budget) over the quorum: a region whose hash differs
   from the others' stops with one ``error:`` line. At the first round, regions wait (up to ``--timeout``)
   until every region is in.
2. **Exchange** (:meth:`QuorumExchange.exchange`) over the quorum's leaders: an all-gather of payload + round
   info, an all-reduce of the dense sum, or, when the plan picks it, the sharded exchange
   (:func:`~geomesh.runtime.distributed.sharded_loop.quorum_sharded_exchange`: one shard per quorum member). If a
   member dies or passes the deadline there, the survivors form a new quorum and exchange the payloads they
   already have (sharded: with a layout for the new quorum, so they own the lost member's shard): the lost
   region's tokens of this round are counted as lost. Then torchft commits the round (its step = rounds done).
3. **Records** (:mod:`.round_records`): ``round`` (members, lost tokens), ``leave`` and ``join`` events, spans;
   every leader keeps them, the writer writes ``events.jsonl`` and ``summary.json`` (:mod:`.records`).

The run goes on while at least ``min_regions`` regions form a quorum, counting only regions whose headers
authenticate (a region with another key is a quorum member for torchft, never one of the ``min_regions``);
with fewer, the quorum times out after ``--timeout`` seconds and the run stops with one ``error:`` line.
Faults, planning, screening, evaluation and checkpoints are the round loop's, as in a static run; with
``--checkpoint-every N`` each region writes its own checkpoint into ``DIR/checkpoints/<region>``.

This file is long because the quorum, the round's header, its exchange and its vote are one region's side of one
elastic round; the records of membership are :mod:`.round_records`', the agreement's pure rules :mod:`.agreement`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ... import checkpoint as ckpt
from ...config import ConfigError
from ...errors import RunError
from ...telemetry import Telemetry
from ..checkpoint_state import run_fingerprint
from .agreement import RoundAgreement, RoundHeader, arrivals_digest, commit_decision, maker_of, vote
from .elastic_state import RegionState
from .records import RunRecords
from .deadline import MEASURED_ROUNDS, adaptive_deadline_s, deadline_history, setup_s
from .exchange import Exchanged, RoundView
from .layout import RegionLayout, region_layout
from .membership import ExchangeFailed, Membership, RunFinished
from .round_records import RoundRecords
from .service import LIGHTHOUSE_ENV, MembershipError, group_store_host, join_timeout_s
from .wan_shaper import WanShaper, ring_allgather_bytes, ring_allreduce_bytes

__all__ = ["QuorumExchange", "RegionLayout", "adaptive_deadline_s", "deadline_history", "region_layout"]



class QuorumExchange:
    """The round loop's exchange, records and recovery state for one elastic region (see the module
    docstring)."""

    elastic = True
    report_wait_s = 0.0  # (the round's records came with its exchange: its report waits for nobody)

    def __init__(self, loop):
        self.loop = loop
        run = loop.run
        self.run, self.sc, self.method = run, loop.sc, loop.method
        self.names, self.n, self.me = loop.names, loop.n, loop.me
        self.min_regions = self.sc.reliability.min_regions
        rel = self.sc.reliability
        self.deadline_s = rel.round_deadline_s  # the fixed deadline; with adaptive deadlines their cap
        self.deadline_mode = rel.round_deadline_mode
        self.last_deadline_s = self.deadline_s  # what the last exchange was held to (its round record says it)
        self.refused: set[int] = set()  # regions (as their frames claim) whose frames did not authenticate
        self.round_rejections: list[dict[str, Any]] = []  # frames refused since the last round record
        self.job_hash = ckpt.fingerprint_hash(run_fingerprint(self.sc, self.method.name, run.seed, run.budget))
        self.faults = loop.faults
        self.records = RunRecords(run.out_dir, self.names[self.me], run.is_leader)
        # what a live region sends one that joins (torchft's recovery), and this region's part of its checkpoint
        self.state = RegionState(run, loop.params, loop.outer, loop.codec, loop.faults, loop.planning, self.records)
        # the round's agreement (agreement.py): its header, why this region refused one, the round's attempt
        self.agreement = RoundAgreement(self.job_hash, self.names, self.me)
        # the records of who came and went, round by round (round_records.py)
        self.history = RoundRecords(run, self.names, self.state, self.records, self.faults, self._emit)
        self.membership: Membership | None = None
        self.launch_members: list[int] | None = None  # overlapped: the members at the last exchange's quorum
        self.launch_head: dict[str, Any] | None = None  # ... and the next round's header, shipped at that quorum
        self.my_calibration: dict[str, Any] | None = None  # this region's step times measured in place
        self.pending_resume: dict[str, Any] | None = None  # resumed, until the first quorum agrees on the round
        run.keeps_records = run.is_leader

    def _emit(self, record: dict[str, Any]) -> None:
        if self.run.is_leader:
            self.run.telemetry.emit(record)

    def _say(self, text: str) -> None:
        if self.run.is_leader and self.run.options.progress:
            print(f"[{self.method.name}] region {self.names[self.me]}: {text}", flush=True)

    # ---- start ----------------------------------------------------------------------------------------
    def start(self) -> None:
        run = self.run
        if run.is_leader:
            run.telemetry = Telemetry(None, sinks=[self.records.sink()])
            self.records.claim_folder()
            self._connect()
            self._emit({"type": "run", "runtime": "distributed", "method": self.method.name, "scenario": self.sc.name,
                        "seed": run.seed, "tokens_budget": run.budget, "model": run.model_name,
                        "model_params": run.global_model.num_params(), "workers": self.names,
                        "backend": run.backend, "wan": run.options.wan, "elastic": True,
                        "min_regions": self.min_regions, "round_deadline_s": self.deadline_s,
                        "round_deadline_mode": self.deadline_mode})  # fmt: skip
        run.transport.barrier(None, what="the start barrier")
        run.clock.start()
        self.state.snapshot()  # θ as a region behind may ask for it at the first quorum

    def share_calibration(self, mine: dict[str, Any] | None) -> None:
        """This region's calibration travels with its quorum header, so every member learns the others'."""
        self.my_calibration = mine

    def planned_for_after_resume(self) -> list[int] | None:
        return None  # the first quorum after a resume plans its members

    def _connect(self) -> None:
        run = self.run
        lighthouse = run.options.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse:
            raise ConfigError(f"elastic regions need the quorum service's address: --lighthouse http://HOST:PORT or "
                              f"${LIGHTHOUSE_ENV} (`geomesh launch` starts one and sets it)")  # fmt: skip
        try:
            self.membership = Membership(
                region=self.me, name=self.names[self.me], lighthouse=lighthouse, min_regions=self.min_regions,
                deadline_s=self.deadline_s, quorum_timeout_s=run.options.timeout_s, state_dict=self.state.state_dict,
                load_state_dict=self.state.load_state_dict,
                store_addr=group_store_host(lighthouse, self.names[self.me]),
                store_port=int(os.environ.get("MASTER_PORT", "29500")), names=self.names,
                join_timeout_s=join_timeout_s(self.sc.reliability),
                setup_s=setup_s(self.deadline_s, max(max(row) for row in self.sc.wan_model().rtt_s)),
            )  # fmt: skip
        except MembershipError as exc:
            raise RunError(str(exc)) from None
        from .board import RunBoard

        self.board = RunBoard(lighthouse, run=f"{self.membership.run_id}/{self.job_hash}", key=self.membership.key)
        self.membership.finished = self.board.finished

    # ---- 1. the quorum ----------------------------------------------------------------------------------
    def open_round(self, first: bool) -> RoundView:
        """The round's quorum on the leader, shared inside the region (the healing state's tensors too).
        Overlapped rounds take their quorum where the exchange leaves (:meth:`launch_quorum`, so no quorum
        reconfigures the group while an exchange is in flight); a round starts with the last one's members."""
        run = self.run
        if self.loop.overlap is not None and not first:
            # (the leader took it: its region's ranks learn it from the leader, as every quorum)
            launched = {"members": list(self.launch_members), "head": self.launch_head} \
                if run.is_leader and self.launch_members is not None else None  # fmt: skip
            if run.world > 1:
                launched = run.transport.broadcast_json(launched, run.leader, run.region_group,
                                                        what="the overlapped round's members")  # fmt: skip
            if launched is not None:
                if launched["head"] is not None:  # (the next round's header, shipped at that quorum)
                    self._take_header(launched["head"], run.rounds + 1)
                self.launch_head = None
                return RoundView(members=launched["members"], quorum=False)
        view, finished = None, None
        if run.is_leader:
            try:
                ctrl = self._quorum(first)
            except RunFinished as exc:  # (the run board: the run ended without this region)
                finished = exc.note
                self.membership.shutdown()
        if run.is_leader and finished is None:
            state = self.state.healed_state if ctrl["healed"] else None
            self.state.healed_state = None
            view = RoundView(members=ctrl["members"], healed=ctrl["healed"], state=state,
                             rejoined=ctrl["rejoined"], calibration=ctrl["calibration"],
                             resume_round=ctrl.get("resume_round"))  # fmt: skip
        if run.world == 1:
            if finished is not None:
                raise RunFinished(finished)
            return view
        run.wait_for_leader("the round's quorum", self.leader_wait_s())
        head = run.transport.broadcast_json(
            {"finished": finished} if finished is not None else
            {"members": view.members, "healed": view.healed, "rejoined": view.rejoined,
             "calibration": {str(k): v for k, v in view.calibration.items()},
             "resume_round": view.resume_round} if run.is_leader else None,
            run.leader, run.region_group, what="the round's quorum")  # fmt: skip
        if head.get("finished") is not None:  # every rank of the region stops alike
            raise RunFinished(head["finished"])
        state = self.share_state(view.state if run.is_leader else None) if head["healed"] else None
        return RoundView(members=head["members"], healed=head["healed"], state=state, rejoined=head["rejoined"],
                         calibration={int(k): v for k, v in head["calibration"].items()},
                         resume_round=head.get("resume_round"))  # fmt: skip

    def agree_round(self, quorum: list[int], members: list[int], proposal, reason: str,
                    number: int | None = None) -> RoundHeader | None:  # fmt: skip
        """(every rank) The header of round ``number`` (default: the next one; :mod:`.agreement`): the quorum's
        maker ships its ``proposal`` (the plan its plan loop holds for ``members``, and why); every leader checks
        what arrived and shares it inside its region. None: this region refused it, or it did not arrive
        (``agreement.refusal`` says why); the region then takes no part in the round and votes no, so the round
        is rolled back everywhere and tried again."""
        run = self.run
        number = run.rounds + 1 if number is None else number
        head = self._ship_header(quorum, members, proposal, reason, number) if run.is_leader else None
        if run.world > 1:
            head = run.transport.broadcast_json(head, run.leader, run.region_group, what="the round's header")
        return self._take_header(head, number)

    def _take_header(self, head: dict[str, Any], number: int) -> RoundHeader | None:
        """(every rank) The header its leader accepted (or why none), as this region's."""
        header = self.agreement.take(head)
        if header is None:
            why = self.agreement.refusal
            self._say(f"round {number}: refused the round's header: {why}")
            self._emit({"type": "warning", "round": number, "worker": self.names[self.me],
                        "message": f"refused the round's header ({why}); it takes no part in the round"})  # fmt: skip
        return header

    def _ship_header(self, quorum: list[int], members: list[int], proposal, reason: str, number: int) -> dict:
        """(leader) The header collective over the quorum's leaders: the maker's header, checked."""
        m = self.membership
        mine = None
        if maker_of(quorum) == self.me:
            mine = self.agreement.proposal(number, members, proposal, self.loop.planning.exchange_kind, reason)
        try:
            got = {region: obj.get("header") for _, region, obj in
                   m.all_gather_framed_slots({"region": self.me, "header": mine}) if isinstance(obj, dict)}
        except ExchangeFailed as exc:
            m.report(exc)
            return {"header": None, "refusal": f"the header's collective failed ({exc})"}
        self._note_rejections()
        return self.agreement.check(got, quorum, number)

    def leader_wait_s(self) -> float:
        """How long a region's ranks may wait for their leader's quorum or exchange: the startup wait and the
        quorum's timeout (each ``--timeout``), a heal of the model's state, and the round deadline."""
        from .heal import heal_timeout_s

        nbytes = 12 * sum(p.numel() for p in self.loop.params.values())  # θ, momentum and a margin, in fp32
        return 2 * self.run.options.timeout_s + heal_timeout_s(nbytes) + self.deadline_s

    def launch_quorum(self, propose) -> list[int]:
        """(leader, overlapped rounds) The quorum of the exchange about to leave: its members. The next round
        starts with them, so its header is shipped here (``propose(quorum)``: this region's (members, plan,
        reason) for it), before the exchange's thread takes the group."""
        ctrl = self._quorum(first=False)
        if ctrl["healed"]:
            raise RunError(f"region {self.names[self.me]} fell behind the others between two overlapped exchanges; "
                           f"restart it (it rejoins with the live state)")  # fmt: skip
        self.history.restarted_in_place(ctrl["rejoined"], self.run.rounds + 1)
        self.launch_members = list(ctrl["members"])
        members, plan, reason = propose(self.launch_members)
        self.launch_head = self._ship_header(self.launch_members, members, plan, reason, self.run.rounds + 2)
        return list(ctrl["members"])

    def _quorum(self, first: bool) -> dict[str, Any]:
        """(leader) Join the round's quorum and learn its members; retried until a header exchange works."""
        m = self.membership
        startup_until = time.monotonic() + self.run.options.timeout_s
        short_since: float | None = None  # when quorums of too few regions that hold the run's key began
        failing_since: float | None = None  # when quorums whose group could not be set up began
        while True:
            try:  # a member that died between the quorum and the group's set-up fails it: ask again
                healed, _ = m.quorum()
            except ExchangeFailed as exc:
                m.report(exc)
                failing_since = time.monotonic() if failing_since is None else failing_since
                if time.monotonic() - failing_since > self.run.options.timeout_s:
                    raise RunError(f"region {self.names[self.me]}: no quorum could set up its group within "
                                   f"{self.run.options.timeout_s:g}s: {exc}") from None  # fmt: skip
                continue
            failing_since = None
            try:
                wait = first and not healed and time.monotonic() < startup_until
                headers = m.all_gather_framed({"region": self.me, "hash": self.job_hash, "wait": wait,
                                               "healed": healed, "calibration": self.my_calibration,
                                               "resume": self.pending_resume, "attempt": self.agreement.attempt})  # fmt: skip
            except ExchangeFailed as exc:
                m.report(exc)
                continue
            self._note_rejections()
            self._outvoted(headers)
            self._check_hashes(headers)
            members = sorted(h["region"] for h in headers)
            if healed:
                first = False
            # (a region whose frames do not authenticate is not waited for: it cannot take part)
            if len(set(members) | self.refused) < self.n and all(h["wait"] for h in headers):
                time.sleep(0.3)  # the first round: wait for every region to come up
                continue
            # torchft counts every quorum member towards min_regions, a region with another key too: a round of
            # fewer regions that prove the key would commit a step the missing ones must then heal across (and
            # let the odd one train on alone). Such a quorum is not one: ask again, up to --timeout.
            if len(members) < self.min_regions:
                short_since = time.monotonic() if short_since is None else short_since
                if time.monotonic() - short_since > self.run.options.timeout_s:
                    odd = ", ".join(map(m.region_name, sorted(self.refused))) or "none"
                    raise RunError(f"region {self.names[self.me]}: no quorum of at least {self.min_regions} "
                                   f"region(s) that hold the run's key within {self.run.options.timeout_s:g}s (regions "
                                   f"whose frames do not authenticate: {odd})")  # fmt: skip
                time.sleep(0.3)
                continue
            # regions resumed together: every member (a resumed one, or one whose folder was lost) takes the round
            # every resumed member holds, then asks again (where one behind it heals)
            resuming = [h for h in headers if isinstance(h.get("resume"), dict) and not h.get("healed")]
            self.pending_resume = None
            if resuming and not healed:
                return {"members": members, "healed": False, "rejoined": [], "calibration": {},
                        "resume_round": self._agreed_resume_round(resuming)}  # fmt: skip
            # regions that were behind and received a live region's state at this quorum
            self.agreement.seen_attempts(h.get("attempt") for h in headers)
            return {"members": members, "healed": healed,
                    "rejoined": sorted(h["region"] for h in headers if h["healed"]),
                    "calibration": {h["region"]: h.get("calibration") for h in headers
                                    if isinstance(h.get("calibration"), dict)}}  # fmt: skip

    def _outvoted(self, headers: list[dict[str, Any]]) -> None:
        """Stop when this region authenticates no other member's header and cannot authenticate those of most
        of the scenario's other regions: it holds another run key than they do. It cannot follow θ (that would
        mean trusting unverified bytes), and while it stays in the quorum it holds the others' collectives; so
        it leaves, with one error. The scenario's count, not the quorum's: at start-up a live region may meet
        the odd one before the others and must not take itself for the odd one; and a forged frame beside a
        genuine one of the same region (an outsider) proves nothing against this region. (With two regions
        neither can tell: both stop.)"""
        if any(h["region"] != self.me for h in headers):
            return
        bad = sorted({r["region"] for r in self.membership.rejected if "HMAC" in r["reason"]
                      and isinstance(r["region"], int) and 0 <= r["region"] < self.n and r["region"] != self.me})  # fmt: skip
        if bad and 2 * len(bad) > self.n - 1:
            who = ", ".join(self.membership.region_name(i) for i in bad)
            raise RunError(f"region {self.names[self.me]} cannot authenticate the frames of regions {who} (HMAC tag "
                           f"mismatch): it holds another run key (reliability.hmac_key_env / hmac_key_file) than "
                           f"they do; it stops (start it with the run's key to rejoin)")  # fmt: skip

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

    def members_known(self, view: RoundView, members: list[int]) -> None:
        """``leave``/``join`` records for the round's members (every leader alike)."""
        self.history.members_known(view.rejoined, members, self.run.rounds + 1)

    def planned(self, plan, members: list[int], round_index: int, header: RoundHeader | None = None) -> None:
        agreed = {} if header is None else {"attempt": header.attempt, "maker": self.names[header.maker],
                                            "reason": header.reason, "digest": header.digest}  # fmt: skip
        self._emit({"type": "plan", "round": round_index, "time": self.run._now(), "plan": plan.to_json(),
                    "members": [self.names[i] for i in members], **agreed})  # fmt: skip

    def apply_healed(self, state: dict[str, Any]) -> int | None:
        """The live region's state, received at the quorum, applied on every rank; the index of the plan the
        live region's round in progress runs (None: the plan in force)."""
        plan_at = self.state.apply_healed(state)
        if self.run.is_leader:  # an operator wants to see this one even with --quiet
            print(f"region {self.names[self.me]}: joined at round {self.run.rounds + 1} with the state of a live "
                  f"region", flush=True)  # fmt: skip
        return plan_at

    def share_state(self, state: dict[str, Any] | None) -> dict[str, Any]:
        """A healing state (θ, outer momentum, the loop's JSON state) from the leader to the region's ranks:
        the JSON part as JSON, the tensors one by one in θ's order (whole tensors, as the leader holds them)."""
        run = self.run
        head = run.transport.broadcast_json(
            {k: v for k, v in state.items() if k != "params" and k != "outer"} | {
                "outer": {k: v for k, v in state["outer"].items() if k != "buf"}} if run.is_leader else None,
            run.leader, run.region_group, what="the state of a live region")  # fmt: skip
        params, buf = {}, {}
        for k, v in self.loop.params.items():
            for out, src in ((params, state["params"] if run.is_leader else None),
                             (buf, state["outer"]["buf"] if run.is_leader else None)):  # fmt: skip
                t = src[k].to(torch.float32) if src is not None else torch.empty(tuple(v.shape), dtype=torch.float32)
                out[k] = run.transport.broadcast(t.contiguous(), run.leader, run.region_group)
        return {**head, "params": params, "outer": {**head["outer"], "buf": buf}}

    # ---- 2. the exchange ---------------------------------------------------------------------------------
    def straggler_barrier(self, round_number: int) -> None:
        pass  # the quorum at the round's start is the barrier

    def info_fields(self) -> dict[str, Any]:
        run = self.run
        spans = run.clock.take_spans()
        return {"spans": spans, "stream": run.worker.stream.state_dict(), "crc": self.state.theta_crc()}

    def _wan(self, members: list[int]):
        return self.faults.wan(members)

    def shaper_s(self, members: list[int]) -> float:
        """What the WAN shaper holds this exchange to (0 without a shaper or with a single region)."""
        if len(members) < 2:
            return 0.0
        if self.loop.sharded is not None:  # the sharded exchange of these members (runtime/distributed/sharded_loop.py)
            from .sharded_loop import shaper_s

            return shaper_s(self.loop, members)
        shaper = WanShaper(self._wan(members), self.run.options.wan)
        return shaper.allreduce_s(4 * (self.loop.d + 1)) if self.loop.summed else shaper.allgather_s(
            self.loop.slot_nbytes)  # fmt: skip

    def exchange(self, payload: bytes | None, summed: torch.Tensor | None, info: dict[str, Any],
                 members: list[int], round_number: int | None = None) -> Exchanged:  # fmt: skip
        """(leader) The all-gather (or all-reduce, or the sharded exchange the plan picked) over the quorum, then
        the round's commit vote (:mod:`.agreement`). A round that does not commit comes back ``void``: no region
        applies it, every one rolls it back and trains it again under a new header. ``round_number``: the round
        it is of (default: the one in progress; an overlapped exchange on its thread is given it, as the round
        loop counts on meanwhile)."""
        m, run = self.membership, self.run
        number = self.exchange_round = run.rounds + 1 if round_number is None else round_number
        header = self.agreement.header_for(number)
        if self.loop.overlap is not None:  # (overlapped: the vote is on this exchange, over its own quorum)
            refused = number in self.agreement.refused_rounds
            self.agreement.refused_rounds.discard(number)
            header = None if refused else RoundHeader(
                run=self.job_hash, round=number, attempt=0, members=tuple(sorted(members)), plan={}, digest="",
                exchange="", reason="overlapped exchange", maker=min(members))  # fmt: skip
        t0 = time.perf_counter()
        sent, sharded, infos, gathered = 0, None, [], None
        deadline = self.last_deadline_s = self.round_deadline_s(members)
        ok, why, arrived = header is not None, self.agreement.refusal or "it holds no header for the round", None
        group_intact = True
        try:
            since = time.perf_counter()
            if self.loop.sharded is not None and summed is None:
                from .sharded_loop import quorum_sharded_exchange

                sharded = quorum_sharded_exchange(self, payload, info, deadline)
                infos = sharded["infos"]
                sent += sharded["wan_bytes"]
                update = sharded["update"]  # (the combined update every leader assembled from the owners' shards)
                extra = update.numpy().tobytes() if update is not None else b"none"
                arrived = arrivals_digest([i["region"] for i in infos], extra=extra)
            elif summed is not None:
                infos = m.all_gather_framed(info, timeout_s=deadline)
                self._note_rejections()
                m.all_reduce_sum(summed, timeout_s=deadline)
                sent += ring_allreduce_bytes(4 * (self.loop.d + 1), len(infos))  # (on the wire: docs/formats.md)
                arrived = arrivals_digest([i["region"] for i in infos], extra=summed.numpy().tobytes())
            else:
                envelopes = m.all_gather_framed({**info, "payload": payload}, timeout_s=deadline)
                self._note_rejections()
                infos = [{k: v for k, v in e.items() if k != "payload"} for e in envelopes]
                gathered = {e["region"]: e["payload"] for e in envelopes}
                sent += ring_allgather_bytes(self.loop.slot_nbytes, len(envelopes))
                arrived = arrivals_digest(gathered, gathered)
            if run.hooks.at("arrived", self.names[self.me], number, rank=run.rank):
                raise ExchangeFailed("fault hook: the connection broke after the payloads arrived")
            who = sorted(i["region"] for i in infos)
            WanShaper(self._wan(who), run.options.wan).hold(self.shaper_s(who), since)
        except ExchangeFailed as exc:
            m.report(exc)
            ok, why, group_intact = False, f"its exchange failed ({exc})", False
        committed, why_not = self._vote(header, ok, arrived, why, group_intact)
        if not committed:
            return Exchanged([], None, None, time.perf_counter() - t0, sent, void=True, why=why_not)
        crcs = {i["crc"] for i in infos}
        if len(crcs) > 1:
            detail = ", ".join(f"{self.names[i['region']]}: {i['crc']}" for i in infos)
            raise RunError(f"round {number}: the regions hold different global parameters ({detail})")
        if sharded is not None:
            return Exchanged(infos, None, None, time.perf_counter() - t0, sent, update=sharded["update"],
                             sharded=sharded["sharded"])  # fmt: skip
        return Exchanged(sorted(infos, key=lambda i: i["region"]), gathered, summed, time.perf_counter() - t0, sent)

    def _vote(self, header: RoundHeader | None, ok: bool, arrived: str | None, why: str,
              group_intact: bool) -> tuple[bool, str]:  # fmt: skip
        """(leader) The round's commit vote over the quorum's leaders: (commit, why not). Every member that
        gathers the votes reads the same ones and decides alike; one that cannot gather them rolls back (if the
        others committed, it is behind: the next quorum heals it). A rolled-back round is a commit failure for
        torchft (its step stays), so the next quorum is a new one with a group formed afresh."""
        m = self.membership
        decided, why_not = False, why
        if group_intact:  # (a region that refused the header votes no: the others learn it at once)
            try:
                votes = m.all_gather_framed(vote(region=self.me, header=header, ok=ok, arrived=arrived, why=why),
                                            timeout_s=self.last_deadline_s)  # fmt: skip
                if header is not None:
                    decided, why_not = commit_decision(votes, header, self.names)
            except ExchangeFailed as exc:
                m.report(exc)
                group_intact, why_not = False, f"the commit vote failed ({exc})"
        if decided and m.commit():
            return True, ""
        if group_intact:  # (a failed collective reported itself already)
            m.report(ExchangeFailed(f"the round was rolled back: {why_not}"))
        return False, why_not or "torchft did not commit the round"

    def theta_changed(self) -> None:
        self.state.snapshot()

    def round_deadline_s(self, members: list[int]) -> float:
        """(leader) How long this round's exchange waits for its slowest member: ``round_deadline_s``, or with
        ``round_deadline_mode: adaptive`` :func:`adaptive_deadline_s` of the recent round records' measured
        compute (every leader keeps the same records, so every leader holds the exchange to the same deadline)
        plus the WAN shaper's modeled hold, within the cap."""
        if self.deadline_mode != "adaptive":
            return float(self.deadline_s)
        rel = self.sc.reliability
        history = deadline_history(self.records.records)
        base = adaptive_deadline_s(history, multiple=rel.round_deadline_multiple, floor_s=rel.round_deadline_floor_s,
                                   cap_s=self.deadline_s, window=rel.round_deadline_window)  # fmt: skip
        if len(history) < MEASURED_ROUNDS:
            return float(self.deadline_s)
        return float(min(self.deadline_s, base + self.shaper_s(members)))

    # ---- 3. records (round_records.py) --------------------------------------------------------------------
    def end_round(self, result: Exchanged, members: list[int], outcome: dict[str, Any], lost: dict[int, int],
                  planned: dict[int, int], compute_s: float, comm_s: float, round_number: int | None = None,
                  **_: Any) -> None:  # fmt: skip
        number = self.run.rounds if round_number is None else round_number  # (overlapped: the exchange's own round)
        rejections, self.round_rejections = self.round_rejections, []  # (refused later: the next record's)
        self.history.end_round(result, members, outcome, lost, planned, number, self.last_deadline_s, rejections,
                               self.loop.slot_nbytes)  # fmt: skip

    # ---- the end ----------------------------------------------------------------------------------------
    # ---- resumed from checkpoints, together --------------------------------------------------------------
    def resumed(self) -> None:
        """Resumed from this region's own newest checkpoint. The rounds its folder holds go with its first quorum
        header, and torchft's step stays 0 until the members agree (:meth:`_agreed_resume_round`): a step of its
        own would make torchft heal the regions whose newest checkpoint is older from the one that got further,
        with a fresh AdamW, so the run would part from the uninterrupted one."""
        from .checkpoints import list_complete

        held = [r for r, _, _ in list_complete(self.run.checkpoints.directory)]
        self.pending_resume = {"loaded": self.run.rounds, "rounds": held}
        self.state.snapshot()

    def resumed_at_round(self) -> None:
        """The loop loaded the agreed round: torchft's step is the rounds done, and the records are rewritten."""
        if self.membership is not None:
            self.membership.set_step(self.run.rounds)
        self.records.written = -1
        self.state.snapshot()

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

    # ---- this region's part of its checkpoint (RegionState) -------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        return self.state.checkpoint_state()

    def checkpoint_state_rank0(self) -> dict[str, Any] | None:
        return self.state.checkpoint_state_rank0()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.state.load_checkpoint_state(state)

    def finish(self) -> dict[str, Any]:
        run = self.run
        run._mark("other")
        final = [self.me]
        checksums = {self.names[self.me]: self.state.theta_crc()}
        if run.is_leader and self.membership is not None:
            spans = run.clock.take_spans()
            ends = [{"region": self.me, "spans": spans}]
            try:  # every live region's checksum of θ at the end (equal: they applied the same updates), and its
                # last spans (its last exchange's: a round's spans travel with the next round's info), so that
                # every host's records hold every region's whole run
                mine = {"region": self.me, "crc": checksums[self.names[self.me]], "spans": spans}
                ends = sorted(self.membership.all_gather_framed(mine), key=lambda e: e["region"])
                final = [e["region"] for e in ends]
                checksums = {self.names[e["region"]]: e["crc"] for e in ends}
            except ExchangeFailed:
                pass
            self.history.ended(ends, final)
            # word for a region that arrives after the end (it stops at once, exit 0: board.py)
            self.board.post_finished({"round": run.rounds, "regions": [self.names[i] for i in final],
                                      "checksum": checksums.get(self.names[self.me])})  # fmt: skip
            self.membership.shutdown()
        writer = self.records.writes(min(final) == self.me) if run.is_leader else False
        if run.region_group is not None:  # its ranks evaluate θ and gather it for the summary together
            writer = run.transport.broadcast_json(writer, run.leader, run.region_group,
                                                  what="whether this region writes the summary")  # fmt: skip
        run.writes_summary = bool(writer)
        run.ledger.end(list(checksums.values()), run._now())
        loop, stats = self.loop, self.state.stats
        return {
            **run.ledger.exchange_fields(run.rounds, loop.planning.wire_nbytes, loop.kit.payload_nbytes,
                                         loop.kit.modeled_payload_nbytes, self.shaper_s(final),
                                         self.method.collective),  # fmt: skip
            "status": "complete",
            "exchange": loop.planning.exchange_kind,
            "shard_bits": loop.sharded.bits if loop.sharded is not None else None,
            "world_size": None,
            "ranks_per_region": None,
            "elastic": {"min_regions": self.min_regions, "round_deadline_s": self.deadline_s,
                        "round_deadline_mode": self.deadline_mode, **self.history.summary_fields(final)},
            "rounds_without": stats["rounds_without"],
            "tokens_lost": sum(stats["tokens_lost"].values()),
            "faults": self.faults.records,
            "param_checksums": checksums,
            "rejected_payloads": int(run.telemetry.counters.get("rejected_payloads", 0)),
            # frames refused from quorum members (forged, replayed, another run's) and recoveries refused to
            # whoever could not prove the key, as this region saw them
            "rejected_frames": self.membership.rejected_frames if self.membership is not None else 0,
            "heals_refused": getattr(getattr(self.membership, "heal", None), "refused", 0),
            "overlap": loop.overlap is not None,
            **loop.planning.summary_fields(),
        }
