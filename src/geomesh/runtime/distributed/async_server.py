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
from .async_wire import PULL, PUSH, pack, unpack
from .core import RankFailure, RankRun
from .frames import Rejected


class ParameterServer:
    """θ and its Delayed Nesterov state on the server's leader (rank ``run.layout.leaders[method.server]``)."""

    def __init__(self, run: RankRun, steps: list[int], width: int, group: Any,
                 order: Iterator[tuple[float, int]] | None) -> None:  # fmt: skip
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

    def spent(self) -> bool:
        return self.run.tokens_done >= self.run.budget

    # ---- applying an arrival -------------------------------------------------------------------------------
    def take(self, region: int, delta: dict[str, torch.Tensor] | None | Rejected, info: dict[str, Any]
             ) -> dict[str, Any]:  # fmt: skip
        """Apply ``region``'s push (``None``: its signed "no update"; :class:`Rejected`: a bad push) when its turn
        comes; the reply: θ after it (a copy), the tokens applied, the rounds, whether the run is over, and the
        seconds it waited for its turn."""
        run = self.run
        waited = time.perf_counter()
        with self.cond:
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
            stop = self.spent()
            if stop:
                self.stopped.add(region)
            self.pulled_at[region] = run.rounds
            reply = {"theta": {k: v.detach().to("cpu", copy=True) for k, v in self.params.items()},
                     "info": {"tokens": run.tokens_done, "rounds": run.rounds, "stop": stop, "waited_s": waited}}
            self.cond.notify_all()
            return reply

    def _apply(self, region: int, delta: dict[str, torch.Tensor] | None | Rejected, info: dict[str, Any]) -> None:
        run, name = self.run, self.names[region]
        tokens = self.region_tokens[region]
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
        if self.remote:
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
        """Wait for the serving thread (it ends once every remote region was told to stop); its error, if any."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise RankFailure(f"the parameter server stopped: {self.error}")
