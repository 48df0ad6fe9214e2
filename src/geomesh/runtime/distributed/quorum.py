"""The round's quorum on one elastic region (torchft's, through :class:`~.membership.Membership`), held by
:class:`~.elastic.QuorumExchange` beside the exchange and its vote; the records of membership are
:mod:`.round_records`'.

The region's leader connects to the quorum service (torchft's Lighthouse, and the run board beside it) and asks for
each round's quorum. A region that died is not in it (it stopped heartbeating); one that hangs or is late is left
out once ``reliability.round_deadline_s`` has passed; a region behind the others (restarted, or back after missing
rounds) first receives θ, the outer momentum and the loop's state from a live region (torchft's checkpoint
transport), then takes part with a fresh AdamW and an empty error-feedback residual (a restarted process, as in the
emulated runtime); its data stream continues where it last reported it. Members all-gather a quorum header (region,
a hash of scenario, method, seed and budget, its calibration, the checkpoint rounds it resumed from, its attempt)
over the quorum: a region whose hash differs from the others' stops with one ``error:`` line, and regions resumed
together agree on the round they resume at. At the first round, regions wait (up to ``--timeout``) until every
region is in. The leader shares the quorum with its region's ranks, a healing state's tensors too. The round's plan
header is shipped over the same quorum (its pure rules: :mod:`.agreement`), and the frames the quorum refused are
noted for the round's record.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from ...config import ConfigError
from ...errors import RunError
from .agreement import RoundAgreement, RoundHeader, maker_of
from .elastic_state import RegionState
from .exchange import RoundView
from .membership import ExchangeFailed, Membership, RunFinished
from .service import LIGHTHOUSE_ENV, MembershipError, group_store_host


class RoundQuorum:
    """One region's side of every round's quorum, on every rank of ``run``: ``names`` the scenario's regions,
    ``job_hash`` the run's (every member must hold the same), ``agreement`` the round's header, ``state`` the
    region's (a heal's state lands there), ``params`` θ (the shapes a healing state is shared in); ``emit`` and
    ``say`` the region's records and progress lines. The leader connects to the quorum service (:meth:`connect`)."""

    def __init__(self, run: Any, names: list[str], min_regions: int, job_hash: str, agreement: RoundAgreement,
                 state: RegionState, params: dict[str, torch.Tensor], emit: Callable[[dict], None],
                 say: Callable[[str], None]):  # fmt: skip
        self.run, self.names, self.n, self.me = run, names, len(names), run.region
        self.min_regions, self.job_hash, self.timeout_s = min_regions, job_hash, run.options.timeout_s
        self.agreement, self.state, self.params, self.emit, self.say = agreement, state, params, emit, say
        self.membership: Membership | None = None
        self.board: Any = None  # (leader) the run board beside the quorum service: word of a finished run
        self.refused: set[int] = set()  # regions (as their frames claim) whose frames did not authenticate
        self.rejections: list[dict[str, Any]] = []  # frames refused since the last round record
        self.launch_members: list[int] | None = None  # overlapped: the members at the last exchange's quorum
        self.launch_head: dict[str, Any] | None = None  # ... and the next round's header, shipped at that quorum
        self.calibration: dict[str, Any] | None = None  # this region's step times measured in place
        self.pending_resume: dict[str, Any] | None = None  # resumed, until the first quorum agrees on the round

    def connect(self, lighthouse: str | None, deadline_s: float, join_timeout_s: float, setup_s: float) -> Membership:
        """(leader) The region's connection to the quorum service at ``lighthouse`` (torchft's quorums, and the run
        board a region arriving after the end reads), its collectives held to ``deadline_s``."""
        if not lighthouse:
            raise ConfigError(f"elastic regions need the quorum service's address: --lighthouse http://HOST:PORT or "
                              f"${LIGHTHOUSE_ENV} (`geomesh launch` starts one and sets it)")  # fmt: skip
        name = self.names[self.me]
        try:
            self.membership = Membership(
                region=self.me, name=name, lighthouse=lighthouse, min_regions=self.min_regions,
                deadline_s=deadline_s, quorum_timeout_s=self.timeout_s, state_dict=self.state.state_dict,
                load_state_dict=self.state.load_state_dict, store_addr=group_store_host(lighthouse, name),
                store_port=int(os.environ.get("MASTER_PORT", "29500")), names=self.names,
                join_timeout_s=join_timeout_s, setup_s=setup_s)  # fmt: skip
        except MembershipError as exc:
            raise RunError(str(exc)) from None
        from .board import RunBoard

        self.board = RunBoard(lighthouse, run=f"{self.membership.run_id}/{self.job_hash}", key=self.membership.key)
        self.membership.finished = self.board.finished
        return self.membership

    def close(self, note: dict[str, Any]) -> None:
        """(leader, at the end) Word for a region that arrives after the end (it stops at once, exit 0: board.py),
        then the connection closed."""
        self.board.post_finished(note)
        self.membership.shutdown()

    def share_calibration(self, mine: dict[str, Any] | None) -> None:
        """This region's calibration travels with its quorum header, so every member learns the others'."""
        self.calibration = mine

    def resume_from(self, loaded: int, held: list[int]) -> None:
        """Resumed at round ``loaded``, holding the checkpoints of rounds ``held``: said in the quorum headers until
        the members agree on the round they all resume at (:meth:`agreed_resume_round`)."""
        self.pending_resume = {"loaded": loaded, "rounds": held}

    def take_rejections(self) -> list[dict[str, Any]]:
        """The frames refused since the last round record (for the next one), and none from now on."""
        taken, self.rejections = self.rejections, []
        return taken

    def note_rejections(self) -> None:
        """The members the last collective refused, for the round's record, by region name (``claimed``: what
        an unauthenticated frame says it is)."""
        for r in self.membership.rejected:
            if r["claimed"] and r["region"] is not None and ("HMAC" in r["reason"] or "unsigned" in r["reason"]):
                self.refused.add(r["region"])
            entry = {"region": r["name"], "claimed": r["claimed"], "reason": r["reason"]}
            if entry not in self.rejections:  # (the first round's startup wait repeats its header)
                self.rejections.append(entry)

    # ---- the round's quorum, on every rank ---------------------------------------------------------------
    def open_round(self, first: bool, overlapped: bool, wait_s: Callable[[], float]) -> RoundView:
        """The round's quorum on the leader, shared inside the region (the healing state's tensors too; its ranks
        wait ``wait_s()`` seconds for it). Overlapped rounds take their quorum where the exchange leaves
        (:meth:`launch`, so no quorum reconfigures the group while an exchange is in flight); a round starts with
        the last one's members."""
        run = self.run
        if overlapped and not first:
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
            healed = self.state.take_healed()
            view = RoundView(members=ctrl["members"], healed=ctrl["healed"], state=healed if ctrl["healed"] else None,
                             rejoined=ctrl["rejoined"], calibration=ctrl["calibration"],
                             resume_round=ctrl.get("resume_round"))  # fmt: skip
        if run.world == 1:
            if finished is not None:
                raise RunFinished(finished)
            return view
        run.wait_for_leader("the round's quorum", wait_s())
        head = run.transport.broadcast_json(
            {"finished": finished} if finished is not None else
            {"members": view.members, "healed": view.healed, "rejoined": view.rejoined,
             "calibration": {str(k): v for k, v in view.calibration.items()},
             "resume_round": view.resume_round} if run.is_leader else None,
            run.leader, run.region_group, what="the round's quorum")  # fmt: skip
        if head.get("finished") is not None:  # every rank of the region stops alike
            raise RunFinished(head["finished"])
        state = self._share_state(view.state if run.is_leader else None) if head["healed"] else None
        return RoundView(members=head["members"], healed=head["healed"], state=state, rejoined=head["rejoined"],
                         calibration={int(k): v for k, v in head["calibration"].items()},
                         resume_round=head.get("resume_round"))  # fmt: skip

    def _share_state(self, state: dict[str, Any] | None) -> dict[str, Any]:
        """A healing state (θ, outer momentum, the loop's JSON state) from the leader to the region's ranks:
        the JSON part as JSON, the tensors one by one in θ's order (whole tensors, as the leader holds them)."""
        run = self.run
        head = run.transport.broadcast_json(
            {k: v for k, v in state.items() if k != "params" and k != "outer"} | {
                "outer": {k: v for k, v in state["outer"].items() if k != "buf"}} if run.is_leader else None,
            run.leader, run.region_group, what="the state of a live region")  # fmt: skip
        params, buf = {}, {}
        for k, v in self.params.items():
            for out, src in ((params, state["params"] if run.is_leader else None),
                             (buf, state["outer"]["buf"] if run.is_leader else None)):  # fmt: skip
                t = src[k].to(torch.float32) if src is not None else torch.empty(tuple(v.shape), dtype=torch.float32)
                out[k] = run.transport.broadcast(t.contiguous(), run.leader, run.region_group)
        return {**head, "params": params, "outer": {**head["outer"], "buf": buf}}

    def launch(self) -> tuple[list[int], list[int]]:
        """(leader, overlapped rounds) The quorum of the exchange about to leave: (its members, the regions healed
        at it). The next round starts with them; its header follows (:meth:`ship_launch_header`)."""
        ctrl = self._quorum(first=False)
        if ctrl["healed"]:
            raise RunError(f"region {self.names[self.me]} fell behind the others between two overlapped exchanges; "
                           f"restart it (it rejoins with the live state)")  # fmt: skip
        self.launch_members = list(ctrl["members"])
        return list(ctrl["members"]), ctrl["rejoined"]

    def launched_with(self, members: list[int]) -> None:
        """(leader, overlapped rounds) The members the next round starts with, where this region healed at the
        exchange's quorum (it asked for none itself)."""
        self.launch_members = list(members)

    def ship_launch_header(self, members: list[int], proposal, reason: str, exchange_kind: str, number: int) -> None:
        """(leader, overlapped rounds) Round ``number``'s header, shipped at the quorum :meth:`launch` formed,
        before the exchange's thread takes the group; its region learns it as the round opens."""
        self.launch_head = self._ship_header(self.launch_members, members, proposal, reason, exchange_kind, number)

    def ends(self, crc: int, spans: Any) -> list[dict[str, Any]]:
        """(leader, at the end) Every live region's checksum of θ (equal: they applied the same updates) and its
        last spans (its last exchange's: a round's spans travel with the next round's info), so that every host's
        records hold every region's whole run; by region. Only this region's where the quorum cannot gather."""
        mine = {"region": self.me, "crc": crc, "spans": spans}
        try:
            return sorted(self.membership.all_gather_framed(mine), key=lambda e: e["region"])
        except ExchangeFailed:
            return [mine]

    # ---- the round's header --------------------------------------------------------------------------------
    def agree(self, quorum: list[int], members: list[int], proposal, reason: str, exchange_kind: str,
              number: int) -> RoundHeader | None:  # fmt: skip
        """(every rank) The header of round ``number`` (:mod:`.agreement`): the quorum's maker ships its
        ``proposal`` (the plan its plan loop holds for ``members``, its ``exchange_kind``, and why); every leader
        checks what arrived and shares it inside its region. None: this region refused it, or it did not arrive
        (``agreement.refusal`` says why)."""
        run = self.run
        head = self._ship_header(quorum, members, proposal, reason, exchange_kind, number) if run.is_leader else None
        if run.world > 1:
            head = run.transport.broadcast_json(head, run.leader, run.region_group, what="the round's header")
        return self._take_header(head, number)

    def _take_header(self, head: dict[str, Any], number: int) -> RoundHeader | None:
        """(every rank) The header its leader accepted (or why none), as this region's."""
        header = self.agreement.take(head)
        if header is None:
            why = self.agreement.refusal
            self.say(f"round {number}: refused the round's header: {why}")
            self.emit({"type": "warning", "round": number, "worker": self.names[self.me],
                       "message": f"refused the round's header ({why}); it takes no part in the round"})  # fmt: skip
        return header

    def _ship_header(self, quorum: list[int], members: list[int], proposal, reason: str, exchange_kind: str,
                     number: int) -> dict:  # fmt: skip
        """(leader) The header collective over the quorum's leaders: the maker's header, checked."""
        m = self.membership
        mine = None
        if maker_of(quorum) == self.me:
            mine = self.agreement.proposal(number, members, proposal, exchange_kind, reason)
        try:
            got = {region: obj.get("header") for _, region, obj in
                   m.all_gather_framed_slots({"region": self.me, "header": mine}) if isinstance(obj, dict)}
        except ExchangeFailed as exc:
            m.report(exc)
            return {"header": None, "refusal": f"the header's collective failed ({exc})"}
        self.note_rejections()
        return self.agreement.check(got, quorum, number)

    # ---- torchft's quorum and the quorum headers, on the leader ---------------------------------------------
    def _quorum(self, first: bool) -> dict[str, Any]:
        """(leader) Join the round's quorum and learn its members; retried until a header exchange works."""
        m = self.membership
        startup_until = time.monotonic() + self.timeout_s
        short_since: float | None = None  # when quorums of too few regions that hold the run's key began
        failing_since: float | None = None  # when quorums whose group could not be set up began
        while True:
            try:  # a member that died between the quorum and the group's set-up fails it: ask again
                healed, _ = m.quorum()
            except ExchangeFailed as exc:
                m.report(exc)
                failing_since = time.monotonic() if failing_since is None else failing_since
                if time.monotonic() - failing_since > self.timeout_s:
                    raise RunError(f"region {self.names[self.me]}: no quorum could set up its group within "
                                   f"{self.timeout_s:g}s: {exc}") from None  # fmt: skip
                continue
            failing_since = None
            try:
                wait = first and not healed and time.monotonic() < startup_until
                headers = m.all_gather_framed({"region": self.me, "hash": self.job_hash, "wait": wait,
                                               "healed": healed, "calibration": self.calibration,
                                               "resume": self.pending_resume,
                                               "attempt": self.agreement.attempt})  # fmt: skip
            except ExchangeFailed as exc:
                m.report(exc)
                continue
            self.note_rejections()
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
                if time.monotonic() - short_since > self.timeout_s:
                    odd = ", ".join(map(m.region_name, sorted(self.refused))) or "none"
                    raise RunError(f"region {self.names[self.me]}: no quorum of at least {self.min_regions} "
                                   f"region(s) that hold the run's key within {self.timeout_s:g}s (regions "
                                   f"whose frames do not authenticate: {odd})")  # fmt: skip
                time.sleep(0.3)
                continue
            # regions resumed together: every member (a resumed one, or one whose folder was lost) takes the round
            # every resumed member holds, then asks again (where one behind it heals)
            resuming = [h for h in headers if isinstance(h.get("resume"), dict) and not h.get("healed")]
            self.pending_resume = None
            if resuming and not healed:
                return {"members": members, "healed": False, "rejoined": [], "calibration": {},
                        "resume_round": self.agreed_resume_round(resuming)}  # fmt: skip
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
                      and isinstance(r["region"], int) and 0 <= r["region"] < self.n
                      and r["region"] != self.me})  # fmt: skip
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

    @staticmethod
    def agreed_resume_round(resuming: list[dict[str, Any]]) -> int:
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
