"""The asynchronous baseline's parameter server (``async-local-sgd``), on the leader of region ``method.server``.

It holds θ (the global model's parameters on that rank) and :class:`~geomesh.outer.DelayedNesterov`'s state, and
applies each region's pseudo-gradient when it arrives, as the emulated twin's event queue does: one arrival is one
round, its tokens count when it lands (a signed "no update" too, as in the twin; a rejected push's tokens are
lost), evaluation every ``eval_every_rounds × N`` arrivals and when the budget is reached. The reply to a push is
θ as it is right after that push, the tokens applied so far and whether the run is over: once the budget is
spent every later push is answered "stop" and not applied (work still in flight when the budget ran out is cut,
as in the twin).

Two callers, one lock: the server region's own leader hands its push over in-process (:meth:`take`), the other
regions' leaders push over a point-to-point Gloo group of the leaders, served by one thread (:meth:`serve`) that
receives a push from whichever region sends first, opens it (:mod:`.async_wire`: a bad push is dropped and costs
only its sender's update), applies it and sends θ back.

Order. ``arrival`` (the default): pushes are applied in the order they arrive, so a run is not reproducible bit for
bit. ``modeled`` (``--async-order modeled``): the server applies them in the order of the modeled arrivals
(:func:`~geomesh.methods.async_local_sgd.modeled_arrivals`: the emulated twin's event queue), waiting for the
region whose modeled turn it is; then the run is the emulated run's, bit for bit (same θ, same losses), at the
price of regions waiting for their turn (recorded as ``straggler_wait`` on the server's region).

Elastic regions (``--min-regions N``: each region its own world): the remote regions reach the server over
sessions of :mod:`.async_link`, one thread each (:meth:`serve_session`). The run starts once ``N`` regions (the
server's own included) are connected, and goes on while at least ``N`` are: a session's welcome is θ as it is then.
A region whose connection drops just stops pushing (a ``leave`` record; nobody waits for it while ``N`` others are
connected; with fewer, the server holds every push until enough are back, up to ``--timeout``, as a round-based
run waits for a quorum of ``N``); a region that connects again (restarted with its own command) is welcome with the
current θ (a ``join`` record); a newer session of a region supersedes an older one, which is told to stop at its
next push. Once the budget is spent the server answers every live session's next push
with "stop" and θ (bounded by ``--timeout``) before it ends. Arrival order only.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...outer import DelayedNesterov
from .async_link import Session
from .async_wire import PULL, PUSH, pack, unpack
from .core import RankFailure, RankRun
from .frames import Rejected
from .service import MembershipError
from .region import params_checksum


class ParameterServer:
    """θ and its Delayed Nesterov state on the server's leader (rank ``run.layout.leaders[method.server]``)."""

    def __init__(self, run: RankRun, steps: list[int], width: int, group: Any,
                 order: Iterator[tuple[float, int]] | None, min_regions: int = 0) -> None:  # fmt: skip
        sc, tr = run.scenario, run.scenario.training
        self.run, self.steps, self.width, self.group = run, steps, width, group
        self.names = [r.name for r in sc.regions]
        self.n = len(self.names)
        self.home = run.method.server  # the server's own region (pushes in-process)
        self.remote = [i for i in range(self.n) if i != self.home]
        self.params = {k: p.detach() for k, p in run.global_model.named_parameters()}
        self.outer = DelayedNesterov(self.params, lr=tr.outer_lr, momentum=tr.outer_momentum, n_workers=self.n,
                                     c=run.method.c)  # fmt: skip
        self.region_tokens = [h * tr.batch * sc.model.seq_len for h in steps]
        self.eval_every = tr.eval_every_rounds * self.n
        self.order = order
        self.turn = next(order)[1] if order is not None else None
        self.cond = threading.Condition()
        self.pushes = [0] * self.n  # each remote region's next push number (what its frame must claim)
        self.pulled_at = [0] * self.n  # the round each region last pulled θ at (an arrival's staleness)
        self.stopped: set[int] = set()
        self.error: BaseException | None = None
        self.sent = 0  # bytes of θ this rank sent back to remote regions
        self.applied = 0  # arrivals whose update reached θ
        self.thread: threading.Thread | None = None
        # elastic regions (min_regions >= 1): the sessions of remote regions (async_link.py)
        self.min_regions = min_regions
        self.started = min_regions == 0  # (elastic: once min_regions regions are connected)
        self.sessions: dict[int, Session] = {}  # each region's newest session
        self.live: set[Session] = set()  # sessions not yet ended
        self.seen: set[int] = set()
        self.at_end: dict[int, str] = {}  # region -> the checksum of θ it was told to stop with
        self.leaves = self.joins = 0
        self.received = 0  # bytes of pushes received over sessions
        self.arrivals = [0] * self.n  # each region's pushes that arrived (applied, dropped or rejected)

    def spent(self) -> bool:
        return self.run.tokens_done >= self.run.budget

    def _connected(self) -> int:
        """(under the lock) The regions connected now, the server's own included."""
        return len({s.region for s in self.live} | {self.home})

    def _enough(self) -> bool:
        return self.min_regions == 0 or self._connected() >= self.min_regions

    # ---- applying an arrival -------------------------------------------------------------------------------
    def take(self, region: int, delta: dict[str, torch.Tensor] | None | Rejected, info: dict[str, Any]
             ) -> dict[str, Any]:  # fmt: skip
        """Apply ``region``'s push (``None``: its signed "no update"; :class:`Rejected`: a bad push) when its turn
        comes; the reply: θ after it (a copy), the tokens applied, the rounds, whether the run is over, and the
        seconds it waited for its turn."""
        run = self.run
        waited = time.perf_counter()
        with self.cond:
            # (elastic) a push is applied only while min_regions regions are connected: the run's floor, as a
            # round-based run's quorum
            if not self.cond.wait_for(lambda: self.error is not None or self.spent() or self._enough(),
                                      timeout=run.options.timeout_s):  # fmt: skip
                raise MembershipError(f"only {self._connected()} of the {self.min_regions} regions "
                                      f"(reliability.min_regions) were connected to the parameter server for "
                                      f"{run.options.timeout_s:g}s; fewer regions are alive than "
                                      f"reliability.min_regions")  # fmt: skip

            def mine() -> bool:
                return self.error is not None or self.spent() or self.order is None or self.turn == region

            if not self.cond.wait_for(mine, timeout=run.options.timeout_s):
                raise RankFailure(f"the parameter server waited {run.options.timeout_s:g}s for region "
                                  f"{self.names[self.turn]}'s push, whose modeled turn it is (--async-order "
                                  f"modeled); is that region alive?")  # fmt: skip
            if self.error is not None:
                raise RankFailure(f"the parameter server stopped: {self.error}")
            waited = time.perf_counter() - waited
            if not self.spent():
                self._apply(region, delta, info)
                if self.order is not None:
                    self.turn = next(self.order)[1]
            return self._reply(region, waited)

    def _reply(self, region: int, waited: float = 0.0) -> dict[str, Any]:
        """(under the lock) θ now (a copy), the tokens applied, the rounds and whether the run is over."""
        run, stop = self.run, self.spent()
        theta = {k: v.detach().to("cpu", copy=True) for k, v in self.params.items()}
        if stop:
            self.stopped.add(region)
            self.at_end[region] = params_checksum(theta)
        self.pulled_at[region] = run.rounds
        self.cond.notify_all()
        return {"theta": theta, "info": {"tokens": run.tokens_done, "rounds": run.rounds, "stop": stop,
                                         "waited_s": waited}}  # fmt: skip

    def _apply(self, region: int, delta: dict[str, torch.Tensor] | None | Rejected, info: dict[str, Any]) -> None:
        run, name = self.run, self.names[region]
        tokens = self.region_tokens[region]
        self.arrivals[region] += 1
        if isinstance(delta, Rejected):
            run.tokens_lost += tokens
            run.telemetry.count("rejected_payloads")
            self._warn(region, f"rejected push: {delta.reason}; its update is dropped")
        elif delta is None:
            run.tokens_done += tokens  # (the twin counts a dropped update's tokens as done)
            run.telemetry.count("dropped_updates")
            self._warn(region, "non-finite update; the push is dropped")
        else:
            self.outer.step({k: v.to(self.params[k].device) for k, v in delta.items()})
            run.tokens_done += tokens
            self.applied += 1
        run.rounds += 1
        remote = region != self.home
        run.ledger.totals["proxy_bytes_sent"] += 2 * 4 * sum(v.numel() for v in self.params.values()) if remote else 0
        run.telemetry.emit({"type": "round", "round": run.rounds, "time": run._now(), "tokens": run.tokens_done,
                            "members": [name], "compute_s": [float(info.get("compute_s", 0.0))],
                            "exchange_s": float(info.get("exchange_s", 0.0)),
                            "staleness": run.rounds - 1 - self.pulled_at[region],
                            "bytes_sent": 2 * self.width if remote else 0})  # fmt: skip
        if run.rounds % self.eval_every == 0 or self.spent():
            run._evaluate(run._now())

    def _warn(self, region: int, message: str) -> None:
        self.run.telemetry.emit({"type": "warning", "round": self.run.rounds + 1, "worker": self.names[region],
                                 "message": message})  # fmt: skip

    # ---- the remote regions' pushes ----------------------------------------------------------------------
    def start(self) -> None:
        if self.remote and self.group is not None:  # (elastic regions: a thread per session instead)
            self.thread = threading.Thread(target=self.serve, name="geomesh-parameter-server", daemon=True)
            self.thread.start()

    def serve(self) -> None:
        """Until every remote region has been told to stop: receive a push (from any region, or in modeled order
        from the region whose turn it is), open it, apply it, send θ back."""
        run, leaders = self.run, self.run.layout.leaders
        buf = torch.empty(self.width, dtype=torch.uint8)
        try:
            while not set(self.remote) <= self.stopped:
                with self.cond:  # (modeled order: the server region's own push may be next)
                    self.cond.wait_for(lambda: self.order is None or self.spent() or self.turn != self.home)
                    src = None if self.order is None or self.spent() else leaders[self.turn]
                sender = dist.recv(buf, src=src, group=self.group)
                region = leaders.index(sender)
                number = self.pushes[region]
                self.pushes[region] += 1
                body = unpack(PUSH, buf, region=region, number=number, sender=sender, like=self.params)
                if isinstance(body, Rejected):
                    print(f"warning: region {self.names[region]}: rejected its push {number}: {body.reason}",
                          file=sys.stderr, flush=True)  # fmt: skip
                    delta, info = body, {}
                else:
                    delta, info = body["delta"], body["info"]
                reply = self.take(region, delta, info)
                dist.send(pack(PULL, reply, region=region, number=number, sender=run.rank, width=self.width),
                          dst=sender, group=self.group)  # fmt: skip
                self.sent += self.width
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which stops the run with it
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def join(self) -> None:
        """Wait for the serving thread (it ends once every remote region was told to stop); its error, if any.
        Elastic: wait (up to ``--timeout``) until every live session was told to stop or dropped."""
        if self.thread is not None:
            self.thread.join()
        with self.cond:
            if not self.cond.wait_for(lambda: not self.live or self.error is not None,
                                      timeout=self.run.options.timeout_s):  # fmt: skip
                names = sorted(self.names[s.region] for s in self.live)
                print(f"warning: the parameter server ends without telling region(s) {', '.join(names)} to stop: "
                      f"no push from them within {self.run.options.timeout_s:g}s of the run's end (hung?)",
                      file=sys.stderr, flush=True)  # fmt: skip
        if self.error is not None:
            raise RankFailure(f"the parameter server stopped: {self.error}")

    # ---- elastic regions: one session per connected region (async_link.py) --------------------------------
    def wait_start(self) -> None:
        """(the server's own region) Until ``min_regions`` regions are connected, up to ``--timeout``."""
        timeout = self.run.options.timeout_s
        with self.cond:
            if not self.cond.wait_for(lambda: self.started or self.error is not None, timeout=timeout):
                raise MembershipError(f"only {self._connected()} of the {self.min_regions} regions "
                                      f"(reliability.min_regions) "
                                      f"connected to the parameter server within {timeout:g}s")  # fmt: skip

    def serve_session(self, session: Session) -> None:
        """A region's session (a thread of its own): the welcome (θ once the run has started), then push, apply,
        pull, until the run is over for it, its connection drops or a newer session of the region replaces it."""
        region, run = session.region, self.run
        with self.cond:
            if region in self.sessions:
                self.sessions[region].superseded = True
            if region in self.seen:  # (connected before: restarted, or back after its connection broke)
                self.joins += 1
                run.telemetry.emit({"type": "join", "round": run.rounds + 1, "time": run._now(),
                                    "region": self.names[region]})  # fmt: skip
            self.seen.add(region)
            self.sessions[region] = session
            self.live.add(session)
            self.started = self.started or self._enough()
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.started or self.error is not None)
            reply = self._reply(region)
        number = 0
        try:
            while True:
                session.send(pack(PULL, reply, region=region, number=number, sender=self.home, width=self.width,
                                  key=session.key))  # fmt: skip
                self.sent += self.width
                if reply["info"]["stop"]:
                    return self._ended(session, "superseded" if reply["info"].get("superseded") else "stop")
                buf = session.recv()
                if buf is None:
                    return self._ended(session, "dropped")
                self.received += self.width
                body = unpack(PUSH, buf, region=region, number=number, sender=region, like=self.params,
                              key=session.key)  # fmt: skip
                number += 1
                if session.superseded:  # a newer instance of the region is connected: this one stops
                    with self.cond:
                        reply = self._reply(region)
                    reply["info"].update(stop=True, superseded=True)
                    continue
                if isinstance(body, Rejected):
                    print(f"warning: region {self.names[region]}: rejected its push {number - 1} (from "
                          f"{session.peer}): {body.reason}", file=sys.stderr, flush=True)  # fmt: skip
                    delta, info = body, {}
                else:
                    delta, info = body["delta"], body["info"]
                reply = self.take(region, delta, info)
        except OSError:
            self._ended(session, "dropped")
        except BaseException as exc:  # noqa: BLE001 - the server's own failure: the run stops with it
            with self.cond:
                self.error = self.error or exc
            self._ended(session, "dropped")

    def _ended(self, session: Session, how: str) -> None:
        run = self.run
        with self.cond:
            session.ended = how
            self.live.discard(session)
            if how == "dropped" and not self.spent():
                self.leaves += 1
                run.telemetry.emit({"type": "leave", "round": run.rounds + 1, "time": run._now(),
                                    "region": self.names[session.region],
                                    "reason": "its connection to the parameter server closed"})  # fmt: skip
                print(f"warning: region {self.names[session.region]}: its connection to the parameter server "
                      f"closed; the run goes on without it", file=sys.stderr, flush=True)  # fmt: skip
            self.cond.notify_all()
