"""GeoMesh's balanced plan (:func:`plan_balanced`): the planning rule's fill of a round, and the sequence
target's deadline search, sweep, price ladder and repairs (the package docstring explains the algorithm).
Pure: no I/O, no clock."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

from ..errors import PlanError
from ..hardware import WorkerProfile
from .plan import Plan, PlanConstraints, _assemble, _upper, _usable, reference_round_s, split_batch

IDLE_WARN = 0.05  # plan_balanced warns when the predicted straggler idle of the compute phase exceeds this
V_SLACK = 0.003  # plans within this much of the best balance score count as equally good
WINDOW_STRETCH = 1.15  # how far above T_b the sweep looks (best-value responses do fewer sequences)
_EPS = 1e-12  # relative slack when comparing a compute time with a deadline (float rounding)
_MAX_EVENTS = 150_000  # cap on (b, H) pairs swept; the window is narrowed when it would hold more
_SMALL_SWEEP = 20_000  # small problems (pairs, workers): the sweep is repeated with prices on sequences
_SMALL_CLUSTER = 8  # and the best plans near the band are repaired into it
_SMALL_STRETCH = 1.5  # and the window is stretched further
_PRICE_LADDER = (0.0, -0.5, -0.25, -0.1, -0.04, 0.04, 0.1, 0.25, 0.5, 1.0)
_REPAIRED = 8  # in small sweeps, how many of the best plans just outside the band are repaired into it
_REPAIR_MARGIN = 0.25  # "just outside": within this fraction of the target
FILL_SLACK = 0.01  # the planning rule: options within 1% of a worker's longest compute count as filling the round


# ----------------------------------------------------------------------------------------------------
# GeoMesh: balanced plan


class _Worker:
    """Precomputed options of one worker: batches, their splits and step times, value weights."""

    __slots__ = ("profile", "c", "min_h", "step1", "knee_upper", "bs", "ts", "splits", "rate", "wc", "ws", "min_opt",
                 "o")

    def __init__(self, profile: WorkerProfile, constraints: PlanConstraints, min_h: int):
        # the same numbers as knee_micro_batch / candidate_batches / knee_rate, each step time computed once
        c = constraints
        top = min(profile.max_micro_batch, c.max_batch)
        step1 = [profile.step_s(m, 1) for m in range(1, top + 1)]  # accum 1
        for m, t in enumerate(step1, start=1):
            if not (math.isfinite(t) and t > 0):
                raise PlanError(f"worker {profile.name!r}: step time {t!r} at batch {m} is not positive and finite")
        thr = [m / t for m, t in enumerate(step1, start=1)]
        best = max(thr)
        knee = next(m for m, x in enumerate(thr, start=1) if x >= c.knee * best * (1 - 1e-12))
        self.profile, self.c, self.min_h, self.step1 = profile, c, min_h, step1
        self.o = profile.round_overhead_s  # paid once per round: an option's round is o + H·t
        self.knee_upper = min(c.max_batch, max(knee, c.min_batch))
        self.rate = max(b / self._step(b) for b in range(c.min_batch, self.knee_upper + 1))
        beta = c.efficiency_weight
        self.wc, self.ws = 1.0 - beta, beta / self.rate  # v = wc·c + ws·S

    def _step(self, b: int) -> float:
        m, a = split_batch(b, self.profile.max_micro_batch)
        t = self.step1[b - 1] if a == 1 else self.profile.step_s(m, a)
        if not (math.isfinite(t) and t > 0):
            raise PlanError(f"worker {self.profile.name!r}: step time {t!r} at batch {b} is not positive and finite")
        return t

    def set_batches(self, upper: int) -> None:
        """Candidate batches min_batch..upper."""
        self.bs = list(range(self.c.min_batch, upper + 1))
        self.splits = [split_batch(b, self.profile.max_micro_batch) for b in self.bs]
        self.ts = [self._step(b) for b in self.bs]
        # quickest option (ties: more sequences): the response when nothing fits the deadline
        j = min(range(len(self.bs)), key=lambda k: (self.ts[k], -self.bs[k]))
        self.min_opt = self.option(self.bs[j], self.min_h, self.ts[j])

    def option(self, b: int, h: int, t: float) -> tuple[float, int, int, int, float]:
        """(c, S, b, H, v) of running ``h`` steps of batch ``b`` (step time ``t``); c counts the round overhead."""
        c = self.o + h * t
        return (c, b * h, b, h, self.wc * c + self.ws * b * h)


def _respond(w: _Worker, deadline: float, min_h: int, max_h: int, lam: float = 0.0):
    """Best response (c, S, b, H, v) to a deadline: the highest v + lam·S with c ≤ deadline.

    Ties go to more sequences; when nothing fits, the quickest option.
    """
    lim = deadline * (1 + _EPS) - w.o
    best = None
    best_key = None
    wc, wsq = w.wc, w.ws + lam
    for b, t in zip(w.bs, w.ts):
        h = int(lim / t)
        if h > max_h:
            h = max_h
        if h < min_h:
            continue
        if wc * t + wsq * b <= 0:  # the criterion falls with H: the fewest steps
            h = min_h
        key = (wc * h * t + wsq * b * h, b * h)
        if best is None or key > best_key:
            best, best_key = w.option(b, h, t), key
    return best if best is not None else w.min_opt


def _max_total(ws: list[_Worker], deadline: float, min_h: int, max_h: int) -> int:
    """Σ_i max S_i with c_i ≤ deadline (quickest option when none fits): non-decreasing in the deadline."""
    lim = deadline * (1 + _EPS)
    total = 0
    for w in ws:
        best = -1
        for b, t in zip(w.bs, w.ts):
            h = int((lim - w.o) / t)
            if h > max_h:
                h = max_h
            if h >= min_h and b * h > best:
                best = b * h
        total += best if best >= 0 else w.min_opt[1]
    return total


def _most_sequences(w: _Worker, deadline: float, min_h: int, max_h: int):
    """The option with the most sequences and c ≤ deadline (ties: shorter); the quickest when none fits."""
    lim = deadline * (1 + _EPS)
    best = None
    for b, t in zip(w.bs, w.ts):
        h = min(max_h, int((lim - w.o) / t))
        if h >= min_h and (best is None or b * h > best[1] or (b * h == best[1] and w.o + h * t < best[0])):
            best = w.option(b, h, t)
    return best if best is not None else w.min_opt


def _bisect(ws, pred, guess: float, t_max: float, min_h: int, max_h: int) -> tuple[float, float]:
    """(a, b), b − a ≤ 1e-9·b, with pred(Σ max S(a)) false and pred(Σ max S(b)) true; pred is monotone in
    the deadline and true at ``t_max``. The bracket is found by doubling or halving from ``guess``."""
    total = lambda t: _max_total(ws, t, min_h, max_h)  # noqa: E731
    if pred(total(0.0)):
        return 0.0, 0.0
    lo_t, hi_t = 0.0, t_max
    probe = min(max(guess, 1e-9 * t_max), t_max)
    if pred(total(probe)):
        hi_t = probe
        while probe > 1e-9 * t_max:
            probe /= 2
            if not pred(total(probe)):
                lo_t = probe
                break
            hi_t = probe
    else:
        lo_t = probe
        while probe < t_max:
            probe = min(2 * probe, t_max)
            if pred(total(probe)):
                hi_t = probe
                break
            lo_t = probe
    for _ in range(100):
        if hi_t - lo_t <= 1e-9 * hi_t:
            break
        mid = 0.5 * (lo_t + hi_t)
        if pred(total(mid)):
            hi_t = mid
        else:
            lo_t = mid
    return lo_t, hi_t


def _pick(cands: list[tuple[float, int, object]]):
    """The best candidate (V, |S − target|, payload): V within V_SLACK of the best, then closest to target."""
    best_v = max(c[0] for c in cands)
    eligible = [c for c in cands if c[0] >= best_v - V_SLACK]
    return min(eligible, key=lambda c: (c[1], -c[0]))


def _as_candidate(state, n: int, target: int):
    top = max(s[0] for s in state)
    return (sum(s[4] for s in state) / (n * top), abs(sum(s[1] for s in state) - target), state)


class _Repair:
    """``state`` with worker ``i`` switched to ``opt`` (materialised only for the chosen candidate)."""

    __slots__ = ("state", "i", "opt")

    def __init__(self, state, i, opt):
        self.state, self.i, self.opt = state, i, opt

    def materialise(self):
        new = list(self.state)
        new[self.i] = self.opt
        return new


def _repairs(ws, state, lo, hi, target, min_h, max_h):
    """Plans that change one worker of ``state`` so that Σ S lands in [lo, hi], as candidates for _pick."""
    n = len(ws)
    total = sum(s[1] for s in state)
    value = sum(s[4] for s in state)
    tops = sorted(((s[0], j) for j, s in enumerate(state)), reverse=True)[:2]
    out = []
    for i, w in enumerate(ws):
        rest = total - state[i][1]
        rest_value = value - state[i][4]
        others_top = next((c for c, j in tops if j != i), 0.0)
        for b, t in zip(w.bs, w.ts):
            h_lo = max(min_h, -(-(lo - rest) // b))
            h_hi = min(max_h, (hi - rest) // b)
            for h in {h_lo, h_hi} if h_lo <= h_hi else ():
                opt = w.option(b, h, t)
                top = max(others_top, opt[0])
                out.append(((rest_value + opt[4]) / (n * top), abs(rest + opt[1] - target), _Repair(state, i, opt)))
    return out


def _sweep(ws, t_a, t_b, lam, min_h, max_h):
    """Every distinct best-response plan (criterion v + lam·S) for deadlines in [T_a, T_b].

    Returns (scored [(V, Σ S, event index)], initial state, events); event index −1 is the initial state.
    """
    n = len(ws)
    init = [_respond(w, t_a, min_h, max_h, lam) for w in ws]
    lim_a, lim_b = t_a * (1 + _EPS), t_b * (1 + _EPS)
    events = []
    for i, w in enumerate(ws):
        wc, wsq = w.wc, w.ws
        pairs = []
        for b, t in zip(w.bs, w.ts):
            h0 = max(min_h, int((lim_a - w.o) / t))
            h1 = min(max_h, int((lim_b - w.o) / t))
            for h in range(h0, h1 + 1):
                c = w.o + h * t
                if lim_a < c <= lim_b:
                    v = wc * c + wsq * b * h
                    pairs.append((c, -(v + lam * b * h), -b * h, b, h, v))
        pairs.sort()
        cur = init[i][4] + lam * init[i][1]
        for c, neg_key, neg_s, b, h, v in pairs:
            if -neg_key > cur:
                cur = -neg_key
                events.append((c, i, -neg_s, b, h, v))
    events.sort()

    floor_top = max((s[0] for s in init if s[0] > lim_a), default=0.0)  # workers that fit no deadline yet
    state_s = [s[1] for s in init]
    state_v = [s[4] for s in init]
    total = sum(state_s)
    value = sum(state_v)
    scored = [(value / (n * max(s[0] for s in init)), total, -1)]
    k, n_ev = 0, len(events)
    while k < n_ev:
        c = events[k][0]
        while k < n_ev and events[k][0] == c:
            _, i, s, _, _, v = events[k]
            total += s - state_s[i]
            value += v - state_v[i]
            state_s[i], state_v[i] = s, v
            k += 1
        scored.append((value / (n * max(c, floor_top)), total, k - 1))
    return scored, init, events


def _replay(init, events, indices):
    """{index: state} for the given event indices (−1: the initial state), in one pass over the events."""
    out = {}
    state = list(init)
    todo = sorted(set(indices))
    j = 0
    while j < len(todo) and todo[j] < 0:
        out[todo[j]] = list(state)
        j += 1
    for k, (c, i, s, b, h, v) in enumerate(events):
        if j >= len(todo):
            break
        state[i] = (c, s, b, h, v)
        while j < len(todo) and todo[j] == k:
            out[k] = list(state)
            j += 1
    return out


def _solve(ws: list[_Worker], lo: int, hi: int, target: int, min_h: int, max_h: int):
    """Per-worker options (c, S, b, H, v) of the best plan, or None when the band is unreachable."""
    n = len(ws)
    t_max = max(w.o + max_h * max(w.ts) for w in ws)
    if _max_total(ws, t_max, min_h, max_h) < lo:
        return None
    # deadline window from the most-sequences responses: T_a = smallest deadline with Σ S ≥ lo,
    # T_b = largest with Σ S ≤ hi (their plans are in the band and always candidates)
    guess = target / sum(w.rate for w in ws)  # the continuous balanced round time
    if _max_total(ws, 0.0, min_h, max_h) >= lo:
        t_a = 0.0
    else:
        t_a = _bisect(ws, lambda s: s >= lo, guess, t_max, min_h, max_h)[1]
    if _max_total(ws, t_max, min_h, max_h) <= hi:
        t_b = t_max
    else:
        t_b = _bisect(ws, lambda s: s > hi, guess, t_max, min_h, max_h)[0]
    above = [_most_sequences(w, t_a, min_h, max_h) for w in ws]
    below = [_most_sequences(w, t_b, min_h, max_h) for w in ws]
    if t_a <= t_b:
        cands = [_as_candidate(x, n, target) for x in (above, below) if lo <= sum(s[1] for s in x) <= hi]
    else:  # Σ S jumps over the band between T_b and T_a: repair the plans on both sides of the jump
        cands = _repairs(ws, above, lo, hi, target, min_h, max_h) + _repairs(ws, below, lo, hi, target, min_h, max_h)
        t_a, t_b = t_b, t_a

    # best-value responses may do fewer sequences than the most-sequences ones: look a bit further up
    def pairs_up_to(t_end: float) -> float:
        return sum(max(0.0, (t_end - t_a) / t) + 1 for w in ws for t in w.ts)

    small = n <= _SMALL_CLUSTER and pairs_up_to(min(t_max, t_b * _SMALL_STRETCH)) <= _SMALL_SWEEP
    t_b = min(t_max, t_b * (_SMALL_STRETCH if small else WINDOW_STRETCH))
    n_pairs = pairs_up_to(t_b)
    if n_pairs > _MAX_EVENTS:  # keep the sweep fast: narrow the window
        t_b = t_a + (t_b - t_a) * _MAX_EVENTS / n_pairs
    prices = tuple(k * sum(1.0 / w.rate for w in ws) / n for k in _PRICE_LADDER) if small else (0.0,)
    for lam in prices:
        scored, init, events = _sweep(ws, t_a, t_b, lam, min_h, max_h)
        in_band = [(v, abs(s - target), k) for v, s, k in scored if lo <= s <= hi]
        wanted = [_pick(in_band)[2]] if in_band else []
        repair = small or not in_band
        if repair:  # the band may cut off the best plans: repair the best few near it, one worker each
            margin = _REPAIR_MARGIN * target
            near = [x for x in scored if lo - margin <= x[1] <= hi + margin and not lo <= x[1] <= hi]
            wanted += [k for _, _, k in sorted(near, reverse=True)[:_REPAIRED]]
        states = _replay(init, events, wanted)
        if in_band:
            cands.append(_as_candidate(states[wanted[0]], n, target))
        if repair:
            for k in wanted[1 if in_band else 0 :]:
                cands += _repairs(ws, states[k], lo, hi, target, min_h, max_h)
    if not cands:
        raise PlanError(
            f"no plan within tolerance: sequences per round jump from {sum(s[1] for s in below)} "
            f"to {sum(s[1] for s in above)} around the band [{lo}, {hi}]; widen the tolerance "
            "or the batch/step bounds"
        )
    best = _pick(cands)[2]
    return best.materialise() if isinstance(best, _Repair) else best


def plan_balanced(
    profiles: Sequence[WorkerProfile],
    constraints: PlanConstraints,
    exchange_bytes: int = 0,
    exchange_s: float = 0.0,
) -> Plan:
    """GeoMesh's balanced plan (per-worker batch and inner steps); algorithm in the module docstring."""
    constraints.validate()
    kept, dropped = _usable(profiles, constraints.allow_drop)
    if constraints.fills:
        return _plan_fill(kept, dropped, constraints, exchange_bytes, exchange_s)
    n = len(kept)
    lo, hi = constraints.band(n)
    target = constraints.target(n)
    min_h, max_h = constraints.min_inner_steps, constraints.max_inner_steps
    least = n * constraints.min_batch * min_h
    if least > hi:
        raise PlanError(
            f"target {target} sequences (at most {hi} with tolerance {constraints.tolerance}) is below the "
            f"{least} that {n} workers do at least with min_batch={constraints.min_batch} and "
            f"min_inner_steps={min_h}"
        )
    ws = [_Worker(p, constraints, min_h) for p in kept]
    round_s = target / sum(w.rate for w in ws)
    for w in ws:
        w.set_batches(_upper(w.knee_upper, w.rate, round_s, constraints))
    state = _solve(ws, lo, hi, target, min_h, max_h)
    if state is None:  # the target is out of reach with batches near the knee: allow up to max_batch
        for w in ws:
            w.set_batches(constraints.max_batch)
        state = _solve(ws, lo, hi, target, min_h, max_h)
    if state is None:
        most = n * constraints.max_batch * max_h
        raise PlanError(
            f"target {target} sequences (at least {lo} with tolerance {constraints.tolerance}) is unreachable: "
            f"{n} workers do at most {most} with max_batch={constraints.max_batch} and max_inner_steps={max_h}"
        )
    choices = []
    for w, (_, _, b, h, _) in zip(ws, state):
        m, a = w.splits[w.bs.index(b)]
        choices.append((m, a, h))
    rule = f"sequences per round: {target} (tolerance {constraints.tolerance:.0%})"
    if constraints.overlap:
        rule += "; the exchange runs under the next round's compute"
    plan = _assemble(kept, choices, exchange_bytes, exchange_s, "geomesh", target, dropped, rule, constraints.overlap)
    _warn_if_unbalanced(plan, ws, state)
    return plan


def _fill_response(w: _Worker, deadline: float, min_h: int, max_h: int):
    """Worker ``w``'s best way to fill ``deadline``: the options (c, S, b, H, v) with c ≤ deadline whose
    compute is within FILL_SLACK of the longest such option (straggler idle first), and among those the most
    sequences (the most efficient batch), then the smaller batch (more inner steps). The quickest option
    when nothing fits."""
    lim = deadline * (1 + _EPS) - w.o
    options = []
    for b, t in zip(w.bs, w.ts):
        h = min(max_h, int(lim / t))
        if h >= min_h:
            options.append(w.option(b, h, t))
    if not options:
        return w.min_opt
    longest = max(o[0] for o in options)
    full = [o for o in options if o[0] >= longest * (1 - FILL_SLACK)]
    return max(full, key=lambda o: (o[1], -o[2]))


def _plan_fill(kept, dropped, constraints: PlanConstraints, exchange_bytes: int, exchange_s: float) -> Plan:
    """The planning rule: every worker fills the round's compute time (the reference plan on the slowest
    worker, or ``round_compute_s``) with its best batch and inner steps (:func:`_fill_response`)."""
    c = constraints
    min_h, max_h = c.min_inner_steps, c.max_inner_steps
    overhead = max(p.round_overhead_s for p in kept)
    if c.round_compute_s is not None:  # (the compute of the worker with the most round overhead)
        deadline = float(c.round_compute_s) + overhead
        rule = f"explicit round: {c.round_compute_s:.3g} s of compute (geomesh.round_time_s)"
    else:
        deadline, slowest = reference_round_s(kept, c.ref_batch, c.ref_inner_steps)
        what = "compute and round overhead" if overhead > 0 else "compute"
        rule = (f"fill the slowest worker's reference round: {c.ref_inner_steps} steps of {c.ref_batch} sequences "
                f"on {slowest} = {deadline:.3g} s of {what}; every worker fills it")  # fmt: skip
    if overhead > 0:  # a worker slower outside its inner steps (an evaluation, the outer step) computes less
        rule += "; round overheads measured: " + ", ".join(f"{p.name} {p.round_overhead_s:.3g} s" for p in kept)
    if c.overlap:
        # the exchange runs under the next round's compute: a round shorter than the exchange would leave the
        # workers waiting for it, so the compute fills at least the exchange (docs/overlap.md)
        if exchange_s > deadline:
            rule += f"; stretched to the exchange it hides ({exchange_s:.3g} s, overlap)"
            deadline = float(exchange_s)
        else:
            rule += f"; the exchange ({exchange_s:.3g} s) runs under the next round's compute (overlap)"
    ws = [_Worker(p, c, min_h) for p in kept]
    for w in ws:
        w.set_batches(_upper(w.knee_upper, w.rate, deadline, c))
    state = [_fill_response(w, deadline, min_h, max_h) for w in ws]
    choices = []
    for w, (_, _, b, h, _) in zip(ws, state):
        m, a = w.splits[w.bs.index(b)]
        choices.append((m, a, h))
    plan = _assemble(kept, choices, exchange_bytes, exchange_s, "geomesh", None, dropped, rule, c.overlap)
    _warn_if_unbalanced(plan, ws, state)
    return plan


def _warn_if_unbalanced(plan: Plan, ws: list[_Worker], state) -> None:
    """Warn when the constraints leave much straggler idle (e.g. a slow worker's minimum is too long)."""
    n = len(plan.workers)
    top = max(w.compute_s + w.overhead_s for w in plan.workers)  # the round's work (compute and round overhead)
    idle = sum(w.straggler_wait_s for w in plan.workers) / (n * top)
    if idle <= IDLE_WARN:
        return
    pinned = [w.profile.name for w, s in zip(ws, state) if s == w.min_opt and s[0] >= top * (1 - 1e-9)]
    if pinned:
        reason = (
            f"worker(s) {', '.join(pinned)} cannot do less than min_inner_steps steps of their smallest batch; "
            "lower min_batch/min_inner_steps or raise the target"
        )
    else:
        reason = "integer batches and steps within the bounds allow no better balance; widen the bounds"
    warnings.warn(
        f"planner: predicted straggler idle {idle:.1%} of the compute phase (round compute "
        f"{top:.3g} s): {reason}",
        stacklevel=3,
    )
