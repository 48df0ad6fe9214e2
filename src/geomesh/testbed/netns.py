"""Real links on one machine: Linux network namespaces joined by one bridge, each one's egress shaped per
destination from a WAN model.

:class:`Bridge` is the one mechanism: a hub namespace holds a bridge (``br0``); every namespace joins it by a veth
pair at an address of its own; a namespace's egress to each shaped destination is an ``htb`` class at the link's
bandwidth (a token bucket: ``Bridge.burst_bytes``), delayed by half its RTT where the kernel has ``sch_netem``
(elsewhere ``delay_in_kernel`` is False and the ranks' shaper adds the latency: ``--wan latency``), and
everything else (its own region, a service) goes at LAN speed. Two users: :class:`NetnsWan` (``geomesh launch
--wan netns``: a namespace per local rank) and the hosts test bed (:class:`~geomesh.testbed.hosts.HostsBed`: a
namespace per region's host). Needs root and iproute2 (:func:`netns_unavailable_reason` says why not); ``close``
deletes every namespace it made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

from ..network import WanModel

MAX_NAMESPACES = 250  # one /24 of addresses


class NetnsError(RuntimeError):
    """Network namespaces (or a qdisc) cannot be set up here; the message says why."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"`tc {' '.join(args)}` in {ns} failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def netns_unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (``None``: they can)."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"gmprobe{os.getpid() % 100000}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        veth = ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0", check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair: {veth.stderr.strip()}"
        htb = tc(probe, "qdisc", "add", "dev", "a0", "root", "handle", "1:", "htb", check=False)
        if htb.returncode != 0:
            return f"the kernel has no htb qdisc: {htb.stderr.strip()}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


def namespace_pids(ns: str) -> set[int]:
    """The processes in network namespace ``ns`` (``ip netns pids``); none once it is gone."""
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return {int(p) for p in done.stdout.split() if p.isdigit()} if done.returncode == 0 else set()


def set_up(network):
    """``network.setup()``, everything it made removed (``network.close()``) if that fails: a context's entry."""
    try:
        network.setup()
    except BaseException:
        network.close()
        raise
    return network


def rate_bit(wan: WanModel, a: int, b: int, factor: float = 1.0) -> int:
    """Region ``a``'s link to region ``b`` in bit/s (× ``factor``), at least what ``htb`` accepts."""
    return max(int(wan.bandwidth_Bps[a][b] * 8 * factor), 8000)


@dataclass
class Bridge:
    """Namespaces on one bridge, each at an address on interface ``dev``, their egress shaped per destination."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    dev: str = "eth0"
    lan_gbps: float = 10.0
    namespaces: list[str] = field(default_factory=list)
    delay_in_kernel: bool = False
    # a shaped link's token bucket in bytes: None, htb's 15k burst (its ceil bucket smaller still: a link held at
    # its rate from the first packets); a size, a bucket of that many bytes let through at line rate before the
    # rate holds (burst and cburst), as a cloud's shaper lets a burst through
    burst_bytes: int | None = None

    @property
    def hub(self) -> str:
        return f"gm{self.tag}hub"

    def open(self, count: int) -> None:
        """The hub and its bridge, for ``count`` namespaces to come."""
        if count > MAX_NAMESPACES:
            raise NetnsError(f"{count} namespaces: at most {MAX_NAMESPACES} on one machine")
        self._add(self.hub)
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")

    def _add(self, ns: str) -> None:
        ip("netns", "add", ns)
        self.namespaces.append(ns)

    def join(self, ns: str, port: str, address: str) -> None:
        """Namespace ``ns`` made and joined to the bridge: a veth pair (``dev`` in ``ns`` at ``address``/24,
        ``port`` on the bridge), both ends up, and ``ns``'s loopback up."""
        self._add(ns)
        ip("-n", ns, "link", "add", self.dev, "type", "veth", "peer", "name", port, "netns", self.hub)
        ip("-n", self.hub, "link", "set", port, "master", "br0")
        ip("-n", self.hub, "link", "set", port, "up")
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", self.dev)
        ip("-n", ns, "link", "set", self.dev, "up")
        ip("-n", ns, "link", "set", "lo", "up")

    def probe_netem(self, ns: str) -> None:
        """Whether this kernel has ``sch_netem`` (delay), probed on ``ns``'s device: else the delay is left out."""
        ok = tc(ns, "qdisc", "add", "dev", self.dev, "root", "handle", "9:", "netem", "delay", "1ms", check=False)
        if ok.returncode == 0:
            tc(ns, "qdisc", "del", "dev", self.dev, "root", check=False)
        self.delay_in_kernel = ok.returncode == 0

    def shape(self, ns: str, links: list[tuple[int, str, int, float]]) -> None:
        """``ns``'s egress: each ``(index, address, bit/s, rtt_s)`` a class of its own (``1:<index+10>``) at that
        rate and half that RTT; everything else at LAN speed with no delay."""
        tc(ns, "qdisc", "add", "dev", self.dev, "root", "handle", "1:", "htb", "default", "1")
        tc(ns, "class", "add", "dev", self.dev, "parent", "1:", "classid", "1:1", "htb", "rate", f"{self.lan_gbps}gbit")
        for index, address, bits, rtt_s in links:
            cls = self._class(index)
            tc(ns, "class", "add", "dev", self.dev, "parent", "1:", "classid", cls, "htb", "rate", f"{bits}bit",
               *self._bucket())  # fmt: skip
            if self.delay_in_kernel:
                tc(ns, "qdisc", "add", "dev", self.dev, "parent", cls, "netem", "delay", f"{rtt_s / 2 * 1000:.3f}ms",
                   "limit", "100000")  # fmt: skip
            tc(ns, "filter", "add", "dev", self.dev, "protocol", "ip", "parent", "1:", "prio", "1", "u32", "match",
               "ip", "dst", f"{address}/32", "flowid", cls)  # fmt: skip

    def set_rate(self, ns: str, index: int, bits: int) -> None:
        """``ns``'s class for destination ``index`` (:meth:`shape`) at ``bits`` bit/s from now on."""
        tc(ns, "class", "change", "dev", self.dev, "parent", "1:", "classid", self._class(index), "htb", "rate",
           f"{bits}bit", *self._bucket())  # fmt: skip

    def _bucket(self) -> list[str]:
        if self.burst_bytes is None:
            return ["burst", "15k"]
        return ["burst", f"{self.burst_bytes}b", "cburst", f"{self.burst_bytes}b"]

    @staticmethod
    def _class(index: int) -> str:
        return f"1:{index + 10:x}"

    def close(self) -> None:
        for ns in reversed(self.namespaces):
            ip("netns", "del", ns, check=False)
        self.namespaces.clear()


@dataclass
class NetnsWan:
    """One namespace per local rank (``wan0`` at 10.213.0.<rank+1>) on a :class:`Bridge`: rank i's egress to
    rank j at the bandwidth of their regions' link and half its RTT; ranks of one region talk at LAN speed.
    Use as a context manager; ``close`` deletes everything."""

    wan: WanModel
    region_of_rank: list[int]
    lan_gbps: float = 10.0
    bridge: Bridge = field(default_factory=lambda: Bridge(dev="wan0"))

    @property
    def iface(self) -> str:
        return self.bridge.dev

    @property
    def delay_in_kernel(self) -> bool:
        return self.bridge.delay_in_kernel

    def ns(self, rank: int) -> str:
        return f"gm{self.bridge.tag}r{rank}"

    @staticmethod
    def address(rank: int) -> str:
        return f"10.213.0.{rank + 1}"

    def __enter__(self) -> NetnsWan:
        return set_up(self)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def setup(self) -> None:
        ranks = range(len(self.region_of_rank))
        self.bridge.lan_gbps = self.lan_gbps
        self.bridge.open(len(ranks))
        for r in ranks:
            self.bridge.join(self.ns(r), f"p{r}", self.address(r))
        self.bridge.probe_netem(self.ns(0))
        for r in ranks:
            a = self.region_of_rank[r]
            self.bridge.shape(self.ns(r), [(s, self.address(s), rate_bit(self.wan, a, b), self.wan.rtt_s[a][b])
                                           for s, b in enumerate(self.region_of_rank) if b != a])  # fmt: skip

    def command(self, rank: int, argv: list[str]) -> list[str]:
        """``argv`` run inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.ns(rank), *argv]

    def close(self) -> None:
        self.bridge.close()
