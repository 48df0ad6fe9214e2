"""The wide-area network model: latency matrix, link bandwidths, and the time of a collective.

Time of a ring collective over the workers in ring order 0 → 1 → … → N−1 → 0: every ring step moves one
chunk across every link at once, so a step costs the slowest link's one-way latency (RTT/2) plus
chunk / bandwidth on that link.

- ring all-reduce of M bytes: 2(N−1) steps of M/N bytes each (reduce-scatter + all-gather);
- all-gather of one p-byte payload per worker: N−1 steps of p bytes each.

So a 1-bit all-gather moves (N−1)·d/8 bytes per worker against 2(N−1)/N·4d for an fp32 all-reduce: 64/N
times less, which stops paying beyond a few tens of workers.

Direct collectives (every worker sends to every other at once, one latency step): worker i's links share
its network interface, so what it sends (and, separately, what it receives) is serialised: its time is the
longest one-way latency among its links plus Σ_j bytes_ij / bandwidth_ij; the collective lasts the slowest
worker's time.

- all-to-all of ``m`` bytes from every worker to every other: (N−1)·m out and (N−1)·m in per worker;
- the sharded exchange (:func:`sharded_s`): an all-to-all of the 1-bit slices (each worker's slice k of
  s/N bytes goes to shard k's owner), then an all-to-all of the combined shards (owner k sends its c/N
  bytes to every worker): (N−1)/N·(s + c) bytes out and in per worker, whatever N, in four latency steps
  (two more direct exchanges of N flag bytes agree on who is out and which shards arrived intact).
 Latencies are the published P95 inter-region round-trip times of Azure (30 days ending
2026-07-30); Azure publishes no bandwidth, so links default to 1 Gbit/s as in Streaming DiLoCo's tables
(papers in this field use 0.1-1 Gbit/s between regions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# P95 round-trip latency (ms) between Azure regions; rows are sources, columns destinations.
AZURE_REGIONS = (
    "East US", "West US 2", "North Europe", "West Europe", "UK South", "Japan East", "Southeast Asia",
    "Central India",
)  # fmt: skip
AZURE_RTT_MS = (
    (0, 75, 74, 89, 80, 165, 229, 214),
    (76, 0, 135, 147, 144, 102, 165, 218),
    (76, 136, 0, 19, 15, 232, 236, 160),
    (91, 153, 20, 0, 13, 240, 182, 153),
    (80, 145, 14, 12, 0, 235, 183, 151),
    (165, 103, 232, 242, 237, 0, 74, 129),
    (229, 165, 236, 181, 183, 74, 0, 58),
    (218, 218, 159, 153, 150, 129, 59, 0),
)


def azure_rtt_ms(src: str, dst: str) -> float:
    """Published P95 RTT between two Azure regions (KeyError lists the known regions)."""
    names = {n.lower(): i for i, n in enumerate(AZURE_REGIONS)}
    try:
        return float(AZURE_RTT_MS[names[src.lower()]][names[dst.lower()]])
    except KeyError:
        raise KeyError(f"unknown Azure region in ({src!r}, {dst!r}); known: {', '.join(AZURE_REGIONS)}") from None


@dataclass(frozen=True)
class WanModel:
    """Link latency (RTT, seconds) and bandwidth (bytes/second) between every pair of workers."""

    rtt_s: tuple[tuple[float, ...], ...]
    bandwidth_Bps: tuple[tuple[float, ...], ...]

    @property
    def n(self) -> int:
        return len(self.rtt_s)

    def _ring_links(self) -> list[tuple[int, int]]:
        n = self.n
        return [(i, (i + 1) % n) for i in range(n)] if n > 1 else []

    def ring_step_s(self, chunk_bytes: float) -> float:
        """One ring step: every link carries one chunk at the same time; the slowest link sets the pace."""
        return max(
            (self.rtt_s[i][j] / 2 + chunk_bytes / self.bandwidth_Bps[i][j] for i, j in self._ring_links()),
            default=0.0,
        )

    def allreduce_s(self, nbytes: float) -> float:
        """Ring all-reduce of an ``nbytes`` buffer held by every worker."""
        n = self.n
        return 0.0 if n < 2 else 2 * (n - 1) * self.ring_step_s(nbytes / n)

    def allgather_s(self, payload_bytes: float) -> float:
        """Ring all-gather of one ``payload_bytes`` payload from every worker."""
        n = self.n
        return 0.0 if n < 2 else (n - 1) * self.ring_step_s(payload_bytes)

    @staticmethod
    def allreduce_bytes_per_worker(nbytes: float, n: int) -> float:
        """Bytes each worker sends in a ring all-reduce."""
        return 0.0 if n < 2 else 2 * (n - 1) / n * nbytes

    @staticmethod
    def allgather_bytes_per_worker(payload_bytes: float, n: int) -> float:
        """Bytes each worker sends in a ring all-gather (its own payload plus forwarded ones)."""
        return 0.0 if n < 2 else (n - 1) * payload_bytes

    def direct_s(self, bytes_out: "list[list[float]] | float") -> float:
        """A direct collective where worker i sends ``bytes_out[i][j]`` bytes to worker j (one figure: the same
        for every pair), all at once: one latency step, each worker's sends and receives serialised on its
        interface (the slower of the two sets its time)."""
        n = self.n
        if n < 2:
            return 0.0
        m = [[float(bytes_out)] * n for _ in range(n)] if isinstance(bytes_out, (int, float)) else bytes_out
        worst = 0.0
        for i in range(n):
            others = [j for j in range(n) if j != i]
            latency = max(self.rtt_s[i][j] for j in others) / 2
            out = sum(m[i][j] / self.bandwidth_Bps[i][j] for j in others)
            into = sum(m[j][i] / self.bandwidth_Bps[j][i] for j in others)
            worst = max(worst, latency + max(out, into))
        return worst

    def alltoall_s(self, nbytes: float) -> float:
        """Direct all-to-all: every worker sends ``nbytes`` to every other."""
        return self.direct_s(nbytes)

    def sharded_s(self, slices_bytes: float, combined_bytes: float, agreements: int = 2) -> float:
        """The sharded exchange: each worker's 1-bit payload (``slices_bytes`` in all, cut in N slices) goes
        slice by slice to the shards' owners, then each owner sends its combined shard (``combined_bytes`` in
        all, cut in N) to every worker: two direct all-to-alls of 1/N of each; plus ``agreements`` direct
        exchanges of one flag byte per worker (who is out of the round; which shards arrived intact)."""
        n = self.n
        if n < 2:
            return 0.0
        return self.alltoall_s(slices_bytes / n) + self.alltoall_s(combined_bytes / n) + agreements * self.alltoall_s(n)

    @staticmethod
    def sharded_bytes_per_worker(slices_bytes: float, combined_bytes: float, n: int) -> float:
        """Bytes each worker sends (and receives) in the sharded exchange."""
        return 0.0 if n < 2 else (n - 1) / n * (slices_bytes + combined_bytes)

    def subset(self, indices: list[int]) -> "WanModel":
        """The WAN between a subset of the workers (ring order kept), e.g. the survivors of a fault."""
        return WanModel(
            rtt_s=tuple(tuple(self.rtt_s[i][j] for j in indices) for i in indices),
            bandwidth_Bps=tuple(tuple(self.bandwidth_Bps[i][j] for j in indices) for i in indices),
        )

    def scaled(self, latency_factor: float, transfer_factor: float) -> "WanModel":
        """A copy whose every latency is ``latency_factor`` times this one's and every transfer (bytes /
        bandwidth) ``transfer_factor`` times: RTTs × the first, bandwidths ÷ the second (the measured WAN is the
        declared one scaled so, :mod:`geomesh.planner.wan`)."""
        for name, f in (("latency_factor", latency_factor), ("transfer_factor", transfer_factor)):
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
                raise ValueError(f"{name}={f!r}: expected a positive, finite factor")
        if latency_factor == 1 and transfer_factor == 1:
            return self
        return WanModel(rtt_s=tuple(tuple(x * latency_factor for x in row) for row in self.rtt_s),
                        bandwidth_Bps=tuple(tuple(x / transfer_factor for x in row) for row in self.bandwidth_Bps))  # fmt: skip

    def scaled_bandwidth(self, i: int, factor: float) -> "WanModel":
        """A copy where every link touching worker ``i`` has its bandwidth multiplied by ``factor``."""
        bw = [list(r) for r in self.bandwidth_Bps]
        for j in range(self.n):
            if j != i:
                bw[i][j] *= factor
                bw[j][i] *= factor
        return WanModel(self.rtt_s, tuple(tuple(r) for r in bw))
