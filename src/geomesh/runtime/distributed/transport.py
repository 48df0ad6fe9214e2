"""How bytes move in the distributed runtime: the collectives with byte accounting, the WAN shaper, wire
counters, and Linux network namespaces that put a real (rate-limited, delayed) link between local ranks.

- :class:`Transport` wraps ``torch.distributed`` for the few collectives a round needs (the leaders'
  straggler barrier, the all-gather of equal-size payloads, the all-reduce of a flat fp32 buffer, the
  broadcast inside a region, small control objects) and counts the bytes handed to each.
- :class:`WanShaper` stretches an exchange to what the scenario's WAN model says it costs (latency +
  bytes / bandwidth of the ring collective, :class:`~geomesh.network.WanModel`), so heterogeneous-link
  experiments run on one machine over loopback (``--wan shaper``). ``latency`` mode adds only the latency
  part, for links whose rate is already limited by the kernel.
- :class:`NetnsWan` gives each local rank its own network namespace, joined through a bridge in a hub
  namespace, with per-destination ``htb`` rate limits and (where the kernel has ``sch_netem``) ``netem``
  delays from the WAN model (``--wan netns``). Every address lives inside namespaces it creates
  (``10.213.0.0/24``), and everything is deleted afterwards.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from ...network import WanModel

WanMode = Literal["none", "shaper", "latency"]
ABSENT = b"\0\0\0\0"  # a payload slot of a worker whose update was dropped (real payloads start with b"GMSH")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the rendezvous port of a local launch)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---- the WAN shaper ------------------------------------------------------------------------------


@dataclass
class WanShaper:
    """Holds an exchange until the WAN model's time for it has passed (``mode="none"``: never holds)."""

    wan: WanModel
    mode: WanMode = "shaper"

    def allgather_s(self, payload_bytes: int) -> float:
        if self.mode == "none":
            return 0.0
        if self.mode == "latency":
            return self._latency_only(self.wan.n - 1)
        return self.wan.allgather_s(payload_bytes)

    def allreduce_s(self, nbytes: int) -> float:
        if self.mode == "none":
            return 0.0
        if self.mode == "latency":
            return self._latency_only(2 * (self.wan.n - 1))
        return self.wan.allreduce_s(nbytes)

    def _latency_only(self, ring_steps: int) -> float:
        return max(0, ring_steps) * self.wan.ring_step_s(0.0)

    def hold(self, seconds: float, since: float) -> float:
        """Hold an exchange that started at ``since`` (a ``perf_counter`` time); returns the sleep.

        ``shaper``: the transfer on this machine is part of the emulated transfer, so the exchange takes
        max(measured, modeled), never measured + modeled. ``latency``: the bytes really crossed a
        rate-limited link, so the latency is added to it."""
        if self.mode == "latency":
            time.sleep(seconds)
            return seconds
        left = since + seconds - time.perf_counter()
        if left > 0:
            time.sleep(left)
            return left
        return 0.0


# ---- collectives with byte accounting -----------------------------------------------------------


@dataclass
class Transport:
    """The collectives of one rank, with the bytes handed to each counted by purpose.

    ``wan_bytes``: payload bytes this rank handed to the cross-region collectives (all-gather, all-reduce);
    ``intra_bytes``: bytes broadcast inside a region; ``control_bytes``: plans, checksums, telemetry.
    """

    device: torch.device
    backend: str
    timeout_s: float
    wan_bytes: int = 0
    intra_bytes: int = 0
    control_bytes: int = 0
    op: str = "startup"  # the collective in progress, for error messages

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    def barrier(self, group: Any = None, what: str = "barrier") -> None:
        """Wait for every rank of ``group``; Gloo names the ranks that did not arrive within the timeout."""
        self.op = what
        if self.backend == "gloo":
            dist.monitored_barrier(group=group, timeout=self.timeout, wait_all_ranks=True)
        else:
            dist.barrier(group=group, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def all_gather_bytes(self, payload: bytes | None, nbytes: int, group: Any, size: int) -> torch.Tensor:
        """All-gather one ``nbytes`` payload per rank of ``group`` (``None``: an absent slot of zeros).

        Returns the gathered uint8 tensor [size * nbytes] in group-rank order (on CPU)."""
        self.op = "all_gather of the payloads"
        mine = torch.zeros(nbytes, dtype=torch.uint8)
        if payload is not None:
            if len(payload) != nbytes:
                raise ValueError(f"payload of {len(payload)} bytes, expected {nbytes} (all payloads are one size)")
            mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        mine = mine.to(self.device)
        out = torch.empty(size * nbytes, dtype=torch.uint8, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, mine, group=group)
        self.wan_bytes += nbytes
        return out.cpu()

    def all_reduce_sum(self, flat: torch.Tensor, group: Any) -> torch.Tensor:
        """Sum a flat float32 buffer over ``group`` (in place); returns it."""
        self.op = "all_reduce of the pseudo-gradients"
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        self.wan_bytes += flat.numel() * flat.element_size()
        return flat

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any) -> torch.Tensor:
        """Broadcast ``tensor`` (in place) from global rank ``src`` to the ranks of ``group`` (a region)."""
        self.op = "broadcast inside the region"
        moved = tensor.to(self.device)
        dist.broadcast(moved, src=src, group=group)
        self.intra_bytes += moved.numel() * moved.element_size()
        return moved.cpu() if moved is not tensor else tensor

    def all_gather_object(self, obj: Any, what: str = "control message") -> list[Any]:
        """Every rank's ``obj`` (small, picklable), in rank order."""
        self.op = what
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        self.control_bytes += len(pickle.dumps(obj))
        return out

    def broadcast_object(self, obj: Any, src: int = 0, what: str = "control message") -> Any:
        self.op = what
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        self.control_bytes += len(pickle.dumps(box[0]))
        return box[0]


def split_gathered(gathered: torch.Tensor, nbytes: int) -> list[bytes | None]:
    """The payloads of an all-gather in rank order; an all-zero slot (a dropped update) is ``None``."""
    raw = gathered.numpy().tobytes()
    out: list[bytes | None] = []
    for k in range(len(raw) // nbytes):
        piece = raw[k * nbytes : (k + 1) * nbytes]
        out.append(None if piece[:4] == ABSENT else piece)
    return out


# ---- wire counters --------------------------------------------------------------------------------


def tx_bytes(iface: str | None) -> int | None:
    """Bytes this network namespace sent on ``iface`` so far (``None`` when not measurable)."""
    if not iface:
        return None
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


# ---- network namespaces ---------------------------------------------------------------------------


class NetnsError(RuntimeError):
    """Network namespaces (or a qdisc) cannot be set up here; the message says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"`tc {' '.join(args)}` in {ns} failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def netns_unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (``None``: they can)."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"gmprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        veth = _ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0", check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair: {veth.stderr.strip()}"
        htb = _tc(probe, "qdisc", "add", "dev", "a0", "root", "handle", "1:", "htb", check=False)
        if htb.returncode != 0:
            return f"the kernel has no htb qdisc: {htb.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def netem_available(ns: str, dev: str) -> bool:
    """Whether this kernel has ``sch_netem`` (delay); probed on a device of our own namespace."""
    ok = _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "9:", "netem", "delay", "1ms", check=False)
    if ok.returncode == 0:
        _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
        return True
    return False


@dataclass
class NetnsWan:
    """One namespace per rank (``wan0`` at 10.213.0.<rank+1>), all joined by a bridge in a hub namespace.

    Rank i's egress to rank j is limited to the bandwidth of the link between their regions (``htb``
    class per destination) and delayed by half its RTT (``netem``, when the kernel has it; otherwise
    ``delay_in_kernel`` is False and the launcher asks the ranks' shaper for the latency part). Ranks of
    one region talk at ``lan_gbps`` with no delay. Use as a context manager; ``close`` deletes everything.
    """

    wan: WanModel
    region_of_rank: list[int]
    lan_gbps: float = 10.0
    iface: str = "wan0"
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    namespaces: list[str] = field(default_factory=list)
    delay_in_kernel: bool = False

    @property
    def hub(self) -> str:
        return f"gm{self.tag}hub"

    def ns(self, rank: int) -> str:
        return f"gm{self.tag}r{rank}"

    @staticmethod
    def address(rank: int) -> str:
        return f"10.213.0.{rank + 1}"

    def __enter__(self) -> NetnsWan:
        try:
            self.setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def setup(self) -> None:
        n = len(self.region_of_rank)
        if n > 250:
            raise NetnsError(f"{n} ranks: at most 250 namespaces on one machine")
        _ip("netns", "add", self.hub)
        self.namespaces.append(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for r in range(n):
            ns = self.ns(r)
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            _ip("-n", ns, "link", "add", self.iface, "type", "veth", "peer", "name", f"p{r}", "netns", self.hub)
            _ip("-n", self.hub, "link", "set", f"p{r}", "master", "br0")
            _ip("-n", self.hub, "link", "set", f"p{r}", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", self.iface)
            _ip("-n", ns, "link", "set", self.iface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        self.delay_in_kernel = netem_available(self.ns(0), self.iface)
        for r in range(n):
            self._shape(r)

    def _shape(self, r: int) -> None:
        ns, dev = self.ns(r), self.iface
        _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
        _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", f"{self.lan_gbps}gbit")
        a = self.region_of_rank[r]
        for s in range(len(self.region_of_rank)):
            b = self.region_of_rank[s]
            if s == r or a == b:
                continue  # same region: the default class (LAN speed, no delay)
            cls = f"1:{s + 10:x}"
            rate_bit = max(int(self.wan.bandwidth_Bps[a][b] * 8), 8000)
            _tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate", f"{rate_bit}bit",
                "burst", "15k")  # fmt: skip
            if self.delay_in_kernel:
                delay_ms = self.wan.rtt_s[a][b] / 2 * 1000
                _tc(ns, "qdisc", "add", "dev", dev, "parent", cls, "netem", "delay", f"{delay_ms:.3f}ms",
                    "limit", "100000")  # fmt: skip
            _tc(ns, "filter", "add", "dev", dev, "protocol", "ip", "parent", "1:", "prio", "1", "u32", "match",
                "ip", "dst", f"{self.address(s)}/32", "flowid", cls)  # fmt: skip

    def command(self, rank: int, argv: list[str]) -> list[str]:
        """``argv`` run inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.ns(rank), *argv]

    def close(self) -> None:
        for ns in reversed(self.namespaces):
            _ip("netns", "del", ns, check=False)
        self.namespaces.clear()
