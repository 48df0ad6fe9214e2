"""The hosts test bed: a scenario's regions run as a team deploys them, one host per region, on one machine.

Each region is a *host*: its own Linux network namespace with its own address (``10.215.0.<i+2>``), its own
folder (standing for its disk: nothing is shared between hosts), and its own command, the one
docs/distributed.md gives for a cluster: ``torchrun --nnodes 1 --nproc-per-node K --rdzv-backend c10d
--rdzv-endpoint ADDR:29500 -m geomesh.run SCENARIO ...`` with ``GEOMESH_REGION``, ``TORCHFT_LIGHTHOUSE``,
``GEOMESH_ADVERTISE_HOST`` and the run key in its environment. The quorum service runs alone on a host of its
own (``10.215.0.1``, ``python -m geomesh.runtime.distributed.membership``). Hosts meet through a bridge in a
hub namespace; each host's egress to every other region's host is rate-limited to the scenario's link
bandwidth (``htb``, a class per destination) and delayed by half the link's RTT where the kernel has
``sch_netem`` (elsewhere the ranks' shaper adds the latency only: ``--wan latency``).

CPU quotas (``cpu``: region -> cores): each host runs in a control group of its own with that CPU-time quota
(:class:`~.quotas.CpuQuotas`) and 100 times a default group's weight (so it gets its quota on a machine busy
with other work); its command is started inside the group, so every process of the host, a restarted host's
too, is held to it, and the regions' speeds differ as their GPUs' would. Quotas that come later
(``cpu_later``: :class:`CpuChange`, as a container's limit set on running processes, a neighbour's load, or a
burst that ends would): the host is started in its group without a limit (or at its ``cpu`` quota) and each
change is set on the running processes that many seconds after the host's first start, or after its run
folder appeared (the run's start: its imports done, its model, data and calibration about to begin);
:meth:`HostsBed.start_cpu_schedule` runs them, ``cpu_log`` says when each was set.

Host-level faults: a host lost (every process of it killed, SIGKILL to its process group), started again with
its folder kept or deleted; a link partitioned for a while (the host's port on the bridge down: every packet
to and from it dropped); a host's link bandwidth changed mid-run. :mod:`geomesh.cli.hosts` is the face
(``geomesh hosts``). The network is a :class:`~geomesh.testbed.netns.Bridge`. Needs root and iproute2
(:func:`~geomesh.testbed.netns.netns_unavailable_reason` says why not).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..network import WanModel
from ..runtime.distributed.service import ADVERTISE_ENV, LIGHTHOUSE_ENV
from .netns import Bridge, NetnsError, ip, namespace_pids, rate_bit, set_up
from .quotas import CpuQuotas, QuotaError

QUORUM_PORT = 29510
RDZV_PORT = 29500
ANCHORS = ("start", "run")  # a CpuChange's clock: the host's first start, or its run folder's appearance


@dataclass
class CpuChange:
    """Region ``region``'s quota set to ``cores`` (None: no limit) ``at_s`` seconds after its ``anchor``:
    ``start`` (its host's command first started) or ``run`` (its run folder ``<folder>/run`` appeared)."""

    region: int
    cores: float | None
    at_s: float
    anchor: str = "start"
    done: bool = False


def host_address(slot: int) -> str:
    """Slot 0 is the quorum service's host; region i is slot i + 1."""
    return f"10.215.0.{slot + 1}"


@dataclass
class Host:
    """One region's host: its namespace, address, folder and the command that starts it."""

    region: int
    name: str
    ns: str
    address: str
    folder: Path
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    log: Path | None = None
    starts: int = 0
    cgroup: Path | None = None  # the cgroup.procs file of its CPU quota's group: the command starts in it
    clock_s: int = 0  # its clocks' offset from the machine's (a time namespace of its own)
    twin: bool = False  # a second host started as a live region (a misdeployment)
    started_at: float | None = None  # time.monotonic() of its first start

    def command(self) -> list[str]:
        """What starts the host: its argv inside its namespace (in a time namespace whose monotonic and boot
        clocks run ``clock_s`` apart from the machine's, and inside its CPU quota's group, entered by a shell
        that then becomes the command, so every process of the host is born in the group)."""
        argv = ["ip", "netns", "exec", self.ns, *self.argv]
        if self.clock_s:
            argv = ["unshare", "--time", "--monotonic", str(self.clock_s), "--boottime", str(self.clock_s), *argv]
        if self.cgroup is None:
            return argv
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup), *argv]

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        if self.started_at is None:
            self.started_at = time.monotonic()
        n = self.starts
        while (self.folder / f"host-{n}.log").exists():  # (a resumed bed keeps the logs of the first start)
            n += 1
        self.log = self.folder / f"host-{n}.log"
        with open(self.log, "w") as out:  # (the child keeps its own descriptor)
            self.proc = subprocess.Popen(self.command(), env=self.env, cwd=self.folder, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def kill(self) -> None:
        """Every process of the host: everything in its network namespace (torchrun starts each rank in a
        session of its own, so killing torchrun's process group would leave its ranks running)."""
        for _ in range(50):
            pids = namespace_pids(self.ns)
            if self.proc is not None and self.proc.poll() is None:
                pids.add(self.proc.pid)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        if self.proc is not None:
            self.proc.wait()


@dataclass
class HostsBed:
    """Namespaces, links and hosts for one run (a context manager; ``close`` removes everything)."""

    CPU_WEIGHT = 100  # a host with a CPU quota weighs as 100 busy processes: it gets its quota on a busy machine

    wan: WanModel
    names: list[str]
    root: Path
    lan_gbps: float = 10.0
    cpu: dict[int, float] = field(default_factory=dict)  # region -> its CPU quota in cores (none: unlimited)
    clock: dict[int, int] = field(default_factory=dict)  # region -> its host's clocks' offset in seconds
    twins: list[int] = field(default_factory=list)  # regions a second host is started as (a misdeployment)
    cpu_later: list[CpuChange] = field(default_factory=list)  # quotas set on running hosts (start_cpu_schedule)
    link_burst: int | None = None  # the links' token bucket in bytes (None: htb's 15k; Bridge.burst_bytes)
    bridge: Bridge = field(default_factory=Bridge)
    hosts: list[Host] = field(default_factory=list)
    quorum: subprocess.Popen | None = None
    quotas: CpuQuotas | None = None
    _timers: list[threading.Timer] = field(default_factory=list)
    cpu_log: list[dict] = field(default_factory=list)  # the quotas set later, as they were set
    _stop: threading.Event = field(default_factory=threading.Event)
    _schedule: threading.Thread | None = None

    @property
    def tag(self) -> str:
        return self.bridge.tag

    def ns(self, slot: int) -> str:
        return f"gm{self.tag}h{slot}"

    def port(self, slot: int) -> str:
        return f"gm{self.tag}p{slot}"  # the host's end on the bridge (in the hub)

    @property
    def lighthouse(self) -> str:
        return f"http://{host_address(0)}:{QUORUM_PORT}"

    def __enter__(self) -> HostsBed:
        return set_up(self)

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the network --------------------------------------------------------------------------------
    def setup(self) -> None:
        self.bridge.lan_gbps = self.lan_gbps
        self.bridge.burst_bytes = self.link_burst
        slots = len(self.names) + 1 + len(self.twins)
        self.bridge.open(slots)
        if self.clock and (reason := time_namespace_unavailable_reason()):
            raise NetnsError(f"a host's clock cannot be set apart here: {reason}")
        for slot in range(slots):
            self.bridge.join(self.ns(slot), self.port(slot), host_address(slot))
        self.bridge.probe_netem(self.ns(1))
        for a in range(len(self.names)):  # (the quorum host and twins: the default class, LAN speed)
            self.bridge.shape(self.ns(a + 1), [(b, host_address(b + 1), rate_bit(self.wan, a, b), self.wan.rtt_s[a][b])
                                               for b in range(len(self.names)) if b != a])  # fmt: skip
        if self.cpu or self.cpu_later:  # (QuotaError where control groups cannot be made)
            self.quotas = CpuQuotas(self.tag, weight=self.CPU_WEIGHT)
            for i in sorted(self.quota_regions):  # (a region with later quotas only: no limit until the first)
                self.quotas.set(self.names[i], self.cpu.get(i))

    @property
    def quota_regions(self) -> set[int]:
        """The regions whose hosts run in a CPU group of their own (a quota now or later)."""
        return set(self.cpu) | {c.region for c in self.cpu_later}

    @property
    def delay_in_kernel(self) -> bool:
        return self.bridge.delay_in_kernel

    def tx_bytes(self, region: int) -> int | None:
        """The bytes region ``region``'s host has sent on its interface so far (every peer and the quorum
        service), as the kernel counts them; None once its namespace is gone."""
        done = ip("-n", self.ns(region + 1), "-j", "-s", "link", "show", "eth0", check=False)
        try:
            return int(json.loads(done.stdout)[0]["stats64"]["tx"]["bytes"])
        except (ValueError, LookupError, TypeError):
            return None

    def set_bandwidth(self, region: int, factor: float) -> None:
        """Region ``region``'s links to every other region at ``factor`` × the scenario's bandwidth (egress of
        both ends)."""
        for a in range(len(self.names)):
            for b in range(len(self.names)):
                if a != b and region in (a, b):
                    self.bridge.set_rate(self.ns(a + 1), b, rate_bit(self.wan, a, b, factor))

    def partition(self, region: int, up: bool) -> None:
        """Cut region ``region``'s host off (its port on the bridge down: every packet to or from it is dropped),
        or join it again."""
        ip("-n", self.bridge.hub, "link", "set", self.port(region + 1), "up" if up else "down")

    def partition_for(self, region: int, seconds: float) -> None:
        self.partition(region, up=False)
        timer = threading.Timer(seconds, self.partition, args=(region,), kwargs={"up": True})
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    # ---- the processes ------------------------------------------------------------------------------
    def start_quorum(self, min_regions: int, deadline_s: float) -> None:
        argv = [sys.executable, "-m", "geomesh.runtime.distributed.membership", "--min-regions", str(min_regions),
                "--host", host_address(0), "--port", str(QUORUM_PORT), "--deadline", f"{deadline_s:g}"]  # fmt: skip
        folder = self.root / "quorum"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "quorum.log", "w") as out:
            self.quorum = subprocess.Popen(["ip", "netns", "exec", self.ns(0), *argv], stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True, env=dict(os.environ))  # fmt: skip

    def add_host(self, region: int, ranks: int, run_argv: list[str], env: dict[str, str],
                 module: str = "geomesh.run", twin: bool = False) -> Host:  # fmt: skip
        """Region ``region``'s host, started by the cluster recipe's command (``run_argv``: what follows
        ``-m geomesh.run``, or ``-m module``, a peer system's runner; its ``--out`` is the host's own folder).
        ``twin``: a second host started as that region (a misdeployment), on a host, address and folder
        (``<region>-twin``) of its own; its links are not shaped."""
        slot = len(self.names) + 1 + self.twins.index(region) if twin else region + 1
        address = host_address(slot)
        name = f"{self.names[region]}-twin" if twin else self.names[region]
        folder = self.root / name
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{address}:{RDZV_PORT}", "--rdzv-conf", "is_host=true",
                    "--local-addr", address,
                    "-m", module, *run_argv, "--out", str(folder / "run")]  # fmt: skip
        host_env = dict(env, **{"GEOMESH_REGION": self.names[region], LIGHTHOUSE_ENV: self.lighthouse,
                                ADVERTISE_ENV: address, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})  # fmt: skip
        host = Host(region, name, self.ns(slot), address, folder, torchrun, host_env,
                    cgroup=self.quotas.procs_file(self.names[region]) if region in self.quota_regions and self.quotas
                    and not twin else None, clock_s=self.clock.get(region, 0), twin=twin)  # fmt: skip
        self.hosts.append(host)
        return host

    def lose(self, region: int, wipe: bool = False, restart: bool = True) -> None:
        """The host lost: every process killed; its folder deleted with ``wipe``; started again with
        ``restart`` (the same command and environment)."""
        host = self.hosts[region]
        host.kill()
        if wipe:
            shutil.rmtree(host.folder, ignore_errors=True)
        if restart:
            host.start()

    def start_cpu_schedule(self, poll_s: float = 0.05) -> None:
        """Set each of ``cpu_later`` on its running host when it is due (a thread, until every one is set or the
        bed closes); each one set is appended to ``cpu_log``: region, cores, anchor, the seconds after the host's
        start it was set at (``time_s``) and those after its anchor (``after_anchor_s``)."""
        if not self.cpu_later or self._schedule is not None:
            return
        self._schedule = threading.Thread(target=self._run_cpu_schedule, args=(poll_s,), daemon=True)
        self._schedule.start()

    def _run_cpu_schedule(self, poll_s: float) -> None:
        hosts = {h.region: h for h in self.hosts if not h.twin}
        run_seen: dict[int, float] = {}  # region -> when its run folder was first seen
        pending = sorted(self.cpu_later, key=lambda c: (c.anchor != "start", c.at_s))
        while pending and not self._stop.is_set():
            now = time.monotonic()
            for change in list(pending):
                host = hosts.get(change.region)
                if host is None or host.started_at is None:
                    continue
                if change.anchor == "run":
                    if change.region not in run_seen and (host.folder / "run").is_dir():
                        run_seen[change.region] = now
                    anchor = run_seen.get(change.region)
                else:
                    anchor = host.started_at
                if anchor is None or now < anchor + change.at_s:
                    continue
                if self.quotas is None or self._stop.is_set():
                    return
                entry = {"region": self.names[change.region], "cores": change.cores, "anchor": change.anchor,
                         "at_s": change.at_s, "time_s": round(now - host.started_at, 3),
                         "after_anchor_s": round(now - anchor, 3)}  # fmt: skip
                try:
                    self.quotas.set(self.names[change.region], change.cores)
                except QuotaError as exc:  # (said in the bed's result, not a thread's traceback)
                    entry["error"] = str(exc)
                change.done = True
                pending.remove(change)
                self.cpu_log.append(entry)
            self._stop.wait(poll_s)

    def close(self) -> None:
        self._stop.set()
        if self._schedule is not None:
            self._schedule.join(timeout=5)
        for t in self._timers:
            t.cancel()
        for h in self.hosts:
            h.kill()
        if self.quorum is not None and self.quorum.poll() is None:
            os.killpg(self.quorum.pid, signal.SIGKILL)
            self.quorum.wait()
        if self.quotas is not None:
            self.quotas.close()
            self.quotas = None
        self.bridge.close()


def time_namespace_unavailable_reason() -> str | None:
    """Why a host's clocks cannot be set apart here (``unshare --time``: Linux 5.6, util-linux 2.36), or None."""
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux)"
    done = subprocess.run(["unshare", "--time", "--monotonic", "1", "true"], capture_output=True, text=True)
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["unshare --time failed"])[-1]
    return None


def wait_all(hosts: list[Host], timeout_s: float, tick=None) -> bool:
    """Wait until every host's command has exited (``tick()`` called meanwhile); False on the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        if all(h.proc is not None and h.proc.poll() is not None for h in hosts):
            return True
        time.sleep(0.2)
    return False
