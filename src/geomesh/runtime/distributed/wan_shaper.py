"""The WAN on one machine: :class:`WanShaper` stretches an exchange to what the scenario's WAN model says it costs
(latency + bytes / bandwidth of the ring collective, :class:`~geomesh.network.WanModel`), so heterogeneous-link
experiments run over loopback (``--wan shaper``; ``latency`` adds only the latency part, for links whose rate the
kernel already limits); the bytes a ring collective puts on the wire; and the kernel's wire counters."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ...network import WanModel

WanMode = Literal["none", "shaper", "latency"]


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

    def push_pull_s(self, i: int, j: int, nbytes: int) -> float:
        """A push of ``nbytes`` from region ``i`` to region ``j`` and the pull of as many back (the asynchronous
        baseline's exchange): two one-way transfers of latency + bytes / bandwidth (none inside one region)."""
        if self.mode == "none" or i == j:
            return 0.0
        one_way = self.wan.rtt_s[i][j] / 2
        if self.mode == "latency":
            return 2 * one_way
        return 2 * (one_way + nbytes / self.wan.bandwidth_Bps[i][j])

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


# ---- what a ring collective sends ----------------------------------------------------------------


def ring_allgather_bytes(slot_bytes: int, size: int) -> int:
    """What one rank sends in a ring all-gather of one ``slot_bytes`` slot per rank of a ``size``-rank group."""
    return max(size - 1, 0) * slot_bytes


def ring_allreduce_bytes(nbytes: int, size: int) -> int:
    """What one rank sends in a ring all-reduce of an ``nbytes`` buffer over a ``size``-rank group."""
    return 2 * (size - 1) * nbytes // size if size > 1 else 0


# ---- wire counters --------------------------------------------------------------------------------


def tx_bytes(iface: str | None) -> int | None:
    """Bytes this network namespace sent on ``iface`` so far (``None`` when not measurable)."""
    if not iface:
        return None
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None
