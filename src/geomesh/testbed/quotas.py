"""CPU-time quotas, one control group per region: a region's processes run at a set share of the machine's cores
whatever the other regions do, as a region's GPUs run at their own speed.

The kernel's CFS bandwidth control (cgroup v1's ``cpu`` controller: ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``; cgroup v2: ``cpu.max``). Two processes that share a core by affinity are coupled: when
one ends its round early the other has the core to itself, so each one's speed depends on the other's work,
which no per-region speed describes; under quotas each region's speed is its own. A process started in a
group stays in it, and so do its children: the hosts test bed starts each host's command inside its group
(:meth:`CpuQuotas.procs_file`), so every process of the host is throttled, restarted hosts too;
``bench/distributed.py --throttle`` moves running processes in (:meth:`CpuQuotas.set`), and a quota may change
while they run (the bed's quotas applied after a host starts: its group made without a limit, the limit set
later, as a container's limit or a neighbour's load would come). A quota is a ceiling,
not a reservation: on a busy machine a region may get less. With ``weight`` (the bed's) each group also weighs
that many times a default group (``cpu.shares`` / ``cpu.weight``), so on a machine busy with other work it still
gets its quota (keep the quotas' sum below the machine's cores: the rest is left to that work). Needs the right
to make cgroups (root).
"""

from __future__ import annotations

import os
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")


class QuotaError(RuntimeError):
    """CPU quotas cannot be set here; the message says why."""


class CpuQuotas:
    """A CPU-time quota per region, each in a group of its own (``geomesh-<tag>-<region>``); ``close`` moves
    what is left in them back to the root group and removes them."""

    PERIOD_US = 10_000  # a short period: a round is many periods, so the throttling's granularity averages out
    MIN_SHARE = 0.1  # the kernel's smallest quota is 1 ms per period

    def __init__(self, tag: str, weight: int = 1) -> None:
        if (V1_ROOT / "cpu.cfs_quota_us").exists():
            self.root, self.v2 = V1_ROOT, False
        elif "cpu" in _controllers(V2_ROOT):
            self.root, self.v2 = V2_ROOT, True
        else:
            raise QuotaError("no cgroup cpu controller here (cgroup v1 cpu.cfs_quota_us or cgroup v2 cpu.max)")
        self.tag, self.groups, self.weight = tag[:12], {}, max(1, int(weight))

    def set(self, region: str, share: float | None, pids: list[int] = ()) -> None:
        """Region ``region`` at ``share`` of one core (``share`` > 1: several cores; None: no limit, the group's
        weight only), its group made at the first call; its processes ``pids`` (each with every thread) moved
        into it."""
        group = self.groups.get(region)
        if group is None:
            group = self.root / f"geomesh-{self.tag}-{region}"
            try:
                if self.v2 and "cpu" not in (self.root / "cgroup.subtree_control").read_text().split():
                    (self.root / "cgroup.subtree_control").write_text("+cpu\n")
                group.mkdir()
            except OSError as exc:
                raise QuotaError(f"cannot make the control group {group}: {exc.strerror or exc} (root is needed)"
                                 ) from None  # fmt: skip
            self.groups[region] = group
        quota = -1 if share is None else max(int(self.MIN_SHARE * self.PERIOD_US), int(share * self.PERIOD_US))
        try:
            if self.v2:
                (group / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {self.PERIOD_US}\n")
                if self.weight > 1:
                    (group / "cpu.weight").write_text(f"{min(10_000, 100 * self.weight)}\n")
            else:
                (group / "cpu.cfs_period_us").write_text(f"{self.PERIOD_US}\n")
                (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")
                if self.weight > 1:
                    (group / "cpu.shares").write_text(f"{min(262_144, 1024 * self.weight)}\n")
        except OSError as exc:
            raise QuotaError(f"cannot set the CPU quota of {group}: {exc.strerror or exc}") from None
        for pid in pids:
            try:
                (group / "cgroup.procs").write_text(f"{pid}\n")  # the process and every thread of it
            except OSError:  # (a process that has just ended)
                pass

    def procs_file(self, region: str) -> Path:
        """The file a process writes its pid into to enter ``region``'s group (its children are born in it)."""
        return self.groups[region] / "cgroup.procs"

    def quota(self, region: str) -> float:
        """``region``'s quota as the kernel holds it, in cores (``inf``: no limit)."""
        group = self.groups[region]
        if self.v2:
            quota, period = (group / "cpu.max").read_text().split()[:2]
        else:
            quota, period = (group / "cpu.cfs_quota_us").read_text(), (group / "cpu.cfs_period_us").read_text()
        return float("inf") if quota.strip() in ("max", "-1") else int(quota) / int(period)

    def close(self) -> None:
        for group in self.groups.values():
            try:
                pids = (group / "cgroup.procs").read_text().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    (self.root / "cgroup.procs").write_text(f"{pid}\n")
                except OSError:
                    pass
            try:
                group.rmdir()
            except OSError:
                pass


def _controllers(root: Path) -> list[str]:
    try:
        return (root / "cgroup.controllers").read_text().split()
    except OSError:
        return []


def quota_unavailable_reason() -> str | None:
    """Why CPU quotas cannot be set here (``None``: they can): a probe group is made and removed."""
    if os.name != "posix":
        return "CPU quotas need Linux control groups"
    try:
        probe = CpuQuotas(f"probe{os.getpid()}")
        try:
            probe.set("probe", 0.5)
        finally:
            probe.close()
    except QuotaError as exc:
        return str(exc)
    return None
