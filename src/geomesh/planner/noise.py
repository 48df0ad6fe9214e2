"""Robust statistics of noisy wall-clock measurements, shared by the online planner (compute, round overheads)
and the WAN estimator (links): medians and median absolute deviations rather than means and standard
deviations, so that one stalled or healing round does not move them. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence

MAD_TO_SIGMA = 1.4826  # a normal distribution's σ per median absolute deviation
NOISE_MIN_CHANGES = 3  # round-to-round changes before a dispersion is trusted (a worker's own, or all workers')


def median(values: Sequence[float]) -> float:
    xs = sorted(values)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def geomean(values: Sequence[float]) -> float:
    return math.exp(math.fsum(math.log(x) for x in values) / len(values))


def robust_sigma(values: Sequence[float]) -> float:
    """σ of ``values`` from their median absolute deviation (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    mid = median(values)
    return MAD_TO_SIGMA * median([abs(x - mid) for x in values])


def change_sigma(changes: Sequence[float]) -> float:
    """σ of one measurement from the absolute changes between successive ones: the robust scale of the
    changes over √2 (a change carries two measurements' noise). A step change is one large change among
    several, which the median ignores."""
    return MAD_TO_SIGMA * median(changes) / math.sqrt(2.0)


def dispersion(*histories: Sequence[float]) -> float | None:
    """The relative round-to-round dispersion σ of recent observed factors (one worker's, or several workers'
    pooled): :func:`change_sigma` of the successive log-ratios; ``None`` with fewer than
    :data:`NOISE_MIN_CHANGES` changes."""
    steps = [abs(math.log(b / a)) for h in histories for a, b in zip(h, h[1:])]
    if len(steps) < NOISE_MIN_CHANGES:
        return None
    return change_sigma(steps)
