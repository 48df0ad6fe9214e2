"""The overlapped round on one rank of the distributed runtime (docs/overlap.md; the algorithm is
:mod:`geomesh.methods.overlap`, the same code the emulated runtime runs).

When its round ends, a region leader passes the straggler barrier and *launches* the exchange
(``async_op=True``: Gloo or NCCL moves the bytes on its own threads) and returns to training at once; every
rank of the region computes its eager start for the next round (:meth:`RankOverlap.prepare_next`). At the
apply step of the next round (:func:`~geomesh.methods.overlap.apply_step`, from the plan, so every rank and
the emulated runtime apply it at the same step), :meth:`RankOverlap.arrive` completes it: the leader waits
for the collective and the WAN shaper's hold (the exchange lasts max(measured, modeled) from its launch, as
in the plain round), broadcasts the bytes inside its region, and every rank takes the same outer step; the
worker then rebases the steps it trained onto θ. Time spent waiting there is ``comm_wait``; the exchange's
time in flight is an ``exchange`` event (rank 0's view) in ``events.jsonl``. The last round's exchange is
completed right after the round (:meth:`RankOverlap.drain`): nothing is left to hide it under. It leaves in
fragments, the overlapped round's :class:`~.overlap_tail.TailExchange` (``tail``): the leader launches each
fragment's collective at its send step, inside the round, and the shaper holds the fragments one after another.

Where the plan picks the sharded exchange (docs/overlap.md, *Which exchange*), a static leader runs it whole
(:func:`~.sharded.sharded_round`: several direct exchanges with work between them, which no single
``async_op`` covers) on a thread, over a group of the leaders of its own: the round's report goes over the
leaders' group meanwhile, and one group's collectives must be issued in one order on every member. At the
apply step the leader joins it and shares the update and the exchange's decisions inside its region
(:meth:`RankOverlap._arrive_sharded`). Elastic leaders run the quorum's exchange on their thread, whichever kind
(:meth:`RankOverlap.launch_on_thread`). Rank 0 (with a sharded θ, region 0's ranks together) evaluates θ when
it is formed, i.e. inside :meth:`RankOverlap.arrive`, labelled with the tokens it contains."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ...methods.overlap import TailSend, TailSplit, apply_step, eager_start, eager_weights, planned_tokens
from ..payloads import screen_payload
from .overlap_tail import TailExchange
from .region import lay_out_like
from .transport import split_gathered
from .wan_shaper import ring_allgather_bytes, ring_allreduce_bytes

Tensors = dict[str, torch.Tensor]


class RankOverlap:
    """The overlapped schedule's state on one rank: its eager start, the last combined update, the exchange
    in flight (the leader's collective handle), and what it cost."""

    def __init__(self, run: Any, method: Any, combiner: Any, outer: Any, params: Tensors, manifest: Any,
                 shaper: Any, shaper_s: float, dense: bool, proxy_payload: int):  # fmt: skip
        self.run, self.method, self.combiner, self.outer, self.params = run, method, combiner, outer, params
        self.manifest, self.shaper, self.shaper_s = manifest, shaper, shaper_s
        self.dense, self.proxy_payload = dense, proxy_payload
        self.device = run.device
        self.start: Tensors = params  # no round 0 start is needed: nothing is in flight then
        self.last: Tensors | None = None
        self.in_flight_s = 0.0  # the plan's exchange time of the exchange in flight (0: none)
        self.waited_s = 0.0  # wall seconds this rank waited for exchanges (this round)
        # wall seconds of this round that are not its compute: the waits above, the outer step and an evaluation
        # at the apply step (the region's measured compute, which the plan loop re-plans from, leaves them out)
        self.apart_s = 0.0
        # (leader) the wire time of the last exchange that arrived: (seconds from its launch to its arrival, its
        # round), for the plan loop's WAN measurement (plan_loop.py); None once taken, or when none was measured
        self.wire: tuple[float, int] | None = None
        self._done_at: list[float] = []  # when the collective in flight completed (its future's callback)
        self._expect = False  # an exchange was launched and is not yet applied
        self._work = None
        self._buffer: torch.Tensor | None = None
        self._since = 0.0
        self._launched_at = 0.0
        # the last round's exchange, in fragments
        self.tail = TailExchange(run, method, manifest, combiner.key, shaper, dense, self._start)
        self._rejected: list[tuple[int, str]] = []  # (region, why) of updates left out since last taken
        self.planning: Any = None  # (static) the plan loop (plan_loop.py): the sharded exchange, when its plan picks it
        self.exchange: Any = None  # (static) the leaders' exchange (exchange.py): the shaper's time of the sharded one
        self.update: Any = None  # the round's update (update.py): screens, combines and steps what arrives
        self._sharded: dict[str, Any] | None = None  # (static) the sharded exchange in flight on the leader's thread
        self.quorum: Any = None  # (elastic) the quorum's exchange, run on the leader's thread: its agreement settles it
        self.share: Any = None  # (elastic) the leader's exchange result on every rank (leader_exchange.py)
        self.observe_arrived: Any = None  # (elastic) the plan loop measures an exchange as it arrives (in_flight.py)
        self._members: list[int] = []
        self._thread: threading.Thread | None = None
        self._outcome: Any = None
        self.arrived: list[tuple[Any, Any, list[int]]] = []  # (exchanged, outcome, members) not yet recorded
        self._dropped: list[int] = []  # regions whose slot arrived empty (no update) since last taken

    def apply_at(self, wp: Any, steps: int, margin: float = 1.0) -> int:
        """This round's apply step, from the plan's predicted step time (as the emulated runtime); ``margin``:
        the exchange expected that many times later (the plan loop's, from the measurements' noise)."""
        return apply_step(self.in_flight_s * margin, wp.compute_s / max(wp.inner_steps, 1), steps)

    @torch.no_grad()
    def prepare_next(self, payload: bytes | None, plan: Any, steps: list[int], exchange_s: float) -> None:
        """After this round's inner steps: the eager start of the next round from θ_r and this region's own
        payload, before the update in flight is applied; the round's exchange will be in flight."""
        run = self.run
        weights = eager_weights(planned_tokens(plan.workers, steps), self.method.weighting)
        mine = (lay_out_like(self.combiner.combine([payload], device=self.device), self.params)
                if payload is not None else None)  # fmt: skip
        name = run.scenario.regions[run.region].name  # (an elastic plan holds only the round's members)
        weight = weights.get(name, 0.0)
        self.start = eager_start(self.outer, mine, self.last, weight, run.scenario.geomesh.overlap_start)
        self.in_flight_s = exchange_s
        self._expect = True

    def launch_on_thread(self, exchange: Any, members: list[int]) -> None:
        """(elastic, the leader) Run ``exchange()`` (the quorum's whole exchange: collective, retries after a
        lost member, commit) on a thread; it arrives at this round's apply step, as a launched collective would.
        torchft's Gloo collectives release the interpreter lock, so the region's training goes on meanwhile."""
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["result"] = exchange()
            except BaseException as exc:  # noqa: BLE001 - raised where the exchange is waited for
                box["error"] = exc

        self._outcome = box
        self._members = list(members)
        self._expect = True  # (a region that joined at this exchange has no eager start of its own to set it)
        self._launched_at = self.run._now()
        self._thread = threading.Thread(target=work, name="geomesh-exchange", daemon=True)
        self._thread.start()

    def expect_members(self, members: list[int]) -> None:
        """(elastic, every rank) The members of the exchange now in flight (the leader launched it)."""
        self._members = list(members)

    def _arrive_elastic(self, waited_from: float) -> Tensors:
        """The elastic exchange in flight, joined (leader), shared inside the region (the wait: ``comm_wait``
        from ``waited_from``), screened, combined and applied by the round loop (``other``, as the static
        round's outer step); remembered for its round's records."""
        run = self.run
        result = None
        if run.is_leader:
            run.transport.op = f"the exchange of round {run.rounds} (overlapped)"
            self._thread.join()
            box, self._thread = self._outcome, None
            if "error" in box:
                raise box["error"]
            result = box["result"]
        result = self.share(result)
        run._mark("comm_wait")
        self.waited_s += run._cursor - waited_from
        if result.void:  # the exchange's vote did not commit it: no region applies it (the round is rolled back;
            # its tokens are lost work), and each moves its steps onto θ as it stands
            self.last = None
            self.quorum.agreement.settled(False, result.why, self.run.rounds + 1)
            self.arrived.append((result, {"took_part": [], "rejected": [], "dropped": [], "lost": set(self._members),
                                          "update": None, "void": result.why or "rolled back"}, self._members))
            return self.params
        self.quorum.agreement.settled(True, "", self.run.rounds + 1)
        if run.is_leader and not result.void:  # the exchange thread's own time, launch to arrival (not the wait)
            self.wire = (result.comm_s, run.rounds)
        outcome = self.update.apply(result, self._members, self.run.rounds + 1)
        if outcome.get("update") is not None and len(outcome["update"]) == len(self.params):
            self.last = outcome["update"]
        self.observe_arrived(result, outcome)  # (measured now, before the next exchange's quorum)
        self.arrived.append((result, outcome, self._members))
        return self.params

    def launch(self, payload: bytes | None, since: float) -> None:
        """The leader hands its payload to the cross-region collective and does not wait for it (the sharded
        exchange, when the plan picks it: run whole on a thread, over the leaders' overlap group)."""
        self.run.transport.op = f"the exchange of round {self.run.rounds + 1} (overlapped)"
        if self._sharded_now():
            self._launch_sharded(payload, since)
            return
        self._work, self._buffer = self._start(payload, self.combiner)
        self._since = since
        self._launched_at = self.run._now()
        done = self._done_at = []  # when the collective completes, not when the region takes it (apply step)
        try:
            self._work.get_future().add_done_callback(lambda _: done.append(time.perf_counter()))
        except (AttributeError, RuntimeError):  # (a backend without futures: measured when it is waited for)
            pass

    def _sharded_now(self) -> bool:
        """Static rounds whose plan picked the sharded exchange (the same on every rank)."""
        return self.quorum is None and self.planning is not None and self.planning.sharded is not None

    def _launch_sharded(self, payload: bytes | None, since: float) -> None:
        """(static, the leader) This round's sharded exchange (:func:`~.sharded.sharded_round`, payloads only, as
        the overlapped all-gather: the round's infos go with its report) on a thread, over the leaders' overlap
        group; it arrives at the next round's apply step (:meth:`_arrive_sharded`), held by the shaper to the
        WAN model's time of the bytes it moves."""
        from .sharded import quiet, sharded_round

        run, names = self.run, [r.name for r in self.run.scenario.regions]
        key, run_id = run.transport._trust()
        number = run.rounds + 1
        box: dict[str, Any] = {"shaper_s": self.exchange.shaper_s(list(range(len(names))))}

        def work() -> None:
            try:
                box["result"] = sharded_round(payload, self.planning.sharded, run.overlap_group, device=run.device,
                                              names=names, round_number=number, key=key, run_id=run_id,
                                              warn=quiet)  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - raised where the exchange is waited for
                box["error"] = exc
            box["done"] = time.perf_counter()

        self._sharded, self._since, self._launched_at = box, since, run._now()
        box["thread"] = threading.Thread(target=work, name="geomesh-exchange", daemon=True)
        box["thread"].start()

    def _arrive_sharded(self) -> Tensors | None:
        """(static, every rank) The sharded exchange in flight: the leader joins its thread and the shaper, the
        region's ranks share the update and the exchange's decisions (who was refused, had no update, lost its
        combined shard, or refused most others: :meth:`~.update.RoundUpdate.stands_aside`); the update to apply
        (None: nothing)."""
        from .update import lost_shard

        run, box, self._sharded = self.run, self._sharded, None
        head, flat = None, None
        if run.is_leader:
            box["thread"].join()
            if "error" in box:
                raise box["error"]
            r = box["result"]
            run.transport.wan_bytes += r.sent_bytes
            self.shaper.hold(box["shaper_s"], self._since)
            self.wire = (max(box["done"] - self._since, box["shaper_s"]), run.rounds)
            if run.rank == 0:
                run.telemetry.emit({"type": "exchange", "round": run.rounds - 1, "start": self._launched_at,
                                    "end": run._now(), "workers": [r.name for r in run.scenario.regions]})  # fmt: skip
            head = {"rejected": {str(j): why for j, why in r.rejected.items()}, "absent": list(r.absent),
                    "lost_shards": {str(k): why for k, why in r.lost_shards.items()}, "suspect": list(r.suspect),
                    "has_update": r.flat is not None}  # fmt: skip
            flat = r.flat
        if run.region_group is not None:
            head = run.transport.broadcast_json(head, run.leader, run.region_group, what="the round's exchange")
            if head["has_update"]:
                if not run.is_leader:
                    flat = torch.empty(self.manifest.numel, dtype=torch.float32, device=self.device)
                flat = run.transport.broadcast(flat, run.leader, run.region_group)
        for j, why in head["rejected"].items():
            self._rejected.append((int(j), f"payload rejected: {why}"))
        self._dropped.extend(int(j) for j in head["absent"])
        for k, why in head["lost_shards"].items():
            self._rejected.append((int(k), lost_shard(why)))
        suspect = [int(k) for k in head["suspect"]]
        if self.update.outvoted or self.update.stands_aside(suspect, run.rounds + 1) or flat is None:
            return None
        return self.combiner._split(flat)

    def _start(self, payload: bytes | None, codec: Any) -> tuple[Any, torch.Tensor]:
        """Launch the collective of one payload made by ``codec`` (the whole model's or a fragment's):
        (work, the buffer it fills)."""
        run, group = self.run, self.run.leaders_group
        if self.dense:  # a sum mixes contributions before anyone could check one: the sender checks its own
            reason = screen_payload(codec, payload) if payload is not None else None
            if reason is not None:
                self._rejected.append((run.region, f"payload rejected: {reason}"))
            flat = codec.reducible(payload if reason is None else None, device=self.device)
            run.transport.wan_bytes += ring_allreduce_bytes(flat.numel() * flat.element_size(), len(run.layout.leaders))
            return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True), flat
        nbytes, size = codec.payload_nbytes(), len(run.layout.leaders)
        mine = torch.zeros(nbytes, dtype=torch.uint8)
        if payload is not None:
            mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        mine = mine.to(self.device)
        out = torch.empty(size * nbytes, dtype=torch.uint8, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        run.transport.wan_bytes += ring_allgather_bytes(nbytes, size)
        return gather(out, mine, group=group, async_op=True), out

    # ---- the last round: its exchange in fragments -------------------------------------------------
    def tail_split(self, wan: Any, modeled_payload: int, round_s: float) -> TailSplit | None:
        """The fragments of the last round's exchange (None: one exchange): :meth:`.TailExchange.split_for`."""
        return self.tail.split_for(wan, modeled_payload, round_s, self.in_flight_s)

    def tail_send(self, split: TailSplit, wp: Any, steps: int, apply_at: int) -> TailSend:
        """This rank's part of the last round's split exchange (:meth:`.TailExchange.send`)."""
        return self.tail.send(split, wp.compute_s / max(wp.inner_steps, 1), steps, apply_at)

    def arrive(self, before: str = "compute") -> Tensors:
        """Complete the exchange in flight (the leader waits for it and the shaper, then the region's ranks
        share it) and take the outer step; returns θ. Nothing in flight: θ as it is."""
        run = self.run
        if not self._expect:
            return self.params
        run._mark(before)
        waited_from = run._cursor
        if self.quorum is not None:
            self._arrive_elastic(waited_from)
            return self._apart(self._formed(), waited_from)
        if self._sharded is not None or (not run.is_leader and self._sharded_now()):
            run.transport.op = f"the exchange of round {run.rounds} (overlapped)"
            combined = self._arrive_sharded()
            run._mark("comm_wait")
            self.waited_s += run._cursor - waited_from
            self._step(combined)
            return self._apart(self._formed(), waited_from)
        exchanged = self._buffer
        if run.is_leader:
            run.transport.op = f"the exchange of round {run.rounds} (overlapped)"
            self._work.wait()
            done = self._done_at[0] if self._done_at else time.perf_counter()
            self.shaper.hold(self.shaper_s, self._since)
            # its time on the wire: launch to arrival (the collective's completion, held by the shaper to the
            # modeled WAN), not the wait at the apply step
            self.wire = (max(done - self._since, self.shaper_s), run.rounds)
            if run.rank == 0:  # the exchange as rank 0 saw it: from its launch to when rank 0 took it
                run.telemetry.emit({"type": "exchange", "round": run.rounds - 1, "start": self._launched_at,
                                    "end": run._now(), "workers": [r.name for r in run.scenario.regions]})  # fmt: skip
        if run.region_group is not None:
            if exchanged is None:
                d, n = self.manifest.numel, len(run.layout.leaders)
                exchanged = (torch.empty(d + 1, dtype=torch.float32, device=self.device) if self.dense
                             else torch.empty(n * self.proxy_payload, dtype=torch.uint8))  # fmt: skip
            exchanged = run.transport.broadcast(exchanged, run.leader, run.region_group)
        run._mark("comm_wait")
        self.waited_s += run._cursor - waited_from
        self._step(self._combined(exchanged, self.combiner))
        return self._apart(self._formed(), waited_from)

    def _apart(self, params: Tensors, since: float) -> Tensors:
        """Count the time from ``since`` (the apply step) to now as not this round's compute."""
        self.apart_s += self.run._cursor - since
        return params

    def take_wire(self) -> tuple[float, int] | None:
        """(leader) The wire time of the last exchange that arrived and its round, once (None: none new)."""
        wire, self.wire = self.wire, None
        return wire

    def _formed(self) -> Tensors:
        """θ after the outer step: nothing is in flight any more; rank 0 evaluates it when it is due."""
        run = self.run
        self._expect, self._work, self._buffer = False, None, None
        self.in_flight_s = 0.0  # (this round's apply step is taken; a round after a drain starts from θ)
        if run.evaluates:
            every = run.scenario.training.eval_every_rounds
            if run.rounds % every == 0 or run.stopping.spent(run.tokens_done):
                run._evaluate(run._now())
        run._mark("other")  # the outer step (and rank 0's evaluation), as in the plain round
        return self.params

    @torch.no_grad()
    def _combined(self, exchanged: torch.Tensor, codec: Any) -> Tensors | None:
        """The combined update in the exchanged bytes of payloads made by ``codec``; None when none arrived."""
        if self.dense:
            return codec.reduced_update(exchanged)
        # every payload screened before any is combined (a bad one costs its sender's update)
        slots = dict(enumerate(split_gathered(exchanged.cpu(), codec.payload_nbytes())))
        screened = self.update.screened(codec, slots, list(slots), self.run.rounds + 1)
        self._dropped.extend(screened.dropped)
        if screened.outvoted:  # another run key than most others': it stands aside (as in plain rounds)
            return None
        self._rejected.extend(screened.rejected)
        return screened.update

    def take_rejected(self) -> list[tuple[int, str]]:
        """(region, why) of every payload screened out since the last call (each region once)."""
        seen, out = set(), []
        for region, why in self._rejected:
            if region not in seen:
                seen.add(region)
                out.append((region, why))
        self._rejected = []
        return out

    def take_dropped(self) -> list[int]:
        """Regions whose update was absent (non-finite) since the last call."""
        out, self._dropped = sorted(set(self._dropped)), []
        return out

    @torch.no_grad()
    def _step(self, combined: Tensors | None) -> None:
        """The outer step, the same on every rank; a whole update is remembered as the last one."""
        if combined is None:
            return
        combined = lay_out_like(combined, self.params)  # each rank's shard of it, where θ is sharded
        self.outer.step(combined)
        if len(combined) == len(self.params):
            self.last = combined

    def drain(self) -> None:
        """Wait for the exchange in flight now: the last round's (nothing is left to hide it under; in
        fragments, :meth:`.TailExchange.arrive`), or one a checkpoint must not hold (the next round then starts
        from θ, as a plain round)."""
        if self.tail.split is None:
            self.arrive(before="other")
            return
        run = self.run
        run._mark("other")
        waited_from = run._cursor
        combined = self.tail.arrive(self._combined)
        run._mark("comm_wait")
        self.waited_s += run._cursor - waited_from
        self._step(combined)
        self._apart(self._formed(), waited_from)

    def take_waited(self) -> float:
        """The seconds waited for exchanges since the last call (``comm_wait``); the round's time apart from
        its compute starts again too."""
        waited, self.waited_s, self.apart_s = self.waited_s, 0.0, 0.0
        return waited
