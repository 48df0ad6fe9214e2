"""The asynchronous baseline's loop in the distributed runtime (``async-local-sgd``), on one rank.

Every region runs its own cycle and never waits for another: it loads the θ it last pulled, trains its DyLU
inner steps H_w (:func:`~geomesh.methods.async_local_sgd.dynamic_local_updates`, from the declared profiles or
``--profile`` files, as the emulated twin), and its leader pushes the fp32 pseudo-gradient Δ = θ_pulled − local to
the parameter server (:mod:`.async_server`, on region ``method.server``'s leader) and pulls θ as it is right after
Δ was applied; the leader then shares θ inside its region. The server's own region hands its push over in-process.
The run ends when the server has applied the token budget: each region learns it from its next pull.

Messages cross processes as fixed-width frames (:mod:`.async_wire`), never pickles: over a Gloo group of the
leaders in a static world; with elastic regions (``--min-regions``, each region its own world) over one
authenticated TCP session per region with the server (:mod:`.async_link`; churn and records:
:mod:`.async_elastic`). With ``--wan shaper`` a remote region's push and pull are held to the WAN model's time for
their bytes (:meth:`~.wan_shaper.WanShaper.push_pull_s`).

Records (rank 0, the server's rank): one ``round`` record per arrival (``members``: the region, its
``compute_s``, its previous exchange time ``exchange_s``, and ``staleness``: the arrivals applied since it pulled
θ), evaluations every ``eval_every_rounds × N`` arrivals and at the end, each leader's spans (``compute``,
``comm_wait``; the server's region waits for its modeled turn as ``straggler_wait``; ``other``), and a summary
with the bytes sent (a push and a pull of one frame per remote cycle), the DyLU steps and the order.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ...config import ConfigError
from ...methods.async_local_sgd import NO_CHECKPOINTS, dynamic_local_updates, modeled_arrivals, modeled_cycle
from ...planner import Plan, plan_uniform
from ...worker import inner_lr
from ..options import checkpoint_cadence
from . import async_elastic
from .async_server import ParameterServer
from .async_wire import PULL, PUSH, message_width, pack, unpack
from .core import RankFailure, RankRun
from .frames import Rejected
from .service import MembershipError
from .trust import LAUNCHER_ENV
from .wan_shaper import WanShaper

ORDERS = ("arrival", "modeled")  # --async-order: how the server orders the pushes (see async_server.py)


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors.values()])


def _unflat(flat: torch.Tensor, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, t in like.items():
        out[name] = flat[offset : offset + t.numel()].view(t.shape).clone()
        offset += t.numel()
    return out


class RegionCycle:
    """One region's cycles on this rank: train from the pulled θ, push Δ (the leader), pull θ, share it."""

    def __init__(self, run: RankRun, steps: list[int], width: int, group: Any, server: ParameterServer | None,
                 session: Any = None):  # fmt: skip
        sc = run.scenario
        self.run, self.steps, self.width, self.group, self.server = run, steps, width, group, server
        self.session = session  # elastic regions: this leader's session with the server (async_link.py)
        self.me = run.region
        self.name = sc.regions[self.me].name
        self.server_rank = run.layout.leaders[run.method.server]
        self.like = {k: p.detach() for k, p in run.global_model.named_parameters()}
        self.pulled = {k: v.clone() for k, v in self.like.items()}  # θ0: the same on every rank (the seed)
        self.shaper = WanShaper(sc.wan_model(), run.options.wan)
        self.hold_s = self.shaper.push_pull_s(self.me, run.method.server, width)
        self.begin = 0  # tokens applied when this region pulled θ (its learning rates start there)
        self.pushes = 0
        self.sent = 0  # bytes this leader pushed
        self.received = 0  # bytes this leader pulled over its session (elastic regions)
        self.comm_s = 0.0  # seconds of push and pull, all cycles
        self.last_comm_s = 0.0
        self.cycles = 0
        self.stopped_at_welcome = False  # (elastic: a region that connected after the run's end)
        # the scenario's corrupt faults: (the region's push number, 0-based; the region) damaged on the wire
        self.corrupt = {(f.at_round, f.region) for f in sc.faults if f.kind == "corrupt"}

    def run_cycles(self) -> None:
        run, tr = self.run, self.run.scenario.training
        h = self.steps[self.me]
        tokens = h * tr.batch * run.scenario.model.seq_len
        stop = self.stopped_at_welcome
        while not stop:
            run._mark("other")
            begin = self.begin

            def lr_at(k: int) -> float:  # (the emulated twin's expression: the same learning rates, bit for bit)
                return inner_lr(begin + k / h * tokens, run.budget, tr)

            run.worker.load_global(self.pulled)
            started = run._cursor
            result = run.worker.train(h, tr.batch, lr_at)
            run._mark("compute")
            compute_s = run._cursor - started
            delta = run.worker.pseudo_gradient(self.pulled) if result.finite else None
            # the fault hooks' point "send" of this region's cycle (1-based): trained, its push not yet sent
            run.hooks.at("send", self.name, self.cycles + 1, rank=run.rank)
            comm_start = run._cursor
            control, theta = self._exchange(delta, {"compute_s": compute_s, "exchange_s": self.last_comm_s})
            run._mark("comm_wait")
            self.last_comm_s = run._cursor - comm_start
            self.comm_s += self.last_comm_s
            self.pulled = {k: v.to(run.device) for k, v in theta.items()}
            self.begin, stop = int(control["tokens"]), bool(control["stop"])
            if self.server is None:  # (on the server's rank the server keeps the run's counts)
                run.rounds, run.tokens_done = int(control["rounds"]), int(control["tokens"])
            self.cycles += 1

    def _exchange(self, delta: dict[str, torch.Tensor] | None, info: dict[str, float]
                  ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:  # fmt: skip
        """The leader pushes and pulls; every rank of the region gets the pull's control and θ."""
        run = self.run
        control, theta = None, None
        if self.server is not None:  # the server's own region: in-process
            reply = self.server.take(self.me, delta, info)
            run._mark("straggler_wait", until=run._cursor + reply["info"]["waited_s"])  # its modeled turn
            control, theta = reply["info"], reply["theta"]
        elif run.is_leader:
            control, theta = self._push_pull(delta, info)
        return self._share(control, theta)

    def _share(self, control: dict[str, Any] | None, theta: dict[str, torch.Tensor] | None
               ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:  # fmt: skip
        """The leader's pull to every rank of the region; a superseded session stops them all alike."""
        run = self.run
        if run.region_group is not None:
            control = run.transport.broadcast_json(control, run.leader, run.region_group,
                                                   what="the pulled θ's control inside the region")  # fmt: skip
            flat = _flat(theta) if run.is_leader else torch.empty(sum(t.numel() for t in self.like.values()))
            theta = _unflat(run.transport.broadcast(flat, run.leader, run.region_group), self.like)
        if control.get("superseded"):
            raise MembershipError(f"another instance of region {self.name} connected to the parameter server after "
                                  f"this one; this one stops")  # fmt: skip
        return control, theta

    def welcome(self) -> None:
        """(elastic regions) The server's welcome: θ as it is now and the tokens applied, on every rank."""
        run, control, theta = self.run, None, None
        if run.is_leader:
            control, theta = self._opened(self._receive(0), -1)
        run.wait_for_leader("the parameter server's welcome", 2 * run.options.timeout_s + 60)
        control, theta = self._share(control, theta)
        self.pulled = {k: v.to(run.device) for k, v in theta.items()}
        self.begin = int(control["tokens"])
        run.rounds, run.tokens_done = int(control["rounds"]), int(control["tokens"])
        if control["stop"]:
            self.stopped_at_welcome = True

    def _receive(self, number: int) -> dict[str, Any] | Rejected:
        """(elastic) Pull ``number`` of this session (bounded: the server answers a push at once, its welcome once
        ``min_regions`` regions are in, which its own ``--timeout`` bounds)."""
        run = self.run
        run.transport.op = f"pull {number} of region {self.name} from the parameter server"
        buf = self.session.recv(2 * run.options.timeout_s + 60)
        if buf is None:
            raise async_elastic.server_lost(self.name, run.scenario.regions[run.method.server].name,
                                            "its connection closed")  # fmt: skip
        self.received += self.width
        return unpack(PULL, buf, region=self.me, number=number, sender=run.method.server, like=self.like,
                      key=self.session.key)  # fmt: skip

    def _opened(self, reply: dict[str, Any] | Rejected, number: int
                ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:  # fmt: skip
        if isinstance(reply, Rejected):  # the server is the run: no θ to go on from
            what = "welcome" if number < 0 else f"reply to push {number}"
            raise RankFailure(f"region {self.name}: the parameter server's {what} was refused: {reply.reason}")
        return reply["info"], reply["theta"]

    def _push_pull(self, delta: dict[str, torch.Tensor] | None, info: dict[str, float]
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:  # fmt: skip
        run, number = self.run, self.pushes
        since = time.perf_counter()
        body = {"delta": None if delta is None else {k: v.to("cpu") for k, v in delta.items()}, "info": info}
        run.transport.op = f"push {number} of region {self.name} to the parameter server"
        damaged = (number, self.name) in self.corrupt
        if self.session is not None:  # elastic: the session's push number; its pull k + 1 answers push k
            buf = pack(PUSH, body, region=self.me, number=number, sender=self.me, width=self.width, damaged=damaged,
                       key=self.session.key)  # fmt: skip
            try:
                self.session.send(buf)
            except OSError as exc:
                raise async_elastic.server_lost(self.name, run.scenario.regions[run.method.server].name,
                                                f"sending push {number}: {exc.strerror or exc}") from None  # fmt: skip
            self.sent += self.width
            reply = self._receive(number + 1)
        else:
            buf = pack(PUSH, body, region=self.me, number=number, sender=run.rank, width=self.width, damaged=damaged)
            dist.send(buf, dst=self.server_rank, group=self.group)
            self.sent += self.width
            run.transport.op = f"pull {number} of region {self.name} from the parameter server"
            dist.recv(buf, src=self.server_rank, group=self.group)
            reply = unpack(PULL, buf, region=self.me, number=number, sender=self.server_rank, like=self.like)
        self.pushes += 1
        control, theta = self._opened(reply, number)
        self.shaper.hold(self.hold_s, since)
        return control, theta


def run_async(run: RankRun) -> dict[str, Any]:
    """The asynchronous baseline on this rank of ``run`` (set up); returns the summary's method fields."""
    sc, tr, method = run.scenario, run.scenario.training, run.method
    names = [r.name for r in sc.regions]
    order_name = getattr(run.options, "async_order", "arrival")
    every, _ = checkpoint_cadence(run.options, sc.reliability)
    if every > 0 and run.rank == 0 and not os.environ.get(LAUNCHER_ENV):
        print(f"warning: {method.name}: {NO_CHECKPOINTS}", file=sys.stderr, flush=True)  # (launch said it already)

    def make_plan() -> dict:
        profiles = run.profile_source.read()
        steps = dynamic_local_updates(profiles, tr.batch, tr.inner_steps)
        plan = plan_uniform(profiles, tr.batch, tr.inner_steps)
        for wp, h in zip(plan.workers, steps):
            wp.inner_steps = h
        return plan.to_json()

    plan = Plan.from_json(run._on_rank0("planning", make_plan))
    run.plans.append(plan)
    steps = [wp.inner_steps for wp in plan.workers]
    run.worker.follow_plan(plan.workers[run.region])
    params = {k: p.detach() for k, p in run.global_model.named_parameters()}
    width = message_width(params)
    elastic = run.options.elastic_region is not None
    home = run.region == method.server and run.is_leader  # the parameter server's rank
    server, session, link, group, records = None, None, None, None, None
    if elastic:  # each region its own world: sessions over TCP (async_elastic.py, async_link.py)
        if order_name == "modeled":
            raise ConfigError(f"--async-order modeled: not with elastic regions (--min-regions): a region lost "
                              f"would hold every later turn; use --async-order arrival")  # fmt: skip
        records = async_elastic.start_records(run)
        run.board = async_elastic.board(run)
        if home:
            server = ParameterServer(run, steps, width, None, None, min_regions=sc.reliability.min_regions)
            link = async_elastic.listen(run, width, server.serve_session)
        elif run.is_leader:
            session = async_elastic.join_server(run, width)
    else:  # the pushes and pulls: point to point among the leaders, over Gloo whatever the backend
        group = dist.new_group(run.layout.leaders, backend="gloo", timeout=run.transport.timeout)
        if home:
            order = None
            if order_name == "modeled":
                order = modeled_arrivals(*modeled_cycle(sc, run.profiles, steps, method.server))
            server = ParameterServer(run, steps, width, group, order)
    cycle = RegionCycle(run, steps, width, group, server, session)
    run._start_records(plan)
    try:
        if elastic and home:
            server.wait_start()  # (min_regions regions connected)
        elif elastic and run.region != method.server:
            cycle.welcome()
        run._start_clock()
        if server is not None:
            server.start()
        try:
            cycle.run_cycles()
        finally:
            if server is not None:
                server.join()
    finally:
        if link is not None:
            link.shutdown()
        if session is not None:
            session.close()
    if server is None:  # every rank ends on the server's θ (the last pull of every region)
        with torch.no_grad():
            for k, p in run.global_model.named_parameters():
                p.copy_(cycle.pulled[k])
    mine = {"sent": cycle.sent + (server.sent if server is not None else 0), "comm_s": cycle.comm_s,
            "cycles": cycle.cycles, "intra_bytes": run.transport.intra_bytes}  # fmt: skip
    leaders = run.reports.from_leaders(mine, what="the asynchronous totals")
    if run.rank == 0:
        run.ledger.totals["bytes_sent"] = sum(i["sent"] for i in leaders)
        run.ledger.totals["comm_s"] = sum(i["comm_s"] for i in leaders)
        run.ledger.totals["intra_region_bytes"] = sum(i["intra_bytes"] for i in leaders)
    run._final_telemetry(params)
    shaper_s = max(cycle.shaper.push_pull_s(i, method.server, width) for i in range(len(names)))
    fields = run.ledger.exchange_fields(run.rounds, width, 4 * sum(t.numel() for t in params.values()),
                                        4 * sc.timing().params, shaper_s, "push_pull")  # fmt: skip
    fields.update({"server": names[method.server], "dyLU_inner_steps": dict(zip(names, steps)),
                   "async_order": order_name, "tokens_lost": run.tokens_lost,
                   "rejected_payloads": int(run.telemetry.counters.get("rejected_payloads", 0)),
                   "cycles": {n: i["cycles"] for n, i in zip(names, leaders)} if leaders else None})  # fmt: skip
    if elastic:
        fields.update(async_elastic.finish(run, records, server, cycle))
    return fields
