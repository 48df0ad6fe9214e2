"""The WAN measured in place: the declared WAN is the prior, every exchange (and every probe) a measurement.

The plan's exchange time comes from a :class:`~geomesh.network.WanModel`. The scenario declares one, and a team
rarely knows its links to a factor of two. :class:`WanEstimator` learns two factors from measured exchanges:
latencies are ``latency_factor`` times the declared ones, and transfer times (bytes / bandwidth)
``transfer_factor`` times, i.e. bandwidths ÷ it. So :meth:`WanEstimator.measured` is
``declared.scaled(latency_factor, transfer_factor)``, which the plan then uses wherever it uses exchange time.

One observation is one exchange: ``latency_s`` and ``transfer_s``, the declared model's latency part and
transfer part of that very exchange (:func:`exchange_parts`, :func:`time_parts`), and ``measured_s``, the time
it took. The model is measured ≈ a·latency_s + b·transfer_s.

- **Two sizes separate latency from bandwidth.** When the observations of the current level (below) have
  transfer shares ``transfer_s / (latency_s + transfer_s)`` at least :data:`SPAN_MIN` apart (probes at two
  sizes) as declared, or as measured (a link declared far faster than it is, where both probe sizes look
  like latency alone to the declaration: sizes :data:`SIZES_APART` times apart, whose transfer shares at the
  fitted factors are :data:`SPAN_MIN` and :data:`SCATTER_APART` times the observations' scatter apart), a
  and b are fitted by weighted least squares on relative errors, Σ w_k·(a·x_k + b·y_k − 1)² with
  x_k = latency_s/measured_s and y_k = transfer_s/measured_s, each bounded to [:data:`FACTOR_MIN`,
  :data:`FACTOR_MAX`]; their ratio a:b is then what is known of the split. When they do not (every round
  exchanges the same size), one total factor is refined and the a:b ratio known so far is kept (at first the
  prior's 1:1): the geometric mean of measured / (ratio·latency_s + transfer_s).
- **Smoothed.** Over the last :data:`WINDOW` observations of the level (the exchanges since the link last
  changed): with ``noise_k`` > 0 every one weighs alike (the level's mean is what the noise is compared with,
  as the online planner's noise-aware factor; a change of the link starts a new level at once); with
  ``noise_k`` 0 (the plain rule, modeled times without noise) the weights are ``smoothing ** age``, the newest
  weighing 1 (``smoothing`` 0: the newest alone).
- **Outliers robust** (the online planner's noise-aware rules, :class:`~geomesh.planner.OnlinePlanner`): σ
  is the robust dispersion of the successive changes of the last :data:`NOISE_WINDOW` prediction errors
  log(measured / predicted), each at the factors before its exchange was folded in (1.4826 × the median
  absolute change / √2: a step change of the link is one large change among several, which the median
  ignores; out of sample, so a fit of few exchanges does not make the noise look smaller than it is; unknown
  until :data:`NOISE_MIN_CHANGES` changes are known: one from three or four is often far too low). With
  ``noise_k`` > 0 and σ known, an exchange further than max(``threshold``, ``noise_k``·σ) from the prediction
  is held back instead of folded in: alone, or with fewer than :data:`CONFIRM` in a row on one side, it is
  an outlier (a congested moment) and is dropped when the next one is back within the noise;
  :data:`CONFIRM` in a row on one side are a change of the link, and the level starts again from them (one
  re-plan to the new link, not a chain of re-plans half-way there).
  Three, not two as for compute: with σ measured from a few exchanges, two in a row past a 2σ band on one
  side come from noise alone too often. A probe is always folded in: probes are deliberate, and their sizes
  differ on purpose.
- **Probes that a burst cannot fool, and a first exchange that corrects them.** A token bucket lets a burst
  through at line rate (tens of KB), so a probe that fits in one measures the line, not the rate: the large
  probe is at least :data:`PROBE_BURST_TIMES` plausible bursts (:func:`probe_sizes`). Where the probes were
  fooled anyway (a shaper that holds only longer transfers, a bucket larger than thought), the first exchanges
  say so: with ``noise_k`` > 0, an exchange more than :data:`FAR_FACTOR` off its prediction (and than twice
  the noise band of the probes' own scatter) while σ is still unknown starts a new level from itself at once
  (the a:b split as known), and :meth:`WanEstimator.should_replan` re-plans for it without waiting for the
  noise.
- **A deadband.** :meth:`WanEstimator.drift` is the log-ratio of the latest exchange as predicted at the
  factors now and at those the plan in force assumed (:meth:`WanEstimator.assume`).
  :meth:`WanEstimator.should_replan` gives a one-line reason when that drift is past ``threshold`` and past
  ``noise_k``·σ, else None: a change smaller than the measurements' noise is no change. With ``noise_k`` > 0
  there is no re-plan while σ is unknown (the first six exchanges, probes included) but for an exchange
  :data:`FAR_FACTOR` off (above); with
  ``noise_k`` 0, ``threshold`` alone. Simulated (noise lognormal with σ equal to the 10% threshold, 40
  exchanges of one size around an accurately declared link, 200 seeds), 5% of the runs re-plan on noise
  alone, where the plain threshold rule re-plans 6.5 times per run.

Pure and deterministic: the same observations give the same factors and decisions on every rank, and
:meth:`WanEstimator.state_dict` (JSON values) carries everything, so a resumed or healed copy goes on
bit-identically. No I/O, no clock: the runtimes measure, this module only reads the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from ..network import WanModel
from .noise import change_sigma

WINDOW = 16  # observations of the current level that the factors are fitted from
NOISE_WINDOW = 16  # recent observations (held-back ones included) whose residuals measure the noise
SPAN_MIN = 0.1  # transfer shares at least this far apart separate latency from bandwidth
SIZES_APART = 4.0  # transfer parts per latency part this many times apart are two sizes (the probes: >= 4x)
SCATTER_APART = 4.0  # measured shares this many times their scatter apart are a split, not noise
# the factors' sane range (a link held to 400 kbit/s and declared 1 Gbit/s is 2500 times slower than declared)
FACTOR_MIN, FACTOR_MAX = 1 / 4096, 4096.0
NOISE_MIN_CHANGES = 5  # successive changes of the prediction errors before their dispersion is trusted
CONFIRM = 3  # exchanges in a row outside the noise, on one side, that are a change of the link (fewer: outliers)

PROBE_SMALL = 512  # bytes per region of the small WAN probe (latency), before round 0
# what a token bucket plausibly lets through at line rate before it holds a link to its rate: Linux tbf's and most
# shapers' bursts are tens of KB (tbf needs at least rate / HZ; 32-64 KB is the common setting), and a probe that
# fits in one measures the line, not the rate (the bed, declared 1 Gbit/s and held to 400 kbit/s: "transfer x2.49")
PROBE_BURST = 64 << 10
PROBE_BURST_TIMES = 4  # the large probe is at least this many plausible bursts: its time is mostly the held rate
PROBE_LARGE_MAX = 4 << 20  # the large probe (bandwidth) is the exchange's payload, up to this (at least the above)
PROBE_REPEATS = 2  # each size this many times: the probes' scatter is what tells a split from jitter
# (noise_k > 0) an exchange whose wire time is more than this factor off the prediction (either way) before the
# noise is known (the first exchanges after the probes) corrects the factors at once: the probes before round 0
# were fooled (a burst let them through at line rate, a shaper that holds only longer transfers), and the plan
# made from them is re-made at once, not after the exchanges that measure the noise
FAR_FACTOR = 2.0

_STATE_VERSION = 1
_SAME = 1e-9  # factors this close to 1 are 1 (float rounding of a latency part plus a transfer part)


def exchange_parts(method: Any, wan: WanModel, nbytes: float) -> tuple[float, float]:
    """(latency_s, transfer_s) of ``method``'s exchange of ``nbytes`` per worker on ``wan``: the exchange of
    nothing, and what the bytes add to it (``method.exchange(wan, nbytes)`` returns (seconds, bytes sent))."""
    latency = float(method.exchange(wan, 0)[0])
    total = float(method.exchange(wan, nbytes)[0])
    return latency, max(0.0, total - latency)


def probe_sizes(payload_nbytes: float) -> list[int]:
    """The WAN probes before round 0, in the order both runtimes send them: :data:`PROBE_REPEATS` times a
    :data:`PROBE_SMALL`-byte all-gather and one of the exchange's payload, at most :data:`PROBE_LARGE_MAX` and at
    least :data:`PROBE_BURST_TIMES` × :data:`PROBE_BURST` (256 KiB): a probe that a token bucket's burst lets
    through at line rate measures the line, not the rate the link is held to, so the large probe is several
    plausible bursts (its time is then mostly the held rate: within 4/3 of it). Two sizes separate latency from
    bandwidth (the module docstring). What they cost: 2 × 256 KiB on a link held to 400 kbit/s takes about 11 s
    (each ring step of the all-gather carries it once), on one at 20 Mbit/s a quarter of a second."""
    large = max(PROBE_BURST * PROBE_BURST_TIMES, min(int(payload_nbytes), PROBE_LARGE_MAX))
    return [PROBE_SMALL, large] * PROBE_REPEATS


def time_parts(cost: Callable[[WanModel], float], wan: WanModel) -> tuple[float, float]:
    """(latency_s, transfer_s) of any collective, ``cost(wan)`` its time on a WAN: its time on ``wan`` with
    unlimited bandwidth, and what the bytes add (the sharded exchange, whose sizes are not one figure)."""
    inf = float("inf")
    latency = float(cost(WanModel(wan.rtt_s, tuple(tuple(inf for _ in row) for row in wan.bandwidth_Bps))))
    return latency, max(0.0, float(cost(wan)) - latency)


def _scaled(declared: WanModel, a: float, b: float) -> WanModel:
    """``declared.scaled(a, b)``, and ``declared`` itself where a factor is 1 but for float rounding (modeled
    exchanges measured against their own model: the plan stays the declared WAN's, bit for bit)."""
    same = abs(a - 1.0) <= _SAME and abs(b - 1.0) <= _SAME
    return declared if same else declared.scaled(a, b)


def _bounded(f: float) -> float:
    return min(FACTOR_MAX, max(FACTOR_MIN, f))


def _sizes_measured_apart(weighted: list[tuple[float, tuple[float, float, float]]], a: float, b: float) -> bool:
    """Whether the measurements themselves separate latency from bandwidth, where the declared WAN says they
    cannot (a link declared far faster than it is: every size looks like latency alone to the declaration):
    sizes :data:`SIZES_APART` times apart, at least four observations, and at the fitted factors transfer shares
    at least :data:`SPAN_MIN` and :data:`SCATTER_APART` times the observations' scatter around the fit (relative
    RMS, n − 2 degrees of freedom) apart, so that jitter between two sizes on a link the declaration gets right
    is seldom taken for a bandwidth (tests/test_wan_measured.py counts how seldom)."""
    n = len(weighted)
    per_latency = [t / lat for _, (lat, t, _m) in weighted if lat > 0]
    if n < 4 or len(per_latency) < n or not max(per_latency) >= SIZES_APART * min(per_latency):
        return False  # (one size, sizes too close, or too few to see their scatter: noise taken for a split)
    fitted = [b * t / (a * lat + b * t) for _, (lat, t, _m) in weighted]
    total = math.fsum(w for w, _ in weighted)
    squares = math.fsum(w * math.log(m / (a * lat + b * t)) ** 2 for w, (lat, t, m) in weighted)
    scatter = math.sqrt(squares / total * n / (n - 2))  # (two factors fitted: n − 2 degrees of freedom)
    span = max(fitted) - min(fitted)
    return span >= SPAN_MIN and span >= SCATTER_APART * scatter


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what}={value!r}: expected finite seconds >= 0")
    return float(value)


class WanEstimator:
    """The measured WAN as two factors of the declared one (see the module's docstring for the rules)."""

    def __init__(self, *, smoothing: float = 0.5, threshold: float = 0.1, noise_k: float = 2.0):
        if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing={smoothing!r}: must be in [0, 1)")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold < math.inf:
            raise ValueError(f"threshold={threshold!r}: must be > 0")
        if isinstance(noise_k, bool) or not isinstance(noise_k, (int, float)) or not (
                math.isfinite(noise_k) and noise_k >= 0.0):  # fmt: skip
            raise ValueError(f"noise_k={noise_k!r}: must be >= 0")
        self.smoothing, self.threshold, self.noise_k = float(smoothing), float(threshold), float(noise_k)
        self._a = self._b = 1.0  # the factors now
        self._ratio = 1.0  # a:b as known so far (the prior's 1:1 until two sizes are measured)
        self._assumed = (1.0, 1.0)  # the factors the plan in force was made with
        self._level: list[tuple[float, float, float]] = []  # (latency_s, transfer_s, measured_s) since the link changed
        self._history: list[float] = []  # the last NOISE_WINDOW observations' residuals as predicted: the noise
        self._held: list[tuple[float, float, float]] = []  # outside the noise on one side, not yet CONFIRM of them
        self._last: tuple[float, float] | None = None  # the latest exchange's declared parts: what drift() predicts
        self._since = 0  # observations folded in since the plan in force
        self._corrected = False  # FAR_FACTOR corrected the factors since the plan in force (a re-plan, noise unknown)
        self.observations = 0
        self.probes = 0
        self.held_back = 0

    # ---- the factors ---------------------------------------------------------------------------------------
    @property
    def latency_factor(self) -> float:
        return self._a

    @property
    def transfer_factor(self) -> float:
        return self._b

    @property
    def assumed(self) -> tuple[float, float]:
        """(latency_factor, transfer_factor) that the plan in force assumed."""
        return self._assumed

    def measured(self, declared: WanModel) -> WanModel:
        """The WAN as measured: ``declared`` with its latencies × ``latency_factor``, bandwidths ÷
        ``transfer_factor``."""
        return _scaled(declared, self._a, self._b)

    def planned(self, declared: WanModel) -> WanModel:
        """The WAN the plan in force assumed (:meth:`assume`): ``declared`` scaled by those factors."""
        return _scaled(declared, *self._assumed)

    def predict(self, latency_s: float, transfer_s: float) -> float:
        """An exchange whose declared parts are these, as the factors now predict it."""
        return self._a * latency_s + self._b * transfer_s

    # ---- measurements --------------------------------------------------------------------------------------
    def observe(self, latency_s: float, transfer_s: float, measured_s: float, *, probe: bool = False) -> None:
        """Fold one exchange in: the declared model's ``latency_s`` and ``transfer_s`` of it, and the
        ``measured_s`` it took (``probe``: a deliberate measurement, never held back)."""
        obs = (_number(latency_s, "latency_s"), _number(transfer_s, "transfer_s"), _number(measured_s, "measured_s"))
        if obs[0] + obs[1] <= 0:
            raise ValueError("latency_s + transfer_s = 0: the declared model says this exchange takes no time, so "
                             "it measures nothing")  # fmt: skip
        if obs[2] <= 0:
            raise ValueError(f"measured_s={measured_s!r}: expected positive seconds")
        self.observations += 1
        self.probes += bool(probe)
        self._last = (obs[0], obs[1])
        sigma = self.noise()  # from the observations before this one
        residual = self._residual(obs)
        if not probe and self.noise_k > 0 and sigma is None and self._level and abs(residual) > self._far():
            # an exchange far from what the probes (or the first exchanges) predicted, before the noise is known:
            # they were fooled, the link is what this exchange measured; a new level from it at once (the a:b
            # split as known), and a re-plan without waiting for the noise (should_replan)
            self._held = []
            self._level = [obs]
            self._since += 1
            self._corrected = True
        elif probe or self.noise_k <= 0 or sigma is None or abs(residual) <= max(self.threshold, self.noise_k * sigma):
            self._held = []  # an earlier held-back exchange was an outlier
            self._level = [*self._level, obs][-WINDOW:]
            self._since += 1
        elif len(self._held) + 1 >= CONFIRM and all((self._residual(h) > 0) == (residual > 0) for h in self._held):
            self._level = [*self._held, obs]  # CONFIRM in a row on the same side: the link changed
            self._held = []
            self._since += CONFIRM
        else:
            same = all((self._residual(h) > 0) == (residual > 0) for h in self._held)
            self._held = [*self._held, obs] if same else [obs]
            self.held_back += 1
            self._history = [*self._history, residual][-NOISE_WINDOW:]
            return
        self._history = [*self._history, residual][-NOISE_WINDOW:]
        self._fit()

    def observe_probe(self, declared: WanModel, nbytes: int, measured_s: float) -> None:
        """Fold one WAN probe in (:func:`probe_sizes`): an all-gather of ``nbytes`` per region, its latency and
        transfer parts on ``declared``, that took ``measured_s``. A probe that measured nothing (no time, or one
        the declared WAN gives no time) is left out: it says nothing of the link, and a run never stops on it."""
        latency, transfer = time_parts(lambda wan: wan.allgather_s(nbytes), declared)
        if latency + transfer > 0 and measured_s > 0:
            self.observe(latency, transfer, measured_s, probe=True)

    def _far(self) -> float:
        """(noise_k > 0, σ unknown) How far (log) an exchange may be from the prediction before it corrects the
        factors at once: log(:data:`FAR_FACTOR`), or twice the noise band of the level's own scatter around its
        fit (2·``noise_k``·its relative RMS, n − 2 degrees of freedom: the probes repeat each size, and on
        loopback or a busy host their times scatter by a factor of three) where that is wider."""
        n = len(self._level)
        far = math.log(FAR_FACTOR)
        if n < 3:
            return far
        squares = math.fsum(math.log(m / self.predict(lat, t)) ** 2 for lat, t, m in self._level)
        return max(far, 2.0 * self.noise_k * math.sqrt(squares / (n - 2)))

    def _residual(self, obs: tuple[float, float, float]) -> float:
        return math.log(obs[2] / self.predict(obs[0], obs[1]))

    def _fit(self) -> None:
        """The factors from the level's observations (module docstring: two sizes, or one total factor)."""
        level = self._level
        n = len(level)
        # noise-aware: every observation of the level alike (its mean is what the noise is compared with; a
        # change of the link starts a new level at once); plain: the newest weigh most
        weighted = [(1.0 if self.noise_k > 0 else self.smoothing ** (n - 1 - k), o) for k, o in enumerate(level)]
        weighted = [(w, o) for w, o in weighted if w > 0]
        shares = [t / (lat + t) for _, (lat, t, _m) in weighted]
        fit = self._fit_both(weighted)
        if fit is not None and (max(shares) - min(shares) >= SPAN_MIN or _sizes_measured_apart(weighted, *fit)):
            self._a, self._b = fit
            self._ratio = fit[0] / fit[1]
            return
        rho = self._ratio  # one size: the total factor, at the a:b known so far
        log_s = math.fsum(w * math.log(m / (rho * lat + t)) for w, (lat, t, m) in weighted)
        s = math.exp(log_s / math.fsum(w for w, _ in weighted))
        self._a, self._b = _bounded(rho * s), _bounded(s)

    def _fit_both(self, weighted: list[tuple[float, tuple[float, float, float]]]) -> tuple[float, float] | None:
        """Least squares of measured ≈ a·latency + b·transfer on relative errors: (a, b); None when ill-posed."""
        sxx = math.fsum(w * (lat / m) ** 2 for w, (lat, t, m) in weighted)
        syy = math.fsum(w * (t / m) ** 2 for w, (lat, t, m) in weighted)
        sxy = math.fsum(w * lat * t / m**2 for w, (lat, t, m) in weighted)
        sx = math.fsum(w * lat / m for w, (lat, t, m) in weighted)
        sy = math.fsum(w * t / m for w, (lat, t, m) in weighted)
        det = sxx * syy - sxy * sxy
        if not det > 1e-9 * sxx * syy:
            return None
        a, b = (sx * syy - sy * sxy) / det, (sy * sxx - sx * sxy) / det
        if not FACTOR_MIN <= a <= FACTOR_MAX:  # one bound reached: the other factor fitted with it fixed
            a = _bounded(a)
            b = _bounded((sy - a * sxy) / syy)
        elif not FACTOR_MIN <= b <= FACTOR_MAX:
            b = _bounded(b)
            a = _bounded((sx - b * sxy) / sxx)
        return a, b

    def noise(self) -> float | None:
        """σ: the relative dispersion of the recent exchanges around their predictions (module docstring); None
        while fewer than :data:`NOISE_MIN_CHANGES` changes are known."""
        changes = [abs(b - a) for a, b in zip(self._history, self._history[1:])]
        if len(changes) < NOISE_MIN_CHANGES:
            return None
        return change_sigma(changes)

    # ---- re-planning ----------------------------------------------------------------------------------------
    def drift(self) -> float:
        """log(the latest exchange as predicted at the factors now / as the plan in force predicted it)."""
        if self._last is None:
            return 0.0
        lat, t = self._last
        a0, b0 = self._assumed
        return math.log(self.predict(lat, t) / (a0 * lat + b0 * t))

    def should_replan(self) -> str | None:
        """Why the plan should be made again over the measured WAN (one line), or None: the drift is within
        ``threshold`` or within the measurements' noise (``noise_k``·σ)."""
        d = self.drift()
        if self._since == 0 or abs(d) <= self.threshold:
            return None
        if self.noise_k > 0:
            sigma = self.noise()
            if (sigma is None and not self._corrected) or (sigma is not None and abs(d) <= self.noise_k * sigma):
                return None  # (no noise known yet: no change is known to be more than noise, but a far one)
        lat, t = self._last
        a0, b0 = self._assumed
        how = f"{math.exp(d):.1f}x slower" if d > 0 else f"{math.exp(-d):.1f}x faster"
        return (f"the WAN measured {how} than the plan assumed (an exchange of {self.predict(lat, t):.3g} s "
                f"against {a0 * lat + b0 * t:.3g} s; latency x{self._a:.2f}, transfer x{self._b:.2f} the declared)")

    def assume(self) -> None:
        """The plan in force now assumes the factors now."""
        self._assumed = (self._a, self._b)
        self._since = 0
        self._corrected = False

    # ---- state ------------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """What records and summaries carry: the factors now, and how many exchanges (probes) measured them."""
        return {"latency_factor": self._a, "transfer_factor": self._b, "observations": self.observations,
                "probes": self.probes, "held_back": self.held_back}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Everything, as JSON values: a copy loaded from it decides as this one does."""
        return {"version": _STATE_VERSION, "latency_factor": self._a, "transfer_factor": self._b,
                "ratio": self._ratio, "assumed": list(self._assumed), "level": [list(o) for o in self._level],
                "history": list(self._history), "held": [list(o) for o in self._held],
                "last": list(self._last) if self._last is not None else None, "since": self._since,
                "corrected": self._corrected,
                "observations": self.observations, "probes": self.probes, "held_back": self.held_back}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from :meth:`state_dict` output (ValueError when it is not one)."""
        try:
            if state.get("version") != _STATE_VERSION:
                raise ValueError(f"version {state.get('version')!r}")

            def triples(key: str) -> list[tuple[float, float, float]]:
                out = [tuple(float(x) for x in o) for o in state[key]]
                if any(len(o) != 3 or not all(math.isfinite(x) and x >= 0 for x in o) for o in out):
                    raise ValueError(key)
                return out  # type: ignore[return-value]

            a, b, ratio = float(state["latency_factor"]), float(state["transfer_factor"]), float(state["ratio"])
            assumed = tuple(float(x) for x in state["assumed"])
            if len(assumed) != 2 or not all(math.isfinite(x) and x > 0 for x in (a, b, ratio, *assumed)):
                raise ValueError("factors")
            level, held = triples("level"), triples("held")
            history = [float(x) for x in state["history"]]
            if not all(math.isfinite(x) for x in history):
                raise ValueError("history")
            last = state["last"]
            last = None if last is None else tuple(float(x) for x in last)
            if last is not None and len(last) != 2:
                raise ValueError("last")
            counts = [int(state[k]) for k in ("since", "observations", "probes", "held_back")]
            corrected = bool(state.get("corrected", False))  # (older states: none pending)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a WanEstimator state ({exc})") from None
        self._a, self._b, self._ratio, self._assumed = a, b, ratio, assumed  # type: ignore[assignment]
        self._level, self._history, self._held, self._last = level, history, held, last  # type: ignore[assignment]
        self._since, self.observations, self.probes, self.held_back = counts
        self._corrected = corrected
