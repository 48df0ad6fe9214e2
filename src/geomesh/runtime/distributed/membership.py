"""Which regions take part in a round, and how their leaders talk: torchft's Lighthouse and Manager.

Elastic regions (``reliability.min_regions >= 1``) use torchft (PyTorch's fault-tolerance library) for
membership rather than consensus written here:

- one **Lighthouse** per job (``geomesh launch`` hosts it; on a cluster ``torchft_lighthouse`` or
  ``python -m geomesh.runtime.distributed.membership``) forms a *quorum* every round from the regions that ask for one:
  all live regions, or, once ``round_deadline_s`` has passed, those that arrived, if at least
  ``min_regions`` did. A region whose process died stops heartbeating and is left out at once;
- one **Manager** per region, on the region's leader (one replica group = one region, group world size 1:
  only leaders cross the WAN), asks for the quorum at the start of each round, reconfigures a torchft Gloo
  process group over the quorum's leaders (a new rendezvous per quorum, so a dead peer never poisons the
  next round), and counts committed rounds (``current_step`` = rounds done);
- **live recovery**: a region whose step is behind the quorum's (a restarted process, or one that missed
  rounds) receives the state of a live region over torchft's HTTP checkpoint transport before its first
  round (:meth:`Membership.quorum` returns ``healed=True``).

Why not torchft's ``Manager.allreduce``: GeoMesh exchanges 1-bit payloads of one size, which an all-reduce
cannot combine (the combine weights signs by tokens and decodes magnitudes). So the Manager gives
membership, recovery and the reconfigured process group, and the exchange is an all-gather over that group
(:meth:`Membership.all_gather_bytes`); dense (fp32) methods all-reduce a weighted buffer over it.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import sys
import time
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # the Lighthouse's address, http://HOST:PORT (torchft's own variable)
ADVERTISE_ENV = "GEOMESH_ADVERTISE_HOST"  # how other regions reach this leader (default: its host name)


class MembershipError(RuntimeError):
    """No quorum within the time allowed, or the quorum service cannot be reached (the message says which)."""


class ExchangeFailed(RuntimeError):
    """A collective over the quorum failed: a member died, hung past the deadline or left."""


def start_lighthouse(min_regions: int, deadline_s: float, bind: str = "[::]:0",
                     heartbeat_timeout_s: float = 5.0):  # fmt: skip
    """A torchft Lighthouse (in this process, on a background thread); ``.address()`` is what regions use."""
    os.environ.setdefault("RUST_LOG", "error")  # torchft's own (Rust) logging: errors only
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=int(min_regions), join_timeout_ms=int(deadline_s * 1000),
                            quorum_tick_ms=100, heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))  # fmt: skip


def check_reachable(address: str, timeout_s: float) -> None:
    """Raise MembershipError unless something accepts TCP connections at ``address`` (http://HOST:PORT)."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit():
        raise MembershipError(f"quorum service address {address!r}: expected http://HOST:PORT")
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, int(port)), timeout=min(2.0, timeout_s)):
                return
        except OSError as exc:
            last = exc
            time.sleep(0.25)
    raise MembershipError(f"the quorum service (torchft Lighthouse) at {address} cannot be reached within "
                          f"{timeout_s:g}s: {last}; start it (`geomesh launch` hosts one; on a cluster run "
                          f"torchft_lighthouse) and set ${LIGHTHOUSE_ENV}")  # fmt: skip


class Membership:
    """A region leader's view of the job: the torchft Manager (quorum, recovery, step count) and the
    reconfigurable Gloo group over the quorum's leaders."""

    def __init__(self, *, region: int, name: str, lighthouse: str, min_regions: int, deadline_s: float,
                 quorum_timeout_s: float, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
                 store_addr: str, store_port: int):  # fmt: skip
        os.environ.setdefault("RUST_LOG", "error")
        import logging

        logging.getLogger("torchft").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", message="The 'warn' method is deprecated")  # torchft's own logger
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        check_reachable(lighthouse, min(quorum_timeout_s, 30.0))
        self.region, self.name = region, name
        self.deadline = timedelta(seconds=deadline_s)
        self.quorum_timeout = timedelta(seconds=quorum_timeout_s)
        self.lighthouse = lighthouse
        self.min_regions = min_regions
        self.pg = ProcessGroupGloo(timeout=self.deadline)
        # replica ids sort in scenario order (the quorum ranks follow them); torchft appends a fresh uuid, so a
        # restarted region is a new replica of the same name
        self.manager = Manager(
            pg=self.pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=min_regions,
            use_async_quorum=False, timeout=self.deadline, quorum_timeout=self.quorum_timeout,
            connect_timeout=timedelta(seconds=min(quorum_timeout_s, 60.0)), rank=0, world_size=1,
            store_addr=store_addr, store_port=store_port, lighthouse_addr=lighthouse,
            replica_id=f"region{region:03d}_{name}", hostname=os.environ.get(ADVERTISE_ENV) or socket.gethostname(),
            heartbeat_interval=timedelta(milliseconds=100), init_sync=False,
        )  # fmt: skip
        self.control_bytes = 0

    @property
    def step(self) -> int:
        return self.manager.current_step()

    def set_step(self, step: int) -> None:
        """After a resume from a checkpoint: the rounds already done."""
        self.manager.load_state_dict({"step": int(step), "batches_committed": int(step)})

    def quorum(self) -> tuple[bool, int]:
        """Join this round's quorum (blocks until the Lighthouse forms it). Returns (healed, participants):
        ``healed`` when this region was behind and has just received a live region's state."""
        before = self.step
        try:
            self.manager.start_quorum(timeout=self.quorum_timeout)
        except Exception as exc:  # noqa: BLE001 - torchft raises RuntimeError/TimeoutError from its RPCs
            why = "timed out" if "Timeout" in str(exc) or "timed out" in str(exc) else _short(exc)
            raise MembershipError(f"no quorum of at least {self.min_regions} region(s) within "
                                  f"{self.quorum_timeout.total_seconds():g}s (quorum service {self.lighthouse}): "
                                  f"{why}; fewer regions are alive than reliability.min_regions") from None  # fmt: skip
        err = self.manager.errored()
        if err is not None:
            raise ExchangeFailed(f"reconfiguring for the quorum failed: {_short(err.original_exception)}")
        return self.step != before, self.manager.num_participants()

    def report(self, exc: Exception) -> None:
        """A collective failed: the round is void for torchft, and this leader's group is torn down at once.
        Its peers may still be blocked in the same collective on a link that never touched the lost region
        (a ring's other half); closing our connections fails them now instead of at the round deadline, so
        every survivor asks for the next quorum together."""
        self.manager.report_error(exc)
        self.pg.abort()

    def commit(self) -> bool:
        """End the round for torchft (the step count advances); False when the round must not count."""
        return bool(self.manager.should_commit(timeout=self.deadline))

    # ---- collectives over the quorum's leaders ------------------------------------------------------
    def _wait(self, work) -> None:
        try:
            work.wait()
            return
        except Exception as exc:  # noqa: BLE001 - Gloo: connection closed, timed out
            why = _short(exc)
        # the failed work holds the Gloo context: dropped here, not kept alive by the traceback we raise
        del work
        raise ExchangeFailed(why)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every quorum member's ``data`` in quorum order (sizes may differ)."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        n = self.pg.size()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        self._wait(self.pg.allgather([sizes], [size], AllgatherOptions()))
        width = max(1, max(int(s) for s in sizes))
        mine = torch.zeros(width, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(width, dtype=torch.uint8) for _ in range(n)]
        self._wait(self.pg.allgather([outs], [mine], AllgatherOptions()))
        return [bytes(o[: int(s)].numpy()) for o, s in zip(outs, sizes)]

    def all_gather_object(self, obj: Any) -> list[Any]:
        blob = pickle.dumps(obj)
        self.control_bytes += len(blob)
        return [pickle.loads(b) for b in self.all_gather_bytes(blob)]

    def all_reduce_sum(self, flat: torch.Tensor) -> torch.Tensor:
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        self._wait(self.pg.allreduce([flat], opts))
        return flat

    def shutdown(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


def main(argv: list[str] | None = None) -> int:
    """``python -m geomesh.runtime.distributed.membership --min-regions N [--port P] [--deadline S]``: a Lighthouse for
    a cluster run (the same as torchft's ``torchft_lighthouse``), until interrupted."""
    p = argparse.ArgumentParser(prog="python -m geomesh.runtime.distributed.membership", description=main.__doc__)
    p.add_argument("--min-regions", type=int, required=True)
    p.add_argument("--port", type=int, default=29510)
    p.add_argument("--deadline", type=float, default=60.0, help="round deadline (s): the quorum's join timeout")
    args = p.parse_args(argv)
    if args.min_regions < 1:
        print(f"error: --min-regions {args.min_regions}: expected >= 1", file=sys.stderr)
        return 2
    server = start_lighthouse(args.min_regions, args.deadline, bind=f"[::]:{args.port}")
    print(f"quorum service (torchft Lighthouse) at {server.address()}; regions need "
          f"{LIGHTHOUSE_ENV}=http://<this host>:{args.port}", flush=True)  # fmt: skip
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
